"""Export: PEFT reproduces the training model's logits; the per-expert split is exact and uses the module names of the
per-expert checkpoint layout (checked through transformers' own per-expert -> fused loader); merged only on request."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_random_tiny
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from mint.cli import main
from mint.config import LoraConfig
from mint.errors import MintError
from mint.hub.catalog import Catalog
from mint.hub.export import (
    engine_layout,
    export,
    export_peft,
    fuse_experts,
    lora_size,
    read_adapter_dir,
    split_experts,
    write_adapter_dir,
)
from mint.hub.integrity import verify_catalog
from mint.hub.revisions import ADAPTER_FILE, CONFIG_FILE, base_fingerprint, read_revision_dir, revision_id
from mint.models import families, specs
from mint.models.expert_lora import factor_experts
from mint.models.lora import adapter_config_dict, add_lora, load_lora_state, lora_state, peft_config
from mint.models.specs import load_model, moe_layers, moe_layout, tiny_config

X = torch.tensor([[3, 17, 42, 8, 91, 5, 60, 11, 29]])


def _trained(base: str, seed: int = 1, lora: LoraConfig | None = None):
    """The learner's model (base + LoRA built from the recipe) with non-zero LoRA weights, as after some steps."""
    model = add_lora(load_model(base), lora or LoraConfig(), seed=0)
    g = torch.Generator().manual_seed(seed)
    load_lora_state(model, {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in lora_state(model).items()})
    return model


def _publish(tmp_path: Path, base: str, model) -> tuple[Catalog, str]:
    cat = Catalog(tmp_path / "catalog")
    config = json.loads(json.dumps(adapter_config_dict(model, base)))
    meta = cat.put(lora_state(model), config, run="t", step=1, base_model=base, base_fingerprint=base_fingerprint(base))
    return cat, meta.id


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=X).logits


def test_peft_export_loads_with_peft_and_gives_the_training_logits(random_tiny_path, tmp_path):
    trained = _trained(random_tiny_path)
    cat, rid = _publish(tmp_path, random_tiny_path, trained)
    report = export(cat, rid[:10], tmp_path / "peft", "peft")
    assert report["revision"] == rid and 0 < report["revision_bytes_over_merged"] < 1
    assert not (tmp_path / "peft" / "model.safetensors").exists(), "peft export must never write a merged model"
    # Plain PEFT (what a serving engine runs) computes W + s·B@A; training ran the factored x@A@B: same tensors,
    # rounding-level differences (3.6e-7 in fp32). Factored the same way, the loaded adapter is bit-identical.
    loaded = PeftModel.from_pretrained(load_model(random_tiny_path), str(tmp_path / "peft"))
    torch.testing.assert_close(_logits(loaded), _logits(trained), rtol=0, atol=1e-5)
    assert factor_experts(loaded) > 0
    torch.testing.assert_close(_logits(loaded), _logits(trained), rtol=0, atol=0)
    with pytest.raises(MintError, match="already exists"):
        export(cat, rid, tmp_path / "peft", "peft")


def _flip(path: Path) -> None:
    path.chmod(0o644)  # catalog files are read-only; root writes them anyway, a non-root run needs this
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01
    path.write_bytes(bytes(data))


def test_peft_exports_are_independent_copies(tmp_path):
    """`<run>/adapters/step_N` was once a hard link to the catalog's file, so one flipped byte corrupted both: every
    export is a copy."""
    cat = Catalog(tmp_path / "catalog")
    g = torch.Generator().manual_seed(0)
    tensors = {"x.lora_A.weight": torch.randn(2, 3, generator=g), "x.lora_B.weight": torch.randn(3, 2, generator=g)}
    rid = cat.put(tensors, {"r": 2, "lora_alpha": 4.0}, run="t", step=1).id
    a, b = export_peft(cat, rid, tmp_path / "a"), export_peft(cat, rid, tmp_path / "b")
    catalog_file = cat.revision_dir(rid) / ADAPTER_FILE
    assert (a / ADAPTER_FILE).stat().st_ino != catalog_file.stat().st_ino and catalog_file.stat().st_nlink == 1

    _flip(a / ADAPTER_FILE)  # a damaged export leaves the catalog whole
    with pytest.raises(MintError, match="refusing to load"):
        read_revision_dir(a)
    assert verify_catalog(cat).ok and cat.load(rid)[1].id == rid

    _flip(catalog_file)  # and a damaged catalog leaves the export whole
    assert read_revision_dir(b, expect_id=rid)[2]["id"] == rid
    assert [p.revision for p in verify_catalog(cat).problems] == [rid]
    with pytest.raises(MintError, match="refusing to load"):  # nothing unverified is ever copied out
        export_peft(cat, rid, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def _merge_per_expert_into_checkpoint(base: str, adapter_dir: Path, out: Path) -> None:
    """Fold per-expert 2-D LoRA into the base checkpoint by key name alone: W[module] += scale * B @ A.

    transformers saves Qwen-MoE experts per expert (`mlp.experts.{e}.gate_proj.weight`, the hub layout) and fuses
    them on load, so a wrong name, expert index or gate/up order shows up as wrong logits.
    """
    config = json.loads((adapter_dir / CONFIG_FILE).read_text())
    scale = config["lora_alpha"] / config["r"]
    lora = load_file(str(adapter_dir / ADAPTER_FILE))
    weights = load_file(str(Path(base) / "model.safetensors"))
    modules = {k[: -len(".lora_A.weight")] for k in lora if k.endswith(".lora_A.weight")}
    for module in modules:
        key = module.removeprefix("base_model.model.") + ".weight"
        assert key in weights, f"{key}: per-expert LoRA names a module the checkpoint does not have"
        delta = lora[f"{module}.lora_B.weight"] @ lora[f"{module}.lora_A.weight"]
        weights[key] = weights[key] + scale * delta
    shutil.copytree(base, out)
    save_file(weights, str(out / "model.safetensors"))


def _assert_split_is_exact_and_serves_the_same_model(base: str, tmp_path: Path, lora: LoraConfig | None = None) -> None:
    trained = _trained(base, lora=lora)
    cat, rid = _publish(tmp_path, base, trained)
    tensors, meta = cat.load(rid)
    base_config = AutoConfig.from_pretrained(base)
    split, config = split_experts(tensors, meta.lora_config, base_config)

    layout = moe_layout(base_config)  # GLM's dense first layer has no experts
    H, inter, r = base_config.hidden_size, base_config.moe_intermediate_size, meta.lora_config["r"]
    expert_keys = [k for k in split if ".mlp.experts." in k]
    assert len(expert_keys) == layout.num_layers * layout.num_experts * 3 * 2 and not any(
        ".base_layer." in k for k in split
    )
    prefix = f"base_model.model.model.layers.{moe_layers(base_config)[-1]}.mlp.experts.3"
    assert split[f"{prefix}.gate_proj.lora_A.weight"].shape == (r, H)
    assert split[f"{prefix}.up_proj.lora_B.weight"].shape == (inter, r)
    assert split[f"{prefix}.down_proj.lora_A.weight"].shape == (r, inter)
    assert split[f"{prefix}.down_proj.lora_B.weight"].shape == (H, r)
    assert config["target_parameters"] is None and {"gate_proj", "up_proj", "down_proj"} <= set(
        config["target_modules"]
    )

    back = fuse_experts(split, meta.lora_config, base_config)  # recombining gives the very same bits
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)

    export(cat, rid, tmp_path / "per-expert", "per-expert")
    _merge_per_expert_into_checkpoint(base, tmp_path / "per-expert", tmp_path / "merged-by-name")
    served = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged-by-name"), dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(served), _logits(trained), rtol=1e-5, atol=1e-5)
    cat.close()


def test_per_expert_split_is_exact_and_serves_the_same_model(random_tiny_path, tmp_path):
    _assert_split_is_exact_and_serves_the_same_model(random_tiny_path, tmp_path)


def test_glm4_moe_expert_lora_splits_per_expert_and_serves_the_same_model(random_glm_path, tmp_path):
    """GLM-4.5 expert LoRA could not be written per expert (the split knew only Qwen-MoE), so a vLLM or SGLang engine
    was handed PEFT's fused layout, which neither loads. GLM's fused gate_up rows are [gate; up] as in Qwen-MoE, so the
    same split applies: exact, and folded in by name through transformers' own per-expert -> fused GLM loader it gives
    the trained model's logits (a swapped gate/up or a wrong expert index would not). What a rollout actor writes for
    GLM reads back (`mint serve`) as the trained revision."""
    _assert_split_is_exact_and_serves_the_same_model(random_glm_path, tmp_path)
    with Catalog(tmp_path / "catalog") as cat:
        rid = cat.latest("t").id
        tensors, meta = cat.load(rid)
    base_config = AutoConfig.from_pretrained(random_glm_path)
    assert engine_layout("auto", meta.lora_config, base_config, engine="vllm") == "per-expert"
    out = write_adapter_dir(tmp_path / "engine", rid, tensors, meta.lora_config, {}, "per-expert", base_config)
    back, _, recorded = read_adapter_dir(out, base_config)
    assert (
        recorded["id"] == rid and all(torch.equal(back[k], tensors[k]) for k in tensors) and set(back) == set(tensors)
    )


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_next"])
def test_hybrid_expert_lora_splits_per_expert_and_serves_the_same_model(family, tmp_path):
    """Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet layers, a shared expert beside the routed ones): the fused expert
    LoRA splits per expert exactly, folded in by name through transformers' own per-expert -> fused loader it gives
    the trained model's logits, and vLLM, SGLang and `mint serve` get the layout the table gives them."""
    from test_expert_lora import build_hybrid_tiny

    base = build_hybrid_tiny(family, str(tmp_path / "base"))
    _assert_split_is_exact_and_serves_the_same_model(base, tmp_path)
    with Catalog(tmp_path / "catalog") as cat:
        tensors, meta = cat.load(cat.latest("t").id)
    config = AutoConfig.from_pretrained(base)
    assert config.model_type == family
    for engine in ("vllm", "sglang"):
        assert engine_layout("auto", meta.lora_config, config, engine=engine) == "per-expert"
        with pytest.raises(MintError, match=f"{engine} reads {family} expert LoRA in the per-expert layout, not peft"):
            engine_layout("peft", meta.lora_config, config, engine=engine)
    assert engine_layout("per-expert", meta.lora_config, config, engine="mint") == "per-expert"
    out = write_adapter_dir(tmp_path / "engine", meta.id, tensors, meta.lora_config, {}, "per-expert", config)
    back, _, recorded = read_adapter_dir(out, config)
    assert recorded["id"] == meta.id and set(back) == set(tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa"])
def test_mla_expert_lora_splits_per_expert_and_serves_the_same_model(family, tmp_path):
    """The multi-head latent attention families (a dense first layer, V3-style routing, a shared expert beside the
    routed ones; the DSA ones on their dense path): with LoRA on every MLA projection and the fused experts, the
    per-expert split is exact, and folded in by name through transformers' own per-expert -> fused loader it gives the
    trained model's logits (so their fused gate_up rows are [gate; up]). vLLM and SGLang get per-expert; kv_b_proj,
    whose LoRA vLLM's absorbed MLA decode drops, is refused for vLLM in one line (and not for SGLang, which folds it
    into its absorbed path); without it vLLM gets per-expert. What is written reads back as the trained revision."""
    assert family in specs.MLA_FAMILIES and families.FAMILIES[family].experts
    base = build_random_tiny(family, str(tmp_path / "base"))
    _assert_split_is_exact_and_serves_the_same_model(base, tmp_path, LoraConfig(target_modules=MLA_TARGETS))
    with Catalog(tmp_path / "catalog") as cat:
        tensors, meta = cat.load(cat.latest("t").id)
    config = AutoConfig.from_pretrained(base)
    assert config.model_type == family and moe_layers(config) == [1, 2]
    assert not any(".layers.0.mlp." in k for k in tensors)  # the dense first layer carries no LoRA
    assert {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors} >= set(MLA_TARGETS)
    for layout in ("auto", "peft", "per-expert"):
        with pytest.raises(MintError, match=f"vllm drops kv_b_proj LoRA on {family} in decode") as err:
            engine_layout(layout, meta.lora_config, config, engine="vllm")
        assert "\n" not in str(err.value)
    assert engine_layout("auto", meta.lora_config, config, engine="sglang") == "per-expert"
    with pytest.raises(MintError, match=f"sglang reads {family} expert LoRA in the per-expert layout, not peft"):
        engine_layout("peft", meta.lora_config, config, engine="sglang")
    assert engine_layout("auto", meta.lora_config, config, engine="mint") == "peft"
    without_kv_b = {**meta.lora_config, "target_modules": sorted(set(MLA_TARGETS) - {"kv_b_proj"})}
    assert engine_layout("auto", without_kv_b, config, engine="vllm") == "per-expert"
    out = write_adapter_dir(tmp_path / "engine", meta.id, tensors, meta.lora_config, {}, "per-expert", config)
    back, _, recorded = read_adapter_dir(out, config)
    assert recorded["id"] == meta.id and set(back) == set(tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_engine_adapter_dirs_read_back_as_the_trained_revision(random_tiny_path, tmp_path):
    """What a rollout actor writes for its engine: the per-expert layout records the trained revision's id
    and config, and `read_adapter_dir` (what `mint serve` loads) fuses it back to the very tensors of that id; the
    peft layout is the revision as trained. A `mint export --format per-expert` directory reads back the same way."""
    trained = _trained(random_tiny_path)
    cat, rid = _publish(tmp_path, random_tiny_path, trained)
    tensors, meta = cat.load(rid)
    base_config = AutoConfig.from_pretrained(random_tiny_path)
    record = {"run": "t", "base_fingerprint": meta.base_fingerprint}
    for layout in ("peft", "per-expert"):
        out = write_adapter_dir(tmp_path / layout, rid, tensors, meta.lora_config, record, layout, base_config)
        written = load_file(str(out / ADAPTER_FILE))
        assert (revision_id(written) == rid) == (layout == "peft")
        assert any(".experts.0.gate_proj." in k for k in written) == (layout == "per-expert")
        back, config, recorded = read_adapter_dir(out, base_config)
        assert recorded["id"] == rid and recorded["format"] == layout and recorded["run"] == "t"
        assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
        assert config["target_parameters"] == meta.lora_config["target_parameters"]
    export(cat, rid, tmp_path / "exported", "per-expert")
    back, config, recorded = read_adapter_dir(tmp_path / "exported", base_config)
    assert recorded["id"] == rid and revision_id(back) == rid
    assert config["base_model_name_or_path"] == random_tiny_path
    cat.close()


def test_engine_layout_follows_what_each_engine_reads():
    """auto: the layout the family registry (mint.models.families) gives the engine for the base's family when the
    experts carry LoRA (per-expert for Qwen-MoE and GLM-MoE on vLLM and SGLang; `mint serve` reads both and gets the
    trained one), peft without expert LoRA; an explicit layout the engine cannot read, an unknown engine or an
    unknown layout is one line. The expert metadata (a meta skeleton of the base) is built once per pair of configs."""
    from mint.hub.export import _EXPERT_LORAS

    def adapter(config, experts: bool) -> dict:
        lora = peft_config(LoraConfig(target_experts=experts), config).to_dict()
        return {k: sorted(v) if isinstance(v, set) else v for k, v in lora.items()}

    qwen, glm = tiny_config("qwen3_moe", 97), tiny_config("glm4_moe", 97)
    for config in (qwen, glm):
        experts, attention_only = adapter(config, True), adapter(config, False)
        for engine in ("vllm", "sglang"):
            assert engine_layout("auto", experts, config, engine=engine) == "per-expert"
            assert engine_layout("per-expert", experts, config, engine=engine) == "per-expert"
            assert engine_layout("auto", attention_only, config, engine=engine) == "peft"
            assert engine_layout("peft", attention_only, config, engine=engine) == "peft"  # the same keys either way
            with pytest.raises(MintError, match=f"{engine} reads {config.model_type} expert LoRA in the per-expert"):
                engine_layout("peft", experts, config, engine=engine)
        assert engine_layout("auto", experts, config, engine="mint") == "peft"
        assert engine_layout("per-expert", experts, config, engine="mint") == "per-expert"
    cached = len(_EXPERT_LORAS)
    assert engine_layout("auto", adapter(qwen, True), qwen) == "per-expert" and len(_EXPERT_LORAS) == cached
    with pytest.raises(MintError, match="layout, not peft") as err:
        engine_layout("peft", adapter(glm, True), glm)
    assert "\n" not in str(err.value)
    with pytest.raises(MintError, match="engine 'builtin' is not one of vllm, sglang, mint"):
        engine_layout("auto", adapter(qwen, True), qwen, engine="builtin")
    with pytest.raises(MintError, match="not one of auto, peft, per-expert"):
        engine_layout("merged", adapter(qwen, True), qwen)


def test_engine_layout_auto_refuses_a_family_without_a_registry_entry():
    """A family outside the registry whose experts carry LoRA (here a 4-expert OLMoE): `auto` used to write PEFT's
    fused layout there without a word, the guess that once broke GLM on both engines; now it is refused in one line
    that says what to set. An explicit peft stands (the user read the engine's loader); an explicit per-expert is
    one line too, since `split_experts` does not know its gate/up order."""
    from transformers import OlmoeConfig

    olmoe = OlmoeConfig(
        vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    lora = peft_config(LoraConfig(), olmoe).to_dict()
    lora = {k: sorted(v) if isinstance(v, set) else v for k, v in lora.items()}
    for engine in ("vllm", "sglang", "mint"):
        with pytest.raises(MintError, match=f"{engine}: no expert-LoRA layout is known for olmoe") as err:
            engine_layout("auto", lora, olmoe, engine=engine)
        assert "\n" not in str(err.value) and "engines.adapter_layout" in str(err.value)
        assert engine_layout("peft", lora, olmoe, engine=engine) == "peft"
        attention_only = peft_config(LoraConfig(target_experts=False), olmoe).to_dict()
        attention_only = {k: sorted(v) if isinstance(v, set) else v for k, v in attention_only.items()}
        assert engine_layout("auto", attention_only, olmoe, engine=engine) == "peft"  # the same keys in either layout
    with pytest.raises(MintError, match=r"per-expert knows the fused expert layout of registered families, not olmoe"):
        engine_layout("per-expert", lora, olmoe)


def test_merged_export_is_written_only_on_request(random_qwen3_path, tmp_path, capsys):
    trained = _trained(random_qwen3_path)
    cat, rid = _publish(tmp_path, random_qwen3_path, trained)
    cat.close()
    c = ["--catalog", str(tmp_path / "catalog")]
    assert main(["export", rid[:8], *c, "--out", str(tmp_path / "default")]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "peft"
    assert not (tmp_path / "default" / "model.safetensors").exists()
    assert main(["export", rid[:8], *c, "--format", "merged", "--out", str(tmp_path / "merged")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bytes"] == report["merged_bytes"] and report["revision_bytes_over_merged"] < 1
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(merged), _logits(trained), rtol=1e-5, atol=1e-5)


def test_export_refuses_a_different_base(random_qwen3_path, tmp_path, capsys):
    trained = _trained(random_qwen3_path)
    cat, rid = _publish(tmp_path, random_qwen3_path, trained)
    cat.close()
    other = build_random_tiny("qwen3_moe", str(tmp_path / "other-base"), seed=7)
    capsys.readouterr()  # drop the weight-loading progress bars
    argv = ["export", rid, "--catalog", str(tmp_path / "catalog"), "--format", "per-expert"]
    code = main([*argv, "--out", str(tmp_path / "x"), "--base", other])
    err = capsys.readouterr().err
    assert code == 1 and "wrong base" in err and err.count("\n") == 1 and not (tmp_path / "x").exists()


def test_lora_size_from_a_meta_skeleton_counts_the_real_adapter(random_qwen3_path):
    trained = _trained(random_qwen3_path)
    sizes = lora_size(AutoConfig.from_pretrained(random_qwen3_path), 8, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert sizes["lora_params"] == sum(v.numel() for v in lora_state(trained).values())
    assert sizes["base_params"] == sum(p.numel() for n, p in trained.named_parameters() if "lora_" not in n)


def _families_with_experts() -> set[str]:
    """Every checkpoint model_type with routed experts, found without trusting the registry's `experts` flag: the
    tiny bases and the MLA families built and asked (moe_layout), the real shapes `mint plan` knows, and the
    vision-language checkpoints whose text model has experts."""
    from mint.models.shapes import SHAPES

    built = {f: tiny_config(f, 97) for f in (*specs.TINY_FAMILIES, *specs.MLA_FAMILIES)}
    found = {config.model_type for config in built.values() if moe_layout(config)}
    found |= {s.family for s in SHAPES.values() if s.experts}
    found |= {vlm for vlm, text in specs.VLM_TEXT_MODEL_TYPES.items() if text in found}
    return found


def test_every_family_with_experts_has_a_layout_for_every_engine_or_is_refused_there():
    """`mint serve` had no entry for qwen3_5_moe (the Qwen3.5-MoE VLM checkpoint) nor kimi_k25, and auto silently
    fell back to peft for any family missing from the table, which an engine that wants per-expert loads as no
    expert LoRA at all. Every family with experts now has, in the registry (mint.models.families), layouts for each
    engine or that engine's one-line refusal, and each names layouts the writer can produce for it."""
    found = _families_with_experts()
    assert {"qwen3_moe", "glm4_moe", "qwen3_5_moe", "kimi_k25", "deepseek_v32"} <= found, found
    for engine in families.ENGINES:
        missing = sorted(
            f for f in found if not families.engine_layouts(engine, f) and not families.engine_refusal(engine, f)
        )
        assert not missing, f"{engine} has no expert layout for {missing}"
        for model_type in found:
            layouts = families.engine_layouts(engine, model_type) or ()
            assert set(layouts) <= {"peft", "per-expert"}, (engine, model_type, layouts)
            text = specs.VLM_TEXT_MODEL_TYPES.get(model_type, model_type)
            assert "per-expert" not in layouts or families.family(text).experts, (engine, model_type)
