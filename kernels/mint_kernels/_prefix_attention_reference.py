"""Plain-torch prefix attention: the CPU path of `prefix_attention` and the reference its Triton kernels are tested on.

It runs the kernel's algorithm in torch ops, sized for long prefixes on a CPU:

- Queries are grouped per K/V head, q [B, H_q, R, D] -> [B, H_kv, G*R, D] (G = H_q / H_kv), so one matmul per key
  block covers a K/V head's G query heads; K/V are never repeated, and prefix and response K/V are never concatenated.
- Keys are read block by block, the prefix first and then the response's own keys, with one online softmax whose
  statistics (running max, sum, accumulator) are kept in promote_types(dtype, fp32). A block holds about
  SCORE_BLOCK_ELEMENTS scores, so the transient is ~4 MiB whatever P is, not [B, H_q, R, P + R].
- Autograd saves q, k_resp, v_resp, out and lse: O(R), nothing of size P. The prefix is held by reference on ctx (it
  is the caller's K/V state, live anyway; not version-checked, so it must not change before backward). The backward
  recomputes the probabilities block by block from lse.
- Prefix dK/dV: added in place into caller buffers when given (any strides), returned through autograd when the prefix
  requires grad, and not computed at all otherwise.
"""

from __future__ import annotations

import torch

# Scores per key block, all heads and batch rows together: 2^20 fp32 = 4 MiB. Keys per block = this / (B * H_q * R),
# at least MIN_KEY_BLOCK: a 1024-token capture chunk on 4 query heads reads 256 keys at a time, a 128-token replay
# on 32 heads 256 too, and an 8-token replay on 32 heads 4096.
SCORE_BLOCK_ELEMENTS = 1 << 20
MIN_KEY_BLOCK = 16


def prefix_attention_reference(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_resp: torch.Tensor,
    v_resp: torch.Tensor,
    scale: float,
    *,
    return_lse: bool = False,
    dk_prefix_acc: torch.Tensor | None = None,
    dv_prefix_acc: torch.Tensor | None = None,
):
    """softmax(scale * q [K_prefix; K_resp]^T + bottom-right causal mask) [V_prefix; V_resp], blocked over keys.

    Same shapes, semantics and gradients as `prefix_attention` (see there); q [B?, H_q, R, D], prefix K/V
    [H_kv, P, D] (shared) or [B, H_kv, P, D], response K/V [B?, H_kv, R, D], P >= 0. Returns out (q's dtype) and, with
    return_lse, lse [B?, H_q, R] in promote_types(q.dtype, fp32).

    dk_prefix_acc / dv_prefix_acc: fp32 buffers shaped like k_prefix (views of a larger buffer are fine); the backward
    ADDS the prefix dK/dV into them and autograd sees no prefix gradient. Without them, a prefix that requires grad gets
    its gradient through autograd, and a constant prefix costs no gradient work at all.
    """
    if (dk_prefix_acc is None) != (dv_prefix_acc is None):
        raise ValueError("pass both dk_prefix_acc and dv_prefix_acc, or neither")
    batched = q.dim() == 4
    q4, kr4, vr4 = (q, k_resp, v_resp) if batched else (q.unsqueeze(0), k_resp.unsqueeze(0), v_resp.unsqueeze(0))
    # A shared prefix gets a batch axis of 1 that the matmuls broadcast: nothing is copied.
    kp4 = k_prefix if k_prefix.dim() == 4 else k_prefix.unsqueeze(0)
    vp4 = v_prefix if v_prefix.dim() == 4 else v_prefix.unsqueeze(0)
    dk4 = dv4 = None
    if dk_prefix_acc is not None:
        kp4, vp4 = kp4.detach(), vp4.detach()  # the buffers take the prefix gradient, not autograd
        dk4 = dk_prefix_acc if dk_prefix_acc.dim() == 4 else dk_prefix_acc.unsqueeze(0)
        dv4 = dv_prefix_acc if dv_prefix_acc.dim() == 4 else dv_prefix_acc.unsqueeze(0)
    out, lse = _BlockedPrefixAttention.apply(q4, kp4, vp4, kr4, vr4, float(scale), dk4, dv4)
    if not batched:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out


def _key_blocks(k_prefix, v_prefix, k_resp, v_resp, rows: int, prefix: bool, own: bool):
    """Yield (own, start, end, k_blk, v_blk) over the prefix keys then the response keys; `rows` scores per key."""
    block = max(MIN_KEY_BLOCK, SCORE_BLOCK_ELEMENTS // max(1, rows))
    for is_own, k, v in ((False, k_prefix, v_prefix), (True, k_resp, v_resp)):
        if (is_own and own) or (not is_own and prefix):
            for start in range(0, k.shape[2], block):
                end = min(start + block, k.shape[2])
                yield is_own, start, end, k[:, :, start:end], v[:, :, start:end]


def _scores(q_M_D, k_blk, own: bool, start: int, scale: float, groups: int):
    """s [B, H_kv, M, n] = scale * q k^T for one key block; response keys j > t are -inf for query row t."""
    s = (q_M_D @ k_blk.to(q_M_D.dtype).transpose(-1, -2)) * scale
    if not own:
        return s
    b, hkv, m, n = s.shape
    r = m // groups
    hidden_R_N = torch.arange(start, start + n, device=s.device)[None, :] > torch.arange(r, device=s.device)[:, None]
    return s.view(b, hkv, groups, r, n).masked_fill(hidden_R_N, float("-inf")).view(b, hkv, m, n)


class _BlockedPrefixAttention(torch.autograd.Function):
    """q, k_resp, v_resp [B, H, R, D]; k/v_prefix [B or 1, H_kv, P, D]; dk/dv_acc like the prefix or None."""

    @staticmethod
    def forward(ctx, q, k_prefix, v_prefix, k_resp, v_resp, scale, dk_acc, dv_acc):
        B, Hq, R, D = q.shape
        Hkv = k_resp.shape[1]
        groups = Hq // Hkv
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        # Row (g, t) of a K/V head's block is query head kv * G + g, token t: HF repeat_kv's head order.
        q_M_D = q.reshape(B, Hkv, groups * R, D).to(acc_dtype)
        m = torch.full((B, Hkv, groups * R, 1), float("-inf"), dtype=acc_dtype, device=q.device)
        denom = torch.zeros_like(m)
        acc = torch.zeros(B, Hkv, groups * R, D, dtype=acc_dtype, device=q.device)
        for own, start, _, k_blk, v_blk in _key_blocks(k_prefix, v_prefix, k_resp, v_resp, B * Hq * R, True, True):
            s = _scores(q_M_D, k_blk, own, start, scale, groups)
            # Finite from the first block on: every prefix key is visible, and response key 0 is visible to every
            # query, so exp(m - m_new) never sees -inf - -inf.
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            denom = denom * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + p @ v_blk.to(acc_dtype)
            m = m_new
            del s, p
        out = (acc / denom).to(q.dtype).view(B, Hq, R, D)
        lse = (m + torch.log(denom)).view(B, Hq, R)
        ctx.save_for_backward(q, k_resp, v_resp, out, lse)
        ctx.prefix = (k_prefix, v_prefix, dk_acc, dv_acc)
        ctx.scale = scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k_resp, v_resp, out, lse = ctx.saved_tensors
        k_prefix, v_prefix, dk_acc, dv_acc = ctx.prefix
        need_dq, need_dkp, need_dvp, need_dkr, need_dvr = ctx.needs_input_grad[:5]
        prefix_grad = dk_acc is not None or need_dkp or need_dvp
        B, Hq, R, D = q.shape
        Hkv = k_resp.shape[1]
        groups, M = Hq // Hkv, Hq // Hkv * R
        scale = ctx.scale
        acc_dtype = lse.dtype
        dq = dkp = dvp = dkr = dvr = None
        if dout is None and dlse is None:
            return dq, dkp, dvp, dkr, dvr, None, None, None

        q_M_D = q.reshape(B, Hkv, M, D).to(acc_dtype)
        do_M_D = torch.zeros_like(q_M_D) if dout is None else dout.reshape(B, Hkv, M, D).to(acc_dtype)
        lse_M = lse.view(B, Hkv, M, 1)
        # D_i = rowsum(dO_i * O_i) - dLSE_i (the softmax Jacobian, plus lse's own gradient dLSE_i / ds_ij = P_ij).
        delta_M = (do_M_D * out.reshape(B, Hkv, M, D).to(acc_dtype)).sum(-1, keepdim=True)
        if dlse is not None:
            delta_M = delta_M - dlse.reshape(B, Hkv, M, 1).to(acc_dtype)
        dq_M_D = torch.zeros_like(q_M_D) if need_dq else None
        if need_dkr or need_dvr:
            dkr = torch.zeros(k_resp.shape, dtype=acc_dtype, device=q.device)
            dvr = torch.zeros(v_resp.shape, dtype=acc_dtype, device=q.device)
        if prefix_grad and dk_acc is None:  # gradient through autograd: a scratch of the prefix's size, then returned
            dkp = torch.zeros(k_prefix.shape, dtype=acc_dtype, device=q.device)
            dvp = torch.zeros(v_prefix.shape, dtype=acc_dtype, device=q.device)
        # The prefix blocks are read only when dQ or a prefix gradient needs them, the own ones for dQ or dK/dV.
        read_own = need_dq or dkr is not None
        blocks = _key_blocks(k_prefix, v_prefix, k_resp, v_resp, B * Hq * R, need_dq or prefix_grad, read_own)
        for own, start, end, k_blk, v_blk in blocks:
            k_blk, v_blk = k_blk.to(acc_dtype), v_blk.to(acc_dtype)
            p = torch.exp(_scores(q_M_D, k_blk, own, start, scale, groups) - lse_M)
            ds = p * (do_M_D @ v_blk.transpose(-1, -2) - delta_M)
            if need_dq:
                dq_M_D += ds @ k_blk
            if own and dkr is not None:
                dkr[:, :, start:end] = ds.transpose(-1, -2) @ q_M_D * scale
                dvr[:, :, start:end] = p.transpose(-1, -2) @ do_M_D
            elif not own and prefix_grad:
                _add_prefix_grads(
                    ds, p, q_M_D, do_M_D, scale, (dk_acc, dv_acc) if dk_acc is not None else (dkp, dvp), start, end
                )
            del p, ds
        if need_dq:
            dq = (dq_M_D * scale).view(B, Hq, R, D).to(q.dtype)
        if dkr is not None:
            dkr, dvr = dkr.to(k_resp.dtype), dvr.to(v_resp.dtype)
        if dkp is not None:
            dkp, dvp = dkp.to(k_prefix.dtype), dvp.to(v_prefix.dtype)
        return dq, dkp, dvp, dkr, dvr, None, None, None


def _add_prefix_grads(ds, p, q_M_D, do_M_D, scale, targets, start: int, end: int) -> None:
    """Add one prefix block's dK = scale dS^T q and dV = P^T dO into targets[:, :, start:end], in place.

    The sums run over the G query heads of each K/V head (the M rows) and, for a shared prefix (a batch axis of 1),
    over the batch rows too.
    """
    dk_blk = ds.transpose(-1, -2) @ q_M_D * scale
    dv_blk = p.transpose(-1, -2) @ do_M_D
    dk_buf, dv_buf = targets
    if dk_buf.shape[0] == 1 and dk_blk.shape[0] > 1:
        dk_blk, dv_blk = dk_blk.sum(0, keepdim=True), dv_blk.sum(0, keepdim=True)
    dk_buf[:, :, start:end] += dk_blk
    dv_buf[:, :, start:end] += dv_blk
