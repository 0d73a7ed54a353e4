import copy
import random

import pytest
import torch
from torch import nn

from opsnn_lab.models import EncoderConfig, MaskedTokenTask
from opsnn_lab.precision import DynamicScaler, MasterWeightOptimizer

INF = float("inf")


@pytest.fixture(autouse=True)
def one_thread():
    # the CI box is shared: 2 threads fighting 8 jobs run tiny matmuls 30x slower than one thread
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 3)).to(dtype)


def _backward(model, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 5, generator=g).to(next(model.parameters()).dtype)
    (model(x).float().square().mean() * scale).backward()


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()], [m.clone() for m in opt.masters],
            [[t.clone() for t in s] for s in opt.state], opt.steps_taken)


def _assert_same(a, b):
    for xs, ys in zip(a[:3], b[:3]):
        flat_x = [t for x in xs for t in (x if isinstance(x, list) else [x])]
        flat_y = [t for y in ys for t in (y if isinstance(y, list) else [y])]
        assert all(torch.equal(x, y) for x, y in zip(flat_x, flat_y))
    assert a[3] == b[3]


# ---------------------------------------------------------------- matches torch.optim in fp32
@pytest.mark.parametrize("kind, kwargs, torch_opt", [
    ("adamw", dict(lr=1e-2, weight_decay=0.1), lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    ("sgd", dict(lr=0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_follows_torch_optimizer_in_fp32(kind, kwargs, torch_opt, dtype):
    model = _model(dtype)
    ref_params = [nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    ref = torch_opt(ref_params)
    scaler = DynamicScaler(init_scale=256.0, underflow_threshold=None)
    opt = MasterWeightOptimizer(model, kind, scaler=scaler, **kwargs)
    for step in range(3):
        opt.zero_grad()
        _backward(model, seed=step, scale=scaler.scale)
        for rp, p in zip(ref_params, model.parameters()):
            rp.grad = p.grad.float() / scaler.scale
        assert opt.step() is True
        ref.step()
    for m, rp, p in zip(opt.masters, ref_params, model.parameters()):
        torch.testing.assert_close(m, rp.detach(), atol=1e-6, rtol=1e-5)
        assert p.dtype == dtype and torch.equal(p.detach(), m.to(dtype))


# ---------------------------------------------------------------- non-finite steps touch nothing
NONFINITE = [float("nan"), INF, -INF]


@pytest.mark.parametrize("bad", NONFINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("with_scaler", [True, False])
def test_nonfinite_step_leaves_everything_untouched(kind, with_scaler, bad):
    model = _model(torch.float16)
    scaler = DynamicScaler(init_scale=64.0) if with_scaler else None
    opt = MasterWeightOptimizer(model, kind, lr=0.1, scaler=scaler)
    _backward(model)
    opt.step()  # populate moments
    opt.zero_grad()
    _backward(model, seed=3)
    model[2].bias.grad[1] = bad
    before = _snapshot(model, opt)
    assert opt.step() is False
    _assert_same(before, _snapshot(model, opt))
    assert opt.skipped_steps == 1 and opt.last_nonfinite == ["2.bias"]
    if with_scaler:
        assert scaler.scale == 32.0 and scaler.history[-1]["nonfinite"] == ["2.bias"]


def test_fp16_grad_routing_turns_overflow_into_a_skip():
    model = _model(torch.float32)
    scaler = DynamicScaler(init_scale=2.0**15)
    opt = MasterWeightOptimizer(model, lr=1e-3, scaler=scaler, grad_dtype=torch.float16)
    _backward(model, scale=2.0**15 * 1e3)  # finite in fp32, Inf once cast to fp16
    assert opt.step() is False and scaler.history[-1]["overflow"]


def test_scaler_step_drives_master_optimizer():
    model = _model(torch.bfloat16)
    scaler = DynamicScaler(init_scale=16.0, underflow_threshold=None)
    opt = MasterWeightOptimizer(model, lr=1e-2, scaler=scaler)
    twin = copy.deepcopy(model)
    twin_opt = MasterWeightOptimizer(twin, lr=1e-2, scaler=DynamicScaler(init_scale=16.0, underflow_threshold=None))
    for m in (model, twin):
        _backward(m, scale=16.0)
    assert scaler.step(opt) is True
    scaler.update()
    twin_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(opt.masters, twin_opt.masters))


# ---------------------------------------------------------------- pipelined mode
def _grad_peak(model, opt, seed):
    live = {"peak": 0}

    def on_grad(g):  # runs when a grad is computed, before it is accumulated and before the update hook
        now = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        live["peak"] = max(live["peak"], now + g.numel() * g.element_size())

    handles = [p.register_hook(on_grad) for p in model.parameters()]
    _backward(model, seed=seed, scale=opt.scaler.scale if opt.scaler else 1.0)
    for h in handles:
        h.remove()
    return live["peak"]


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_pipelined_equals_plain_and_frees_grads(kind):
    a, b = _model(torch.bfloat16), _model(torch.bfloat16)
    plain = MasterWeightOptimizer(a, kind, lr=1e-2, scaler=DynamicScaler(init_scale=8.0))
    piped = MasterWeightOptimizer(b, kind, lr=1e-2, scaler=DynamicScaler(init_scale=8.0), pipelined=True)
    peaks = []
    for step in range(3):
        plain.zero_grad()
        peaks.append((_grad_peak(a, plain, step), _grad_peak(b, piped, step)))
        assert all(p.grad is None for p in b.parameters())
        assert plain.step() is True and piped.step() is True
    for x, y in zip(plain.masters, piped.masters):
        assert torch.equal(x, y)
    total = sum(p.numel() * p.element_size() for p in a.parameters())
    biggest = max(p.numel() * p.element_size() for p in a.parameters())
    assert peaks[0][0] == total and peaks[0][1] <= biggest
    assert piped.scaler.history.to_dict()["scale"] == plain.scaler.history.to_dict()["scale"]


@pytest.mark.parametrize("bad", NONFINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("with_scaler", [True, False])
def test_pipelined_nonfinite_updates_all_with_zero_grad_for_the_bad_param(with_scaler, bad):
    model = _model(torch.float16)
    scaler = DynamicScaler(init_scale=8.0) if with_scaler else None
    opt = MasterWeightOptimizer(model, "sgd", lr=0.1, momentum=0.0, scaler=scaler, pipelined=True)
    model[0].weight.register_hook(lambda g: torch.full_like(g, bad))  # the first layer's grad is non-finite
    before = [m.clone() for m in opt.masters]
    _backward(model, scale=8.0 if with_scaler else 1.0)
    assert opt.step() is True
    changed = [not torch.equal(x, y) for x, y in zip(before, opt.masters)]
    # SGD without momentum or decay: a zero grad leaves the bad param in place, the others move
    assert changed == [False, True, True, True]
    assert all(torch.isfinite(m).all() for m in opt.masters)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.last_nonfinite == ["0.weight"] and opt.steps_taken == 1
    if with_scaler:
        assert scaler.scale == 4.0
        row = scaler.history[-1]
        assert row["overflow"] and not row["skipped"]


# ---------------------------------------------------------------- checkpoint
def test_state_dict_resume_bit_identical():
    def make():
        m = _model(torch.bfloat16)
        return m, MasterWeightOptimizer(m, lr=1e-2, scaler=DynamicScaler(init_scale=4.0, growth_interval=2))

    def run(m, o, steps):
        for s in steps:
            o.zero_grad()
            _backward(m, seed=s, scale=o.scaler.scale)
            if s == 5:
                m[0].bias.grad[0] = INF
            o.step()

    m1, o1 = make()
    run(m1, o1, range(10))
    m2, o2 = make()
    run(m2, o2, range(6))
    ckpt = copy.deepcopy({"model": m2.state_dict(), "opt": o2.state_dict()})
    m3, o3 = make()
    _backward(m3)  # stale grads and a different state must not matter after load
    m3.load_state_dict(ckpt["model"])
    o3.load_state_dict(ckpt["opt"])
    run(m3, o3, range(6, 10))
    _assert_same(_snapshot(m1, o1), _snapshot(m3, o3))
    assert o1.scaler.scale == o3.scaler.scale and o1.skipped_steps == o3.skipped_steps == 1


def test_bad_arguments():
    model = _model(torch.float16)
    with pytest.raises(ValueError, match="optimizer"):
        MasterWeightOptimizer(model, "lamb")
    with pytest.raises(ValueError, match="lr"):
        MasterWeightOptimizer(model, lr=0)
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        MasterWeightOptimizer(model, betas=(0.9, 1.0))
    with pytest.raises(TypeError, match="scaler"):
        MasterWeightOptimizer(model, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match="params"):
        MasterWeightOptimizer(42)
    with pytest.raises(TypeError, match="params"):
        MasterWeightOptimizer([nn.Parameter(torch.zeros(2, dtype=torch.float64))])
    with pytest.raises(ValueError, match="nesterov"):
        MasterWeightOptimizer(model, "adamw", nesterov=True)
    opt = MasterWeightOptimizer(model)
    with pytest.raises(ValueError, match="state"):
        opt.load_state_dict({"kind": "sgd", "masters": []})


# ---------------------------------------------------------------- the embedded encoder
def _encoder_run(mode, steps, inject=()):
    """Train the tiny encoder; ``inject``: steps whose grads get a NaN/Inf (the fp32 run just skips them)."""
    torch.manual_seed(0)
    task = MaskedTokenTask(vocab_size=32, seq_len=16, batch_size=16)
    model = task.model(EncoderConfig.tiny(hidden=32, intermediate=64, layers=1, heads=2, dropout=0.0,
                                          attn_dropout=0.0))
    if mode == "fp32":
        opt, scaler = torch.optim.AdamW(model.parameters(), lr=3e-3), None
    else:
        model = model.to(torch.bfloat16)
        scaler = DynamicScaler(growth_interval=50)
        opt = MasterWeightOptimizer(model, lr=3e-3, scaler=scaler)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = task.loss(model, task.batch(step))
        (loss if scaler is None else scaler.scale_loss(loss)).backward()
        if step in inject and scaler is not None:
            next(model.parameters()).grad.view(-1)[0] = float("nan" if step % 2 else "inf")
        if not (step in inject and scaler is None):
            opt.step()
        losses.append(loss.item())
    return losses, opt


@pytest.mark.slow
def test_encoder_master_weight_training_tracks_fp32():
    steps = 200
    tail = lambda xs: sum(xs[-20:]) / 20
    ref, _ = _encoder_run("fp32", steps)
    ours, opt = _encoder_run("bf16", steps)
    assert sum(ref[:20]) / 20 - tail(ref) > 0.1  # it learned something (chance: log(31) = 3.43)
    assert abs(tail(ours) - tail(ref)) / tail(ref) < 0.02
    assert opt.skipped_steps == 0

    inject = set(random.Random(0).sample(range(10, steps), 8))
    ref, _ = _encoder_run("fp32", steps, inject)
    ours, opt = _encoder_run("bf16", steps, inject)
    assert abs(tail(ours) - tail(ref)) / tail(ref) < 0.02
    assert opt.skipped_steps == len(inject)
    assert all(torch.isfinite(m).all() for m in opt.masters)
    assert all(torch.isfinite(p).all() for p in opt.params)
    assert sorted(opt.scaler.history.skipped_steps) == sorted(inject)


def test_encoder_checkpoint_resume_bit_identical():
    task = MaskedTokenTask(vocab_size=32, seq_len=8, batch_size=4)
    cfg = EncoderConfig.tiny(hidden=16, intermediate=32, layers=1, heads=2, dropout=0.0, attn_dropout=0.0)

    def make():
        torch.manual_seed(0)
        model = task.model(cfg).to(torch.bfloat16)
        return model, MasterWeightOptimizer(model, lr=1e-2, scaler=DynamicScaler(init_scale=2.0**20,
                                                                                  growth_interval=3))

    def run(model, opt, steps):
        for step in steps:
            opt.zero_grad()
            opt.scaler.scale_loss(task.loss(model, task.batch(step))).backward()
            opt.step()

    full = make()
    run(*full, range(12))
    half = make()
    run(*half, range(6))
    ckpt = copy.deepcopy({"model": half[0].state_dict(), "opt": half[1].state_dict()})
    resumed = make()
    resumed[0].load_state_dict(ckpt["model"])
    resumed[1].load_state_dict(ckpt["opt"])
    run(*resumed, range(6, 12))
    _assert_same(_snapshot(*full), _snapshot(*resumed))
    assert full[1].scaler.history.to_dict()["scale"][6:] == resumed[1].scaler.history.to_dict()["scale"]
