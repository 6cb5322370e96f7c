"""Built-in synthetic tasks with verifiable rewards.

A task's correct answer must depend on the prompt: for `first_last` the answer is one of the prompt's digits, drawn
uniformly, so any constant answer scores 0.1 in expectation, which is chance.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from mint.errors import DataError

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


TASKS = {FirstLastTask.name: FirstLastTask}


def get_task(name: str) -> FirstLastTask:
    """The synthetic task called `name`; DataError names the valid ones otherwise."""
    try:
        return TASKS[name]()
    except KeyError:
        raise DataError(f"unknown synthetic task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}") from None
