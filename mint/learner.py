"""The learner group: N Ray actors forming one torch.distributed group, each a DeepSpeed engine over a PEFT model.

One optimizer step (per epoch) works group by group: each micro-step runs the G responses of one prompt through
the model, scores them, and calls backward; the engine reduces gradients across ranks on the last micro-step and
steps. Every rank runs the same number of micro-steps (the driver pads with zero-weight copies), because ZeRO-3
gathers parameters collectively inside forward and a rank that skipped one would hang the others.

The loss of a step is a sum over tokens of weight x per-token objective, with weights from global counts (see
`mint.grpo.token_weights`), so the micro-steps' backward passes add up to the gradient of the global loss.
"""

from __future__ import annotations

import contextlib
import os
import resource
from dataclasses import dataclass

import ray
import torch

from longstraw.routing import RouteReplay
from longstraw.scoring import token_logprobs
from longstraw.trust import ExpertLayout, TrustCounts, icepop_status, out_of_route, route_status, trust_mask
from mint.config import Config, norm_constant
from mint.grpo import LossSpec, per_token_objective, token_weights


@dataclass(frozen=True)
class GroupBatch:
    """One prompt and its G responses, as the learner needs them."""

    prompt_tokens_P: torch.Tensor  # int64 [P]
    responses: list[torch.Tensor]  # G x int64 [R_i], stop token included
    rollout_logprobs: list[torch.Tensor]  # G x float32 [R_i], recorded by the rollout engine
    adv_G: torch.Tensor  # float32 [G]
    # R3: routes recorded by the rollout engine (None for a dense model or when the record is missing).
    prompt_routes_P1_L_K: torch.Tensor | None = None  # prompt positions 0..P-2
    routes: list[torch.Tensor | None] | None = None  # G x [R_i, L, k]; row j = the position that produced token j


@dataclass
class _Replay:
    """R3 inputs for one padded forward: recorded ids per flattened position, which positions replay them, and the
    routers' native choices (filled by the forward)."""

    routes_T_L_K: torch.Tensor
    ok_T: torch.Tensor
    native_T_L_K: torch.Tensor | None = None


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


def loss_spec(config: Config) -> LossSpec:
    g = config.grpo
    return LossSpec(
        eps_low=g.eps_low, eps_high=g.eps_high, agg=g.loss_agg, norm_constant=norm_constant(config), kl_coef=g.kl_coef
    )


def _deepspeed_config(config: Config) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        # Accumulation boundaries are set explicitly per micro-step (groups per rank vary by step).
        "gradient_accumulation_steps": 1,
        "gradient_clipping": config.learner.grad_clip,
        "zero_optimization": {"stage": config.learner.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": config.model.dtype == "bfloat16"},
        "fp16": {"enabled": config.model.dtype == "float16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _max_abs_diff(logp: list[torch.Tensor], rollout_logp: list[torch.Tensor]) -> float:
    return max(float((a.detach().cpu() - b).abs().max()) for a, b in zip(logp, rollout_logp, strict=True))


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class LearnerActor:
    """One data-parallel rank of the learner: frozen base + LoRA, wrapped by DeepSpeed."""

    def __init__(self, config: Config, model_path: str, rank: int, world_size: int):
        self.config = config
        self.model_path = model_path
        self.rank = rank
        self.world_size = world_size
        self.use_cuda = config.ray.learner_gpus > 0 and torch.cuda.is_available()
        torch.set_num_threads(config.ray.torch_threads)

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port: rank 0 hosts the torch.distributed rendezvous."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the process group, load base + LoRA, and wrap it in DeepSpeed. Every rank calls this at once."""
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",
        )
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if self.use_cuda else "cpu")
        import deepspeed
        import deepspeed.ops

        # DeepSpeed's CPU accelerator compiles a shared-memory all-reduce op on first use (about 30 s of g++ on a
        # fresh machine); gloo does the same job for LoRA-sized gradients.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="nccl" if self.use_cuda else "gloo", auto_mpi_discovery=False)

        from transformers import AutoConfig

        from mint.lora import add_lora
        from mint.models import load_model, moe_layout

        config = self.config
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.use_cuda else torch.device("cpu")
        self.spec = loss_spec(config)
        moe = moe_layout(AutoConfig.from_pretrained(self.model_path))
        self.layout = None if moe is None else ExpertLayout(moe.num_layers, moe.num_experts, moe.top_k)
        model = add_lora(load_model(self.model_path, config.model.dtype), config.lora, config.grpo.seed)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=config.learner.lr, weight_decay=config.learner.weight_decay)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_deepspeed_config(config))
        self._deepspeed = deepspeed
        self.steps_done = 0
        return self.rank

    # ---- scoring -------------------------------------------------------------------------------------------------

    def _score_group(
        self, group: GroupBatch, with_grad: bool, adapter: bool = True, replay: _Replay | None = None
    ) -> list[torch.Tensor]:
        """Logprobs of each response under the model: G x [R_i], fp32.

        The G sequences prompt + response[:-1] are right-padded into one [G, P + R_max - 1] batch: with causal
        attention, padding after a sequence cannot reach its real positions, so no attention mask is needed. Only
        the last R_max positions produce logits (logits_to_keep), never [P, V]. With `replay`, every router uses
        the recorded expert ids of the positions that have a mappable route (R3).
        """
        tokens_P = group.prompt_tokens_P
        lengths = [len(r) for r in group.responses]
        r_max = max(lengths)
        seq_len = len(tokens_P) + r_max - 1
        input_ids = torch.zeros(len(lengths), seq_len, dtype=torch.long)
        targets_G_R = torch.zeros(len(lengths), r_max, dtype=torch.long)
        for i, resp in enumerate(group.responses):
            seq = torch.cat([tokens_P, resp[:-1]])
            input_ids[i, : len(seq)] = seq
            targets_G_R[i, : len(resp)] = resp
        input_ids, targets_G_R = input_ids.to(self.device), targets_G_R.to(self.device)
        with torch.set_grad_enabled(with_grad), contextlib.ExitStack() as stack:
            if not adapter:
                stack.enter_context(self.engine.module.disable_adapter())
            if replay is not None:
                hooks = stack.enter_context(RouteReplay(self.engine.module))
                hooks.set(replay.routes_T_L_K, replay.ok_T)
            logits = self.engine(input_ids=input_ids, logits_to_keep=r_max, use_cache=False).logits
            if replay is not None:
                replay.native_T_L_K = hooks.native().cpu()
            logp_G_R = token_logprobs(logits, targets_G_R, self.config.rollout.temperature)
        # The kept window starts at position P-1, which predicts response token 0, for every row.
        return [logp_G_R[i, :n] for i, n in enumerate(lengths)]

    def _replay_inputs(self, group: GroupBatch) -> tuple[_Replay | None, list[torch.Tensor]]:
        """R3 inputs for the padded [G, P + R_max - 1] batch, and each response token's route status [R_i].

        Status 0 means the token's producing position has a mappable route; see longstraw.trust for the reasons.
        Without a MoE layout (dense model) every status is 0 and nothing is replayed.
        """
        lengths = [len(r) for r in group.responses]
        if self.layout is None:
            return None, [torch.zeros(n, dtype=torch.long) for n in lengths]
        num_prompt = len(group.prompt_tokens_P)
        seq_len = num_prompt + max(lengths) - 1
        layout = self.layout
        routes_G_S_L_K = torch.zeros(len(lengths), seq_len, layout.num_layers, layout.top_k, dtype=torch.long)
        ok_G_S = torch.zeros(len(lengths), seq_len, dtype=torch.bool)
        statuses = []
        for i, n in enumerate(lengths):
            recorded = group.routes[i] if group.routes is not None else None
            full = None
            if group.prompt_routes_P1_L_K is not None and recorded is not None:
                try:
                    full = torch.cat([group.prompt_routes_P1_L_K, recorded])
                except (RuntimeError, TypeError):
                    full = None  # shapes or dtypes that do not even concatenate: counted as missing
            status_S = route_status(full, num_prompt - 1 + n, layout)
            statuses.append(status_S[num_prompt - 1 :])
            if self.config.grpo.r3 and full is not None:
                ok = status_S == 0
                routes_G_S_L_K[i, : len(ok)][ok] = full[ok].long()
                ok_G_S[i, : len(ok)] = ok
        replay = _Replay(routes_G_S_L_K.flatten(0, 1), ok_G_S.flatten())
        return replay, statuses

    # ---- one optimizer step --------------------------------------------------------------------------------------

    def step(self, plan: StepPlan) -> dict:
        """Run the plan's micro-steps for each epoch, reduce, and step the optimizer. Returns this rank's sums."""
        sums = dict(loss=0.0, kl=0.0, clipped=0.0, tokens=0.0, seqs=0.0)
        # Largest |learner logprob - rollout logprob| before the update: ~1e-6 in fp32 when weight sync is right.
        logp_diff_max = 0.0
        trust = TrustCounts()
        old_logprobs: dict[int, list[torch.Tensor]] = {}
        n_micro = len(plan.micro_steps)
        for epoch in range(self.config.learner.epochs):
            for i, micro in enumerate(plan.micro_steps):
                self.engine.set_gradient_accumulation_boundary(i == n_micro - 1)
                loss, stats, logp = self._micro_loss(micro, plan, old_logprobs.get(i))
                if epoch == 0:
                    old_logprobs[i] = [lp.detach() for lp in logp]
                    if micro.real:
                        logp_diff_max = max(logp_diff_max, _max_abs_diff(logp, micro.group.rollout_logprobs))
                # DeepSpeed averages gradients over ranks; scaling by world size turns that into the global sum.
                self.engine.backward(loss * (self.world_size if micro.real else 0.0))
                if micro.real and epoch == self.config.learner.epochs - 1:
                    trust.add(stats.pop("trust"))
                    for k, v in stats.items():
                        sums[k] += v
            self.engine.step()
        self.steps_done += 1
        grad_norm = self.engine.get_global_grad_norm()
        sums["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        sums["peak_memory_mb"] = _peak_memory_mb(self.device)
        sums["logp_diff_max"] = logp_diff_max
        sums["trust"] = trust
        return sums

    def _micro_loss(self, micro: MicroStep, plan: StepPlan, old: list[torch.Tensor] | None):
        """The group's loss contribution (weights from global counts), its stats, and the fresh logprobs."""
        group = micro.group
        replay, route_status_G = self._replay_inputs(group)
        logp = self._score_group(group, with_grad=True, replay=replay)
        ref = None
        if self.spec.kl_coef > 0:
            ref_replay = None if replay is None else _Replay(replay.routes_T_L_K, replay.ok_T)
            ref = self._score_group(group, with_grad=False, adapter=False, replay=ref_replay)
        lengths = [len(r) for r in group.responses]
        weights_G = token_weights(lengths, self.spec, plan.total_tokens, plan.total_seqs)
        loss = torch.zeros((), device=self.device)
        stats = dict(loss=0.0, kl=0.0, clipped=0.0, tokens=float(sum(lengths)), seqs=float(len(lengths)))
        trust = TrustCounts()
        grpo = self.config.grpo
        for i, logp_R in enumerate(logp):
            old_R = old[i] if old is not None else logp_R.detach()
            rollout_R = group.rollout_logprobs[i].to(self.device)
            ratio_status = icepop_status(old_R, rollout_R, grpo.icepop_alpha, grpo.icepop_beta) if grpo.icepop else None
            status_R = route_status_G[i] if grpo.r3 else torch.zeros_like(route_status_G[i])
            mask_R, counts = trust_mask(status_R.to(self.device), ratio_status, old_R, rollout_R)
            trust.add(counts)
            if replay is not None and replay.native_T_L_K is not None:
                counts_oor = self._out_of_route(group, replay, i, route_status_G[i])
                trust.out_of_route += counts_oor[0]
                trust.routed += counts_oor[1]
            adv_R = group.adv_G[i].to(self.device).expand_as(logp_R)
            loss_R, st = per_token_objective(
                logp_R, old_R, adv_R, self.spec, ref_logp_T=ref[i] if ref is not None else None
            )
            contribution = weights_G[i].to(self.device) * (loss_R * mask_R).sum()
            loss = loss + contribution
            kept = mask_R.bool()
            stats["loss"] += float(contribution.detach())
            stats["kl"] += float(st["kl_T"][kept].sum())
            stats["clipped"] += float(st["clipped_T"][kept].float().sum())
        stats["trust"] = trust
        return loss, stats, logp

    def _out_of_route(self, group: GroupBatch, replay: _Replay, i: int, status_R: torch.Tensor) -> tuple[int, int]:
        """Response i's tokens whose learner-native top-k differs from the recorded one (measured while replaying)."""
        num_prompt, r_max = len(group.prompt_tokens_P), max(len(r) for r in group.responses)
        seq_len = num_prompt + r_max - 1
        n = len(group.responses[i])
        rows = slice(i * seq_len + num_prompt - 1, i * seq_len + num_prompt - 1 + n)
        return out_of_route(replay.native_T_L_K[rows], replay.routes_T_L_K[rows], status_R)

    # ---- state out -----------------------------------------------------------------------------------------------

    def _gathered(self, params):
        """Context in which ZeRO-3-partitioned parameters are whole on every rank (a no-op below stage 3)."""
        return self._deepspeed.zero.GatheredParameters(
            list(params), modifier_rank=None, enabled=self.config.learner.zero_stage == 3
        )

    def lora_state_bytes(self) -> bytes | None:
        """The adapter as safetensors bytes, on rank 0 (collective under ZeRO-3: every rank must call it)."""
        from mint.lora import lora_state
        from mint.revisions import to_bytes

        model = self.engine.module
        with self._gathered(p for p in model.parameters() if p.requires_grad):
            state = lora_state(model) if self.rank == 0 else None
        return to_bytes(state) if state is not None else None

    def adapter_config(self, base_path: str) -> dict:
        from mint.lora import adapter_config_dict

        return adapter_config_dict(self.engine.module, base_path)

    def param_digests(self) -> dict[str, str]:
        """sha256 of the base weights and of the LoRA weights (collective under ZeRO-3). Tests use it to prove the
        base never moves."""
        from mint.revisions import revision_id

        model = self.engine.module
        with self._gathered(model.parameters()):
            base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
            lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        return {"base": revision_id(base), "lora": revision_id(lora)}
