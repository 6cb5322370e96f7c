"""Context parallel prefix: the captured prompt's K/V pages split over the C ranks of a group (docs/sharding.md).

Layout: of the S = P-1 captured positions, rank r holds [b_r, b_{r+1}) with b_r = r * S // C (contiguous pages), so
prefix memory (and exact mode's dK/dV buffer) per rank is ~1/C. Every rank runs the same tokens with the same
weights: the decoder is replicated, only the attention over the prefix is split.

Attention of queries q over all pages plus their own causal keys is merged from per-rank partials. Rank r computes
(o_r, lse_r) over its pages with `prefix_attention(..., return_lse=True)`; one rank also counts the own keys. Then

    m = max_r lse_r;   w_r = exp(lse_r - m);   o = sum_r w_r o_r / sum_r w_r;   lse = m + log sum_r w_r

with one all-reduce MAX (m) and one all-reduce SUM of [w_r o_r, w_r] packed. m is a constant for autograd (o and
lse do not depend on it). Gradient rules (longstraw._cp_collectives): the SUM's backward is local, and the queries
and the own K/V enter through an operator whose backward all-reduces their gradients. So every rank ends with the
full gradient of the one loss for every replicated tensor, and each local page's dK/dV is complete on its owner:
LoRA gradients are identical on all ranks, and a mean over the CP group is a no-op (a SUM would count them C times).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch

import mint_kernels as kernels
from longstraw._cp_collectives import (
    all_reduce_,
    collective_log,
    rank,
    replicated_to_partial,
    sum_to_replicated,
    world_size,
)
from longstraw.adapters import KINDS, Adapter, KVState, adapter_for
from longstraw.adapters.base import IntoBuffer
from longstraw.adapters.hybrid import HybridQwenAdapter
from longstraw.adapters.mla import SplitGradLatentState
from longstraw.adapters.qwen import _FORCE, surrogate_backward
from longstraw.errors import LongStrawError

__all__ = [
    "CPKVState",
    "ContextParallel",
    "HybridPages",
    "LatentPages",
    "as_context_parallel",
    "capture_cp",
    "collective_log",
    "cp_adapter_for",
    "cp_class",
    "cp_prefix_attention",
    "merge_partials",
    "own_rank",
    "page_bounds",
]


# -- layout ------------------------------------------------------------------------------------------------------


def page_bounds(length: int, ranks: int) -> list[int]:
    """[b_0 .. b_C]: rank r holds positions b_r .. b_{r+1}-1 of `length`, b_r = r * length // C."""
    return [r * length // ranks for r in range(ranks + 1)]


def own_rank(start: int, length: int, ranks: int) -> int:
    """The rank that counts the own (causal) keys of queries starting at position `start` over pages of `length`:
    the owner of position start-1 (its pages then end right where the own keys begin, the single-rank key order),
    or the last rank when no page precedes `start`."""
    bounds = page_bounds(length, ranks)
    if start == 0:
        return ranks - 1
    p = min(start, length) - 1
    return next(r for r in range(ranks) if bounds[r] <= p < bounds[r + 1])


# -- attention ---------------------------------------------------------------------------------------------------


def merge_partials(out_r: torch.Tensor, lse_r: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge this rank's partial attention with the other ranks' (exact, differentiable); see the module doc.

    out_r [..., R, D] and lse_r [..., R] (natural log; -inf for a rank with no keys; some rank must have one, as the
    rank counting the own keys does) -> (out like out_r, lse fp32 or fp64), identical on every rank. Gradients flow
    into out_r and lse_r; the backward issues no collective.
    """
    acc = torch.promote_types(lse_r.dtype, torch.float32)
    m = all_reduce_(lse_r.detach().to(acc).clone(memory_format=torch.contiguous_format), "max", group)
    w = torch.exp(lse_r.to(acc) - m).unsqueeze(-1)
    total = sum_to_replicated(torch.cat([w * out_r.to(acc), w], dim=-1), group)
    den = total[..., -1:]
    return (total[..., :-1] / den).to(out_r.dtype), m + torch.log(den.squeeze(-1))


def cp_prefix_attention(
    q: torch.Tensor,
    k_local: torch.Tensor,
    v_local: torch.Tensor,
    k_resp: torch.Tensor,
    v_resp: torch.Tensor,
    scale: float,
    *,
    include_own: bool,
    dk_acc: torch.Tensor | None = None,
    dv_acc: torch.Tensor | None = None,
    group=None,
    force: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`prefix_attention` over the pages of every rank of `group` plus the own causal keys; returns (out, lse).

    q [H_q, R, D]; k/v_local [H_kv, S_r, D], this rank's pages that the queries see (S_r >= 0); k/v_resp
    [H_kv, R, D], the own keys (query i sees own keys 0..i), replicated on every rank and counted by exactly one
    rank: the one called with include_own=True. dk/dv_acc: fp32 buffers shaped like k_local (exact mode); backward
    adds the local pages' dK/dV into them. Returns out [H_q, R, D] (q's dtype) and lse [H_q, R] (fp32), identical
    on every rank; q, k_resp and v_resp get the full gradient on every rank. Every rank must call this in lockstep.
    """
    if q.dim() != 3:
        raise LongStrawError(f"cp_prefix_attention: q must be [H_q, R, D], got {tuple(q.shape)}")
    q, k_resp, v_resp = replicated_to_partial(q, k_resp, v_resp, group=group)
    if include_own:
        accs = dict(dk_prefix_acc=dk_acc, dv_prefix_acc=dv_acc)
        out_r, lse_r = kernels.prefix_attention(
            q, k_local, v_local, k_resp, v_resp, scale, return_lse=True, force=force, **accs
        )
    else:
        out_r, lse_r = _pages_only(q, k_local, v_local, scale, dk_acc, dv_acc, force)
    return merge_partials(out_r, lse_r, group)


def _pages_only(q, k, v, scale, dk_acc, dv_acc, force):
    """(out, lse) of q [H_q, R, D] over the keys k/v [H_kv, n, D] only, with no own keys.

    The kernel always shows query i its own keys 0..i, so the own-key slot is filled with pages, each key seen
    exactly once (exact, no cancellation):
    - n > R: with u_j = page n-R-1+j (j = 0..R), call 1 reads pages 0..n-R-2 as prefix and u_0..u_{R-1} as own keys
      (query i sees u_0..u_i); call 2 runs the queries reversed against own keys u_R, u_{R-1}, .., u_1 (query i sees
      u_R..u_{i+1}). Together: every page once. Call 2 is R x R work.
    - 1 <= n <= R: each query is its own batch row (q [R, H_q, 1, D]) with pages 1..n-1 as the shared prefix and
      page 0 as its one own key.
    - n = 0: lse = -inf and out = 0 * q (zero, but it keeps q in the graph so this rank's backward still reaches the
      gradient all-reduce of the queries: the collectives stay in lockstep).
    Pages in the own slot take their gradient through autograd, routed into dk/dv_acc (exact mode).
    """
    hq, r, _ = q.shape
    n = k.shape[1]
    call = lambda *a, **kw: kernels.prefix_attention(*a, scale, return_lse=True, force=force, **kw)
    acc_slice = lambda a, b: {} if dk_acc is None else dict(dk_prefix_acc=dk_acc[:, a:b], dv_prefix_acc=dv_acc[:, a:b])
    if n == 0:
        return q * 0, torch.full((hq, r), float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32))
    if n <= r:
        k0, v0 = _pages_as_own(q, k[:, :1], v[:, :1], dk_acc, dv_acc, 0)
        shape = (r, *k0.shape[:1], 1, k0.shape[-1])
        q_b = q.transpose(0, 1).unsqueeze(2)  # [R, H_q, 1, D], a view
        out, lse = call(q_b, k[:, 1:], v[:, 1:], k0.unsqueeze(0).expand(shape), v0.unsqueeze(0).expand(shape),
                        **acc_slice(1, n))  # fmt: skip
        return out.squeeze(2).transpose(0, 1), lse.squeeze(2).transpose(0, 1)
    pre = n - r - 1
    ku, vu = _pages_as_own(q, k[:, pre : n - 1], v[:, pre : n - 1], dk_acc, dv_acc, pre)
    out1, lse1 = call(q, k[:, :pre], v[:, :pre], ku, vu, **acc_slice(0, pre))
    kw, vw = _pages_as_own(q, k[:, n - r : n], v[:, n - r : n], dk_acc, dv_acc, n - r)
    out2, lse2 = call(q.flip(1), k[:, :0], v[:, :0], kw.flip(1), vw.flip(1))
    out2, lse2 = out2.flip(1), lse2.flip(1)
    lse = torch.logaddexp(lse1, lse2)
    out = torch.exp(lse1 - lse).unsqueeze(-1) * out1 + torch.exp(lse2 - lse).unsqueeze(-1) * out2
    return out.to(q.dtype), lse


def _pages_as_own(q, k, v, dk_acc, dv_acc, start: int):
    """Page rows k/v [H_kv, m, D] for the kernel's own-key slot. Detached mode: the constant rows. Exact mode: the
    same rows through `IntoBuffer`, whose backward adds their gradient into dk/dv_acc[:, start:start+m] (the kernel
    fills the buffers only for its prefix slot); overlapping rows of two calls add up there."""
    if dk_acc is None or not (torch.is_grad_enabled() and q.requires_grad):
        return k, v
    m = k.shape[1]
    return IntoBuffer.apply(q, k, dk_acc[:, start : start + m]), IntoBuffer.apply(q, v, dv_acc[:, start : start + m])


# -- prefix state and adapters -----------------------------------------------------------------------------------


@dataclass
class CPKVState:
    """This rank's pages of a context-parallel prefix: local holds positions lo .. lo + local.length - 1 of the
    `length` captured positions (page_bounds(length, ranks)). The engine sees `length` (the whole prefix, where
    replays start), `nbytes` and `storages()` of the local pages only, and `zeros_like()` (exact mode's dK/dV)."""

    local: KVState
    lo: int
    total: int
    ranks: int

    @property
    def length(self) -> int:
        return self.total

    @property
    def nbytes(self) -> int:
        return self.local.nbytes

    def storages(self) -> set[int]:
        return self.local.storages()

    def zeros_like(self, dtype=torch.float32) -> CPKVState:
        return CPKVState(self.local.zeros_like(dtype), self.lo, self.total, self.ranks)


class CPPrefix(NamedTuple):
    """One layer's view for `_attend`: this rank's pages before the queries, their dK/dV buffers (exact mode), and
    whether this rank counts the queries' own keys."""

    k: torch.Tensor
    v: torch.Tensor
    grad_k: torch.Tensor | None
    grad_v: torch.Tensor | None
    include_own: bool


class ContextParallel:
    """Context parallel over any adapter of the K/V-page kinds: capture, replay and prompt backward with the pages
    split over `group`. Every rank runs every chunk and every replay (collectives in lockstep); see the module doc.
    It is composed onto an adapter's own class (`as_context_parallel`), never written per family; the kinds whose
    pages differ add their page handling below (`CP_KINDS`)."""

    group = None
    # cp_prefix_attention merges one sequence's partials; replay micro-batches are not split over ranks yet.
    batched_replay = False

    def _prefixes(self, state: CPKVState, length: int, grad: CPKVState | None) -> list[CPPrefix]:
        """Per layer: the local pages of positions < length, and whether this rank counts the own keys."""
        n = max(0, min(state.lo + state.local.length, length) - state.lo)
        include_own = rank(self.group) == own_rank(length, state.total, state.ranks)
        local = state.local
        out = []
        for i in range(local.k_L_Hkv_S_D.shape[0]):
            gk = gv = None
            if grad is not None:
                gk, gv = grad.local.k_L_Hkv_S_D[i, :, :n], grad.local.v_L_Hkv_S_D[i, :, :n]
            out.append(CPPrefix(local.k_L_Hkv_S_D[i, :, :n], local.v_L_Hkv_S_D[i, :, :n], gk, gv, include_own))
        return out

    def _attend(self, attn, q, k, v, prefix: CPPrefix) -> torch.Tensor:
        t = q.shape[2]
        out_H_T_D, _ = cp_prefix_attention(
            q.reshape(self.num_heads, t, self.head_dim), prefix.k, prefix.v, k, v, attn.scaling,
            include_own=prefix.include_own, dk_acc=prefix.grad_k, dv_acc=prefix.grad_v, group=self.group,
            force=_FORCE[self.kernels],
        )  # fmt: skip
        return attn.o_proj(out_H_T_D.transpose(0, 1).reshape(t, -1))

    def capture(self, tokens_S: torch.Tensor, chunk_size: int) -> CPKVState:
        """Chunks of `chunk_size` as in QwenAdapter.capture, every rank runs every chunk; each keeps only the K/V of
        its own pages. A chunk's queries see all earlier pages through the partial + merge."""
        s_len, ranks = tokens_S.shape[0], world_size(self.group)
        bounds = page_bounds(s_len, ranks)
        lo, hi = bounds[rank(self.group)], bounds[rank(self.group) + 1]
        weight = self.decoder.embed_tokens.weight
        local = self.pages.empty(
            self.num_layers, self.num_kv_heads, hi - lo, self.head_dim, weight.dtype, weight.device
        )
        state = CPKVState(local, lo, s_len, ranks)
        with torch.no_grad():
            for start in range(0, s_len, chunk_size):
                end = min(start + chunk_size, s_len)
                _, kv = self._layers(tokens_S[start:end], start, self._prefixes(state, start, None), 0, full=False)
                a, b = max(start, lo), min(end, hi)
                for i, (k, v) in enumerate(kv):
                    if a < b:
                        local.k_L_Hkv_S_D[i, :, a - lo : b - lo] = k[:, a - start : b - start]
                        local.v_L_Hkv_S_D[i, :, a - lo : b - lo] = v[:, a - start : b - start]
        return state

    def backward_prompt(self, tokens_S, state: CPKVState, grad: CPKVState, chunk_size: int, meter=None, backward=None):
        """QwenAdapter.backward_prompt across ranks: last chunk first, every rank recomputes the chunk (attending
        over all earlier pages through the merge, so its backward adds dK/dV into each owner's buffer), after one
        all-reduce has given every rank the chunk's complete dK/dV (its rows live on their owners)."""
        s_len = tokens_S.shape[0]
        lo, hi = state.lo, state.lo + state.local.length
        graph_bytes = 0
        for start in reversed(range(0, s_len, chunk_size)):
            end = min(start + chunk_size, s_len)
            # Complete on each owner: every reader of start..end-1 (later chunks, responses) has run its backward.
            g = grad.local.k_L_Hkv_S_D.new_zeros((2, self.num_layers, self.num_kv_heads, end - start, self.head_dim))
            a, b = max(start, lo), min(end, hi)
            if a < b:
                g[0, :, :, a - start : b - start] = grad.local.k_L_Hkv_S_D[:, :, a - lo : b - lo]
                g[1, :, :, a - start : b - start] = grad.local.v_L_Hkv_S_D[:, :, a - lo : b - lo]
            all_reduce_(g, "sum", self.group)
            chunk_meter = meter() if meter is not None else nullcontext()
            with torch.enable_grad(), chunk_meter:
                _, kv = self._layers(tokens_S[start:end], start, self._prefixes(state, start, grad), 0, full=False)
            if meter is not None:
                graph_bytes = max(graph_bytes, chunk_meter.nbytes)
            pairs = [(out, g[j, i].to(out.dtype)) for i, kv_i in enumerate(kv) for j, out in enumerate(kv_i)
                     if out.requires_grad]  # fmt: skip
            surrogate_backward(pairs, start == 0, backward)
            del kv, pairs, g
        return graph_bytes


class HybridPages(ContextParallel):
    """The hybrid kind (HybridQwenAdapter): its full layers' K/V pages split over `group` as above. The linear
    layers' recurrent boundary is replicated: every rank already runs every chunk and every replay with the whole
    decoder, so each one computes the same S and window (flat in P, ~61 MiB at Qwen3.5-35B-A3B) itself, and in
    exact mode carries the same dS back (a replicated tensor gets the full gradient on every rank). Handing boundary
    states rank to rank would only pay if ranks ran different chunks, which this layout never does
    (docs/decisions.md)."""

    capture = HybridQwenAdapter.capture
    backward_prompt = HybridQwenAdapter.backward_prompt
    _prefixes = HybridQwenAdapter._prefixes

    def _new_pages(self, length: int) -> CPKVState:
        ranks = world_size(self.group)
        lo, hi = page_bounds(length, ranks)[rank(self.group) : rank(self.group) + 2]
        weight = self.decoder.embed_tokens.weight
        local = KVState.empty(self.num_full, self.num_kv_heads, hi - lo, self.head_dim, weight.dtype, weight.device)
        return CPKVState(local, lo, length, ranks)

    def _page_prefix(self, pages: CPKVState, j: int, length: int, grad_pages: CPKVState | None) -> CPPrefix:
        n = max(0, min(pages.lo + pages.local.length, length) - pages.lo)
        include_own = rank(self.group) == own_rank(length, pages.total, pages.ranks)
        gk = gv = None
        if grad_pages is not None:
            gk, gv = grad_pages.local.k_L_Hkv_S_D[j, :, :n], grad_pages.local.v_L_Hkv_S_D[j, :, :n]
        return CPPrefix(pages.local.k_L_Hkv_S_D[j, :, :n], pages.local.v_L_Hkv_S_D[j, :, :n], gk, gv, include_own)

    def _store_pages(self, pages: CPKVState, j: int, start: int, end: int, k, v) -> None:
        lo = pages.lo
        a, b = max(start, lo), min(end, lo + pages.local.length)
        if a < b:
            pages.local.k_L_Hkv_S_D[j, :, a - lo : b - lo] = k[:, a - start : b - start]
            pages.local.v_L_Hkv_S_D[j, :, a - lo : b - lo] = v[:, a - start : b - start]

    def _chunk_page_grads(self, grad_pages: CPKVState, start: int, end: int):
        """The chunk's dK/dV rows live on their owners: one all-reduce gives every rank all of them."""
        local, lo = grad_pages.local, grad_pages.lo
        g = local.k_L_Hkv_S_D.new_zeros((2, self.num_full, self.num_kv_heads, end - start, self.head_dim))
        a, b = max(start, lo), min(end, lo + local.length)
        if a < b:
            g[0, :, :, a - start : b - start] = local.k_L_Hkv_S_D[:, :, a - lo : b - lo]
            g[1, :, :, a - start : b - start] = local.v_L_Hkv_S_D[:, :, a - lo : b - lo]
        all_reduce_(g, "sum", self.group)
        return g[0], g[1]


class LatentPages(ContextParallel):
    """The MLA kind (MlaAdapter): its latent pages split over `group`: the merge above runs on the absorbed form
    (one K/V head of width kv_lora_rank + qk_rope_head_dim whose value is the page itself; the rope columns of the
    output are dropped), then each rank up-projects the merged latent through W_uv. The partials run on
    prefix_attention, whose kernel accumulates the key and value gradients separately, so the pages' gradient is two
    buffers here."""

    pages = SplitGradLatentState

    def _attend(self, attn, q, k, v, prefix: CPPrefix) -> torch.Tensor:
        t = q.shape[-2]
        out_H_T_D, _ = cp_prefix_attention(
            q.reshape(self.num_heads, t, self.head_dim), prefix.k, prefix.v, k, k, attn.scaling,
            include_own=prefix.include_own, dk_acc=prefix.grad_k, dv_acc=prefix.grad_v, group=self.group,
            force=_FORCE[self.kernels],
        )  # fmt: skip
        return attn.o_proj(self._up(attn, out_H_T_D[..., : self.kv_lora_rank]).transpose(0, 1).reshape(t, -1))


def as_context_parallel(adapter: Adapter, group=None) -> Adapter:
    """`adapter` with its pages split over `group`: the same modules and settings (shared, not copied), its class
    composed with its kind's page handling (`cp_class`)."""
    composed = cp_class(getattr(type(adapter), "composed_from", type(adapter)))
    cp = composed.__new__(composed)
    cp.__dict__.update(adapter.__dict__)
    cp.group = group
    return cp


def cp_adapter_for(model, group=None) -> Adapter:
    """adapter_for(model), context-parallel over `group`."""
    return as_context_parallel(adapter_for(model), group)


def capture_cp(adapter: Adapter, tokens_S: torch.Tensor, chunk_size: int, group=None) -> CPKVState:
    """Capture positions 0..S-1 keeping only this rank's pages (every rank of `group` calls it together)."""
    return as_context_parallel(adapter, group).capture(tokens_S, chunk_size)


def cp_kinds() -> dict[str, type[ContextParallel]]:
    """Per LongStraw kind (longstraw.adapters.KINDS), how its pages split: the K/V pages of "gqa" are the base case,
    the others override what their pages hold."""
    from longstraw.context_parallel_dsa import IndexedLatentPages  # it builds on this module's classes

    return {"gqa": ContextParallel, "hybrid": HybridPages, "mla": LatentPages, "dsa": IndexedLatentPages}


_COMPOSED: dict[type, type] = {}


def cp_class(cls: type[Adapter]) -> type[Adapter]:
    """`cls` composed with its kind's page handling, made once per adapter class: a new family, or an adapter
    subclass, of a kind LongStraw has needs no context-parallel code."""
    if cls not in _COMPOSED:
        kind = next((k for k, base in KINDS.items() if issubclass(cls, base)), None)
        if kind is None:
            raise LongStrawError(f"context parallel covers LongStraw's adapter kinds, not {cls.__name__}")
        _COMPOSED[cls] = type(f"ContextParallel{cls.__name__}", (cp_kinds()[kind], cls), {"composed_from": cls})
    return _COMPOSED[cls]
