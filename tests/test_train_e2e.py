"""End to end through real local Ray, 2 learner ranks on DeepSpeed (gloo), the tiny pretrained Qwen3-MoE."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import headroom_closed
from peft import PeftModel

from mint.config import load_config
from mint.hub.revisions import META_FILE, revision_id
from mint.models.lora import add_lora
from mint.models.specs import load_model
from mint.models.tiny import resolve_model_path
from mint.train.driver import train

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _digests(model) -> dict[str, str]:
    base = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return {"base": revision_id(base), "lora": revision_id(lora)}


def test_smoke_recipe_trains_lora_and_never_moves_the_base(tmp_path):
    """The smoke recipe as written: LongStraw exact with its responses replayed in micro-batches."""
    config = load_config(
        ROOT / "recipes/smoke.toml",
        [
            "grpo.steps=4",
            f"logging.root={tmp_path}",
            "logging.name=e2e",
            "logging.progress=false",
            "catalog.export_every=2",
            "learner.num_ranks=2",
            "grpo.kl_coef=0.01",
        ],
    )
    summary = train(config)

    # The learner's weights against a fresh load of the same base wrapped the same way (same LoRA seed).
    fresh = add_lora(load_model(resolve_model_path(config.model.path)), config.lora, config.grpo.seed)
    start = _digests(fresh)
    assert summary["base_digest"] == start["base"], "the frozen base changed during training"
    assert summary["lora_digest"] != start["lora"], "the LoRA parameters did not change"

    run = Path(summary["run_dir"])
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for m in lines:
        for key in ("reward_mean", "reward_std", "loss", "kl", "clip_frac", "tokens_per_s", "step_s", "peak_memory_mb"):
            assert key in m, key
        assert 0.0 <= m["reward_mean"] <= 1.0 and m["peak_memory_mb"] > 0
        # The rollout actor sampled with exactly the revision the learner scores: same logprobs up to fp32 noise.
        assert m["logp_diff_max"] < 1e-4, m["logp_diff_max"]
        # R3: the routes crossed Ray (rollout actor -> driver -> learner) intact and aligned with the learner's
        # positions, so in fp32 the learner's own routers agree with every recorded route and nothing is masked.
        assert m["out_of_route_ratio"] == 0.0 and m["trust_kept_frac"] == 1.0, m
    assert summary["steps"] == 4 and summary["revision"] == lines[-1]["revision"]
    # KL to the reference (the same model with the adapter disabled): exactly 0 while LoRA B is still 0 at step 1.
    assert lines[0]["kl"] == 0.0 and lines[-1]["kl"] > 0.0

    # Revisions were written every 2 steps as PEFT adapter directories, content-addressed, with lineage.
    saved = sorted(p.name for p in (run / "adapters").iterdir())
    assert saved == ["step_000002", "step_000004"]
    meta = json.loads((run / "adapters/step_000004" / META_FILE).read_text())
    assert meta["id"] == summary["revision"] and meta["step"] == 4 and meta["parent"] == lines[2]["revision"]

    # The final adapter loads with plain PEFT on the base and is not the identity.
    base_path = resolve_model_path(config.model.path)
    peft_model = PeftModel.from_pretrained(load_model(base_path), str(run / "adapters/step_000004"))
    x = torch.tensor([[1, 5, 9, 13, 17]])
    with torch.no_grad():
        adapted = peft_model(x).logits
        with peft_model.disable_adapter():
            plain = peft_model(x).logits
    assert not torch.allclose(adapted, plain)


def test_cli_main_job_prints_json_last_line_under_zero3(tmp_path):
    """The README's main job, shortened, as a real process; ZeRO-3 shards the frozen base across the 2 ranks."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mint.cli",
            "train",
            "recipes/smoke.toml",
            "grpo.steps=2",
            "learner.zero_stage=3",
            "learner.inner_step=naive",
            "grpo.filter_zero_variance=true",
            f"logging.root={tmp_path}",
            "logging.name=cli",
            "logging.progress=false",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary) >= {"steps", "reward_first", "reward_last", "reward_gain", "revision", "seconds"}
    assert summary["steps"] == 2 and len(summary["revision"]) == 64
    config = load_config(ROOT / "recipes/smoke.toml")
    fresh = add_lora(load_model(resolve_model_path(config.model.path)), config.lora, config.grpo.seed)
    assert summary["base_digest"] == _digests(fresh)["base"], "ZeRO-3 gathered base differs from the base on disk"


@pytest.mark.parametrize("mode", ["detached", "resident"])
def test_longstraw_modes_train_through_ray(tmp_path, mode):
    """The other LongStraw modes run the same loop (exact: test_exact_run_equals_the_naive_run_step_by_step)."""
    config = load_config(
        ROOT / "recipes/smoke.toml",
        [
            "grpo.steps=3",
            "learner.num_ranks=1",
            "learner.inner_step=longstraw",
            f"longstraw.mode={mode}",
            f"logging.root={tmp_path}",
            f"logging.name={mode}",
            "logging.progress=false",
        ],
    )
    summary = train(config)
    fresh = add_lora(load_model(resolve_model_path(config.model.path)), config.lora, config.grpo.seed)
    assert summary["lora_digest"] != _digests(fresh)["lora"] and summary["base_digest"] == _digests(fresh)["base"]
    lines = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert all(m["logp_diff_max"] < 1e-4 and m["trust_kept_frac"] == 1.0 for m in lines)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_exact_run_equals_the_naive_run_step_by_step(tmp_path):
    """The default inner step, LongStraw exact, end to end through `mint train` as a real process: real Ray,
    2 learner ranks on real DeepSpeed (ZeRO-2, gloo), KL on, R3 on. A naive-step run of the same recipe gives the
    same losses and gradient norms at every step (fp32, 1e-5): the same gradient, so the same run. The smoke recipe
    replays each group's responses as one micro-batch (longstraw.replay_budget_mb), so this is that path too."""
    common = [
        "grpo.steps=3",
        "learner.num_ranks=2",
        "grpo.kl_coef=0.01",
        "longstraw.chunk_size=8",
        f"logging.root={tmp_path}",
        "logging.progress=false",
    ]
    exact_overrides = ["logging.name=exact", "learner.inner_step=longstraw", "longstraw.mode=exact"]
    proc = subprocess.run(
        [sys.executable, "-m", "mint.cli", "train", "recipes/smoke.toml", *common, *exact_overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    exact_summary = json.loads(proc.stdout.strip().splitlines()[-1])
    # Every run ends with its report: the path on stderr, the PNGs beside it.
    assert f"mint: report {tmp_path / 'exact' / 'report.md'}" in proc.stderr
    assert len(list((tmp_path / "exact" / "plots").glob("*.png"))) >= 4
    exact_config = json.loads((tmp_path / "exact/config.json").read_text())
    assert exact_config["learner"]["inner_step"] == "longstraw" and exact_config["longstraw"]["mode"] == "exact"

    naive = ["logging.name=naive", "learner.inner_step=naive"]
    naive_summary = train(load_config(ROOT / "recipes/smoke.toml", [*common, *naive]))
    exact, naive = _metrics(tmp_path / "exact"), _metrics(tmp_path / "naive")
    assert [m["step"] for m in exact] == [m["step"] for m in naive] == [1, 2, 3]
    for a, b in zip(exact, naive, strict=True):
        assert a["reward_mean"] == b["reward_mean"], (a, b)  # same revisions sampled the same tokens
        for key in ("loss", "grad_norm", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-5), (key, a[key], b[key])
        assert a["logp_diff_max"] < 1e-4 and a["trust_kept_frac"] == 1.0
    assert exact[-1]["grad_norm"] > 0 and exact[-1]["kl"] > 0
    assert exact_summary["base_digest"] == naive_summary["base_digest"]


def test_held_out_eval_samples_and_lr_schedule(tmp_path):
    """Held-out eval (chat-message prompts from a JSONL file, an extra column, math_verify) rises while
    training; samples.jsonl holds prompts with completions, rewards and advantages; the cosine schedule with warmup
    drives the learning rate every step logs."""
    from mint.rl.tasks import get_task

    task, rng = get_task("first_last"), __import__("random").Random(12345)
    rows = []
    for _ in range(32):
        ex = task.sample(rng)
        rows.append({"prompt": [{"role": "user", "content": ex.prompt}], "answer": ex.answer, "source": "held-out"})
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = 30
    config = load_config(
        ROOT / "recipes/smoke.toml",
        [
            f"grpo.steps={steps}",
            "learner.num_ranks=1",
            "data.reward=math_verify",
            f"eval.source={held_out}",
            "eval.every=15",
            "eval.samples=4",
            "eval.temperature=1.0",
            "logging.samples_every=10",
            "learner.lr_schedule=cosine",
            "learner.warmup_steps=5",
            f"logging.root={tmp_path}",
            "logging.name=eval",
            "logging.progress=false",
        ],
    )
    summary = train(config)
    assert summary["eval_pass@1_last"] > summary["eval_pass@1_first"] + 0.1, summary
    assert "eval_pass@4_last" in summary and 0.0 <= summary["eval_reward_mean_first"] <= 1.0
    lines = [json.loads(line) for line in (tmp_path / "eval/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "eval_pass@1" in m] == [15, 30]
    from mint.train.learner import lr_factor

    lrs = [m["lr"] for m in lines]
    want = [config.learner.lr * lr_factor(config)(s) for s in range(steps)]
    assert lrs == pytest.approx(want, rel=1e-6) and lrs[0] < lrs[4] and lrs[-1] < lrs[10]
    samples = [json.loads(line) for line in (tmp_path / "eval/samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {10, 20, 30} and len(samples) == 3 * 2 * config.logging.samples_per_step
    assert all({"prompt", "completion", "reward", "advantage"} <= set(s) for s in samples)


def test_expert_parallel_smoke_run_learns_and_publishes_every_expert(tmp_path):
    """`mint train recipes/smoke.toml learner.num_ranks=2 learner.expert_parallel=2` as written (250 steps, each
    learner rank holding 2 of the 4 experts) learns the task (reward_last >= 0.9, closing >= 0.8 of the headroom
    1 - reward_first), and its published adapter holds every expert under the unsharded adapter's names and shapes
    (gathered at publish), which plain PEFT loads."""
    config = load_config(
        ROOT / "recipes/smoke.toml",
        [
            "learner.num_ranks=2",
            "learner.expert_parallel=2",
            f"logging.root={tmp_path}",
            "logging.name=ep",
            "logging.progress=false",
        ],
    )
    summary = train(config)
    # Relative to the headroom, not an absolute gain: a base that starts higher has less to gain (0.49 -> 0.964 closed
    # 0.93 of it but gained only 0.474). Measured runs reach 0.96-0.98 and close 0.93-0.97 (docs/benchmarks.md); the
    # former bar, a gain of 0.5 from the 0.37 start it was set at, asked for 0.87 and 0.79 of the headroom.
    closed = headroom_closed(summary["reward_first"], summary["reward_last"])
    assert summary["reward_last"] >= 0.9 and closed >= 0.8, (closed, summary)
    lines = _metrics(Path(summary["run_dir"]))
    assert all(m["logp_diff_max"] < 1e-4 for m in lines)  # the rollout scored with exactly the learner's adapter

    from safetensors.torch import load_file

    from mint.models.lora import lora_state

    base_path = resolve_model_path(config.model.path)
    unsharded = lora_state(add_lora(load_model(base_path), config.lora, config.grpo.seed))
    adapter = Path(summary["adapter"])
    published = load_file(str(adapter / "adapter_model.safetensors"))
    assert {k: tuple(v.shape) for k, v in published.items()} == {k: tuple(v.shape) for k, v in unsharded.items()}
    assert any("mlp.experts" in k for k in published)
    PeftModel.from_pretrained(load_model(base_path), str(adapter))


def test_a_hybrid_base_trains_exactly_as_the_naive_step(tmp_path):
    """tiny:qwen3_5_moe (Gated DeltaNet + gated attention, fused experts, shared expert) through `train`: real Ray,
    2 learner ranks on DeepSpeed, R3 on, built-in rollouts from the slab's recurrent states. LongStraw exact with
    prompts over several capture chunks (so the prompt backward runs through the recurrent checkpoints) gives the
    naive step's losses and gradient norms at every step, and the learner scores the rollout's tokens as sampled."""
    common = [
        "model.path=tiny:qwen3_5_moe",
        "grpo.steps=2",
        "learner.num_ranks=2",
        "grpo.kl_coef=0.01",
        "longstraw.chunk_size=8",
        f"logging.root={tmp_path}",
        "logging.progress=false",
    ]
    train(load_config(ROOT / "recipes/smoke.toml", [*common, "logging.name=exact", "longstraw.mode=exact"]))
    train(load_config(ROOT / "recipes/smoke.toml", [*common, "logging.name=naive", "learner.inner_step=naive"]))
    exact, naive = _metrics(tmp_path / "exact"), _metrics(tmp_path / "naive")
    assert [m["step"] for m in exact] == [m["step"] for m in naive] == [1, 2]
    for a, b in zip(exact, naive, strict=True):
        assert a["reward_mean"] == b["reward_mean"], (a, b)
        for key in ("loss", "grad_norm", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-5), (key, a[key], b[key])
        assert a["logp_diff_max"] < 1e-4 and a["out_of_route_ratio"] == 0.0 and a["trust_kept_frac"] == 1.0, a
    assert exact[-1]["grad_norm"] > 0


def test_retry_recipe_learns_from_multi_turn_episodes(tmp_path):
    """recipes/retry_cpu.toml as written but 30 steps (60 in the recipe): multi-turn episodes on the built-in engine,
    trained as masked tails. The rollout's logprobs of every sampled token, after observations too, equal the
    learner's (the positions line up), every position's route is replayed, and the reward rises as the policy
    needs the retry less."""
    overrides = ["grpo.steps=30", f"logging.root={tmp_path}", "logging.progress=false", "logging.samples_every=10"]
    summary = train(load_config(ROOT / "recipes/retry_cpu.toml", overrides))
    run = Path(summary["run_dir"])
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for m in lines:
        assert m["logp_diff_max"] < 1e-4 and m["trust_kept_frac"] == 1.0 and m["out_of_route_ratio"] == 0.0, m
        assert 1.0 <= m["turns_mean"] <= 3.0 and m["episode_tokens_mean"] <= 64
        assert sum(v for k, v in m.items() if k.startswith("stop/")) == pytest.approx(1.0)
    first, last = summary["reward_first"], summary["reward_last"]
    assert headroom_closed(first, last) >= 0.25, (first, last)
    assert lines[-1]["turns_mean"] < lines[0]["turns_mean"]
    # samples.jsonl shows each episode's turns: the action, then the feedback it got
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    retried = [row for row in rows if len(row["turns"]) > 1]
    assert retried and all("Wrong. Try again." in row["turns"][0]["observation"] for row in retried)
    assert all(row["stop_reason"] in ("completed", "max_turns") for row in rows)


def test_tool_use_recipe_learns_to_call_the_tool(tmp_path):
    """recipes/tool_use_cpu.toml as written but 20 steps (30 in the recipe): the answer is not in the prompt, and the
    tiny tool base calls `lookup` on about a third of prompts. Episodes that call score 1, guesses 0.1, so GRPO raises
    the calling rate: turns per episode rise towards 2 (call, then answer). Measured: reward 0.51 -> 0.99 over the
    first and last 2 steps, turns 1.41 -> 1.99."""
    overrides = [
        "grpo.steps=20",
        f"model.path={ROOT / 'mint/models/tiny_tool_bases/qwen3_moe-lookup'}",  # the recipe's is relative to ROOT
        f"logging.root={tmp_path}",
        "logging.progress=false",
        "logging.samples_every=10",
    ]
    summary = train(load_config(ROOT / "recipes/tool_use_cpu.toml", overrides))
    run = Path(summary["run_dir"])
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for m in lines:
        assert m["logp_diff_max"] < 1e-4 and m["trust_kept_frac"] == 1.0 and m["out_of_route_ratio"] == 0.0, m
        assert 1.0 <= m["turns_mean"] <= 2.0 and m["episode_tokens_mean"] <= 128
    first, last = summary["reward_first"], summary["reward_last"]
    assert headroom_closed(first, last) >= 0.5 and last - first >= 0.3, (first, last)
    assert lines[-1]["turns_mean"] > 1.5 and lines[-1]["turns_mean"] > lines[0]["turns_mean"]
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    called = [row for row in rows if len(row["turns"]) > 1]
    assert called and all("<tool_response>" in row["turns"][0]["observation"] for row in called)
