"""FusedConvBNAct in float64 against eager float64 at fp64 tolerance: the BatchNorm statistics, the recomputed
pre-activation and the eval-mode folded weights must be taken in fp64, not fp32 (which is off by ~1e-8
relative, a hundred times past ``TOLERANCES[torch.float64]``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from opsnn_lab.ops.conv_bn_relu import FusedConvBNAct
from opsnn_lab.testing import TOLERANCES, seeded

ACTS = {"relu": nn.ReLU, "relu6": nn.ReLU6, "silu": nn.SiLU, "hardswish": nn.Hardswish, "gelu": nn.GELU}

# name: (N, Cin, H, W, Cout, kernel, stride, padding, groups, conv bias, pool (k, s, p) or None)
CONVS = {
    "plain": (3, 5, 9, 7, 7, 3, 1, 1, 1, True, None),
    "pointwise": (2, 8, 6, 6, 16, 1, 1, 0, 1, False, None),
    "depthwise": (2, 6, 11, 9, 6, 3, 1, 1, 6, False, None),
    "depthwise_pool": (2, 6, 10, 10, 6, 3, 2, 1, 6, True, (3, 2, 1)),
}


def _chain(cfg, act):
    n, cin, h, w, cout, k, stride, padding, groups, bias, pool = cfg
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, k, stride, padding, groups=groups, bias=bias)
    bn = nn.BatchNorm2d(cout)
    with torch.no_grad():  # gamma up to 4 so the activations' curved parts (and ReLU6's 6) are reached
        bn.weight.uniform_(1.0, 4.0)
        bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 2.0)
    mods = [conv, bn, ACTS[act]()] + ([nn.MaxPool2d(*pool)] if pool else [])
    for m in mods:
        m.double()
    x = seeded(n, cin, h, w, seed=1, dtype=torch.float64, scale=3.0) + 1.0
    return mods, x


def _run(module, mods, x):
    """Output, then the gradients of input, conv weight (and bias), BN weight and bias, then BN buffers."""
    conv, bn = mods[0], mods[1]
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    out.backward(seeded(*out.shape, seed=7, dtype=out.dtype))
    leaves = [x, conv.weight] + ([conv.bias] if conv.bias is not None else []) + [bn.weight, bn.bias]
    names = ["input", "conv.weight"] + (["conv.bias"] if conv.bias is not None else []) + ["bn.weight", "bn.bias"]
    results = {"output": out.detach()} | {f"grad {n}": t.grad for n, t in zip(names, leaves)}
    return results | {"running_mean": bn.running_mean, "running_var": bn.running_var,
                      "num_batches_tracked": bn.num_batches_tracked}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("conv", list(CONVS))
@pytest.mark.parametrize("act", list(ACTS))
def test_fp64_matches_eager_fp64(act, conv, train):
    mods, x = _chain(CONVS[conv], act)
    eager_mods = copy.deepcopy(mods)
    eager = nn.Sequential(*eager_mods).train(train)
    fused = FusedConvBNAct.from_modules(*mods[:3], mods[3] if len(mods) > 3 else None).train(train)
    expected, actual = _run(eager, eager_mods, x), _run(fused, mods, x)
    atol, rtol = TOLERANCES[torch.float64]
    for name, e in expected.items():
        assert actual[name].dtype == e.dtype, name
        torch.testing.assert_close(actual[name], e, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")
