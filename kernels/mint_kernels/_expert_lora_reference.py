"""Plain-torch expert LoRA: the CPU path of `expert_lora` and the reference its Triton kernels are tested on.

It runs the kernels' per-segment math with torch matmuls, one expert segment at a time:

    forward    mid_e = X_e A_e^T                [n_e, r]    (saved for backward)
               Y_e   = s mid_e B_e^T             [n_e, O]
    backward   g_e   = dY_e B_e                  [n_e, r]
               dX_e  = s g_e A_e                 [n_e, H]
               dA_e  = s g_e^T X_e               [r, H]
               dB_e  = s dY_e^T mid_e            [O, r]

All of it runs in promote_types(x, A, B, fp32): fp32 for half inputs, fp64 for fp64 (gradcheck). B_e A_e, the
[O, H] delta weight, is never formed, let alone the [E, O, H] stack: the largest transient is one segment's
[n_e, max(H, O)] in the compute dtype. Autograd saves x, A and B (the caller's tensors, held anyway) and the
[N, r] intermediate: N r elements, nothing that grows with E O H.
"""

from __future__ import annotations

import itertools

import torch


def _bounds(offsets_E1: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, lo, hi) of every non-empty segment. Reads offsets on the host (one sync for CUDA offsets)."""
    offs = offsets_E1.tolist()
    return [(e, lo, hi) for e, (lo, hi) in enumerate(itertools.pairwise(offs)) if hi > lo]


def check_inputs(x_N_H, A_E_R_H, B_E_O_R, offsets_E1, *, values: bool) -> None:
    """Shapes, dtypes and devices; with values=True also the offsets' values (a host read of E + 1 integers)."""
    if x_N_H.dim() != 2 or A_E_R_H.dim() != 3 or B_E_O_R.dim() != 3:
        raise ValueError(
            f"x must be [N, H], A [E, r, H], B [E, O, r]; got {tuple(x_N_H.shape)}, {tuple(A_E_R_H.shape)}, "
            f"{tuple(B_E_O_R.shape)}"
        )
    (N, H), (E, R, Ha), (Eb, _, Rb) = x_N_H.shape, A_E_R_H.shape, B_E_O_R.shape
    if Ha != H or Eb != E or Rb != R:
        raise ValueError(f"A {tuple(A_E_R_H.shape)} and B {tuple(B_E_O_R.shape)} do not match x [N={N}, H={H}]")
    if offsets_E1.dim() != 1 or offsets_E1.shape[0] != E + 1 or offsets_E1.dtype != torch.int64:
        raise ValueError(f"offsets must be int64 [E + 1] = [{E + 1}], got {offsets_E1.dtype} {tuple(offsets_E1.shape)}")
    for t in (x_N_H, A_E_R_H, B_E_O_R):
        if not t.is_floating_point():
            raise ValueError(f"x, A and B must be floating point, got {t.dtype}")
    if values:
        offs = offsets_E1.tolist()
        if offs[0] != 0 or offs[-1] != N:
            raise ValueError(f"offsets must run from 0 to N={N}, got offsets[0]={offs[0]}, offsets[E]={offs[-1]}")
        drop = next((e for e, (lo, hi) in enumerate(itertools.pairwise(offs)) if hi < lo), None)
        if drop is not None:
            raise ValueError(f"offsets must rise monotonically: offsets[{drop + 1}]={offs[drop + 1]} < {offs[drop]}")


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _forward(x_N_H, A_E_R_H, B_E_O_R, segments, scaling: float, keep_mid: bool):
    """y [N, O] in x's dtype and, with keep_mid, mid [N, r] = x A_e^T per row in the compute dtype."""
    N, R, n_out = x_N_H.shape[0], A_E_R_H.shape[1], B_E_O_R.shape[1]
    acc = _compute_dtype(x_N_H, A_E_R_H, B_E_O_R)
    # Every row lies in a segment (offsets[0] = 0, offsets[E] = N), so every row of y is written.
    y_N_O = torch.empty((N, n_out), device=x_N_H.device, dtype=x_N_H.dtype)
    mid_N_R = torch.empty((N, R), device=x_N_H.device, dtype=acc) if keep_mid else None
    for e, lo, hi in segments:
        mid = x_N_H[lo:hi].to(acc) @ A_E_R_H[e].to(acc).T
        y_N_O[lo:hi] = (scaling * (mid @ B_E_O_R[e].to(acc).T)).to(x_N_H.dtype)
        if keep_mid:
            mid_N_R[lo:hi] = mid
    return y_N_O, mid_N_R


class _ExpertLoraReference(torch.autograd.Function):
    """Per-segment backward (module docstring); only the gradients autograd asks for are computed."""

    @staticmethod
    def forward(ctx, x_N_H, A_E_R_H, B_E_O_R, offsets_E1, scaling):
        segments = _bounds(offsets_E1)
        y_N_O, mid_N_R = _forward(x_N_H, A_E_R_H, B_E_O_R, segments, scaling, keep_mid=True)
        # mid is saved rather than recomputed: N r elements (4 MiB at N = 32k, r = 32 in fp32), against a second
        # pass over X (N H, 128 MiB in bf16 at H = 2048) to rebuild it.
        ctx.save_for_backward(x_N_H, A_E_R_H, B_E_O_R, mid_N_R)
        ctx.segments, ctx.scaling = segments, scaling
        return y_N_O

    @staticmethod
    def backward(ctx, dy_N_O):
        x_N_H, A_E_R_H, B_E_O_R, mid_N_R = ctx.saved_tensors
        need_x, need_A, need_B = ctx.needs_input_grad[:3]
        s, acc = ctx.scaling, mid_N_R.dtype
        dx = torch.zeros_like(x_N_H) if need_x else None
        dA = torch.zeros_like(A_E_R_H) if need_A else None  # experts with no tokens keep a zero gradient
        dB = torch.zeros_like(B_E_O_R) if need_B else None
        for e, lo, hi in ctx.segments:
            dy = dy_N_O[lo:hi].to(acc)
            if need_B:
                dB[e] = (s * (dy.T @ mid_N_R[lo:hi])).to(dB.dtype)
            if need_x or need_A:
                g = dy @ B_E_O_R[e].to(acc)
                if need_x:
                    dx[lo:hi] = (s * (g @ A_E_R_H[e].to(acc))).to(dx.dtype)
                if need_A:
                    dA[e] = (s * (g.T @ x_N_H[lo:hi].to(acc))).to(dA.dtype)
        return dx, dA, dB, None, None


def expert_lora_reference(
    x_N_H: torch.Tensor,
    A_E_R_H: torch.Tensor,
    B_E_O_R: torch.Tensor,
    offsets_E1: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """y[n] = scaling * B_e (A_e x[n]) for the rows n in [offsets[e], offsets[e+1]): expert_lora's CPU path.

    Same shapes, semantics and gradients as `expert_lora` (see there): x [N, H] sorted by expert, A [E, r, H],
    B [E, O, r], offsets int64 [E+1]; any strides. Returns y [N, O] in x's dtype, computed in
    promote_types(dtype, fp32). Checks the offsets' values (it reads them to the host anyway).
    """
    check_inputs(x_N_H, A_E_R_H, B_E_O_R, offsets_E1, values=True)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x_N_H, A_E_R_H, B_E_O_R)):
        return _ExpertLoraReference.apply(x_N_H, A_E_R_H, B_E_O_R, offsets_E1, float(scaling))
    return _forward(x_N_H, A_E_R_H, B_E_O_R, _bounds(offsets_E1), float(scaling), keep_mid=False)[0]
