"""Token logprobs straight from final hidden states, without keeping [T, V] logits for backward.

Same math as `longstraw.scoring.token_logprobs(lm_head(hidden), targets, T)`: log softmax(logits / T)[target] in
fp32 with logits in the head's dtype, but the head runs over row blocks and the backward recomputes each block's
logits instead of saving them. What is saved is hidden_T_Hd; the transient is one block of rows x V in fp32. At
R=256, V=151k that is the difference between ~155 MiB per response saved for backward (plus as much again in
the backward) and ~16 MiB transient.
"""

from __future__ import annotations

import torch
from torch import nn

from longstraw.scoring import token_logprobs

# Elements of one block's fp32 logits: 2^21 = 8 MiB, i.e. 65 rows at V=32k, 13 rows at V=151k.
LOGIT_BLOCK_ELEMENTS = 1 << 21


def head_logprobs(hidden_T_Hd: torch.Tensor, head: nn.Module, targets_T: torch.Tensor, temperature: float):
    """logp_T [T] fp32 of targets under softmax(head(hidden) / temperature).

    Falls back to the plain path (logits kept) when the head is not a frozen nn.Linear, e.g. LoRA on lm_head.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
    if type(head) is not nn.Linear or any(p.requires_grad for p in head.parameters()):
        return token_logprobs(head(hidden_T_Hd), targets_T, temperature)
    rows = max(1, LOGIT_BLOCK_ELEMENTS // head.out_features)
    return _HeadLogprobs.apply(hidden_T_Hd, head.weight, head.bias, targets_T, temperature, rows)


def _block_logits(h, weight, bias, temperature):
    logits = nn.functional.linear(h, weight, bias).float()
    return logits / temperature if temperature != 1.0 else logits


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, rows):
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            logits = _block_logits(hidden[start : start + rows], weight, bias, temperature)
            picked = logits.gather(-1, targets[start : start + rows, None]).squeeze(-1)
            out[start : start + rows] = picked - torch.logsumexp(logits, dim=-1)
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx, grad_T):
        hidden, weight, bias, targets = ctx.saved_tensors
        temperature, rows = ctx.temperature, ctx.rows
        grad_hidden = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], rows):
            end = min(start + rows, hidden.shape[0])
            # d logp / d logits = (onehot(target) - softmax) / T
            dlogits = torch.softmax(_block_logits(hidden[start:end], weight, bias, temperature), dim=-1).neg_()
            dlogits[torch.arange(end - start, device=dlogits.device), targets[start:end]] += 1.0
            dlogits *= grad_T[start:end, None] / temperature
            grad_hidden[start:end] = dlogits.to(weight.dtype) @ weight
            del dlogits
        return grad_hidden, None, None, None, None, None
