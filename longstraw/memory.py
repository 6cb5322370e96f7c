"""Measured memory: the peak above a baseline (process RSS on CPU, the caching allocator on CUDA) and the bytes a
forward saves for backward (saved-tensor hooks over unique storages). Nothing here estimates.
"""

from __future__ import annotations

import resource

import torch

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


def _status_kib(*fields: str) -> tuple[int, ...]:
    """The named fields of /proc/self/status in KiB, read in one pass (so VmHWM and VmRSS are from the same moment)."""
    found: dict[str, int] = {}
    with open(_STATUS) as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in fields:
                found[name] = int(line.split()[1])
    missing = [x for x in fields if x not in found]
    if missing:
        raise OSError(f"{', '.join(missing)} not in {_STATUS}")
    return tuple(found[x] for x in fields)


class PeakMeter:
    """Peak memory above the level at `start()`.

    CPU: VmHWM (peak RSS) after resetting it through /proc/self/clear_refs ("5", Linux >= 4.0), minus VmRSS at
    start. RSS counts what the allocator holds from the OS, so freed-but-cached heap pages count as used; the
    benchmark runs each configuration in a fresh process for that reason. The reset is process-wide: a nested
    meter's start() (grpo_update starts one) clears the outer meter's record too, which is harmless only while the
    level between the two starts stays at the outer baseline.
    Whether the reset worked is checked, not assumed: `start()` reads VmHWM before and after writing, and counts the
    reset as working when VmHWM dropped, or when it equals VmRSS right after (then no earlier, higher peak is
    hidden in it). Where the write is refused or VmHWM keeps an earlier, higher value, `reset_worked` and
    `resettable` are False and `peak()` is the process-lifetime peak (ru_maxrss) above the baseline: an upper bound
    on the interval's peak, not the interval's peak.
    CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus memory_allocated at start; the reset
    always works there.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.baseline = 0
        self.resettable = True  # False once any start() found the reset not working
        self.reset_worked: bool | None = None  # the last start()'s finding; None before start()

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            self.reset_worked = True
            return
        (hwm_before,) = _status_kib("VmHWM")
        try:
            with open(_CLEAR_REFS, "w") as f:
                f.write("5")
            written = True
        except OSError:
            written = False
        hwm_after, rss = _status_kib("VmHWM", "VmRSS")
        self.reset_worked = written and (hwm_after < hwm_before or hwm_after <= rss)
        self.resettable = self.resettable and self.reset_worked
        self.baseline = rss * 1024

    def peak(self) -> int:
        """Bytes of the peak since start() above the baseline (the process-lifetime peak if the reset failed)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        if self.reset_worked:
            return _status_kib("VmHWM")[0] * 1024 - self.baseline
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.baseline

    def report(self) -> dict:
        """JSON-ready: `peak_meter_reset` (did the last start() reset the peak), `peak_scope` (what peak() covers)."""
        scope = "since start()" if self.reset_worked else "process lifetime (peak reset did not work)"
        return {"peak_meter_reset": self.reset_worked, "peak_scope": scope}


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


class TensorPeak:
    """Peak bytes of tensors allocated inside `with` and live at once: the allocator's view, without the heap.

    CUDA: max_memory_allocated after reset_peak_memory_stats, above memory_allocated at entry (what PeakMeter reads
    there). CPU: the torch profiler's allocation log (profile_memory), replayed in time order; every allocation and
    free inside the interval counts, so tensors that existed before it (weights) are not counted, and a free of one
    of them lowers the running total. RSS (PeakMeter) also counts heap pages glibc keeps after a free, which on a
    long prefix grows with the number of chunks run; this meter is the CPU counterpart of the GPU figure. The
    profiler records every op, so use it in benchmarks, not in a training step.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.nbytes = 0
        self._prof = None
        self._baseline = 0

    def __enter__(self) -> TensorPeak:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.nbytes = torch.cuda.max_memory_allocated(self.device) - self._baseline
            return
        from torch.profiler import DeviceType

        self._prof.__exit__(*exc)
        events = self._prof.profiler.kineto_results.events()
        changes = sorted(
            (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
        )
        live = peak = 0
        for _, n in changes:
            live += n
            peak = max(peak, live)
        self.nbytes = peak
        self._prof = None
