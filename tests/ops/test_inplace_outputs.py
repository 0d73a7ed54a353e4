"""Every fused op's output may be modified in place, as the eager modules' may (``out += residual``, ``q *= scale``
in a model's forward), with the gradients eager gives; where the op saves its output for backward (a norm with
``save_output=True``), autograd reports the write instead of computing a wrong gradient."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab import ops
from opsnn_lab.testing import seeded


class _Packed(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up, self.down = nn.Linear(8, 24), nn.Linear(12, 8)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


def _cases():
    lin = nn.Linear
    return {
        "linear_gelu_dropout": (lambda: nn.Sequential(lin(8, 8), nn.GELU()),
                                lambda m: ops.FusedLinearGELUDropout.from_modules(m[0], m[1], None), 1),
        "linear_silu_linear": (lambda: nn.Sequential(lin(8, 12), nn.SiLU(), lin(12, 8)),
                               lambda m: ops.FusedLinearActDropoutLinear.from_modules(m[0], m[1], None, m[2]), 1),
        "gated_mlp": (lambda: nn.ModuleList([lin(8, 12), lin(8, 12), lin(12, 8)]),
                      lambda m: ops.FusedGatedMLP.from_modules(m[0], m[1], m[2], nn.SiLU(), pack=False), 1),
        "gated_mlp_packed": (_Packed, lambda m: ops.FusedGatedMLP.from_packed(m.gate_up, m.down, nn.SiLU()), 1),
        "qkv": (lambda: nn.ModuleList([lin(8, 8), lin(8, 4), lin(8, 4)]),
                lambda m: ops.FusedQKV.from_modules(m[0], m[1], m[2]), 3),
        "layer_norm": (lambda: nn.LayerNorm(8), lambda m: ops.FusedLayerNorm.from_modules(m, save_output=False), 1),
        "rms_norm": (lambda: nn.RMSNorm(8), lambda m: ops.FusedRMSNorm.from_modules(m, save_output=False), 1),
        "add_rms_norm": (lambda: nn.RMSNorm(8), lambda m: ops.FusedAddRMSNorm.from_modules(m, save_output=False), 1),
    }


def _eager(name, m, x, r):
    if name == "gated_mlp":
        return m[2](F.silu(m[0](x)) * m[1](x))
    if name == "qkv":
        return tuple(lin(x) for lin in m)
    if name == "add_rms_norm":  # the fused op returns the residual stream too
        s = x + r
        return m(s), s
    return m(x)


def _step(fn, x, r, outputs_written):
    out = fn(x, r)
    outs = out if isinstance(out, tuple) else (out,)
    for o in outs[:outputs_written]:
        o.mul_(2.0).add_(1.0)  # in place, as a model's forward might
    sum(((o.double() * (i + 1)).sin().sum() for i, o in enumerate(outs))).backward()
    return [o.detach() for o in outs]


@pytest.mark.parametrize("name", list(_cases()))
def test_outputs_written_in_place_give_eagers_gradients(name):
    make, fuse, written = _cases()[name]
    torch.manual_seed(0)
    eager = make()
    fused_src = copy.deepcopy(eager)
    fused = fuse(fused_src)
    x = seeded(2, 3, 8, seed=1, requires_grad=True)
    r = seeded(2, 3, 8, seed=2, requires_grad=True)
    x2, r2 = (t.detach().clone().requires_grad_(True) for t in (x, r))
    want = _step(lambda a, b: _eager(name, eager, a, b), x, r, written)
    got = _step(lambda a, b: fused(a, b) if name == "add_rms_norm" else fused(a), x2, r2, written)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(x2.grad, x.grad)
    for (n, p), (_, q) in zip(sorted(fused_src.named_parameters()), sorted(eager.named_parameters())):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_a_norm_that_saves_its_output_reports_an_in_place_write():
    fused = ops.FusedLayerNorm.from_modules(nn.LayerNorm(8))  # save_output: for a Linear that keeps y anyway
    y = fused(seeded(4, 8, requires_grad=True))
    y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_attention_output_and_per_token_loss_written_in_place():
    # with dropout (the op's own Function; without, it is aten's SDPA, which saves its output as eager's does):
    # the same draw written in place or scaled out of place gives the same gradients
    grads = []
    for in_place in (True, False):
        q, k, v = (seeded(2, 2, 5, 4, seed=s, requires_grad=True) for s in (1, 2, 3))
        out = ops.FusedAttention(dropout_p=0.5, seed=7)(q, k, v)
        out = out.mul_(3.0) if in_place else out * 3.0
        out.square().sum().backward()
        grads.append([t.grad for t in (q, k, v)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    head = nn.Linear(8, 11)
    h = seeded(2, 3, 8, seed=4, requires_grad=True)
    h2 = h.detach().clone().requires_grad_(True)
    t = torch.tensor([[1, 2, -100], [4, 0, 10]])
    want = F.cross_entropy(head(h).flatten(0, 1), t.flatten(), reduction="none").view(2, 3)
    got = ops.linear_cross_entropy(h2, head.weight, t, head.bias, reduction="none")
    mask = torch.tensor([[1.0, 0.5, 0.0], [2.0, 1.0, 1.0]])
    gw = []
    for o in (want, got):
        o.mul_(mask)  # a per-token weighting, in place
        head.zero_grad()
        o.sum().backward()
        gw.append(head.weight.grad.clone())
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(h2.grad, h.grad)
    torch.testing.assert_close(gw[1], gw[0])
