"""GLM-4.5-class bases (`glm4_moe`): the MoE layout, R3 on GLM's sigmoid router, the rollout, the adapter.

The model is the random tiny GLM of conftest's `random_glm_path`: 3 layers with a dense first layer, 4 routed
experts in 2 groups of 2 (one group kept, top-2), routed_scaling_factor 2.5, a shared expert, and a non-zero
e_score_correction_bias. The LongStraw parity tests (logprobs, exact and detached gradients) run GLM in
tests/test_longstraw.py, and the R3 weight rule for every family in tests/test_trust.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import load_fp32, sum_atol
from test_rollout import PROMPT, assert_matches_full_forward, hf_greedy
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2MoeConfig

from longstraw.adapters import QwenAdapter, adapter_for
from longstraw.engine import score_response
from longstraw.routing import RouteRecorder, RouteReplay, find_routers
from longstraw.scoring import token_logprobs
from mint.config import LoraConfig
from mint.models.lora import add_lora
from mint.models.specs import moe_layout, tiny_config
from mint.rollout.engine import RolloutEngine, SamplingParams

TOKENS = torch.tensor([[3, 9, 27, 81, 5, 7, 64, 12, 33, 90, 41, 2, 58, 17, 76, 25]])


@pytest.fixture(scope="module")
def glm(random_glm_path):
    return load_fp32(random_glm_path)


def _own_choice(router, hidden_T_H: torch.Tensor, use_bias: bool = True, use_groups: bool = True) -> torch.Tensor:
    """GLM's expert choice restated from Glm4MoeTopkRouter: rank sigmoid(logits) + bias; keep the topk_group groups
    with the largest sum of their top-2 ranks; top-k inside them. Returned sorted (a route is a set)."""
    scores_T_E = torch.nn.functional.linear(hidden_T_H.reshape(-1, router.hidden_dim).float(), router.weight).sigmoid()
    rank_T_E = scores_T_E + router.e_score_correction_bias if use_bias else scores_T_E
    if use_groups:
        rank_T_G_S = rank_T_E.view(-1, router.num_group, router.num_experts // router.num_group)
        kept_T_G = rank_T_G_S.topk(2, dim=-1).values.sum(-1).topk(router.topk_group, dim=-1).indices
        keep_T_G = torch.zeros(rank_T_G_S.shape[:2], dtype=torch.bool).scatter(1, kept_T_G, True)
        rank_T_E = rank_T_G_S.masked_fill(~keep_T_G[..., None], float("-inf")).flatten(1)
    return rank_T_E.topk(router.top_k, dim=-1).indices.sort(-1).values


def _router_inputs(model) -> tuple[list[torch.Tensor], list]:
    inputs = []
    handles = [r.register_forward_pre_hook(lambda mod, a: inputs.append(a[0])) for r in find_routers(model)]
    return inputs, handles


# -- the MoE layout -----------------------------------------------------------------------------------------------


def test_moe_layout_honours_first_k_dense_replace():
    """Once raised 'config says 3 MoE layers, found 2 routers'. Layers below first_k_dense_replace are dense."""
    for first_dense, moe in ((1, 2), (0, 3), (2, 1)):
        config = tiny_config("glm4_moe", 97, first_k_dense_replace=first_dense)
        layout = moe_layout(config)
        assert (layout.num_layers, layout.num_experts, layout.top_k) == (moe, 4, 2)
    assert moe_layout(tiny_config("glm4_moe", 97, first_k_dense_replace=3)) is None  # every layer dense
    # Qwen-MoE's rules are unchanged: mlp_only_layers and decoder_sparse_step.
    common = dict(vocab_size=97, hidden_size=64, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2)
    assert moe_layout(Qwen2MoeConfig(**common, mlp_only_layers=[0])).num_layers == 3
    assert moe_layout(Qwen2MoeConfig(**common, decoder_sparse_step=2)).num_layers == 2  # layers 1 and 3


def test_layout_matches_the_built_model_and_the_rollout_engine_starts(glm):
    routers = find_routers(glm)
    first = glm.config.first_k_dense_replace
    assert routers == [layer.mlp.gate for layer in glm.model.layers[first:]]
    assert not hasattr(glm.model.layers[0].mlp, "gate")  # the dense layer
    assert moe_layout(glm.config).num_layers == len(routers) == 2
    RolloutEngine(glm, eos_token_ids=[])  # raised "config says 3 MoE layers, found 2 routers" once


# -- R3 on GLM's router -------------------------------------------------------------------------------------------


def test_recorded_routes_are_the_models_own_choice(glm):
    """The recorder's ids are what the experts modules ran, and GLM's rule (bias and group limit included) picks them.

    The model is one where both parts of the rule matter: without the bias, or without the group limit, some tokens
    would go to other experts."""
    ran = []
    handles = [
        layer.mlp.experts.register_forward_pre_hook(lambda mod, a: ran.append(a[1]))
        for layer in glm.model.layers[glm.config.first_k_dense_replace :]
    ]
    inputs, more = _router_inputs(glm)
    try:
        with torch.no_grad(), RouteRecorder(glm) as recorder:
            glm(TOKENS)
            routes_T_L_K = recorder.pop()
    finally:
        for handle in handles + more:
            handle.remove()
    assert routes_T_L_K.shape == (TOKENS.numel(), 2, 2)
    assert torch.equal(routes_T_L_K, torch.stack(ran, dim=1))
    unbiased_differs = ungrouped_differs = False
    for layer, (router, hidden) in enumerate(zip(find_routers(glm), inputs, strict=True)):
        recorded_T_K = routes_T_L_K[:, layer].sort(-1).values
        assert torch.equal(recorded_T_K, _own_choice(router, hidden))
        unbiased_differs |= not torch.equal(recorded_T_K, _own_choice(router, hidden, use_bias=False))
        ungrouped_differs |= not torch.equal(recorded_T_K, _own_choice(router, hidden, use_groups=False))
    assert unbiased_differs and ungrouped_differs


def test_replaying_the_models_own_routes_reproduces_its_forward(glm):
    """Recorded ids replayed with ok everywhere: same experts, same weights (sigmoid without bias, normalized, times
    routed_scaling_factor), so the logits are bit-identical."""
    with torch.no_grad(), RouteRecorder(glm) as recorder:
        plain = glm(TOKENS).logits
        routes_T_L_K = recorder.pop()
    with torch.no_grad(), RouteReplay(glm) as replay:
        replay.set(routes_T_L_K, torch.ones(TOKENS.numel(), dtype=torch.bool))
        replayed = glm(TOKENS).logits
        assert torch.equal(replay.native(), routes_T_L_K)
    assert torch.equal(replayed, plain)


def test_replayed_weights_leave_out_the_bias_and_reach_a_trainable_router(glm):
    """Forced ids (including ones the group limit forbids) weigh sigmoid(logits)[ids] / sum * scale, never with the
    bias; the weights carry the router's gradient."""
    n = TOKENS.numel()
    gen = torch.Generator().manual_seed(5)
    routes_T_L_K = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(n * 2)]).view(n, 2, 2)
    weights = []
    handles = [
        layer.mlp.experts.register_forward_pre_hook(lambda mod, a: weights.append(a[2]))
        for layer in glm.model.layers[glm.config.first_k_dense_replace :]
    ]
    inputs, more = _router_inputs(glm)
    router = find_routers(glm)[0]
    router.weight.requires_grad_(True)
    try:
        with RouteReplay(glm) as replay:
            replay.set(routes_T_L_K, torch.ones(n, dtype=torch.bool))
            glm(TOKENS).logits.sum().backward()
    finally:
        for handle in handles + more:
            handle.remove()
        router.weight.requires_grad_(False)
    grad, router.weight.grad = router.weight.grad, None
    assert grad is not None and grad.abs().sum() > 0
    for layer, (r, hidden) in enumerate(zip(find_routers(glm), inputs, strict=True)):
        logits_T_E = torch.nn.functional.linear(hidden.reshape(n, -1).float(), r.weight.detach())
        ids_T_K = routes_T_L_K[:, layer]
        want = logits_T_E.sigmoid().gather(-1, ids_T_K)
        want = want / (want.sum(-1, keepdim=True) + 1e-20) * r.routed_scaling_factor
        torch.testing.assert_close(weights[layer].detach(), want)
        biased = (logits_T_E.sigmoid() + r.e_score_correction_bias).gather(-1, ids_T_K)
        biased = biased / biased.sum(-1, keepdim=True) * r.routed_scaling_factor
        assert (weights[layer].detach() - biased).abs().max() > 1e-3


# -- the rollout engine -------------------------------------------------------------------------------------------


def test_greedy_rollout_matches_hf_generate(glm):
    reference = hf_greedy(glm, PROMPT, 8, eos_token_id=None)
    group = RolloutEngine(glm, eos_token_ids=[]).generate([PROMPT], 2, SamplingParams(temperature=0.0, max_tokens=8), 0)
    for completion in group[0].completions:
        assert completion.tokens_R.tolist() == reference
    assert_matches_full_forward(glm, group[0], temperature=1.0)


def test_sampled_logprobs_and_routes_match_full_forward(glm):
    group = RolloutEngine(glm, eos_token_ids=[]).generate([PROMPT], 3, SamplingParams(max_tokens=7), seed=4)[0]
    assert group.prompt_routes_P1_L_K.shape == (len(PROMPT) - 1, 2, 2)
    assert_matches_full_forward(glm, group, temperature=1.0)


# -- the adapter on other GLM shapes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # the tiny: q/k norm, q/k/v bias, half-rotary, attention width 128 on hidden 64, a dense first layer
        dict(use_qk_norm=False),  # GLM-4.5-Air-like attention
        # Full rotary, no bias, head_dim = hidden / heads, every layer MoE, no group limit, no renormalization.
        dict(
            partial_rotary_factor=1.0,
            attention_bias=False,
            head_dim=16,
            first_k_dense_replace=0,
            n_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
        ),
    ],
    ids=["tiny", "no-qk-norm", "full-rotary"],
)
def test_adapter_matches_hf_kv_and_logprobs_on_glm_shapes(tmp_path, overrides):
    """The captured K/V equal HF's cache (post-norm, post-RoPE) at every layer, and the logprobs a full forward's.

    K/V first: on this random tiny model with the q/k norm off, RoPE applied to the wrong dims moved the logprobs by
    under 1e-5 (measured), so the logprobs alone would not catch it."""
    torch.manual_seed(0)
    config = tiny_config("glm4_moe", 97, initializer_range=0.05, **overrides)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = add_lora(load_fp32(str(tmp_path)).requires_grad_(False), LoraConfig(), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    adapter = adapter_for(model)
    assert type(adapter) is QwenAdapter  # GLM's partial RoPE, q/k norm and biases are read off its modules
    tokens = TOKENS[0]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        state = adapter.capture(tokens[:11], chunk_size=4)
        got = score_response(adapter, tokens[:12], tokens[12:], state, None, 0, 1.0)
        model(input_ids=TOKENS[:, :11], cache=cache, use_cache=True)
        logits_T_V = model(input_ids=TOKENS).logits[0]
    # The capture and HF add the same fp32 products in other orders (chunks of 4, other kernels): they part by about
    # eps * max|value| * sqrt(terms), terms = the layers times the widest reduction of a layer (sum_atol says why).
    widest = max(config.hidden_size, config.num_attention_heads * config.head_dim, config.intermediate_size)
    terms = config.num_hidden_layers * widest
    for i, layer in enumerate(cache.layers):
        for got_kv, want_kv in ((state.k_L_Hkv_S_D[i], layer.keys[0]), (state.v_L_Hkv_S_D[i], layer.values[0])):
            atol = sum_atol(torch.float32, want_kv.abs().max().item(), terms)
            torch.testing.assert_close(got_kv, want_kv, atol=atol, rtol=0, msg=lambda m, i=i: f"layer {i}: {m}")
    want = token_logprobs(logits_T_V[11:15], tokens[12:], 1.0)  # one more reduction: the log-sum-exp over the vocab
    atol = sum_atol(torch.float32, want.abs().max().item(), terms + config.vocab_size)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
