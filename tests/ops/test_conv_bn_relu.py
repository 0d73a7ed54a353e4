"""FusedConvBNAct / FusedConvBNReLU against eager nn.Sequential(conv, bn, act[, maxpool]): outputs, every
gradient, running statistics, every activation, grouped and depthwise convs, layouts, empty batch, bad
arguments and the activation bytes it saves."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from opsnn_lab.measuring import activation_bytes, saved_tensors_report
from opsnn_lab.ops.conv_bn_relu import FusedConvBNAct, FusedConvBNReLU
from opsnn_lab.testing import assert_within_eager_error, non_contiguous, seeded, triton_interpreter_ready

# (N, Cin, H, W, Cout, kernel, stride, padding, pool (k, s, p) or None, conv bias, groups)
SHAPES = [
    (2, 3, 9, 7, 5, 3, 1, 1, None, True, 1),
    (3, 5, 11, 13, 7, 3, 2, 0, (3, 2, 1), True, 1),
    (2, 7, 8, 8, 3, 1, 1, 0, (2, 2, 0), False, 1),
    (1, 3, 15, 9, 4, 5, 2, 2, (3, 2, 1), False, 1),
    (2, 4, 10, 9, 6, 3, 1, 1, (2, 1, 1), True, 2),
]


ACTS = {"relu": lambda: nn.ReLU(), "relu6": lambda: nn.ReLU6(inplace=True), "leaky_relu": lambda: nn.LeakyReLU(0.2),
        "leaky_relu_neg": lambda: nn.LeakyReLU(-0.3), "silu": lambda: nn.SiLU(), "hardswish": lambda: nn.Hardswish(),
        "gelu": lambda: nn.GELU(), "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "mish": lambda: nn.Mish(),
        "elu": lambda: nn.ELU(inplace=True)}


def make_chain(cin, cout, k, stride, padding, pool, bias=True, groups=1, seed=0, momentum=0.1, inplace=False,
               act=None, dilation=1):
    torch.manual_seed(seed)
    conv = nn.Conv2d(cin, cout, k, stride, padding, dilation=dilation, bias=bias, groups=groups)
    bn = nn.BatchNorm2d(cout, momentum=momentum)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5) if act in (None, "relu") else bn.weight.uniform_(1.0, 4.0)  # reach 6 and +-3
        bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 2.0)
    mods = [conv, bn, ACTS[act]() if act else nn.ReLU(inplace=inplace)]
    if pool is not None:
        mods.append(nn.MaxPool2d(*pool))
    return mods


def params(mods):
    conv, bn = mods[0], mods[1]
    return [p for p in (conv.weight, conv.bias, bn.weight, bn.bias) if p is not None]


def fwd_bwd(module, mods, x, steps=1, grad_seed=7):
    """Run ``steps`` forward+backward passes; return output, input grad, param grads, BN buffers."""
    for p in params(mods):
        p.grad = None
    x = x.detach().clone().requires_grad_(True) if not x.requires_grad else x
    for step in range(steps):
        x.grad = None
        out = module(x)
        g = seeded(*out.shape, seed=grad_seed + step, dtype=out.dtype)
        out.backward(g)
    bn = mods[1]
    bufs = [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]
    return out.detach(), x.grad, [p.grad.clone() for p in params(mods)], bufs


def pair(mods, dtype=torch.float32, train=True):
    eager_mods = copy.deepcopy(mods)
    for m in eager_mods + mods:
        m.to(dtype)
    eager = nn.Sequential(*eager_mods).train(train)
    cls = FusedConvBNReLU if type(mods[2]) is nn.ReLU else FusedConvBNAct
    fused = cls.from_modules(*mods[:3], mods[3] if len(mods) > 3 else None).train(train)
    return eager, eager_mods, fused


def assert_rel(actual, expected, rtol=1e-5, name="", scale=0.0):
    """fp32 criterion: max |a - e| <= rtol * max(max |e|, scale) (+ a tiny floor for all-zero references)."""
    err = (actual.double() - expected.double()).abs().max().item() if expected.numel() else 0.0
    scale = max(scale, expected.double().abs().max().item() if expected.numel() else 0.0)
    assert err <= rtol * scale + 1e-7, f"{name}: max error {err:.3e} > {rtol} x {scale:.3e}"


def compare(eager_res, fused_res, rtol=1e-5):
    names = ["output", "input grad"]
    for name, e, f in zip(names, eager_res[:2], fused_res[:2]):
        assert f.shape == e.shape, name
        assert_rel(f, e, rtol, name)
    # In training the conv bias gradient is exactly 0 in exact arithmetic (BN removes a per-channel shift):
    # both sides hold rounding noise of a sum whose terms are as large as the BN bias gradient, so that
    # gradient's magnitude is the scale the 1e-5 is taken of.
    bn_bias_scale = eager_res[2][-1].abs().max().item()
    for i, (e, f) in enumerate(zip(eager_res[2], fused_res[2])):
        assert_rel(f, e, rtol, f"param grad {i}", scale=bn_bias_scale)
    for name, e, f in zip(["running_mean", "running_var", "num_batches_tracked"], eager_res[3], fused_res[3]):
        assert_rel(f, e, rtol, name)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + f"-pool{s[8]}-g{s[10]}")
def test_matches_eager_fp32(shape, train):
    n, cin, h, w, cout, k, s, p, pool, bias, groups = shape
    mods = make_chain(cin, cout, k, s, p, pool, bias=bias, groups=groups)
    eager, eager_mods, fused = pair(mods, train=train)
    x = seeded(n, cin, h, w, seed=1)
    compare(fwd_bwd(eager, eager_mods, x, steps=2), fwd_bwd(fused, mods, x, steps=2))


@pytest.mark.parametrize("momentum", [None, 0.3])
def test_running_stats_momentum(momentum):
    mods = make_chain(3, 5, 3, 1, 1, (3, 2, 1), momentum=momentum)
    eager, eager_mods, fused = pair(mods)
    x = seeded(2, 3, 7, 9, seed=2)
    e, f = fwd_bwd(eager, eager_mods, x, steps=4), fwd_bwd(fused, mods, x, steps=4)
    compare(e, f)
    assert int(mods[1].num_batches_tracked) == 4


@pytest.mark.parametrize("layout", ["channels_last", "strided"])
def test_non_contiguous_input(layout):
    mods = make_chain(5, 4, 3, 2, 1, (3, 2, 1))
    eager, eager_mods, fused = pair(mods)
    base = seeded(2, 5, 13, 11, seed=3)
    x = base.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else non_contiguous(base)
    assert not x.is_contiguous()
    e = fwd_bwd(eager, eager_mods, x.detach().clone(memory_format=torch.preserve_format).requires_grad_())
    f = fwd_bwd(fused, mods, x.detach().clone(memory_format=torch.preserve_format).requires_grad_())
    compare(e, f)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    assert fused(x).is_contiguous(memory_format=fmt)


def _fp64_reference(mods, x, train):
    ref_mods = [copy.deepcopy(m).double() for m in mods]
    ref = nn.Sequential(*ref_mods).train(train)
    return fwd_bwd(ref, ref_mods, x.double())


# (N, Cin, H, W, Cout, kernel, stride, padding, pool, activation, groups)
LOW_PRECISION = [
    (torch.bfloat16, (2, 3, 12, 10, 6, 3, 2, 1, (3, 2, 1), "relu", 1)),
    (torch.bfloat16, (2, 5, 9, 7, 7, 3, 1, 1, None, "relu", 1)),
    (torch.float16, (2, 3, 7, 5, 4, 3, 1, 1, (3, 2, 1), "relu", 1)),
    (torch.bfloat16, (2, 6, 9, 7, 6, 3, 2, 1, None, "relu6", 6)),
    (torch.float16, (2, 6, 9, 7, 6, 3, 1, 1, (3, 2, 1), "relu6", 6)),
    (torch.bfloat16, (2, 4, 9, 7, 8, 1, 1, 0, None, "silu", 1)),
    (torch.float16, (2, 6, 10, 9, 6, 3, 2, 1, None, "silu", 6)),
    (torch.bfloat16, (2, 6, 9, 7, 6, 3, 1, 1, (2, 2, 0), "hardswish", 6)),
    (torch.float16, (2, 4, 9, 7, 8, 1, 1, 0, None, "hardswish", 1)),
    (torch.bfloat16, (2, 4, 9, 7, 6, 3, 1, 1, (3, 2, 1), "gelu", 2)),
    (torch.float16, (2, 4, 9, 7, 6, 3, 1, 1, None, "gelu_tanh", 1)),
    (torch.bfloat16, (2, 4, 9, 7, 6, 3, 1, 1, None, "leaky_relu", 1)),
    (torch.bfloat16, (2, 4, 9, 7, 6, 3, 2, 1, None, "mish", 2)),
    (torch.float16, (2, 4, 9, 7, 6, 3, 1, 1, (3, 2, 1), "elu", 1)),
]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype, shape", LOW_PRECISION,
                         ids=[f"{str(d)[6:]}-{s[9]}-g{s[10]}-pool{s[8] is not None:d}" for d, s in LOW_PRECISION])
def test_low_precision_within_eager_error(dtype, shape, train):
    n, cin, h, w, cout, k, s, p, pool, act, groups = shape
    mods = make_chain(cin, cout, k, s, p, pool, act=act, groups=groups)
    ref = _fp64_reference(mods, seeded(n, cin, h, w, seed=4), train)
    eager, eager_mods, fused = pair(mods, dtype=dtype, train=train)
    x = seeded(n, cin, h, w, seed=4, dtype=dtype)
    e, f = fwd_bwd(eager, eager_mods, x), fwd_bwd(fused, mods, x)
    assert f[0].dtype == dtype
    assert_within_eager_error(f[0], e[0], ref[0], name="output")
    assert_within_eager_error(f[1], e[1], ref[1], name="input grad")
    for i, (fg, eg, rg) in enumerate(zip(f[2], e[2], ref[2])):
        assert_within_eager_error(fg, eg, rg, name=f"param grad {i}")
    for i, (fb, eb, rb) in enumerate(zip(f[3][:2], e[3][:2], ref[3][:2])):
        assert_within_eager_error(fb, eb, rb, name=f"running stat {i}")


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("pool", [None, (3, 2, 1)])
def test_empty_batch_matches_eager(pool, train):
    """Eager accepts an empty batch: empty output, running stats untouched, counter + 1, zero grads."""
    mods = make_chain(3, 4, 3, 1, 1, pool)
    eager, eager_mods, fused = pair(mods, train=train)
    x = torch.zeros(0, 3, 8, 8)
    e, f = fwd_bwd(eager, eager_mods, x), fwd_bwd(fused, mods, x)
    assert f[0].shape == e[0].shape and f[1].shape == x.shape
    compare(e, f)


def test_one_value_per_channel_raises_like_eager():
    mods = make_chain(3, 4, 3, 1, 0, None)
    eager, _, fused = pair(mods)
    x = seeded(1, 3, 3, 3)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        eager(x)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        fused(x)


def test_relu_inplace_and_deterministic():
    mods = make_chain(3, 6, 3, 1, 1, (3, 2, 1), inplace=True)
    eager, eager_mods, fused = pair(mods)
    x = seeded(2, 3, 9, 9, seed=5)
    e = fwd_bwd(eager, eager_mods, x)
    before = [m.clone() for m in (mods[1].running_mean, mods[1].running_var)]
    f1 = fwd_bwd(fused, mods, x)
    compare(e, f1)
    mods[1].running_mean.copy_(before[0])
    mods[1].running_var.copy_(before[1])
    f2 = fwd_bwd(fused, mods, x)
    for a, b in zip([f1[0], f1[1], *f1[2]], [f2[0], f2[1], *f2[2]]):
        assert torch.equal(a, b)


def test_shares_original_parameters_and_state_dict_keys():
    conv, bn, relu, pool = make_chain(3, 4, 3, 1, 1, (3, 2, 1))
    fused = FusedConvBNReLU.from_modules(conv, bn, relu, pool)
    assert fused.conv.weight is conv.weight and fused.bn.running_var is bn.running_var
    assert set(fused.state_dict()) == {"conv.weight", "conv.bias", "bn.weight", "bn.bias", "bn.running_mean",
                                       "bn.running_var", "bn.num_batches_tracked"}
    bare = FusedConvBNReLU.from_modules(conv, bn, relu, pool, register_modules=False)
    assert bare.state_dict() == {} and list(bare.parameters()) == []
    bare.train()(seeded(2, 3, 6, 6))
    assert int(bn.num_batches_tracked) == 1  # the originals' buffers are the ones updated
    conv.double(), bn.double()
    assert bare(seeded(2, 3, 6, 6, dtype=torch.float64)).dtype == torch.float64


def test_activation_bytes_small_stem():
    """Bytes are exact: the fused stem saves at most 0.6 of eager, indices as uint8, no int64, no pre-pool ReLU."""
    mods = make_chain(3, 16, 7, 2, 3, (3, 2, 1), bias=False)
    eager, _, fused = pair(mods)
    x = seeded(2, 3, 64, 64)
    ratio = activation_bytes(lambda: fused(x)) / activation_bytes(lambda: eager(x))
    assert ratio <= 0.6, ratio
    saved = saved_tensors_report(lambda: fused(x)).tensors
    dtypes = {row["dtype"] for row in saved}
    assert "uint8" in dtypes and "int64" not in dtypes
    full = [row for row in saved if row["shape"] == (2, 16, 32, 32)]
    assert len(full) == 1  # the conv output only; the ReLU output before the pool is never kept


def test_activation_bytes_without_pool():
    """Conv+BN+ReLU saves the conv input and output only (eager adds the ReLU output): (x + y) / (x + 2y)."""
    mods = make_chain(3, 16, 3, 1, 1, None, bias=False)
    eager, _, fused = pair(mods)
    x = seeded(2, 3, 32, 32)
    assert activation_bytes(lambda: fused(x)) / activation_bytes(lambda: eager(x)) <= 0.6


@pytest.mark.parametrize("padding", ["same", "valid"])
def test_string_padding(padding):
    mods = make_chain(3, 4, 3, 1, padding, None)
    eager, eager_mods, fused = pair(mods)
    x = seeded(2, 3, 7, 6, seed=8)
    compare(fwd_bwd(eager, eager_mods, x), fwd_bwd(fused, mods, x))
    even = nn.Conv2d(3, 4, 2, padding="same")
    ok, reason = FusedConvBNReLU.supports(even, nn.BatchNorm2d(4), nn.ReLU())
    assert not ok and "conv.padding" in reason


def test_eval_saves_no_conv_output_with_pool():
    mods = make_chain(3, 8, 3, 1, 1, (2, 2, 0))
    _, _, fused = pair(mods, train=False)
    x = seeded(2, 3, 8, 8, requires_grad=True)
    shapes = [row["shape"] for row in saved_tensors_report(lambda: fused(x)).tensors]
    assert (2, 8, 8, 8) not in shapes


@pytest.mark.parametrize("kwargs, match", [
    ({"padding_mode": "reflect"}, "padding_mode"),
    ({"affine": False}, "affine"),
    ({"track_running_stats": False}, "track_running_stats"),
    ({"dilation": 2}, "dilation"),
    ({"ceil_mode": True}, "ceil_mode"),
    ({"return_indices": True}, "return_indices"),
    ({"num_features": 5}, "num_features"),
])
def test_unsupported_configs_rejected(kwargs, match):
    conv_kw = {k: v for k, v in kwargs.items() if k == "padding_mode"}
    bn_kw = {k: v for k, v in kwargs.items() if k in ("affine", "track_running_stats", "num_features")}
    pool_kw = {k: v for k, v in kwargs.items() if k in ("dilation", "ceil_mode", "return_indices")}
    conv = nn.Conv2d(3, 4, 3, padding=1, **conv_kw)
    bn = nn.BatchNorm2d(bn_kw.pop("num_features", 4), **bn_kw)
    pool = nn.MaxPool2d(3, 2, 1, **pool_kw)
    ok, reason = FusedConvBNReLU.supports(conv, bn, nn.ReLU(), pool)
    assert not ok and match in reason
    with pytest.raises(ValueError, match=match):
        FusedConvBNReLU.from_modules(conv, bn, nn.ReLU(), pool)


def test_wrong_module_types_raise_type_error():
    conv, bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
    assert FusedConvBNReLU.supports(conv, bn, nn.ReLU()) == (True, "")
    for args, name in [((nn.Linear(3, 4), bn, nn.ReLU()), "conv"), ((conv, nn.BatchNorm1d(4), nn.ReLU()), "bn"),
                       ((conv, bn, nn.GELU()), "relu"), ((conv, bn, nn.ReLU(), nn.AvgPool2d(2)), "maxpool")]:
        assert not FusedConvBNReLU.supports(*args)[0]
        with pytest.raises(TypeError, match=name):
            FusedConvBNReLU.from_modules(*args)


def test_bad_inputs_name_the_argument():
    fused = FusedConvBNReLU.from_modules(*make_chain(3, 4, 3, 1, 1, None))
    with pytest.raises(ValueError, match="input"):
        fused(seeded(3, 8, 8))
    with pytest.raises(ValueError, match="channels"):
        fused(seeded(2, 5, 8, 8))
    with pytest.raises(TypeError, match="dtype"):
        fused(seeded(2, 3, 8, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="input"):
        fused(torch.zeros(2, 3, 8, 8, dtype=torch.int64))
    with pytest.raises(TypeError, match="input"):
        fused([1.0, 2.0])


@pytest.mark.skipif(not triton_interpreter_ready(), reason="triton missing, or imported before TRITON_INTERPRET=1")
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("pool", [None, (3, 2, 1)])
@pytest.mark.parametrize("act", [None, "hardswish", "mish", "elu"])
def test_triton_interpreter_path_matches_eager(monkeypatch, act, pool, train):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("OPSNN_BACKEND", "triton")
    mods = make_chain(3, 4, 3, 1, 1, pool, act=act)
    eager, eager_mods, fused = pair(mods, train=train)
    x = seeded(2, 3, 7, 6, seed=6)
    compare(fwd_bwd(eager, eager_mods, x), fwd_bwd(fused, mods, x))


# ------------------------------------------------------------------------------------------------ activations
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("pool", [None, (3, 2, 1)], ids=["nopool", "pool"])
@pytest.mark.parametrize("act", list(ACTS))
def test_every_activation_matches_eager_fp32(act, pool, train):
    mods = make_chain(4, 6, 3, 1, 1, pool, groups=2, act=act)
    eager, eager_mods, fused = pair(mods, train=train)
    x = seeded(2, 4, 9, 8, seed=11)
    compare(fwd_bwd(eager, eager_mods, x, steps=2), fwd_bwd(fused, mods, x, steps=2))


# (Cin = Cout = groups, kernel, stride, padding, dilation, pool): MobileNet/EfficientNet depthwise layers
DEPTHWISE = [(8, 3, 2, 1, 1, None), (8, 3, 1, "same", 2, None), (6, 5, 2, "valid", 1, None), (6, 3, 1, 1, 1, (3, 2, 1)),
             (5, 3, 2, 2, 2, (2, 2, 0))]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("cfg, act", list(zip(DEPTHWISE, ["relu6", "silu", "hardswish", "silu", "relu6"])),
                         ids=lambda c: c if isinstance(c, str) else "c{}k{}s{}p{}d{}-pool{}".format(*c))
def test_depthwise_matches_eager(cfg, act, train):
    c, k, s, p, d, pool = cfg
    mods = make_chain(c, c, k, s, p, pool, groups=c, act=act, dilation=d, bias=False)
    eager, eager_mods, fused = pair(mods, train=train)
    x = seeded(2, c, 13, 11, seed=12)
    compare(fwd_bwd(eager, eager_mods, x, steps=2), fwd_bwd(fused, mods, x, steps=2))


@pytest.mark.parametrize("recompute", [None, True, False], ids=["auto", "recompute", "save"])
@pytest.mark.parametrize("stride, pool", [(1, None), (2, None), (1, (3, 2, 1))])
def test_depthwise_recomputes_its_conv_output_with_the_same_bits(stride, pool, recompute):
    # by default a stride-1 depthwise conv's output is recomputed in backward instead of saved: the op keeps
    # only the conv input (which the conv's weight gradient needs anyway) and per-channel statistics, a third
    # of eager's bytes; at stride 2 it is saved. The recomputed output has the saved one's bits, so every
    # gradient is bitwise the gradient of the op that saves it.
    c, hw = 12, 10
    recomputes = stride == 1 if recompute is None else recompute
    mods = make_chain(c, c, 3, stride, 1, pool, groups=c, act="relu6", bias=True)
    eager = nn.Sequential(*copy.deepcopy(mods))
    fused = FusedConvBNAct.from_modules(*mods[:3], mods[3] if pool else None, recompute=recompute)
    x = seeded(2, c, hw, hw, seed=5)
    shapes = [row["shape"] for row in saved_tensors_report(lambda: fused(x)).tensors]
    conv_out = (2, c, (hw - 1) // stride + 1, (hw - 1) // stride + 1)
    kept = shapes.count(conv_out) - (stride == 1)  # at stride 1, x itself has the conv output's shape
    assert kept == (0 if recomputes else 1), shapes
    ratio = activation_bytes(lambda: fused(x)) / activation_bytes(lambda: eager(x))
    if pool is None:
        n_x, n_y = hw * hw, conv_out[2] * conv_out[3]
        kept_bytes = n_x + (0 if recomputes else n_y)
        assert ratio == pytest.approx(kept_bytes / (n_x + 2 * n_y), abs=0.02), ratio  # eager: x, y, y'
    grads = []
    for flag in (True, False):
        m = make_chain(c, c, 3, stride, 1, pool, groups=c, act="relu6", bias=True)
        op = FusedConvBNAct.from_modules(*m[:3], m[3] if pool else None, recompute=flag)
        xi = x.clone().requires_grad_()
        op(xi).square().sum().backward()
        grads.append([xi.grad, *(p.grad for p in m[0].parameters()), *(p.grad for p in m[1].parameters())])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_a_full_conv_recomputes_on_request_with_the_same_bits():
    grads = []
    for flag in (True, False):
        m = make_chain(4, 6, 3, 1, 1, None, act="silu")
        op = FusedConvBNAct.from_modules(*m[:3], recompute=flag)
        x = seeded(2, 4, 7, 9, seed=3).requires_grad_()
        op(x).square().sum().backward()
        grads.append([x.grad, *(p.grad for p in m[0].parameters()), *(p.grad for p in m[1].parameters())])
        assert ("recompute=True" in repr(op)) == flag
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="recompute must be bool"):
        FusedConvBNAct.from_modules(*make_chain(4, 6, 3, 1, 1, None, act="silu")[:3], recompute="yes")


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_accurate", "silu"])
def test_hugging_face_activations(name):
    activations = pytest.importorskip("transformers.activations")
    act = activations.ACT2FN[name]
    expected = "silu" if name == "silu" else "gelu" if name == "gelu" else "gelu_tanh"
    mods = make_chain(3, 5, 3, 1, 1, (3, 2, 1))
    mods[2] = act
    assert FusedConvBNAct.supports(*mods) == (True, "")
    eager, eager_mods, fused = pair(mods)
    assert fused.act_spec.name == expected
    x = seeded(2, 3, 9, 7, seed=13)
    e, f = fwd_bwd(eager, eager_mods, x), fwd_bwd(fused, mods, x)
    compare(e, f, rtol=1e-5 if name in ("gelu", "silu", "gelu_pytorch_tanh") else 1e-4)  # python tanh formulas


def test_unsupported_activations_are_named():
    conv, bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
    for act in (nn.Tanh(), nn.Sigmoid(), nn.Identity()):  # a PReLU is taken: tests/ops/test_conv_bn_prelu.py
        ok, reason = FusedConvBNAct.supports(conv, bn, act)
        assert not ok and reason.startswith("act must be one of") and type(act).__name__ in reason
        with pytest.raises(TypeError, match="act must be"):
            FusedConvBNAct.from_modules(conv, bn, act)
    ok, reason = FusedConvBNAct.supports(conv, bn, "relu")
    assert not ok and "act must be an nn.Module" in reason
    with pytest.raises(TypeError, match="relu must be ReLU"):
        FusedConvBNReLU.from_modules(conv, bn, nn.SiLU())
    assert FusedConvBNReLU.supports(conv, bn, nn.SiLU())[1].startswith("relu must be ReLU")
    ok, reason = FusedConvBNAct.supports(conv, bn, nn.ELU(alpha=0.5))  # the kernels compute alpha 1
    assert not ok and "act (ELU) has alpha=0.5" in reason


def test_hugging_face_lookalike_is_probed():
    """A class named like an HF activation from a transformers module that computes something else is refused."""
    fake = type("QuickGELUActivation", (nn.Module,), {"forward": lambda self, x: x * torch.sigmoid(1.702 * x)})
    wrong = type("GELUActivation", (nn.Module,), {"forward": lambda self, x: x * torch.sigmoid(1.702 * x)})
    fake.__module__ = wrong.__module__ = "transformers.activations"
    conv, bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
    assert "act must be one of" in FusedConvBNAct.supports(conv, bn, fake())[1]
    ok, reason = FusedConvBNAct.supports(conv, bn, wrong())
    assert not ok and "does not compute gelu" in reason


def test_fused_relu_keeps_its_names():
    mods = make_chain(3, 4, 3, 1, 1, None)
    fused = FusedConvBNReLU.from_modules(*mods[:3])
    assert isinstance(fused, FusedConvBNAct) and fused.relu is mods[2] and fused.act_spec.name == "relu"
    general = FusedConvBNAct.from_modules(*mods[:3])
    assert general.act is mods[2] and not hasattr(general, "relu")
    assert set(general.state_dict()) == set(fused.state_dict())


@pytest.mark.parametrize("act", ["relu6", "silu", "hardswish", "gelu"])
def test_activation_bytes_pointwise_expansion(act):
    """1x1 expansion (MobileNetV2/EfficientNet, 4 -> 24): eager saves x, y and the BN output; fused x and y."""
    mods = make_chain(4, 24, 1, 1, 0, None, bias=False, act=act)
    eager, _, fused = pair(mods)
    x = seeded(2, 4, 16, 16)
    ratio = activation_bytes(lambda: fused(x)) / activation_bytes(lambda: eager(x))
    assert ratio <= (1 + 6) / (1 + 12) + 1e-3, ratio
    full = [r for r in saved_tensors_report(lambda: fused(x)).tensors if r["shape"] == (2, 24, 16, 16)]
    assert len(full) == 1  # the conv output only: the pre-activation is recomputed


@pytest.mark.parametrize("act, keeps_conv_output", [("relu6", False), ("silu", True), ("leaky_relu", True)])
def test_eval_with_pool_saves_conv_output_only_when_needed(act, keeps_conv_output):
    mods = make_chain(3, 8, 3, 1, 1, (2, 2, 0), act=act)
    _, _, fused = pair(mods, train=False)
    x = seeded(2, 3, 8, 8, requires_grad=True)
    shapes = [row["shape"] for row in saved_tensors_report(lambda: fused(x)).tensors]
    assert ((2, 8, 8, 8) in shapes) == keeps_conv_output
    assert shapes.count((2, 8, 8, 8)) <= 1


@pytest.mark.slow
def test_torch_compile_forward_backward_in_training():
    mods = make_chain(4, 6, 3, 2, 1, None, act="silu", groups=2)
    eager, eager_mods, fused = pair(mods)
    x = seeded(2, 4, 9, 8, seed=14)
    compiled = torch.compile(fused)
    compare(fwd_bwd(eager, eager_mods, x, steps=2), fwd_bwd(compiled, mods, x, steps=2))


def test_a_conv_subclass_is_fused_only_when_it_keeps_conv2d_forward():
    class Renamed(nn.Conv2d):  # as EfficientNet's depthwise conv: a new name, Conv2d's computation
        pass

    class Shifted(nn.Conv2d):
        def forward(self, x):
            return super().forward(x) + 1.0

    torch.manual_seed(0)
    bn, act = nn.BatchNorm2d(4), nn.SiLU()
    ok, why = FusedConvBNAct.supports(Renamed(4, 4, 3, padding=1, groups=4), bn, act)
    assert ok, why
    ok, why = FusedConvBNAct.supports(Shifted(4, 4, 3, padding=1), bn, act)
    assert not ok and "conv must be Conv1d, Conv2d or Conv3d" in why and "Shifted" in why
    conv = Renamed(4, 4, 3, padding=1, groups=4)
    x = torch.randn(2, 4, 7, 7)
    fused = FusedConvBNAct.from_modules(copy.deepcopy(conv), copy.deepcopy(bn), act).train()
    torch.testing.assert_close(fused(x), act(bn.train()(conv(x))), atol=1e-5, rtol=1e-5)
