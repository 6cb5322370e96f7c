"""LongStraw on DSA bases past index_topk (fp32, CPU, against transformers): DeepSeek-V3.2 and GLM-5 with index_topk 8,
so after the first 8 positions every query attends to a subset of its keys, in the capture, the replay and the
prompt backward alike. GLM-5's third layer is a shared one: it reads the second layer's selection.

Two ways past the indexer's ties (its ReLU scores tie at 0, and a tie across the cut lets two correct
implementations keep different keys):
- injected: one fixed random causal selection per layer and position drives both transformers' attention (its
  indexer's output replaced) and LongStraw's (`index_replay`), so logprobs and gradients must agree to fp32 noise;
- own: LongStraw's indexer against transformers', on a base with 8 indexer heads where no tie falls at the cut for
  these inputs (checked: transformers' selections, replayed as rollout records, count no mismatch).
"""

from __future__ import annotations

import pytest
import torch
from conftest import load_fp32, lora_model, pop_lora_grads, update_inputs, update_objective
from test_mla import TARGETS, TEMPERATURE, _hf_logp, assert_grads_close, hf_grads

from longstraw.adapters import adapter_for
from longstraw.adapters.dsa import DsaAdapter, DsaState
from longstraw.engine import UpdateSpec, capture_prefix, grpo_update, score_response
from longstraw.errors import LongStrawError
from longstraw.indexer_replay import IndexerReplay

FAMILIES = ["deepseek_v32", "glm_moe_dsa"]
TOPK = 8
CHUNK = 7


def _path(family: str, directory: str, **overrides) -> str:
    """A random tiny DSA base with index_topk 8 and its 1-d weights (norms, biases) moved off their init, so a norm
    read wrong changes the outputs."""
    from transformers import AutoModelForCausalLM

    from mint.models.specs import tiny_config

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(
        tiny_config(family, 97, **{"index_topk": TOPK, "initializer_range": 0.05, **overrides})
    )
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=FAMILIES)
def dsa_path(request, tmp_path_factory) -> str:
    return _path(request.param, str(tmp_path_factory.mktemp(request.param)))


class Injected:
    """One random causal selection per indexer layer and query position (every key while a query has at most
    index_topk of them), served to transformers' indexers and to LongStraw's index_replay alike."""

    def __init__(self, model, length: int, seed: int = 7):
        gen = torch.Generator().manual_seed(seed)
        self.rows = {}  # layer -> [length, TOPK] absolute key positions, -1 for an empty slot
        for i, layer in enumerate(model.get_base_model().model.layers):
            if getattr(layer.self_attn, "indexer", None) is None:
                continue
            rows = torch.full((length, TOPK), -1, dtype=torch.int64)
            for s in range(length):
                keys = torch.arange(s + 1) if s < TOPK else torch.randperm(s + 1, generator=gen)[:TOPK]
                rows[s, : keys.numel()] = keys
            self.rows[i] = rows

    def replay(self, layer: int, start: int, own: torch.Tensor) -> torch.Tensor:
        """LongStraw's index_replay: the injected rows in place of the layer's own selection [T, K]."""
        t, k = own.shape[-2:]
        return self.rows[layer][start : start + t, :k].expand_as(own)

    def records(self, prompt_len: int, responses) -> list[torch.Tensor]:
        """Per response, the injected rows of its queries (positions P-1 ..) as rollout records [R, I, K]."""
        layers = sorted(self.rows)
        return [
            torch.stack([self.rows[i][prompt_len - 1 : prompt_len - 1 + len(r)] for i in layers], 1) for r in responses
        ]

    def patch(self, model, own_before: int = 0):
        """Replace each HF indexer's top-k by the injected rows, from query position `own_before` on (the queries
        before it keep the indexer's own): [1, S, min(TOPK, S)] with the empty slots filled by future positions,
        which the causal mask hides (transformers' own top-k does the same)."""
        for i, rows in self.rows.items():
            indexer = model.get_base_model().model.layers[i].self_attn.indexer
            own_forward = indexer.forward

            def forward(hidden_states, *args, _rows=rows, _own=own_forward, **kwargs):
                s = hidden_states.shape[1]
                k = min(TOPK, s)
                out = _rows[:s, :k].clone()
                for q in range(min(k - 1, s)):
                    out[q, q + 1 :] = torch.arange(q + 1, k)
                out[:own_before] = _own(hidden_states, *args, **kwargs)[0, :own_before].long()
                return out[None].to(torch.int32)

            indexer.forward = forward


def test_the_prefix_state_keeps_indexer_pages_without_a_gradient_buffer(dsa_path):
    model = load_fp32(dsa_path)
    tokens_P, _ = update_inputs(model.config.vocab_size)
    adapter = adapter_for(model)
    assert isinstance(adapter, DsaAdapter)
    state = adapter.capture(tokens_P[:-1], CHUNK)
    c, s = model.config, tokens_P.shape[0] - 1
    indexer_layers = sum(t == "full" for t in getattr(c, "indexer_types", ["full"] * c.num_hidden_layers))
    assert isinstance(state, DsaState) and state.index_I_S_D.shape == (indexer_layers, s, c.index_head_dim)
    pages = c.num_hidden_layers * s * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    assert state.nbytes == pages + indexer_layers * s * c.index_head_dim * 4
    assert state.zeros_like().nbytes == pages  # no gradient for the indexer
    # Captured in chunks of 7 past index_topk, the pages equal one capture of the whole prompt in one chunk, up to
    # fp32 rounding (the chunks' sums add in another order: ~1e-6 at these magnitudes; a wrong selection is ~1e-1).
    whole = adapter.capture(tokens_P[:-1], 64)
    torch.testing.assert_close(state.k_L_Hkv_S_D, whole.k_L_Hkv_S_D, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.index_I_S_D, whole.index_I_S_D, atol=1e-5, rtol=1e-5)


def test_injected_selection_logprobs_match_hf(dsa_path):
    model = lora_model(dsa_path, TARGETS)
    tokens_P, responses = update_inputs(model.config.vocab_size)
    injected = Injected(model, tokens_P.shape[0] + max(len(r) for r in responses))
    adapter = adapter_for(model).with_options(index_replay=injected.replay)
    with torch.no_grad():
        capture = capture_prefix(model, tokens_P, CHUNK, adapter)
        got = [score_response(adapter, tokens_P, r, capture.state, None, 0, TEMPERATURE) for r in responses]
        native = [_hf_logp(model, tokens_P, r) for r in responses]
        injected.patch(model)
        want = [_hf_logp(model, tokens_P, r) for r in responses]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    # The selection matters: the model's own indexer gives other logprobs.
    assert max((n - w).abs().max() for n, w in zip(native, want, strict=True)) > 1e-3


@pytest.mark.parametrize("mode", ["exact", "detached"])
@pytest.mark.parametrize("budget", [0, 1 << 30], ids=["serial-checkpointed", "one-micro-batch"])
def test_injected_selection_grads_equal_hf_backprop(dsa_path, mode, budget):
    """exact: the prompt's pages receive the gradient of the responses' sparse reads (scatter-added into the selected
    rows) and carry it back through the prompt, whose own queries past index_topk read sparsely too."""
    model = lora_model(dsa_path, TARGETS)
    tokens_P, responses = update_inputs(model.config.vocab_size)
    injected = Injected(model, tokens_P.shape[0] + max(len(r) for r in responses))
    adapter = adapter_for(model).with_options(index_replay=injected.replay)
    injected.patch(model)
    want = hf_grads(model, tokens_P, responses, mode)
    spec = UpdateSpec(
        mode=mode, chunk_size=CHUNK, temperature=TEMPERATURE, need_ref=True, replay_budget_bytes=budget,
        checkpoint_min_tokens=4 if budget == 0 else 256,
    )  # fmt: skip
    grpo_update(model, tokens_P, responses, update_objective, spec, adapter=adapter)
    assert_grads_close(pop_lora_grads(model), want)


@pytest.mark.parametrize("family", FAMILIES)
def test_own_selection_equals_hf_where_no_tie_falls_at_the_cut(family, tmp_path):
    model = lora_model(_path(family, str(tmp_path / family), index_n_heads=8), TARGETS)
    tokens_P, responses = update_inputs(model.config.vocab_size)
    # transformers' selections over each whole sequence, recorded from its indexers
    recorded = {}
    for i, layer in enumerate(model.get_base_model().model.layers):
        if getattr(layer.self_attn, "indexer", None) is not None:
            layer.self_attn.indexer.register_forward_hook(lambda m, a, out, i=i: recorded.__setitem__(i, out[0]))
    adapter, p1 = adapter_for(model), tokens_P.shape[0] - 1
    with torch.no_grad():
        capture = capture_prefix(model, tokens_P, CHUNK, adapter)
        for r in responses:
            want = _hf_logp(model, tokens_P, r)
            hf = {i: _causal(rows.long()) for i, rows in recorded.items()}

            records = [torch.stack([hf[i][p1 : p1 + len(r)] for i in sorted(hf)], 1)]
            replay = IndexerReplay(records, [len(r)], tokens_P.shape[0], adapter.index_slot)
            counted = adapter.with_options(index_replay=replay.for_rows([0]))
            got = score_response(counted, tokens_P, r, capture.state, None, 0, TEMPERATURE)
            assert int(replay.replayed) == len(r) * len(hf) and int(replay.mismatched) == 0
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            mine = score_response(adapter, tokens_P, r, capture.state, None, 0, TEMPERATURE)
            torch.testing.assert_close(mine, want, atol=1e-5, rtol=0)


def _causal(rows: torch.Tensor) -> torch.Tensor:
    """transformers' [S, K] top-k with the future positions it picks for short queries replaced by -1, sorted so
    that the empty slots come first (LongStraw compares selections as sets)."""
    s = torch.arange(rows.shape[0])[:, None]
    return rows.masked_fill(rows > s, -1).sort(-1).values


@pytest.mark.parametrize("family", FAMILIES)
def test_indexer_replay_attends_to_the_records_and_counts_mismatches(family, tmp_path):
    """grpo_update with rollout records for the response queries (here: random selections, as if the rollout's
    indexer had picked them): the response forwards attend to them, the prompt keeps the learner's own (equal to
    transformers' on this tie-free base), exact-mode gradients equal transformers' backprop under the same
    selections, and the update counts every replayed query x layer and the ones that differed."""
    model = lora_model(_path(family, str(tmp_path / family), index_n_heads=8), TARGETS)
    tokens_P, responses = update_inputs(model.config.vocab_size)
    p = tokens_P.shape[0]
    injected = Injected(model, p + max(len(r) for r in responses))
    injected.patch(model, own_before=p - 1)
    want = hf_grads(model, tokens_P, responses)
    spec = UpdateSpec(mode="exact", chunk_size=CHUNK, temperature=TEMPERATURE, need_ref=True)
    metrics = grpo_update(model, tokens_P, responses, update_objective, spec, indexer=injected.records(p, responses))
    assert_grads_close(pop_lora_grads(model), want)
    assert metrics.indexer_replayed == sum(len(r) for r in responses) * len(injected.rows)
    # Queries with at most index_topk keys keep them all either way; past that a random pick differs from the top k.
    past = sum(max(0, p - 1 + len(r) - TOPK) for r in responses) * len(injected.rows)
    assert 0 < metrics.indexer_mismatched <= past


def test_indexer_records_of_the_wrong_shape_are_refused_in_one_line(dsa_path):
    model = lora_model(dsa_path, TARGETS)
    tokens_P, responses = update_inputs(model.config.vocab_size)
    bad = [torch.zeros(len(r) + 1, 2, TOPK, dtype=torch.int32) for r in responses]
    with pytest.raises(LongStrawError, match="record is") as err:
        grpo_update(model, tokens_P, responses, update_objective, UpdateSpec(chunk_size=CHUNK), indexer=bad)
    assert "\n" not in str(err.value)
