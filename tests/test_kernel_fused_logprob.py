"""fused_logprob: Triton kernel vs plain-torch reference, both outputs and every gradient.

The Triton kernels run on CPU under the Triton interpreter, which must be switched on before triton is first imported;
test_triton_kernels_under_interpreter re-runs this file's `interp_` tests in a subprocess with TRITON_INTERPRET=1
(see tests/test_kernel_prefix_attention.py for why). Run them directly with:
TRITON_INTERPRET=1 pytest tests/test_kernel_fused_logprob.py -k interp_
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from conftest import assert_three_way, compile_for_hopper, run_interp_tests_in_subprocess

from mint_kernels import fused_logprob, fused_logprob_reference

# The package re-exports the function under the module's name, so fetch the module itself for monkeypatching.
fl = importlib.import_module("mint_kernels.fused_logprob")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in test_triton_kernels_under_interpreter's TRITON_INTERPRET=1 subprocess"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


LAYOUTS = ("contiguous", "hidden-cols", "hidden-t+weight-cols")


def make_inputs(T, H, V, *, trainable_head, dtype=torch.float32, device="cpu", layout="contiguous", ignored=(), seed=0):
    """hidden [T, H], weight [V, H], targets [T] (rows in `ignored` set to -100).

    layout: "contiguous"; "hidden-cols": hidden is hidden_wide[:, :H] (row stride 2H, a slice of a wider activation);
    "hidden-t+weight-cols": hidden is a [H, T] tensor transposed (unit row stride) and weight is [V, H + 16][:, :H].
    The views survive detach() and requires_grad_(), so kernel and reference see the same strides.
    """
    g = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        hidden = torch.randn(T, H, generator=g)
    elif layout == "hidden-cols":
        hidden = torch.randn(T, 2 * H, generator=g)[:, :H]
    else:
        hidden = torch.randn(H, T, generator=g).t()
    # Head scale 2/sqrt(H) gives logits of std ~2: a peaked but not one-hot softmax, like a trained LM head's.
    weight = torch.randn(V, H + 16, generator=g)[:, :H] * (2.0 / H**0.5)
    if layout != "hidden-t+weight-cols":
        weight = weight.contiguous()
    targets = torch.randint(0, V, (T,), generator=g)
    targets[list(ignored)] = -100
    hidden, weight = (t.to(device=device, dtype=dtype) for t in (hidden, weight))
    assert layout == "contiguous" or not hidden.is_contiguous()
    return hidden.requires_grad_(), weight.requires_grad_(trainable_head), targets.to(device)


def run(inputs, *, force, temperature, grads_from=("logprob", "entropy"), cast=None, seed=1, **kw):
    """Forward and backward of sum(a * logprob) + sum(b * entropy); returns outputs and the gradients."""
    hidden, weight, targets = (
        t.detach().to(cast or t.dtype).requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs
    )
    logprob, entropy = fused_logprob(hidden, weight, targets, temperature, force=force, **kw)
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(logprob.shape, generator=g).to(logprob)
    b = torch.randn(entropy.shape, generator=g).to(entropy)
    loss = 0
    if "logprob" in grads_from:
        loss = loss + (logprob * a).sum()
    if "entropy" in grads_from:
        loss = loss + (entropy * b).sum()
    loss.backward()
    res = {"logprob": logprob, "entropy": entropy, "d_hidden": hidden.grad}
    if weight.requires_grad:
        res["d_weight"] = weight.grad
    else:
        assert weight.grad is None
    return res


# T=37 (odd, three 16-row tiles), H=48 (not a multiple of the 32-wide H step), V=1000 (not a multiple of the 64-wide
# V tile; three V splits of 384/384/232 columns under the interpreter).
CASES = [
    # trainable_head, temperature, grads_from, layout, backward chunk rows
    (False, 0.7, ("logprob", "entropy"), "hidden-cols", None),
    (True, 1.0, ("logprob", "entropy"), "contiguous", 16),
    (False, 1.3, ("logprob",), "contiguous", 16),
    (False, 1.0, ("entropy",), "contiguous", None),
    (True, 0.9, ("logprob", "entropy"), "hidden-t+weight-cols", 16),
]
CASE_IDS = [
    "frozen-both-hidden-cols",
    "trainable-both-chunked",
    "frozen-logprob-chunked",
    "frozen-entropy",
    "trainable-hidden-t-weight-cols-chunked",
]


@needs_interpreter
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1e-4)])
@pytest.mark.parametrize("trainable,temperature,grads_from,layout,chunk_rows", CASES, ids=CASE_IDS)
def test_interp_matches_reference(
    trainable, temperature, grads_from, layout, chunk_rows, dtype, atol, rtol, monkeypatch
):
    T, H, V = 37, 48, 1000
    if chunk_rows is not None:  # force the backward to walk T in several chunks
        monkeypatch.setattr(fl, "BWD_BUFFER_BYTES", chunk_rows * V * torch.finfo(dtype).bits // 8)
    inputs = make_inputs(T, H, V, trainable_head=trainable, dtype=dtype, layout=layout)
    kw = dict(temperature=temperature, grads_from=grads_from)
    assert_three_way(
        run(inputs, force="triton", **kw),
        run(inputs, force="reference", **kw),
        run(inputs, force="reference", cast=torch.float32, **kw),
        atol,
        rtol,
    )


@needs_interpreter
def test_interp_extreme_logits_stay_finite():
    """Logits of +-60 (temperature 0.25 on std-15 scores): the online max keeps exp() in range, entropy ~0 not nan."""
    hidden, weight, targets = make_inputs(20, 32, 300, trainable_head=False)
    hidden = (hidden.detach() * 15).requires_grad_()
    kernel = run((hidden, weight, targets), force="triton", temperature=0.25)
    ref = run((hidden, weight, targets), force="reference", temperature=0.25)
    for name in kernel:
        assert torch.isfinite(kernel[name]).all(), name
        torch.testing.assert_close(kernel[name], ref[name], atol=1e-4, rtol=1e-4)


# Rows 0, 5-9 (a run of padding, as a batch's tail would be) and 36 (the last, in a partial tile) are ignored.
IGNORED = (0, 5, 6, 7, 8, 9, 36)


def check_ignored_rows(res, ignored, atol=0.0):
    """Ignored rows: logprob 0, entropy 0, zero d_hidden rows."""
    for name in ("logprob", "entropy"):
        torch.testing.assert_close(res[name][list(ignored)], torch.zeros(len(ignored)).to(res[name]), atol=atol, rtol=0)
    zeros = torch.zeros_like(res["d_hidden"][list(ignored)])
    torch.testing.assert_close(res["d_hidden"][list(ignored)], zeros, atol=atol, rtol=0)


@needs_interpreter
@pytest.mark.parametrize("ignore_index", [-100, 3], ids=["minus-100", "inside-vocab"])
def test_interp_ignore_index(ignore_index, monkeypatch):
    """Ignored rows give 0 and no gradient on both paths, to hidden or to weight."""
    T, H, V = 37, 48, 1000
    monkeypatch.setattr(fl, "BWD_BUFFER_BYTES", 16 * V * 4)  # three backward chunks
    hidden, weight, targets = make_inputs(T, H, V, trainable_head=True, ignored=IGNORED)
    targets[list(IGNORED)] = ignore_index
    inputs = (hidden, weight, targets)
    kw = dict(temperature=0.8, ignore_index=ignore_index)
    kernel = run(inputs, force="triton", **kw)
    ref = run(inputs, force="reference", **kw)
    assert_three_way(kernel, ref, run(inputs, force="reference", cast=torch.float32, **kw), 1e-4, 1e-4)
    check_ignored_rows(kernel, IGNORED)
    # Ignored rows' hidden states do not reach d_weight: replacing them changes nothing.
    other = hidden.detach().clone()
    other[list(IGNORED)] = 10 * torch.randn(len(IGNORED), H, generator=torch.Generator().manual_seed(3))
    moved = run((other, weight, targets), force="triton", **kw)
    torch.testing.assert_close(moved["d_weight"], kernel["d_weight"], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(INTERPRETED, reason="under the interpreter the kernels are not compiled")
def test_kernels_compile_for_hopper():
    """Both kernels with the GPU tiles in bf16, every HAS_G_* variant the backward launches."""
    cfg = fl._config(torch.device("cuda"))
    ptrs = dict.fromkeys(["X", "W"], "*bf16") | {"TGT": "*i64"}
    stats = dict.fromkeys(["M_OUT", "S_OUT", "U_OUT", "ZT_OUT"], "*fp32")
    compile_for_hopper(fl._fused_logprob_fwd_kernel, cfg, ptrs | stats, ("inv_temp",), PRECISION="tf32")
    ptrs |= dict.fromkeys(["LSE", "ENT", "G_LP", "G_ENT"], "*fp32") | {"DZ": "*bf16"}
    for has_lp, has_ent in ((True, True), (True, False), (False, True)):
        kw = dict(HAS_G_LP=has_lp, HAS_G_ENT=has_ent, PRECISION="tf32")
        compile_for_hopper(fl._fused_logprob_bwd_dlogits_kernel, cfg, ptrs, ("inv_temp",), **kw)


def test_triton_kernels_under_interpreter():
    """Runs the interp_ tests above in a subprocess with TRITON_INTERPRET=1 (see the module docstring)."""
    if INTERPRETED:
        pytest.skip("already under the interpreter: the interp_ tests run directly")
    run_interp_tests_in_subprocess(__file__, min_passed=len(CASES) + 3)


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_reference_gradcheck_float64(trainable):
    hidden, weight, targets = make_inputs(5, 4, 7, trainable_head=trainable, dtype=torch.float64)
    # chunk_rows=2 walks T in three blocks, each recomputed in the backward: the path that bounds the CPU memory.
    fn = lambda h, w: fused_logprob_reference(h, w, targets, 0.7, chunk_rows=2)
    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_reference_chunking_is_exact():
    inputs = make_inputs(37, 48, 1000, trainable_head=True)
    whole = run(inputs, force="reference", temperature=0.9)
    hidden, weight, targets = (t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
    logprob, entropy = fused_logprob_reference(hidden, weight, targets, 0.9, chunk_rows=10)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(logprob.shape, generator=g)
    b = torch.randn(entropy.shape, generator=g)
    ((logprob * a).sum() + (entropy * b).sum()).backward()
    chunked = {"logprob": logprob, "entropy": entropy, "d_hidden": hidden.grad, "d_weight": weight.grad}
    for name in whole:
        torch.testing.assert_close(chunked[name], whole[name], atol=1e-5, rtol=1e-5)


def naive_logprob_entropy(hidden, weight, targets, temperature, ignore_index=-100):
    """The definition on materialized logits: log softmax at the target, -sum p log p, ignored rows 0."""
    logp = torch.log_softmax((hidden @ weight.T).double() / temperature, dim=-1)
    keep = targets != ignore_index
    logprob = logp.gather(-1, torch.where(keep, targets, 0)[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.where(keep, logprob, 0.0), torch.where(keep, entropy, 0.0)


def test_reference_matches_definition():
    """logprob = log softmax at the target; entropy = -sum p log p; temperature divides the logits."""
    hidden, weight, targets = (t.detach() for t in make_inputs(6, 8, 11, trainable_head=False, dtype=torch.float64))
    logprob, entropy = fused_logprob(hidden, weight, targets, 2.0)  # CPU tensors: the reference
    p = torch.softmax(hidden @ weight.T / 2.0, dim=-1)
    torch.testing.assert_close(logprob, p[torch.arange(6), targets].log())
    torch.testing.assert_close(entropy, -(p * p.log()).sum(-1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_matches_naive_formula(layout):
    """The chunked reference on strided views and ignored rows vs the naive formula, outputs and both gradients."""
    T, H, V = 37, 48, 1000
    inputs = make_inputs(T, H, V, trainable_head=True, layout=layout, ignored=IGNORED)
    ref = run(inputs, force="reference", temperature=0.8)
    hidden, weight, targets = (t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
    logprob, entropy = naive_logprob_entropy(hidden, weight, targets, 0.8)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(logprob.shape, generator=g).double()
    b = torch.randn(entropy.shape, generator=g).double()
    ((logprob * a).sum() + (entropy * b).sum()).backward()
    naive = {"logprob": logprob, "entropy": entropy, "d_hidden": hidden.grad, "d_weight": weight.grad}
    for name in ref:
        torch.testing.assert_close(ref[name].double(), naive[name].double(), atol=1e-5, rtol=1e-5)
    check_ignored_rows(ref, IGNORED)


def test_reference_saves_nothing_vocab_sized(monkeypatch):
    """Besides the caller's hidden and weight, the reference saves O(T) for backward whatever V is (naive: T x V);
    its logit blocks hold LOGIT_BLOCK_ELEMENTS, or one row when a row is larger."""
    fl_ref = importlib.import_module("mint_kernels._fused_logprob_reference")
    monkeypatch.setattr(fl_ref, "LOGIT_BLOCK_ELEMENTS", 128)
    real, largest = fl_ref._block_logits, []

    def recording_block_logits(*args):
        z = real(*args)
        largest.append(z.numel())
        return z

    monkeypatch.setattr(fl_ref, "_block_logits", recording_block_logits)

    def saved(fn, V):
        hidden, weight, targets = make_inputs(8, 16, V, trainable_head=True)
        inputs = {hidden.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()}
        sizes = []

        def pack(t):
            if t.untyped_storage().data_ptr() not in inputs:
                sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logprob, entropy = fn(hidden, weight, targets, 1.0)
        (logprob.sum() + entropy.sum()).backward()
        return sum(sizes)

    small, large = saved(fused_logprob_reference, 64), saved(fused_logprob_reference, 4096)
    assert small == large <= 8 * 3 * 8, (small, large)  # targets (int64), lse and entropy (fp32): [T] each
    assert set(largest) == {128, 4096}  # two rows of V = 64, one row of V = 4096
    assert saved(naive_logprob_entropy, 4096) > 8 * 4096 * 8  # the check sees T x V saves


@pytest.mark.parametrize("force", ["reference", "triton"])
def test_out_of_range_targets_raise(force):
    """Outside [0, V) and not ignore_index: ValueError before anything runs, on both paths."""
    hidden, weight, targets = make_inputs(4, 8, 11, trainable_head=False, ignored=(1,))
    for bad in (11, -1):
        wrong = targets.clone()
        wrong[2] = bad
        with pytest.raises(ValueError, match=rf"targets\[2\] = {bad} is outside \[0, 11\)"):
            fused_logprob(hidden, weight, wrong, force=force)
    with pytest.raises(ValueError, match="is not ignore_index"):  # -100 is an error once another index is chosen
        fused_logprob(hidden, weight, targets, force=force, ignore_index=-1)
    with pytest.raises(ValueError, match="integer"):
        fused_logprob(hidden, weight, targets.float(), force=force)


def test_rejects_bad_inputs():
    hidden, weight, targets = make_inputs(4, 8, 11, trainable_head=False)
    with pytest.raises(ValueError, match="targets"):
        fused_logprob(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="temperature"):
        fused_logprob(hidden, weight, targets, 0.0)
    with pytest.raises(ValueError, match="force"):
        fused_logprob(hidden, weight, targets, force="gpu")
    if not INTERPRETED:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            fused_logprob(hidden, weight, targets, force="triton")


# bf16 on the GPU. The kernel accumulates logits in fp32 from bf16 inputs, like the fp32 reference run on the same
# bf16 values, so logprob/entropy agree to ~1e-3; 2e-2 leaves room for the same-dtype reference, whose logits are
# rounded to bf16 (relative step 3.9e-3 on logits of magnitude ~5). dlogits are stored in bf16 before the dHidden
# matmul, so gradients carry one extra bf16 rounding: 5e-2. Not yet run: no GPU was available when written.
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "dtype,atol,rtol", [(torch.bfloat16, 2e-2, 2e-2), (torch.float32, 1e-4, 1e-4)], ids=["bf16", "fp32"]
)
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_gpu_matches_fp32_reference(trainable, dtype, atol, rtol):
    inputs = make_inputs(777, 512, 32003, trainable_head=trainable, dtype=dtype, device="cuda")
    kernel = run(inputs, force="triton", temperature=0.8)
    ref_same = run(inputs, force="reference", temperature=0.8)
    ref_fp32 = run(inputs, force="reference", temperature=0.8, cast=torch.float32)
    grad_tol = 1e-4 if dtype == torch.float32 else 5e-2
    for name in kernel:
        tol = atol if name in ("logprob", "entropy") else grad_tol
        for ref, label in ((ref_same, "same-dtype"), (ref_fp32, "fp32")):
            torch.testing.assert_close(
                kernel[name].float(),
                ref[name].float(),
                atol=tol,
                rtol=tol,
                msg=lambda m, n=name, r=label: f"{n} vs {r}: {m}",
            )


@pytest.mark.gpu
@needs_cuda
def test_gpu_frozen_head_peak_memory_is_bounded():
    """Peak extra memory is the backward's [C, V] scratch (BWD_BUFFER_BYTES) plus O(T * H), independent of T * V."""
    T, H, V = 16384, 1024, 32003
    hidden, weight, targets = make_inputs(T, H, V, trainable_head=False, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logprob, entropy = fused_logprob(hidden, weight, targets)
    (logprob.sum() + entropy.sum()).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    bound = fl.BWD_BUFFER_BYTES + 2 * T * H * 2 + 4 * 64 * T * 4 + 2**20  # scratch + dHidden + per-split row stats
    logits_bytes = T * V * 2  # 1 GB in bf16
    assert extra <= bound < 0.5 * logits_bytes, f"peak {extra / 2**20:.0f} MB, bound {bound / 2**20:.0f} MB"
