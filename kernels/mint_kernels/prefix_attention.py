"""Prefix attention: response queries over a constant prefix K/V followed by the response's own causal K/V.

LongStraw replays G short responses against one long prompt. Library kernels (flash-attn, SDPA) need the prefix and
response K/V concatenated (a copy per layer per replay) and then compute dK/dV for the whole prefix only to throw it
away. This kernel walks the prefix tiles and then the response tiles with one online softmax, never concatenating, and
computes prefix dK/dV only when the caller asks for them (LongStraw exact mode), adding them into fp32 buffers.

Math (per query row i, per head; s_ij = scale * q_i . k_j over the P prefix keys then response keys 0..i):

    m_i = max_j s_ij        l_i = sum_j exp(s_ij - m_i)        LSE_i = m_i + log l_i
    O_i = sum_j exp(s_ij - LSE_i) v_j

Backward (P_ij = exp(s_ij - LSE_i), D_i = rowsum(dO_i * O_i) - dLSE_i):

    dV_j = sum_i P_ij dO_i        dS_ij = P_ij (dO_i . v_j - D_i)
    dQ_i = scale sum_j dS_ij k_j  dK_j  = scale sum_i dS_ij q_i

GQA: query head h reads K/V head h // (H_q / H_kv) (the repeat_interleave convention of Hugging Face's repeat_kv);
repeated K/V is never materialized. dK/dV programs own one K/V tile and loop over the query heads of their group, so
no atomics are needed (the Triton interpreter has no fp16 atomics, and fp32 atomics would make results
order-dependent).

Tensors: q [B, H_q, R, D] or [H_q, R, D]; k_prefix/v_prefix [H_kv, P, D] (shared by every batch row) or
[B, H_kv, P, D], P >= 0; k_resp/v_resp [B, H_kv, R, D] or [H_kv, R, D] (batch present iff q has it). Any strides.

Files: this one holds the public API, the launchers and the autograd.Function; _prefix_attention_triton.py the
@triton.jit kernels; _prefix_attention_reference.py the blocked plain-torch version, which is also the CPU path.
"""

from __future__ import annotations

import math

import torch
import triton

from mint_kernels._dispatch import check_launchable, use_triton
from mint_kernels._prefix_attention_reference import prefix_attention_reference
from mint_kernels._prefix_attention_triton import (
    LOG2E,
    _prefix_attn_bwd_delta_kernel,
    _prefix_attn_bwd_dkdv_kernel,
    _prefix_attn_bwd_dq_kernel,
    _prefix_attn_fwd_kernel,
)

__all__ = ["prefix_attention", "prefix_attention_reference"]


# --------------------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------------------


def _blocks(d: int, device: torch.device) -> dict:
    """Tile sizes. Under the interpreter small tiles keep the numpy work per program low."""
    block_d = max(16, triton.next_power_of_2(d))
    if device.type == "cpu":
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_D=block_d, num_warps=4, num_stages=1)
    # Hopper-class defaults in the range the Triton flash-attention tutorial uses. Not tuned here: no GPU was available.
    if block_d <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=block_d, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=block_d, num_warps=8, num_stages=3)


def _bwd_blocks(d: int, device: torch.device) -> dict:
    block_d = max(16, triton.next_power_of_2(d))
    if device.type == "cpu":
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_D=block_d, num_warps=4, num_stages=1)
    # The backward keeps two [BLOCK, D] fp32 accumulators live; 64x64 tiles keep D=128 inside the register file.
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=block_d, num_warps=4 if block_d <= 64 else 8, num_stages=2)


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs would default to tf32 on the GPU (~1e-3 error); ieee keeps fp32 runs comparable to the reference.
    return "ieee" if dtype == torch.float32 else "tf32"


def _s4(t: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(t.stride())  # type: ignore[return-value]


def _forward(q_B_Hq_R_D, kp_B_Hkv_P_D, vp_B_Hkv_P_D, kr_B_Hkv_R_D, vr_B_Hkv_R_D, scale):
    """Launch the forward. Inputs are 4-D (prefix may have batch stride 0). Returns out [B,H_q,R,D], lse fp32."""
    q = q_B_Hq_R_D
    B, Hq, R, D = q.shape
    Hkv, P = kp_B_Hkv_P_D.shape[1], kp_B_Hkv_P_D.shape[2]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, Hq, R), device=q.device, dtype=torch.float32)
    kernel = _prefix_attn_fwd_kernel
    check_launchable(kernel, q.device)
    cfg = _blocks(D, q.device)
    grid = (triton.cdiv(R, cfg["BLOCK_M"]), B * Hq)
    kernel[grid](
        q, kp_B_Hkv_P_D, vp_B_Hkv_P_D, kr_B_Hkv_R_D, vr_B_Hkv_R_D, out, lse,
        *_s4(q), *_s4(kp_B_Hkv_P_D), *_s4(vp_B_Hkv_P_D), *_s4(kr_B_Hkv_R_D), *_s4(vr_B_Hkv_R_D), *_s4(out),
        Hq, P, R, D, Hq // Hkv, scale * LOG2E.value,
        MASK_P=P % cfg["BLOCK_N"] != 0, PRECISION=_precision(q.dtype), **cfg,
    )  # fmt: skip
    return out, lse


def _backward(q, kp, vp, kr, vr, out, lse, do, dlse, scale, dkp_acc, dvp_acc, prefix_shared, need_dq, need_dkv):
    """Launch the backward. Returns dq, dk_resp, dv_resp (None where not needed); adds prefix grads into
    dkp_acc/dvp_acc when given."""
    B, Hq, R, D = q.shape
    Hkv, P = kp.shape[1], kp.shape[2]
    group = Hq // Hkv
    cfg = _bwd_blocks(D, q.device)
    prec = _precision(q.dtype)
    for kernel in (_prefix_attn_bwd_delta_kernel, _prefix_attn_bwd_dq_kernel, _prefix_attn_bwd_dkdv_kernel):
        check_launchable(kernel, q.device)

    delta = torch.empty((B, Hq, R), device=q.device, dtype=torch.float32)
    grid_m = (triton.cdiv(R, cfg["BLOCK_M"]), B * Hq)
    _prefix_attn_bwd_delta_kernel[grid_m](
        out, do, dlse if dlse is not None else delta, delta,
        *_s4(out), *_s4(do), Hq, R, D,
        HAS_DLSE=dlse is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"],
    )  # fmt: skip

    dq = dkr = dvr = None
    if need_dq:
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        _prefix_attn_bwd_dq_kernel[grid_m](
            q, kp, vp, kr, vr, do, lse, delta, dq,
            *_s4(q), *_s4(kp), *_s4(vp), *_s4(kr), *_s4(vr), *_s4(do), *_s4(dq),
            Hq, P, R, D, group, scale, scale * LOG2E.value,
            MASK_P=P % cfg["BLOCK_N"] != 0, PRECISION=prec, **cfg,
        )  # fmt: skip

    if need_dkv:
        dkr = torch.empty_like(kr, memory_format=torch.contiguous_format)
        dvr = torch.empty_like(vr, memory_format=torch.contiguous_format)
        _prefix_attn_bwd_dkdv_kernel[(triton.cdiv(R, cfg["BLOCK_N"]), B * Hkv)](
            q, kr, vr, do, lse, delta, dkr, dvr,
            *_s4(q), *_s4(kr), *_s4(vr), *_s4(do), *_s4(dkr), *_s4(dvr),
            Hq, Hkv, R, R, D, group, 1, scale, scale * LOG2E.value,
            CAUSAL=True, ACCUMULATE=False, PRECISION=prec, **cfg,
        )  # fmt: skip

    if dkp_acc is not None and P > 0:
        # A shared prefix sums its gradient over the batch inside one program (BATCH_LOOP = B): no atomics.
        b_out, batch_loop = (1, B) if prefix_shared else (B, 1)
        dkp4 = dkp_acc if dkp_acc.dim() == 4 else dkp_acc.unsqueeze(0)
        dvp4 = dvp_acc if dvp_acc.dim() == 4 else dvp_acc.unsqueeze(0)
        _prefix_attn_bwd_dkdv_kernel[(triton.cdiv(P, cfg["BLOCK_N"]), b_out * Hkv)](
            q, kp, vp, do, lse, delta, dkp4, dvp4,
            *_s4(q), *_s4(kp), *_s4(vp), *_s4(do), *_s4(dkp4), *_s4(dvp4),
            Hq, Hkv, P, R, D, group, batch_loop, scale, scale * LOG2E.value,
            CAUSAL=False, ACCUMULATE=True, PRECISION=prec, **cfg,
        )  # fmt: skip
    return dq, dkr, dvr


class PrefixAttentionFunction(torch.autograd.Function):
    """autograd wrapper of the Triton kernels; q/k_resp/v_resp are 4-D here, the prefix is 3-D (shared) or 4-D.

    Saved for backward: q, k_resp, v_resp, out, lse (O(R)). The prefix and the buffers are held by reference on ctx,
    as in the reference: the prefix is the caller's live K/V state and must not change before backward.
    """

    @staticmethod
    def forward(ctx, q, k_prefix, v_prefix, k_resp, v_resp, scale, dkp_acc, dvp_acc):
        out, lse = _forward(q, *_batched_prefix(q, k_prefix, v_prefix), k_resp, v_resp, scale)
        ctx.save_for_backward(q, k_resp, v_resp, out, lse)
        ctx.prefix = (k_prefix, v_prefix, dkp_acc, dvp_acc)
        ctx.scale = scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k_resp, v_resp, out, lse = ctx.saved_tensors
        k_prefix, v_prefix, dkp_acc, dvp_acc = ctx.prefix
        if do is None:  # only the LSE was used downstream
            do = torch.zeros_like(out)
        # Prefix K/V that require grad and no caller buffers: compute into fp32 scratch and hand the result to
        # autograd. LongStraw's detached mode passes constant prefix K/V and no buffers, so it never pays for this.
        autograd_prefix = dkp_acc is None and (ctx.needs_input_grad[1] or ctx.needs_input_grad[2])
        if autograd_prefix:
            dkp_acc = torch.zeros(k_prefix.shape, device=q.device, dtype=torch.float32)
            dvp_acc = torch.zeros(v_prefix.shape, device=q.device, dtype=torch.float32)
        # Strides are passed for every [.., D] tensor; dLSE ([B, H_q, R], R floats per head, a cheap copy) is made
        # contiguous because the kernels index it like lse, as row (b * H_q + h) * R + i.
        dq, dkr, dvr = _backward(
            q, *_batched_prefix(q, k_prefix, v_prefix), k_resp, v_resp, out, lse, do,
            None if dlse is None else dlse.contiguous(), ctx.scale, dkp_acc, dvp_acc, k_prefix.dim() == 3,
            need_dq=ctx.needs_input_grad[0], need_dkv=ctx.needs_input_grad[3] or ctx.needs_input_grad[4],
        )  # fmt: skip
        dkp = dkp_acc.to(k_prefix.dtype) if autograd_prefix else None
        dvp = dvp_acc.to(v_prefix.dtype) if autograd_prefix else None
        return dq, dkp, dvp, dkr, dvr, None, None, None


def _batched_prefix(q, k_prefix, v_prefix):
    """A shared [H_kv, P, D] prefix as a batch-stride-0 [B, H_kv, P, D] view: nothing is copied."""
    if k_prefix.dim() == 4:
        return k_prefix, v_prefix
    B = q.shape[0]
    return k_prefix.unsqueeze(0).expand(B, *k_prefix.shape), v_prefix.unsqueeze(0).expand(B, *v_prefix.shape)


# --------------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------------


def _check(q, k_prefix, v_prefix, k_resp, v_resp, dk_acc, dv_acc) -> None:
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [H_q, R, D] or [B, H_q, R, D], got {tuple(q.shape)}")
    if k_resp.shape != v_resp.shape or k_resp.dim() != q.dim():
        raise ValueError(f"k_resp/v_resp must both be [B?, H_kv, R, D] like q, got {k_resp.shape}, {v_resp.shape}")
    if k_prefix.shape != v_prefix.shape or k_prefix.dim() not in (3, 4) or k_prefix.dim() > q.dim():
        raise ValueError(f"k_prefix/v_prefix must both be [H_kv, P, D] or [B, H_kv, P, D], got {k_prefix.shape}")
    Hq, R, D = q.shape[-3:]
    Hkv, Rk, Dk = k_resp.shape[-3:]
    if Rk != R or Dk != D or (q.dim() == 4 and k_resp.shape[0] != q.shape[0]):
        raise ValueError(f"k_resp {tuple(k_resp.shape)} does not match q {tuple(q.shape)}")
    if (
        k_prefix.shape[-3] != Hkv
        or k_prefix.shape[-1] != D
        or (k_prefix.dim() == 4 and k_prefix.shape[0] != q.shape[0])
    ):
        raise ValueError(f"k_prefix {tuple(k_prefix.shape)} does not match k_resp {tuple(k_resp.shape)}")
    if Hq % Hkv != 0:
        raise ValueError(f"H_q={Hq} must be a multiple of H_kv={Hkv}")
    if R < 1:
        raise ValueError("the response must have at least one token")
    if (dk_acc is None) != (dv_acc is None):
        raise ValueError("pass both dk_prefix_acc and dv_prefix_acc, or neither")
    for name, acc in (("dk_prefix_acc", dk_acc), ("dv_prefix_acc", dv_acc)):
        if acc is not None and (acc.dtype != torch.float32 or acc.shape != k_prefix.shape or acc.device != q.device):
            raise ValueError(f"{name} must be fp32 with k_prefix's shape {tuple(k_prefix.shape)} on {q.device}")


def prefix_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_resp: torch.Tensor,
    v_resp: torch.Tensor,
    scale: float | None = None,
    *,
    dk_prefix_acc: torch.Tensor | None = None,
    dv_prefix_acc: torch.Tensor | None = None,
    return_lse: bool = False,
    force: str | None = None,
):
    """Attention of response queries over prefix K/V then causal response K/V, without concatenating them.

    Shapes (any strides: transposed projections and slices of a larger K/V state are read in place):
        q             [H_q, R, D] or [B, H_q, R, D], R >= 1
        k/v_prefix    [H_kv, P, D] (shared by all batch rows) or [B, H_kv, P, D]; P >= 0 (P = 0: a first chunk)
        k/v_resp      [H_kv, R, D] or [B, H_kv, R, D] (batch present iff q has it)
        returns       out like q (contiguous); with return_lse=True also lse [B?, H_q, R] (natural log) in fp32,
                      fp64 for fp64 inputs on the reference path

    Query i sees all P prefix keys and response keys 0..i (causal, bottom-right aligned). H_q must be a multiple of
    H_kv; query head h reads K/V head h // (H_q / H_kv). scale defaults to 1/sqrt(D).

    Gradients: q, k_resp and v_resp get theirs through autograd. Prefix gradients are computed only when asked:
    pass fp32 buffers dk_prefix_acc/dv_prefix_acc (k_prefix's shape; views such as grad[layer, :, :P] are fine, and
    nothing outside them is written) and backward ADDS dK/dV of the prefix into them (LongStraw exact mode sums them
    over the G replays); autograd then sees no prefix gradient. Without buffers,
    prefix K/V that do not require grad (LongStraw detached mode) cost nothing; prefix K/V that do require grad get
    their gradient through autograd.

    Dispatch: CUDA tensors run the Triton kernels, CPU tensors prefix_attention_reference (blocked over keys, saves
    nothing of size P; see _prefix_attention_reference.py); force="triton" or
    "reference" overrides (Triton on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported).
    """
    _check(q, k_prefix, v_prefix, k_resp, v_resp, dk_prefix_acc, dv_prefix_acc)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    accs = dict(dk_prefix_acc=dk_prefix_acc, dv_prefix_acc=dv_prefix_acc)
    if not use_triton(q, force):
        return prefix_attention_reference(q, k_prefix, v_prefix, k_resp, v_resp, scale, return_lse=return_lse, **accs)
    if dk_prefix_acc is not None:  # the buffers take the prefix gradient, not autograd
        k_prefix, v_prefix = k_prefix.detach(), v_prefix.detach()
    batched = q.dim() == 4
    q4, kr4, vr4 = (q, k_resp, v_resp) if batched else (q.unsqueeze(0), k_resp.unsqueeze(0), v_resp.unsqueeze(0))
    out, lse = PrefixAttentionFunction.apply(
        q4, k_prefix, v_prefix, kr4, vr4, float(scale), dk_prefix_acc, dv_prefix_acc
    )
    if not batched:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out
