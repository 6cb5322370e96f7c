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

from longstraw.routing import RouteReplay, SequenceRoutes
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


class _GroupAccumulator:
    """The per-response objective of one group, shared by both inner steps: trust mask (R3 x IcePop), PPO-clip
    with KL, the global aggregation weight; and the group's stats."""

    def __init__(self, learner: LearnerActor, group: GroupBatch, plan: StepPlan, route_status_G: list[torch.Tensor]):
        self.learner, self.group = learner, group
        self.route_status_G = route_status_G
        lengths = [len(r) for r in group.responses]
        self.weights_G = token_weights(lengths, learner.spec, plan.total_tokens, plan.total_seqs)
        self.sums = dict(loss=0.0, kl=0.0, clipped=0.0, tokens=float(sum(lengths)), seqs=float(len(lengths)))
        self.trust = TrustCounts()

    def response_loss(self, i: int, logp_R, ref_R, old, native_R_L_K) -> torch.Tensor:
        """Response i's weighted loss contribution; masked tokens contribute 0 and are counted by reason."""
        learner, group, grpo = self.learner, self.group, self.learner.config.grpo
        device = logp_R.device
        old_R = old[i].to(device) if old is not None else logp_R.detach()
        rollout_R = group.rollout_logprobs[i].to(device)
        ratio_status = icepop_status(old_R, rollout_R, grpo.icepop_alpha, grpo.icepop_beta) if grpo.icepop else None
        status_R = self.route_status_G[i] if grpo.r3 else torch.zeros_like(self.route_status_G[i])
        mask_R, counts = trust_mask(status_R.to(device), ratio_status, old_R, rollout_R)
        if native_R_L_K is not None and group.routes is not None and group.routes[i] is not None:
            # Only positions with a usable route are compared; a malformed payload has none (all statuses nonzero).
            status = self.route_status_G[i]
            counts.out_of_route, counts.routed = out_of_route(native_R_L_K.cpu(), group.routes[i], status)
        self.trust.add(counts)
        adv_R = group.adv_G[i].to(device).expand_as(logp_R)
        loss_R, st = per_token_objective(logp_R, old_R, adv_R, learner.spec, ref_logp_T=ref_R)
        contribution = self.weights_G[i].to(device) * (loss_R * mask_R).sum()
        kept = mask_R.bool()
        self.sums["loss"] += float(contribution.detach())
        self.sums["kl"] += float(st["kl_T"][kept].sum())
        self.sums["clipped"] += float(st["clipped_T"][kept].float().sum())
        return contribution

    def stats(self) -> dict:
        return {**self.sums, "trust": self.trust}


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
        self._captures: dict[bytes, object] = {}  # resident mode: prompt tokens -> kept PrefixCapture
        self._captures_used: set[bytes] = set()
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
        micro_step = self._longstraw_micro if self.config.learner.engine == "longstraw" else self._naive_micro
        for epoch in range(self.config.learner.epochs):
            for i, micro in enumerate(plan.micro_steps):
                stats, logp = micro_step(micro, plan, old_logprobs.get(i), last=i == n_micro - 1)
                if epoch == 0:
                    old_logprobs[i] = [lp.detach() for lp in logp]
                    if micro.real:
                        logp_diff_max = max(logp_diff_max, _max_abs_diff(logp, micro.group.rollout_logprobs))
                if micro.real and epoch == self.config.learner.epochs - 1:
                    trust.add(stats.pop("trust"))
                    for k, v in stats.items():
                        sums[k] += v
            self.engine.step()
        self.steps_done += 1
        # resident mode keeps the captures of this step's prompts only.
        self._captures = {k: v for k, v in self._captures.items() if k in self._captures_used}
        self._captures_used = set()
        grad_norm = self.engine.get_global_grad_norm()
        sums["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        sums["peak_memory_mb"] = _peak_memory_mb(self.device)
        sums["logp_diff_max"] = logp_diff_max
        sums["trust"] = trust
        return sums

    def _loss_scale(self, micro: MicroStep) -> float:
        # DeepSpeed averages gradients over ranks; scaling by world size turns that into the global sum. Padding
        # micro-steps (real=False) run forward and backward for lockstep but weigh nothing.
        return float(self.world_size) if micro.real else 0.0

    def _naive_micro(self, micro: MicroStep, plan: StepPlan, old: list[torch.Tensor] | None, last: bool):
        """One padded full-sequence forward for the group's G responses, then one backward."""
        group = micro.group
        replay, route_status_G = self._replay_inputs(group)
        logp = self._score_group(group, with_grad=True, replay=replay)
        ref = None
        if self.spec.kl_coef > 0:
            ref_replay = None if replay is None else _Replay(replay.routes_T_L_K, replay.ok_T)
            ref = self._score_group(group, with_grad=False, adapter=False, replay=ref_replay)
        acc = _GroupAccumulator(self, group, plan, route_status_G)
        loss = torch.zeros((), device=self.device)
        for i, logp_R in enumerate(logp):
            native = None
            if replay is not None and replay.native_T_L_K is not None:
                native = self._response_rows(group, replay.native_T_L_K, i)
            loss = loss + acc.response_loss(i, logp_R, ref[i] if ref is not None else None, old, native)
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * self._loss_scale(micro))
        return acc.stats(), logp

    def _longstraw_micro(self, micro: MicroStep, plan: StepPlan, old: list[torch.Tensor] | None, last: bool):
        """LongStraw: capture the prompt once, replay each response with autograd and backward it, one at a time."""
        from longstraw.engine import UpdateSpec, grpo_update

        group = micro.group
        route_status_G, routes = self._sequence_routes(group)
        acc = _GroupAccumulator(self, group, plan, route_status_G)
        scale = self._loss_scale(micro)
        logp: list[torch.Tensor] = [None] * len(group.responses)

        def objective(i: int, logp_R: torch.Tensor, ref_R: torch.Tensor | None):
            logp[i] = logp_R.detach()
            native = routes.replay.native() if routes is not None and routes.replay is not None else None
            return acc.response_loss(i, logp_R, ref_R, old, native) * scale, {}

        def backward(loss: torch.Tensor, final: bool) -> None:
            self.engine.set_gradient_accumulation_boundary(last and final)
            self.engine.backward(loss)

        ls = self.config.longstraw
        spec = UpdateSpec(
            mode=ls.mode,
            chunk_size=ls.chunk_size,
            temperature=self.config.rollout.temperature,
            need_ref=self.spec.kl_coef > 0,
            max_prefix_age=ls.max_prefix_age,
            kernels=ls.kernels,
        )
        capture = self._resident_capture(group.prompt_tokens_P) if ls.mode == "resident" else None
        device = self.device
        grpo_update(
            self.engine.module,
            group.prompt_tokens_P.to(device),
            [r.to(device) for r in group.responses],
            objective,
            spec,
            capture=capture,
            backward=backward,
            routes=routes,
        )
        return acc.stats(), logp

    def _resident_capture(self, tokens_P: torch.Tensor):
        """resident mode: the kept capture of this prompt, or a fresh one (kept for the prompts of the last step)."""
        from longstraw.engine import capture_prefix

        key = tokens_P.numpy().tobytes()
        self._captures_used.add(key)
        if key not in self._captures:
            ls = self.config.longstraw
            self._captures[key] = capture_prefix(self.engine.module, tokens_P.to(self.device), ls.chunk_size)
        return self._captures[key]

    def _sequence_routes(self, group: GroupBatch):
        """Per-response route statuses [R_i] and, with R3 on, the recorded routes by position for LongStraw."""
        replay, statuses = self._replay_inputs(group)
        if replay is None:
            return statuses, None
        # With R3 off every ok is False: the routers run natively, and the replay still measures out-of-route.
        num_prompt = len(group.prompt_tokens_P)
        seq_len = num_prompt + max(len(r) for r in group.responses) - 1
        routes_G_S = replay.routes_T_L_K.view(len(group.responses), seq_len, *replay.routes_T_L_K.shape[1:])
        ok_G_S = replay.ok_T.view(len(group.responses), seq_len)
        # The prompt rows are the same in every row of the padded batch; response i's rows follow them.
        rows = [slice(num_prompt - 1, num_prompt - 1 + len(r)) for r in group.responses]
        responses = [(routes_G_S[i, rows[i]], ok_G_S[i, rows[i]]) for i in range(len(group.responses))]
        # Prompt rows are identical in every row that has them; a row whose own record is missing has none.
        prompt_ok_G_S = ok_G_S[:, : num_prompt - 1]
        source = int(prompt_ok_G_S.any(1).float().argmax())
        return statuses, SequenceRoutes(routes_G_S[source, : num_prompt - 1], prompt_ok_G_S[source], responses)

    @staticmethod
    def _response_rows(group: GroupBatch, rows_T_L_K: torch.Tensor, i: int) -> torch.Tensor:
        """Response i's producing positions (P-1 .. P+R_i-2) out of a padded [G * S] flattening."""
        num_prompt, r_max = len(group.prompt_tokens_P), max(len(r) for r in group.responses)
        seq_len = num_prompt + r_max - 1
        first = i * seq_len + num_prompt - 1
        return rows_T_L_K[first : first + len(group.responses[i])]

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
