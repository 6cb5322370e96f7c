"""DSA under context parallel: the latent pages and the indexer pages split over the ranks, the selection merged.

Rank r holds the pages of positions [lo_r, lo_r + n_r) (longstraw.context_parallel's layout), latent and indexer
alike. Past index_topk each query selects its top k keys among all ranks' positions and its own:

1. every rank scores the queries against its own indexer pages (and the rank that counts the own keys against the
   queries' own indexer keys) and keeps its local top k as (score, position) pairs;
2. one all-gather of those pairs; every rank merges the C x k candidates into the global top k with the tie rule of
   one rank (`top_keys`: ties to the lower position), so the merged selection is the one-rank selection exactly;
3. every rank attends to the selected keys it holds (`sparse_latent_attention` over its local pages, positions
   mapped to local rows, the others empty), and the partials merge by LSE (`merge_partials`) as for dense pages.

A candidate of the global top k is in its rank's local top k (a local list is the global order restricted to that
rank), so step 2 loses nothing. The gradient rules are the dense path's: the queries and own pages enter through
`replicated_to_partial`; each rank adds its selected pages' gradient into its own buffer. Communication per query
token and indexer layer: C x k x 16 bytes gathered (score and position, fp64), besides the dense merge's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

import mint_kernels as kernels
from longstraw._cp_collectives import all_gather, rank, replicated_to_partial, world_size
from longstraw.adapters.base import KVState
from longstraw.adapters.dsa import DsaState, top_keys
from longstraw.adapters.mla import LatentState
from longstraw.context_parallel import ContextParallel, CPKVState, LatentPages, merge_partials, page_bounds

__all__ = ["IndexedLatentPages", "merge_top_keys"]


def merge_top_keys(scores_C: torch.Tensor, positions_C: torch.Tensor, k: int) -> torch.Tensor:
    """The top k of the ranks' candidates scores_C / positions_C [C, ..., k_r] (-inf / -1 for empty slots): [..., k]
    positions, -1 where fewer than k candidates exist, ties to the lower position as `top_keys` breaks them."""
    scores = scores_C.movedim(0, -2).flatten(-2)
    positions = positions_C.movedim(0, -2).flatten(-2)
    order = positions.argsort(dim=-1, stable=True)  # ascending position first, so the stable sort keeps that order
    scores, positions = scores.gather(-1, order), positions.gather(-1, order)
    top, at = top_keys(scores, k)
    return positions.gather(-1, at).masked_fill(top == float("-inf"), -1)


class CPDsaPrefix(NamedTuple):
    """One layer's view: CPPrefix's fields, this rank's indexer pages (None on a shared layer), the first position
    lo of its pages, and start, where the queries' own positions begin."""

    k: torch.Tensor
    v: torch.Tensor
    grad_k: torch.Tensor | None
    grad_v: torch.Tensor | None
    include_own: bool
    index_k: torch.Tensor | None
    lo: int
    start: int


@dataclass
class SplitGradDsaState(DsaState):
    """DSA pages whose gradient is two buffers (key part, value part): the dense partials run on prefix_attention,
    which accumulates them apart (as LatentPages'); the sparse partials add their whole gradient into the
    key part's."""

    def zeros_like(self, dtype=torch.float32) -> KVState:
        return KVState.zeros_like(self, dtype)


class IndexedLatentPages(LatentPages):
    """The DSA kind (DsaAdapter): its latent and indexer pages split over `group`: dense layers (within
    index_topk) as LatentPages, sparse ones through the merged selection (module doc)."""

    pages = SplitGradDsaState

    def _prefixes(self, state: CPKVState, length: int, grad: CPKVState | None) -> list[CPDsaPrefix]:
        out = []
        for i, p in enumerate(ContextParallel._prefixes(self, state, length, grad)):
            slot = self.index_slot.get(i)
            index_k = state.local.index_I_S_D[slot, : p.k.shape[1]] if slot is not None else None
            out.append(CPDsaPrefix(*p, index_k=index_k, lo=state.lo, start=length))
        return out

    def _select(self, attn, x, cos, sin, prefix: CPDsaPrefix, own_keys, start: int) -> torch.Tensor:
        t = x.shape[-2]
        n = prefix.k.shape[1]
        keys = [prefix.index_k.unsqueeze(0)]
        positions = [torch.arange(prefix.lo, prefix.lo + n, device=x.device)]
        if prefix.include_own:
            keys.append(own_keys.reshape(1, t, self.index_dim))
            positions.append(torch.arange(start, start + t, device=x.device))
        k = min(self.index_topk, start + t)
        scores, chosen = self._candidates(attn, x, cos, sin, torch.cat(keys, 1), torch.cat(positions), start, k)
        gathered = all_gather(torch.stack([scores.double(), chosen.double()]), self.group)  # [C, 2, 1, T, k]
        return merge_top_keys(gathered[:, 0], gathered[:, 1].long(), k).reshape(t, k)

    def _attend_sparse(self, attn, q, k, prefix: CPDsaPrefix, selection: torch.Tensor) -> torch.Tensor:
        """This rank's selected keys (its pages, and the own keys on the rank counting them), merged by LSE."""
        t, n = q.shape[-2], prefix.k.shape[1]
        local = torch.where((selection >= prefix.lo) & (selection < prefix.lo + n), selection - prefix.lo, -1)
        if prefix.include_own:
            local = torch.where(selection >= prefix.start, n + selection - prefix.start, local)
        q3, own = replicated_to_partial(q.reshape(self.num_heads, t, self.head_dim), k.reshape(t, self.head_dim),
                                        group=self.group)  # fmt: skip
        acc = prefix.grad_k[0] if prefix.grad_k is not None else None
        out_r, lse_r = kernels.sparse_latent_attention(
            q3, prefix.k[0], own, local, self.kv_lora_rank, attn.scaling, dpage_acc=acc, return_lse=True
        )
        out, _ = merge_partials(out_r, lse_r, self.group)
        return attn.o_proj(self._up(attn, out).transpose(0, 1).reshape(t, -1))

    def capture(self, tokens_S: torch.Tensor, chunk_size: int) -> CPKVState:
        """ContextParallel.capture with the indexer pages: each rank keeps the latent and indexer keys of its own
        positions."""
        s_len, ranks = tokens_S.shape[0], world_size(self.group)
        lo, hi = page_bounds(s_len, ranks)[rank(self.group) : rank(self.group) + 2]
        weight = self.decoder.embed_tokens.weight
        pages = LatentState.empty(self.num_layers, 1, hi - lo, self.head_dim, weight.dtype, weight.device)
        index = torch.empty((len(self.index_slot), hi - lo, self.index_dim), dtype=weight.dtype, device=weight.device)
        local = SplitGradDsaState(pages.k_L_Hkv_S_D, pages.v_L_Hkv_S_D, index)
        state = CPKVState(local, lo, s_len, ranks)
        with torch.no_grad():
            for start in range(0, s_len, chunk_size):
                end = min(start + chunk_size, s_len)
                _, kv, keys = self._run(tokens_S[start:end], start, self._prefixes(state, start, None), 0, False)
                a, b = max(start, lo), min(end, hi)
                if a < b:
                    for i, (k, _) in enumerate(kv):
                        local.k_L_Hkv_S_D[i, :, a - lo : b - lo] = k[:, a - start : b - start]
                    for i, own in keys.items():
                        local.index_I_S_D[self.index_slot[i], a - lo : b - lo] = own[a - start : b - start]
        return state
