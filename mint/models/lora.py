"""LoRA on a frozen base through PEFT, and moving LoRA state in and out of a model.

The learner and the rollout actors build the adapter from the same recipe section, so a state dict produced by one
loads into the other key for key. Fused 3-D experts (transformers 5.x `mlp.experts.gate_up_proj` / `down_proj`) get
LoRA through PEFT `target_parameters`; attention projections through `target_modules`. By default those experts
compute their LoRA factored (`mint.models.expert_lora`): same modules, parameters and names, but W + ΔW is never formed.
"""

from __future__ import annotations

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

from mint.config import LoraConfig
from mint.models.expert_lora import factor_experts
from mint.models.quant import compute_dtype_view, is_quantized_experts
from mint.models.specs import moe_layout

EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def peft_config(lora: LoraConfig, model_config) -> PeftLoraConfig:
    """The PEFT LoraConfig for a recipe's [lora] section on a given base config."""
    experts = list(EXPERT_PARAMETERS) if lora.target_experts and moe_layout(model_config) else None
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        target_parameters=experts,
        bias="none",
    )


def add_lora(model: torch.nn.Module, lora: LoraConfig, seed: int, factored_experts: bool = True) -> torch.nn.Module:
    """Wrap a frozen base with LoRA. Seeded, so every learner rank starts from the same adapter.

    The LoRA weights take the base's dtype (the recipe's model.dtype), in the learner, the rollout actors and the
    server alike: PEFT's default upcast of bf16 adapters to fp32 made the rollout's LoRA fp32 while DeepSpeed's
    bf16 learner ran it in bf16, and cast the factors back to bf16 on every forward (53 MiB of copies saved per
    replay per MoE layer at Qwen3-30B-A3B dims). DeepSpeed keeps the fp32 master copy in the optimizer.

    factored_experts: fused-expert LoRA runs as x A^T B^T per routed row (`mint.models.expert_lora`); False keeps
    PEFT's materialized W + s·B A (for equality tests and benchmarks). The adapter's tensors are the same either way.
    On a quantized base (mint.models.quant) the LoRA takes the compute dtype, and experts always run factored.
    """
    with torch.random.fork_rng(devices=[]), compute_dtype_view(model, model.get_input_embeddings().weight.dtype):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, peft_config(lora, model.config), autocast_adapter_dtype=False)
    for name, p in peft_model.named_parameters():
        p.requires_grad_("lora_" in name)
    if factored_experts or any(is_quantized_experts(m) for m in peft_model.modules()):
        factor_experts(peft_model)  # PEFT's materialized W + s·B A cannot add to FP8 bytes
    return peft_model


def lora_state(peft_model) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (no adapter name), detached, contiguous, on CPU."""
    state = get_peft_model_state_dict(peft_model)
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def load_lora_state(peft_model, state: dict[str, torch.Tensor]) -> None:
    """Load tensors produced by `lora_state` into a model built with the same [lora] section; strict on keys."""
    result = set_peft_model_state_dict(peft_model, state)
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise ValueError(f"adapter state has keys this model does not: {unexpected[:3]}")


def adapter_config_dict(peft_model, base_path: str) -> dict:
    """adapter_config.json content, as PEFT writes it, pointing at the base the adapter was trained on."""
    cfg = peft_model.peft_config["default"].to_dict()
    cfg["base_model_name_or_path"] = base_path
    return {k: sorted(v) if isinstance(v, set) else v for k, v in cfg.items()}
