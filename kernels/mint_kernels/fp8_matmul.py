"""FP8 block-scaled matmul: x times a frozen FP8 weight, dequantized tile by tile inside the GEMM.

A quantized frozen linear holds W [O, K] as float8 e4m3 bytes q and fp32 scales s [ceil(O/bo), ceil(K/bk)], one per
(bo x bk) block: W[o, k] = q[o, k] * s[o // bo, k // bk]. The forward needs x W^T and the backward's dX needs dY W;
neither should form W in memory (a [O, K] copy per call is what this kernel exists to avoid on a GPU):

    fp8_block_matmul(x, q, s, block)                  -> x [.., K] @ W^T  [.., O]   (the forward)
    fp8_block_matmul(dy, q, s, block, transpose=False) -> dy [.., O] @ W  [.., K]   (dX)

The Triton kernel loads a [BLOCK_K, BLOCK_N] tile of q as bytes, decodes e4m3 with integer ops (sign, 4-bit exponent
with bias 7, 3-bit mantissa, subnormals at exponent 0: exact in fp32, so the tile equals torch's own float8 -> fp32
conversion and the interpreter needs no float8 support), multiplies by the tile's block scales, rounds to the
activation's dtype (as the reference rounds W before its matmul) and accumulates the dot in fp32. The reference, which
is also the CPU path, dequantizes W whole in the activation's dtype and calls the matmul.

Tensors: x [..., K] (any leading dims; the last must be the reduction), q [O, K] float8_e4m3fn (or its uint8 view),
s [ceil(O/bo), ceil(K/bk)] fp32. Dispatch as every kernel here: CUDA tensors run Triton, CPU the reference,
force="triton" | "reference" overrides.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mint_kernels._dispatch import check_launchable, use_triton

__all__ = ["fp8_block_matmul", "fp8_block_matmul_reference"]


def _scale_grid(s: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    bo, bk = block
    return s.float().repeat_interleave(bo, 0).repeat_interleave(bk, 1)[:rows, :cols]


def fp8_block_matmul_reference(x, q, s, block, transpose: bool = True) -> torch.Tensor:
    """The matmul with W = q * s dequantized whole in x's dtype (the product formed in fp32)."""
    q = q.view(torch.float8_e4m3fn) if q.dtype == torch.uint8 else q
    w = (q.float() * _scale_grid(s, *q.shape, block)).to(x.dtype)
    return torch.nn.functional.linear(x, w) if transpose else x @ w


@triton.jit
def _fp8_block_matmul_kernel(
    X, Q, S, Y,
    M, N, K,
    sx_m, sx_k, sq_r, sq_c, ss_r, ss_c, sy_m, sy_n,
    BO: tl.constexpr, BK: tl.constexpr, TRANSPOSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # Y [M, N] = X [M, K] @ B [K, N] with B[k, n] = W[n, k] (TRANSPOSE, the forward) or W[k, n] (dX). W's element at
    # q row r, column c is decode(q[r, c]) * s[r // BO, c // BK].
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        x = tl.load(X + rm[:, None] * sx_m + rk[None, :] * sx_k, mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        if TRANSPOSE:
            row, col = rn[None, :], rk[:, None]
        else:
            row, col = rk[:, None], rn[None, :]
        inside = (rk[:, None] < K) & (rn[None, :] < N)
        bits = tl.load(Q + row * sq_r + col * sq_c, mask=inside, other=0).to(tl.int32)
        exponent = (bits >> 3) & 15
        mantissa = bits & 7
        normal = exponent > 0
        # normal: (8 + m) / 8 * 2^(e - 7); subnormal: m / 8 * 2^-6; both as (integer) * 2^(power - 3)
        significand = tl.where(normal, mantissa + 8, mantissa).to(tl.float32)
        power = tl.where(normal, exponent - 7, -6) - 3
        w = significand * tl.exp2(power.to(tl.float32))
        w = tl.where((bits & 128) != 0, -w, w)
        w = w * tl.load(S + (row // BO) * ss_r + (col // BK) * ss_c, mask=inside, other=0.0)
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), w, input_precision=PRECISION)
        else:
            acc += tl.dot(x, w.to(x.dtype))
    tl.store(Y + rm[:, None] * sy_m + rn[None, :] * sy_n, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def _blocks(device: torch.device) -> dict:
    if device.type == "cpu":  # the interpreter: small tiles keep the numpy work per program low
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)
    # Starting points, not tuned (no GPU was available).
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)


def _launch(x2, q_bytes, s, block, transpose: bool) -> torch.Tensor:
    M, K = x2.shape
    N = q_bytes.shape[0] if transpose else q_bytes.shape[1]
    y = torch.empty((M, N), device=x2.device, dtype=torch.float32)
    if M == 0 or N == 0:
        return y.to(x2.dtype)
    check_launchable(_fp8_block_matmul_kernel, x2.device)
    cfg = _blocks(x2.device)
    fp32 = x2.dtype == torch.float32
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
    _fp8_block_matmul_kernel[grid](
        x2, q_bytes, s, y, M, N, K, *x2.stride(), *q_bytes.stride(), *s.stride(), *y.stride(),
        BO=block[0], BK=block[1], TRANSPOSE=transpose, FP32_DOT=fp32, PRECISION="ieee", **cfg,
    )  # fmt: skip
    return y.to(x2.dtype)


def fp8_block_matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    s: torch.Tensor,
    block: tuple[int, int],
    *,
    transpose: bool = True,
    force: str | None = None,
) -> torch.Tensor:
    """x @ W^T (transpose, the forward: x [..., K], W = q * s [O, K] -> [..., O]) or x @ W (x [..., O] -> [..., K]),
    W never formed on the Triton path. No autograd: the caller's Function runs this for the forward and, with
    transpose=False, for dX (the base is frozen: there is no weight gradient)."""
    rows, cols = q.shape
    want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(s.shape) != want:
        raise ValueError(f"a {rows}x{cols} weight in {block} blocks needs a {want} scale grid, got {tuple(s.shape)}")
    if x.shape[-1] != (cols if transpose else rows):
        raise ValueError(f"x's last dim {x.shape[-1]} does not meet the weight {rows}x{cols} (transpose={transpose})")
    if not use_triton(x, force):
        return fp8_block_matmul_reference(x, q, s, block, transpose)
    x2 = x.reshape(-1, x.shape[-1])
    q_bytes = q.view(torch.uint8) if q.dtype != torch.uint8 else q
    y = _launch(x2, q_bytes, s.float(), tuple(block), transpose)
    return y.reshape(*x.shape[:-1], y.shape[-1])
