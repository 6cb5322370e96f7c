"""Several reward functions with weights, scored per function and summed: reward = sum_f w_f * clip(r_f, 0, 1).

A recipe's `data.reward` names them: "math_verify:1.0,format:0.2", or a list ["math_verify:1.0", "my.mod:fmt:0.2"].
A name's weight is what follows its last ":" when that part is a number written with digits (default 1.0), so
`pkg.module:fn` and `pkg.module:fn:0.5` both read, and so does a function named like a float word: `pkg.module:nan`
is the function `nan` (weight 1.0), never a NaN weight; `pkg.module:nan:0.5` weighs it 0.5.

Each function is inspected once. It is called as `fn(response, answer, **fields)`, where `fields` are the example's
extra record fields that its signature accepts (all of them with `**kwargs`). A function marked `fn.batched = True`
is called once per batch with lists (`fn(responses, answers, **{field: [values]})`) and returns a list. An
`async def` function runs concurrently with the other async calls of the batch (one asyncio.gather), each call
bounded by `timeout_s`. A sample on which a function fails (raises, times out, returns a non-number, NaN or inf)
scores 0.0 for that function and is counted; a finite value outside [0, 1] is clipped. Synchronous functions
cannot be interrupted, so `timeout_s` bounds only async ones.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mint.errors import RewardError
from mint.rl.rewards import BUILTINS, _one_line, resolve_reward
from mint.rl.tasks import Example

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0


def parse_reward_spec(spec: str | Sequence[str]) -> list[tuple[str, float]]:
    """[(name, weight)] of "a:1.0,b:0.2" or ["a:1.0", "b"]; RewardError on an empty, repeated or bad entry.

    A weight is written with digits: `nan`, `inf` and `infinity` after the last ":" name a function (`mod:nan`),
    which float() would have read as a weight. A name holds at most one ":" (`module:fn`), and a built-in's
    (`exact_match`) takes only a weight after it."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    parsed: list[tuple[str, float]] = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise RewardError(f"reward spec {spec!r}: empty entry; write name or name:weight, comma-separated")
        name, weight = item.strip(), 1.0
        head, sep, tail = name.rpartition(":")
        # `pkg.module:fn`: the part after ":" is the function, not a weight; so is `pkg.module:nan`.
        if sep and any(c.isdigit() for c in tail):
            with contextlib.suppress(ValueError):
                weight, name = float(tail), head.strip()
        module, _, attr = name.partition(":")
        if not name or not math.isfinite(weight) or ":" in attr or (attr and module.strip() in BUILTINS):
            raise RewardError(
                f"reward spec {spec!r}: bad entry {item.strip()!r}; write name, name:weight or module:fn:weight "
                "(a weight is a finite number written with digits)"
            )
        if name in (n for n, _ in parsed):
            raise RewardError(f"reward spec {spec!r}: {name!r} appears twice")
        parsed.append((name, weight))
    return parsed


@dataclass(frozen=True)
class _Term:
    """One resolved function and how to call it."""

    name: str
    weight: float
    fn: Callable
    batched: bool
    is_async: bool
    fields: frozenset[str] | None  # extra fields its signature takes by keyword; None: all (it has **kwargs)
    positional: frozenset[str]  # names of its first two parameters: never passed as fields

    def kwargs(self, extra: dict[str, Any]) -> dict[str, Any]:
        return {
            k: v for k, v in extra.items() if (self.fields is None or k in self.fields) and k not in self.positional
        }


def _term(name: str, weight: float) -> _Term:
    fn = resolve_reward(name)
    batched = bool(getattr(fn, "batched", False))
    # A callable object with `async def __call__` is async too.
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except ValueError:  # some C callables have no signature: pass no fields
        return _Term(name, weight, fn, batched, is_async, frozenset(), frozenset())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        fields = None
    else:
        fields = frozenset(p.name for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    positional = frozenset(p.name for p in params[:2] if p.kind is not p.VAR_POSITIONAL)
    return _Term(name, weight, fn, batched, is_async, fields, positional)


@dataclass(frozen=True)
class RewardSetResult:
    """Rewards of one batch of N samples, per function (each in [0, 1]) and weighted into `total`.

    `failures[name][i]` is "" where function `name` scored sample i, else its failure in one line ("TimeoutError:
    ..." for a timeout); a failed sample scored 0.0 for that function.
    """

    weights: dict[str, float]
    rewards: dict[str, list[float]]
    failures: dict[str, list[str]]
    clipped: dict[str, list[bool]]

    @property
    def total(self) -> list[float]:
        """total[i] = sum over functions f of weights[f] * rewards[f][i]."""
        columns = [[w * r for r in self.rewards[name]] for name, w in self.weights.items()]
        return [sum(values) for values in zip(*columns, strict=True)]

    @property
    def errors(self) -> dict[str, int]:
        """Failed samples per function (timeouts included)."""
        return {name: sum(bool(f) for f in fails) for name, fails in self.failures.items()}

    @property
    def timeouts(self) -> dict[str, int]:
        return {name: sum(f.startswith("TimeoutError") for f in fails) for name, fails in self.failures.items()}

    @property
    def failed_samples(self) -> int:
        """Samples on which at least one function failed: what `data.max_reward_error_frac` compares."""
        return sum(any(fails) for fails in zip(*self.failures.values(), strict=True))

    @property
    def first_error(self) -> str:
        """The first failure, "name: Type: message", in the order of the functions; "" when none failed."""
        for name, fails in self.failures.items():
            for f in fails:
                if f:
                    return f"{name}: {f}"
        return ""

    def part(self, start: int, stop: int) -> RewardSetResult:
        """The result of samples [start, stop): one group's share of a shard scored in one call."""
        return RewardSetResult(
            dict(self.weights),
            {k: v[start:stop] for k, v in self.rewards.items()},
            {k: v[start:stop] for k, v in self.failures.items()},
            {k: v[start:stop] for k, v in self.clipped.items()},
        )


class RewardSet:
    """The functions of a reward spec, resolved and inspected once; `score` rates a batch with all of them."""

    def __init__(self, spec: str | Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S):
        if not timeout_s > 0:
            raise RewardError(f"reward timeout must be > 0 seconds, got {timeout_s}")
        self.terms = tuple(_term(name, weight) for name, weight in parse_reward_spec(spec))
        self.timeout_s = float(timeout_s)

    @property
    def weights(self) -> dict[str, float]:
        return {t.name: t.weight for t in self.terms}

    def score(self, responses: list[str], examples: list[Example]) -> RewardSetResult:
        """Score responses[i] against examples[i] (its answer and extra fields) with every function.

        Failures never propagate; one warning line per failing function per batch names its first failure.
        """
        if len(responses) != len(examples):
            raise ValueError(f"{len(responses)} responses but {len(examples)} examples")
        raw: dict[str, list[Any]] = {}  # per function: a value or an exception per sample
        pending = []  # (term, sample index or None for a batched call, coroutine)
        for term in self.terms:
            raw[term.name] = [None] * len(responses)
            calls = _calls(term, responses, examples)
            for index, call in calls:
                if term.is_async:
                    pending.append((term, index, call))
                    continue
                _store(raw[term.name], index, _outcome(call), len(responses))
        if pending:
            outcomes = _run(self._gather([call for _, _, call in pending]))
            for (term, index, _), outcome in zip(pending, outcomes, strict=True):
                _store(raw[term.name], index, outcome, len(responses))
        return self._result(raw)

    async def _gather(self, calls: list[Callable]) -> list[Any]:
        async def bounded(call):
            try:
                return await asyncio.wait_for(call(), self.timeout_s)
            except asyncio.TimeoutError:
                return TimeoutError(f"no result within {self.timeout_s:g}s")
            except Exception as e:
                return e

        return await asyncio.gather(*(bounded(call) for call in calls))

    def _result(self, raw: dict[str, list[Any]]) -> RewardSetResult:
        rewards, failures, clipped = {}, {}, {}
        for name, values in raw.items():
            rewards[name], failures[name], clipped[name] = [], [], []
            for value in values:
                reward, failure, clip = _check(value)
                rewards[name].append(reward)
                failures[name].append(failure)
                clipped[name].append(clip)
            fails = [f for f in failures[name] if f]
            if fails:
                logger.warning(
                    "reward %s failed on %d of %d samples (scored 0.0); first: %s",
                    name, len(fails), len(values), fails[0],
                )  # fmt: skip
        return RewardSetResult(self.weights, rewards, failures, clipped)

    def check(self, example: Example) -> None:
        """Score the example's own answer as the response; RewardError (one line) if any function fails on it."""
        result = self.score([example.answer], [example])
        if result.first_error:
            raise RewardError(
                f"reward {result.first_error} (on the first example, response = its answer {example.answer!r})"
            )


def _calls(term: _Term, responses: list[str], examples: list[Example]) -> list[tuple[int | None, Callable]]:
    """(sample index, or None for one batched call; a zero-argument callable) for each call of `term`."""
    if term.batched:
        fields: dict[str, list[Any]] = {}
        for i, ex in enumerate(examples):
            for k, v in term.kwargs(ex.extra).items():
                # A field missing from some examples reads as None there, so every list has one value per sample.
                fields.setdefault(k, [None] * len(examples))[i] = v
        answers = [ex.answer for ex in examples]
        return [(None, lambda: term.fn(list(responses), answers, **fields))]
    return [
        (i, lambda r=r, ex=ex: term.fn(r, ex.answer, **term.kwargs(ex.extra)))
        for i, (r, ex) in enumerate(zip(responses, examples, strict=True))
    ]


def _outcome(call: Callable) -> Any:
    try:
        return call()
    except Exception as e:  # the user's function may fail in any way
        return e


def _store(values: list[Any], index: int | None, outcome: Any, n: int) -> None:
    """Put a per-sample outcome at `index`, or spread a batched call's list (or its failure) over all samples."""
    if index is not None:
        values[index] = outcome
    elif isinstance(outcome, BaseException):
        values[:] = [outcome] * n
    elif not isinstance(outcome, (list, tuple)) or len(outcome) != n:
        got = f"{len(outcome)} values" if isinstance(outcome, (list, tuple)) else type(outcome).__name__
        values[:] = [TypeError(f"batched reward returned {got}, not a list of {n}")] * n
    else:
        values[:] = list(outcome)


def _check(value: Any) -> tuple[float, str, bool]:
    """(reward in [0, 1], failure text or "", clipped) of one returned value or exception."""
    if isinstance(value, BaseException):
        return 0.0, _one_line(value), False
    if not isinstance(value, numbers.Real):
        return 0.0, f"TypeError: returned {type(value).__name__}, not a number", False
    value = float(value)
    if not math.isfinite(value):
        return 0.0, f"ValueError: returned {value}", False
    clipped = min(max(value, 0.0), 1.0)
    return clipped, "", clipped != value


def _run(coroutine) -> Any:
    """Run `coroutine` to completion, also from inside a running event loop (an async caller): then on a thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
