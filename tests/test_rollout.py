"""The rollout engine and route recording on real tiny MoE models (both families) and on the hybrid linear-attention
families (Qwen3.5-MoE, Qwen3-Next, dense Qwen3.5), against independent references.

References: HF `generate` for greedy tokens, a fresh full forward over prompt + response for logprobs and routes, each
group decoded alone for the all-groups decode batch, and the exact tempered/top-p distribution for the
sampler.
"""

from __future__ import annotations

import pickle
from contextlib import nullcontext

import pytest
import torch
from conftest import load_fp32
from peft import LoraConfig, get_peft_model

from longstraw.errors import LongStrawError
from longstraw.routing import RouteRecorder, find_routers
from longstraw.scoring import token_logprobs
from mint.config import LoraConfig as RecipeLora
from mint.errors import ConfigError, MintError
from mint.models.expert_lora import is_factored
from mint.models.lora import add_lora, load_lora_state, lora_state
from mint.models.specs import moe_layout, tiny_config
from mint.rollout._cache import KVSlab
from mint.rollout._sampling import sample_groups
from mint.rollout.engine import GroupRollout, RolloutEngine, SamplingParams, group_seed

PROMPT = [5, 17, 3, 42, 8, 11, 29]
# A step's prompts: different lengths (left padding in the decode batch), one of length 1, and PROMPT twice (one
# prefill for both groups).
STEP_PROMPTS = [PROMPT, [7], [1, 2, 3], PROMPT, list(range(10, 22))]


@pytest.fixture(scope="module")
def tiny_model(random_tiny_path):
    return load_fp32(random_tiny_path)


@pytest.fixture(scope="module")
def qwen3_model(random_qwen3_path):
    return load_fp32(random_qwen3_path)


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def full_forward(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [T, V] and routes [T, L, k] (None for a dense model) of one uncached forward over `tokens` [T]."""
    recording = RouteRecorder(model) if moe_layout(model.config) is not None else nullcontext()
    with torch.inference_mode(), recording as recorder:
        logits_T_V = model(input_ids=tokens[None], use_cache=False).logits[0]
        routes_T_L_K = None if recorder is None else recorder.pop()
    return logits_T_V, routes_T_L_K


def assert_matches_full_forward(model, group: GroupRollout, temperature: float) -> None:
    """Each completion's logprobs and routes equal those of a fresh full forward over prompt + response."""
    prompt_P = group.prompt_tokens_P
    num_prompt = prompt_P.shape[0]
    layout = moe_layout(model.config)
    for completion in group.completions:
        tokens_R = completion.tokens_R
        num_resp = tokens_R.shape[0]
        logits_T_V, routes_T_L_K = full_forward(model, torch.cat([prompt_P, tokens_R]))
        # Logits at position P-1+j predict response token j.
        expected_R = token_logprobs(logits_T_V[num_prompt - 1 : num_prompt - 1 + num_resp], tokens_R, temperature)
        torch.testing.assert_close(completion.logprobs_R, expected_R, atol=1e-5, rtol=0)
        if layout is None:  # a dense model records no routes
            assert completion.routes_R_L_K is None and group.prompt_routes_P1_L_K is None
            continue
        # Routes of prompt + response[:-1] (the learner's inputs); the last response token is never fed.
        assert completion.routes_R_L_K.shape == (num_resp, layout.num_layers, layout.top_k)
        assert completion.routes_R_L_K.dtype == torch.uint8
        recorded_T_L_K = torch.cat([group.prompt_routes_P1_L_K, completion.routes_R_L_K]).long()
        assert torch.equal(recorded_T_L_K, routes_T_L_K[: num_prompt + num_resp - 1])


# -- routing ----------------------------------------------------------------------------------------------------------


def test_find_routers_in_layer_order(tiny_model):
    routers = find_routers(tiny_model)
    layers = tiny_model.model.layers
    assert routers == [layer.mlp.gate for layer in layers]


def test_find_routers_rejects_dense_model():
    with pytest.raises(LongStrawError, match="no top-k router"):
        find_routers(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_route_recorder_removes_hooks_on_error(qwen3_model):
    routers = find_routers(qwen3_model)
    with pytest.raises(RuntimeError, match="boom"), RouteRecorder(qwen3_model):
        assert all(len(router._forward_hooks) == 1 for router in routers)
        raise RuntimeError("boom")
    assert all(len(router._forward_hooks) == 0 for router in routers)


def test_route_recorder_batched_layout(qwen3_model):
    """pop_batched(B, S)[b, s] is the route of input [b, s]: equal to a batch-1 forward over row b alone."""
    input_ids_B_S = torch.tensor([PROMPT, PROMPT[::-1]])
    with torch.inference_mode(), RouteRecorder(qwen3_model) as recorder:
        qwen3_model(input_ids=input_ids_B_S, use_cache=False)
        routes_B_S_L_K = recorder.pop_batched(2, len(PROMPT))
        qwen3_model(input_ids=input_ids_B_S[1:], use_cache=False)
        row1_S_L_K = recorder.pop()
    assert torch.equal(routes_B_S_L_K[1], row1_S_L_K)
    assert routes_B_S_L_K.dtype == torch.int64


# -- greedy against HF generate ---------------------------------------------------------------------------------------


def test_greedy_matches_hf_generate(tiny_model):
    max_tokens = 10
    reference = hf_greedy(tiny_model, PROMPT, max_tokens, eos_token_id=None)
    assert len(reference) == max_tokens
    engine = RolloutEngine(tiny_model, eos_token_ids=[])
    group = engine.generate([PROMPT], 3, SamplingParams(temperature=0.0, max_tokens=max_tokens), seed=0)[0]
    for completion in group.completions:
        assert completion.tokens_R.tolist() == reference
        assert completion.finish_reason == "length"

    # With an eos that greedy emits mid-way, HF stops there and keeps the eos; so must the engine.
    eos = reference[3]
    with_eos = hf_greedy(tiny_model, PROMPT, max_tokens, eos_token_id=eos)
    assert with_eos[-1] == eos and len(with_eos) <= 4
    engine = RolloutEngine(tiny_model, eos_token_ids=[eos])
    group = engine.generate([PROMPT], 3, SamplingParams(temperature=0.0, max_tokens=max_tokens), seed=0)[0]
    for completion in group.completions:
        assert completion.tokens_R.tolist() == with_eos
        assert completion.finish_reason == "stop"
    assert_matches_full_forward(tiny_model, group, temperature=1.0)  # greedy records logprobs at T = 1


def test_top_p_tiny_equals_greedy(qwen3_model):
    engine = RolloutEngine(qwen3_model, eos_token_ids=[])
    greedy = engine.generate([PROMPT], 2, SamplingParams(temperature=0.0, max_tokens=8), seed=0)[0]
    nucleus = engine.generate([PROMPT], 2, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8), seed=1)[0]
    for a, b in zip(greedy.completions, nucleus.completions, strict=True):
        assert torch.equal(a.tokens_R, b.tokens_R)
        # Same tokens, same T = 1 scoring: top-p is not part of the scored policy.
        torch.testing.assert_close(a.logprobs_R, b.logprobs_R, atol=1e-6, rtol=0)


# -- sampled logprobs and routes against a full forward ---------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_and_routes_match_full_forward(tiny_model, temperature):
    engine = RolloutEngine(tiny_model, eos_token_ids=[])
    params = SamplingParams(temperature=temperature, top_p=0.9, max_tokens=9)
    group = engine.generate([PROMPT], 3, params, seed=123)[0]
    assert group.prompt_routes_P1_L_K.shape == (len(PROMPT) - 1, 2, 2)
    assert group.prompt_routes_P1_L_K.dtype == torch.uint8
    assert len({tuple(c.tokens_R.tolist()) for c in group.completions}) > 1, "G rows should sample differently"
    assert_matches_full_forward(tiny_model, group, temperature)


def test_one_token_prompt(qwen3_model):
    group = RolloutEngine(qwen3_model, eos_token_ids=[]).generate([[7]], 2, SamplingParams(max_tokens=4), seed=0)[0]
    assert group.prompt_routes_P1_L_K.shape == (0, 2, 2)
    assert_matches_full_forward(qwen3_model, group, temperature=1.0)


# -- stopping ---------------------------------------------------------------------------------------------------------


def test_stop_token_and_length(qwen3_model):
    engine = RolloutEngine(qwen3_model, eos_token_ids=[])
    reference = engine.generate([PROMPT], 1, SamplingParams(temperature=0.0, max_tokens=6), seed=0)[0]
    tokens = reference.completions[0].tokens_R.tolist()
    assert reference.completions[0].finish_reason == "length" and len(tokens) == 6

    stop = tokens[2]
    params = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(stop,))
    stopped = engine.generate([PROMPT], 2, params, seed=0)[0].completions[0]
    assert stopped.finish_reason == "stop"
    assert stopped.tokens_R.tolist() == tokens[: tokens.index(stop) + 1]
    assert stopped.logprobs_R.shape == stopped.routes_R_L_K.shape[:1] == stopped.tokens_R.shape


def test_sampled_rows_stop_independently(tiny_model):
    """Rows that finish early are masked out while the others decode on; none carries a token after its stop.
    (16 rows and seed 5 since the sampler became inverse-CDF: with 8 rows the old seed drew all stops.)"""
    stop_ids = tuple(range(0, 97, 4))  # ~25% of the vocab: some rows stop early, some run to max_tokens
    engine = RolloutEngine(tiny_model, eos_token_ids=[96])
    params = SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=stop_ids)
    group = engine.generate([PROMPT], 16, params, seed=5)[0]
    stops = set(stop_ids) | {96}
    reasons = set()
    for completion in group.completions:
        tokens = completion.tokens_R.tolist()
        reasons.add(completion.finish_reason)
        assert not stops & set(tokens[:-1])
        if completion.finish_reason == "stop":
            assert tokens[-1] in stops
        else:
            assert len(tokens) == 6 and tokens[-1] not in stops
    assert reasons == {"stop", "length"}
    assert_matches_full_forward(tiny_model, group, temperature=1.0)


def test_sampling_params_validation():
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


# -- determinism, prefill once, pickling ------------------------------------------------------------------------------


def test_seed_determinism(qwen3_model):
    engine = RolloutEngine(qwen3_model, eos_token_ids=[])
    params = SamplingParams(temperature=1.0, max_tokens=8)
    prompts = [PROMPT, PROMPT[:3]]

    def tokens(seed: int) -> list[list[int]]:
        groups = engine.generate(prompts, 4, params, seed=seed)
        return [c.tokens_R.tolist() for g in groups for c in g.completions]

    assert tokens(11) == tokens(11)
    assert tokens(11) != tokens(12)


def forward_shapes(model, run) -> list[tuple[int, int]]:
    """The [batch, seq] input shape of every model forward during `run()`, seen by a hook on the input embedding."""
    shapes = []
    handle = model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: shapes.append(tuple(args[0].shape))
    )
    try:
        run()
    finally:
        handle.remove()
    return shapes


def test_prefill_runs_once(qwen3_model):
    """The prompt goes through the model once at batch 1; every other forward is one token for each of G rows."""
    group_size, max_tokens = 4, 5
    engine = RolloutEngine(qwen3_model, eos_token_ids=[])
    shapes = forward_shapes(
        qwen3_model, lambda: engine.generate([PROMPT], group_size, SamplingParams(max_tokens=max_tokens), seed=0)
    )
    assert shapes == [(1, len(PROMPT))] + [(group_size, 1)] * (max_tokens - 1)


def test_group_rollout_pickles(qwen3_model):
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=5, stop_token_ids=(3,))
    assert pickle.loads(pickle.dumps(params)) == params
    group = RolloutEngine(qwen3_model, eos_token_ids=[]).generate([PROMPT], 3, SamplingParams(max_tokens=5), seed=0)[0]
    restored = pickle.loads(pickle.dumps(group))
    assert torch.equal(restored.prompt_tokens_P, group.prompt_tokens_P)
    assert torch.equal(restored.prompt_routes_P1_L_K, group.prompt_routes_P1_L_K)
    for a, b in zip(restored.completions, group.completions, strict=True):
        assert torch.equal(a.tokens_R, b.tokens_R)
        assert torch.equal(a.logprobs_R, b.logprobs_R)
        assert torch.equal(a.routes_R_L_K, b.routes_R_L_K)
        assert a.finish_reason == b.finish_reason
        # Each tensor owns its storage: a view would pickle the whole [G, max_tokens] decode buffer.
        assert b.tokens_R.untyped_storage().nbytes() == b.tokens_R.numel() * 8


# -- PEFT -------------------------------------------------------------------------------------------------------------


def test_peft_lora_model(random_tiny_path):
    model = load_fp32(random_tiny_path)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    peft_model = get_peft_model(model, config).eval()
    # LoRA B starts at zero (adapter = identity); make it non-trivial so the test sees the adapter's routes/logits.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    assert len(find_routers(peft_model)) == 2

    engine = RolloutEngine(peft_model, eos_token_ids=[])
    group = engine.generate([PROMPT], 3, SamplingParams(temperature=0.8, max_tokens=6), seed=0)[0]
    assert_matches_full_forward(peft_model, group, temperature=0.8)
    greedy = engine.generate([PROMPT], 2, SamplingParams(temperature=0.0, max_tokens=6), seed=0)[0]
    assert greedy.completions[0].tokens_R.tolist() == hf_greedy(peft_model, PROMPT, 6, eos_token_id=None)
    with peft_model.disable_adapter():
        base = engine.generate([PROMPT], 1, SamplingParams(temperature=0.0, max_tokens=6), seed=0)[0]
    assert not torch.equal(base.completions[0].logprobs_R, greedy.completions[0].logprobs_R), "adapter had no effect"


# -- all groups of a step in one decode batch -------------------------------------------------------------------------


def test_batched_groups_equal_each_group_decoded_alone(tiny_model):
    """Greedy: every group of a batch with left padding, a duplicated prompt and chunked prefill gets the tokens it
    gets decoded alone, token for token, with logprobs within 1e-5."""
    params = SamplingParams(temperature=0.0, max_tokens=8)
    # prefill_tokens=16: the prompts of lengths 1, 3, 7, 12 are prefilled in three left-padded batches.
    batched = RolloutEngine(tiny_model, eos_token_ids=[], prefill_tokens=16).generate(STEP_PROMPTS, 3, params, seed=0)
    engine = RolloutEngine(tiny_model, eos_token_ids=[])
    for prompt, group in zip(STEP_PROMPTS, batched, strict=True):
        alone = engine.generate([prompt], 3, params, seed=0)[0]
        assert group.prompt_tokens_P.tolist() == prompt
        assert torch.equal(group.prompt_routes_P1_L_K, alone.prompt_routes_P1_L_K)
        for a, b in zip(group.completions, alone.completions, strict=True):
            assert a.tokens_R.tolist() == b.tokens_R.tolist()
            torch.testing.assert_close(a.logprobs_R, b.logprobs_R, atol=1e-5, rtol=0)
        assert_matches_full_forward(tiny_model, group, temperature=1.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_batched_sampled_logprobs_and_routes_match_full_forward(tiny_model, temperature):
    """Sampled, with stop ids so groups finish at different steps and leave the batch (the slab is compacted): every
    completion's logprobs (fp32, 1e-5) and routes equal a teacher-forced forward over its prompt + tokens."""
    stop_ids = tuple(range(0, 97, 4))  # ~25% of the vocab: some groups finish within a few steps
    engine = RolloutEngine(tiny_model, eos_token_ids=[96])
    params = SamplingParams(temperature=temperature, top_p=0.9, max_tokens=6, stop_token_ids=stop_ids)
    groups = []
    shapes = forward_shapes(tiny_model, lambda: groups.extend(engine.generate(STEP_PROMPTS, 2, params, seed=3)))
    decode_rows = [batch for batch, seq in shapes if seq == 1]
    assert decode_rows[0] == 2 * len(STEP_PROMPTS) and min(decode_rows) < decode_rows[0], "no group left the batch"
    assert sorted(decode_rows, reverse=True) == decode_rows and all(rows % 2 == 0 for rows in decode_rows)
    assert any(c.finish_reason == "stop" for group in groups for c in group.completions)
    for group in groups:
        assert group.prompt_routes_P1_L_K.shape[0] == group.prompt_tokens_P.numel() - 1
        assert_matches_full_forward(tiny_model, group, temperature)


def test_each_distinct_prompt_is_prefilled_once(qwen3_model):
    """One left-padded prefill for the distinct prompts (PROMPT twice counts once), then [B, 1] decode forwards; a
    prefill budget smaller than the padded batch splits it, shortest prompts first."""
    prompts, group_size, max_tokens = [PROMPT, [4, 5, 6], PROMPT], 2, 3
    params = SamplingParams(max_tokens=max_tokens)
    engine = RolloutEngine(qwen3_model, eos_token_ids=[])
    shapes = forward_shapes(qwen3_model, lambda: engine.generate(prompts, group_size, params, seed=0))
    decode = [(len(prompts) * group_size, 1)] * (max_tokens - 1)
    assert shapes == [(2, len(PROMPT)), *decode]
    engine = RolloutEngine(qwen3_model, eos_token_ids=[], prefill_tokens=2 * len(PROMPT) - 1)
    shapes = forward_shapes(qwen3_model, lambda: engine.generate(prompts, group_size, params, seed=0))
    assert shapes == [(1, 3), (1, len(PROMPT)), *decode]


def test_max_batch_tokens_splits_the_step(qwen3_model):
    """A KV slab budget below the whole step decodes it in several batches, each group's tokens unchanged."""
    params = SamplingParams(temperature=0.0, max_tokens=4)
    whole = RolloutEngine(qwen3_model, eos_token_ids=[]).generate(STEP_PROMPTS, 2, params, seed=0)
    # Slots are rows x (P_max + 3), shortest prompts first: lengths 1 and 3 share 2 x 2 x 6 = 24 <= 30 slots, each
    # prompt of 7 (20 slots, 40 for both) and the one of 12 (30) go alone.
    engine = RolloutEngine(qwen3_model, eos_token_ids=[], max_batch_tokens=30)
    split = []
    shapes = forward_shapes(qwen3_model, lambda: split.extend(engine.generate(STEP_PROMPTS, 2, params, seed=0)))
    assert [batch for batch, seq in shapes if seq == 1] == [4] * 3 + [2] * 9
    for a, b in zip(whole, split, strict=True):
        assert torch.equal(a.prompt_tokens_P, b.prompt_tokens_P)
        assert [c.tokens_R.tolist() for c in a.completions] == [c.tokens_R.tolist() for c in b.completions]


def test_a_groups_samples_do_not_depend_on_its_batch(qwen3_model):
    """Group i draws from its own generator (group_seed(seed, i)): sampled alone from that generator it gets the same
    tokens as inside the step's batch; group 0's seed is the call's seed."""
    engine = RolloutEngine(qwen3_model, eos_token_ids=[])
    params = SamplingParams(temperature=1.0, max_tokens=6)
    batched = engine.generate(STEP_PROMPTS[:3], 4, params, seed=77)
    assert engine.generate(STEP_PROMPTS[:1], 4, params, seed=77)[0].completions[0].tokens_R.tolist() == (
        batched[0].completions[0].tokens_R.tolist()
    )
    for index in (1, 2):
        generator = torch.Generator().manual_seed(group_seed(77, index))
        alone = engine.generate_group(STEP_PROMPTS[index], 4, params, generator)
        assert [c.tokens_R.tolist() for c in alone.completions] == [
            c.tokens_R.tolist() for c in batched[index].completions
        ]


def test_group_seed_streams_are_distinct():
    """Group seeds of nearby call seeds never collide (the trainer seeds shards step_seed * 1000 + shard)."""
    assert group_seed(123, 0) == 123
    seeds = {group_seed(step * 1000 + shard, i) for step in range(4) for shard in range(8) for i in range(64)}
    assert len(seeds) == 4 * 8 * 64
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.5, 1.0), (1.0, 0.75)])
def test_sampler_draws_the_tempered_nucleus(temperature, top_p):
    """Inverse-CDF draws follow softmax(logits / T) truncated to the top-p nucleus and renormalised: empirical
    frequencies of 40,000 draws within 0.012 (> 4 standard errors) of the exact probabilities; zero-mass tokens
    never drawn."""
    logits_V = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0])
    params = SamplingParams(temperature=temperature, top_p=top_p)
    generators = [torch.Generator().manual_seed(s) for s in range(8)]
    draws = torch.cat([sample_groups(logits_V.expand(1000, -1), params, generators, 125) for _ in range(5)])
    probs_V = torch.softmax(logits_V / temperature, dim=-1)
    if top_p < 1.0:  # tokens 0 and 1 already hold 0.77 >= 0.75 of the mass: the nucleus is {0, 1}
        probs_V[2:] = 0.0
        probs_V /= probs_V.sum()
    freq_V = torch.bincount(draws, minlength=6).double() / draws.numel()
    torch.testing.assert_close(freq_V, probs_V.double(), atol=0.012, rtol=0)
    assert bool((probs_V[draws] > 0).all()), "a token outside the nucleus was drawn"


def test_kv_slab_refuses_what_it_cannot_hold():
    with pytest.raises(MintError, match=r"supports full-attention layers.*sliding_attention"):
        config = tiny_config("qwen2_moe", 97, use_sliding_window=True, sliding_window=8, max_window_layers=2)
        KVSlab(config, rows=2, capacity=8)
    with pytest.raises(MintError, match=r"supports full-attention layers.*\['linear_attention'\]"):
        KVSlab(tiny_config("qwen3_5_moe", 97, layer_types=["linear_attention"] * 4), rows=2, capacity=8)
    hybrid = KVSlab(tiny_config("qwen3_5_moe", 97), rows=2, capacity=8)
    assert [type(layer).__name__ for layer in hybrid.layers] == ["_SlabLinearLayer"] * 3 + ["_SlabLayer"]
    slab = KVSlab(tiny_config("qwen3_moe", 97), rows=2, capacity=4)
    layer = slab.layers[0]
    keys, values = layer.update(torch.ones(2, 2, 3, 16), torch.ones(2, 2, 3, 16))
    assert keys.shape == values.shape == (2, 2, 3, 16) and layer.keys.shape == (2, 2, 4, 16)
    with pytest.raises(MintError, match="does not fit"):
        layer.update(torch.ones(2, 2, 2, 16), torch.ones(2, 2, 2, 16))


def test_batched_decode_with_factored_expert_lora(random_tiny_path):
    """The rollout actor's model (`add_lora`, expert LoRA factored) through the all-groups decode: logprobs and routes
    equal a teacher-forced forward of PEFT's materialized expert LoRA with the same (non-zero) adapter."""
    models = []
    for factored in (True, False):
        models.append(add_lora(load_fp32(random_tiny_path).requires_grad_(False), RecipeLora(), 0, factored))
    state = lora_state(models[0])
    generator = torch.Generator().manual_seed(5)
    for name in sorted(state):
        if "lora_B" in name:  # B starts at zero: the adapter would change nothing
            state[name] = 0.05 * torch.randn(state[name].shape, generator=generator)
    for model in models:
        load_lora_state(model, state)
    factored, materialized = models
    assert sum(is_factored(m) for m in factored.modules()) == factored.config.num_hidden_layers
    engine = RolloutEngine(factored, eos_token_ids=[])
    groups = engine.generate(STEP_PROMPTS, 3, SamplingParams(temperature=0.9, max_tokens=6), seed=4)
    for group in groups:
        assert_matches_full_forward(materialized, group, temperature=0.9)
