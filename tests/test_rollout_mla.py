"""The built-in rollout engine on the multi-head latent attention families (DeepSeek-V3, GLM-4.7-Flash, and the DSA
ones DeepSeek-V3.2 and GLM-5): each layer's slab holds the latent and the RoPE key (one head, two widths), and a DSA
layer's slab also holds its indexer's per-token keys."""

from __future__ import annotations

import pytest
import torch
from conftest import build_random_tiny, load_fp32
from rollout_checks import (
    check_compaction_keeps_the_other_rows,
    check_greedy_matches_hf_generate,
    check_sampled_batch_equals_each_group_alone,
)
from test_rollout import PROMPT
from transformers import DynamicCache

from longstraw.scoring import token_logprobs
from mint.errors import MintError
from mint.rollout._cache import KVSlab
from mint.rollout.engine import RolloutEngine, SamplingParams

MLA_FAMILIES = ["deepseek_v3", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa"]
DSA_FAMILIES = ["deepseek_v32", "glm_moe_dsa"]


def _noisy_random_tiny(family: str, directory: str) -> torch.nn.Module:
    """A random tiny base of `family` whose 1-D parameters get noise: the routers' e_score_correction_bias starts at
    zero (it would never move a pick) and every RMSNorm weight at one (the same plain norm everywhere)."""
    model = load_fp32(build_random_tiny(family, directory))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return model


@pytest.fixture(scope="module", params=MLA_FAMILIES)
def mla_model(request, tmp_path_factory):
    """A random tiny MLA base of each family (index_topk 64 on the DSA ones: every test sequence fits, so every key
    is selected)."""
    return _noisy_random_tiny(request.param, str(tmp_path_factory.mktemp(request.param)))


def test_mla_greedy_matches_hf_generate(mla_model):
    """Greedy, all groups of STEP_PROMPTS in one decode batch (left padding, a one-token prompt, chunked prefill,
    G = 3): every row gets HF generate's tokens for its prompt alone, and its logprobs (fp32, 1e-5) and routes equal a
    teacher-forced forward over prompt + tokens."""
    check_greedy_matches_hf_generate(mla_model)


def test_mla_compaction_keeps_the_other_rows(mla_model):
    """Greedy with an eos that only PROMPT's groups emit: those two groups (2 of 5) stop early and leave the batch, the
    slab (latents, and indexer keys on DSA) is compacted, and every group still gets HF generate's tokens."""
    check_compaction_keeps_the_other_rows(mla_model)


def test_mla_sampled_batch_equals_each_group_alone(mla_model):
    """Sampled, with stop ids so groups finish at different steps and leave the batch: each group gets the tokens it
    gets sampled alone from its own generator, and logprobs (fp32, 1e-5) and routes of a teacher-forced forward."""
    check_sampled_batch_equals_each_group_alone(mla_model)


def test_mla_slab_steps_like_hf_cache(mla_model):
    """One prompt prefilled once, written into 3 slab rows, then one decode step with a different token per row: the
    logits, every layer's latent [3, 1, P+1, kv_lora_rank] and RoPE key [3, 1, P+1, qk_rope_head_dim], and on DSA
    every indexer's keys [3, P+1, index_head_dim] equal HF's own DynamicCache over the prompt repeated 3 times (a
    GLM-5 "shared" layer, which reuses the previous layer's selection, keeps none); compaction keeps the chosen rows."""
    config = mla_model.config
    prompt_1_P = torch.tensor([PROMPT])
    next_3_1 = torch.tensor([[3], [40], [77]])
    with torch.inference_mode():
        prefill = DynamicCache(config=config)
        mla_model(input_ids=prompt_1_P, cache=prefill, use_cache=True)
        slab = KVSlab(config, rows=3, capacity=len(PROMPT) + 1)
        slab.write_prefill(prefill, torch.arange(3), torch.zeros(3, dtype=torch.int64), column=0)
        slab.set_length(len(PROMPT))
        logits_3_V = mla_model(input_ids=next_3_1, cache=slab, use_cache=True).logits[:, -1]

        reference = DynamicCache(config=config)
        mla_model(input_ids=prompt_1_P.expand(3, -1), cache=reference, use_cache=True)
        expected_3_V = mla_model(input_ids=next_3_1, cache=reference, use_cache=True).logits[:, -1]
    torch.testing.assert_close(logits_3_V, expected_3_V, atol=1e-5, rtol=0)
    assert not torch.allclose(logits_3_V[0], logits_3_V[1]), "rows fed different tokens should differ"
    columns = len(PROMPT) + 1
    indexers = 0
    for index, (layer, ref) in enumerate(zip(slab.layers, reference.layers, strict=True)):
        assert layer.keys.shape == (3, 1, columns, config.kv_lora_rank)
        assert layer.values.shape == (3, 1, columns, config.qk_rope_head_dim)
        torch.testing.assert_close(layer.keys, ref.keys, atol=1e-6, rtol=0)
        torch.testing.assert_close(layer.values, ref.values, atol=1e-6, rtol=0)
        shared = getattr(config, "indexer_types", None) and config.indexer_types[index] == "shared"
        if config.model_type in DSA_FAMILIES and not shared:
            assert layer.indexer_keys.shape == (3, columns, config.index_head_dim)
            torch.testing.assert_close(layer.indexer_keys, ref.indexer_keys, atol=1e-6, rtol=0)
            indexers += 1
        else:
            assert getattr(layer, "indexer_keys", None) is None
    expected_indexers = {"deepseek_v32": 3, "glm_moe_dsa": 2}.get(config.model_type, 0)
    assert indexers == expected_indexers

    kept = [(layer.keys[[2, 0]].clone(), getattr(layer, "indexer_keys", None)) for layer in slab.layers]
    kept = [(keys, None if idx is None else idx[[2, 0]].clone()) for keys, idx in kept]
    slab.batch_select_indices(torch.tensor([2, 0]))
    assert slab.rows == 2 and slab.get_seq_length() == columns
    for layer, (keys, indexer_keys) in zip(slab.layers, kept, strict=True):
        assert torch.equal(layer.keys, keys)
        if indexer_keys is not None:
            assert torch.equal(layer.indexer_keys, indexer_keys)
    with torch.inference_mode(), pytest.raises((RuntimeError, MintError)):
        mla_model(input_ids=next_3_1, cache=slab, use_cache=True)  # 3 rows into a 2-row slab


@pytest.mark.parametrize("family", DSA_FAMILIES)
def test_dsa_selection_below_the_sequence_follows_hf_generate(family, tmp_path):
    """index_topk 4, below the sequences here, so the indexer's selection decides what each query attends to (the
    top-4 logits differ from the all-keys ones): decoding through the slab's indexer keys gives HF generate's greedy
    tokens, and logprobs (1e-5) of the logits HF generate produced them from.

    Compared with HF generate, not a teacher-forced forward: on this tiny indexer (2 heads, ReLU'd scores) many keys
    score exactly 0, and torch.topk breaks those ties differently for rows of different lengths, so transformers' own
    uncached forward over prompt + response picks other keys than its own cached decode (logits 0.57 apart)."""
    model = _noisy_random_tiny(family, str(tmp_path))
    max_tokens = 8
    with torch.inference_mode():
        all_keys = model(input_ids=torch.tensor([PROMPT])).logits
        for module in model.modules():
            if hasattr(module, "index_topk"):
                module.index_topk = 4
        top4 = model(input_ids=torch.tensor([PROMPT])).logits
        assert not torch.allclose(all_keys, top4, atol=1e-3), "the selection does not move the logits"
        input_ids = torch.tensor([PROMPT])
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    reference_R = out.sequences[0, len(PROMPT) :]
    expected_R = token_logprobs(torch.cat(out.logits), reference_R, 1.0)
    engine = RolloutEngine(model, eos_token_ids=[])
    group = engine.generate([PROMPT], 3, SamplingParams(temperature=0.0, max_tokens=max_tokens), seed=0)[0]
    for completion in group.completions:
        assert completion.tokens_R.tolist() == reference_R.tolist()
        torch.testing.assert_close(completion.logprobs_R, expected_R, atol=1e-5, rtol=0)
