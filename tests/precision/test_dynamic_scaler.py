import copy
import math
import random

import pytest
import torch
from torch import nn

from opsnn_lab.precision import FP16_MIN, DynamicScaler, MasterWeightOptimizer
from opsnn_lab.precision.dynamic_scaler import ScalerPinnedError

INF = float("inf")


# ---------------------------------------------------------------- the seed's adjust rule
def test_adjust_seed_semantics():
    s = DynamicScaler(init_scale=2.0**16, growth_factor=2.0)
    assert s.adjust(torch.tensor([1.0, INF])) is False and s.scale == 2.0**15
    assert s.adjust(torch.tensor([1.0, float("nan")])) is False and s.scale == 2.0**14
    assert s.adjust(torch.tensor([FP16_MIN / 2])) is False and s.scale == 2.0**15
    assert s.adjust(torch.tensor([FP16_MIN, -3.0])) is True and s.scale == 2.0**15
    assert s.factor == 2.0
    assert [r["skipped"] for r in s.history] == [True, True, True, False]


def test_adjust_threshold_none_and_custom_backoff():
    s = DynamicScaler(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.5, underflow_threshold=None)
    assert s.adjust(torch.zeros(3)) is True and s.scale == 1024.0
    assert s.adjust(torch.tensor([INF])) is False and s.scale == 512.0
    t = DynamicScaler(init_scale=1024.0, growth_factor=4.0)
    assert t.backoff_factor == 0.25 and (t.adjust(torch.tensor([INF])), t.scale) == (False, 256.0)


def test_adjust_accepts_model_and_names_bad_parameters():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    model(torch.ones(1, 3)).sum().backward()
    model[1].bias.grad[0] = float("nan")
    s = DynamicScaler()
    assert s.adjust(model) is False
    assert s.history[0]["nonfinite"] == ["1.bias"]
    assert s.adjust({"a": torch.ones(2), "b": torch.tensor([INF])}) is False
    assert s.history[1]["nonfinite"] == ["b"]


def test_adjust_clamps_to_min_and_max_scale():
    s = DynamicScaler(init_scale=4.0, min_scale=2.0, max_scale=8.0, min_scale_patience=100)
    for _ in range(3):
        s.adjust(torch.tensor([INF]))
    assert s.scale == 2.0
    for _ in range(3):
        s.adjust(torch.tensor([0.0]))
    assert s.scale == 8.0


# ---------------------------------------------------------------- GradScaler parity
def _drive(scale_loss, scaler_step, scaler_update, get_scale, pattern):
    p = nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=1.0)
    scales, stepped = [], []
    for bad in pattern:
        scales.append(float(get_scale()))
        before = p.detach().clone()
        opt.zero_grad()
        scale_loss((p * torch.arange(4.0)).sum() * (INF if bad else 1.0)).backward()
        scaler_step(opt)
        scaler_update()
        stepped.append(not torch.equal(before, p.detach()))
    return scales, stepped


@pytest.mark.parametrize("growth, backoff, interval", [(2.0, 0.5, 3), (2.0, 0.25, 1), (1.5, 0.7, 2)])
def test_matches_torch_gradscaler(growth, backoff, interval):
    rng = random.Random(0)
    pattern = [rng.random() < 0.3 for _ in range(200)]
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_factor=growth, backoff_factor=backoff,
                               growth_interval=interval)
    ours = DynamicScaler(init_scale=2.0**16, growth_factor=growth, backoff_factor=backoff, growth_interval=interval,
                         hysteresis=1, underflow_threshold=None, min_scale=2.0**-100, max_scale=math.inf)
    ref_scales, ref_stepped = _drive(ref.scale, ref.step, ref.update, ref.get_scale, pattern)
    our_scales, our_stepped = _drive(ours.scale_loss, ours.step, ours.update, lambda: ours.scale, pattern)
    assert our_scales == ref_scales
    assert our_stepped == ref_stepped
    assert ours.history.skipped_steps == [i for i, b in enumerate(pattern) if b]


def test_hysteresis_backs_off_only_after_n_overflows():
    s = DynamicScaler(init_scale=1024.0, hysteresis=3, growth_interval=2, underflow_threshold=None)
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    seq = []
    for bad in [True, True, True, True, False, False, True]:
        p.grad = torch.full((2,), INF if bad else 1.0)
        s.step(opt)
        s.update()
        seq.append(s.scale)
    # 3rd overflow backs off, the 4th too (tracker stays spent until a growth), growth resets it
    assert seq == [1024.0, 1024.0, 512.0, 256.0, 256.0, 512.0, 512.0]


def test_loop_unscales_and_grows_on_underflow():
    s = DynamicScaler(init_scale=8.0, growth_interval=1000)
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0)
    loss = s.scale_loss((p * torch.tensor([1.0, 2.0, 3.0])).sum())
    loss.backward()
    s.unscale_(opt)
    torch.testing.assert_close(p.grad, torch.tensor([1.0, 2.0, 3.0]))
    s.step(opt)
    s.update()
    torch.testing.assert_close(p.detach(), torch.tensor([0.0, -1.0, -2.0]))
    p.grad = torch.full((3,), 1e-6)  # scaled amax below FP16_MIN: skip and grow at once
    assert s.step(opt) is None
    s.update()
    assert s.scale == 16.0 and s.history[-1]["underflow"] and s.history[-1]["skipped"]


def test_underflow_fraction_in_history():
    s = DynamicScaler(init_scale=1.0, underflow_threshold=None)
    p = nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([1.0, 1e-9, 0.0, 2.0**-26])
    s.step(torch.optim.SGD([p], lr=0.1))
    s.update()
    assert s.history[0]["underflow_fraction"] == pytest.approx(0.5)


def test_pinned_at_min_scale_raises_with_names():
    model = nn.Linear(2, 1)
    s = DynamicScaler(init_scale=4.0, min_scale=1.0, min_scale_patience=3).attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ScalerPinnedError, match=r"min_scale=1.*weight"):
        for _ in range(10):
            model.weight.grad = torch.full((1, 2), float("nan"))
            model.bias.grad = torch.ones(1)
            s.step(opt)
            s.update()
    assert s.scale == 1.0 and len(s.history) == 5  # 4 -> 2 -> 1, then the 3rd overflow at 1 raises
    assert s.history[-1]["overflow"] and s.history[-1]["scale"] == 1.0
    assert s.history[0]["nonfinite"] == ["weight"]


def test_state_dict_resume_is_bit_identical():
    rng = random.Random(1)
    pattern = [rng.random() < 0.2 for _ in range(120)]

    def run(scaler, pat):
        p = nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([p], lr=0.1)
        for bad in pat:
            p.grad = torch.full((2,), INF if bad else 1e-2)
            scaler.step(opt)
            scaler.update()
        return scaler.history.to_dict()

    kw = dict(init_scale=2.0**10, growth_interval=5, hysteresis=2)
    full = run(DynamicScaler(**kw), pattern)
    first = DynamicScaler(**kw)
    run(first, pattern[:50])
    resumed = DynamicScaler(init_scale=2.0)
    resumed.load_state_dict(first.state_dict())
    tail = run(resumed, pattern[50:])
    assert tail["scale"] == full["scale"][50:] and tail["skipped"] == full["skipped"][50:]
    assert tail["step"] == full["step"][50:]


def _run_until_pinned(scaler, pattern):
    """Feed Inf (True) or finite (False) grads; return the history and the index that raised, if any."""
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    for i, bad in enumerate(pattern):
        p.grad = torch.full((2,), INF if bad else 1e-2)
        try:
            scaler.step(opt)
            scaler.update()
        except ScalerPinnedError:
            return scaler.history.to_dict(), i
    return scaler.history.to_dict(), None


def test_resume_mid_hysteresis_and_while_pinned_is_bit_identical():
    """Resume at every step: right after an overflow that has not backed off yet, and at min_scale with
    overflows already counted towards ``min_scale_patience``; the rest of the run must not change."""
    kw = dict(init_scale=8.0, min_scale=1.0, growth_interval=3, hysteresis=2, min_scale_patience=3,
              underflow_threshold=None)
    pattern = [False, True, True, False, False, False, True, False, True, True, True, True, True, False,
               True, True, False, True, True, True]
    full, raised = _run_until_pinned(DynamicScaler(**kw), pattern)
    assert raised == len(pattern) - 1 and full["scale"][-1] == 1.0
    seen = {"mid_hysteresis": 0, "pinned": 0}
    for k in range(1, raised):
        first = DynamicScaler(**kw)
        assert _run_until_pinned(first, pattern[:k])[1] is None
        state = first.state_dict()
        # read from the scaler, not the state: the state is what is under test
        seen["mid_hysteresis"] += first._hysteresis_tracker == 1 and full["overflow"][k - 1]
        seen["pinned"] += first._pinned > 0
        resumed = DynamicScaler(init_scale=2.0**16)  # every setting and counter comes from the state
        resumed.load_state_dict(copy.deepcopy(state))
        tail, tail_raised = _run_until_pinned(resumed, pattern[k:])
        assert tail_raised is not None and k + tail_raised == raised, k
        for key in ("step", "scale", "overflow", "skipped"):
            assert tail[key] == full[key][k:], (k, key)
    assert seen["mid_hysteresis"] >= 2 and seen["pinned"] >= 3  # the resumes this test is about happened


def test_replay_matches_live_loop():
    rng = random.Random(2)
    amaxes = [rng.choice([1e-9, 1e-3, 0.5, 3.0, INF]) for _ in range(300)]
    kw = dict(init_scale=2.0**12, growth_interval=4, hysteresis=2, min_scale=2.0**-30)
    live = DynamicScaler(**kw)
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    for a in amaxes:
        # backward of a scaled loss in an fp16 pipeline: the scaled grad, rounded through fp16
        p.grad = (torch.tensor([a]) * live.scale).half().float()
        live.step(opt)
        live.update()
    rep = DynamicScaler(**kw).replay(amaxes)
    hist = live.history.to_dict()
    for key in ("scale", "overflow", "underflow", "skipped"):
        assert rep[key] == hist[key], key


def test_replay_event_forms_and_flush_fraction():
    s = DynamicScaler(init_scale=1.0, underflow_threshold=None, min_scale=2.0**-10, min_scale_patience=2)
    hist = ([-40.0, -30.0, -20.0], [10, 10])
    out = s.replay([True, 0.5, {"amax": 1.0, "hist": hist, "zeros": 5}, {"overflow": True}])
    assert out["overflow"] == [True, False, False, True]
    assert out["scale"] == [1.0, 0.5, 0.5, 0.5]
    # at scale 0.5 the cut is log2(2**-25) + 1 = -24: bin [-40, -30] all, [-30, -20] 60%
    assert out["underflow_fraction"][2] == pytest.approx((10 + 6) / 25)
    assert len(s.history) == 0 and s.scale == 1.0  # replay leaves the scaler alone
    with pytest.raises(TypeError, match="events"):
        s.replay(["x"])


def test_replay_of_a_long_trace_matches_its_own_rules():
    events = [1.0 if i % 97 else INF for i in range(10_000)]
    out = DynamicScaler(growth_interval=50).replay(events)
    assert len(out["scale"]) == 10_000 and sum(out["overflow"]) == 104 + sum(
        1 for s, e in zip(out["scale"], events) if e == 1.0 and s > 65504.0)
    assert not any(out["pinned"])


def test_underflow_fraction_at_current_scale():
    s = DynamicScaler(init_scale=2.0**10)
    g = torch.tensor([1.0, 2.0**-36, 2.0**-30, 0.0])  # 2**-36 * 2**10 = 2**-26 flushes, 2**-20 does not
    assert s.underflow_fraction(g) == 0.25
    assert s.underflow_fraction([g, torch.ones(4)]) == 0.125


@pytest.mark.parametrize("kwargs, match, exc", [
    ({"init_scale": 0}, "init_scale", ValueError),
    ({"growth_factor": 1.0}, "growth_factor", ValueError),
    ({"backoff_factor": 1.5}, "backoff_factor", ValueError),
    ({"growth_interval": 0}, "growth_interval", ValueError),
    ({"hysteresis": 1.5}, "hysteresis", TypeError),
    ({"min_scale": 4.0, "max_scale": 2.0}, "max_scale", ValueError),
    ({"init_scale": 2.0**30}, "init_scale", ValueError),
    ({"underflow_threshold": -1.0}, "underflow_threshold", ValueError),
])
def test_bad_arguments_name_the_argument(kwargs, match, exc):
    with pytest.raises(exc, match=match):
        DynamicScaler(**kwargs)


def test_bad_calls():
    s = DynamicScaler()
    with pytest.raises(TypeError, match="grad"):
        s.adjust("nope")
    with pytest.raises(RuntimeError, match="update"):
        s.update()
    with pytest.raises(ValueError, match="state"):
        s.load_state_dict({"scale": 1.0})
    p = nn.Parameter(torch.zeros(2, dtype=torch.float16))
    p.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="fp16"):
        s.unscale_(torch.optim.SGD([p], lr=0.1))


def test_adjust_pinned_raises_after_patience():
    s = DynamicScaler(init_scale=2.0, min_scale=1.0, min_scale_patience=2)
    assert s.adjust(torch.tensor([INF])) is False  # 2 -> 1
    assert s.adjust(torch.tensor([INF])) is False  # first overflow at the floor
    assert s.adjust(torch.ones(1)) is True  # a clean step resets the count
    s.adjust(torch.tensor([INF]))
    with pytest.raises(ScalerPinnedError, match="min_scale_patience=2"):
        s.adjust(torch.tensor([INF]))
    assert len(s.history) == 5


class _SparseBag(nn.Module):
    """An ``nn.Embedding(sparse=True)`` (recommendation models, word2vec): its gradient is a sparse tensor."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(50, 8, sparse=True), nn.Linear(8, 1)

    def forward(self, ids):
        return self.out(self.emb(ids)).sum()


@pytest.mark.parametrize("opt", ["sgd", "sparse_adam"])
def test_sparse_gradients_are_scanned_unscaled_and_stepped_as_torch_would(opt):
    torch.manual_seed(0)
    model, ids = _SparseBag(), torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)

    def make(m):
        return torch.optim.SGD(m.parameters(), lr=0.1) if opt == "sgd" else torch.optim.SparseAdam(
            list(m.emb.parameters()))

    scaler, optim, ref_optim = DynamicScaler(init_scale=2.0**10).attach(model), make(model), make(ref)
    scaler.scale_loss(model(ids)).backward()
    assert model.emb.weight.grad.is_sparse
    scaler.step(optim)
    scaler.update()
    assert not scaler.history[-1]["skipped"] and scaler.history[-1]["amax"] > 0
    ref(ids).backward()
    ref_optim.step()
    assert torch.equal(model.emb.weight, ref.emb.weight)  # a power-of-two scale divides out exactly
    # an index given twice whose two finite values sum past fp32's range: found once coalesced
    g = torch.sparse_coo_tensor(torch.tensor([[3, 3]]), torch.full((2, 8), 3e38), (50, 8), check_invariants=True)
    model.emb.weight.grad, model.out.weight.grad, model.out.bias.grad = g, None, None
    before = model.emb.weight.detach().clone()
    scaler.step(optim)
    scaler.update()
    assert torch.equal(model.emb.weight, before) and scaler.history[-1]["skipped"] and scaler.history[-1]["overflow"]
    assert scaler.history[-1]["nonfinite"] == ["emb.weight"]


def test_master_weights_refuse_a_sparse_gradient_by_name():
    model, ids = _SparseBag(), torch.randint(0, 50, (4, 6))
    opt = MasterWeightOptimizer(model, "sgd", lr=0.1)
    model(ids).backward()
    with pytest.raises(TypeError, match=r"emb.weight has a sparse gradient"):
        opt.step()
