"""Model specs, tiny configs, and loading through the one `from_pretrained` path.

A model spec is a hub id, a local path, or `tiny:<family>` for the embedded tiny bases (built locally and cached by
`mint.models.tiny`, never downloaded). Whatever the spec, the trainer loads the result with `AutoModelForCausalLM.
from_pretrained`, so the smoke run exercises the same code as a real run.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Glm4MoeConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from longstraw.routing import ExpertLayout
from mint.errors import ConfigError

TINY_PREFIX = "tiny:"
TINY_FAMILIES = ("qwen3_moe", "qwen2_moe", "glm4_moe", "qwen3")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tiny_config(family: str, vocab_size: int, **overrides) -> PretrainedConfig:
    """The config of an embedded tiny base: hidden 64, 4 routed experts (top-2), GQA 4:2.

    qwen3_moe / qwen2_moe: 2 layers, both MoE; qwen2_moe adds a shared expert with its sigmoid gate, which is the
    case route replay and LoRA export must also cover. glm4_moe (GLM-4.5 class): 3 layers of which the first is a
    dense MLP (first_k_dense_replace=1), sigmoid routing with group-limited top-k (2 groups of 2, one group kept)
    and routed_scaling_factor 2.5, an ungated shared expert, partial RoPE (half of head_dim 32, so the attention
    width 128 differs from hidden 64 as in GLM-4.5-Air), q/k RMSNorm and q/k/v bias. qwen3: a dense Qwen3 (no
    experts, MLP 128 wide) with head_dim 32, the smallest head vLLM's CPU attention serves (it refuses 16), so a real
    vLLM server runs it in the tests. Sizes are chosen so a CPU builds, pretrains and RL-trains one in seconds.
    """
    if family == "glm4_moe":
        return _tiny_glm4_moe(vocab_size, **overrides)
    if family == "qwen3":
        return _tiny_qwen3(vocab_size, **overrides)
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
        return Qwen3MoeConfig(**{"head_dim": 16, **common})  # head_dim=32 serves on vLLM's CPU attention
    if family == "qwen2_moe":
        common.setdefault("shared_expert_intermediate_size", 64)
        return Qwen2MoeConfig(**common)
    raise ConfigError(f"model.path: unknown tiny family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")


def _tiny_qwen3(vocab_size: int, **overrides) -> Qwen3Config:
    config = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    config.update(overrides)
    return Qwen3Config(**config)


def _tiny_glm4_moe(vocab_size: int, **overrides) -> Glm4MoeConfig:
    config = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        partial_rotary_factor=0.5,
        use_qk_norm=True,
        attention_bias=True,
        max_position_embeddings=256,
        intermediate_size=128,  # the dense layer's MLP
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=64,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    config.update(overrides)
    return Glm4MoeConfig(**config)


def moe_layers(config: PretrainedConfig) -> list[int]:
    """Indices of the decoder layers whose MLP is a routed-expert block, in model order ([] for a dense model).

    A layer is dense when any of the families' rules says so: GLM / DeepSeek-V3 `first_k_dense_replace` (layers
    below it), Qwen-MoE `mlp_only_layers` (listed layers) and `decoder_sparse_step` (MoE only where (i + 1) % step
    == 0). Each rule is read only where the config has it, so one family's default never applies to another.
    """
    num_experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    if not num_experts:
        return []
    first_moe = getattr(config, "first_k_dense_replace", None) or 0
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return [i for i in range(config.num_hidden_layers) if i >= first_moe and i not in dense and (i + 1) % step == 0]


def moe_layout(config: PretrainedConfig) -> ExpertLayout | None:
    """The expert layout of a sparse-MoE config, or None for a dense model. num_layers counts MoE layers only (the
    learner's routes); layer_ids and num_decoder_layers place them among all decoder layers (the engines' routes)."""
    layers = moe_layers(config)
    if not layers:
        return None
    num_experts = getattr(config, "num_experts", None) or config.n_routed_experts
    return ExpertLayout(
        num_layers=len(layers),
        num_experts=num_experts,
        top_k=config.num_experts_per_tok,
        layer_ids=tuple(layers),
        num_decoder_layers=config.num_hidden_layers,
    )


def load_model(path: str, dtype: str = "float32") -> torch.nn.Module:
    """Load a causal LM from a hub id or a local directory, in eval mode, with all base weights frozen."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def tokenizer_size(model_path: str) -> int | None:
    """len() of the model directory's tokenizer, or None when it has no tokenizer files (transformers would make an
    empty one-token tokenizer up, which must not cut the vocabulary)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    if Path(model_path).is_dir() and not any((Path(model_path) / f).exists() for f in TOKENIZER_FILES):
        return None
    return len(AutoTokenizer.from_pretrained(model_path))


def usable_vocab(tokenizer_size: int | None, config: PretrainedConfig) -> int | None:
    """The ids a rollout may sample and the learner scores: the tokenizer's, when the head has more rows (padding),
    else None (all of them). Preflight refuses a tokenizer with ids the head cannot produce."""
    return tokenizer_size if tokenizer_size is not None and tokenizer_size < config.vocab_size else None
