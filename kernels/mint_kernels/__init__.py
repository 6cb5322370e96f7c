"""Triton kernels for LongStraw, installed as `mint_kernels` (never as a top-level `kernels`).

Each kernel has Triton kernels, launchers, an autograd.Function and a plain-torch `*_reference` that is also the CPU
path: one implementation per op on CPU, memory-lean (nothing of size P or T x V saved for backward), and the one the
Triton kernels are tested against. The files are split by job to stay under ~450 lines each: prefix_attention.py (API,
launchers, Function), _prefix_attention_triton.py (@triton.jit kernels), _prefix_attention_reference.py;
fused_logprob.py (API, launchers, Function, kernels), _fused_logprob_reference.py; expert_lora.py (API, launchers,
Function), _expert_lora_triton.py (@triton.jit kernels), _expert_lora_reference.py; latent_attention.py (API,
launchers, Function), _latent_attention_triton.py (@triton.jit kernels), _latent_attention_reference.py. Imports
here are torch and triton only. Callers use the functions below; nothing outside this package calls
`Function.apply` or imports triton.

    prefix_attention(q, k_prefix, v_prefix, k_resp, v_resp, scale=None, *, dk_prefix_acc=None,
                     dv_prefix_acc=None, return_lse=False, force=None) -> out (, lse)
        q [B?, H_q, R, D]; prefix K/V [H_kv, P, D] or [B, H_kv, P, D], P >= 0; response K/V [B?, H_kv, R, D]; any
        strides. Response queries over the prefix, then causal over the response; never concatenates K/V. Prefix
        dK/dV are added into the fp32 buffers when given (exact mode; views of a larger buffer are fine) and skipped
        otherwise (detached mode). The CPU path saves nothing of size P for backward.

    latent_prefix_attention(q, pages, own_pages, latent_dim, scale, *, dpage_acc=None, return_lse=False,
                            force=None) -> out (, lse)
        MLA in absorbed form. q [B?, H, R, D_k]; pages [P, D_k] shared by the batch, P >= 0; own_pages [B?, R, D_k];
        any strides. Key j = page j, value j = page j[:latent_dim]; causal over the own pages; out [B?, H, R, D_v].
        One page head serves all H query heads and is never expanded. The prefix pages' whole gradient (key part plus
        value part) is added into the one fp32 [P, D_k] buffer dpage_acc when given, skipped otherwise. The CPU path
        saves nothing of size P for backward.

    fused_logprob(hidden, weight, targets, temperature=1.0, *, ignore_index=-100, force=None) -> (logprob, entropy)
        hidden [T, H]; weight [V, H]; targets [T] -> fp32 [T], [T]. Never materializes [T, V] logits; no weight
        gradient unless weight.requires_grad. targets == ignore_index give 0 and no gradient; other targets outside
        [0, V) raise ValueError.

    expert_lora(x_N_H, A_E_R_H, B_E_O_R, offsets_E1, scaling, *, force=None) -> y_N_O
        x [N, H] routed rows sorted by expert; A [E, r, H]; B [E, O, r]; offsets int64 [E + 1] (segment e = rows
        offsets[e]:offsets[e+1]); any strides. y[n] = scaling * B_e (A_e x[n]) in x's dtype, fp32 accumulation;
        gradients to x, A, B. Never forms B_e @ A_e or any [E, O, H] tensor; saves the [N, r] x A_e^T for backward.

    sparse_latent_attention(q, pages, own_pages, index, latent_dim, scale, *, dpage_acc=None,
                            return_lse=False) -> out (, lse)
        DSA: latent_prefix_attention's pages, but each query token attends only to its selected keys. index int
        [B?, R, K]: positions in [pages; own_pages], -1 = empty slot (causal, distinct: the caller's guarantee).
        Plain torch on every device (no Triton kernel), blocked over query tokens; the selected prefix rows' gradient
        is scatter-added into dpage_acc when given. Saves nothing of size P for backward.

    fp8_block_matmul(x, q, s, block, *, transpose=True, force=None) -> y
        x [..., K] @ W^T with W = q (float8 e4m3 [O, K]) times its fp32 block scales s, dequantized tile by tile in
        the GEMM (transpose=False: x [..., O] @ W, the dX of a frozen FP8 linear). No autograd of its own.

Dispatch: CUDA tensors -> Triton, CPU tensors -> reference; force="triton" | "reference" overrides. See
docs/kernels.md for the math, the tiling and how to test and benchmark.
"""

from mint_kernels.expert_lora import expert_lora, expert_lora_reference
from mint_kernels.fp8_matmul import fp8_block_matmul, fp8_block_matmul_reference
from mint_kernels.fused_logprob import fused_logprob, fused_logprob_reference
from mint_kernels.latent_attention import latent_prefix_attention, latent_prefix_attention_reference
from mint_kernels.prefix_attention import prefix_attention, prefix_attention_reference
from mint_kernels.sparse_latent_attention import sparse_latent_attention

__all__ = [
    "expert_lora",
    "expert_lora_reference",
    "fp8_block_matmul",
    "fp8_block_matmul_reference",
    "fused_logprob",
    "fused_logprob_reference",
    "latent_prefix_attention",
    "latent_prefix_attention_reference",
    "prefix_attention",
    "prefix_attention_reference",
    "sparse_latent_attention",
]
