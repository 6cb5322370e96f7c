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
# as measured under `make test` on 2 cores (the durations table in CI's log); a unit not listed weighs nothing and
# keeps its collection order.
SPREAD = {"test_train_e2e.py", "test_golden.py"}
TEST_SECONDS = {
    "test_expert_parallel_smoke_run_learns_and_publishes_every_expert": 140,
    "test_golden_run_matches_its_pinned_figures": 60,
    "test_golden_figures_hold_under_other_cpu_kernels": 65,
    "test_exact_run_equals_the_naive_run_step_by_step": 100,
    "test_a_hybrid_base_trains_exactly_as_the_naive_step": 95,
    "test_longstraw_modes_train_through_ray": 80,
    "test_retry_recipe_learns_from_multi_turn_episodes": 80,
    "test_tool_use_recipe_learns_to_call_the_tool": 45,
}
FILE_SECONDS = {
    "test_reliability.py": 650,
    "test_vllm_real.py": 300,
    "test_engines.py": 300,
    "test_sharded_learner.py": 300,
    "test_rollout_backends.py": 250,
    "test_multinode.py": 200,
    "test_quant.py": 150,
    "test_workflow.py": 150,
    "test_durability.py": 150,
    "test_engine_conformance.py": 150,
    "test_expert_parallel.py": 150,
    "test_sandbox.py": 50,
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
