"""The rollout engine and route recording on real tiny MoE models (both families), against independent references.

References: HF `generate` for greedy tokens, a fresh full forward over prompt + response for logprobs and routes.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import load_fp32
from peft import LoraConfig, get_peft_model

from longstraw.errors import LongStrawError
from longstraw.routing import RouteRecorder, find_routers
from longstraw.scoring import token_logprobs
from mint.errors import ConfigError
from mint.models.specs import moe_layout
from mint.rollout.engine import GroupRollout, RolloutEngine, SamplingParams

PROMPT = [5, 17, 3, 42, 8, 11, 29]


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


def full_forward(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [T, V] and routes [T, L, k] of one uncached forward over `tokens` [T]."""
    with torch.inference_mode(), RouteRecorder(model) as recorder:
        logits_T_V = model(input_ids=tokens[None], use_cache=False).logits[0]
        routes_T_L_K = recorder.pop()
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
    """Rows that finish early are masked out while the others decode on; none carries a token after its stop."""
    stop_ids = tuple(range(0, 97, 4))  # ~25% of the vocab: some rows stop early, some run to max_tokens
    engine = RolloutEngine(tiny_model, eos_token_ids=[96])
    params = SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=stop_ids)
    group = engine.generate([PROMPT], 8, params, seed=3)[0]
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


def test_prefill_runs_once(qwen3_model):
    """The prompt goes through the model once at batch 1; every other forward is one token for each of G rows."""
    group_size, max_tokens = 4, 5
    shapes = []
    embed = qwen3_model.get_input_embeddings()
    handle = embed.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    try:
        engine = RolloutEngine(qwen3_model, eos_token_ids=[])
        engine.generate([PROMPT], group_size, SamplingParams(max_tokens=max_tokens), seed=0)
    finally:
        handle.remove()
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
