"""``make_reproducible`` under ``torch.compile``: the masks of the eager run, and one set of graphs for every
step. A counter stream's step and a functional call's key live in Python; traced, each step's seed was a new
graph (the recompile limit hit by the 4th step, and every dropout frame left to run uncompiled after it). The
draws are opaque to Dynamo now (``_opaque.opaque_to_compile``): the graph breaks around them instead."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab.consistency import get_step, make_reproducible
from opsnn_lab.testing import seeded

dynamo = pytest.importorskip("torch._dynamo")


class Block(nn.Module):
    """Every kind of draw: a dropout module, an inline ``F.dropout``, SDPA's dropout, a drop path (``torch.rand``)."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.drop, self.fc2 = nn.Linear(d, 2 * d), nn.Dropout(0.2), nn.Linear(2 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)
        x = x + F.dropout(self.out(a.transpose(1, 2).reshape(b, t, d)), 0.1, self.training)
        keep = (torch.rand(b, 1, 1) > 0.2).to(x.dtype) / 0.8 if self.training else 1.0
        return x + keep * self.fc2(self.drop(F.gelu(self.fc1(x))))


def _train(model, x, steps, compiled):
    run = torch.compile(model, backend="eager") if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, graphs = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = run(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        graphs.append(dynamo.utils.counters["stats"]["unique_graphs"])
    return torch.stack(losses), graphs


@pytest.mark.parametrize("functional", [True, False], ids=["functional", "modules_only"])
def test_a_compiled_reproducible_model_draws_the_eager_masks_with_one_set_of_graphs(functional):
    torch.manual_seed(0)
    base, x = nn.Sequential(Block(), Block()).train(), seeded(2, 5, 16, seed=1)
    runs = {}
    for compiled in (False, True):
        dynamo.reset()
        dynamo.utils.counters.clear()
        model = make_reproducible(copy.deepcopy(base), seed=4, functional=functional)
        torch.manual_seed(9)  # torch's own stream, for the modules_only run's functional draws
        runs[compiled] = _train(model, x, 6, compiled)
        assert get_step(model) == 6
    (eager, _), (compiled, graphs) = runs[False], runs[True]
    if functional:  # every draw keyed: the compiled run's masks are the eager run's
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-7)
    assert graphs[1] > 0 and graphs[-1] == graphs[1]  # nothing compiled after the second step
