"""The learner group: N Ray actors forming one torch.distributed group, each a DeepSpeed engine over a PEFT model.

One optimizer step (per epoch) works group by group: each micro-step runs one prompt's G responses through an inner
step (`mint.train.inner_step`: the naive padded step or LongStraw), which scores them and calls backward; the engine
reduces gradients across ranks on the last micro-step and steps. Every rank runs the same number of micro-steps (the
driver pads with zero-weight copies), because ZeRO-3 gathers parameters collectively inside forward and a rank that
skipped one would hang the others.

Expert parallel (`learner.expert_parallel` = EP > 1, docs/sharding.md): ranks [k·EP, (k+1)·EP) form EP group k and
split the routed experts (each loads only its own from the checkpoint); the EP groups are data-parallel replicas of
each other. DeepSpeed learns of it the way its own MoE layers declare themselves: the expert parameters carry
`allreduce = False` and the EP group's name, the expert LoRA sits in a `moe` parameter group, and a parameter-less
`MoE` subclass in the model turns on DeepSpeed's expert handling. So ZeRO-1 reduces the expert LoRA gradients over
the replicas of the same experts only (sum / N, as the replicated ones are averaged over all N ranks), partitions
their optimizer state over those replicas, counts every expert once in the clipping norm, and broadcasts each
expert's initial weights within its replicas only.

Context parallel (`longstraw.context_parallel` = C > 1, `mint.train.context_parallel`): CP groups of C ranks
run the same groups and split each captured prompt's pages; each rank weighs its loss by N / C, since every CP rank
holds its replica's whole gradient.
"""

from __future__ import annotations

import math
import os
import resource
import time

import ray
import torch

from longstraw.memory import reset_peak
from longstraw.trust import TrustCounts
from mint.config import Config
from mint.train import wire
from mint.train.faults import Faults
from mint.train.inner_step import INNER_STEPS, GroupBatch, MicroStep, StepContext, StepPlan, loss_spec

__all__ = ["GroupBatch", "LearnerActor", "MicroStep", "StepPlan", "loss_spec"]


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


def lr_factor(config: Config):
    """The learning-rate multiplier of GRPO step s + 1 (s = 0, 1, ...), for every epoch of it: linear warmup over
    learner.warmup_steps, then constant or a cosine down to min_lr_ratio at grpo.steps. A function of the step alone:
    a skipped step (non-finite gradient) does not shift the steps after it."""
    warmup, steps, floor = config.learner.warmup_steps, config.grpo.steps, config.learner.min_lr_ratio
    cosine = config.learner.lr_schedule == "cosine"

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if not cosine:
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, steps - warmup - 1))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _max_abs_diff(logp: list[torch.Tensor], rollout_logp: list[torch.Tensor]) -> float:
    return max(float((a.detach().cpu() - b).abs().max()) for a, b in zip(logp, rollout_logp, strict=True))


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class LearnerActor:
    """One data-parallel rank of the learner: frozen base + LoRA, wrapped by DeepSpeed."""

    def __init__(self, config: Config, model_path: str, rank: int, world_size: int, faults: Faults | None = None):
        self.config = config
        self.model_path = model_path
        self.rank = rank
        self.world_size = world_size
        self.faults = faults or Faults()
        self.use_cuda = config.ray.learner_gpus > 0 and torch.cuda.is_available()
        torch.set_num_threads(config.ray.torch_threads)
        wire.register()  # any tensor this rank hands Ray crosses as a numpy buffer, as the driver's and rollouts' do

    def where(self) -> str:
        """ "pid N on NODE_IP": how the driver names this actor when it dies."""
        return f"(pid {os.getpid()} on {ray.util.get_node_ip_address()})"

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port: rank 0 hosts the torch.distributed rendezvous."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int, init_lora: bytes | None = None) -> int:
        """Join the process group, load base + LoRA, and wrap it in DeepSpeed. Every rank calls this at once.

        init_lora: a warm start (`lora.init`): LoRA tensors as safetensors bytes, loaded before the optimizer is
        built, so the optimizer starts fresh from them."""
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

        from mint.models.lora import add_lora
        from mint.models.specs import load_model, moe_layout

        config = self.config
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.use_cuda else torch.device("cpu")
        model_config = AutoConfig.from_pretrained(self.model_path)
        self.ep_group = None
        if config.learner.expert_parallel > 1:
            model, param_groups = self._load_expert_parallel(model_config)
        else:
            base = load_model(self.model_path, config.model.dtype, config.model.quantization)
            model = add_lora(base, config.lora, config.grpo.seed)
            param_groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        if init_lora is not None:
            from mint.hub import from_bytes
            from mint.models.expert_parallel import load_full_lora_state
            from mint.models.lora import load_lora_state

            load = load_full_lora_state if self.ep_group is not None else load_lora_state
            load(model, from_bytes(init_lora))
        optimizer = torch.optim.AdamW(param_groups, lr=config.learner.lr, weight_decay=config.learner.weight_decay)
        # No DeepSpeed lr scheduler: it advances once per engine.step() that applies, so once per epoch and not on a
        # skipped step, and the schedule would drift off grpo.steps. `step` sets each step's rate (_set_lr).
        self.lr_factor = lr_factor(config)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_deepspeed_config(config))
        self._deepspeed = deepspeed
        from mint.models.specs import tokenizer_size, usable_vocab

        limit = usable_vocab(tokenizer_size(self.model_path), model_config)
        layout = moe_layout(model_config)
        self.ctx = StepContext(self.engine, config, loss_spec(config), layout, self.device, self.world_size)
        self.ctx.vocab_limit = limit
        if config.longstraw.context_parallel > 1:
            from mint.train.context_parallel import new_cp_group

            self.ctx.context_parallel = config.longstraw.context_parallel
            self.ctx.cp_group = new_cp_group(
                self.rank, self.world_size, self.ctx.context_parallel, config.learner.expert_parallel
            )
        if self.ep_group is not None:
            from longstraw.expert_parallel import Lockstep
            from mint.models.expert_parallel import experts_by_layer

            self.ctx.lockstep = Lockstep(self.ep_group, experts_by_layer(model), layout.top_k)
        self.steps_done = 0
        return self.rank

    def _load_expert_parallel(self, model_config) -> tuple[torch.nn.Module, list[dict]]:
        """Build the EP groups (DeepSpeed's, so its reduction and our dispatch share them), load this rank's experts
        only, and mark the expert parameters for DeepSpeed. Returns the model and the optimizer's parameter groups."""
        from deepspeed.utils import groups

        from mint.models.expert_parallel import experts_by_layer, load_expert_parallel
        from mint.models.specs import moe_layout
        from mint.train.preflight import check_expert_parallel

        config, ep = self.config, self.config.learner.expert_parallel
        check_expert_parallel(config, model_config)  # preflight refused these before Ray; a rank started alone too
        layout = moe_layout(model_config)
        name = f"ep_size_{ep}"
        if name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(ep)  # EP groups: consecutive ranks; replicas: strided
        self.ep_group = groups._get_expert_parallel_group(name)
        model, _ = load_expert_parallel(
            self.model_path, self.ep_group, config.lora, config.grpo.seed, config.model.dtype
        )
        experts = [p for _, module in experts_by_layer(model) for p in module.parameters()]
        for p in experts:
            p.allreduce, p.group_name = False, name  # DeepSpeed's mark of an expert parameter
        expert_ids = {id(p) for p in experts}
        trainable = [p for p in model.parameters() if p.requires_grad]
        param_groups = [{"params": [p for p in trainable if id(p) not in expert_ids]}]
        expert_lora = [p for p in trainable if id(p) in expert_ids]
        if expert_lora:
            param_groups.append({"params": expert_lora, "moe": True, "name": name})
            model.add_module("mint_expert_parallel", _declaration(ep, layout.num_experts, name))
        return model, param_groups

    # ---- one optimizer step --------------------------------------------------------------------------------------

    def step(self, plan: StepPlan) -> dict:
        """Run the plan's micro-steps for each epoch, reduce, and step the optimizer. Returns this rank's sums, and
        its own seconds in this call (`seconds`: the learner's busy time, without Ray's dispatch)."""
        t0 = time.perf_counter()
        sums = dict(loss=0.0, kl=0.0, clipped=0.0, tokens=0.0, seqs=0.0)
        # Largest |learner logprob - rollout logprob| before the update: ~1e-6 in fp32 when weight sync is right.
        logp_diff_max = 0.0
        trust = TrustCounts()
        old_logprobs: dict[int, list[torch.Tensor]] = {}
        n_micro = len(plan.micro_steps)
        inner_step = INNER_STEPS[self.config.learner.inner_step]
        sums["lr"] = self._set_lr(plan.step)  # the rate every epoch of this step uses
        # The peak is the step's: reset once here, read once after the optimizer step (peak_memory_mb). Nothing
        # inside a group resets it (a reset per group left only the last group's peak), so LongStraw's update runs
        # with measure=False.
        reset_peak(self.device)
        for epoch in range(self.config.learner.epochs):
            epoch_loss = 0.0  # this epoch's own: sums["loss"] holds the last epoch's only
            for i, micro in enumerate(plan.micro_steps):
                stats, logp = inner_step(self.ctx, micro, plan, old_logprobs.get(i), last=i == n_micro - 1)
                epoch_loss += stats["loss"] if micro.real else 0.0
                if epoch == 0:
                    old_logprobs[i] = [lp.detach() for lp in logp]
                    if micro.real:
                        logp_diff_max = max(logp_diff_max, _max_abs_diff(logp, micro.group.rollout_logprobs))
                if micro.real and epoch == self.config.learner.epochs - 1:
                    trust.add(stats.pop("trust"))
                    for k, v in stats.items():
                        sums[k] += v
            self.ctx.end_accumulation()
            if self.faults.nan_gradient_at(plan.step):
                self._poison_gradients()
            self._step_unless_non_finite(sums, epoch_loss)
        self.steps_done += 1
        # resident mode keeps the captures of this step's prompts only.
        self.ctx.captures.end_step()
        sums["peak_memory_mb"] = _peak_memory_mb(self.device)
        sums["logp_diff_max"] = logp_diff_max
        sums["trust"] = trust
        sums["seconds"] = time.perf_counter() - t0
        return sums

    def _set_lr(self, step: int) -> float:
        """Set GRPO step `step`'s rate (1-based; 0, a plan without a step, counts as step 1) on every parameter
        group, the expert LoRA's included, and return it as the optimizer holds it.

        Set afresh at every step, so a restored optimizer state (whose groups carry the rate of the step it was
        saved at) and a skipped step change nothing."""
        lr = self.config.learner.lr * self.lr_factor(max(step, 1) - 1)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        return float(self.engine.get_lr()[0])

    def _step_unless_non_finite(self, sums: dict, loss: float) -> None:
        """engine.step(), unless the step's gradient is not finite on some rank; records grad_norm, `skipped`, `bad`
        and, for a bad step, `bad_cause`: "loss" when this rank's epoch loss (`loss`) was already not finite, else
        "gradient" (a finite loss whose backward overflowed). Non-finite rollout log-probs never get here: the trust
        mask drops them (non_finite), so a non-finite loss comes from the learner's own numbers.

        ZeRO stages 1-3 (DeepSpeed 0.19) already refuse such a step: a non-finite global gradient norm zeroes the
        gradients, skips the optimizer and reports the norm as inf (`DeepSpeedZeroOptimizer.step`). Stage 0 wraps the
        torch optimizer directly and would apply it, so there the ranks agree on finiteness first (one all-reduce).
        fp16's dynamic loss scale also skips overflowing steps by design; those are not counted as bad steps.
        (Under ZeRO-0 the norm is DeepSpeed's own, computed for clipping; it may be None without clipping.)
        """
        bad = False
        if self.config.learner.zero_stage == 0:
            grads = [p.grad for p in self.engine.module.parameters() if p.requires_grad and p.grad is not None]
            local = float(not all(bool(torch.isfinite(g).all()) for g in grads))
            flag = torch.tensor([local], device=self.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            bad = bool(flag.item())
        if bad:
            self.engine.optimizer.zero_grad(set_to_none=True)
        else:
            self.engine.step()
        norm = self.engine.get_global_grad_norm()
        sums["grad_norm"] = float(norm) if norm is not None else float("nan")
        # DeepSpeed reports a skipped step's norm as inf; stage 0 skips only when the ranks agreed it was bad.
        skipped = bad or (self.config.learner.zero_stage > 0 and not math.isfinite(sums["grad_norm"]))
        # A bad step is a skipped one with a broken gradient; fp16's scale search skips finite-loss steps by design.
        fp16_search = self.config.model.dtype == "float16" and math.isfinite(loss)
        bad_now = skipped and not fp16_search
        sums["skipped"] = sums.get("skipped", False) or skipped  # any epoch
        if bad_now and not sums.get("bad"):  # the first bad epoch's cause
            sums["bad_cause"] = "gradient" if math.isfinite(loss) else "loss"
        sums["bad"] = sums.get("bad", False) or bad_now

    def _poison_gradients(self) -> None:
        """Fault injection (MINT_FAULTS=nan_loss@STEP; tests and drills only): this step's gradient becomes NaN on
        every rank, as a diverged loss would make it."""
        from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

        for p in self.engine.module.parameters():
            grad = safe_get_full_grad(p) if p.requires_grad else None
            if grad is not None:
                safe_set_full_grad(p, torch.full_like(grad, float("nan")))

    # ---- checkpoints ---------------------------------------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> None:
        """This rank's part of a checkpoint (collective: every rank calls it): DeepSpeed's optimizer state and LoRA
        weights (the frozen base excluded) under <directory>/deepspeed, and the rank's RNG states."""
        self.engine.save_checkpoint(
            os.path.join(directory, "deepspeed"), tag="state", exclude_frozen_parameters=True, save_latest=False
        )
        rng = {"torch": torch.get_rng_state()}
        if self.use_cuda:
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        torch.save(rng, os.path.join(directory, "rng", f"rank_{self.rank}.pt"))

    def load_checkpoint(self, directory: str, revision: str) -> str:
        """Restore a checkpoint written by `save_checkpoint` (collective) and check that the LoRA weights hash to
        `revision`, the id the driver recorded with it; returns that id."""
        from mint.errors import MintError
        from mint.hub import revision_id

        path, _ = self.engine.load_checkpoint(
            os.path.join(directory, "deepspeed"),
            tag="state",
            load_module_strict=False,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,  # no scheduler: each step sets its own rate (_set_lr)
        )
        if path is None:
            raise MintError(f"checkpoint {directory}: DeepSpeed found no state to load")
        if self.ep_group is not None:
            self._weights_from_master()
        rng = torch.load(os.path.join(directory, "rng", f"rank_{self.rank}.pt"), weights_only=True)
        torch.set_rng_state(rng["torch"])
        if self.use_cuda and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        state = self._full_lora_state()
        if not state:  # expert parallel: the first rank of each EP group checks its group's experts
            return revision
        got = revision_id(state)
        if got != revision:
            raise MintError(f"checkpoint {directory}: restored LoRA hashes to {got[:12]}, not {revision[:12]}")
        return got

    def _weights_from_master(self) -> None:
        """Expert parallel: set every LoRA weight from the optimizer's restored fp32 master (collective).

        DeepSpeed's model-state file is written by rank 0 alone, so loading it gives every rank rank 0's expert
        LoRA (same names, same shapes, other experts); ZeRO-1 restores each rank's own master partition but only
        refreshes the weights from it at the next step. Measured before this: the restored adapter hashed wrong."""
        from deepspeed.utils import safe_get_full_fp32_param

        with torch.no_grad():
            for p in self.engine.module.parameters():
                if p.requires_grad:
                    p.copy_(safe_get_full_fp32_param(p).to(p.dtype))

    # ---- state out -----------------------------------------------------------------------------------------------

    def _gathered(self, params):
        """Context in which ZeRO-3-partitioned parameters are whole on every rank (a no-op below stage 3)."""
        return self._deepspeed.zero.GatheredParameters(
            list(params), modifier_rank=None, enabled=self.config.learner.zero_stage == 3
        )

    def _full_lora_state(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """The whole adapter, every expert, as `lora_state` of an unsharded model gives it. Collective under ZeRO-3
        and under expert parallel, where each EP group gathers its experts' LoRA to its first rank
        (`gather_expert_lora`) and the other ranks get {}. keep=False: this rank only takes part in the collective
        and copies nothing (without expert parallel)."""
        from mint.models.expert_parallel import gather_expert_lora
        from mint.models.lora import lora_state

        model = self.engine.module
        if self.ep_group is not None:
            return gather_expert_lora(model, self.ep_group)
        with self._gathered(p for p in model.parameters() if p.requires_grad):
            return lora_state(model) if keep else {}

    def lora_state_bytes(self) -> bytes | None:
        """The adapter as safetensors bytes, on rank 0 (collective under ZeRO-3 and expert parallel: every rank must
        call it). Under expert parallel it holds every expert, with the names and shapes of the unsharded one."""
        from mint.hub import to_bytes

        state = self._full_lora_state(keep=self.rank == 0)  # only rank 0's copy is sent
        return to_bytes(state) if self.rank == 0 else None

    def adapter_config(self, base_path: str) -> dict:
        from mint.models.lora import adapter_config_dict

        return adapter_config_dict(self.engine.module, base_path)

    def param_digests(self) -> dict[str, str]:
        """sha256 of the base weights and of the LoRA weights (collective under ZeRO-3). Tests use it to prove the
        base never moves. Hashed in place, one tensor at a time: a clone of the base would cost its whole size again
        (61 GB on a GPU at Qwen3-30B-A3B)."""
        from mint.hub import revision_id

        model = self.engine.module
        with self._gathered(model.parameters()):
            base = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
            lora = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
            return {"base": revision_id(base), "lora": revision_id(lora)}


def _declaration(ep: int, num_experts: int, name: str) -> torch.nn.Module:
    """A parameter-less DeepSpeed `MoE` that tells the engine the model has expert-parallel parameters (group
    `name`); DeepSpeed recognizes expert parallelism by that type. It holds no experts and never runs."""
    from deepspeed.moe.layer import MoE

    class ExpertParallelDeclaration(MoE):
        def __init__(self):
            torch.nn.Module.__init__(self)  # not MoE's: no gate, no experts
            self.ep_size, self.num_experts, self.expert_group_name = ep, num_experts, name
            # 0: DeepSpeed's checkpoints write (and look for) no per-expert weight files for it. The frozen experts
            # are reloaded from the base; the expert LoRA is restored from each rank's ZeRO optimizer partition
            # (its fp32 master weights), and load_checkpoint checks the gathered adapter's hash.
            self.num_local_experts = 0

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            pass  # the groups exist already (LearnerActor._load_expert_parallel)

        def forward(self, *args, **kwargs):
            raise RuntimeError("ExpertParallelDeclaration only declares expert parallel to DeepSpeed; it never runs")

    return ExpertParallelDeclaration()
