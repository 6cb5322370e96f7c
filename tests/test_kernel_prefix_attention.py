"""prefix_attention: Triton kernel vs plain-torch reference, outputs and every gradient.

The Triton kernels run on CPU under the Triton interpreter. TRITON_INTERPRET must be set before triton is first
imported, and other test modules in the same pytest process import it first (and a GPU run must not interpret), so
test_triton_kernels_under_interpreter re-runs this file's `interp_` tests in a subprocess with TRITON_INTERPRET=1.
Run them directly with: TRITON_INTERPRET=1 pytest tests/test_kernel_prefix_attention.py -k interp_
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch
from conftest import assert_three_way, compile_for_hopper, run_interp_tests_in_subprocess, saved_bytes

from mint_kernels import prefix_attention, prefix_attention_reference

# The package re-exports the function under the module's name, so fetch the modules themselves for monkeypatching.
pa = importlib.import_module("mint_kernels.prefix_attention")
pa_ref = importlib.import_module("mint_kernels._prefix_attention_reference")
pa_triton = importlib.import_module("mint_kernels._prefix_attention_triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in test_triton_kernels_under_interpreter's TRITON_INTERPRET=1 subprocess"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_inputs(B, Hq, Hkv, P, R, D, *, shared_prefix=True, dtype=torch.float32, device="cpu", seed=0):
    """Random inputs; q, k_resp, v_resp require grad, the prefix K/V are constants (as LongStraw captures them)."""
    g = torch.Generator().manual_seed(seed)
    batch = () if B is None else (B,)
    prefix_batch = () if shared_prefix else batch

    def rnd(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)

    return dict(
        q=rnd(*batch, Hq, R, D, grad=True),
        k_prefix=rnd(*prefix_batch, Hkv, P, D),
        v_prefix=rnd(*prefix_batch, Hkv, P, D),
        k_resp=rnd(*batch, Hkv, R, D, grad=True),
        v_resp=rnd(*batch, Hkv, R, D, grad=True),
    )


def run(inputs, *, force, exact, acc_init=None, cast=None, seed=1):
    """Forward (out, lse) and backward of sum(out * gO) + sum(lse * gL); returns every output and gradient.

    cast: dtype to cast the inputs to first (the fp32 reference of a bf16 run). exact: pass fp32 prefix buffers,
    pre-filled with acc_init, and return them too.
    """
    ins = {k: v.detach().to(cast or v.dtype).requires_grad_(v.requires_grad) for k, v in inputs.items()}
    acc = {}
    if exact:
        for name in ("dk_prefix_acc", "dv_prefix_acc"):
            acc[name] = (
                acc_init.clone() if acc_init is not None else torch.zeros_like(ins["k_prefix"], dtype=torch.float32)
            )
    scale = 1.0 / math.sqrt(ins["q"].shape[-1])
    out, lse = prefix_attention(**ins, scale=scale, return_lse=True, force=force, **acc)
    g = torch.Generator().manual_seed(seed)
    g_out = torch.randn(out.shape, generator=g).to(out)
    g_lse = torch.randn(lse.shape, generator=g).to(lse)
    ((out.float() * g_out.float()).sum() + (lse * g_lse).sum()).backward()
    res = {"out": out, "lse": lse, "dq": ins["q"].grad, "dk_resp": ins["k_resp"].grad, "dv_resp": ins["v_resp"].grad}
    res.update({k: v for k, v in acc.items()})
    assert ins["k_prefix"].grad is None and ins["v_prefix"].grad is None  # prefix grads never reach autograd here
    return res


def naive_attention(q, k_prefix, v_prefix, k_resp, v_resp, scale):
    """The formula, spelled out: concatenate K/V, repeat the K/V heads, mask tril(diagonal=P), softmax.

    Accumulates in promote_types(dtype, fp32) like the reference; returns (out in q's dtype, lse). Autograd gives
    every gradient, prefix included. This materializes [B, H_q, R, P + R], which is what the reference avoids.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    batched = q.dim() == 4
    q4, kr, vr = (q, k_resp, v_resp) if batched else (q.unsqueeze(0), k_resp.unsqueeze(0), v_resp.unsqueeze(0))
    B, Hq, R, _ = q4.shape
    kp = k_prefix if k_prefix.dim() == 4 else k_prefix.unsqueeze(0).expand(B, *k_prefix.shape)
    vp = v_prefix if v_prefix.dim() == 4 else v_prefix.unsqueeze(0).expand(B, *v_prefix.shape)
    groups, P = Hq // kr.shape[1], kp.shape[2]
    k = torch.cat([kp, kr], dim=2).repeat_interleave(groups, dim=1).to(acc)
    v = torch.cat([vp, vr], dim=2).repeat_interleave(groups, dim=1).to(acc)
    s = (q4.to(acc) @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(R, P + R, dtype=torch.bool).tril(diagonal=P), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = (torch.softmax(s, dim=-1) @ v).to(q.dtype)
    return (out, lse) if batched else (out.squeeze(0), lse.squeeze(0))


def adapter_views(Hq, Hkv, P, T, D, *, layers=3, slack=5, layer=1, dtype=torch.float32, seed=0):
    """Leaves in the layouts the LongStraw adapter passes, and a function that builds its views from them.

    q/k/v come out of [T, H * D] projections as `.view(T, H, D).transpose(0, 1)` (non-contiguous [H, T, D]); the
    prefix K/V are `state[layer, :, :P]` of a [L, H_kv, S, D] state with S = P + slack (non-contiguous), and the
    exact-mode dK/dV buffers are the same slices of fp32 [L, H_kv, S, D] buffers that already hold values.
    """
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
    leaves = dict(
        q_proj=rnd(T, Hq * D),
        k_proj=rnd(T, Hkv * D),
        v_proj=rnd(T, Hkv * D),
        state_k=rnd(layers, Hkv, P + slack, D),
        state_v=rnd(layers, Hkv, P + slack, D),
        grad_k=torch.randn(layers, Hkv, P + slack, D, generator=g),
        grad_v=torch.randn(layers, Hkv, P + slack, D, generator=g),
    )

    def views(t):
        return dict(
            q=t["q_proj"].view(T, Hq, D).transpose(0, 1),
            k_resp=t["k_proj"].view(T, Hkv, D).transpose(0, 1),
            v_resp=t["v_proj"].view(T, Hkv, D).transpose(0, 1),
            k_prefix=t["state_k"][layer, :, :P],
            v_prefix=t["state_v"][layer, :, :P],
        ), dict(dk_prefix_acc=t["grad_k"][layer, :, :P], dv_prefix_acc=t["grad_v"][layer, :, :P])

    return leaves, views


def run_adapter_views(leaves, views, fn, *, seed=1):
    """fn(**views, scale, return_lse=True, **buffers) forward and backward on fresh copies of the leaves.

    Returns outputs, the projections' gradients and the whole dK/dV buffers (to check what lies outside the slice).
    """
    t = {k: v.detach().clone().requires_grad_(k.endswith("proj")) for k, v in leaves.items()}
    ins, accs = views(t)
    scale = 1.0 / math.sqrt(ins["q"].shape[-1])
    out, lse = fn(**ins, scale=scale, return_lse=True, **accs)
    g = torch.Generator().manual_seed(seed)
    g_out, g_lse = torch.randn(out.shape, generator=g).to(out), torch.randn(lse.shape, generator=g).to(lse)
    ((out.float() * g_out.float()).sum() + (lse.float() * g_lse.float()).sum()).backward()
    res = {"out": out, "lse": lse, **{f"d_{k}": t[k].grad for k in ("q_proj", "k_proj", "v_proj")}}
    return res | {"grad_k": t["grad_k"], "grad_v": t["grad_v"]}


# Odd shapes (P and R not powers of two): P=37, R=13, D in {16, 32, 64}, GQA 4:1 and 1:1; plus a multi-tile response
# (R=40 spans three 16-row tiles, so causal tile skipping runs) with a tile-aligned prefix, and an empty prefix.
SHAPES = [
    # B, H_q, H_kv, P, R, D, shared_prefix
    (None, 4, 1, 37, 13, 16, True),
    (2, 4, 4, 37, 13, 32, True),
    (2, 8, 2, 37, 13, 64, False),
    (None, 2, 1, 32, 40, 16, True),
    (None, 2, 2, 0, 5, 16, True),
]
SHAPE_IDS = ["gqa4-d16", "mha-d32-batched", "gqa4-d64-batched-prefix", "r40-aligned-p", "empty-prefix"]


@needs_interpreter
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1e-4)])
@pytest.mark.parametrize("B,Hq,Hkv,P,R,D,shared", SHAPES, ids=SHAPE_IDS)
def test_interp_matches_reference(B, Hq, Hkv, P, R, D, shared, dtype, atol, rtol):
    inputs = make_inputs(B, Hq, Hkv, P, R, D, shared_prefix=shared, dtype=dtype)
    # Detached mode: no buffers, prefix constant.
    kernel = run(inputs, force="triton", exact=False)
    assert_three_way(
        kernel,
        run(inputs, force="reference", exact=False),
        run(inputs, force="reference", exact=False, cast=torch.float32),
        atol,
        rtol,
    )
    # Exact mode: prefix grads are ADDED into buffers that already hold something.
    init = torch.randn(inputs["k_prefix"].shape, generator=torch.Generator().manual_seed(7))
    kernel = run(inputs, force="triton", exact=True, acc_init=init)
    ref = run(inputs, force="reference", exact=True, acc_init=init)
    assert_three_way(
        kernel, ref, run(inputs, force="reference", exact=True, acc_init=init, cast=torch.float32), atol, rtol
    )
    fresh = run(inputs, force="reference", exact=True)
    torch.testing.assert_close(kernel["dk_prefix_acc"], init + fresh["dk_prefix_acc"], atol=atol, rtol=rtol)


@needs_interpreter
@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32)])
def test_interp_unequal_tiles(block_m, block_n, monkeypatch):
    """The GPU tiles are not square (128x64 forward): causal tile bounds must hold when BLOCK_M != BLOCK_N."""
    tiles = lambda d, device: dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=16, num_warps=4, num_stages=1)
    monkeypatch.setattr(pa, "_blocks", tiles)
    monkeypatch.setattr(pa, "_bwd_blocks", tiles)
    inputs = make_inputs(None, 4, 2, 37, 40, 16)
    kernel = run(inputs, force="triton", exact=True)
    ref = run(inputs, force="reference", exact=True)
    assert_three_way(kernel, ref, ref, 1e-4, 1e-4)


@needs_interpreter
def test_interp_prefix_buffers_sum_over_replays():
    """LongStraw exact mode replays G responses against one prefix; the buffers must hold the sum of their grads."""
    Hq, Hkv, P, R, D = 4, 2, 37, 13, 16
    first = make_inputs(None, Hq, Hkv, P, R, D, seed=0)
    second = make_inputs(None, Hq, Hkv, P, 9, D, seed=1)
    second["k_prefix"], second["v_prefix"] = first["k_prefix"], first["v_prefix"]
    dk = torch.zeros(Hkv, P, D)
    dv = torch.zeros(Hkv, P, D)
    for inputs in (first, second):
        out = prefix_attention(**inputs, dk_prefix_acc=dk, dv_prefix_acc=dv, force="triton")
        out.square().sum().backward()
    expected_dk = torch.zeros_like(dk)
    expected_dv = torch.zeros_like(dv)
    for inputs in (first, second):
        kp = inputs["k_prefix"].detach().requires_grad_()
        vp = inputs["v_prefix"].detach().requires_grad_()
        ins = dict(inputs, k_prefix=kp, v_prefix=vp, q=inputs["q"].detach())
        prefix_attention_reference(**ins, scale=1 / math.sqrt(D)).square().sum().backward()
        expected_dk += kp.grad
        expected_dv += vp.grad
    torch.testing.assert_close(dk, expected_dk, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dv, expected_dv, atol=1e-4, rtol=1e-4)


@needs_interpreter
def test_interp_detached_mode_skips_prefix_gradients(monkeypatch):
    """Without buffers the prefix dK/dV kernel is never launched: detached mode does not pay for it."""
    launches = []
    real = pa._prefix_attn_bwd_dkdv_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(pa, "_prefix_attn_bwd_dkdv_kernel", Counting())
    inputs = make_inputs(None, 4, 1, 37, 13, 16)
    prefix_attention(**inputs, force="triton").sum().backward()
    assert len(launches) == 1  # response dK/dV only
    dk = torch.zeros(1, 37, 16)
    prefix_attention(**inputs, dk_prefix_acc=dk, dv_prefix_acc=torch.zeros_like(dk), force="triton").sum().backward()
    assert len(launches) == 3  # response + prefix


@needs_interpreter
def test_interp_prefix_requiring_grad_gets_autograd_gradient():
    """Prefix K/V that require grad (and no buffers) get their gradient through autograd; a shared prefix sums it."""
    inputs = make_inputs(2, 4, 2, 19, 5, 16)
    grads = {}
    for force in ("triton", "reference"):
        ins = {k: v.detach().requires_grad_() for k, v in inputs.items()}
        prefix_attention(**ins, force=force).square().sum().backward()
        grads[force] = {k: v.grad for k, v in ins.items()}
    for name in grads["triton"]:
        torch.testing.assert_close(grads["triton"][name], grads["reference"][name], atol=1e-4, rtol=1e-4)


@needs_interpreter
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1e-4)])
@pytest.mark.parametrize("P", [37, 0], ids=["p37", "empty-prefix"])
def test_interp_adapter_views(P, dtype, atol, rtol):
    """The adapter's strided views: transposed q/k/v, prefix K/V and dK/dV buffers sliced out of [L, H_kv, S, D].

    Kernel vs reference for the output, lse and every gradient, and nothing outside the buffers' slice is written.
    """
    leaves, views = adapter_views(8, 2, P, 13, 16, dtype=dtype)
    kernel = run_adapter_views(leaves, views, lambda **kw: prefix_attention(**kw, force="triton"))
    ref = run_adapter_views(leaves, views, prefix_attention_reference)
    assert_three_way(kernel, ref, ref, atol, rtol)  # fp32 only: the same-dtype reference is the fp32 one
    for name in ("grad_k", "grad_v"):
        outside = torch.ones_like(leaves[name], dtype=torch.bool)
        outside[1, :, :P] = False
        torch.testing.assert_close(kernel[name][outside], leaves[name][outside], atol=0, rtol=0)


@pytest.mark.skipif(INTERPRETED, reason="under the interpreter the kernels are not compiled")
def test_kernels_compile_for_hopper():
    """Every kernel variant the launchers use, at D = 128 in bf16 with the GPU tiles."""
    cuda = torch.device("cuda")
    fwd, bwd = pa._blocks(128, cuda), pa._bwd_blocks(128, cuda)
    bf16 = lambda *names: dict.fromkeys(names, "*bf16")
    fp32 = lambda *names: dict.fromkeys(names, "*fp32")
    scales = ("scale", "qk_scale_log2")
    for mask_p in (False, True):
        ptrs = bf16("Q", "KP", "VP", "KR", "VR", "OUT") | fp32("LSE")
        compile_for_hopper(pa_triton._prefix_attn_fwd_kernel, fwd, ptrs, scales, MASK_P=mask_p, PRECISION="tf32")
        ptrs = bf16("Q", "KP", "VP", "KR", "VR", "DO", "DQ") | fp32("LSE", "DELTA")
        compile_for_hopper(pa_triton._prefix_attn_bwd_dq_kernel, bwd, ptrs, scales, MASK_P=mask_p, PRECISION="tf32")
    tiles = {"BLOCK_M": bwd["BLOCK_M"], "BLOCK_D": bwd["BLOCK_D"]}
    ptrs = bf16("OUT", "DO") | fp32("DLSE", "DELTA")
    compile_for_hopper(pa_triton._prefix_attn_bwd_delta_kernel, tiles, ptrs, HAS_DLSE=True)
    for causal in (True, False):  # the response's dK/dV (bf16, written) and the prefix's (fp32 buffers, added into)
        ptrs = bf16("Q", "K", "V", "DO") | fp32("LSE", "DELTA") | (bf16 if causal else fp32)("DK", "DV")
        kernel = pa_triton._prefix_attn_bwd_dkdv_kernel
        compile_for_hopper(kernel, bwd, ptrs, scales, CAUSAL=causal, ACCUMULATE=not causal, PRECISION="tf32")


def test_triton_kernels_under_interpreter():
    """Runs the interp_ tests above in a subprocess with TRITON_INTERPRET=1 (see the module docstring)."""
    if INTERPRETED:
        pytest.skip("already under the interpreter: the interp_ tests run directly")
    run_interp_tests_in_subprocess(__file__, min_passed=len(SHAPES) + 7)


def small_key_blocks(monkeypatch, keys=3):
    """Make the reference read `keys` keys per block, so small tests cross many block boundaries."""
    monkeypatch.setattr(pa_ref, "SCORE_BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(pa_ref, "MIN_KEY_BLOCK", keys)


@pytest.mark.parametrize(
    "B,P,shared",
    [(2, 7, True), (2, 7, False), (None, 7, True), (2, 0, True)],
    ids=["shared", "batched", "unbatched", "p0"],
)
def test_reference_gradcheck_float64(B, P, shared, monkeypatch):
    """Gradients of out and lse w.r.t. q, prefix K/V (through autograd) and response K/V, over 3-key blocks."""
    small_key_blocks(monkeypatch)
    inputs = make_inputs(B, 4, 2, P, 5, 3, shared_prefix=shared, dtype=torch.float64)
    args = tuple(t.detach().requires_grad_() for t in inputs.values())
    fn = lambda *t: prefix_attention_reference(*t, scale=0.4, return_lse=True)
    assert torch.autograd.gradcheck(fn, args)


# bf16: the reference accumulates in fp32 and rounds each result once to bf16 (relative step 3.9e-3 on values of
# magnitude up to ~3), hence 2e-2.
@pytest.mark.parametrize(
    "dtype,atol,rtol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("B,Hq,Hkv,P,R,D,shared", SHAPES, ids=SHAPE_IDS)
def test_reference_matches_naive_formula(B, Hq, Hkv, P, R, D, shared, dtype, atol, rtol, monkeypatch):
    """Blocked reference (5-key blocks, so P=37 and R=13 end in partial blocks) vs naive_attention, with exact-mode
    buffers vs the naive formula's autograd prefix gradients."""
    small_key_blocks(monkeypatch, keys=5)
    inputs = make_inputs(B, Hq, Hkv, P, R, D, shared_prefix=shared, dtype=dtype)
    init = torch.randn(inputs["k_prefix"].shape, generator=torch.Generator().manual_seed(7))
    ref = run(inputs, force="reference", exact=True, acc_init=init)

    def naive(cast):
        ins = {k: v.detach().to(cast).requires_grad_() for k, v in inputs.items()}
        out, lse = naive_attention(**ins, scale=1.0 / math.sqrt(D))
        g = torch.Generator().manual_seed(1)
        g_out = torch.randn(out.shape, generator=g).to(out)
        g_lse = torch.randn(lse.shape, generator=g).to(lse)
        ((out.float() * g_out.float()).sum() + (lse * g_lse).sum()).backward()
        grads = {"dq": ins["q"].grad, "dk_resp": ins["k_resp"].grad, "dv_resp": ins["v_resp"].grad}
        accs = {
            "dk_prefix_acc": init + ins["k_prefix"].grad.float(),
            "dv_prefix_acc": init + ins["v_prefix"].grad.float(),
        }
        return {"out": out, "lse": lse, **grads, **accs}

    assert_three_way(ref, naive(dtype), naive(torch.float32), atol, rtol)


def add_grad_into(buffer):
    def hook(leaf):  # a post-accumulate-grad hook must return None
        buffer.add_(leaf.grad)

    return hook


@pytest.mark.parametrize("P", [37, 0], ids=["p37", "empty-prefix"])
def test_reference_adapter_views_match_naive_formula(P, monkeypatch):
    """The adapter's strided views on the CPU path: only the buffers' slice changes, by the naive prefix gradient."""
    small_key_blocks(monkeypatch, keys=5)
    leaves, views = adapter_views(8, 2, P, 13, 16)
    ref = run_adapter_views(leaves, views, prefix_attention)  # CPU tensors: the reference path

    def naive(**kw):  # naive_attention with the prefix's gradient added into the buffers, as exact mode does
        buffers = kw.pop("dk_prefix_acc"), kw.pop("dv_prefix_acc")
        prefix = kw.pop("k_prefix").detach().requires_grad_(), kw.pop("v_prefix").detach().requires_grad_()
        for leaf, buffer in zip(prefix, buffers, strict=True):
            leaf.register_post_accumulate_grad_hook(add_grad_into(buffer))
        kw.pop("return_lse")
        return naive_attention(k_prefix=prefix[0], v_prefix=prefix[1], **kw)

    expected = run_adapter_views(leaves, views, naive)
    assert_three_way(ref, expected, expected, 1e-5, 1e-5)
    for name in ("grad_k", "grad_v"):
        outside = torch.ones_like(leaves[name], dtype=torch.bool)
        outside[1, :, :P] = False
        torch.testing.assert_close(ref[name][outside], leaves[name][outside], atol=0, rtol=0)


@pytest.mark.parametrize("mode", ["detached", "exact", "prefix-requires-grad"])
def test_reference_saves_nothing_prefix_sized(mode, monkeypatch):
    """What the reference saves for backward does not grow with P (the naive formula's [H, R, P + R] does), and its
    largest score block stays within SCORE_BLOCK_ELEMENTS."""
    Hq, Hkv, R, D = 4, 2, 8, 16
    monkeypatch.setattr(pa_ref, "SCORE_BLOCK_ELEMENTS", 1024)  # 1024 / (H_q * R) = 32 keys per block
    largest = []
    real_scores = pa_ref._scores

    def recording_scores(*args):
        s = real_scores(*args)
        largest.append(s.numel())
        return s

    monkeypatch.setattr(pa_ref, "_scores", recording_scores)

    def saved(fn, P):
        inputs = make_inputs(None, Hq, Hkv, P, R, D, seed=P)
        if mode == "prefix-requires-grad":
            inputs = {k: v.detach().requires_grad_() for k, v in inputs.items()}
        accs = {}
        if mode == "exact":
            accs = dict(dk_prefix_acc=torch.zeros(Hkv, P, D), dv_prefix_acc=torch.zeros(Hkv, P, D))
        return saved_bytes(lambda: fn(**inputs, scale=0.25, **accs)[0].sum().backward())

    reference = lambda **kw: prefix_attention_reference(**kw, return_lse=True)
    small, large = saved(reference, 64), saved(reference, 4096)
    assert small == large, (small, large)
    assert large <= 6 * Hq * R * D * 4  # q, k/v_resp, out, lse: a few [H, R, D] tensors
    assert max(largest) <= 1024
    if mode != "exact":  # the check does see P-sized saves: the naive formula's grow with P
        assert saved(naive_attention, 4096) > saved(naive_attention, 64) + Hq * R * 4000 * 4


def test_reference_detached_mode_skips_prefix_gradients(monkeypatch):
    """A constant prefix and no buffers: the backward computes no prefix dK/dV (it reads the prefix for dQ only)."""
    calls = []
    real = pa_ref._add_prefix_grads
    monkeypatch.setattr(pa_ref, "_add_prefix_grads", lambda *a: calls.append(1) or real(*a))
    small_key_blocks(monkeypatch, keys=8)
    inputs = make_inputs(None, 4, 1, 37, 13, 16)
    prefix_attention_reference(**inputs, scale=0.25).sum().backward()
    assert not calls
    dk = torch.zeros(1, 37, 16)
    out = prefix_attention_reference(**inputs, scale=0.25, dk_prefix_acc=dk, dv_prefix_acc=torch.zeros_like(dk))
    out.sum().backward()
    assert len(calls) == 5  # cdiv(37, 8) prefix blocks


def test_reference_is_cpu_default_and_fills_buffers():
    """On CPU tensors prefix_attention is the reference; exact-mode buffers are filled on that path too."""
    inputs = make_inputs(2, 4, 2, 37, 13, 16)
    default = run(inputs, force=None, exact=True, acc_init=torch.ones(2, 37, 16))
    ref = run(inputs, force="reference", exact=True, acc_init=torch.ones(2, 37, 16))
    for name in default:
        torch.testing.assert_close(default[name], ref[name], atol=0, rtol=0)
    kp = inputs["k_prefix"].detach().requires_grad_()
    ins = dict(inputs, k_prefix=kp, q=inputs["q"].detach())
    out, lse = prefix_attention_reference(**ins, scale=0.25, return_lse=True)
    g = torch.Generator().manual_seed(1)
    ((out * torch.randn(out.shape, generator=g)).sum() + (lse * torch.randn(lse.shape, generator=g)).sum()).backward()
    torch.testing.assert_close(default["dk_prefix_acc"], 1 + kp.grad, atol=1e-5, rtol=1e-5)


def test_reference_causal_mask_is_bottom_right():
    """Query i sees all P prefix keys and response keys 0..i: perturbing response key i+1 leaves query i unchanged."""
    inputs = make_inputs(None, 2, 1, 6, 4, 8)
    base = prefix_attention_reference(**inputs, scale=0.3)
    bumped = dict(inputs, k_resp=inputs["k_resp"].detach().clone(), v_resp=inputs["v_resp"].detach().clone())
    bumped["k_resp"][:, 2] += 1.0
    bumped["v_resp"][:, 2] += 1.0
    out = prefix_attention_reference(**bumped, scale=0.3)
    torch.testing.assert_close(out[:, :2], base[:, :2], atol=0, rtol=0)
    assert not torch.allclose(out[:, 2:], base[:, 2:])


def test_rejects_bad_shapes_and_force():
    inputs = make_inputs(None, 3, 2, 5, 4, 8)
    with pytest.raises(ValueError, match="multiple"):
        prefix_attention(**inputs)
    inputs = make_inputs(None, 4, 2, 5, 4, 8)
    with pytest.raises(ValueError, match="force"):
        prefix_attention(**inputs, force="cuda")
    with pytest.raises(ValueError, match="fp32"):
        prefix_attention(
            **inputs, dk_prefix_acc=torch.zeros(2, 5, 8, dtype=torch.float64), dv_prefix_acc=torch.zeros(2, 5, 8)
        )
    if not INTERPRETED:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            prefix_attention(**inputs, force="triton")


# bf16 on the GPU. Tolerances: bf16 has an 8-bit mantissa (relative step 3.9e-3); O averages V over up to P+R keys,
# and the gradients sum over R queries (dK/dV also over the G heads of a group), so they carry a few bf16 roundings.
# The kernel rounds P and dS to bf16 before its tl.dot calls where the reference keeps them in fp32, hence the 5e-2 on
# gradients.
# Not yet run: no GPU was available when these were written.
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "dtype,atol,rtol", [(torch.bfloat16, 2e-2, 2e-2), (torch.float32, 1e-4, 1e-4)], ids=["bf16", "fp32"]
)
@pytest.mark.parametrize("B,Hq,Hkv,P,R,D,shared", [(None, 32, 4, 1000, 130, 128, True), (2, 8, 8, 37, 13, 64, False)])
def test_gpu_matches_fp32_reference(B, Hq, Hkv, P, R, D, shared, dtype, atol, rtol):
    inputs = make_inputs(B, Hq, Hkv, P, R, D, shared_prefix=shared, dtype=dtype, device="cuda")
    init = torch.randn(inputs["k_prefix"].shape, device="cuda")
    kernel = run(inputs, force="triton", exact=True, acc_init=init)
    ref_same = run(inputs, force="reference", exact=True, acc_init=init)
    ref_fp32 = run(inputs, force="reference", exact=True, acc_init=init, cast=torch.float32)
    grad_tol = 1e-4 if dtype == torch.float32 else 5e-2
    for name in kernel:
        tol = atol if name in ("out", "lse") else grad_tol
        for ref, label in ((ref_same, "same-dtype"), (ref_fp32, "fp32")):
            torch.testing.assert_close(
                kernel[name].float(),
                ref[name].float(),
                atol=tol,
                rtol=tol,
                msg=lambda m, n=name, r=label: f"{n} vs {r}: {m}",
            )
