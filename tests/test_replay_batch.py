"""LongStraw's replay in micro-batches (longstraw.replay) against one-response-at-a-time replay (fp32, CPU).

G=4 responses of unequal lengths (2, 9, 5, 1 tokens) after a P=23 prompt, LoRA on attention and on the fused experts
with non-zero lora_B, every tiny MoE family. Micro-batched replay pads responses to the longest of their micro-batch
and runs them in one forward and one backward; its logprobs and LoRA gradients must be serial replay's up to the
order of fp32 sums, in exact and detached mode, with the reference (KL) pass, with recorded routes (R3).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import forced_routes, lora_model, sum_atol

from longstraw.adapters import adapter_for
from longstraw.engine import UpdateSpec, grpo_update
from longstraw.memory import GraphMeter, module_storages
from longstraw.replay import plan_micro_batches, score_responses

_attention_reference = importlib.import_module("mint_kernels._prefix_attention_reference")
_logprob_reference = importlib.import_module("mint_kernels._fused_logprob_reference")

every_family = pytest.mark.parametrize("random_tiny_path", ["qwen3_moe", "qwen2_moe", "glm4_moe"], indirect=True)

P = 23
LENGTHS = (2, 9, 5, 1)
TEMPERATURE = 0.9
ALL_AT_ONCE = 1 << 40  # a budget every micro-batch fits


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Tiny kernel blocks, so the batched attention crosses prefix and own-key block edges as serial replay does."""
    monkeypatch.setattr(_attention_reference, "SCORE_BLOCK_ELEMENTS", 16)
    monkeypatch.setattr(_attention_reference, "MIN_KEY_BLOCK", 4)
    monkeypatch.setattr(_logprob_reference, "LOGIT_BLOCK_ELEMENTS", 3 * 97)


def _inputs(vocab: int):
    gen = torch.Generator().manual_seed(1)
    tokens_P = torch.randint(0, vocab, (P,), generator=gen)
    return tokens_P, [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]


def _update(model, tokens_P, responses, mode, budget, routes=None, **spec):
    """(logprobs by response, LoRA grads, metrics) of one update whose objective is GRPO-shaped with a KL term."""
    logps = {}

    def objective(i, logp_R, ref_R):
        logps[i] = logp_R.detach().clone()
        loss = -((1.0 if i % 2 else -0.7) * logp_R).mean() + 0.3 * (logp_R - ref_R).pow(2).mean()
        return loss, {"n": 1.0}

    spec = UpdateSpec(
        mode=mode, chunk_size=7, temperature=TEMPERATURE, need_ref=True, replay_budget_bytes=budget, **spec
    )
    metrics = grpo_update(model, tokens_P, responses, objective, spec, routes=routes)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return [logps[i] for i in range(len(responses))], grads, metrics


def _terms(config) -> int:
    """The longest chain of fp32 roundings behind a LoRA gradient (conftest.sum_atol): the layers times the widest
    reduction of a layer plus the log-sum-exp over the vocabulary, for each of the G responses whose gradients add
    up (serial replay adds them one backward at a time, a micro-batch inside its matmuls)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    widest = max(config.hidden_size, config.num_attention_heads * head_dim, config.intermediate_size)
    return (config.num_hidden_layers * widest + config.vocab_size) * len(LENGTHS)


def _assert_same(got, want, config):
    """Logprobs and gradients of the same sums added in another order: eps * magnitude * sqrt(terms) apart."""
    (got_logps, got_grads), (want_logps, want_grads) = got, want
    terms = _terms(config)
    for g, w in zip(got_logps, want_logps, strict=True):
        torch.testing.assert_close(g, w, atol=sum_atol(torch.float32, w.abs().max().item(), terms), rtol=0)
    assert got_grads.keys() == want_grads.keys()
    assert any("experts" in n for n in want_grads) and any("k_proj" in n for n in want_grads)
    for name, w in want_grads.items():
        atol = sum_atol(torch.float32, w.abs().max().item(), terms)
        torch.testing.assert_close(got_grads[name], w, atol=atol, rtol=0, msg=name)


@every_family
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_micro_batched_replay_equals_serial_replay(random_tiny_path, mode):
    """All four responses in one micro-batch, and a budget that fits two per micro-batch, against one at a time."""
    model = lora_model(random_tiny_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    serial_logps, serial_grads, serial = _update(model, tokens_P, responses, mode, 0)
    assert serial.micro_batches == len(LENGTHS)
    pair = adapter_for(model).with_options(checkpoint_min_tokens=256).replay_graph_bytes(2, max(LENGTHS))
    # The pair budget, longest first: [9, 5] (two rows of 9 fit), then [2, 1].
    for budget, micro_batches in ((ALL_AT_ONCE, 1), (pair, 2)):
        logps, grads, metrics = _update(model, tokens_P, responses, mode, budget)
        assert metrics.micro_batches == micro_batches
        _assert_same((logps, grads), (serial_logps, serial_grads), model.config)
        assert metrics.loss == pytest.approx(serial.loss, rel=1e-6) and metrics.stats == serial.stats


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_micro_batched_replay_with_routes_equals_serial_replay(random_tiny_path, mode):
    """R3: each row of a micro-batch replays its own response's routes (the pads route natively and count for
    nothing); gradients, logprobs and the routers' own picks per response equal serial replay's."""
    model = lora_model(random_tiny_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    routes, _ = forced_routes(model, tokens_P, responses)
    serial_logps, serial_grads, serial = _update(model, tokens_P, responses, mode, 0, routes=routes)
    logps, grads, batched = _update(model, tokens_P, responses, mode, ALL_AT_ONCE, routes=routes)
    assert batched.micro_batches == 1 and serial.micro_batches == len(LENGTHS)
    _assert_same((logps, grads), (serial_logps, serial_grads), model.config)
    for got, want, n in zip(batched.native_routes, serial.native_routes, LENGTHS, strict=True):
        assert got.shape == (n, model.config.num_hidden_layers, model.config.num_experts_per_tok)
        assert torch.equal(got, want)
    # The forced routes matter: without them the gradient is another one.
    _, native_grads, _ = _update(model, tokens_P, responses, mode, ALL_AT_ONCE)
    assert max((native_grads[n] - grads[n]).abs().max() for n in grads) > 1e-4


def test_plan_takes_responses_longest_first_while_the_estimate_fits():
    lengths = [3, 40, 9, 9, 1]
    tokens_of = lambda rows, tokens: rows * tokens  # one token, one byte
    assert plan_micro_batches(lengths, 0, tokens_of) == [[0], [1], [2], [3], [4]]  # no budget: serial, in order
    assert plan_micro_batches(lengths, 39, tokens_of) == [[1], [2, 3, 0, 4]]  # 40 alone exceeds 39: on its own
    assert plan_micro_batches(lengths, 80, tokens_of) == [[1, 2], [3, 0, 4]]  # [40, 9] pads to 80
    assert plan_micro_batches(lengths, 1 << 20, tokens_of) == [[1, 2, 3, 0, 4]]
    assert plan_micro_batches(lengths, 1 << 20, tokens_of, batched=False) == [[0], [1], [2], [3], [4]]
    # Rows of at least alone_from tokens (the checkpointing threshold) replay alone; the shorter ones still batch.
    assert plan_micro_batches(lengths, 1 << 20, tokens_of, alone_from=9) == [[1], [2], [3], [0, 4]]


def test_rows_long_enough_to_be_checkpointed_replay_alone(random_qwen3_path):
    """With checkpoint_min_tokens=5, the 9- and 5-token responses replay one at a time and the 2- and 1-token ones
    together, whatever the budget: a checkpointed micro-batch's backward would recompute all its rows' layer at
    once, which no saved-tensor meter sees. Gradients are serial replay's."""
    model = lora_model(random_qwen3_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    serial = _update(model, tokens_P, responses, "exact", 0, checkpoint_min_tokens=5)
    batched = _update(model, tokens_P, responses, "exact", ALL_AT_ONCE, checkpoint_min_tokens=5)
    assert batched[2].micro_batches == 3
    _assert_same(batched[:2], serial[:2], model.config)


@every_family
def test_graph_estimate_bounds_the_metered_graph(random_tiny_path):
    """The adapter's replay_graph_bytes (what sizes micro-batches) is 1x to 2x the bytes a micro-batch's forward
    saves for backward (longstraw.memory.GraphMeter), for micro-batches of 1 to 4 unequal responses."""
    model = lora_model(random_tiny_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    adapter = adapter_for(model)
    state = adapter.capture(tokens_P[:-1], 7)
    exclude = module_storages(model) | state.storages()
    for rows in ([1], [3], [1, 2], [0, 1, 2, 3]):
        batch = [responses[i] for i in rows]
        with GraphMeter(exclude) as meter:
            score_responses(adapter, tokens_P, batch, state, None, 1, TEMPERATURE)
        estimate = adapter.replay_graph_bytes(len(batch), max(len(r) for r in batch))
        assert meter.nbytes <= estimate <= 2 * meter.nbytes, (rows, meter.nbytes, estimate)


def test_budget_caps_the_metered_graph_of_every_micro_batch(random_qwen3_path):
    """With a budget of two 9-token rows, every micro-batch's metered graph stays within it, and the largest is
    above one response's (so the budget, not the longest response, set it)."""
    model = lora_model(random_qwen3_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    budget = adapter_for(model).with_options(checkpoint_min_tokens=256).replay_graph_bytes(2, max(LENGTHS))
    _, _, serial = _update(model, tokens_P, responses, "exact", 0, measure_graph=True)
    _, _, batched = _update(model, tokens_P, responses, "exact", budget, measure_graph=True)
    assert batched.micro_batches == 2
    assert serial.graph_bytes_max < batched.graph_bytes_max <= budget


def test_update_leaves_the_callers_adapter_and_routes_as_they_were(random_qwen3_path):
    """grpo_update set the spec's options and an R3 window hook on the caller's adapter and wrote the current
    response and its route hooks into the caller's routes, which the learner's objective then read back. Now the
    engine runs copies (Adapter.with_options), hands the routers' own picks back in UpdateMetrics.native_routes,
    and what the caller passed is unchanged."""
    model = lora_model(random_qwen3_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    adapter = adapter_for(model)
    routes, _ = forced_routes(model, tokens_P, responses)
    adapter_before, routes_before = dict(vars(adapter)), dict(vars(routes))
    spec = UpdateSpec(mode="exact", chunk_size=7, checkpoint_min_tokens=1, vocab_limit=97, replay_budget_bytes=1 << 30)
    metrics = grpo_update(
        model, tokens_P, responses, lambda i, logp, ref: (-logp.mean(), {}), spec, adapter, routes=routes
    )
    model.zero_grad(set_to_none=True)
    assert vars(adapter).keys() == adapter_before.keys() and vars(routes).keys() == routes_before.keys()
    assert all(vars(adapter)[k] is v for k, v in adapter_before.items())
    assert all(vars(routes)[k] is v for k, v in routes_before.items())
    assert adapter.on_positions is None and adapter.checkpoint_min_tokens == 0 and adapter.vocab_limit is None
    assert len(metrics.native_routes) == len(LENGTHS)


@pytest.mark.parametrize("r3", ["true", "false"])
def test_learner_step_with_a_replay_budget_equals_the_naive_step(random_tiny_path, r3, monkeypatch):
    """The learner's LongStraw exact step with every response of the group in one micro-batch, through DeepSpeed's
    backward: gradients, logprobs, loss and trust counts (out-of-route included, now counted from the routes the
    update returns) equal the padded full-sequence step's, as tests/test_inner_step.py holds serial replay to."""
    from test_inner_step import _group, _lora_grads, _one, real_learner

    import longstraw.engine
    from mint.train.inner_step import longstraw_group_step, naive_group_step

    batch_sizes = []

    def counted(adapter, tokens_P, responses, *args):
        batch_sizes.append(len(responses))
        return score_responses(adapter, tokens_P, responses, *args)

    monkeypatch.setattr(longstraw.engine, "score_responses", counted)

    overrides = ["longstraw.mode=exact", "longstraw.chunk_size=2", "longstraw.replay_budget_mb=64", "grpo.kl_coef=0.05"]
    learner = real_learner(random_tiny_path, [*overrides, f"grpo.r3={r3}", "grpo.icepop=false"])
    micro, plan = _one(_group(routes_ok=False))
    naive_stats, naive_logp = naive_group_step(learner.ctx, micro, plan, None, last=True)
    naive = _lora_grads(learner)
    learner.engine.optimizer.zero_grad()
    stats, logp = longstraw_group_step(learner.ctx, micro, plan, None, last=True)
    assert torch.allclose(_lora_grads(learner), naive, atol=1e-6, rtol=1e-4) and float(naive.abs().sum()) > 0
    for a, b in zip(logp, naive_logp, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert stats["loss"] == pytest.approx(naive_stats["loss"], abs=1e-6)
    assert stats["kl"] == pytest.approx(naive_stats["kl"], rel=1e-4, abs=1e-9)
    a, b = stats["trust"], naive_stats["trust"]
    assert (a.kept, a.masked, a.routed, a.out_of_route) == (b.kept, b.masked, b.routed, b.out_of_route)
    assert a.routed > 0
    assert batch_sizes == [2, 2]  # the reference pass and the replay: both responses in one forward
