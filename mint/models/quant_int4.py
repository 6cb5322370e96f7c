"""INT weights group-quantized by compressed-tensors (`pack-quantized`, the format of Kimi-K2's and K2.5's experts):
the format read with compressed-tensors' own compressor, and the dequantizing matmul over it.

A quantized linear ships `weight_packed` [O, ceil(I·b/32)] int32 (b-bit integers packed densely), `weight_scale`
[O, I/g] (one scale per group of g inputs; bf16 in Kimi's release) and `weight_shape` ([O, I]). Mint reads symmetric
schemes; an asymmetric one adds a packed `weight_zero_point` and is refused in one line. config.json's
quantization_config (quant_method "compressed-tensors", format "pack-quantized") names the scheme per config group.
Kimi-K2.5's is 4-bit, symmetric, group 32, on the routed experts only: attention, shared experts, the dense MLPs and
the head stay bf16.

Nothing here unpacks or scales bits by hand: `PackedQuantizationCompressor.decompress` is the library's, run per
matmul (per expert segment for fused experts) and again in backward for dX, so no dequantized weight is kept.
"""

from __future__ import annotations

import torch
from torch import nn

from mint.errors import ConfigError

PACKED = ("weight_packed", "weight_scale", "weight_shape")  # what the format writes in place of `weight`


def scheme_of(quantization_config: dict, where: str):
    """The one weight scheme (compressed_tensors.QuantizationScheme) of a pack-quantized checkpoint's config; a
    one-line ConfigError for what Mint does not read: another format, activation quantization, float weights,
    activation-ordered groups, or config groups with different weight schemes."""
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(quantization_config)
    if qc.format != "pack-quantized":
        raise ConfigError(f"model.path: {where} is compressed-tensors {qc.format!r}; Mint reads 'pack-quantized'")
    schemes = list(qc.config_groups.values())
    weights = {s.weights.model_dump_json() if s.weights else "" for s in schemes}
    if not schemes or len(weights) != 1:
        raise ConfigError(f"model.path: {where}: {len(weights)} weight schemes in its config groups; Mint reads one")
    scheme = schemes[0]
    w = scheme.weights
    readable = w is not None and w.type == "int" and w.symmetric and w.strategy == "group"
    if not readable or scheme.input_activations is not None or w.actorder not in (None, "static"):
        raise ConfigError(f"model.path: {where}: compressed-tensors weights {w} with input activations "
                          f"{scheme.input_activations}; Mint reads weight-only symmetric INT groups "
                          f"(W4A16)")  # fmt: skip
    return scheme


def decompress(tensors: dict[str, torch.Tensor], scheme, dtype: torch.dtype) -> torch.Tensor:
    """The weight [O, I] in `dtype` from one linear's `weight_packed`, `weight_scale` and `weight_shape`, by
    compressed-tensors' own compressor."""
    from compressed_tensors.compressors import PackedQuantizationCompressor

    return PackedQuantizationCompressor.decompress(tensors, scheme)["weight"].to(dtype).contiguous()


def compress(weight: torch.Tensor, scheme) -> dict[str, torch.Tensor]:
    """What a compressed-tensors export writes for `weight` [O, I] under `scheme`: min-max group scales from the
    library's `calculate_qparams`, packed by its compressor (the tiny INT4 bases are made this way)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.weights
    rows, cols = weight.shape
    group = args.group_size
    if cols % group:
        raise ConfigError(f"int4: {cols} inputs are not whole groups of {group}")
    w = weight.float().reshape(rows, cols // group, group)
    scale, zero_point = calculate_qparams(w.amin(-1), w.amax(-1), args)
    state = {"weight": weight.float(), "weight_scale": scale.to(weight.dtype), "weight_zero_point": zero_point}
    # Symmetric: the compressor drops the zero point.
    return {k: v.contiguous() for k, v in PackedQuantizationCompressor.compress(state, scheme).items()}


class _PackedMatmul(torch.autograd.Function):
    """x W^T (+ b), W decompressed from its packed tensors for the forward and again for the backward's dX; the graph
    keeps the packed tensors by reference only. The base is frozen: nothing but x gets a gradient."""

    @staticmethod
    def forward(ctx, x, weight: PackedWeight, e, bias):
        ctx.weight, ctx.e = weight, e
        return nn.functional.linear(x, weight.dequantized(x.dtype, e), bias)

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = grad_out @ ctx.weight.dequantized(grad_out.dtype, ctx.e) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


class PackedWeight:
    """One weight in the pack-quantized format, [O, I] or fused experts' [E, O, I]: its tensors (by reference) and
    the scheme that reads them."""

    def __init__(self, tensors: dict[str, torch.Tensor], shape: tuple[int, ...], scheme):
        self.tensors, self.shape, self.scheme = tensors, torch.Size(shape), scheme

    def dequantized(self, dtype: torch.dtype, e: int | None = None) -> torch.Tensor:
        """W [O, I] (expert `e`'s of fused experts) in `dtype`: a temporary."""
        parts = {k: v if e is None else v[e] for k, v in self.tensors.items()}
        parts["weight_shape"] = torch.tensor(self.shape[-2:])
        return decompress(parts, self.scheme, dtype)

    def linear(self, x: torch.Tensor, e: int | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _PackedMatmul.apply(x, self, e, bias)


class PackedLinear(nn.Linear):
    """A frozen nn.Linear over a pack-quantized weight. An nn.Linear to PEFT, so LoRA wraps it as any linear;
    `compute_dtype` is what the LoRA factors and the matmul run in (the recipe's model.dtype)."""

    def __init__(
        self, packed: torch.Tensor, scale: torch.Tensor, shape, scheme, bias: torch.Tensor | None, compute_dtype
    ):
        nn.Module.__init__(self)
        self.out_features, self.in_features = (int(n) for n in shape)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.register_buffer("weight_scale", scale)
        self.scheme = scheme
        self.bias = None if bias is None else nn.Parameter(bias.to(compute_dtype), requires_grad=False)
        self.compute_dtype = compute_dtype

    def packed(self) -> PackedWeight:
        """The module's own tensors (read on every call, so `.to()` and loading keep working)."""
        tensors = {"weight_packed": self.weight, "weight_scale": self.weight_scale}
        return PackedWeight(tensors, (self.out_features, self.in_features), self.scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed().linear(x, bias=self.bias)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.packed().dequantized(dtype or self.compute_dtype)

    def extra_repr(self) -> str:
        w = self.scheme.weights
        return f"in_features={self.in_features}, out_features={self.out_features}, int{w.num_bits} groups of " \
               f"{w.group_size}"  # fmt: skip


def pack_experts(
    experts: nn.Module, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], shapes: dict, scheme
) -> None:
    """Give a fused-experts module its pack-quantized weights in place of `gate_up_proj` and `down_proj`: tensors
    name -> (packed [E, O, P] int32, scale [E, O, G]), shapes name -> (O, I). The packed ints take the parameter's
    name, the scales become the buffer `{name}_scale`; its forward must be one that reads them
    (`mint.models.expert_lora.base_experts_forward`, which the loader installs)."""
    for name, (packed, scale) in tensors.items():
        setattr(experts, name, nn.Parameter(packed, requires_grad=False))
        experts.register_buffer(name + "_scale", scale)
    known = getattr(experts, "packed_shapes", {})
    experts.packed_shapes = {**known, **{name: tuple(int(n) for n in shape) for name, shape in shapes.items()}}
    experts.packed_scheme = scheme


def packed_experts_weight(experts: nn.Module, name: str) -> PackedWeight:
    """Fused experts' `name` weight as a PackedWeight over the module's own tensors, [E, O, I]."""
    tensors = {"weight_packed": getattr(experts, name), "weight_scale": getattr(experts, name + "_scale")}
    e = tensors["weight_packed"].shape[0]
    return PackedWeight(tensors, (e, *experts.packed_shapes[name]), experts.packed_scheme)
