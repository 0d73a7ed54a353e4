"""ol.train's switchboard: fuse, precision, seed, strict and record each do what they say."""

from __future__ import annotations

import pytest
import torch

import opsnn_lab as ol
from opsnn_lab.models import EncoderConfig, MaskedTokenTask

TASK = MaskedTokenTask(vocab_size=32, seq_len=16, batch_size=4)


def _model(**kw):
    torch.manual_seed(0)
    return TASK.model(EncoderConfig.tiny(hidden=32, intermediate=64, **kw))


def test_fuse_trains_the_fused_copy_and_keeps_the_plan():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = ol.train(model, TASK, steps=2, fuse=True)
    plan = result.extras["fusion_plan"]
    assert any(d.fused for d in plan.decisions)
    assert result.model is not model
    assert set(result.model.state_dict()) == set(before)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), "original untouched"


def test_fp16_master_routes_grads_through_the_scaler():
    result = ol.train(_model(), TASK, steps=3, precision="fp16-master")
    history = result.extras["scaler_history"]
    assert len(history) == 3
    assert all(p.dtype == torch.float32 for p in result.model.parameters())  # CPU: fp32 compute
    assert all(all(a < 1e3 for a in series) for series in result.grad_amax.values()), "amax is unscaled"


def test_bf16_master_casts_the_model():
    result = ol.train(_model(), TASK, steps=2, precision="bf16-master")
    assert all(p.dtype == torch.bfloat16 for p in result.model.parameters())
    assert all(torch.isfinite(torch.tensor(result.losses)))


def test_fp32_and_bf16_autocast_agree_roughly():
    a = ol.train(_model(dropout=0.0, attn_dropout=0.0), TASK, steps=2)
    b = ol.train(_model(dropout=0.0, attn_dropout=0.0), TASK, steps=2, precision="bf16")
    assert a.losses[0] == pytest.approx(b.losses[0], rel=2e-2)


def test_seed_makes_two_runs_identical_with_dropout():
    a = ol.train(_model(), TASK, steps=3, seed=7)
    b = ol.train(_model(), TASK, steps=3, seed=7)
    assert a.losses == b.losses


def test_strict_runs_and_restores():
    from opsnn_lab.consistency import is_strict

    ol.train(_model(), TASK, steps=1, strict=True)
    assert not is_strict()


def test_record_keeps_what_the_widgets_need():
    result = ol.train(_model(), TASK, steps=2, record=True, precision="fp16-master")
    assert {"gradient_stats", "consistency", "scaler_history"} <= set(result.extras)
    assert result.extras["consistency"].reference is not None


@pytest.mark.parametrize("kwargs, err, word", [
    (dict(precision="fp8"), ValueError, "precision"),
    (dict(fuse=1), TypeError, "fuse"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(precision="fp16-master", optimizer=torch.optim.SGD), ValueError, "optimizer"),
])
def test_bad_switchboard_arguments(kwargs, err, word):
    with pytest.raises(err, match=word):
        ol.train(_model(), TASK, steps=1, **kwargs)
