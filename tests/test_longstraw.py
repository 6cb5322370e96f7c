"""LongStraw engine against independent references (fp32, CPU): HF full-sequence forwards and backprops.

G=3 responses of unequal lengths after a P=23 prompt, LoRA on attention and fused experts with non-zero lora_B
(so the adapter changes every K/V and every expert output), every MoE family: Qwen3-MoE, Qwen2-MoE and GLM-4.5
(a dense first layer, partial RoPE, q/k norm, q/k/v bias, head_dim 32 on hidden 64).
"""

from __future__ import annotations

import importlib
import pickle

import pytest
import torch
from conftest import load_fp32, lora_model, sum_atol
from transformers import AutoModelForCausalLM, Qwen3Config

from longstraw.adapters import KVState, adapter_for
from longstraw.engine import PrefixCapture, UpdateMetrics, UpdateSpec, capture_prefix, grpo_update, score_response
from longstraw.errors import LongStrawError
from longstraw.memory import TensorPeak
from longstraw.scoring import token_logprobs
from mint.config import LoraConfig
from mint.models.lora import add_lora

# The kernels' torch references are LongStraw's CPU path; their block sizes are module constants.
_attention_reference = importlib.import_module("mint_kernels._prefix_attention_reference")
_logprob_reference = importlib.import_module("mint_kernels._fused_logprob_reference")

# conftest's random_tiny_path, over every tiny MoE family (its default params are the two Qwen families).
every_family = pytest.mark.parametrize("random_tiny_path", ["qwen3_moe", "qwen2_moe", "glm4_moe"], indirect=True)

P = 23
LENGTHS = (2, 5, 9)
ADV = (1.0, -0.5, 0.7)
BETA = 0.3
TEMPERATURE = 0.9


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Tiny blocks so every test crosses block boundaries: prefix keys 4 at a time, own keys split, 3 logit rows."""
    monkeypatch.setattr(_attention_reference, "SCORE_BLOCK_ELEMENTS", 16)
    monkeypatch.setattr(_attention_reference, "MIN_KEY_BLOCK", 4)
    monkeypatch.setattr(_logprob_reference, "LOGIT_BLOCK_ELEMENTS", 3 * 97)


def _inputs(vocab: int, lengths=LENGTHS, prompt_len=P):
    gen = torch.Generator().manual_seed(1)
    tokens_P = torch.randint(0, vocab, (prompt_len,), generator=gen)
    return tokens_P, [torch.randint(0, vocab, (r,), generator=gen) for r in lengths]


def _objective(i, logp_R, ref_logp_R):
    """A GRPO-shaped loss: policy-gradient term plus a squared-log-ratio penalty to the reference."""
    loss = -(ADV[i] * logp_R).mean()
    if ref_logp_R is not None:
        loss = loss + BETA * (logp_R - ref_logp_R).pow(2).mean()
    return loss, {"logp": float(logp_R.detach().sum()), "n": 1.0}


def _lora_grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return grads


def _hf_logp(model, tokens_P, response_R, detach_prompt_kv=False):
    """Full-sequence HF forward over prompt+response; optionally detach k_proj/v_proj outputs at prompt positions."""
    handles = []
    if detach_prompt_kv:

        def hook(module, args, out):
            return torch.cat([out[:, :P].detach(), out[:, P:]], dim=1)

        for layer in model.get_base_model().model.layers:
            handles += [layer.self_attn.k_proj.register_forward_hook(hook)]
            handles += [layer.self_attn.v_proj.register_forward_hook(hook)]
    try:
        logits = model(input_ids=torch.cat([tokens_P, response_R])[None]).logits[0]
    finally:
        for h in handles:
            h.remove()
    return token_logprobs(logits[P - 1 : P - 1 + response_R.shape[0]], response_R, TEMPERATURE)


def _hf_grads(model, tokens_P, responses, detach_prompt_kv):
    for i, r in enumerate(responses):
        with model.disable_adapter(), torch.no_grad():
            ref = _hf_logp(model, tokens_P, r)
        loss, _ = _objective(i, _hf_logp(model, tokens_P, r, detach_prompt_kv), ref)
        loss.backward()
    return _lora_grads(model)


def _terms(config) -> int:
    """The longest chain of fp32 roundings behind a K/V row or a logprob (conftest.sum_atol): the layers times the
    widest reduction of a layer, plus the log-sum-exp over the vocabulary."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    moe = getattr(config, "moe_intermediate_size", 0)  # 0 on the dense Qwen3
    widest = max(config.hidden_size, config.num_attention_heads * head_dim, config.intermediate_size, moe)
    return config.num_hidden_layers * widest + config.vocab_size


def _assert_logp_close(got, want, config):
    """Two evaluations of the same logprobs in fp32, the same sums added in another order."""
    atol = sum_atol(torch.float32, want.abs().max().item(), _terms(config))
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


def _engine_grads(model, tokens_P, responses, mode, chunk_size=7, kernels="auto"):
    spec = UpdateSpec(mode=mode, chunk_size=chunk_size, temperature=TEMPERATURE, need_ref=True, kernels=kernels)
    metrics = grpo_update(model, tokens_P, responses, _objective, spec)
    return _lora_grads(model), metrics


def _assert_grads_close(got, want):
    assert got.keys() == want.keys()
    assert any("experts" in n for n in want) and any("k_proj" in n for n in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def _cosine(a, b) -> float:
    va = torch.cat([a[n].flatten() for n in sorted(a)])
    vb = torch.cat([b[n].flatten() for n in sorted(a)])
    return float(torch.nn.functional.cosine_similarity(va, vb, dim=0))


@every_family
def test_logprobs_match_hf_full_forward(random_tiny_path):
    """(a) Each response's logprobs equal a HF full forward over prompt+response."""
    model = lora_model(random_tiny_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    adapter = adapter_for(model)
    with torch.no_grad():
        capture = capture_prefix(model, tokens_P, chunk_size=7, adapter=adapter)
        for r in responses:
            got = score_response(adapter, tokens_P, r, capture.state, None, 0, TEMPERATURE)
            _assert_logp_close(got, _hf_logp(model, tokens_P, r), model.config)


@every_family
def test_exact_grads_equal_full_backprop(random_tiny_path):
    """(b) Exact mode equals full-sequence backprop of the same loss, prompt backward over several chunks."""
    model = lora_model(random_tiny_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    want = _hf_grads(model, tokens_P, responses, detach_prompt_kv=False)
    got, metrics = _engine_grads(model, tokens_P, responses, "exact")
    _assert_grads_close(got, want)
    assert metrics.mode == "exact" and metrics.dkv_bytes == metrics.prefix_bytes  # fp32 dKV of fp32 K/V


@every_family
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_kernel_path_wiring_equals_full_backprop(random_tiny_path, mode, monkeypatch):
    """One implementation per op: the adapter calls only mint_kernels (prefix_attention with the exact
    mode's dK/dV buffers, fused_logprob from hidden states); on CPU tensors those run their torch references, so
    this pins the wiring (layouts, GQA head order, buffer accumulation). The Triton bodies are checked against the
    same references under TRITON_INTERPRET=1 in tests/test_kernel_*.py."""
    import mint_kernels as kernels

    calls = {"prefix_attention": 0, "fused_logprob": 0}
    for name in calls:
        original = getattr(kernels, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    model = lora_model(random_tiny_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    want = _hf_grads(model, tokens_P, responses, detach_prompt_kv=mode == "detached")
    got, _ = _engine_grads(model, tokens_P, responses, mode)
    _assert_grads_close(got, want)
    assert calls["prefix_attention"] > 0 and calls["fused_logprob"] == 2 * len(responses)  # replays + reference


@every_family
def test_detached_grads_equal_backprop_with_prompt_kv_detached(random_tiny_path, capsys):
    """(c) Detached mode equals full backprop with the K/V of all P prompt positions detached (HF hooks)."""
    model = lora_model(random_tiny_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    want = _hf_grads(model, tokens_P, responses, detach_prompt_kv=True)
    got, metrics = _engine_grads(model, tokens_P, responses, "detached")
    _assert_grads_close(got, want)
    exact, _ = _engine_grads(model, tokens_P, responses, "exact")
    cosine = _cosine(got, exact)
    with capsys.disabled():
        print(f"\n[{model.config.model_type}] cosine(detached grad, exact grad) = {cosine:.3f}")
    assert cosine < 0.99  # the prompt path matters here, so (b) and (c) are different claims
    assert metrics.tokens == sum(LENGTHS) and metrics.responses == 3 and metrics.dkv_bytes == 0
    assert metrics.stats["n"] == 3.0


def test_first_response_token_gets_gradient_in_detached_mode(random_qwen3_path):
    """The last prompt position is replayed live, so a loss on r_0 alone still reaches LoRA (docs/longstraw.md)."""
    model = lora_model(random_qwen3_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    spec = UpdateSpec(mode="detached", chunk_size=7)
    grpo_update(model, tokens_P, responses[:1], lambda i, logp, ref: (-logp[0], {}), spec)
    grads = _lora_grads(model)
    assert any(g.abs().max() > 0 for n, g in grads.items() if "q_proj" in n)


@every_family
@pytest.mark.parametrize("chunk_size", [P, P // 4, 7])
def test_chunked_capture_gives_same_prefix_state(random_tiny_path, chunk_size):
    """(d) The captured prefix state does not depend on the chunk size."""
    model = lora_model(random_tiny_path)
    tokens_P, _ = _inputs(model.config.vocab_size)
    adapter = adapter_for(model)
    want = adapter.capture(tokens_P[:-1], chunk_size=P)
    got = adapter.capture(tokens_P[:-1], chunk_size=chunk_size)
    assert isinstance(got, KVState) and got.length == P - 1
    # The same fp32 sums in chunks of another size: they part by eps * max|value| * sqrt(terms) (conftest.sum_atol).
    for got_kv, want_kv in ((got.k_L_Hkv_S_D, want.k_L_Hkv_S_D), (got.v_L_Hkv_S_D, want.v_L_Hkv_S_D)):
        atol = sum_atol(torch.float32, want_kv.abs().max().item(), _terms(model.config))
        torch.testing.assert_close(got_kv, want_kv, atol=atol, rtol=0)


def test_dense_qwen3_logprobs_match_hf(tmp_path):
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.05,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = lora_model(str(tmp_path))
    tokens_P, responses = _inputs(97)
    adapter = adapter_for(model)
    with torch.no_grad():
        state = adapter.capture(tokens_P[:-1], chunk_size=5)
        for r in responses:
            got = score_response(adapter, tokens_P, r, state, None, 0, TEMPERATURE)
            _assert_logp_close(got, _hf_logp(model, tokens_P, r), model.config)


def test_replay_saves_nothing_prompt_sized(random_qwen3_path):
    """No copy or head-repeat of the prefix is saved for backward: every saved tensor is O(R), none O(P)."""
    model = lora_model(random_qwen3_path)
    prompt_len = 301  # larger than every model dimension (hidden 64, vocab 97, experts 4 x 128)
    tokens_P, responses = _inputs(model.config.vocab_size, lengths=(4,), prompt_len=prompt_len)
    adapter = adapter_for(model)
    state = adapter.capture(tokens_P[:-1], chunk_size=64)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp = score_response(adapter, tokens_P, responses[0], state, None, 1, 1.0)
    assert shapes and logp.requires_grad
    assert all(max(s, default=0) < prompt_len - 1 for s in shapes), [s for s in shapes if max(s) >= prompt_len - 1]


def test_resident_prefix_ages_and_is_stale_by_design(random_qwen3_path):
    model = lora_model(random_qwen3_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    detached, _ = _engine_grads(model, tokens_P, responses, "detached")

    capture = capture_prefix(model, tokens_P, chunk_size=7)
    spec = UpdateSpec(mode="resident", chunk_size=7, temperature=TEMPERATURE, need_ref=True, max_prefix_age=2)
    first = grpo_update(model, tokens_P, responses, _objective, spec, capture=capture)
    _assert_grads_close(_lora_grads(model), detached)  # fresh: same gradient as detached
    assert first.prefix_age == 0 and capture.age == 1

    with torch.no_grad():  # an optimizer step changes the adapter; the kept prefix does not follow
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    second = grpo_update(model, tokens_P, responses, _objective, spec, capture=capture)
    stale = _lora_grads(model)
    fresh, _ = _engine_grads(model, tokens_P, responses, "detached")
    assert second.prefix_age == 1
    assert max((stale[n] - fresh[n]).abs().max() for n in fresh) > 1e-5

    third = grpo_update(model, tokens_P, responses, _objective, spec, capture=capture)
    _lora_grads(model)
    assert third.prefix_age == 0 and capture.age == 1  # max_prefix_age=2 reached: recaptured


def test_spec_and_metrics_round_trip_pickle_and_validate(random_qwen3_path):
    spec = UpdateSpec(mode="exact", chunk_size=16, measure_graph=True)
    assert pickle.loads(pickle.dumps(spec)) == spec
    model = lora_model(random_qwen3_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    metrics = grpo_update(model, tokens_P, responses, _objective, spec)
    assert isinstance(metrics, UpdateMetrics) and pickle.loads(pickle.dumps(metrics)) == metrics
    assert metrics.graph_bytes_max > 0 and metrics.peak_memory_bytes >= 0 and metrics.prefix_age == 0
    with pytest.raises(LongStrawError, match="mode"):
        UpdateSpec(mode="full")
    with pytest.raises(LongStrawError, match="resident"):
        grpo_update(model, tokens_P, responses, _objective, UpdateSpec(mode="resident"))
    other = PrefixCapture(tokens_P.flip(0), capture_prefix(model, tokens_P).state)
    with pytest.raises(LongStrawError, match="different prompt"):
        grpo_update(model, tokens_P, responses, _objective, UpdateSpec(mode="resident"), capture=other)


def test_active_dropout_is_refused(random_qwen3_path):
    """Capture and replay (and exact mode's recompute) must compute the same function."""
    base = load_fp32(random_qwen3_path).requires_grad_(False)
    model = add_lora(base, LoraConfig(dropout=0.1, target_experts=False), seed=0).train()
    tokens_P, responses = _inputs(model.config.vocab_size)
    with pytest.raises(LongStrawError, match="dropout"):
        grpo_update(model, tokens_P, responses, _objective, UpdateSpec())
    model.eval()
    grpo_update(model, tokens_P, responses, _objective, UpdateSpec())


def test_update_with_measure_off_keeps_the_callers_peak_of_a_larger_first_update(random_qwen3_path):
    """Two updates inside one metered step, the first the larger (P=64, responses of 9, 16, 24 tokens, exact) and
    the second tiny (P=3, one token). A measuring update starts its own peak meter, which resets the device's
    process-wide peak, so the step's meter kept only the second update's peak (the learner's peak_memory_mb was
    the last group's). With measure=False the step keeps the first update's peak, and the update reports no
    timings and no peak, since it took none."""
    model = lora_model(random_qwen3_path)
    big = _inputs(model.config.vocab_size, lengths=(9, 16, 24), prompt_len=64)
    small = _inputs(model.config.vocab_size, lengths=(1,), prompt_len=3)

    def update(inputs, measure: bool) -> UpdateMetrics:
        spec = UpdateSpec(mode="exact", chunk_size=7, need_ref=True, measure=measure)
        return grpo_update(model, *inputs, _objective, spec)

    update(big, False)
    _lora_grads(model)
    with TensorPeak() as alone:
        update(big, False)
    _lora_grads(model)
    with TensorPeak() as step:
        update(big, False)
        metrics = update(small, False)
    _lora_grads(model)
    with TensorPeak() as measured_step:
        update(big, True)
        update(small, True)
    _lora_grads(model)
    # Measured: 504 KB for the big update, 156 KB for the measured step (the big one's gradients plus the small
    # update). The 64 KiB slack, for bookkeeping that may differ between runs, is far below that gap.
    slack = 64 * 1024
    assert abs(step.nbytes - alone.nbytes) <= slack, (step.nbytes, alone.nbytes)
    assert measured_step.nbytes < alone.nbytes / 2, (measured_step.nbytes, alone.nbytes)
    assert metrics.peak_memory_bytes is None and metrics.capture_s is None and metrics.replay_s is None
    assert metrics.ref_s is None and metrics.prompt_backward_s is None


def test_phase_clock_that_is_off_never_synchronizes_cuda(monkeypatch):
    """grpo_update timed its phases with a torch.cuda.synchronize at each boundary (8 per group with a reference,
    2 more for its peak meter) for metrics the learner then threw away. Its clock with measure=False must not
    synchronize at all; on, it synchronizes once per reading. CUDA-only code, reached on CPU through a counting
    stand-in for torch.cuda.synchronize (nothing else of CUDA runs)."""
    from longstraw.engine import _Clock

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    off = _Clock(torch.device("cuda", 0), on=False)
    assert off.since(off.now()) is None and calls == []
    on = _Clock(torch.device("cuda", 0), on=True)
    assert on.since(on.now()) >= 0.0 and len(calls) == 2
