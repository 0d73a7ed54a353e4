"""A BatchNorm module that applies its own activation (as timm's ``BatchNormAct2d``: a BatchNorm2d subclass
with ``drop``/``act`` children) fuses with the conv before it: FusedConvBNAct reads only its tensors and
settings once a probe has shown its forward computes ``act(BatchNorm2d(x))``. Checked: outputs, every
gradient and the running statistics against the eager module over several steps; the probe's verdicts (a
different forward, an act that is not its child, extra children) and that it leaves the module as it was."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab.ops import FusedConvBNAct
from opsnn_lab.ops._bn_act import computes_batch_norm, inner_activation
from opsnn_lab.testing import seeded


class BatchNormAct(nn.BatchNorm2d):
    """BatchNorm2d then ``drop`` then ``act``, written out as timm writes it (F.batch_norm, own momentum logic)."""

    def __init__(self, c, act=None, momentum=0.1):
        super().__init__(c, momentum=momentum)
        self.drop, self.act = nn.Identity(), act if act is not None else nn.Identity()

    def forward(self, x):
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, factor,
                         self.eps)
        return self.act(self.drop(x))


class ShiftedBN(BatchNormAct):  # the same children, another computation
    def forward(self, x):
        return super().forward(x) + 0.5


class StatsFrozenBN(BatchNormAct):  # the same output in training, but the running statistics never move
    def forward(self, x):
        x = F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps) if self.training else \
            F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return self.act(self.drop(x))


class DropBN(BatchNormAct):  # a second non-identity child: not just BN then act
    def __init__(self, c, act):
        super().__init__(c, act)
        self.drop = nn.Dropout(0.0)


def _chain(act, momentum=0.1, depthwise=False, c=6):
    torch.manual_seed(0)
    conv = nn.Conv2d(c, c, 3, padding=1, groups=c if depthwise else 1, bias=False)
    bn = BatchNormAct(c, act, momentum)
    with torch.no_grad():
        bn.weight.uniform_(1.0, 3.0)
        bn.bias.uniform_(-0.5, 0.5)
    return conv, bn


def _run(module, params, x, steps=3):
    outs, grads = [], []
    for step in range(steps):
        for p in params:
            p.grad = None
        xi = x.clone().requires_grad_(True)
        out = module(xi)
        out.backward(seeded(*out.shape, seed=10 + step))
        outs.append(out.detach())
        grads.append([xi.grad, *[p.grad.clone() for p in params]])
    return outs, grads


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("act, depthwise", [(nn.SiLU(), True), (nn.Hardswish(), False), (nn.ReLU6(), True),
                                            (nn.ReLU(inplace=True), False)])
def test_fuses_with_the_activation_it_applies_itself(act, depthwise, momentum):
    conv, bn = _chain(act, momentum, depthwise)
    eager_conv, eager_bn = copy.deepcopy(conv), copy.deepcopy(bn)
    ok, why = FusedConvBNAct.supports(conv, bn, bn.act)
    assert ok, why
    fused = FusedConvBNAct.from_modules(conv, bn, bn.act).train()
    x = seeded(2, 6, 7, 5, seed=1)
    eager = nn.Sequential(eager_conv, eager_bn).train()
    (eo, eg), (fo, fg) = _run(eager, [eager_conv.weight, eager_bn.weight, eager_bn.bias], x), \
        _run(fused, [conv.weight, bn.weight, bn.bias], x)
    for a, b in zip(eo, fo):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for ga, gb in zip(eg, fg):
        for a, b in zip(ga, gb):
            torch.testing.assert_close(b, a, atol=1e-4 * a.abs().max().item() + 1e-6, rtol=1e-4)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(bn, name), getattr(eager_bn, name), atol=1e-6, rtol=1e-5, msg=name)
    fused.eval()
    eager.eval()
    torch.testing.assert_close(fused(x), eager(x), atol=1e-5, rtol=1e-5)


def test_one_without_an_activation_child_is_a_plain_batch_norm():
    conv, bn = _chain(None)
    assert computes_batch_norm(bn, None)
    ok, why = FusedConvBNAct.supports(conv, bn, nn.SiLU())  # the act after it, as with nn.BatchNorm2d
    assert ok, why


@pytest.mark.parametrize("make, act, match", [
    (lambda: ShiftedBN(6, nn.SiLU()), "own", "bn must be BatchNorm2d"),
    (lambda: DropBN(6, nn.SiLU()), "own", "bn must be BatchNorm2d"),
    (lambda: StatsFrozenBN(6, nn.SiLU()), "own", "bn must be BatchNorm2d"),
    (lambda: BatchNormAct(6, nn.SiLU()), "other", "bn must be BatchNorm2d"),  # applies SiLU, then SiLU again
])
def test_refused_when_the_forward_is_not_the_chain(make, act, match):
    bn = make()
    conv = nn.Conv2d(6, 6, 3, padding=1)
    act_mod = bn.act if act == "own" else nn.SiLU()
    ok, why = FusedConvBNAct.supports(conv, bn, act_mod)
    assert not ok and match in why and type(bn).__name__ in why
    with pytest.raises(TypeError, match=match):
        FusedConvBNAct.from_modules(conv, bn, act_mod)


def test_the_probe_leaves_buffers_flags_and_rng_as_they_were():
    _, bn = _chain(nn.SiLU())
    bn.eval()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    assert computes_batch_norm(bn, bn.act)
    assert torch.equal(torch.rand(3), want)
    assert not bn.training and not bn.act.training
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_inner_activation_names_the_one_non_identity_child():
    assert inner_activation(BatchNormAct(4, nn.GELU()))[0]
    assert inner_activation(BatchNormAct(4))[1] is None
    assert inner_activation(DropBN(4, nn.GELU())) == (False, None)
    assert not computes_batch_norm(nn.Conv2d(2, 2, 1))
