"""The precision demos notebook 02 calls: scaled training loops, naive low-precision weights, update cosine,
2-rank all-reduce error table."""

import copy
import math

import pytest
import torch

from opsnn_lab.demos.precision import (
    RoundWeights,
    allreduce_demo,
    allreduce_errors,
    flat_weights,
    train_scaled,
    update_cosine,
)
from opsnn_lab.models import EncoderConfig, MaskedTokenTask
from opsnn_lab.precision import DynamicScaler, GradientStats, MasterWeightOptimizer


@pytest.fixture
def setup():
    torch.manual_seed(0)
    task = MaskedTokenTask(vocab_size=32, seq_len=8, batch_size=2)
    model = task.model(EncoderConfig.tiny(hidden=16, intermediate=32, layers=1, heads=2, dropout=0.0,
                                          attn_dropout=0.0))
    return task, model


def test_train_scaled_with_dynamic_scaler_skips_overflowing_steps_and_records_true_grads(setup):
    task, model = setup
    scaler = DynamicScaler(init_scale=2.0**24, growth_interval=100)  # far above what fp16 grads can hold
    opt = MasterWeightOptimizer(model, lr=1e-3, scaler=scaler, grad_dtype=torch.float16)
    stats = GradientStats(model, scale=scaler, scaled=True)
    before = flat_weights(model)
    res = train_scaled(model, task, 12, optimizer=opt, scaler=scaler, callbacks=[stats], progress=False)
    assert len(res.losses) == 12 and all(math.isfinite(v) for v in res.losses)
    skipped, scale = res.extras["skipped"], res.extras["scale"]
    assert skipped[0] and scale[0] == 2.0**24 and not skipped[-1]
    for i in range(11):  # every skipped (overflowing) step halves the scale; an applied one keeps it
        assert scale[i + 1] == scale[i] * (0.5 if skipped[i] else 1.0)
    assert sum(skipped) == opt.skipped_steps
    assert not torch.equal(before, flat_weights(model))
    tr = stats.trace()
    assert tr.scale.tolist() == scale  # the stats read the scale each step used
    assert (tr.amax < 1e3).all()  # the scale was divided out: true gradients, not g * 2**24


def test_train_scaled_with_gradscaler_and_fp16_grads(setup):
    task, model = setup
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=100)
    res = train_scaled(model, task, 5, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), scaler=gs,
                       grad_dtype=torch.float16, progress=False)
    assert res.extras["skipped"][0] and res.extras["scale"][:2] == [2.0**24, 2.0**23]
    # the replay of GradScaler's skips through DynamicScaler with the same policy gives its scales
    same = DynamicScaler(init_scale=2.0**24, growth_interval=100, underflow_threshold=None)
    assert same.replay(res.extras["skipped"])["scale"] == res.extras["scale"]
    with pytest.raises(TypeError, match="scaler"):
        train_scaled(model, task, 1, optimizer=None, scaler=object())


def test_round_weights_stores_weights_in_low_precision(setup):
    _, model = setup
    for dtype in (torch.float16, torch.bfloat16):
        m = copy.deepcopy(model)
        RoundWeights(dtype).on_step_end(0, m, 0.0)
        w = flat_weights(m)
        assert torch.equal(w, w.to(dtype).float()) and not torch.equal(w, flat_weights(model))
    with pytest.raises(ValueError, match="dtype"):
        RoundWeights(torch.float32)


def test_update_cosine():
    a, b = torch.zeros(4), torch.tensor([1.0, 2.0, 0.0, -1.0])
    assert update_cosine(a, b, a, 3 * b) == pytest.approx(1.0)
    assert update_cosine(a, b, a, -b) == pytest.approx(-1.0)
    assert update_cosine(a, torch.tensor([0.0, 0.0, 1.0, 0.0]), a, b) == pytest.approx(0.0)
    assert math.isnan(update_cosine(a, a, a, b))
    with pytest.raises(ValueError, match="shape"):
        update_cosine(a, b, a, torch.zeros(3))
    with pytest.raises(ValueError, match="params"):
        flat_weights([])


@pytest.mark.distributed
@pytest.mark.slow
def test_allreduce_demo_two_ranks():
    errors = allreduce_errors(allreduce_demo(magnitudes=(1e-9, 1e5), world_size=2, numel=256))
    assert set(errors) == {"fp32", "torch fp16_compress_hook", "fp16_allreduce_hook"}
    assert all(set(per_mag) == {1e-9, 1e5} for per_mag in errors.values())
    assert max(errors["fp32"].values()) < 1e-6
    assert errors["torch fp16_compress_hook"][1e-9] == 1.0  # flushed to zero
    assert errors["torch fp16_compress_hook"][1e5] == math.inf  # overflowed
    assert max(errors["fp16_allreduce_hook"].values()) < 2.0**-10  # within fp16 precision


def test_allreduce_errors_from_a_report():
    # built by hand: the table is max |got - exact| / max |exact| per hook, inf where a result is not finite
    exact = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)
    report = {1.0: {"exact": exact, "fp32": exact.float(), "stock_fp16": torch.tensor([1.0, -2.0, math.inf]),
                    "opsnn_fp16": torch.tensor([1.0, -2.0, 4.5])},
              1e-9: {"exact": exact * 1e-9, "fp32": (exact * 1e-9).float(), "stock_fp16": torch.zeros(3),
                     "opsnn_fp16": (exact * 1e-9).float()}}
    errors = allreduce_errors(report)
    assert errors["fp32"][1.0] == 0.0
    assert errors["torch fp16_compress_hook"][1.0] == math.inf
    assert errors["fp16_allreduce_hook"][1.0] == pytest.approx(0.5 / 4.0)
    assert errors["torch fp16_compress_hook"][1e-9] == 1.0  # everything flushed to zero
    assert errors["fp16_allreduce_hook"][1e-9] == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(TypeError, match="report"):
        allreduce_errors([report])
