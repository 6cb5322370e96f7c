"""DeepSeek Sparse Attention (DSA) decoders: DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`), MLA with a
lightning indexer, in transformers 5.x.

Per layer with an indexer, each token has an indexer key (index_head_dim wide, from the normed hidden state, RoPE'd
on its first qk_rope_head_dim columns) and each query an index score per key,

    I(t, j) = sum_h w_h(t) relu(scale * q_h(t) . k_j)        (index_n_heads heads, no gradient)

and attends only to its top index_topk causal keys by I. GLM-5's "shared" layers have no indexer: they attend to
the previous indexer layer's selection. While a forward's last position fits index_topk every query keeps every
causal key, and a layer is MlaAdapter's dense latent attention exactly. Past it, attention runs over the selection
with `kernels.sparse_latent_attention`, which gathers each query's selected pages (prefix and own) and, in exact
mode, scatter-adds their gradient into the selected prefix rows of the page-gradient buffer.

The prefix state adds indexer pages: one key per prompt token and indexer layer ([indexer layers, S,
index_head_dim], the model's dtype, no gradient buffer), captured with the latent pages. Selection is an exact top-k
over the same scores transformers computes, so it agrees with transformers' wherever the k-th and (k+1)-th scores
differ. ReLU scores of 0 tie often: LongStraw gives a tie to the lower position (`top_keys`), the same whatever the
chunking or the context-parallel layout, where torch.topk's choice may change with the row length. Where a tie falls
at the cut, the rollout engine may have kept other keys; indexer replay removes that difference.

Indexer replay (`index_replay`, off unless set): a callable (layer, start, own) given the layer's own selection
own [..., T, K] for positions start .. start + T - 1, returning the selection to attend to (the rollout's, where it
was recorded: longstraw.indexer_replay), in the same form.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

import mint_kernels as kernels
from longstraw.adapters.mla import LatentState, MlaAdapter
from longstraw.adapters.qwen import KVPrefix
from longstraw.errors import LongStrawError

# The RoPE layout each indexer class applies to its keys, keyed by the module's class as router_rules keys routers:
# DeepSeek-V3.2's indexer rotates halves (its MLA attention interleaves), GLM-5's interleaves like its attention.
# Nothing on the module or its config says which (transformers hard-codes the call), so a new indexer class is
# refused until it is listed here, after reading its forward.
INDEXER_ROPE = {"DeepseekV32Indexer": "apply_rotary_pos_emb", "GlmMoeDsaIndexer": "apply_rotary_pos_emb_interleave"}
# Index scores [B, queries, heads, keys] per block of queries: about 2^22 fp32 (16 MiB), at least one query (64 heads
# x 128k keys: 32 MiB).
_SCORE_BLOCK_ELEMENTS = 1 << 22


def top_keys(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of scores [..., S] along the last dim as (values, positions), ties going to the lower position.

    The tie rule makes a selection a function of the scores alone: torch.topk may break a tie differently for
    another row length, so a prompt captured in chunks, or split over context-parallel ranks, would select other
    keys than one captured whole. ReLU index scores tie at 0 often enough for that to matter."""
    values, positions = scores.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], positions[..., :k]


class DsaPrefix(NamedTuple):
    """A layer's view of a DSA prefix: KVPrefix's fields (the latent page is k and v, its gradient buffer grad_k and
    grad_v) plus the indexer keys [S, index_head_dim] of the prompt positions (None on a layer without an indexer)."""

    k: torch.Tensor
    v: torch.Tensor
    grad_k: torch.Tensor | None = None
    grad_v: torch.Tensor | None = None
    index_k: torch.Tensor | None = None


@dataclass
class DsaState(LatentState):
    """Latent pages [layers, 1, S, kv_lora_rank + rope] plus indexer pages [indexer layers, S, index_head_dim]."""

    index_I_S_D: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.index_I_S_D.numel() * self.index_I_S_D.element_size()

    def storages(self) -> set[int]:
        return super().storages() | {self.index_I_S_D.untyped_storage().data_ptr()}

    def zeros_like(self, dtype=torch.float32) -> LatentState:
        """The gradient buffer covers the latent pages only: the indexer runs without gradient."""
        grad = torch.zeros_like(self.k_L_Hkv_S_D, dtype=dtype)
        return LatentState(grad, grad)


class DsaAdapter(MlaAdapter):
    pages = DsaState

    def __init__(self, model: nn.Module):
        super().__init__(model)
        # Layer -> its slot in the indexer pages; a shared layer (GLM-5) has none and reads the previous selection.
        self.index_slot = {}
        for i, layer in enumerate(self.decoder.layers):
            indexer = getattr(layer.self_attn, "indexer", None)
            if indexer is not None:
                if type(indexer).__name__ not in INDEXER_ROPE:
                    raise LongStrawError(
                        f"no indexer RoPE layout for {type(indexer).__name__}; known: {', '.join(sorted(INDEXER_ROPE))}"
                    )
                self.index_slot[i] = len(self.index_slot)
        self.index_dim = self.config.index_head_dim

    # -- the indexer ---------------------------------------------------------------------------------------------

    def _index_keys(self, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Indexer keys [..., T, index_head_dim] of normed inputs x [..., T, Hd]."""
        ix = attn.indexer
        lead, t = x.shape[:-2], x.shape[-2]
        k = ix.k_norm(ix.wk(x.reshape(-1, t, x.shape[-1]))).unsqueeze(2)  # [B, T, 1, D]
        k_rot, k_pass = k.split([self.rope_dim, self.index_dim - self.rope_dim], dim=-1)
        _, k_rot = self._index_rope(attn, k_rot, k_rot, cos, sin)
        return torch.cat([k_rot, k_pass], dim=-1).squeeze(2).reshape(*lead, t, self.index_dim)

    def _index_rope(self, attn, q, k, cos, sin):
        apply = getattr(sys.modules[type(attn).__module__], INDEXER_ROPE[type(attn.indexer).__name__])
        return apply(q, k, cos[None], sin[None], unsqueeze_dim=2)

    def _candidates(self, attn, x, cos, sin, keys, positions, start: int, k: int):
        """The top k of `keys` [B or 1, S', D] (at absolute `positions` [S'], ascending) for each query of x [..., T,
        Hd] at start .., by index score, keys after a query's own position excluded: (scores [B, T, k] fp32,
        positions [B, T, k] int64), -inf and -1 in slots past a query's candidates. Blocked over queries."""
        ix = attn.indexer
        t, hd = x.shape[-2], x.shape[-1]
        x3 = x.reshape(-1, t, hd)
        q = ix.wq_b(attn.q_a_layernorm(attn.q_a_proj(x3))).view(x3.shape[0], t, ix.n_heads, self.index_dim)
        q_rot, q_pass = q.split([self.rope_dim, self.index_dim - self.rope_dim], dim=-1)
        q_rot, _ = self._index_rope(attn, q_rot, q_rot[:, :, :1], cos, sin)
        q = torch.cat([q_rot, q_pass], dim=-1).float()  # [B, T, heads, D]
        weights = ix.weights_proj(x3.to(ix.weights_proj.weight.dtype)).float() * ix.n_heads**-0.5  # [B, T, heads]
        keys = keys.float()
        values = torch.full((x3.shape[0], t, k), float("-inf"), device=x.device)
        chosen = torch.full((x3.shape[0], t, k), -1, dtype=torch.int64, device=x.device)
        n = min(k, keys.shape[1])
        block = max(1, _SCORE_BLOCK_ELEMENTS // max(1, x3.shape[0] * ix.n_heads * keys.shape[1]))
        for a in range(0, t, block):
            b = min(a + block, t)
            scores = torch.relu(torch.einsum("bthd,bsd->bths", q[:, a:b], keys) * ix.softmax_scale)
            index = torch.einsum("bth,bths->bts", weights[:, a:b], scores)
            causal = positions[None, :] <= (start + torch.arange(a, b, device=x.device))[:, None]  # [Tb, S']
            top, at = top_keys(index.masked_fill(~causal, float("-inf")), n)
            values[:, a:b, :n] = top
            chosen[:, a:b, :n] = positions[at].masked_fill(top == float("-inf"), -1)
        return values, chosen

    def _select(self, attn, x, cos, sin, prefix: DsaPrefix, own_keys, start: int) -> torch.Tensor:
        """Each query's top index_topk causal keys by index score: [..., T, K] absolute key positions (prefix j is
        page j, own token t is start + t), -1 in the slots of a query with fewer than K causal keys."""
        t = x.shape[-2]
        own = own_keys.reshape(-1, t, self.index_dim)
        keys = torch.cat([prefix.index_k.unsqueeze(0).expand(own.shape[0], -1, -1), own], dim=1)  # [B, S, D]
        positions = torch.arange(start + t, device=x.device)
        _, chosen = self._candidates(attn, x, cos, sin, keys, positions, start, min(self.index_topk, start + t))
        return chosen.reshape(*x.shape[:-2], t, chosen.shape[-1])

    # -- the layer loop ------------------------------------------------------------------------------------------

    def _layer(self, layer, h, cos, sin, prefix, constant_rows, kv_only, selection=None):
        """MlaAdapter's layer; with a selection [..., T, K] its attention reads only the selected keys."""
        attn = layer.self_attn
        q, k, _ = self._qkv(attn, layer.input_layernorm(h), cos, sin)
        if constant_rows:
            k = torch.cat([k[..., :constant_rows, :].detach(), k[..., constant_rows:, :]], dim=-2)
        if kv_only:
            return None, k, k
        if selection is None:
            out = self._attend(attn, q, k, k, prefix)
        else:
            out = self._attend_sparse(attn, q, k, prefix, selection)
        return self._mlp(layer, h + out), k, k

    def _layer_selection(self, attn, x, cos, sin, prefix: DsaPrefix, own_keys, start: int) -> torch.Tensor:
        own = self._select(attn, x, cos, sin, prefix, own_keys, start)
        if self.index_replay is None:
            return own
        return self.index_replay(attn.layer_idx, start, own)

    def _attend_sparse(self, attn: nn.Module, q, k, prefix: KVPrefix, selection: torch.Tensor) -> torch.Tensor:
        """Latent attention over each query's selected pages, then W_uv and o_proj (see MlaAdapter._attend)."""
        lead, t = q.shape[:-4], q.shape[-2]
        acc = prefix.grad_k[0] if prefix.grad_k is not None else None
        out_lat = kernels.sparse_latent_attention(
            q.flatten(-4, -3), prefix.k[0], k.squeeze(-3), selection, self.kv_lora_rank, attn.scaling, dpage_acc=acc
        )
        return attn.o_proj(self._up(attn, out_lat).transpose(-3, -2).reshape(*lead, t, -1))

    def _run(self, tokens_T, start: int, prefixes: list[DsaPrefix], constant_rows: int, full: bool):
        """(hidden or None, [(k, v)] per layer, {layer: own indexer keys}) over tokens at `start`: QwenAdapter._layers'
        loop (R3 window, per-layer checkpointing), with the indexer run before each layer, outside its checkpoint
        (no gradient, so nothing to recompute): its keys, and past index_topk the selection the layer attends to,
        which a shared layer takes from the layer before."""
        if self.on_positions is not None:
            self.on_positions(start, tokens_T.shape[-1])
        h = self.decoder.embed_tokens(tokens_T)
        cos, sin = self._rope(h, start)
        sparse = start + tokens_T.shape[-1] > self.index_topk  # else every query keeps every causal key: dense MLA
        checkpointed = torch.is_grad_enabled() and 0 < self.checkpoint_min_tokens <= tokens_T.shape[-1]
        kv, index_keys, selection = [], {}, None
        for i, layer in enumerate(self.decoder.layers):
            kv_only = not full and i == self.num_layers - 1
            attn = layer.self_attn
            if i in self.index_slot:
                with torch.no_grad():
                    x = layer.input_layernorm(h)
                    index_keys[i] = self._index_keys(attn, x, cos, sin)
                    if sparse and not kv_only:
                        selection = self._layer_selection(attn, x, cos, sin, prefixes[i], index_keys[i], start)
            args = (layer, h, cos, sin, prefixes[i], constant_rows, kv_only, selection if sparse else None)
            if checkpointed:
                h, k, v = torch.utils.checkpoint.checkpoint(self._layer, *args, use_reentrant=False)
            else:
                h, k, v = self._layer(*args)
            kv.append((k, v))
            if kv_only:
                return None, kv, index_keys
        return self.decoder.norm(h), kv, index_keys

    def _layers(self, tokens_T, start: int, prefixes: list, constant_rows: int, full: bool):
        hidden, kv, _ = self._run(tokens_T, start, prefixes, constant_rows, full)
        return hidden, kv

    def _prefixes(self, state: DsaState, length: int, grad: LatentState | None) -> list[DsaPrefix]:
        out = []
        for i, p in enumerate(super()._prefixes(state, length, grad)):
            slot = self.index_slot.get(i)
            index_k = state.index_I_S_D[slot, :length] if slot is not None else None
            out.append(DsaPrefix(*p, index_k=index_k))
        return out

    # -- the Adapter API -----------------------------------------------------------------------------------------

    def capture(self, tokens_S: torch.Tensor, chunk_size: int) -> DsaState:
        s_len = tokens_S.shape[0]
        weight = self.decoder.embed_tokens.weight
        pages = LatentState.empty(self.num_layers, 1, s_len, self.head_dim, weight.dtype, weight.device)
        index = torch.empty((len(self.index_slot), s_len, self.index_dim), dtype=weight.dtype, device=weight.device)
        state = DsaState(pages.k_L_Hkv_S_D, pages.v_L_Hkv_S_D, index)
        with torch.no_grad():
            for start in range(0, s_len, chunk_size):
                end = min(start + chunk_size, s_len)
                _, kv, keys = self._run(tokens_S[start:end], start, self._prefixes(state, start, None), 0, False)
                for i, (k, _) in enumerate(kv):
                    state.k_L_Hkv_S_D[i, :, start:end] = k
                for i, own in keys.items():
                    state.index_I_S_D[self.index_slot[i], start:end] = own
        return state
