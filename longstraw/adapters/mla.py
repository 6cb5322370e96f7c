"""Multi-head latent attention (MLA) decoders: DeepSeek-V3 (`deepseek_v3`, Kimi-K2.5's text-tower architecture) and
GLM-4.7-Flash (`glm4_moe_lite`) in transformers 5.x.

MLA projects each token to a latent c = kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora_rank]) and one RoPE key k_r
shared by all heads; kv_b_proj expands c into every head's k_nope and v. LongStraw keeps the latent, not the
expansion: a prefix page per token and layer is [c, k_r] (kv_lora_rank + qk_rope_head_dim values, 576 at V3's dims;
expanded K/V would be heads x (qk_nope + qk_rope + v) = 40,960), and attention runs in the absorbed form:

    q_abs_h = [q_nope_h W_uk_h, q_rope_h]   (576 wide)   score_h(j) = q_abs_h . [c_j, k_r_j] * scaling
    out_h   = (sum_j p_h(j) c_j) W_uv_h^T                (W_uk_h, W_uv_h: head h's rows of kv_b_proj)

which is the module's own attention with its products reassociated: a single K/V head of width 576 shared by the
query group of all heads. The value of a key is its latent itself, so the page serves as key and value:
`mint_kernels.latent_prefix_attention` reads one page per token for both and adds the page's whole gradient into
one fp32 buffer in exact mode. kv_b_proj's LoRA folds in factored: q_nope (B_uk A) is
(q_nope B_uk) A, never the [heads x (nope + v), kv_lora_rank] product.

What the modes then mean: the prefix's latent and rope key are constant in detached and resident modes, but
kv_b_proj's up-projection (W_uk, W_uv, with their LoRA) stays live over every prefix position, because it acts on the
queries and the outputs; exact mode adds d(loss)/d[c, k_r] over the prompt like any K/V page. The machinery (capture,
replay, prompt backward, checkpointing, R3 hooks, micro-batches) is QwenAdapter's: an MLA page is a KVState of one
head whose key and value are the same tensor.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

import mint_kernels as kernels
from longstraw.adapters.base import KVState
from longstraw.adapters.qwen import _FORCE, KVPrefix, QwenAdapter

# deepseek_v32 and glm_moe_dsa add DSA's indexer on top of this attention: longstraw.adapters.dsa.


@dataclass
class LatentState(KVState):
    """MLA pages [layers, 1, S, kv_lora_rank + qk_rope_head_dim], one allocation held as both key and value."""

    @property
    def nbytes(self) -> int:
        return self.k_L_Hkv_S_D.numel() * self.k_L_Hkv_S_D.element_size()

    @classmethod
    def empty(cls, layers: int, kv_heads: int, length: int, head_dim: int, dtype, device) -> LatentState:
        pages = torch.empty((layers, kv_heads, length, head_dim), dtype=dtype, device=device)
        return cls(pages, pages)

    def zeros_like(self, dtype=torch.float32) -> LatentState:
        """Exact mode's gradient: one fp32 buffer per page, key and value parts summed into it by the latent kernel."""
        grad = torch.zeros_like(self.k_L_Hkv_S_D, dtype=dtype)
        return LatentState(grad, grad)


@dataclass
class SplitGradLatentState(LatentState):
    """Latent pages whose gradient is two buffers, the key part's and the value part's (a kernel that accumulates
    them separately, as prefix_attention under context parallel does), summed by the prompt backward's surrogate."""

    def zeros_like(self, dtype=torch.float32) -> KVState:
        return KVState.zeros_like(self, dtype)


def lora_parts(linear: nn.Module) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, float]]]:
    """(base weight [O, I], [(A [r, I], B [O, r], scaling)] of the active LoRA adapters) as the module's forward
    applies them: none when the adapter is disabled or merged into the weight, or for a plain Linear. A quantized
    base linear (one with `dequantized()`, as mint's Fp8Linear) gives its weight dequantized, a temporary."""
    base = getattr(linear, "base_layer", linear)
    weight = base.dequantized() if hasattr(base, "dequantized") else base.weight
    if not hasattr(linear, "lora_A") or linear.disable_adapters or getattr(linear, "merged", False):
        return weight, []
    active = [a for a in linear.active_adapters if a in linear.lora_A]
    return weight, [(linear.lora_A[a].weight, linear.lora_B[a].weight, linear.scaling[a]) for a in active]


class MlaAdapter(QwenAdapter):
    batched_replay = True
    pages = LatentState

    def __init__(self, model: nn.Module):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = base.config
        self.config = config
        self.decoder = base.model
        self.lm_head = base.lm_head
        attn = self.decoder.layers[0].self_attn
        self.num_heads = attn.num_heads
        self.kv_lora_rank, self.rope_dim = attn.kv_lora_rank, attn.qk_rope_head_dim
        self.nope_dim, self.v_dim = attn.qk_nope_head_dim, attn.v_head_dim
        self.num_kv_heads, self.groups = 1, self.num_heads  # one latent K/V head for every query head
        self.head_dim = self.kv_lora_rank + self.rope_dim
        self.qk_norm = False
        self.num_layers = len(self.decoder.layers)
        # DeepSeek-V3 and GLM-4.7-Flash read rope_interleave (True as released); the DSA families always interleave.
        self.interleaved = bool(getattr(config, "rope_interleave", True))
        self.index_topk = getattr(config, "index_topk", None)  # DSA's (DsaAdapter); None without an indexer

    # -- pieces --------------------------------------------------------------------------------------------------

    def _kv_b(self, attn: nn.Module):
        """kv_b_proj split per head: base W_uk [H, nope, C], W_uv [H, v, C] and per LoRA adapter (A [r, C],
        B_uk [H, nope, r], B_uv [H, v, r], scaling)."""
        weight, loras = lora_parts(attn.kv_b_proj)
        per_head = (self.num_heads, self.nope_dim + self.v_dim)
        w = weight.view(*per_head, -1)
        folded = []
        for a, b, scaling in loras:
            b = b.view(*per_head, -1)
            folded.append((a, b[:, : self.nope_dim], b[:, self.nope_dim :], scaling))
        return w[:, : self.nope_dim], w[:, self.nope_dim :], folded

    def _qkv(self, attn: nn.Module, x_T_Hd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Absorbed queries q [..., 1, H, T, C + rope] and the tokens' own pages k = v [..., 1, T, C + rope]."""
        lead, t = x_T_Hd.shape[:-2], x_T_Hd.shape[-2]
        x = x_T_Hd.reshape(-1, t, x_T_Hd.shape[-1])  # [B, T, Hd]: the module's rope functions expect a batch dim
        if attn.q_lora_rank is None:
            q = attn.q_proj(x)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        q = q.view(x.shape[0], t, self.num_heads, -1).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = attn.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = attn.kv_a_layernorm(latent).unsqueeze(1)  # [B, 1, T, C]
        rope = sys.modules[type(attn).__module__]
        apply = rope.apply_rotary_pos_emb_interleave if self.interleaved else rope.apply_rotary_pos_emb
        q_rot, k_rot = apply(q_rot, k_rot.unsqueeze(1), cos[None], sin[None])
        w_uk, _, folded = self._kv_b(attn)
        q_lat = torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk)
        for a, b_uk, _, scaling in folded:
            q_lat = q_lat + scaling * torch.einsum("bhtn,hnr->bhtr", q_nope, b_uk) @ a
        q_abs = torch.cat([q_lat, q_rot], dim=-1).unsqueeze(1)  # [B, 1, H, T, C + rope]
        page = torch.cat([latent, k_rot], dim=-1)  # [B, 1, T, C + rope]
        q_abs, page = q_abs.reshape(*lead, *q_abs.shape[1:]), page.reshape(*lead, *page.shape[1:])
        return q_abs, page, page

    def _attend(self, attn: nn.Module, q, k, v, prefix: KVPrefix) -> torch.Tensor:
        """The latent kernel over the prefix pages and the tokens' own (k; v is the same page), then W_uv and o_proj.
        In exact mode the pages' gradient lands in the one buffer prefix.grad_k (prefix.grad_v is the same)."""
        lead, t = q.shape[:-4], q.shape[-2]
        acc = prefix.grad_k[0] if prefix.grad_k is not None else None
        out_lat = kernels.latent_prefix_attention(
            q.flatten(-4, -3), prefix.k[0], k.squeeze(-3), self.kv_lora_rank, attn.scaling, dpage_acc=acc,
            force=_FORCE[self.kernels],
        )  # fmt: skip
        return attn.o_proj(self._up(attn, out_lat).transpose(-3, -2).reshape(*lead, t, -1))

    def _up(self, attn: nn.Module, out_lat: torch.Tensor) -> torch.Tensor:
        """Per head, the attended latent [..., H, T, C] through W_uv (and its LoRA): [..., H, T, v]."""
        _, w_uv, folded = self._kv_b(attn)
        out = torch.einsum("...htc,hvc->...htv", out_lat, w_uv)
        for a, _, b_uv, scaling in folded:
            out = out + scaling * torch.einsum("...htr,hvr->...htv", out_lat @ a.T, b_uv)
        return out

    # -- the Adapter API -----------------------------------------------------------------------------------------

    def replay_graph_bytes(self, rows: int, tokens: int) -> int:
        """As QwenAdapter's, with an MLA layer's widths per token: hidden, the q and kv down-projections, the
        query heads before and after absorption (H x (nope + rope) and H x (C + rope)), the page, the attended
        latent and its up-projection (H x (C + v)), times 3 for what norms, LoRA and rope save beside them."""
        config, hd, h = self.config, self.config.hidden_size, self.num_heads
        q_down = getattr(config, "q_lora_rank", None) or 0
        attention = hd + q_down + h * (self.nope_dim + self.rope_dim) + (h + 1) * self.head_dim
        attention += h * (self.kv_lora_rank + self.v_dim)
        per_token = sum(3 * (attention + self._mlp_width(layer)) for layer in self.decoder.layers)
        return rows * tokens * (per_token + 3 * hd) * self.decoder.embed_tokens.weight.element_size()
