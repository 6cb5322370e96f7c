"""Token scoring shared by rollout and learner.

Both sides must agree on what "the logprob of a sampled token" means, or the PPO ratio and every mismatch metric is
biased from step one. The convention here: the policy at temperature T is softmax(logits / T); top-p truncation is a
sampling device and is not part of the scored policy (the same choice vLLM and verl make for reported logprobs).
"""

import torch


def token_logprobs(logits_T_V: torch.Tensor, targets_T: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target] per position, computed in fp32.

    logits_T_V: [..., V] any float dtype; targets_T: [...] int64. Returns [...] float32.
    fp32 here because bf16 log-softmax over V=151k loses about 1e-2 nats, which is the size of the signal.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
    logits = logits_T_V.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets_T.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
