"""A rollout engine as an episode policy (mint.envs.episode.Policy): the actions of concurrent episodes are sampled
together, in one decode batch of the built-in engine or one round of concurrent requests to the engine servers.

Token in, token out on every backend: each request carries the episode's context as ids (never a chat re-rendered),
and the HTTP backends name the run's adapter on every request (mint.rollout.backends), so no turn of an episode is
sampled by the bare base.

Episodes ask for actions at different moments: one waits on a tool while another is ready. `EnginePolicy` collects
the requests that arrive together and hands them to `RolloutEngine.generate_groups` as one batch (one group of one
row per episode): it runs once every live episode is waiting, or `window_s` after the first request of a batch, so a
slow tool holds the others back by at most that long.

This policy prefills each request's whole context, every turn: the engine keeps no state between calls. Keeping an
episode's K/V across turns and prefilling only the new observation is the engine's next step; until then the
episode's record is the same either way (the sampled ids, their logprobs, each turn's revision), only slower.

Routes (R3 over the whole episode) follow the engine's route convention: row p is the routing of the forward whose
input is the token at position p. Each call returns rows for its context (its prefill) and for its sampled tokens
(the decode that produced them); the policy keeps, per episode, the rows of positions it does not hold yet, so every
position's row comes from the first forward that computed it: a sampled token's from the decode that sampled it, an
observation's from the prefill of the turn after it. `release` returns them concatenated, [P + T - 1, layers, k];
`group_rollout` checks they cover every position once.

`group_rollout` turns a group's episodes into the GroupRollout a single-turn group would be, which is what the
trainer carries to the learner: the prompt is the part of the initial observations all G share (normally all of it:
one task, G attempts), each completion the rest of its episode: what is left of its initial observation (if any),
then its actions and observations in order, with `loss_mask_R` True on the sampled tokens of unmasked actions. The
prompt's route rows come from the first episode (the others computed the same prompt).

Sampling is deterministic for a fixed seed and arrival order. On the built-in engine episode n (in the order of
their first request) draws from a generator seeded with `group_seed(seed, n)`, which lives as long as the episode; an
engine server takes a seed per request instead, request i of the policy's b-th batch (b = 1, 2, ...) getting
`group_seed(group_seed(seed, -b), i)`.

An engine server may return no routes for a request (one started without route recording, or a prefix it served
from its cache): the episode's routes then have a gap, and the whole episode goes to the learner without routes (R3
masks and counts its tokens as route_missing) rather than with rows shifted onto the wrong positions.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from mint.envs.env import EnvGroupBuilder, StopCondition, StopReason, Tokens
from mint.envs.episode import Episode, EpisodeLimits, Sample, run_group
from mint.errors import MintError
from mint.rollout._sampling import SamplingParams, group_seed
from mint.rollout.backends.base import RolloutBackend
from mint.rollout.engine import Completion, GroupRollout, RolloutEngine

ENV_ENDED = (StopReason.COMPLETED, StopReason.PARSE_ERROR, StopReason.TOOL_ERROR)


@dataclass
class _Request:
    key: Hashable
    context: Tokens
    stop: StopCondition
    done: asyncio.Future


class EnginePolicy:
    def __init__(
        self,
        engine: RolloutEngine | RolloutBackend,
        revision: str,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        window_s: float = 0.005,
    ):
        self.engine = engine
        self.revision = revision
        self.temperature, self.top_p = temperature, top_p
        self.seed = seed
        self.window_s = window_s
        self._generators: dict[Hashable, torch.Generator] = {}
        self._routes: dict[Hashable, list[torch.Tensor]] = {}  # per episode: route rows held, in position order
        self._positions: dict[Hashable, int] = {}  # per episode: the positions whose rows are held (0..n-1)
        self._gaps: set[Hashable] = set()  # episodes a request returned no routes for (after some did)
        self._started = 0
        self._pending: list[_Request] = []
        self._flush: asyncio.TimerHandle | None = None
        self.batches = 0  # decode batches run (a test reads how many requests shared one)

    async def sample(self, key: Hashable, context: Tokens, stop: StopCondition) -> Sample:
        if key not in self._generators:
            generator = None
            if isinstance(self.engine, RolloutEngine):
                generator = torch.Generator(device=self.engine.device)
                generator.manual_seed(group_seed(self.seed, self._started))
            self._generators[key] = generator
            self._started += 1
        loop = asyncio.get_running_loop()
        request = _Request(key, list(context), stop, loop.create_future())
        self._pending.append(request)
        # Checked once the tasks already scheduled have run: the episodes of a group started together all reach
        # their first sample() before it, and so go out in one batch.
        loop.call_soon(self._run_if_all_wait)
        if self._flush is None:
            self._flush = loop.call_later(self.window_s, self._run_pending)
        return await request.done

    async def release(self, key: Hashable) -> torch.Tensor | None:
        """Forget the episode; returns its routes, [positions, layers, k] (None on a dense base)."""
        self._generators.pop(key, None)
        asyncio.get_running_loop().call_soon(self._run_if_all_wait)
        rows = self._routes.pop(key, None)
        self._positions.pop(key, None)
        if key in self._gaps:
            self._gaps.discard(key)
            return None
        return torch.cat(rows) if rows else None

    def _run_if_all_wait(self) -> None:
        if self._pending and len(self._pending) == len(self._generators):  # no live episode is left to wait for
            self._run_pending()

    def _run_pending(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            samples = self._decode(batch)
        except Exception as err:  # every waiting episode sees the engine's error
            for request in batch:
                request.done.set_exception(err)
            return
        for request, sample in zip(batch, samples, strict=True):
            request.done.set_result(sample)

    def _decode(self, batch: list[_Request]) -> list[Sample]:
        """One decode batch per distinct stop condition (the engine takes one SamplingParams per call)."""
        self.batches += 1
        samples: list[Sample | None] = [None] * len(batch)
        by_stop: dict[StopCondition, list[int]] = {}
        for i, request in enumerate(batch):
            by_stop.setdefault(request.stop, []).append(i)
        for stop, rows in by_stop.items():
            params = SamplingParams(self.temperature, self.top_p, stop.max_tokens, stop.stop_tokens)
            contexts = [batch[i].context for i in rows]
            if isinstance(self.engine, RolloutEngine):
                groups = self.engine.generate_groups(
                    contexts, 1, params, [self._generators[batch[i].key] for i in rows]
                )
            else:  # an engine server: a seed per request, from this batch's own
                groups = self.engine.generate(contexts, 1, params, group_seed(self.seed, -self.batches))
            for i, group in zip(rows, groups, strict=True):
                (completion,) = group.completions
                self._keep_routes(batch[i], group)
                samples[i] = Sample(
                    tokens=completion.tokens_R.tolist(),
                    logprobs=completion.logprobs_R.tolist(),
                    revision=self.revision,
                    finish_reason=completion.finish_reason,
                )
        return samples

    def _keep_routes(self, request: _Request, group) -> None:
        """Keep the rows of the positions this episode's record lacks: the new context positions from the prefill
        (the observation, and the last token of the previous action), then the decode's rows of the sampled tokens."""
        (completion,) = group.completions
        if group.prompt_routes_P1_L_K is None or completion.routes_R_L_K is None:
            if request.key in self._routes or completion.routes_R_L_K is not None:
                self._gaps.add(request.key)  # some positions have rows and these do not: never shift rows
            return
        held = self._positions.get(request.key, 0)
        C = len(request.context)
        if held > C - 1:
            raise RuntimeError(f"episode {request.key!r}: the context shrank below the routes already held")
        rows = self._routes.setdefault(request.key, [])
        rows += [group.prompt_routes_P1_L_K[held : C - 1], completion.routes_R_L_K]
        self._positions[request.key] = C - 1 + len(completion.tokens_R)


def shared_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """The length of the longest prefix all `prompts` share."""
    shortest = min(len(p) for p in prompts)
    n = 0
    while n < shortest and all(p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


def group_rollout(episodes: Sequence[Episode]) -> GroupRollout:
    """A group's episodes as one GroupRollout (prompt shared, each tail a masked completion); see the module doc."""
    if not episodes:
        raise MintError("group_rollout: a group needs at least one episode")
    if any(not ep.tokens for ep in episodes):
        raise MintError("group_rollout: an episode ended before its first action; there is nothing to train on")
    P = shared_prefix([ep.prompt for ep in episodes])
    if P < 1:
        raise MintError("group_rollout: the group's initial observations share no first token; LongStraw needs one")
    completions = []
    for ep in episodes:
        rest = ep.prompt[P:]
        routes = None
        if ep.routes is not None:
            positions = len(ep.prompt) + len(ep.tokens) - 1
            if ep.routes.shape[0] != positions:
                raise MintError(
                    f"group_rollout: {ep.routes.shape[0]} route rows for {positions} positions; a policy's record "
                    "must cover every position once"
                )
            routes = ep.routes[P - 1 :]
        completions.append(
            Completion(
                tokens_R=torch.tensor(rest + ep.tokens, dtype=torch.int64),
                logprobs_R=torch.tensor([math.nan] * len(rest) + ep.logprobs, dtype=torch.float32),
                routes_R_L_K=routes,
                # "stop" when the environment ended the episode, "length" when a limit of the runner's did
                finish_reason="stop" if ep.stop_reason in ENV_ENDED else "length",
                loss_mask_R=torch.tensor([0] * len(rest) + ep.loss_mask, dtype=torch.bool),
            )
        )
    routed = [ep for ep in episodes if ep.routes is not None]  # an episode without routes: R3 masks its tokens
    prompt_routes = routed[0].routes[: P - 1] if routed else None
    return GroupRollout(torch.tensor(episodes[0].prompt[:P], dtype=torch.int64), prompt_routes, completions)


def sample_episodes(
    policy: EnginePolicy, builders: Sequence[EnvGroupBuilder], limits: EpisodeLimits
) -> list[list[Episode]]:
    """Every group's episodes, all groups at once (their actions share the policy's decode batches)."""

    async def run_all():
        return await asyncio.gather(*(run_group(b, policy, limits, key=i) for i, b in enumerate(builders)))

    return [list(group) for group in asyncio.run(run_all())]
