"""`mint report RUN`: plots and a one-page markdown summary of a finished (or running) run directory.

A pure reader: it opens metrics.jsonl, config.json and summary.json and writes <out>/report.md and <out>/plots/*.png
(out defaults to the run directory). It imports neither Ray nor DeepSpeed, and it is the only module that imports
matplotlib. Figures are built on `matplotlib.figure.Figure` with an explicit Agg canvas, never through pyplot, so the
global backend of a caller (a notebook, say) is left as it was.

Each `plot_*` function takes the metric rows and returns a Figure, or None when none of its keys has a value;
`write_report` saves the figures, skips the empty ones (and says so in the report), then writes report.md atomically.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mint.config.schema import RENAMED
from mint.errors import MintError

__all__ = ["EMA_ALPHA", "FIG_DPI", "FIG_SIZE", "PLOTS", "NotARunError", "ema", "load_run", "write_report"]

FIG_SIZE = (8.0, 4.5)  # inches; at FIG_DPI a PNG is 880 x 495 pixels (no tight bbox, so the size is fixed)
FIG_DPI = 110
# Smoothing of the reward curve: s_1 = x_1, s_t = a x_t + (1 - a) s_{t-1}. With a = 0.1 a step's weight halves
# after about 7 steps, enough to read a trend out of 8-prompt steps whose mean reward jumps by +-0.1.
EMA_ALPHA = 0.1
RECIPE_KEYS = (
    "model.path",
    "lora.rank",
    "rollout.group_size",
    "rollout.prompts_per_step",
    "rollout.max_tokens",
    "learner.inner_step",
    "learner.lr",
    "longstraw.mode",
)


class NotARunError(MintError):
    """The directory handed to `mint report` holds no logged steps (no readable metrics.jsonl)."""


def load_run(run: Path) -> tuple[list[dict], dict, dict]:
    """(metric rows in step order, config, summary) of a run directory; config and summary are {} when absent."""
    run = Path(run)
    path = run / "metrics.jsonl"
    if not run.is_dir():
        raise NotARunError(f"{run} is not a directory")
    if not path.is_file():
        raise NotARunError(f"{run} is not a run directory (no metrics.jsonl)")
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash mid-write: the steps before it still report
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    if not rows:
        raise NotARunError(f"{run} is not a run directory (metrics.jsonl holds no steps)")
    rows.sort(key=lambda r: r["step"])
    return rows, _read_json(run / "config.json"), _read_json(run / "summary.json")


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, leaving out steps where it is missing or null (e.g. grad_norm on a skip)."""
    pairs = [(r["step"], float(r[key])) for r in rows if _number(r.get(key))]
    return [s for s, _ in pairs], [v for _, v in pairs]


def present(rows: list[dict], keys) -> list[str]:
    """The keys among `keys` that have at least one value, in the order given."""
    return [k for k in keys if any(_number(r.get(k)) for r in rows)]


def keys_like(rows: list[dict], prefix: str) -> list[str]:
    return sorted({k for r in rows for k in r if k.startswith(prefix)})


def ema(values: list[float], alpha: float = EMA_ALPHA) -> list[float]:
    """Exponential moving average, seeded with the first value: s_1 = x_1, s_t = alpha x_t + (1 - alpha) s_{t-1}."""
    out: list[float] = []
    for x in values:
        out.append(x if not out else alpha * x + (1 - alpha) * out[-1])
    return out


def _figure(nrows: int = 1) -> tuple[Figure, list]:
    fig = Figure(figsize=FIG_SIZE, dpi=FIG_DPI)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(nrows, 1, i + 1) for i in range(nrows)]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    return fig, axes


def _lines(ax, rows: list[dict], keys: list[str], **style) -> None:
    for key in keys:
        ax.plot(*series(rows, key), label=key, **style)
    if keys:  # two legend columns once there are many (the masked_* reasons number eight)
        ax.legend(fontsize=6, loc="best", ncol=2 if len(keys) > 4 else 1)


def plot_reward(rows: list[dict]) -> Figure | None:
    """lines[0]: reward_mean per step; lines[1]: its EMA; then each eval_* metric."""
    evals = present(rows, keys_like(rows, "eval_"))
    if not present(rows, ["reward_mean"]) and not evals:
        return None
    fig, (ax,) = _figure()
    steps, mean = series(rows, "reward_mean")
    ax.plot(steps, mean, color="tab:blue", alpha=0.35, linewidth=1, label="reward_mean (per step)")
    ax.plot(steps, ema(mean), color="tab:blue", linewidth=2, label=f"reward_mean, EMA alpha={EMA_ALPHA}")
    s_std, std = series(rows, "reward_std")
    if mean and s_std == steps:  # a +-1 std band of the group rewards, when logged at every step
        low, high = [m - s for m, s in zip(mean, std, strict=True)], [m + s for m, s in zip(mean, std, strict=True)]
        ax.fill_between(steps, low, high, alpha=0.08)
    _lines(ax, rows, evals, marker="o", markersize=3)
    ax.set_ylabel("reward")
    ax.set_title("Reward")
    ax.legend(fontsize=7, loc="best")
    return fig


def _simple(rows: list[dict], keys: list[str], title: str, ylabel: str) -> Figure | None:
    keys = present(rows, keys)
    if not keys:
        return None
    fig, (ax,) = _figure()
    _lines(ax, rows, keys)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    return fig


def plot_response_length(rows: list[dict]) -> Figure | None:
    return _simple(rows, ["response_len_mean"], "Mean response length", "tokens")


def plot_policy(rows: list[dict]) -> Figure | None:
    """Top: KL terms. Bottom: fractions of tokens (PPO-clipped, kept by the trust mask, masked by each cause)."""
    kl = present(rows, ["kl", "mismatch_kl"])
    frac = present(rows, ["clip_frac", "trust_kept_frac", *keys_like(rows, "masked_"), "out_of_route_ratio"])
    if not kl and not frac:
        return None
    fig, (ax_kl, ax_frac) = _figure(2)
    _lines(ax_kl, rows, kl)
    ax_kl.set_ylabel("KL")
    ax_kl.set_title("KL, clipping and masking")
    _lines(ax_frac, rows, frac, linewidth=1)
    ax_frac.set_ylabel("fraction of tokens")
    return fig


def plot_grad_norm(rows: list[dict]) -> Figure | None:
    """lines[0]: grad_norm where logged (nulls left out); skipped steps are red vertical lines."""
    if not present(rows, ["grad_norm"]):
        return None
    fig, (ax,) = _figure()
    ax.plot(*series(rows, "grad_norm"), marker=".", markersize=3, label="grad_norm")
    skipped = [r["step"] for r in rows if r.get("skipped")]
    for i, step in enumerate(skipped):
        ax.axvline(step, color="tab:red", alpha=0.5, linewidth=1, label="skipped step" if i == 0 else None)
    ax.set_title(f"Gradient norm ({len(skipped)} skipped steps)")
    ax.set_ylabel("norm")
    ax.legend(fontsize=7, loc="best")
    return fig


def plot_time(rows: list[dict]) -> Figure | None:
    """Seconds per step in each phase (rollout, learn, sync when logged), the learner's idle time and the whole step,
    as lines (with rollout.max_staleness >= 1, rollout_s is only the wait that learning did not hide)."""
    return _simple(rows, ["rollout_s", "learn_s", "sync_s", "idle_s", "step_s"], "Time per step", "seconds")


def plot_memory(rows: list[dict]) -> Figure | None:
    return _simple(rows, ["peak_memory_mb"], "Peak learner memory", "MB")


# name -> (plot, the keys it reads, for the report's "skipped" line)
PLOTS: dict[str, tuple[Callable[[list[dict]], Figure | None], str]] = {
    "reward": (plot_reward, "reward_mean, eval_*"),
    "response_length": (plot_response_length, "response_len_mean"),
    "policy": (plot_policy, "kl, clip_frac, trust_kept_frac, masked_*"),
    "grad_norm": (plot_grad_norm, "grad_norm"),
    "time": (plot_time, "rollout_s, learn_s, sync_s, idle_s, step_s"),
    "memory": (plot_memory, "peak_memory_mb"),
}


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def git_commit(where: Path | None = None) -> str:
    """HEAD of the git checkout holding `where` (default: the mint package), or "unknown" outside one."""
    where = Path(where) if where is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _get(config: dict, dotted: str):
    """A key of a run's config.json; a run written before a key was renamed holds it under its old name."""
    old = {new: old for old, new in RENAMED.items()}.get(dotted)
    for name in (dotted, old) if old else (dotted,):
        section, _, key = name.partition(".")
        if isinstance(config.get(section), dict) and key in config[section]:
            return config[section][key]
    return "unknown"


def _reward_summary(rows: list[dict], summary: dict) -> tuple:
    """(first, last, gain) from summary.json, else over the first and last 10% of steps as the driver computes them."""
    if all(_number(summary.get(k)) for k in ("reward_first", "reward_last", "reward_gain")):
        return summary["reward_first"], summary["reward_last"], summary["reward_gain"]
    _, rewards = series(rows, "reward_mean")
    if not rewards:
        return "unknown", "unknown", "unknown"
    k = max(1, round(0.1 * len(rewards)))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return round(first, 4), round(last, 4), round(last - first, 4)


def render(run: Path, rows: list[dict], config: dict, summary: dict, plots: list[str], skipped: list[str]) -> str:
    # Config.digest(): sha256 of the canonical JSON of the resolved recipe, the recipe hash stored with each revision.
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest() if config else "unknown"
    revision = summary.get("revision") or rows[-1].get("revision") or "unknown"
    first, last, gain = _reward_summary(rows, summary)
    facts = [
        ("recipe digest", digest),
        ("base (model.path)", _get(config, "model.path")),
        *[(key, _get(config, key)) for key in RECIPE_KEYS[1:]],
        ("final revision", revision),
        ("steps", summary.get("steps", rows[-1]["step"])),
        ("reward first / last / gain", f"{first} / {last} / {gain}"),
        ("seconds", summary.get("seconds", "unknown")),
        ("skipped steps", sum(1 for r in rows if r.get("skipped"))),
    ]
    if summary.get("interrupted"):
        facts.append(("interrupted", "yes"))
    lines = [f"# Run report: {Path(run).resolve().name}", ""]
    lines += [f"Run directory: `{run}`", "", f"Report written by mint at commit: `{git_commit()}`", ""]
    lines += ["| | |", "|---|---|", *[f"| {name} | `{value}` |" for name, value in facts], ""]
    if not summary:
        lines += ["No summary.json: the run is still going or stopped early; figures come from metrics.jsonl.", ""]
    lines += ["## Plots", "", f"The reward's smoothed line is an exponential moving average, alpha = {EMA_ALPHA}.", ""]
    lines += [f"![{name}](plots/{name}.png)\n" for name in plots]
    lines += [f"- {name}: skipped, no values for {PLOTS[name][1]} in metrics.jsonl" for name in skipped]
    return "\n".join(lines).rstrip() + "\n"


def write_report(run: Path, out: Path | None = None) -> Path:
    """Write <out>/plots/<name>.png for each plot with data and <out>/report.md; return the report's path."""
    run = Path(run)
    rows, config, summary = load_run(run)
    out = Path(out) if out is not None else run
    (out / "plots").mkdir(parents=True, exist_ok=True)
    made, skipped = [], []
    for name, (plot, _) in PLOTS.items():
        path = out / "plots" / f"{name}.png"
        fig = plot(rows)
        if fig is None:
            skipped.append(name)
            path.unlink(missing_ok=True)  # a stale figure from an earlier report must not pass for this one
            continue
        fig.tight_layout()  # margins only: the pixel size stays FIG_SIZE x FIG_DPI
        _atomic(path, lambda tmp, fig=fig: fig.savefig(tmp, format="png", dpi=FIG_DPI))
        made.append(name)
    text = render(run, rows, config, summary, made, skipped)
    report = out / "report.md"
    _atomic(report, lambda tmp: tmp.write_text(text))
    return report
