"""Latent prefix attention: multi-head latent attention (MLA) in absorbed form over one shared page head.

MLA caches per token one page [c, k_r]: the latent c (D_v = kv_lora_rank wide) and the RoPE key k_r, D_k = D_v + rope
wide (576 at DeepSeek-V3's dims). In absorbed form every query head attends to the pages directly: the key is the whole
page, the value its latent. prefix_attention can run that with one K/V head of width D_k by passing the pages as both
key and value, but then it computes a D_k-wide output (the rope columns are dropped afterwards) and, in exact mode,
keeps two fp32 [P, D_k] gradient buffers. This kernel reads values as the first D_v columns of the pages (no copy),
writes a D_v-wide output, and adds the pages' whole gradient (key part plus value part) into ONE fp32 buffer.

Math (per row i = one query head at one response token; s_ij = scale * q_i . page_j over the P prefix pages and then
own pages 0..t(i)):

    LSE_i = log sum_j exp(s_ij)        O_i = sum_j exp(s_ij - LSE_i) page_j[:D_v]

Backward (P_ij = exp(s_ij - LSE_i), D_i = rowsum(dO_i * O_i) - dLSE_i, dS_ij = P_ij (dO_i . page_j[:D_v] - D_i)):

    dQ_i = scale sum_j dS_ij page_j        dPage_j = scale sum_i dS_ij q_i + [sum_i P_ij dO_i, 0]

The sums over i run over every head and, for the shared prefix, every batch row. The H heads are one query group of
the single page head (H up to 128): the kernels take BLOCK_M rows across heads, so a page tile is read once for all of
them, and pages are never expanded per head.

Tensors: q [B, H, R, D_k] or [H, R, D_k]; pages [P, D_k] (shared by every batch row), P >= 0; own_pages [B, R, D_k]
or [R, D_k] (batch present iff q has it). Any strides.

Files: this one holds the public API, the launchers and the autograd.Function; _latent_attention_triton.py the
@triton.jit kernels; _latent_attention_reference.py the blocked plain-torch version, which is also the CPU path.
"""

from __future__ import annotations

import torch
import triton

from mint_kernels._dispatch import check_launchable, use_triton
from mint_kernels._latent_attention_reference import latent_prefix_attention_reference
from mint_kernels._latent_attention_triton import (
    LOG2E,
    _latent_bwd_delta_kernel,
    _latent_bwd_dpage_kernel,
    _latent_bwd_dq_kernel,
    _latent_fwd_kernel,
)

__all__ = ["latent_prefix_attention", "latent_prefix_attention_reference"]


# --------------------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------------------


def _blocks(device: torch.device, dpage: bool = False) -> dict:
    """Tiles: BLOCK_DK is the column chunk of the q . k / dO . v loops, BLOCK_DO the output column chunk a program
    owns. Under the interpreter small tiles keep the numpy work per program low (and make D span several chunks)."""
    if device.type == "cpu":
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_DK=16, BLOCK_DO=16, num_warps=4, num_stages=1)
    # Not timed: no GPU was available. Chosen by compiling for sm_90 (Triton 3.9, bf16) and reading each kernel's
    # local stack with cuobjdump -res-usage, once, by hand: 64 x 64 tiles with a 256-wide output chunk spilled
    # 1.7-2.2 KB a thread; these spill 0-0.1 KB (forward 112 B, dQ 0, dPage 120 B). The forward takes two column
    # programs for D_v = 512, dQ three for D_k = 576, dPage (its q and dO chunks are [BLOCK_M, BLOCK_DO] tiles) five;
    # each column program recomputes the scores.
    if dpage:
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_DK=64, BLOCK_DO=128, num_warps=8, num_stages=2)
    return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_DK=64, BLOCK_DO=256, num_warps=8, num_stages=2)


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs would default to tf32 on the GPU (~1e-3 error); ieee keeps fp32 runs comparable to the reference.
    return "ieee" if dtype == torch.float32 else "tf32"


def _forward(q, pages, own, dv, scale):
    """q [B, H, R, D_k], pages [P, D_k], own [B, R, D_k] -> out [B, H, R, D_v], lse fp32 [B, R * H] (token-major)."""
    B, H, R, Dk = q.shape
    P = pages.shape[0]
    out = torch.empty((B, H, R, dv), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, R * H), device=q.device, dtype=torch.float32)
    check_launchable(_latent_fwd_kernel, q.device)
    cfg = _blocks(q.device)
    grid = (triton.cdiv(R * H, cfg["BLOCK_M"]), triton.cdiv(dv, cfg["BLOCK_DO"]), B)
    _latent_fwd_kernel[grid](
        q, pages, own, out, lse, *q.stride(), *pages.stride(), *own.stride(), *out.stride(),
        H, P, R, Dk, dv, scale * LOG2E.value, PRECISION=_precision(q.dtype), **cfg,
    )  # fmt: skip
    return out, lse


def _backward(q, pages, own, out, lse, do, dlse, scale, dpage_acc, need_dq, need_down):
    """Returns dq, d_own (None where not needed); adds the prefix pages' gradient into dpage_acc when given."""
    B, H, R, Dk = q.shape
    P, dv = pages.shape[0], out.shape[-1]
    cfg = _blocks(q.device)
    prec = _precision(q.dtype)
    for kernel in (_latent_bwd_delta_kernel, _latent_bwd_dq_kernel, _latent_bwd_dpage_kernel):
        check_launchable(kernel, q.device)
    rows = triton.cdiv(R * H, cfg["BLOCK_M"])
    delta = torch.empty((B, R * H), device=q.device, dtype=torch.float32)
    _latent_bwd_delta_kernel[(rows, B)](
        out, do, dlse if dlse is not None else delta, delta, *out.stride(), *do.stride(), H, R, dv,
        HAS_DLSE=dlse is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_DK=cfg["BLOCK_DK"],
    )  # fmt: skip
    dq = down = None
    if need_dq:
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        _latent_bwd_dq_kernel[(rows, triton.cdiv(Dk, cfg["BLOCK_DO"]), B)](
            q, pages, own, do, lse, delta, dq,
            *q.stride(), *pages.stride(), *own.stride(), *do.stride(), *dq.stride(),
            H, P, R, Dk, dv, scale, scale * LOG2E.value, PRECISION=prec, **cfg,
        )  # fmt: skip
    cfg = _blocks(q.device, dpage=True)
    cols = triton.cdiv(Dk, cfg["BLOCK_DO"])
    if need_down:
        down = torch.empty_like(own, memory_format=torch.contiguous_format)
        _latent_bwd_dpage_kernel[(triton.cdiv(R, cfg["BLOCK_N"]), cols, B)](
            q, own, do, lse, delta, down, *q.stride(), *own.stride(), *do.stride(), *down.stride(),
            H, R, R, Dk, dv, 1, scale, scale * LOG2E.value, CAUSAL=True, ACCUMULATE=False, PRECISION=prec, **cfg,
        )  # fmt: skip
    if dpage_acc is not None and P > 0:
        # The batch rows share the prefix: one program sums its tile's gradient over them (BATCH_LOOP = B), no atomics.
        _latent_bwd_dpage_kernel[(triton.cdiv(P, cfg["BLOCK_N"]), cols, 1)](
            q, pages, do, lse, delta, dpage_acc, *q.stride(), 0, *pages.stride(), *do.stride(), 0, *dpage_acc.stride(),
            H, P, R, Dk, dv, B, scale, scale * LOG2E.value, CAUSAL=False, ACCUMULATE=True, PRECISION=prec, **cfg,
        )  # fmt: skip
    return dq, down


class LatentPrefixAttentionFunction(torch.autograd.Function):
    """autograd wrapper of the Triton kernels; q is 4-D, own 3-D, pages 2-D here.

    Saved for backward: q, own, out, lse (O(R)). The pages and the buffer are held by reference on ctx, as in the
    reference: the pages are the caller's live state and must not change before backward.
    """

    @staticmethod
    def forward(ctx, q, pages, own, dv, scale, dpage_acc):
        out, lse = _forward(q, pages, own, dv, scale)
        ctx.save_for_backward(q, own, out, lse)
        ctx.prefix = (pages, dpage_acc)
        ctx.scale = scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, own, out, lse = ctx.saved_tensors
        pages, dpage_acc = ctx.prefix
        if do is None:  # only the LSE was used downstream
            do = torch.zeros_like(out)
        # Pages that require grad and no caller buffer: an fp32 scratch whose result goes to autograd.
        autograd_prefix = dpage_acc is None and ctx.needs_input_grad[1]
        if autograd_prefix:
            dpage_acc = torch.zeros(pages.shape, device=q.device, dtype=torch.float32)
        dq, down = _backward(
            q, pages, own, out, lse, do, None if dlse is None else dlse.contiguous(), ctx.scale, dpage_acc,
            need_dq=ctx.needs_input_grad[0], need_down=ctx.needs_input_grad[2],
        )  # fmt: skip
        dpages = dpage_acc.to(pages.dtype) if autograd_prefix else None
        return dq, dpages, down, None, None, None


# --------------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------------


def _check(q, pages, own, latent_dim, dpage_acc) -> None:
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [H, R, D_k] or [B, H, R, D_k], got {tuple(q.shape)}")
    if own.dim() != q.dim() - 1:
        raise ValueError(f"own_pages must be [B?, R, D_k] with q's batch, got {tuple(own.shape)}")
    if pages.dim() != 2:
        raise ValueError(f"pages must be [P, D_k] (shared by the batch rows), got {tuple(pages.shape)}")
    R, Dk = q.shape[-2:]
    if own.shape[-2:] != (R, Dk) or (q.dim() == 4 and own.shape[0] != q.shape[0]) or pages.shape[1] != Dk:
        raise ValueError(f"q {tuple(q.shape)}, pages {tuple(pages.shape)}, own_pages {tuple(own.shape)} disagree")
    if not 0 < latent_dim <= Dk:
        raise ValueError(f"latent_dim must be in [1, D_k={Dk}], got {latent_dim}")
    if R < 1:
        raise ValueError("the response must have at least one token")
    if pages.dtype != q.dtype or own.dtype != q.dtype:
        raise ValueError(f"q, pages and own_pages must share a dtype, got {q.dtype}, {pages.dtype}, {own.dtype}")
    if dpage_acc is not None and (
        dpage_acc.dtype != torch.float32 or dpage_acc.shape != pages.shape or dpage_acc.device != q.device
    ):
        raise ValueError(f"dpage_acc must be fp32 with pages' shape {tuple(pages.shape)} on {q.device}")


def latent_prefix_attention(
    q: torch.Tensor,
    pages: torch.Tensor,
    own_pages: torch.Tensor,
    latent_dim: int,
    scale: float,
    *,
    dpage_acc: torch.Tensor | None = None,
    return_lse: bool = False,
    force: str | None = None,
):
    """MLA in absorbed form: every head attends to the shared prefix pages, then causally to the own pages.

    Shapes (any strides):
        q           [H, R, D_k] or [B, H, R, D_k], R >= 1; the absorbed queries (latent part, then rope part)
        pages       [P, D_k], P >= 0: the prefix, one page per token (latent c of width latent_dim, then rope key),
                    shared by every batch row
        own_pages   [R, D_k] or [B, R, D_k] (batch present iff q has it): the response tokens' own pages
        latent_dim  D_v: a page's first D_v columns are its value
        returns     out [B?, H, R, D_v] in q's dtype (contiguous); with return_lse=True also lse [B?, H, R] (natural
                    log), fp32 (fp64 for fp64 inputs on the reference path)

    Key j is page j (all D_k columns), value j its first D_v columns. Query token i sees every prefix page and own
    pages 0..i. scale has no default: pass the module's (MLA's includes the YaRN mscale).

    Gradients: q and own_pages get theirs through autograd (a page's key and value parts summed). The prefix's is
    computed only when asked: pass an fp32 [P, D_k] buffer dpage_acc (a view such as grad[layer, :P] is fine; nothing
    outside it is written) and backward ADDS the pages' whole gradient into it; autograd then sees none. Without it,
    constant pages cost nothing and pages that require grad get their gradient through autograd.

    Dispatch: CUDA tensors run the Triton kernels, CPU tensors latent_prefix_attention_reference (blocked over keys,
    saves nothing of size P); force="triton" or "reference" overrides (Triton on CPU tensors needs TRITON_INTERPRET=1
    set before triton is imported).
    """
    _check(q, pages, own_pages, latent_dim, dpage_acc)
    if not use_triton(q, force):
        return latent_prefix_attention_reference(
            q, pages, own_pages, latent_dim, scale, dpage_acc=dpage_acc, return_lse=return_lse
        )
    if dpage_acc is not None:  # the buffer takes the prefix gradient, not autograd
        pages = pages.detach()
    batched = q.dim() == 4
    q4, own3 = (q, own_pages) if batched else (q.unsqueeze(0), own_pages.unsqueeze(0))
    out, lse = LatentPrefixAttentionFunction.apply(q4, pages, own3, int(latent_dim), float(scale), dpage_acc)
    B, H, R = q4.shape[:3]
    lse = lse.view(B, R, H).transpose(1, 2)  # the kernels' token-major rows, as [B, H, R]
    if not batched:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out
