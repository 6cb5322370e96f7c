"""expert_lora: Triton kernels vs the plain-torch reference, outputs and every gradient.

The Triton kernels run on CPU under the Triton interpreter. TRITON_INTERPRET must be set before triton is first
imported, and other test modules in the same pytest process import it first (and a GPU run must not interpret), so
test_triton_kernels_under_interpreter re-runs this file's `interp_` tests in a subprocess with TRITON_INTERPRET=1.
Run them directly with: TRITON_INTERPRET=1 pytest tests/test_kernel_expert_lora.py -k interp_
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch
from conftest import assert_three_way, compile_for_hopper, run_interp_tests_in_subprocess, saved_bytes

from mint_kernels import expert_lora, expert_lora_reference

# The package re-exports the function under the module's name, so fetch the modules themselves.
el = importlib.import_module("mint_kernels.expert_lora")
el_triton = importlib.import_module("mint_kernels._expert_lora_triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in test_triton_kernels_under_interpreter's TRITON_INTERPRET=1 subprocess"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SCALING = 2.0  # lora_alpha / r = 16 / 8
# E = 4: a 19-row expert (two 16-row interpreter tiles, one partial), an empty one, a single-token one, and a 33-row
# one (three tiles).
COUNTS = (19, 0, 1, 33)


def offsets_of(counts, device="cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64, device=device)


def make_case(counts, r, H, n_out, *, layout, dtype=torch.float32, device="cpu", seed=0):
    """Leaves and a function that builds the (x, A, B) views expert_lora receives from them.

    layout "peft": x = x_src[:, 1:N+1].T (transposed, offset: non-contiguous), A = lora_A.view(E, r, H) and
    B = lora_B.view(O, r, E).permute(2, 0, 1) (strides (1, r E, E)), PEFT's target_parameters weights.
    layout "plain": contiguous x [N, H], A [E, r, H], B [E, O, r]. A ~ 1/sqrt(H) and B ~ 1/sqrt(r) keep y ~ O(1).
    """
    E, N = len(counts), sum(counts)
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, std=1.0: (torch.randn(*shape, generator=g) * std).to(device=device, dtype=dtype)
    if layout == "peft":
        leaves = dict(x=rnd(H, N + 3), A=rnd(E * r, H, std=H**-0.5), B=rnd(n_out, r * E, std=r**-0.5))
        views = lambda t: (t["x"][:, 1 : N + 1].T, t["A"].view(E, r, H), t["B"].view(n_out, r, E).permute(2, 0, 1))
    else:
        leaves = dict(x=rnd(N, H), A=rnd(E, r, H, std=H**-0.5), B=rnd(E, n_out, r, std=r**-0.5))
        views = lambda t: (t["x"], t["A"], t["B"])
    return leaves, views, offsets_of(counts, device)


def run(case, fn, *, cast=None, need=("x", "A", "B"), grad=None, seed=1):
    """fn(x, A, B, offsets, SCALING) forward and backward of sum(y * dY) on fresh copies of the leaves.

    cast: dtype to cast the leaves to first (the fp32 reference of a half run). need: leaves that require grad.
    grad: "sum" backpropagates y.sum() instead (a stride-0 dY). Returns y and the leaves' gradients.
    """
    leaves, views, offsets = case
    t = {k: v.detach().to(cast or v.dtype).requires_grad_(k in need) for k, v in leaves.items()}
    y = fn(*views(t), offsets, SCALING)
    if grad == "sum":
        y.sum().backward()
    else:
        # dY is rounded to the leaves' dtype first, so a half run and its fp32 reference see the same values.
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(leaves["x"]).to(y)
        (y.float() * dy.float()).sum().backward()
    return {"y": y, **{f"d{k}": t[k].grad for k in need}}


triton_fn = lambda *a: expert_lora(*a, force="triton")
reference_fn = lambda *a: expert_lora(*a, force="reference")


@needs_interpreter
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1e-4)])
@pytest.mark.parametrize("layout", ["plain", "peft"])
@pytest.mark.parametrize("r", [8, 5], ids=["r8", "r5-not-pow2"])
def test_interp_matches_reference(r, layout, dtype, atol, rtol):
    """H = 48 (three 16-wide K tiles), O = 40 (a partial output tile), one empty and one single-token expert."""
    case = make_case(COUNTS, r, 48, 40, layout=layout, dtype=dtype)
    kernel = run(case, triton_fn)
    assert_three_way(kernel, run(case, reference_fn), run(case, reference_fn, cast=torch.float32), atol, rtol)
    _, dA_E_R_H, dB_E_O_R = case[1]({"x": kernel["dx"], "A": kernel["dA"], "B": kernel["dB"]})
    assert dA_E_R_H[1].abs().max() == 0 and dB_E_O_R[1].abs().max() == 0  # the empty expert's gradient is zero


@needs_interpreter
@pytest.mark.parametrize("need", [("A", "B"), ("x", "B"), ("x",), ("A",)], ids=["frozen-x", "frozen-A", "x", "A"])
def test_interp_partial_gradients(need):
    """Only the gradients asked for: a constant x runs the chain kernel for g alone, no dX; a frozen A skips g."""
    case = make_case(COUNTS, 5, 48, 40, layout="peft")
    kernel, ref = run(case, triton_fn, need=need), run(case, reference_fn, need=need)
    assert kernel.keys() == ref.keys() == {"y", *(f"d{k}" for k in need)}
    assert_three_way(kernel, ref, ref, 1e-4, 1e-4)  # fp32: the same-dtype reference is the fp32 one


@needs_interpreter
@pytest.mark.parametrize("counts", [(0, 0, 40), (1,) * 5, (0, 17, 0)], ids=["leading-empty", "all-single", "one"])
def test_interp_segment_edges_and_stride0_grad(counts):
    """Empty leading experts, one token per expert, a single busy expert; dY from y.sum() has strides (0, 0)."""
    case = make_case(counts, 8, 48, 40, layout="plain")
    kernel, ref = run(case, triton_fn, grad="sum"), run(case, reference_fn, grad="sum")
    assert_three_way(kernel, ref, ref, 1e-4, 1e-4)


# fp16 under the interpreter (its tl.dot on bf16 operands returns garbage in Triton 3.9, so bf16 is left to the GPU
# tests). fp16's relative step is 4.9e-4; the kernels round the [N, r] intermediates (mid, g) to fp16 before their
# second dot where the reference keeps fp32. dA/dB sum up to 33 row products of size ~1 at s = 2, so their absolute
# error reaches sqrt(33) * 2 * 4.9e-4 = 1.1e-2 (1.3e-2 measured): 2e-2.
@needs_interpreter
@pytest.mark.parametrize("lora_dtype", [torch.float16, torch.float32], ids=["fp16", "fp16-x-fp32-lora"])
def test_interp_half_and_mixed_dtypes(lora_dtype):
    """fp16 throughout (fp16 dots), and fp16 x with fp32 LoRA weights (tiles upcast, fp32 dots); grads keep dtypes."""
    leaves, views, offsets = make_case(COUNTS, 8, 48, 40, layout="plain", dtype=torch.float16)
    case = (leaves | {"A": leaves["A"].to(lora_dtype), "B": leaves["B"].to(lora_dtype)}, views, offsets)
    kernel = run(case, triton_fn)
    assert_three_way(kernel, run(case, reference_fn), run(case, reference_fn, cast=torch.float32), 2e-2, 2e-2)
    assert kernel["y"].dtype == kernel["dx"].dtype == torch.float16 and kernel["dA"].dtype == lora_dtype


@needs_interpreter
def test_interp_no_grad_and_empty_input():
    """Without autograd the forward stores no intermediate and matches; N = 0 returns [0, O] and backward is a no-op."""
    leaves, views, offsets = make_case(COUNTS, 8, 48, 40, layout="peft")
    with torch.no_grad():
        y = expert_lora(*views(leaves), offsets, SCALING, force="triton")
    torch.testing.assert_close(y, expert_lora_reference(*views(leaves), offsets, SCALING), atol=1e-4, rtol=1e-4)
    x = torch.randn(0, 48, requires_grad=True)
    A, B = torch.randn(3, 8, 48, requires_grad=True), torch.randn(3, 40, 8, requires_grad=True)
    y = expert_lora(x, A, B, torch.zeros(4, dtype=torch.int64), SCALING, force="triton")
    assert y.shape == (0, 40)
    y.sum().backward()
    assert A.grad is None or A.grad.abs().max() == 0


@pytest.mark.skipif(INTERPRETED, reason="under the interpreter the kernels are not compiled")
def test_kernels_compile_for_hopper():
    """Every (STORE_MID, COMPUTE_Y) and dot mode the launchers use, with the GPU tiles at r = 32; r = 16 and 128 too."""
    cuda = torch.device("cuda")
    half = dict(FP32_DOT=False, PRECISION="tf32")  # PRECISION is unused on half operands
    ieee, tf32 = dict(FP32_DOT=True, PRECISION="ieee"), dict(FP32_DOT=True, PRECISION="tf32")
    modes = {  # x/dY dtype, A/B dtype, the chain's dot mode, the wgrad's (_dot_mode of x or dY alone)
        "bf16": ("*bf16", "*bf16", half, half),
        "fp16": ("*fp16", "*fp16", half, half),
        "fp32": ("*fp32", "*fp32", ieee, ieee),
        "bf16-x-fp32-lora": ("*bf16", "*fp32", tf32, half),
    }
    tiles = dict.fromkeys(("TILE_E", "TILE_LO", "TILE_HI"), "*i64") | {"MID": "*fp32"}
    chain, wgrad = el_triton._expert_lora_chain_kernel, el_triton._expert_lora_wgrad_kernel
    for name, (xt, wt, dot, wdot) in modes.items():
        ptrs = {"X": xt, "Y": xt, "W1": wt, "W2": wt} | tiles
        flags = [(True, True), (False, True), (True, False)] if name == "bf16" else [(True, True)]
        for store_mid, compute_y in flags:
            cfg = el._chain_blocks(32, cuda)
            compile_for_hopper(chain, cfg, ptrs, ("scale",), STORE_MID=store_mid, COMPUTE_Y=compute_y, **dot)
        wptrs = {"P": xt, "Q": "*fp32", "OUT": wt, "OFFSETS": "*i64"}
        compile_for_hopper(wgrad, el._wgrad_blocks(32, cuda), wptrs, ("scale",), **wdot)
    for r in (16, 128):
        ptrs = {"X": "*bf16", "Y": "*bf16", "W1": "*bf16", "W2": "*bf16"} | tiles
        compile_for_hopper(chain, el._chain_blocks(r, cuda), ptrs, ("scale",), STORE_MID=True, COMPUTE_Y=True, **half)
        wptrs = {"P": "*bf16", "Q": "*fp32", "OUT": "*bf16", "OFFSETS": "*i64"}
        compile_for_hopper(wgrad, el._wgrad_blocks(r, cuda), wptrs, ("scale",), **half)


def test_triton_kernels_under_interpreter():
    """Runs the interp_ tests above in a subprocess with TRITON_INTERPRET=1 (see the module docstring)."""
    if INTERPRETED:
        pytest.skip("already under the interpreter: the interp_ tests run directly")
    run_interp_tests_in_subprocess(__file__, min_passed=4 + 4 + 3 + 2 + 1)


def naive_peft(x_N_H, A_E_R_H, B_E_O_R, offsets_E1, scaling, lora_A=None, lora_B=None):
    """The formula through PEFT's delta weight: einsum("o r e, e r i -> e o i") of lora_B.view(O, r, E) and
    lora_A.view(E, r, H), then W_e x per routed token. Materializes [E, O, H] (what expert_lora avoids)."""
    (E, R, H), n_out = A_E_R_H.shape, B_E_O_R.shape[1]
    delta_E_O_H = torch.einsum("o r e, e r i -> e o i", lora_B.view(n_out, R, E), lora_A.view(E, R, H)) * scaling
    expert_N = torch.repeat_interleave(torch.arange(E), offsets_E1.diff())
    return (delta_E_O_H[expert_N] @ x_N_H.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("counts", [COUNTS, (0, 0, 40), (1,) * 5], ids=["mixed", "leading-empty", "all-single"])
@pytest.mark.parametrize("r", [8, 5])
def test_reference_matches_peft_delta_formula_float64(counts, r):
    """Reference vs the materialized PEFT delta weight in float64: output and the gradients of x, lora_A, lora_B."""
    case = make_case(counts, r, 48, 40, layout="peft", dtype=torch.float64)
    naive = lambda x, A, B, offs, s: naive_peft(x, A, B, offs, s, lora_A=A._base, lora_B=B._base)
    assert_three_way(run(case, expert_lora_reference), run(case, naive), run(case, naive), 1e-10, 1e-10)


def test_reference_gradcheck_float64():
    leaves, views, offsets = make_case((3, 0, 1, 4), 3, 6, 5, layout="peft", dtype=torch.float64)
    ins = [v.detach().requires_grad_() for v in leaves.values()]
    fn = lambda x, A, B: expert_lora_reference(*views({"x": x, "A": A, "B": B}), offsets, SCALING)
    assert torch.autograd.gradcheck(fn, ins)


@pytest.mark.parametrize("E,n_out,H", [(4, 40, 48), (16, 160, 192), (64, 320, 384)])
def test_reference_saves_nothing_delta_sized(E, n_out, H):
    """Beyond x, A and B (the caller's tensors, held anyway), the reference saves the [N, r] intermediate only: the
    same N r fp32 as E O H grows 500-fold. The naive formula saves per-token [O, H] weights (the check sees them)."""
    N, r = 80, 8
    counts = [N - E + 2, 0, *([1] * (E - 3)), 1]
    leaves, views, offsets = make_case(counts, r, H, n_out, layout="peft")
    t = {k: v.requires_grad_() for k, v in leaves.items()}
    ins = views(t)
    inputs = sum(v.numel() * v.element_size() for v in ins)
    saved = saved_bytes(lambda: expert_lora_reference(*ins, offsets, SCALING).sum().backward())
    assert saved - inputs == N * r * 4, (saved, inputs)
    naive = saved_bytes(lambda: naive_peft(*ins, offsets, SCALING, lora_A=t["A"], lora_B=t["B"]).sum().backward())
    assert naive >= N * n_out * H * 4


def test_reference_half_inputs_accumulate_in_fp32():
    """bf16 in, bf16 out, computed in fp32: the bf16 reference equals the fp32 one on the same values, then rounded."""
    case = make_case(COUNTS, 8, 48, 40, layout="peft", dtype=torch.bfloat16)
    half, full = run(case, reference_fn), run(case, reference_fn, cast=torch.float32)
    for name in half:
        assert half[name].dtype == torch.bfloat16
        torch.testing.assert_close(half[name], full[name].to(torch.bfloat16), atol=0, rtol=0)


def test_cpu_default_is_the_reference():
    case = make_case(COUNTS, 5, 48, 40, layout="peft")
    default, ref = run(case, expert_lora), run(case, expert_lora_reference)
    for name in default:
        torch.testing.assert_close(default[name], ref[name], atol=0, rtol=0)


@pytest.mark.parametrize("counts", [(19, 0, 1, 33), (0, 0, 0, 5), (64,), (1, 15, 16, 17, 0, 31, 33)])
def test_row_tiles_partition_each_segment(counts):
    """The tile-to-expert map: tiles never cross a segment, cover every row once, and fit the launcher's bound."""
    offsets, block = offsets_of(counts), 16
    tile_e, lo, hi = el.row_tiles(offsets, sum(counts), block)
    assert tile_e.shape[0] == (sum(counts) + len(counts) * (block - 1)) // block
    covered = torch.zeros(sum(counts), dtype=torch.int64)
    for e, a, b in zip(tile_e.tolist(), lo.tolist(), hi.tolist(), strict=True):
        if b > a:
            assert offsets[e] <= a < b <= offsets[e + 1] and b - a <= block
            covered[a:b] += 1
    assert (covered == 1).all()
    assert int((hi > lo).sum()) == sum(math.ceil(c / block) for c in counts)


def test_rejects_bad_inputs():
    leaves, views, offsets = make_case(COUNTS, 8, 48, 40, layout="plain")
    x, A, B = views(leaves)
    bad = {
        "monotonically": torch.tensor([0, 20, 19, 20, 53]),
        "int64": offsets.int(),
        r"\[E \+ 1\]": offsets[:-1],
        "from 0 to N": offsets + 1,
    }
    for match, offs in bad.items():
        for force in (None, "reference"):
            with pytest.raises(ValueError, match=match):
                expert_lora(x, A, B, offs, SCALING, force=force)
    with pytest.raises(ValueError, match="do not match"):
        expert_lora(x, A, B[:, :, :4], offsets, SCALING)
    with pytest.raises(ValueError, match="force"):
        expert_lora(x, A, B, offsets, SCALING, force="cuda")
    with pytest.raises(ValueError, match="fp64"):
        expert_lora(x.double(), A.double(), B.double(), offsets, SCALING, force="triton")
    with pytest.raises(ValueError, match="r <= 128"):
        wide = torch.randn(1, 129, 4), torch.randn(1, 3, 129)
        expert_lora(torch.randn(2, 4), *wide, torch.tensor([0, 2]), SCALING, force="triton")
    if not INTERPRETED:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            expert_lora(x, A, B, offsets, SCALING, force="triton")


# Half precision on the GPU. The kernels round the [N, r] intermediates (mid = X A_e^T, g = dY B_e) to the input dtype
# before their second dot, as PEFT's bf16 LoRA does, where the reference keeps them in fp32; outputs are stored in the
# input dtype. The rounding error of dA/dB is a sum over a segment's rows (~125 here) of terms as large as the typical
# entry, so it scales with the tensor's magnitude, not with each entry (an entry near 0 carries the same absolute
# error): atol is tol * max|ref|. tol: bf16's relative step is 3.9e-3, so 2e-2 is about five roundings; fp16's is
# 4.9e-4, so 5e-3; fp32 runs IEEE dots, 1e-4. Not yet run: no GPU was available when these were written.
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3), (torch.float32, 1e-4)], ids=["bf16", "fp16", "fp32"]
)
@pytest.mark.parametrize("layout", ["plain", "peft"])
def test_gpu_matches_fp32_reference(layout, dtype, tol):
    g = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.rand(16, generator=g), 2000, replacement=True, generator=g).bincount(minlength=16)
    counts[3] = 0  # one empty expert
    case = make_case(counts.tolist(), 32, 512, 384, layout=layout, dtype=dtype, device="cuda")
    kernel = run(case, triton_fn)
    refs = {"same-dtype": run(case, reference_fn), "fp32": run(case, reference_fn, cast=torch.float32)}
    for name in kernel:
        for label, ref in refs.items():
            scale = float(ref[name].float().abs().max())
            torch.testing.assert_close(
                kernel[name].float(),
                ref[name].float(),
                atol=tol * scale,
                rtol=tol,
                msg=lambda m, n=name, lb=label: f"{n} vs {lb}: {m}",
            )


@pytest.mark.gpu
@needs_cuda
def test_gpu_peak_memory_has_no_delta_weight():
    """Qwen3-30B-A3B's gate_up shapes (E=128, H=2048, O=1536, r=32): forward + backward on 4096 routed rows stays far
    below one [E, O, H] bf16 delta (805 MB), which PEFT's materialized path allocates on every forward."""
    E, H, n_out, r, N = 128, 2048, 1536, 32, 4096
    counts = torch.full((E,), N // E)
    case = make_case(counts.tolist(), r, H, n_out, layout="peft", dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run(case, triton_fn)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < E * n_out * H * 2 // 10
