"""The learner group: N Ray actors forming one torch.distributed group, each a DeepSpeed engine over a PEFT model.

One optimizer step (per epoch) works group by group: each micro-step runs one prompt's G responses through an inner
step (`mint.train.inner_step`: the naive padded step or LongStraw), which scores them and calls backward; the engine
reduces gradients across ranks on the last micro-step and steps. Every rank runs the same number of micro-steps (the
driver pads with zero-weight copies), because ZeRO-3 gathers parameters collectively inside forward and a rank that
skipped one would hang the others.
"""

from __future__ import annotations

import os
import resource

import ray
import torch

from longstraw.trust import TrustCounts
from mint.config import Config
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

        from mint.models.lora import add_lora
        from mint.models.specs import load_model, moe_layout

        config = self.config
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.use_cuda else torch.device("cpu")
        model = add_lora(load_model(self.model_path, config.model.dtype), config.lora, config.grpo.seed)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=config.learner.lr, weight_decay=config.learner.weight_decay)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_deepspeed_config(config))
        self._deepspeed = deepspeed
        layout = moe_layout(AutoConfig.from_pretrained(self.model_path))
        self.ctx = StepContext(self.engine, config, loss_spec(config), layout, self.device, self.world_size)
        self.steps_done = 0
        return self.rank

    # ---- one optimizer step --------------------------------------------------------------------------------------

    def step(self, plan: StepPlan) -> dict:
        """Run the plan's micro-steps for each epoch, reduce, and step the optimizer. Returns this rank's sums."""
        sums = dict(loss=0.0, kl=0.0, clipped=0.0, tokens=0.0, seqs=0.0)
        # Largest |learner logprob - rollout logprob| before the update: ~1e-6 in fp32 when weight sync is right.
        logp_diff_max = 0.0
        trust = TrustCounts()
        old_logprobs: dict[int, list[torch.Tensor]] = {}
        n_micro = len(plan.micro_steps)
        inner_step = INNER_STEPS[self.config.learner.engine]
        for epoch in range(self.config.learner.epochs):
            for i, micro in enumerate(plan.micro_steps):
                stats, logp = inner_step(self.ctx, micro, plan, old_logprobs.get(i), last=i == n_micro - 1)
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
        self.ctx.captures.end_step()
        grad_norm = self.engine.get_global_grad_norm()
        sums["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        sums["peak_memory_mb"] = _peak_memory_mb(self.device)
        sums["logp_diff_max"] = logp_diff_max
        sums["trust"] = trust
        return sums

    # ---- state out -----------------------------------------------------------------------------------------------

    def _gathered(self, params):
        """Context in which ZeRO-3-partitioned parameters are whole on every rank (a no-op below stage 3)."""
        return self._deepspeed.zero.GatheredParameters(
            list(params), modifier_rank=None, enabled=self.config.learner.zero_stage == 3
        )

    def lora_state_bytes(self) -> bytes | None:
        """The adapter as safetensors bytes, on rank 0 (collective under ZeRO-3: every rank must call it)."""
        from mint.hub import to_bytes
        from mint.models.lora import lora_state

        model = self.engine.module
        with self._gathered(p for p in model.parameters() if p.requires_grad):
            state = lora_state(model) if self.rank == 0 else None
        return to_bytes(state) if state is not None else None

    def adapter_config(self, base_path: str) -> dict:
        from mint.models.lora import adapter_config_dict

        return adapter_config_dict(self.engine.module, base_path)

    def param_digests(self) -> dict[str, str]:
        """sha256 of the base weights and of the LoRA weights (collective under ZeRO-3). Tests use it to prove the
        base never moves."""
        from mint.hub import revision_id

        model = self.engine.module
        with self._gathered(model.parameters()):
            base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
            lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        return {"base": revision_id(base), "lora": revision_id(lora)}
