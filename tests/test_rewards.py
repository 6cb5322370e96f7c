"""mint.rl.rewards: the built-in rewards on hand cases, resolving specs, and `score` containing a misbehaving fn."""

from __future__ import annotations

import logging
import math
import pickle
import textwrap

import pytest

from mint.errors import RewardError
from mint.rl.data import load_dataset
from mint.rl.rewards import RewardResult, exact_match, math_reward, resolve_reward, score


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("4", "4", 1.0),
        ("  4\n", " 4 ", 1.0),
        ("4.0", "4", 0.0),
        ("The answer is 4", "4", 0.0),
        ("paris", "Paris", 0.0),
        ("", "", 1.0),
    ],
)
def test_exact_match(response, answer, expected):
    assert exact_match(response, answer) == expected


@pytest.mark.parametrize(
    "response, answer",
    [
        (r"So the total is \boxed{42}.", "42"),
        (r"First \boxed{7}, no wait: \boxed{42}", "42"),  # the last box wins
        (r"\boxed{\frac{3}{4}}", "0.75"),
        (r"\boxed{{1,234}}", "1234"),  # nested braces
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
        ("#### $1,234.", "1234"),
        ("#### 18 dollars", "18"),
        ("She has 3 apples, then 5, so 8", "8"),  # the last number
        ("It costs 1,234,567 in total.", "1234567"),
        ("The share is 3/4", "0.75"),
        ("The share is 3 / 4", "3/4"),
        ("The result is -5.", "-5"),
        ("The result is \u22125", "-5"),
        ("It costs 2.50", "2.5"),
        ("It is 50%", "50"),
        ("10-3 = 7", "7"),
        ("about 0.3333333", "1/3"),  # within rel tol 1e-6
        ("Paris", "Paris"),  # non-numeric reference: string equality
        (r"\boxed{x + 1}", "x+1"),
        ("Work...\n#### 72", "Long GSM8K solution.\n#### 72"),  # the reference's own #### part
        ("72", r"Solution text \boxed{72}"),
    ],
)
def test_math_reward_right(response, answer):
    assert math_reward(response, answer) == 1.0


@pytest.mark.parametrize(
    "response, answer",
    [
        (r"\boxed{41}", "42"),
        ("#### 71", "72"),
        ("The answer is 42, I checked 43", "42"),  # last number, not any number
        (r"\boxed{7} but really 42", "42"),  # a box beats a later loose number
        ("It is 50%", "0.5"),  # percent is not converted
        ("5", "-5"),
        ("0.333", "1/3"),  # outside rel tol 1e-6
        ("no numbers here", "3"),
        ("", "3"),
        ("The answer is Paris", "Paris"),
        ("3/0", "3"),
    ],
)
def test_math_reward_wrong(response, answer):
    assert math_reward(response, answer) == 0.0


# --- resolve_reward --------------------------------------------------------------------------------------------------


def test_resolve_builtins():
    assert resolve_reward("exact_match") is exact_match
    assert resolve_reward("math") is math_reward


def test_resolve_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def half(response, answer):
                return 0.5

            class Scorer:
                @staticmethod
                def length(response, answer):
                    return len(response) / 10

            NOT_CALLABLE = 3

            def one_arg(response):
                return 1.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward("my_rewards:half")("a", "b") == 0.5
    assert resolve_reward("my_rewards:Scorer.length")("abc", "") == pytest.approx(0.3)
    with pytest.raises(RewardError, match=r"'my_rewards:NOT_CALLABLE' is a int, not a callable"):
        resolve_reward("my_rewards:NOT_CALLABLE")
    with pytest.raises(RewardError, match=r"'my_rewards:one_arg' cannot be called as fn\(response, answer\)"):
        resolve_reward("my_rewards:one_arg")
    with pytest.raises(RewardError, match=r"'my_rewards:missing'.*no attribute 'missing'"):
        resolve_reward("my_rewards:missing")


def test_resolve_stdlib_function_of_the_right_shape():
    fn = resolve_reward("operator:eq")
    assert score(fn, ["a", "b"], ["a", "c"]) == RewardResult([1.0, 0.0], errors=0, clipped=0)


def test_resolve_unknown_names():
    with pytest.raises(
        RewardError,
        match=r"unknown reward 'exact_mach' \(did you mean 'exact_match'\?\); built-ins: "
        r"exact_match, math",
    ):
        resolve_reward("exact_mach")
    with pytest.raises(RewardError, match=r"'no_such_module_xyz:fn': cannot import 'no_such_module_xyz'"):
        resolve_reward("no_such_module_xyz:fn")


def test_resolve_module_that_fails_on_import(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"cannot import 'broken_rewards': RuntimeError: boom second line") as info:
        resolve_reward("broken_rewards:fn")
    assert "\n" not in str(info.value)
    assert pickle.loads(pickle.dumps(info.value)).args == info.value.args


# --- score -----------------------------------------------------------------------------------------------------------


def test_score_contains_failures(caplog):
    def flaky(response, answer):
        if response == "raise":
            raise ZeroDivisionError("bad sample")
        return {"nan": math.nan, "inf": math.inf, "str": "1.0", "none": None}.get(response, 1.0)

    responses = ["ok", "raise", "nan", "inf", "str", "none", "ok"]
    with caplog.at_level(logging.WARNING, logger="mint.rl.rewards"):
        result = score(flaky, responses, ["x"] * len(responses))
    assert result == RewardResult(
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0], errors=5, clipped=0, first_error="ZeroDivisionError: bad sample"
    )
    (record,) = caplog.records  # one line per batch, not one per failure
    assert "ZeroDivisionError: bad sample" in record.getMessage() and "5 of 7" in record.getMessage()


def test_score_clips_out_of_range():
    values = {"a": -0.5, "b": 1.5, "c": 0.25, "d": True}
    result = score(lambda r, a: values[r], list(values), [""] * 4)
    assert result == RewardResult([0.0, 1.0, 0.25, 1.0], errors=0, clipped=2)


def test_score_length_mismatch():
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        score(exact_match, ["a", "b"], ["a"])


def test_reward_result_pickles():
    result = score(exact_match, ["1", "2"], ["1", "3"])
    assert pickle.loads(pickle.dumps(result)) == result == RewardResult([1.0, 0.0])


# --- the synthetic task is not guessable -----------------------------------------------------------------------------


def test_constant_answer_on_synthetic_task_scores_chance():
    # The answer must depend on the prompt: any constant guess should score 1/10 (sd 0.007 over 2000 samples).
    examples = load_dataset("synthetic:first_last").take(2000, seed=1234)
    answers = [e.answer for e in examples]
    for guess in "0123456789":
        rewards = score(exact_match, [guess] * len(answers), answers).rewards
        assert sum(rewards) / len(rewards) == pytest.approx(0.1, abs=0.03), guess
