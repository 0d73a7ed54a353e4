"""strict() and weight norm: ``_weight_norm_interface`` (``torch.nn.utils.weight_norm`` and
``parametrizations.weight_norm``, e.g. Wav2Vec2's positional conv, normed over its last axis) and its backward
give the same bits at any thread count, within fp32 tolerance of the native kernels; and the other norm-style
reductions strict() leaves native are thread-invariant on this build."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations
from torch.nn.utils import weight_norm as old_weight_norm

from opsnn_lab.consistency import fixed_rows as fr
from opsnn_lab.consistency.strict import is_strict, strict
from opsnn_lab.testing import TOLERANCES, seeded, threads

C, T = 32, 24


@pytest.fixture(autouse=True)
def _never_leak_strict():
    yield
    strict(False)
    assert not is_strict(), "a test left strict mode on"


class _WeightNormed(nn.Module):
    """Both weight-norm APIs on a Conv1d and a Linear, over the first axis and over the last (the one whose
    native kernel sums rows in per-thread buffers)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        with warnings.catch_warnings():  # the deprecated torch.nn.utils.weight_norm is tested on purpose
            warnings.simplefilter("ignore", FutureWarning)
            self._build()

    def _build(self):
        self.pos_conv = parametrizations.weight_norm(nn.Conv1d(C, C, 16, padding=8, groups=2), dim=2)  # Wav2Vec2
        self.conv = old_weight_norm(nn.Conv1d(C, C, 3, padding=1), dim=2)
        # dim=0; kernel 3: a 1x1 Conv1d's oneDNN forward changes bits with the thread count even under strict()
        self.conv0 = old_weight_norm(nn.Conv1d(C, C, 3, padding=1))
        self.proj = parametrizations.weight_norm(nn.Linear(C, C), dim=1)
        self.head = parametrizations.weight_norm(nn.Linear(C, C))  # dim=0
        self.out = old_weight_norm(nn.Linear(C, C), dim=1)

    def forward(self, x):  # (B, C, T)
        h = x + F.gelu(self.pos_conv(x)[..., :-1]) + self.conv(x) + self.conv0(x)
        h = self.proj(h.transpose(1, 2))
        return self.out(F.gelu(self.head(h)))


_MODEL = _WeightNormed()
_X = seeded(8, C, T, seed=1)
_UPSTREAM = seeded(8, T, C, seed=2)


def _run(x, upstream):
    """Output, input gradient, then every parameter gradient in named_parameters order."""
    x = x.clone().requires_grad_()
    _MODEL.zero_grad(set_to_none=True)
    out = _MODEL(x)
    out.backward(upstream)
    return [out.detach(), x.grad] + [p.grad.clone() for _, p in _MODEL.named_parameters()]


def _names():
    return ["output", "input grad"] + [f"grad {n}" for n, _ in _MODEL.named_parameters()]


def test_weight_normed_model_has_the_same_bits_at_1_and_2_threads_under_strict():
    runs = []
    for n in (1, 2):
        with strict(), threads(n):
            runs.append(_run(_X, _UPSTREAM))
    differing = [name for name, a, b in zip(_names(), *runs) if not torch.equal(a, b)]
    assert not differing


def test_weight_normed_model_sample_bits_do_not_depend_on_batch_size_under_strict():
    with strict(), threads(2):
        full = _run(_X, _UPSTREAM)[:2]
        part = _run(_X[:2], _UPSTREAM[:2])[:2]
    for name, a, b in zip(("output", "input grad"), full, part):
        assert torch.equal(a[:2], b), name


def test_weight_normed_model_under_strict_is_within_fp32_tolerance_of_eager():
    atol, rtol = TOLERANCES[torch.float32]
    with threads(2):
        eager = _run(_X, _UPSTREAM)
        with strict():
            fixed = _run(_X, _UPSTREAM)
    for name, a, e in zip(_names(), fixed, eager):
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


# (v shape, dim, g shape): the first axis, the last, a Linear's last, a 1-d weight, a g given flat (ATen's
# kernel takes only the first and the last axis; weight_norm sends any other through norm_except_dim)
WEIGHT_NORM_CASES = [((24, 16, 5), 0, (24, 1, 1)), ((24, 16, 5), 2, (1, 1, 5)), ((40, 33), 1, (1, 33)),
                     ((7,), 0, (7,)), ((24, 16, 5), 0, (24,))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v_shape, dim, g_shape", WEIGHT_NORM_CASES)
def test_fixed_weight_norm_matches_the_native_kernel(v_shape, dim, g_shape, dtype):
    v, g = seeded(*v_shape, seed=3, dtype=dtype), (seeded(*g_shape, seed=4).abs() + 0.5).to(dtype)
    grad_w = seeded(*v_shape, seed=5, dtype=dtype)
    want_w, want_norm = torch._weight_norm_interface(v, g, dim)
    want_gv, want_gg = torch.ops.aten._weight_norm_interface_backward(grad_w, v, g, want_norm, dim)
    got_w, got_norm = fr.weight_norm_interface(v, g, dim)
    got_gv, got_gg = fr.weight_norm_interface_backward(grad_w, v, g, got_norm, dim)
    atol, rtol = TOLERANCES[dtype]
    for got, want in ((got_w, want_w), (got_norm, want_norm), (got_gv, want_gv), (got_gg, want_gg)):
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def _weight_norm_grads(v, g, dim):
    v, g = v.clone().requires_grad_(), g.clone().requires_grad_()
    w, _ = torch._weight_norm_interface(v, g, dim)
    w.backward(seeded(*w.shape, seed=9))
    return [w.detach(), v.grad, g.grad]


def _group_norm_grads(x, groups):
    x = x.clone().requires_grad_()
    w, b = torch.ones(x.shape[1], requires_grad=True), torch.zeros(x.shape[1], requires_grad=True)
    y = F.group_norm(x, groups, w, b)
    y.backward(seeded(*y.shape, seed=9))
    return [y.detach(), x.grad, w.grad, b.grad]


def _prelu_grads(fused: bool):
    """A one-slope PReLU's gradient is a sum over the whole tensor (at 2 threads, other bits than at 1 outside
    strict()): eager's, and the InstanceNorm op's."""
    from opsnn_lab.ops import FusedInstanceNormAct

    x = seeded(8, 4, 128, 128).requires_grad_()
    prelu = nn.PReLU()  # one slope: a sum over the whole tensor
    f = FusedInstanceNormAct.from_modules(nn.InstanceNorm2d(4, affine=True), prelu) if fused else prelu
    y = f(x)
    y.backward(seeded(*y.shape, seed=9))
    return [y.detach(), x.grad, prelu.weight.grad]


# Each over more than TensorIterator's 32768-element parallel grain, along rows, columns and whole tensors.
REDUCTIONS = {
    "weight_norm dim=last": lambda: _weight_norm_grads(seeded(256, 48, 32), seeded(1, 1, 32).abs() + 1, 2),
    "weight_norm dim=0": lambda: _weight_norm_grads(seeded(256, 48, 32), seeded(256, 1, 1).abs() + 1, 0),
    "vector_norm whole": lambda: [torch.linalg.vector_norm(seeded(300_000))],
    "norm rows, columns": lambda: [seeded(4, 70_000).norm(dim=1), seeded(70_000, 4).norm(dim=0)],
    "var/std rows, columns, whole": lambda: [seeded(4, 70_000).var(dim=1), seeded(70_000, 4).std(dim=0),
                                             seeded(300_000).var()],
    "group_norm and its backward": lambda: _group_norm_grads(seeded(2, 32, 96, 96), 4),
    "cumsum rows, columns": lambda: [seeded(4, 70_000).cumsum(1), seeded(70_000, 4).cumsum(0)],
    "prelu and its slope gradient": lambda: _prelu_grads(fused=False),
    "instance_norm -> prelu fused": lambda: _prelu_grads(fused=True),
}


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_norm_style_reductions_are_thread_invariant_under_strict(name):
    runs = []
    for n in (1, 2):
        with strict(), threads(n):
            runs.append(REDUCTIONS[name]())
    assert all(torch.equal(a, b) for a, b in zip(*runs))
