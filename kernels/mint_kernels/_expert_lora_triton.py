"""The Triton kernels of expert LoRA; the math, the launchers and the autograd.Function are in expert_lora.py.

Two kernels cover the forward and the three gradients:

- `_expert_lora_chain_kernel`: Y[n] = scale * W2_e (W1_e X[n]) for the rows n of expert e's segment, and optionally
  the unscaled [N, r] intermediate MID[n] = W1_e X[n] in fp32. The forward runs it with (W1, W2) = (A, B); the dX pass
  runs it on dY with (W1, W2) = (B^T, A^T), which are only other strides of the same tensors, and its MID is
  g = dY B_e, which dA needs.
- `_expert_lora_wgrad_kernel`: OUT_e[m, j] = scale * sum_{n in segment e} P[n, m] Q[n, j]. It gives dB_e (P = dY,
  Q = the forward's MID) and dA_e^T (P = X, Q = g, OUT = dA with its last two strides swapped). One program owns one
  [BLOCK_M, r] tile of one expert and loops over that expert's rows, so no atomics are needed.

Every tensor is addressed through strides passed by the launcher, so PEFT's views (A = lora_A.weight.view(E, r, H),
B = lora_B.weight.view(O, r, E).permute(2, 0, 1)) and a transposed or sliced X are read in place; loads and stores are
masked to each view's extent. The rank r is padded to BLOCK_R = next_power_of_2(max(r, 16)) by masking: padded
columns load as 0 and add nothing.

Indexing is int64: program ids, tile bounds and row/column offsets are int64 before they meet a stride. N x H for
4096 tokens x top-8 x 8 responses at H = 2048 is 5.4e8 elements, and a longer batch passes int32's 2.1e9.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _expert_lora_chain_kernel(
    X, W1, W2, Y, MID, TILE_E, TILE_LO, TILE_HI,
    sx_n, sx_k,
    s1_e, s1_r, s1_k,
    s2_e, s2_m, s2_r,
    sy_n, sy_m,
    smid_n,
    K, M, R, NUM_M, scale,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    STORE_MID: tl.constexpr, COMPUTE_Y: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # grid: (NUM_M * n_row_tiles,), NUM_M = cdiv(M, BLOCK_M) output tiles (1 when only MID is wanted). The output
    # tile varies fastest, so programs launched together share one row tile and read its X rows from L2 after the
    # first; one flat axis also avoids the 65,535 limit of grid axis 1. A row tile lies inside one expert's segment:
    # rows [TILE_LO[t], TILE_HI[t]) of expert TILE_E[t]; the bound on the tile count leaves up to E tiles empty.
    pid = tl.program_id(0).to(tl.int64)
    pid_m = pid % NUM_M
    pid_t = pid // NUM_M
    lo = tl.load(TILE_LO + pid_t)
    hi = tl.load(TILE_HI + pid_t)
    if hi > lo:
        e = tl.load(TILE_E + pid_t)
        rows = lo + tl.arange(0, BLOCK_N).to(tl.int64)
        mask_n = rows < hi
        offs_r = tl.arange(0, BLOCK_R).to(tl.int64)
        mask_r = offs_r < R
        offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
        w1 = W1 + e * s1_e
        # MID = X W1_e^T, [BLOCK_N, BLOCK_R], accumulated in fp32 over K in BLOCK_K steps.
        mid = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            mask_k = k < K
            x = tl.load(X + rows[:, None] * sx_n + k[None, :] * sx_k, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            w1t = tl.load(
                w1 + offs_r[None, :] * s1_r + k[:, None] * s1_k, mask=mask_k[:, None] & mask_r[None, :], other=0.0
            )
            if FP32_DOT:
                x, w1t = x.to(tl.float32), w1t.to(tl.float32)
            mid += tl.dot(x, w1t, input_precision=PRECISION)
        if STORE_MID and pid_m == 0:  # one output tile's program writes it; the others computed the same values
            tl.store(MID + rows[:, None] * smid_n + offs_r[None, :], mid, mask=mask_n[:, None] & mask_r[None, :])
        if COMPUTE_Y:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
            mask_m = offs_m < M
            w2t = tl.load(
                W2 + e * s2_e + offs_m[None, :] * s2_m + offs_r[:, None] * s2_r,
                mask=mask_r[:, None] & mask_m[None, :],
                other=0.0,
            )
            if FP32_DOT:
                w2t = w2t.to(tl.float32)
            # MID is rounded to the operands' dtype for the second dot (bf16 tensor cores), as PEFT's bf16 LoRA
            # rounds x @ A^T; both dots accumulate in fp32.
            y = tl.dot(mid.to(w2t.dtype), w2t, input_precision=PRECISION) * scale
            tl.store(
                Y + rows[:, None] * sy_n + offs_m[None, :] * sy_m,
                y.to(Y.dtype.element_ty),
                mask=mask_n[:, None] & mask_m[None, :],
            )


@triton.jit
def _expert_lora_wgrad_kernel(
    P, Q, OUT, OFFSETS,
    sp_n, sp_m,
    sq_n,
    so_e, so_m, so_r,
    M, R, scale,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(M, BLOCK_M), E). One program = OUT[e, m-tile, :], summed over the segment's rows in BLOCK_N steps.
    # An empty segment writes zeros (its expert's gradient is 0, and the buffer comes from torch.empty).
    pid_m = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1).to(tl.int64)
    lo = tl.load(OFFSETS + e)
    hi = tl.load(OFFSETS + e + 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    mask_m = offs_m < M
    offs_r = tl.arange(0, BLOCK_R).to(tl.int64)
    mask_r = offs_r < R
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        rows = n0 + offs_n
        mask_n = rows < hi
        # P^T tile [BLOCK_M, BLOCK_N], read transposed through the strides.
        pt = tl.load(
            P + rows[None, :] * sp_n + offs_m[:, None] * sp_m, mask=mask_m[:, None] & mask_n[None, :], other=0.0
        )
        q = tl.load(Q + rows[:, None] * sq_n + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        if FP32_DOT:
            pt = pt.to(tl.float32)
        # Q (the fp32 [N, r] intermediate) is rounded to P's dtype, as in the forward's second dot.
        acc += tl.dot(pt, q.to(pt.dtype), input_precision=PRECISION)
    tl.store(
        OUT + e * so_e + offs_m[:, None] * so_m + offs_r[None, :] * so_r,
        (acc * scale).to(OUT.dtype.element_ty),
        mask=mask_m[:, None] & mask_r[None, :],
    )
