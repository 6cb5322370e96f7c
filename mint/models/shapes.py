"""The real bases Mint's users train, by their public config.json dimensions (nothing is downloaded).

`bench/real_shapes.py` builds a few layers of each with random weights to measure per-layer memory, and `mint plan`
multiplies those measurements by the real layer counts. The dims below are the models' published config.json values
(Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, zai-org/GLM-4.5-Air, and the hybrids below).

Hybrid shapes (Qwen3.5-MoE, Qwen3-Next) interleave Gated DeltaNet "linear_attention" layers with output-gated
"full_attention" layers: layer i is full when (i + 1) % full_attention_interval == 0 (3:1 at interval 4). Only the full
layers keep K/V pages; each linear layer keeps a boundary state per sequence: S [H_v, d_k, d_v] in fp32 and the
causal conv's window of K - 1 pre-conv rows of conv_dim = 2 H_k d_k + H_v d_v channels in the model dtype.

Multi-head latent attention (MLA) shapes (DeepSeek-V3.2, GLM-4.7-Flash, GLM-5, Kimi-K2.5's text tower) project each
token to a kv_lora_rank latent and one qk_rope_head_dim RoPE key shared by all heads; kv_b_proj expands the latent into
every head's k_nope (qk_nope_head_dim) and v (v_head_dim). LongStraw and the rollout engines keep the latent and the
roped key (a latent page: kv_lora_rank + qk_rope_head_dim values per token and layer, 576 at V3's dims), never the
expansion. The DSA shapes (`deepseek_v32`, `glm_moe_dsa`) add a lightning indexer per indexer layer: one
index_head_dim key per token (an indexer page, no gradient) scored by index_heads query heads, top index_topk keys per
query.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import (
    DeepseekV3Config,
    DeepseekV32Config,
    Glm4MoeConfig,
    Glm4MoeLiteConfig,
    GlmMoeDsaConfig,
    PretrainedConfig,
    Qwen3_5MoeTextConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from mint.errors import ConfigError
from mint.models import families


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
    # Hybrid decoders only (0 / False: every layer is a plain full-attention layer, as in the GQA MoE shapes).
    full_attention_interval: int = 0  # layer i is full attention when (i + 1) % interval == 0, else Gated DeltaNet
    linear_key_heads: int = 0  # H_k
    linear_value_heads: int = 0  # H_v
    linear_key_head_dim: int = 0  # d_k
    linear_value_head_dim: int = 0  # d_v
    linear_conv_kernel: int = 0  # K, the causal conv's width over the pre-conv q/k/v rows
    attn_output_gate: bool = False  # q_proj emits 2 x heads x head_dim: the query and a sigmoid output gate
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(Linear(hidden -> 1))
    # MLA decoders only (kv_lora_rank 0: not MLA). heads = kv_heads there, head_dim = qk_nope + qk_rope.
    q_lora_rank: int = 0  # the query's down-projection rank; 0: one q_proj [hidden -> heads x head_dim]
    kv_lora_rank: int = 0  # the latent's width
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0  # the roped key, one per token shared by all heads
    v_head_dim: int = 0
    # DSA (lightning indexer) only.
    index_heads: int = 0
    index_head_dim: int = 0  # one indexer key per token and indexer layer
    index_topk: int = 0  # keys each query attends to
    indexer_layers: int = 0  # decoder layers that run their own indexer (GLM-5: all; GLM-5.2's shared layers: not)
    # The hub card's headline, when it is rounded (30B, 1T): tests allow half of this either way; 0: exact total.
    params_rounding_b: float = 0.0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def hybrid(self) -> bool:
        return self.full_attention_interval > 0

    @property
    def full_layers(self) -> int:
        """Decoder layers with softmax attention (the only ones with K/V pages)."""
        return self.layers // self.full_attention_interval if self.hybrid else self.layers

    @property
    def linear_layers(self) -> int:
        """Gated DeltaNet layers (a recurrent boundary state each, flat in the prompt length)."""
        return self.layers - self.full_layers

    @property
    def conv_dim(self) -> int:
        """Channels of a linear layer's causal conv: q and k (H_k x d_k each) and v (H_v x d_v)."""
        return (
            2 * self.linear_key_heads * self.linear_key_head_dim + self.linear_value_heads * self.linear_value_head_dim
        )

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def dsa(self) -> bool:
        return self.indexer_layers > 0

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one prompt token over every full-attention layer; for MLA, the latent pages (what is kept)."""
        if self.mla:
            return self.latent_bytes_per_token(dtype_bytes)
        return self.full_layers * 2 * self.kv_heads * self.head_dim * dtype_bytes

    def latent_bytes_per_token(self, dtype_bytes: int) -> int:
        """MLA: the normed latent and the roped key of one prompt token over every layer."""
        return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes

    def expanded_kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """MLA: what expanded per-head K and V would take instead, heads x (qk_nope + qk_rope + v) over every layer."""
        per_head = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        return self.layers * self.heads * per_head * dtype_bytes

    def indexer_bytes_per_token(self, dtype_bytes: int) -> int:
        """DSA: the indexer key of one prompt token over every indexer layer (no gradient flows into it)."""
        return self.indexer_layers * self.index_head_dim * dtype_bytes

    def indexer_replay_bytes_per_token(self) -> int:
        """DSA indexer replay: index_topk int32 key indices per response token and indexer layer."""
        return self.indexer_layers * self.index_topk * 4

    def recurrent_state_bytes(self, window_dtype_bytes: int) -> int:
        """One linear layer's boundary state: S [H_v, d_k, d_v] in fp32 (always) + the conv window of K - 1 rows of
        conv_dim channels (window_dtype_bytes each: the model dtype; 4 for its fp32 gradient)."""
        s = self.linear_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        return s + (self.linear_conv_kernel - 1) * self.conv_dim * window_dtype_bytes

    def boundary_state_bytes(self, dtype_bytes: int) -> int:
        """One sequence's boundary state over every linear layer; independent of the prompt length."""
        return self.linear_layers * self.recurrent_state_bytes(dtype_bytes)


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
    # Hybrids. total_params_b is the headline of the hub card, rounded to whole billions; the Qwen3.5 ones count the
    # vision tower too (about 0.45 B), which the text model does not load (tests allow for both).
    # Qwen/Qwen3.5-35B-A3B: every value checked against transformers' Qwen3_5MoeTextConfig defaults (documented as
    # this checkpoint) and an independent Megatron launch script of the same dims. rope_theta 1e7.
    "qwen35_35b_a3b": RealShape(
        "Qwen3.5-35B-A3B", "qwen3_5_moe", hidden=2048, layers=40, dense_layers=0, heads=16, kv_heads=2, head_dim=256,
        experts=256, top_k=8, moe_intermediate=512, intermediate=0, shared_intermediate=512, vocab=248320,
        total_params_b=35.0, full_attention_interval=4, linear_key_heads=16, linear_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel=4, attn_output_gate=True,
        shared_expert_gate=True,
    ),
    # Qwen/Qwen3.5-122B-A10B: from one stored copy of its dims (an inference test config), not from the hub file
    # itself; the parameter count they give (122.1 B + vision) matches the published 122 B.
    "qwen35_122b_a10b": RealShape(
        "Qwen3.5-122B-A10B", "qwen3_5_moe", hidden=3072, layers=48, dense_layers=0, heads=32, kv_heads=2,
        head_dim=256, experts=256, top_k=8, moe_intermediate=1024, intermediate=0, shared_intermediate=1024,
        vocab=248320, total_params_b=122.0, full_attention_interval=4, linear_key_heads=16, linear_value_heads=64,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel=4, attn_output_gate=True,
        shared_expert_gate=True,
    ),
    # Qwen/Qwen3.5-397B-A17B: three stored sources agree on every value but shared_expert_intermediate_size, where
    # one test fixture says 4096 and two say 1024; 1024 is taken because it reproduces the published 397 B (4096
    # would give 398.6 B + vision).
    "qwen35_397b_a17b": RealShape(
        "Qwen3.5-397B-A17B", "qwen3_5_moe", hidden=4096, layers=60, dense_layers=0, heads=32, kv_heads=2,
        head_dim=256, experts=512, top_k=10, moe_intermediate=1024, intermediate=0, shared_intermediate=1024,
        vocab=248320, total_params_b=397.0, full_attention_interval=4, linear_key_heads=16, linear_value_heads=64,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel=4, attn_output_gate=True,
        shared_expert_gate=True,
    ),
    # Qwen/Qwen3-Next-80B-A3B (-Instruct): a stored copy of its config.json, and transformers' Qwen3NextConfig
    # defaults (documented as this checkpoint) agree. intermediate_size 5120 is unused (no dense layer).
    "qwen3_next_80b_a3b": RealShape(
        "Qwen3-Next-80B-A3B", "qwen3_next", hidden=2048, layers=48, dense_layers=0, heads=16, kv_heads=2,
        head_dim=256, experts=512, top_k=10, moe_intermediate=512, intermediate=5120, shared_intermediate=512,
        vocab=151936, total_params_b=80.0, full_attention_interval=4, linear_key_heads=16, linear_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel=4, attn_output_gate=True,
        shared_expert_gate=True,
    ),
    # MLA shapes. Every value below is the hub config.json's as found in several stored copies of it (vLLM, SGLang
    # and inference-engine test fixtures, Megatron launch scripts) and transformers' config defaults; where they
    # disagree it says so. Norm weights and the router's e_score_correction_bias (a buffer) are not counted.
    # deepseek-ai/DeepSeek-V3.2: 671 B is V3's main model; V3.2's indexer adds 0.85 B (61 x 14 M) and the hub's 685 B
    # counts the 14 B multi-token-prediction layer too, which the learner does not load.
    "deepseek_v32": RealShape(
        "DeepSeek-V3.2", "deepseek_v32", hidden=7168, layers=61, dense_layers=3, heads=128, kv_heads=128,
        head_dim=192, experts=256, top_k=8, moe_intermediate=2048, intermediate=18432, shared_intermediate=2048,
        vocab=129280, total_params_b=671.0, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, index_heads=64, index_head_dim=128, index_topk=2048, indexer_layers=61,
    ),
    # zai-org/GLM-4.7-Flash (glm4_moe_lite): "30B-A3B" on its card; first_k_dense_replace = 1; its MTP layer (one
    # more decoder layer) is not counted.
    "glm47_flash": RealShape(
        "GLM-4.7-Flash", "glm4_moe_lite", hidden=2048, layers=47, dense_layers=1, heads=20, kv_heads=20,
        head_dim=256, experts=64, top_k=4, moe_intermediate=1536, intermediate=10240, shared_intermediate=1536,
        vocab=154880, total_params_b=30.0, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, params_rounding_b=1.0,
    ),
    # zai-org/GLM-5 (glm_moe_dsa): "744B (40B active)" on its card. Its config has no index_topk_freq, so every layer
    # runs its own indexer (GLM-5.2 shares one indexer over 4 layers; not this shape). The index_* values come from
    # copies of the GLM-5 / GLM-5.1 config.json and transformers' GlmMoeDsaConfig defaults (documented as GLM-5).
    "glm5": RealShape(
        "GLM-5", "glm_moe_dsa", hidden=6144, layers=78, dense_layers=3, heads=64, kv_heads=64, head_dim=256,
        experts=256, top_k=8, moe_intermediate=2048, intermediate=12288, shared_intermediate=2048, vocab=154880,
        total_params_b=744.0, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
        v_head_dim=256, index_heads=32, index_head_dim=128, index_topk=2048, indexer_layers=78, params_rounding_b=1.0,
    ),
    # moonshotai/Kimi-K2.5, its text_config (deepseek_v3 architecture; the MoonViT vision tower, about 0.4 B, is
    # not loaded). Its card says "1T"; these dims give 1.026 T, as for Kimi-K2 whose report says 1.04 T: not
    # verified which parts that figure adds. routed_scaling_factor 2.827, n_group = topk_group = 1.
    "kimi_k25": RealShape(
        "Kimi-K2.5", "deepseek_v3", hidden=7168, layers=61, dense_layers=1, heads=64, kv_heads=64, head_dim=192,
        experts=384, top_k=8, moe_intermediate=2048, intermediate=18432, shared_intermediate=2048, vocab=163840,
        total_params_b=1000.0, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, params_rounding_b=100.0,
    ),
}  # fmt: skip


def shape(name: str) -> RealShape:
    if name not in SHAPES:
        raise ConfigError(f"unknown real shape {name!r}; choose one of {', '.join(SHAPES)}")
    return SHAPES[name]


def layer_types(s: RealShape, n: int) -> list[str]:
    """The schedule of a hybrid built with n layers: n - 1 Gated DeltaNet layers, then one full-attention layer (n = 4
    is the real models' repeating block; n = 2 builds one layer of each kind)."""
    return ["linear_attention"] * (n - 1) + ["full_attention"]


def layer_config(s: RealShape, moe_layers: int, max_positions: int = 40960) -> PretrainedConfig:
    """A transformers config with the real dims and `moe_layers` MoE decoder layers (no dense ones): what the
    benchmark builds with random weights to measure one MoE layer's figures. Hybrids: `layer_types(s, moe_layers)`.

    The family's builder (LAYER_CONFIGS) names its config class and what differs from its kind's common arguments."""
    build = LAYER_CONFIGS.get(s.family)
    if build is None or s.family not in families.FAMILIES:
        raise ConfigError(f"no layer config for family {s.family!r}; choose a shape of {', '.join(LAYER_CONFIGS)}")
    common = _COMMON[families.FAMILIES[s.family].kind](s, moe_layers, max_positions)
    return build(s, moe_layers, common)


def _gqa_common(s: RealShape, n: int, max_positions: int) -> dict:
    return dict(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=n,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        moe_intermediate_size=s.moe_intermediate,
        num_experts_per_tok=s.top_k,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        rope_theta=1_000_000.0,
    )


def _hybrid_common(s: RealShape, n: int, max_positions: int) -> dict:
    return dict(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        num_hidden_layers=n,
        layer_types=layer_types(s, n),
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        linear_conv_kernel_dim=s.linear_conv_kernel,
        linear_key_head_dim=s.linear_key_head_dim,
        linear_value_head_dim=s.linear_value_head_dim,
        linear_num_key_heads=s.linear_key_heads,
        linear_num_value_heads=s.linear_value_heads,
        moe_intermediate_size=s.moe_intermediate,
        shared_expert_intermediate_size=s.shared_intermediate,
        num_experts=s.experts,
        num_experts_per_tok=s.top_k,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        # Partial RoPE: 64 of head_dim 256 rotate.
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    )


def _mla_common(s: RealShape, n: int, max_positions: int) -> dict:
    """n MoE decoder layers of an MLA shape (no dense first layers). Routing is not group-limited here (n_group 1):
    the group limit picks which experts, not how many, so no figure moves."""
    return dict(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        moe_intermediate_size=s.moe_intermediate,
        num_hidden_layers=n,
        num_attention_heads=s.heads,
        num_key_value_heads=s.heads,
        n_routed_experts=s.experts,
        n_shared_experts=s.shared_intermediate // s.moe_intermediate,
        num_experts_per_tok=s.top_k,
        q_lora_rank=s.q_lora_rank or None,
        kv_lora_rank=s.kv_lora_rank,
        qk_nope_head_dim=s.qk_nope_head_dim,
        qk_rope_head_dim=s.qk_rope_head_dim,
        v_head_dim=s.v_head_dim,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )


def _dsa_common(s: RealShape, n: int, max_positions: int) -> dict:
    """MLA's, every layer with its own indexer."""
    indexer = dict(index_n_heads=s.index_heads, index_head_dim=s.index_head_dim, index_topk=s.index_topk)
    return _mla_common(s, n, max_positions) | indexer


_COMMON = {"gqa": _gqa_common, "hybrid": _hybrid_common, "mla": _mla_common, "dsa": _dsa_common}


def _glm4_moe(s: RealShape, n: int, common: dict) -> Glm4MoeConfig:
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


# Each family's real-shape builder (shape, MoE layers, its kind's common arguments) -> config, keyed by the
# registry's names: the config class and what the family sets beyond its kind's arguments. A family with measured
# shapes (families.Family.shapes) has one here.
LAYER_CONFIGS = {
    "qwen3_moe": lambda s, n, common: Qwen3MoeConfig(
        num_experts=s.experts, norm_topk_prob=True, decoder_sparse_step=1, **common
    ),
    "glm4_moe": _glm4_moe,
    "qwen3_5_moe": lambda s, n, common: Qwen3_5MoeTextConfig(**common),
    "qwen3_next": lambda s, n, common: Qwen3NextConfig(
        intermediate_size=s.intermediate, decoder_sparse_step=1, norm_topk_prob=True, **common
    ),
    "deepseek_v3": lambda s, n, common: DeepseekV3Config(first_k_dense_replace=0, **common),
    "glm4_moe_lite": lambda s, n, common: Glm4MoeLiteConfig(mlp_layer_types=["sparse"] * n, **common),
    "deepseek_v32": lambda s, n, common: DeepseekV32Config(
        first_k_dense_replace=0, mlp_layer_types=["sparse"] * n, **common
    ),
    "glm_moe_dsa": lambda s, n, common: GlmMoeDsaConfig(
        first_k_dense_replace=0, mlp_layer_types=["sparse"] * n, indexer_types=["full"] * n, **common
    ),
}
