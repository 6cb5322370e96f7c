"""Which implementation of a kernel runs: the few rules every kernel in this package shares."""

from __future__ import annotations

import torch
from triton.runtime.jit import JITFunction


def use_triton(t: torch.Tensor, force: str | None) -> bool:
    """CUDA tensors run Triton, CPU tensors the torch reference; force="triton" | "reference" overrides."""
    if force is None:
        return t.is_cuda
    if force not in ("triton", "reference"):
        raise ValueError(f"force must be None, 'triton' or 'reference', got {force!r}")
    return force == "triton"


def check_launchable(kernel, device: torch.device) -> None:
    """A compiled Triton kernel cannot launch on CPU tensors; under TRITON_INTERPRET=1 kernels are not JITFunctions."""
    if device.type == "cpu" and isinstance(kernel, JITFunction):
        raise RuntimeError(
            "the Triton path on CPU tensors runs only under the Triton interpreter: set TRITON_INTERPRET=1 before "
            "triton is first imported, or use force='reference'"
        )
