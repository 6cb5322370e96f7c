"""The real bases Mint's users train, by their public config.json dimensions (nothing is downloaded).

`bench/real_shapes.py` builds a few layers of each with random weights to measure per-layer memory, and `mint plan`
multiplies those measurements by the real layer counts. The dims below are the models' published config.json values
(Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, zai-org/GLM-4.5-Air).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Glm4MoeConfig, PretrainedConfig, Qwen3MoeConfig

from mint.errors import ConfigError


@dataclass(frozen=True)
class RealShape:
    name: str
    family: str  # transformers model_type
    hidden: int
    layers: int  # decoder layers in the real model
    dense_layers: int  # of which dense MLP layers (GLM's first_k_dense_replace)
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    moe_intermediate: int
    intermediate: int  # dense MLP width
    shared_intermediate: int  # shared-expert width, 0 without one
    vocab: int
    total_params_b: float  # published total parameters, billions (a cross-check on the weight term)

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers


SHAPES: dict[str, RealShape] = {
    "qwen3_30b_a3b": RealShape(
        "Qwen3-30B-A3B", "qwen3_moe", hidden=2048, layers=48, dense_layers=0, heads=32, kv_heads=4, head_dim=128,
        experts=128, top_k=8, moe_intermediate=768, intermediate=6144, shared_intermediate=0, vocab=151936,
        total_params_b=30.5,
    ),
    "qwen3_235b_a22b": RealShape(
        "Qwen3-235B-A22B", "qwen3_moe", hidden=4096, layers=94, dense_layers=0, heads=64, kv_heads=4, head_dim=128,
        experts=128, top_k=8, moe_intermediate=1536, intermediate=12288, shared_intermediate=0, vocab=151936,
        total_params_b=235.1,
    ),
    "glm45_air": RealShape(
        "GLM-4.5-Air", "glm4_moe", hidden=4096, layers=46, dense_layers=1, heads=96, kv_heads=8, head_dim=128,
        experts=128, top_k=8, moe_intermediate=1408, intermediate=10944, shared_intermediate=1408, vocab=151552,
        total_params_b=106.9,
    ),
}  # fmt: skip


def shape(name: str) -> RealShape:
    if name not in SHAPES:
        raise ConfigError(f"unknown real shape {name!r}; choose one of {', '.join(SHAPES)}")
    return SHAPES[name]


def layer_config(s: RealShape, moe_layers: int, max_positions: int = 40960) -> PretrainedConfig:
    """A transformers config with the real dims and `moe_layers` MoE decoder layers (no dense ones): what the
    benchmark builds with random weights to measure one MoE layer's figures."""
    common = dict(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=moe_layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        moe_intermediate_size=s.moe_intermediate,
        num_experts_per_tok=s.top_k,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        rope_theta=1_000_000.0,
    )
    if s.family == "qwen3_moe":
        return Qwen3MoeConfig(num_experts=s.experts, norm_topk_prob=True, decoder_sparse_step=1, **common)
    if s.family == "glm4_moe":
        return Glm4MoeConfig(
            n_routed_experts=s.experts,
            n_shared_experts=1 if s.shared_intermediate else 0,
            first_k_dense_replace=0,
            partial_rotary_factor=0.5,
            attention_bias=True,
            use_qk_norm=False,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            **common,
        )
    raise ConfigError(f"no layer config for family {s.family!r}")
