"""`mint report RUN`: the figures and report.md of a run directory, built here from synthetic metrics.

The run directory is written the way mint/train/driver.py writes one (config.json, metrics.jsonl with one sorted-key
JSON object per step, summary.json), including a step skipped for a non-finite gradient (grad_norm null).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mint.cli import main
from mint.train import report

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
SKIPPED = 5  # this step's gradient was non-finite: grad_norm null, nothing published
REVISION = "ab" * 32
EXPECTED_PX = (round(report.FIG_SIZE[1] * report.FIG_DPI), round(report.FIG_SIZE[0] * report.FIG_DPI))  # (h, w)


def _row(step: int) -> dict:
    reward = 0.3 + 0.05 * step + 0.02 * math.sin(step)
    return {
        "step": step,
        "reward_mean": reward,
        "reward_std": 0.3,
        "reward_errors": 0,
        "loss": -0.01 * step,
        "kl": 0.001 * step,
        "clip_frac": 0.01,
        "grad_norm": None if step == SKIPPED else 0.1 + 0.01 * step,
        "skipped": int(step == SKIPPED),
        "response_len_mean": 2.0 + step % 3,
        "rollout_s": 0.1,
        "learn_s": 0.2,
        "step_s": 0.3,
        "peak_memory_mb": 600.0 + step,
        "trust_kept_frac": 1.0,
        "masked_ratio_high": 0.0,
        "out_of_route_ratio": 0.0,
        "mismatch_kl": 0.0,
        "revision": REVISION if step == STEPS else f"{step:064x}",
        **({"eval_reward": 0.25 + 0.05 * step} if step % 4 == 0 else {}),
    }


@pytest.fixture
def run_dir(tmp_path) -> Path:
    run = tmp_path / "runs" / "synthetic"
    for sub in ("adapters", "catalog", "checkpoints"):
        (run / sub).mkdir(parents=True)
    config = {
        "model": {"path": "tiny:qwen3_moe", "dtype": "float32"},
        "lora": {"rank": 8},
        "rollout": {"group_size": 8, "prompts_per_step": 8, "max_tokens": 4},
        "learner": {"inner_step": "naive", "lr": 0.001},
        "longstraw": {"mode": "exact"},
    }
    (run / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    lines = [json.dumps(_row(s), sort_keys=True) for s in range(1, STEPS + 1)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = {"steps": STEPS, "reward_first": 0.37, "reward_last": 0.9, "reward_gain": 0.53, "revision": REVISION}
    (run / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return run


def _check_outputs(out: Path) -> str:
    """Every PNG is a readable image of the fixed size and report.md links each one; returns report.md's text."""
    from matplotlib import image

    text = (out / "report.md").read_text()
    pngs = sorted((out / "plots").glob("*.png"))
    assert len(pngs) >= 4, pngs
    for png in pngs:
        pixels = image.imread(png)
        assert pixels.shape[:2] == EXPECTED_PX, (png.name, pixels.shape)
        assert pixels.std() > 0, f"{png.name} is blank"
        assert f"](plots/{png.name})" in text, png.name
    assert not list(out.glob(".*.tmp")) and not list((out / "plots").glob(".*.tmp")), "temp files left behind"
    return text


def test_report_through_main(run_dir, capsys):
    assert main(["report", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(run_dir / "report.md")
    text = _check_outputs(run_dir)
    assert {p.stem for p in (run_dir / "plots").glob("*.png")} == set(report.PLOTS)  # every key family present
    assert REVISION in text
    assert re.search(r"^Report written by mint at commit: `([0-9a-f]{40}|unknown)`$", text, re.M), text
    for fact in ("tiny:qwen3_moe", "| lora.rank | `8` |", "| learner.inner_step | `naive` |", "| steps | `12` |"):
        assert fact in text, fact
    assert "`0.37 / 0.9 / 0.53`" in text
    # A run written before learner.engine was renamed learner.inner_step reports it under the new name.
    config = json.loads((run_dir / "config.json").read_text())
    config["learner"] = {"engine": "naive", "lr": 0.001}
    (run_dir / "config.json").write_text(json.dumps(config))
    assert main(["report", str(run_dir)]) == 0
    assert "| learner.inner_step | `naive` |" in (run_dir / "report.md").read_text()
    capsys.readouterr()
    assert "skipped" not in text.split("## Plots")[1], "no plot should be skipped for a full run"


def test_report_as_a_process(run_dir, tmp_path):
    out = tmp_path / "elsewhere"
    done = subprocess.run(
        [sys.executable, "-m", "mint.cli", "report", str(run_dir), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(out / "report.md")
    assert REVISION in _check_outputs(out)
    assert not (run_dir / "report.md").exists()  # --out leaves the run directory alone


def test_reward_plot_reads_the_metrics(run_dir):
    rows, _, _ = report.load_run(run_dir)
    fig = report.plot_reward(rows)
    raw, smooth, evals = fig.axes[0].lines[:3]
    expected = [_row(s)["reward_mean"] for s in range(1, STEPS + 1)]
    assert list(raw.get_xdata()) == list(range(1, STEPS + 1))
    assert list(raw.get_ydata()) == pytest.approx(expected)
    # the smoothing the report states: s_1 = x_1, s_t = a x_t + (1 - a) s_{t-1}
    s = [expected[0]]
    for x in expected[1:]:
        s.append(report.EMA_ALPHA * x + (1 - report.EMA_ALPHA) * s[-1])
    assert list(smooth.get_ydata()) == pytest.approx(s)
    assert evals.get_label() == "eval_reward" and list(evals.get_xdata()) == [4, 8, 12]


def test_grad_norm_plot_skips_nulls_and_marks_skipped_steps(run_dir):
    rows, _, _ = report.load_run(run_dir)
    ax = report.plot_grad_norm(rows).axes[0]
    norm, *marks = ax.lines
    assert SKIPPED not in list(norm.get_xdata())
    assert list(norm.get_ydata()) == pytest.approx([_row(s)["grad_norm"] for s in range(1, STEPS + 1) if s != SKIPPED])
    assert [m.get_xdata()[0] for m in marks] == [SKIPPED]


def test_missing_keys_skip_their_plot_and_say_so(run_dir, tmp_path):
    """An older run without memory or grad-norm metrics, killed before its summary: the rest still reports."""
    rows = [_row(s) for s in range(1, STEPS + 1)]
    for row in rows:
        del row["peak_memory_mb"], row["grad_norm"]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 13, "rew')
    (run_dir / "summary.json").unlink()
    (run_dir / "plots").mkdir()
    (run_dir / "plots" / "memory.png").write_bytes(b"stale")  # from an earlier report: must not survive
    assert main(["report", str(run_dir)]) == 0
    text = _check_outputs(run_dir)
    assert not (run_dir / "plots" / "memory.png").exists()
    assert "- memory: skipped, no values for peak_memory_mb" in text
    assert "- grad_norm: skipped, no values for grad_norm" in text
    assert "| final revision | `" + REVISION in text  # from the last metrics row when there is no summary
    assert "| steps | `12` |" in text  # the cut-short 13th line is left out


@pytest.mark.parametrize("make", ["missing", "empty_dir", "no_steps"])
def test_not_a_run_exits_2_with_one_line(tmp_path, capsys, make):
    target = tmp_path / "x"
    if make != "missing":
        target.mkdir()
    if make == "no_steps":
        (target / "metrics.jsonl").write_text("")
    assert main(["report", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and captured.err.startswith("mint: report: "), captured.err
    assert not (target / "report.md").exists()


def test_git_commit_outside_a_checkout_is_unknown(tmp_path):
    assert report.git_commit(tmp_path) == "unknown"
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", report.git_commit())
