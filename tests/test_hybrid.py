"""LongStraw on the hybrid linear-attention families against transformers' own forward and backward (fp32, CPU).

Qwen3.5-MoE, Qwen3-Next and dense Qwen3.5 tiny bases (random weights, 3 Gated DeltaNet layers then a gated
full-attention layer), LoRA on the attention and Gated DeltaNet projections and the fused experts, with non-zero
lora_B. G=3 responses of unequal lengths after a P=23 prompt captured in chunks of 7, so the prompt backward crosses
three chunk-start checkpoints. The references are HF full-sequence forwards and backprops, and for detached mode HF's
own cached continuation with the cache held constant after the last prompt position.
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
from transformers import DynamicCache

from longstraw.adapters import LayeredState, adapter_for
from longstraw.adapters.hybrid import FULL, LINEAR
from longstraw.engine import UpdateSpec, capture_prefix, grpo_update, score_response
from longstraw.errors import LongStrawError
from longstraw.memory import GraphMeter, module_storages
from longstraw.replay import score_responses
from longstraw.routing import RouteReplay
from longstraw.scoring import token_logprobs

FAMILIES = ["qwen3_5_moe", "qwen3_next", "qwen3_5"]
P, LENGTHS = UPDATE_P, UPDATE_LENGTHS
TEMPERATURE = 0.9
CHUNK = 7
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj")


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid_path(request, tmp_path_factory) -> str:
    """A random tiny base of each hybrid family whose norms, decays and dt biases are moved off their init (zeros
    for the zero-centred norms), so a norm read as w instead of 1 + w, or a wrong decay, changes every output."""
    path = build_random_tiny(request.param, str(tmp_path_factory.mktemp(request.param)))
    model = load_fp32(path)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    return path


def _hf_logp(model, tokens_P, response_R):
    """The response's logprobs from one forward over prompt + response[:-1] (nothing reads the last token's)."""
    logits = model(input_ids=torch.cat([tokens_P, response_R[:-1]])[None]).logits[0]
    return token_logprobs(logits[P - 1 : P - 1 + response_R.shape[0]], response_R, TEMPERATURE)


def _assert_grads_close(got, want, model):
    """Within 1e-5 (abs) for every LoRA tensor; the expert, Gated DeltaNet and attention LoRA all get gradients."""
    assert got.keys() == want.keys()
    assert any("in_proj" in n for n in want) and any("q_proj" in n for n in want)
    assert any("experts" in n for n in want) == bool(getattr(model.config, "num_experts", 0))
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_logprobs_match_hf_full_forward(hybrid_path):
    model = lora_model(hybrid_path, list(PROJECTIONS))
    tokens_P, responses = update_inputs(model.config.vocab_size)
    adapter = adapter_for(model)
    with torch.no_grad():
        capture = capture_prefix(model, tokens_P, CHUNK, adapter)
        for r in responses:
            got = score_response(adapter, tokens_P, r, capture.state, None, 0, TEMPERATURE)
            torch.testing.assert_close(got, _hf_logp(model, tokens_P, r), atol=1e-5, rtol=0)


def test_capture_holds_the_state_hf_caches(hybrid_path):
    """The boundary (S, conv window) and the full layer's K/V pages equal what HF's own cache holds after the same
    positions, captured in chunks."""
    model = load_fp32(hybrid_path)
    tokens_P, _ = update_inputs(model.config.vocab_size)
    state = adapter_for(model).capture(tokens_P[:-1], CHUNK)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=tokens_P[None, :-1], cache=cache, use_cache=True)
    boundary, pages = state.parts[LINEAR], state.parts[FULL]
    linear = [i for i, t in enumerate(model.config.layer_types) if t == LINEAR]
    full = [i for i, t in enumerate(model.config.layer_types) if t == FULL]
    width = boundary.window_L_C_W.shape[-1]
    for j, i in enumerate(linear):
        torch.testing.assert_close(boundary.s_L_H_K_V[j], cache.layers[i].recurrent_states[0][0], atol=1e-5, rtol=0)
        hf_window = cache.layers[i].conv_states[0][0][:, -width:]
        torch.testing.assert_close(boundary.window_L_C_W[j], hf_window, atol=1e-5, rtol=0)
    for j, i in enumerate(full):
        torch.testing.assert_close(pages.k_L_Hkv_S_D[j], cache.layers[i].keys[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(pages.v_L_Hkv_S_D[j], cache.layers[i].values[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("budget", [0, 1 << 30], ids=["serial-checkpointed", "one-micro-batch"])
def test_exact_grads_equal_full_backprop(hybrid_path, budget):
    """Exact mode through the recurrence: the replays' dS reaches the boundary, the prompt backward carries it
    chunk by chunk through the checkpoints; LoRA gradients equal full-sequence backprop."""
    model = lora_model(hybrid_path, list(PROJECTIONS))
    tokens_P, responses = update_inputs(model.config.vocab_size)
    for i, r in enumerate(responses):
        with model.disable_adapter(), torch.no_grad():
            ref = _hf_logp(model, tokens_P, r)
        update_objective(i, _hf_logp(model, tokens_P, r), ref)[0].backward()
    want = pop_lora_grads(model)
    spec = UpdateSpec(
        mode="exact", chunk_size=CHUNK, temperature=TEMPERATURE, need_ref=True, replay_budget_bytes=budget,
        checkpoint_min_tokens=4 if budget == 0 else 256,
    )  # fmt: skip
    metrics = grpo_update(model, tokens_P, responses, update_objective, spec)
    assert metrics.micro_batches == (len(LENGTHS) if budget == 0 else 1)
    _assert_grads_close(pop_lora_grads(model), want, model)


def _detach_cache(cache: DynamicCache) -> None:
    for layer in cache.layers:
        for name in ("keys", "values"):
            if isinstance(getattr(layer, name, None), torch.Tensor):
                setattr(layer, name, getattr(layer, name).detach())
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None)
            if isinstance(states, list | dict):
                for key in range(len(states)) if isinstance(states, list) else list(states):
                    if isinstance(states[key], torch.Tensor):
                        states[key] = states[key].detach()


def _assigning(layer):
    def update(recurrent_states, state_idx=0, **kwargs):
        layer.recurrent_states[state_idx] = recurrent_states
        return recurrent_states

    return update


def _detached_reference_logp(model, tokens_P, response_R):
    """HF's cached continuation: the prompt's last position runs live (its own K/V detached, as LongStraw's K/V
    layers treat it) from the cache of positions 0..P-2, then the cache is held constant and the response runs
    from it."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=tokens_P[None, :-1], cache=cache, use_cache=True)
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            # HF copies a step's new state into the tensor the step read (kept static for CUDA graphs), which
            # autograd refuses to differentiate through; assigning the new one computes the same forward.
            layer.update_recurrent_state = _assigning(layer)

    def detach_output(module, args, out):
        return out.detach()

    handles = []
    for layer in model.get_base_model().model.layers:
        if hasattr(layer, "self_attn"):
            handles += [layer.self_attn.k_proj.register_forward_hook(detach_output)]
            handles += [layer.self_attn.v_proj.register_forward_hook(detach_output)]
    try:
        first = model(input_ids=tokens_P[None, -1:], cache=cache, use_cache=True).logits[0]
    finally:
        for h in handles:
            h.remove()
    logits = [first]
    if response_R.shape[0] > 1:
        _detach_cache(cache)
        logits.append(model(input_ids=response_R[None, :-1], cache=cache, use_cache=True).logits[0])
    return token_logprobs(torch.cat(logits), response_R, TEMPERATURE)


def test_detached_equals_hf_with_the_boundary_state_held_constant(hybrid_path):
    model = lora_model(hybrid_path, list(PROJECTIONS))
    tokens_P, responses = update_inputs(model.config.vocab_size)
    for i, r in enumerate(responses):
        update_objective(i, _detached_reference_logp(model, tokens_P, r), None)[0].backward()
    want = pop_lora_grads(model)
    spec = UpdateSpec(mode="detached", chunk_size=CHUNK, temperature=TEMPERATURE, replay_budget_bytes=1 << 30)
    grpo_update(model, tokens_P, responses, update_objective, spec)
    got = pop_lora_grads(model)
    _assert_grads_close(got, want, model)
    # Detached is another gradient than exact: the state after the prompt is a constant.
    grpo_update(
        model, tokens_P, responses, update_objective, UpdateSpec(mode="exact", chunk_size=CHUNK, temperature=0.9)
    )
    exact = pop_lora_grads(model)
    assert max((exact[n] - got[n]).abs().max() for n in got) > 1e-4


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_route_replay_reproduces_hf_logprobs_under_forced_routes(hybrid_path, mode):
    """R3 with each router's own rule (Qwen3.5's always-renormalized top-k, Qwen3-Next's norm_topk_prob, the
    sigmoid-gated shared expert untouched): logprobs of an update that replays forced routes equal an HF forward
    under the same routes, and the routers' own picks come back per response."""
    model = lora_model(hybrid_path, list(PROJECTIONS))
    if not getattr(model.config, "num_experts", 0):
        pytest.skip("dense Qwen3.5 has no routers")
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
    metrics = grpo_update(model, tokens_P, responses, objective, spec, routes=routes)
    for i, w in enumerate(want):
        torch.testing.assert_close(got[i], w, atol=1e-5, rtol=0)
    with torch.no_grad():
        native = [_hf_logp(model, tokens_P, r) for r in responses]
    assert max((n - w).abs().max() for n, w in zip(native, want, strict=True)) > 1e-3  # the forcing matters
    assert [tuple(n.shape[:1]) for n in metrics.native_routes] == [(n,) for n in LENGTHS]


def test_exact_mode_needs_the_captures_checkpoints(hybrid_path):
    model = lora_model(hybrid_path, list(PROJECTIONS))
    tokens_P, _ = update_inputs(model.config.vocab_size)
    adapter = adapter_for(model)
    bare = adapter.capture(tokens_P[:-1], CHUNK)
    with pytest.raises(LongStrawError, match="keep_checkpoints"):
        adapter.backward_prompt(tokens_P[:-1], bare, bare.zeros_like(), CHUNK)
    kept = adapter.with_options(keep_checkpoints=True).capture(tokens_P[:-1], CHUNK)
    with pytest.raises(LongStrawError, match="same chunk size"):
        adapter.backward_prompt(tokens_P[:-1], kept, kept.zeros_like(), CHUNK + 1)


def test_boundary_state_is_flat_in_the_prompt_length_and_pages_are_not(hybrid_path):
    model = load_fp32(hybrid_path)
    adapter = adapter_for(model).with_options(keep_checkpoints=True)
    sizes = {}
    for prompt_len in (16, 64):
        tokens_P, _ = update_inputs(model.config.vocab_size, prompt_len)
        state = adapter.capture(tokens_P[:-1], 8)
        assert isinstance(state, LayeredState)
        boundary = state.parts[LINEAR]
        assert len(boundary.checkpoints) == -(-(prompt_len - 1) // 8) - 1
        sizes[prompt_len] = (state.parts[FULL].nbytes, boundary.zeros_like(None).nbytes, boundary.nbytes)
    pages, flat, with_checkpoints = zip(*(sizes[16], sizes[64]), strict=True)
    assert flat[0] == flat[1] and pages[1] == pages[0] * 63 // 15
    assert with_checkpoints[1] == flat[1] * (1 + -(-63 // 8) - 1)


def test_graph_estimate_bounds_the_metered_graph(hybrid_path):
    """replay_graph_bytes, what sizes replay micro-batches, is 1x to 3x the bytes a forward saves for backward."""
    model = lora_model(hybrid_path, list(PROJECTIONS))
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


@pytest.mark.gpu
def test_flash_linear_attention_path_equals_the_torch_path(hybrid_path):
    """On CUDA with the gpu extra: the chunked kernel of flash-linear-attention gives the torch path's logprobs and
    exact-mode gradients (fp32)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("fla")
    model = lora_model(hybrid_path, list(PROJECTIONS)).cuda()
    tokens_P, responses = update_inputs(model.config.vocab_size)
    tokens_P, responses = tokens_P.cuda(), [r.cuda() for r in responses]
    results = []
    for kernels in ("on", "off"):
        spec = UpdateSpec(mode="exact", chunk_size=CHUNK, temperature=TEMPERATURE, kernels=kernels)
        grpo_update(model, tokens_P, responses, update_objective, spec)
        results.append(pop_lora_grads(model))
    for name in results[1]:
        torch.testing.assert_close(results[0][name], results[1][name], atol=1e-4, rtol=1e-3, msg=name)


def test_resident_from_a_fresh_capture_is_detached_and_ages(hybrid_path):
    """Resident mode keeps the LayeredState (pages and boundary) across updates: from a fresh capture its gradient
    is detached mode's; after an optimizer step the kept state is stale by design and the gradient moves."""
    model = lora_model(hybrid_path, list(PROJECTIONS))
    tokens_P, responses = update_inputs(model.config.vocab_size)
    spec = dict(chunk_size=CHUNK, temperature=TEMPERATURE)
    grpo_update(model, tokens_P, responses, update_objective, UpdateSpec(mode="detached", **spec))
    detached = pop_lora_grads(model)
    kept = capture_prefix(model, tokens_P, CHUNK)
    metrics = grpo_update(
        model, tokens_P, responses, update_objective, UpdateSpec(mode="resident", **spec), capture=kept
    )
    _assert_grads_close(pop_lora_grads(model), detached, model)
    assert metrics.prefix_age == 0 and kept.age == 1 and isinstance(kept.state, LayeredState)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.mul_(1.5)
    grpo_update(model, tokens_P, responses, update_objective, UpdateSpec(mode="resident", **spec), capture=kept)
    stale = pop_lora_grads(model)
    grpo_update(model, tokens_P, responses, update_objective, UpdateSpec(mode="detached", **spec))
    fresh = pop_lora_grads(model)
    assert max((stale[n] - fresh[n]).abs().max() for n in fresh) > 1e-5
