"""Per-layer activation checkpointing inside LongStraw's replays and prompt-backward chunks.

Gradients are those of the plain path (the recompute runs the same function, R3 windows included), and the bytes a
replay saves for backward drop to about the layer inputs and K/V.
"""

from __future__ import annotations

import pytest
import torch
from conftest import lora_model

from longstraw.engine import UpdateSpec, grpo_update
from longstraw.routing import RouteRecorder, SequenceRoutes

P = 17
LENGTHS = (3, 40, 9)


def _inputs(vocab: int):
    gen = torch.Generator().manual_seed(3)
    tokens_P = torch.randint(0, vocab, (P,), generator=gen)
    return tokens_P, [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]


def _objective(i, logp_R, ref_R):
    loss = -((i + 1) * logp_R).mean()
    if ref_R is not None:
        loss = loss + 0.3 * (logp_R - ref_R).pow(2).mean()
    return loss, {}


def _grads(model, tokens_P, responses, mode, min_tokens, routes=None, measure=False):
    spec = UpdateSpec(mode=mode, chunk_size=8, need_ref=True, checkpoint_min_tokens=min_tokens, measure_graph=measure)
    metrics = grpo_update(model, tokens_P, responses, _objective, spec, routes=routes)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads, metrics


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_checkpointed_layers_give_the_same_gradients(random_tiny_path, mode):
    model = lora_model(random_tiny_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    plain, _ = _grads(model, tokens_P, responses, mode, min_tokens=0)
    ckpt, _ = _grads(model, tokens_P, responses, mode, min_tokens=1)
    assert plain.keys() == ckpt.keys() and any("experts" in n for n in plain)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


def test_checkpointing_replays_routes_in_the_recompute(random_qwen3_path):
    """With R3 the recompute in backward must see the same recorded routes as the forward: gradients match."""
    model = lora_model(random_qwen3_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    full = [torch.cat([tokens_P, r[:-1]]) for r in responses]
    recorded = []
    with RouteRecorder(model) as rec, torch.no_grad():
        for seq in full:
            model(input_ids=seq[None])
            recorded.append(rec.pop())
    # Every other recorded route rotated by one expert: replay must force these, not the native choice.
    forced = [(r + torch.arange(r.shape[0])[:, None, None] % 2) % model.config.num_experts for r in recorded]
    forced = [torch.where(f[..., :1] == f[..., 1:], r, f) for f, r in zip(forced, recorded, strict=True)]

    def routes():
        ok = [torch.ones(len(r), dtype=torch.bool) for r in responses]
        return SequenceRoutes(
            forced[0][: P - 1],
            torch.ones(P - 1, dtype=torch.bool),
            [(f[P - 1 :], o) for f, o in zip(forced, ok, strict=True)],
        )

    plain, _ = _grads(model, tokens_P, responses, "exact", 0, routes=routes())
    ckpt, _ = _grads(model, tokens_P, responses, "exact", 1, routes=routes())
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


def test_checkpointing_cuts_the_bytes_a_replay_saves(random_qwen3_path):
    model = lora_model(random_qwen3_path)
    tokens_P, responses = _inputs(model.config.vocab_size)
    _, plain = _grads(model, tokens_P, responses, "exact", 0, measure=True)
    _, ckpt = _grads(model, tokens_P, responses, "exact", 1, measure=True)
    ratio = ckpt.graph_bytes_max / plain.graph_bytes_max
    print(f"replay saved bytes: plain {plain.graph_bytes_max}, checkpointed {ckpt.graph_bytes_max} ({ratio:.3f})")
    assert ratio < 0.5, ratio
    assert ckpt.prompt_graph_bytes_max < plain.prompt_graph_bytes_max
