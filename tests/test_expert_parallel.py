"""Expert parallel: the sharded layout against the unsharded result, on 2 and 4 gloo ranks.

Ranks are forked processes in one gloo group; each returns its tensors to the test, which compares them with a
single-process computation over the same data. Different token counts per rank (one rank with none), experts that
receive no rows, and transformers' "no expert" sentinel id are covered.
"""

from __future__ import annotations

import datetime
import gc
import os
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import finish_rank, run_rank_processes, sum_atol

from longstraw.expert_parallel import combine, counted_sends, dispatch

# The dispatch/combine unit cases add short sums: conftest.sum_atol's eps * max|value| * sqrt(terms) at max|value| <= 7
# and terms <= H + D_OUT + 22 tokens = 50 is 6e-6, under ATOL (measured: at most 1e-6).
ATOL, RTOL = 1e-5, 1e-5
H, D_OUT, K = 16, 12, 2
TOKENS = {2: [7, 4], 4: [6, 0, 9, 3]}  # tokens per rank: different counts, and a rank with none
# 4 ranks in the full suite only, as every 4-rank parity case: `make test-fast` keeps the 2-rank ones.
FOUR_RANKS = pytest.param(4, marks=pytest.mark.slow)


# ---- ranks -----------------------------------------------------------------------------------------------------------


def run_ranks(tmp_path, world: int, fn, *args, timeout: float = 240.0) -> list:
    """fn(rank, world, *args) on `world` forked processes in one gloo group; returns their results in rank order."""
    ctx = mp.get_context("fork")  # fork: the children reuse the imported torch/transformers (spawn costs ~10 s each)
    run_dir = tmp_path / f"ranks_{fn.__name__}_{world}_{os.getpid()}_{len(list(tmp_path.iterdir()))}"
    run_dir.mkdir()
    return run_rank_processes(ctx, run_dir, world, _rank_main, (world, fn, args), timeout)


def _rank_main(run_dir: str, rank: int, world: int, fn, args) -> None:
    def body():
        dist.init_process_group(
            "gloo",
            init_method=f"file://{run_dir}/store",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        result = fn(rank, world, *args)
        dist.destroy_process_group()
        return result

    finish_rank(run_dir, rank, body)


# ---- dispatch / combine ----------------------------------------------------------------------------------------------


def _rank_data(rank: int, T: int, E: int, experts: list[int] | None = None, sentinel: bool = False):
    """x [T, H], distinct ids [T, k] (drawn from `experts` when given), weights [T, k]; reproducible per rank."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=gen)
    pool = torch.tensor(experts if experts is not None else list(range(E)))
    scores = torch.rand(T, len(pool), generator=gen)
    ids = pool[scores.topk(K, dim=-1).indices]
    if sentinel and T > 1:
        ids[1, 1] = E  # transformers' "no expert": skipped
    weights = torch.rand(T, K, generator=gen)
    return x, ids, weights


def _weights(E: int) -> torch.Tensor:
    return torch.randn(E, D_OUT, H, generator=torch.Generator().manual_seed(7)) / H**0.5


def _reference_linear(x, ids, weights, W_E_O_I):
    """out[t] = sum_j w[t, j] W[ids[t, j]] x[t], one process, all experts; sentinel ids contribute 0."""
    E = W_E_O_I.shape[0]
    padded = torch.cat([W_E_O_I, W_E_O_I.new_zeros(1, *W_E_O_I.shape[1:])])
    y_T_K_O = torch.einsum("tkoi,ti->tko", padded[ids.clamp(max=E)], x)
    return (y_T_K_O * weights[..., None]).sum(1)


def _identity_rank(rank, world, E, experts, sentinel):
    x, ids, w = _rank_data(rank, TOKENS[world][rank], E, experts, sentinel)
    x_local, offsets, plan = dispatch(x, ids, None, E // world)
    assert offsets[0] == 0 and offsets[-1] == x_local.shape[0] and bool((offsets.diff() >= 0).all())
    return {"out": combine(x_local, plan, w, x.shape[0]), "offsets": offsets}


def _linear_rank(rank, world, E, experts, sentinel):
    """A per-expert linear map run on the owning rank; the loss sums each rank's output times a fixed target."""
    E_local = E // world
    x, ids, w = _rank_data(rank, TOKENS[world][rank], E, experts, sentinel)
    x.requires_grad_(True)
    w.requires_grad_(True)
    W_local = _weights(E)[rank * E_local : (rank + 1) * E_local].clone().requires_grad_(True)
    x_local, offsets, plan = dispatch(x, ids, None, E_local)
    ends = offsets.tolist()
    y_local = torch.cat([x_local[ends[e] : ends[e + 1]] @ W_local[e].T for e in range(E_local)])
    out = combine(y_local, plan, w, x.shape[0])
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(200 + rank))
    (out * target).sum().backward()
    return {"out": out.detach(), "dx": x.grad, "dw": w.grad, "dW_local": W_local.grad, "target": target}


CASES = {
    "all_experts": (None, False),
    "sentinel": (None, True),
    "idle_experts": ([0, 1], False),  # rank 1 (of 2) or ranks 1-3 (of 4, with 8 experts) receive no rows
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("world", [2, FOUR_RANKS])
def test_dispatch_identity_combine_is_the_weighted_sum_over_k(tmp_path, world, case):
    E = 2 * world
    experts, sentinel = CASES[case]
    results = run_ranks(tmp_path, world, _identity_rank, E, experts, sentinel)
    for rank, got in enumerate(results):
        x, ids, w = _rank_data(rank, TOKENS[world][rank], E, experts, sentinel)
        expected = (x[:, None, :] * (w * (ids < E))[..., None]).sum(1)
        torch.testing.assert_close(got["out"], expected, atol=ATOL, rtol=RTOL)
        assert got["offsets"].shape == (E // world + 1,)
    if case == "idle_experts":
        assert all(int(r["offsets"][-1]) == 0 for r in results[1:])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("world", [2, FOUR_RANKS])
def test_per_expert_linear_and_gradients_equal_one_process(tmp_path, world, case):
    E = 2 * world
    E_local = E // world
    experts, sentinel = CASES[case]
    results = run_ranks(tmp_path, world, _linear_rank, E, experts, sentinel)
    W = _weights(E).requires_grad_(True)
    for rank, got in enumerate(results):
        x, ids, w = _rank_data(rank, TOKENS[world][rank], E, experts, sentinel)
        x.requires_grad_(True)
        w.requires_grad_(True)
        out = _reference_linear(x, ids, w, W)
        (out * got["target"]).sum().backward()  # W.grad accumulates every rank's tokens, as the owners' do
        torch.testing.assert_close(got["out"], out.detach(), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got["dx"], x.grad, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got["dw"], w.grad, atol=ATOL, rtol=RTOL)
    dW = torch.cat([r["dW_local"] for r in results])
    torch.testing.assert_close(dW, W.grad, atol=ATOL, rtol=RTOL)
    assert W.grad[:E_local].abs().sum() > 0


def _bytes_rank(rank, world, E):
    """Count every all_to_all payload that leaves this rank, forward and backward."""
    with counted_sends(rank, world) as sent:
        got = _linear_rank(rank, world, E, None, False)
    return {"sent": sent["bytes"], **got}


@pytest.mark.parametrize("world", [2, FOUR_RANKS])
def test_communication_bytes_match_the_formula(tmp_path, world):
    """Every off-rank pair (token on rank s, expert on rank d != s) moves H·b out and D_OUT·b back in the forward,
    and the same two the other way in backward (b = 4, fp32). So rank r sends (counts, then rows)
        (ep - 1)·E_local·8 + (pairs it sends out + rows it serves for other ranks)·(H + D_OUT)·b."""
    E = 2 * world
    E_local = E // world
    results = run_ranks(tmp_path, world, _bytes_rank, E)
    owner = [torch.div(_rank_data(s, TOKENS[world][s], E)[1], E_local, rounding_mode="floor") for s in range(world)]
    total_off_rank = 0
    for rank, got in enumerate(results):
        out_pairs = int((owner[rank] != rank).sum())
        served = sum(int((owner[s] == rank).sum()) for s in range(world) if s != rank)
        formula = (world - 1) * E_local * 8 + (out_pairs + served) * (H + D_OUT) * 4
        assert got["sent"] == formula, (rank, got["sent"], formula)
        total_off_rank += out_pairs
    rows_bytes = sum(r["sent"] for r in results) - world * (world - 1) * E_local * 8
    assert rows_bytes == 2 * total_off_rank * (H + D_OUT) * 4  # per off-rank pair, forward and backward


# ---- the EP-aware experts on a tiny Qwen3-MoE ------------------------------------------------------------------------

SHAPES = {0: (2, 9), 1: (1, 13), 2: (1, 5), 3: (3, 4)}  # each rank's own batch [B, S]: different token counts


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    from conftest import build_random_tiny

    return build_random_tiny("qwen3_moe", str(tmp_path_factory.mktemp("ep_qwen3")))


@pytest.fixture(scope="module")
def adapter_state(tiny_path) -> dict:
    """A trained-looking adapter: PEFT's seeded A and a non-zero B (B = 0 would hide a wrong B mapping)."""
    from mint.models.lora import lora_state

    state = lora_state(_model(tiny_path))
    gen = torch.Generator().manual_seed(3)
    return {k: torch.randn(v.shape, generator=gen) * 0.05 if "lora_B" in k else v for k, v in sorted(state.items())}


def _model(path: str, state: dict | None = None):
    from conftest import load_fp32

    from mint.config import LoraConfig
    from mint.models.lora import add_lora, load_lora_state

    base = load_fp32(path)
    for p in base.parameters():
        p.requires_grad_(False)
    model = add_lora(base, LoraConfig(), seed=0)
    if state is not None:
        load_lora_state(model, state)
    return model


def _batch(rank: int, vocab: int):
    B, S = SHAPES[rank]
    gen = torch.Generator().manual_seed(40 + rank)
    ids = torch.randint(0, vocab, (B, S), generator=gen)
    return ids, torch.randn(B, S, vocab, generator=gen)


def _routes(rank: int, T: int, layers: int) -> torch.Tensor:
    """Recorded routes that only use experts 0 and 1 (owned by rank 0 of 2): the other ranks' experts idle."""
    flip = torch.rand(T, layers, generator=torch.Generator().manual_seed(60 + rank)) < 0.5
    return torch.stack([flip.long(), 1 - flip.long()], dim=-1)


def _forward(model, rank: int, replay_routes: bool):
    from longstraw.routing import RouteReplay

    ids, target = _batch(rank, model.config.vocab_size)
    if not replay_routes:
        return model(ids).logits, target
    with RouteReplay(model) as replay:
        routes = _routes(rank, ids.numel(), replay.num_layers)
        replay.set(routes, torch.ones(ids.numel(), dtype=torch.bool))
        return model(ids).logits, target


def _ep_model_rank(rank, world, path, state, replay_routes):
    from mint.models.expert_parallel import (
        expert_bytes,
        gather_expert_lora,
        is_sharded,
        load_full_lora_state,
        shard_experts,
    )

    model = _model(path, state)
    full_bytes = expert_bytes(model)
    full_experts = [weakref.ref(p) for n, p in model.named_parameters() if "mlp.experts" in n]
    from mint.models.specs import moe_layers

    assert shard_experts(model, None) == len(moe_layers(model.config))
    gc.collect()
    assert all(ref() is None for ref in full_experts)  # nothing holds the full stacks or the full factors any more
    assert sum(is_sharded(m) for m in model.modules()) == len(moe_layers(model.config))
    logits, target = _forward(model, rank, replay_routes)
    (logits * target).sum().backward()
    for name, p in model.named_parameters():  # replicated LoRA: each rank's own tokens, summed as DP would
        if p.requires_grad and "mlp.experts" not in name:
            dist.all_reduce(p.grad)
    with torch.no_grad(), model.disable_adapter():
        base_logits = _forward(model, rank, replay_routes)[0]
    fresh = _model(path)  # a full state loads into a sharded model, each rank taking its experts
    shard_experts(fresh, None)
    load_full_lora_state(fresh, state)
    params = dict(model.named_parameters())
    assert all(torch.equal(p, params[n]) for n, p in fresh.named_parameters())
    return {
        "logits": logits.detach(),
        "base_logits": base_logits,
        "grads": gather_expert_lora(model, None, grads=True),
        "state": gather_expert_lora(model, None),
        "bytes": expert_bytes(model),
        "full_bytes": full_bytes,
    }


@pytest.mark.parametrize(
    ("world", "replay_routes"), [(2, False), pytest.param(4, False, marks=pytest.mark.slow), (2, True)]
)
def test_ep_model_logits_and_lora_gradients_equal_one_rank(tmp_path, tiny_path, adapter_state, world, replay_routes):
    """EP over 2 and 4 ranks (1 expert each) against the single-rank factored model run on every rank's batch;
    with replay_routes the R3 routes use experts 0 and 1 only, so on 2 ranks rank 1 receives no rows."""
    _assert_ep_equals_one_rank(tmp_path, tiny_path, adapter_state, world, replay_routes)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe_lite", "glm_moe_dsa"])
def test_ep_on_a_hybrid_or_mla_base_equals_one_rank(tmp_path, family):
    """The same on Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet layers, a sigmoid-gated shared expert beside the
    routed ones), on DeepSeek-V3 and GLM-4.7-Flash (MLA, a dense first layer, V3-style routing), and on GLM-5 with
    index_topk 4, below the batches' lengths (DSA attends to a selection), EP=2 with the R3 routes replayed."""
    from conftest import build_random_tiny

    from mint.models.lora import lora_state

    if family == "glm_moe_dsa":
        from test_dsa import _path

        path = _path(family, str(tmp_path / "base"), index_topk=4)
    else:
        path = build_random_tiny(family, str(tmp_path / "base"))
    gen = torch.Generator().manual_seed(3)
    state = {k: torch.randn(v.shape, generator=gen) * 0.05 if "lora_B" in k else v
             for k, v in sorted(lora_state(_model(path)).items())}  # fmt: skip
    _assert_ep_equals_one_rank(tmp_path, path, state, 2, True)


def _assert_ep_equals_one_rank(tmp_path, tiny_path, adapter_state, world, replay_routes):
    from mint.models.lora import lora_state

    results = run_ranks(tmp_path, world, _ep_model_rank, tiny_path, adapter_state, replay_routes)
    model = _model(tiny_path, adapter_state)
    # EP adds each expert's rows, and the ranks' gradients, in another order than one process: they part by about
    # eps * max|value| * sqrt(terms) (conftest.sum_atol), terms = the forward's and the backward's chains (the layers
    # times the widest reduction, each way) plus the tokens a gradient sums. Measured: at most 3.9 eps * max|value|.
    c = model.config
    widest = max(c.hidden_size, c.num_attention_heads * c.head_dim, getattr(c, "intermediate_size", 0) or 0,
                 c.moe_intermediate_size)  # fmt: skip
    tokens = sum(SHAPES[r][0] * SHAPES[r][1] for r in range(world))
    terms = 2 * c.num_hidden_layers * widest + tokens

    def close(got, want, msg=None):
        atol = sum_atol(torch.float32, want.abs().max().item(), terms)
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=msg)

    for rank, got in enumerate(results):
        logits, target = _forward(model, rank, replay_routes)
        (logits * target).sum().backward()  # grads accumulate over every rank's batch
        close(got["logits"], logits.detach())
        with torch.no_grad(), model.disable_adapter():
            base = _forward(model, rank, replay_routes)[0]
        close(got["base_logits"], base)
    grads = results[0]["grads"]
    expected = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads.keys() == expected.keys() == lora_state(model).keys()
    for name, g in expected.items():
        if not replay_routes or "mlp.experts" not in name:
            assert g.abs().sum() > 0, name
        close(grads[name], g, msg=lambda m, n=name: f"{n}: {m}")
    assert results[0]["state"].keys() == adapter_state.keys()
    assert all(torch.equal(results[0]["state"][k], adapter_state[k]) for k in adapter_state)
    assert all(r["grads"] == {} and r["state"] == {} for r in results[1:])
    for got in results:  # the expert weights really dropped: storage bytes, base stacks and their LoRA
        assert got["bytes"]["base"] * world == got["full_bytes"]["base"]
        assert got["bytes"]["lora"] * world == got["full_bytes"]["lora"]


# ---- loading only the local experts ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fused_path(tiny_path, tmp_path_factory) -> str:
    """The same base saved with fused stacks (experts.gate_up_proj [E, 2I, H]), as transformers holds it in memory."""
    import shutil

    from conftest import load_fp32
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("ep_qwen3_fused")
    shutil.copy(f"{tiny_path}/config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in load_fp32(tiny_path).state_dict().items()}, str(out / "model.safetensors"))
    return str(out)


def _load_rank(rank, world, path, reference_path):
    from mint.config import LoraConfig
    from mint.models.expert_parallel import load_expert_parallel, shard_experts

    model, read = load_expert_parallel(path, None, LoraConfig(), seed=0)
    reference = _model(reference_path)
    shard_experts(reference, None)
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].shape == want[key].shape and torch.equal(got[key], want[key]), key
    ids, _ = _batch(rank, model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=0, rtol=0)
    return read


def _load_quantized_rank(rank, world, path):
    from mint.config import LoraConfig
    from mint.models.expert_parallel import load_expert_parallel, shard_experts
    from mint.models.lora import add_lora
    from mint.models.quant import FP8, Fp8Linear
    from mint.models.quant_int4 import PackedLinear
    from mint.models.specs import load_model

    model, read = load_expert_parallel(path, None, LoraConfig(), seed=0)
    reference = add_lora(load_model(path), LoraConfig(), seed=0)  # the whole quantized base, then cut to this rank
    shard_experts(reference, None)
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys() and any(t.dtype in (FP8, torch.int32) for t in got.values())
    assert any(isinstance(m, Fp8Linear | PackedLinear) for m in model.modules())
    for key in want:
        a, b = got[key], want[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == FP8 else torch.equal(a, b), key
    ids, _ = _batch(rank, model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=0, rtol=0)
    return read


@pytest.mark.parametrize("quantization", ["fp8", "int4"])
def test_load_of_a_quantized_checkpoint_keeps_its_bytes_and_reads_only_local_experts(tmp_path, tiny_path, quantization):
    """Expert parallel on an FP8 checkpoint (16 x 16 blocks) or an INT4 one (every linear and expert packed, groups
    of 16): each of 2 ranks reads half the experts' quantized bytes and scales, and holds what sharding the whole
    quantized base gives, byte for byte, with the same logits."""
    from mint.models.quant_checkpoint import pack_checkpoint, quantize_checkpoint

    if quantization == "fp8":
        path = quantize_checkpoint(tiny_path, str(tmp_path / "fp8"), (16, 16))
    else:
        path = pack_checkpoint(tiny_path, str(tmp_path / "int4"), group_size=16, linears=True)
    for read in run_ranks(tmp_path, 2, _load_quantized_rank, path):
        assert read["experts"] * 2 == read["experts_total"], read


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("world", [2, FOUR_RANKS])
def test_load_reads_only_local_experts_and_equals_sharding_a_full_load(tmp_path, tiny_path, fused_path, world, layout):
    """Expert bytes read per rank = 1/ep of the checkpoint's (2 MoE layers x 4 experts: 196,608 of 393,216 bytes on
    2 ranks, 98,304 on 4); the dense weights are read whole (151,552 bytes)."""
    path = tiny_path if layout == "per_expert" else fused_path
    results = run_ranks(tmp_path, world, _load_rank, path, tiny_path)
    for read in results:
        assert read["experts"] * world == read["experts_total"], read
        assert read["dense"] > 0
