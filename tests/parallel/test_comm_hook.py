"""``fp16_allreduce_hook`` under a loss scaler: the fp16 payload is all it sends, and an overflow reaches the sum."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from opsnn_lab.parallel.wrap import wrap_model
from opsnn_lab.precision import DynamicScaler


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 5))


def _collectives(monkeypatch):
    seen = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        seen.append((tensor.dtype, tensor.numel()))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting)
    return seen


@pytest.mark.parametrize("scaled", [True, False])
def test_hook_sends_only_the_fp16_payload_under_a_scaler(world_of_one, monkeypatch, scaled):
    scaler = DynamicScaler() if scaled else None
    ref = _model()
    ddp, state = wrap_model(_model(), "ddp", fp16_hook=True, scaler=scaler)
    x = torch.randn(7, 12)
    seen = _collectives(monkeypatch)
    (ddp(x).square().mean() * 1024).backward()
    (ref(x).square().mean() * 1024).backward()
    numel = sum(p.numel() for p in ref.parameters())
    payload = [(torch.float16, numel)]
    assert seen == payload if scaled else seen == [(torch.float32, 2), *payload]  # adaptive: [amax, fault] first
    assert state.bytes_reduced * 2 == state.bytes_fp32 == 4 * numel and state.calls == 1
    for p, q in zip(ddp.parameters(), ref.parameters()):  # fp16 rounding of the sent values, nothing more
        torch.testing.assert_close(p.grad, q.grad, rtol=2**-10, atol=1e-6)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 1e6])
def test_a_non_finite_or_too_large_gradient_arrives_non_finite(world_of_one, bad):
    """What every rank receives: the inf/NaN (or fp16 overflow) survives the sum, so every rank's scaler skips."""
    ddp, _ = wrap_model(_model(), "ddp", fp16_hook=True, scaler=DynamicScaler())
    first = next(ddp.parameters())
    first.register_hook(lambda g: g.flatten().index_fill(0, torch.tensor([3]), bad).view_as(g))
    ddp(torch.randn(7, 12)).sum().backward()
    assert not torch.isfinite(first.grad.flatten()[3])
    assert torch.isfinite(first.grad.flatten()[:3]).all()
