"""The Triton kernels of prefix attention; the math, the launchers and the autograd.Function are in prefix_attention.py.

Every tensor is addressed through its strides, so non-contiguous views (q transposed out of a [T, H, D] projection,
prefix K/V sliced out of a [L, H_kv, S, D] state buffer, dK/dV accumulators sliced the same way) are read and written
in place, and every load and store is masked to the view's own [rows, D] extent.

Indexing is int64: program ids and row/column offsets are cast before they are multiplied by strides. An offset is
b * stride_b + h * stride_h + n * stride_n within one tensor, and a per-row prefix [B, H_kv, P, D] at B = 8, H_kv = 8,
P = 512k, D = 128 spans 4.3e9 elements, past int32's 2.1e9, where int32 offsets would silently wrap.
"""

from __future__ import annotations

import triton
import triton.language as tl

# exp(s) = exp2(s * log2(e)): the kernels work in base 2. A tl.constexpr object, the only kind of global a
# jitted function may read; the launchers use LOG2E.value.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _load_rows(base, rows, s_row, offs_d, s_d, mask_rows, mask_d):
    """[len(rows), BLOCK_D] tile of a [N, D] matrix with row stride s_row; masked entries read 0."""
    return tl.load(
        base + rows[:, None] * s_row + offs_d[None, :] * s_d, mask=mask_rows[:, None] & mask_d[None, :], other=0.0
    )


@triton.jit
def _fwd_tiles(
    q, m_i, l_i, acc, K, V, sk_n, sk_d, sv_n, sv_d, hi, N, offs_m, offs_d, mask_d, qk_scale_log2,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Fold keys [0, hi) of one K/V head (N rows) into the running (max, sum, acc) of the online softmax.

    CAUSAL: these are response keys, key n visible to query m iff n <= m. Otherwise every key is visible (prefix) and
    MASK_N masks the columns of a partial last tile.
    """
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + offs_n
        k = _load_rows(K, n, sk_n, offs_d, sk_d, n < N, mask_d)
        v = _load_rows(V, n, sv_n, offs_d, sv_d, n < N, mask_d)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2
        if CAUSAL:
            s = tl.where((n[None, :] <= offs_m[:, None]) & (n[None, :] < N), s, float("-inf"))
        elif MASK_N:
            s = tl.where(n[None, :] < N, s, float("-inf"))
        # m_new is finite from the first tile on: a prefix tile has a valid column, and response key 0 is visible
        # to every row (padded rows included), so exp2(m_i - m_new) never sees -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta, K, V, sk_n, sk_d, sv_n, sv_d, hi, N, offs_m, mask_m, offs_d, mask_d, qk_scale_log2,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Add sum_j dS_ij k_j over keys [0, hi) of one K/V head to dq (unscaled); masks as in _fwd_tiles."""
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + offs_n
        k = _load_rows(K, n, sk_n, offs_d, sk_d, n < N, mask_d)
        v = _load_rows(V, n, sv_n, offs_d, sv_d, n < N, mask_d)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2
        p = tl.exp2(s - lse2[:, None])
        if CAUSAL:
            p = tl.where(mask_m[:, None] & (n[None, :] <= offs_m[:, None]) & (n[None, :] < N), p, 0.0)
        elif MASK_N:
            p = tl.where(mask_m[:, None] & (n[None, :] < N), p, 0.0)
        else:
            p = tl.where(mask_m[:, None], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


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
    MASK_P: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(R, BLOCK_M), B * H_q). One program = BLOCK_M query rows of one (batch, query head).
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    mask_d = offs_d < D
    mask_m = offs_m < R
    q = _load_rows(Q + b * sq_b + h * sq_h, offs_m, sq_n, offs_d, sq_d, mask_m, mask_d)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Phase 1: every prefix key is visible to every response query.
    m_i, l_i, acc = _fwd_tiles(
        q, m_i, l_i, acc, KP + b * skp_b + hk * skp_h, VP + b * svp_b + hk * svp_h, skp_n, skp_d, svp_n, svp_d,
        P, P, offs_m, offs_d, mask_d, qk_scale_log2, BLOCK_N, False, MASK_P, PRECISION,
    )  # fmt: skip
    # Phase 2: response keys 0..i for query i (bottom-right causal); tiles past this block's last row are skipped.
    m_i, l_i, acc = _fwd_tiles(
        q, m_i, l_i, acc, KR + b * skr_b + hk * skr_h, VR + b * svr_b + hk * svr_h, skr_n, skr_d, svr_n, svr_d,
        tl.minimum(R, (pid_m + 1) * BLOCK_M), R, offs_m, offs_d, mask_d, qk_scale_log2, BLOCK_N, True, True, PRECISION,
    )  # fmt: skip

    # Every valid row saw at least response key 0, so l_i > 0 and m_i is finite.
    acc = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) / LOG2E  # stored in natural log
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
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    mask_m = offs_m < R
    mask_d = offs_d < D
    o = _load_rows(OUT + b * so_b + h * so_h, offs_m, so_n, offs_d, so_d, mask_m, mask_d)
    do = _load_rows(DO + b * sdo_b + h * sdo_h, offs_m, sdo_n, offs_d, sdo_d, mask_m, mask_d)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + pid_bh * R + offs_m, mask=mask_m, other=0.0)
    tl.store(DELTA + pid_bh * R + offs_m, delta, mask=mask_m)


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
    MASK_P: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # dQ_i = scale * sum_j P_ij (dO_i . v_j - D_i) k_j. grid: (cdiv(R, BLOCK_M), B * H_q).
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    mask_d = offs_d < D
    mask_m = offs_m < R
    q = _load_rows(Q + b * sq_b + h * sq_h, offs_m, sq_n, offs_d, sq_d, mask_m, mask_d)
    do = _load_rows(DO + b * sdo_b + h * sdo_h, offs_m, sdo_n, offs_d, sdo_d, mask_m, mask_d)
    lse2 = tl.load(LSE + pid_bh * R + offs_m, mask=mask_m, other=0.0) * LOG2E
    delta = tl.load(DELTA + pid_bh * R + offs_m, mask=mask_m, other=0.0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_tiles(
        dq, q, do, lse2, delta, KP + b * skp_b + hk * skp_h, VP + b * svp_b + hk * svp_h, skp_n, skp_d, svp_n, svp_d,
        P, P, offs_m, mask_m, offs_d, mask_d, qk_scale_log2, BLOCK_N, False, MASK_P, PRECISION,
    )  # fmt: skip
    dq = _dq_tiles(
        dq, q, do, lse2, delta, KR + b * skr_b + hk * skr_h, VR + b * svr_b + hk * svr_h, skr_n, skr_d, svr_n, svr_d,
        tl.minimum(R, (pid_m + 1) * BLOCK_M), R, offs_m, mask_m, offs_d, mask_d, qk_scale_log2,
        BLOCK_N, True, True, PRECISION,
    )  # fmt: skip
    dq_ptrs = DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_n + offs_d[None, :] * sdq_d
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


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
    # ACCUMULATE: DK/DV are the caller's fp32 buffers (possibly strided slices); add into them.
    pid_n = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b_out = pid_bh // H_KV
    hk = pid_bh % H_KV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    mask_d = offs_d < D
    mask_n = offs_n < N
    k = _load_rows(K + b_out * sk_b + hk * sk_h, offs_n, sk_n, offs_d, sk_d, mask_n, mask_d)
    v = _load_rows(V + b_out * sv_b + hk * sv_h, offs_n, sv_n, offs_d, sv_d, mask_n, mask_d)
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
                q = _load_rows(q_base, m, sq_n, offs_d, sq_d, mask_m, mask_d)
                do = _load_rows(do_base, m, sdo_n, offs_d, sdo_d, mask_m, mask_d)
                lse2 = tl.load(LSE + row_base + m, mask=mask_m, other=0.0) * LOG2E
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
    kv_mask = mask_n[:, None] & mask_d[None, :]
    if ACCUMULATE:
        dk += tl.load(dk_ptrs, mask=kv_mask, other=0.0)
        dv += tl.load(dv_ptrs, mask=kv_mask, other=0.0)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)
