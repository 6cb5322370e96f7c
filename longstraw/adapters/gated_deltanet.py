"""A Gated DeltaNet layer (the linear attention of Qwen3.5 and Qwen3-Next) run from a recurrent boundary state.

The layer is transformers' own module; this runs its pieces so that a call can start where a prefix ended:

    in_proj -> causal depthwise conv1d (kernel K) -> SiLU -> q, k, v; beta = sigmoid(b), g = -exp(A_log) softplus(a
    + dt_bias) -> chunked gated delta rule with initial state S -> gated RMSNorm with z -> out_proj

The conv reads the K - 1 pre-conv rows before a call's first token: the window. With S and the window of the
positions before `start`, a call over positions start .. start + T - 1 is exactly the full-sequence layer there (a
fresh sequence starts from zeros, as the conv's zero padding and the rule's zero state do). A call returns the
state after its last token, so prefill can go chunk by chunk and a replay can continue a captured prompt.

Gradients into a prefix state (exact mode) land in fp32 buffers through `IntoBuffer`: d(loss)/dS and
d(loss)/dWindow, summed over a micro-batch's rows, which all start from the one state.

The delta rule itself: flash-linear-attention's chunked kernel on CUDA when installed (optional GPU extra,
imported lazily; it returns the initial state's gradient), else the family's own torch implementation in
transformers (CPU, and the reference the kernel is checked against).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from longstraw.adapters.base import IntoBuffer
from longstraw.errors import LongStrawError


class DeltaNetPrefix(NamedTuple):
    """One linear layer's view of the prefix state: s [H_v, d_k, d_v] fp32 and window [conv_dim, K - 1], and in
    exact mode the fp32 buffers their gradients are added into (None otherwise)."""

    s: torch.Tensor
    window: torch.Tensor
    grad_s: torch.Tensor | None = None
    grad_window: torch.Tensor | None = None


class DeltaNetDims(NamedTuple):
    key_heads: int
    value_heads: int
    key_dim: int  # d_k per head
    value_dim: int  # d_v per head
    conv_dim: int  # channels of the conv: 2 H_k d_k + H_v d_v
    width: int  # K - 1 pre-conv rows of window

    @classmethod
    def of(cls, attn: nn.Module) -> DeltaNetDims:
        return cls(
            attn.num_k_heads, attn.num_v_heads, attn.head_k_dim, attn.head_v_dim, attn.conv_dim,
            attn.conv_kernel_size - 1,
        )  # fmt: skip

    def state_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one layer's boundary state: S in fp32 plus the window in the model's dtype."""
        return self.value_heads * self.key_dim * self.value_dim * 4 + self.conv_dim * self.width * dtype_bytes


def is_deltanet(layer: nn.Module) -> bool:
    return hasattr(layer, "linear_attn")


def _projections(attn: nn.Module, x_B_T_Hd: torch.Tensor):
    """Pre-conv q|k|v rows [B, T, conv_dim], z [B, T, H_v, d_v], b and a [B, T, H_v], by the family's projections."""
    b_, t = x_B_T_Hd.shape[:2]
    if hasattr(attn, "in_proj_qkvz"):  # Qwen3-Next: two fused projections grouped by key head
        q, k, v, z, b, a = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(x_B_T_Hd), attn.in_proj_ba(x_B_T_Hd))
        mixed = torch.cat([q.reshape(b_, t, -1), k.reshape(b_, t, -1), v.reshape(b_, t, -1)], dim=-1)
        return mixed, z, b, a
    z = attn.in_proj_z(x_B_T_Hd).reshape(b_, t, -1, attn.head_v_dim)
    return attn.in_proj_qkv(x_B_T_Hd), z, attn.in_proj_b(x_B_T_Hd), attn.in_proj_a(x_B_T_Hd)


def _delta_rule(attn: nn.Module, device: torch.device, force: str | None):
    """The chunked gated delta rule: flash-linear-attention's kernel or the family's torch implementation."""
    if force == "reference" or (force is None and device.type != "cuda"):
        return sys.modules[type(attn).__module__].torch_chunk_gated_delta_rule
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        if force is None:  # auto on CUDA without the extra: the torch path still computes the same thing
            return sys.modules[type(attn).__module__].torch_chunk_gated_delta_rule
        raise LongStrawError(
            "Gated DeltaNet kernels were asked for (kernels=on) but flash-linear-attention is not installed; "
            "install the gpu extra (pip install 'mint[gpu]')"
        ) from exc

    def fla_rule(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        heads = v.shape[-2]
        if q.shape[-2] != heads:  # grouped values: each q/k head serves consecutive value heads
            q, k = (x.repeat_interleave(heads // x.shape[-2], dim=-2) for x in (q, k))
        # The kernel reads the state by its own strides: a micro-batch's broadcast view becomes real rows.
        initial_state = initial_state.float().contiguous() if initial_state is not None else None
        return chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )  # fmt: skip

    return fla_rule


def _segment(attn, rule, mixed, z, b, a, s0, w0, state_only: bool):
    """The layer over one run of positions from state (s0, w0); returns (out or None, s_end, window_end)."""
    rows, t, channels = mixed.shape
    if w0.dim() == 2:
        w0 = w0.expand(rows, *w0.shape)
    if s0.dim() == 3:
        s0 = s0.expand(rows, *s0.shape)
    weight = attn.conv1d.weight  # [conv_dim, 1, K]
    rows_C_W = torch.cat([w0.to(mixed.dtype), mixed.transpose(1, 2)], dim=-1)  # the window, then this run's rows
    conv = F.conv1d(rows_C_W.to(weight.dtype), weight, attn.conv1d.bias, groups=channels).to(mixed.dtype)
    conv = ACT2FN[attn.activation](conv).transpose(1, 2)  # [B, T, conv_dim]
    window_end = rows_C_W[..., rows_C_W.shape[-1] - w0.shape[-1] :]
    kd, vd = attn.key_dim, attn.value_dim
    q = conv[..., :kd].reshape(rows, t, -1, attn.head_k_dim)
    k = conv[..., kd : 2 * kd].reshape(rows, t, -1, attn.head_k_dim)
    v = conv[..., 2 * kd : 2 * kd + vd].reshape(rows, t, -1, attn.head_v_dim)
    beta = b.sigmoid()
    g = -attn.A_log.float().exp() * F.softplus(a.float() + attn.dt_bias)
    core, s_end = rule(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if state_only:
        return None, s_end, window_end
    core = attn.norm(core.reshape(-1, attn.head_v_dim), z.reshape(-1, attn.head_v_dim))
    return attn.out_proj(core.reshape(rows, t, -1)), s_end, window_end


def deltanet(
    attn: nn.Module,
    x_T_Hd: torch.Tensor,
    prefix: DeltaNetPrefix,
    constant_rows: int,
    force: str | None,
    state_only: bool = False,
):
    """The layer's output over normed inputs x [..., T, Hd] ([T, Hd] or [B, T, Hd]) starting from `prefix`, and the
    state after the last token: (out like x or None when state_only, s_end [B?, H_v, d_k, d_v], window_end [B?,
    conv_dim, K - 1]). The leading batch dim of the results matches x's.

    constant_rows: the state after the first rows is a constant (detached mode's last prompt position): those rows'
    own outputs are live, and the rows after them start from that state detached.
    """
    single = x_T_Hd.dim() == 2
    x = x_T_Hd.unsqueeze(0) if single else x_T_Hd
    mixed, z, b, a = _projections(attn, x)
    rule = _delta_rule(attn, x.device, force)
    s0, w0 = prefix.s, prefix.window
    if prefix.grad_s is not None:
        anchor = torch.empty(0, requires_grad=True)  # puts the taps in the graph whatever else needs a gradient
        s0 = IntoBuffer.apply(anchor, s0, prefix.grad_s)
        w0 = IntoBuffer.apply(anchor, w0, prefix.grad_window)
    t = x.shape[1]
    if 0 < constant_rows < t:
        c = constant_rows
        out_c, s_c, w_c = _segment(attn, rule, mixed[:, :c], z[:, :c], b[:, :c], a[:, :c], s0, w0, False)
        parts = (mixed[:, c:], z[:, c:], b[:, c:], a[:, c:])
        out, s_end, w_end = _segment(attn, rule, *parts, s_c.detach(), w_c.detach(), state_only)
        if out is not None:
            out = torch.cat([out_c, out], dim=1)
    else:
        out, s_end, w_end = _segment(attn, rule, mixed, z, b, a, s0, w0, state_only)
    if single:
        return (out[0] if out is not None else None), s_end[0], w_end[0]
    return out, s_end, w_end
