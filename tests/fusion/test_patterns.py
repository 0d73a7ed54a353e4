"""The pattern table on small hand-written models: each form matches, each rejection says why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opsnn_lab.fusion.patterns import FAMILIES, PATTERNS, find_all, pattern_of
from opsnn_lab.fusion.runtime import trace_runtime
from opsnn_lab.testing import seeded


def _matches(model, *inputs):
    return find_all(trace_runtime(model, inputs).graph)


class Attn(nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.variant = variant

    def forward(self, q, k, v, mask):
        kt = {"no_transpose": lambda: k.permute(0, 1, 3, 2), "mT": lambda: k.mT}.get(self.variant,
                                                                                    lambda: k.transpose(-1, -2))()
        s = q @ kt
        s = 0.5 * s if self.variant != "div" else s / 4.0
        s = mask + s
        p = s.softmax(dim=-1 if self.variant != "dim2" else 2)
        out = p @ v
        return (out, s) if self.variant == "scores_out" else out


@pytest.mark.parametrize("variant, ok, why", [
    ("plain", True, "fused"),
    ("div", True, "fused"),
    ("dim2", False, "softmax over dim 2"),
    ("mT", True, "fused"),
    ("no_transpose", False, "is `permute`, not a transpose"),
    ("scores_out", False, "also read by `output`"),
])
def test_attention_forms(variant, ok, why):
    q, k, v = (seeded(2, 3, 5, 4, seed=i) for i in range(3))
    mask = seeded(2, 1, 5, 5, seed=3)
    (m,) = [m for m in _matches(Attn(variant), q, k, v, mask) if m.pattern == "attention"]
    assert m.ok is ok and why in m.reason
    if ok:
        assert m.params["scale"] == (0.25 if variant == "div" else 0.5) and m.params["dropout_p"] == 0.0
        assert len(m.inputs) == 4  # q, k (before its transpose), v, mask


class Siblings(nn.Module):
    def __init__(self, bias_v=True, n=3):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 4, bias=(i < 2 or bias_v)) for i in range(n))

    def forward(self, x):
        return [lin(x) for lin in self.lins]


def test_qkv_siblings_and_bias_mismatch():
    (m,) = _matches(Siblings(), seeded(2, 4))
    assert m.pattern == "qkv" and m.ok and m.modules == ["lins.0", "lins.1", "lins.2"]
    (m,) = _matches(Siblings(bias_v=False), seeded(2, 4))
    assert not m.ok and ("bias" in m.reason)
    assert _matches(Siblings(n=4), seeded(2, 4)) == []  # four siblings: not the QKV shape


def test_overlapping_candidates_and_switches():
    stack = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    first, second = _matches(stack, seeded(2, 4))
    assert first.ok and first.pattern == "linear_gelu_linear" and first.modules == ["0", "1", "2"]
    assert not second.ok and "overlaps the fused linear_gelu_linear" in second.reason
    assert second.viable  # it would fuse on its own
    off = find_all(trace_runtime(stack, (seeded(2, 4),)).graph, enabled=["qkv"])
    assert all("switched off" in m.reason for m in off)


def test_table_rows():
    assert FAMILIES == ("conv_bn_relu", "gated_mlp", "linear_gelu_dropout", "attention", "qkv", "add_layer_norm",
                        "add_rms_norm", "layer_norm", "rms_norm", "linear_cross_entropy")
    assert pattern_of("linear_cross_entropy").op == "FusedLinearCrossEntropy"
    assert pattern_of("add_rms_norm").op == "FusedAddRMSNorm" and pattern_of("rms_norm").op == "FusedRMSNorm"
    assert pattern_of("conv_bn_relu_maxpool") is PATTERNS[0] and pattern_of("gated_mlp_silu") is PATTERNS[1]
    assert pattern_of("linear_gelu_dropout_linear").op == "FusedLinearGELUDropout"
    assert all(callable(p.find) and callable(p.build) and p.chain for p in PATTERNS)


def test_conv_output_read_twice():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.relu = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU()

        def forward(self, x):
            y = self.conv(x)
            return self.relu(self.bn(y)) + y

    (m,) = _matches(Twice(), seeded(2, 3, 4, 4))
    assert not m.ok and "the output of `conv` is also read by `add`" in m.reason
    assert m.pattern.startswith("conv_bn_relu") and list(m.modules)[:2] == ["conv", "bn"]


@pytest.mark.parametrize("variant", ["plain", "div", "mT"])
def test_attention_forms_rewrite_equivalently(variant):
    import opsnn_lab as ol

    inputs = tuple(seeded(2, 3, 5, 4, seed=i, requires_grad=True) for i in range(3)) + (seeded(2, 1, 5, 5, seed=3),)
    model = Attn(variant)
    fused, plan = ol.fusion.fuse(model, inputs)
    assert plan.summary() == {"attention": {"fused": 1, "rejected": 0}}
    torch.testing.assert_close(fused(*inputs), model(*inputs), atol=1e-5, rtol=1e-5)
    grads = [torch.autograd.grad(m(*inputs).sum(), inputs[:3]) for m in (model, fused)]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
