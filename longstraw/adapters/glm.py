"""GLM-4.5-class decoders (`glm4_moe`: GLM-4.5, GLM-4.5-Air) in transformers 5.x.

What differs from the Qwen families, all in `Glm4MoeAttention` and `Glm4MoeDecoderLayer`:

- head_dim is its own setting (GLM-4.5-Air: 96 heads x 128 = 12288 against hidden 4096), read from the module.
- q/k/v projections may carry a bias (`attention_bias`); o_proj has none. The projections are called as modules, so
  the bias and PEFT LoRA are both live.
- q/k RMSNorm on the head dim only when `use_qk_norm`, before RoPE as in Qwen3.
- Partial RoPE (`partial_rotary_factor`, 0.5 by default): the model's rotary module returns cos/sin over the first
  rotary_dim = head_dim * factor dims; those are rotated (rotate-half within that slice) and the rest pass through.
- Layers below `first_k_dense_replace` have a dense MLP; the others a `Glm4MoeMoE` block (routed experts picked by
  the sigmoid router, plus an ungated shared expert). Both are called as the layer's own `mlp` module, which is
  what `QwenAdapter._mlp` does, so router hooks (R3) and expert LoRA stay live.

Everything else (the capture / replay / prompt-backward machinery and the attention through
`mint_kernels.prefix_attention`) is `QwenAdapter`'s, inherited unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from longstraw.adapters.qwen import QwenAdapter, _rotate_half

FAMILIES = ("glm4_moe",)


class GlmAdapter(QwenAdapter):
    families = FAMILIES

    def _head_dim(self, config) -> int:
        # As Glm4MoeAttention resolved it: config.head_dim, else hidden / heads (GLM-4.5-Air: 128, not 4096 / 96).
        return self.decoder.layers[0].self_attn.head_dim

    def _uses_qk_norm(self, config) -> bool:
        return bool(self.decoder.layers[0].self_attn.use_qk_norm)

    def _qkv(self, attn: nn.Module, x_T_Hd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [..., H_kv, G, T, D], k/v [..., H_kv, T, D] for normed inputs x [..., T, Hd]: optional q/k norm (and the
        projections' bias, live through the modules), then partial RoPE.

        cos/sin are [T, rotary_dim] with rotary_dim <= head_dim (Glm4MoeRotaryEmbedding builds them for the rotated
        part only); as in transformers' `apply_rotary_pos_emb`, dims [0, rotary_dim) rotate and the rest pass through.
        """
        q, k, v = self._projections(attn, x_T_Hd)
        q, k = _partial_rope(q, cos, sin), _partial_rope(k, cos, sin)
        return q.unflatten(-3, (self.num_kv_heads, self.groups)), k, v


def _partial_rope(x_H_T_D: torch.Tensor, cos_T_R: torch.Tensor, sin_T_R: torch.Tensor) -> torch.Tensor:
    """RoPE on the first R dims of the head dim: x[..., :R] * cos + rotate_half(x[..., :R]) * sin; x[..., R:] as is."""
    rotary = cos_T_R.shape[-1]
    x_rot, x_pass = x_H_T_D[..., :rotary], x_H_T_D[..., rotary:]
    return torch.cat([x_rot * cos_T_R + _rotate_half(x_rot) * sin_T_R, x_pass], dim=-1)
