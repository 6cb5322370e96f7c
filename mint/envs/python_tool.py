"""`env.name = "python"`: the dataset's question, with a Python interpreter as a tool (the REPL substrate).

The model may call `python(code)` any number of times before it answers; every call of an episode runs in that
episode's own sandbox (mint.envs.sandbox: one persistent namespace, CPU, memory, output and wall-clock limits, no
network), so a variable set by one call is there for the next. What the call printed (and the value of a final
expression) comes back as the tool's result; an exception, a limit or a crash of the interpreter comes back as its
one-line error, which the model reads like any result. The sandbox is closed, its processes killed and its folder
removed when the episode ends, however it ends.

The answer is scored by `exact_match` against the dataset's reference. The tiny bases were never taught to call it,
so on them this environment is for tests; with a real base and a real task it is the tool loop of an agent.
"""

from __future__ import annotations

import os

from mint.config import Config
from mint.envs.env import EnvGroupBuilder, StopCondition, Tokens
from mint.envs.sandbox import PythonSandbox, SandboxLimits
from mint.envs.tool_calls import FAMILY_FORMAT, Tool
from mint.envs.tool_env import ToolChatEnv, ToolFailure, ToolFn
from mint.rl.rewards import exact_match
from mint.rl.tasks import Example

PYTHON_TOOL = Tool(
    "python",
    "Run Python code in this conversation's interpreter; variables persist between calls. Returns what it prints.",
    {
        "type": "object",
        "properties": {"code": {"type": "string"}},
        "required": ["code"],
        "additionalProperties": False,
    },
)
SYSTEM = "You may call python(code) to compute before you answer."


def python_env(
    example: Example,
    tokenizer,
    stop: StopCondition,
    family_format: str = "hermes",
    limits: SandboxLimits | None = None,
    temp_root: str | os.PathLike | None = None,
) -> ToolChatEnv:
    """One episode: its own sandbox, started at the first call (an episode that answers at once starts none)."""
    sandbox: PythonSandbox | None = None

    async def run(arguments: dict) -> str:
        nonlocal sandbox
        if sandbox is None:
            sandbox = PythonSandbox(limits, temp_root=temp_root)
        result = await sandbox.run(arguments["code"])
        if not result.ok:
            raise ToolFailure(result.error or "failed", result.output.rstrip("\n"))
        return result.output.rstrip("\n")  # print's last newline: the tool message puts its own after the result

    async def close() -> None:
        if sandbox is not None:
            sandbox.close()

    messages = [{"role": "system", "content": SYSTEM}]
    messages += [{"role": role, "content": text} for role, text in example.chat("")]
    return ToolChatEnv(
        tokenizer,
        messages,
        [ToolFn(PYTHON_TOOL, run)],
        lambda answer: exact_match(answer, example.answer),
        stop,
        family_format,
        on_close=close,
    )


class PythonGroup(EnvGroupBuilder):
    def __init__(self, example: Example, tokenizer, config: Config, stop: StopCondition):
        self.example, self.tokenizer, self.config, self.stop = example, tokenizer, config, stop
        # The calls are read in the base family's format: a tiny base's family is in its path, a hub base is read
        # as a Qwen3 one (Hermes) until recipes name the format.
        family = config.model.path.removeprefix("tiny:") if config.model.path.startswith("tiny:") else ""
        self.format = FAMILY_FORMAT.get(family, "hermes")

    async def make_envs(self) -> list[ToolChatEnv]:
        return [
            python_env(self.example, self.tokenizer, self.stop, self.format)
            for _ in range(self.config.rollout.group_size)
        ]


def python(example: Example, tokenizer, config: Config, prompt: Tokens, stop: StopCondition) -> PythonGroup:
    """The factory `env.name = "python"` names; the episode opens with the dataset's question under a system line
    that names the tool (`prompt`, rendered without it, is not used)."""
    return PythonGroup(example, tokenizer, config, stop)
