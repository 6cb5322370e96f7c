"""Context parallel prefix against the unsharded result: 1 rank against C ranks on gloo.

Each test spawns C processes (torch.multiprocessing, file rendezvous); every rank computes the single-rank result
itself from the same seeded inputs, runs the sharded version, and asserts. fp32 throughout, tolerance 1e-5.
"""

from __future__ import annotations

import datetime
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import build_random_tiny, lora_model

from longstraw.adapters import KINDS, Adapter, adapter_for
from longstraw.context_parallel import (
    ContextParallel,
    as_context_parallel,
    capture_cp,
    collective_log,
    cp_adapter_for,
    cp_class,
    cp_kinds,
    cp_prefix_attention,
    own_rank,
    page_bounds,
)
from longstraw.engine import UpdateSpec, grpo_update, score_response
from longstraw.errors import LongStrawError
from mint_kernels import prefix_attention

# The fp32 comparisons below part by at most 5.7 eps * max|value| (1.2e-6 at max|value| 3.1), measured under the
# default and the AVX2 kernels: a tenth of TOL. The fp64 ones use 1e-12.
TOL = dict(atol=1e-5, rtol=1e-5)


def _close(got, want, label: str, **tol) -> None:
    torch.testing.assert_close(got, want, **(tol or TOL), msg=lambda m: f"{label}: {m}")


def _spawn(fn, world: int, tmp_path, *args) -> None:
    mp.spawn(_entry, args=(world, str(tmp_path / "rendezvous"), fn, args), nprocs=world, join=True)


def _entry(rank: int, world: int, rendezvous: str, fn, args) -> None:
    torch.set_num_threads(1)  # C processes on 2 shared cores
    # A rank that skipped a collective fails the test after 2 minutes instead of hanging it.
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=timeout)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


# -- deliverable 1: the merged attention ---------------------------------------------------------------------------

HQ, HKV, D = 4, 2, 8
# (S prefix positions, R queries). With C=2 and C=4 these give every kind of partial on some rank: a rank that counts
# the own keys, pages longer than R (two-call split), pages of 1..R keys (one batch row per query), and no pages.
ATTENTION_CASES = [(13, 3), (5, 4), (3, 2), (40, 7), (9, 1)]


def _attention_worker(rank: int, world: int, force: str) -> None:
    for case, (s_len, r) in enumerate(ATTENTION_CASES):
        gen = torch.Generator().manual_seed(case)
        q = torch.randn(HQ, r, D, generator=gen)
        k, v = torch.randn(HKV, s_len, D, generator=gen), torch.randn(HKV, s_len, D, generator=gen)
        kr, vr = torch.randn(HKV, r, D, generator=gen), torch.randn(HKV, r, D, generator=gen)
        g_out, g_lse = torch.randn(HQ, r, D, generator=gen), torch.randn(HQ, r, generator=gen)

        leaves = [t.clone().requires_grad_(True) for t in (q, kr, vr)]
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        out, lse = prefix_attention(leaves[0], k, v, leaves[1], leaves[2], 0.3, dk_prefix_acc=dk, dv_prefix_acc=dv,
                                    return_lse=True, force=force)  # fmt: skip
        ((out * g_out).sum() + (lse * g_lse).sum()).backward()
        want = dict(out=out, lse=lse, dq=leaves[0].grad, dk_resp=leaves[1].grad, dv_resp=leaves[2].grad)

        bounds = page_bounds(s_len, world)
        lo, hi = bounds[rank], bounds[rank + 1]
        # The default owner of the own keys, and rank 0: any one rank may count them.
        for include in sorted({own_rank(s_len, s_len, world), 0}):
            for exact in (True, False):
                leaves = [t.clone().requires_grad_(True) for t in (q, kr, vr)]
                dk_r, dv_r = torch.zeros(HKV, hi - lo, D), torch.zeros(HKV, hi - lo, D)
                accs = dict(dk_acc=dk_r, dv_acc=dv_r) if exact else {}
                with collective_log() as calls:
                    out, lse = cp_prefix_attention(leaves[0], k[:, lo:hi], v[:, lo:hi], leaves[1], leaves[2], 0.3,
                                                   include_own=rank == include, force=force, **accs)  # fmt: skip
                    ((out * g_out).sum() + (lse * g_lse).sum()).backward()
                got = dict(out=out, lse=lse, dq=leaves[0].grad, dk_resp=leaves[1].grad, dv_resp=leaves[2].grad)
                label = f"S={s_len} R={r} C={world} rank={rank} own on {include} exact={exact}"
                for name in want:
                    _close(got[name], want[name], f"{label} {name}")
                if exact:  # each rank's buffer is its slice of the single-rank dK/dV: concatenated, the whole
                    _close(dk_r, dk[:, lo:hi], f"{label} dK")
                    _close(dv_r, dv[:, lo:hi], f"{label} dV")
                # docs/sharding.md: forward 4 H_q (D + 2) bytes per query token (max of lse, sum of [w o, w]),
                # backward 4 (H_q + 2 H_kv) D (dQ, dK_own, dV_own), all fp32.
                assert calls == [
                    ("all_reduce_max", 4 * HQ * r),
                    ("all_reduce_sum", 4 * HQ * r * (D + 1)),
                    ("all_reduce_sum", 4 * (HQ + 2 * HKV) * r * D),
                ], (label, calls)


# test-fast's context-parallel parity case: 2 ranks on the reference path (8 s of CPU). 4 ranks, the Triton-interpreter
# ranks and the whole-model cases below (11-16 s of CPU each, 12-36 s on 2 shared cores) run in `make test` only.
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_cp_prefix_attention_matches_single_rank(world, tmp_path):
    """Outputs, lse, dQ, own dK/dV on every rank, and each rank's page dK/dV, against one prefix_attention."""
    _spawn(_attention_worker, world, tmp_path, "reference")


@pytest.mark.slow
def test_cp_prefix_attention_triton_interpreter(tmp_path, monkeypatch):
    """The same on the Triton kernels (the CUDA path), run by the Triton interpreter on CPU: the spawned ranks import
    triton afresh with TRITON_INTERPRET=1. Covers the stride-0 own key of the one-row-per-query partial and the
    empty prefix of the two-call split on that path."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _spawn(_attention_worker, 2, tmp_path, "triton")


def test_page_layout_and_own_rank():
    assert page_bounds(22, 2) == [0, 11, 22]
    assert page_bounds(3, 4) == [0, 0, 1, 2, 3]
    assert own_rank(22, 22, 2) == 1  # the replay: the last page's owner
    assert own_rank(8, 22, 2) == 0 and own_rank(11, 22, 2) == 0 and own_rank(12, 22, 2) == 1
    assert own_rank(0, 22, 2) == 1 and own_rank(1, 3, 4) == 1  # rank 0 holds no page of S=3 over 4


def test_context_parallel_composes_with_any_adapter_of_a_kind(tmp_path):
    """No adapter has a hand-written twin: each kind's page handling is composed onto the adapter's own class, so a
    subclass (a new family's adapter) gets context parallel with no code of its own, and an adapter of no kind is
    refused in one line."""
    for kind, cls in KINDS.items():
        composed = cp_class(cls)
        assert composed.__mro__[1] is cp_kinds()[kind] and issubclass(composed, cls)
        assert cp_class(cls) is composed  # made once

    class NewFamilyAdapter(KINDS["mla"]):
        pass

    composed = cp_class(NewFamilyAdapter)
    assert issubclass(composed, NewFamilyAdapter) and issubclass(composed, cp_kinds()["mla"])
    assert composed.pages is cp_kinds()["mla"].pages  # the latent pages' split gradient, not the plain ones

    plain = adapter_for(lora_model(build_random_tiny("qwen3_moe", str(tmp_path / "base"))))
    cp = as_context_parallel(plain, group=None)
    assert type(cp) is cp_class(type(plain)) and cp.decoder is plain.decoder and not isinstance(plain, ContextParallel)
    assert type(as_context_parallel(cp)) is type(cp)  # composing twice composes once

    class Elsewhere(Adapter):
        pass

    with pytest.raises(LongStrawError, match="context parallel covers LongStraw's adapter kinds, not Elsewhere"):
        cp_class(Elsewhere)


def test_single_process_is_plain_prefix_attention():
    """Without torch.distributed the merge is over one rank: the same numbers as prefix_attention."""
    gen = torch.Generator().manual_seed(5)
    q, kr, vr = torch.randn(HQ, 3, D, generator=gen), torch.randn(HKV, 3, D, generator=gen), torch.randn(HKV, 3, D)
    k, v = torch.randn(HKV, 6, D, generator=gen), torch.randn(HKV, 6, D, generator=gen)
    out, lse = cp_prefix_attention(q, k, v, kr, vr, 0.25, include_own=True, force="reference")
    want_out, want_lse = prefix_attention(q, k, v, kr, vr, 0.25, return_lse=True, force="reference")
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(lse, want_lse, **TOL)


@pytest.mark.parametrize("n, r", [(1, 3), (3, 3), (4, 3), (10, 3), (2, 5)])
def test_pages_only_partial_every_path(n, r):
    """One process, include_own=False: attention over the pages alone (no own keys), against plain softmax, for each
    way of filling the kernel's own-key slot (1..R pages, more than R), in fp64 (a rank with no pages is covered by
    the gloo tests: alone it would leave no key at all). Page dK/dV reach the
    buffers also under torch.autograd.grad over the queries only."""
    gen = torch.Generator().manual_seed(n * 10 + r)
    q = torch.randn(HQ, r, D, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(HKV, n, D, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(HKV, n, D, dtype=torch.float64, generator=gen, requires_grad=True)
    own = torch.randn(HKV, r, D, dtype=torch.float64, generator=gen)
    g_out, g_lse = torch.randn(HQ, r, D, dtype=torch.float64, generator=gen), torch.randn(HQ, r, dtype=torch.float64)
    dk, dv = torch.zeros(HKV, n, D), torch.zeros(HKV, n, D)
    out, lse = cp_prefix_attention(q, k.detach(), v.detach(), own, own, 0.3, include_own=False, dk_acc=dk, dv_acc=dv,
                                   force="reference")  # fmt: skip
    (dq,) = torch.autograd.grad((out * g_out).sum() + (lse * g_lse).sum(), q)
    s = 0.3 * q @ k.repeat_interleave(HQ // HKV, 0).transpose(-1, -2)
    want_out, want_lse = torch.softmax(s, -1) @ v.repeat_interleave(HQ // HKV, 0), torch.logsumexp(s, -1)
    want = torch.autograd.grad((want_out * g_out).sum() + (want_lse * g_lse).sum(), [q, k, v])
    for got, ref, name in ((out, want_out, "out"), (lse, want_lse, "lse"), (dq, want[0], "dq")):
        _close(got, ref, name, atol=1e-12, rtol=1e-12)
    _close(dk, want[1].float(), "dK", **TOL)  # fp32 buffers
    _close(dv, want[2].float(), "dV", **TOL)


# -- deliverables 2 and 3: LongStraw with the pages split -----------------------------------------------------------

P = 23
LENGTHS = (2, 5, 12)  # with S = 22 over 2 ranks (11 pages each), R = 12 > 11 takes the one-row-per-query partial
CHUNK = 8  # chunks [0, 8), [8, 16), [16, 22): a chunk with no earlier pages, one on rank 0 only, one across both
ADV = (1.0, -0.5, 0.7)
BETA = 0.3
TEMPERATURE = 0.9


def _run(model, tokens_P, responses, spec, adapter=None):
    """(logp per response, LoRA grads, metrics) of one grpo_update; grads are cleared afterwards."""
    logps = []

    def objective(i, logp_R, ref_logp_R):
        logps.append(logp_R.detach().clone())
        loss = -(ADV[i] * logp_R).mean()
        if ref_logp_R is not None:
            loss = loss + BETA * (logp_R - ref_logp_R).pow(2).mean()
        return loss, {}

    metrics = grpo_update(model, tokens_P, responses, objective, spec, adapter=adapter)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return logps, grads, metrics


def _longstraw_worker(rank: int, world: int, path: str, mode: str) -> None:
    model = lora_model(path)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    tokens_P = torch.randint(0, vocab, (P,), generator=gen)
    responses = [torch.randint(0, vocab, (r,), generator=gen) for r in LENGTHS]
    # checkpoint_min_tokens=4 checkpoints the longer replays and chunks: the recompute in backward repeats the
    # forward's merges, in the same order on every rank.
    specs = [UpdateSpec(mode=mode, chunk_size=CHUNK, temperature=TEMPERATURE, need_ref=True, checkpoint_min_tokens=m)
             for m in (0, 4)]  # fmt: skip
    want_logps, want_grads, want_metrics = _run(model, tokens_P, responses, specs[0])
    assert any("experts" in n for n in want_grads) and any("k_proj" in n for n in want_grads)
    adapter = cp_adapter_for(model)

    for spec in specs:
        logps, grads, metrics = _run(model, tokens_P, responses, spec, adapter)
        label = f"{mode} C={world} rank={rank} checkpoint_min_tokens={spec.checkpoint_min_tokens}"
        for got, want in zip(logps, want_logps, strict=True):
            _close(got, want, f"{label} logp")
        assert grads.keys() == want_grads.keys()
        for name in want_grads:
            _close(grads[name], want_grads[name], f"{label} {name}", atol=1e-5, rtol=1e-4)
        # The reduction rule: every rank holds the full gradient, so the mean over the CP group changes nothing.
        flat = torch.cat([grads[n].reshape(-1) for n in sorted(grads)])
        mean = flat.clone()
        dist.all_reduce(mean)
        _close(mean / world, flat, f"{label}: ranks differ", atol=1e-7, rtol=1e-6)
        pages = page_bounds(P - 1, world)[rank + 1] - page_bounds(P - 1, world)[rank]
        assert metrics.prefix_bytes * (P - 1) == want_metrics.prefix_bytes * pages  # this rank's pages only

    # Each rank's pages are its slice of the single-rank capture.
    adapter_1 = cp_adapter_for(model, group=None)
    full = adapter_for(model).capture(tokens_P[:-1], CHUNK)
    state = capture_cp(adapter_1, tokens_P[:-1], CHUNK)
    lo, hi = state.lo, state.lo + state.local.length
    assert (lo, hi) == tuple(page_bounds(P - 1, world)[rank : rank + 2])
    torch.testing.assert_close(state.local.k_L_Hkv_S_D, full.k_L_Hkv_S_D[:, :, lo:hi], **TOL)
    torch.testing.assert_close(state.local.v_L_Hkv_S_D, full.v_L_Hkv_S_D[:, :, lo:hi], **TOL)

    if mode == "detached":  # communication of one replay, measured: docs/sharding.md's bytes per token per layer
        config = model.config
        hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        layers = config.num_hidden_layers
        r = LENGTHS[1]
        with collective_log() as calls:
            logp = score_response(adapter_1, tokens_P, responses[1], state, None, 1, TEMPERATURE)
            logp.sum().backward()
        per_token_layer = 4 * hq * (d + 2) + 4 * (hq + 2 * hkv) * d
        assert sum(b for _, b in calls) == per_token_layer * r * layers, calls
        for p in model.parameters():
            p.grad = None


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, mode, world",
    [
        ("qwen3_moe", "detached", 2),
        ("qwen3_moe", "exact", 2),
        ("glm4_moe", "exact", 2),
        ("qwen3_moe", "exact", 4),  # 40 s on 2 shared cores
    ],
)
def test_longstraw_cp_equals_single_rank(family, mode, world, tmp_path):
    """Logprobs and LoRA gradients (detached: prompt K/V constant; exact: the prompt backward across ranks) of a
    tiny random MoE with LoRA on attention and experts, CP=2 (and 4) against one rank, with and without per-layer
    checkpointing; both ranks hold the same gradients; the captured pages are slices of the single-rank capture.
    GLM-4.5 (partial RoPE, q/k/v bias, a dense first layer) checks that the CP mixin composes with any
    QwenAdapter-family adapter."""
    path = build_random_tiny(family, str(tmp_path / "model"))
    _spawn(_longstraw_worker, world, tmp_path, path, mode)


def _hybrid_worker(rank: int, world: int, path: str, mode: str) -> None:
    from longstraw.adapters.hybrid import FULL, LINEAR

    model = lora_model(path)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    tokens_P = torch.randint(0, vocab, (P,), generator=gen)
    responses = [torch.randint(0, vocab, (r,), generator=gen) for r in LENGTHS]
    spec = UpdateSpec(mode=mode, chunk_size=CHUNK, temperature=TEMPERATURE, need_ref=True, checkpoint_min_tokens=4)
    want_logps, want_grads, want_metrics = _run(model, tokens_P, responses, spec)
    logps, grads, metrics = _run(model, tokens_P, responses, spec, cp_adapter_for(model))
    label = f"hybrid {mode} C={world} rank={rank}"
    for got, want in zip(logps, want_logps, strict=True):
        _close(got, want, f"{label} logp")
    assert grads.keys() == want_grads.keys() and any("experts" in n for n in grads)
    for name in want_grads:
        _close(grads[name], want_grads[name], f"{label} {name}", atol=1e-5, rtol=1e-4)
    # This rank's pages of the full layers, and the whole (replicated) recurrent boundary.
    state = cp_adapter_for(model).capture(tokens_P[:-1], CHUNK)
    full = adapter_for(model).capture(tokens_P[:-1], CHUNK)
    lo, hi = page_bounds(P - 1, world)[rank : rank + 2]
    _close(state.parts[FULL].local.k_L_Hkv_S_D, full.parts[FULL].k_L_Hkv_S_D[:, :, lo:hi], f"{label} pages")
    _close(state.parts[LINEAR].s_L_H_K_V, full.parts[LINEAR].s_L_H_K_V, f"{label} boundary")
    pages = full.parts[FULL].nbytes * (hi - lo) // (P - 1)
    assert state.nbytes == pages + full.parts[LINEAR].nbytes
    if mode == "exact":
        assert metrics.prefix_bytes < want_metrics.prefix_bytes


@pytest.mark.slow
@pytest.mark.parametrize("family, mode", [("qwen3_5_moe", "exact"), ("qwen3_next", "detached")])
def test_longstraw_cp_on_a_hybrid_base_equals_single_rank(family, mode, tmp_path):
    """Qwen3.5-MoE / Qwen3-Next with CP=2: the full layers' pages split over the ranks, the Gated DeltaNet boundary
    replicated and carried back through the prompt on every rank; logprobs and LoRA gradients equal one rank's."""
    path = build_random_tiny(family, str(tmp_path / "model"))
    _spawn(_hybrid_worker, 2, tmp_path, path, mode)


def _mla_worker(rank: int, world: int, path: str, mode: str) -> None:
    from test_mla import TARGETS

    model = lora_model(path, TARGETS)
    gen = torch.Generator().manual_seed(1)
    tokens_P = torch.randint(0, model.config.vocab_size, (P,), generator=gen)
    responses = [torch.randint(0, model.config.vocab_size, (r,), generator=gen) for r in LENGTHS]
    spec = UpdateSpec(mode=mode, chunk_size=CHUNK, temperature=TEMPERATURE, need_ref=True, checkpoint_min_tokens=4)
    want_logps, want_grads, _ = _run(model, tokens_P, responses, spec)
    logps, grads, _ = _run(model, tokens_P, responses, spec, cp_adapter_for(model))
    label = f"mla {mode} C={world} rank={rank}"
    for got, want in zip(logps, want_logps, strict=True):
        _close(got, want, f"{label} logp")
    assert grads.keys() == want_grads.keys() and any("kv_b_proj" in n for n in grads)
    for name in want_grads:
        _close(grads[name], want_grads[name], f"{label} {name}", atol=1e-5, rtol=1e-4)
    lo, hi = page_bounds(P - 1, world)[rank : rank + 2]
    state = capture_cp(adapter_for(model), tokens_P[:-1], CHUNK)
    full = adapter_for(model).capture(tokens_P[:-1], CHUNK)
    _close(state.local.k_L_Hkv_S_D, full.k_L_Hkv_S_D[:, :, lo:hi], f"{label} latent pages")
    assert state.nbytes * (P - 1) == full.nbytes * (hi - lo)  # this rank's latent pages, stored once


@pytest.mark.slow
@pytest.mark.parametrize("family, mode", [("deepseek_v3", "exact"), ("glm4_moe_lite", "detached")])
def test_longstraw_cp_on_an_mla_base_equals_single_rank(family, mode, tmp_path):
    """DeepSeek-V3 / GLM-4.7-Flash with CP=2: the latent pages split over the ranks and merged by LSE in the
    absorbed form; logprobs and LoRA gradients (kv_b_proj's factored fold included) equal one rank's."""
    path = build_random_tiny(family, str(tmp_path / "model"))
    _spawn(_mla_worker, 2, tmp_path, path, mode)


# -- DSA: the selection merged across ranks ------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [2, 3])
def test_merged_top_keys_equal_the_one_rank_top_keys(ranks):
    """Per-rank top k of each rank's contiguous positions, merged, is the top k over all positions, ties included
    (scores of exactly 0, as ReLU index scores give, go to the lower position either way), also where a rank has
    fewer than k candidates (-inf / -1 slots)."""
    from longstraw.adapters.dsa import top_keys
    from longstraw.context_parallel_dsa import merge_top_keys

    gen = torch.Generator().manual_seed(ranks)
    rows, keys, k = 50, 23, 8
    scores = torch.randn(rows, keys, generator=gen).relu()  # about half exactly 0
    scores[:, -4:] = float("-inf")  # keys after the queries' own positions
    want_scores, want = top_keys(scores, k)
    want = want.masked_fill(want_scores == float("-inf"), -1)
    bounds = [r * keys // ranks for r in range(ranks + 1)]
    local_scores, local_positions = [], []
    for lo, hi in itertools.pairwise(bounds):
        top, at = top_keys(scores[:, lo:hi], min(k, hi - lo))
        pad = k - top.shape[-1]
        positions = (at + lo).masked_fill(top == float("-inf"), -1)
        local_scores.append(torch.nn.functional.pad(top, (0, pad), value=float("-inf")))
        local_positions.append(torch.nn.functional.pad(positions, (0, pad), value=-1))
    got = merge_top_keys(torch.stack(local_scores), torch.stack(local_positions), k)
    assert torch.equal(got, want)
    assert (scores.gather(-1, want.clamp(min=0)) == 0).any()  # ties at 0 were at the cut


def _dsa_worker(rank: int, world: int, path: str, mode: str) -> None:
    """One rank's LongStraw (own selection, recorded) against CP=world; the CP run hands its merged selections to
    index_replay, which finds every one equal to the one-rank selection of the same forward. No
    reference pass and one response per replay, so that (layer, start, length) names one forward's selection."""
    from test_dsa import TARGETS

    model = lora_model(path, TARGETS)
    gen = torch.Generator().manual_seed(1)
    tokens_P = torch.randint(0, model.config.vocab_size, (P,), generator=gen)
    responses = [torch.randint(0, model.config.vocab_size, (r,), generator=gen) for r in LENGTHS]
    spec = UpdateSpec(mode=mode, chunk_size=CHUNK, temperature=TEMPERATURE, checkpoint_min_tokens=4)
    one = adapter_for(model)
    seen = {}
    select = one._layer_selection

    def record(attn, x, cos, sin, prefix, own_keys, start):
        seen[attn.layer_idx, start, x.shape[-2]] = chosen = select(attn, x, cos, sin, prefix, own_keys, start)
        return chosen

    one._layer_selection = record
    want_logps, want_grads, _ = _run(model, tokens_P, responses, spec, one)
    assert seen and max(s.shape[-1] for s in seen.values()) == model.config.index_topk  # the sparse path ran
    differ = []

    def replay(layer, start, own):
        one_rank = seen[layer, start, own.shape[-2]]
        differ.append(int((own.sort(-1).values != one_rank.sort(-1).values).any(-1).sum()))
        return one_rank

    logps, grads, _ = _run(model, tokens_P, responses, spec, cp_adapter_for(model).with_options(index_replay=replay))
    label = f"dsa {mode} C={world} rank={rank}"
    assert len(differ) >= len(seen) and not any(differ), (label, differ)  # exact mode recomputes prompt chunks
    for got, want in zip(logps, want_logps, strict=True):
        _close(got, want, f"{label} logp")
    assert grads.keys() == want_grads.keys() and any("kv_b_proj" in n for n in grads)
    for name in want_grads:
        _close(grads[name], want_grads[name], f"{label} {name}", atol=1e-5, rtol=1e-4)
    lo, hi = page_bounds(P - 1, world)[rank : rank + 2]
    state = capture_cp(adapter_for(model), tokens_P[:-1], CHUNK)
    full = adapter_for(model).capture(tokens_P[:-1], CHUNK)
    _close(state.local.k_L_Hkv_S_D, full.k_L_Hkv_S_D[:, :, lo:hi], f"{label} latent pages")
    _close(state.local.index_I_S_D, full.index_I_S_D[:, lo:hi], f"{label} indexer pages")


@pytest.mark.slow
@pytest.mark.parametrize("family, mode", [("glm_moe_dsa", "exact"), ("deepseek_v32", "detached")])
def test_longstraw_cp_on_a_dsa_base_past_index_topk_equals_single_rank(family, mode, tmp_path):
    """DeepSeek-V3.2 / GLM-5 with index_topk 8 and CP=2: latent and indexer pages split over the ranks, each query's
    top k merged from the ranks' candidates (equal to one rank's, counted), sparse partials merged by LSE; logprobs
    and LoRA gradients equal one rank's."""
    from test_dsa import _path

    _spawn(_dsa_worker, 2, tmp_path, _path(family, str(tmp_path / "model")), mode)
