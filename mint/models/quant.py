"""A quantized frozen base: the checkpoint's FP8 bytes and block scales kept as they ship, dequantized per layer.

LoRA never changes the base, so the learner can compute on the very weights the engines serve instead of a bf16
copy: a 230B-1T MoE then fits the clusters it is trained on, and the rollout/learner mismatch loses the part that
came from weight quantization (docs/quantization.md).

Format: FP8 e4m3 with block scales, the DeepSeek-V3 key layout that DeepSeek, Qwen and GLM "-FP8" checkpoints ship.
A quantized linear's `weight` [O, I] is float8_e4m3fn and `weight_scale_inv` [ceil(O/bo), ceil(I/bi)] fp32 holds
what each (bo x bi) block's values are multiplied by (the name is the vendors'); config.json's quantization_config
reads {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bo, bi], "activation_scheme": "dynamic"}.

Compute: `Fp8Linear` (every quantized nn.Linear) and quantized fused experts (`quantize_experts`) dequantize the
weight inside the matmul's autograd function, in the compute dtype, and again in backward for dX; they save no
dequantized copy, so backward holds the quantized bytes (by reference) and the activations only. There is no weight
gradient: the base is frozen.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

import mint_kernels
from mint.errors import ConfigError
from mint.models.quant_int4 import PackedLinear, packed_experts_weight

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE_SUFFIX = "_scale_inv"  # beside each quantized tensor: `weight_scale_inv`, `gate_up_proj_scale_inv`


# ---- the format -----------------------------------------------------------------------------------------------------


def _expand(scale_G_H: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Per-block scales [..., G, H] as a per-element grid [..., rows, cols] (the last block of a dimension that the
    block size does not divide is cut, as DeepSeek's own dequantization reads it)."""
    bo, bi = block
    grid = scale_G_H.repeat_interleave(bo, dim=-2).repeat_interleave(bi, dim=-1)
    return grid[..., :rows, :cols]


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 scale per block) of w [..., O, I]: each block's absolute maximum maps to 448,
    the format's largest value, and w ~ q * scale. What vendors' FP8 exporters write; the tiny FP8 bases use it."""
    *lead, rows, cols = w.shape
    bo, bi = block
    g, h = math.ceil(rows / bo), math.ceil(cols / bi)
    padded = w.new_zeros(*lead, g * bo, h * bi, dtype=torch.float32)
    padded[..., :rows, :cols] = w.float()
    amax = padded.reshape(*lead, g, bo, h, bi).abs().amax(dim=(-3, -1))
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w.float() / _expand(scale, rows, cols, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """q [..., O, I] float8 times its block scales, in `dtype` (the product is formed in fp32)."""
    rows, cols = q.shape[-2:]
    return (q.float() * _expand(scale.float(), rows, cols, block)).to(dtype)


def block_of(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> tuple[int, int]:
    """The block size: the config's, checked against the scale grid, or read off the grid when the dims divide."""
    rows, cols = q.shape[-2:]
    g, h = scale.shape[-2:]
    if block is None:
        if rows % g or cols % h:
            raise ConfigError(f"fp8: a scale grid {g}x{h} does not divide a {rows}x{cols} weight; give the block size")
        return rows // g, cols // h
    want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if want != (g, h):
        raise ConfigError(f"fp8: a {rows}x{cols} weight in {block[0]}x{block[1]} blocks needs a scale grid of "
                          f"{want[0]}x{want[1]}, the checkpoint has {g}x{h}")  # fmt: skip
    return tuple(block)


# ---- compute --------------------------------------------------------------------------------------------------------


class _DequantLinear(torch.autograd.Function):
    """x W^T (+ b) with W dequantized from (q, scale) for the forward and again for the backward's dX: the graph keeps
    q and scale by reference, never the dequantized W. The base is frozen, so q, scale and b get no gradient."""

    @staticmethod
    def forward(ctx, x, q, scale, bias, block):
        ctx.save_for_backward(q, scale)
        ctx.block = block
        # mint_kernels dispatches: the Triton dequant-GEMM on CUDA (W never whole), W dequantized per call on CPU.
        y = mint_kernels.fp8_block_matmul(x, q, scale, block)
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        q, scale = ctx.saved_tensors
        grad_x = mint_kernels.fp8_block_matmul(grad_out, q, scale, ctx.block, transpose=False)
        return grad_x, None, None, None, None


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block, bias=None) -> torch.Tensor:
    return _DequantLinear.apply(x, q, scale, bias, tuple(block))


class Fp8Linear(nn.Linear):
    """A frozen nn.Linear whose weight is the checkpoint's FP8 bytes with block scales. An nn.Linear to PEFT, so
    LoRA wraps it as any linear; `compute_dtype` is what PEFT puts the LoRA factors in (the recipe's model.dtype),
    as it does over bitsandbytes' quantized linears."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, block, bias: torch.Tensor | None, compute_dtype):
        nn.Module.__init__(self)
        self.out_features, self.in_features = q.shape
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale_inv", scale.float())
        self.bias = None if bias is None else nn.Parameter(bias.to(compute_dtype), requires_grad=False)
        self.block = tuple(block)
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale_inv, self.block, dtype or self.compute_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 blocks {self.block}"


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """A frozen linear's weight [O, I] in its compute dtype: dequantized for an Fp8Linear or PackedLinear (a
    temporary, for code that must form the matrix itself, as MLA's absorbed up-projection), the parameter itself
    otherwise."""
    return linear.dequantized() if isinstance(linear, (Fp8Linear, PackedLinear)) else linear.weight


class ExpertWeight:
    """One fused-experts weight [E, O, I] as `experts_forward` reads it: `linear(x, e)` is x W[e]^T, dequantized
    in the matmul when the experts are quantized (FP8 blocks, `quantize_experts`; or pack-quantized INT,
    `mint.models.quant_int4.pack_experts`)."""

    def __init__(self, experts: nn.Module, name: str):
        self.weight = getattr(experts, name)
        self.scale = getattr(experts, name + SCALE_SUFFIX, None)
        self.block = getattr(experts, "fp8_block", None)
        self.packed = packed_experts_weight(experts, name) if hasattr(experts, "packed_scheme") else None

    @property
    def shape(self) -> torch.Size:
        return self.packed.shape if self.packed is not None else self.weight.shape

    @property
    def quantized(self) -> bool:
        return self.scale is not None or self.packed is not None

    def linear(self, x: torch.Tensor, e: int) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.linear(x, e)
        if self.scale is None:
            return F.linear(x, self.weight[e])
        return fp8_linear(x, self.weight[e], self.scale[e], self.block)


def is_quantized_experts(experts: nn.Module) -> bool:
    return hasattr(experts, "fp8_block") or hasattr(experts, "packed_scheme")


@contextmanager
def compute_dtype_view(model: nn.Module, dtype: torch.dtype):
    """While PEFT wraps `model`: each quantized experts weight stands in as a `dtype` tensor of its shape [E, O, I]
    (one value, expanded: no memory). PEFT puts an expert parameter's LoRA factors in that parameter's dtype, which
    for FP8 bytes would round the factors' initial values to FP8 (and packed INT words have another shape); the
    LoRA must be in the compute dtype, as over Fp8Linear. The quantized parameters are back in place on exit; PEFT's
    wrappers read them by name, on every call."""
    swapped = []
    for module in model.modules():
        if is_quantized_experts(module):
            packed = getattr(module, "packed_shapes", {})
            for name, p in list(module.named_parameters(recurse=False)):
                if p.dtype == FP8 or name in packed:
                    shape = (p.shape[0], *packed[name]) if name in packed else p.shape
                    stand_in = torch.zeros((), dtype=dtype, device=p.device).expand(shape)
                    setattr(module, name, nn.Parameter(stand_in, requires_grad=False))
                    swapped.append((module, name, p))
    try:
        yield
    finally:
        for module, name, p in swapped:
            setattr(module, name, p)


def quantize_experts(experts: nn.Module, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], block) -> None:
    """Give a fused-experts module (gate_up_proj [E, 2I, H], down_proj [E, H, I]) the checkpoint's FP8 bytes and
    scales in place of its parameters. tensors: name -> (q, scale). Its forward must then be one that reads them
    (`mint.models.expert_lora.base_experts_forward`, which the loader installs: transformers' forwards cannot)."""
    for name, (q, scale) in tensors.items():
        setattr(experts, name, nn.Parameter(q, requires_grad=False))
        experts.register_buffer(name + SCALE_SUFFIX, scale.float())
    experts.fp8_block = tuple(block)
