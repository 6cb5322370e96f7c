"""The golden runs: one fixed-seed `mint train` per tiny base, whose per-step figures and revision ids are pinned in
tests/golden/<base>.json. tests/test_golden.py compares a fresh run with those files; tests/golden/regenerate.py
(`make golden`) rewrites them. Both run the same code, below.

A run is a real `mint train` process: local Ray, 2 learner ranks on DeepSpeed (gloo), LongStraw exact
(tests/golden/recipe.toml). Its float kernels are pinned through the environment (PINNED_ENV), which makes a run
repeat bit for bit on one machine but not across machines: an AVX2 Xeon moved every revision id from step 1 and the
figures by 1e-7 to 5e-5 relative. So the figures are compared within tolerances derived from the computation (one
function per figure, below), the discrete ones exactly, and the revision ids (sha256 of the adapter tensors) only
where the environment's fingerprint (`fingerprint`: CPU, libc, requirements.lock, torch, pinned env) equals the one
the golden file was made with.

Figures come from where a run writes them: metrics.jsonl (through `mint.train.report.load_run`, the reader `mint
report` uses), samples.jsonl (the logged advantages), and the run's catalog (the revisions' lineage and the rollout
records' sampled tokens).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parent
ROOT = GOLDEN_DIR.parents[1]
RECIPE = GOLDEN_DIR / "recipe.toml"
# Every tiny family: MoE with and without shared experts, dense, hybrid linear attention (Gated DeltaNet), MLA and
# DSA. qwen3 (dense, no experts) is the cheapest run and carries the other-kernel runs (OTHER_KERNELS).
BASES = (
    "qwen3_moe",
    "qwen2_moe",
    "glm4_moe",
    "qwen3",
    "qwen3_5_moe",
    "qwen3_next",
    "qwen3_5",
    "deepseek_v3",
    "glm4_moe_lite",
    "glm_moe_dsa",
)
CHEAPEST = "qwen3"

# The float kernels a run may use, pinned to the code paths least tied to the CPU: a run repeats bit for bit on one
# machine, but another CPU still moves the bits (an AVX2 Xeon moved every revision id against an AVX-512 EPYC's
# files), so the figures are held to TOLERANCES and the ids to the fingerprint. ATen dispatches its
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
# Runs with other float kernels, as stand-ins for another CPU: their figures must hold within the tolerances (their
# revision ids are not compared: their fingerprint's env differs). None = removed from the run's environment, so
# "native" runs the kernels this machine's ISA selects (AVX-512 here, AVX2 on an AVX2-only machine).
OTHER_KERNELS: dict[str, dict[str, str | None]] = {
    "avx2": PINNED_ENV | {"ATEN_CPU_CAPABILITY": "avx2"},
    "native": PINNED_ENV | {"ATEN_CPU_CAPABILITY": None, "MKL_CBWR": None, "ONEDNN_MAX_CPU_ISA": None},
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
    "rewards",
    "rollout_tokens_sha256",
    "adv_min",
    "adv_max",
    "adv_abs_mean",
    "response_tokens",
    "prompt_tokens",
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


def run_env(pinned: Mapping[str, str | None] = PINNED_ENV) -> dict[str, str]:
    """The environment of the `mint train` process: the caller's, minus UNSET_ENV and the keys `pinned` maps to
    None, plus the rest of `pinned`."""
    env = {k: v for k, v in os.environ.items() if k not in UNSET_ENV and k not in pinned}
    return env | {k: v for k, v in pinned.items() if v is not None}


def run_golden(base: str, root: Path, timeout_s: float = 600.0, pinned: Mapping[str, str | None] = PINNED_ENV) -> dict:
    """Run the golden recipe on tiny:<base> as a `mint train` process under `root`, with the float-kernel
    environment `pinned` (None: unset); return its figures (what the golden file holds) plus "workers": the values
    of `pinned`'s variables each Ray worker of the run was seen with (None: unset)."""
    mark = uuid.uuid4().hex
    # SPT_NOENV=1: a Ray worker's title would otherwise overwrite its /proc/PID/environ, mark and PINNED_ENV with it
    # (run_mark_env in tests/conftest.py says how).
    env = run_env(pinned) | {RUN_MARK_VAR: mark, "SPT_NOENV": "1"}
    cmd = [sys.executable, "-m", "mint.cli", "train", str(RECIPE), *overrides(base, Path(root))]
    seen: dict[int, dict] = {}
    done = threading.Event()
    watcher = threading.Thread(target=_watch_workers, args=(mark, tuple(pinned), seen, done), daemon=True)
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


def _watch_workers(mark: str, keys: tuple[str, ...], seen: dict[int, dict], done: threading.Event) -> None:
    """Until `done`: note the values of `keys` in every Ray worker process whose environment holds the run's mark
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
                seen[int(entry.name)] = {"title": title} | {k: pairs.get(k) for k in keys}
        time.sleep(0.2)


def unpinned_workers(fig: dict, pinned: Mapping[str, str | None] = PINNED_ENV) -> list[str]:
    """What is wrong with the Ray workers `run_golden` saw: a role never seen, or a worker whose environment is not
    `pinned` (a variable pinned to None must be unset), e.g. a run meant for other kernels whose workers kept
    PINNED_ENV's, which would compare the pinned kernels with themselves."""
    seen = fig.get("workers", [])
    problems = [f"no {t} process of the run was seen" for t in WORKER_TITLES if t not in {w["title"] for w in seen}]
    for w in seen:
        wrong = {k: w.get(k, "(not read)") for k, v in pinned.items() if w.get(k, "(not read)") != v}
        if wrong:
            problems.append(f"a {w['title']} ran with {wrong}, not the pinned {dict(pinned)}")
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
        records = {shard.step: read_step(catalog, shard).tensors for shard in catalog.records(run=base)}
    tokens = {s: hashlib.sha256(t["tokens"].numpy().tobytes()).hexdigest() for s, t in records.items()}
    steps = []
    for row in rows:
        s, adv = row["step"], advantages.get(row["step"], [])
        if not adv:
            raise GoldenError(f"{run_dir}: samples.jsonl logged no advantages at step {s}")
        fig = {"step": s} | {k: row[k] for k in STEP_KEYS if k in row}
        fig |= {"rollout_tokens_sha256": tokens.get(s)} | advantage_figures(adv)
        if s in records:
            fig |= {"rewards": _rewards_by_group(records[s]), "prompt_tokens": int(records[s]["prompt_offsets"][-1])}
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


def advantage_figures(adv: list[float]) -> dict:
    """adv_min, adv_max, adv_abs_mean of a step's logged advantages (samples.jsonl)."""
    return {"adv_min": min(adv), "adv_max": max(adv), "adv_abs_mean": math.fsum(abs(a) for a in adv) / len(adv)}


def _rewards_by_group(tensors: dict) -> list[list[float]]:
    """The step's rewards as B lists of G, from a rollout-record shard (rewards and group index per response)."""
    out: dict[int, list[float]] = {}
    for b, r in zip(tensors["group"].tolist(), tensors["rewards"].tolist(), strict=True):
        out.setdefault(b, []).append(r)
    return [out[b] for b in sorted(out)]


# ---- tolerances ------------------------------------------------------------------------------------------------
#
# Each continuous figure gets the largest difference two runs of the recipe may show when they differ only in their
# float kernels (ATen's scalar, AVX2 or AVX-512 builds; MKL's code paths), derived from fp32's epsilon and the size
# and number of the terms each figure sums. Each function returns an absolute bound for |golden - got|, from the
# golden step `a`, the fresh step `b` and the recipe's numbers `r`. A bound must stay below what a real change
# moves: the advantage normalisation's eps from 1e-6 to 2e-6 moves every advantage by 1e-6 / std, at least 1.7e-6
# relative for 4 binary rewards (std <= 1/sqrt(3)), and tests/test_golden.py checks that the adv figures report it.

EPS32 = 2.0**-23  # torch.finfo(torch.float32).eps: the distance from 1.0 to the next fp32


@functools.cache
def recipe_numbers() -> dict:
    """The recipe's numbers the tolerances use; refuses a recipe the derivations below do not cover."""
    from mint.config import load_config

    c = load_config(RECIPE)
    # The loss tolerance takes the PPO ratio as exactly 1 (one epoch, on-policy: the old logprobs are the learner's
    # own, detached), and all bounds take fp32 math; a recipe that changes either needs its tolerances re-derived.
    assumed = {
        "learner.epochs": (c.learner.epochs, 1),
        "rollout.max_staleness": (c.rollout.max_staleness, 0),
        "model.dtype": (c.model.dtype, "float32"),
    }
    if wrong := {k: got for k, (got, want) in assumed.items() if got != want}:
        raise GoldenError(f"{RECIPE}: the golden tolerances assume {assumed}; this recipe has {wrong}")
    G, B = c.rollout.group_size, c.rollout.prompts_per_step
    return {"G": G, "n_rewards": B * G, "R_max": c.rollout.max_tokens, "kl_coef": c.grpo.kl_coef}


def _adv_rel(r: dict) -> float:
    """Relative bound on an advantage A = (x - mean) / (std + eps) over a group of G rewards. The rewards are 0/1,
    so their mean (an exact sum, one division) and x - mean are the same bits under any kernel; the unbiased std is
    a reduction of G non-negative squares whose order and algorithm (scalar or vector Welford) are the kernel's:
    each run's variance is within G/2 EPS32 relative, so the two differ by <= G EPS32 and their square roots by
    G/2 EPS32. The + eps and the division may then round apart by one ulp each: (G/2 + 2) EPS32 = 4.8e-7 for G = 4,
    a third of the eps change's 1.7e-6."""
    return (r["G"] / 2 + 2) * EPS32


def _tol_adv(a: dict, b: dict, r: dict, key: str) -> float:
    """adv_min, adv_max, adv_abs_mean: each is one advantage, or a float64 mean of |advantages| (math.fsum, no fp32
    rounding), so each moves by at most _adv_rel of its size."""
    return _adv_rel(r) * abs(a[key])


def _tol_reward_std(a: dict, b: dict, r: dict, key: str) -> float:
    """reward_std: the population std of the step's n = B x G rewards in fp32. As for the advantages' std: the
    variance, a reduction of n non-negative squares, is within n/2 EPS32 relative in each run, so the two runs'
    square roots differ by <= n/2 EPS32, plus one ulp for the root's rounding: (n/2 + 1) EPS32 (1.1e-6 for n = 16)."""
    return (r["n_rewards"] / 2 + 1) * EPS32 * abs(a[key])


def _tol_logp_diff_max(a: dict, b: dict, r: dict, key: str) -> float:
    """logp_diff_max = max over the step's tokens of |learner logprob - rollout logprob|, the same fp32 math through
    two code paths: it is rounding noise, not a computed value, so other kernels draw it afresh and only its scale
    can be pinned. Its values are a few ulps of the logits (2^-20 = 9.5e-7 is one ulp in [8, 16)); measured across
    ATen's default, AVX2 and AVX-512 kernels, the two draws differed by a factor of 1.75 at most (qwen3_moe step 3:
    4.8e-7 and 8.3e-7). So the two may differ by 3 times the smaller (a factor of 4), or by 8 EPS32 (one ulp of a
    logit in [8, 16)) when one of them is 0; what the figure exists for moves it by orders of magnitude: a learner
    scoring another revision than the rollout sampled is 1e-3 or more off."""
    return 3 * min(a[key], b[key]) + 8 * EPS32


# The learner's logprob noise, at most: on the bases whose rollout agrees with the learner, logp_diff_max is 4 to 45
# EPS32 (4.8e-7 to 5.4e-6, qwen3_5_moe step 3 the largest); 64 EPS32 = 7.6e-6.
NU_MAX = 64 * EPS32


def _nu(a: dict, b: dict) -> float:
    """The runs' own logprob noise: the larger logp_diff_max of the two (learner vs rollout, same weights), capped at
    NU_MAX. A larger logp_diff_max is a disagreement between rollout and learner (tiny:qwen3_5's rollout scores
    3 to 17 nats off; docs/decisions.md), not noise of the learner's own passes, which the KL compares."""
    return min(max(a["logp_diff_max"], b["logp_diff_max"]), NU_MAX)


def _tol_kl(a: dict, b: dict, r: dict, key: str = "kl") -> float:
    """kl = mean over the step's T tokens of k3(d) = exp(d) - d - 1, d = ref logprob - logprob, in fp32.
    - k3 is a small difference of terms of size 1: exp(d) is within one ulp of exp in ATen's scalar and vector
      (Sleef) builds, - d rounds at magnitude 1 (half an ulp), - 1 is exact (Sterbenz): 1.5 EPS32 per token in
      each run, 3 EPS32 between two runs, and the mean keeps that bound. This term dominates: 3.6e-7 absolute.
    - the fp32 sums of T terms of the mean's size: T EPS32 kl.
    - d moves by the logprob noise of both passes, <= 2 nu (nu: _nu); k3'(d) = exp(d) - 1 ~ d, and the mean of
      |d| is <= sqrt(2 kl) (Cauchy-Schwarz, k3 ~ d^2 / 2): 2 nu sqrt(2 kl). The adapter a step-2 or step-3 pass
      runs with differs between the runs by the earlier steps' gradient noise (Adam's first steps are lr g / |g|,
      insensitive to a 1e-7 relative change of g), which this covers."""
    kl, T = max(a["kl"], b["kl"]), a["response_tokens"]
    return 3 * EPS32 + T * EPS32 * kl + 2 * _nu(a, b) * math.sqrt(2 * kl)


def _tol_loss(a: dict, b: dict, r: dict, key: str) -> float:
    """loss = sum over the step's tokens of w_t fl(-A_t r_t + c k3_t), sum of w_t = 1 (token-mean), r_t = 1
    exactly (recipe_numbers: on-policy, one epoch), c = kl_coef. Its policy part is a small difference of large terms:
    a group's advantages sum to 0, so in the reals the loss is c kl plus what unequal response lengths leave, and
    in fp32 it is rounding at the advantages' magnitude. So the bound is absolute:
    - the KL part: c times the KL tolerance;
    - the advantages may move by _adv_rel of their size;
    - where any input differs, the fp32 operations on terms of size |A_t| may round apart, one ulp each: the
      per-token add, the response's sum of up to R_max terms, the weight's product: (R_max + 1) EPS32 |A_t|.
    sum_t w_t |A_t| <= max |A| = (G - 1) / sqrt(G) (the largest standardized score with the unbiased std), 1.5 for
    G = 4: the bound is 1.8e-6, the size of this recipe's losses (1e-9 to 3e-6): the loss pins the KL part and
    catches a policy term off by more than rounding; grad_norm and kl pin the rest."""
    a_max = (r["G"] - 1) / math.sqrt(r["G"])
    return r["kl_coef"] * _tol_kl(a, b, r) + a_max * (_adv_rel(r) + (r["R_max"] + 1) * EPS32)


def _tol_grad_norm(a: dict, b: dict, r: dict, key: str) -> float:
    """grad_norm = || sum of the per-position gradient terms ||. Every position the step's backward runs over (each
    response token's replay, and each prompt token in exact mode) adds one term to every LoRA gradient entry: n =
    response_tokens + prompt_tokens terms, each within a few ulps under other kernels, summed in another order: the
    sum moves by <= n EPS32 relative to the sum of |terms| (the norm's own sum of squares, of non-negative terms,
    adds less). Measured across ATen's default, AVX2 and AVX-512 kernels: 0.8e-7 to 2.2e-7 relative, about 2
    EPS32, against n EPS32 = 1.6e-5 for the n = 130 to 134 of these runs."""
    n = a["response_tokens"] + a["prompt_tokens"]
    return n * EPS32 * abs(a[key])


# Figures compared within a tolerance; every other figure is discrete (rewards and their mean, an exact sum of 0/1
# values divided once; token hashes and counts, groups kept, the kept and clipped fractions: counts divided once)
# and compared exactly. Revision ids are compared only where `differences` is told the fingerprints match.
TOLERANCES: dict[str, Callable[[dict, dict, dict, str], float]] = {
    "reward_std": _tol_reward_std,
    "adv_min": _tol_adv,
    "adv_max": _tol_adv,
    "adv_abs_mean": _tol_adv,
    "logp_diff_max": _tol_logp_diff_max,
    "loss": _tol_loss,
    "kl": _tol_kl,
    "grad_norm": _tol_grad_norm,
}
REVISION_KEYS = ("initial_revision", "revision", "final_revision")


def _within(a: dict, b: dict, key: str, r: dict) -> tuple[bool, float]:
    """(whether step `b`'s figure `key` holds against golden step `a`, the bound used: 0 for an exact figure)."""
    x, y = a.get(key), b.get(key)
    tol = TOLERANCES.get(key)
    if tol is None or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (x, y)):
        return x == y, 0.0
    bound = tol(a, b, r, key)
    return abs(x - y) <= bound, bound


def differences(expected: dict, got: dict, *, exact: bool = False, compare_ids: bool = True) -> list[str]:
    """Every figure that differs beyond its tolerance (TOLERANCES; every figure bit for bit with `exact`), first
    step and first metric first: 'step 2 grad_norm: golden X, got Y (|diff| D > tolerance T)'. Revision ids are
    compared, bit for bit, only with `compare_ids`."""
    r = {} if exact else recipe_numbers()
    out = []
    keys = ("base", "initial_revision") if compare_ids else ("base",)
    for key in keys:
        if expected.get(key) != got.get(key):
            out.append(f"{key}: golden {expected.get(key)!r}, got {got.get(key)!r}")
    want, have = expected.get("steps", []), got.get("steps", [])
    if [s["step"] for s in want] != [s["step"] for s in have]:
        out.append(f"steps: golden {[s['step'] for s in want]}, got {[s['step'] for s in have]}")
    for a, b in zip(want, have, strict=False):  # a run cut short still reports its steps
        for key in STEP_KEYS:
            if key == "revision" and not compare_ids:
                continue
            ok, bound = (a.get(key) == b.get(key), 0.0) if exact else _within(a, b, key, r)
            if not ok:
                line = f"step {a['step']} {key}: golden {a.get(key)!r}, got {b.get(key)!r}"
                if bound:
                    line += f" (|diff| {abs(a[key] - b[key]):.3g} > tolerance {bound:.3g})"
                out.append(line)
    if compare_ids and expected.get("final_revision") != got.get("final_revision"):
        out.append(f"final_revision: golden {expected.get('final_revision')}, got {got.get('final_revision')}")
    return out


# ---- the environment's fingerprint -----------------------------------------------------------------------------
#
# What decides a run's bits beyond the code: the CPU (its ISA selects MKL's and ATen's paths where they are not
# pinned, and its model the microarchitecture's), the C library (ATen's scalar exp and log are glibc's libm), the
# locked packages (requirements.lock: torch, numpy, DeepSpeed, transformers, ...), torch itself (a local build is
# not in the lock), and the pinned environment. Revision ids are compared only when all of them are equal.

# /proc/cpuinfo flags that name vector ISAs or float features a kernel may be chosen by.
ISA_FLAG = re.compile(r"^(sse\w*|ssse3|avx\w*|fma\w*|f16c|amx\w*)$")


def cpu_fingerprint(cpuinfo: str | None = None) -> dict:
    """The first CPU's vendor, family, model number and name, and its ISA flags (ISA_FLAG), from /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {"machine": platform.machine()}
    first = cpuinfo.split("\n\n", 1)[0]
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    flags = sorted(f for f in fields.get("flags", "").split() if ISA_FLAG.match(f))
    out = {k: fields.get(k) for k in ("vendor_id", "cpu family", "model", "model name")}
    return {"machine": platform.machine()} | out | {"isa_flags": flags}


def fingerprint(pinned: Mapping[str, str | None] = PINNED_ENV) -> dict:
    """This environment's fingerprint, for a run made with the float-kernel environment `pinned`."""
    import torch

    lock = ROOT / "requirements.lock"
    return {
        "cpu": cpu_fingerprint(),
        "libc": " ".join(platform.libc_ver()).strip() or None,
        "requirements_lock_sha256": hashlib.sha256(lock.read_bytes()).hexdigest() if lock.exists() else None,
        "torch": torch.__version__,
        "env": dict(pinned),
    }


def fingerprint_differences(recorded: dict | None, current: dict) -> list[str]:
    """What differs between a golden file's fingerprint and this one, one line each ('cpu.model name: golden X,
    here Y'); a file without a fingerprint differs everywhere."""
    if not recorded:
        return ["the golden file records no fingerprint"]

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) and k != "env" else {f"{prefix}{k}": v}
        return out

    old, new = flat(recorded), flat(current)
    lines = []
    for k in sorted(old.keys() | new.keys()):
        if old.get(k) == new.get(k):
            continue
        if k.endswith("isa_flags") and isinstance(old.get(k), list) and isinstance(new.get(k), list):
            lost, extra = sorted(set(old[k]) - set(new[k])), sorted(set(new[k]) - set(old[k]))
            lines.append(f"{k}: golden has {lost or 'nothing'} more, here {extra or 'nothing'} more")
        elif k == "env":
            moved = {e: (old[k].get(e), new[k].get(e)) for e in sorted(old[k].keys() | new[k].keys())}
            moved = {e: f"{a or 'unset'} -> {b or 'unset'}" for e, (a, b) in moved.items() if a != b}
            lines.append("env: " + ", ".join(f"{e} {v}" for e, v in moved.items()))
        else:
            lines.append(f"{k}: golden {old.get(k)!r}, here {new.get(k)!r}")
    return lines


def golden_record(fig: dict) -> dict:
    """What a golden file holds: the figures, and how they were made: the recipe, and the fingerprint that decides
    whether a fresh run's revision ids can be compared with the file's."""
    made_with = {"recipe": str(RECIPE.relative_to(ROOT)), "fingerprint": fingerprint(PINNED_ENV)}
    return {k: v for k, v in fig.items() if k != "workers"} | {"made_with": made_with}


def write_golden(base: str, fig: dict) -> Path:
    """Write tiny:<base>'s golden file atomically."""
    path = golden_file(base)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(golden_record(fig), indent=2) + "\n")
    os.replace(tmp, path)
    return path
