"""vLLM's own LoRA loader reads the adapter directories Mint writes for it, and holds exactly the trained factors.

For each family Mint trains expert LoRA on (qwen3_moe; qwen2_moe, with LoRA on its shared expert too; glm4_moe, whose
dense first layer and shared experts carry none) and a dense Qwen3 (attention and MLP LoRA), a tiny random base gets
LoRA the way the learner builds it, with non-zero A and B, and the adapter is written in every layout. One subprocess
in the engine virtualenv (tests/engine_scripts/vllm_lora_load.py) builds each base with vLLM's CPU model runner and
its LoRA worker manager (the real model class, its packed-module and expert mappings) and loads the directories as
/v1/load_lora_adapter does. Checked here:

- the layout `engine_layout(..., engine="vllm")` picks loads, and every stacked LoRA buffer vLLM fills equals the
  trained factor bit for bit (per expert and per projection, A and B; B carries the scale alpha / r = 2, which vLLM
  folds in: a power of two, so the product is exact), and every buffer Mint did not train stays zero;
- per expert, vLLM's B @ A equals the delta PEFT's own merge puts on the fused gate_up_proj / down_proj, so the names,
  the expert order and the [gate; up] split are those of the model and not only of Mint's indexing;
- every other layout is refused by vLLM and by `engine_layout`, in one line.

The Qwen3.5 vision-language checkpoints (model_type qwen3_5_moe / qwen3_5, built by test_vlm_checkpoint.build_vlm_tiny)
are served by vLLM's Qwen3_5{Moe}ForConditionalGeneration, whose LoRA modules sit under language_model.model.layers
and whose MoE wrapper is the 3-D one (is_3d_moe_weight): Mint trains the text model, and the directory it writes for
vLLM on such a base names the modules as the checkpoint (model.language_model.*) and keeps PEFT's fused expert
layout. vLLM fills every buffer from it as trained; the same tensors under the text model's names it loads and
applies nowhere, and per-expert keys it refuses.

The MLA families vLLM's CPU build runs (DeepSeek-V3, GLM-4.7-Flash; DSA's sparse attention it refuses on CPU) are
2-D MoE classes like Qwen-MoE: per-expert, with q_a_proj and kv_a_proj_with_mqa packed into fused_qkv_a_proj. vLLM
loads kv_b_proj's LoRA too, but decodes with absorbed weights split off the base kv_b_proj, so Mint refuses it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import build_random_tiny, load_fp32
from safetensors.torch import load_file
from test_expert_lora import build_hybrid_tiny
from test_vlm_checkpoint import build_vlm_tiny
from transformers import AutoConfig, AutoModelForCausalLM

from mint.config import LoraConfig
from mint.errors import MintError
from mint.hub.export import ENGINE_LAYOUTS, engine_layout, merged_model, write_adapter_dir
from mint.hub.revisions import revision_id
from mint.models.families import engine_layouts
from mint.models.lora import adapter_config_dict, add_lora, load_lora_state, lora_state
from mint.models.specs import moe_layers, tiny_config

SCRIPT = Path(__file__).resolve().parent / "engine_scripts" / "vllm_lora_load.py"
RANK = 8  # the adapter's r and vLLM's max_lora_rank, so the stacked buffers have exactly the trained shapes
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# family -> the recipe's lora.target_modules. The dense MLP and qwen2_moe's shared expert carry LoRA too, so vLLM's
# packing of gate_proj/up_proj beside the routed experts is covered. GLM keeps attention only: on glm4_moe PEFT's
# transformers-v5 conversion moves gate_proj/up_proj/down_proj targets onto the fused experts (gate_up_proj at rank 2r),
# so its dense first layer and shared experts would get none anyway; vLLM must then hold none there.
TARGETS = {"qwen3": ATTENTION + MLP, "qwen3_moe": ATTENTION, "qwen2_moe": ATTENTION + MLP, "glm4_moe": ATTENTION}
# The hybrid families (built from transformers' configs, test_expert_lora.build_hybrid_tiny): LoRA on the Gated DeltaNet
# projections too, under transformers' names, which vLLM packs (Qwen3.5: in_proj_qkv + in_proj_z -> in_proj_qkvz,
# in_proj_b + in_proj_a -> in_proj_ba; Qwen3-Next keeps its fused names).
GDN_35 = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
HYBRID = {
    "qwen3_5_moe_text": ATTENTION + GDN_35,
    "qwen3_next": [*ATTENTION, "in_proj_qkvz", "in_proj_ba", "out_proj"],
    "qwen3_5_text": ATTENTION + GDN_35 + MLP,
}
TARGETS |= HYBRID
VLM = {"qwen3_5_moe": ATTENTION + GDN_35, "qwen3_5": ATTENTION + GDN_35 + MLP}  # the VLM checkpoints, by model_type
TARGETS |= VLM
# The multi-head latent attention families vLLM's CPU build runs (DSA's sparse attention it refuses on CPU): LoRA on
# the MLA projections it applies, which vLLM packs (q_a_proj + kv_a_proj_with_mqa -> fused_qkv_a_proj). kv_b_proj,
# whose LoRA vLLM's absorbed decode drops, `engine_layout` refuses for vLLM; a directory with it is loaded as well, to
# show that vLLM would take it without a word.
MLA = {"deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]}
MLA["glm4_moe_lite"] = MLA["deepseek_v3"]
TARGETS |= MLA
MOE = ("qwen3_moe", "qwen2_moe", "glm4_moe", "qwen3_next", "qwen3_5_moe_text", *MLA)
# vLLM packs q/k/v into qkv_proj and gate/up into gate_up_proj (slices in this order); other projections keep a name
PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
PACKED |= {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
PACKED |= {"in_proj_z": ("in_proj_qkvz", 3), "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1)}
PACKED |= {"q_a_proj": ("fused_qkv_a_proj", 0), "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1)}
# vLLM's Qwen3.5 GDN in_proj_qkvz has four output slices (q, k, v, z): in_proj_qkv's B is split over the first three
# by their sizes and its A repeated (MergedColumnParallelLinearWithLoRA.expand_packed_lora)
# vLLM's qwen3_5.py imports its VLM module, which imports transformers' torchvision image processor only for a
# smart_resize helper; the engine env has no torchvision (no CPU build for its torch). The subprocess aliases that
# module to transformers' PIL image processor (the same helper), nothing else: the text model path never uses it.
SITECUSTOMIZE = """
import importlib, importlib.abc, importlib.util, sys
_NAME = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
class _PilImageProcessor(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == _NAME else None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        pil = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
        module.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
sys.meta_path.insert(0, _PilImageProcessor())
"""
REFUSED_FUSED = "contains fused 3D MoE weights"  # vLLM's error for PEFT's fused layout on a 2-D MoE wrapper
# A subprocess in the engine virtualenv builds each tiny base with vLLM's CPU model runner, and `make test-fast`
# installs no engines: the full suite only. The layouts Mint writes are checked without vLLM in test_export.py.
pytestmark = pytest.mark.slow


def build_mla_tiny(family: str, directory: str) -> str:
    """`build_random_tiny` of an MLA family, its config.json carrying the keys of the released one that vLLM reads
    and transformers does not: DeepSeek-V3's routing (topk_method noaux_tc, scoring_func sigmoid; without noaux_tc
    vLLM's DeepseekV2MoE has no e_score_correction_bias to load the checkpoint's into), GLM-4.7-Flash's
    first_k_dense_replace (1, the dense layers vLLM's Glm4MoeLite builds; transformers reads mlp_layer_types)."""
    torch.manual_seed(0)
    extra = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"} if family == "deepseek_v3" else {}
    extra |= {"first_k_dense_replace": 1} if family == "glm4_moe_lite" else {}
    AutoModelForCausalLM.from_config(tiny_config(family, 97, initializer_range=0.05, **extra)).save_pretrained(
        directory
    )
    return directory


def _trained(base: str, family: str, targets: list[str] | None = None):
    """The learner's model on `base` with A and B ~ N(0, 0.05^2) (seeded): PEFT starts B at zero."""
    lora = LoraConfig(rank=RANK, alpha=2.0 * RANK, target_modules=targets or TARGETS[family])
    model = add_lora(load_fp32(base), lora, seed=0)
    g = torch.Generator().manual_seed(7)
    load_lora_state(model, {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in lora_state(model).items()})
    return model


@pytest.fixture(scope="module")
def vllm_loads(engine_python, tmp_path_factory) -> dict:
    """family -> {base, config, tensors, adapter_config, chosen: the layout `engine_layout` picks for vLLM, loaded:
    {layout: vLLM's record of loading it}, vllm: its model class, is_3d_moe_weight and LoRA wrappers}: every family's
    adapter in every layout, loaded by vLLM in one subprocess (importing vLLM alone takes ~10 s)."""
    root = tmp_path_factory.mktemp("vllm_lora")
    cases, argv = {}, []
    for family in TARGETS:
        build = build_vlm_tiny if family in VLM else build_hybrid_tiny if family in HYBRID else build_random_tiny
        build = build_mla_tiny if family in MLA else build
        base = build(family, str(root / f"{family}-base"))
        model = _trained(base, family)
        tensors = lora_state(model)
        adapter_config = json.loads(json.dumps(adapter_config_dict(model, base)))
        config = AutoConfig.from_pretrained(base)
        chosen = engine_layout("auto", adapter_config, config, engine="vllm")
        layouts, unwritten = {}, {}
        for layout in ("peft", "per-expert"):
            out = root / f"{family}-{layout}"
            try:
                write_adapter_dir(out, revision_id(tensors), tensors, adapter_config, {}, layout, config)
            except MintError as err:  # a layout Mint cannot write is one vLLM never sees
                unwritten[layout] = {"ok": False, "error": f"not written: {err}", "dump": None}
                continue
            layouts[layout] = str(out)
            argv += [base, str(out)]
        if family in MLA:  # kv_b_proj too, as a rollout actor would write it for vLLM without `engine_layout`
            with_kv_b = _trained(base, family, [*TARGETS[family], "kv_b_proj"])
            kv_b = lora_state(with_kv_b)
            kv_b_config = json.loads(json.dumps(adapter_config_dict(with_kv_b, base)))
            out = root / f"{family}-kv_b"
            write_adapter_dir(out, revision_id(kv_b), kv_b, kv_b_config, {}, "per-expert", config)
            layouts["kv_b"] = str(out)
            argv += [base, str(out)]
        if family in VLM:  # the trained tensors under the text model's names, as written before the VLM layout
            out = root / f"{family}-text-names"
            text = config.get_text_config()
            write_adapter_dir(out, revision_id(tensors), tensors, adapter_config, {}, "peft", text)
            layouts["text-names"] = str(out)
            argv += [base, str(out)]
        cases[family] = dict(base=base, config=config, tensors=tensors, adapter_config=adapter_config, chosen=chosen)
        cases[family].update(dirs=layouts, unwritten=unwritten)
        if family in MLA:
            cases[family]["kv_b"] = dict(tensors=kv_b, adapter_config=kv_b_config)
    dumps = root / "dumps"
    dumps.mkdir()
    shim = root / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the engine env imports its own packages only
    env["PYTHONPATH"] = str(shim)
    proc = subprocess.run(
        [str(engine_python), str(SCRIPT), str(dumps), str(RANK), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=root,  # not the repo root, whose kernels/ vLLM's model inspection subprocess imports for HF's `kernels`
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads(proc.stdout)
    by_dir = {r["adapter"]: r for r in report["adapters"]}
    for case in cases.values():
        case["vllm"] = report["bases"][case["base"]]
        case["run"] = dict(python=str(engine_python), env=env, cwd=root)  # for a further engine subprocess
        case["loaded"] = {layout: by_dir[d] for layout, d in case["dirs"].items()} | case["unwritten"]
    return cases


def _expected(
    tensors: dict[str, torch.Tensor], config, scale: float, under: str = "", fused_w13: bool = False
) -> dict[str, torch.Tensor]:
    """What vLLM's stacked buffers must hold (slot 0, under the script's `{module}.{buffer}.{slice}` names), from the
    trained PEFT tensors: PEFT keeps expert e's A as rows [e*r, (e+1)*r) of the fused lora_A and its B as columns
    e, e+E, ... of the fused lora_B; the fused expert parameter is experts.base_layer (gate_up_proj, out rows
    [gate; up]) and experts (down_proj). `under`: where vLLM's model class keeps the text model's modules
    ("language_model." in a VLM class); `fused_w13`: the 3-D MoE wrapper, one w13 slice holding [gate; up]."""
    config = config.get_text_config()
    E = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    want = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = under + key.removesuffix(".lora_A.weight").removeprefix("base_model.model.")
        b = tensors[key.replace(".lora_A.", ".lora_B.")] * scale
        if module.endswith(".mlp.experts.base_layer") or module.endswith(".mlp.experts"):
            prefix = module.removesuffix(".base_layer")
            a_E = a.reshape(E, -1, a.shape[-1])  # (E, r, in)
            b_E = b.reshape(b.shape[0], -1, E).permute(2, 0, 1)  # (E, out, r)
            if module.endswith(".base_layer") and fused_w13:
                want[f"{prefix}.w13_lora_a_stacked.0"], want[f"{prefix}.w13_lora_b_stacked.0"] = a_E, b_E
            elif module.endswith(".base_layer"):
                inter = b_E.shape[1] // 2
                want[f"{prefix}.w13_lora_a_stacked.0"] = want[f"{prefix}.w13_lora_a_stacked.1"] = a_E
                want[f"{prefix}.w13_lora_b_stacked.0"] = b_E[:, :inter]
                want[f"{prefix}.w13_lora_b_stacked.1"] = b_E[:, inter:]
            else:
                want[f"{prefix}.w2_lora_a_stacked.0"], want[f"{prefix}.w2_lora_b_stacked.0"] = a_E, b_E
            continue
        parent, name = module.rsplit(".", 1)
        if name == "in_proj_qkv":  # Qwen3.5 GDN: q, k, v slices 0..2 of vLLM's in_proj_qkvz
            key_dim = config.linear_num_key_heads * config.linear_key_head_dim
            for i, rows in enumerate(b.split([key_dim, key_dim, b.shape[0] - 2 * key_dim])):
                want[f"{parent}.in_proj_qkvz.lora_a_stacked.{i}"] = a[None]
                want[f"{parent}.in_proj_qkvz.lora_b_stacked.{i}"] = rows[None]
            continue
        packed, i = PACKED.get(name, (name, 0))
        want[f"{parent}.{packed}.lora_a_stacked.{i}"] = a[None]  # linear buffers: (1, r, in) / (1, out, r)
        want[f"{parent}.{packed}.lora_b_stacked.{i}"] = b[None]
    return want


@pytest.mark.parametrize("family", list(TARGETS))
def test_vllm_loads_the_layout_mint_writes_for_it_as_trained(vllm_loads, family):
    case = vllm_loads[family]
    record = case["loaded"][case["chosen"]]
    assert record["ok"], f"vLLM refused the {case['chosen']} layout Mint writes for it: {record['error']}"
    assert case["chosen"] == ("per-expert" if family in MOE else "peft")  # the MoE VLM: 3-D experts, peft
    if family in MOE:  # the 2-D MoE LoRA wrapper, which is why per-expert is the layout it reads
        assert not case["vllm"]["is_3d_moe_weight"]
        assert engine_layouts("vllm", family) == ("per-expert",)
        experts = [m for m, cls in case["vllm"]["wrappers"].items() if m.endswith(".mlp.experts")]
        assert experts and all(case["vllm"]["wrappers"][m] == "FusedMoEWithLoRA" for m in experts)
    _assert_holds_as_trained(case, load_file(record["dump"]))
    if family in MOE:
        _assert_expert_deltas_match_peft_merge(case, load_file(record["dump"]))


def _assert_holds_as_trained(case: dict, held: dict[str, torch.Tensor]) -> None:
    """Every buffer Mint trained holds the trained factor bit for bit, and every other buffer is zero."""
    scale = case["adapter_config"]["lora_alpha"] / case["adapter_config"]["r"]
    prefix = "language_model." if case["vllm"]["model_class"].endswith("ForConditionalGeneration") else ""
    want = _expected(case["tensors"], case["config"], scale, prefix, fused_w13=case["vllm"]["is_3d_moe_weight"])
    assert set(want) <= set(held), f"vLLM has no buffer for {sorted(set(want) - set(held))[:4]}"
    for key, value in want.items():
        torch.testing.assert_close(held[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
    untrained = [k for k in set(held) - set(want) if held[k].any()]
    assert not untrained, f"vLLM put LoRA on modules Mint did not train: {sorted(untrained)[:4]}"


def _assert_expert_deltas_match_peft_merge(case: dict, held: dict[str, torch.Tensor]) -> None:
    """Per expert, vLLM's B @ A (gate and up stacked as the fused rows, then down) equals the delta PEFT's merge puts
    on the fused parameter of the transformers model: fp32 sums of r = 8 products of ~0.05^2 terms, off by rounding.
    vLLM's 3-D wrapper holds gate and up as one w13 slice; a VLM class keeps the text model under language_model."""
    base = dict(load_fp32(case["base"]).named_parameters())
    merged = dict(merged_model(case["tensors"], case["adapter_config"], case["base"]).named_parameters())
    prefixes = sorted({k.split(".w13_")[0] for k in held if ".w13_lora_a_stacked." in k})
    assert prefixes
    for prefix in prefixes:
        w13 = [held[f"{prefix}.w13_lora_b_stacked.{i}"] @ held[f"{prefix}.w13_lora_a_stacked.{i}"] for i in (0, 1)
               if f"{prefix}.w13_lora_a_stacked.{i}" in held]  # fmt: skip
        down = held[f"{prefix}.w2_lora_b_stacked.0"] @ held[f"{prefix}.w2_lora_a_stacked.0"]
        for name, got in (("gate_up_proj", torch.cat(w13, dim=1)), ("down_proj", down)):
            param = f"{prefix.removeprefix('language_model.')}.{name}"
            delta = merged[param] - base[param]
            assert delta.abs().max() > 1e-3  # the LoRA moved the weights, so the comparison means something
            torch.testing.assert_close(got, delta, rtol=0, atol=1e-6, msg=lambda m, n=param: f"{n}: {m}")


@pytest.mark.parametrize("family", MOE)
def test_vllm_refuses_every_other_layout_and_so_does_engine_layout(vllm_loads, family):
    """PEFT's fused expert layout on a model vLLM runs with the 2-D MoE LoRA wrapper: vLLM refuses it at load (without
    --enable-mixed-moe-lora-format), so an explicit engines.adapter_layout = peft is a one-line error up front."""
    case = vllm_loads[family]
    for layout in set(ENGINE_LAYOUTS) - {"auto", case["chosen"]}:
        record = case["loaded"][layout]
        assert not record["ok"] and REFUSED_FUSED in record["error"], record
        with pytest.raises(MintError, match=f"vllm reads {family} expert LoRA in the per-expert layout") as err:
            engine_layout(layout, case["adapter_config"], case["config"], engine="vllm")
        assert "\n" not in str(err.value)


def test_glm4_moe_expert_lora_was_written_fused_which_vllm_refuses(vllm_loads):
    """GLM-4.5 expert LoRA under engines.adapter_layout = auto was handed to vLLM in PEFT's fused layout (per-expert
    was refused for GLM as unverified), and vLLM refused the load ("contains fused 3D MoE weights ... 2D MoE LoRA
    wrapper"). auto now writes GLM per-expert, whose names (experts.{e}.gate_proj/up_proj/down_proj beside
    shared_experts.*) vLLM's Glm4MoeForCausalLM packs into its experts, and vLLM loads it."""
    case = vllm_loads["glm4_moe"]
    assert case["vllm"]["model_class"] == "Glm4MoeForCausalLM" and not case["vllm"]["is_3d_moe_weight"]
    assert not case["loaded"][case["chosen"]]["error"], case["loaded"][case["chosen"]]["error"]
    assert case["chosen"] == "per-expert" and case["loaded"]["per-expert"]["ok"]
    assert REFUSED_FUSED in case["loaded"]["peft"]["error"]


@pytest.mark.parametrize("family", list(VLM))
def test_vllm_vlm_class_holds_the_adapter_mint_writes_on_a_vlm_checkpoint(vllm_loads, family):
    """A Qwen3.5(-MoE) VLM checkpoint: vLLM builds Qwen3_5{Moe}ForConditionalGeneration (the MoE one with the 3-D
    expert wrapper), and the directory Mint writes for it (peft: fused experts; names model.language_model.*) fills
    every buffer Mint trained (attention, the Gated DeltaNet projections, the experts) bit for bit and no other; the
    same tensors under the text model's names (model.layers.*) fill none, though vLLM accepts them."""
    case = vllm_loads[family]
    moe = family == "qwen3_5_moe"
    assert case["vllm"]["model_class"] == f"Qwen3_5{'Moe' if moe else ''}ForConditionalGeneration"
    assert case["vllm"]["is_3d_moe_weight"] == moe and (engine_layouts("vllm", family) or ("peft",))[0] == "peft"
    experts = [m for m, cls in case["vllm"]["wrappers"].items() if m.endswith(".mlp.experts")]
    assert all(case["vllm"]["wrappers"][m] == "FusedMoE3DWithLoRA" for m in experts) and len(experts) == 4 * moe
    assert case["chosen"] == "peft"
    record = case["loaded"]["peft"]
    assert record["ok"], f"vLLM refused the layout Mint writes for it: {record['error']}"
    held = load_file(record["dump"])
    _assert_holds_as_trained(case, held)
    trained = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in case["tensors"]} - {"experts", "base_layer"}
    assert trained == set(TARGETS[family]) - ({"gate_proj", "up_proj", "down_proj"} if moe else set())
    filled = {k.split(".lora_")[0].split(".w")[0].rsplit(".", 1)[-1] for k, v in held.items() if v.any()}
    assert filled >= {"qkv_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"} | ({"experts"} if moe else set())
    if moe:
        _assert_expert_deltas_match_peft_merge(case, held)
    text_names = case["loaded"]["text-names"]  # vLLM accepts these and applies them nowhere
    assert not text_names["ok"] or not any(t.any() for t in load_file(text_names["dump"]).values()), text_names
    if moe:  # per-expert keys the 3-D wrapper does not take: vLLM refuses them, and so does engine_layout
        assert "expected target modules" in case["loaded"]["per-expert"]["error"]
        with pytest.raises(MintError, match="vllm reads qwen3_5_moe expert LoRA in the peft layout, not per-expert"):
            engine_layout("per-expert", case["adapter_config"], case["config"], engine="vllm")


# Loads one adapter into the base in vLLM's CPU model runner and prints, per MLA layer, which of its attention's own
# tensors (decode's absorbed W_UK_T / W_UV among them) the load left bit for bit as they were, and whether the layer's
# kv_b_proj LoRA buffers hold anything.
ABSORBED = """
import json, os, sys
out = os.fdopen(os.dup(1), "w"); os.dup2(2, 1)
sys.path.insert(0, sys.argv[1])
from vllm_lora_load import runner_for
from vllm.config import set_current_vllm_config
from vllm.lora.request import LoRARequest
runner = runner_for(sys.argv[2], int(sys.argv[4]))
def own(attn):
    return dict([*attn.named_parameters(recurse=False), *attn.named_buffers(recurse=False)])
layers = [layer.self_attn.mla_attn.mla_attn for layer in runner.model.model.layers]
before = [{k: v.clone() for k, v in own(a).items()} for a in layers]
with set_current_vllm_config(runner.vllm_config):
    runner.add_lora(LoRARequest("kv_b", 1, sys.argv[3]))
report = [{"unchanged": sorted(k for k, v in own(a).items() if v.equal(b[k])), "kv_b_lora": bool(
    a.kv_b_proj.lora_b_stacked[0][0].any() and a.kv_b_proj.lora_a_stacked[0][0].any())} for a, b in zip(layers, before)]
out.write(json.dumps(report) + "\\n")
out.flush()
"""


def test_vllm_mla_decode_weights_stay_the_base_s_with_kv_b_proj_lora_loaded(vllm_loads):
    """Why kv_b_proj is refused for vLLM, shown with vLLM's own code: with a kv_b_proj adapter loaded (its buffers
    non-zero in every layer, so the prefill path's wrapper would apply it), the W_UK_T / W_UV that vLLM's MLA decode
    multiplies by are still the ones split off the base weight at load, bit for bit: decode serves the base there."""
    case = vllm_loads["deepseek_v3"]
    run = case["run"]
    argv = [str(SCRIPT.parent), case["base"], case["dirs"]["kv_b"], str(RANK)]
    proc = subprocess.run(
        [run["python"], "-c", ABSORBED, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=run["env"],
        cwd=run["cwd"],
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert len(report) == 3
    for layer in report:
        assert layer["kv_b_lora"] and {"W_UK_T", "W_UV"} <= set(layer["unchanged"]), layer


@pytest.mark.parametrize("family", list(MLA))
def test_vllm_mla_class_holds_the_mla_and_expert_lora_and_kv_b_proj_is_refused_up_front(vllm_loads, family):
    """DeepSeek-V3 and GLM-4.7-Flash: vLLM builds DeepseekV3ForCausalLM / Glm4MoeLiteForCausalLM with the 2-D expert
    wrapper on the MoE layers only (the first is dense), q_a_proj and kv_a_proj_with_mqa packed as fused_qkv_a_proj's
    two slices; the per-expert directory fills every MLA and expert buffer as trained (the generic test above) and
    leaves the dense layer's MLP, the shared experts and the router at zero. kv_b_proj: vLLM's loader fills its buffers
    just as well, though its absorbed MLA decode never applies them, so `engine_layout` refuses it for vLLM in one
    line (and not for SGLang, which folds it into the absorbed path)."""
    case = vllm_loads[family]
    cls = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM"}[family]
    assert case["vllm"]["model_class"] == cls and not case["vllm"]["is_3d_moe_weight"]
    wrappers = case["vllm"]["wrappers"]
    experts = sorted(int(m.split(".")[2]) for m, c in wrappers.items() if m.endswith(".mlp.experts"))
    assert experts == moe_layers(case["config"]) == [1, 2]
    assert all(c == "FusedMoEWithLoRA" for m, c in wrappers.items() if m.endswith(".mlp.experts"))
    assert wrappers["model.layers.0.self_attn.fused_qkv_a_proj"] == "MergedColumnParallelLinearWithLoRA"
    held = load_file(case["loaded"][case["chosen"]]["dump"])
    filled = {k.split(".lora_")[0].split(".w")[0].rsplit(".", 1)[-1] for k, v in held.items() if v.any()}
    assert filled == {"fused_qkv_a_proj", "q_b_proj", "o_proj", "experts"}
    assert all(
        held[f"model.layers.{i}.self_attn.fused_qkv_a_proj.lora_b_stacked.{s}"].any() for i in range(3) for s in (0, 1)
    )
    kv_b = {**case, **case["kv_b"]}  # the same base, the adapter with kv_b_proj
    record = case["loaded"]["kv_b"]
    assert record["ok"], record["error"]
    _assert_holds_as_trained(kv_b, load_file(record["dump"]))  # kv_b_proj's buffers too, bit for bit
    with pytest.raises(MintError, match=f"vllm drops kv_b_proj LoRA on {family} in decode") as err:
        engine_layout("auto", kv_b["adapter_config"], kv_b["config"], engine="vllm")
    assert "\n" not in str(err.value)
    assert engine_layout("auto", kv_b["adapter_config"], kv_b["config"], engine="sglang") == "per-expert"
