"""Expert LoRA: the LoRA term of a sparse-MoE expert layer, factored per routed token.

PEFT's `target_parameters` LoRA on fused [E, O, H] expert weights materializes W + s B@A for the whole expert stack on
every forward (1.21 GB per MoE layer at Qwen3-30B-A3B in bf16). The factored form needs only the routed rows:

    y[n] = s B_e (A_e x[n])        for the rows n of expert e's segment [offsets[e], offsets[e+1])

Backward, per segment (mid_e = X_e A_e^T [n_e, r], saved by the forward; g_e = dY_e B_e [n_e, r]):

    dX_e = s g_e A_e        dA_e = s g_e^T X_e        dB_e = s dY_e^T mid_e

Nothing of size [O, H] per expert, or [E, O, H], is ever formed. mid is saved rather than recomputed: N r fp32
(4 MiB at N = 32k routed rows, r = 32), while recomputing it would read X (N H, 128 MiB in bf16 at H = 2048) again.

Tensors: x [N, H] routed rows sorted by expert; A [E, r, H]; B [E, O, r]; offsets int64 [E + 1]. Any strides (PEFT's
views lora_A.weight.view(E, r, H) and lora_B.weight.view(O, r, E).permute(2, 0, 1) are read in place).

Files: this one holds the public API, the launchers and the autograd.Function; _expert_lora_triton.py the
@triton.jit kernels; _expert_lora_reference.py the per-segment plain-torch version, which is also the CPU path.
"""

from __future__ import annotations

import torch
import triton

from mint_kernels._dispatch import check_launchable, use_triton
from mint_kernels._expert_lora_reference import check_inputs, expert_lora_reference
from mint_kernels._expert_lora_triton import _expert_lora_chain_kernel, _expert_lora_wgrad_kernel

__all__ = ["expert_lora", "expert_lora_reference"]


# --------------------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------------------


def _block_r(r: int) -> int:
    return max(16, triton.next_power_of_2(r))  # tl.dot needs >= 16; padded rank columns are masked to 0


def _chain_blocks(r: int, device: torch.device) -> dict:
    """Tiles of the chain kernel (forward and dX). Under the interpreter, 16s keep the numpy work per program low."""
    if device.type == "cpu":
        return dict(BLOCK_N=16, BLOCK_K=16, BLOCK_M=16, BLOCK_R=_block_r(r), num_warps=4, num_stages=1)
    # Starting points, not tuned (no GPU was available). Two fp32 accumulators live per program: mid [64, BLOCK_R]
    # and y [64, 128]; at r = 128 that is 128 registers a thread at 4 warps, hence 8.
    warps = 4 if _block_r(r) <= 64 else 8
    return dict(BLOCK_N=64, BLOCK_K=64, BLOCK_M=128, BLOCK_R=_block_r(r), num_warps=warps, num_stages=3)


def _wgrad_blocks(r: int, device: torch.device) -> dict:
    if device.type == "cpu":
        return dict(BLOCK_N=16, BLOCK_M=16, BLOCK_R=_block_r(r), num_warps=4, num_stages=1)
    warps = 4 if _block_r(r) <= 64 else 8
    return dict(BLOCK_N=64, BLOCK_M=64, BLOCK_R=_block_r(r), num_warps=warps, num_stages=3)


def _dot_mode(*tensors: torch.Tensor) -> dict:
    """All operands of one half dtype: dots in it. Otherwise (fp32, or mixed like bf16 x with fp32 LoRA weights) the
    tiles are upcast to fp32; fp32 inputs use IEEE dots (tf32 would give ~1e-3 error), mixed ones tf32."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1 and torch.float32 not in dtypes:
        return dict(FP32_DOT=False, PRECISION="tf32")  # PRECISION only applies to fp32 operands
    return dict(FP32_DOT=True, PRECISION="ieee" if dtypes == {torch.float32} else "tf32")


def row_tiles(offsets_E1: torch.Tensor, N: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tile-to-expert map: row tiles of BLOCK_N rows that never cross a segment boundary.

    Expert e's segment gets cdiv(n_e, BLOCK_N) tiles. The map is built with torch ops on offsets' device, without a
    host sync; the tile count is bounded by T = (N + E (BLOCK_N - 1)) // BLOCK_N >= sum_e cdiv(n_e, BLOCK_N), and
    tiles past the real count get lo = hi = 0 (their programs return at once). Returns int64 [T] tile_e, lo, hi.
    """
    E = offsets_E1.shape[0] - 1
    tiles_E = (offsets_E1[1:] - offsets_E1[:-1] + block_n - 1) // block_n
    ends_E = torch.cumsum(tiles_E, 0)
    t = torch.arange((N + E * (block_n - 1)) // block_n, device=offsets_E1.device)
    tile_e = torch.searchsorted(ends_E, t, right=True)  # first expert whose tiles end after t
    valid = tile_e < E
    tile_e = tile_e.clamp(max=E - 1)
    lo = offsets_E1[tile_e] + (t - (ends_E[tile_e] - tiles_E[tile_e])) * block_n
    hi = torch.minimum(lo + block_n, offsets_E1[tile_e + 1])
    zero = torch.zeros_like(lo)
    return tile_e, torch.where(valid, lo, zero), torch.where(valid, hi, zero)


def _chain(x_N_K, w1_E_R_K, w2_E_M_R, tiles, scaling, *, y_N_M, mid_N_R):
    """y = scaling * (x W1_e^T) W2_e^T per segment into y_N_M (when given); x W1_e^T into mid_N_R (when given)."""
    K = x_N_K.shape[1]
    R, M = w1_E_R_K.shape[1], w2_E_M_R.shape[1]
    check_launchable(_expert_lora_chain_kernel, x_N_K.device)
    cfg = _chain_blocks(R, x_N_K.device)
    tile_e, lo, hi = tiles
    compute_y = y_N_M is not None
    y = y_N_M if compute_y else x_N_K  # a placeholder pointer when Y is not written (its code is compiled out)
    mid = mid_N_R if mid_N_R is not None else x_N_K
    num_m = triton.cdiv(M, cfg["BLOCK_M"]) if compute_y else 1
    _expert_lora_chain_kernel[(num_m * lo.shape[0],)](
        x_N_K, w1_E_R_K, w2_E_M_R, y, mid, tile_e, lo, hi,
        *x_N_K.stride(), *w1_E_R_K.stride(), *w2_E_M_R.stride(), *(y.stride() if compute_y else (0, 0)),
        R if mid_N_R is None else mid_N_R.stride(0),
        K, M, R, num_m, float(scaling),
        STORE_MID=mid_N_R is not None, COMPUTE_Y=compute_y, **_dot_mode(x_N_K, w1_E_R_K, w2_E_M_R), **cfg,
    )  # fmt: skip


def _wgrad(p_N_M, q_N_R, out_E_M_R, offsets_E1, scaling):
    """out[e] = scaling * P_e^T Q_e over each segment's rows (zeros for an empty segment)."""
    E, M, R = out_E_M_R.shape
    check_launchable(_expert_lora_wgrad_kernel, p_N_M.device)
    cfg = _wgrad_blocks(R, p_N_M.device)
    _expert_lora_wgrad_kernel[(triton.cdiv(M, cfg["BLOCK_M"]), E)](
        p_N_M, q_N_R, out_E_M_R, offsets_E1,
        *p_N_M.stride(), q_N_R.stride(0), *out_E_M_R.stride(), M, R, float(scaling),
        **_dot_mode(p_N_M), **cfg,
    )  # fmt: skip


def _forward(x_N_H, A_E_R_H, B_E_O_R, offsets_E1, scaling, keep_mid: bool):
    """y [N, O] in x's dtype (and the fp32 [N, r] mid, the row tiles, when keep_mid)."""
    N, R, n_out = x_N_H.shape[0], A_E_R_H.shape[1], B_E_O_R.shape[1]
    y_N_O = torch.empty((N, n_out), device=x_N_H.device, dtype=x_N_H.dtype)
    if N == 0:
        return y_N_O, None, None
    tiles = row_tiles(offsets_E1, N, _chain_blocks(R, x_N_H.device)["BLOCK_N"])
    mid_N_R = torch.empty((N, R), device=x_N_H.device, dtype=torch.float32) if keep_mid else None
    _chain(x_N_H, A_E_R_H, B_E_O_R, tiles, scaling, y_N_M=y_N_O, mid_N_R=mid_N_R)
    return y_N_O, mid_N_R, tiles


class ExpertLoraFunction(torch.autograd.Function):
    """autograd wrapper of the Triton kernels.

    Saved for backward: x, A, B (the caller's tensors), the fp32 [N, r] mid and the row-tile map (3 int64 per tile).
    The backward launches only what needs_input_grad asks for:
      dX (x needs grad): chain kernel on dY with (W1, W2) = (B_e^T, A_e^T), storing g = dY B_e when dA is needed too;
      dA (A needs grad): chain kernel storing g alone when dX is not needed, then wgrad(P = X, Q = g) into dA^T;
      dB (B needs grad): wgrad(P = dY, Q = mid).
    """

    @staticmethod
    def forward(ctx, x_N_H, A_E_R_H, B_E_O_R, offsets_E1, scaling):
        y_N_O, mid_N_R, tiles = _forward(x_N_H, A_E_R_H, B_E_O_R, offsets_E1, scaling, keep_mid=True)
        if tiles is None:  # N = 0: nothing to save
            ctx.scaling, ctx.empty = scaling, True
            return y_N_O
        ctx.save_for_backward(x_N_H, A_E_R_H, B_E_O_R, offsets_E1, mid_N_R, *tiles)
        ctx.scaling, ctx.empty = scaling, False
        return y_N_O

    @staticmethod
    def backward(ctx, dy_N_O):
        need_x, need_A, need_B = ctx.needs_input_grad[:3]
        if ctx.empty:
            return None, None, None, None, None
        x_N_H, A_E_R_H, B_E_O_R, offsets_E1, mid_N_R, *tiles = ctx.saved_tensors
        s = ctx.scaling
        dx = dA = dB = None
        if need_x or need_A:
            dx = torch.empty_like(x_N_H) if need_x else None  # keeps x's strides when x is dense
            g_N_R = torch.empty_like(mid_N_R) if need_A else None
            B_E_R_O, A_E_H_R = B_E_O_R.transpose(1, 2), A_E_R_H.transpose(1, 2)
            _chain(dy_N_O, B_E_R_O, A_E_H_R, tiles, s, y_N_M=dx, mid_N_R=g_N_R)
            if need_A:
                dA = torch.empty_like(A_E_R_H)
                _wgrad(x_N_H, g_N_R, dA.transpose(1, 2), offsets_E1, s)
        if need_B:
            dB = torch.empty_like(B_E_O_R)  # PEFT's permuted view gets a gradient with the same strides
            _wgrad(dy_N_O, mid_N_R, dB, offsets_E1, s)
        return dx, dA, dB, None, None


# --------------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------------


def expert_lora(
    x_N_H: torch.Tensor,
    A_E_R_H: torch.Tensor,
    B_E_O_R: torch.Tensor,
    offsets_E1: torch.Tensor,
    scaling: float,
    *,
    force: str | None = None,
) -> torch.Tensor:
    """The LoRA term of an MoE expert layer on routed rows: y[n] = scaling * B_e (A_e x[n]), n in segment e.

    Shapes (any strides; non-contiguous views are read in place):
        x_N_H       [N, H] routed token rows, sorted by expert; any float dtype
        A_E_R_H     [E, r, H] per-expert LoRA A (e.g. lora_A.weight.view(E, r, H)), r <= 128
        B_E_O_R     [E, O, r] per-expert LoRA B (e.g. lora_B.weight.view(O, r, E).permute(2, 0, 1))
        offsets_E1  int64 [E + 1]: expert e owns rows offsets[e]:offsets[e+1]; offsets[0] = 0, offsets[E] = N,
                    monotone; empty segments are fine
        returns     y [N, O] in x's dtype, accumulated in fp32 (fp64 for fp64 inputs on the reference)

    Gradients go to whichever of x, A and B require grad (x carries the gradient back to the attention and router
    path). B_e @ A_e is never formed; backward uses the [N, r] intermediate x A_e^T saved by the forward.

    Dispatch: CUDA tensors run the Triton kernels (fp16/bf16/fp32), CPU tensors expert_lora_reference;
    force="triton" or "reference" overrides (Triton on CPU tensors needs TRITON_INTERPRET=1 set before triton is
    imported). The offsets' values are checked wherever that costs no device sync: always on the reference path
    and for CPU offsets; CUDA offsets on the Triton path are trusted (a check would sync every layer).
    """
    if not use_triton(x_N_H, force):
        return expert_lora_reference(x_N_H, A_E_R_H, B_E_O_R, offsets_E1, scaling)  # checks everything itself
    check_inputs(x_N_H, A_E_R_H, B_E_O_R, offsets_E1, values=not offsets_E1.is_cuda)
    if torch.float64 in (x_N_H.dtype, A_E_R_H.dtype, B_E_O_R.dtype):
        raise ValueError("the Triton path takes fp16, bf16 and fp32; use force='reference' for fp64")
    if A_E_R_H.shape[1] > 128:
        raise ValueError(f"the Triton path keeps the rank in registers and takes r <= 128, got {A_E_R_H.shape[1]}")
    if len({x_N_H.device, A_E_R_H.device, B_E_O_R.device, offsets_E1.device}) != 1:
        raise ValueError("x, A, B and offsets must be on one device")
    offsets_E1 = offsets_E1.contiguous()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x_N_H, A_E_R_H, B_E_O_R)):
        return ExpertLoraFunction.apply(x_N_H, A_E_R_H, B_E_O_R, offsets_E1, float(scaling))
    return _forward(x_N_H, A_E_R_H, B_E_O_R, offsets_E1, float(scaling), keep_mid=False)[0]
