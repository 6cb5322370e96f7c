"""Golden figures: a fixed-seed `mint train` on each tiny base (tests/golden/recipe.toml: local Ray, 2 learner ranks
on DeepSpeed over gloo, LongStraw exact, KL on) gives the per-step figures pinned in tests/golden/<base>.json, and,
in the environment the file was made in, its revision ids bit for bit.

Every other end-to-end comparison computes its reference in the same session, so a change that moves both sides
passes them; this one compares with numbers written before the change. The pinned float kernels
(tests/golden/harness.py, PINNED_ENV) make a run repeat bit for bit on one machine, not across machines: an AVX2
Xeon moved every revision id from step 1 and the figures by 1e-7 to 5e-5 relative. So the continuous figures are
compared within tolerances derived from fp32 and the sums behind each figure (harness.TOLERANCES, one function per
figure), the discrete ones (rewards, sampled tokens, counts, kept and clipped fractions) exactly, and the revision
ids only where the environment's fingerprint equals the file's; elsewhere the test says it did not compare them.
The tolerances stay tight enough to see the advantage normalisation's eps moved from 1e-6 to 2e-6 (at least 1.7e-6
relative on every advantage), which a test below plants.

A change meant to move the numbers regenerates the files with `make golden` (docs/getting-started.md, Tests).
"""

from __future__ import annotations

import inspect
import json
import math
import platform
import warnings
from types import SimpleNamespace

import pytest
from golden.harness import (
    BASES,
    CHEAPEST,
    OTHER_KERNELS,
    PINNED_ENV,
    RECIPE,
    STEP_KEYS,
    TOLERANCES,
    advantage_figures,
    cpu_fingerprint,
    differences,
    fingerprint,
    fingerprint_differences,
    golden_file,
    run_golden,
    unpinned_workers,
)

from mint.config import load_config

X86 = platform.machine() in ("x86_64", "AMD64")
ADV_KEYS = ("adv_min", "adv_max", "adv_abs_mean")


class RevisionIdsNotCompared(UserWarning):
    """A golden run's revision ids were not compared: this environment is not the one the golden file was made in."""


def _golden(base: str) -> dict:
    return json.loads(golden_file(base).read_text())


def _copy(d: dict) -> dict:
    return json.loads(json.dumps(d))


def _ids_comparable(golden: dict, pinned=PINNED_ENV) -> bool:
    """Whether a run made here with the float-kernel environment `pinned` can be held to `golden`'s revision ids;
    when not, say so (a RevisionIdsNotCompared warning in the test's output) with what differs."""
    moved = fingerprint_differences(golden.get("made_with", {}).get("fingerprint"), fingerprint(pinned))
    if moved:
        warnings.warn(
            RevisionIdsNotCompared(
                f"{golden['base']}: revision ids not compared (the figures were, within their tolerances): this "
                f"environment differs from the golden file's: {'; '.join(moved)}"
            ),
            stacklevel=2,
        )
    return not moved


@pytest.mark.parametrize("base", BASES)
def test_golden_file_holds_every_step_of_the_recipe(base):
    """Each base's golden file has one entry per recipe step with every figure set (the rewards as B groups of G),
    its final revision is the last step's, and it records the fingerprint of the environment it was made in: a file
    written by hand, or left behind when the recipe's step count or shape changed, fails here."""
    golden = _golden(base)
    config = load_config(RECIPE)
    assert golden["base"] == f"tiny:{base}"
    assert [s["step"] for s in golden["steps"]] == list(range(1, config.grpo.steps + 1))
    for s in golden["steps"]:
        unset = [k for k in STEP_KEYS if s.get(k) is None]
        assert not unset, f"step {s['step']} has no {unset}"
        shape = [len(g) for g in s["rewards"]]
        assert shape == [config.rollout.group_size] * config.rollout.prompts_per_step, shape
        assert s["reward_mean"] == sum(map(sum, s["rewards"])) / sum(shape)
    revisions = [golden["initial_revision"]] + [s["revision"] for s in golden["steps"]]
    assert all(len(r) == 64 for r in revisions) and len(set(revisions)) == len(revisions), revisions
    assert golden["final_revision"] == golden["steps"][-1]["revision"]
    recorded = golden["made_with"]["fingerprint"]
    assert recorded["env"] == PINNED_ENV
    assert {"vendor_id", "model name", "isa_flags"} <= recorded["cpu"].keys(), recorded["cpu"]
    assert recorded["torch"] and len(recorded["requirements_lock_sha256"]) == 64, recorded


def test_differences_name_the_first_differing_step_and_metric():
    """Step 2's grad_norm moved by 1e-4 relative (eight times its tolerance) and another final revision: the report
    starts at step 2 grad_norm with the bound it broke, then the revision; without ids compared only grad_norm is
    left. One ulp on grad_norm is inside the tolerance, and only `exact` (regenerate's two runs) reports it."""
    golden = _golden(BASES[0])
    assert differences(golden, _copy(golden)) == []
    moved = _copy(golden)
    g = moved["steps"][1]["grad_norm"]
    moved["steps"][1]["grad_norm"] = g * (1 + 1e-4)
    moved["final_revision"] = "0" * 64
    found = differences(golden, moved)
    assert found[0].startswith(f"step 2 grad_norm: golden {g!r}, got {g * (1 + 1e-4)!r} (|diff| "), found
    assert "> tolerance" in found[0], found
    assert found[1].startswith("final_revision: golden ") and len(found) == 2, found
    assert [line.split(":")[0] for line in differences(golden, moved, compare_ids=False)] == ["step 2 grad_norm"]

    ulp = _copy(golden)
    ulp["steps"][1]["grad_norm"] = math.nextafter(g, math.inf)
    assert differences(golden, ulp) == []
    assert differences(golden, ulp, exact=True) == [
        f"step 2 grad_norm: golden {g!r}, got {math.nextafter(g, math.inf)!r}"
    ]


def _with_advantages(golden: dict, monkeypatch, eps: float | None) -> dict:
    """`golden` with its adv figures recomputed from its own rewards by the real code that logs them
    (mint.train.evaluation.sample_rows, which calls mint.rl.grpo.group_advantages_batch), after changing that
    function's default eps to `eps` as an edit of its signature would (None: left as it is)."""
    import torch

    from mint.rl import grpo
    from mint.train.evaluation import sample_rows

    if eps is not None:
        params = inspect.signature(grpo.group_advantages_batch).parameters.values()
        defaults = tuple(eps if p.name == "eps" else p.default for p in params if p.default is not p.empty)
        monkeypatch.setattr(grpo.group_advantages_batch, "__defaults__", defaults)
    config = load_config(RECIPE)
    out = _copy(golden)
    for s in out["steps"]:
        rewards_B_G = torch.tensor(s["rewards"], dtype=torch.float32)
        results = [
            SimpleNamespace(example=SimpleNamespace(prompt="", answer=""), responses=[""] * len(g), episodes=None)
            for g in s["rewards"]
        ]
        s |= advantage_figures([row["advantage"] for row in sample_rows(config, s["step"], results, rewards_B_G)])
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("base", BASES)
def test_advantage_eps_moved_from_1e6_to_2e6_is_reported_by_the_adv_figures(base, monkeypatch):
    """The advantage normalisation's eps changed from 1e-6 to 2e-6 in `group_advantages_batch` (the signature's
    default, which every caller uses) moves every advantage by 1e-6 / std, 1.7e-6 to 2e-6 relative for 4 binary
    rewards (25 to 34 fp32 ulps), which no kernel does. Recomputed from the golden run's own rewards: with eps as it
    is the adv figures hold (computed here with this machine's own kernels, not the pinned ones); with 2e-6 every
    step whose groups are not all ties reports adv_abs_mean, and nothing but adv figures moves."""
    from mint.rl.grpo import group_advantages_batch

    assert inspect.signature(group_advantages_batch).parameters["eps"].default == 1e-6
    golden = _golden(base)
    assert differences(golden, _with_advantages(golden, monkeypatch, None), compare_ids=False) == []
    planted = differences(golden, _with_advantages(golden, monkeypatch, 2e-6), compare_ids=False)
    assert group_advantages_batch.__defaults__[-1] == 1e-6  # the plant is gone again
    tied = {s["step"] for s in golden["steps"] if all(len(set(g)) == 1 for g in s["rewards"])}
    assert len(tied) < len(golden["steps"]), f"every step of tiny:{base} is all ties: the plant moves nothing"
    reported = {(int(line.split()[1]), line.split()[2].rstrip(":")) for line in planted}
    assert {k for _, k in reported} <= set(ADV_KEYS), planted
    assert {(s, "adv_abs_mean") for s in range(1, len(golden["steps"]) + 1) if s not in tied} <= reported, planted


# Kernel noise as measured (docs/decisions.md, golden figures): on an AVX2 Xeon against the files made on an AVX-512
# EPYC, qwen3's step 3 moved loss 8.2049518e-07 -> 8.2053244e-07, kl 8.18558e-05 -> 8.18595e-05, grad_norm
# 0.20115506 -> 0.20115504 (1e-7 to 5e-5 relative); here, with ATen's AVX2 and AVX-512 kernels, kl moved by up to
# 9.1e-5 relative, grad_norm by up to 2.2e-7, logp_diff_max by a factor of up to 1.75, the advantages not at all.
MEASURED_NOISE = {
    "loss": lambda v: v * (1 + 5e-5) + 4e-11,
    "kl": lambda v: v * (1 + 1e-4),
    "grad_norm": lambda v: v * (1 - 2.5e-7),
    "logp_diff_max": lambda v: v * 1.75,
    "reward_std": lambda v: math.nextafter(v, 0.0),
    "adv_min": lambda v: math.nextafter(v, -math.inf),
    "adv_max": lambda v: math.nextafter(v, math.inf),
    "adv_abs_mean": lambda v: math.nextafter(v, math.inf),
}


@pytest.mark.parametrize("base", BASES)
def test_kernel_noise_of_the_measured_sizes_is_within_the_tolerances(base):
    """Every continuous figure of every step moved by the largest noise other kernels were measured to give (and the
    advantages by one ulp, which they never moved), every revision id different: nothing is reported when ids are
    not compared; the ids are when they are."""
    assert set(MEASURED_NOISE) == set(TOLERANCES)
    golden = _golden(base)
    noisy = _copy(golden)
    for s in noisy["steps"]:
        s |= {k: f(s[k]) for k, f in MEASURED_NOISE.items()}
        s["revision"] = "f" * 64
    noisy["initial_revision"] = noisy["final_revision"] = "e" * 64
    assert differences(golden, noisy, compare_ids=False) == []
    reported = [line.split(":")[0] for line in differences(golden, noisy)]
    assert reported == ["initial_revision", "step 1 revision", "step 2 revision", "step 3 revision", "final_revision"]


def test_kernel_noise_measured_on_an_avx2_xeon_is_within_the_tolerances():
    """The figures an AVX2 Xeon (no AVX-512) gave for qwen3's step 3 where the golden file was made on an AVX-512
    EPYC: loss, kl and grad_norm moved by 4.5e-5, 4.5e-5 and 1e-7 relative; they hold."""
    golden = _golden("qwen3")
    step = golden["steps"][2]
    assert (f"{step['loss']:.7e}", f"{step['kl']:.5e}", f"{step['grad_norm']:.8f}") == (
        "8.2049518e-07",
        "8.18558e-05",
        "0.20115507",
    ), "qwen3's golden step 3 moved: the Xeon's figures below belong to the old file"
    xeon = _copy(golden)
    xeon["steps"][2] |= {"loss": 8.2053244e-07, "kl": 8.18595e-05, "grad_norm": 0.20115504}
    assert differences(golden, xeon, compare_ids=False) == []


def test_fingerprint_decides_whether_revision_ids_are_compared():
    """The same fingerprint: ids are compared and a changed one is reported. Another CPU (an AVX2 Xeon), another
    lock, another torch or another kernel environment: ids are not compared, the test says so naming what differs,
    and the figures are still held to their tolerances."""
    golden = _golden(BASES[0])
    here = fingerprint(PINNED_ENV)
    same = _copy(golden)
    same["made_with"]["fingerprint"] = here
    with warnings.catch_warnings():
        warnings.simplefilter("error", RevisionIdsNotCompared)
        assert _ids_comparable(same)
    xeon = cpu_fingerprint(
        "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 85\n"
        "model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz\nflags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 "
        "aes\n\nprocessor\t: 1\nvendor_id\t: GenuineIntel\n"
    )
    assert xeon["vendor_id"] == "GenuineIntel" and xeon["model name"].startswith("Intel(R) Xeon(R)")
    assert xeon["isa_flags"] == ["avx", "avx2", "f16c", "fma", "sse", "sse2", "sse4_1", "sse4_2", "ssse3"]
    for changed, what in [
        ({"cpu": xeon}, "cpu.vendor_id"),
        ({"requirements_lock_sha256": "0" * 64}, "requirements_lock_sha256"),
        ({"torch": "0.0.0"}, "torch"),
    ]:
        other = _copy(golden)
        other["made_with"]["fingerprint"] = here | changed
        with pytest.warns(RevisionIdsNotCompared, match=f"revision ids not compared.*{what}"):
            assert not _ids_comparable(other)
    with pytest.warns(RevisionIdsNotCompared, match="env: ATEN_CPU_CAPABILITY default -> avx2"):
        assert not _ids_comparable(same, OTHER_KERNELS["avx2"])

    moved = _copy(golden)
    moved["final_revision"] = "0" * 64
    moved["steps"][0]["grad_norm"] *= 1 + 1e-3
    assert [line.split(":")[0] for line in differences(golden, moved, compare_ids=True)] == [
        "step 1 grad_norm",
        "final_revision",
    ]
    assert [line.split(":")[0] for line in differences(golden, moved, compare_ids=False)] == ["step 1 grad_norm"]


def _check_run(base: str, got: dict, pinned) -> bool:
    """Hold a fresh run of tiny:<base>, made with the float-kernel environment `pinned`, to its golden file; whether
    its revision ids were compared."""
    problems = unpinned_workers(got, pinned)
    assert not problems, problems
    golden = _golden(base)
    compare_ids = _ids_comparable(golden, pinned)
    diffs = differences(golden, got, compare_ids=compare_ids)
    assert not diffs, (
        f"tiny:{base} moved from its golden figures (tests/golden/{base}.json) at {diffs[0]}; "
        f"{len(diffs)} figures differ:\n  " + "\n  ".join(diffs) + "\n"
        "If the change is meant to move the numbers, `make golden` rewrites the files; say why in the commit message."
    )
    return compare_ids


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason=f"the golden figures are x86-64's pinned kernels; this is {platform.machine()}")
@pytest.mark.parametrize("base", BASES)
def test_golden_run_matches_its_pinned_figures(base, tmp_path):
    """The golden run of tiny:<base>, as a `mint train` process, against tests/golden/<base>.json: every step's
    rewards, sampled tokens and counts exactly; its advantages, loss, KL, grad norm and logprob difference within
    their tolerances; its revision ids and the final revision (the sha256 of the adapter tensors, re-hashed from the
    run's catalog) bit for bit where this environment's fingerprint is the file's. Every Ray worker of the run ran
    with the pinned float kernels (its own environment, read from /proc while it ran)."""
    _check_run(base, run_golden(base, tmp_path), PINNED_ENV)


def _has_flag(flag: str) -> bool:
    return flag in cpu_fingerprint().get("isa_flags", [])


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason=f"the golden figures are x86-64's pinned kernels; this is {platform.machine()}")
@pytest.mark.parametrize("kernels", sorted(OTHER_KERNELS))
def test_golden_figures_hold_under_other_cpu_kernels(kernels, tmp_path):
    """The cheapest base's golden run with other float kernels, as another CPU would run it: ATen's AVX2 build
    (avx2), or this machine's own choice with MKL and oneDNN unpinned (native: AVX-512 where the CPU has it). Every
    Ray worker ran with that environment, not the pinned one; every figure holds within its tolerance; the revision
    ids are not compared (the fingerprint's env differs), and the test says so."""
    if kernels == "avx2" and not _has_flag("avx2"):
        pytest.skip("this CPU has no AVX2: ATen cannot run its AVX2 kernels here")
    pinned = OTHER_KERNELS[kernels]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", RevisionIdsNotCompared)
        compared = _check_run(CHEAPEST, run_golden(CHEAPEST, tmp_path, pinned=pinned), pinned)
    notes = [str(w.message) for w in said if issubclass(w.category, RevisionIdsNotCompared)]
    assert not compared and len(notes) == 1 and "env: ATEN_CPU_CAPABILITY default -> " in notes[0], notes
    warnings.warn(RevisionIdsNotCompared(notes[0]), stacklevel=1)  # and say it in pytest's summary
