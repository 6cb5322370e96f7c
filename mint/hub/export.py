"""Export a catalog revision for serving: PEFT as trained, per-expert for vLLM/SGLang, or merged (only on request).

Formats
    peft        The revision directory as it is: `PeftModel.from_pretrained(base, dir)` loads it and gives the
                training model's logits. Fused MoE experts keep PEFT's `target_parameters` layout.
    per-expert  Fused 3-D expert LoRA split into per-expert 2-D LoRA under the module names of Qwen-MoE
                checkpoints, which vLLM and SGLang load:
                    base_model.model.model.layers.{l}.mlp.experts.{e}.gate_proj.lora_A.weight   [r, H]
                    base_model.model.model.layers.{l}.mlp.experts.{e}.gate_proj.lora_B.weight   [I, r]
                    ... .up_proj.lora_A / lora_B                                                 [r, H] / [I, r]
                    ... .down_proj.lora_A / lora_B                                               [r, I] / [H, r]
                Attention LoRA keys are unchanged. See docs/mint.md for where the names come from.
    merged      base + scale * B @ A folded into a full HF checkpoint. Written only when asked for by name.

The split is exact (indexing only, no arithmetic): PEFT keeps expert e's A as rows [e*r, (e+1)*r) of lora_A
(r*E, in) and its B as columns e, e+E, e+2E, ... of lora_B (out, r*E); the delta of expert e is
scale * B_e @ A_e, shape (out, in). gate_up_proj's out rows are [gate (I); up (I)] (Qwen-MoE computes
`gate, up = linear(x, W_e).chunk(2)`), so gate_proj and up_proj share A_e and take the two halves of B_e.
`fuse_experts` inverts `split_experts` bit for bit; tests check both that and the logits of a checkpoint merged from
the per-expert keys through transformers' own per-expert -> fused loader.
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
from mint.hub.revisions import ADAPTER_FILE, CONFIG_FILE, META_FILE, RevisionMeta, base_fingerprint, fsync_dir

FORMATS = ("peft", "per-expert", "merged")
PER_EXPERT_FAMILIES = ("qwen2_moe", "qwen3_moe")  # fused gate_up rows are [gate; up] in these
_PEFT_PREFIX = "base_model.model."


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


def export_peft(catalog: Catalog, ref: str, out: str | Path, base: str | None = None, link: bool = False) -> Path:
    """Write the revision as a PEFT adapter directory: an independent copy of the bytes whose hash was just checked.
    `base` overrides base_model_name_or_path.

    `link` is accepted and ignored. It used to hard-link the tensors file to the catalog's, which made one corrupt byte
    corrupt both copies (read-only modes do not stop root); an export now never shares a file with the catalog.
    """
    del link
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


def expert_loras(base_config, adapter_config: dict) -> list[ExpertLora]:
    """Which PEFT module carries which fused expert parameter, read off a meta-device skeleton of the base wrapped
    exactly as PEFT wraps it (so nesting order is never guessed)."""
    if not adapter_config.get("target_parameters"):
        return []
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = get_peft_model(AutoModelForCausalLM.from_config(base_config), peft_lora_config(adapter_config))
    return [
        ExpertLora(name, module.parameter_name, int(module.num_experts))
        for name, module in skeleton.named_modules()
        if hasattr(module, "parameter_name") and getattr(module, "num_experts", 1) > 1
    ]


def _expert_prefix(module: str) -> str:
    """base_model.model.model.layers.0.mlp.experts.base_layer -> base_model.model.model.layers.0.mlp.experts"""
    while module.endswith(".base_layer"):
        module = module[: -len(".base_layer")]
    return module


def split_experts(
    tensors: dict[str, torch.Tensor], adapter_config: dict, base_config
) -> tuple[dict[str, torch.Tensor], dict]:
    """Fused 3-D expert LoRA -> per-expert 2-D LoRA (see the module docstring); other keys pass through."""
    family = getattr(base_config, "model_type", "")
    experts = expert_loras(base_config, adapter_config)
    if experts and family not in PER_EXPERT_FAMILIES:
        raise MintError(f"per-expert export knows the Qwen-MoE layout ({', '.join(PER_EXPERT_FAMILIES)}), not {family}")
    out = dict(tensors)
    for ex in experts:
        a, b = out.pop(f"{ex.module}.lora_A.weight"), out.pop(f"{ex.module}.lora_B.weight")
        E = ex.num_experts
        r = a.shape[0] // E
        a_E_r_in = a.reshape(E, r, a.shape[-1])
        b_out_r_E = b.reshape(b.shape[0], r, E)
        prefix = _expert_prefix(ex.module)
        for e in range(E):
            a_e, b_e = a_E_r_in[e].contiguous(), b_out_r_E[:, :, e].contiguous()
            if ex.parameter == "gate_up_proj":
                half = b_e.shape[0] // 2
                parts = {"gate_proj": b_e[:half], "up_proj": b_e[half:]}
            elif ex.parameter == "down_proj":
                parts = {"down_proj": b_e}
            else:
                raise MintError(f"per-expert export: unknown fused expert parameter {ex.parameter}")
            for proj, b_part in parts.items():
                out[f"{prefix}.{e}.{proj}.lora_A.weight"] = a_e.clone()
                out[f"{prefix}.{e}.{proj}.lora_B.weight"] = b_part.contiguous()
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
        prefix = _expert_prefix(ex.module)
        projs = ("gate_proj", "up_proj") if ex.parameter == "gate_up_proj" else ("down_proj",)
        a_rows, b_cols = [], []
        for e in range(ex.num_experts):
            a_e = [out.pop(f"{prefix}.{e}.{p}.lora_A.weight") for p in projs]
            if any(not torch.equal(a_e[0], other) for other in a_e[1:]):
                raise MintError(f"{prefix}.{e}: gate_proj and up_proj LoRA A differ; not a split of a fused adapter")
            a_rows.append(a_e[0])
            b_cols.append(torch.cat([out.pop(f"{prefix}.{e}.{p}.lora_B.weight") for p in projs], dim=0))
        out[f"{ex.module}.lora_A.weight"] = torch.cat(a_rows, dim=0)  # (E*r, in), expert-major
        out[f"{ex.module}.lora_B.weight"] = torch.stack(b_cols, dim=-1).flatten(1)  # (out, r*E), expert-minor
    return out


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
    """The base with the adapter folded in (fp32 merge), as a plain transformers model."""
    from peft import PeftModel, set_peft_model_state_dict

    from mint.models.specs import load_model

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
    """Parameter counts of the base and of its LoRA, from a meta-device skeleton wrapped by PEFT (no weights, so a
    30B config costs seconds). Used to size revisions against merged checkpoints for models we cannot load here."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from mint.config import LoraConfig
    from mint.models.lora import peft_config

    lora = LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=list(target_modules), target_experts=target_experts)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
        base = sum(p.numel() for p in model.parameters())
        peft_model = get_peft_model(model, peft_config(lora, model_config))
    adapter = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    return {"base_params": int(base), "lora_params": int(adapter)}


def export(catalog: Catalog, ref: str, out: str | Path, fmt: str = "peft", base: str | None = None) -> dict:
    """Export in one format and report sizes: the revision's bytes against a merged checkpoint of its base."""
    if fmt not in FORMATS:
        raise MintError(f"export: format {fmt!r} is not one of {', '.join(FORMATS)}")
    meta = catalog.get(ref)
    if fmt == "peft":
        path = export_peft(catalog, meta.id, out, base)
    elif fmt == "per-expert":
        path = export_per_expert(catalog, meta.id, out, base)
    else:
        path = export_merged(catalog, meta.id, out, base)
    report = {"revision": meta.id, "format": fmt, "path": str(path), "bytes": checkpoint_bytes(path)}
    try:
        merged = checkpoint_bytes(resolve_base(meta, base))
    except MintError:
        merged = 0
    if merged:
        report.update(merged_bytes=merged, revision_bytes_over_merged=round(meta.nbytes / merged, 6))
    return report
