"""The torch path of BN + activation (+ max-pool): the activation table against eager's modules and autograd,
the pool/activation commutation it relies on, window-index round trips against aten's int64 indices, and
forward + every gradient against eager BatchNorm2d -> activation -> MaxPool2d."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opsnn_lab.kernels import bn_act as K
from opsnn_lab.testing import assert_close_dtype, seeded

POOLS = [K.PoolSpec((3, 3), (2, 2), (1, 1)), K.PoolSpec((2, 2), (2, 2), (1, 1)), K.PoolSpec((2, 3), (1, 2), (0, 1))]
POOL_IDS = ["p3s2p1", "p2s2p1", "p2x3"]
MODULES = {"relu": nn.ReLU(), "relu6": nn.ReLU6(), "leaky_relu": nn.LeakyReLU(0.2), "silu": nn.SiLU(),
           "hardswish": nn.Hardswish(), "gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh"), "mish": nn.Mish(),
           "elu": nn.ELU()}
ACTS = [K.Act(name, 0.2) for name in K.ACTS]


def _grid(dtype=torch.float32):
    """Every kink of every activation (0, +-3, 6) and a spread around them."""
    kinks = torch.tensor([-3.0, 0.0, 3.0, 6.0])
    return torch.cat([kinks, seeded(200, seed=1, scale=4.0)]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act", ACTS, ids=K.ACTS)
def test_act_table_is_eagers_forward_and_backward(act, dtype):
    z = _grid(dtype).requires_grad_()
    ref = MODULES[act.name](z)
    g = seeded(*ref.shape, seed=2, dtype=dtype)
    (ref_grad,) = torch.autograd.grad(ref, z, g)
    assert torch.equal(act.forward(z.detach().clone(), inplace=True), ref.detach())
    assert torch.equal(act.forward(z.detach(), inplace=False), ref.detach())
    assert torch.equal(act.backward_(g, z.detach().clone()), ref_grad)


def test_act_properties_and_bad_name():
    assert [a.monotone for a in ACTS] == [True, True, True, False, False, False, False, False, True]
    assert not K.Act("leaky_relu", -0.1).monotone
    assert [a.has_dead_zone for a in ACTS] == [True, True] + [False] * 7
    assert K.Act("relu6").dead(torch.tensor([-1.0, 0.0, 3.0, 6.0])).tolist() == [True, True, False, True]
    with pytest.raises(ValueError, match="act"):
        K.Act("tanh")


@pytest.mark.parametrize("act", ACTS[:3], ids=K.ACTS[:3])
def test_pool_commutes_with_a_monotone_activation(act):
    z = seeded(2, 3, 9, 8, seed=3, scale=4.0)
    a = act.forward(torch.nn.functional.max_pool2d(z, 3, 2, 1), inplace=False)
    b = torch.nn.functional.max_pool2d(act.forward(z, inplace=False), 3, 2, 1)
    assert torch.equal(a, b)


@pytest.mark.parametrize("spec", POOLS, ids=POOL_IDS)
@pytest.mark.parametrize("channels_last", [False, True])
def test_window_index_round_trip(spec, channels_last):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    z = seeded(2, 3, 9, 11, seed=3).contiguous(memory_format=fmt)
    out, flat = torch.ops.aten.max_pool2d_with_indices(z, *spec.args(), [1, 1], False)
    idx = K.window_index(flat.clone(), out <= 0, 9, 11, spec)
    assert idx.dtype == torch.uint8 and idx.is_contiguous(memory_format=fmt)
    positive = out > 0
    assert bool((idx[~positive] == spec.sentinel).all())
    back = K.flat_index(idx, 9, 11, spec)
    assert back.is_contiguous(memory_format=fmt)
    assert torch.equal(back[positive], flat[positive])
    assert int(back.min()) >= 0 and int(back.max()) < 9 * 11
    assert torch.equal(K.flat_index(K.window_index(flat.clone(), None, 9, 11, spec), 9, 11, spec), flat)


def _bn_inputs(c, seed=0, gain=4.0):
    """BN gain 4: the pre-activation reaches ReLU6's 6 and Hardswish's +-3."""
    weight = (seeded(c, seed=seed + 1).abs() + 0.5) * gain
    bias = seeded(c, seed=seed + 2, scale=0.3)
    rm = seeded(c, seed=seed + 3, scale=0.1)
    rv = seeded(c, seed=seed + 4).abs() + 0.5
    return weight, bias, rm, rv


def _eager(y, weight, bias, rm, rv, act_name, pool, training):
    """nn.BatchNorm2d -> activation -> MaxPool2d with the given tensors; returns (module chain, bn)."""
    bn = nn.BatchNorm2d(y.shape[1], momentum=0.1).train(training)
    with torch.no_grad():
        bn.weight.copy_(weight), bn.bias.copy_(bias), bn.running_mean.copy_(rm), bn.running_var.copy_(rv)
    mods = [bn, MODULES[act_name]] + ([nn.MaxPool2d(pool.kernel, pool.stride, pool.padding)] if pool else [])
    return nn.Sequential(*mods), bn


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("pool", [None, POOLS[0], POOLS[2]], ids=["nopool", *POOL_IDS[::2]])
@pytest.mark.parametrize("act", ACTS, ids=K.ACTS)
def test_torch_path_matches_eager(act, pool, training):
    y = seeded(2, 3, 7, 9, seed=5, scale=2.0) + 0.3
    weight, bias, rm, rv = _bn_inputs(3)
    chain, bn = _eager(y, weight, bias, rm, rv, act.name, pool, training)
    y_ref = y.clone().requires_grad_()
    ref = chain(y_ref)
    g = seeded(*ref.shape, seed=6)
    ref_grads = torch.autograd.grad(ref, [y_ref, bn.weight, bn.bias], g)
    bufs = (rm.clone(), rv.clone())
    out, mean, invstd, idx = K.bn_act_forward_torch(y, weight, bias, *bufs, training=training, momentum=0.1,
                                                    eps=bn.eps, act=act, pool=pool)
    assert_close_dtype(out, ref.detach(), msg="output")
    assert (idx is None) == (pool is None) and (idx is None or idx.dtype == torch.uint8)
    for a, b, name in zip(bufs, (bn.running_mean, bn.running_var), ("running_mean", "running_var")):
        assert_close_dtype(a, b, msg=name)
    grads = K.bn_act_backward_torch(g, y, weight, bias, mean, invstd, idx, training=training, eps=bn.eps, act=act,
                                    pool=pool)
    for a, b, name in zip(grads, ref_grads, ("grad_y", "grad_weight", "grad_bias")):
        assert_close_dtype(a, b, msg=name)


def test_dispatch_uses_torch_on_cpu(monkeypatch):
    monkeypatch.delenv("OPSNN_BACKEND", raising=False)
    y = seeded(2, 3, 4, 4)
    weight, bias, rm, rv = _bn_inputs(3)
    act = K.Act("silu")
    out = K.bn_act_forward(y, weight, bias, rm.clone(), rv.clone(), training=True, momentum=0.1, eps=1e-5, act=act)
    ref = K.bn_act_forward_torch(y, weight, bias, rm.clone(), rv.clone(), training=True, momentum=0.1, eps=1e-5,
                                 act=act)
    assert torch.equal(out[0], ref[0])
