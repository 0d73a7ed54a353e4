"""The run-time dataflow trace: producers, consumers, scopes and saved bytes, in code no tracer accepts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from opsnn_lab.bench import activation_bytes
from opsnn_lab.fusion.runtime import flatten_tensors, trace_runtime
from opsnn_lab.testing import seeded


@dataclass
class Out:
    y: torch.Tensor
    extra: dict


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(4, 4), nn.GELU()

    def forward(self, x, scale=2.0):
        h = self.act(self.fc(x))
        if h.sum() > 0:  # data-dependent
            h = h * scale
        h[:, 0] = 0.0  # item assignment
        z = self.fc(h)  # the same module again
        return Out(z, {"h": h})


def test_graph_of_a_model_no_tracer_accepts():
    torch.manual_seed(0)  # the branch below is data-dependent: these weights take it (h.sum() = 1.83)
    model = Odd()
    tr = trace_runtime(model, (seeded(3, 4),), {"scale": 3.0})
    g = tr.graph
    names = [n.name for n in g.nodes]
    assert names[:3] == ["input0", "fc", "act"] and "fc#2" in names and "setitem" in names
    assert g["act"].inputs == ["fc"] and g["act"].module == "act" and g["act"].op == "gelu"
    assert {u.name for u in g.users["mul"]} >= {"setitem", "fc#2"}
    assert g["output"].inputs == ["fc#2", "mul"]  # tensors inside a dataclass and a dict
    assert tr.calls["fc"][0][0][0].shape == (3, 4) and len(tr.calls["fc"]) == 2
    assert tr.calls[""][0][1] == {"scale": 3.0}


def test_saved_bytes_are_attributed_and_complete():
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.5), nn.Linear(8, 2))
    x = seeded(5, 4)
    tr = trace_runtime(model, (x,))
    total = sum(dict((k, b) for _, k, b in tr.saved).values())
    assert total == activation_bytes(lambda: model(x), exclude=tuple(model.parameters()))
    by_node = {n for n, _, _ in tr.saved}
    assert {"1", "2", "3"} <= by_node  # GELU saves its input, Dropout its mask, the last Linear its input


def test_flatten_tensors_walks_structures():
    t = torch.ones(1)
    assert len(flatten_tensors([t, (t, {"a": t}), Out(t, {"b": [t]}), 3, None])) == 5


def test_casts_that_return_their_input_are_not_a_second_producer():
    class Casts(torch.nn.Module):
        def forward(self, x, h):
            return x.float().contiguous() + x.to(x.dtype), h.float()  # h is bf16: a real cast

    g = trace_runtime(Casts(), (torch.randn(2, 3), torch.randn(2, 3).bfloat16())).graph
    (add,) = [n for n in g.nodes if n.op == "add"]
    assert add.inputs == ["input0", "input0"]  # the add reads the input itself, not a no-op cast of it
    assert [n.op for n in g.nodes if n.kind == "function"] == ["add", "float"]


def test_modules_of_which_nothing_ran_are_listed_uppermost():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.functional = nn.Linear(4, 4), nn.Linear(4, 4)
            self.idle = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
            self.looked_at = nn.Linear(4, 4)
            self.mha = nn.MultiheadAttention(4, 1)  # out_proj is never called: MHA reads its weight itself

        def forward(self, x):
            assert self.looked_at.weight.device == x.device  # metadata only: looked_at does not run
            h = torch.nn.functional.linear(self.used(x), self.functional.weight, self.functional.bias)
            return self.mha(h, h, h)[0]

    trace = trace_runtime(M(), (seeded(3, 2, 4),))
    assert trace.not_called == ["idle", "looked_at"]


def test_each_tensor_of_a_call_that_returns_several_is_its_own_item():
    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.lstm = nn.Linear(4, 18), nn.LSTM(18, 3, batch_first=True)

        def forward(self, x):
            dt, b = self.proj(x).split([2, 16], dim=-1)
            out, (h, c) = self.lstm(torch.cat([b, dt], -1))
            return dt.sum(-1) + b.mean(-1), out, c

    tr = trace_runtime(Split(), (seeded(3, 5, 4),))
    g = tr.graph
    split = next(n for n in g.nodes if n.op == "split")
    items = [u for u in g.users[split.name] if u.op == "getitem"]
    assert [(i.args[1], i.shape) for i in items] == [(0, (3, 5, 2)), (1, (3, 5, 16))]
    assert {u.op for u in g.users[split.name]} == {"getitem"}  # every reader reads one item
    assert torch.equal(g.tensors[items[1].name], tr.calls["lstm"][0][0][0][..., :16])
    assert g["output"].inputs[0] == "add" and g["add"].inputs == ["sum", "mean"]
    assert g["sum"].inputs == [items[0].name] and g["mean"].inputs == [items[1].name]
    lstm_items = [u for u in g.users["lstm"] if u.op == "getitem"]  # out, h, c: flattened
    assert [i.shape for i in lstm_items] == [(3, 5, 3), (1, 3, 3), (1, 3, 3)]
    assert g["output"].inputs[1:] == [lstm_items[0].name, lstm_items[2].name]
