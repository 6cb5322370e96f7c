"""`env.name = "lookup"`: the built-in tool-use environment, where the answer is not in the prompt.

Each example becomes a question about a hidden table: "What is the value of q?". The table (`TABLE_SIZE` letter keys
-> digits, drawn from a hash of the example's prompt, so a group's G episodes share it) stores the example's reference
answer under the key asked, so any dataset whose answers are digits drives it (`synthetic:first_last` in the recipe:
its prompt only seeds the table, its answer is the value). The model sees the question alone and has one tool:

    turn 1  the model calls it in Hermes format (Qwen's):
            <tool_call>\\n{"name": "lookup", "arguments": {"key": "q"}}\\n</tool_call>
            and the environment answers as Qwen's template renders a tool result, a user turn holding
            <tool_response>\\n7\\n</tool_response> (role "user" with that text gives the same bytes under the tiny
            bases' plain ChatML and under Qwen's own template, which wraps a "tool" message the same way)
    turn 2  the model answers "7": reward 1 if it is the value, else 0

A turn without a call is the answer: a direct guess is right one time in ten. A call of a key not in the table is
answered "error: unknown key" and the episode goes on (the table's keys are not in the prompt, so only the asked key is
known to exist). A turn that cannot be read (a malformed call, an unknown tool, bad arguments) ends the episode at
reward 0 with `parse_error` and its action masked: the learner must not push towards or away from tokens the
environment could not read. A retry after a parse error was not offered: the tiny tool base writes either a whole call
or a digit, so there was nothing to recover (docs/agents.md has the measured rates).

Per-turn metrics: `tool_calls` (calls read in the action), `tool_errors` (unreadable actions and unknown keys),
`correct` (on the answering turn).
"""

from __future__ import annotations

import random

from mint.config import Config
from mint.envs.env import Env, EnvGroupBuilder, StopCondition, Tokens
from mint.envs.tool_calls import Tool, ToolCall, render_turn
from mint.envs.tool_env import ToolChatEnv, ToolFailure, ToolFn
from mint.rl.rewards import exact_match
from mint.rl.tasks import Example

LOOKUP_TOOL = Tool(
    "lookup",
    "The value stored under a key of the table.",
    {
        "type": "object",
        "properties": {"key": {"type": "string"}},
        "required": ["key"],
        "additionalProperties": False,
    },
)
FORMAT = "hermes"  # the qwen3 families' format (tool_calls.FAMILY_FORMAT); the tiny tool base was trained on it
KEYS = "abcdefghijklmnopqrstuvwxyz"  # one letter each: a key is one token in the tiny tokenizer
TABLE_SIZE = 4
UNKNOWN = "unknown key"


def question(key: str) -> str:
    return f"What is the value of {key}?"


def call_text(key: str) -> str:
    """The assistant turn that calls the tool for `key`, as the Hermes format writes it."""
    return render_turn(FORMAT, [ToolCall(LOOKUP_TOOL.name, {"key": key})])


def table_for(example: Example) -> tuple[str, dict[str, str]]:
    """The key asked and the hidden table of `example`: TABLE_SIZE distinct keys, the asked one holding the
    example's answer, the others uniform digits. Seeded by the prompt, so every episode of a group sees one table."""
    rng = random.Random(f"mint-lookup-{example.prompt}")
    keys = rng.sample(KEYS, TABLE_SIZE)
    table = {k: str(rng.randrange(10)) for k in keys}
    table[keys[0]] = example.answer
    return keys[0], table


class LookupEnv(ToolChatEnv):
    """The question about the example's hidden table, with `lookup` as the one tool (mint.envs.tool_env runs the
    loop: parse, call, render the result, score the answer)."""

    def __init__(self, example: Example, tokenizer, stop: StopCondition, system_prompt: str = ""):
        self.key, self.table = table_for(example)
        answer = self.table[self.key]
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": question(self.key)})

        async def run(arguments: dict) -> str:
            value = self.table.get(arguments["key"])
            if value is None:
                raise ToolFailure(UNKNOWN)
            return value

        tools = [ToolFn(LOOKUP_TOOL, run)]
        super().__init__(tokenizer, messages, tools, lambda text: exact_match(text, answer), stop, FORMAT)


class LookupGroup(EnvGroupBuilder):
    def __init__(self, example: Example, tokenizer, config: Config, stop: StopCondition):
        self.example, self.tokenizer, self.config, self.stop = example, tokenizer, config, stop

    async def make_envs(self) -> list[Env]:
        system = self.config.data.system_prompt
        return [
            LookupEnv(self.example, self.tokenizer, self.stop, system) for _ in range(self.config.rollout.group_size)
        ]


def lookup(example: Example, tokenizer, config: Config, prompt: Tokens, stop: StopCondition) -> LookupGroup:
    """The factory `env.name = "lookup"` names. `prompt` (the dataset's rendered prompt) is not used: the episode
    opens with the lookup question instead."""
    return LookupGroup(example, tokenizer, config, stop)
