"""GradientStats / GradientTrace: exact octave histograms and fp16/bf16 range fractions."""

import math

import numpy as np
import pytest
import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab.models import EncoderConfig, MaskedTokenTask
from opsnn_lab.precision.grad_stats import EXP_MIN, N_BINS, NONFINITE_BIN, ZERO_BIN, GradientStats, GradientTrace
from opsnn_lab.testing import non_contiguous

FP16_UNDER, FP16_NORMAL, FP16_OVER = 2.0**-24, 2.0**-14, 2.0**16
BF16_UNDER, BF16_NORMAL = 2.0**-133, 2.0**-126


def log_uniform(n, lo, hi, seed=0):
    """Magnitudes spread evenly over octaves lo..hi with random signs (float64 draw, float32 result)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return (mag * sign).float()


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(37, 29))  # odd shape
        self.b = nn.Parameter(torch.zeros(513))
        self.frozen = nn.Parameter(torch.zeros(3), requires_grad=False)


def with_grads(*grads):
    model = Two()
    for p, g in zip((model.a, model.b), grads):
        p.grad = None if g is None else g.reshape(p.shape).clone()
    return model


def ref_floor_log2(x: torch.Tensor) -> np.ndarray:
    v = x.double().abs().numpy()
    v = v[(v > 0) & np.isfinite(v)]
    return np.floor(np.log2(v)).astype(np.int64)


def direct_fractions(g: torch.Tensor, s: float, under: float, normal: float, over: float):
    x = g.double().abs() * s
    nz = x[(x > 0) & torch.isfinite(x)]
    n = max(nz.numel(), 1)
    return ((nz < under).sum().item() / n, ((nz >= under) & (nz < normal)).sum().item() / n,
            (nz >= over).sum().item() / n)


@pytest.mark.parametrize("subnormal", [False, True], ids=["zeros", "zeros+float32-subnormals"])
def test_histogram_bins_are_exact_floor_log2(subnormal):
    a = log_uniform(37 * 29, -60, 30, seed=1)
    a[:5] = torch.tensor([1.0, 2.0**-24, 2.0**-14, 65504.0, 2.0**-140 if subnormal else -(2.0**-126)])
    if subnormal:
        a[9:12] = torch.tensor([2.0**-149, -(2.0**-127), 1.5 * 2.0**-130])
    a[5:8] = 0.0
    a[8] = -0.0
    b = -log_uniform(513, -20, 5, seed=2)
    stats = GradientStats(with_grads(a, b), bins=(-40, 20))
    stats.record(0)
    tr = stats.trace()
    assert tr.names == ["a", "b"]  # frozen parameter left out
    for p, g in enumerate((a, b)):
        e = ref_floor_log2(g)
        ref = np.bincount(e - EXP_MIN, minlength=N_BINS)
        hist = tr.param_hist[0, p]
        assert hist[0] == (e < -40).sum() and hist[-1] == (e >= 20).sum()
        np.testing.assert_array_equal(hist[1:-1], ref[-40 - EXP_MIN:20 - EXP_MIN])
        assert tr.param_zeros[0, p] == (g == 0).sum()
    whole = np.bincount(ref_floor_log2(torch.cat([a, b])) - EXP_MIN, minlength=N_BINS)
    whole[ZERO_BIN] = 4
    np.testing.assert_array_equal(tr.counts[0], whole)
    assert tr.amax[0] == pytest.approx(max(a.abs().max().item(), b.abs().max().item()))
    np.testing.assert_allclose(tr.param_amax[0], [a.abs().max(), b.abs().max()])


@pytest.mark.parametrize("log2_scale", [0, 8, 16, 24, -4])
def test_fractions_at_any_power_of_two_scale_match_direct_computation(log2_scale):
    a, b = log_uniform(37 * 29, -50, 10, seed=3), log_uniform(513, -30, 3, seed=4)
    stats = GradientStats(with_grads(a, b))
    stats.record(0, scale=1.0)
    tr, s = stats.trace(), 2.0**log2_scale
    g = torch.cat([a, b])
    got = tr.fractions(s, "fp16")
    want = direct_fractions(g, s, FP16_UNDER, FP16_NORMAL, FP16_OVER)
    for kind, w in zip(("underflow", "subnormal", "overflow"), want):
        assert got[kind][0] == pytest.approx(w, abs=1e-12), kind
    assert want[0] > 0.01 and (want[2] > 0.01 or log2_scale < 16)  # the cases are not vacuous
    # the overflow flag is the real cast: does g * s hold an inf in fp16?
    assert tr.overflow(s)[0] == bool(torch.isinf((g * s).half()).any())
    layer = tr.layer_fractions(0, scale=s)  # the default display bins keep fp16 exact from 2**-4 to 2**24
    for p, gp in enumerate((a, b)):
        want = direct_fractions(gp, s, FP16_UNDER, FP16_NORMAL, FP16_OVER)
        for kind, w in zip(("underflow", "subnormal", "overflow"), want):
            assert layer[kind][p] == pytest.approx(w, abs=1e-12), (kind, p)


def test_underflow_semantics_match_the_fp16_cast():
    g = log_uniform(4000, -30, -10, seed=5)
    stats = GradientStats(with_grads(g[:37 * 29], g[37 * 29:37 * 29 + 513]))
    stats.record(0)
    flagged = stats.trace().fractions(1.0)["underflow"][0]
    x = torch.cat([stats.params[0].grad.reshape(-1), stats.params[1].grad.reshape(-1)])
    half = x.half().float()
    # below the smallest subnormal the cast leaves two outcomes: zero, or 2**-24 with 1-100% error
    rounded_up = (half.abs() == FP16_UNDER) & (x.abs() < FP16_UNDER)
    flushed = (half == 0).double().mean().item()
    assert 0.05 < flushed < flagged  # every element that flushes to zero is counted as underflow
    assert flagged == pytest.approx(flushed + rounded_up.double().mean().item(), abs=1e-12)


def test_bf16_fractions_and_bf16_gradients():
    a = log_uniform(37 * 29, -140, -120, seed=6)  # straddles the bf16 subnormal range at scale 1
    stats = GradientStats(with_grads(a, torch.ones(513)))
    stats.record(0)
    got = stats.trace().fractions(1.0, "bf16")
    want = direct_fractions(torch.cat([a, torch.ones(513)]), 1.0, BF16_UNDER, BF16_NORMAL, 2.0**128)
    assert got["underflow"][0] == pytest.approx(want[0]) and want[0] > 0.1
    assert got["subnormal"][0] == pytest.approx(want[1]) and want[1] > 0.1
    model = with_grads(None, None).bfloat16()
    model.a.grad = log_uniform(37 * 29, -10, 2).reshape(37, 29).bfloat16()
    stats = GradientStats(model)
    stats.record(3)
    assert stats.trace().counts[0].sum() == 37 * 29  # b has no grad: no elements


def test_fractional_scale_interpolates_between_neighbouring_octaves():
    stats = GradientStats(with_grads(log_uniform(37 * 29, -40, 0), log_uniform(513, -35, -5)))
    stats.record(0)
    tr = stats.trace()
    u = [tr.underflow_fraction(2.0**k)[0] for k in (10, 10.5, 11)]
    assert u[0] > u[1] > u[2]
    assert u[1] == pytest.approx((u[0] + u[2]) / 2, rel=0.2)  # log-uniform data: close to the midpoint


def test_nonfinite_gradients_are_counted_apart_and_overflow_at_any_scale():
    a = log_uniform(37 * 29, -10, 0)
    a[3], a[7] = math.inf, math.nan
    stats = GradientStats(with_grads(a, torch.zeros(513)))
    stats.record(0)
    stats.params[0].grad = torch.ones(37, 29)
    stats.record(1)
    tr = stats.trace()
    assert tr.param_nonfinite[0].tolist() == [2, 0] and tr.param_nonfinite[1].tolist() == [0, 0]
    assert tr.counts[0, NONFINITE_BIN] == 2 and tr.counts[0, ZERO_BIN] == 513
    assert math.isnan(tr.amax[0]) and tr.amax[1] == 1.0
    assert tr.overflow(2.0**-30).tolist() == [True, False]
    assert tr.overflow(2.0**16).tolist() == [True, True]  # 1.0 * 65536 rounds to inf in fp16
    assert tr.overflow(65519.0).tolist() == [True, False]  # largest value that still rounds to 65504
    assert tr.zero_fraction[1] == pytest.approx(513 / (513 + 37 * 29))


def test_non_contiguous_gradients():
    model = with_grads(None, torch.ones(513))
    model.a.grad = non_contiguous(log_uniform(37 * 29, -30, 0).reshape(37, 29))
    stats = GradientStats(model)
    stats.record(0)
    e = ref_floor_log2(model.a.grad)
    assert stats.trace().param_hist[0, 0, 1:-1].sum() == ((e >= -48) & (e < 20)).sum()


def test_callback_records_every_step_of_ol_train_and_reads_the_scaler_scale():
    task = MaskedTokenTask(seq_len=8, batch_size=2)
    model = task.model(EncoderConfig.tiny(hidden=16, intermediate=32, layers=1, heads=2))

    class Scaler:
        scale = 2.0**12

    stats = GradientStats(model, scale=Scaler())
    result = ol.train(model, task, 4, callbacks=[stats], progress=False)
    tr = stats.trace()
    assert len(tr) == 4 and tr.step.tolist() == [0, 1, 2, 3]
    assert tr.scale.tolist() == [2.0**12] * 4
    assert tr.names == [n for n, p in model.named_parameters() if p.requires_grad]
    np.testing.assert_allclose(tr.param_amax.max(1), [max(v[i] for v in result.grad_amax.values()) for i in range(4)],
                               rtol=1e-6)
    every = GradientStats(model, scale=lambda: 8.0, every=2)
    ol.train(model, task, 5, callbacks=[every], progress=False)
    assert every.trace().step.tolist() == [0, 2, 4] and every.trace().scale.tolist() == [8.0] * 3


def test_scaled_gradients_are_divided_back_to_true_gradients():
    a, b = log_uniform(37 * 29, -30, 0, seed=8), log_uniform(513, -10, 2, seed=9)
    plain = GradientStats(with_grads(a, b))
    plain.record(0, scale=2.0**12)
    scaled = GradientStats(with_grads(a * 2.0**12, b * 2.0**12), scale=2.0**12, scaled=True)
    scaled.record(0)
    p, s = plain.trace(), scaled.trace()
    np.testing.assert_array_equal(p.counts, s.counts)
    np.testing.assert_array_equal(p.param_hist, s.param_hist)
    assert p.amax[0] == s.amax[0] and s.scale[0] == 2.0**12
    assert scaled.params[0].grad.abs().max() == (a * 2.0**12).abs().max()  # .grad left untouched
    with pytest.raises(TypeError, match="scaled"):
        GradientStats(Two(), scaled=1)


def test_by_module_merges_parameters_of_one_module():
    task = MaskedTokenTask(seq_len=8, batch_size=2)
    model = task.model(EncoderConfig.tiny(hidden=16, intermediate=32, layers=1, heads=2))
    stats = GradientStats(model)
    ol.train(model, task, 2, callbacks=[stats], progress=False)
    tr = stats.trace()
    mod = tr.by_module()
    assert "layers.0.mlp.fc1" in mod.names and len(mod.names) < len(tr.names)
    i = mod.names.index("layers.0.mlp.fc1")
    parts = [tr.names.index("layers.0.mlp.fc1.weight"), tr.names.index("layers.0.mlp.fc1.bias")]
    np.testing.assert_array_equal(mod.param_hist[:, i], tr.param_hist[:, parts].sum(1))
    np.testing.assert_array_equal(mod.param_amax[:, i], tr.param_amax[:, parts].max(1))
    assert mod.param_numel[i] == 16 * 32 + 32 and mod.param_numel.sum() == tr.param_numel.sum()
    np.testing.assert_array_equal(mod.counts, tr.counts)  # the whole-model view is unchanged


def test_save_load_roundtrip(tmp_path):
    stats = GradientStats(with_grads(log_uniform(37 * 29, -30, 0), None), bins=(-30, 10))
    for step in range(3):
        stats.record(step, scale=2.0**step)
    tr = stats.trace()
    back = GradientTrace.load(stats.save(tmp_path / "trace.npz"))
    assert back.names == tr.names and back.bins == (-30, 10)
    for k in ("step", "scale", "counts", "amax", "param_hist", "param_amax", "param_zeros", "param_nonfinite"):
        np.testing.assert_array_equal(getattr(back, k), getattr(tr, k))
    np.testing.assert_array_equal(back.underflow_fraction(2.0**5), tr.underflow_fraction(2.0**5))
    with pytest.raises(ValueError, match="path"):
        tr.save(tmp_path / "trace.json")
    np.savez(tmp_path / "other.npz", x=np.zeros(2))
    with pytest.raises(ValueError, match="path"):
        GradientTrace.load(tmp_path / "other.npz")


def test_empty_trace_and_reset():
    stats = GradientStats(Two())
    tr = stats.trace()
    assert len(tr) == 0 and tr.overflow(1.0).shape == (0,) and tr.underflow_fraction().shape == (0,)
    stats.params[0].grad = torch.ones(37, 29)
    stats.record(0)
    assert len(stats) == 1
    stats.reset()
    assert len(stats) == 0


def test_bad_arguments_name_the_argument():
    with pytest.raises(TypeError, match="model"):
        GradientStats("not a model")
    with pytest.raises(ValueError, match="model"):
        GradientStats(nn.ReLU())
    for bins in [(20, -40), (-40,), (-200, 0), (-40.0, 20)]:
        with pytest.raises(ValueError, match="bins"):
            GradientStats(Two(), bins=bins)
    with pytest.raises(ValueError, match="scale"):
        GradientStats(Two(), scale=0.0)
    with pytest.raises(ValueError, match="every"):
        GradientStats(Two(), every=0)
    stats = GradientStats(Two())
    with pytest.raises(ValueError, match="scale"):
        stats.record(0, scale=math.inf)
    with pytest.raises(ValueError, match="step"):
        stats.record(-1)
    stats.record(0)
    with pytest.raises(ValueError, match="fmt"):
        stats.trace().fractions(1.0, "fp8")
    with pytest.raises(ValueError, match="scale"):
        stats.trace().overflow(-1.0)


def test_events_and_from_amax_feed_the_scaler_replay():
    from opsnn_lab.precision import DynamicScaler

    a = log_uniform(37 * 29, -20, -2, seed=7)
    stats = GradientStats(with_grads(a, torch.ones(513) * 2.0**-3))
    stats.record(0)
    stats.params[0].grad[0, 0] = math.inf
    stats.record(1)
    tr = stats.trace()
    events = tr.events()
    assert events[0] == pytest.approx(a.abs().max().item()) and math.isnan(events[1])
    assert DynamicScaler(init_scale=2.0**16).replay(events)["overflow"] == [False, True]
    assert tr.max_safe_scale()[0] == pytest.approx(65520.0 / events[0]) and tr.max_safe_scale()[1] == 0.0
    # a trace rebuilt from the amax sequence replays identically and puts one element at each amax
    back = GradientTrace.from_amax(tr.amax)
    assert back.events()[0] == events[0] and back.nonfinite.tolist() == [False, True]
    assert back.counts[0, int(np.floor(np.log2(events[0]))) - EXP_MIN] == 1
    with pytest.raises(ValueError, match="counts"):
        GradientTrace.from_amax([1.0, 2.0], counts=np.zeros((3, N_BINS)))


def test_a_sparse_gradient_is_histogrammed_as_the_dense_one_it_stands_for():
    """``nn.Embedding(sparse=True)``: its gradient is a sparse tensor; the rows no index drew count as zeros."""
    torch.manual_seed(0)
    emb = nn.Embedding(40, 6, sparse=True)
    emb(torch.tensor([[1, 3, 3, 7]])).square().sum().backward()
    assert emb.weight.grad.is_sparse
    dense = nn.Embedding(40, 6)
    dense.weight.grad = emb.weight.grad.to_dense()
    traces = []
    for m in (emb, dense):
        stats = GradientStats(m)
        stats.record(0)
        traces.append(stats.trace())
    np.testing.assert_array_equal(traces[0].param_hist, traces[1].param_hist)
    assert traces[0].zero_fraction[0] == pytest.approx(37 / 40)
