"""``nn.MultiheadAttention`` computes and keeps its attention weights for backward when called with
``need_weights=True`` (its default), even for a caller that only takes ``[0]`` (RT-DETR's decoder, many models). It is
a built-in module opsnn_lab does not rewrite: the plan declines it by name, with the bytes it keeps (those of the
saved (batch x heads, L, S) tensors, as measured) and the argument that keeps none of them; a caller that reads the
weights, or passes need_weights=False, gets no such line; the rest of the model fuses and the plan is the step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab.measuring import activation_bytes, saved_tensors_report

B, T, D, H = 2, 7, 32, 4


class _Block(nn.Module):
    def __init__(self, p=0.0, read=False, need_weights=None, average=True):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, H, dropout=p, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.read, self.average = read, average
        self.kwargs = {} if need_weights is None else {"need_weights": need_weights}

    def forward(self, x):
        out, weights = self.attn(x, x, x, average_attn_weights=self.average, **self.kwargs)
        y = x + self.ff(x + out)
        return (y, weights) if self.read else y


def _advice(model, x):
    return [d for d in ol.fusion.analyze(model, (x,)).decisions if d.pattern == "attention"]


@pytest.mark.parametrize("p, average", [(0.0, True), (0.1, True), (0.0, False)])
def test_weights_nobody_reads_are_named_with_what_they_keep(p, average):
    torch.manual_seed(0)
    model = _Block(p, average=average).train()
    x = torch.randn(B, T, D, requires_grad=True)
    (d,) = _advice(model, x)
    assert d.modules == ["attn"] and not d.fused and "need_weights=False" in d.reason
    saved = saved_tensors_report(lambda: model.attn(x, x, x)[0])
    kept = sum(r["bytes"] for r in saved.tensors if r["shape"] == (B * H, T, T))
    assert kept == (3 if p else 1) * B * H * T * T * 4 and f"({kept:,} bytes)" in d.reason
    assert ("math path" in d.reason) == bool(p) and ("dropout mask" in d.reason) == bool(p)
    if not p:  # the argument it names keeps none of them (on CPU: without dropout)
        without = saved_tensors_report(lambda: model.attn(x, x, x, need_weights=False)[0])
        assert not [r for r in without.tensors if r["shape"][-2:] == (T, T)]
    fused, plan = ol.fusion.fuse(model, (x,))
    assert [e.pattern for e in plan.fused] == ["linear_gelu_linear"]
    eager = activation_bytes(lambda: model(x), exclude=tuple(model.parameters()))
    assert plan.activation_bytes == eager
    assert plan.saved_bytes == eager - activation_bytes(lambda: fused(x), exclude=tuple(fused.parameters()))


@pytest.mark.parametrize("kwargs", [{"read": True}, {"need_weights": False}])
def test_weights_read_or_not_computed_get_no_line(kwargs):
    assert _advice(_Block(**kwargs).train(), torch.randn(B, T, D)) == []
