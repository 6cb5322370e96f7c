"""latent_prefix_attention: Triton kernel vs plain-torch reference vs the naive formula, outputs and every gradient.

The Triton kernels run on CPU under the Triton interpreter, in a subprocess with TRITON_INTERPRET=1 (see
tests/test_kernel_prefix_attention.py's docstring for why). Run them directly with:
TRITON_INTERPRET=1 pytest tests/test_kernel_latent_attention.py -k interp_
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from conftest import assert_three_way, compile_for_hopper, run_interp_tests_in_subprocess, saved_bytes

from mint_kernels import latent_prefix_attention, latent_prefix_attention_reference, prefix_attention

la = importlib.import_module("mint_kernels.latent_attention")
la_ref = importlib.import_module("mint_kernels._latent_attention_reference")
la_triton = importlib.import_module("mint_kernels._latent_attention_triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in test_triton_kernels_under_interpreter's TRITON_INTERPRET=1 subprocess"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SCALE = 0.15


def make_inputs(B, H, P, R, Dk, *, dtype=torch.float32, device="cpu", seed=0):
    """Random inputs; q and own_pages require grad, the prefix pages are constants (as LongStraw captures them)."""
    g = torch.Generator().manual_seed(seed)
    batch = () if B is None else (B,)

    def rnd(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)

    return dict(q=rnd(*batch, H, R, Dk, grad=True), pages=rnd(P, Dk), own_pages=rnd(*batch, R, Dk, grad=True))


def backward_of(out, lse, seed=1):
    """Backward of sum(out * gO) + sum(lse * gL) with fixed random gO, gL: gradients flow from both outputs."""
    g = torch.Generator().manual_seed(seed)
    g_out = torch.randn(out.shape, generator=g).to(device=out.device, dtype=torch.float32)
    g_lse = torch.randn(lse.shape, generator=g).to(device=lse.device, dtype=torch.float32)
    ((out.float() * g_out).sum() + (lse.float() * g_lse).sum()).backward()


def run(inputs, dv, *, force, exact, acc_init=None, cast=None):
    """Forward (out, lse) and backward; returns every output and gradient, and the buffer in exact mode."""
    ins = {k: v.detach().to(cast or v.dtype).requires_grad_(v.requires_grad) for k, v in inputs.items()}
    acc = {}
    if exact:
        init = torch.zeros(ins["pages"].shape) if acc_init is None else acc_init
        acc["dpage_acc"] = init.clone().to(ins["pages"].device)
    out, lse = latent_prefix_attention(**ins, latent_dim=dv, scale=SCALE, return_lse=True, force=force, **acc)
    backward_of(out, lse)
    assert ins["pages"].grad is None  # prefix gradients never reach autograd here
    return {"out": out, "lse": lse, "dq": ins["q"].grad, "d_own": ins["own_pages"].grad, **acc}


def naive_latent(q, pages, own_pages, dv, scale):
    """The formula, spelled out: concatenate the pages, repeat them per head, mask tril(diagonal=P), softmax, values =
    keys[..., :dv]. Materializes [B, H, R, P + R]; autograd gives every gradient, the pages' included."""
    acc = torch.promote_types(q.dtype, torch.float32)
    batched = q.dim() == 4
    q4, own = (q, own_pages) if batched else (q.unsqueeze(0), own_pages.unsqueeze(0))
    B, H, R, _ = q4.shape
    P = pages.shape[0]
    keys = torch.cat([pages.unsqueeze(0).expand(B, *pages.shape), own], dim=1).unsqueeze(1).expand(B, H, P + R, -1)
    keys = keys.to(acc)
    s = (q4.to(acc) @ keys.transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(R, P + R, dtype=torch.bool).tril(diagonal=P), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = (torch.softmax(s, dim=-1) @ keys[..., :dv]).to(q.dtype)
    return (out, lse) if batched else (out.squeeze(0), lse.squeeze(0))


def run_naive(inputs, dv, acc_init, cast):
    ins = {k: v.detach().to(cast).requires_grad_() for k, v in inputs.items()}
    out, lse = naive_latent(**ins, dv=dv, scale=SCALE)
    backward_of(out, lse)
    dpage = acc_init + ins["pages"].grad.float()
    return {"out": out, "lse": lse, "dq": ins["q"].grad, "d_own": ins["own_pages"].grad, "dpage_acc": dpage}


# Odd sizes: D_k = 40, D_v = 32 (three and two 16-wide column chunks under the interpreter, the last D_k one partial),
# P = 37, R = 13; H = 3 so the interpreter's 16-row tiles straddle heads unevenly; batch rows sharing one prefix; an
# empty prefix; R = 1 with 8 heads; and a multi-tile response (R * H = 40 rows, R = 20 own pages) with an aligned P.
SHAPES = [
    # B, H, P, R, D_k, D_v
    (None, 4, 37, 13, 40, 32),
    (2, 3, 37, 5, 40, 32),
    (2, 4, 0, 5, 24, 16),
    (None, 8, 21, 1, 40, 32),
    (None, 2, 16, 20, 24, 16),
]
SHAPE_IDS = ["unbatched", "batch-shared-prefix-h3", "empty-prefix", "r1-h8", "multi-tile-response"]


def small_key_blocks(monkeypatch, keys=5):
    """Make the reference read `keys` keys per block, so small tests cross many block boundaries."""
    monkeypatch.setattr(la_ref, "SCORE_BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(la_ref, "MIN_KEY_BLOCK", keys)


# --------------------------------------------------------------------------------------------------------------------
# The reference (the CPU path), default process
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float64, 1e-10, 1e-10), (torch.float32, 1e-5, 1e-5)])
@pytest.mark.parametrize("B,H,P,R,Dk,Dv", SHAPES, ids=SHAPE_IDS)
def test_reference_matches_naive_formula(B, H, P, R, Dk, Dv, dtype, atol, rtol, monkeypatch):
    """Blocked reference (5-key blocks: P = 37 and R = 13 end in partial blocks) vs naive_latent, the buffer included
    (added into existing contents)."""
    small_key_blocks(monkeypatch)
    inputs = make_inputs(B, H, P, R, Dk, dtype=dtype)
    init = torch.randn(P, Dk, generator=torch.Generator().manual_seed(7))
    ref = run(inputs, Dv, force="reference", exact=True, acc_init=init)
    oracle = run_naive(inputs, Dv, init.double(), torch.float64)  # the oracle in fp64, whatever the reference's dtype
    assert ref.keys() == oracle.keys()
    for name, want in oracle.items():
        tol = max(atol, 1e-5) if name == "dpage_acc" else atol  # the buffer is fp32 by contract, even for fp64 inputs
        torch.testing.assert_close(ref[name].double(), want, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("B,P", [(2, 7), (None, 7), (2, 0)], ids=["batched", "unbatched", "p0"])
def test_reference_gradcheck_float64(B, P, monkeypatch):
    """Gradients of out and lse w.r.t. q, the prefix pages (through autograd) and own pages, over 3-key blocks."""
    small_key_blocks(monkeypatch, keys=3)
    inputs = make_inputs(B, 3, P, 4, 6, dtype=torch.float64)
    args = tuple(t.detach().requires_grad_() for t in inputs.values())
    fn = lambda *t: latent_prefix_attention_reference(*t, latent_dim=4, scale=0.4, return_lse=True)
    assert torch.autograd.gradcheck(fn, args)


def test_reference_equals_prefix_attention_on_pages():
    """The formulation it replaces: prefix_attention with the pages as both K and V and one K/V head. Its output's
    first D_v columns are ours, and its dK + dV buffers sum to our one buffer."""
    inputs = make_inputs(2, 4, 37, 13, 40)
    ours = run(inputs, 32, force="reference", exact=True)
    ins = {k: v.detach().requires_grad_(v.requires_grad) for k, v in inputs.items()}
    dk, dv = torch.zeros(1, 37, 40), torch.zeros(1, 37, 40)
    page = ins["own_pages"].unsqueeze(1)
    out, lse = prefix_attention(
        ins["q"], ins["pages"][None], ins["pages"][None], page, page, SCALE,
        dk_prefix_acc=dk, dv_prefix_acc=dv, return_lse=True,
    )  # fmt: skip
    backward_of(out[..., :32], lse)
    theirs = {"out": out[..., :32], "lse": lse, "dq": ins["q"].grad, "d_own": ins["own_pages"].grad}
    assert_three_way(ours, theirs | {"dpage_acc": (dk + dv)[0]}, theirs | {"dpage_acc": (dk + dv)[0]}, 1e-5, 1e-5)


@pytest.mark.parametrize("mode", ["detached", "exact", "prefix-requires-grad"])
def test_reference_saves_nothing_prefix_sized(mode, monkeypatch):
    """What the reference saves does not grow with P (the naive formula's does), and its largest score block stays
    within SCORE_BLOCK_ELEMENTS."""
    H, R, Dk, Dv = 4, 8, 24, 16
    monkeypatch.setattr(la_ref, "SCORE_BLOCK_ELEMENTS", 1024)  # 1024 / (H * R) = 32 keys per block
    largest = []
    real_scores = la_ref._scores

    def recording_scores(*args):
        s = real_scores(*args)
        largest.append(s.numel())
        return s

    monkeypatch.setattr(la_ref, "_scores", recording_scores)

    def saved(fn, P):
        inputs = make_inputs(None, H, P, R, Dk, seed=P)
        if mode == "prefix-requires-grad":
            inputs = {k: v.detach().requires_grad_() for k, v in inputs.items()}
        acc = dict(dpage_acc=torch.zeros(P, Dk)) if mode == "exact" else {}
        return saved_bytes(lambda: fn(**inputs, dv=Dv, scale=0.25, **acc)[0].sum().backward())

    def reference(dv, **kw):
        return latent_prefix_attention_reference(**kw, latent_dim=dv, return_lse=True)

    small, large = saved(reference, 64), saved(reference, 4096)
    assert small == large, (small, large)
    assert large <= 4 * H * R * Dk * 4  # q, own, out, lse: a few [H, R, D] tensors
    assert max(largest) <= 1024
    if mode != "exact":  # the check does see P-sized saves: the naive formula's grow with P
        assert saved(naive_latent, 4096) > saved(naive_latent, 64) + H * R * 4000 * 4


def test_reference_detached_mode_skips_prefix_gradient(monkeypatch):
    """Constant pages and no buffer: the backward computes no prefix gradient (it reads the prefix for dQ only)."""
    calls = []
    real = la_ref._add_prefix_grad
    monkeypatch.setattr(la_ref, "_add_prefix_grad", lambda *a: calls.append(1) or real(*a))
    small_key_blocks(monkeypatch, keys=8)
    inputs = make_inputs(None, 4, 37, 13, 24)
    latent_prefix_attention_reference(**inputs, latent_dim=16, scale=0.25).sum().backward()
    assert not calls
    out = latent_prefix_attention_reference(**inputs, latent_dim=16, scale=0.25, dpage_acc=torch.zeros(37, 24))
    out.sum().backward()
    assert len(calls) == 5  # cdiv(37, 8) prefix blocks


def strided_views(t, P, layer=1):
    """The adapter's layouts: q out of a [T, H * D_k] projection as view(T, H, D_k).transpose(0, 1), own pages a
    column slice of a wider tensor, the prefix pages and the buffer `[layer, :P]` slices of [L, S, D_k] tensors."""
    T, Dk = t["own_wide"].shape[0], t["state"].shape[-1]
    q = t["q_proj"].view(T, -1, Dk).transpose(0, 1)
    return dict(q=q, pages=t["state"][layer, :P], own_pages=t["own_wide"][:, 3 : 3 + Dk]), t["grad"][layer, :P]


@pytest.mark.parametrize("force", ["reference", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("P", [37, 0], ids=["p37", "empty-prefix"])
def test_interp_and_reference_strided_views(force, P):
    """Strided views on both paths against naive_latent on contiguous copies; only the buffer's slice changes."""
    H, T, Dk, Dv = 4, 13, 40, 32
    g = torch.Generator().manual_seed(0)
    leaves = dict(
        q_proj=torch.randn(T, H * Dk, generator=g),
        own_wide=torch.randn(T, Dk + 5, generator=g),
        state=torch.randn(3, P + 5, Dk, generator=g),
        grad=torch.randn(3, P + 5, Dk, generator=g),
    )
    t = {k: v.clone().requires_grad_(k in ("q_proj", "own_wide")) for k, v in leaves.items()}
    ins, buffer = strided_views(t, P)
    out, lse = latent_prefix_attention(
        **ins, latent_dim=Dv, scale=SCALE, dpage_acc=buffer, return_lse=True, force=force
    )
    backward_of(out, lse)
    got = {"out": out, "lse": lse, "dq": t["q_proj"].grad, "d_own": t["own_wide"].grad, "buffer": t["grad"]}
    n = {k: v.clone().requires_grad_(k in ("q_proj", "own_wide")) for k, v in leaves.items()}
    n_ins, _ = strided_views(n, P)
    n_ins = {k: v.detach().contiguous().requires_grad_() for k, v in n_ins.items()}
    n_out, n_lse = naive_latent(**n_ins, dv=Dv, scale=SCALE)
    backward_of(n_out, n_lse)
    d_q_proj = n_ins["q"].grad.transpose(0, 1).reshape(T, H * Dk)
    d_own = torch.zeros(T, Dk + 5)
    d_own[:, 3 : 3 + Dk] = n_ins["own_pages"].grad
    buffer = leaves["grad"].clone()
    buffer[1, :P] += n_ins["pages"].grad
    expected = {"out": n_out, "lse": n_lse, "dq": d_q_proj, "d_own": d_own, "buffer": buffer}
    assert_three_way(got, expected, expected, 1e-4, 1e-4)


def test_rejects_bad_shapes_and_force():
    inputs = make_inputs(None, 4, 5, 3, 8)
    with pytest.raises(ValueError, match="latent_dim"):
        latent_prefix_attention(**inputs, latent_dim=9, scale=0.3)
    with pytest.raises(ValueError, match="pages"):
        latent_prefix_attention(inputs["q"], inputs["pages"][None], inputs["own_pages"], 4, 0.3)
    with pytest.raises(ValueError, match="force"):
        latent_prefix_attention(**inputs, latent_dim=4, scale=0.3, force="cuda")
    with pytest.raises(ValueError, match="fp32"):
        latent_prefix_attention(**inputs, latent_dim=4, scale=0.3, dpage_acc=torch.zeros(5, 8, dtype=torch.float64))
    if not INTERPRETED:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            latent_prefix_attention(**inputs, latent_dim=4, scale=0.3, force="triton")


# --------------------------------------------------------------------------------------------------------------------
# Triton under the interpreter (subprocess)
# --------------------------------------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("B,H,P,R,Dk,Dv", SHAPES, ids=SHAPE_IDS)
def test_interp_matches_reference(B, H, P, R, Dk, Dv):
    """Exact mode (the buffer ADDED into existing contents) and detached mode, fp32 at 1e-4."""
    inputs = make_inputs(B, H, P, R, Dk)
    init = torch.randn(P, Dk, generator=torch.Generator().manual_seed(7))
    kernel = run(inputs, Dv, force="triton", exact=True, acc_init=init)
    ref = run(inputs, Dv, force="reference", exact=True, acc_init=init)
    assert_three_way(kernel, ref, ref, 1e-4, 1e-4)  # fp32: the same-dtype reference is the fp32 one
    detached = run(inputs, Dv, force="triton", exact=False)
    for name in detached:
        torch.testing.assert_close(detached[name], kernel[name], atol=0, rtol=0)


@needs_interpreter
@pytest.mark.parametrize("block_m,block_n,block_do", [(32, 16, 32), (16, 32, 16)])
def test_interp_unequal_tiles(block_m, block_n, block_do, monkeypatch):
    """The GPU tiles differ in shape from the interpreter's: causal bounds (rows = tokens x heads) and the column
    chunks must hold when BLOCK_M != BLOCK_N and BLOCK_DO != BLOCK_DK."""
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DK=16, BLOCK_DO=block_do, num_warps=4, num_stages=1)
    monkeypatch.setattr(la, "_blocks", lambda device, dpage=False: tiles)
    inputs = make_inputs(2, 3, 37, 19, 40)
    kernel = run(inputs, 32, force="triton", exact=True)
    ref = run(inputs, 32, force="reference", exact=True)
    assert_three_way(kernel, ref, ref, 1e-4, 1e-4)


@needs_interpreter
def test_interp_detached_mode_skips_prefix_gradient_and_pages_requiring_grad(monkeypatch):
    """Without a buffer the prefix page-gradient kernel is not launched; pages that require grad get their gradient
    through autograd (summed over the batch rows), as on the reference."""
    launches = []
    real = la._latent_bwd_dpage_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(la, "_latent_bwd_dpage_kernel", Counting())
    inputs = make_inputs(2, 4, 19, 5, 24)
    latent_prefix_attention(**inputs, latent_dim=16, scale=SCALE, force="triton").sum().backward()
    assert len(launches) == 1  # own pages only
    grads = {}
    for force in ("triton", "reference"):
        ins = {k: v.detach().requires_grad_() for k, v in inputs.items()}
        latent_prefix_attention(**ins, latent_dim=16, scale=SCALE, force=force).square().sum().backward()
        grads[force] = {k: v.grad for k, v in ins.items()}
    assert len(launches) == 3  # own + prefix
    for name in grads["triton"]:
        torch.testing.assert_close(grads["triton"][name], grads["reference"][name], atol=1e-4, rtol=1e-4)


def test_triton_kernels_under_interpreter():
    """Runs the interp_ tests above in a subprocess with TRITON_INTERPRET=1."""
    if INTERPRETED:
        pytest.skip("already under the interpreter: the interp_ tests run directly")
    run_interp_tests_in_subprocess(__file__, min_passed=len(SHAPES) + 5)


# --------------------------------------------------------------------------------------------------------------------
# Compiled kernels
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(INTERPRETED, reason="under the interpreter the kernels are not compiled")
def test_kernels_compile_for_hopper():
    """Every kernel variant the launchers use, in bf16 with the GPU tiles, to an sm_90 cubin (no GPU needed)."""
    cfg, dpage_cfg = la._blocks(torch.device("cuda")), la._blocks(torch.device("cuda"), dpage=True)
    bf16 = lambda *names: dict.fromkeys(names, "*bf16")
    fp32 = lambda *names: dict.fromkeys(names, "*fp32")
    scales = ("scale", "qk_scale_log2")
    compile_for_hopper(
        la_triton._latent_fwd_kernel, cfg, bf16("Q", "PG", "OWN", "OUT") | fp32("LSE"), scales, PRECISION="tf32"
    )
    ptrs = bf16("Q", "PG", "OWN", "DO", "DQ") | fp32("LSE", "DELTA")
    compile_for_hopper(la_triton._latent_bwd_dq_kernel, cfg, ptrs, scales, PRECISION="tf32")
    tiles = {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_DK": cfg["BLOCK_DK"]}
    compile_for_hopper(
        la_triton._latent_bwd_delta_kernel, tiles, bf16("OUT", "DO") | fp32("DLSE", "DELTA"), HAS_DLSE=True
    )
    for causal in (True, False):  # own pages (bf16, written) and the prefix (fp32 buffer, added into)
        ptrs = bf16("Q", "K", "DO") | fp32("LSE", "DELTA") | (bf16 if causal else fp32)("DK_OUT")
        kernel = la_triton._latent_bwd_dpage_kernel
        compile_for_hopper(kernel, dpage_cfg, ptrs, scales, CAUSAL=causal, ACCUMULATE=not causal, PRECISION="tf32")


# bf16 on the GPU at DeepSeek-V3's widths (D_k = 576, D_v = 512) with 16 heads. bf16 has an 8-bit mantissa (relative
# step 3.9e-3); the output averages values over up to P + R pages, and the gradients sum over R * H rows (the prefix
# buffer also over the batch), each a few bf16 roundings: P and dS are rounded to bf16 before the kernel's tl.dot
# calls where the reference keeps them in fp32, hence 5e-2 on gradients, as for prefix_attention.
# Not yet run: no GPU was available when these were written.
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "dtype,atol,rtol", [(torch.bfloat16, 2e-2, 2e-2), (torch.float32, 1e-4, 1e-4)], ids=["bf16", "fp32"]
)
@pytest.mark.parametrize("B,H,P,R", [(None, 16, 1000, 130), (2, 128, 300, 3)], ids=["h16-r130", "h128-r3"])
def test_gpu_matches_fp32_reference(B, H, P, R, dtype, atol, rtol):
    inputs = make_inputs(B, H, P, R, 576, dtype=dtype, device="cuda")
    init = torch.randn(P, 576)
    kernel = run(inputs, 512, force="triton", exact=True, acc_init=init)
    ref_same = run(inputs, 512, force="reference", exact=True, acc_init=init)
    ref_fp32 = run(inputs, 512, force="reference", exact=True, acc_init=init, cast=torch.float32)
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
