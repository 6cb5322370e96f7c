"""fp8_block_matmul: the Triton FP8 dequant-GEMM against its plain-torch reference, forward and dX forms.

The Triton kernel runs on CPU under the Triton interpreter, in a subprocess with TRITON_INTERPRET=1
(test_triton_kernel_under_interpreter; see tests/test_kernel_expert_lora.py for why). Run the interp_ tests directly
with: TRITON_INTERPRET=1 pytest tests/test_kernel_fp8_matmul.py -k interp_
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from conftest import compile_for_hopper, run_interp_tests_in_subprocess

from mint_kernels import fp8_block_matmul, fp8_block_matmul_reference

fm = importlib.import_module("mint_kernels.fp8_matmul")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in test_triton_kernel_under_interpreter's TRITON_INTERPRET=1 subprocess"
)


def weight(rows: int, cols: int, block: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 bytes and block scales as mint.models.quant writes them, with subnormal and negative values among them."""
    from mint.models.quant import quantize_fp8

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w[::3, ::5] *= 1e-5  # far below their block's largest value: e4m3 subnormals (and zeros)
    return quantize_fp8(w, block)


@needs_interpreter
@pytest.mark.parametrize("transpose", [True, False], ids=["forward", "dx"])
@pytest.mark.parametrize(
    "rows,cols,block", [(40, 48, (16, 16)), (33, 20, (16, 8)), (24, 40, (128, 128))], ids=["whole", "cut", "big"]
)
def test_interp_matches_reference_fp32(rows, cols, block, transpose):
    q, s = weight(rows, cols, block)
    assert (q.view(torch.uint8) & 0x78 == 0).any() and (q.float() < 0).any()  # subnormals and negatives are in
    x = torch.randn(2, 9, cols if transpose else rows, generator=torch.Generator().manual_seed(1))
    got = fp8_block_matmul(x, q, s, block, transpose=transpose, force="triton")
    want = fp8_block_matmul_reference(x, q, s, block, transpose)
    assert got.shape == want.shape == (2, 9, rows if transpose else cols)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_interpreter
def test_interp_half_activations_round_the_weight_as_the_reference_does():
    # fp16: the interpreter emulates bf16 dots wrongly (numpy has no bf16); the GPU compile test covers bf16.
    q, s = weight(32, 48, (16, 16), seed=2)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    got = fp8_block_matmul(x, q, s, (16, 16), force="triton")
    want = fp8_block_matmul_reference(x.float(), q, s, (16, 16))
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@needs_interpreter
def test_interp_transposed_and_empty_activations():
    q, s = weight(24, 32, (8, 16), seed=4)
    x = torch.randn(32, 7, generator=torch.Generator().manual_seed(5)).T  # a non-contiguous view
    torch.testing.assert_close(fp8_block_matmul(x, q, s, (8, 16), force="triton"),
                               fp8_block_matmul_reference(x, q, s, (8, 16)), atol=1e-5, rtol=1e-5)  # fmt: skip
    assert fp8_block_matmul(x[:0], q, s, (8, 16), force="triton").shape == (0, 24)


def test_triton_kernel_under_interpreter():
    """Runs the interp_ tests above in a subprocess with TRITON_INTERPRET=1."""
    if INTERPRETED:
        pytest.skip("already under the interpreter: the interp_ tests run directly")
    run_interp_tests_in_subprocess(__file__, min_passed=6 + 1 + 1)


@pytest.mark.skipif(INTERPRETED, reason="under the interpreter the kernels are not compiled")
def test_kernel_compiles_for_hopper():
    cfg = fm._blocks(torch.device("cuda"))
    for xt, fp32 in (("*bf16", False), ("*fp32", True)):
        ptrs = {"X": xt, "Q": "*u8", "S": "*fp32", "Y": "*fp32"}
        for transpose in (True, False):
            compile_for_hopper(fm._fp8_block_matmul_kernel, cfg, ptrs, BO=128, BK=128, TRANSPOSE=transpose,
                               FP32_DOT=fp32, PRECISION="ieee")  # fmt: skip


def test_reference_is_the_dequantizing_matmul_of_mint_models_quant():
    """The CPU path is the computation Fp8Linear always ran: W dequantized in x's dtype, then the matmul."""
    from mint.models.quant import dequantize_fp8

    q, s = weight(40, 48, (16, 16))
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(6))
    w = dequantize_fp8(q, s, (16, 16), torch.float32)
    assert torch.equal(fp8_block_matmul(x, q, s, (16, 16)), torch.nn.functional.linear(x, w))
    dy = torch.randn(3, 40, generator=torch.Generator().manual_seed(7))
    assert torch.equal(fp8_block_matmul(dy, q, s, (16, 16), transpose=False), dy @ w)


def test_rejects_a_scale_grid_or_width_that_does_not_fit():
    q, s = weight(40, 48, (16, 16))
    with pytest.raises(ValueError, match="needs a"):
        fp8_block_matmul(torch.zeros(2, 48), q, s[:, :1], (16, 16))
    with pytest.raises(ValueError, match="does not meet"):
        fp8_block_matmul(torch.zeros(2, 40), q, s, (16, 16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_matches_reference_at_real_block_size():
    q, s = weight(1536, 2048, (128, 128))
    x = torch.randn(300, 2048, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    q, s, x = q.cuda(), s.cuda(), x.cuda()
    want = fp8_block_matmul_reference(x.float(), q, s, (128, 128))
    torch.testing.assert_close(fp8_block_matmul(x, q, s, (128, 128)).float(), want, atol=5e-2, rtol=2e-2)
