"""Model specs, tiny configs, and loading through the one `from_pretrained` path.

A model spec is a hub id, a local path, or `tiny:<family>` for the embedded tiny bases (built locally and cached by
`mint.models.tiny`, never downloaded). Whatever the spec, the trainer loads the result with `AutoModelForCausalLM.
from_pretrained`, so the smoke run exercises the same code as a real run.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig

from longstraw.routing import ExpertLayout
from mint.errors import ConfigError

TINY_PREFIX = "tiny:"
TINY_FAMILIES = ("qwen3_moe", "qwen2_moe")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tiny_config(family: str, vocab_size: int, **overrides) -> PretrainedConfig:
    """The config of an embedded tiny MoE base: 2 layers, hidden 64, 4 routed experts (top-2), GQA 4:2.

    qwen2_moe adds a shared expert with its sigmoid gate, which is the case route replay and LoRA export must also
    cover. Sizes are chosen so a CPU builds, pretrains and RL-trains one in seconds.
    """
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        intermediate_size=128,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    common.update(overrides)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=16, **common)
    if family == "qwen2_moe":
        common.setdefault("shared_expert_intermediate_size", 64)
        return Qwen2MoeConfig(**common)
    raise ConfigError(f"model.path: unknown tiny family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")


def moe_layout(config: PretrainedConfig) -> ExpertLayout | None:
    """The expert layout of a Qwen-MoE-style config, or None for a dense model."""
    num_experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    if not num_experts:
        return None
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    layers = [i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0]
    return ExpertLayout(num_layers=len(layers), num_experts=num_experts, top_k=config.num_experts_per_tok)


def load_model(path: str, dtype: str = "float32") -> torch.nn.Module:
    """Load a causal LM from a hub id or a local directory, in eval mode, with all base weights frozen."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
