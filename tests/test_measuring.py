"""measuring: exact bytes autograd saves (unique storages, parameters excluded) and interleaved median times."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opsnn_lab.measuring import activation_bytes, interleaved_medians, median_time, peak_bytes, saved_tensors_report


def test_linear_saves_its_input_only():
    lin = nn.Linear(16, 32)
    x = torch.randn(8, 16, requires_grad=True)
    # addmm saves the input (8x16 fp32); the weight is a parameter and not counted
    assert activation_bytes(lambda: lin(x)) == 8 * 16 * 4


def test_views_of_one_storage_count_once():
    x = torch.randn(64, requires_grad=True)

    def fn():
        a = x * 2
        return (a[:32] * a[32:]).sum()  # saves two views of `a`

    assert activation_bytes(fn) == 64 * 4


def test_gelu_dropout_chain_eager_bytes():
    x = torch.randn(4, 10, requires_grad=True)
    torch.manual_seed(0)
    drop = nn.Dropout(0.5).train()
    report = saved_tensors_report(lambda: drop(torch.nn.functional.gelu(x)))
    # gelu saves x; on CPU eager dropout multiplies by a float mask and saves it (4 bytes an element,
    # where CUDA's native_dropout keeps a bool mask): the baseline fused dropout is measured against
    assert [r["dtype"] for r in report.tensors] == ["float32", "float32"]
    assert report.total_bytes == 2 * 4 * 10 * 4
    assert report.by_dtype() == {"float32": 320}


def test_what_a_dropped_computation_saved_is_not_held_and_never_hides_a_later_save():
    # a forward may drop a computation with its graph (RT-DETR's last box refinement, Mamba's discarded state): what
    # it saved is freed before the step's backward, and the allocator may give its address to a later save, which
    # counted as the same storage (the figure moved between runs: 4,000 bytes in some, 8,000 in others, before)
    x = torch.randn(1000, requires_grad=True)

    def fwd():
        dropped = x.exp()  # exp keeps its output for backward; the forward drops it, and its graph, here
        del dropped
        return x.exp()

    for _ in range(8):
        report = saved_tensors_report(fwd)
        assert report.total_bytes == 1000 * 4 and [r["shape"] for r in report.tensors] == [(1000,)]
    assert activation_bytes(lambda: fwd().sum().item()) == 0  # nothing holds the graph once fn returns
    import opsnn_lab as ol

    assert ol.fusion.activation_bytes_by_module(_Forward(fwd), torch.zeros(1), depth=1) == {"<model>": 1000 * 4}


class _Forward(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, _):
        return self.fn()


def test_no_grad_saves_nothing():
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        assert activation_bytes(lambda: lin(torch.randn(2, 4))) == 0


def test_exclude_and_bad_argument():
    x = torch.randn(8, requires_grad=True)
    y = x * 1.0
    assert activation_bytes(lambda: (y * y).sum(), exclude=(y,)) == 0
    with pytest.raises(TypeError, match="fn"):
        activation_bytes(42)


def test_the_documented_import_paths_are_the_same_functions():
    import opsnn_lab.bench as bench
    from opsnn_lab.bench import common, memory

    assert bench.activation_bytes is activation_bytes and bench.saved_tensors_report is saved_tensors_report
    assert memory.activation_bytes is activation_bytes
    assert common.interleaved_medians is interleaved_medians and common.median_time is median_time


def _scripted(monkeypatch, durations):
    """Variants whose calls advance a fake clock by scripted durations: the medians are exact and the order
    is observable. Returns ``(variants, the names called in order)``."""
    import opsnn_lab.measuring as measuring

    now, calls, left = [0.0], [], {k: iter(v) for k, v in durations.items()}

    def fn(name):
        def run():
            calls.append(name)
            now[0] += next(left[name])
        return run

    monkeypatch.setattr(measuring.time, "perf_counter", lambda: now[0])
    return {k: fn(k) for k in durations}, calls


def test_interleaved_medians_runs_round_robin_and_takes_medians(monkeypatch):
    fns, calls = _scripted(monkeypatch, {"a": [9, 9, 1, 5, 3], "b": [9, 2, 8, 4, 6]})  # first: the warm-up call
    out = interleaved_medians(fns, warmup=1, repeat=4)
    assert out == {"a": 4.0, "b": 5.0}  # medians of (9, 1, 5, 3) and (2, 8, 4, 6)
    assert calls == ["a", "b"] + ["a", "b"] * 4  # warm-up, then round-robin


def test_interleaved_medians_repeats_short_steps_for_a_minimum_round(monkeypatch):
    # warm-up 9, then one timed call each (2 and 4: the fastest sets 3 calls a round for min_round_s 5)
    fns, calls = _scripted(monkeypatch, {"a": [9, 2] + [1, 1, 4] + [3, 3, 3], "b": [9, 4] + [2, 2, 2] + [5, 6, 7]})
    out = interleaved_medians(fns, warmup=1, repeat=2, min_round_s=5)
    assert out == {"a": 2.5, "b": 4.0}  # per call: medians of (6 / 3, 9 / 3) and (6 / 3, 18 / 3)
    assert calls == ["a", "b", "a", "b"] + ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3


def test_median_time_excludes_warmup(monkeypatch):
    import opsnn_lab.measuring as measuring

    now, steps = [0.0], iter([100, 100, 1, 2, 3])

    def fn():
        now[0] += next(steps)

    monkeypatch.setattr(measuring.time, "perf_counter", lambda: now[0])
    assert median_time(fn, warmup=2, repeat=3) == 2.0


def test_peak_bytes_counts_what_is_alive_at_once():
    x = torch.randn(1000)
    assert peak_bytes(lambda: x * 2) == 4000
    assert peak_bytes(lambda: x.mul_(1.0)) == 0  # in place: no new storage
    assert peak_bytes(lambda: x[10:].clone().view(10, 99)) == 3960  # a view of a new storage counts once
    assert peak_bytes(lambda: (x * 2).sum()) == 4004  # the temporary is alive when the sum is allocated

    def drop_then_allocate():
        t = x * 2
        del t  # freed before the next op allocates: the peak is one buffer, not two
        return x * 3
    assert peak_bytes(drop_then_allocate) == 4000


def test_peak_bytes_sees_backward_and_the_grads_it_creates():
    lin = nn.Linear(16, 32)
    x = torch.randn(8, 16, requires_grad=True)
    assert peak_bytes(lambda: lin(x)) == 8 * 32 * 4
    step = peak_bytes(lambda: lin(x).sum().backward())
    grads = (lin.weight.numel() + lin.bias.numel() + x.numel()) * 4
    assert lin.weight.grad is not None and step >= grads  # the .grad tensors autograd creates are counted
    with pytest.raises(TypeError, match="fn"):
        peak_bytes(3)


def test_counting_saved_tensors_keeps_nothing_of_the_forward_alive():
    """A pack hook returning the tensor itself, or holding the report, kept an op's saved output (exp, rsqrt) alive
    from its own autograd node: a cycle through C++ the collector cannot see, and the forward leaked for good."""
    import gc
    import weakref

    def measure():
        w, x = torch.nn.Parameter(torch.randn(8, 8)), torch.randn(4, 8)
        assert activation_bytes(lambda: torch.rsqrt((x @ w).exp() + 1).sum()) > 0
        report = saved_tensors_report(lambda: torch.rsqrt((x @ w).exp() + 1))
        return weakref.ref(report.output), weakref.ref(w)

    out, param = measure()
    gc.collect()
    assert out() is None and param() is None
