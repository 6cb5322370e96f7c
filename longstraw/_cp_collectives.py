"""The collectives of context parallelism, and the two autograd rules that keep gradients counted once.

Every rank of a context-parallel (CP) group runs the same replicated computation (same tokens, same weights, same
LoRA); only the prefix pages are split. Two operators cross between "replicated" and "per-rank partial" values, the
pair Megatron calls f and g:

- `sum_to_replicated(x_r)` (g): forward all-reduce SUM of the per-rank partials; backward identity. The result is
  replicated, so every rank back-propagates the same, full dL/dy; since y = sum_r x_r, dL/dx_r = dL/dy, locally.
  An all-reduce in backward here would count the gradient C times.
- `replicated_to_partial(*xs)` (f): forward identity; backward all-reduce SUM. A replicated input (the queries, the
  response's own K/V) feeds each rank's partial, and each rank's backward only sees the gradient through its own
  partial; the full gradient is the sum over ranks, which every rank needs because everything upstream of x is
  replicated.

Payloads go over the wire in fp32 (sums of C bf16 partials would round C times). `CollectiveLog` records each
collective's kind and payload bytes, which is how the tests measure communication per token.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

_LOGS: list[list[tuple[str, int]]] = []


@contextmanager
def collective_log():
    """Record (kind, payload bytes) of every CP collective this process issues inside the block."""
    calls: list[tuple[str, int]] = []
    _LOGS.append(calls)
    try:
        yield calls
    finally:
        _LOGS.remove(calls)


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def all_reduce_(t: torch.Tensor, op: str, group=None) -> torch.Tensor:
    """In-place all-reduce ("sum" or "max") over `group`; a no-op on one rank (or without torch.distributed).

    `t` must be contiguous: gloo reduces a strided view's storage as if it were dense (a transposed lse came back
    wrong, silently)."""
    if not t.is_contiguous():
        raise ValueError(f"all_reduce_ needs a contiguous tensor, got strides {t.stride()} for {tuple(t.shape)}")
    for calls in _LOGS:
        calls.append((f"all_reduce_{op}", t.numel() * t.element_size()))
    if world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return t


def all_gather(t: torch.Tensor, group=None) -> torch.Tensor:
    """[C, *t.shape]: every rank's `t` in rank order (no gradient); [1, *t.shape] on one rank."""
    for calls in _LOGS:
        calls.append(("all_gather", t.numel() * t.element_size()))
    t = t.contiguous()
    if world_size(group) == 1:
        return t.unsqueeze(0)
    parts = [torch.empty_like(t) for _ in range(world_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.stack(parts)


class _SumToReplicated(torch.autograd.Function):
    """y = sum over ranks of x (fp32 on the wire); backward: dL/dx = dL/dy (y is replicated, see module doc)."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.to(torch.promote_types(x.dtype, torch.float32)).clone(memory_format=torch.contiguous_format)
        return all_reduce_(y, "sum", group).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _ReplicatedToPartial(torch.autograd.Function):
    """Identity forward; backward sums each input's gradient over the ranks, all inputs packed in one all-reduce."""

    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        ctx.meta = [(x.shape, x.dtype) for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        # Every rank packs the same layout (unused outputs' gradients are materialized as zeros), so the collective
        # lines up even where this rank's partial did not read an input (a rank that does not count the own keys).
        acc = torch.promote_types(grads[0].dtype, torch.float32)
        flat = all_reduce_(torch.cat([g.reshape(-1).to(acc) for g in grads]), "sum", ctx.group)
        out, offset = [], 0
        for (shape, dtype), need in zip(ctx.meta, ctx.needs_input_grad[1:], strict=True):
            n = shape.numel()
            out.append(flat[offset : offset + n].view(shape).to(dtype) if need else None)
            offset += n
        return (None, *out)


def sum_to_replicated(x: torch.Tensor, group=None) -> torch.Tensor:
    """g: the sum over the group's ranks of x (same shape), replicated; its backward is local (module doc)."""
    return _SumToReplicated.apply(x, group)


def replicated_to_partial(*xs: torch.Tensor, group=None) -> tuple[torch.Tensor, ...]:
    """f: the same tensors, whose gradients are summed over the group's ranks in backward (module doc)."""
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in xs):
        return xs
    return _ReplicatedToPartial.apply(group, *xs)
