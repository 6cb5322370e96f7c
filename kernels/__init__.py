"""Triton kernels for LongStraw, installed as `longstraw.kernels` (never as a top-level `kernels`).

Each kernel is one file holding the Triton kernel(s), the launcher, the autograd.Function and a plain-torch
`*_reference` that is also the CPU path. Imports here are torch and triton only. Callers use the functions below;
nothing outside this package calls `Function.apply` or imports triton.

    prefix_attention(q, k_prefix, v_prefix, k_resp, v_resp, scale=None, *, dk_prefix_acc=None,
                     dv_prefix_acc=None, return_lse=False, force=None) -> out (, lse)
        q [B?, H_q, R, D]; prefix K/V [H_kv, P, D] or [B, H_kv, P, D]; response K/V [B?, H_kv, R, D].
        Response queries over the prefix, then causal over the response; never concatenates K/V. Prefix dK/dV are
        added into the fp32 buffers when given (exact mode) and skipped otherwise (detached mode).

    fused_logprob(hidden, weight, targets, temperature=1.0, *, force=None) -> (logprob, entropy)
        hidden [T, H]; weight [V, H]; targets [T] -> fp32 [T], [T]. Never materializes [T, V] logits; no weight
        gradient unless weight.requires_grad.

Dispatch: CUDA tensors -> Triton, CPU tensors -> reference; force="triton" | "reference" overrides. See
docs/kernels.md for the math, the tiling and how to test and benchmark.
"""

from longstraw.kernels.fused_logprob import fused_logprob, fused_logprob_reference
from longstraw.kernels.prefix_attention import prefix_attention, prefix_attention_reference

__all__ = ["fused_logprob", "fused_logprob_reference", "prefix_attention", "prefix_attention_reference"]
