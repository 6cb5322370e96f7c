"""Measured memory: the peak above a baseline (process RSS on CPU, the caching allocator on CUDA) and the bytes a
forward saves for backward (saved-tensor hooks over unique storages). Nothing here estimates.
"""

from __future__ import annotations

import resource

import torch

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int:
    with open(_STATUS) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in {_STATUS}")


class PeakMeter:
    """Peak memory above the level at `start()`.

    CPU: VmHWM (peak RSS) after resetting it through /proc/self/clear_refs ("5", Linux >= 4.0), minus VmRSS at
    start. RSS counts what the allocator holds from the OS, so freed-but-cached heap pages count as used; the
    benchmark runs each configuration in a fresh process for that reason. Where the reset is not allowed the
    process-lifetime peak (ru_maxrss) is used and `resettable` is False.
    CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus memory_allocated at start.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.baseline = 0
        self.resettable = True

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            return
        try:
            with open(_CLEAR_REFS, "w") as f:
                f.write("5")
        except OSError:
            self.resettable = False
        self.baseline = _status_kib("VmRSS") * 1024

    def peak(self) -> int:
        """Bytes of the peak since start() above the baseline."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        if self.resettable:
            return _status_kib("VmHWM") * 1024 - self.baseline
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.baseline


class GraphMeter:
    """Bytes saved for backward by the forwards run inside `with`, over unique storages.

    Storages listed in `exclude` (weights, the prefix state, the dKV buffer: memory that is live anyway) are not
    counted. A storage is counted whole even when only a view of it is saved, because the whole storage stays alive.
    The pack hook returns the tensor itself, so metering adds no memory.
    """

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.exclude:
            self._seen[key] = storage.nbytes()
        return t

    @property
    def nbytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> GraphMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def module_storages(model: torch.nn.Module) -> set[int]:
    """data_ptr of the storages of every parameter and buffer of `model`."""
    tensors = [*model.parameters(), *model.buffers()]
    return {t.untyped_storage().data_ptr() for t in tensors}
