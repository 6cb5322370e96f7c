"""Softmax-attention decoders with q/k/v projections (GQA or MHA) in transformers 5.x: Qwen3-MoE, Qwen2-MoE (shared
expert), dense Qwen3 / Qwen2, GLM-4.5 (`glm4_moe`), and any family whose attention module has the same parts.

The layer math mirrors transformers' eager path exactly: pre-norm residual blocks; attention with q/k RMSNorm on the
head dim where the module has one (`q_norm`; GLM's `use_qk_norm` can switch it off), RoPE from the model's own rotary
module at absolute positions, over the whole head or, where the rotary module covers fewer dims (GLM's
`partial_rotary_factor`), over the first ones with the rest passed through; GQA with query head h = kv * G + g; then
the block's own MLP module (routed experts, plus a shared expert where the family has one; dense below GLM's
`first_k_dense_replace`), called as a module so PEFT LoRA on fused experts and router hooks stay live. q/k/v biases
(Qwen2, GLM's `attention_bias`) are live through the projection modules. The head dim is read from the attention
module (GLM-4.5-Air: 128, not hidden / heads = 4096 / 96).

Everything here is asked of the modules, not of a family name: a new family whose attention has these parts needs no
change here (`longstraw.adapters.adapter_for`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import torch
from torch import nn

import mint_kernels as kernels
from longstraw.adapters.base import Adapter, KVState
from longstraw.errors import LongStrawError
from longstraw.scoring import token_logprobs

# Adapter.kernels -> mint_kernels' `force`: auto dispatches by device (Triton on CUDA, the torch reference on CPU).
_FORCE = {"auto": None, "on": "triton", "off": "reference"}


class KVPrefix(NamedTuple):
    """One layer's view of the prefix state: k/v [H_kv, S, D] (S may be 0) and, in exact mode, the fp32 dK/dV
    buffers [H_kv, S, D] that the attention backward adds into (None otherwise)."""

    k: torch.Tensor
    v: torch.Tensor
    grad_k: torch.Tensor | None = None
    grad_v: torch.Tensor | None = None


def surrogate_backward(pairs: list[tuple[torch.Tensor, torch.Tensor]], last: bool, backward=None) -> None:
    """Back-propagate gradients g given for outputs `out` of a prompt chunk's recompute: <out, g> summed is a scalar
    whose gradient w.r.t. each out is g, so one scalar backward per chunk does it, and a framework that only
    back-propagates losses (DeepSpeed) can run it. Nothing to do without pairs."""
    if not pairs:
        return
    surrogate = sum((out * g).sum() for out, g in pairs)
    if backward is None:
        surrogate.backward()
    else:
        backward(surrogate, last, True)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x_H_T_D: torch.Tensor, cos_T_R: torch.Tensor, sin_T_R: torch.Tensor) -> torch.Tensor:
    """RoPE on the first R dims of the head dim, as transformers' `apply_rotary_pos_emb`: x[..., :R] * cos +
    rotate_half(x[..., :R]) * sin, and x[..., R:] as is. R is the rotary module's width: the whole head for Qwen,
    a part of it under `partial_rotary_factor` (GLM-4.5, the gated attention of Qwen3.5 / Qwen3-Next)."""
    rotary = cos_T_R.shape[-1]
    if rotary == x_H_T_D.shape[-1]:
        return x_H_T_D * cos_T_R + _rotate_half(x_H_T_D) * sin_T_R
    x_rot, x_pass = x_H_T_D[..., :rotary], x_H_T_D[..., rotary:]
    return torch.cat([x_rot * cos_T_R + _rotate_half(x_rot) * sin_T_R, x_pass], dim=-1)


class QwenAdapter(Adapter):
    batched_replay = True
    pages = KVState  # the prefix state's type (MLA: LatentState, one tensor serving as key and value)

    def __init__(self, model: nn.Module):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = base.config
        layer_types = getattr(config, "layer_types", None) or []
        if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
            raise LongStrawError("sliding-window attention is not supported by LongStraw yet")
        self.config = config
        self.decoder = base.model
        self.lm_head = base.lm_head
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self._head_dim(config)
        self.groups = self.num_heads // self.num_kv_heads
        self.qk_norm = self._uses_qk_norm(config)
        self.num_layers = len(self.decoder.layers)

    def _attention(self) -> nn.Module:
        """The first softmax-attention module: the one every capability below is read from."""
        return next(layer.self_attn for layer in self.decoder.layers if hasattr(layer, "self_attn"))

    def _head_dim(self, config) -> int:
        # As the attention module resolved it: config.head_dim, else hidden / heads.
        return getattr(self._attention(), "head_dim", None) or config.hidden_size // config.num_attention_heads

    def _uses_qk_norm(self, config) -> bool:
        attn = self._attention()
        return hasattr(attn, "q_norm") and bool(getattr(attn, "use_qk_norm", True))

    # -- pieces --------------------------------------------------------------------------------------------------

    def _rope(self, hidden_T_Hd: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] at positions start .. start + T - 1 (hidden [..., T, Hd]: every batch row shares them)."""
        t = hidden_T_Hd.shape[-2]
        positions = torch.arange(start, start + t, device=hidden_T_Hd.device).unsqueeze(0)
        cos, sin = self.decoder.rotary_emb(hidden_T_Hd, positions)
        return cos[0], sin[0]  # [T, D]

    def _projections(self, attn: nn.Module, x_T_Hd: torch.Tensor):
        """q [..., H, T, D], k/v [..., H_kv, T, D] for normed inputs x [..., T, Hd], q/k norm applied, no RoPE."""
        lead, t = x_T_Hd.shape[:-2], x_T_Hd.shape[-2]
        q = attn.q_proj(x_T_Hd).view(*lead, t, self.num_heads, self.head_dim)
        k = attn.k_proj(x_T_Hd).view(*lead, t, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x_T_Hd).view(*lead, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)

    def _qkv(self, attn: nn.Module, x_T_Hd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [..., H_kv, G, T, D], k/v [..., H_kv, T, D] for normed inputs x [..., T, Hd] (k-norm and RoPE applied);
        the leading dims are the replay's micro-batch rows (none for one sequence)."""
        q, k, v = self._projections(attn, x_T_Hd)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        return q.unflatten(-3, (self.num_kv_heads, self.groups)), k, v

    def _attend(self, attn: nn.Module, q, k, v, prefix: KVPrefix) -> torch.Tensor:
        lead, t = q.shape[:-4], q.shape[-2]
        # Query head h = kv * G + g reads K/V head h // G, the kernel's GQA convention; in exact mode the kernel adds
        # the prefix dK/dV into the buffers during backward. Batch rows (a replay micro-batch) share the prefix: the
        # kernel reads one [H_kv, S, D] prefix for all of them and sums their prefix dK/dV into the one buffer.
        out_H_T_D = kernels.prefix_attention(
            q.flatten(-4, -3),
            prefix.k,
            prefix.v,
            k,
            v,
            attn.scaling,
            dk_prefix_acc=prefix.grad_k,
            dv_prefix_acc=prefix.grad_v,
            force=_FORCE[self.kernels],
        )
        return attn.o_proj(out_H_T_D.transpose(-3, -2).reshape(*lead, t, -1))

    @staticmethod
    def _mlp(layer: nn.Module, h_T_Hd: torch.Tensor) -> torch.Tensor:
        # MoE blocks read (batch, seq, hidden) from the input shape and route its tokens flattened row-major.
        x = layer.post_attention_layernorm(h_T_Hd)
        return h_T_Hd + (layer.mlp(x) if x.dim() == 3 else layer.mlp(x.unsqueeze(0)).squeeze(0))

    def _layer(self, layer: nn.Module, h, cos, sin, prefix: KVPrefix, constant_rows: int, kv_only: bool):
        """One decoder layer over h_T_Hd: (h_out or None when kv_only, k_Hkv_T_D, v_Hkv_T_D)."""
        attn = layer.self_attn
        q, k, v = self._qkv(attn, layer.input_layernorm(h), cos, sin)
        if constant_rows:
            k = torch.cat([k[..., :constant_rows, :].detach(), k[..., constant_rows:, :]], dim=-2)
            v = torch.cat([v[..., :constant_rows, :].detach(), v[..., constant_rows:, :]], dim=-2)
        if kv_only:
            return None, k, v
        h = h + self._attend(attn, q, k, v, prefix)
        return self._mlp(layer, h), k, v

    def _layers(self, tokens_T: torch.Tensor, start: int, prefixes: list[KVPrefix], constant_rows: int, full: bool):
        """Run the decoder over tokens at `start`; returns (hidden_T_Hd or None, [(k, v)] per layer).

        full=False stops after the last layer's K/V: prompt positions need nothing past that. With autograd on and
        at least `checkpoint_min_tokens` tokens, each layer is checkpointed: the graph keeps the layer's input and
        its K/V instead of every activation inside it, and backward recomputes the layer (routes replay the same
        way: the R3 window set below is still the current one when backward runs). tokens may be [B, T] (a replay
        micro-batch, every row at the same positions); the threshold counts a row's T tokens (the engine replays
        rows that reach it one at a time, longstraw.replay).
        """
        if self.on_positions is not None:
            self.on_positions(start, tokens_T.shape[-1])
        h = self.decoder.embed_tokens(tokens_T)
        cos, sin = self._rope(h, start)
        checkpointed = torch.is_grad_enabled() and 0 < self.checkpoint_min_tokens <= tokens_T.shape[-1]
        kv = []
        for i, layer in enumerate(self.decoder.layers):
            kv_only = not full and i == self.num_layers - 1
            args = (layer, h, cos, sin, prefixes[i], constant_rows, kv_only)
            if checkpointed:
                h, k, v = torch.utils.checkpoint.checkpoint(self._layer, *args, use_reentrant=False)
            else:
                h, k, v = self._layer(*args)
            kv.append((k, v))
            if kv_only:
                return None, kv
        return self.decoder.norm(h), kv

    @staticmethod
    def _prefixes(state: KVState, length: int, grad: KVState | None) -> list[KVPrefix]:
        out = []
        for i in range(state.k_L_Hkv_S_D.shape[0]):
            gk = gv = None
            if grad is not None:
                gk, gv = grad.k_L_Hkv_S_D[i, :, :length], grad.v_L_Hkv_S_D[i, :, :length]
            out.append(KVPrefix(state.k_L_Hkv_S_D[i, :, :length], state.v_L_Hkv_S_D[i, :, :length], gk, gv))
        return out

    # -- the Adapter API -----------------------------------------------------------------------------------------

    def replay_graph_bytes(self, rows: int, tokens: int) -> int:
        """rows x tokens x bytes per token that an uncheckpointed forward saves for backward (the engine batches only
        rows below checkpoint_min_tokens), from the widths of the layers, per token: 3 x (hidden + q + 2 kv widths)
        per layer for attention, 3 x (k x (hidden + 3 I) + E, plus hidden + 3 I_s for a shared expert) per MoE
        block, 3 x (hidden + 3 I) per dense one, and 3 x hidden for the head. The factor 3 covers what norms, LoRA
        and routing save beside the matmul inputs. On the tiny Qwen3-MoE, Qwen2-MoE and GLM-4.5 this is 1x to 2x
        the metered bytes (tests/test_replay_batch.py)."""
        hd = self.config.hidden_size
        attention = hd + (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        per_token = sum(3 * (attention + self._mlp_width(layer)) for layer in self.decoder.layers)
        return rows * tokens * (per_token + 3 * hd) * self.decoder.embed_tokens.weight.element_size()

    def _mlp_width(self, layer: nn.Module) -> int:
        """Per token, the widths a layer's MLP saves for backward (see replay_graph_bytes): k x (hidden + 3 I) + E,
        plus hidden + 3 I_s for a shared expert, in an MoE block; hidden + 3 I in a dense one."""
        config, hd = self.config, self.config.hidden_size
        if not hasattr(layer.mlp, "experts"):
            return hd + 3 * getattr(config, "intermediate_size", 0)
        moe_i = getattr(config, "moe_intermediate_size", 0)
        experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", 0)
        shared = getattr(config, "shared_expert_intermediate_size", 0) or getattr(config, "n_shared_experts", 0) * moe_i
        width = getattr(config, "num_experts_per_tok", 0) * (hd + 3 * moe_i) + experts
        return width + (hd + 3 * shared if shared else 0)

    def capture(self, tokens_S: torch.Tensor, chunk_size: int) -> KVState:
        s_len = tokens_S.shape[0]
        weight = self.decoder.embed_tokens.weight
        state = self.pages.empty(self.num_layers, self.num_kv_heads, s_len, self.head_dim, weight.dtype, weight.device)
        with torch.no_grad():
            for start in range(0, s_len, chunk_size):
                end = min(start + chunk_size, s_len)
                _, kv = self._layers(tokens_S[start:end], start, self._prefixes(state, start, None), 0, full=False)
                for i, (k, v) in enumerate(kv):
                    state.k_L_Hkv_S_D[i, :, start:end] = k
                    state.v_L_Hkv_S_D[i, :, start:end] = v
        return state

    def forward(self, tokens_T, state: KVState, grad: KVState | None, constant_rows: int) -> torch.Tensor:
        prefixes = self._prefixes(state, state.length, grad)
        hidden, _ = self._layers(tokens_T, state.length, prefixes, constant_rows, full=True)
        return hidden

    def logprobs(self, hidden_T_Hd: torch.Tensor, targets_T: torch.Tensor, temperature: float) -> torch.Tensor:
        head = self.lm_head
        if type(head) is nn.Linear and head.bias is None and not head.weight.requires_grad:
            # A frozen head: chunked over T and V, [T, V] logits never kept for backward; dHidden only. The rows
            # past vocab_limit are cut as a view, the same cut the rollout engine samples with.
            force = _FORCE[self.kernels]
            weight = head.weight[: self.vocab_limit]
            flat_T_Hd, flat_T = hidden_T_Hd.reshape(-1, hidden_T_Hd.shape[-1]), targets_T.reshape(-1)
            logp_T = kernels.fused_logprob(flat_T_Hd, weight, flat_T, temperature, force=force)[0]
            return logp_T.view(targets_T.shape)
        logits = head(hidden_T_Hd)[..., : self.vocab_limit]  # a trained or biased head: plain logits
        return token_logprobs(logits, targets_T, temperature)

    def backward_prompt(
        self, tokens_S, state: KVState, grad: KVState, chunk_size: int, meter=None, backward=None
    ) -> int:
        s_len = tokens_S.shape[0]
        graph_bytes = 0
        for start in reversed(range(0, s_len, chunk_size)):
            end = min(start + chunk_size, s_len)
            chunk_meter = meter() if meter is not None else nullcontext()
            with torch.enable_grad(), chunk_meter:
                prefixes = self._prefixes(state, start, grad)
                _, kv = self._layers(tokens_S[start:end], start, prefixes, 0, full=False)
            if meter is not None:
                graph_bytes = max(graph_bytes, chunk_meter.nbytes)
            outputs, grads = [], []
            # A page that serves as both key and value (MLA's latent) has one gradient buffer: counted once.
            shared = grad.v_L_Hkv_S_D is grad.k_L_Hkv_S_D
            for i, (k, v) in enumerate(kv):
                # Complete: every reader of positions start..end-1 (later chunks, responses) has run its backward.
                pairs = [(k, grad.k_L_Hkv_S_D[i, :, start:end])]
                if not (shared and v is k):
                    pairs.append((v, grad.v_L_Hkv_S_D[i, :, start:end]))
                for out, g in pairs:
                    if out.requires_grad:
                        outputs.append(out)
                        grads.append(g.to(out.dtype))
            surrogate_backward(list(zip(outputs, grads, strict=True)), start == 0, backward)
            del kv, outputs, grads
        return graph_bytes
