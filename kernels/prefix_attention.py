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
[B, H_kv, P, D]; k_resp/v_resp [B, H_kv, R, D] or [H_kv, R, D] (batch present iff q has it).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

LOG2E = 1.4426950408889634  # the kernels use exp2/log2: s * log2(e) turns exp(s) into exp2(s * log2(e))


# --------------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------------


@triton.jit
def _prefix_attn_fwd_kernel(
    Q, KP, VP, KR, VR, OUT, LSE,
    sq_b, sq_h, sq_n, sq_d,
    skp_b, skp_h, skp_n, skp_d,
    svp_b, svp_h, svp_n, svp_d,
    skr_b, skr_h, skr_n, skr_d,
    svr_b, svr_h, svr_n, svr_d,
    so_b, so_h, so_n, so_d,
    H_Q, P, R, D, GROUP, qk_scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_P: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(R, BLOCK_M), B * H_q). One program = BLOCK_M query rows of one (batch, query head).
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    hk = h // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mask_m = offs_m < R

    q_ptrs = Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_n + offs_d[None, :] * sq_d
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Phase 1: every prefix key is visible to every response query.
    kp_base = KP + b * skp_b + hk * skp_h
    vp_base = VP + b * svp_b + hk * svp_h
    for start_n in range(0, P, BLOCK_N):
        n = start_n + offs_n
        kv_mask = (n[:, None] < P) & mask_d[None, :]
        k = tl.load(kp_base + n[:, None] * skp_n + offs_d[None, :] * skp_d, mask=kv_mask, other=0.0)
        v = tl.load(vp_base + n[:, None] * svp_n + offs_d[None, :] * svp_d, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2
        if not EVEN_P:
            s = tl.where(n[None, :] < P, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # Phase 2: response keys 0..i for query i (bottom-right causal); tiles past this block's last row are skipped.
    kr_base = KR + b * skr_b + hk * skr_h
    vr_base = VR + b * svr_b + hk * svr_h
    hi = tl.minimum(R, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + offs_n
        kv_mask = (n[:, None] < R) & mask_d[None, :]
        k = tl.load(kr_base + n[:, None] * skr_n + offs_d[None, :] * skr_d, mask=kv_mask, other=0.0)
        v = tl.load(vr_base + n[:, None] * svr_n + offs_d[None, :] * svr_d, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2
        s = tl.where((n[None, :] <= offs_m[:, None]) & (n[None, :] < R), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # Every valid row saw at least response key 0, so l_i > 0 and m_i is finite.
    acc = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) / 1.4426950408889634  # stored in natural log
    o_ptrs = OUT + b * so_b + h * so_h + offs_m[:, None] * so_n + offs_d[None, :] * so_d
    tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    tl.store(LSE + pid_bh * R + offs_m, lse, mask=mask_m)


@triton.jit
def _prefix_attn_bwd_delta_kernel(
    OUT, DO, DLSE, DELTA,
    so_b, so_h, so_n, so_d,
    sdo_b, sdo_h, sdo_n, sdo_d,
    H_Q, R, D,
    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # D_i = rowsum(dO_i * O_i) - dLSE_i, fp32. grid: (cdiv(R, BLOCK_M), B * H_q).
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < R) & (offs_d[None, :] < D)
    o = tl.load(OUT + b * so_b + h * so_h + offs_m[:, None] * so_n + offs_d[None, :] * so_d, mask=mask, other=0.0)
    do = tl.load(DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_n + offs_d[None, :] * sdo_d, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + pid_bh * R + offs_m, mask=offs_m < R, other=0.0)
    tl.store(DELTA + pid_bh * R + offs_m, delta, mask=offs_m < R)


@triton.jit
def _prefix_attn_bwd_dq_kernel(
    Q, KP, VP, KR, VR, DO, LSE, DELTA, DQ,
    sq_b, sq_h, sq_n, sq_d,
    skp_b, skp_h, skp_n, skp_d,
    svp_b, svp_h, svp_n, svp_d,
    skr_b, skr_h, skr_n, skr_d,
    svr_b, svr_h, svr_n, svr_d,
    sdo_b, sdo_h, sdo_n, sdo_d,
    sdq_b, sdq_h, sdq_n, sdq_d,
    H_Q, P, R, D, GROUP, scale, qk_scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_P: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # dQ_i = scale * sum_j P_ij (dO_i . v_j - D_i) k_j. grid: (cdiv(R, BLOCK_M), B * H_q).
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    hk = h // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mask_m = offs_m < R
    row_mask = mask_m[:, None] & mask_d[None, :]

    q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_n + offs_d[None, :] * sq_d, mask=row_mask, other=0.0)
    do = tl.load(
        DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_n + offs_d[None, :] * sdo_d, mask=row_mask, other=0.0
    )
    lse2 = tl.load(LSE + pid_bh * R + offs_m, mask=mask_m, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + pid_bh * R + offs_m, mask=mask_m, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    kp_base = KP + b * skp_b + hk * skp_h
    vp_base = VP + b * svp_b + hk * svp_h
    for start_n in range(0, P, BLOCK_N):
        n = start_n + offs_n
        kv_mask = (n[:, None] < P) & mask_d[None, :]
        k = tl.load(kp_base + n[:, None] * skp_n + offs_d[None, :] * skp_d, mask=kv_mask, other=0.0)
        v = tl.load(vp_base + n[:, None] * svp_n + offs_d[None, :] * svp_d, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2
        p = tl.exp2(s - lse2[:, None])
        if EVEN_P:
            p = tl.where(mask_m[:, None], p, 0.0)
        else:
            p = tl.where(mask_m[:, None] & (n[None, :] < P), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)

    kr_base = KR + b * skr_b + hk * skr_h
    vr_base = VR + b * svr_b + hk * svr_h
    hi = tl.minimum(R, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + offs_n
        kv_mask = (n[:, None] < R) & mask_d[None, :]
        k = tl.load(kr_base + n[:, None] * skr_n + offs_d[None, :] * skr_d, mask=kv_mask, other=0.0)
        v = tl.load(vr_base + n[:, None] * svr_n + offs_d[None, :] * svr_d, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2
        p = tl.exp2(s - lse2[:, None])
        p = tl.where(mask_m[:, None] & (n[None, :] <= offs_m[:, None]) & (n[None, :] < R), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)

    dq = dq * scale
    tl.store(
        DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_n + offs_d[None, :] * sdq_d,
        dq.to(DQ.dtype.element_ty),
        mask=row_mask,
    )


@triton.jit
def _prefix_attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    sq_b, sq_h, sq_n, sq_d,
    sk_b, sk_h, sk_n, sk_d,
    sv_b, sv_h, sv_n, sv_d,
    sdo_b, sdo_h, sdo_n, sdo_d,
    sdk_b, sdk_h, sdk_n, sdk_d,
    sdv_b, sdv_h, sdv_n, sdv_d,
    H_Q, H_KV, N, R, D, GROUP, BATCH_LOOP, scale, qk_scale_log2,
    CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # dV_j = sum_i P_ij dO_i ; dK_j = scale * sum_i P_ij (dO_i . v_j - D_i) q_i over the GROUP query heads of this K/V
    # head (and over BATCH_LOOP batch rows when a shared prefix is differentiated).
    # grid: (cdiv(N, BLOCK_N), B_out * H_kv). One program owns one K/V tile: no atomics.
    # CAUSAL: the keys are the response's (key j visible to query i iff j <= i); else prefix keys (all visible).
    # ACCUMULATE: DK/DV are the caller's fp32 buffers; add into them.
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b_out = pid_bh // H_KV
    hk = pid_bh % H_KV

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mask_n = offs_n < N
    kv_mask = mask_n[:, None] & mask_d[None, :]

    k = tl.load(K + b_out * sk_b + hk * sk_h + offs_n[:, None] * sk_n + offs_d[None, :] * sk_d, mask=kv_mask, other=0.0)
    v = tl.load(V + b_out * sv_b + hk * sv_h + offs_n[:, None] * sv_n + offs_d[None, :] * sv_d, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Causal: queries before this tile's first key see none of it.
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    for bi in range(0, BATCH_LOOP):
        b = b_out * BATCH_LOOP + bi
        for g in range(0, GROUP):
            h = hk * GROUP + g
            q_base = Q + b * sq_b + h * sq_h
            do_base = DO + b * sdo_b + h * sdo_h
            row_base = (b * H_Q + h) * R
            for start_m in range(lo, R, BLOCK_M):
                m = start_m + offs_m
                mask_m = m < R
                row_mask = mask_m[:, None] & mask_d[None, :]
                q = tl.load(q_base + m[:, None] * sq_n + offs_d[None, :] * sq_d, mask=row_mask, other=0.0)
                do = tl.load(do_base + m[:, None] * sdo_n + offs_d[None, :] * sdo_d, mask=row_mask, other=0.0)
                lse2 = tl.load(LSE + row_base + m, mask=mask_m, other=0.0) * 1.4426950408889634
                delta = tl.load(DELTA + row_base + m, mask=mask_m, other=0.0)
                s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale_log2  # [BLOCK_N, BLOCK_M]
                p_t = tl.exp2(s_t - lse2[None, :])
                valid = mask_n[:, None] & mask_m[None, :]
                if CAUSAL:
                    valid = valid & (offs_n[:, None] <= m[None, :])
                p_t = tl.where(valid, p_t, 0.0)
                dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
                dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
                ds_t = p_t * (dp_t - delta[None, :])
                dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)

    dk = dk * scale
    dk_ptrs = DK + b_out * sdk_b + hk * sdk_h + offs_n[:, None] * sdk_n + offs_d[None, :] * sdk_d
    dv_ptrs = DV + b_out * sdv_b + hk * sdv_h + offs_n[:, None] * sdv_n + offs_d[None, :] * sdv_d
    if ACCUMULATE:
        dk += tl.load(dk_ptrs, mask=kv_mask, other=0.0)
        dv += tl.load(dv_ptrs, mask=kv_mask, other=0.0)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)


# --------------------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------------------


def _check_launchable(kernel, device: torch.device) -> None:
    if device.type == "cpu" and isinstance(kernel, JITFunction):
        raise RuntimeError(
            "the Triton path on CPU tensors runs only under the Triton interpreter: set TRITON_INTERPRET=1 before "
            "triton is first imported, or use force='reference'"
        )


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
    _check_launchable(kernel, q.device)
    cfg = _blocks(D, q.device)
    grid = (triton.cdiv(R, cfg["BLOCK_M"]), B * Hq)
    kernel[grid](
        q, kp_B_Hkv_P_D, vp_B_Hkv_P_D, kr_B_Hkv_R_D, vr_B_Hkv_R_D, out, lse,
        *_s4(q), *_s4(kp_B_Hkv_P_D), *_s4(vp_B_Hkv_P_D), *_s4(kr_B_Hkv_R_D), *_s4(vr_B_Hkv_R_D), *_s4(out),
        Hq, P, R, D, Hq // Hkv, scale * LOG2E,
        EVEN_P=P % cfg["BLOCK_N"] == 0, PRECISION=_precision(q.dtype), **cfg,
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
        _check_launchable(kernel, q.device)

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
            Hq, P, R, D, group, scale, scale * LOG2E,
            EVEN_P=P % cfg["BLOCK_N"] == 0, PRECISION=prec, **cfg,
        )  # fmt: skip

    if need_dkv:
        dkr = torch.empty_like(kr, memory_format=torch.contiguous_format)
        dvr = torch.empty_like(vr, memory_format=torch.contiguous_format)
        _prefix_attn_bwd_dkdv_kernel[(triton.cdiv(R, cfg["BLOCK_N"]), B * Hkv)](
            q, kr, vr, do, lse, delta, dkr, dvr,
            *_s4(q), *_s4(kr), *_s4(vr), *_s4(do), *_s4(dkr), *_s4(dvr),
            Hq, Hkv, R, R, D, group, 1, scale, scale * LOG2E,
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
            Hq, Hkv, P, R, D, group, batch_loop, scale, scale * LOG2E,
            CAUSAL=False, ACCUMULATE=True, PRECISION=prec, **cfg,
        )  # fmt: skip
    return dq, dkr, dvr


class PrefixAttentionFunction(torch.autograd.Function):
    """autograd wrapper of the Triton kernels; q/k_resp/v_resp are 4-D here, the prefix is 3-D (shared) or 4-D."""

    @staticmethod
    def forward(ctx, q, k_prefix, v_prefix, k_resp, v_resp, scale, dkp_acc, dvp_acc):
        B = q.shape[0]
        shared = k_prefix.dim() == 3
        # A shared prefix becomes a batch-stride-0 view: nothing is copied.
        kp = k_prefix.unsqueeze(0).expand(B, *k_prefix.shape) if shared else k_prefix
        vp = v_prefix.unsqueeze(0).expand(B, *v_prefix.shape) if shared else v_prefix
        out, lse = _forward(q, kp, vp, k_resp, v_resp, scale)
        ctx.save_for_backward(q, k_prefix, v_prefix, k_resp, v_resp, out, lse)
        ctx.scale = scale
        ctx.accs = (dkp_acc, dvp_acc)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k_prefix, v_prefix, k_resp, v_resp, out, lse = ctx.saved_tensors
        B = q.shape[0]
        shared = k_prefix.dim() == 3
        kp = k_prefix.unsqueeze(0).expand(B, *k_prefix.shape) if shared else k_prefix
        vp = v_prefix.unsqueeze(0).expand(B, *v_prefix.shape) if shared else v_prefix
        if do is None:  # only the LSE was used downstream
            do = torch.zeros_like(out)
        dkp_acc, dvp_acc = ctx.accs
        # Prefix K/V that require grad and no caller buffers: compute into fp32 scratch and hand the result to
        # autograd. LongStraw's detached mode passes constant prefix K/V and no buffers, so it never pays for this.
        autograd_prefix = dkp_acc is None and (ctx.needs_input_grad[1] or ctx.needs_input_grad[2])
        if autograd_prefix:
            dkp_acc = torch.zeros(k_prefix.shape, device=q.device, dtype=torch.float32)
            dvp_acc = torch.zeros(v_prefix.shape, device=q.device, dtype=torch.float32)
        dq, dkr, dvr = _backward(
            q, kp, vp, k_resp, v_resp, out, lse, do, None if dlse is None else dlse.contiguous(),
            ctx.scale, dkp_acc, dvp_acc, shared,
            need_dq=ctx.needs_input_grad[0], need_dkv=ctx.needs_input_grad[3] or ctx.needs_input_grad[4],
        )  # fmt: skip
        dkp = dkp_acc.to(k_prefix.dtype) if autograd_prefix else None
        dvp = dvp_acc.to(v_prefix.dtype) if autograd_prefix else None
        return dq, dkp, dvp, dkr, dvr, None, None, None


# --------------------------------------------------------------------------------------------------------------------
# Reference (also the CPU path)
# --------------------------------------------------------------------------------------------------------------------


def prefix_attention_reference(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_resp: torch.Tensor,
    v_resp: torch.Tensor,
    scale: float,
    *,
    return_lse: bool = False,
):
    """Plain-torch prefix attention with autograd: concatenate K/V, mask bottom-right causal, softmax.

    Same shapes and result as prefix_attention. Scores and softmax are computed in fp32 (fp64 for fp64 inputs); the
    two matmuls run in the input dtype, as a bf16 model's own attention would. Gradients flow to every input that
    requires grad, prefix K/V included.
    """
    batched = q.dim() == 4
    q_B_Hq_R_D = q if batched else q.unsqueeze(0)
    kr_B_Hkv_R_D = k_resp if batched else k_resp.unsqueeze(0)
    vr_B_Hkv_R_D = v_resp if batched else v_resp.unsqueeze(0)
    B, Hq, R, D = q_B_Hq_R_D.shape
    Hkv = kr_B_Hkv_R_D.shape[1]
    kp_B_Hkv_P_D = k_prefix if k_prefix.dim() == 4 else k_prefix.unsqueeze(0).expand(B, *k_prefix.shape)
    vp_B_Hkv_P_D = v_prefix if v_prefix.dim() == 4 else v_prefix.unsqueeze(0).expand(B, *v_prefix.shape)
    P = kp_B_Hkv_P_D.shape[2]

    k_B_Hkv_N_D = torch.cat([kp_B_Hkv_P_D, kr_B_Hkv_R_D], dim=2)  # the reference may concatenate; the kernel never does
    v_B_Hkv_N_D = torch.cat([vp_B_Hkv_P_D, vr_B_Hkv_R_D], dim=2)
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    # GQA by broadcasting: query head h reads K/V head h // G.
    q_B_Hkv_G_R_D = q_B_Hq_R_D.reshape(B, Hkv, Hq // Hkv, R, D)
    s = torch.matmul(q_B_Hkv_G_R_D, k_B_Hkv_N_D.unsqueeze(2).transpose(-1, -2)).to(acc_dtype) * scale
    visible_R_N = torch.ones(R, P + R, dtype=torch.bool, device=q.device).tril(diagonal=P)
    s = s.masked_fill(~visible_R_N, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p.to(v_B_Hkv_N_D.dtype), v_B_Hkv_N_D.unsqueeze(2)).reshape(B, Hq, R, D).to(q.dtype)
    lse = lse.reshape(B, Hq, R)
    if not batched:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out


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


def _use_triton(t: torch.Tensor, force: str | None) -> bool:
    if force is None:
        return t.is_cuda
    if force not in ("triton", "reference"):
        raise ValueError(f"force must be None, 'triton' or 'reference', got {force!r}")
    return force == "triton"


def _into_buffer(leaf: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """A grad-requiring copy-free alias of `leaf` whose gradient is added into `acc` and then dropped."""
    alias = leaf.detach().requires_grad_(True)

    def add_and_drop(t: torch.Tensor) -> None:
        acc.add_(t.grad.to(acc.dtype))
        t.grad = None

    alias.register_post_accumulate_grad_hook(add_and_drop)
    return alias


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

    Shapes:
        q             [H_q, R, D] or [B, H_q, R, D]
        k/v_prefix    [H_kv, P, D] (shared by all batch rows) or [B, H_kv, P, D]
        k/v_resp      [H_kv, R, D] or [B, H_kv, R, D] (batch present iff q has it)
        returns       out like q; with return_lse=True also lse [B?, H_q, R] fp32 (natural log)

    Query i sees all P prefix keys and response keys 0..i (causal, bottom-right aligned). H_q must be a multiple of
    H_kv; query head h reads K/V head h // (H_q / H_kv). scale defaults to 1/sqrt(D).

    Gradients: q, k_resp and v_resp get theirs through autograd. Prefix gradients are computed only when asked:
    pass fp32 buffers dk_prefix_acc/dv_prefix_acc (k_prefix's shape) and backward ADDS dK/dV of the prefix into them
    (LongStraw exact mode sums them over the G replays); autograd then sees no prefix gradient. Without buffers,
    prefix K/V that do not require grad (LongStraw detached mode) cost nothing; prefix K/V that do require grad get
    their gradient through autograd.

    Dispatch: CUDA tensors run the Triton kernels, CPU tensors prefix_attention_reference; force="triton" or
    "reference" overrides (Triton on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported).
    """
    _check(q, k_prefix, v_prefix, k_resp, v_resp, dk_prefix_acc, dv_prefix_acc)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if dk_prefix_acc is not None:
        k_prefix = _into_buffer(k_prefix, dk_prefix_acc) if not _use_triton(q, force) else k_prefix.detach()
        v_prefix = _into_buffer(v_prefix, dv_prefix_acc) if not _use_triton(q, force) else v_prefix.detach()

    if not _use_triton(q, force):
        return prefix_attention_reference(q, k_prefix, v_prefix, k_resp, v_resp, scale, return_lse=return_lse)

    batched = q.dim() == 4
    q4, kr4, vr4 = (q, k_resp, v_resp) if batched else (q.unsqueeze(0), k_resp.unsqueeze(0), v_resp.unsqueeze(0))
    out, lse = PrefixAttentionFunction.apply(
        q4, k_prefix, v_prefix, kr4, vr4, float(scale), dk_prefix_acc, dv_prefix_acc
    )
    if not batched:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out
