"""The learner's work on one group (a prompt and its G responses): the two inner steps and what they share.

    naive      one padded full-sequence forward of the G sequences, then one backward
    longstraw  LongStraw: capture the prompt once without a graph, replay the responses with autograd in
               micro-batches sized by a memory budget, backward each, and (exact mode) back-propagate the prompt
               chunk by chunk

Both score with the same objective (`GroupObjective`: trust mask, PPO-clip with KL, global aggregation weights), so
in exact mode their gradients are equal (tests/test_inner_step.py holds them to 1e-6). DeepSpeed owns every backward
through `StepContext.backward`; nothing here sets DeepSpeed up (that is `mint.train.learner`).

Under expert parallel (`StepContext.lockstep`) the ranks of an EP group must issue the same MoE collectives while they
run different groups: the LongStraw step pads G with one-token stand-ins and runs through
`longstraw.expert_parallel.LockstepAdapter`, and the accumulation boundary moves to `StepContext.end_accumulation`
(docs/sharding.md, "Lockstep").

The loss of a step is a sum over tokens of weight x per-token objective, with weights from global counts (see
`mint.rl.grpo.token_weights`), so the micro-steps' backward passes add up to the gradient of the global loss.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from longstraw.adapters import adapter_for
from longstraw.context_parallel import cp_adapter_for
from longstraw.engine import PrefixCapture, UpdateSpec, capture_prefix, grpo_update
from longstraw.expert_parallel import Lockstep, LockstepAdapter, pad_responses
from longstraw.routing import ExpertLayout, GroupRoutes, RouteReplay
from longstraw.scoring import token_logprobs
from longstraw.trust import TrustCounts, icepop_status, out_of_route, trust_mask
from mint.config import Config, norm_constant
from mint.rl.grpo import LOG_RATIO_CLAMP, LossSpec, per_token_objective, token_weights


@dataclass(frozen=True)
class GroupBatch:
    """One prompt and its G responses, as the learner needs them (its tensors cross Ray as numpy arrays)."""

    prompt_tokens_P: torch.Tensor  # int64 [P]
    responses: list[torch.Tensor]  # G x int64 [R_i], stop token included
    rollout_logprobs: list[torch.Tensor]  # G x float32 [R_i], recorded by the rollout engine
    adv_G: torch.Tensor  # float32 [G]
    # R3: routes recorded by the rollout engine (None for a dense model or when the record is missing).
    prompt_routes_P1_L_K: torch.Tensor | None = None  # prompt positions 0..P-2
    routes: list[torch.Tensor | None] | None = None  # G x [R_i, L, k]; row j = the position that produced token j
    # DSA indexer replay: the rollout's selections, G x [R_i, indexer layers, index_topk] (None when not recorded).
    indexer: list[torch.Tensor | None] | None = None
    # Multi-turn episodes (mint.envs.episode): G x bool [R_i], True on the tokens that carry loss (sampled by the
    # policy), False on observation tokens, which are replayed as context only. None: every token was sampled.
    loss_masks: list[torch.Tensor] | None = None

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.responses]

    @property
    def loss_lengths(self) -> list[int]:
        """Tokens carrying loss per response: what the aggregation counts (token-mean, seq-mean, Dr. GRPO)."""
        if self.loss_masks is None:
            return self.lengths
        return [int(m.sum()) for m in self.loss_masks]

    def loss_mask(self, i: int) -> torch.Tensor:
        """bool [R_i]: response i's tokens that carry loss."""
        if self.loss_masks is None:
            return torch.ones(len(self.responses[i]), dtype=torch.bool)
        return self.loss_masks[i].bool()


@dataclass(frozen=True)
class MicroStep:
    group: GroupBatch
    real: bool  # False: a zero-weight copy that keeps ranks in lockstep


@dataclass(frozen=True)
class StepPlan:
    """What one rank does in one optimizer step, with the global counts that fix the loss weights."""

    micro_steps: list[MicroStep]
    total_tokens: int  # response tokens over all ranks
    total_seqs: int  # responses over all ranks
    step: int = 0  # the run's optimizer step this plan belongs to (1-based)


def loss_spec(config: Config) -> LossSpec:
    g = config.grpo
    return LossSpec(
        eps_low=g.eps_low, eps_high=g.eps_high, agg=g.loss_agg, norm_constant=norm_constant(config), kl_coef=g.kl_coef
    )


class ResidentCaptures:
    """resident mode's kept prefix captures, keyed by prompt tokens; an optimizer step keeps only its own prompts'."""

    def __init__(self):
        self._kept: dict[bytes, PrefixCapture] = {}
        self._used: set[bytes] = set()

    def get(self, model, tokens_P: torch.Tensor, chunk_size: int, device: torch.device) -> PrefixCapture:
        key = tokens_P.numpy().tobytes()
        self._used.add(key)
        if key not in self._kept:
            self._kept[key] = capture_prefix(model, tokens_P.to(device), chunk_size)
        return self._kept[key]

    def end_step(self) -> None:
        self._kept = {k: v for k, v in self._kept.items() if k in self._used}
        self._used = set()


def deepspeed_loss_scale(engine) -> float:
    """The factor DeepSpeed's engine.backward multiplies a loss by: the fp16 loss scale under a ZeRO optimizer
    (stages 1-3), else 1. (Stage 0's fp16 optimizer is not scaled in engine.backward; the config refuses fp16 there.)
    """
    if not engine.fp16_enabled():
        return 1.0
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    return float(engine.optimizer.loss_scale) if isinstance(engine.optimizer, ZeROOptimizer) else 1.0


@dataclass
class StepContext:
    """What an inner step needs from its learner rank."""

    engine: Any  # the DeepSpeed engine: forward, .module (the PEFT model), backward, accumulation boundary
    config: Config
    spec: LossSpec
    layout: ExpertLayout | None
    device: torch.device
    world_size: int
    captures: ResidentCaptures = field(default_factory=ResidentCaptures)
    vocab_limit: int | None = None  # score only ids below it (a padded head), as the rollout engine samples
    # Expert parallel: keeps this rank's MoE collectives in step with its EP group's (None without EP).
    lockstep: Lockstep | None = None
    # Context parallel: this rank's CP group (None without CP) and its size C (mint.train.context_parallel).
    cp_group: Any = None
    context_parallel: int = 1

    def backward(self, loss: torch.Tensor, boundary: bool, carries_scale: bool = False) -> None:
        """DeepSpeed's backward, with the accumulation boundary set first (gradients reduce on the boundary).

        carries_scale: the scalar was built from gradients of earlier backward calls (LongStraw's prompt surrogate
        <out, dL/dout>), which already carry DeepSpeed's fp16 loss scale S; engine.backward multiplies by S again,
        so it is divided out here. Without this the prompt path's gradient came out S times too large.

        Under expert parallel no inner backward is a boundary: a rank may still serve its EP peers' backward after
        its own last one, so the reduction waits for `end_accumulation`, which every rank calls at the same point.
        """
        self.engine.set_gradient_accumulation_boundary(boundary and self.lockstep is None)
        if carries_scale:
            loss = loss / deepspeed_loss_scale(self.engine)
        self.engine.backward(loss)

    def end_accumulation(self) -> None:
        """Expert parallel: the boundary backward (a zero loss) after every rank's micro-steps, so DeepSpeed reduces
        the accumulated gradients once, with the ranks in step. Nothing to do without EP (the last micro-step's
        backward was the boundary)."""
        if self.lockstep is None:
            return
        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        zero = sum(p.reshape(-1)[:1].sum() for p in params) * 0.0
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.backward(zero)

    def micro_weight(self, micro: MicroStep) -> float:
        # DeepSpeed averages gradients over ranks; scaling by world size turns that into the global sum. Padding
        # micro-steps (real=False) run forward and backward for lockstep but weigh nothing. Under context parallel
        # the C ranks of a CP group each hold the whole gradient of the same groups: weigh by N / C.
        return float(self.world_size // self.context_parallel) if micro.real else 0.0

    def group_routes(self, group: GroupBatch) -> GroupRoutes | None:
        """R3 bookkeeping for the group, or None for a dense model (every status 0, nothing replayed)."""
        if self.layout is None:
            return None
        return GroupRoutes.build(
            group.prompt_routes_P1_L_K,
            group.routes,
            len(group.prompt_tokens_P),
            group.lengths,
            self.layout,
            replay=self.config.grpo.r3,
        )


def _statuses(group: GroupBatch, routes: GroupRoutes | None) -> list[torch.Tensor]:
    return routes.status_G if routes is not None else [torch.zeros(n, dtype=torch.long) for n in group.lengths]


def _kept_only(kept_R: torch.Tensor, logp_R, behaviour_R, ref_R):
    """(logp, behaviour, ref) for `per_token_objective`, fp32, with every masked token's logprobs selected to 0.

    kept_R: bool [R]; logp_R [R] (autograd), behaviour_R [R], ref_R [R] or None.
    A masked token then has log-ratio 0 and KL 0 exactly, and torch.where's backward gives its logp a gradient of
    exactly 0. Multiplying its term by 0 afterwards is not enough: with the rollout's logprob at -100 (or -inf) and
    the learner's at -2, exp(98) = 3.6e42 overflows fp32 (max 3.4e38) to inf, so the loss is inf x 0 = nan when
    A < 0, and for either sign exp's backward multiplies the 0 that reaches it by that inf (nan in every LoRA grad).
    """
    zero = torch.zeros((), dtype=torch.float32, device=logp_R.device)
    logp_R = torch.where(kept_R, logp_R.float(), zero)
    behaviour_R = torch.where(kept_R, behaviour_R.detach().float(), zero)
    ref_R = torch.where(kept_R, ref_R.detach().float(), zero) if ref_R is not None else None
    return logp_R, behaviour_R, ref_R


class GroupObjective:
    """The per-response objective of one group, shared by both inner steps: trust mask (R3 x IcePop), PPO-clip
    with KL, the global aggregation weight; and the group's stats."""

    def __init__(self, ctx: StepContext, group: GroupBatch, plan: StepPlan, route_status_G: list[torch.Tensor]):
        self.ctx, self.group = ctx, group
        self.route_status_G = route_status_G
        lengths = group.loss_lengths  # observation tokens are context, not counted
        self.weights_G = token_weights(lengths, ctx.spec, plan.total_tokens, plan.total_seqs)
        self.sums = dict(loss=0.0, kl=0.0, clipped=0.0, tokens=float(sum(lengths)), seqs=float(len(lengths)))
        self.trust = TrustCounts()

    def response_loss(self, i: int, logp_R, ref_R, old, native_R_L_K) -> torch.Tensor:
        """Response i's weighted loss contribution; masked tokens contribute 0 and are counted by reason."""
        group, grpo = self.group, self.ctx.config.grpo
        device = logp_R.device
        old_R = old[i].to(device) if old is not None else logp_R.detach()
        rollout_R = group.rollout_logprobs[i].to(device)
        # The trust mask judges sampled tokens only (S of them): an observation token has no rollout logprob to
        # compare with and is never counted as masked; it carries no loss either way.
        sampled_R = group.loss_mask(i).to(device)
        old_S, rollout_S = old_R[sampled_R], rollout_R[sampled_R]
        ratio_status = icepop_status(old_S, rollout_S, grpo.icepop_alpha, grpo.icepop_beta) if grpo.icepop else None
        status_R = self.route_status_G[i] if grpo.r3 else torch.zeros_like(self.route_status_G[i])
        mask_S, counts = trust_mask(status_R.to(device)[sampled_R], ratio_status, old_S, rollout_S)
        self.trust.add(counts)
        mask_R = torch.zeros_like(sampled_R)
        mask_R[sampled_R] = mask_S.bool()
        if native_R_L_K is not None:
            self.count_out_of_route(i, native_R_L_K)
        adv_R = group.adv_G[i].to(device).expand_as(logp_R)
        # Off-policy (rollout.max_staleness > 0): the samples came from an older revision, so the PPO ratio is taken
        # against the rollout's logprobs (the behaviour policy); on-policy the learner's own first pass is used.
        behaviour_R = rollout_R if self.ctx.config.rollout.max_staleness else old_R
        kept = mask_R.bool()
        logp_R, behaviour_R, ref_R = _kept_only(kept, logp_R, behaviour_R, ref_R)
        weight_R = None
        if grpo.tis_cap > 0 and not self.ctx.config.rollout.max_staleness:
            # On-policy the ratio is against the learner's own first pass, so the rollout engine's mismatch is
            # corrected here (off-policy the PPO ratio is already against the rollout's logprobs).
            log_w = torch.where(kept, old_R.float() - rollout_R.float(), 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            weight_R = log_w.exp().clamp(max=grpo.tis_cap)
        loss_R, st = per_token_objective(logp_R, behaviour_R, adv_R, self.ctx.spec, ref_R, weight_R)
        # A masked token's term is now finite (ratio 1: -A) but not 0; selecting drops it and its gradient.
        contribution = self.weights_G[i].to(device) * torch.where(kept, loss_R, 0.0).sum()
        self.sums["loss"] += float(contribution.detach())
        self.sums["kl"] += float(st["kl_T"][kept].sum())
        self.sums["clipped"] += float(st["clipped_T"][kept].float().sum())
        return contribution

    def count_out_of_route(self, i: int, native_R_L_K: torch.Tensor) -> None:
        """Count response i's tokens whose routers, left to themselves, picked other experts than the rollout did."""
        group = self.group
        if group.routes is not None and group.routes[i] is not None:
            # Only positions with a usable route are compared; a malformed payload has none (all statuses nonzero).
            status = self.route_status_G[i]
            out, routed = out_of_route(native_R_L_K.cpu(), group.routes[i], status)
            self.trust.out_of_route += out
            self.trust.routed += routed

    def stats(self) -> dict:
        return {**self.sums, "trust": self.trust}


# ---- naive: one padded full-sequence forward ------------------------------------------------------------------------


def _score_padded(
    ctx: StepContext,
    group: GroupBatch,
    with_grad: bool,
    adapter: bool = True,
    routes: GroupRoutes | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Logprobs of each response under the model (G x [R_i], fp32), and the routers' native ids [G*S, L, k].

    The G sequences prompt + response[:-1] are right-padded into one [G, S = P + R_max - 1] batch: with causal
    attention, padding after a sequence cannot reach its real positions, so no attention mask is needed. Only the
    last R_max positions produce logits (logits_to_keep), never [P, V]. With `routes`, every router uses the recorded
    expert ids of the positions that have a mappable route (R3).
    """
    tokens_P, lengths = group.prompt_tokens_P, group.lengths
    r_max = max(lengths)
    input_ids = torch.zeros(len(lengths), len(tokens_P) + r_max - 1, dtype=torch.long)
    targets_G_R = torch.zeros(len(lengths), r_max, dtype=torch.long)
    for i, resp in enumerate(group.responses):
        seq = torch.cat([tokens_P, resp[:-1]])
        input_ids[i, : len(seq)] = seq
        targets_G_R[i, : len(resp)] = resp
    input_ids, targets_G_R = input_ids.to(ctx.device), targets_G_R.to(ctx.device)
    native = None
    with torch.set_grad_enabled(with_grad), contextlib.ExitStack() as stack:
        if not adapter:
            stack.enter_context(ctx.engine.module.disable_adapter())
        if routes is not None:
            hooks = stack.enter_context(RouteReplay(ctx.engine.module))
            hooks.set(*routes.padded())
        logits = ctx.engine(input_ids=input_ids, logits_to_keep=r_max, use_cache=False).logits
        if routes is not None:
            native = hooks.native().cpu()
        logp_G_R = token_logprobs(logits[..., : ctx.vocab_limit], targets_G_R, ctx.config.rollout.temperature)
    # The kept window starts at position P-1, which predicts response token 0, for every row.
    return [logp_G_R[i, :n] for i, n in enumerate(lengths)], native


def naive_group_step(ctx: StepContext, micro: MicroStep, plan: StepPlan, old: list[torch.Tensor] | None, last: bool):
    """One padded full-sequence forward for the group's G responses, then one backward. Returns (stats, logp)."""
    group = micro.group
    routes = ctx.group_routes(group)
    logp, native = _score_padded(ctx, group, with_grad=True, routes=routes)
    ref = None
    if ctx.spec.kl_coef > 0:
        ref, _ = _score_padded(ctx, group, with_grad=False, adapter=False, routes=routes)
    objective = GroupObjective(ctx, group, plan, _statuses(group, routes))
    loss = torch.zeros((), device=ctx.device)
    for i, logp_R in enumerate(logp):
        native_R = routes.response_rows(native, i) if native is not None else None
        loss = loss + objective.response_loss(i, logp_R, ref[i] if ref is not None else None, old, native_R)
    ctx.backward(loss * ctx.micro_weight(micro), boundary=last)
    return objective.stats(), logp


# ---- longstraw: capture once, replay each response ------------------------------------------------------------------


def longstraw_group_step(
    ctx: StepContext, micro: MicroStep, plan: StepPlan, old: list[torch.Tensor] | None, last: bool
):
    """LongStraw: capture the prompt once, replay the responses with autograd in micro-batches (longstraw.replay:
    as many per forward as `longstraw.replay_budget_mb` allows), one backward each."""
    group = micro.group
    routes = ctx.group_routes(group)
    # With R3 off every ok is False: the routers run natively, and the replay still measures out-of-route.
    sequence = routes.sequence() if routes is not None else None
    objective = GroupObjective(ctx, group, plan, _statuses(group, routes))
    weight = ctx.micro_weight(micro)
    logp: list[torch.Tensor | None] = [None] * len(group.responses)

    def response_objective(i: int, logp_R: torch.Tensor, ref_R: torch.Tensor | None):
        if i >= len(logp):  # an expert-parallel stand-in: its backward only keeps the EP group in step
            return logp_R.sum() * 0.0, {}
        logp[i] = logp_R.detach()
        return objective.response_loss(i, logp_R, ref_R, old, None) * weight, {}

    def backward(loss: torch.Tensor, final: bool, carries_scale: bool = False) -> None:
        ctx.backward(loss, boundary=last and final, carries_scale=carries_scale)

    indexer = list(group.indexer) if ctx.config.grpo.indexer_replay and group.indexer is not None else None
    adapter = None
    if ctx.cp_group is not None:  # context parallel: this rank keeps its pages of the prompt only
        adapter = cp_adapter_for(ctx.engine.module, ctx.cp_group)
    responses = [r.to(ctx.device) for r in group.responses]
    if ctx.lockstep is not None:
        # Expert parallel: every rank of the EP group replays as many responses (one-token stand-ins that weigh
        # nothing), and the lockstep adapter pads the chunked phases (docs/sharding.md, "Lockstep").
        adapter = LockstepAdapter(adapter or adapter_for(ctx.engine.module), ctx.lockstep)
        extra = pad_responses(ctx.lockstep, responses)
        responses += [responses[0][:1]] * extra
        if indexer is not None:
            indexer += [None] * extra  # stand-ins keep the learner's own selection
        if sequence is not None and extra:
            # A stand-in is response 0's first position again, so it replays that position's route (R3 keeps
            # every token on its recorded experts).
            routes_R_L_K, ok_R = sequence.responses[0]
            sequence.responses.extend([(routes_R_L_K[:1], ok_R[:1])] * extra)

    ls = ctx.config.longstraw
    spec = UpdateSpec(
        mode=ls.mode,
        chunk_size=ls.chunk_size,
        temperature=ctx.config.rollout.temperature,
        need_ref=ctx.spec.kl_coef > 0,
        max_prefix_age=ls.max_prefix_age,
        checkpoint_min_tokens=ls.checkpoint_min_tokens,
        vocab_limit=ctx.vocab_limit,
        kernels=ls.kernels,
        replay_budget_bytes=int(ls.replay_budget_mb * 2**20),
        # The update's own metrics are not read here. Measuring them cost 8 to 10 CUDA synchronizes per group (two
        # per timed phase, two for its peak meter) and reset the device peak the learner meters over the whole step.
        measure=False,
    )
    model = ctx.engine.module
    capture = None
    if ls.mode == "resident":
        capture = ctx.captures.get(model, group.prompt_tokens_P, ls.chunk_size, ctx.device)
    metrics = grpo_update(
        model,
        group.prompt_tokens_P.to(ctx.device),
        responses,
        response_objective,
        spec,
        adapter=adapter,
        capture=capture,
        backward=backward,
        routes=sequence,
        indexer=indexer,
    )
    objective.trust.indexer_replayed += metrics.indexer_replayed
    objective.trust.indexer_mismatched += metrics.indexer_mismatched
    if metrics.native_routes is not None:  # what the routers picked on their own, response by response
        for i in range(len(logp)):
            objective.count_out_of_route(i, metrics.native_routes[i])
    return objective.stats(), logp


INNER_STEPS = {"naive": naive_group_step, "longstraw": longstraw_group_step}
