"""``opsnn_lab._randomness``: which fx calls draw, and the helpers that key them, inert outside a reproducible forward
(the keyed behaviour itself: ``tests/consistency/test_fused_reproducible.py``)."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab import _randomness


class Draws(nn.Module):
    def forward(self, x):
        y = x.new_empty(x.shape).bernoulli_(0.5) + torch.rand_like(x) + F.dropout(x, 0.1)
        y = y + torch.randn(3, device=x.device) + x.uniform_(0, 1) + x.tanh()
        return y + F.scaled_dot_product_attention(x, x, x)


def test_draws_random_knows_the_calls_fx_records():
    gm = fx.symbolic_trace(Draws())
    drawing = sorted(str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes
                     if _randomness.draws_random(n.op, n.target))
    assert drawing == ["bernoulli_", "dropout", "rand_like", "randn", "scaled_dot_product_attention", "uniform_"]
    assert {"bernoulli_", "uniform_", "normal_", "exponential_", "bernoulli"} <= _randomness.RANDOM_METHODS
    assert not _randomness.draws_random("call_method", "tanh")
    assert not _randomness.draws_random("call_module", "bernoulli_")


def test_outside_a_reproducible_forward_the_helpers_do_nothing():
    assert _randomness.running() is None
    assert _randomness.functional_seed("block:dropout.0") is None
    _randomness.enter_module("block", torch.ones(1))  # no stack to push on: nothing happens, nothing raises
    _randomness.exit_module(torch.ones(1))


def test_inside_one_the_running_mode_keys_an_absorbed_call_by_its_module_and_index():
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append([_randomness.functional_seed("inner:dropout.0") for _ in range(2)])
            return F.dropout(x, 0.5, self.training)

    model = nn.Sequential(Probe()).train()
    ol.consistency.make_reproducible(model, 3)
    model(torch.ones(4))
    pool = ol.consistency.SeedPool(3)
    # the module at "inner" took indices 0 and 1 of step 0; the Probe's own F.dropout keeps "0:dropout.0"
    assert seen == [[pool.seed_for("inner:dropout.0", 0), pool.seed_for("inner:dropout.1", 0)]]
    assert _randomness.running() is None  # the forward's mode is gone after it
