"""A group's episodes as the learner's batch: the shared prompt once, each episode's tail as a masked response.

LongStraw captures a group's prompt once and replays the G responses over it. For episodes, the prompt is the part of
the initial observations all G share (normally all of it: one task, G attempts), and each tail holds what follows:
the rest of its initial observation (if any), then its actions and observations in order. `loss_masks` is the
episode's own mask there (1 on sampled tokens of unmasked actions), 0 on the initial observation's rest.

Routes (R3) are the policy's rows, one per position of the episode's forward (mint.rollout.episodes): the first P-1
go to the prompt, the rest to the tail, row j of the tail being the forward that produced its token j, as the
learner's route convention has it. Episodes without routes (a dense base) give none. The prompt's rows are taken from
the first episode; the others computed the same prompt and, past a numerical tie, the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mint.envs.episode import Episode
from mint.errors import MintError
from mint.train.inner_step import GroupBatch


def shared_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """The length of the longest prefix all `prompts` share."""
    shortest = min(len(p) for p in prompts)
    n = 0
    while n < shortest and all(p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


def episode_batch(episodes: Sequence[Episode], adv_G: torch.Tensor) -> GroupBatch:
    """The learner's GroupBatch for one group of episodes; `adv_G` [G] their advantages."""
    if not episodes:
        raise MintError("episode_batch: a group needs at least one episode")
    if any(not ep.tokens for ep in episodes):
        raise MintError("episode_batch: an episode with no action cannot be trained on (it ended before its first)")
    P = shared_prefix([ep.prompt for ep in episodes])
    if P < 1:
        raise MintError("episode_batch: the group's initial observations share no first token; LongStraw needs one")
    responses, logprobs, masks, routes = [], [], [], []
    for ep in episodes:
        rest = ep.prompt[P:]
        responses.append(torch.tensor(rest + ep.tokens, dtype=torch.int64))
        logprobs.append(torch.tensor([math.nan] * len(rest) + ep.logprobs, dtype=torch.float32))
        masks.append(torch.tensor([0] * len(rest) + ep.loss_mask, dtype=torch.bool))
        if ep.routes is not None:
            positions = len(ep.prompt) + len(ep.tokens) - 1
            if ep.routes.shape[0] != positions:
                raise MintError(
                    f"episode_batch: {ep.routes.shape[0]} route rows for {positions} positions; the policy's record "
                    "must cover every position once"
                )
            routes.append(ep.routes[P - 1 :])
    with_routes = len(routes) == len(episodes)
    return GroupBatch(
        prompt_tokens_P=torch.tensor(episodes[0].prompt[:P], dtype=torch.int64),
        responses=responses,
        rollout_logprobs=logprobs,
        adv_G=adv_G.to(torch.float32),
        prompt_routes_P1_L_K=episodes[0].routes[: P - 1] if with_routes else None,
        routes=routes if with_routes else None,
        loss_masks=masks,
    )
