"""The built-in rollout engine on the hybrid linear-attention families (Qwen3.5-MoE, Qwen3-Next, dense Qwen3.5):
Gated DeltaNet layers keep per-row conv and recurrent states in the slab beside the full layers' K/V."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_random_tiny, load_fp32
from rollout_checks import (
    check_compaction_keeps_the_other_rows,
    check_greedy_matches_hf_generate,
    check_sampled_batch_equals_each_group_alone,
)
from test_rollout import PROMPT, forward_shapes
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionLayer

from mint.errors import MintError
from mint.models.specs import tiny_config
from mint.rollout._cache import KVSlab, row_state_columns
from mint.rollout.engine import RolloutEngine, SamplingParams

HYBRID_FAMILIES = ["qwen3_5_moe", "qwen3_next", "qwen3_5"]


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def hybrid_model(request, tmp_path_factory):
    """A random tiny hybrid (Gated DeltaNet "linear_attention" layers + "full_attention" layers) of each family. Its
    1-D parameters get noise: the zero-centred norm weights start at zero in every layer, which would leave the norms
    (and the gated norm of the linear layers) the same plain RMSNorm everywhere."""
    family = request.param
    model = load_fp32(build_random_tiny(family, str(tmp_path_factory.mktemp(family))))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    assert {"linear_attention", "full_attention"} <= set(model.config.layer_types)
    return model


# -- hybrid linear-attention families ----------------------------------------------------------------------------------


def test_hybrid_greedy_matches_hf_generate(hybrid_model):
    """Greedy, all groups of STEP_PROMPTS in one decode batch (left padding, a one-token prompt shorter than the conv
    kernel, chunked prefill, G = 3): every row gets HF generate's tokens for its prompt alone, and its logprobs
    (fp32, 1e-5) and routes equal a teacher-forced forward over prompt + tokens."""
    check_greedy_matches_hf_generate(hybrid_model)


def test_hybrid_compaction_keeps_the_other_rows(hybrid_model):
    """Greedy with an eos that only PROMPT's groups emit: those two groups (2 of 5) stop early and leave the batch, the
    slab (K/V and linear states) is compacted, and every group still gets HF generate's tokens with that eos."""
    check_compaction_keeps_the_other_rows(hybrid_model)


def test_hybrid_sampled_batch_equals_each_group_alone(hybrid_model):
    """Sampled, with stop ids so groups finish at different steps and leave the batch: each group gets the tokens it
    gets sampled alone from its own generator, and logprobs (fp32, 1e-5) and routes of a teacher-forced forward."""
    check_sampled_batch_equals_each_group_alone(hybrid_model)


def test_hybrid_slab_steps_like_hf_cache_in_place(hybrid_model):
    """One prompt prefilled once, written into 3 slab rows, then one decode step with a different token per row: the
    logits and every linear layer's conv and recurrent states equal HF's own DynamicCache over the prompt repeated 3
    times; the states are updated in place (same storage); compaction keeps the chosen rows' states."""
    config = hybrid_model.config
    prompt_1_P = torch.tensor([PROMPT])
    next_3_1 = torch.tensor([[3], [40], [77]])
    with torch.inference_mode():
        prefill = DynamicCache(config=config)
        hybrid_model(input_ids=prompt_1_P, cache=prefill, use_cache=True)
        slab = KVSlab(config, rows=3, capacity=len(PROMPT) + 1)
        slab.write_prefill(prefill, torch.arange(3), torch.zeros(3, dtype=torch.int64), column=0)
        slab.set_length(len(PROMPT))
        linear = [layer for layer in slab.layers if isinstance(layer, LinearAttentionLayer)]
        assert len(linear) == config.layer_types.count("linear_attention") > 0
        storage = [(layer.conv_states[0].data_ptr(), layer.recurrent_states[0].data_ptr()) for layer in linear]
        logits_3_V = hybrid_model(input_ids=next_3_1, cache=slab, use_cache=True).logits[:, -1]

        reference = DynamicCache(config=config)
        hybrid_model(input_ids=prompt_1_P.expand(3, -1), cache=reference, use_cache=True)
        expected_3_V = hybrid_model(input_ids=next_3_1, cache=reference, use_cache=True).logits[:, -1]
    torch.testing.assert_close(logits_3_V, expected_3_V, atol=1e-5, rtol=0)
    assert not torch.allclose(logits_3_V[0], logits_3_V[1]), "rows fed different tokens should differ"
    ref_linear = [layer for layer in reference.layers if isinstance(layer, LinearAttentionLayer)]
    for layer, ref, (conv_ptr, recurrent_ptr) in zip(linear, ref_linear, storage, strict=True):
        assert layer.conv_states[0].data_ptr() == conv_ptr and layer.recurrent_states[0].data_ptr() == recurrent_ptr
        assert layer.recurrent_states[0].dtype == ref.recurrent_states[0].dtype
        torch.testing.assert_close(layer.conv_states[0], ref.conv_states[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(layer.recurrent_states[0], ref.recurrent_states[0], atol=1e-5, rtol=0)

    kept_conv = [layer.conv_states[0][[2, 0]].clone() for layer in linear]
    kept_recurrent = [layer.recurrent_states[0][[2, 0]].clone() for layer in linear]
    slab.batch_select_indices(torch.tensor([2, 0]))
    assert slab.rows == 2 and slab.get_seq_length() == len(PROMPT) + 1
    for layer, conv, recurrent in zip(linear, kept_conv, kept_recurrent, strict=True):
        assert torch.equal(layer.conv_states[0], conv) and torch.equal(layer.recurrent_states[0], recurrent)
    with torch.inference_mode(), pytest.raises((RuntimeError, MintError)):
        hybrid_model(input_ids=next_3_1, cache=slab, use_cache=True)  # 3 rows into a 2-row slab


def test_row_state_columns_count_the_states_transformers_allocates(hybrid_model):
    """One row's linear-attention states, read off transformers' own cache after a prefill (conv window and recurrent
    state of every linear layer), over one column's K/V of every full layer, rounded up; none without linear layers."""
    with torch.inference_mode():
        cache = DynamicCache(config=hybrid_model.config)
        hybrid_model(input_ids=torch.tensor([PROMPT]), cache=cache, use_cache=True)
    linear = [layer for layer in cache.layers if isinstance(layer, LinearAttentionLayer)]
    full = [layer for layer in cache.layers if not isinstance(layer, LinearAttentionLayer)]
    row = sum(layer.conv_states[0].nbytes + layer.recurrent_states[0].nbytes for layer in linear)
    column = sum(layer.keys.nbytes + layer.values.nbytes for layer in full) // len(PROMPT)
    assert row_state_columns(hybrid_model.config, 4) == math.ceil(row / column) > 0
    assert row_state_columns(tiny_config("qwen3_moe", 97), 4) == 0


def test_a_hybrid_rows_states_count_against_the_decode_budget(hybrid_model):
    """Two groups of 2 rows whose K/V alone (2 x 2 x (7 + 2) = 36 slots) fits a budget one slot short of what their
    linear states add decode one after the other, with each group's tokens unchanged; at the full figure they share
    one batch."""
    prompts, params = [PROMPT, [1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3)
    columns = RolloutEngine(hybrid_model, eos_token_ids=[]).row_state_columns
    both = 2 * 2 * (len(PROMPT) + params.max_tokens - 1 + columns)

    def decode(budget: int) -> tuple[list[int], list[list[list[int]]]]:
        """The decode forwards' batch sizes and each group's tokens under `budget` slots."""
        engine, groups = RolloutEngine(hybrid_model, eos_token_ids=[], max_batch_tokens=budget), []
        shapes = forward_shapes(hybrid_model, lambda: groups.extend(engine.generate(prompts, 2, params, seed=0)))
        tokens = [[c.tokens_R.tolist() for c in group.completions] for group in groups]
        return [batch for batch, seq in shapes if seq == 1], tokens

    (together, tokens), (apart, tokens_apart) = decode(both), decode(both - 1)
    assert together == [4] * 2 and apart == [2] * 4
    assert tokens == tokens_apart
