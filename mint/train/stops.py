"""The rules that end a run that has stopped learning, each with one line that names what broke and its fix.

    bad steps       checkpoint.max_bad_steps skipped steps in a row (a non-finite loss or gradient): the line says
                    which of the two was not finite (`bad_steps_message`)

Pure: the driver calls it after logging each step's metrics.
"""

from __future__ import annotations

from pathlib import Path

from mint.config import Config


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
