"""mint.rl.rewards and mint.rl.reward_set: the built-in rewards on hand cases and on a table of real answer forms,
resolving specs, and RewardSet (weights, extra fields, batched, async, a misbehaving fn contained)."""

from __future__ import annotations

import asyncio
import logging
import pickle
import textwrap
import uuid

import pytest

from mint.errors import RewardError
from mint.rl.data import load_dataset
from mint.rl.reward_set import RewardSet, RewardSetResult, parse_reward_spec
from mint.rl.rewards import exact_match, math_reward, math_verify_reward, resolve_reward
from mint.rl.tasks import Example


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
    assert resolve_reward("math") is resolve_reward("math_verify") is math_verify_reward
    assert resolve_reward("math_rules") is math_reward


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

            def with_field(response, answer, level):
                return 1.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward("my_rewards:half")("a", "b") == 0.5
    assert resolve_reward("my_rewards:Scorer.length")("abc", "") == pytest.approx(0.3)
    with pytest.raises(RewardError, match=r"'my_rewards:NOT_CALLABLE' is a int, not a callable"):
        resolve_reward("my_rewards:NOT_CALLABLE")
    with pytest.raises(
        RewardError, match=r"'my_rewards:one_arg' cannot be called as fn\(response, answer, \*\*fields\)"
    ):
        resolve_reward("my_rewards:one_arg")
    assert resolve_reward("my_rewards:with_field")  # `level` may come from the example's extra fields
    with pytest.raises(RewardError, match=r"'my_rewards:missing'.*no attribute 'missing'"):
        resolve_reward("my_rewards:missing")


def test_resolve_stdlib_function_of_the_right_shape():
    result = RewardSet("operator:eq").score(["a", "b"], [ex("a"), ex("c")])
    assert result.rewards == {"operator:eq": [1.0, 0.0]} and result.first_error == ""


def test_resolve_unknown_names():
    with pytest.raises(
        RewardError,
        match=r"unknown reward 'exact_mach' \(did you mean 'exact_match'\?\); built-ins: "
        r"exact_match, math, math_rules, math_verify",
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


# --- the synthetic task is not guessable -----------------------------------------------------------------------------


def test_constant_answer_on_synthetic_task_scores_chance():
    # The answer must depend on the prompt: any constant guess should score 1/10 (sd 0.007 over 2000 samples).
    examples = load_dataset("synthetic:first_last").take(2000, seed=1234)
    rewards = RewardSet("exact_match")
    for guess in "0123456789":
        total = rewards.score([guess] * len(examples), examples).total
        assert sum(total) / len(total) == pytest.approx(0.1, abs=0.03), guess


# --- math_verify against the hand-written rules on real answer forms --------------------------------------------------

# (response, reference, right answer?, math_verify agrees, math_rules agrees). The forms come from model outputs on
# GSM8K/MATH: radicals, pi, polynomials in another form, multiple choice, GSM8K "####", the last number in the text.
MATH_FORMS = [
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1, True, False),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1, True, False),
    ("so it is √8", r"2\sqrt{2}", 1, False, False),  # Unicode radical in plain text: neither reads it
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", 1, True, False),
    ("the angle is π/2", r"\frac{\pi}{2}", 1, False, False),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1, True, False),
    (r"\boxed{(x+1)^2}", "x^2 + 2x + 1", 1, True, False),
    (r"\boxed{\text{(B)}}", r"\text{(B)}", 1, True, True),
    (r"\boxed{B}", r"\text{(B)}", 1, True, False),
    ("The answer is (B).", r"\text{(B)}", 1, False, False),
    ("She has 3 apples, then 5, so 8", "8", 1, True, True),  # the last number in the text
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1, True, True),
    ("Work...\n#### 72", "Long GSM8K solution.\n#### 72", 1, True, True),
    (r"\boxed{\frac{3}{4}}", "0.75", 1, True, True),
    (r"\boxed{\dfrac{1}{3}}", "1/3", 1, True, True),
    (r"\boxed{{1,234}}", "1234", 1, False, True),  # math_verify reads the set {1, 234}
    ("#### $1,234.", "1234", 1, True, True),
    ("It costs 1,234,567 in total.", "1234567", 1, True, True),
    ("The share is 3/4", "0.75", 1, True, True),
    ("The result is \u22125.", "-5", 1, True, True),
    ("It is 50%", "50", 1, True, True),
    (r"\boxed{x + 1}", "x+1", 1, True, True),
    (r"\boxed{(1, 2)}", "(1,2)", 1, True, True),
    (r"\boxed{10^\circ}", "10", 1, True, True),
    (r"\boxed{x = 3}", "3", 1, True, True),
    ("Paris", "Paris", 1, True, True),  # math_verify reads nothing: the rules decide (string equality)
    ("The answer is 42, I checked 43", "42", 1, True, False),  # the stated answer, not the last number
    (r"\boxed{41}", "42", 0, True, True),
    (r"\boxed{7} but really 42", "42", 0, True, True),  # a box beats a later loose number
    (r"\boxed{\sqrt{8}}", "3", 0, True, True),
    ("no numbers here", "3", 0, True, True),
    ("", "3", 0, True, True),
]


@pytest.mark.parametrize("response, answer, right, verify_agrees, rules_agree", MATH_FORMS)
def test_math_forms(response, answer, right, verify_agrees, rules_agree):
    assert (math_verify_reward(response, answer) == right) == verify_agrees
    assert (math_reward(response, answer) == right) == rules_agree


def test_math_verify_reads_more_forms_than_the_rules():
    # Why `math` names math_verify: 28 of 32 forms against 22; the rules stay as its fallback and as `math_rules`.
    assert len(MATH_FORMS) >= 19
    assert sum(row[3] for row in MATH_FORMS) == 28 and sum(row[4] for row in MATH_FORMS) == 22


# --- RewardSet -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("exact_match", [("exact_match", 1.0)]),
        ("math_verify:1.0,format:0.2", [("math_verify", 1.0), ("format", 0.2)]),
        (" a : 2 , b ", [("a", 2.0), ("b", 1.0)]),
        ("pkg.mod:fn", [("pkg.mod:fn", 1.0)]),  # the part after ":" is a function, not a weight
        ("pkg.mod:fn:0.5,pkg.mod:Cls.g:-1", [("pkg.mod:fn", 0.5), ("pkg.mod:Cls.g", -1.0)]),
        (["math:1", "exact_match:0"], [("math", 1.0), ("exact_match", 0.0)]),
    ],
)
def test_parse_reward_spec(spec, expected):
    assert parse_reward_spec(spec) == expected


@pytest.mark.parametrize(
    "spec, pattern",
    [
        ("", "empty entry"),
        ("a,,b", "empty entry"),
        ("a:1,a:2", "'a' appears twice"),
        # A NaN or infinite weight: after a built-in, after module:fn, or a number written with digits that overflows.
        ("exact_match:nan", "bad entry 'exact_match:nan'"),
        ("pkg.mod:fn:nan", "bad entry 'pkg.mod:fn:nan'"),
        ("a:1e999", "bad entry 'a:1e999'"),
    ],
)
def test_parse_reward_spec_errors(spec, pattern):
    with pytest.raises(RewardError, match=pattern):
        parse_reward_spec(spec)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("float_words:nan", [("float_words:nan", 1.0)]),
        ("float_words:inf", [("float_words:inf", 1.0)]),
        ("float_words:Infinity", [("float_words:Infinity", 1.0)]),
        ("float_words:nan:0.5,float_words:inf:2", [("float_words:nan", 0.5), ("float_words:inf", 2.0)]),
        ("a:nan", [("a:nan", 1.0)]),  # function nan of module a, not reward a with a NaN weight
    ],
)
def test_reward_function_named_nan_or_inf_is_a_function_not_a_weight(spec, expected):
    """`module:nan` read the function name `nan` (or `inf`, `Infinity`) as a weight, float("nan"), and refused the
    entry as a bad weight: such a function could not be named at all. A weight is written with digits."""
    assert parse_reward_spec(spec) == expected


def test_reward_functions_named_nan_and_inf_score(tmp_path, monkeypatch):
    """The functions `nan` and `inf` of a module are resolved and called, weighted or not."""
    (tmp_path / "float_words.py").write_text(
        "def nan(response, answer):\n    return 1.0\n\n\ndef inf(response, answer):\n    return 0.25\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = RewardSet("float_words:nan,float_words:inf:2")
    assert rewards.weights == {"float_words:nan": 1.0, "float_words:inf": 2.0}
    assert rewards.score(["x"], [ex("y")]).total == [1.5]


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(
        textwrap.dedent(
            """
            import asyncio

            def fmt(response, answer):
                return float(response.startswith("A:"))

            def by_level(response, answer, level, unit="m"):
                return level / 10 if unit == "m" else 0.0

            def sees_all(response, answer, **fields):
                return float(fields == {"level": 3, "unit": "m"})

            def batched_len(responses, answers, level):
                return [len(r) / 10 + lv * 0 for r, lv in zip(responses, level)]
            batched_len.batched = True

            def batched_wrong(responses, answers):
                return [1.0]
            batched_wrong.batched = True

            _gates = {}

            async def slow(response, answer):
                # "never" runs until the timeout cuts it. "<tag>/<n>" returns once n calls of that tag are running
                # at once: called one after another, the first would wait for the others until its timeout.
                if response == "never":
                    await asyncio.Event().wait()
                tag, n = response.split("/")
                gate = _gates.setdefault(tag, [0, asyncio.Event()])
                gate[0] += 1
                if gate[0] >= int(n):
                    gate[1].set()
                await gate[1].wait()
                return 1.0

            async def async_batched(responses, answers):
                await asyncio.sleep(0.01)
                return [float(r == a) for r, a in zip(responses, answers)]
            async_batched.batched = True

            def flaky(response, answer):
                if response == "raise":
                    raise KeyError("bad")
                return 2.0

            def misbehaves(response, answer):
                if response == "raise":
                    raise ZeroDivisionError("bad sample")
                return {"nan": float("nan"), "inf": float("inf"), "str": "1.0", "none": None}.get(response, 1.0)

            def out_of_range(response, answer):
                return {"a": -0.5, "b": 1.5, "c": 0.25, "d": True}[response]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def ex(answer: str, **extra) -> Example:
    return Example("q", answer, extra=extra)


def test_weighted_sum_logged_per_function(user_rewards):
    rewards = RewardSet("exact_match:1.0,user_rewards:fmt:0.2")
    result = rewards.score(["A:4", "4", "B"], [ex("A:4"), ex("4"), ex("4")])
    assert result.rewards == {"exact_match": [1.0, 1.0, 0.0], "user_rewards:fmt": [1.0, 0.0, 0.0]}
    assert result.total == pytest.approx([1.2, 1.0, 0.0])
    assert result.errors == {"exact_match": 0, "user_rewards:fmt": 0} and result.first_error == ""
    assert rewards.weights == {"exact_match": 1.0, "user_rewards:fmt": 0.2}


def test_extra_fields_reach_the_functions_that_take_them(user_rewards):
    rewards = RewardSet(["user_rewards:by_level", "user_rewards:sees_all", "exact_match"])
    result = rewards.score(["x", "x"], [ex("x", level=3, unit="m"), ex("x", level=5, unit="ft")])
    assert result.rewards["user_rewards:by_level"] == [0.3, 0.0]
    assert result.rewards["user_rewards:sees_all"] == [1.0, 0.0]
    assert result.rewards["exact_match"] == [1.0, 1.0]  # takes no fields: none passed
    missing = rewards.score(["x"], [ex("x")])  # `level` is required but the example has none
    assert missing.errors["user_rewards:by_level"] == 1
    assert missing.first_error.startswith("user_rewards:by_level: TypeError")


def test_dataset_fields_reach_the_reward(user_rewards, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "p", "answer": "x", "level": 7, "unit": "m"}\n')
    (example,) = load_dataset(str(path)).examples
    assert RewardSet("user_rewards:by_level").score(["x"], [example]).total == [pytest.approx(0.7)]


def test_batched_functions_get_lists(user_rewards):
    rewards = RewardSet("user_rewards:batched_len,user_rewards:batched_wrong")
    result = rewards.score(["ab", "abcd"], [ex("", level=1), ex("", level=2)])
    assert result.rewards["user_rewards:batched_len"] == [0.2, 0.4]
    # A batched call returning the wrong number of values fails the whole batch for that function.
    assert result.errors["user_rewards:batched_wrong"] == 2
    assert "returned 1 values, not a list of 2" in result.first_error
    assert result.failed_samples == 2


def test_async_functions_run_concurrently_with_a_timeout(user_rewards, caplog):
    # The three "<tag>/3" calls return only if all three run at once (in a row, each would wait out its timeout);
    # "never" returns only by the timeout. 2 s is long enough for three tasks of one event loop to start on a loaded
    # machine; nothing here asserts on elapsed time.
    rewards = RewardSet("user_rewards:slow,user_rewards:async_batched", timeout_s=2)
    together = f"{uuid.uuid4().hex}/3"  # a fresh gate: the module stays imported between tests
    with caplog.at_level(logging.WARNING, logger="mint.rl.reward_set"):
        result = rewards.score(
            [together, together, together, "never"], [ex(together), ex("x"), ex(together), ex("never")]
        )
    assert result.rewards["user_rewards:slow"] == [1.0, 1.0, 1.0, 0.0]
    assert result.timeouts == {"user_rewards:slow": 1, "user_rewards:async_batched": 0}
    assert result.errors["user_rewards:slow"] == 1
    assert result.first_error == "user_rewards:slow: TimeoutError: no result within 2s"
    assert result.rewards["user_rewards:async_batched"] == [1.0, 0.0, 1.0, 1.0]
    (record,) = caplog.records
    assert "user_rewards:slow failed on 1 of 4" in record.getMessage()


def test_async_functions_from_inside_an_event_loop(user_rewards):
    async def caller():  # an async Ray actor, or a notebook
        return RewardSet("user_rewards:async_batched").score(["a"], [ex("a")])

    assert asyncio.run(caller()).total == [1.0]


def test_failures_clipping_and_parts(user_rewards):
    rewards = RewardSet("user_rewards:flaky:0.5,exact_match")
    result = rewards.score(["raise", "ok", "ok"], [ex("ok"), ex("ok"), ex("no")])
    assert result.rewards["user_rewards:flaky"] == [0.0, 1.0, 1.0]  # 2.0 clipped to 1.0
    assert result.clipped["user_rewards:flaky"] == [False, True, True]
    assert result.total == [0.0, 1.5, 0.5]
    assert result.first_error == "user_rewards:flaky: KeyError: 'bad'"
    tail = result.part(1, 3)
    assert tail.total == [1.5, 0.5] and tail.errors == {"user_rewards:flaky": 0, "exact_match": 0}
    assert pickle.loads(pickle.dumps(result)) == result
    assert isinstance(result, RewardSetResult)
    with pytest.raises(ValueError, match="2 responses but 1 examples"):
        rewards.score(["a", "b"], [ex("a")])


def test_a_misbehaving_function_scores_zero_there_and_logs_one_line_per_batch(user_rewards, caplog):
    """A sample on which the function raises, or returns NaN, inf, a string or None, scores 0.0 and names its
    failure; the batch goes on, and the log gets one warning line for the batch, not one per failed sample."""
    responses = ["ok", "raise", "nan", "inf", "str", "none", "ok"]
    with caplog.at_level(logging.WARNING, logger="mint.rl.reward_set"):
        result = RewardSet("user_rewards:misbehaves").score(responses, [ex("x")] * len(responses))
    assert result.rewards == {"user_rewards:misbehaves": [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]}
    assert result.failures["user_rewards:misbehaves"] == [
        "",
        "ZeroDivisionError: bad sample",
        "ValueError: returned nan",
        "ValueError: returned inf",
        "TypeError: returned str, not a number",
        "TypeError: returned NoneType, not a number",
        "",
    ]
    assert result.first_error == "user_rewards:misbehaves: ZeroDivisionError: bad sample"
    (record,) = caplog.records
    assert "ZeroDivisionError: bad sample" in record.getMessage() and "5 of 7" in record.getMessage()


def test_values_outside_zero_one_are_clipped_and_a_bool_is_a_number(user_rewards):
    result = RewardSet("user_rewards:out_of_range").score(["a", "b", "c", "d"], [ex("")] * 4)
    assert result.rewards == {"user_rewards:out_of_range": [0.0, 1.0, 0.25, 1.0]}
    assert result.clipped == {"user_rewards:out_of_range": [True, True, False, False]}
    assert result.errors == {"user_rewards:out_of_range": 0}


def test_check_raises_on_the_first_example(user_rewards):
    RewardSet("exact_match,math").check(ex("42"))
    with pytest.raises(RewardError, match=r"reward user_rewards:by_level: TypeError.*first example"):
        RewardSet("user_rewards:by_level").check(ex("42"))
    with pytest.raises(RewardError, match="timeout must be > 0"):
        RewardSet("exact_match", timeout_s=0)
    with pytest.raises(RewardError, match="unknown reward 'mat'"):
        RewardSet("exact_match,mat:0.5")
