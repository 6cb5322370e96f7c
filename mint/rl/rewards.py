"""Reward functions: `fn(response: str, answer: str) -> float` in [0, 1], resolved by name.

`resolve_reward` turns one reward name into a function: a built-in (`exact_match`, `math_verify`, `math`,
`math_rules`) or `pkg.module:fn`, imported with importlib. Scoring a batch safely (a sample whose function raises or
returns a non-number, NaN or inf scores 0.0; a value outside [0, 1] is clipped), with several weighted functions,
extra record fields, batched and async functions, is `mint.rl.reward_set.RewardSet`.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import re
import threading
from collections.abc import Callable
from fractions import Fraction

from mint.errors import RewardError

RewardFn = Callable[[str, str], float]

REL_TOL = 1e-6


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response equals the answer once surrounding whitespace is stripped, else 0.0."""
    return float(response.strip() == answer.strip())


# A number as written in text: optional sign, digits with optional thousands commas ("1,234"), then optional decimals
# or a "/denominator" (simple fractions: integer over integer). The sign must not follow a word character or ")", so
# the "-" of "10-3" is subtraction, not a negative 3.
_NUMBER = r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+|\s*/\s*\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_FULL_NUMBER_RE = re.compile(rf"\s*({_NUMBER})\s*")
_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_BOXED = "\\boxed{"


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference answer, numerically where both are numbers.

    The final answer is the content of the last `\\boxed{...}`, else what follows the last `####` (GSM8K), else the
    last number in the text. The reference may itself be a GSM8K or MATH solution: its `####` or `\\boxed{}` part is
    used. Numbers may carry thousands commas, decimals, a sign, or be a simple fraction (3/4, \\frac{3}{4}); they are
    equal when |a - b| <= 1e-6 * max(|a|, |b|). A percent sign is dropped, not converted: "50%" is 50, not 0.5.
    A non-numeric reference is compared as a string, ignoring whitespace, "$" and a trailing period.
    """
    reference = _marked_answer(answer)
    reference = answer if reference is None else reference
    target = _to_number(reference)
    candidate = _marked_answer(response)
    if target is None:
        return float(_normalize(response if candidate is None else candidate) == _normalize(reference))
    if candidate is None:
        numbers_in_text = _NUMBER_RE.findall(response.replace("\u2212", "-"))
        candidate = numbers_in_text[-1] if numbers_in_text else ""
    value = _to_number(candidate)
    if value is None:
        # "#### 18 dollars": take the first number of the marked answer.
        first = _NUMBER_RE.search(candidate)
        value = _to_number(first.group()) if first else None
    return float(value is not None and abs(value - target) <= REL_TOL * max(abs(value), abs(target)))


def _marked_answer(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), else the rest of the line after the last ####."""
    start = text.rfind(_BOXED)
    if start >= 0:
        depth, i = 1, start + len(_BOXED)
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j]
    marker = text.rfind("####")
    if marker >= 0:
        return text[marker + 4 :].split("\n", 1)[0]
    return None


def _normalize(text: str) -> str:
    return "".join(text.split()).replace("\\$", "").replace("$", "").rstrip(".")


def _to_number(text: str) -> Fraction | None:
    """The exact value of `text` if all of it is one number (see math_reward), else None."""
    text = _normalize(text).replace("\u2212", "-").replace("\\%", "").rstrip("%")
    text = _LATEX_FRAC_RE.sub(r"\1/\2", text)
    match = _FULL_NUMBER_RE.fullmatch(text)
    if match is None:
        return None
    try:
        return Fraction(match.group(1).replace(",", "").replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 when the `math-verify` package finds the response's answer equal to the reference, else 0.0.

    The reference is reduced to its `####` or `\\boxed{}` part (as in math_reward) and parsed as LaTeX between "$",
    so `\\sqrt{8}`, `\\pi/2` or `(x+1)^2` are read as expressions; math-verify extracts the response's answer
    (boxed first, then "the answer is", then the last expression) and compares symbolically: 2\\sqrt{2} equals
    \\sqrt{8}, x^2+2x+1 equals (x+1)^2, \\text{(B)} equals B. Where math-verify reads no answer in the response
    (plain text with a Unicode minus, a word), the hand-written `math_reward` decides instead.
    """
    from math_verify import parse, verify  # imported here: it pulls in sympy (about a second)

    # math-verify bounds parse and verify with signal.alarm, which only the main thread may set; elsewhere it runs
    # unbounded (a Ray actor calls from its main thread).
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    reference = _marked_answer(answer)
    reference = answer if reference is None else reference
    gold = parse(f"${reference}$", parsing_timeout=limit) or parse(reference, parsing_timeout=limit)
    found = parse(response.replace("\u2212", "-"), parsing_timeout=limit)
    if not gold or not found:
        return math_reward(response, answer)
    return float(verify(gold, found, timeout_seconds=limit))


BUILTINS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math_verify": math_verify_reward,
    # `math` is math_verify: it reads 28 of the 32 answer forms in tests/test_rewards.py (MATH_FORMS), math_rules 22.
    "math": math_verify_reward,
    "math_rules": math_reward,
}


def resolve_reward(spec: str) -> RewardFn:
    """The reward function named by `spec`: a built-in name, or `pkg.module:fn` (fn may be dotted, `Class.method`)."""
    if ":" not in spec:
        if spec in BUILTINS:
            return BUILTINS[spec]
        close = difflib.get_close_matches(spec, BUILTINS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RewardError(
            f"unknown reward {spec!r}{hint}; built-ins: {', '.join(sorted(BUILTINS))}, or give pkg.module:fn"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail in any way while importing
        raise RewardError(f"reward {spec!r}: cannot import {module_name!r}: {_one_line(e)}") from None
    try:
        fn = functools.reduce(getattr, attr.split("."), module)
    except AttributeError:
        raise RewardError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(fn):
        raise RewardError(f"reward {spec!r} is a {type(fn).__name__}, not a callable fn(response, answer, **fields)")
    try:
        # Partial: parameters after the first two may be filled by the example's extra fields (mint.rl.reward_set).
        inspect.signature(fn).bind_partial("", "")
    except TypeError:
        raise RewardError(f"reward {spec!r} cannot be called as fn(response, answer, **fields)") from None
    except ValueError:  # some C callables have no signature: nothing to check
        pass
    return fn


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())
