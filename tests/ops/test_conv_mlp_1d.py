"""FusedConvActDropoutConv over Conv1d pairs (a speech model's convolutional feed-forward, Whisper's stem): run as
2-d convolutions of height 1, against eager with the counter-based mask over the row-major (N, C, L) tensor: output
and every gradient per dtype, odd geometries, a transposed (batch, frames, channels) input, half precision, what it
saves, and mixed dimensions turned down."""

import pytest
import torch
from torch import nn

from opsnn_lab.bench import activation_bytes
from opsnn_lab.kernels import rng
from opsnn_lab.ops import FusedConvActDropoutConv
from opsnn_lab.testing import assert_close_dtype, assert_within_eager_error, run_fwd_bwd, seeded

ACTS = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU}


def convs(c=6, hidden=20, k1=3, k2=1, stride=1, bias=True, dtype=torch.float32):
    torch.manual_seed(0)
    conv1 = nn.Conv1d(c, hidden, k1, stride=stride, padding=k1 // 2, bias=bias).to(dtype)
    return conv1, nn.Conv1d(hidden, c, k2, padding=k2 // 2, bias=bias).to(dtype)


def eager(pair, act, p=0.0, seed=11):
    conv1, conv2 = pair
    fn = ACTS[act]()

    def run(x):
        a = fn(conv1(x))
        if p > 0:  # step 0's mask, element e of the row-major (N, C, L) tensor at counter e
            a = a * rng.dropout_mask(seed, 0, a.shape, p, a.device, dtype=a.dtype) / (1 - p)
        return conv2(a)
    return run


def fused(pair, act, p=0.0):
    return FusedConvActDropoutConv.from_modules(pair[0], ACTS[act](), nn.Dropout(p) if p else None, pair[1], seed=11)


def params(pair):
    return [t for c in pair for t in (c.weight, c.bias) if t is not None]


@pytest.mark.parametrize("geometry", [dict(), dict(k1=1, k2=3), dict(k1=5, stride=2, bias=False)])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_every_gradient_match_eager(act, p, geometry, dtype):
    pair = convs(dtype=dtype, **geometry)
    x = seeded(3, 6, 17, dtype=dtype)
    out, grads = run_fwd_bwd(fused(pair, act, p), [x], params(pair))
    ref, ref_grads = run_fwd_bwd(eager(pair, act, p), [x], params(pair))
    assert out.shape == ref.shape and out.is_contiguous()
    assert_close_dtype(out, ref)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close_dtype(g, r, msg=f"grad {i}")


def test_transposed_input_as_a_feed_forward_reads_it():
    pair = convs()
    x = seeded(2, 17, 6).transpose(1, 2)  # (batch, frames, channels) read as (batch, channels, frames)
    out, grads = run_fwd_bwd(fused(pair, "relu", 0.2), [x], params(pair))
    ref, ref_grads = run_fwd_bwd(eager(pair, "relu", 0.2), [x], params(pair))
    assert out.stride() == ref.stride()
    assert_close_dtype(out, ref)
    for g, r in zip(grads, ref_grads):
        assert_close_dtype(g, r)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_within_twice_eager_error(dtype):
    pair, pair64 = convs(dtype=dtype), convs(dtype=torch.float64)
    x = seeded(2, 6, 19)
    want, want_grads = run_fwd_bwd(eager(pair64, "gelu"), [x.double()], params(pair64))
    got, got_grads = run_fwd_bwd(fused(pair, "gelu"), [x.to(dtype)], params(pair))
    base, base_grads = run_fwd_bwd(eager(pair, "gelu"), [x.to(dtype)], params(pair))
    for f, e, r in zip([got, *got_grads], [base, *base_grads], [want, *want_grads]):
        assert_within_eager_error(f, e, r)


def test_saves_the_input_and_the_preactivation_only():
    pair = convs(hidden=24)
    x = seeded(4, 6, 64)
    ratio = activation_bytes(lambda: fused(pair, "gelu")(x)) / activation_bytes(lambda: eager(pair, "gelu")(x))
    assert ratio == pytest.approx((6 + 24) / (6 + 24 + 24), abs=0.01), ratio  # x, h / x, h, gelu(h)


def test_mixed_dimensions_and_bad_inputs_name_the_argument():
    conv1, conv2 = convs()
    ok, why = FusedConvActDropoutConv.supports(conv1, nn.GELU(), None, nn.Conv2d(20, 6, 1))
    assert not ok and "conv2 must be Conv1d as conv1 is" in why
    ok, why = FusedConvActDropoutConv.supports(nn.Conv3d(6, 20, 1), nn.GELU(), None, conv2)
    assert not ok and "conv1 must be Conv2d or Conv1d" in why
    op = fused((conv1, conv2), "gelu")
    with pytest.raises(ValueError, match="x"):
        op(seeded(2, 6, 4, 4))  # a 2-d map for a 1-d MLP


@pytest.mark.parametrize("dim", [1, 2])
def test_an_unbatched_input_runs_as_the_convs_run_it(dim):
    """nn.Conv1d takes (C, L) and nn.Conv2d (C, H, W): the fused pair takes them too, as a batch of one (the mask
    over the same row-major elements)."""
    kind = nn.Conv1d if dim == 1 else nn.Conv2d
    torch.manual_seed(0)
    pair = kind(6, 20, 3, padding=1), kind(20, 6, 1)
    x = seeded(6, *(9,) * dim, dtype=torch.float64)
    pair = tuple(c.double() for c in pair)
    out, grads = run_fwd_bwd(fused(pair, "gelu", 0.3), [x], params(pair))
    ref, ref_grads = run_fwd_bwd(eager(pair, "gelu", 0.3), [x], params(pair))
    assert out.shape == ref.shape == x.shape
    assert_close_dtype(out, ref)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close_dtype(g, r, msg=f"grad {i}")
