"""FusedConvActDropoutConv: ``conv2(dropout(act(conv1(x))))`` against eager, every gradient, per dtype; the mask
of the counter-based dropout; odd geometries, channels-last, non-contiguous and empty inputs; what it saves;
bad arguments; Triton (the activation kernels) under the interpreter."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab.bench import activation_bytes
from opsnn_lab.kernels import gelu_dropout, rng, triton_available
from opsnn_lab.ops import FusedConvActDropoutConv
from opsnn_lab.ops import conv_mlp as conv_mlp_ops
from opsnn_lab.testing import assert_close_dtype, assert_within_eager_error, reloaded, run_fwd_bwd, seeded

_ACTS = {"gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU, "relu": nn.ReLU}


def _convs(c=6, hidden=20, out=None, k1=1, k2=1, stride=1, groups=1, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    conv1 = nn.Conv2d(c, hidden, k1, stride=stride, padding=k1 // 2, groups=groups, bias=bias).to(dtype)
    return conv1, nn.Conv2d(hidden, out or c, k2, padding=k2 // 2, bias=bias).to(dtype)


def _eager(convs, act, p=0.0, step=0, seed=11):
    """The unfused chain, nn.Dropout's mask replaced by the counter-based one (row-major over N, C, H, W)."""
    conv1, conv2 = convs
    act_fn = _ACTS[act]()

    def fn(x):
        a = act_fn(conv1(x))
        if p > 0:
            keep = rng.dropout_mask(seed, step * rng.MAX_NUMEL, a.shape, p, a.device, dtype=a.dtype)
            a = a * keep * (0.0 if p == 1 else 1.0 / (1 - p))
        return conv2(a)
    return fn


def _fused(convs, act, p=0.0, ops=None):
    op = (ops or conv_mlp_ops).FusedConvActDropoutConv
    return op.from_modules(convs[0], _ACTS[act](), nn.Dropout(p) if p else None, convs[1], seed=11)


def _params(convs):
    return [t for c in convs for t in (c.weight, c.bias) if t is not None]


def _compare(fused, eager, x, convs, dtype=None):
    out, grads = run_fwd_bwd(fused, [x], _params(convs))
    ref, ref_grads = run_fwd_bwd(eager, [x], _params(convs))
    assert_close_dtype(out, ref, dtype)
    assert len(grads) == len(ref_grads) == 1 + len(_params(convs))
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close_dtype(g, r, dtype, msg=f"grad {i}")


def _within_twice_eager_error(convs, convs64, x, x64, act, p):
    """The fused op's output and every gradient within twice eager's error in ``x``'s dtype, against fp64."""
    ref, ref_grads = run_fwd_bwd(_eager(convs64, act, p), [x64], _params(convs64))
    eager, eager_grads = run_fwd_bwd(_eager(convs, act, p), [x], _params(convs))
    out, grads = run_fwd_bwd(_fused(convs, act, p), [x], _params(convs))
    assert_within_eager_error(out, eager, ref)
    for i, (g, e, r) in enumerate(zip(grads, eager_grads, ref_grads)):
        assert_within_eager_error(g, e, r, name=f"grad {i}")


@pytest.mark.parametrize("act", list(_ACTS))
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_every_gradient_match_eager(act, p, bias, dtype):
    convs = _convs(bias=bias, dtype=dtype)
    fused = _fused(convs, act, p)
    fused.set_rng(11, 2)
    x = seeded(3, 6, 5, 7, seed=1, dtype=dtype, requires_grad=True)
    _compare(fused, _eager(convs, act, p, step=2), x, convs)
    assert fused.rng_step == 3


@pytest.mark.parametrize("geometry", [dict(k1=3, k2=1), dict(k1=1, k2=3), dict(k1=3, stride=2),
                                      dict(k1=3, groups=6, hidden=12), dict(hidden=7, out=5)])
def test_odd_geometries_channels_last_and_non_contiguous_inputs(geometry):
    convs = _convs(**geometry)
    base = seeded(2, 6, 9, 11, seed=3)
    for x in (base.to(memory_format=torch.channels_last), base[:, :, :, 1:10], base.transpose(2, 3)):
        for p in (0.0, 0.2):  # channels-last: walked in memory order without a mask, in (N, C, H, W) order with one
            _compare(_fused(convs, "gelu", p), _eager(convs, "gelu", p), x.requires_grad_(True), convs)
            # the output in eager's layout: a channels-last map stays one for the layers after it (their speed, and
            # the bits of any torch dropout drawn in memory order there)
            assert _fused(convs, "gelu", p)(x).stride() == _eager(convs, "gelu", p)(x).stride()


@pytest.mark.parametrize("act", ["gelu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_within_twice_eager_error(act, dtype):
    convs64, convs = _convs(c=16, hidden=48, dtype=torch.float64), _convs(c=16, hidden=48, dtype=dtype)
    x64 = seeded(2, 16, 6, 5, seed=2, dtype=torch.float64, requires_grad=True)
    x = x64.detach().to(dtype).requires_grad_(True)
    _within_twice_eager_error(convs, convs64, x, x64, act, 0.2)


def test_under_autocast_it_computes_what_autocast_makes_of_the_chain():
    convs = _convs(c=16, hidden=32)
    x = seeded(2, 16, 5, 5, seed=4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads = run_fwd_bwd(_fused(convs, "gelu"), [x], _params(convs))
        ref, ref_grads = run_fwd_bwd(_eager(convs, "gelu"), [x], _params(convs))
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_close_dtype(out, ref, torch.bfloat16)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == r.dtype and torch.allclose(g, r, rtol=2e-2, atol=2e-2 * r.abs().max().item())


def test_empty_batch_draws_a_step_and_eval_mode_draws_none():
    convs = _convs()
    fused = _fused(convs, "silu", 0.2)
    out, grads = run_fwd_bwd(fused, [torch.zeros(0, 6, 4, 4, requires_grad=True)], _params(convs))
    assert out.shape == (0, 6, 4, 4) and all(g is None or not g.any() for g in grads) and fused.rng_step == 1
    fused.eval()
    x = seeded(2, 6, 4, 4, seed=5)
    assert_close_dtype(fused(x), _eager(convs, "silu")(x)) and fused.rng_step == 1


def test_eval_mode_with_grad_runs_the_fused_op_without_a_draw():
    convs = _convs()
    fused, eager = _fused(convs, "gelu", 0.3).eval(), _eager(convs, "gelu")  # eager: the chain without dropout
    x = seeded(2, 6, 4, 4, seed=5, requires_grad=True)
    out, grads = run_fwd_bwd(fused, [x], _params(convs))
    ref, ref_grads = run_fwd_bwd(eager, [x], _params(convs))
    assert_close_dtype(out, ref)
    for g, r in zip(grads, ref_grads):
        assert_close_dtype(g, r)
    assert fused.rng_step == 0
    assert activation_bytes(lambda: fused(x)) < activation_bytes(lambda: eager(x))


def test_an_already_counter_based_dropout_lends_its_stream():
    from opsnn_lab.ops import Dropout

    convs = _convs()
    drop = Dropout(0.25, seed=5)
    fused = FusedConvActDropoutConv.from_modules(convs[0], nn.GELU(), drop, convs[1])
    x = seeded(2, 6, 4, 5, seed=6)
    torch.testing.assert_close(fused(x), convs[1](drop(F.gelu(convs[0](x)))), rtol=0, atol=0)


def test_saves_the_input_and_the_preactivation_only():
    convs = _convs(c=16, hidden=64)
    x = seeded(4, 16, 8, 8, seed=7, requires_grad=True)
    eager, fused = _eager(convs, "gelu", 0.1), _fused(convs, "gelu", 0.1)
    got, want = activation_bytes(lambda: fused(x)), activation_bytes(lambda: eager(x))
    unit = x.numel() * 4  # one input-sized fp32 tensor; the hidden one is 4x as large
    assert got == unit + 4 * unit  # x and the pre-activation
    assert want >= unit + 3 * 4 * unit  # x, the pre-activation, the activation's output, the dropout's mask


def test_supports_and_bad_arguments_name_the_argument():
    conv1, conv2 = _convs()
    ok, why = FusedConvActDropoutConv.supports(conv1, nn.GELU(), None, nn.Conv2d(7, 6, 1))
    assert not ok and "conv2 must have in_channels=20" in why
    for args, err, match in [((conv1, nn.Tanh(), None, conv2), TypeError, "act"),
                             ((conv1, nn.GELU(), nn.Dropout2d(0.1), conv2), TypeError, "dropout"),
                             ((nn.Linear(6, 20), nn.GELU(), None, conv2), TypeError, "conv1 must be Conv2d"),
                             ((conv1, nn.GELU(), None, nn.Conv2d(20, 6, 3, padding=1, padding_mode="reflect")),
                              TypeError, "conv2.padding_mode"),
                             ((conv1, nn.GELU(), None, nn.Conv2d(20, 6, 1).double()), TypeError, "conv2 must have")]:
        with pytest.raises(err, match=match):
            FusedConvActDropoutConv.from_modules(*args)
    fused = _fused((conv1, conv2), "gelu")
    for x, err, match in [(seeded(2, 5, 4, 4), ValueError, "x must have 6 channels"),
                          (seeded(2, 6, 4, 4).double(), TypeError, "x has dtype"),
                          (seeded(4, 4), ValueError, "x")]:  # (C, H, W) runs as unbatched
        with pytest.raises(err, match=match):
            fused(x)


def test_parameters_stay_the_convolutions_own():
    conv1, conv2 = _convs()
    fused = _fused((conv1, conv2), "gelu")
    assert [p for p in fused.parameters()] == _params((conv1, conv2))
    quiet = FusedConvActDropoutConv.from_modules(conv1, nn.GELU(), None, conv2, register_modules=False)
    assert not list(quiet.parameters()) and quiet.convs == (conv1, conv2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("act", ["gelu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_matches_eager_error_bound(act, dtype):
    convs = [c.cuda() for c in _convs(c=96, hidden=384, k1=1, dtype=dtype)]
    convs64 = [c.cuda() for c in _convs(c=96, hidden=384, k1=1, dtype=torch.float64)]
    x64 = seeded(8, 96, 28, 28, seed=12, dtype=torch.float64, device="cuda", scale=0.5, requires_grad=True)
    x = x64.detach().to(dtype).requires_grad_(True)
    _within_twice_eager_error(convs, convs64, x, x64, act, 0.1)


# --------------------------------------------------------------------------- Triton under the interpreter
@pytest.fixture
def interpreted():
    if not triton_available():
        pytest.skip("triton not installed")
    with reloaded(rng, gelu_dropout, conv_mlp_ops, TRITON_INTERPRET="1", OPSNN_BACKEND="triton") as ops:
        yield ops


@pytest.mark.parametrize("act, p", [("gelu", 0.3), ("silu", 0.0)])
def test_triton_interpreter_matches_eager(interpreted, act, p):
    convs = _convs(c=4, hidden=8)
    x = seeded(2, 4, 3, 5, seed=10, requires_grad=True)
    _compare(_fused(convs, act, p, ops=interpreted), _eager(convs, act, p), x, convs)
