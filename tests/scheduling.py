"""How `make test` spreads the suite over two pytest-xdist workers (`-n 2 --dist loadscope --no-loadscope-reorder`).

tests/conftest.py imports these hooks, so pytest runs them; tests/test_scheduling.py runs them on a small suite of
its own.
"""

from __future__ import annotations

from pathlib import Path

# ---- scheduling on two pytest-xdist workers (`make test`: -n 2 --dist loadscope --no-loadscope-reorder) ----------
# A file is one work unit (its module fixtures, a vLLM server or a shared reference run, start once), except the
# files in SPREAD, whose tests are independent runs handed out one by one. Units go out longest first, so the two
# workers finish together instead of one running a 2-minute smoke run alone at the end. Seconds
# as measured under `make test` on 2 cores (each test's own time, 2026-12-07, from pytest's --junitxml; the
# durations table in CI's log shows the slowest); a unit not listed weighs nothing and keeps its collection order.
SPREAD = {"test_train_e2e.py", "test_golden.py"}
TEST_SECONDS = {
    "test_expert_parallel_smoke_run_learns_and_publishes_every_expert": 140,
    "test_held_out_eval_samples_and_lr_schedule": 115,
    "test_exact_run_equals_the_naive_run_step_by_step": 70,
    "test_a_hybrid_base_trains_exactly_as_the_naive_step": 60,
    "test_tool_use_recipe_learns_to_call_the_tool": 50,
    "test_retry_recipe_learns_from_multi_turn_episodes": 45,
    "test_golden_figures_hold_under_other_cpu_kernels": 45,
    "test_golden_run_matches_its_pinned_figures": 40,
    "test_cli_main_job_prints_json_last_line_under_zero3": 35,
    "test_smoke_recipe_trains_lora_and_never_moves_the_base": 30,
    "test_longstraw_modes_train_through_ray": 25,
}
FILE_SECONDS = {
    "test_reliability.py": 660,
    "test_vllm_real.py": 345,
    "test_engines.py": 255,
    "test_sharded_learner.py": 200,
    "test_multinode.py": 160,
    "test_context_parallel.py": 110,
    "test_workflow.py": 105,
    "test_vllm_lora_conformance.py": 105,
    "test_overlap.py": 100,
    "test_rollout_backends.py": 80,
    "test_engine_conformance.py": 70,
    "test_tiny.py": 70,
    "test_quant.py": 70,
    "test_preflight.py": 50,
    "test_quant_int4.py": 50,
    "test_serve.py": 35,
    "test_sandbox.py": 35,
    "test_durability.py": 35,
    "test_eval_recovery.py": 35,
    "test_kimi_checkpoint.py": 30,
}


def pytest_collection_modifyitems(config, items):
    def seconds(item) -> float:
        if item.path.name in SPREAD:
            return TEST_SECONDS.get(item.originalname, 30)
        return FILE_SECONDS.get(item.path.name, 0)

    items.sort(key=lambda item: -seconds(item))  # stable: within a weight, collection order


def pytest_xdist_make_scheduler(config, log):
    """Work units by file, SPREAD files' tests one by one, in the collection order above (--no-loadscope-reorder).

    xdist's own `loadgroup` (an `xdist_group` mark per file) cannot do this under pytest 9.2: it renames a test's
    `_nodeid`, which pytest no longer reads (Node.nodeid comes from Node._id), so every test became a unit of its own
    and each file's module fixtures started once per worker (docs/decisions.md)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if Path(path).name in SPREAD else path

    return ByFile(config, log)
