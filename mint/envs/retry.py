"""`env.name = "retry"`: the built-in multi-turn environment, over any dataset with reference answers.

The episode opens with the dataset's prompt. An answer that matches the reference (`exact_match`) ends it; a wrong
one is told "Wrong. Try again." as a user message, and the model answers again, up to `env.max_turns` actions. The
reward is 1 for a first-turn answer and halves with each retry (0.5, 0.25, ...): trying again is worth something,
getting it right at once more, so a policy learns both to use the feedback and to need it less.

It needs no tool, so any base with a chat template can run it; recipes/retry_cpu.toml trains tiny:qwen3_moe, whose
pretraining on the built-in tasks' single-turn chats is enough for a later answer to differ from a wrong one.
"""

from __future__ import annotations

from mint.config import Config
from mint.envs.chat import observation_delta
from mint.envs.env import Env, EnvGroupBuilder, StepResult, StopCondition, StopReason, Tokens
from mint.rl.rewards import exact_match
from mint.rl.tasks import Example

FEEDBACK = "Wrong. Try again."
DISCOUNT = 0.5


class RetryEnv(Env):
    def __init__(self, example: Example, tokenizer, prompt: Tokens, stop: StopCondition, system_prompt: str = ""):
        self.example, self.tokenizer, self.prompt, self.stop = example, tokenizer, prompt, stop
        self.history = [{"role": role, "content": text} for role, text in example.chat(system_prompt)]
        self.turn = 0

    async def initial_observation(self) -> tuple[Tokens, StopCondition]:
        return list(self.prompt), self.stop

    async def step(self, action: Tokens) -> StepResult:
        self.turn += 1
        eos = self.tokenizer.eos_token_id
        closed = bool(action) and action[-1] == eos
        text = self.tokenizer.decode(action, skip_special_tokens=True)
        if exact_match(text, self.example.answer) > 0:
            reward = DISCOUNT ** (self.turn - 1)
            return StepResult(reward, True, metrics={"correct": 1.0}, stop_reason=StopReason.COMPLETED)
        self.history.append({"role": "assistant", "content": text})
        feedback = {"role": "user", "content": FEEDBACK}
        observation = observation_delta(self.tokenizer, self.history, [feedback], self.tokenizer.eos_token, closed)
        self.history.append(feedback)
        return StepResult(0.0, False, observation, metrics={"correct": 0.0})


class RetryGroup(EnvGroupBuilder):
    def __init__(self, example: Example, tokenizer, config: Config, prompt: Tokens, stop: StopCondition):
        self.example, self.tokenizer, self.config, self.prompt, self.stop = example, tokenizer, config, prompt, stop

    async def make_envs(self) -> list[Env]:
        system = self.config.data.system_prompt
        return [
            RetryEnv(self.example, self.tokenizer, self.prompt, self.stop, system)
            for _ in range(self.config.rollout.group_size)
        ]


def retry(example: Example, tokenizer, config: Config, prompt: Tokens, stop: StopCondition) -> RetryGroup:
    return RetryGroup(example, tokenizer, config, prompt, stop)
