"""Chains a forward runs with gradients off (``torch.no_grad()`` inside it: a frozen encoder, the early cycles of a
recurrent model) save nothing for backward, fused or not: their decisions say so, their bytes stay out of the plan's
figures, which are the step's, and a module called both ways is fused for its calls with gradients."""

from __future__ import annotations

import copy

import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab.measuring import activation_bytes
from tests.fusion._reproducible import assert_trains_as_eager


def _mlp(d: int = 16):
    return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class _Recurrent(nn.Module):
    """A frozen encoder run under no_grad, then one block run three times, the first two without gradients (only
    the last step backpropagates, as HrmText's cycles do)."""

    def __init__(self):
        super().__init__()
        self.encoder, self.block = _mlp().requires_grad_(False), _mlp()

    def forward(self, x):
        with torch.no_grad():
            context = self.encoder(x)
            h = x
            for _ in range(2):
                h = h + self.block(h + context)
        return h + self.block(h + context)


def test_chains_run_without_gradients_save_nothing_and_the_plan_is_the_step():
    torch.manual_seed(0)
    model = _Recurrent().double().train()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    mlps = [d for d in plan.decisions if d.pattern == "linear_gelu_linear"]
    assert len(mlps) == 4 and all(d.fused for d in mlps), plan.summary()  # the encoder's and the block's 3 calls
    quiet = [d for d in mlps if "gradients off" in d.reason]
    assert len(quiet) == 3 and all(d.saved_bytes == 0 for d in quiet)
    (live,) = [d for d in mlps if d not in quiet]
    assert live.modules[0].startswith("block.") and live.saved_bytes > 0
    run = lambda m: m(x).sum()  # noqa: E731
    eager = activation_bytes(lambda: run(model), exclude=tuple(model.parameters()))
    assert plan.activation_bytes == eager
    assert plan.saved_bytes == eager - activation_bytes(lambda: run(fused), exclude=tuple(fused.parameters())) > 0
    assert_trains_as_eager(model, fused, x)


def test_a_region_called_without_gradients_in_training_mode_keeps_that_mode():
    torch.manual_seed(0)
    model = _Recurrent().double().train()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    fused, _ = ol.fusion.fuse(copy.deepcopy(model), (x,))
    with torch.no_grad():  # the traced code switches gradients back to the caller's mode, not on
        assert not fused(x).requires_grad and not torch.is_grad_enabled()
    assert torch.is_grad_enabled() and fused(x).requires_grad


class _Positions(nn.Module):
    """A table computed under ``@torch.no_grad()`` (as rotary embeddings are), traced inline with the model."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.register_buffer("freq", torch.linspace(0.1, 1.0, d))

    @torch.no_grad()
    def forward(self, x):
        table = torch.sin(torch.arange(x.shape[1], dtype=x.dtype)[:, None] * self.freq.to(x.dtype))
        return table.expand(x.shape[0], -1, -1).contiguous()


class _WithTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.positions, self.mlp = _Positions(), _mlp()

    def forward(self, x):
        return x + self.mlp(x + self.positions(x))


def test_a_no_grad_forward_traced_inline_fuses_the_rest():
    torch.manual_seed(0)
    model = _WithTable().double().train()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    assert {d.pattern for d in plan.fused} >= {"linear_gelu_linear", "add_layer_norm"}, plan.summary()
    run = lambda m: m(x).sum()  # noqa: E731
    eager = activation_bytes(lambda: run(model), exclude=tuple(model.parameters()))
    assert plan.saved_bytes == eager - activation_bytes(lambda: run(fused), exclude=tuple(fused.parameters())) > 0
    assert_trains_as_eager(model, fused, x)
