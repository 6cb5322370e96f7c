"""The family registry (mint.models.families): one entry per family, read by LongStraw's choice of adapter (checked
against the entry's kind), export's engine layouts, preflight and `mint plan`; and a new family of a kind Mint has,
added as one entry plus its tiny config, then checked by preflight, planned, and trained one LongStraw step."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from conftest import pop_lora_grads, update_inputs, update_objective
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2MoeConfig, Qwen2MoeForCausalLM

from longstraw.adapters import QwenAdapter, adapter_for, kind_of
from longstraw.engine import UpdateSpec, grpo_update
from longstraw.scoring import token_logprobs
from mint import hub
from mint.cli import main as mint_main
from mint.config import LoraConfig, load_config
from mint.models import families, plan, shapes, specs
from mint.models.lora import adapter_config_dict, add_lora
from mint.models.plan import hub_shape
from mint.models.tiny import ensure_tiny
from mint.train.preflight import preflight


@pytest.mark.parametrize("name", sorted(specs.TINY_CONFIGS))
def test_each_family_is_the_kind_longstraw_finds_in_its_modules(name):
    """The entry's kind and the adapter LongStraw picks from the built model's modules agree, for every family with a
    tiny config (the registry's word is what export, plan and preflight act on; LongStraw reads the modules)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(specs.tiny_config(name, 97))
    assert kind_of(model) == families.FAMILIES[name].kind


def test_every_family_with_experts_names_a_layout_or_a_refusal_for_every_engine():
    """`auto` never guesses the expert-LoRA layout an engine reads: each family with experts (and each VLM wrapper
    over one) has, per engine, the layouts it reads or the reason it takes no adapter."""
    missing = []
    for f in families.FAMILIES.values():
        if not f.experts:
            continue
        for model_type in (f.model_type, *(w.model_type for w in f.wrappers)):
            for engine in families.ENGINES:
                if not families.engine_layouts(engine, model_type) and not families.engine_refusal(engine, model_type):
                    missing.append(f"{engine}: {model_type}")
    assert not missing, missing


def test_every_family_has_its_builders_and_every_real_shape_builds_its_familys_config():
    """A tiny family has a tiny config, a family with hub ids a real-shape builder; each measured shape's config is
    its family's model_type, and the shape's own dims say the entry's kind (hybrid layers, a latent)."""
    for f in families.FAMILIES.values():
        assert not f.tiny or f.name in specs.TINY_CONFIGS, f.name
        for key in f.shapes.values():
            assert shapes.SHAPES[key].family == f.name and f.name in shapes.LAYER_CONFIGS, (f.name, key)
    for key, s in shapes.SHAPES.items():
        kind = families.FAMILIES[s.family].kind
        assert shapes.layer_config(s, 1).model_type == families.FAMILIES[s.family].model_type, key
        assert (s.hybrid, s.mla, s.dsa) == (kind == "hybrid", kind in ("mla", "dsa"), kind == "dsa"), key


def test_a_family_with_experts_and_no_engine_layouts_is_refused_at_registration():
    with pytest.raises(ValueError, match="names the layouts each engine reads"):
        families.Family("mint_test_nolayouts", "gqa", experts=True)
    with pytest.raises(ValueError, match="kind 'ssm'"):
        families.Family("mint_test_ssm", "ssm", experts=False)


# A new family of an existing kind, as a user would add one: a transformers model of its own (here Qwen2-MoE's
# modules under another model_type, registered with transformers' Auto classes), one registry entry, one tiny config.
NEW = "mint_test_moe"
NEW_HUB_ID = "example-org/Test-MoE-30B-A3B"
NEW_SHAPE = "mint_test_moe_30b_a3b"


class _NewConfig(Qwen2MoeConfig):
    model_type = NEW


class _NewForCausalLM(Qwen2MoeForCausalLM):
    config_class = _NewConfig


def _new_tiny_config(family: str, vocab_size: int, **overrides) -> _NewConfig:
    config = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, intermediate_size=128, norm_topk_prob=True, tie_word_embeddings=False,
    )  # fmt: skip
    return _NewConfig(**(config | overrides))


def _new_layer_config(s: shapes.RealShape, n: int, common: dict) -> _NewConfig:
    """Its real-shape builder: GQA's common arguments, plus the family's own names for its experts."""
    return _NewConfig(num_experts=s.experts, shared_expert_intermediate_size=s.moe_intermediate, **common)


@pytest.fixture
def new_family(monkeypatch, tmp_path):
    """Register the new family for one test: its transformers classes (once per process: transformers keeps them),
    its registry entry, its tiny config, and a real shape of its own (Qwen3-30B-A3B's dims, with that shape's
    measured per-layer figures) with its builder; save a random base with the tiny tokenizer beside it."""
    if NEW not in AutoConfig.for_model.__globals__["CONFIG_MAPPING"]:
        AutoConfig.register(NEW, _NewConfig)
        AutoModelForCausalLM.register(_NewConfig, _NewForCausalLM)
    entry = families.Family(
        NEW,
        "gqa",
        experts=True,
        layouts={"vllm": ("per-expert",), "sglang": ("per-expert",), "mint": ("peft", "per-expert")},
        shapes={NEW_HUB_ID: NEW_SHAPE},
    )
    monkeypatch.setitem(families.FAMILIES, NEW, entry)
    monkeypatch.setitem(specs.TINY_CONFIGS, NEW, _new_tiny_config)
    real = dataclasses.replace(shapes.SHAPES["qwen3_30b_a3b"], name="Test-MoE-30B-A3B", family=NEW)
    monkeypatch.setitem(shapes.SHAPES, NEW_SHAPE, real)
    monkeypatch.setitem(shapes.LAYER_CONFIGS, NEW, _new_layer_config)
    measured = tmp_path / "measured"
    measured.mkdir()
    shutil.copy(plan.MEASURED / "qwen3_30b_a3b.json", measured / f"{NEW_SHAPE}.json")
    monkeypatch.setattr(plan, "MEASURED", measured)
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny("qwen3_moe"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(specs.tiny_config(NEW, len(tokenizer), initializer_range=0.05))
    path = tmp_path / "base"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return entry, path


def test_a_new_family_of_an_existing_kind_is_one_entry_and_trains_a_step(new_family, tmp_path, capsys):
    _, path = new_family
    # Preflight checks the recipe on it as on any base: model, tokenizer, routers (R3 is on), prompt lengths.
    config = load_config("recipes/smoke.toml", [f"model.path={path}", f"logging.root={tmp_path / 'runs'}"])
    assert config.grpo.r3
    checked = preflight(config)
    assert checked.model_path == str(path) and checked.prompts_over_limit == 0
    # LongStraw needs nothing of it: the adapter comes from the modules.
    model = add_lora(specs.load_model(str(path)), LoraConfig(), seed=0)
    assert type(adapter_for(model)) is QwenAdapter
    # Export reads the entry: `auto` writes the layout the entry says vLLM reads for expert LoRA.
    adapter_config = adapter_config_dict(model, str(path))
    assert adapter_config.get("target_parameters"), adapter_config  # LoRA on the fused experts
    model_config = AutoConfig.from_pretrained(path)
    assert hub.engine_layout("auto", adapter_config, model_config, engine="vllm") == "per-expert"
    assert hub.engine_layout("auto", adapter_config, model_config, engine="mint") == "peft"
    # `mint plan` finds its real shape through the entry's hub id, and builds that shape's layer with the family's
    # builder (expert parallel checks the experts split over the ranks on it).
    assert hub_shape(NEW_HUB_ID) == NEW_SHAPE
    layer = shapes.layer_config(shapes.shape(NEW_SHAPE), 1)
    assert layer.model_type == NEW and layer.num_experts == 128 and layer.hidden_size == 2048
    recipe = "recipes/qwen3_30b_a3b_8xh20.toml"
    plan_args = ["plan", recipe, f"model.path={NEW_HUB_ID}", "--gpus", "4", "--prompt-len", "16384"]
    code = mint_main([*plan_args, "--expert-parallel", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "fits in 96 GiB" in out, out
    # One exact LongStraw update equals transformers' full backprop of the same objective.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)  # a live adapter: every K/V and expert output moves
    tokens_P, responses = update_inputs(model.config.vocab_size)
    for i, r in enumerate(responses):
        with model.disable_adapter(), torch.no_grad():
            ref = _full_logp(model, tokens_P, r)
        update_objective(i, _full_logp(model, tokens_P, r), ref)[0].backward()
    want = pop_lora_grads(model)
    grpo_update(model, tokens_P, responses, update_objective, UpdateSpec(mode="exact", chunk_size=7, need_ref=True))
    got = pop_lora_grads(model)
    assert got.keys() == want.keys() and any("experts" in n for n in want)
    assert any(g.abs().sum() > 0 for g in got.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def _full_logp(model, tokens_P, response_R):
    """log p(response | prompt) from one transformers forward over prompt + response (temperature 1)."""
    logits = model(input_ids=torch.cat([tokens_P, response_R])[None]).logits[0]
    p = tokens_P.shape[0]
    return token_logprobs(logits[p - 1 : p - 1 + response_R.shape[0]], response_R, 1.0)
