"""A padded LM head (real Qwen checkpoints: 151,936 rows for 151,669 tokens): padding ids are never sampled, and the
rollout engine and LongStraw score over the same cut vocabulary."""

from __future__ import annotations

import torch
from conftest import load_fp32

from longstraw.engine import UpdateSpec, grpo_update
from longstraw.scoring import token_logprobs
from mint.config import LoraConfig
from mint.models.lora import add_lora
from mint.models.specs import usable_vocab
from mint.rollout import RolloutEngine, SamplingParams

LIMIT = 90  # the tiny bases have 97 rows: ids 90..96 play the padding


def _padded(path: str):
    model = load_fp32(path).requires_grad_(False)
    with torch.no_grad():  # padding rows that would win every draw if they could be sampled
        model.lm_head.weight[LIMIT:] = model.lm_head.weight[:LIMIT].abs().amax(0) * 50
    return model


def test_usable_vocab_cuts_only_a_padded_head(random_qwen3_path):
    config = load_fp32(random_qwen3_path).config
    assert usable_vocab(LIMIT, config) == LIMIT and usable_vocab(config.vocab_size, config) is None


def test_the_engine_never_samples_padding_and_scores_the_cut_distribution(random_qwen3_path):
    model = _padded(random_qwen3_path)
    engine = RolloutEngine(model, eos_token_ids=[], vocab_limit=LIMIT)
    prompt = [3, 9, 27, 81, 5]
    (group,) = engine.generate([prompt], 6, SamplingParams(temperature=1.0, max_tokens=5), seed=0)
    for completion in group.completions:
        tokens = completion.tokens_R
        assert int(tokens.max()) < LIMIT
        logits = model(input_ids=torch.tensor([prompt + tokens[:-1].tolist()])).logits[0, len(prompt) - 1 :]
        want = token_logprobs(logits[:, :LIMIT], tokens)
        torch.testing.assert_close(completion.logprobs_R, want, atol=1e-5, rtol=1e-5)
    uncut = RolloutEngine(model, eos_token_ids=[])
    (group,) = uncut.generate([prompt], 16, SamplingParams(temperature=1.0, max_tokens=8), seed=0)
    assert any(int(c.tokens_R.max()) >= LIMIT for c in group.completions)  # the padding rows do dominate


def test_longstraw_scores_over_the_same_cut(random_qwen3_path):
    model = add_lora(_padded(random_qwen3_path), LoraConfig(), seed=0)
    tokens_P = torch.tensor([3, 9, 27, 81, 5, 11])
    responses = [torch.tensor([7, 11, 13]), torch.tensor([17, 19])]
    got = []
    spec = UpdateSpec(mode="exact", vocab_limit=LIMIT)
    grpo_update(model, tokens_P, responses, lambda i, lp, ref: (got.append(lp.detach()) or lp.sum(), {}), spec)
    for response, logp in zip(responses, got, strict=True):
        logits = model(input_ids=torch.cat([tokens_P, response[:-1]])[None]).logits[0, len(tokens_P) - 1 :]
        torch.testing.assert_close(logp, token_logprobs(logits[:, :LIMIT], response), atol=1e-5, rtol=1e-5)
