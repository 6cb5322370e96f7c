"""Model specs, tiny configs, and loading through the one `from_pretrained` path.

A model spec is a hub id, a local path, or `tiny:<family>` for the embedded tiny bases (built locally and cached by
`mint.models.tiny`, never downloaded). Whatever the spec, the trainer loads the result with `AutoModelForCausalLM.
from_pretrained`, so the smoke run exercises the same code as a real run.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV32Config,
    Glm4MoeConfig,
    Glm4MoeLiteConfig,
    GlmMoeDsaConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from longstraw.routing import ExpertLayout
from mint.errors import ConfigError
from mint.models import families

TINY_PREFIX = "tiny:"
# The released families' tables, read off the registry (mint.models.families); code that must also see a family
# registered later asks the registry itself.
TINY_FAMILIES = families.names(tiny=True)
HYBRID_FAMILIES = families.names("hybrid")  # Gated DeltaNet + gated full attention, 3:1
# Multi-head latent attention MoE (DeepSeek-V3, GLM-4.7-Flash; with DSA: DeepSeek-V3.2, GLM-5). Three are shipped
# tiny bases (TINY_FAMILIES); deepseek_v32 is a config only (tests build it at random): it differs from glm_moe_dsa
# only by the indexer's RoPE layout (half-split, not interleaved) and by running an indexer in every layer, which the
# random-base tests cover, so a fourth pretrained MLA base would add build time and package bytes and no case.
MLA_FAMILIES = families.names("mla") + families.names("dsa")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tiny_config(family: str, vocab_size: int, **overrides) -> PretrainedConfig:
    """The config of an embedded tiny base: hidden 64, 4 routed experts (top-2), GQA 4:2.

    qwen3_moe / qwen2_moe: 2 layers, both MoE; qwen2_moe adds a shared expert with its sigmoid gate, which is the
    case route replay and LoRA export must also cover. glm4_moe (GLM-4.5 class): 3 layers of which the first is a
    dense MLP (first_k_dense_replace=1), sigmoid routing with group-limited top-k (2 groups of 2, one group kept)
    and routed_scaling_factor 2.5, an ungated shared expert, partial RoPE (half of head_dim 32, so the attention
    width 128 differs from hidden 64 as in GLM-4.5-Air), q/k RMSNorm and q/k/v bias. qwen3: a dense Qwen3 (no
    experts, MLP 128 wide) with head_dim 32, the smallest head vLLM's CPU attention serves (it refuses 16), so a real
    vLLM server runs it in the tests.

    The hybrid families (HYBRID_FAMILIES) are the text models of Qwen3.5-MoE (`qwen3_5_moe`: saved model_type
    `qwen3_5_moe_text`, Qwen3_5MoeForCausalLM), Qwen3-Next (`qwen3_next`) and dense Qwen3.5 (`qwen3_5`: saved
    `qwen3_5_text`, Qwen3_5ForCausalLM): 4 layers, layer_types 3 x linear_attention (Gated DeltaNet: 2 key heads and 4
    value heads of 16, causal conv 4) then 1 x full_attention (output-gated, GQA 4:2, head_dim 32, RoPE on a quarter
    of it as in the released checkpoints). The MoE ones route every layer to 4 experts of 64 (top-2, normalized) plus
    a sigmoid-gated shared expert of 64; qwen3_5 has a dense MLP 128 wide. Four layers so that one full-attention
    layer follows the linear ones, as in every 4-layer block of the real models.

    The multi-head latent attention families (MLA_FAMILIES; `_mla_dims` has the dims) are DeepSeek-V3
    (`deepseek_v3`), GLM-4.7-Flash (`glm4_moe_lite`) and, with DSA's lightning indexer, DeepSeek-V3.2
    (`deepseek_v32`, a config only) and GLM-5 (`glm_moe_dsa`): 3 layers, the first dense, V3-style sigmoid routing
    with a shared expert. The engines cache one latent and one RoPE key per token and layer (and, under DSA, the
    indexer's key); index_topk 64 covers the built-in tasks' prompts and responses, so the indexer keeps every key.

    Sizes are chosen so a CPU builds, pretrains and RL-trains one in seconds (the hybrids in minutes: without the
    fused kernels transformers runs Gated DeltaNet in plain torch).
    """
    build = TINY_CONFIGS.get(family)
    if build is None or family not in families.FAMILIES:
        raise ConfigError(f"model.path: unknown tiny family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")
    return build(family, vocab_size, **overrides)


def _tiny(config_class, dims, **own):
    """A tiny family's builder: its kind's dims (a function of vocab_size), then the family's own arguments, then the
    caller's overrides, given to the family's config class."""

    def build(family: str, vocab_size: int, **overrides) -> PretrainedConfig:
        return config_class(**(dims(vocab_size) | own | overrides))

    return build


def _qwen_moe_dims(vocab_size: int) -> dict:
    return dict(
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


def _qwen3_dims(vocab_size: int) -> dict:
    return dict(
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


def _hybrid_dims(vocab_size: int) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention refuses 16
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


_HYBRID_EXPERTS = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64
)


def _glm4_moe_dims(vocab_size: int) -> dict:
    return dict(
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


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config: a vision-language checkpoint's text_config (its sizes, experts and layers live
    there), else `config` itself."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def moe_layers(config: PretrainedConfig) -> list[int]:
    """Indices of the decoder layers whose MLP is a routed-expert block, in model order ([] for a dense model).

    A layer is dense when any of the families' rules says so: GLM / DeepSeek-V3 `first_k_dense_replace` (layers
    below it), Qwen-MoE `mlp_only_layers` (listed layers) and `decoder_sparse_step` (MoE only where (i + 1) % step
    == 0). Each rule is read only where the config has it, so one family's default never applies to another. A
    config with `mlp_layer_types` (GLM-4.7-Flash, GLM-5: "dense" / "sparse" per layer) says it per layer, and that
    list is what its decoder builds from.
    """
    config = text_config(config)
    num_experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    if not num_experts:
        return []
    kinds = getattr(config, "mlp_layer_types", None)
    if kinds:
        return [i for i, kind in enumerate(kinds[: config.num_hidden_layers]) if kind == "sparse"]
    first_moe = getattr(config, "first_k_dense_replace", None) or 0
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return [i for i in range(config.num_hidden_layers) if i >= first_moe and i not in dense and (i + 1) % step == 0]


def moe_layout(config: PretrainedConfig) -> ExpertLayout | None:
    """The expert layout of a sparse-MoE config, or None for a dense model. num_layers counts MoE layers only (the
    learner's routes); layer_ids and num_decoder_layers place them among all decoder layers (the engines' routes)."""
    config = text_config(config)
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


def _mla_dims(vocab_size: int) -> dict:
    """A tiny MLA MoE: 3 layers, 4 heads with q and kv down-projections (q_lora_rank 32, kv_lora_rank 32), nope / rope
    / v head dims 16, interleaved RoPE as released; V3-style routing: sigmoid with a score-correction bias, 2 groups
    of 2 experts (1 kept), top-2, routed scaling 2.5, one shared expert. The first layer is dense: the family says how
    (first_k_dense_replace, or mlp_layer_types)."""
    return dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        intermediate_size=128, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip


def _dsa_dims(vocab_size: int) -> dict:
    """MLA's, plus DSA's lightning indexer (2 heads of 16) picking index_topk keys per query; 64 covers the tests'
    sequences, where selection keeps every key (the dense path)."""
    return _mla_dims(vocab_size) | dict(index_topk=64, index_n_heads=2, index_head_dim=16)


_DENSE_FIRST = ["dense", "sparse", "sparse"]

# Each tiny family's config builder (family, vocab_size, **overrides) -> config, keyed by the registry's names. A new
# family of an existing kind adds its entry to mint.models.families and its builder here.
TINY_CONFIGS = {
    "qwen3_moe": _tiny(Qwen3MoeConfig, _qwen_moe_dims, head_dim=16),  # head_dim=32 serves on vLLM's CPU attention
    "qwen2_moe": _tiny(Qwen2MoeConfig, _qwen_moe_dims, shared_expert_intermediate_size=64),
    "glm4_moe": _tiny(Glm4MoeConfig, _glm4_moe_dims),
    "qwen3": _tiny(Qwen3Config, _qwen3_dims),
    "qwen3_5_moe": _tiny(Qwen3_5MoeTextConfig, _hybrid_dims, **_HYBRID_EXPERTS),
    # Qwen3_5MoeTextConfig has none of these: every layer is MoE, top-k normalized.
    "qwen3_next": _tiny(
        Qwen3NextConfig,
        _hybrid_dims,
        **_HYBRID_EXPERTS,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        intermediate_size=128,
    ),
    "qwen3_5": _tiny(Qwen3_5TextConfig, _hybrid_dims, intermediate_size=128),
    "deepseek_v3": _tiny(DeepseekV3Config, _mla_dims, first_k_dense_replace=1),
    "glm4_moe_lite": _tiny(Glm4MoeLiteConfig, _mla_dims, mlp_layer_types=_DENSE_FIRST),
    "deepseek_v32": _tiny(DeepseekV32Config, _dsa_dims, first_k_dense_replace=1),
    # GLM-5's third layer reuses the second's indexer selection.
    "glm_moe_dsa": _tiny(
        GlmMoeDsaConfig, _dsa_dims, mlp_layer_types=_DENSE_FIRST, indexer_types=["full", "full", "shared"]
    ),
}


# Vision-language checkpoints whose text model Mint trains: config.json model_type -> the text model's. The released
# Qwen3.5 and Qwen3.5-MoE checkpoints are these (Qwen3_5{Moe}ForConditionalGeneration, weights model.language_model.*
# and model.visual.*). AutoModelForCausalLM maps them to the text CausalLM (Qwen3_5{Moe}ForCausalLM), whose config is
# the checkpoint's text_config and which reads model.language_model.* as its model.* and leaves model.visual.* unread.
VLM_TEXT_MODEL_TYPES = {w.model_type: f.model_type for f in families.FAMILIES.values() for w in f.wrappers}
# Those that AutoModelForCausalLM maps to no class: the text_config's CausalLM loads with these renamings (regex ->
# replacement, applied in order) of the checkpoint's keys; the vision tower's keys match no parameter and are not read.
# Kimi-K2.5 (Kimi_K25ForConditionalGeneration, text_config deepseek_v3) as released: language_model.model.* and
# language_model.lm_head.* (per-expert experts.{e}.*, fused by transformers' deepseek_v3 conversion). Its
# save_pretrained writes that layout but with the decoder's layers as blocks (the reverse of the vision tower's
# blocks -> layers renaming hits it too); with save_original_format=False, its module names model.language_model.*.
VLM_TEXT_KEY_MAPPINGS = {
    "kimi_k25": {r"^language_model\.": "", r"^model\.language_model\.": "model.", r"^model\.blocks\.": "model.layers."}
}
# The text models AutoModelForCausalLM gives for the other VLM checkpoints; their own checkpoints load strictly too.
_MAPPED_TEXT_MODELS = {text for vlm, text in VLM_TEXT_MODEL_TYPES.items() if vlm not in VLM_TEXT_KEY_MAPPINGS}


def vlm_text_model_type(config: PretrainedConfig) -> str | None:
    """The text model's model_type when `config` is a vision-language checkpoint's (VLM_TEXT_MODEL_TYPES), else None."""
    return VLM_TEXT_MODEL_TYPES.get(getattr(config, "model_type", ""))


def causal_lm_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config AutoModelForCausalLM builds the trained model from: a VLM_TEXT_KEY_MAPPINGS checkpoint's text_config
    (transformers maps its own config to no CausalLM), else `config` itself. A meta-device skeleton of the base
    (`AutoModelForCausalLM.from_config`) takes this, not the checkpoint's config."""
    return text_config(config) if getattr(config, "model_type", "") in VLM_TEXT_KEY_MAPPINGS else config


def load_model(path: str, dtype: str = "float32", quantization: str = "auto") -> torch.nn.Module:
    """Load a causal LM from a hub id or a local directory, in eval mode, with all base weights frozen.

    An FP8 or INT4 checkpoint (model.quantization auto, fp8 or int4) keeps its quantized weights as they ship and
    computes in `dtype` (mint.models.quant, mint.models.quant_int4); `quantization` and the checkpoint must agree
    (`resolve_quantization`).

    A vision-language checkpoint of VLM_TEXT_MODEL_TYPES loads as its text model (the vision tower is not loaded):
    by AutoModelForCausalLM's own mapping, or as the text_config's CausalLM reading the keys VLM_TEXT_KEY_MAPPINGS
    renames. For those families (and the Qwen3.5 text models) a base weight the checkpoint lacks is an error, not a
    freshly initialized (and frozen) one: it is what a renaming of the checkpoint's language-model keys that did not
    apply would look like."""
    from mint.models.quant_checkpoint import load_quantized, resolve_quantization

    kind = resolve_quantization(quantization, path)
    config = AutoConfig.from_pretrained(path)
    vlm = vlm_text_model_type(config)
    renames = VLM_TEXT_KEY_MAPPINGS.get(config.model_type)
    if kind != "none":
        model = load_quantized(path, DTYPES[dtype], causal_lm_config(config), renames)
        model.eval()
        return model
    text = dict(config=causal_lm_config(config), key_mapping=renames) if renames else {}
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], output_loading_info=True, **text)
    missing = sorted(info.get("missing_keys") or [])
    if missing and (vlm or model.config.model_type in _MAPPED_TEXT_MODELS):
        raise ConfigError(f"model.path: {path} lacks {len(missing)} weights of its text model, e.g. {missing[0]}")
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
    else None (all of them). Preflight refuses a tokenizer with ids the head cannot produce. `config` may be a
    vision-language checkpoint's: the head is its text model's."""
    vocab = text_config(config).vocab_size
    return tokenizer_size if tokenizer_size is not None and tokenizer_size < vocab else None
