"""Reading a checkpoint's experts a rank at a time: the safetensors files held open, each expert's rows read on
their own (plain, FP8 with block scales, or INT4 packed), the bytes counted. `mint.models.expert_parallel` loads its
sharded model through it.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mint.errors import ConfigError
from mint.models.expert_lora import DOWN, GATE_UP
from mint.models.quant import SCALE_SUFFIX, Fp8Linear, block_of
from mint.models.quant_int4 import PackedLinear


@dataclass(frozen=True)
class PackedRows:
    """Experts lo:hi of a pack-quantized (INT4) weight: packed int32 words [n, O, P], scales [n, O, G], the logical
    (O, I) of one expert, and the scheme that reads them (mint.models.quant_int4)."""

    packed: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, int]
    scheme: object


# An expert's weight, or (FP8 checkpoints) its block scales, or (INT4) its packed words, group scales and shape.
PER_EXPERT = re.compile(
    r"^(?P<module>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight"
    r"(?:_scale_inv|_packed|_scale|_shape)?$"
)
_FUSED = re.compile(rf"^(?P<module>.+\.experts)\.(?P<proj>{GATE_UP}|{DOWN})$")
_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1}


class CheckpointReader:
    """The safetensors files of a checkpoint, open for the loader's duration; counts the bytes it reads."""

    def __init__(self, path: str, stack: ExitStack, dtype: torch.dtype, block=None, scheme=None):
        from safetensors import safe_open

        root = Path(path)
        index = root / "model.safetensors.index.json"
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.exists()
            else ["model.safetensors"]
        )
        self.dtype, self.block, self.scheme = dtype, block, scheme
        self.taken: set[str] = set()  # keys read already (a quantized linear's weight, scales and bias)
        self.handles = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(root / file), framework="pt"))
            keys = handle.keys()
            self.handles.update(dict.fromkeys(keys, handle))
        self.expert_bytes_read = self.dense_bytes_read = 0
        self.expert_bytes_total = sum(self._nbytes(k) for k in self.handles if is_expert_key(k))

    def _nbytes(self, key: str) -> int:
        s = self.handles[key].get_slice(key)
        return _ITEMSIZE[s.get_dtype()] * int(torch.Size(s.get_shape()).numel())

    def quantized_linears(self, model: nn.Module) -> None:
        """Every linear the checkpoint quantizes becomes an Fp8Linear (its `weight_scale_inv`) or a PackedLinear
        (its `weight_packed`) over its own bytes."""
        marker = ".weight" + SCALE_SUFFIX if self.scheme is None else ".weight_packed"
        for key in [k for k in self.handles if k.endswith(marker) and not is_expert_key(k)]:
            name = key.removesuffix(marker)
            parent, _, attr = name.rpartition(".")
            bias = self._raw(f"{name}.bias") if f"{name}.bias" in self.handles else None
            if self.scheme is None:
                linear = Fp8Linear(self._raw(f"{name}.weight"), self._raw(key), self.block, bias, self.dtype)
            else:
                shape = tuple(self._raw(f"{name}.weight_shape").tolist())
                linear = PackedLinear(self._raw(key), self._raw(f"{name}.weight_scale"), shape, self.scheme, bias,
                                      self.dtype)  # fmt: skip
            setattr(model.get_submodule(parent) if parent else model, attr, linear)
            self.taken.update({key, f"{name}.weight", f"{name}.bias", f"{name}.weight_scale", f"{name}.weight_shape"})

    def _raw(self, key: str) -> torch.Tensor:
        self.dense_bytes_read += self._nbytes(key)
        return self.handles[key].get_tensor(key)

    def dense_state(self) -> dict[str, torch.Tensor]:
        state = {}
        for key, handle in self.handles.items():
            if not is_expert_key(key) and key not in self.taken:
                state[key] = handle.get_tensor(key).to(self.dtype)
                self.dense_bytes_read += self._nbytes(key)
        return state

    def expert_rows(self, module: str, pname: str, lo: int, hi: int) -> torch.Tensor | tuple | PackedRows:
        """Rows lo:hi of `module`.`pname` in the model's fused layout, reading only those experts."""
        fused = f"{module}.{pname}"
        if fused in self.handles:
            if self.block is not None or self.scheme is not None:
                raise ConfigError(f"expert parallel load: {fused}: fused quantized expert stacks are not read; "
                                  f"per expert")  # fmt: skip
            return self._read(fused, slice(lo, hi))
        projs = ("gate_proj", "up_proj") if pname == GATE_UP else ("down_proj",)

        def stacked(suffix: str) -> torch.Tensor:
            keys = [[f"{module}.{e}.{p}.weight{suffix}" for p in projs] for e in range(lo, hi)]
            return torch.stack([torch.cat([self._read(k, slice(None)) for k in row]) for row in keys])

        if self.scheme is not None:
            shapes = {
                tuple(tuple(self._read(f"{module}.{e}.{p}.weight_shape", slice(None)).tolist()) for p in projs)
                for e in range(lo, hi)
            }
            if len(shapes) != 1:
                raise ConfigError(f"expert parallel load: {module}: experts {lo}..{hi - 1} differ in shape: {shapes}")
            (row,) = shapes
            shape = (sum(s[0] for s in row), row[0][1])
            return PackedRows(stacked("_packed"), stacked("_scale"), shape, self.scheme)
        if self.block is None:
            return stacked("")
        q, scale = stacked(""), stacked(SCALE_SUFFIX)
        return q, scale, block_of(q, scale, self.block)  # refuses gate rows that are not whole blocks

    def _read(self, key: str, rows: slice) -> torch.Tensor:
        if key not in self.handles:
            raise ConfigError(f"expert parallel load: the checkpoint has no {key}")
        tensor = self.handles[key].get_slice(key)[rows]
        self.expert_bytes_read += tensor.numel() * tensor.element_size()
        # Quantized bytes and their scales stay as they are (the experts compute on them); the rest takes the dtype.
        return tensor if self.block is not None or self.scheme is not None else tensor.to(self.dtype)


def is_expert_key(key: str) -> bool:
    return bool(PER_EXPERT.match(key) or _FUSED.match(key))
