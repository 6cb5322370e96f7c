"""How a step's data crosses Ray: tensors travel as numpy arrays.

Ray pickles a torch tensor through torch's own storage reduction, which runs a `torch.save` into an in-memory zip
file per storage: tens of microseconds per tensor each way, whatever its size. A step's rollout holds a few small
tensors per response (tokens, logprobs, routes), so on the smoke recipe that overhead, not the bytes, was most of the
time the driver spent collecting a step's samples (about 14 ms of it; bench/wire.py and docs/benchmarks.md).
A numpy array pickles as a header and one buffer (out of band under protocol 5, as Ray uses it).

Dataclasses that cross Ray inherit `TensorsAsArrays`: when pickled, their CPU tensor fields (alone or in a list)
travel as numpy arrays and come back as tensors; other fields pickle as usual.
"""

from __future__ import annotations

import torch

# dtypes numpy holds exactly (bfloat16 and friends are left to torch's own pickling)
_NUMPY_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
     torch.float64}
)  # fmt: skip


class _Array:
    """A tensor in transit: its numpy array (a marker, so a field that really holds an array stays one)."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __reduce__(self):
        return _Array, (self.array,)


def _pack(value):
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.dtype in _NUMPY_DTYPES and not value.requires_grad:
            return _Array(value.resolve_conj().resolve_neg().numpy())
        return value
    if isinstance(value, list) and any(isinstance(v, torch.Tensor) for v in value):
        return [_pack(v) for v in value]
    return value


def _unpack(value):
    if isinstance(value, _Array):
        array = value.array
        # Ray hands back arrays that are read-only views of its object store; a tensor must own writable memory
        return torch.from_numpy(array if array.flags.writeable else array.copy())
    if isinstance(value, list):
        return [_unpack(v) for v in value]
    return value


class TensorsAsArrays:
    """Pickle support for a (possibly frozen) dataclass whose fields hold CPU tensors or lists of them."""

    def __getstate__(self) -> dict:
        return {name: _pack(value) for name, value in vars(self).items()}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, _unpack(value))
