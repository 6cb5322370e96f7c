"""The environment interface of multi-turn RL: token in, token out, asynchronous.

An episode alternates the policy's actions with the environment's observations, all as token ids:

    initial observation (the prompt) -> action 1 -> observation 1 -> action 2 -> ... -> action n (done)

- The environment never sees text it has to re-encode: it gets the action's sampled ids, and answers with the ids
  of the next observation only (a delta appended after the action). Decoding sampled ids and encoding the whole chat
  again changes ids (BPE merges across the boundary, templates that drop past reasoning), and the learner would then
  train on tokens the policy never sampled; so what was sampled is kept as sampled, and an environment that renders
  chat messages renders the new message alone (mint.envs.chat checks the family's template allows that).
- Every call may await (a tool in a subprocess, a remote sandbox); the episode runner (mint.envs.episode) drives the
  G environments of a group concurrently, so the policy can decode them in one batch.
- The shapes follow tinker-cookbook's `Env`/`StepResult`/`EnvGroupBuilder`, so a researcher's environment ports by
  renaming; the differences are that observations are plain token lists, each turn's stop condition names its stop
  ids and token budget, and a step says why an episode ended.

Environments run beside the rollout engine (in the rollout actors), never in the learner.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

Tokens = list[int]


class StopReason(str, enum.Enum):
    """Why an episode ended. The first three are the environment's word; the rest the runner's."""

    COMPLETED = "completed"  # the environment ended it (an answer was given)
    PARSE_ERROR = "parse_error"  # the action could not be read (a malformed tool call) and the environment gave up
    TOOL_ERROR = "tool_error"  # a tool failed and the environment gave up
    MAX_TURNS = "max_turns"  # the runner's turn limit
    MAX_TOKENS = "max_tokens"  # the episode's token budget (actions and observations after the prompt) ran out
    CONTEXT_OVERFLOW = "context_overflow"  # the next observation would not fit the context: the episode ends before it
    TIMEOUT = "timeout"  # the environment's step did not answer in time


@dataclass(frozen=True)
class StopCondition:
    """How the next action is sampled: it ends after any of `stop_tokens` (kept as its last token) or after
    `max_tokens` sampled tokens, whichever comes first. The runner may lower `max_tokens` to the episode's budget."""

    stop_tokens: tuple[int, ...]
    max_tokens: int

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"StopCondition.max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class StepResult:
    """What `Env.step` returns.

    reward            this turn's reward (a per-episode reward is the last turn's, or `EnvGroupBuilder.group_rewards`)
    episode_done      no further action is sampled
    next_observation  the ids appended after the action (empty when done); never a re-encoding of the action
    next_stop         the next action's stop condition (None: the previous one again)
    metrics           numbers for the step's logs (summed or averaged over episodes by name)
    stop_reason       when done: why (None means COMPLETED)
    mask_action       the action just taken gets no loss (it could not be parsed): the learner must not push the policy
                      towards or away from tokens the environment could not read. Its tokens stay in the context.
    """

    reward: float
    episode_done: bool
    next_observation: Tokens = field(default_factory=list)
    next_stop: StopCondition | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    stop_reason: StopReason | None = None
    mask_action: bool = False


class Env(ABC):
    """One episode's environment. Used once: `initial_observation`, then `step` until it says done, then `close`."""

    @abstractmethod
    async def initial_observation(self) -> tuple[Tokens, StopCondition]:
        """The prompt's ids and the first action's stop condition."""

    @abstractmethod
    async def step(self, action: Tokens) -> StepResult:
        """Take the sampled ids of one action (its stop token included when it stopped on one)."""

    async def close(self) -> None:
        """Free what the episode held (a sandbox process, files). Called once, however the episode ended."""
        return None  # an environment that holds nothing has nothing to free


class EnvGroupBuilder(ABC):
    """Makes the G environments of one GRPO group: G episodes over one task, whose rewards are compared."""

    @abstractmethod
    async def make_envs(self) -> Sequence[Env]:
        """G fresh environments over the same task."""

    async def group_rewards(self, episodes: Sequence) -> list[float]:
        """Rewards given once the whole group is done (a pairwise judge, say), added to each episode's own; one per
        episode, in order. Default: none."""
        return [0.0] * len(episodes)

    def tags(self) -> list[str]:
        """Names under which this group's metrics are also logged (a dataset's name, say)."""
        return []
