"""FusedConvBNAct over 1-d and 3-d chains (Conv1d -> BatchNorm1d -> act [-> MaxPool1d], Conv3d -> BatchNorm3d ->
act) against eager: outputs, every gradient, running statistics, layouts, empty batches, half precision, the
bytes each saves, and the arguments it turns down."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from opsnn_lab.measuring import activation_bytes, saved_tensors_report
from opsnn_lab.ops.conv_bn_relu import FusedConvBNAct
from opsnn_lab.testing import TOLERANCES, assert_within_eager_error, seeded, triton_interpreter_ready

CONV = {1: nn.Conv1d, 3: nn.Conv3d}
BN = {1: nn.BatchNorm1d, 3: nn.BatchNorm3d}
SPATIAL = {1: (13,), 3: (5, 7, 6)}
ACTS = {"relu": nn.ReLU, "silu": nn.SiLU, "hardswish": nn.Hardswish, "gelu": nn.GELU, "relu6": nn.ReLU6}
# name: (Cin, Cout, kernel, stride, padding, groups, conv bias, MaxPool1d (k, s, p) or None, act)
CASES = {
    "plain": (3, 5, 3, 1, 1, 1, True, None, "relu"),
    "strided_valid": (4, 6, 3, 2, "valid", 1, False, None, "silu"),
    "depthwise": (6, 6, 5, 1, 2, 6, False, None, "silu"),
    "depthwise_s2": (6, 6, 3, 2, 1, 6, True, None, "hardswish"),
    "grouped_same": (4, 8, 3, 1, "same", 2, True, None, "gelu"),
    "pool": (3, 6, 3, 1, 1, 1, True, (3, 2, 1), "relu6"),
}


def chain(dim, case, seed=0):
    cin, cout, k, stride, padding, groups, bias, pool, act = CASES[case]
    torch.manual_seed(seed)
    conv = CONV[dim](cin, cout, k, stride, padding, groups=groups, bias=bias)
    bn = BN[dim](cout)
    with torch.no_grad():
        bn.weight.uniform_(1.0, 3.0)
        bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 2.0)
    return [conv, bn, ACTS[act](), *([nn.MaxPool1d(*pool)] if pool else [])]


def run(module, mods, x, steps=2):
    """Outputs of ``steps`` training steps' forward, the input's and every parameter's gradient, BN's buffers."""
    x = x.detach().clone().requires_grad_()
    for step in range(steps):
        out = module(x)
        out.backward(seeded(*out.shape, seed=9 + step, dtype=out.dtype, device=out.device))
    grads = [p.grad for m in mods[:2] for p in m.parameters()]
    return [out.detach(), x.grad, *grads, *mods[1].buffers()]


def pair(mods, dtype, train=True, **kwargs):
    eager_mods = [copy.deepcopy(m).to(dtype) for m in mods]
    fused_mods = [copy.deepcopy(m).to(dtype) for m in mods]
    fused = FusedConvBNAct.from_modules(*fused_mods[:3], fused_mods[3] if len(mods) > 3 else None, **kwargs)
    return (nn.Sequential(*eager_mods).train(train), eager_mods), (fused.train(train), fused_mods)


def cases(dim):
    return [c for c in CASES if dim == 1 or CASES[c][7] is None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dim, case", [(d, c) for d in (1, 3) for c in cases(d)])
def test_matches_eager(dim, case, train, dtype):
    (eager, em), (fused, fm) = pair(chain(dim, case), dtype, train)
    x = seeded(3, CASES[case][0], *SPATIAL[dim], seed=1, dtype=dtype)
    want, got = run(eager, em, x), run(fused, fm, x)
    rtol = TOLERANCES[dtype][0]
    bias = CASES[case][6]
    bn_bias_grad = want[5 if bias else 4].abs().max().item()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, i
        # in training the conv bias gradient is 0 in exact arithmetic (BN removes a per-channel shift): both hold
        # rounding noise of a sum of terms as large as the BN bias gradient's, which is its scale
        scale = bn_bias_grad * CASES[case][1] if i == 3 and bias and train else w.abs().max().item()
        assert (g.double() - w.double()).abs().max().item() <= rtol * max(scale, 1.0), (i, case)


LOW = [(1, "depthwise", torch.bfloat16), (1, "pool", torch.float16), (1, "plain", torch.bfloat16),
       (3, "plain", torch.float16), (3, "depthwise", torch.bfloat16), (3, "grouped_same", torch.bfloat16)]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dim, case, dtype", LOW, ids=[f"{d}d-{c}-{str(t)[6:]}" for d, c, t in LOW])
def test_half_precision_within_eager_error(dim, case, dtype, train):
    mods = chain(dim, case)
    (ref, rm), _ = pair(mods, torch.float64, train)
    (eager, em), (fused, fm) = pair(mods, dtype, train)
    x = seeded(3, CASES[case][0], *SPATIAL[dim], seed=2)
    want64 = run(ref, rm, x.double(), steps=1)
    eager_res, fused_res = run(eager, em, x.to(dtype), steps=1), run(fused, fm, x.to(dtype), steps=1)
    for i, (f, e, r) in enumerate(zip(fused_res[:-1], eager_res[:-1], want64[:-1])):  # num_batches_tracked aside
        assert_within_eager_error(f, e.to(f.dtype), r, name=f"tensor {i}")


def test_transposed_1d_input_gives_eager_layout():
    """A Conformer's conv module reads (batch, frames, channels) transposed: the same values, and the contiguous
    output aten's 1-d conv gives, not a channels-last one."""
    (eager, em), (fused, fm) = pair(chain(1, "depthwise"), torch.float32)
    x = seeded(3, 13, 6, seed=3).transpose(1, 2)
    want, got = run(eager, em, x), run(fused, fm, x)
    assert got[0].stride() == want[0].stride()
    for g, w in zip(got, want):  # the conv's weight gradient: another kernel's fp32 rounding on some CPUs (AVX2)
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * max(w.abs().max().item(), 1.0))


def test_channels_last_3d_input_keeps_its_layout():
    (eager, em), (fused, fm) = pair(chain(3, "grouped_same"), torch.float32)  # its conv bias gradient is noise
    em[0].bias = fm[0].bias = None
    x = seeded(2, 4, 5, 7, 6, seed=4).contiguous(memory_format=torch.channels_last_3d)
    got, want = run(fused, fm, x), run(eager, em, x)
    assert got[0].is_contiguous(memory_format=torch.channels_last_3d) and got[0].stride() == want[0].stride()
    for g, w in zip(got, want):  # the conv's weight gradient: another kernel's rounding
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * w.abs().max().item())


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dim, case", [(1, "pool"), (3, "plain")])
def test_empty_batch_matches_eager(dim, case, train):
    (eager, em), (fused, fm) = pair(chain(dim, case), torch.float32, train)
    x = torch.zeros(0, CASES[case][0], *SPATIAL[dim])
    want, got = run(eager, em, x, steps=1), run(fused, fm, x, steps=1)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("dim", [1, 3])
def test_one_value_per_channel_raises_like_eager(dim):
    (eager, _), (fused, _) = pair(chain(dim, "strided_valid"), torch.float32)
    x = seeded(1, 4, *(3,) * dim)  # 'valid' 3-wide kernel: one output value per channel
    for module in (eager, fused):
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            module(x)


@pytest.mark.parametrize("dim, recompute, kept", [(1, None, "x+y"), (1, True, "x"), (3, None, "x"), (3, False, "x+y")])
def test_depthwise_bytes(dim, recompute, kept):
    """A stride-1 depthwise 3-d conv's output is recomputed by default (x alone is kept: 1/3 of eager's x, conv
    output and activation output); a 1-d one's is saved (2/3), where recomputing costs more (``recompute``)."""
    (eager, _), (fused, fm) = pair(chain(dim, "depthwise"), torch.float32, recompute=recompute)
    x = seeded(2, 6, *(16,) * dim, seed=5)
    ratio = activation_bytes(lambda: fused(x)) / activation_bytes(lambda: eager(x))
    assert ratio == pytest.approx(1 / 3 if kept == "x" else 2 / 3, abs=0.02), ratio
    assert all(r["dtype"] != "int64" for r in saved_tensors_report(lambda: fused(x)).tensors)


def test_1d_pool_saves_uint8_indices():
    (eager, _), (fused, _) = pair(chain(1, "pool"), torch.float32)
    x = seeded(2, 3, 64, seed=6)
    dtypes = {r["dtype"] for r in saved_tensors_report(lambda: fused(x)).tensors}
    assert "uint8" in dtypes and "int64" not in dtypes
    assert activation_bytes(lambda: fused(x)) / activation_bytes(lambda: eager(x)) <= 0.6


@pytest.mark.parametrize("args, kind, match", [
    (lambda: (nn.Conv1d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), TypeError, "bn must be BatchNorm1d after a Conv1d"),
    (lambda: (nn.Conv3d(3, 4, 3), nn.BatchNorm1d(4), nn.ReLU()), TypeError, "bn must be BatchNorm3d"),
    (lambda: (nn.Conv3d(3, 4, 3), nn.BatchNorm3d(4), nn.ReLU(), nn.MaxPool3d(2)), TypeError, "maxpool must be None"),
    (lambda: (nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), nn.ReLU(), nn.MaxPool2d(2)), TypeError,
     "maxpool must be MaxPool1d"),
    (lambda: (nn.ConvTranspose1d(3, 4, 3), nn.BatchNorm1d(4), nn.ReLU()), TypeError, "conv must be Conv1d, Conv2d"),
    (lambda: (nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), nn.ReLU(), nn.MaxPool1d(3, dilation=2)), ValueError,
     "maxpool.dilation"),
    (lambda: (nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), nn.ReLU(), nn.MaxPool1d(2, padding=2)), ValueError,
     "maxpool.padding"),
    (lambda: (nn.Conv3d(3, 4, 3, padding_mode="circular", padding=1), nn.BatchNorm3d(4), nn.ReLU()), ValueError,
     "padding_mode"),
    (lambda: (nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4, affine=False), nn.ReLU()), ValueError,
     "BatchNorm1d without weight"),
    (lambda: (nn.Conv3d(3, 4, 3), nn.BatchNorm3d(5), nn.ReLU()), ValueError, "num_features"),
])
def test_unsupported_chains_name_the_argument(args, kind, match):
    mods = args()
    ok, why = FusedConvBNAct.supports(*mods)
    assert not ok and match in why, why
    with pytest.raises(kind, match=match.replace(".", r"\.")):
        FusedConvBNAct.from_modules(*mods)


@pytest.mark.parametrize("dim", [1, 3])
def test_bad_inputs_name_the_argument(dim):
    (_, _), (fused, _) = pair(chain(dim, "plain"), torch.float32)
    with pytest.raises(ValueError, match="input"):
        fused(seeded(2, 3, *(8,) * (dim + 1)))  # a 2-d / 4-d conv's input
    with pytest.raises(ValueError, match="channels"):
        fused(seeded(2, 5, *(8,) * dim))
    with pytest.raises(TypeError, match="dtype"):
        fused(seeded(2, 3, *(8,) * dim, dtype=torch.float64))


@pytest.mark.skipif(not triton_interpreter_ready(), reason="triton missing, or imported before TRITON_INTERPRET=1")
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dim, case", [(1, "pool"), (3, "depthwise")])
def test_triton_interpreter_path_matches_eager(monkeypatch, dim, case, train):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("OPSNN_BACKEND", "triton")
    (eager, em), (fused, fm) = pair(chain(dim, case), torch.float32, train)
    x = seeded(2, CASES[case][0], *SPATIAL[dim], seed=7)
    for g, w in zip(run(fused, fm, x, steps=1), run(eager, em, x, steps=1)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


GPU_CASES = [(1, "depthwise", "silu"), (1, "pool", "relu6"), (3, "plain", "relu"), (3, "depthwise", "elu"),
             (3, "grouped_same", "mish")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim, case, act", GPU_CASES, ids=[f"{d}d-{c}-{a}" for d, c, a in GPU_CASES])
def test_gpu_triton_path_within_eager_error(dim, case, act, dtype):
    """The Triton statistics and activation kernels on a 1-d chain's (N, C, 1, L) maps and a 3-d one's (N, C, D,
    H*W) view, Mish and ELU among the activations: every tensor within twice eager's error against fp64."""
    mods = chain(dim, case)
    mods[2] = ACTS[act]() if act in ACTS else {"elu": nn.ELU, "mish": nn.Mish}[act]()
    mods = [m.cuda() for m in mods]
    (ref, rm), _ = pair(mods, torch.float64)
    (eager, em), (fused, fm) = pair(mods, dtype)
    x = seeded(4, CASES[case][0], *(s * 3 for s in SPATIAL[dim]), seed=8, device="cuda")
    want = run(ref, rm, x.double(), steps=1)
    for f, e, r in zip(run(fused, fm, x.to(dtype), steps=1)[:-1], run(eager, em, x.to(dtype), steps=1)[:-1], want[:-1]):
        assert_within_eager_error(f, e.to(f.dtype), r)
