"""Rollout-engine checks every family must pass, run by the family test files on their own random tiny models:
greedy against HF generate, compaction of finished groups, and sampled batches against each group alone."""

from __future__ import annotations

import torch
from test_rollout import PROMPT, STEP_PROMPTS, assert_matches_full_forward, forward_shapes, hf_greedy

from mint.rollout.engine import RolloutEngine, SamplingParams, group_seed


def check_greedy_matches_hf_generate(model) -> None:
    """Greedy, all groups of STEP_PROMPTS in one decode batch (left padding, a one-token prompt shorter than the conv
    kernel, chunked prefill, G = 3): every row gets HF generate's tokens for its prompt alone, and its logprobs
    (fp32, 1e-5) and routes equal a teacher-forced forward over prompt + tokens."""
    max_tokens = 8
    engine = RolloutEngine(model, eos_token_ids=[], prefill_tokens=16)
    groups = engine.generate(STEP_PROMPTS, 3, SamplingParams(temperature=0.0, max_tokens=max_tokens), seed=0)
    for prompt, group in zip(STEP_PROMPTS, groups, strict=True):
        reference = hf_greedy(model, prompt, max_tokens, eos_token_id=None)
        assert len(reference) == max_tokens
        for completion in group.completions:
            assert completion.tokens_R.tolist() == reference
            assert completion.finish_reason == "length"
        assert_matches_full_forward(model, group, temperature=1.0)


def check_compaction_keeps_the_other_rows(model) -> None:
    """Greedy with an eos that only PROMPT's groups emit: those two groups (2 of 5) stop early and leave the batch, the
    slab (K/V, and whatever per-row state the family keeps) is compacted, and every group still gets HF generate's
    tokens with that eos."""
    max_tokens = 8
    plain = {tuple(p): hf_greedy(model, p, max_tokens, eos_token_id=None) for p in STEP_PROMPTS}
    others = {t for p, tokens in plain.items() if list(p) != PROMPT for t in tokens}
    eos = next((t for t in plain[tuple(PROMPT)][1:5] if t not in others), None)
    assert eos is not None, "no token of PROMPT's greedy tokens 1..4 is free of the other prompts' tokens"
    engine = RolloutEngine(model, eos_token_ids=[eos])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    groups = []
    shapes = forward_shapes(model, lambda: groups.extend(engine.generate(STEP_PROMPTS, 2, params, seed=0)))
    decode_rows = [batch for batch, seq in shapes if seq == 1]
    assert decode_rows[0] == 2 * len(STEP_PROMPTS) and decode_rows[-1] == 2 * (len(STEP_PROMPTS) - 2)
    for prompt, group in zip(STEP_PROMPTS, groups, strict=True):
        reference = hf_greedy(model, prompt, max_tokens, eos_token_id=eos)
        assert (reference[-1] == eos) == (prompt == PROMPT)
        for completion in group.completions:
            assert completion.tokens_R.tolist() == reference
        assert_matches_full_forward(model, group, temperature=1.0)


def check_sampled_batch_equals_each_group_alone(model) -> None:
    """Sampled, with stop ids so groups finish at different steps and leave the batch: each group gets the tokens it
    gets sampled alone from its own generator, and logprobs (fp32, 1e-5) and routes of a teacher-forced forward."""
    stop_ids = tuple(range(0, 97, 4))  # ~25% of the vocab: some groups finish within a few steps
    engine = RolloutEngine(model, eos_token_ids=[96])
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, stop_token_ids=stop_ids)
    groups = []
    shapes = forward_shapes(model, lambda: groups.extend(engine.generate(STEP_PROMPTS, 2, params, seed=3)))
    decode_rows = [batch for batch, seq in shapes if seq == 1]
    assert decode_rows[0] == 2 * len(STEP_PROMPTS) and min(decode_rows) < decode_rows[0], "no group left the batch"
    for index, (prompt, group) in enumerate(zip(STEP_PROMPTS, groups, strict=True)):
        alone = engine.generate_group(prompt, 2, params, torch.Generator().manual_seed(group_seed(3, index)))
        for a, b in zip(group.completions, alone.completions, strict=True):
            assert a.tokens_R.tolist() == b.tokens_R.tolist()
            torch.testing.assert_close(a.logprobs_R, b.logprobs_R, atol=1e-5, rtol=0)
        assert_matches_full_forward(model, group, temperature=0.8)
