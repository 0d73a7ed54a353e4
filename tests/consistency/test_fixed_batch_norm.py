"""strict()'s batch norm: at 2 threads the bits aten gives at one, outputs, running statistics and every gradient,
for the layouts aten reduces per thread (``(N, C)``, ``(N, C, L)``, channels-last) and the contiguous map; within
fp32 tolerance of the default mode; no running statistics, no affine, eval mode, empty batch and a double
backward as aten handles them."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from opsnn_lab.consistency.strict import strict
from opsnn_lab.testing import seeded, threads

# (module, input shape): rows enough that aten splits the channel reductions over threads
CASES = {
    "bn1d_rows": (lambda: nn.BatchNorm1d(24), (4099, 24)),
    "bn1d_sequence": (lambda: nn.BatchNorm1d(16), (37, 16, 129)),
    "bn2d_channels_last": (lambda: nn.BatchNorm2d(12), (9, 12, 31, 29)),
    "bn2d_contiguous": (lambda: nn.BatchNorm2d(12), (9, 12, 31, 29)),
    "no_stats_no_affine": (lambda: nn.BatchNorm1d(24, affine=False, track_running_stats=False), (4099, 24)),
}


def _step(case, *, strict_on, n_threads=1, train=True):
    make, shape = CASES[case]
    torch.manual_seed(0)
    bn = make().train(train)
    if bn.affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    x = seeded(*shape, seed=3, scale=3.0).add_(1.0)
    if case.endswith("channels_last"):
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    with threads(n_threads), (strict() if strict_on else nullcontext()):
        y = bn(x)
        y.backward(seeded(*y.shape, seed=7))
    stats = [bn.running_mean, bn.running_var] if bn.track_running_stats else []
    return [y.detach(), x.grad, *stats, *(p.grad for p in bn.parameters())]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", list(CASES))
def test_batch_norm_keeps_its_bits_at_any_thread_count_and_matches_aten(case, train):
    if not train and case == "no_stats_no_affine":
        pytest.skip("without running statistics, eval mode normalises with the batch's: the train case")
    one = _step(case, strict_on=True, n_threads=1, train=train)
    two = _step(case, strict_on=True, n_threads=2, train=train)
    native = _step(case, strict_on=False, n_threads=2, train=train)
    assert len(one) == len(two) == len(native) >= 2
    for a, b, c in zip(one, two, native):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5 * max(1.0, c.abs().max().item()))


def test_an_empty_batch_and_a_double_backward_behave_as_aten():
    bn = nn.BatchNorm1d(5, track_running_stats=False)
    empty = torch.zeros(0, 5, 7)
    with strict():
        assert bn.eval()(empty).shape == (0, 5, 7)
    x = seeded(64, 5, seed=1).requires_grad_()
    outs = []
    for strict_on in (True, False):
        with strict() if strict_on else nullcontext():
            (g,) = torch.autograd.grad(bn.train()(x).pow(3).sum(), x, create_graph=True)
            (gg,) = torch.autograd.grad(g.square().sum(), x)
        outs.append((g.detach(), gg))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))
