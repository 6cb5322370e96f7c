"""Chat environments with function tools: the model calls tools in its family's format until it answers.

`ToolChatEnv` runs the loop every tool environment needs, so a new one is its tools and its reward:

    each action   decoded and read with the family's tool-call format (mint.envs.tool_calls)
      malformed   a call that cannot be read (bad markers, bad JSON, an unknown tool, arguments against the schema)
                  ends the episode at reward 0 with `parse_error`, the action masked: the learner must not push
                  towards or away from tokens the environment could not read
      calls       each tool runs (awaited: a sandbox, a remote service); its results come back as tool messages,
                  rendered by the chat template as a delta after the action (mint.envs.chat); a tool that fails
                  answers with its one-line error, which the model reads like any result: a tool error is the
                  episode's business, never the run's
      no call     the action is the answer: `reward(content)` scores it and the episode ends

Tool messages are written as Qwen's template writes a "tool" message, a user turn holding <tool_response>...
</tool_response>; under the tiny bases' plain ChatML that is the same bytes. Per-turn metrics: `tool_calls`,
`tool_errors` (unreadable actions and failed calls), `correct` (the answer's reward).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from mint.envs.chat import observation_delta
from mint.envs.env import Env, StepResult, StopCondition, StopReason, Tokens
from mint.envs.tool_calls import Tool, check_arguments, parse_tool_calls


class ToolFailure(Exception):
    """A tool could not do what it was asked: the model reads `output` (what it produced before it failed, if
    anything) and then "error: " and the one-line message, as the call's result."""

    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output

    def result(self) -> str:
        line = f"error: {self}"
        return f"{self.output}\n{line}" if self.output else line


@dataclass(frozen=True)
class ToolFn:
    """A tool the model may call: its declaration and the coroutine that runs it on the call's arguments."""

    tool: Tool
    run: Callable[[dict], Awaitable[str]]


def tool_message(result: str) -> dict[str, str]:
    """A tool result as Qwen's template renders a "tool" message: a user turn wrapping it in <tool_response>."""
    return {"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"}


class ToolChatEnv(Env):
    """One episode of a chat with tools. `messages`: the conversation before the first action (ending with the
    user's turn); `reward(answer_text)`: the answer's reward; `on_close`: what frees the episode's resources."""

    def __init__(
        self,
        tokenizer,
        messages: Sequence[dict[str, str]],
        tools: Sequence[ToolFn],
        reward: Callable[[str], float],
        stop: StopCondition,
        family_format: str = "hermes",
        on_close: Callable[[], Awaitable[None]] | None = None,
    ):
        self.tokenizer, self.stop, self.format = tokenizer, stop, family_format
        self.history = [dict(m) for m in messages]
        self.tools = {fn.tool.name: fn for fn in tools}
        self.reward = reward
        self._on_close = on_close

    async def initial_observation(self) -> tuple[Tokens, StopCondition]:
        text = self.tokenizer.apply_chat_template(self.history, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False), self.stop

    async def step(self, action: Tokens) -> StepResult:
        closed = bool(action) and action[-1] == self.tokenizer.eos_token_id
        text = self.tokenizer.decode(action, skip_special_tokens=True)
        declared = [fn.tool for fn in self.tools.values()]
        turn = parse_tool_calls(self.format, text, declared)
        bad = turn.error or next(
            (e for call in turn.calls if (e := check_arguments(self.tools[call.name].tool, call))), None
        )
        if bad:
            metrics = {"tool_calls": 0.0, "tool_errors": 1.0}
            return StepResult(0.0, True, metrics=metrics, stop_reason=StopReason.PARSE_ERROR, mask_action=True)
        if not turn.calls:  # no call: this turn is the answer
            score = float(self.reward(turn.content))
            return StepResult(score, True, metrics={"correct": score, "tool_calls": 0.0, "tool_errors": 0.0})
        results, failed = [], 0
        for call in turn.calls:
            try:
                results.append(await self.tools[call.name].run(call.arguments))
            except ToolFailure as err:
                results.append(err.result())
                failed += 1
        self.history.append({"role": "assistant", "content": text})
        new = [tool_message(r) for r in results]
        observation = observation_delta(self.tokenizer, self.history, new, self.tokenizer.eos_token, closed)
        self.history.extend(new)
        metrics = {"tool_calls": float(len(turn.calls)), "tool_errors": float(failed)}
        return StepResult(0.0, False, observation, metrics=metrics)

    async def close(self) -> None:
        if self._on_close is not None:
            await self._on_close()
