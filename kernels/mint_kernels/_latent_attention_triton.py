"""The Triton kernels of latent prefix attention; the math, the launchers and the autograd.Function are in
latent_attention.py.

Rows. The H query heads share the one page head, so a program's BLOCK_M rows are taken from the flattened
[R * H] (token-major) row index: row m is token m // H, head m % H. A tile of pages is then read once for up to
BLOCK_M query rows of every head, and a causal tile bound follows from the tile's last token. Rows are addressed
through q's own strides; lse and delta are [B, R * H] contiguous fp32.

Widths. D_k (576 at DeepSeek-V3) is not a power of two and a [BLOCK, D_k] tile would not fit the register file, so
every q . k and dO . v product is a loop over BLOCK_DK-wide column chunks (_rows_dot), and every accumulator is one
BLOCK_DO-wide column chunk of the output: programs on the grid's column axis own the other chunks and recompute the
scores. Values are the first D_v columns of the same page tensor: they are loaded from it, never copied.

Indexing is int64, as in _prefix_attention_triton.py: program ids and offsets are cast before they meet strides.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _rows_dot(
    A, a_rows, s_ad, mask_a, B, b_rows, s_bd, mask_b, D, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_DK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """[BLOCK_A, BLOCK_B] fp32 sum over d < D of A[a, d] * B[b, d]; a_rows/b_rows are the rows' element offsets."""
    offs_d = tl.arange(0, BLOCK_DK).to(tl.int64)
    acc = tl.zeros([BLOCK_A, BLOCK_B], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_DK):
        d = d0 + offs_d
        mask_d = d < D
        a = tl.load(A + a_rows[:, None] + d[None, :] * s_ad, mask=mask_a[:, None] & mask_d[None, :], other=0.0)
        b = tl.load(B + b_rows[:, None] + d[None, :] * s_bd, mask=mask_b[:, None] & mask_d[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(b), input_precision=PRECISION)
    return acc


@triton.jit
def _chunk(X, rows, s_d, mask_rows, cols, limit):
    """[len(rows), len(cols)] tile of columns `cols` (masked to < limit) of the rows at element offsets `rows`."""
    return tl.load(
        X + rows[:, None] + cols[None, :] * s_d, mask=mask_rows[:, None] & (cols < limit)[None, :], other=0.0
    )


@triton.jit
def _fwd_tiles(
    Q, q_rows, sq_d, mask_m, tok_m, m_i, l_i, acc, K, sk_n, sk_d, hi, N, DK, DV, cols, qk_scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Fold pages [0, hi) (N rows) into the online softmax; the value tile is columns `cols` of the same pages.

    CAUSAL: own pages, page n visible to row m iff n <= its token. Otherwise every page is visible (prefix).
    """
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + offs_n
        mask_n = n < N
        s = _rows_dot(Q, q_rows, sq_d, mask_m, K, n * sk_n, sk_d, mask_n, DK, BLOCK_M, BLOCK_N, BLOCK_DK, PRECISION)
        s = s * qk_scale_log2
        if CAUSAL:
            s = tl.where(mask_n[None, :] & (n[None, :] <= tok_m[:, None]), s, float("-inf"))
        else:
            s = tl.where(mask_n[None, :], s, float("-inf"))
        # m_new is finite from the first tile on: a prefix tile has a valid column, and own page 0 is visible to
        # every row (padded rows included), so exp2(m_i - m_new) never sees -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _chunk(K, n * sk_n, sk_d, mask_n, cols, DV)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _latent_fwd_kernel(
    Q, PG, OWN, OUT, LSE,
    sq_b, sq_h, sq_r, sq_d,
    sp_n, sp_d,
    sw_b, sw_n, sw_d,
    so_b, so_h, so_r, so_d,
    H, P, R, DK, DV, qk_scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DO: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(R * H, BLOCK_M), cdiv(D_v, BLOCK_DO), B). One program = BLOCK_M rows, one output column chunk.
    pid_m = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    mask_m = offs_m < R * H
    tok_m = offs_m // H
    q_rows = b * sq_b + (offs_m % H) * sq_h + tok_m * sq_r
    cols = pid_c * BLOCK_DO + tl.arange(0, BLOCK_DO).to(tl.int64)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DO], dtype=tl.float32)
    m_i, l_i, acc = _fwd_tiles(
        Q, q_rows, sq_d, mask_m, tok_m, m_i, l_i, acc, PG, sp_n, sp_d, P, P, DK, DV, cols, qk_scale_log2,
        BLOCK_M, BLOCK_N, BLOCK_DK, False, PRECISION,
    )  # fmt: skip
    # Own pages up to this tile's last token (bottom-right causal).
    hi = tl.minimum(R, ((pid_m + 1) * BLOCK_M - 1) // H + 1)
    m_i, l_i, acc = _fwd_tiles(
        Q, q_rows, sq_d, mask_m, tok_m, m_i, l_i, acc, OWN + b * sw_b, sw_n, sw_d, hi, R, DK, DV, cols,
        qk_scale_log2, BLOCK_M, BLOCK_N, BLOCK_DK, True, PRECISION,
    )  # fmt: skip
    acc = acc / l_i[:, None]
    o_rows = b * so_b + (offs_m % H) * so_h + tok_m * so_r
    o_ptrs = OUT + o_rows[:, None] + cols[None, :] * so_d
    tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=mask_m[:, None] & (cols < DV)[None, :])
    lse = (m_i + tl.log2(l_i)) / LOG2E  # natural log; every column chunk computes it, chunk 0 stores it
    if pid_c == 0:
        tl.store(LSE + b * R * H + offs_m, lse, mask=mask_m)


@triton.jit
def _latent_bwd_delta_kernel(
    OUT, DO, DLSE, DELTA,
    so_b, so_h, so_r, so_d,
    sdo_b, sdo_h, sdo_r, sdo_d,
    H, R, DV,
    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DK: tl.constexpr,
):  # fmt: skip
    # D_m = rowsum(dO_m * O_m) - dLSE_m in fp32, over D_v in BLOCK_DK chunks. grid: (cdiv(R * H, BLOCK_M), B).
    pid_m = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    mask_m = offs_m < R * H
    h, tok = offs_m % H, offs_m // H
    o_rows = b * so_b + h * so_h + tok * so_r
    do_rows = b * sdo_b + h * sdo_h + tok * sdo_r
    offs_d = tl.arange(0, BLOCK_DK).to(tl.int64)
    delta = tl.zeros([BLOCK_M], dtype=tl.float32)
    for d0 in range(0, DV, BLOCK_DK):
        o = _chunk(OUT, o_rows, so_d, mask_m, d0 + offs_d, DV)
        do = _chunk(DO, do_rows, sdo_d, mask_m, d0 + offs_d, DV)
        delta += tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + b * R * H + offs_m, mask=mask_m, other=0.0)
    tl.store(DELTA + b * R * H + offs_m, delta, mask=mask_m)


@triton.jit
def _dq_tiles(
    Q, q_rows, sq_d, DO, do_rows, sdo_d, mask_m, tok_m, lse2, delta, dq, K, sk_n, sk_d, hi, N, DK, DV, cols,
    qk_scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Add sum_n dS_mn k_n[cols] over pages [0, hi) to dq (unscaled); masks as in _fwd_tiles."""
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + offs_n
        mask_n = n < N
        s = _rows_dot(Q, q_rows, sq_d, mask_m, K, n * sk_n, sk_d, mask_n, DK, BLOCK_M, BLOCK_N, BLOCK_DK, PRECISION)
        valid = mask_m[:, None] & mask_n[None, :]
        if CAUSAL:
            valid = valid & (n[None, :] <= tok_m[:, None])
        p = tl.where(valid, tl.exp2(s * qk_scale_log2 - lse2[:, None]), 0.0)
        dp = _rows_dot(DO, do_rows, sdo_d, mask_m, K, n * sk_n, sk_d, mask_n, DV, BLOCK_M, BLOCK_N, BLOCK_DK, PRECISION)
        ds = p * (dp - delta[:, None])
        k = _chunk(K, n * sk_n, sk_d, mask_n, cols, DK)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _latent_bwd_dq_kernel(
    Q, PG, OWN, DO, LSE, DELTA, DQ,
    sq_b, sq_h, sq_r, sq_d,
    sp_n, sp_d,
    sw_b, sw_n, sw_d,
    sdo_b, sdo_h, sdo_r, sdo_d,
    sdq_b, sdq_h, sdq_r, sdq_d,
    H, P, R, DK, DV, scale, qk_scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DO: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # dQ_m = scale sum_n P_mn (dO_m . v_n - D_m) k_n, one D_k column chunk. grid: (cdiv(R*H, BLOCK_M), cdiv(D_k,
    # BLOCK_DO), B).
    pid_m = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    mask_m = offs_m < R * H
    h, tok_m = offs_m % H, offs_m // H
    q_rows = b * sq_b + h * sq_h + tok_m * sq_r
    do_rows = b * sdo_b + h * sdo_h + tok_m * sdo_r
    cols = pid_c * BLOCK_DO + tl.arange(0, BLOCK_DO).to(tl.int64)
    lse2 = tl.load(LSE + b * R * H + offs_m, mask=mask_m, other=0.0) * LOG2E
    delta = tl.load(DELTA + b * R * H + offs_m, mask=mask_m, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_DO], dtype=tl.float32)
    dq = _dq_tiles(
        Q, q_rows, sq_d, DO, do_rows, sdo_d, mask_m, tok_m, lse2, delta, dq, PG, sp_n, sp_d, P, P, DK, DV, cols,
        qk_scale_log2, BLOCK_M, BLOCK_N, BLOCK_DK, False, PRECISION,
    )  # fmt: skip
    hi = tl.minimum(R, ((pid_m + 1) * BLOCK_M - 1) // H + 1)
    dq = _dq_tiles(
        Q, q_rows, sq_d, DO, do_rows, sdo_d, mask_m, tok_m, lse2, delta, dq, OWN + b * sw_b, sw_n, sw_d, hi, R, DK,
        DV, cols, qk_scale_log2, BLOCK_M, BLOCK_N, BLOCK_DK, True, PRECISION,
    )  # fmt: skip
    dq_ptrs = DQ + (b * sdq_b + h * sdq_h + tok_m * sdq_r)[:, None] + cols[None, :] * sdq_d
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=mask_m[:, None] & (cols < DK)[None, :])


@triton.jit
def _latent_bwd_dpage_kernel(
    Q, K, DO, LSE, DELTA, DK_OUT,
    sq_b, sq_h, sq_r, sq_d,
    sk_b, sk_n, sk_d,
    sdo_b, sdo_h, sdo_r, sdo_d,
    sdk_b, sdk_n, sdk_d,
    H, N, R, DK, DV, BATCH_LOOP, scale, qk_scale_log2,
    CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DO: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # dPage_n[cols] = scale sum_m dS_mn q_m[cols] + (cols < D_v) sum_m P_mn dO_m[cols]: the key part and the value part
    # in one accumulator, over all R * H rows (every head) and BATCH_LOOP batch rows (a shared prefix sums the batch).
    # grid: (cdiv(N, BLOCK_N), cdiv(D_k, BLOCK_DO), B_out). One program owns one page tile's column chunk: no atomics.
    # CAUSAL: own pages (page n visible to rows of token >= n); else prefix pages. ACCUMULATE: add into DK_OUT.
    pid_n = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1).to(tl.int64)
    b_out = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_n = offs_n < N
    k_rows = b_out * sk_b + offs_n * sk_n
    cols = pid_c * BLOCK_DO + tl.arange(0, BLOCK_DO).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)
    M = R * H
    acc = tl.zeros([BLOCK_N, BLOCK_DO], dtype=tl.float32)
    # Causal: rows of tokens before this tile's first page see none of it.
    if CAUSAL:
        lo = (pid_n * BLOCK_N * H // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    for bi in range(0, BATCH_LOOP):
        b = b_out * BATCH_LOOP + bi
        for start_m in range(lo, M, BLOCK_M):
            m = start_m + offs_m
            mask_m = m < M
            h, tok = m % H, m // H
            q_rows = b * sq_b + h * sq_h + tok * sq_r
            do_rows = b * sdo_b + h * sdo_h + tok * sdo_r
            lse2 = tl.load(LSE + b * M + m, mask=mask_m, other=0.0) * LOG2E
            delta = tl.load(DELTA + b * M + m, mask=mask_m, other=0.0)
            s = _rows_dot(Q, q_rows, sq_d, mask_m, K, k_rows, sk_d, mask_n, DK, BLOCK_M, BLOCK_N, BLOCK_DK, PRECISION)
            valid = mask_m[:, None] & mask_n[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= tok[:, None])
            p = tl.where(valid, tl.exp2(s * qk_scale_log2 - lse2[:, None]), 0.0)
            dp = _rows_dot(
                DO, do_rows, sdo_d, mask_m, K, k_rows, sk_d, mask_n, DV, BLOCK_M, BLOCK_N, BLOCK_DK, PRECISION
            )
            ds = p * (dp - delta[:, None]) * scale
            q = _chunk(Q, q_rows, sq_d, mask_m, cols, DK)
            acc += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
            if pid_c * BLOCK_DO < DV:  # the value part: only chunks that reach into the latent columns
                do = _chunk(DO, do_rows, sdo_d, mask_m, cols, DV)
                acc += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
    ptrs = DK_OUT + (b_out * sdk_b + offs_n * sdk_n)[:, None] + cols[None, :] * sdk_d
    mask = mask_n[:, None] & (cols < DK)[None, :]
    if ACCUMULATE:
        acc += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, acc.to(DK_OUT.dtype.element_ty), mask=mask)
