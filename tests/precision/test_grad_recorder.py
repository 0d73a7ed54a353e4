"""GradientRecorder: hooks fill the same GradientTrace as GradientStats.record after each backward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from opsnn_lab.precision import GradientRecorder, GradientStats


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 3))


def _loop(model, steps, accumulate=1, scale=1.0):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _ in range(accumulate):
            (model(torch.randn(4, 5, generator=g)).pow(2).mean() * scale).backward()
        yield
        opt.step()
        opt.zero_grad()


def test_a_plain_loop_records_what_gradient_stats_records_by_hand():
    a, b = _model(), _model()
    rec = GradientRecorder(a)
    manual = GradientStats(b)
    for step, _ in enumerate(zip(_loop(a, 3), _loop(b, 3))):
        manual.record(step)
    got, want = rec.trace(), manual.trace()
    assert len(got) == 3 and list(got.step) == [0, 1, 2]
    for field in ("counts", "amax", "param_hist", "param_amax", "param_zeros", "param_nonfinite"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)


def test_gradient_accumulation_records_the_complete_gradient_once_per_step():
    a, b = _model(), _model()
    rec = GradientRecorder(a, every=2)
    manual = GradientStats(b)
    for step, _ in enumerate(zip(_loop(a, 2, accumulate=2), _loop(b, 2, accumulate=2))):
        manual.record(step)
    assert rec.backwards == 4 and len(rec) == 2
    np.testing.assert_array_equal(rec.trace().param_amax, manual.trace().param_amax)


def test_scaled_gradients_are_divided_back_and_pause_remove_work():
    model = _model()
    rec = GradientRecorder(model, scale=lambda: 1024.0, scaled=True)
    list(_loop(model, 1, scale=1024.0))  # backward of a loss scaled by 2**10
    plain = _model()
    ref = GradientRecorder(plain)
    list(_loop(plain, 1))
    np.testing.assert_array_equal(rec.trace().param_amax, ref.trace().param_amax)
    rec.pause()
    list(_loop(model, 1))
    assert len(rec) == 1
    rec.resume()
    rec.remove()
    list(_loop(model, 1))
    assert len(rec) == 1


def test_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        GradientRecorder("model")
    with pytest.raises(ValueError, match="every"):
        GradientRecorder(_model(), every=0)
    with pytest.raises(ValueError, match="bins"):
        GradientRecorder(_model(), bins=(3, 1))
