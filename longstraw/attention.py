"""Causal GQA attention of new tokens over a captured prefix K/V plus their own K/V, in plain torch.

This is the CPU path and the reference for a future Triton kernel. The prefix is never copied, concatenated or
head-repeated: queries are grouped per KV head (`q_Hkv_G_T_D`, G = query heads per KV head) so one matmul per KV
head covers all of its query heads, and prefix and the own keys are read block by block (online softmax, fp32) so the
transient score tensor is about SCORE_BLOCK_ELEMENTS, not [H, T, S + T].

What autograd saves for one call is q, the own k/v, the output and the log-sum-exp: O(T), nothing of size S. The
backward recomputes the probabilities block by block. Gradients w.r.t. the prefix K/V are not autograd outputs:
when the prefix carries a gradient sink (exact mode), the backward adds dK/dV into it in place (fp32), so G replays
and the prompt's own chunked backward accumulate into one buffer without a P-sized temporary per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# fp32 score elements per block (H * T * keys): 2^20 = 4 MiB. Keys per block = this / (H * T), at least 16, so a
# 1024-token capture chunk on 4 heads reads 256 keys at a time and a 128-token replay 2048.
SCORE_BLOCK_ELEMENTS = 1 << 20
MIN_KEY_BLOCK = 16


@dataclass
class KVPrefix:
    """The prefix one attention layer attends over: k_Hkv_S_D / v_Hkv_S_D (S may be 0).

    grad_k / grad_v, when set, are fp32 buffers of the same shape that the backward accumulates dK/dV into.
    The tensors must not be modified between a forward and its backward (nothing checks versions here).
    """

    k: torch.Tensor
    v: torch.Tensor
    grad_k: torch.Tensor | None = None
    grad_v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.k.shape[1]


def prefix_attention(
    q_Hkv_G_T_D: torch.Tensor,
    k_Hkv_T_D: torch.Tensor,
    v_Hkv_T_D: torch.Tensor,
    prefix: KVPrefix | None,
    scale: float,
) -> torch.Tensor:
    """softmax(q [K_prefix; K_own]^T * scale + causal mask) [V_prefix; V_own] per query head.

    Query row t (position S + t) sees every prefix key and own keys 0..t. Query head h = kv * G + g, which is the
    head order transformers' `repeat_kv` produces. Returns out_Hkv_G_T_D in q's dtype; softmax in fp32.
    """
    return _PrefixAttention.apply(q_Hkv_G_T_D, k_Hkv_T_D, v_Hkv_T_D, prefix, scale)


def _key_blocks(prefix: KVPrefix | None, own_k: torch.Tensor, own_v: torch.Tensor, rows: int):
    """(k_blk, v_blk, visible_T_B or None, where) over the prefix then the own keys, `rows` query rows per KV head.

    where = ("prefix", start, end) or ("own", start, end). visible_T_B is the causal mask of an own block: query t
    sees own key j iff j <= t (None for prefix blocks: every prefix key is visible).
    """
    block = max(MIN_KEY_BLOCK, SCORE_BLOCK_ELEMENTS // max(1, rows * own_k.shape[0]))
    if prefix is not None:
        for start in range(0, prefix.length, block):
            end = min(start + block, prefix.length)
            yield prefix.k[:, start:end], prefix.v[:, start:end], None, ("prefix", start, end)
    t = own_k.shape[1]
    query_t = torch.arange(t, device=own_k.device)
    for start in range(0, t, block):
        end = min(start + block, t)
        visible = torch.arange(start, end, device=own_k.device)[None, :] <= query_t[:, None]
        yield own_k[:, start:end], own_v[:, start:end], visible, ("own", start, end)


def _scores(q_M_D, k_blk, visible_T_B, scale, groups):
    s = (q_M_D @ k_blk.float().transpose(1, 2)) * scale
    if visible_T_B is None:
        return s
    hkv, m, b = s.shape
    return s.view(hkv, groups, m // groups, b).masked_fill(~visible_T_B, float("-inf")).view(hkv, m, b)


class _PrefixAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, prefix, scale):
        hkv, groups, t, d = q.shape
        q_M_D = q.reshape(hkv, groups * t, d).float()  # M = G * T query rows per KV head
        m = torch.full((hkv, groups * t, 1), float("-inf"), device=q.device)
        denom = torch.zeros_like(m)
        acc = torch.zeros(hkv, groups * t, d, device=q.device)
        for k_blk, v_blk, visible, _ in _key_blocks(prefix, k, v, groups * t):
            s = _scores(q_M_D, k_blk, visible, scale, groups)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            # A row whose keys so far are all masked has m_new = -inf; keep it at zero weight, not NaN.
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_safe)
            p = torch.exp(s - m_safe)
            denom = denom * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + p @ v_blk.float()
            m = m_new
            del s, p
        out_M_D = acc / denom  # every row sees at least its own key, so denom > 0
        lse_M = (m + torch.log(denom)).squeeze(-1)
        out = out_M_D.to(q.dtype).view(hkv, groups, t, d)
        ctx.save_for_backward(q, k, v, out, lse_M)
        ctx.prefix = prefix
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse_M = ctx.saved_tensors
        prefix, scale = ctx.prefix, ctx.scale
        ctx.prefix = None  # the graph is freed after backward; do not keep the prefix alive through ctx
        hkv, groups, t, d = q.shape
        q_M_D = q.reshape(hkv, groups * t, d).float()
        do_M_D = dout.reshape(hkv, groups * t, d).float()
        lse = lse_M.unsqueeze(-1)
        delta = (do_M_D * out.reshape(hkv, groups * t, d).float()).sum(-1, keepdim=True)
        dq_M_D = torch.zeros_like(q_M_D)
        dk_own = torch.zeros(k.shape, device=k.device)
        dv_own = torch.zeros(v.shape, device=v.device)
        for k_blk, v_blk, visible, (kind, start, end) in _key_blocks(prefix, k, v, groups * t):
            p = torch.exp(_scores(q_M_D, k_blk, visible, scale, groups) - lse)
            ds = p * ((do_M_D @ v_blk.float().transpose(1, 2)) - delta)
            dq_M_D += (ds @ k_blk.float()) * scale
            if kind == "own":
                dk_own[:, start:end] = (ds.transpose(1, 2) @ q_M_D) * scale
                dv_own[:, start:end] = p.transpose(1, 2) @ do_M_D
            elif prefix.grad_k is not None:
                prefix.grad_k[:, start:end] += (ds.transpose(1, 2) @ q_M_D) * scale
                prefix.grad_v[:, start:end] += p.transpose(1, 2) @ do_M_D
            del p, ds
        dq = dq_M_D.view(hkv, groups, t, d).to(q.dtype)
        return dq, dk_own.to(k.dtype), dv_own.to(v.dtype), None, None
