"""Golden figures: a fixed-seed `mint train` on each tiny base (tests/golden/recipe.toml: local Ray, 2 learner ranks
on DeepSpeed over gloo, LongStraw exact, KL on) gives, bit for bit, the per-step figures and revision ids pinned in
tests/golden/<base>.json.

Every other end-to-end comparison computes its reference in the same session, so a change that moves both sides
passes them; this one compares with numbers written before the change. The runs pin their float kernels through the
environment (tests/golden/harness.py, PINNED_ENV), so the figures are the same on any x86 machine of this kind and
are compared exactly: a change as small as the advantage normalisation's eps from 1e-6 to 2e-6 moves the
advantages by 1e-6 / std (about 2e-6 relative, 25 to 34 fp32 ulps for 4 binary rewards), which no tolerance wide
enough for other kernels would see.

A change meant to move the numbers regenerates the files with `make golden` (docs/getting-started.md, Tests).
"""

from __future__ import annotations

import json
import math
import platform

import pytest
from golden.harness import (
    BASES,
    RECIPE,
    STEP_KEYS,
    differences,
    golden_file,
    run_golden,
    unpinned_workers,
)

from mint.config import load_config


def _golden(base: str) -> dict:
    return json.loads(golden_file(base).read_text())


@pytest.mark.parametrize("base", BASES)
def test_golden_file_holds_every_step_of_the_recipe(base):
    """Each base's golden file has one entry per recipe step with every figure set, and its final revision is the
    last step's: a file written by hand, or left behind when the recipe's step count changed, fails here."""
    golden = _golden(base)
    steps = load_config(RECIPE).grpo.steps
    assert golden["base"] == f"tiny:{base}"
    assert [s["step"] for s in golden["steps"]] == list(range(1, steps + 1))
    for s in golden["steps"]:
        unset = [k for k in STEP_KEYS if s.get(k) is None]
        assert not unset, f"step {s['step']} has no {unset}"
    revisions = [golden["initial_revision"]] + [s["revision"] for s in golden["steps"]]
    assert all(len(r) == 64 for r in revisions) and len(set(revisions)) == len(revisions), revisions
    assert golden["final_revision"] == golden["steps"][-1]["revision"]


def test_differences_name_the_first_differing_step_and_metric():
    """One ulp on step 2's grad_norm and another final revision: the report starts at step 2 grad_norm, then the
    revision; identical figures report nothing."""
    golden = _golden(BASES[0])
    assert differences(golden, json.loads(json.dumps(golden))) == []
    moved = json.loads(json.dumps(golden))
    g = moved["steps"][1]["grad_norm"]
    moved["steps"][1]["grad_norm"] = math.nextafter(g, math.inf)
    moved["final_revision"] = "0" * 64
    found = differences(golden, moved)
    assert found[0] == f"step 2 grad_norm: golden {g!r}, got {math.nextafter(g, math.inf)!r}", found
    assert found[1].startswith("final_revision: golden ") and len(found) == 2, found


@pytest.mark.slow
@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"),
    reason=f"the golden figures are x86-64's pinned kernels; this machine is {platform.machine()}",
)
@pytest.mark.parametrize("base", BASES)
def test_golden_run_matches_its_pinned_figures(base, tmp_path):
    """The golden run of tiny:<base>, as a `mint train` process, against tests/golden/<base>.json, exactly: every
    step's rewards, sampled tokens, advantages, kept tokens, loss, KL, grad norm and revision id, and the final
    revision (the sha256 of the adapter tensors, re-hashed from the run's catalog). Every Ray worker of the run ran
    with the pinned float kernels (its own environment, read from /proc while it ran)."""
    got = run_golden(base, tmp_path)
    problems = unpinned_workers(got)
    assert not problems, problems
    diffs = differences(_golden(base), got)
    assert not diffs, (
        f"tiny:{base} moved from its golden figures (tests/golden/{base}.json) at {diffs[0]}; "
        f"{len(diffs)} figures differ:\n  " + "\n  ".join(diffs) + "\n"
        "If the change is meant to move the numbers, `make golden` rewrites the files; say why in the commit message."
    )
