"""FP8 checkpoints in the DeepSeek-V3 key layout: reading one into a quantized model, and writing one.

Reading (`load_fp8`) never forms the dequantized base: the model is built with empty weights, each quantized
linear becomes an `Fp8Linear` over the checkpoint's own bytes and scales, each experts module's per-expert
weights (the hub layout, `experts.{e}.gate_proj.weight` ...) are stacked into its fused [E, O, I] FP8 parameters,
and only the tensors that ship unquantized (embeddings, norms, routers, the head) are read in the compute dtype.

Writing (`quantize_checkpoint`) is what a vendor's FP8 export does to a bf16 checkpoint, for the tiny FP8 bases:
every nn.Linear and routed expert weight becomes FP8 with its block scales, except the modules FP8 releases keep in
high precision (`KEEP`: the head, routers, shared-expert gates, DSA's indexer head weights).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tempfile
import types
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from mint.errors import ConfigError
from mint.models.expert_lora import base_experts_forward
from mint.models.quant import SCALE_SUFFIX, Fp8Linear, block_of, is_quantized_experts, quantize_experts, quantize_fp8
from mint.models.quant_int4 import PACKED, PackedLinear, compress, pack_experts, scheme_of

KEEP = ("lm_head", "mlp.gate", "shared_expert_gate", "indexer.weights_proj")
# An expert projection's weight, or the packed INT weight that stands for it (filed under its `.weight` name).
_PER_EXPERT = re.compile(
    r"^(?P<module>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight(_packed)?$"
)
_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def quantization_config(path: str) -> dict | None:
    """The checkpoint's quantization_config (a VLM's may sit in its text_config), or None."""
    config = _config_json(path)
    return config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")


def checkpoint_quantization(path: str) -> str:
    """`fp8` for a checkpoint whose config declares FP8 e4m3 block scales, `int4` for compressed-tensors
    pack-quantized 4-bit weights (symmetric groups), `none` for one without a quantization_config; a one-line
    ConfigError for any other quantization (named), which Mint does not read."""
    qc = quantization_config(path)
    if not qc:
        return "none"
    method = qc.get("quant_method")
    if method == "fp8" and qc.get("fmt", "e4m3") == "e4m3" and qc.get("weight_block_size"):
        return "fp8"
    if method == "compressed-tensors":
        bits = scheme_of(qc, path).weights.num_bits
        if bits == 4:
            return "int4"
        raise ConfigError(f"model.path: {path} is compressed-tensors int{bits}; Mint reads 4-bit packed groups")
    raise ConfigError(f"model.path: {path} is quantized as {method!r} {qc.get('fmt', '')}; Mint reads FP8 e4m3 with "
                      f"block scales (quant_method 'fp8', weight_block_size) and compressed-tensors pack-quantized "
                      f"INT4")  # fmt: skip


def resolve_quantization(requested: str, path: str) -> str:
    """What model.quantization `requested` means for the checkpoint at `path`: `auto` is the checkpoint's own; `fp8`,
    `int4` and `none` must be it (Mint neither quantizes a base on load nor keeps a dequantized copy). One-line
    ConfigError otherwise. A tiny:<family> spec not built yet is an unquantized base."""
    found = "none" if str(path).startswith("tiny:") else checkpoint_quantization(path)
    if requested not in ("auto", found):
        hint = "; quantize it first (mint.models.quant_checkpoint)" if found == "none" else ""
        kind = {"fp8": "an FP8", "int4": "an INT4"}.get(found, "a plain")
        raise ConfigError(
            f"model.quantization: {requested}, but {path} is {kind} checkpoint; use auto or {found}{hint}"
        )
    return found


def _config_json(path: str) -> dict:
    file = Path(path) / "config.json"
    if not file.is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path).to_dict()
    return json.loads(file.read_text())


def _files(path: str) -> list[Path]:
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.path: {path} has no .safetensors files")
    return files


def _tensors(path: str, stack: ExitStack) -> dict[str, tuple[object, str]]:
    """Every tensor's name -> (its file's handle, its name); each file is opened once and stays open until `stack`
    closes (a released base has tens of shards and some 100k tensors: a safe_open per tensor would parse a shard's
    header each time)."""
    where = {}
    for file in _files(path):
        f = stack.enter_context(safe_open(file, "pt"))
        where.update((key, (f, key)) for key in f.keys())  # noqa: SIM118 (safe_open is not iterable)
    return where


def _read(where: tuple[object, str]) -> torch.Tensor:
    return where[0].get_tensor(where[1])


def load_quantized(path: str, dtype: torch.dtype, config=None, renames: dict[str, str] | None = None) -> nn.Module:
    """The causal LM at `path` (an FP8 or INT4 checkpoint) with its quantized weights kept as they ship, the rest in
    `dtype`. config: the config to build (a VLM's text config; default the checkpoint's); renames: regex -> replacement
    of checkpoint keys, applied in order (a VLM's language-model keys), whose unmatched keys (its vision tower) are
    not read."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    kind = checkpoint_quantization(path)
    config = copy.deepcopy(config or AutoConfig.from_pretrained(path))
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # transformers' own paths dequantize on CPU and keep the copy
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with ExitStack() as stack:
        where = _tensors(path, stack)
        if renames:
            where = {_renamed(k, renames): w for k, w in where.items()}
        qc = quantization_config(path)
        fmt = _Fp8(qc) if kind == "fp8" else _Int4(scheme_of(qc, path))
        modules = dict(model.named_modules())
        used: set[str] = set()

        experts: dict[str, dict[str, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
        for key in where:
            m = _PER_EXPERT.match(key)
            if m:
                experts[m["module"]][m["proj"]][int(m["e"])] = key.removesuffix("_packed")
        for name, projs in experts.items():
            keys = [k.removesuffix(".weight") for per in projs.values() for k in per.values()]
            _load_experts(path, modules.get(name), name, projs, where, fmt, dtype)
            used.update(k + suffix for k in keys for suffix in fmt.suffixes)

        for key in where:
            if not key.endswith(fmt.marker) or key in used:
                continue
            name = key.removesuffix(fmt.marker)
            linear = modules.get(name)
            if not isinstance(linear, nn.Linear):
                raise ConfigError(
                    f"model.path: {path}: {key} quantizes a weight of no linear module of {type(model).__name__}"
                )
            bias = _read(where[f"{name}.bias"]) if f"{name}.bias" in where else None
            parent, _, attr = name.rpartition(".")
            setattr(modules[parent] if parent else model, attr, fmt.linear(name, where, bias, dtype))
            used.update(f"{name}{suffix}" for suffix in (*fmt.suffixes, ".bias"))

        rest = {k: _as(_read(w), dtype) for k, w in where.items() if k not in used}
        result = model.load_state_dict(rest, strict=False, assign=True)
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = [k for k in result.unexpected_keys if not any(p.search(k) for p in ignored)]
    if unexpected and not renames:  # a VLM's vision weights are not read
        raise ConfigError(f"model.path: {path} has {len(unexpected)} weights {type(model).__name__} lacks, e.g. "
                          f"{unexpected[0]}")  # fmt: skip
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise ConfigError(f"model.path: {path} lacks {len(missing)} weights, e.g. {missing[0]}")
    return model


def _renamed(key: str, renames: dict[str, str]) -> str:
    for pattern, replacement in renames.items():
        key = re.sub(pattern, replacement, key)
    return key


class _Fp8:
    """FP8 e4m3 with block scales: `weight` (float8) beside `weight_scale_inv`."""

    marker = ".weight" + SCALE_SUFFIX
    suffixes = (".weight", ".weight" + SCALE_SUFFIX)

    def __init__(self, qc: dict):
        self.block = tuple(qc["weight_block_size"])

    def linear(self, name: str, where, bias, dtype) -> nn.Module:
        q, scale = _read(where[f"{name}.weight"]), _read(where[f"{name}{self.marker}"])
        if q.dtype != torch.float8_e4m3fn:
            raise ConfigError(f"model.path: {name}.weight is {q.dtype}, not float8_e4m3fn")
        return Fp8Linear(q, scale, block_of(q, scale, self.block), bias, dtype)

    def expert_row(self, key: str, where) -> tuple:
        """(weight, scale or None) of one expert projection."""
        scale = where.get(key + SCALE_SUFFIX)
        return _read(where[key]), None if scale is None else _read(scale)

    def fuse(self, path, experts, name, rows_of: dict[str, list[list[tuple]]], dtype) -> None:
        if all(scale is None for rows in rows_of.values() for row in rows for _, scale in row):
            for fused, rows in rows_of.items():
                weights = torch.stack([torch.cat([w for w, _ in row]) for row in rows]).to(dtype)
                setattr(experts, fused, nn.Parameter(weights, requires_grad=False))
            return
        if any(scale is None for rows in rows_of.values() for row in rows for _, scale in row):
            raise ConfigError(f"model.path: {path}: {name} quantizes some expert projections and not others")
        rows = rows_of["gate_up_proj"][0][0][0].shape[0]
        if rows % self.block[0]:
            raise ConfigError(f"model.path: {path}: {name}: {rows} rows of gate_proj are not whole {self.block[0]}-row "
                              f"blocks, so gate and up cannot share one fused scale grid")  # fmt: skip
        quantized = {}
        for fused, per_expert in rows_of.items():
            q = torch.stack([torch.cat([w for w, _ in row]) for row in per_expert])
            scale = torch.stack([torch.cat([s for _, s in row]) for row in per_expert])
            block_of(q, scale, self.block)
            quantized[fused] = (q, scale)
        quantize_experts(experts, quantized, self.block)


class _Int4:
    """compressed-tensors pack-quantized: `weight_packed`, `weight_scale`, `weight_shape` in place of `weight`."""

    marker = ".weight_packed"
    suffixes = (".weight", *("." + k for k in PACKED))

    def __init__(self, scheme):
        self.scheme = scheme

    def _parts(self, name: str, where) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        packed, scale = _read(where[f"{name}.weight_packed"]), _read(where[f"{name}.weight_scale"])
        return packed, scale, tuple(int(n) for n in _read(where[f"{name}.weight_shape"]).tolist())

    def linear(self, name: str, where, bias, dtype) -> nn.Module:
        packed, scale, shape = self._parts(name, where)
        return PackedLinear(packed, scale, shape, self.scheme, bias, dtype)

    def expert_row(self, key: str, where) -> tuple:
        """(weight, None) of an unquantized projection, or (packed, scale, (O, I)) of a packed one."""
        if key in where:
            return _read(where[key]), None
        return self._parts(key.removesuffix(".weight"), where)

    def fuse(self, path, experts, name, rows_of: dict[str, list[list[tuple]]], dtype) -> None:
        packed = [len(part) == 3 for rows in rows_of.values() for row in rows for part in row]
        if not any(packed):
            for fused, rows in rows_of.items():
                weights = torch.stack([torch.cat([part[0] for part in row]) for row in rows]).to(dtype)
                setattr(experts, fused, nn.Parameter(weights, requires_grad=False))
            return
        if not all(packed):
            raise ConfigError(f"model.path: {path}: {name} quantizes some expert projections and not others")
        tensors, shapes = {}, {}
        for fused, per_expert in rows_of.items():
            # Packing runs along the input dim, so gate's and up's rows stack as rows: cat(gate, up) as transformers
            # fuses the float weights.
            packed_E = torch.stack([torch.cat([p for p, _, _ in row]) for row in per_expert])
            scale_E = torch.stack([torch.cat([s for _, s, _ in row]) for row in per_expert])
            row = per_expert[0]
            shapes[fused] = (sum(shape[0] for _, _, shape in row), row[0][2][1])
            tensors[fused] = (packed_E, scale_E)
        pack_experts(experts, tensors, shapes, self.scheme)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor shipped unquantized, in the compute dtype (integer buffers as they are)."""
    return t.to(dtype) if t.is_floating_point() else t


def _load_experts(path, experts, name, projs, where, fmt, dtype) -> None:
    """Stack one experts module's per-expert weights into its fused parameters, quantized when the checkpoint's are."""
    if experts is None or not all(hasattr(experts, fused) for fused in _FUSED):
        raise ConfigError(f"model.path: {path}: {name} holds per-expert weights of no fused experts module")
    count = getattr(experts, "num_experts", None) or experts.gate_up_proj.shape[0]
    rows_of = {}
    for fused, parts in _FUSED.items():
        per_expert = []
        for e in range(count):
            keys = [projs.get(p, {}).get(e) for p in parts]
            if None in keys:
                raise ConfigError(f"model.path: {path} lacks {name}.{e}.{parts[keys.index(None)]}.weight")
            per_expert.append([fmt.expert_row(k, where) for k in keys])
        rows_of[fused] = per_expert
    fmt.fuse(path, experts, name, rows_of, dtype)
    if is_quantized_experts(experts):
        # PEFT's expert wrappers call it as their base layer; their factored forward reads the same quantized weights.
        experts.forward = types.MethodType(base_experts_forward, experts)


def quantize_model(model: nn.Module, block: tuple[int, int] = (128, 128), keep: tuple[str, ...] = KEEP) -> nn.Module:
    """`model` (unquantized, not yet wrapped by PEFT) with what `quantize_checkpoint` would quantize turned FP8 in
    place, as `load_fp8` would have loaded it: for measurements at real dims, where writing the checkpoint first
    would only cost disk."""
    dtype = model.get_input_embeddings().weight.dtype
    for name, module in list(model.named_modules()):
        if any(k in name for k in keep):
            continue
        if isinstance(module, nn.Linear) and not isinstance(module, Fp8Linear):
            parent, _, attr = name.rpartition(".")
            q, scale = quantize_fp8(module.weight.detach(), block)
            bias = None if module.bias is None else module.bias.detach()
            setattr(model.get_submodule(parent) if parent else model, attr, Fp8Linear(q, scale, block, bias, dtype))
        elif all(isinstance(getattr(module, p, None), torch.Tensor) for p in _FUSED) and module.gate_up_proj.dim() == 3:
            quantize_experts(module, {p: quantize_fp8(getattr(module, p).detach(), block) for p in _FUSED}, block)
            module.forward = types.MethodType(base_experts_forward, module)
    return model


def quantize_checkpoint(src: str, dst: str, block: tuple[int, int] = (128, 128), keep: tuple[str, ...] = KEEP) -> str:
    """Write `src` (an unquantized checkpoint) to `dst` as FP8 e4m3 with `block` scales: every nn.Linear weight and
    routed expert weight not under a `keep` module, with its `weight_scale_inv`; config.json gains the
    quantization_config FP8 releases carry. Atomic: `dst` appears whole or not at all. Returns dst."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    tensors = {}
    with ExitStack() as stack:
        for key, where in _tensors(src, stack).items():
            t = _read(where)
            module = key.removesuffix(".weight")
            kept = any(k in module for k in keep)
            if key.endswith(".weight") and not kept and (module in linears or _PER_EXPERT.match(key)):
                q, scale = quantize_fp8(t, block)
                tensors[key], tensors[f"{module}.weight{SCALE_SUFFIX}"] = q, scale
            else:
                tensors[key] = t.contiguous()
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": list(keep),
    }
    return _write(src, dst, tensors, qc)


# Kimi-K2.5's release: 4-bit symmetric groups of 32 on the routed experts; these modules stay unquantized.
KIMI_IGNORE = ("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*")


def pack_checkpoint(src: str, dst: str, group_size: int = 32, linears: bool = False) -> str:
    """Write `src` (an unquantized checkpoint with per-expert weights) to `dst` as Kimi-K2.5 ships its experts:
    every routed expert projection compressed-tensors pack-quantized INT4 (symmetric, `group_size` inputs a scale),
    written by compressed-tensors' own compressor; everything else as it is. `linears`: every other nn.Linear weight
    too except the `KEEP` modules, as a W4A16 export of a whole model does. config.json gains the matching
    quantization_config (Kimi's, or one ignoring `KEEP`). Atomic, as `quantize_checkpoint`. Returns dst."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    qc = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": group_size,
                    "dynamic": False,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": list(KEEP) if linears else list(KIMI_IGNORE),
        "kv_cache_scheme": None,
    }
    scheme = scheme_of(qc, dst)
    packed = set()
    if linears:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
        linear = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not any(k in n for k in KEEP)}
        packed = {f"{n}.weight" for n in linear}
    tensors = {}
    with ExitStack() as stack:
        for key, where in _tensors(src, stack).items():
            t = _read(where)
            if _PER_EXPERT.match(key) or key in packed:
                name = key.removesuffix(".weight")
                tensors.update((f"{name}.{k}", v) for k, v in compress(t, scheme).items())
            else:
                tensors[key] = t.contiguous()
    return _write(src, dst, tensors, qc)


def _write(src: str, dst: str, tensors: dict[str, torch.Tensor], qc: dict) -> str:
    """`src`'s other files, `tensors` as model.safetensors and config.json with quantization_config `qc`, written to
    a temporary directory and renamed to `dst` (which must not exist)."""
    out = Path(dst)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        for f in Path(src).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["quantization_config"] = qc
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if out.exists():
            raise FileExistsError(f"{dst} exists")
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst
