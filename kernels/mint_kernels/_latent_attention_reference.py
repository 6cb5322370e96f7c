"""Plain-torch latent prefix attention: the CPU path of `latent_prefix_attention` and the reference its Triton kernels
are tested on.

It runs the kernel's algorithm in torch ops, with prefix_attention_reference's conventions:

- The H query heads share the one page head, so q [B, H, R, D_k] is one [B, H*R, D_k] matrix (row m is head m // R,
  token m % R) and one matmul per key block covers every head. Pages are never repeated per head, and prefix and own
  pages are never concatenated. A page serves as key (all D_k columns) and as value (its first D_v columns), read from
  the same tensor: no value copy.
- Keys are read block by block, the prefix pages first and then the own pages with the causal mask, with one online
  softmax whose statistics are kept in promote_types(dtype, fp32). A block holds about SCORE_BLOCK_ELEMENTS scores
  (the same bound as prefix_attention_reference), so the transient is ~4 MiB whatever P is.
- Autograd saves q, own_pages, out and lse: O(R), nothing of size P. The prefix pages are held by reference on ctx
  (not version-checked: they must not change before backward). The backward recomputes the probabilities block by
  block from lse.
- A page's gradient is the sum of its key part (scale dS^T q, D_k wide) and its value part (P^T dO, the first D_v
  columns), in one D_k-wide tensor. For the prefix it is added in place into the caller's fp32 buffer when given,
  returned through autograd when the pages require grad, and not computed at all otherwise.
"""

from __future__ import annotations

import torch

# Scores per key block, all heads and batch rows together: 2^20 fp32 = 4 MiB (prefix_attention_reference's bound).
# Keys per block = this / (B * H * R), at least MIN_KEY_BLOCK.
SCORE_BLOCK_ELEMENTS = 1 << 20
MIN_KEY_BLOCK = 16


def latent_prefix_attention_reference(
    q: torch.Tensor,
    pages: torch.Tensor,
    own_pages: torch.Tensor,
    latent_dim: int,
    scale: float,
    *,
    dpage_acc: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """softmax(scale * q [pages; own]^T + bottom-right causal mask) [pages; own][:, :latent_dim], blocked over keys.

    Same shapes, semantics and gradients as `latent_prefix_attention` (see there): q [B?, H, R, D_k], pages [P, D_k]
    (shared by the batch rows), own_pages [B?, R, D_k]; returns out [B?, H, R, D_v] in q's dtype and, with return_lse,
    lse [B?, H, R] in promote_types(q.dtype, fp32). dpage_acc: an fp32 [P, D_k] buffer (views are fine) that the
    backward ADDS the prefix pages' gradient into; autograd then sees no prefix gradient.
    """
    batched = q.dim() == 4
    q4, own3 = (q, own_pages) if batched else (q.unsqueeze(0), own_pages.unsqueeze(0))
    pages3 = pages.unsqueeze(0)  # a batch axis of 1 that the matmuls broadcast: nothing is copied
    acc3 = None
    if dpage_acc is not None:
        pages3 = pages3.detach()  # the buffer takes the prefix gradient, not autograd
        acc3 = dpage_acc.unsqueeze(0)
    out, lse = _BlockedLatentAttention.apply(q4, pages3, own3, int(latent_dim), float(scale), acc3)
    if not batched:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out


def _key_blocks(pages, own, rows: int, prefix: bool, own_keys: bool):
    """Yield (is_own, start, end, page_blk) over the prefix pages then the own pages; `rows` scores per key."""
    block = max(MIN_KEY_BLOCK, SCORE_BLOCK_ELEMENTS // max(1, rows))
    for is_own, k in ((False, pages), (True, own)):
        if (is_own and own_keys) or (not is_own and prefix):
            for start in range(0, k.shape[1], block):
                end = min(start + block, k.shape[1])
                yield is_own, start, end, k[:, start:end]


def _scores(q_M_D, k_blk, is_own: bool, start: int, scale: float, R: int):
    """s [B, M, n] = scale * q k^T for one key block; own key j is -inf for rows of tokens t < j (row m: token m%R)."""
    s = (q_M_D @ k_blk.to(q_M_D.dtype).transpose(-1, -2)) * scale
    if not is_own:
        return s
    M, n = s.shape[-2:]
    token_M = torch.arange(M, device=s.device) % R
    hidden_M_N = torch.arange(start, start + n, device=s.device)[None, :] > token_M[:, None]
    return s.masked_fill(hidden_M_N, float("-inf"))


class _BlockedLatentAttention(torch.autograd.Function):
    """q [B, H, R, D_k]; pages [1, P, D_k]; own [B, R, D_k]; acc [1, P, D_k] fp32 or None."""

    @staticmethod
    def forward(ctx, q, pages, own, dv, scale, acc):
        B, H, R, Dk = q.shape
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        q_M_D = q.reshape(B, H * R, Dk).to(acc_dtype)
        m = torch.full((B, H * R, 1), float("-inf"), dtype=acc_dtype, device=q.device)
        denom = torch.zeros_like(m)
        o_M_V = torch.zeros(B, H * R, dv, dtype=acc_dtype, device=q.device)
        for is_own, start, _, k_blk in _key_blocks(pages, own, B * H * R, True, True):
            s = _scores(q_M_D, k_blk, is_own, start, scale, R)
            # Finite from the first block on: every prefix key is visible, and own key 0 is visible to every row.
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            denom = denom * alpha + p.sum(-1, keepdim=True)
            o_M_V = o_M_V * alpha + p @ k_blk[..., :dv].to(acc_dtype)
            m = m_new
            del s, p
        out = (o_M_V / denom).to(q.dtype).view(B, H, R, dv)
        lse = (m + torch.log(denom)).view(B, H, R)
        ctx.save_for_backward(q, own, out, lse)
        ctx.prefix = (pages, acc)
        ctx.scale, ctx.dv = scale, dv
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, own, out, lse = ctx.saved_tensors
        pages, acc = ctx.prefix
        need_dq, need_dpages, need_down = ctx.needs_input_grad[:3]
        if dout is None and dlse is None:
            return None, None, None, None, None, None
        B, H, R, Dk = q.shape
        M, dv, scale, acc_dtype = H * R, ctx.dv, ctx.scale, lse.dtype
        prefix_grad = acc is not None or need_dpages
        q_M_D = q.reshape(B, M, Dk).to(acc_dtype)
        do_M_V = torch.zeros(B, M, dv, dtype=acc_dtype, device=q.device)
        if dout is not None:
            do_M_V = dout.reshape(B, M, dv).to(acc_dtype)
        lse_M = lse.view(B, M, 1)
        # D_i = rowsum(dO_i * O_i) - dLSE_i.
        delta_M = (do_M_V * out.reshape(B, M, dv).to(acc_dtype)).sum(-1, keepdim=True)
        if dlse is not None:
            delta_M = delta_M - dlse.reshape(B, M, 1).to(acc_dtype)
        dq_M_D = torch.zeros_like(q_M_D) if need_dq else None
        down = torch.zeros(own.shape, dtype=acc_dtype, device=q.device) if need_down else None
        dpages = None
        if prefix_grad and acc is None:  # gradient through autograd: a scratch of the prefix's size, then returned
            dpages = torch.zeros(pages.shape, dtype=acc_dtype, device=q.device)
        target = acc if acc is not None else dpages
        blocks = _key_blocks(pages, own, B * M, need_dq or prefix_grad, need_dq or need_down)
        for is_own, start, end, k_blk in blocks:
            k_blk = k_blk.to(acc_dtype)
            p = torch.exp(_scores(q_M_D, k_blk, is_own, start, scale, R) - lse_M)
            ds = p * (do_M_V @ k_blk[..., :dv].transpose(-1, -2) - delta_M)
            if need_dq:
                dq_M_D += ds @ k_blk
            if is_own and down is not None:
                down[:, start:end] = _page_grad(ds, p, q_M_D, do_M_V, scale)
            elif not is_own and prefix_grad:
                _add_prefix_grad(ds, p, q_M_D, do_M_V, scale, target, start, end)
            del p, ds
        dq = (dq_M_D * scale).view(B, H, R, Dk).to(q.dtype) if need_dq else None
        down = down.to(own.dtype) if down is not None else None
        dpages = dpages.to(pages.dtype) if dpages is not None else None
        return dq, dpages, down, None, None, None


def _page_grad(ds, p, q_M_D, do_M_V, scale):
    """[B, n, D_k] gradient of one block of pages: scale dS^T q (key part) plus P^T dO in the first D_v columns."""
    g = ds.transpose(-1, -2) @ q_M_D * scale
    g[..., : do_M_V.shape[-1]] += p.transpose(-1, -2) @ do_M_V
    return g


def _add_prefix_grad(ds, p, q_M_D, do_M_V, scale, target, start: int, end: int) -> None:
    """Add one prefix block's page gradient, summed over the batch rows (they share the prefix), into target[0]."""
    target[:, start:end] += _page_grad(ds, p, q_M_D, do_M_V, scale).sum(0, keepdim=True)
