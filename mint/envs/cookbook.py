"""tinker-cookbook's environments, run unchanged by Mint's episode runner.

Mint's interface (mint.envs.env) was shaped after tinker-cookbook's `Env` / `StepResult` / `EnvGroupBuilder`, so a
wrapper suffices. What it converts, and why:

- Observations. Theirs is a `tinker.ModelInput`, and each step's `next_observation` is the whole context of the next
  turn: their rollout loop samples from it as given, and their renderers build it by rendering the conversation
  again. Mint's is a delta appended after the action as sampled. `CookbookEnv` keeps the context the policy saw
  (prompt, actions, observations) and passes on only what the new full context adds after it. A full context that
  does not start with it has re-rendered the past (Qwen3's default renderer drops earlier reasoning; an environment
  renders the model's turns under another role, or a decoded action re-encodes to other ids): the episode stops with
  `ContextRewritten`, since Mint never trains on a context the policy did not see.
- Stop conditions. Theirs is a list of stop strings or stop ids, with no budget; Mint's names stop ids and a budget.
  A stop string must be one token of the tokenizer given to the adapter; the budget is the adapter's `max_tokens`
  (the recipe's per-action budget; the runner may lower it to what the episode has left).
- The sampler's stop reason. Their `step` is told it (`extra`); Mint's gets the ids only, so it is read off the
  action: "stop" when the action ends on one of the turn's stop ids, else "length".
- Why an episode ended. Their environment says it with a one-hot `stop/<reason>` metric, and marks a turn to be left
  out of the loss with `parse_error_masked`: these become Mint's `stop_reason` and `mask_action`. Their `logs`
  (strings for display) have no place in Mint's record and are dropped.
- Group rewards. Their `compute_group_rewards` reads their `Trajectory` objects; `CookbookGroupBuilder` builds them
  from Mint's episodes: each turn's observation as their environment gave it, the action's ids and logprobs as
  sampled, the turn's reward and metrics. The metrics it returns beside each reward have no slot in Mint's episode;
  they are kept on the builder (`group_metrics`). Their `cleanup` runs once the group's rewards are computed, as in
  their rollout loop; a group whose episode raised never gets there.

tinker-cookbook is optional, and not yet an extra: its 0.6.1 asks for a tml-renderers release the package registry
does not serve (docs/decisions.md). It is imported here only when an environment is wrapped or graded, so
`mint.envs` imports without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mint.envs.env import Env, EnvGroupBuilder, StepResult, StopCondition, StopReason, Tokens
from mint.envs.episode import Episode
from mint.errors import MintError

if TYPE_CHECKING:
    import tinker
    from tinker_cookbook.rl import types as cookbook

# Their one-hot `stop/<reason>` metrics that have a Mint StopReason. The others (tool_stopped: a tool ended the
# episode on purpose; max_tool_calls) end it as completed, which is what Mint calls an environment's own ending.
_STOP_PREFIX = "stop/"
_STOP_REASONS = {
    "completed": StopReason.COMPLETED,
    "parse_error": StopReason.PARSE_ERROR,
    "max_turns": StopReason.MAX_TURNS,
    "max_tokens": StopReason.MAX_TOKENS,
    "max_sampled_tokens": StopReason.MAX_TOKENS,
    "context_overflow": StopReason.CONTEXT_OVERFLOW,
    "rollout_timeout": StopReason.TIMEOUT,
}
_THEIR_STOP_REASON = {StopReason.TIMEOUT: "rollout_timeout"}  # the other values are spelled alike
_MASKED_METRIC = "parse_error_masked"


class CookbookEnvError(MintError):
    """A tinker-cookbook environment gave something a Mint episode cannot hold (an image, a multi-token stop)."""


class ContextRewritten(CookbookEnvError):
    """A tinker-cookbook environment's next context does not extend the context the policy saw."""


def observation_ids(observation: tinker.ModelInput, env_name: str) -> Tokens:
    """The token ids of a ModelInput made of text chunks; any other chunk (an image) is refused."""
    for chunk in observation.chunks:
        if chunk.type != "encoded_text":
            raise CookbookEnvError(
                f"{env_name}: its observation holds a {chunk.type!r} chunk; Mint's episodes hold text tokens only"
            )
    return [int(t) for chunk in observation.chunks for t in chunk.tokens]


def stop_condition(stop: Sequence[str | int], max_tokens: int, tokenizer: Any, env_name: str) -> StopCondition:
    """Their stop condition as Mint's: ids kept, each string mapped to its one token, `max_tokens` as the budget."""
    ids: list[int] = []
    for item in stop:
        if not isinstance(item, str):
            ids.append(int(item))
            continue
        if tokenizer is None:
            raise CookbookEnvError(f"{env_name}: stops on the string {item!r}; give the adapter the tokenizer")
        encoded = list(tokenizer.encode(item, add_special_tokens=False))
        if len(encoded) != 1:
            raise CookbookEnvError(
                f"{env_name}: its stop string {item!r} is {len(encoded)} tokens, and Mint stops on ids: a stop "
                "string must be one token"
            )
        ids.append(int(encoded[0]))
    return StopCondition(tuple(dict.fromkeys(ids)), max_tokens)


def _stop_reason(metrics: dict[str, float]) -> StopReason | None:
    for key, value in metrics.items():
        if key.startswith(_STOP_PREFIX) and value:
            return _STOP_REASONS.get(key[len(_STOP_PREFIX) :])
    return None


class CookbookEnv(Env):
    """One tinker-cookbook `Env` as a Mint `Env` (see the module doc for what is converted).

    env         their environment, single-use like Mint's
    max_tokens  each action's token budget (their stop conditions carry none)
    tokenizer   maps their stop strings to ids (`encode(text, add_special_tokens=False)`); needed only for strings
    """

    def __init__(self, env: cookbook.Env, max_tokens: int, tokenizer: Any = None):
        if max_tokens < 1:
            raise ValueError(f"CookbookEnv: max_tokens must be >= 1, got {max_tokens}")
        self.env, self.max_tokens, self.tokenizer = env, max_tokens, tokenizer
        self.name = type(env).__name__
        self.context: Tokens = []  # what the policy has seen: prompt, then actions and observations as appended
        self._stop: StopCondition | None = None
        # What their Trajectory needs and Mint's episode does not keep: each turn's observation as their env gave
        # it (the full context), whether each step said done, and the observation after the last step.
        self.observations: list[tinker.ModelInput] = []
        self.dones: list[bool] = []
        self.final_observation: tinker.ModelInput | None = None

    def _stop_condition(self, stop: Sequence[str | int]) -> StopCondition:
        return stop_condition(stop, self.max_tokens, self.tokenizer, self.name)

    async def initial_observation(self) -> tuple[Tokens, StopCondition]:
        from tinker_cookbook.rl.types import InitialObservationOverflow

        first = await self.env.initial_observation()
        if isinstance(first, InitialObservationOverflow):
            # Their loop ends such an episode with a synthetic turn; Mint's runner has no turn without an action,
            # and bounds the prompt by EpisodeLimits.context instead.
            raise CookbookEnvError(f"{self.name}: its initial prompt is over the environment's own token budget")
        observation, stop = first
        self.context = observation_ids(observation, self.name)
        self.observations.append(observation)
        self._stop = self._stop_condition(stop)
        return list(self.context), self._stop

    async def step(self, action: Tokens) -> StepResult:
        assert self._stop is not None, "step before initial_observation"
        finish = "stop" if action and action[-1] in self._stop.stop_tokens else "length"
        result = await self.env.step(list(action), extra={"stop_reason": finish})
        self.context += action
        self.dones.append(bool(result.episode_done))
        self.final_observation = result.next_observation
        metrics = {key: float(value) for key, value in result.metrics.items()}
        masked = bool(metrics.get(_MASKED_METRIC, 0.0))
        if result.episode_done:  # their last observation is not a context anyone samples from: nothing to append
            return StepResult(
                reward=float(result.reward),
                episode_done=True,
                metrics=metrics,
                stop_reason=_stop_reason(metrics),
                mask_action=masked,
            )
        full = observation_ids(result.next_observation, self.name)
        seen = len(self.context)
        if full[:seen] != self.context:
            pairs = zip(full, self.context, strict=False)  # the first differing position, for the message
            at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(full), seen))
            raise ContextRewritten(
                f"{self.name}: the context after turn {len(self.dones)} differs from what the policy saw at token "
                f"{at} of {seen} (the past was re-rendered); Mint trains only on what was sampled, so use a renderer "
                "and environment whose next context extends the last"
            )
        self.observations.append(result.next_observation)
        self.context = full
        self._stop = self._stop_condition(result.next_stop_condition)
        return StepResult(
            reward=float(result.reward),
            episode_done=False,
            next_observation=full[seen:],
            next_stop=self._stop,
            metrics=metrics,
            mask_action=masked,
        )


def trajectory(episode: Episode, env: CookbookEnv) -> cookbook.Trajectory:
    """Their record of one episode, from Mint's: per turn, the observation their env gave, the action's ids and
    logprobs as sampled, its reward, done flag and metrics."""
    import tinker
    from tinker_cookbook.completers import TokensWithLogprobs
    from tinker_cookbook.rl.types import Trajectory, Transition

    transitions = []
    for k, turn in enumerate(episode.turns):
        end = turn.start + turn.action
        action = TokensWithLogprobs(
            tokens=episode.tokens[turn.start : end],
            maybe_logprobs=episode.logprobs[turn.start : end],
            stop_reason="stop" if turn.finish_reason == "stop" else "length",
        )
        transitions.append(
            Transition(
                ob=env.observations[k],
                ac=action,
                reward=turn.reward,
                # a step that timed out never answered: the episode ended there all the same
                episode_done=env.dones[k] if k < len(env.dones) else True,
                metrics=dict(turn.metrics),
            )
        )
    final = env.final_observation if env.final_observation is not None else tinker.ModelInput.empty()
    reason = _THEIR_STOP_REASON.get(episode.stop_reason, episode.stop_reason.value)
    return Trajectory(transitions=transitions, final_ob=final, stop_reason=reason)


class CookbookGroupBuilder(EnvGroupBuilder):
    """One tinker-cookbook `EnvGroupBuilder` as Mint's: its environments wrapped in `CookbookEnv`, its group rewards
    computed on their `Trajectory` objects built from Mint's episodes, its logging tags as Mint's tags.

    A builder runs one group at a time (as `run_group` uses it): the group rewards are matched to the environments
    the last `make_envs` made.
    """

    def __init__(self, builder: cookbook.EnvGroupBuilder, max_tokens: int, tokenizer: Any = None):
        if max_tokens < 1:
            raise ValueError(f"CookbookGroupBuilder: max_tokens must be >= 1, got {max_tokens}")
        self.builder, self.max_tokens, self.tokenizer = builder, max_tokens, tokenizer
        self.envs: list[CookbookEnv] = []
        self.group_metrics: list[dict[str, float]] = []  # what compute_group_rewards returned beside each reward

    async def make_envs(self) -> Sequence[Env]:
        self.envs = [CookbookEnv(env, self.max_tokens, self.tokenizer) for env in await self.builder.make_envs()]
        return list(self.envs)

    async def group_rewards(self, episodes: Sequence[Episode]) -> list[float]:
        name = type(self.builder).__name__
        if len(episodes) != len(self.envs):
            raise CookbookEnvError(f"{name}: {len(episodes)} episodes for the {len(self.envs)} environments it made")
        try:
            trajectories = [trajectory(ep, env) for ep, env in zip(episodes, self.envs, strict=True)]
            pairs = await self.builder.compute_group_rewards(trajectories, [env.env for env in self.envs])
        finally:
            await self.builder.cleanup()
        if len(pairs) != len(episodes):
            raise CookbookEnvError(f"{name}: compute_group_rewards gave {len(pairs)} rewards for {len(episodes)}")
        self.group_metrics = [{key: float(value) for key, value in metrics.items()} for _, metrics in pairs]
        return [float(reward) for reward, _ in pairs]

    def tags(self) -> list[str]:
        return list(self.builder.logging_tags())
