"""Plain-torch fused log-prob and entropy: the CPU path of `fused_logprob` and the reference its Triton kernels are
tested against.

The head runs over blocks of rows, about LOGIT_BLOCK_ELEMENTS logits each, and the backward recomputes each block's
logits from the saved lse instead of keeping them. Autograd saves hidden, weight and targets (the caller's tensors,
no copies) plus lse and entropy [T]: O(T), nothing of size T x V. At R = 256, V = 151,936 that is the difference
between ~155 MiB of fp32 logits saved per response (and as much again in the backward) and ~30 MiB transient.
"""

from __future__ import annotations

import torch

# fp32 logits per block: 2^21 = 8 MiB, i.e. 64 rows at V = 32k and 13 at V = 151,936. The forward holds about two
# such blocks (z, p), the backward about four (z, p, dz and the cast for the matmul).
LOGIT_BLOCK_ELEMENTS = 1 << 21


def check_targets(targets: torch.Tensor, V: int, ignore_index: int) -> None:
    """ValueError unless every target is in [0, V) or equals ignore_index. One host sync (two on the error path)."""
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    bad_T = (targets != ignore_index) & ((targets < 0) | (targets >= V))
    if bool(bad_T.any()):
        i = int(bad_T.nonzero()[0, 0])
        raise ValueError(
            f"targets[{i}] = {int(targets[i])} is outside [0, {V}) and is not ignore_index ({ignore_index}); "
            f"{int(bad_T.sum())} such target(s)"
        )


def fused_logprob_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch (logprob [T], entropy [T]) of softmax(hidden @ weight.T / temperature), with autograd.

    hidden [T, H], weight [V, H] (any strides), targets [T]. The matmul runs in the input dtype; the softmax and both
    outputs are in promote_types(dtype, fp32). Rows whose target == ignore_index give logprob 0 and entropy 0 and no
    gradient; any other target outside [0, V) raises ValueError (one host sync). chunk_rows: rows per block (default:
    LOGIT_BLOCK_ELEMENTS // V). dWeight is computed only when weight.requires_grad.
    """
    V = weight.shape[0]
    check_targets(targets, V, ignore_index)
    rows = chunk_rows if chunk_rows is not None else max(1, LOGIT_BLOCK_ELEMENTS // max(1, V))
    return _BlockedLogprob.apply(hidden, weight, targets, float(temperature), int(ignore_index), rows)


def _block_logp(x_C_H, w_V_H, temperature, lse_C=None):
    """log softmax(x w^T / temperature) of one block in fp32/fp64, and its lse; `lse_C` given: reuse it."""
    z_C_V = (x_C_H @ w_V_H.t()).to(torch.promote_types(x_C_H.dtype, torch.float32)) / temperature
    if lse_C is None:
        lse_C = torch.logsumexp(z_C_V, dim=-1)
    return z_C_V.sub_(lse_C[:, None]), lse_C


class _BlockedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, ignore_index, rows):
        T = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)
        logprob_T, entropy_T, lse_T = torch.zeros((3, T), dtype=acc, device=hidden.device).unbind(0)
        keep_T = targets != ignore_index
        for c0 in range(0, T, rows):
            c1 = min(c0 + rows, T)
            logp_C_V, lse_T[c0:c1] = _block_logp(hidden[c0:c1], weight, temperature)
            tgt_C = torch.where(keep_T[c0:c1], targets[c0:c1], 0).long()
            logprob_T[c0:c1] = logp_C_V.gather(-1, tgt_C[:, None]).squeeze(-1)
            entropy_T[c0:c1] = -(logp_C_V.exp() * logp_C_V).sum(-1)
            del logp_C_V
        # where, not a multiply by a 0/1 mask: a non-finite value on an ignored row would make nan (0 * inf).
        logprob_T = torch.where(keep_T, logprob_T, 0.0)
        entropy_T = torch.where(keep_T, entropy_T, 0.0)
        ctx.save_for_backward(hidden, weight, targets, lse_T, entropy_T)
        ctx.temperature, ctx.ignore_index, ctx.rows = temperature, ignore_index, rows
        ctx.set_materialize_grads(False)
        return logprob_T, entropy_T

    @staticmethod
    def backward(ctx, g_logprob, g_entropy):
        """dz = a (1[v = target] - p) - b p (log p + H), zero on ignored rows; dlogits = dz / temperature."""
        hidden, weight, targets, lse_T, entropy_T = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        if (g_logprob is None and g_entropy is None) or not (need_dx or need_dw):
            return None, None, None, None, None, None
        T, temperature, rows = hidden.shape[0], ctx.temperature, ctx.rows
        keep_T = targets != ctx.ignore_index
        dx = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_dx else None
        # fp32 accumulation across blocks; a bf16 running sum would round at every block.
        dw = torch.zeros(weight.shape, dtype=lse_T.dtype, device=weight.device) if need_dw else None
        for c0 in range(0, T, rows):
            c1 = min(c0 + rows, T)
            x_C_H = hidden[c0:c1]
            logp_C_V, _ = _block_logp(x_C_H, weight, temperature, lse_T[c0:c1])
            p_C_V = logp_C_V.exp()
            dz_C_V = torch.zeros_like(p_C_V)
            if g_logprob is not None:
                a_C = g_logprob[c0:c1, None].to(p_C_V.dtype)
                dz_C_V -= a_C * p_C_V
                tgt_C = torch.where(keep_T[c0:c1], targets[c0:c1], 0).long()
                dz_C_V.scatter_add_(-1, tgt_C[:, None], a_C)
            if g_entropy is not None:
                b_C = g_entropy[c0:c1, None].to(p_C_V.dtype)
                dz_C_V -= b_C * p_C_V * (logp_C_V + entropy_T[c0:c1, None])
            dz_C_V = torch.where(keep_T[c0:c1, None], dz_C_V / temperature, 0.0).to(hidden.dtype)
            del logp_C_V, p_C_V
            if need_dx:
                dx[c0:c1] = dz_C_V @ weight
            if need_dw:
                dw += (dz_C_V.t() @ x_C_H).to(dw.dtype)
        return dx, (dw.to(weight.dtype) if need_dw else None), None, None, None, None
