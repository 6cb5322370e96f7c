"""Running episodes, and what an episode leaves for the learner.

`run_group` makes a group's G environments (an `EnvGroupBuilder`) and drives each through `run_episode`
concurrently, so a policy that batches (the built-in engine decodes its waiting episodes together) sees all G at once.

The record (`Episode`) keeps, after the prompt (the initial observation), every token in order: each action as sampled
and each observation as the environment gave it. The learner treats that tail like a response: it is scored with the
same forward, and `loss_mask` says which tokens carry loss (1 on the actions' sampled tokens, 0 on observation tokens
and on the tokens of a masked action). Observation tokens get no loss but stay in the context: later tokens attend to
them and, on an MoE base, their routes are replayed too.

Limits (`EpisodeLimits`), checked by the runner so that an environment need not know them:
    max_turns   actions per episode
    max_tokens  tokens after the prompt, actions and observations together: what the learner replays per episode, so
                LongStraw's memory bound (the longest tail) follows from it
    context     prompt plus tail: the policy's context. An observation that would pass it ends the episode before it
                is appended (`context_overflow`), since the next action could not be sampled anyway
    step_timeout_s  how long one `Env.step` may take; past it the episode ends (`timeout`) with the turns it had
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mint.envs.env import Env, EnvGroupBuilder, StepResult, StopCondition, StopReason, Tokens


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8
    max_tokens: int = 1024
    context: int = 4096
    step_timeout_s: float = 60.0

    def __post_init__(self):
        for name in ("max_turns", "max_tokens", "context"):
            if getattr(self, name) < 1:
                raise ValueError(f"EpisodeLimits.{name} must be >= 1, got {getattr(self, name)}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"EpisodeLimits.step_timeout_s must be > 0, got {self.step_timeout_s}")


@dataclass
class Sample:
    """One sampled action, as the policy returns it."""

    tokens: Tokens  # ends with the stop id when finish_reason == "stop"
    logprobs: list[float]  # the rollout's log-probability of each sampled token
    revision: str  # the adapter revision that sampled it
    finish_reason: str  # "stop" | "length"


class Policy(Protocol):
    """Samples actions, token in, token out. `key` names the episode: a policy that keeps an episode's state between
    turns (its K/V) finds it by key and prefills only the ids of `context` it has not seen; a stateless one (an HTTP
    engine given prompt ids) sends the whole `context`. `context` only ever grows by appending."""

    async def sample(self, key: Hashable, context: Tokens, stop: StopCondition) -> Sample: ...

    async def release(self, key: Hashable) -> Any:
        """The episode is over: free what is held for it, and return what the policy recorded over the whole episode
        beyond tokens and logprobs (an MoE engine's routes, one row per position: `Episode.routes`), or None."""


@dataclass
class Turn:
    """One action and the observation after it, as offsets into `Episode.tokens`."""

    start: int  # the action's first token
    action: int  # sampled tokens
    observation: int  # observation tokens appended after it (0 for the last turn)
    revision: str
    reward: float
    masked: bool  # the action carries no loss (the environment could not read it)
    finish_reason: str
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Episode:
    prompt: Tokens
    tokens: Tokens = field(default_factory=list)  # after the prompt: actions and observations interleaved
    loss_mask: list[int] = field(default_factory=list)  # 1 on sampled tokens of unmasked actions, else 0
    logprobs: list[float] = field(default_factory=list)  # the rollout's, on sampled tokens; NaN on observation tokens
    turns: list[Turn] = field(default_factory=list)
    stop_reason: StopReason = StopReason.COMPLETED
    reward: float = 0.0  # the turns' rewards plus the group's (EnvGroupBuilder.group_rewards)
    # What the policy recorded per position (Policy.release): on an MoE base, the routes of every position's forward,
    # prompt and observations included ([P + len(tokens) - 1, layers, k]), which R3 replays; None on a dense base.
    routes: Any = None

    @property
    def sampled_tokens(self) -> int:
        return sum(t.action for t in self.turns)

    def _append(self, ids: Tokens, mask: int, logprobs: Sequence[float] | None) -> None:
        self.tokens += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [math.nan] * len(ids)


async def run_episode(env: Env, policy: Policy, key: Hashable, limits: EpisodeLimits) -> Episode:
    """Drive `env` with `policy` to the end of the episode; `env` is closed and `key` released however it ends."""
    try:
        prompt, stop = await env.initial_observation()
        episode = Episode(prompt=list(prompt))
        try:
            episode.stop_reason = await _turns(env, policy, key, limits, episode, stop)
        finally:
            episode.routes = await policy.release(key)
        return episode
    finally:
        await env.close()


async def _turns(
    env: Env, policy: Policy, key: Hashable, limits: EpisodeLimits, episode: Episode, stop: StopCondition
) -> StopReason:
    P = len(episode.prompt)
    while True:
        context_room = limits.context - P - len(episode.tokens)
        budget = min(stop.max_tokens, limits.max_tokens - len(episode.tokens), context_room)
        if budget < 1:  # only before the first action: a later observation is refused when it leaves no room
            return StopReason.CONTEXT_OVERFLOW if context_room < 1 else StopReason.MAX_TOKENS
        sample = await policy.sample(key, episode.prompt + episode.tokens, StopCondition(stop.stop_tokens, budget))
        if len(sample.logprobs) != len(sample.tokens) or not 1 <= len(sample.tokens) <= budget:
            raise ValueError(
                f"policy returned {len(sample.tokens)} tokens and {len(sample.logprobs)} logprobs for a budget of "
                f"{budget}"
            )
        start = len(episode.tokens)
        try:
            result = await asyncio.wait_for(env.step(list(sample.tokens)), limits.step_timeout_s)
        except TimeoutError:
            episode._append(sample.tokens, 1, sample.logprobs)
            episode.turns.append(Turn(start, len(sample.tokens), 0, sample.revision, 0.0, False, sample.finish_reason))
            return StopReason.TIMEOUT
        episode._append(sample.tokens, 0 if result.mask_action else 1, sample.logprobs)
        turn = _turn(start, sample, result)
        episode.turns.append(turn)
        episode.reward += result.reward
        if result.episode_done:
            return result.stop_reason or StopReason.COMPLETED
        if len(episode.turns) == limits.max_turns:  # no action would follow the observation: it is not appended
            return StopReason.MAX_TURNS
        observation = list(result.next_observation)
        if P + len(episode.tokens) + len(observation) >= limits.context:
            return StopReason.CONTEXT_OVERFLOW  # not even one more sampled token would fit after it
        if len(episode.tokens) + len(observation) >= limits.max_tokens:
            return StopReason.MAX_TOKENS
        episode._append(observation, 0, None)
        turn.observation = len(observation)
        stop = result.next_stop or stop


def _turn(start: int, sample: Sample, result: StepResult) -> Turn:
    return Turn(
        start=start,
        action=len(sample.tokens),
        observation=0,
        revision=sample.revision,
        reward=float(result.reward),
        masked=result.mask_action,
        finish_reason=sample.finish_reason,
        metrics=dict(result.metrics),
    )


async def run_group(builder: EnvGroupBuilder, policy: Policy, limits: EpisodeLimits, key: Hashable) -> list[Episode]:
    """The group's G episodes, run concurrently (episode i under the key (key, i)), with the group's rewards added."""
    envs = list(await builder.make_envs())
    if not envs:
        raise ValueError("EnvGroupBuilder.make_envs returned no environments")
    episodes = await asyncio.gather(*(run_episode(env, policy, (key, i), limits) for i, env in enumerate(envs)))
    extra = await builder.group_rewards(episodes)
    if len(extra) != len(episodes):
        raise ValueError(f"group_rewards returned {len(extra)} rewards for {len(episodes)} episodes")
    for episode, reward in zip(episodes, extra, strict=True):
        episode.reward += float(reward)
    return list(episodes)
