"""Fused LM-head log-prob and entropy: hidden states to (log p(target), entropy) without [T, V] logits.

Materialized logits cost T * V * 4 bytes in fp32: 19.9 GB at T=32k, V=151,936. The forward kernel computes logit
tiles z = hidden @ weight.T / temperature on chip and folds them into running statistics, chunk by chunk over V.
Per row t, with a running max m:

    s = sum_v exp(z_v - m)                  (online logsumexp: rescale by exp(m_old - m_new) when m grows)
    u = sum_v exp(z_v - m) (z_v - m)        (rescale: u <- exp(m_old - m_new) (u + s (m_old - m_new)))
    lse = m + log s      logprob = z_target - lse      entropy = -sum_v p_v log p_v = log s - u / s

u is kept relative to the running max so entropy never subtracts two large numbers (lse - E[z]).

The V range is split over a second grid axis so short sequences still fill the GPU; the per-split (m, s, u) are
merged with the same rescaling rules.

Backward, with upstream gradients a_t (logprob) and b_t (entropy), p = softmax(z), H the entropy:

    dz_v = a (1[v = target] - p_v) - b p_v (log p_v + H)
    dlogits = dz / temperature      dHidden = dlogits @ weight      dWeight = dlogits.T @ hidden

The backward walks T in chunks of C rows. A Triton kernel recomputes the logit tile, turns it into dlogits in the same
pass, and writes a [C, V] buffer (C sized so the buffer stays near 256 MB), which two cuBLAS matmuls consume. dWeight
(and its [V, H] fp32 buffer) exists only when weight.requires_grad; a frozen head gets dHidden alone.

Ignored targets (targets == ignore_index, -100 by default) have one meaning on both paths: logprob 0, entropy 0, and
no gradient into hidden or weight. Any other target outside [0, V) is a ValueError (one host sync for the check).

Files: this one holds the Triton kernels, launchers, autograd.Function and public API; _fused_logprob_reference.py
the blocked plain-torch version (the CPU path), which saves O(T) for backward and recomputes logits block by block.

Indexing is int64: program ids and row/column offsets are cast before they meet a stride. T x V at 32k x 151,936 is
5.0e9 elements, past int32's 2.1e9; no tensor here is [T, V], but the [V, H] weight is 6.2e8 at H = 4096 and a strided
view or a larger C or H would wrap int32 offsets silently.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mint_kernels._dispatch import check_launchable
from mint_kernels._fused_logprob_reference import check_targets, fused_logprob_reference

__all__ = ["fused_logprob", "fused_logprob_reference"]

# Cap on the backward's [C, V] dlogits scratch (hidden dtype). At V=151,936 in bf16 that is C = 768 rows (883 rounded
# down to the 128-row tile): enough rows for the chunk's matmuls to run at full cuBLAS efficiency, and 2.3% of the
# 9.3 GiB of bf16 logits at T=32k.
BWD_BUFFER_BYTES = 256 * 2**20


# --------------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------------


@triton.jit
def _fused_logprob_fwd_kernel(
    X, W, TGT, M_OUT, S_OUT, U_OUT, ZT_OUT,
    sx_t, sx_h, sw_v, sw_h,
    T, V, H, inv_temp, V_PER_SPLIT, IGNORE_INDEX,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(T, BLOCK_T), n_splits). One program: BLOCK_T rows over the V range [v_lo, v_lo + V_PER_SPLIT).
    # Writes partial (m, s, u, z_target) to [n_splits, T] fp32 buffers; z_target is 0 where the target is elsewhere
    # and for ignored rows (their target reads as -1, which matches no column, even when IGNORE_INDEX is in [0, V)).
    pid_t = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, BLOCK_H).to(tl.int64)
    mask_t = offs_t < T
    tgt = tl.load(TGT + offs_t, mask=mask_t, other=IGNORE_INDEX)
    tgt = tl.where(tgt == IGNORE_INDEX, -1, tgt)

    m_i = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    s_i = tl.zeros([BLOCK_T], dtype=tl.float32)
    u_i = tl.zeros([BLOCK_T], dtype=tl.float32)
    zt = tl.zeros([BLOCK_T], dtype=tl.float32)

    v_lo = pid_s * V_PER_SPLIT
    v_hi = tl.minimum(V, v_lo + V_PER_SPLIT)
    for start_v in range(v_lo, v_hi, BLOCK_V):
        offs_v = start_v + tl.arange(0, BLOCK_V)
        mask_v = offs_v < v_hi
        acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
        for start_h in range(0, H, BLOCK_H):
            h = start_h + offs_h
            x = tl.load(
                X + offs_t[:, None] * sx_t + h[None, :] * sx_h, mask=mask_t[:, None] & (h[None, :] < H), other=0.0
            )
            w = tl.load(
                W + offs_v[:, None] * sw_v + h[None, :] * sw_h, mask=mask_v[:, None] & (h[None, :] < H), other=0.0
            )
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        z = acc * inv_temp
        z = tl.where(mask_v[None, :], z, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, 1))
        alpha = tl.exp(m_i - m_new)
        e = tl.exp(z - m_new[:, None])
        z_rel = tl.where(mask_v[None, :], z - m_new[:, None], 0.0)  # avoid 0 * -inf on padded columns
        shift = tl.where(s_i > 0, m_i - m_new, 0.0)  # first tile: s = 0 and m_old = -inf; 0 * -inf would be nan
        u_i = alpha * (u_i + s_i * shift) + tl.sum(e * z_rel, 1)
        s_i = s_i * alpha + tl.sum(e, 1)
        m_i = m_new
        zt += tl.sum(tl.where(offs_v[None, :] == tgt[:, None], z, 0.0), 1)

    out = pid_s * T + offs_t
    tl.store(M_OUT + out, m_i, mask=mask_t)
    tl.store(S_OUT + out, s_i, mask=mask_t)
    tl.store(U_OUT + out, u_i, mask=mask_t)
    tl.store(ZT_OUT + out, zt, mask=mask_t)


@triton.jit
def _fused_logprob_bwd_dlogits_kernel(
    X, W, TGT, LSE, ENT, G_LP, G_ENT, DZ,
    sx_t, sx_h, sw_v, sw_h, sdz_t, sdz_v,
    T, V, H, inv_temp, IGNORE_INDEX,
    HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(T, BLOCK_T), cdiv(V, BLOCK_V)). Recomputes one logit tile and writes dlogits for it:
    # dlogits = (a (1[v = target] - p) - b p (log p + H)) / temperature; 0 on the rows of ignored targets.
    pid_t = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_h = tl.arange(0, BLOCK_H).to(tl.int64)
    mask_t = offs_t < T
    mask_v = offs_v < V
    tgt = tl.load(TGT + offs_t, mask=mask_t, other=IGNORE_INDEX)
    keep = tgt != IGNORE_INDEX

    acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
    for start_h in range(0, H, BLOCK_H):
        h = start_h + offs_h
        x = tl.load(X + offs_t[:, None] * sx_t + h[None, :] * sx_h, mask=mask_t[:, None] & (h[None, :] < H), other=0.0)
        w = tl.load(W + offs_v[:, None] * sw_v + h[None, :] * sw_h, mask=mask_v[:, None] & (h[None, :] < H), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    lse = tl.load(LSE + offs_t, mask=mask_t, other=0.0)
    logp = acc * inv_temp - lse[:, None]
    p = tl.exp(logp)
    dz = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
    if HAS_G_LP:
        a = tl.load(G_LP + offs_t, mask=mask_t, other=0.0)
        onehot = tl.where(offs_v[None, :] == tgt[:, None], 1.0, 0.0)
        dz += a[:, None] * (onehot - p)
    if HAS_G_ENT:
        b = tl.load(G_ENT + offs_t, mask=mask_t, other=0.0)
        ent = tl.load(ENT + offs_t, mask=mask_t, other=0.0)
        dz -= b[:, None] * p * (logp + ent[:, None])
    # where, not a multiply: p of an ignored row may overflow, and inf * 0 would be nan.
    dz = tl.where(keep[:, None], dz * inv_temp, 0.0)
    tl.store(
        DZ + offs_t[:, None] * sdz_t + offs_v[None, :] * sdz_v,
        dz.to(DZ.dtype.element_ty),
        mask=mask_t[:, None] & mask_v[None, :],
    )


# --------------------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs would default to tf32 on the GPU; ieee keeps fp32 runs comparable to the reference.
    return "ieee" if dtype == torch.float32 else "tf32"


def _config(device: torch.device) -> dict:
    if device.type == "cpu":  # interpreter: small tiles, several V splits so the merge is exercised
        return dict(BLOCK_T=16, BLOCK_V=64, BLOCK_H=32, num_warps=4, num_stages=1)
    # A matmul-shaped tile for Hopper (128x128 output tile, K step 64). Not tuned here: no GPU was available.
    return dict(BLOCK_T=128, BLOCK_V=128, BLOCK_H=64, num_warps=8, num_stages=3)


def _n_splits(T: int, V: int, cfg: dict, device: torch.device) -> int:
    n_v_tiles = triton.cdiv(V, cfg["BLOCK_V"])
    if device.type == "cpu":
        return min(3, n_v_tiles)
    # Aim for >= 4 programs per SM: at T=4k there are only 32 row tiles for 132 SMs.
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(4 * sms, triton.cdiv(T, cfg["BLOCK_T"]))
    return max(1, min(want, n_v_tiles, 64))


def _forward(x_T_H: torch.Tensor, w_V_H: torch.Tensor, tgt_T: torch.Tensor, temperature: float, ignore_index: int):
    """Returns logprob [T], entropy [T] (both 0 on ignored rows), lse [T], all fp32."""
    T, H = x_T_H.shape
    V = w_V_H.shape[0]
    cfg = _config(x_T_H.device)
    splits = _n_splits(T, V, cfg, x_T_H.device)
    v_per_split = triton.cdiv(triton.cdiv(V, cfg["BLOCK_V"]), splits) * cfg["BLOCK_V"]
    splits = triton.cdiv(V, v_per_split)
    m_S_T, s_S_T, u_S_T, zt_S_T = torch.empty((4, splits, T), device=x_T_H.device, dtype=torch.float32).unbind(0)
    check_launchable(_fused_logprob_fwd_kernel, x_T_H.device)
    _fused_logprob_fwd_kernel[(triton.cdiv(T, cfg["BLOCK_T"]), splits)](
        x_T_H, w_V_H, tgt_T, m_S_T, s_S_T, u_S_T, zt_S_T,
        *x_T_H.stride(), *w_V_H.stride(),
        T, V, H, 1.0 / temperature, v_per_split, ignore_index,
        PRECISION=_precision(x_T_H.dtype), **cfg,
    )  # fmt: skip
    # Merge the splits: rescale each split's (s, u) to the global max.
    m_T = m_S_T.max(0).values
    alpha_S_T = torch.exp(m_S_T - m_T)
    s_T = (s_S_T * alpha_S_T).sum(0)
    u_T = (alpha_S_T * (u_S_T + s_S_T * (m_S_T - m_T))).sum(0)
    lse_T = m_T + torch.log(s_T)
    keep_T = tgt_T != ignore_index
    logprob_T = torch.where(keep_T, zt_S_T.sum(0) - lse_T, 0.0)
    entropy_T = torch.where(keep_T, torch.log(s_T) - u_T / s_T, 0.0)
    return logprob_T, entropy_T, lse_T


def _backward(x_T_H, w_V_H, tgt_T, lse_T, ent_T, g_lp_T, g_ent_T, temperature, ignore_index, need_dx, need_dw):
    """Returns (dHidden or None, dWeight or None), walking T in chunks of C rows through a [C, V] dlogits buffer."""
    T, H = x_T_H.shape
    V = w_V_H.shape[0]
    cfg = _config(x_T_H.device)
    bt = cfg["BLOCK_T"]
    rows = max(bt, BWD_BUFFER_BYTES // (V * x_T_H.element_size()) // bt * bt)
    rows = min(rows, triton.cdiv(T, bt) * bt)
    dz_C_V = torch.empty((rows, V), device=x_T_H.device, dtype=x_T_H.dtype)
    # Contiguous whatever hidden's strides are, so each chunk's rows are a dense `out=` for torch.mm.
    dx_T_H = torch.empty(x_T_H.shape, device=x_T_H.device, dtype=x_T_H.dtype) if need_dx else None
    # fp32 accumulation across chunks; a bf16 running sum would round at every chunk.
    dw_V_H = torch.zeros(w_V_H.shape, device=w_V_H.device, dtype=torch.float32) if need_dw else None
    check_launchable(_fused_logprob_bwd_dlogits_kernel, x_T_H.device)
    dummy = lse_T
    for c0 in range(0, T, rows):
        n = min(rows, T - c0)
        x_C_H = x_T_H[c0 : c0 + n]
        dz = dz_C_V[:n]
        _fused_logprob_bwd_dlogits_kernel[(triton.cdiv(n, bt), triton.cdiv(V, cfg["BLOCK_V"]))](
            x_C_H, w_V_H, tgt_T[c0 : c0 + n], lse_T[c0 : c0 + n], ent_T[c0 : c0 + n],
            g_lp_T[c0 : c0 + n] if g_lp_T is not None else dummy,
            g_ent_T[c0 : c0 + n] if g_ent_T is not None else dummy,
            dz,
            *x_C_H.stride(), *w_V_H.stride(), *dz.stride(),
            n, V, H, 1.0 / temperature, ignore_index,
            HAS_G_LP=g_lp_T is not None, HAS_G_ENT=g_ent_T is not None,
            PRECISION=_precision(x_T_H.dtype), **cfg,
        )  # fmt: skip
        if need_dx:
            torch.mm(dz, w_V_H, out=dx_T_H[c0 : c0 + n])
        if need_dw:
            if dw_V_H.dtype == dz.dtype:
                dw_V_H.addmm_(dz.t(), x_C_H)
            else:
                dw_V_H.add_(torch.mm(dz.t(), x_C_H))
    return dx_T_H, (dw_V_H.to(w_V_H.dtype) if need_dw else None)


class FusedLogprobFunction(torch.autograd.Function):
    """autograd wrapper of the Triton kernels; see fused_logprob for the contract."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, ignore_index):
        logprob, entropy, lse = _forward(hidden, weight, targets, temperature, ignore_index)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.ignore_index = temperature, ignore_index
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    def backward(ctx, g_logprob, g_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logprob is None and g_entropy is None) or not (need_dx or need_dw):
            return None, None, None, None, None
        # [T] vectors are made contiguous (a copy of T floats at most); hidden and weight are read through strides.
        dx, dw = _backward(
            hidden, weight, targets, lse, entropy,
            None if g_logprob is None else g_logprob.float().contiguous(),
            None if g_entropy is None else g_entropy.float().contiguous(),
            ctx.temperature, ctx.ignore_index, need_dx, need_dw,
        )  # fmt: skip
        return dx, dw, None, None, None


# --------------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------------


def fused_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    ignore_index: int = -100,
    force: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of the targets and entropy of softmax(hidden @ weight.T / temperature), without [T, V] logits.

    Shapes:
        hidden   [T, H]   (the final hidden states, after the model's last norm; any strides)
        weight   [V, H]   (the LM head; any strides)
        targets  [T]      integers in [0, V), or ignore_index
        returns  logprob [T], entropy [T], both fp32 (fp64 for fp64 inputs on the reference path)

    ignore_index (default -100, as in torch's cross_entropy): rows whose target equals it give logprob 0 and entropy 0
    and send no gradient to hidden or weight, on both paths. Any other target outside [0, V) raises ValueError on both
    paths; the bounds check costs one host sync per call.

    Gradients flow from both outputs into hidden; into weight only when weight.requires_grad (a frozen head allocates
    no [V, H] buffer at all).

    Dispatch: CUDA tensors run the Triton kernels, CPU tensors fused_logprob_reference; force="triton" or "reference"
    overrides (Triton on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [T, H] and weight [V, H], got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [T]={hidden.shape[0]}, got {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if force not in (None, "triton", "reference"):
        raise ValueError(f"force must be None, 'triton' or 'reference', got {force!r}")
    use_triton = hidden.is_cuda if force is None else force == "triton"
    if not use_triton:  # the reference checks the targets itself
        return fused_logprob_reference(hidden, weight, targets, temperature, ignore_index=ignore_index)
    check_targets(targets, weight.shape[0], ignore_index)
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty.clone()
    if weight.dtype != hidden.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype on the Triton path")
    return FusedLogprobFunction.apply(
        hidden, weight, targets.long().contiguous(), float(temperature), int(ignore_index)
    )
