"""OpTracer: ATen ops by module path in forward and backward, statistics, hash, copy-on-write."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opsnn_lab.consistency.tracer import OpTracer, Trace, flatten, unflatten
from opsnn_lab.testing import seeded


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x))).sum(dim=-1)


def _trace(model, x):
    with OpTracer(model) as t:
        model(x).sum().backward()
    return t.trace


def test_forward_and_backward_ops_carry_the_module_path():
    model, x = Net(), seeded(5, 8)
    trace = _trace(model, x)
    ops = [(r.phase, r.module_path, r.op) for r in trace.records if r.kind == "op"]
    assert ("forward", "fc1", "aten.addmm.default") in ops
    assert ("forward", "act", "aten.relu.default") in ops
    assert ("backward", "act", "aten.threshold_backward.default") in ops
    back = [(p, m, o) for p, m, o in ops if p == "backward" and o.startswith("aten.mm")]
    assert {m for _, m, _ in back} == {"fc1", "fc2"}
    # a backward op points at the forward op whose autograd node ran it, and shares its source line
    recs = trace.records
    for r in recs:
        if r.phase == "backward" and r.forward_index is not None:
            assert recs[r.forward_index].phase == "forward"
            assert recs[r.forward_index].module_path == r.module_path
            assert recs[r.forward_index].location == r.location
    assert recs[0].location.endswith(f"test_tracer.py:{Net.forward.__code__.co_firstlineno + 1}")
    module_rows = [r.module_path for r in recs if r.kind == "module"]
    assert module_rows == ["fc1", "act", "fc2", ""]
    grads = {(r.module_path, r.op) for r in recs if r.kind == "grad"}
    assert grads == {("fc1", "grad.weight"), ("fc1", "grad.bias"), ("fc2", "grad.weight"), ("fc2", "grad.bias")}


def test_producers_link_ops_and_leaves_have_stats():
    model, x = Net(), seeded(5, 8)
    recs = _trace(model, x).records
    relu = next(r for r in recs if r.op == "aten.relu.default")
    addmm = recs[relu.input_producers[0]]
    assert addmm.op == "aten.addmm.default" and addmm.module_path == "fc1"
    # addmm(bias, x, weight.t()): all three are leaves, summarised when the trace ends
    assert addmm.input_producers == [None, None, None]
    assert all(s is not None for s in addmm.input_stats)
    assert relu.input_stats == [None]


def test_tracer_without_a_model_discovers_modules():
    model, x = Net(), seeded(3, 8)
    with OpTracer() as t:
        model(x).sum().backward()
    paths = {r.module_path for r in t.trace.records}
    assert {"fc1", "act", "fc2"} <= paths
    assert any(r.kind == "grad" for r in t.trace.records)


def test_in_place_ops_do_not_rewrite_recorded_tensors():
    x = seeded(4, 4, requires_grad=True)
    with OpTracer() as t:
        y = x * 2
        y.add_(1)            # in-place on a recorded output
        y.sum().backward()
    mul = next(r for r in t.trace.records if r.op == "aten.mul.Tensor" and r.phase == "forward")
    add = next(r for r in t.trace.records if r.op == "aten.add_.Tensor")
    torch.testing.assert_close(mul.outputs[0], x.detach() * 2, atol=0, rtol=0)
    torch.testing.assert_close(add.input_tensors()[0], x.detach() * 2, atol=0, rtol=0)
    torch.testing.assert_close(add.outputs[0], x.detach() * 2 + 1, atol=0, rtol=0)


def test_an_in_place_op_copies_what_it_writes_and_holds_what_it_reads():
    x = seeded(4, 4)
    with OpTracer() as t:
        a, b = x * 2, x * 3
        b.add_(a)            # writes b, reads a: a is held as it is, b's old bits are kept
        ptr_after_add = a.data_ptr()
    mul2 = next(r for r in t.trace.records if r.op == "aten.mul.Tensor" and r.occurrence == 0)
    add = next(r for r in t.trace.records if r.op == "aten.add_.Tensor")
    assert add.input_tensors()[1].data_ptr() == ptr_after_add == mul2.outputs[0].data_ptr()  # not copied
    torch.testing.assert_close(add.input_tensors()[0], x * 3, atol=0, rtol=0)
    with OpTracer() as t:
        a, b = x * 2, x * 3
        b.add_(a)
        a.mul_(5)            # a later write to what add_ read: both holders keep the old bits
    mul2 = next(r for r in t.trace.records if r.op == "aten.mul.Tensor" and r.occurrence == 0)
    add = next(r for r in t.trace.records if r.op == "aten.add_.Tensor")
    torch.testing.assert_close(add.input_tensors()[1], x * 2, atol=0, rtol=0)
    torch.testing.assert_close(mul2.outputs[0], x * 2, atol=0, rtol=0)
    torch.testing.assert_close(add.outputs[0], x * 3 + x * 2, atol=0, rtol=0)


def test_the_cycle_collector_is_paused_inside_and_restored_after():
    import gc

    assert gc.isenabled()
    with OpTracer():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), OpTracer():
        raise KeyError("user code fails")
    assert gc.isenabled()
    gc.disable()
    try:
        with OpTracer():
            pass
        assert not gc.isenabled()  # a caller's choice stays
    finally:
        gc.enable()


def test_optimizer_step_after_the_trace_leaves_recorded_leaves_alone():
    model, x = Net(), seeded(5, 8)
    trace = _trace(model, x)
    before = model.fc1.weight.detach().clone()
    grad = model.fc1.weight.grad.clone()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    model.zero_grad(set_to_none=False)   # zeroes .grad in place
    addmm = next(r for r in trace.records if r.op == "aten.addmm.default" and r.module_path == "fc1")
    torch.testing.assert_close(addmm.input_tensors()[2], before.t(), atol=0, rtol=0)
    g = next(r for r in trace.records if r.kind == "grad" and r.module_path == "fc1" and r.op == "grad.weight")
    torch.testing.assert_close(g.outputs[0], grad, atol=0, rtol=0)


def test_save_and_load_round_trip(tmp_path):
    model, x = Net(), seeded(5, 8)
    trace = _trace(model, x)
    trace.save(tmp_path / "t.pt")
    back = Trace.load(tmp_path / "t.pt")
    assert [r.key for r in back.records] == [r.key for r in trace.records]
    assert [r.output_stats for r in back.records] == [r.output_stats for r in trace.records]
    for a, b in zip(back.records, trace.records):
        for ta, tb in zip(a.outputs, b.outputs):
            assert torch.equal(ta, tb)
    (tmp_path / "bad.pt").write_bytes(b"")
    torch.save({"something": 1}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="path"):
        Trace.load(tmp_path / "bad.pt")
    torch.save({"format": "opsnn_lab.trace/1", "rank": 0, "records": []}, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="before the hash changed"):
        Trace.load(tmp_path / "old.pt")


def test_flatten_round_trip():
    obj = ((torch.ones(1), [2, (3, torch.zeros(2))]), {"dim": 1, "out": [torch.ones(3)]})
    flat: list = []
    spec = flatten(obj, flat)
    assert len(flat) == 6
    back = unflatten(flat, spec)
    assert back[0][1][1][0] == 3 and back[1]["dim"] == 1 and torch.equal(back[1]["out"][0], torch.ones(3))


def test_empty_batch_traces():
    model = Net()
    trace = _trace(model, torch.zeros(0, 8))
    assert any(r.phase == "backward" for r in trace.records)
    assert all(s.shape[0] == 0 for r in trace.records if r.op == "aten.addmm.default" for s in r.output_stats)


def test_a_dropped_trace_frees_its_tensors_without_the_cycle_collector():
    # the tracer holds every tensor of its step; once the caller drops it they must go at once (reference
    # counting), not at the next cycle collection: a checker tracing step after step would otherwise hold
    # two steps' tensors and allocate fresh memory for each
    import gc
    import weakref

    was = gc.isenabled()
    gc.disable()
    try:
        with OpTracer(Net()) as t:
            Net()(seeded(4, 8)).sum().backward()
        inner = [o for r in t.trace.records if r.op == "aten.relu.default" for o in r.outputs]
        assert inner
        alive = [weakref.ref(o) for o in inner]
        del t, inner
        assert all(ref() is None for ref in alive)
    finally:
        if was:
            gc.enable()
