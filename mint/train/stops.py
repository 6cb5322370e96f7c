"""The rules that end a run that has stopped learning, each with one line that names what broke and its fix.

    bad steps       checkpoint.max_bad_steps skipped steps in a row (a non-finite loss or gradient): the line says
                    which of the two was not finite (`bad_steps_message`)
    kept fraction   grpo.min_kept_patience steps in a row whose trust mask kept less than grpo.min_kept_fraction of
                    the response tokens (`check_kept`): the line names the cause that dropped the most tokens

The second exists because a step whose every token is masked is not an error anywhere else: its gradient is zero,
the optimizer steps, a revision is published, and a run on an engine started without routed experts (R3 on, every
token `route_missing`) went to its last step and exited 0 having learned nothing. Pure: the driver calls both
after logging each step's metrics.
"""

from __future__ import annotations

from pathlib import Path

from longstraw.trust import CAUSES
from mint.config import Config
from mint.errors import MintError
from mint.train.checkpoint import RunState

# cause (longstraw.trust.CAUSES) -> what it means and the fix, for the kept-fraction line.
KEPT_FIXES = {
    "route_missing": "the engines return no expert routes: start them with --enable-return-routed-experts (the "
    "{routed_experts} placeholder of engines.command), or set grpo.r3=false",
    "route_mismatch": "the engines' routes do not fit the learner's base (another layer count, top-k or expert count; "
    "masked_route_* say which): serve model.path there, or set grpo.r3=false",
    "non_finite": "the rollout's (or the learner's) log-probs are NaN or inf: check the engines' dtype and their "
    "logprobs mode (vLLM: --logprobs-mode processed_logprobs)",
    "icepop": "the rollout's and the learner's probabilities disagree beyond [grpo.icepop_alpha, grpo.icepop_beta]: "
    "check that the engines sample the step's revision in model.dtype with the learner's logprobs (vLLM: "
    "--logprobs-mode processed_logprobs), or lower rollout.max_staleness",
}
assert KEPT_FIXES.keys() == CAUSES.keys()


def bad_steps_message(config: Config, bad_steps: int, cause: str | None, latest: Path | None) -> str:
    """The line that ends a run after checkpoint.max_bad_steps skipped steps in a row, naming what was not finite in
    the last one (`cause`, from the learner: "loss" or "gradient"). Rollout log-probs are not a cause: the trust mask
    drops a non-finite one (non_finite) before it reaches the loss."""
    where = (
        f"(skipped, never published; checkpoint.max_bad_steps = {config.checkpoint.max_bad_steps}); the last good "
        f"checkpoint is {latest or 'none'}"
    )
    if cause == "loss":
        return (
            f"{bad_steps} consecutive steps had a non-finite loss {where}; the learner's own forward overflowed "
            "(its log-probs, or the reference's in the KL term; rollout log-probs are masked as non_finite): check "
            f"the base's weights and model.dtype = {config.model.dtype}"
        )
    return (
        f"{bad_steps} consecutive steps had a non-finite gradient with a finite loss {where}; the backward "
        "overflowed: lower learner.lr or check the rewards"
    )


def check_kept(config: Config, state: RunState, step: int, sums: dict) -> None:
    """Count step `step` toward grpo.min_kept_patience when its trust mask kept less than grpo.min_kept_fraction of
    the response tokens (sums: the learner group's, with `trust_kept_frac` and `trust_dropped_<cause>`), reset the
    count when it kept enough, and raise MintError (one line naming the cause that dropped the most tokens) when the
    count reaches the patience. A step that learned nothing at all (no group kept: no trust counts) neither counts
    nor resets."""
    g = config.grpo
    if "trust_kept_frac" not in sums or not sums.get("tokens"):
        return
    kept = sums["trust_kept_frac"]
    if kept >= g.min_kept_fraction:
        state.low_kept_steps = 0
        return
    state.low_kept_steps += 1
    if state.low_kept_steps < g.min_kept_patience:
        return
    dropped = {cause: sums.get(f"trust_dropped_{cause}", 0.0) for cause in CAUSES}
    cause = max(dropped, key=dropped.__getitem__)
    raise MintError(
        f"{state.low_kept_steps} consecutive steps kept less than grpo.min_kept_fraction = {g.min_kept_fraction} of "
        f"their response tokens (grpo.min_kept_patience = {g.min_kept_patience}), so the run is learning next to "
        f"nothing: step {step} kept {kept:.1%} and dropped {dropped[cause]:.1%} as {cause}; {KEPT_FIXES[cause]}"
    )
