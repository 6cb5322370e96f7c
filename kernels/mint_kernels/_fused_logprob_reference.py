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


def _block_logits(x_C_H, w_V_H, temperature):
    """z = x w^T / temperature of one block, in promote_types(dtype, fp32): the block's only [C, V] allocation."""
    z_C_V = (x_C_H @ w_V_H.t()).to(torch.promote_types(x_C_H.dtype, torch.float32))
    return z_C_V.div_(temperature) if temperature != 1.0 else z_C_V


class _BlockedLogprob(torch.autograd.Function):
    # Every [C, V] operation below is in place on one of at most two block buffers (z and p): at R = 128,
    # V = 32,000 the scoring peak went from 39.7 MiB (out-of-place softmax, exp and products) to about two blocks.

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, ignore_index, rows):
        T = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)
        logprob_T, entropy_T, lse_T = torch.zeros((3, T), dtype=acc, device=hidden.device).unbind(0)
        keep_T = targets != ignore_index
        for c0 in range(0, T, rows):
            c1 = min(c0 + rows, T)
            z_C_V = _block_logits(hidden[c0:c1], weight, temperature)
            max_C = z_C_V.amax(-1)
            z_C_V.sub_(max_C[:, None])  # shifted logits, max 0
            p_C_V = z_C_V.exp()  # unnormalized probabilities
            log_sum_C = p_C_V.sum(-1).log()
            tgt_C = torch.where(keep_T[c0:c1], targets[c0:c1], 0).long()
            lse_T[c0:c1] = max_C + log_sum_C
            logprob_T[c0:c1] = z_C_V.gather(-1, tgt_C[:, None]).squeeze(-1) - log_sum_C
            # H = -sum q log q with q = p / S and log q = z - log S:  H = log S - sum(p z) / S.
            entropy_T[c0:c1] = log_sum_C - p_C_V.mul_(z_C_V).sum(-1) / log_sum_C.exp()
            del z_C_V, p_C_V
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
            logp_C_V = _block_logits(x_C_H, weight, temperature).sub_(lse_T[c0:c1, None])
            if g_entropy is not None:
                b_C = g_entropy[c0:c1, None].to(logp_C_V.dtype)
                p_C_V = logp_C_V.exp()
                dz_C_V = logp_C_V.add_(entropy_T[c0:c1, None]).mul_(p_C_V).mul_(-b_C)  # -b p (log p + H)
                if g_logprob is not None:
                    dz_C_V.sub_(p_C_V.mul_(g_logprob[c0:c1, None].to(dz_C_V.dtype)))  # - a p
                del p_C_V
            else:
                dz_C_V = logp_C_V.exp_().mul_(-g_logprob[c0:c1, None].to(logp_C_V.dtype))  # - a p
            if g_logprob is not None:
                tgt_C = torch.where(keep_T[c0:c1], targets[c0:c1], 0).long()
                dz_C_V.scatter_add_(-1, tgt_C[:, None], g_logprob[c0:c1, None].to(dz_C_V.dtype))  # + a 1[target]
            dz_C_V.masked_fill_(~keep_T[c0:c1, None], 0.0)
            if temperature != 1.0:
                dz_C_V.div_(temperature)
            dz_C_V = dz_C_V.to(hidden.dtype)
            if need_dx:
                dx[c0:c1] = dz_C_V @ weight
            if need_dw:
                dw += (dz_C_V.t() @ x_C_H).to(dw.dtype)
            del dz_C_V
        return dx, (dw.to(weight.dtype) if need_dw else None), None, None, None, None
