"""--resume's refusal names the keys a resumed run may change, and those are exactly the ones result_digest leaves out.

The refusal used to carry its own hand-written list, which drifted from RESULT_NEUTRAL both ways: it left out eval.*,
ray.colocate and the engine keys that a resume may change, and it named no key that result_digest counts. It is now
built from RESULT_NEUTRAL.
"""

from __future__ import annotations

import re

import pytest

from mint.config import RESULT_NEUTRAL, build_config
from mint.errors import ConfigError
from mint.train import checkpoint
from mint.train.checkpoint import RunState


def _refusal(tmp_path) -> str:
    """The one line read() gives for a checkpoint written under another result digest."""
    partial = checkpoint.begin(tmp_path, 2)
    written = checkpoint.commit(partial, RunState(step=2, revision="r" * 64), "digest-at-write", keep_last=2)
    with pytest.raises(ConfigError) as refused:
        checkpoint.read(written, "digest-now")
    return str(refused.value)


def _named_keys(message: str) -> list[str]:
    """The keys the message says may change: the list after "only these may change:", up to its caveats."""
    listed = re.search(r"only these may change: (.*?); but not", message)
    assert listed, message
    return listed.group(1).split(", ")


def test_resume_refusal_names_exactly_the_result_neutral_keys(tmp_path):
    """A recipe refused on --resume: the keys the line says may change are RESULT_NEUTRAL's, in both directions (the
    old hand-written list lacked eval.*, ray.colocate and the rollout.engine* keys, and named ray.address/placement
    in a form no key has)."""
    message = _refusal(tmp_path)
    assert "\n" not in message and message.startswith("--resume: the recipe differs")
    assert _named_keys(message) == list(RESULT_NEUTRAL)


def test_resume_refusal_caveats_are_the_keys_result_digest_counts_after_all():
    """The caveats the refusal states hold: under a cosine schedule grpo.steps changes the result digest, and with
    rollout.max_staleness >= 1 so does checkpoint.every; without them both are free to change."""
    message = checkpoint.changeable_keys()
    assert "not grpo.steps under a cosine learner.lr_schedule" in message
    assert "nor checkpoint.every with rollout.max_staleness >= 1" in message

    def digest(*overrides: str) -> str:
        return build_config({}, list(overrides)).result_digest()

    assert digest("grpo.steps=10") == digest("grpo.steps=20")
    cosine = "learner.lr_schedule=cosine"
    assert digest(cosine, "grpo.steps=10") != digest(cosine, "grpo.steps=20")
    assert digest("checkpoint.every=2") == digest("checkpoint.every=3")
    overlapped = "rollout.max_staleness=1"
    assert digest(overlapped, "checkpoint.every=2") != digest(overlapped, "checkpoint.every=3")


def test_every_result_neutral_key_names_a_real_key_or_section():
    """A RESULT_NEUTRAL entry that names no key would be listed in the refusal and ignored by result_digest."""
    config = build_config({}, []).to_dict()
    for key in RESULT_NEUTRAL:
        section, _, name = key.partition(".")
        assert section in config and (name == "*" or name in config[section]), key
