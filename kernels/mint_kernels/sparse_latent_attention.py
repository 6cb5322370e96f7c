"""Sparse latent attention: MLA in absorbed form where each query token attends only to the keys an indexer selected.

DSA models (DeepSeek-V3.2, GLM-5) run a lightning indexer that picks, per query token, at most K of its causal keys;
attention then runs over those keys only. The keys are MLA pages as in latent_prefix_attention: page j = [c_j, k_r_j]
(D_k wide), key j is the whole page, value j its first D_v = latent_dim columns, and one page head serves all H query
heads. The selected positions index the concatenation [pages; own_pages] (j < P: prefix page j; j >= P: own page
j - P); a negative entry (-1 by convention) is an empty slot.

Math (row i = one head h at one token r; S(r) = the valid slots of index[r]; s_ij = scale * q_i . page_j, j in S(r)):

    LSE_i = log sum_{j in S(r)} exp(s_ij)        O_i = sum_{j in S(r)} exp(s_ij - LSE_i) page_j[:D_v]

Backward (P_ij = exp(s_ij - LSE_i), D_i = rowsum(dO_i * O_i) - dLSE_i, dS_ij = P_ij (dO_i . page_j[:D_v] - D_i)):

    dQ_i = scale sum_j dS_ij page_j        dPage_j = scale sum_i dS_ij q_i + [sum_i P_ij dO_i, 0]

dPage_j sums over every (batch row, head, token) that selected j: the gathered keys' gradient is scatter-added
(index_add_) at the selected rows. A token whose slots are all empty gets out = 0, lse = -inf and no gradient.

This op is plain torch on every device (no Triton kernel yet). It stays memory-bounded because it is blocked over query
tokens: a block of Rb tokens gathers its keys [B, Rb, K, D_k] (never the whole key space, never [pages; own_pages]
concatenated) with Rb chosen so that B * Rb * K * max(D_k, H) <= BLOCK_ELEMENTS (at least one token), so the transients
are a few such blocks whatever P and R are. Autograd saves q, own_pages, index, out and lse, all O(R); the prefix pages
are held by reference on ctx (not version-checked: they must not change before backward), and the backward
recomputes each block's probabilities from lse. Nothing of size P is saved or allocated, except the prefix gradient
itself when the pages require grad through autograd.
"""

from __future__ import annotations

import torch

__all__ = ["sparse_latent_attention"]

# Elements per token block of the largest transient, [B, Rb, K, max(D_k, H)]: 2^20 fp32 = 4 MiB (the dense reference's
# SCORE_BLOCK_ELEMENTS). At DeepSeek-V3.2's K = 2048, D_k = 576 one token already exceeds it, so Rb = 1 there.
BLOCK_ELEMENTS = 1 << 20


def _token_blocks(B: int, R: int, K: int, Dk: int, H: int):
    """Yield (start, end) token ranges of Rb tokens, Rb = BLOCK_ELEMENTS // (B * K * max(D_k, H)), at least 1."""
    rb = max(1, BLOCK_ELEMENTS // max(1, B * K * max(Dk, H)))
    for start in range(0, R, rb):
        yield start, min(start + rb, R)


def _gather_keys(pages, own, idx, dtype):
    """Keys of one token block. pages [P, D_k], own [B, R, D_k], idx int64 [B, Rb, K] -> keys [B, Rb, K, D_k] in
    dtype (empty slots read page 0 / own page 0: the caller masks them), is_own bool [B, Rb, K], valid [B, Rb, K]."""
    P, R = pages.shape[0], own.shape[1]
    valid = idx >= 0
    is_own = idx >= P
    rows_B = torch.arange(own.shape[0], device=idx.device)[:, None, None]
    keys = own[rows_B, (idx - P).clamp(0, R - 1)].to(dtype)
    if P > 0:  # the two gathers, then one select: the key space is never concatenated
        keys = torch.where(is_own[..., None], keys, pages[idx.clamp(0, P - 1)].to(dtype))
    return keys, is_own, valid


def _probs(q_blk, keys, valid, scale, lse_blk=None):
    """q_blk [B, Rb, H, D_k], keys [B, Rb, K, D_k] -> scores [B, Rb, H, K] (empty slots -inf) and, given lse, the
    probabilities exp(s - lse); a token with no valid slot (lse = -inf) gets probabilities 0, not NaN."""
    s = (q_blk @ keys.transpose(-1, -2)) * scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    if lse_blk is None:
        return s
    return torch.exp(s - lse_blk.masked_fill(torch.isinf(lse_blk), 0.0)[..., None])


class _SparseLatentAttention(torch.autograd.Function):
    """q [B, H, R, D_k]; pages [P, D_k]; own [B, R, D_k]; index [B, R, K]; acc [P, D_k] fp32 or None."""

    @staticmethod
    def forward(ctx, q, pages, own, index, dv, scale, acc):
        B, H, R, Dk = q.shape
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        out = torch.empty(B, H, R, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, H, R, dtype=acc_dtype, device=q.device)
        for r0, r1 in _token_blocks(B, R, index.shape[-1], Dk, H):
            keys, _, valid = _gather_keys(pages, own, index[:, r0:r1].long(), acc_dtype)
            q_blk = q[:, :, r0:r1].transpose(1, 2).to(acc_dtype)  # [B, Rb, H, D_k]
            s = _probs(q_blk, keys, valid, scale)
            lse_blk = torch.logsumexp(s, dim=-1)  # [B, Rb, H]; -inf for a token with no valid slot
            p = torch.exp(s - lse_blk.masked_fill(torch.isinf(lse_blk), 0.0)[..., None])
            out[:, :, r0:r1] = (p @ keys[..., :dv]).transpose(1, 2).to(q.dtype)
            lse[:, :, r0:r1] = lse_blk.transpose(1, 2)
            del keys, s, p
        ctx.save_for_backward(q, own, index, out, lse)
        ctx.prefix = (pages, acc)
        ctx.scale, ctx.dv = scale, dv
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, own, index, out, lse = ctx.saved_tensors
        pages, acc = ctx.prefix
        need_dq, need_dpages, need_down = ctx.needs_input_grad[:3]
        prefix_grad = (acc is not None or need_dpages) and pages.shape[0] > 0
        if (dout is None and dlse is None) or not (need_dq or need_down or prefix_grad):
            return None, None, None, None, None, None, None
        B, H, R, Dk = q.shape
        P, dv, scale, acc_dtype = pages.shape[0], ctx.dv, ctx.scale, lse.dtype
        dq = torch.zeros(B, H, R, Dk, dtype=acc_dtype, device=q.device) if need_dq else None
        down_BR = torch.zeros(B * R, Dk, dtype=acc_dtype, device=q.device) if need_down else None
        dpages = None
        if prefix_grad and acc is None:  # gradient through autograd: a scratch of the prefix's size, then returned
            dpages = torch.zeros(P, Dk, dtype=acc_dtype, device=q.device)
        target = acc if acc is not None else dpages
        rows_B = torch.arange(B, device=q.device)[:, None, None]
        for r0, r1 in _token_blocks(B, R, index.shape[-1], Dk, H):
            idx = index[:, r0:r1].long()
            keys, is_own, valid = _gather_keys(pages, own, idx, acc_dtype)
            q_blk = q[:, :, r0:r1].transpose(1, 2).to(acc_dtype)  # [B, Rb, H, D_k]
            p = _probs(q_blk, keys, valid, scale, lse[:, :, r0:r1].transpose(1, 2))
            do_blk = torch.zeros(B, r1 - r0, H, dv, dtype=acc_dtype, device=q.device)
            delta = torch.zeros(B, r1 - r0, H, 1, dtype=acc_dtype, device=q.device)
            if dout is not None:  # D_i = rowsum(dO_i * O_i) - dLSE_i
                do_blk = dout[:, :, r0:r1].transpose(1, 2).to(acc_dtype)
                delta = (do_blk * out[:, :, r0:r1].transpose(1, 2).to(acc_dtype)).sum(-1, keepdim=True)
            if dlse is not None:
                delta = delta - dlse[:, :, r0:r1].transpose(1, 2).to(acc_dtype)[..., None]
            ds = p * (do_blk @ keys[..., :dv].transpose(-1, -2) - delta)  # [B, Rb, H, K]
            if need_dq:
                dq[:, :, r0:r1] = (ds @ keys).transpose(1, 2) * scale
            if not (need_down or prefix_grad):
                continue
            del keys
            dkeys = ds.transpose(-1, -2) @ q_blk * scale  # key part, [B, Rb, K, D_k]
            dkeys[..., :dv] += p.transpose(-1, -2) @ do_blk  # value part
            # Scatter without boolean indexing (no host sync): rows of the other kind or empty add zeros at row 0.
            if prefix_grad:
                mine = (valid & ~is_own)[..., None]
                rows = torch.where(mine[..., 0], idx, 0).flatten()
                target.index_add_(0, rows, torch.where(mine, dkeys, 0).reshape(-1, Dk).to(target.dtype))
            if need_down:
                rows = (rows_B * R + torch.where(is_own, idx - P, 0)).flatten()
                down_BR.index_add_(0, rows, torch.where(is_own[..., None], dkeys, 0).reshape(-1, Dk))
            del p, ds, dkeys
        dq = dq.to(q.dtype) if dq is not None else None
        down = down_BR.view(own.shape).to(own.dtype) if down_BR is not None else None
        dpages = dpages.to(pages.dtype) if dpages is not None else None
        if need_dpages and dpages is None:  # an empty prefix that requires grad
            dpages = torch.zeros_like(pages)
        return dq, dpages, down, None, None, None, None


# --------------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------------


def _check(q, pages, own, index, latent_dim, dpage_acc) -> None:
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [H, R, D_k] or [B, H, R, D_k], got {tuple(q.shape)}")
    if own.dim() != q.dim() - 1:
        raise ValueError(f"own_pages must be [B?, R, D_k] with q's batch, got {tuple(own.shape)}")
    if pages.dim() != 2:
        raise ValueError(f"pages must be [P, D_k] (shared by the batch rows), got {tuple(pages.shape)}")
    R, Dk = q.shape[-2:]
    if own.shape[-2:] != (R, Dk) or (q.dim() == 4 and own.shape[0] != q.shape[0]) or pages.shape[1] != Dk:
        raise ValueError(f"q {tuple(q.shape)}, pages {tuple(pages.shape)}, own_pages {tuple(own.shape)} disagree")
    if index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index must be int32 or int64, got {index.dtype}")
    if index.dim() != own.dim() or index.shape[:-1] != own.shape[:-1] or index.shape[-1] < 1:
        raise ValueError(
            f"index must be [B?, R, K], K >= 1, with q's B and R; got {tuple(index.shape)}, q {tuple(q.shape)}"
        )
    if not 0 < latent_dim <= Dk:
        raise ValueError(f"latent_dim must be in [1, D_k={Dk}], got {latent_dim}")
    if R < 1:
        raise ValueError("the response must have at least one token")
    if pages.dtype != q.dtype or own.dtype != q.dtype:
        raise ValueError(f"q, pages and own_pages must share a dtype, got {q.dtype}, {pages.dtype}, {own.dtype}")
    if len({t.device for t in (q, pages, own, index)}) != 1:
        raise ValueError(f"q, pages, own_pages and index must be on one device, got {q.device}, {pages.device}, ...")
    if dpage_acc is not None and (
        dpage_acc.dtype != torch.float32 or dpage_acc.shape != pages.shape or dpage_acc.device != q.device
    ):
        raise ValueError(f"dpage_acc must be fp32 with pages' shape {tuple(pages.shape)} on {q.device}")


def sparse_latent_attention(
    q: torch.Tensor,
    pages: torch.Tensor,
    own_pages: torch.Tensor,
    index: torch.Tensor,
    latent_dim: int,
    scale: float,
    *,
    dpage_acc: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """MLA in absorbed form over each query token's selected keys (DSA): softmax over the selected pages only.

    Shapes (any strides):
        q           [H, R, D_k] or [B, H, R, D_k], R >= 1; the absorbed queries (latent part, then rope part)
        pages       [P, D_k], P >= 0: the prefix, one page per token, shared by every batch row
        own_pages   [R, D_k] or [B, R, D_k] (batch present iff q has it): the response tokens' own pages
        index       int32 or int64 [R, K] or [B, R, K]: token r's selected keys as positions in [pages; own_pages]
                    (j < P: prefix page j; j >= P: own page j - P); -1 marks an empty slot; slots in any order
        latent_dim  D_v: a page's first D_v columns are its value
        returns     out [B?, H, R, D_v] in q's dtype; with return_lse=True also lse [B?, H, R] (natural log) in
                    promote_types(q.dtype, fp32)

    The caller guarantees the selection: causal (own positions <= P + r), in range, no duplicates. These values are
    not checked (a check would cost a device sync per call); out-of-range positions read clamped pages. A token with
    only empty slots gets out = 0 and lse = -inf. scale has no default: pass the module's.

    Gradients: q and own_pages get theirs through autograd. For the prefix, pass an fp32 [P, D_k] buffer dpage_acc
    (views are fine; nothing outside it is written): backward ADDS the pages' whole gradient (key part plus value
    part, summed over batch rows, heads and tokens) into it at the selected rows, and autograd sees none. Without it,
    constant pages cost nothing and pages that require grad get their gradient through autograd.

    Torch on every device, blocked over query tokens (see the module docstring for the memory bound).
    """
    _check(q, pages, own_pages, index, latent_dim, dpage_acc)
    if dpage_acc is not None:  # the buffer takes the prefix gradient, not autograd
        pages = pages.detach()
    batched = q.dim() == 4
    q4, own3, idx3 = (q, own_pages, index) if batched else (q.unsqueeze(0), own_pages.unsqueeze(0), index.unsqueeze(0))
    out, lse = _SparseLatentAttention.apply(q4, pages, own3, idx3, int(latent_dim), float(scale), dpage_acc)
    if not batched:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out
