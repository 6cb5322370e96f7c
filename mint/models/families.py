"""The model families Mint trains: one `Family` entry each, the one place a family's facts are written.

Every table that used to list family names is derived from `FAMILIES` here: the tiny bases and the attention kinds
(mint.models.specs), the vision-language wrappers whose text model Mint trains (specs.load_model), the layouts each
serving engine reads expert LoRA in and the adapters it refuses (mint.hub.export, preflight), the hub ids with
measured real shapes (mint.models.plan, `mint plan`). LongStraw needs no entry: it picks its adapter from the model's
modules (`longstraw.adapters.kind_of`), and a test checks that the kind it finds is the entry's.

A new family of a kind Mint already has is one `register(Family(...))` plus, for a tiny base, its config builder in
mint.models.specs (`TINY_CONFIGS`) and, for a measured hub id, its layer-config builder in mint.models.shapes
(`LAYER_CONFIGS`); tests/test_families.py registers one that way, trains it a step and plans it at real dims.
Data only: importing this module loads neither torch nor transformers (export reads it on paths that must stay
light).
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("gqa", "hybrid", "mla", "dsa")  # LongStraw's adapter kinds (longstraw.adapters.KINDS)
ENGINES = ("vllm", "sglang", "mint")  # what reads an exported adapter: vLLM, SGLang, `mint serve`
PER_EXPERT = ("per-expert",)

# Why an engine is handed no adapter of a family at all, in one line (docs/mint.md, "Export" has the evidence).
_SGLANG_VLM = "sglang: LoRA on a {} VLM checkpoint is unchecked; use vllm, or serve the text checkpoint ({}_text)"
_VLLM_KIMI = "vllm: its KimiK25ForConditionalGeneration (kimi_k25) takes no LoRA (--enable-lora fails); use builtin"
_SGLANG_KIMI = "sglang: LoRA on a kimi_k25 checkpoint is unverified (no test runs SGLang's loader on one); use builtin"
# vLLM's absorbed MLA decode never calls kv_b_proj, so its LoRA there would load and never apply; SGLang applies it.
_VLLM_KV_B = "vllm drops kv_b_proj LoRA on {} in decode (absorbed MLA); drop it from lora.target_modules"


@dataclass(frozen=True)
class Wrapper:
    """A vision-language checkpoint (its config.json's model_type) whose text model is the family's: what each
    engine reads in it and what it refuses, which can differ from the text checkpoint's."""

    model_type: str
    layouts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    """One model family, named as recipes name it (`tiny:<name>`, `mint plan`); its text model's `model_type` is
    the name unless said (Qwen3.5's text models save `qwen3_5_moe_text` / `qwen3_5_text`).

    kind: LongStraw's attention kind ("gqa", "hybrid", "mla", "dsa"). experts: routed experts (R3, expert LoRA,
    engine layouts apply). tiny: a shipped or buildable `tiny:<name>` base (its config in mint.models.specs).
    layouts: per engine, the expert-LoRA layouts it reads for a checkpoint of this model_type, the first being what
    `auto` writes (read off the engines' own loaders). refused: per engine, why it takes no adapter of this family.
    refused_modules: per engine, target modules whose LoRA it loads but does not apply, with why. wrappers: the VLM
    checkpoints whose text model this is. shapes: hub id -> the key of its measured real shape (mint.models.shapes).
    """

    name: str
    kind: str
    experts: bool
    tiny: bool = False
    model_type: str = ""
    layouts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    refused_modules: dict[str, dict[str, str]] = field(default_factory=dict)
    wrappers: tuple[Wrapper, ...] = ()
    shapes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model_type:
            object.__setattr__(self, "model_type", self.name)
        if self.kind not in KINDS:
            raise ValueError(f"family {self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        for engine in (*self.layouts, *self.refused, *self.refused_modules):
            if engine not in ENGINES:
                raise ValueError(f"family {self.name}: engine {engine!r} is not one of {', '.join(ENGINES)}")
        if self.experts and not self.layouts:
            # Without one, `auto` would have to guess the layout an engine reads: the guess once broke GLM on both.
            raise ValueError(f"family {self.name}: a family with experts names the layouts each engine reads")


def _moe(layouts=None, **kw) -> dict:
    """The usual expert-LoRA layouts: per-expert keys on vLLM and SGLang; `mint serve` reads PEFT's fused keys too."""
    every = {"vllm": PER_EXPERT, "sglang": PER_EXPERT, "mint": ("peft", *PER_EXPERT)}
    return {"experts": True, "layouts": layouts or every, **kw}


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family (a test may add one; the module's own entries below are the released ones)."""
    if family.name in FAMILIES:
        raise ValueError(f"family {family.name} is registered already")
    FAMILIES[family.name] = family
    return family


for _family in (
    Family(
        "qwen3_moe",
        "gqa",
        tiny=True,
        shapes={
            "Qwen/Qwen3-30B-A3B": "qwen3_30b_a3b",
            "Qwen/Qwen3-30B-A3B-Base": "qwen3_30b_a3b",
            "Qwen/Qwen3-235B-A22B": "qwen3_235b_a22b",
        },
        **_moe(),
    ),
    Family("qwen2_moe", "gqa", tiny=True, **_moe()),
    Family("glm4_moe", "gqa", tiny=True, shapes={"zai-org/GLM-4.5-Air": "glm45_air"}, **_moe()),
    Family("qwen3", "gqa", experts=False, tiny=True),
    Family("qwen2", "gqa", experts=False),
    Family(
        "qwen3_5_moe",
        "hybrid",
        tiny=True,
        model_type="qwen3_5_moe_text",
        # vLLM's Qwen3_5MoeForConditionalGeneration reads fused expert LoRA (is_3d_moe_weight) under the VLM's names.
        wrappers=(
            Wrapper(
                "qwen3_5_moe",
                layouts={"vllm": ("peft",)},
                refused={"sglang": _SGLANG_VLM.format("qwen3_5_moe", "qwen3_5_moe")},
            ),
        ),
        shapes={
            "Qwen/Qwen3.5-35B-A3B": "qwen35_35b_a3b",
            "Qwen/Qwen3.5-122B-A10B": "qwen35_122b_a10b",
            "Qwen/Qwen3.5-397B-A17B": "qwen35_397b_a17b",
            "Qwen/Qwen3.5-397B-A17B-FP8": "qwen35_397b_a17b",
        },
        **_moe(),
    ),
    Family(
        "qwen3_next",
        "hybrid",
        tiny=True,
        shapes={
            "Qwen/Qwen3-Next-80B-A3B-Instruct": "qwen3_next_80b_a3b",
            "Qwen/Qwen3-Next-80B-A3B-Thinking": "qwen3_next_80b_a3b",
        },
        **_moe(),
    ),
    Family(
        "qwen3_5",
        "hybrid",
        experts=False,
        tiny=True,
        model_type="qwen3_5_text",
        wrappers=(Wrapper("qwen3_5", refused={"sglang": _SGLANG_VLM.format("qwen3_5", "qwen3_5")}),),
    ),
    Family(
        "deepseek_v3",
        "mla",
        tiny=True,
        refused_modules={"vllm": {"kv_b_proj": _VLLM_KV_B.format("deepseek_v3")}},
        # Kimi-K2.5's checkpoint is a VLM over a DeepSeek-V3 text model, whose keys transformers does not map.
        wrappers=(
            Wrapper("kimi_k25", layouts={"vllm": PER_EXPERT}, refused={"vllm": _VLLM_KIMI, "sglang": _SGLANG_KIMI}),
        ),
        shapes={"moonshotai/Kimi-K2.5": "kimi_k25"},
        **_moe(),
    ),
    Family(
        "glm4_moe_lite",
        "mla",
        tiny=True,
        refused_modules={"vllm": {"kv_b_proj": _VLLM_KV_B.format("glm4_moe_lite")}},
        shapes={"zai-org/GLM-4.7-Flash": "glm47_flash"},
        **_moe(),
    ),
    Family(
        "deepseek_v32",
        "dsa",
        refused_modules={"vllm": {"kv_b_proj": _VLLM_KV_B.format("deepseek_v32")}},
        shapes={"deepseek-ai/DeepSeek-V3.2": "deepseek_v32"},
        **_moe(),
    ),
    Family(
        "glm_moe_dsa",
        "dsa",
        tiny=True,
        refused_modules={"vllm": {"kv_b_proj": _VLLM_KV_B.format("glm_moe_dsa")}},
        shapes={"zai-org/GLM-5": "glm5", "zai-org/GLM-5-FP8": "glm5"},
        **_moe(),
    ),
):
    register(_family)


def family(model_type: str) -> Family | None:
    """The family of a checkpoint's model_type: its text model's, or a wrapper's (a VLM over its text model)."""
    found = next((f for f in FAMILIES.values() if f.model_type == model_type), None)
    return found or next((f for f in FAMILIES.values() for w in f.wrappers if w.model_type == model_type), None)


def wrapper(model_type: str) -> Wrapper | None:
    return next((w for f in FAMILIES.values() for w in f.wrappers if w.model_type == model_type), None)


def names(kind: str | None = None, *, tiny: bool | None = None) -> tuple[str, ...]:
    """Family names of the given kind / with a tiny base, in registration order."""
    return tuple(
        f.name for f in FAMILIES.values() if (kind is None or f.kind == kind) and (tiny is None or f.tiny == tiny)
    )


def engine_layouts(engine: str, model_type: str) -> tuple[str, ...] | None:
    """The expert-LoRA layouts `engine` reads for a checkpoint of `model_type` (the first is `auto`'s), or None
    when no entry says (an unknown family, or an engine the entry does not name)."""
    w = wrapper(model_type)
    if w is not None and engine in w.layouts:
        return w.layouts[engine]
    f = family(model_type)
    return None if f is None else f.layouts.get(engine)


def engine_refusal(engine: str, model_type: str) -> str | None:
    """Why `engine` takes no adapter of a `model_type` checkpoint, or None."""
    w = wrapper(model_type)
    if w is not None:
        return w.refused.get(engine)
    f = family(model_type)
    return None if f is None else f.refused.get(engine)


def refused_modules(engine: str, text_model_type: str) -> dict[str, str]:
    """Target modules whose LoRA `engine` loads but does not apply on a `text_model_type` base, with why."""
    f = family(text_model_type)
    return {} if f is None or wrapper(text_model_type) else dict(f.refused_modules.get(engine, {}))


def hub_shapes() -> dict[str, str]:
    """Hub id -> real-shape key, over every family."""
    return {hub: shape for f in FAMILIES.values() for hub, shape in f.shapes.items()}
