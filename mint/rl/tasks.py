"""Built-in synthetic tasks with verifiable rewards, and a command that writes one to dataset files.

A task's correct answer must depend on the prompt, and no constant answer may beat chance: every task here has
answers uniform over the digits 0-9, so any constant answer scores 0.1 in expectation.

    python -m mint.rl.tasks arithmetic --out data/arith --train 200 --eval 50

writes two disjoint sets of distinct problems as Hugging Face `save_to_disk` directories (`data/arith/train`,
`data/arith/eval`; `--format jsonl` or `parquet` writes files instead), each row a chat-message prompt, its answer and
the task's extra columns, ready for `data.source` and `eval.source`.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Protocol

from mint.errors import DataError, MintError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Example:
    """One prompt (before the chat template), its reference answer, and the other fields of its record.

    `prompt` is the user message. A record whose prompt is a conversation keeps it whole in `messages` as
    (role, content) pairs ending with a user turn; `prompt` is then that last user message (what logs and records
    show). `extra` holds the record's other fields (JSON values), handed to reward functions as keyword arguments;
    it takes part in equality but not in the hash, and is read-only by convention.
    """

    prompt: str
    answer: str
    messages: tuple[tuple[str, str], ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict, hash=False)

    def chat(self, system_prompt: str = "") -> list[dict[str, str]]:
        """The messages to hand the chat template. `system_prompt` goes first unless the record has its own."""
        turns = list(self.messages) if self.messages is not None else [("user", self.prompt)]
        if system_prompt and turns[0][0] != "system":
            turns.insert(0, ("system", system_prompt))
        return [{"role": role, "content": content} for role, content in turns]


class Task(Protocol):
    """A synthetic task: `sample` draws one Example from `rng` (a variable number of draws)."""

    name: str

    def sample(self, rng: random.Random) -> Example: ...


class FirstLastTask:
    """ "What is the first (or last) digit of 3 7 1 4?" -> "3" (or "4").

    3 to 6 digits, each uniform over 0-9, and first/last chosen with equal odds: the answer is uniform over 0-9 and
    independent of everything in the prompt but the digit it names.
    """

    name = "first_last"
    min_digits = 3
    max_digits = 6

    def sample(self, rng: random.Random) -> Example:
        digits = [rng.randrange(10) for _ in range(rng.randint(self.min_digits, self.max_digits))]
        which = rng.choice(("first", "last"))
        answer = digits[0] if which == "first" else digits[-1]
        return Example(f"What is the {which} digit of {' '.join(map(str, digits))}?", str(answer))


class ArithmeticTask:
    """ "What is 3 + 4 + 1?" -> "8": 2 to 4 one-digit terms whose sum is a single digit.

    The sum is drawn first, uniform over 0-9, then the number of terms (uniform over 2-4), then the terms: a uniform
    composition of the sum into that many non-negative parts (stars and bars). So the answer is uniform, and a constant
    answer scores 0.1. There are 990 distinct problems (55, 220 and 715 with 2, 3 and 4 terms); small sums have few
    (three problems sum to 0), so a set of distinct problems leans to larger sums. The extra field `terms` holds the
    terms, so a reward can recompute the answer from the record.
    """

    name = "arithmetic"
    min_terms = 2
    max_terms = 4

    def sample(self, rng: random.Random) -> Example:
        total = rng.randrange(10)
        n = rng.randint(self.min_terms, self.max_terms)
        # A uniform composition: choose n - 1 bar positions among total + n - 1 slots.
        bars = sorted(rng.sample(range(total + n - 1), n - 1))
        edges = [-1, *bars, total + n - 1]
        terms = [edges[i + 1] - edges[i] - 1 for i in range(n)]
        return Example(f"What is {' + '.join(map(str, terms))}?", str(total), extra={"terms": terms})


TASKS: dict[str, type[Task]] = {FirstLastTask.name: FirstLastTask, ArithmeticTask.name: ArithmeticTask}


def get_task(name: str) -> Task:
    """The synthetic task called `name`; DataError names the valid ones otherwise."""
    try:
        return TASKS[name]()
    except KeyError:
        raise DataError(f"unknown synthetic task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}") from None


def distinct_examples(task: Task, n: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[Example]:
    """The first `n` distinct problems (by prompt) of `task`'s stream for `seed`, skipping prompts in `exclude`.

    DataError when the task has too few distinct problems (after 1000 draws in a row without a new one).
    """
    rng, seen, out, misses = random.Random(f"mint-task-{seed}"), set(exclude), [], 0
    while len(out) < n:
        ex = task.sample(rng)
        if ex.prompt in seen:
            misses += 1
            if misses > 1000:
                raise DataError(f"task {task.name!r} has fewer than {n} distinct problems (found {len(out)})")
            continue
        misses = 0
        seen.add(ex.prompt)
        out.append(ex)
    return out


def to_row(ex: Example) -> dict[str, Any]:
    """A dataset record: the prompt as a chat conversation, the answer, and the example's extra fields."""
    return {"prompt": ex.chat(), "answer": ex.answer, **ex.extra}


def write_split(rows: list[dict[str, Any]], path: str, fmt: str) -> str:
    """Write `rows` to `path` (a save_to_disk directory, or a .jsonl / .parquet file) atomically; returns the path."""
    import datasets  # imported here: about a second, and only the command needs it

    datasets.disable_progress_bars()
    table = datasets.Dataset.from_list(rows)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        if fmt == "disk":
            staged = os.path.join(tmp, "dataset")
            table.save_to_disk(staged)
        else:
            staged = os.path.join(tmp, os.path.basename(path))
            if fmt == "jsonl":
                table.to_json(staged, lines=True)
            else:
                table.to_parquet(staged)
        if os.path.isdir(path):  # replacing an earlier set: move it aside first (a rename cannot replace a folder)
            os.rename(path, os.path.join(tmp, "old"))
        os.replace(staged, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


SUFFIX = {"disk": "", "jsonl": ".jsonl", "parquet": ".parquet"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mint.rl.tasks",
        description="Write a synthetic task as train and eval datasets of distinct, disjoint problems.",
    )
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--out", required=True, help="folder that gets <out>/train and <out>/eval")
    parser.add_argument("--train", type=int, default=200, help="training problems (default 200)")
    parser.add_argument("--eval", type=int, default=50, help="held-out problems, none of them in train (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="which problems are drawn (default 0)")
    parser.add_argument("--format", choices=sorted(SUFFIX), default="disk", help="disk: save_to_disk folders (default)")
    args = parser.parse_args(argv)
    try:
        if args.train < 1 or args.eval < 0:
            raise DataError(f"need --train >= 1 and --eval >= 0, got {args.train} and {args.eval}")
        examples = distinct_examples(get_task(args.task), args.train + args.eval, args.seed)
        for name, part in (("train", examples[: args.train]), ("eval", examples[args.train :])):
            if part:
                path = write_split(
                    [to_row(ex) for ex in part], os.path.join(args.out, name + SUFFIX[args.format]), args.format
                )
                print(f"{path}: {len(part)} {args.task} problems")
    except MintError as e:
        print(f"mint: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
