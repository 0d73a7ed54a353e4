"""A module of a fused chain or region in another mode than its host: a frozen BatchNorm, a Dropout switched off
or kept on (Monte Carlo dropout).

A fused op ran in its host's mode: a BatchNorm frozen in eval mode inside a training model (detection and
segmentation fine-tuning) was normalised with the batch's statistics and updated its running ones (3.6 apart
from eager on two Conv -> BN -> act chains, float64); a Dropout set to eval in a training model still dropped
(0.33 apart), and one kept training in an eval model (MC dropout) did not. A chain's op now runs in the mode of its
modules whose forward depends on it (Dropout, BatchNorm), in a region too (a fused op there takes over the mode of
the modules it absorbed); a region's traced code, which holds one mode for every other module it runs inline, runs
unfused while one of those is in another mode than the region.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.bench import activation_bytes
from opsnn_lab.fusion.staleness import op_mode
from opsnn_lab.models import Encoder, EncoderConfig
from opsnn_lab.testing import seeded


class ConvNormAct(nn.Module):
    """One module computing exactly Conv -> BN -> SiLU (fused whole: module:whole)."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.silu(self.bn(self.conv(x)))


def _backbone():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), ConvNormAct(8, 8))


def _grads(model, x):
    out = model(x)
    grads = torch.autograd.grad(out.square().sum(), [p for p in model.parameters() if p.requires_grad])
    return out, grads


def _same(model, fused, x):
    (want, want_grads), (got, got_grads) = _grads(model, x), _grads(fused, x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    for (name, b), (_, c) in zip(model.named_buffers(), fused.named_buffers(), strict=True):
        torch.testing.assert_close(c, b, rtol=1e-12, atol=1e-12, msg=name)


def test_frozen_batch_norms_in_a_training_model_stay_fused_and_compute_what_eager_does():
    torch.manual_seed(0)
    model, x = _backbone().double().train(), seeded(4, 3, 12, 12, dtype=torch.float64)
    model(x)  # running statistics that are not the batch's
    fused, plan = ol.fusion.fuse(model, (x,))
    assert sorted(d.route for d in plan.fused) == ["module:chain", "module:whole"], plan.decisions
    for m in (model, fused):
        for bn in (m[1], m[3].bn):
            bn.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(2):
            _same(model, fused, x)
        assert activation_bytes(lambda: fused(x)) < activation_bytes(lambda: model(x))
    for m in (model, fused):
        m.train()  # unfrozen again: batch statistics, running ones updated
    _same(model, fused, x)


def _mlp():
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.5), nn.Linear(32, 8))


def test_a_dropout_switched_off_in_a_training_model_keeps_its_chain_fused_without_dropping():
    torch.manual_seed(0)
    model, x = _mlp().double().train(), seeded(6, 8, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model, (x,))
    assert [d.pattern for d in plan.fused] == ["linear_gelu_dropout_linear"]
    for m in (model, fused):
        m[2].eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _same(model, fused, x)
        assert activation_bytes(lambda: fused(x)) < activation_bytes(lambda: model(x))


def test_monte_carlo_dropout_in_an_eval_model_drops_as_eager_does():
    """``model.eval()`` with the Dropouts kept training: under ``make_reproducible`` fused and eager draw the same
    masks, so they agree bit for bit, and both differ from the model without dropout."""
    torch.manual_seed(0)
    model, x = _mlp().double().train(), seeded(6, 8, dtype=torch.float64)
    fused, _ = ol.fusion.fuse(model, (x,))
    outs = []
    for m in (model, fused):
        m.eval()
        plain = m(x)
        m[2].train()
        ol.consistency.make_reproducible(m, seed=3)
        outs.append((m(x), plain))
    (want, plain), (got, _) = outs
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(want, plain)


class BasicBlock(nn.Module):
    """A residual block whose ReLU runs twice (as torchvision's): its Conv -> BN -> ReLU is fused in an fx region."""

    def __init__(self, c=8):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + x)


def test_a_frozen_batch_norm_a_fused_op_takes_over_keeps_its_region_fused():
    """Before, the region ran unfused while a BatchNorm its Conv -> BN -> ReLU op absorbed was in eval mode."""
    torch.manual_seed(0)
    model, x = BasicBlock().double().train(), seeded(2, 8, 6, 6, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model, (x,))
    assert [(d.pattern, d.route) for d in plan.fused] == [("conv_bn_relu", "fx:<model>")], plan.decisions
    (op,) = ol.fusion.patch.fused_ops(fused)
    calls = []
    op.register_forward_pre_hook(lambda m, args: calls.append(m.training))
    for frozen in (True, False):  # frozen (detection fine-tuning), then training again
        for m in (model, fused):
            for bn in (m.bn1, m.bn2):
                bn.train(not frozen)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # fused, no warning
            _same(model, fused, x)
        assert calls[-1] is not frozen and fused.bn1.num_batches_tracked == model.bn1.num_batches_tracked
    assert len(calls) == 2


def test_a_region_runs_unfused_while_a_module_it_runs_inline_is_in_another_mode():
    torch.manual_seed(0)
    model = Encoder(EncoderConfig.tiny(layers=1)).double().train()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    fused, plan = ol.fusion.fuse(model, (ids,))
    assert any(d.route == "fx:layers.0" for d in plan.fused)
    for m in (model, fused):
        for sub in m.modules():
            if isinstance(sub, nn.Dropout):
                sub.eval()  # dropout off, the rest training: deterministic
    # the attention op takes over its dropout's mode: still fused, without a word
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _same(model, fused, ids)
        fused_bytes = activation_bytes(lambda: fused(ids))
        assert fused_bytes < activation_bytes(lambda: model(ids))
    for m in (model, fused):  # a module the code runs inline itself (its forward may read its flag)
        m.layers[0].attention.eval()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", RuntimeWarning)
        _same(model, fused, ids)
    said = [str(w.message) for w in seen if "changed after the region `layers.0`" in str(w.message)]
    assert said and "`layers.0.attention` changed" in said[0], said
    assert "(in eval mode, where the fused code runs it in training mode)" in said[0], said
    for m in (model, fused):
        m.train()
        for sub in m.modules():
            if isinstance(sub, nn.Dropout):
                sub.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert activation_bytes(lambda: fused(ids)) == fused_bytes  # back in one mode: fused


@pytest.mark.parametrize(("modes", "want"), [
    ((True, True, True), (True, None)),
    ((False, True, False), (True, None)),  # the Linear host's flag does not matter: the Dropout's does
    ((True, False, True), (False, None)),
    ((True, False, True, True), (False, 3)),  # a BatchNorm frozen beside a training Dropout: one op cannot run both
])
def test_op_mode_follows_the_modules_whose_forward_depends_on_it(modes, want):
    modules = [nn.Linear(2, 2), nn.Dropout(0.1), nn.GELU(), nn.BatchNorm1d(2)][:len(modes)]
    if len(modes) == 3:
        modules = modules[:3]
    for m, mode in zip(modules, modes):
        m.train(mode)
    assert op_mode(modules) == want
    assert op_mode([nn.Linear(2, 2).train(False), nn.GELU()]) == (False, None)  # none depends on it: the host's
