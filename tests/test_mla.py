"""LongStraw on multi-head latent attention bases against transformers (fp32, CPU): DeepSeek-V3, GLM-4.7-Flash, and
the DSA families DeepSeek-V3.2 and GLM-5 on their dense path (every sequence within index_topk, so the indexer
selects every key and HF runs it too; tests/test_dsa.py covers them past index_topk).

Tiny random bases (mint.models.specs.tiny_config: 3 layers, the first dense, q and kv down-projections, interleaved
RoPE, V3-style routing with a shared expert), LoRA on every attention projection (kv_b_proj included, so the
absorbed form's factored fold is exercised) and the fused experts, with non-zero lora_B. G=3 responses of unequal
lengths after a P=23 prompt captured in chunks of 7. The references are HF full-sequence forwards and backprops.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    UPDATE_ADV,
    UPDATE_LENGTHS,
    UPDATE_P,
    build_random_tiny,
    forced_routes,
    load_fp32,
    lora_model,
    pop_lora_grads,
    update_inputs,
    update_objective,
)

from longstraw.adapters import adapter_for
from longstraw.adapters.mla import LatentState
from longstraw.engine import UpdateSpec, capture_prefix, grpo_update, score_response
from longstraw.memory import GraphMeter, module_storages
from longstraw.replay import score_responses
from longstraw.routing import RouteReplay
from longstraw.scoring import token_logprobs

FAMILIES = ["deepseek_v3", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa"]
P, LENGTHS = UPDATE_P, UPDATE_LENGTHS
TEMPERATURE = 0.9
CHUNK = 7
TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


@pytest.fixture(scope="module", params=FAMILIES)
def mla_path(request, tmp_path_factory) -> str:
    """A random tiny MLA base whose norms and score-correction biases are moved off their init, so a norm or a
    routing bias read wrong changes the outputs."""
    path = build_random_tiny(request.param, str(tmp_path_factory.mktemp(request.param)))
    model = load_fp32(path)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in [*model.parameters(), *(b for n, b in model.named_buffers() if "e_score_correction_bias" in n)]:
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    return path


def _hf_logp(model, tokens_P, response_R, detach_prompt_pages=False):
    """Logprobs from one forward over prompt + response[:-1]; optionally with the prompt positions' latent and rope
    key (kv_a_proj_with_mqa's output) detached, LongStraw's detached mode for MLA."""
    handles, p = [], tokens_P.shape[0]
    if detach_prompt_pages:

        def hook(module, args, out):
            return torch.cat([out[:, :p].detach(), out[:, p:]], dim=1)

        for layer in model.get_base_model().model.layers:
            handles.append(layer.self_attn.kv_a_proj_with_mqa.register_forward_hook(hook))
    try:
        logits = model(input_ids=torch.cat([tokens_P, response_R[:-1]])[None]).logits[0]
    finally:
        for h in handles:
            h.remove()
    return token_logprobs(logits[p - 1 :], response_R, TEMPERATURE)


def hf_grads(model, tokens_P, responses, mode: str = "exact") -> dict:
    """HF's LoRA gradients of the update objective over `responses` (reference under the adapter disabled):
    full-sequence backprop, or with the prompt's pages detached in detached mode."""
    for i, r in enumerate(responses):
        with model.disable_adapter(), torch.no_grad():
            ref = _hf_logp(model, tokens_P, r)
        update_objective(i, _hf_logp(model, tokens_P, r, mode == "detached"), ref)[0].backward()
    return pop_lora_grads(model)


def assert_grads_close(got, want):
    assert got.keys() == want.keys()
    assert any("experts" in n for n in want) and any("kv_b_proj" in n for n in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_logprobs_match_hf_full_forward(mla_path):
    model = lora_model(mla_path, TARGETS)
    tokens_P, responses = update_inputs(model.config.vocab_size)
    adapter = adapter_for(model)
    with torch.no_grad():
        capture = capture_prefix(model, tokens_P, CHUNK, adapter)
        assert isinstance(capture.state, LatentState)
        for r in responses:
            got = score_response(adapter, tokens_P, r, capture.state, None, 0, TEMPERATURE)
            torch.testing.assert_close(got, _hf_logp(model, tokens_P, r), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["exact", "detached"])
@pytest.mark.parametrize("budget", [0, 1 << 30], ids=["serial-checkpointed", "one-micro-batch"])
def test_grads_equal_hf_backprop(mla_path, mode, budget):
    """exact: full-sequence backprop. detached: backprop with the prompt's pages (latent and rope key) constant;
    kv_b_proj's up-projection stays live over the prefix through the queries and outputs."""
    model = lora_model(mla_path, TARGETS)
    tokens_P, responses = update_inputs(model.config.vocab_size)
    want = hf_grads(model, tokens_P, responses, mode)
    spec = UpdateSpec(
        mode=mode, chunk_size=CHUNK, temperature=TEMPERATURE, need_ref=True, replay_budget_bytes=budget,
        checkpoint_min_tokens=4 if budget == 0 else 256,
    )  # fmt: skip
    grpo_update(model, tokens_P, responses, update_objective, spec)
    assert_grads_close(pop_lora_grads(model), want)


def test_pages_are_the_latent_not_the_expansion(mla_path):
    """One [kv_lora_rank + qk_rope_head_dim] page per token and layer, stored once though it serves as key and value,
    and one gradient buffer of that size."""
    model = load_fp32(mla_path)
    tokens_P, _ = update_inputs(model.config.vocab_size)
    state = adapter_for(model).capture(tokens_P[:-1], CHUNK)
    c = model.config
    width = c.kv_lora_rank + c.qk_rope_head_dim
    assert state.k_L_Hkv_S_D.shape == (c.num_hidden_layers, 1, P - 1, width)
    pages = c.num_hidden_layers * (P - 1) * width * 4
    indexer = state.index_I_S_D.numel() * 4 if hasattr(state, "index_I_S_D") else 0  # DSA (tests/test_dsa.py)
    assert state.nbytes == pages + indexer
    assert state.zeros_like().nbytes == pages  # exact mode's gradient: one fp32 buffer of the pages' size
    expanded = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    assert expanded > width


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_route_replay_reproduces_forced_routes(mla_path, mode):
    """R3 on the V3-style router (sigmoid, score-correction bias, groups, routed scaling): logprobs of an update
    replaying forced routes equal an HF forward under the same routes."""
    model = lora_model(mla_path, TARGETS)
    tokens_P, responses = update_inputs(model.config.vocab_size)
    routes, forced = forced_routes(model, tokens_P, responses)
    want = []
    with RouteReplay(model) as hooks, torch.no_grad():
        for r, f in zip(responses, forced, strict=True):
            hooks.set(f, torch.ones(f.shape[0], dtype=torch.bool))
            want.append(_hf_logp(model, tokens_P, r))
    got = {}

    def objective(i, logp_R, ref_logp_R):
        got[i] = logp_R.detach()
        return -(UPDATE_ADV[i] * logp_R).mean(), {}

    spec = UpdateSpec(mode=mode, chunk_size=CHUNK, temperature=TEMPERATURE, replay_budget_bytes=1 << 30)
    grpo_update(model, tokens_P, responses, objective, spec, routes=routes)
    for i, w in enumerate(want):
        torch.testing.assert_close(got[i], w, atol=1e-5, rtol=0)
    with torch.no_grad():
        native = [_hf_logp(model, tokens_P, r) for r in responses]
    assert max((n - w).abs().max() for n, w in zip(native, want, strict=True)) > 1e-3


def test_graph_estimate_bounds_the_metered_graph(mla_path):
    model = lora_model(mla_path, TARGETS)
    tokens_P, responses = update_inputs(model.config.vocab_size)
    adapter = adapter_for(model)
    state = adapter.capture(tokens_P[:-1], CHUNK)
    exclude = module_storages(model) | state.storages()
    for rows in ([1], [2], [0, 1, 2]):
        batch = [responses[i] for i in rows]
        with GraphMeter(exclude) as meter:
            score_responses(adapter, tokens_P, batch, state, None, 1, TEMPERATURE)
        estimate = adapter.replay_graph_bytes(len(batch), max(len(r) for r in batch))
        assert meter.nbytes <= estimate <= 3 * meter.nbytes, (rows, meter.nbytes, estimate)
