"""Hybrid linear-attention decoders: Qwen3.5-MoE, Qwen3-Next and dense Qwen3.5 in transformers 5.x.

`config.layer_types` interleaves Gated DeltaNet layers ("linear_attention", longstraw.adapters.gated_deltanet) with
gated full-attention layers ("full_attention"), 3:1 in the released models. The prefix state is a LayeredState of two
parts: K/V pages of the full layers (as QwenAdapter keeps them, for those layers only) and the recurrent boundary of
the linear layers (RecurrentState: S and the conv window, flat in the prompt length).

What differs from QwenAdapter, following the families' modules:
- Full layers gate their output: q_proj emits query and gate per head ([.., H, 2D] split in halves), and the
  attention's output is multiplied by sigmoid(gate) before o_proj. Per-head q/k norms; partial RoPE (the rotary
  module builds cos/sin for the rotated dims only; Qwen3.5's mRoPE sections reduce to plain positions for text).
- Norms are zero-centred (1 + w): they are the model's own modules, called as such.
- MoE blocks (routed experts plus a sigmoid-gated shared expert) or a dense MLP: the layer's own `mlp` module.

Modes through the recurrence:
- detached: the state after the last prompt position is a constant (that position's own output is live).
- exact: the replays' gradient reaches the boundary state (dS, dWindow); the prompt backward then runs the capture
  chunks last to first, each recomputed from the state checkpoint at its start, with the surrogate <S_end, dS> +
  <window_end, dWindow> beside the K/V pages' <K, dK> + <V, dV>, and carries the chunk start's dS back. Capture
  keeps those checkpoints only when the engine asks (keep_checkpoints, exact mode).
- resident: as detached, from a kept capture.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from longstraw.adapters.base import KVState, LayeredState, RecurrentState
from longstraw.adapters.gated_deltanet import DeltaNetDims, DeltaNetPrefix, deltanet, is_deltanet
from longstraw.adapters.qwen import _FORCE, KVPrefix, QwenAdapter, _rope, surrogate_backward
from longstraw.errors import LongStrawError

FULL, LINEAR = "full_attention", "linear_attention"


class _GatedOutput:
    """What `_attend` reads of an attention module (scaling, o_proj), with o_proj applied to out * sigmoid(gate):
    QwenAdapter's and the context-parallel `_attend` then serve gated attention unchanged."""

    def __init__(self, attn: nn.Module, gate: torch.Tensor):
        self.attn, self.gate, self.scaling = attn, gate, attn.scaling

    def o_proj(self, out: torch.Tensor) -> torch.Tensor:
        return self.attn.o_proj(out * torch.sigmoid(self.gate.reshape(out.shape)))


class HybridQwenAdapter(QwenAdapter):
    batched_replay = True

    def __init__(self, model: nn.Module):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = base.config
        self.layer_types = list(config.layer_types)
        unknown = sorted(set(self.layer_types) - {FULL, LINEAR})
        if unknown:
            raise LongStrawError(f"layer types {unknown} are not supported by LongStraw yet")
        self.config = config
        self.decoder = base.model
        self.lm_head = base.lm_head
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self._head_dim(config)
        self.groups = self.num_heads // self.num_kv_heads
        self.qk_norm = True
        self.num_layers = len(self.decoder.layers)
        # Each layer's index within its kind's part of the state.
        self.part_index = [self.layer_types[:i].count(kind) for i, kind in enumerate(self.layer_types)]
        self.num_full, self.num_linear = self.layer_types.count(FULL), self.layer_types.count(LINEAR)
        linear = next((layer.linear_attn for layer in self.decoder.layers if is_deltanet(layer)), None)
        self.dims = DeltaNetDims.of(linear) if linear is not None else None

    # -- layers --------------------------------------------------------------------------------------------------

    def _gated_qkv(self, attn: nn.Module, x_T_Hd: torch.Tensor, cos, sin):
        """q [..., H_kv, G, T, D], k/v [..., H_kv, T, D] (q/k norm, partial RoPE) and the output gate [..., T, H D]."""
        lead, t = x_T_Hd.shape[:-2], x_T_Hd.shape[-2]
        query, gate = attn.q_proj(x_T_Hd).view(*lead, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = attn.q_norm(query).transpose(-3, -2)
        k = attn.k_norm(attn.k_proj(x_T_Hd).view(*lead, t, self.num_kv_heads, self.head_dim)).transpose(-3, -2)
        v = attn.v_proj(x_T_Hd).view(*lead, t, self.num_kv_heads, self.head_dim).transpose(-3, -2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        return q.unflatten(-3, (self.num_kv_heads, self.groups)), k, v, gate.reshape(*lead, t, -1)

    def _layer(self, layer: nn.Module, h, cos, sin, prefix, constant_rows: int, state_only: bool):
        """One decoder layer over h [..., T, Hd]: (h_out or None when state_only, and the layer's new state: k, v
        [..., H_kv, T, D] for a full layer; s_end, window_end after the last token for a linear one)."""
        x = layer.input_layernorm(h)
        if isinstance(prefix, DeltaNetPrefix):
            mixed, a, b = deltanet(layer.linear_attn, x, prefix, constant_rows, _FORCE[self.kernels], state_only)
            if state_only:
                return None, a, b
        else:
            attn = layer.self_attn
            q, a, b, gate = self._gated_qkv(attn, x, cos, sin)
            if constant_rows:
                a = torch.cat([a[..., :constant_rows, :].detach(), a[..., constant_rows:, :]], dim=-2)
                b = torch.cat([b[..., :constant_rows, :].detach(), b[..., constant_rows:, :]], dim=-2)
            if state_only:
                return None, a, b
            mixed = self._attend(_GatedOutput(attn, gate), q, a, b, prefix)
        return self._mlp(layer, h + mixed), a, b

    def _slots(self) -> list[tuple[str, int]]:
        """(kind, index within the kind's part of the state) per layer, in model order."""
        return list(zip(self.layer_types, self.part_index, strict=True))

    # -- state ---------------------------------------------------------------------------------------------------

    # K/V pages of the full layers: the context-parallel twin (longstraw.context_parallel) overrides these four.

    def _new_pages(self, length: int):
        weight = self.decoder.embed_tokens.weight
        return KVState.empty(self.num_full, self.num_kv_heads, length, self.head_dim, weight.dtype, weight.device)

    def _page_prefix(self, pages, j: int, length: int, grad_pages):
        """Full layer j's view of positions < length, with its dK/dV buffers in exact mode."""
        gk = gv = None
        if grad_pages is not None:
            gk, gv = grad_pages.k_L_Hkv_S_D[j, :, :length], grad_pages.v_L_Hkv_S_D[j, :, :length]
        return KVPrefix(pages.k_L_Hkv_S_D[j, :, :length], pages.v_L_Hkv_S_D[j, :, :length], gk, gv)

    def _store_pages(self, pages, j: int, start: int, end: int, k, v) -> None:
        pages.k_L_Hkv_S_D[j, :, start:end] = k
        pages.v_L_Hkv_S_D[j, :, start:end] = v

    def _chunk_page_grads(self, grad_pages, start: int, end: int):
        """dK, dV [L_full, H_kv, end - start, D] of a prompt chunk's rows, complete: every reader of them (later
        chunks, the responses) has run its backward."""
        return grad_pages.k_L_Hkv_S_D[:, :, start:end], grad_pages.v_L_Hkv_S_D[:, :, start:end]

    def _empty_state(self, length: int) -> LayeredState:
        weight = self.decoder.embed_tokens.weight
        parts = {}
        if self.num_full:
            parts[FULL] = self._new_pages(length)
        if self.num_linear:
            d = self.dims
            parts[LINEAR] = RecurrentState.zeros(
                self.num_linear, d.value_heads, d.key_dim, d.value_dim, d.conv_dim, d.width, weight.dtype, weight.device
            )
            parts[LINEAR].length = length
        return LayeredState(parts, length)

    def _prefixes(self, state: LayeredState, length: int, grad: LayeredState | None, recurrent=None, carry=None):
        """Per layer: K/V pages of positions < length (and their dK/dV buffers), or a linear layer's state: the
        state's boundary with gradients into grad's, or (prompt backward) `recurrent` with gradients into `carry`."""
        pages, grad_pages = state.parts.get(FULL), grad.parts.get(FULL) if grad is not None else None
        if recurrent is None:
            recurrent, carry = state.parts.get(LINEAR), grad.parts.get(LINEAR) if grad is not None else None
        out = []
        for kind, j in zip(self.layer_types, self.part_index, strict=True):
            if kind == FULL:
                out.append(self._page_prefix(pages, j, length, grad_pages))
            else:
                gs = gw = None
                if carry is not None:
                    gs, gw = carry.s_L_H_K_V[j], carry.window_L_C_W[j]
                out.append(DeltaNetPrefix(recurrent.s_L_H_K_V[j], recurrent.window_L_C_W[j], gs, gw))
        return out

    def _store(self, state: LayeredState, outs: list, start: int, end: int) -> None:
        """Write a chunk's K/V into the pages and the state after it into the boundary."""
        for (kind, j), (a, b) in zip(self._slots(), outs, strict=True):
            if kind == FULL:
                self._store_pages(state.parts[FULL], j, start, end, a, b)
            else:
                state.parts[LINEAR].s_L_H_K_V[j] = a
                state.parts[LINEAR].window_L_C_W[j] = b

    # -- the Adapter API -----------------------------------------------------------------------------------------

    def replay_graph_bytes(self, rows: int, tokens: int) -> int:
        """rows x tokens x bytes per token an uncheckpointed forward saves for backward: QwenAdapter's per-token
        widths for full layers (q doubled by the gate) and the MLPs, 3 x (hidden + 2 x conv_dim + 3 x H_v d_v + 4 H_v)
        for a linear layer's projections, conv, norm and gates, plus what the torch delta rule saves per value head:
        its tokens padded to whole 64-token chunks, each with ~10 fp32 [64]-wide rows (decays, the UT system, the
        intra-chunk attention) and ~12 of width d (q, k, v and their decayed and beta-scaled copies). That padding
        makes a short replay cost a whole chunk. flash-linear-attention (CUDA) saves less, so there the estimate is
        conservative. Tested against the metered bytes in tests/test_hybrid.py."""
        hd = self.config.hidden_size
        attention = hd + (2 * self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        size = self.decoder.embed_tokens.weight.element_size()
        padded = -(-tokens // 64) * 64
        total = 3 * hd * size * tokens
        for kind, layer in zip(self.layer_types, self.decoder.layers, strict=True):
            mlp = self._mlp_width(layer)
            if kind == FULL:
                total += 3 * (attention + mlp) * size * tokens
            else:
                d = self.dims
                width = hd + 2 * d.conv_dim + 3 * d.value_heads * d.value_dim + 4 * d.value_heads
                total += 3 * (width + mlp) * size * tokens
                total += d.value_heads * padded * (10 * 64 + 12 * max(d.key_dim, d.value_dim)) * 4
        return rows * total

    def capture(self, tokens_S: torch.Tensor, chunk_size: int) -> LayeredState:
        s_len = tokens_S.shape[0]
        state = self._empty_state(s_len)
        boundary = state.parts.get(LINEAR)
        with torch.no_grad():
            for start in range(0, s_len, chunk_size):
                end = min(start + chunk_size, s_len)
                if start and boundary is not None and self.keep_checkpoints:
                    boundary.checkpoints.append(boundary.clone())
                _, outs = self._layers(tokens_S[start:end], start, self._prefixes(state, start, None), 0, full=False)
                self._store(state, outs, start, end)
        if boundary is not None:
            boundary.chunk_size = chunk_size
        return state

    def forward(self, tokens_T, state: LayeredState, grad: LayeredState | None, constant_rows: int) -> torch.Tensor:
        hidden, _ = self._layers(tokens_T, state.length, self._prefixes(state, state.length, grad), constant_rows, True)
        return hidden

    def backward_prompt(
        self, tokens_S, state: LayeredState, grad: LayeredState, chunk_size: int, meter=None, backward=None
    ) -> int:
        s_len = tokens_S.shape[0]
        starts = list(range(0, s_len, chunk_size))
        boundary, d_state = state.parts.get(LINEAR), grad.parts.get(LINEAR)
        stale = boundary is not None and (boundary.chunk_size, len(boundary.checkpoints)) != (
            chunk_size,
            len(starts) - 1,
        )
        if stale and len(starts) > 1:
            raise LongStrawError(
                "the prompt backward needs the capture's chunk-start checkpoints at the same chunk size: capture "
                f"with keep_checkpoints (chunk {boundary.chunk_size}, {len(boundary.checkpoints)} checkpoints; "
                f"asked chunk {chunk_size}, {len(starts) - 1} needed)"
            )
        graph_bytes = 0
        for c in reversed(range(len(starts))):
            start, end = starts[c], min(starts[c] + chunk_size, s_len)
            recurrent = carry = None
            if boundary is not None:  # the first chunk starts from zeros, whose gradient nothing needs
                recurrent = boundary.checkpoints[c - 1] if c else boundary.zeros_like(None)
                carry = d_state.zeros_like() if c else None
            pages = self._chunk_page_grads(grad.parts[FULL], start, end) if FULL in grad.parts else None
            chunk_meter = meter() if meter is not None else nullcontext()
            with torch.enable_grad(), chunk_meter:
                prefixes = self._prefixes(state, start, grad, recurrent, carry)
                _, outs = self._layers(tokens_S[start:end], start, prefixes, 0, full=False)
            if meter is not None:
                graph_bytes = max(graph_bytes, chunk_meter.nbytes)
            outputs, grads = [], []
            for (kind, j), (a, b) in zip(self._slots(), outs, strict=True):
                if kind == FULL:
                    pairs = ((a, pages[0][j]), (b, pages[1][j]))
                else:
                    pairs = ((a, d_state.s_L_H_K_V[j]), (b, d_state.window_L_C_W[j]))
                for out, g in pairs:
                    if out.requires_grad:
                        outputs.append(out)
                        grads.append(g.to(out.dtype))
            surrogate_backward(list(zip(outputs, grads, strict=True)), start == 0, backward)
            del outs, outputs, grads
            if carry is not None:
                d_state = carry  # d(loss)/d(state at this chunk's start) = d(loss)/d(state at the previous one's end)
        return graph_bytes
