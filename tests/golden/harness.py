"""The golden runs: one fixed-seed `mint train` per tiny base, whose per-step figures and revision ids are pinned in
tests/golden/<base>.json. tests/test_golden.py compares a fresh run with those files; tests/golden/regenerate.py
(`make golden`) rewrites them. Both run the same code, below.

A run is a real `mint train` process: local Ray, 2 learner ranks on DeepSpeed (gloo), LongStraw exact
(tests/golden/recipe.toml). Its float kernels are pinned through the environment (PINNED_ENV) so that the same run
gives the same bits on any x86 machine of this kind, AVX2 or AVX-512: the figures are compared exactly, and the
revision id (sha256 of the adapter tensors) with them.

Figures come from where a run writes them: metrics.jsonl (through `mint.train.report.load_run`, the reader `mint
report` uses), samples.jsonl (the logged advantages), and the run's catalog (the revisions' lineage and the rollout
records' sampled tokens).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parent
ROOT = GOLDEN_DIR.parents[1]
RECIPE = GOLDEN_DIR / "recipe.toml"
BASES = ("qwen3_moe", "qwen2_moe", "glm4_moe", "qwen3")

# The float kernels a run may use, pinned to code paths every x86-64 CPU runs the same way. ATen dispatches its
# vectorized kernels (softmax, sums, exp) by the CPU's ISA, MKL its SGEMM code path. Measured on tiny:qwen3_moe (AMD
# EPYC, AVX-512), each against the run under all of PINNED_ENV: ATen left at the machine's AVX-512, or set to avx2,
# moved 8 and 7 of the figures (step 1's logprob difference first, by 4e-12); MKL_CBWR unset moved 11; all three
# unset moved 9 (step 1's grad_norm, 0.41095224 -> 0.41095230). Under PINNED_ENV, MKL told to use AVX2 only
# (MKL_ENABLE_INSTRUCTIONS=AVX2, what an AVX2-only machine gives it) moved nothing, and neither did leaving oneDNN
# uncapped (fp32 matmuls go to MKL here); the cap stays for any oneDNN path a future op takes.
PINNED_ENV = {
    "ATEN_CPU_CAPABILITY": "default",  # ATen's baseline kernels, not the AVX2/AVX-512 builds
    "MKL_CBWR": "COMPATIBLE",  # MKL's conditional numerical reproducibility: the same path on every x86 CPU
    "ONEDNN_MAX_CPU_ISA": "SSE41",  # oneDNN's JIT kernels capped at SSE4.1
    "OMP_NUM_THREADS": "1",  # one thread per process: no reduction split across threads
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "disabled",
}
# Dropped from the run's environment: with RAY_ADDRESS the run would join a running cluster, whose workers have that
# cluster's environment, not PINNED_ENV. The local cluster the run starts hands its environment to every worker.
UNSET_ENV = ("RAY_ADDRESS",)
RUN_MARK_VAR = "MINT_GOLDEN_RUN_MARK"
WORKER_TITLES = ("ray::LearnerActor", "ray::RolloutActor")
# The per-step figures, in the order they are compared (the first difference is the one reported).
STEP_KEYS = (
    "reward_mean",
    "reward_std",
    "rollout_tokens_sha256",
    "adv_min",
    "adv_max",
    "adv_abs_mean",
    "response_tokens",
    "groups_kept",
    "trust_kept_frac",
    "logp_diff_max",
    "loss",
    "kl",
    "clip_frac",
    "grad_norm",
    "revision",
)


class GoldenError(RuntimeError):
    """A golden run failed, or wrote figures that disagree with each other."""


def golden_file(base: str) -> Path:
    return GOLDEN_DIR / f"{base}.json"


def overrides(base: str, root: Path) -> list[str]:
    """The command-line overrides of one base's golden run (the rest is tests/golden/recipe.toml)."""
    return [f"model.path=tiny:{base}", f"logging.root={root}", f"logging.name={base}"]


def run_env() -> dict[str, str]:
    """The environment of the `mint train` process: the caller's, minus UNSET_ENV, plus PINNED_ENV."""
    env = {k: v for k, v in os.environ.items() if k not in UNSET_ENV}
    return env | PINNED_ENV


def run_golden(base: str, root: Path, timeout_s: float = 600.0) -> dict:
    """Run the golden recipe on tiny:<base> as a `mint train` process under `root`; return its figures (what the
    golden file holds) plus "workers": the PINNED_ENV values each Ray worker of the run was seen with."""
    mark = uuid.uuid4().hex
    # SPT_NOENV=1: a Ray worker's title would otherwise overwrite its /proc/PID/environ, mark and PINNED_ENV with it
    # (run_mark_env in tests/conftest.py says how).
    env = run_env() | {RUN_MARK_VAR: mark, "SPT_NOENV": "1"}
    cmd = [sys.executable, "-m", "mint.cli", "train", str(RECIPE), *overrides(base, Path(root))]
    seen: dict[int, dict] = {}
    done = threading.Event()
    watcher = threading.Thread(target=_watch_workers, args=(mark, seen, done), daemon=True)
    watcher.start()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    finally:
        done.set()
        watcher.join()
    if proc.returncode != 0:
        raise GoldenError(f"tiny:{base}: `mint train` exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    out = figures(Path(root) / base, base)
    out["workers"] = sorted(seen.values(), key=lambda w: w["title"])
    return out


def _watch_workers(mark: str, seen: dict[int, dict], done: threading.Event) -> None:
    """Until `done`: note the PINNED_ENV values of every Ray worker process whose environment holds the run's mark
    (the mark proves it descends from this run's `mint train`, whose local Ray started it)."""
    wanted = f"{RUN_MARK_VAR}={mark}".encode()
    while not done.is_set():
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in seen:
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:  # gone since the listing, or another user's
                continue
            title = next((t for t in WORKER_TITLES if t in cmdline), None)
            if title and wanted in environ:
                pairs = dict(e.decode(errors="replace").partition("=")[::2] for e in environ if b"=" in e)
                seen[int(entry.name)] = {"title": title} | {k: pairs.get(k) for k in PINNED_ENV}
        time.sleep(0.2)


def unpinned_workers(fig: dict) -> list[str]:
    """What is wrong with the Ray workers `run_golden` saw: a role never seen, or a worker without PINNED_ENV."""
    seen = fig.get("workers", [])
    problems = [f"no {t} process of the run was seen" for t in WORKER_TITLES if t not in {w["title"] for w in seen}]
    for w in seen:
        wrong = {k: w.get(k) for k, v in PINNED_ENV.items() if w.get(k) != v}
        if wrong:
            problems.append(f"a {w['title']} ran with {wrong}, not the pinned {PINNED_ENV}")
    return problems


def figures(run_dir: Path, base: str) -> dict:
    """The golden figures of a finished run directory: per step, the STEP_KEYS; and the revision ids of the run."""
    from mint.hub import Catalog, read_step
    from mint.train.report import load_run

    rows, config, summary = load_run(run_dir)
    advantages: dict[int, list[float]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        advantages.setdefault(row["step"], []).append(row["advantage"])
    with Catalog(Path(config["catalog"]["path"] or run_dir / "catalog"), create=False) as catalog:
        final = catalog.latest(base)
        if final is None:
            raise GoldenError(f"{run_dir}: the catalog holds no revision of run {base!r}")
        catalog.load(final.id)  # re-hashes the stored tensors against the id
        chain = {meta.step: meta.id for meta in catalog.lineage(final.id)}
        tokens = {
            shard.step: hashlib.sha256(read_step(catalog, shard).tensors["tokens"].numpy().tobytes()).hexdigest()
            for shard in catalog.records(run=base)
        }
    steps = []
    for row in rows:
        s, adv = row["step"], advantages.get(row["step"], [])
        if not adv:
            raise GoldenError(f"{run_dir}: samples.jsonl logged no advantages at step {s}")
        fig = {"step": s} | {k: row[k] for k in STEP_KEYS if k in row}
        fig |= {
            "rollout_tokens_sha256": tokens.get(s),
            "adv_min": min(adv),
            "adv_max": max(adv),
            "adv_abs_mean": math.fsum(abs(a) for a in adv) / len(adv),
        }
        if row.get("revision") != chain.get(s):
            raise GoldenError(f"{run_dir}: step {s} logged revision {row.get('revision')} but the catalog has {chain}")
        steps.append({k: fig.get(k) for k in ("step", *STEP_KEYS)})
    if summary.get("revision") != final.id:
        raise GoldenError(f"{run_dir}: summary.json names {summary.get('revision')}, the catalog {final.id}")
    return {
        "base": f"tiny:{base}",
        "initial_revision": chain.get(0),
        "final_revision": final.id,
        "steps": steps,
    }


def differences(expected: dict, got: dict) -> list[str]:
    """Every figure that differs, first step and first metric first: 'step 2 grad_norm: golden X, got Y'."""
    out = []
    for key in ("base", "initial_revision"):
        if expected.get(key) != got.get(key):
            out.append(f"{key}: golden {expected.get(key)!r}, got {got.get(key)!r}")
    want, have = expected.get("steps", []), got.get("steps", [])
    if [s["step"] for s in want] != [s["step"] for s in have]:
        out.append(f"steps: golden {[s['step'] for s in want]}, got {[s['step'] for s in have]}")
    for a, b in zip(want, have, strict=False):  # a run cut short still reports its steps
        for key in STEP_KEYS:
            if a.get(key) != b.get(key):
                out.append(f"step {a['step']} {key}: golden {a.get(key)!r}, got {b.get(key)!r}")
    if expected.get("final_revision") != got.get("final_revision"):
        out.append(f"final_revision: golden {expected.get('final_revision')}, got {got.get('final_revision')}")
    return out


def golden_record(fig: dict) -> dict:
    """What a golden file holds: the figures, and how they were made (for the reader; never compared)."""
    import torch

    made_with = {"torch": torch.__version__, "recipe": str(RECIPE.relative_to(ROOT)), "env": PINNED_ENV}
    return {k: v for k, v in fig.items() if k != "workers"} | {"made_with": made_with}


def write_golden(base: str, fig: dict) -> Path:
    """Write tiny:<base>'s golden file atomically."""
    path = golden_file(base)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(golden_record(fig), indent=2) + "\n")
    os.replace(tmp, path)
    return path
