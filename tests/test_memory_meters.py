"""The memory meters the benchmarks read: TensorPeak (tensor bytes live at once) and GraphMeter (saved for backward)."""

import torch

from longstraw.memory import GraphMeter, TensorPeak, reset_peak

MIB = 1 << 20


def test_tensor_peak_counts_what_is_live_at_once_and_not_what_existed_before():
    weights = torch.zeros(MIB // 4)  # 1 MiB allocated before the interval: not counted, and its free lowers nothing
    with TensorPeak() as meter:
        a = torch.ones(2 * MIB // 4)  # 2 MiB
        b = torch.ones(3 * MIB // 4)  # 5 MiB live
        del a  # 3 MiB
        c = torch.ones(MIB // 4)  # 4 MiB
        del b, c, weights
        d = torch.ones(4 * MIB // 4)  # 4 MiB after the frees
        del d
    assert 5 * MIB <= meter.nbytes < 5 * MIB + 64 * 1024, meter.nbytes


def test_tensor_peak_sees_the_transient_inside_an_op_chain():
    x = torch.randn(256, 256)
    with TensorPeak() as meter:
        y = (x @ x).relu().sum()  # 256 KiB product, 256 KiB relu, both live at once
    assert float(y) >= 0
    assert 2 * 256 * 1024 <= meter.nbytes < 3 * 256 * 1024, meter.nbytes


def test_graph_meter_counts_saved_storages_once_and_skips_excluded_ones():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(8, 64)
    with GraphMeter({w.untyped_storage().data_ptr()}) as meter:
        h = x @ w  # saves x (excluded: no) and w (excluded)
        (h * h).sum()  # saves h twice: one storage
    assert meter.nbytes == x.nbytes + h.nbytes, meter.nbytes


def test_tensor_peak_restarts_at_a_reset_peak_inside_it_as_cudas_counter_does():
    """A reset of the device's peak (`reset_peak`, what every meter's start() calls) inside a CPU TensorPeak: a
    4 MiB transient before it, 1 MiB after. CUDA's counter then reports 1 MiB, and so must the CPU meter, so that
    a CPU test sees a misplaced reset (one per LongStraw group left the learner only the last group's peak)."""
    with TensorPeak() as meter:
        a = torch.ones(4 * MIB // 4)
        del a
        assert reset_peak("cpu") in (True, False)  # the tensor meter restarts whether or not VmHWM could be reset
        b = torch.ones(MIB // 4)
        del b
    assert MIB <= meter.nbytes < MIB + 64 * 1024, meter.nbytes
