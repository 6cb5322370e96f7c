"""Export a catalog revision for serving: PEFT as trained, per-expert for vLLM/SGLang, or merged (only on request).

Formats
    peft        The revision directory as it is: `PeftModel.from_pretrained(base, dir)` loads it and gives the
                training model's logits. Fused MoE experts keep PEFT's `target_parameters` layout.
    per-expert  Fused 3-D expert LoRA split into per-expert 2-D LoRA under the module names of the per-expert
                checkpoints (Qwen-MoE, GLM, DeepSeek-V3), which vLLM (2-D MoE models) and SGLang load:
                    base_model.model.model.layers.{l}.mlp.experts.{e}.gate_proj.lora_A.weight   [r, H]
                    base_model.model.model.layers.{l}.mlp.experts.{e}.gate_proj.lora_B.weight   [I, r]
                    ... .up_proj.lora_A / lora_B                                                 [r, H] / [I, r]
                    ... .down_proj.lora_A / lora_B                                               [r, I] / [H, r]
                Attention LoRA keys are unchanged. See docs/mint.md for where the names come from.
    merged      base + scale * B @ A folded into a full HF checkpoint. Written only when asked for by name.

The split is exact (indexing only, no arithmetic): PEFT keeps expert e's A as rows [e*r, (e+1)*r) of lora_A
(r*E, in) and its B as columns e, e+E, e+2E, ... of lora_B (out, r*E); the delta of expert e is
scale * B_e @ A_e, shape (out, in). gate_up_proj's out rows are [gate (I); up (I)] (`gate, up = linear(x, W_e)
.chunk(2)` in each registered family with experts), so gate_proj and up_proj share A_e and take the two halves of B_e.
`fuse_experts` inverts `split_experts` bit for bit; tests check both that and the logits of a checkpoint merged from
the per-expert keys through transformers' own per-expert -> fused loader.

Engine directories: a rollout actor writes each revision in the layout its engine loads (`engine_layout`, from the
family registry's entries in mint.models.families; `write_adapter_dir`), and `mint serve` reads either layout back
(`read_adapter_dir`). A per-expert directory records the trained (fused) revision's id and adapter config in
mint_revision.json, so a reader fuses it back and checks the hash against that id: the per-expert tensors
themselves hash to something else. On a vision-language base (`mint.models.specs.VLM_TEXT_MODEL_TYPES`: Mint trains
its text model, keys model.layers.*) the directory names the modules as the checkpoint does, model.language_model.*
(`VLM_MODULE_PREFIX`, recorded in mint_revision.json so a reader renames them back).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mint.errors import MintError
from mint.hub.catalog import Catalog
from mint.hub.revisions import (
    ADAPTER_FILE,
    CONFIG_FILE,
    META_FILE,
    RevisionMeta,
    base_fingerprint,
    check_revision_id,
    fsync_dir,
    read_revision_files,
    write_revision_dir,
)
from mint.models import families

FORMATS = ("peft", "per-expert", "merged")
ENGINE_LAYOUTS = ("auto", "peft", "per-expert")  # what a rollout actor may write for its engine
# What each engine reads and refuses, per family, is the family registry's (mint.models.families: `engine_layouts`,
# `engine_refusal`, `refused_modules`), read off the engines' own loaders (tests/test_vllm_lora_conformance.py runs
# vLLM's): a vLLM class's `is_3d_moe_weight` picks fused or per-expert, SGLang takes per-expert for every FusedMoE,
# `mint serve` fuses per-expert back (docs/mint.md). Fused gate_up rows are [gate; up] in every family with experts
# (transformers computes `gate, up = linear(x, W_e).chunk(2)` in each, and its checkpoint conversion maps the
# per-expert keys of all but qwen2_moe itself with qwen2_moe's pattern), so `split_experts` applies to each.
_PEFT_PREFIX = "base_model.model."


def _splits_experts(text_model_type: str) -> bool:
    """Whether `split_experts` knows the fused expert layout of a family (its registry entry has experts)."""
    entry = families.family(text_model_type)
    return entry is not None and entry.experts and entry.model_type == text_model_type


# vLLM's Qwen3_5{Moe}ForConditionalGeneration maps the checkpoint's own names (model.language_model.*, after
# base_model.model. is dropped) to its LoRA modules, and Mint's text-model keys (model.layers.*) nowhere.
VLM_MODULE_PREFIX = "model.language_model."


def vlm_names(tensors: dict, back: bool = False) -> dict:
    """Text-model adapter keys base_model.model.model.* -> the VLM checkpoint's base_model.model.model.language_model.*
    (`back`: the inverse). Keys outside the decoder (none that Mint trains) pass through."""
    old, new = (_PEFT_PREFIX + "model.", _PEFT_PREFIX + VLM_MODULE_PREFIX)[:: -1 if back else 1]
    return {new + k[len(old) :] if k.startswith(old) else k: v for k, v in tensors.items()}


@dataclass(frozen=True)
class ExpertLora:
    """One fused expert parameter that carries LoRA (a PEFT ParamWrapper)."""

    module: str  # PEFT module name, the prefix of its lora_A / lora_B keys
    parameter: str  # gate_up_proj | down_proj
    num_experts: int


# ---- where things go ---------------------------------------------------------------------------------------------


@contextmanager
def _atomic_dir(target: Path):
    """Yield a temp directory beside `target`; on success fsync it and rename it into place."""
    target = Path(target)
    if target.exists():
        raise MintError(f"{target}: already exists; exports never overwrite")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        for f in tmp.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp)
        os.rename(tmp, target)
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True))


def _meta_record(meta: RevisionMeta, fmt: str) -> dict:
    record = {k: v for k, v in meta.to_dict().items() if k not in ("stored",)}
    return {**record, "format": fmt}


def resolve_base(meta: RevisionMeta, base: str | None) -> str:
    """The base to export against: `base`, else the path in the adapter config, else the run's model spec."""
    from mint.models.tiny import resolve_model_path

    spec = base or meta.lora_config.get("base_model_name_or_path") or meta.base_model
    if not spec:
        raise MintError(f"revision {meta.id[:12]}: no base model recorded; pass --base PATH")
    return resolve_model_path(spec)


def check_base(meta: RevisionMeta, base_path: str) -> None:
    """Refuse a base whose fingerprint differs from the one the revision was trained on."""
    have = base_fingerprint(base_path)
    want = meta.base_fingerprint
    if want and not want.startswith("unresolved:") and not have.startswith("unresolved:") and have != want:
        raise MintError(
            f"revision {meta.id[:12]} was trained on base {want[:12]}, but {base_path} is {have[:12]}; wrong base"
        )


# ---- peft ---------------------------------------------------------------------------------------------------------


def export_peft(catalog: Catalog, ref: str, out: str | Path, base: str | None = None) -> Path:
    """Write the revision as a PEFT adapter directory: an independent copy of the bytes whose hash was just checked
    (never a link to the catalog's file: one corrupt byte would then corrupt both, and read-only modes do not stop
    root). `base` overrides base_model_name_or_path.
    """
    data, meta = catalog.adapter_bytes(ref)  # verifies the hash before anything is written
    config = dict(meta.lora_config)
    if base is not None:
        config["base_model_name_or_path"] = base
    with _atomic_dir(Path(out)) as tmp:
        (tmp / ADAPTER_FILE).write_bytes(data)
        _write_json(tmp / CONFIG_FILE, config)
        _write_json(tmp / META_FILE, _meta_record(meta, "peft"))
    return Path(out)


# ---- per-expert ---------------------------------------------------------------------------------------------------


def peft_lora_config(adapter_config: dict):
    from peft import LoraConfig

    names = {f.name for f in dataclasses.fields(LoraConfig)} - {"peft_type", "task_type"}
    return LoraConfig(**{k: v for k, v in adapter_config.items() if k in names})


# (base config JSON, adapter config JSON) -> its expert LoRAs. The skeleton costs seconds at 30B-A3B's 48 layers, and
# a rollout actor or a server splits or fuses every revision of a run with the same two configs.
_EXPERT_LORAS: dict[tuple[str, str], tuple[ExpertLora, ...]] = {}


def expert_loras(base_config, adapter_config: dict) -> list[ExpertLora]:
    """Which PEFT module carries which fused expert parameter, read off a meta-device skeleton of the base wrapped
    exactly as PEFT wraps it (so nesting order is never guessed). Built once per pair of configs in a process."""
    if not adapter_config.get("target_parameters"):
        return []
    to_json = getattr(base_config, "to_json_string", None)
    key = (to_json(use_diff=False), json.dumps(adapter_config, sort_keys=True, default=str)) if to_json else None
    if key is None or key not in _EXPERT_LORAS:
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        from mint.models.specs import causal_lm_config

        with torch.device("meta"):  # a VLM checkpoint's config: its text model's, the model Mint trains
            text = AutoModelForCausalLM.from_config(causal_lm_config(base_config))
            skeleton = get_peft_model(text, peft_lora_config(adapter_config))
        found = tuple(
            ExpertLora(name, module.parameter_name, int(module.num_experts))
            for name, module in skeleton.named_modules()
            if hasattr(module, "parameter_name") and getattr(module, "num_experts", 1) > 1
        )
        if key is None:
            return list(found)
        _EXPERT_LORAS[key] = found
    return list(_EXPERT_LORAS[key])


def _text_family(config) -> str:
    """The model_type of the model Mint trains on a base of `config`: a VLM checkpoint's text model's."""
    from mint.models.specs import vlm_text_model_type

    return vlm_text_model_type(config) or getattr(config, "model_type", "")


def _expert_prefix(module: str) -> str:
    """base_model.model.model.layers.0.mlp.experts.base_layer -> base_model.model.model.layers.0.mlp.experts"""
    while module.endswith(".base_layer"):
        module = module[: -len(".base_layer")]
    return module


def split_experts(
    tensors: dict[str, torch.Tensor], adapter_config: dict, base_config
) -> tuple[dict[str, torch.Tensor], dict]:
    """Fused 3-D expert LoRA -> per-expert 2-D LoRA (see the module docstring); other keys pass through."""
    family = _text_family(base_config)
    experts = expert_loras(base_config, adapter_config)
    if experts and not _splits_experts(family):
        raise MintError(f"per-expert export knows the fused expert layout of registered families, not {family}")
    out = dict(tensors)
    for ex in experts:
        a, b = out.pop(f"{ex.module}.lora_A.weight"), out.pop(f"{ex.module}.lora_B.weight")
        E = ex.num_experts
        r = a.shape[0] // E
        if ex.parameter not in ("gate_up_proj", "down_proj"):
            raise MintError(f"per-expert export: unknown fused expert parameter {ex.parameter}")
        # Disjoint views of one copy of A per projection and of B transposed once to (E, out, r): a clone per expert
        # (768 small allocations per layer at 30B-A3B's 128 experts) was several times slower. safetensors writes
        # disjoint views of one storage apart but refuses one view under two names, hence gate_proj's own A.
        a_E_r_in = a.reshape(E, r, a.shape[-1]).contiguous()
        b_E_out_r = b.reshape(b.shape[0], r, E).permute(2, 0, 1).contiguous()
        if ex.parameter == "gate_up_proj":
            half = b_E_out_r.shape[1] // 2
            parts = {
                "gate_proj": (a_E_r_in.clone(), b_E_out_r[:, :half]),
                "up_proj": (a_E_r_in, b_E_out_r[:, half:]),
            }
        else:
            parts = {"down_proj": (a_E_r_in, b_E_out_r)}
        prefix = _expert_prefix(ex.module)
        for e in range(E):
            for proj, (a_E, b_E) in parts.items():
                out[f"{prefix}.{e}.{proj}.lora_A.weight"] = a_E[e]
                out[f"{prefix}.{e}.{proj}.lora_B.weight"] = b_E[e]
    config = dict(adapter_config)
    if experts:
        config["target_modules"] = sorted(
            set(config.get("target_modules") or []) | {"gate_proj", "up_proj", "down_proj"}
        )
        config["target_parameters"] = None
    return out, config


def fuse_experts(per_expert: dict[str, torch.Tensor], adapter_config: dict, base_config) -> dict[str, torch.Tensor]:
    """The exact inverse of `split_experts`, given the fused adapter config. Raises if the shared A's disagree."""
    out = dict(per_expert)
    for ex in expert_loras(base_config, adapter_config):
        prefix, E = _expert_prefix(ex.module), ex.num_experts
        projs = ("gate_proj", "up_proj") if ex.parameter == "gate_up_proj" else ("down_proj",)

        def take(proj: str, factor: str, prefix=prefix, E=E) -> torch.Tensor:  # (E, ...) in expert order
            return torch.stack([out.pop(f"{prefix}.{e}.{proj}.lora_{factor}.weight") for e in range(E)])

        # Whole stacks per projection: a few large copies instead of E small concatenations and comparisons.
        a_E_r_in = [take(p, "A") for p in projs]
        for other in a_E_r_in[1:]:
            if not torch.equal(a_E_r_in[0], other):
                e = next(e for e in range(E) if not torch.equal(a_E_r_in[0][e], other[e]))
                raise MintError(f"{prefix}.{e}: gate_proj and up_proj LoRA A differ; not a split of a fused adapter")
        b_E_out_r = torch.cat([take(p, "B") for p in projs], dim=1)  # gate_up's out rows are [gate; up]
        out[f"{ex.module}.lora_A.weight"] = a_E_r_in[0].flatten(0, 1)  # (E*r, in), expert-major
        # one transposing copy to (out, r*E), expert-minor
        out[f"{ex.module}.lora_B.weight"] = b_E_out_r.permute(1, 2, 0).reshape(b_E_out_r.shape[1], -1)
    return out


# ---- engine directories (a rollout actor writes one per revision; `mint serve` reads both layouts) ----------------


def engine_layout(requested: str, adapter_config: dict, base_config, engine: str = "vllm") -> str:
    """The layout, "peft" (as trained) or "per-expert", of the adapter directory `engine` ("vllm", "sglang" or "mint",
    the `mint serve` server) is handed, from the base family's registry entry (mint.models.families). A family the
    engine cannot apply Mint's LoRA on (`engine_refusal`), or a target it loads but does not apply there
    (`refused_modules`: kv_b_proj on MLA in vLLM), is refused in one line. `base_config` is the base checkpoint's own
    config (config.json): a VLM one names the family its engine class reads (qwen3_5_moe: 3-D experts, peft), and
    `write_adapter_dir` then writes the VLM's module names.
    Without LoRA on fused experts both layouts hold the same keys: auto gives peft, and either request stands. With
    it, auto gives the first layout the entry says the engine reads; a family without an entry for that engine is
    refused rather than guessed (a guessed layout once broke GLM on both engines), as is an explicit layout that
    engine does not read, or a per-expert request on a family `split_experts` does not know.
    """
    if requested not in ENGINE_LAYOUTS:
        raise MintError(f"adapter layout {requested!r} is not one of {', '.join(ENGINE_LAYOUTS)}")
    if engine not in families.ENGINES:
        raise MintError(f"engine {engine!r} is not one of {', '.join(families.ENGINES)}")
    model_type = getattr(base_config, "model_type", "")
    if refused := families.engine_refusal(engine, model_type):
        raise MintError(refused)
    targets = adapter_config.get("target_modules") or ()  # names, or PEFT's regex string (then a substring test)
    for module, why in families.refused_modules(engine, _text_family(base_config)).items():
        if module in targets:
            raise MintError(why)
    if not expert_loras(base_config, adapter_config):
        return "peft" if requested == "auto" else requested
    reads = families.engine_layouts(engine, model_type)
    if requested == "auto":
        if not reads:
            raise MintError(
                f"{engine}: no expert-LoRA layout is known for {model_type or 'this base'} (mint.models.families has "
                "no entry for it); set engines.adapter_layout to the one its loader reads"
            )
        return reads[0]
    if reads and requested not in reads:
        raise MintError(f"{engine} reads {model_type} expert LoRA in the {' or '.join(reads)} layout, not {requested}")
    if requested == "per-expert" and not _splits_experts(_text_family(base_config)):
        raise MintError(f"per-expert knows the fused expert layout of registered families, not {model_type}; use peft")
    return requested


def write_adapter_dir(
    target: str | Path,
    revision: str,
    tensors: dict[str, torch.Tensor],
    adapter_config: dict,
    meta: dict,
    layout: str,
    base_config,
) -> Path:
    """Write revision `revision` (its trained tensors and adapter config) as an engine's adapter directory in
    `layout` ("peft" or "per-expert"), atomically through `write_revision_dir`. An existing target is kept and not
    split again. mint_revision.json records `meta`, the format, and the trained revision's id; a per-expert one also
    records the trained adapter config (`lora_config`), which `read_adapter_dir` needs to fuse it back. On a VLM
    base (`base_config` the checkpoint's own) the keys take the checkpoint's names (`vlm_names`), recorded as
    `module_prefix`; the adapter config's targets are module suffixes and match under either name."""
    target = Path(target)
    if target.exists():
        return target
    record = {**meta, "format": layout}
    if layout == "per-expert":
        tensors, engine_config = split_experts(tensors, adapter_config, base_config)
        record["lora_config"] = adapter_config
    elif layout == "peft":
        engine_config = adapter_config
    else:
        raise MintError(f"adapter layout {layout!r} is not peft or per-expert")
    if _text_family(base_config) != getattr(base_config, "model_type", ""):
        tensors = vlm_names(tensors)
        record["module_prefix"] = VLM_MODULE_PREFIX
    write_revision_dir(target, tensors, engine_config, record, revision=revision)
    return target


def read_adapter_dir(path: str | Path, base_config) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(tensors, adapter config, meta) of a peft or per-expert revision directory, in the trained (PEFT) layout and
    checked against the revision id it records: a per-expert directory is fused back first (`fuse_experts`, exact),
    so one altered value anywhere fails the hash. Merged checkpoints and anything else are refused, one line each."""
    path = Path(path)
    tensors, config, meta = read_revision_files(path)
    fmt = meta.get("format", "peft")
    if meta.get("module_prefix") == VLM_MODULE_PREFIX:  # written for a VLM base; any other name fails the hash
        tensors = vlm_names(tensors, back=True)
    if fmt == "per-expert":
        trained = meta.get("lora_config")
        if not isinstance(trained, dict) or not trained:
            raise MintError(
                f"{path}: a per-expert directory without the trained adapter config (lora_config in {META_FILE})"
            )
        try:
            tensors = fuse_experts(tensors, trained, base_config)
        except MintError as err:  # gate_proj and up_proj carry different A's
            raise MintError(f"{path}: {err}; refusing to load") from None
        except (KeyError, RuntimeError, ValueError) as err:  # a missing key, or shapes that do not stack
            detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise MintError(f"{path}: per-expert tensors do not fuse back ({detail}); refusing to load") from None
        config = {
            **trained,
            "base_model_name_or_path": config.get("base_model_name_or_path", trained.get("base_model_name_or_path")),
        }
    elif fmt != "peft":
        raise MintError(f"{path}: a {fmt} export; serve a peft or per-expert export (or the catalog revision)")
    check_revision_id(path, tensors, meta.get("id"))
    return tensors, config, meta


def export_per_expert(catalog: Catalog, ref: str, out: str | Path, base: str | None = None) -> Path:
    from transformers import AutoConfig

    tensors, meta = catalog.load(ref)
    base_path = resolve_base(meta, base)
    check_base(meta, base_path)
    split, config = split_experts(tensors, meta.lora_config, AutoConfig.from_pretrained(base_path))
    with _atomic_dir(Path(out)) as tmp:
        save_file(split, str(tmp / ADAPTER_FILE))
        _write_json(tmp / CONFIG_FILE, {**config, "base_model_name_or_path": base_path})
        _write_json(tmp / META_FILE, _meta_record(meta, "per-expert"))
    return Path(out)


# ---- merged -------------------------------------------------------------------------------------------------------


def merged_model(tensors: dict[str, torch.Tensor], adapter_config: dict, base_path: str):
    """The base with the adapter folded in (fp32 merge), as a plain transformers model. Never into a quantized base:
    the sum would be rounded back to FP8, losing most of the update; serve the adapter over the base instead."""
    from peft import PeftModel, set_peft_model_state_dict

    from mint.models.quant_checkpoint import checkpoint_quantization
    from mint.models.specs import load_model

    if Path(base_path).is_dir() and checkpoint_quantization(base_path) != "none":
        raise MintError(f"{base_path}: an FP8 base; Mint never merges into a quantized base, serve the adapter over it")

    peft_model = PeftModel(load_model(base_path, "float32"), peft_lora_config(adapter_config))
    set_peft_model_state_dict(peft_model, tensors)
    return peft_model.merge_and_unload()


def export_merged(catalog: Catalog, ref: str, out: str | Path, base: str | None = None) -> Path:
    """A full HF checkpoint (in the base's stored dtype) plus the base's tokenizer. Only on explicit request."""
    from transformers import AutoConfig, AutoTokenizer

    tensors, meta = catalog.load(ref)
    base_path = resolve_base(meta, base)
    check_base(meta, base_path)
    dtype = getattr(AutoConfig.from_pretrained(base_path), "dtype", None) or torch.float32
    model = merged_model(tensors, meta.lora_config, base_path).to(dtype)
    with _atomic_dir(Path(out)) as tmp:
        model.save_pretrained(str(tmp))
        with contextlib.suppress(Exception):  # a base without a tokenizer still merges; serving then needs its own
            AutoTokenizer.from_pretrained(base_path).save_pretrained(str(tmp))
        _write_json(tmp / META_FILE, _meta_record(meta, "merged"))
    return Path(out)


# ---- sizes --------------------------------------------------------------------------------------------------------


def checkpoint_bytes(path: str | Path) -> int:
    """Bytes of a checkpoint's *.safetensors files: what a merged checkpoint of this base occupies."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def lora_size(model_config, rank: int, target_modules: list[str], target_experts: bool = True) -> dict[str, int]:
    """Parameter counts of the base (a VLM checkpoint's text model: what Mint trains) and of its LoRA, from a
    meta-device skeleton wrapped by PEFT (no weights, so a 30B config costs seconds). Used to size revisions against
    merged checkpoints for models we cannot load here."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from mint.config import LoraConfig
    from mint.models.lora import peft_config
    from mint.models.specs import causal_lm_config

    lora = LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=list(target_modules), target_experts=target_experts)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(causal_lm_config(model_config))  # a VLM's: its text model
        base = sum(p.numel() for p in model.parameters())
        peft_model = get_peft_model(model, peft_config(lora, model_config))
    adapter = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    return {"base_params": int(base), "lora_params": int(adapter)}


def export(catalog: Catalog, ref: str, out: str | Path, fmt: str = "peft", base: str | None = None) -> dict:
    """Export in one format and report sizes: the revision's bytes against a merged checkpoint of its base."""
    if fmt not in FORMATS:
        raise MintError(f"export: format {fmt!r} is not one of {', '.join(FORMATS)}")
    meta = catalog.get(ref)
    writer = {"peft": export_peft, "per-expert": export_per_expert, "merged": export_merged}[fmt]
    path = writer(catalog, meta.id, out, base)
    report = {"revision": meta.id, "format": fmt, "path": str(path), "bytes": checkpoint_bytes(path)}
    try:
        merged = checkpoint_bytes(resolve_base(meta, base))
    except MintError:
        merged = 0
    if merged:
        report.update(merged_bytes=merged, revision_bytes_over_merged=round(meta.nbytes / merged, 6))
    return report
