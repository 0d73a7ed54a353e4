import pytest
import torch

from opsnn_lab.kernels.fused_update import (
    _adamw_fused_cpu,
    _sgd_fused_cpu,
    adamw_reference_,
    adamw_update_,
    sgd_reference_,
    sgd_update_,
)
from opsnn_lab.testing import seeded

SIZES = [(7,), (33, 5), (1151,), (0,)]
ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


def _state(dtype, scale, seed=0, n_state=2):
    params = [seeded(*s, seed=seed + i).to(dtype) for i, s in enumerate(SIZES)]
    grads = [(seeded(*s, seed=100 + seed + i, scale=1e-3) * scale).to(dtype) for i, s in enumerate(SIZES)]
    masters = [p.float() for p in params]
    states = [[seeded(*s, seed=200 + 10 * k + i, scale=1e-3).abs() for i, s in enumerate(SIZES)]
              for k in range(n_state)]
    return params, grads, masters, states


def _clone(xs):
    return [x.clone() for x in xs]


def _torch_adamw_oracle(masters, grads, states, step, inv_scale):
    """torch.optim.AdamW itself on fp32 copies: the definition the reference must match."""
    ws = [torch.nn.Parameter(m.clone()) for m in masters]
    opt = torch.optim.AdamW(ws, lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
                            weight_decay=ADAM["weight_decay"], foreach=False)
    for w, g, m, v in zip(ws, grads, *states):
        w.grad = g.float() * inv_scale
        opt.state[w] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    opt.step()
    return [w.detach() for w in ws], [opt.state[w]["exp_avg"] for w in ws], [opt.state[w]["exp_avg_sq"] for w in ws]


@pytest.mark.parametrize("step", [1, 7])
def test_adamw_reference_matches_torch_optim(step):
    params, grads, masters, states = _state(torch.bfloat16, scale=1024.0)
    want_w, want_m, want_v = _torch_adamw_oracle(masters, grads, states, step, 1 / 1024)
    adamw_reference_(params, grads, masters, *states, step=step, inv_scale=1 / 1024, **ADAM)
    for got, want in zip(masters + states[0] + states[1], want_w + want_m + want_v):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for p, w in zip(params, masters):
        assert p.dtype == torch.bfloat16 and torch.equal(p, w.to(torch.bfloat16))


@pytest.mark.parametrize("momentum, nesterov, wd", [(0.9, False, 0.0), (0.9, True, 0.01), (0.0, False, 0.1)])
def test_sgd_reference_matches_torch_optim(momentum, nesterov, wd):
    params, grads, masters, (bufs,) = _state(torch.float16, scale=64.0, n_state=1)
    ws = [torch.nn.Parameter(m.clone()) for m in masters]
    opt = torch.optim.SGD(ws, lr=0.1, momentum=momentum, nesterov=nesterov, weight_decay=wd, foreach=False)
    for step in (1, 2, 3):
        for w, g in zip(ws, grads):
            w.grad = g.float() / 64.0
        opt.step()
        sgd_reference_(params, grads, masters, bufs, step=step, lr=0.1, momentum=momentum, weight_decay=wd,
                       nesterov=nesterov, inv_scale=1 / 64.0)
    for got, w in zip(masters, ws):
        torch.testing.assert_close(got, w.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cpu_fused_path_matches_reference(dtype):
    params, grads, masters, states = _state(dtype, scale=512.0)
    ref = (_clone(params), _clone(masters), [_clone(s) for s in states])
    for step in (1, 2):
        _adamw_fused_cpu(params, grads, masters, *states, step=step, inv_scale=1 / 512, **ADAM)
        adamw_reference_(ref[0], grads, ref[1], *ref[2], step=step, inv_scale=1 / 512, **ADAM)
    for got, want in zip(masters + states[0] + states[1], ref[1] + ref[2][0] + ref[2][1]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    p2, g2, m2, (b2,) = _state(dtype, scale=8.0, n_state=1)
    r2 = (_clone(p2), _clone(m2), _clone(b2))
    for step in (1, 2):
        _sgd_fused_cpu(p2, g2, m2, b2, step=step, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=False,
                       inv_scale=1 / 8)
        sgd_reference_(r2[0], g2, r2[1], r2[2], step=step, lr=0.1, momentum=0.9, weight_decay=0.01,
                       inv_scale=1 / 8)
    for got, want in zip(m2 + b2, r2[1] + r2[2]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_dispatch_uses_cpu_path_without_triton(monkeypatch):
    monkeypatch.setenv("OPSNN_BACKEND", "torch")
    params, grads, masters, states = _state(torch.bfloat16, scale=1.0)
    ref = (_clone(params), _clone(masters), [_clone(s) for s in states])
    adamw_update_(params, grads, masters, *states, step=1, inv_scale=torch.tensor(1.0), **ADAM)
    adamw_reference_(ref[0], grads, ref[1], *ref[2], step=1, **ADAM)
    for got, want in zip(masters, ref[1]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.fixture
def triton_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("OPSNN_BACKEND", "triton")


# fp32 update math in both; the params are the rounding of equal-within-tolerance masters
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-6, 1e-5), (torch.float16, 1e-3, 1e-3),
                                               (torch.bfloat16, 1e-2, 1.6e-2)])
def test_triton_adamw_matches_reference(triton_interpreter, dtype, atol, rtol):
    params, grads, masters, states = _state(dtype, scale=256.0)
    ref = (_clone(params), _clone(masters), [_clone(s) for s in states])
    for step in (1, 2):
        adamw_update_(params, grads, masters, *states, step=step, inv_scale=1 / 256, **ADAM)
        adamw_reference_(ref[0], grads, ref[1], *ref[2], step=step, inv_scale=1 / 256, **ADAM)
    for got, want in zip(masters + states[0] + states[1], ref[1] + ref[2][0] + ref[2][1]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for got, want in zip(params, ref[0]):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("momentum, nesterov", [(0.9, False), (0.9, True), (0.0, False)])
def test_triton_sgd_matches_reference(triton_interpreter, momentum, nesterov):
    params, grads, masters, (bufs,) = _state(torch.float16, scale=32.0, n_state=1)
    ref = (_clone(params), _clone(masters), _clone(bufs))
    for step in (1, 2):
        sgd_update_(params, grads, masters, bufs, step=step, lr=0.1, momentum=momentum, weight_decay=0.01,
                    nesterov=nesterov, inv_scale=1 / 32)
        sgd_reference_(ref[0], grads, ref[1], ref[2], step=step, lr=0.1, momentum=momentum, weight_decay=0.01,
                       nesterov=nesterov, inv_scale=1 / 32)
    for got, want in zip(masters + bufs, ref[1] + ref[2]):  # momentum buffers too (untouched at momentum 0)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    if not momentum:
        assert all(torch.equal(b, b0) for b, b0 in zip(bufs, _state(torch.float16, scale=32.0, n_state=1)[3][0]))
    for got, want in zip(params, ref[0]):  # the fp16 params are the rounding of the masters
        assert got.dtype == torch.float16
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_triton_found_inf_flag_skips_everything(triton_interpreter, kind):
    params, grads, masters, states = _state(torch.float16, scale=1.0, n_state=2 if kind == "adamw" else 1)
    before = [_clone(params), _clone(masters), *(_clone(s) for s in states)]
    if kind == "adamw":
        adamw_update_(params, grads, masters, *states, step=1, found_inf=torch.ones(1), **ADAM)
    else:
        sgd_update_(params, grads, masters, *states, step=2, lr=0.1, momentum=0.9, weight_decay=0.01,
                    found_inf=torch.ones(1))
    for got, want in zip([params, masters, *states], before):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the same call with the flag clear does update: the skip is the flag's doing
    if kind == "adamw":
        adamw_update_(params, grads, masters, *states, step=1, found_inf=torch.zeros(1), **ADAM)
    else:
        sgd_update_(params, grads, masters, *states, step=2, lr=0.1, momentum=0.9, weight_decay=0.01,
                    found_inf=torch.zeros(1))
    for got, want in zip([masters, *states], before[1:]):  # fp32: every non-empty tensor moves
        assert not any(torch.equal(a, b) for a, b in zip(got, want) if a.numel())
    assert not all(torch.equal(a, b) for a, b in zip(params, before[0]))  # fp16 may round a tiny step away


def test_triton_rejects_non_contiguous_param(triton_interpreter):
    p = torch.zeros(4, 6)[:, ::2]
    with pytest.raises(ValueError, match="param"):
        adamw_update_([p], [torch.ones(4, 3)], [torch.zeros(4, 3)], [torch.zeros(4, 3)], [torch.zeros(4, 3)],
                      step=1, **ADAM)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_triton_matches_cpu_reference(dtype):
    params, grads, masters, states = _state(dtype, scale=256.0)
    ref = (_clone(params), _clone(masters), [_clone(s) for s in states])
    cuda = lambda xs: [x.cuda() for x in xs]
    gp, gg, gm, gs = cuda(params), cuda(grads), cuda(masters), [cuda(s) for s in states]
    found = torch.zeros(1, device="cuda")
    for step in (1, 2):
        adamw_update_(gp, gg, gm, *gs, step=step, inv_scale=torch.full((1,), 1 / 256, device="cuda"),
                      found_inf=found, **ADAM)
        adamw_reference_(ref[0], grads, ref[1], *ref[2], step=step, inv_scale=1 / 256, **ADAM)
    for got, want in zip(gm + gs[0] + gs[1], ref[1] + ref[2][0] + ref[2][1]):
        torch.testing.assert_close(got.cpu(), want, atol=1e-6, rtol=1e-5)
    before = [m.clone() for m in gm]
    found.fill_(1.0)
    adamw_update_(gp, gg, gm, *gs, step=3, found_inf=found, **ADAM)
    assert all(torch.equal(a, b) for a, b in zip(before, gm))
