"""Measured memory: the peak above a baseline (process RSS on CPU, the caching allocator on CUDA) and the bytes a
forward saves for backward (saved-tensor hooks over unique storages). Nothing here estimates.

A device's peak counter is process-wide (CUDA's allocator statistics, the kernel's VmHWM), so a reset by anyone ends
the record of every window open on that device. Every meter here resets through `reset_peak`, and on CPU it also
restarts the open `TensorPeak` windows, so the CPU meters see a reset exactly as CUDA's counter does and a test on
CPU catches code that resets the peak where it should not. The rule that follows: the outermost caller that reports
a peak (the learner, once per step) resets it; code nested inside never does (`UpdateSpec.measure=False`).

What these meters check is LongStraw's bound (docs/longstraw.md, "Memory model"): prefix + gradients (+ exact mode's
dK/dV) + the largest replay micro-batch's graph (`GraphMeter` around each micro-batch) + its scoring blocks. The
micro-batch term is what `UpdateSpec.replay_budget_bytes` caps through the adapter's estimate; with no budget each
micro-batch is one response, and the term is the longest response's graph, as before micro-batching.
"""

from __future__ import annotations

import resource

import torch

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


_RESET_EVENT = "longstraw.memory.reset_peak"  # marks a reset in an open TensorPeak's profiler log
_open_tensor_peaks: list[TensorPeak] = []  # CPU TensorPeak windows now open, innermost last


def reset_peak(device: torch.device | str) -> bool:
    """Reset the device's process-wide peak to the memory in use now; True when the reset went through.

    CUDA: torch.cuda.reset_peak_memory_stats after a synchronize (always True). CPU: VmHWM (and with it ru_maxrss)
    through /proc/self/clear_refs ("5", Linux >= 4.0; False where the write is refused), and every open CPU
    `TensorPeak` restarts its peak from the tensor bytes live now.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return True
    if _open_tensor_peaks:
        with torch.profiler.record_function(_RESET_EVENT):
            pass
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


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
    benchmark runs each configuration in a fresh process for that reason. The reset is process-wide (`reset_peak`):
    a nested meter's start() (a measuring grpo_update starts one) ends the outer meter's record, so code that runs
    inside a metered step must not start one.
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
            self.reset_worked = reset_peak(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            return
        (hwm_before,) = _status_kib("VmHWM")
        written = reset_peak(self.device)
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
    profiler records every op, so use it in benchmarks and tests, not in a training step.
    A `reset_peak` inside the interval acts as on CUDA: the peak restarts from the bytes live at the reset (still
    above the level at entry), so what came before it is forgotten.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.nbytes = 0
        self._prof = None
        self._baseline = 0

    def __enter__(self) -> TensorPeak:
        if self.device.type == "cuda":
            reset_peak(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
            _open_tensor_peaks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.nbytes = torch.cuda.max_memory_allocated(self.device) - self._baseline
            return
        from torch.profiler import DeviceType

        _open_tensor_peaks.remove(self)
        self._prof.__exit__(*exc)
        events = self._prof.profiler.kineto_results.events()
        # (time, 0, bytes) for an allocation (+) or a free (-); (time, 1, 0) for a reset, after same-time changes.
        changes = sorted(
            (e.start_ns(), 0, e.nbytes()) if e.name() == "[memory]" else (e.start_ns(), 1, 0)
            for e in events
            if e.device_type() == DeviceType.CPU and e.name() in ("[memory]", _RESET_EVENT)
        )
        live = peak = 0
        for _, is_reset, n in changes:
            live += n
            peak = live if is_reset else max(peak, live)
        self.nbytes = peak
        self._prof = None
