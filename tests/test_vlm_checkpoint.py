"""A Qwen3.5(-MoE) vision-language checkpoint, as released, trains as its text model and exports to vLLM's VLM class.

The released Qwen3.5 and Qwen3.5-MoE checkpoints are Qwen3_5{Moe}ForConditionalGeneration (model_type qwen3_5_moe /
qwen3_5; weights model.language_model.* and model.visual.*). A tiny one of each is built here with transformers' own
classes and save_pretrained. Checked:

- `load_model` gives the text CausalLM (its config the checkpoint's text_config), holding exactly the VLM's language
  weights, whose logits equal the VLM's own text-only forward; a checkpoint missing a language weight is refused;
- the adapter directory a rollout actor writes for vLLM on that base names its modules as the checkpoint does
  (model.language_model.layers.*), keeps the fused 3-D expert LoRA (vLLM's Qwen3_5MoeForConditionalGeneration reads
  only that), and reads back (`mint serve`) as the trained revision, hash-checked;
- PEFT loads that directory onto transformers' VLM class and gives the trained text model's logits, with LoRA on the
  same modules and none on the vision tower: the names and the suffix targets mean what they meant in training;
- SGLang is refused in one line.
vLLM's own loader on these directories: tests/test_vllm_lora_conformance.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
)

from mint.config import LoraConfig
from mint.errors import ConfigError, MintError
from mint.hub.export import engine_layout, read_adapter_dir, write_adapter_dir
from mint.hub.revisions import revision_id
from mint.models.lora import adapter_config_dict, add_lora, load_lora_state, lora_state
from mint.models.specs import load_model

VLM_CLASSES = {"qwen3_5_moe": Qwen3_5MoeForConditionalGeneration, "qwen3_5": Qwen3_5ForConditionalGeneration}
TEXT = {"qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"), "qwen3_5": ("Qwen3_5ForCausalLM", "qwen3_5_text")}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
GDN = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
TARGETS = {"qwen3_5_moe": ATTENTION + GDN, "qwen3_5": ATTENTION + GDN + MLP}  # MoE: the experts through target_experts
RANK = 8


def build_vlm_tiny(model_type: str, directory: str, vocab_size: int = 97, seed: int = 0) -> str:
    """Save a random tiny Qwen3.5 VLM checkpoint of `model_type` (qwen3_5_moe / qwen3_5) and return it: the text dims
    of Mint's tiny hybrids (hidden 64, layer_types 3 x linear + 1 x full, GQA 4:2 of head_dim 32 with RoPE on a
    quarter, Gated DeltaNet 2 key / 4 value heads of 16; MoE: 4 experts top-2 of 64 plus a shared expert of 64; dense:
    MLP 128), mrope sections over the 4 rotary frequencies, and a one-block vision tower; init std 0.05 as
    build_random_tiny."""
    text = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.05,
    )
    if model_type == "qwen3_5_moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)
    else:
        text.update(intermediate_size=128)
    vision = dict(
        depth=1,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
        num_position_embeddings=16,
        initializer_range=0.05,
    )
    config_cls = Qwen3_5MoeConfig if model_type == "qwen3_5_moe" else Qwen3_5Config
    config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=False, initializer_range=0.05)
    torch.manual_seed(seed)
    VLM_CLASSES[model_type](config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=list(VLM_CLASSES))
def vlm_base(request, tmp_path_factory) -> tuple[str, str]:
    """(model_type, directory) of a tiny VLM checkpoint."""
    return request.param, build_vlm_tiny(request.param, str(tmp_path_factory.mktemp(f"vlm_{request.param}")))


def _ids() -> torch.Tensor:
    return torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))


def _vlm(model_type: str, path: str):
    return VLM_CLASSES[model_type].from_pretrained(path, dtype=torch.float32).eval()


def test_the_saved_checkpoint_is_a_vlm_one(vlm_base):
    model_type, path = vlm_base
    saved = json.loads((Path(path) / "config.json").read_text())
    assert saved["model_type"] == model_type and saved["architectures"] == [VLM_CLASSES[model_type].__name__]
    keys = set(load_file(f"{path}/model.safetensors"))
    assert any(k.startswith("model.visual.") for k in keys)
    assert keys and all(k.startswith(("model.visual.", "model.language_model.", "lm_head.")) for k in keys)


def test_load_model_gives_the_text_model_with_the_vlms_text_logits(vlm_base):
    """The text CausalLM, its config the text_config, every weight the VLM's language model's bit for bit, and the
    logits of the VLM's own forward on the same input_ids (no images) exactly."""
    model_type, path = vlm_base
    lm, vlm = load_model(path), _vlm(model_type, path)
    assert (type(lm).__name__, lm.config.model_type) == TEXT[model_type]
    assert not any("visual" in n for n, _ in lm.named_parameters())
    language = dict(vlm.model.language_model.named_parameters()) | {"lm_head.weight": vlm.lm_head.weight}
    mine = {n.removeprefix("model."): p for n, p in lm.named_parameters()}
    assert set(mine) == set(language)
    assert all(torch.equal(mine[n], language[n]) for n in mine)
    with torch.no_grad():
        want, got = vlm(input_ids=_ids()).logits, lm(input_ids=_ids()).logits
    assert want.abs().max() > 0.1  # random weights at std 0.05 give non-trivial logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_load_model_refuses_a_vlm_checkpoint_without_a_language_weight(vlm_base, tmp_path):
    model_type, _ = vlm_base
    broken = build_vlm_tiny(model_type, str(tmp_path / "broken"))
    weights = load_file(f"{broken}/model.safetensors")
    del weights["model.language_model.layers.3.self_attn.q_proj.weight"]
    save_file(weights, f"{broken}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ConfigError, match=re.escape("lacks 1 weights of its text model, e.g. model.layers.3.self_attn.q_proj")
    ):
        load_model(broken)


def _trained(path: str, model_type: str, factored: bool = True):
    """The learner's LoRA on the text model of `path` with A and B ~ N(0, 0.05^2) (PEFT starts B at zero)."""
    lora = LoraConfig(rank=RANK, alpha=2.0 * RANK, target_modules=TARGETS[model_type])
    model = add_lora(load_model(path), lora, seed=0, factored_experts=factored)
    g = torch.Generator().manual_seed(7)
    load_lora_state(model, {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in lora_state(model).items()})
    return model


@pytest.fixture(scope="module")
def vllm_dir(vlm_base, tmp_path_factory):
    """The adapter directory a vLLM rollout actor writes on the VLM base, and what it was written from."""
    model_type, path = vlm_base
    model = _trained(path, model_type)
    tensors, adapter_config = lora_state(model), adapter_config_dict(model, path)
    config = AutoConfig.from_pretrained(path)  # what the actor and preflight read: config.json, the VLM's
    layout = engine_layout("auto", adapter_config, config, engine="vllm")
    out = tmp_path_factory.mktemp(f"vllm_dir_{model_type}") / "rev"
    write_adapter_dir(out, revision_id(tensors), tensors, adapter_config, {"run": "t"}, layout, config)
    return dict(model_type=model_type, path=path, model=model, tensors=tensors, config=config, layout=layout, out=out)


def test_vllm_directory_names_modules_as_the_checkpoint_and_keeps_experts_fused(vllm_dir):
    d = vllm_dir
    assert d["layout"] == "peft"  # the VLM class reads 3-D expert LoRA (is_3d_moe_weight), PEFT's own layout
    written = load_file(str(d["out"] / "adapter_model.safetensors"))
    want = {k.replace("base_model.model.model.layers.", "base_model.model.model.language_model.layers."): v
            for k, v in d["tensors"].items()}  # fmt: skip
    assert all(k.startswith("base_model.model.model.layers.") for k in d["tensors"])
    assert set(written) == set(want)
    assert all(torch.equal(written[k], want[k]) for k in want)
    experts = {k for k in written if ".mlp.experts." in k}
    if d["model_type"] == "qwen3_5_moe":  # fused: experts.base_layer (gate_up_proj) and experts (down_proj), 2-D
        assert {k.split(".mlp.experts.")[1] for k in experts} == {
            f"{m}lora_{f}.weight" for m in ("", "base_layer.") for f in "AB"
        }
        down_a = written["base_model.model.model.language_model.layers.0.mlp.experts.lora_A.weight"]
        assert down_a.shape == (4 * RANK, 64)  # (E * r, moe_intermediate): PEFT's fused down_proj A
    else:
        assert not experts
    meta = json.loads((d["out"] / "mint_revision.json").read_text())
    assert meta["module_prefix"] == "model.language_model." and meta["format"] == "peft"


def test_vllm_directory_reads_back_as_the_trained_revision(vllm_dir):
    """`mint serve` runs the text model: it reads the directory back under the trained names, hash-checked; one
    changed value is refused."""
    d = vllm_dir
    back, _, meta = read_adapter_dir(d["out"], d["model"].config)
    assert meta["id"] == revision_id(d["tensors"]) and set(back) == set(d["tensors"])
    assert all(torch.equal(back[k], d["tensors"][k]) for k in back)
    tampered = d["out"].parent / "tampered"
    tampered.mkdir()
    for f in d["out"].iterdir():
        (tampered / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(tampered / "adapter_model.safetensors"))
    key = next(k for k in weights if "in_proj_qkv.lora_B" in k)
    weights[key][0, 0] += 1.0
    (tampered / "adapter_model.safetensors").chmod(0o644)
    save_file(weights, str(tampered / "adapter_model.safetensors"))
    with pytest.raises(MintError):
        read_adapter_dir(tampered, d["model"].config)


def test_peft_on_the_vlm_class_applies_the_directory_as_trained(vllm_dir):
    """transformers' VLM class with the directory loaded by PEFT (names model.language_model.*, targets as written)
    gives the trained text model's logits: LoRA on exactly the trained modules, none on the vision tower."""
    d = vllm_dir
    trained = _trained(d["path"], d["model_type"], factored=False)  # PEFT's own expert path on both sides
    vlm = PeftModel.from_pretrained(_vlm(d["model_type"], d["path"]), str(d["out"])).eval()
    wrapped = {n for n, m in vlm.named_modules() if hasattr(m, "lora_A")}
    assert wrapped and not any(".visual." in n for n in wrapped)
    want = {n.replace("model.model.layers.", "model.model.language_model.layers.")
            for n, m in trained.named_modules() if hasattr(m, "lora_A")}  # fmt: skip
    assert wrapped == want
    with torch.no_grad():
        got, want_logits = vlm(input_ids=_ids()).logits, trained(input_ids=_ids()).logits
        with vlm.disable_adapter():
            plain = vlm(input_ids=_ids()).logits
    assert (plain - want_logits).abs().max() > 1e-2  # the LoRA moves the logits, so the comparison means something
    torch.testing.assert_close(got, want_logits, rtol=1e-5, atol=1e-5)


def test_engine_layout_on_a_vlm_base(vlm_base):
    """vLLM: peft (fused experts) by auto and on request; per-expert, which its 3-D wrapper does not read, refused on
    the MoE one. SGLang: refused in one line, with or without expert LoRA."""
    model_type, path = vlm_base
    config = AutoConfig.from_pretrained(path)
    experts = {"r": RANK, "target_modules": ["q_proj"], "target_parameters": ["mlp.experts.gate_up_proj"]}
    for adapter in ({"r": RANK, "target_modules": ["q_proj"]}, experts):
        assert engine_layout("auto", adapter, config, engine="vllm") == "peft"
        assert engine_layout("peft", adapter, config, engine="vllm") == "peft"
        for layout in ("auto", "peft", "per-expert"):
            with pytest.raises(MintError, match=f"sglang: LoRA on a {model_type} VLM checkpoint") as err:
                engine_layout(layout, adapter, config, engine="sglang")
            assert "\n" not in str(err.value)
    if model_type == "qwen3_5_moe":
        with pytest.raises(MintError, match="vllm reads qwen3_5_moe expert LoRA in the peft layout, not per-expert"):
            engine_layout("per-expert", experts, config, engine="vllm")


def test_the_expert_layout_of_a_vlm_checkpoint_is_its_text_models():
    """A VLM checkpoint's composite config keeps the experts and layers in text_config: route replay, preflight's EP
    and R3 checks and the expert LoRA targets read them there, not as a dense model."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    from mint.models.lora import peft_config
    from mint.models.specs import moe_layout

    text = dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=4)
    layout = moe_layout(Qwen3_5MoeConfig(text_config=text))
    assert (layout.num_layers, layout.num_experts, layout.top_k) == (4, 4, 2)
    assert peft_config(LoraConfig(), Qwen3_5MoeConfig(text_config=text)).target_parameters
    assert moe_layout(Qwen3_5Config()) is None
