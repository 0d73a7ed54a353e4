"""BN statistics + normalize + activation (+ max-pool) Triton kernels (interpreter on CPU, compiled on CUDA)
against the torch reference of kernels/bn_act.py, for every activation; determinism."""

from __future__ import annotations

import math

import pytest
import torch

from opsnn_lab.kernels import bn_act as K
from opsnn_lab.kernels import bn_act_triton as T
from opsnn_lab.testing import assert_close_dtype, assert_within_eager_error, seeded, triton_interpreter_ready

needs_interpreter = pytest.mark.skipif(not triton_interpreter_ready(),
                                       reason="triton missing, or imported before TRITON_INTERPRET=1")

POOLS = [None, K.PoolSpec((3, 3), (2, 2), (1, 1)), K.PoolSpec((2, 2), (2, 2), (1, 1)),
         K.PoolSpec((2, 3), (1, 2), (0, 1))]
POOL_IDS = ["nopool", "p3s2p1", "p2s2p1", "p2x3"]
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(shape, dtype=torch.float32, device="cpu", channels_last=False, seed=0, gain=1.0):
    n, c, h, w = shape
    y = seeded(n, c, h, w, seed=seed, dtype=dtype, device=device, scale=2.0) + 0.3
    if channels_last:
        y = y.contiguous(memory_format=torch.channels_last)
    weight = ((seeded(c, seed=seed + 1, device=device).abs() + 0.5) * gain).to(dtype)
    bias = seeded(c, seed=seed + 2, device=device, scale=0.3).to(dtype)
    rm = seeded(c, seed=seed + 3, device=device, scale=0.1).to(dtype)
    rv = (seeded(c, seed=seed + 4, device=device).abs() + 0.5).to(dtype)
    return y, weight, bias, rm, rv


ACTS = [K.Act(name, 0.2) for name in K.ACTS] + [K.Act("leaky_relu", -0.3)]  # a negative slope is not monotone
ACT_IDS = [*K.ACTS, "leaky_relu_neg"]


def _forward_both(shape, pool, training, dtype=torch.float32, device="cpu", channels_last=False, identity=False,
                  act=K.RELU):
    # A BN gain of 4 for activations other than ReLU: the pre-activation reaches ReLU6's 6 and Hardswish's +-3.
    y, weight, bias, rm, rv = _inputs(shape, dtype, device, channels_last, gain=1.0 if act == K.RELU else 4.0)
    if identity:
        weight = bias = rm = rv = None
    results = []
    for fn in (K.bn_act_forward_torch, T.bn_act_forward_triton):
        bufs = (None, None) if rm is None else (rm.clone(), rv.clone())
        out = fn(y, weight, bias, *bufs, training=training, momentum=0.1, eps=1e-5, act=act, pool=pool)
        results.append((out, bufs))
    return (y, weight, bias), results


def _check_forward(results, dtype):
    (ref, ref_bufs), (tri, tri_bufs) = results
    assert_close_dtype(tri[0], ref[0], dtype, msg="output")
    for a, b, name in ((tri[1], ref[1], "mean"), (tri[2], ref[2], "invstd")):
        if b is not None:
            assert_close_dtype(a.float(), b.float(), dtype, msg=name)
    for a, b in zip(tri_bufs, ref_bufs):
        if b is not None:
            assert_close_dtype(a, b, dtype, msg="running stats")
    if ref[3] is not None:
        assert tri[3].dtype == torch.uint8
        mismatch = (tri[3] != ref[3]).float().mean().item()
        assert mismatch <= (0.0 if dtype == torch.float32 else 0.02), f"window index mismatch {mismatch:.3f}"


@needs_interpreter
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("pool", POOLS, ids=POOL_IDS)
def test_forward_triton_matches_torch(pool, training):
    _, results = _forward_both((2, 3, 7, 9), pool, training)
    _check_forward(results, torch.float32)


@needs_interpreter
@pytest.mark.parametrize("pool", POOLS[:2], ids=POOL_IDS[:2])
def test_forward_triton_matches_torch_bf16(pool):
    _, results = _forward_both((2, 3, 7, 9), pool, True, torch.bfloat16)
    _check_forward(results, torch.bfloat16)


@needs_interpreter
@pytest.mark.parametrize("pool", [None, POOLS[1]], ids=POOL_IDS[:2])
def test_forward_two_stage_stats_channels_last_identity(pool):
    # 2 x 23 x 23 = 1058 elements per channel: two chunks, so the stage-2 merge is exercised.
    _, results = _forward_both((2, 2, 23, 23), pool, True, channels_last=True)
    _check_forward(results, torch.float32)
    _, results = _forward_both((2, 3, 5, 7), pool, False, identity=True)
    _check_forward(results, torch.float32)


def _backward_both(shape, pool, training, dtype=torch.float32, device="cpu", identity=False, act=K.RELU):
    (y, weight, bias), results = _forward_both(shape, pool, training, dtype, device, identity=identity, act=act)
    ref = results[0][0]
    grad = seeded(*ref[0].shape, seed=9, dtype=dtype, device=device)
    mean, invstd = ref[1], ref[2]  # batch statistics in training, running ones in eval
    outs = []
    for fn in (K.bn_act_backward_torch, T.bn_act_backward_triton):
        outs.append(fn(grad, y, weight, bias, mean, invstd, ref[3], training=training, eps=1e-5, act=act,
                       pool=pool))
    return outs


@needs_interpreter
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("pool", POOLS, ids=POOL_IDS)
def test_backward_triton_matches_torch(pool, training):
    ref, tri = _backward_both((2, 3, 7, 9), pool, training)
    for name, a, b in zip(("grad_y", "grad_weight", "grad_bias"), tri, ref):
        assert_close_dtype(a.float(), b.float(), torch.float32, msg=name)


@needs_interpreter
def test_backward_identity_and_bf16():
    ref, tri = _backward_both((2, 3, 6, 5), POOLS[1], False, identity=True)
    assert tri[1] is None and ref[1] is None
    assert_close_dtype(tri[0], ref[0], torch.float32)
    ref, tri = _backward_both((2, 3, 6, 5), POOLS[1], True, dtype=torch.bfloat16)
    for a, b in zip(tri, ref):
        assert_close_dtype(a.float(), b.float(), torch.bfloat16)


@needs_interpreter
def test_triton_is_deterministic():
    """No atomics: two runs of the reductions give the same bits."""
    a = _backward_both((2, 2, 23, 23), POOLS[1], True, act=K.Act("silu"))[1]
    b = _backward_both((2, 2, 23, 23), POOLS[1], True, act=K.Act("silu"))[1]
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# Every activation in training; eval (running statistics, no BN-gradient coefficients) for one smooth and one
# piecewise-linear activation without a dead zone: the ReLU eval paths are covered above.
ACT_CASES = [(a, True) for a in ACTS] + [(ACTS[3], False), (ACTS[2], False)]


@needs_interpreter
@pytest.mark.parametrize("pool", POOLS[:2], ids=POOL_IDS[:2])
@pytest.mark.parametrize("act, training", ACT_CASES,
                         ids=[f"{a.name}{'_neg' * (a.negative_slope < 0)}-{'train' if t else 'eval'}"
                              for a, t in ACT_CASES])
def test_every_activation_triton_matches_torch(act, training, pool):
    _, results = _forward_both((2, 2, 6, 7), pool, training, act=act)
    _check_forward(results, torch.float32)
    ref, tri = _backward_both((2, 2, 6, 7), pool, training, act=act)
    for name, a, b in zip(("grad_y", "grad_weight", "grad_bias"), tri, ref):
        assert_close_dtype(a.float(), b.float(), torch.float32, msg=name)


@needs_interpreter
@pytest.mark.parametrize("act", [K.Act("silu"), K.Act("gelu_tanh"), K.Act("relu6")], ids=["silu", "gelu_tanh", "relu6"])
def test_activation_bf16_with_pool(act):
    """Forward against the torch path by the bf16 tolerance; gradients by the eager-error criterion (the kernel
    keeps dL/d(pre-activation) in fp32 where the torch path rounds it to bf16, so it may be the closer one)."""
    (y, weight, bias), results = _forward_both((2, 3, 8, 7), POOLS[1], True, torch.bfloat16, act=act)
    _check_forward(results, torch.bfloat16)
    ref, tri = _backward_both((2, 3, 8, 7), POOLS[1], True, dtype=torch.bfloat16, act=act)
    out, mean, invstd, idx = results[0][0]
    grad = seeded(*out.shape, seed=9, dtype=torch.bfloat16)
    ref64 = K.bn_act_backward_torch(grad.double(), y.double(), weight.double(), bias.double(), mean.double(),
                                    invstd.double(), idx, training=True, eps=1e-5, act=act, pool=POOLS[1])
    for name, a, b, r in zip(("grad_y", "grad_weight", "grad_bias"), tri, ref, ref64):
        assert_within_eager_error(a, b, r, name=name)


@needs_interpreter
def test_backward_needs_y_for_a_smooth_activation_with_pool():
    (y, weight, bias), results = _forward_both((1, 2, 6, 6), POOLS[1], False, act=K.Act("silu"))
    out, mean, invstd, idx = results[0][0]
    with pytest.raises(ValueError, match="y is needed"):
        T.bn_act_backward_triton(out, None, weight, bias, mean, invstd, idx, training=False, eps=1e-5,
                                 act=K.Act("silu"), pool=POOLS[1], in_shape=(1, 2, 6, 6))


class _Counting:
    """A kernel that records its launches by name."""

    def __init__(self, name, fn, calls):
        self.name, self.fn, self.calls = name, fn, calls

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def run(*args, **kwargs):
            self.calls.append(self.name)
            return launch(*args, **kwargs)
        return run


@pytest.fixture
def launches(monkeypatch):
    """The kernels' launches, by name, in order."""
    calls, real = [], T._kernels
    monkeypatch.setattr(T, "_kernels", lambda interpret: {name: _Counting(name, fn, calls)
                                                          for name, fn in real(interpret).items()})
    return calls


def _both_ways(shape, pool, training, act, monkeypatch, dtype=torch.float32):
    """Forward and backward with the statistics merged inside the normalize / phase 1 (few chunks), and again
    with each merge in its own [C]-sized launch (``_INLINE_CHUNKS`` 0, as a large batch takes it)."""
    out = []
    for inline in (T._INLINE_CHUNKS, 0):
        monkeypatch.setattr(T, "_INLINE_CHUNKS", inline)
        _, results = _forward_both(shape, pool, training, dtype, act=act)
        out.append((results[1], _backward_both(shape, pool, training, dtype, act=act)[1]))
    return out


@needs_interpreter
@pytest.mark.parametrize("shape", [(2, 3, 7, 9), (2, 2, 23, 23)], ids=["one_chunk", "two_chunks"])
@pytest.mark.parametrize("act, training", [(K.RELU, True), (K.Act("silu"), True), (K.Act("hardswish"), False)],
                         ids=["relu-train", "silu-train", "hardswish-eval"])
def test_statistics_merged_in_the_normalize_give_the_separate_launches_bits(shape, act, training, monkeypatch):
    """The forward's statistics, running statistics and output, and every gradient, to the bit: both ways run
    the same fixed-order arithmetic with every product and sum rounded once."""
    (merged, merged_grads), (separate, separate_grads) = _both_ways(shape, None, training, act, monkeypatch)
    (out_a, bufs_a), (out_b, bufs_b) = merged, separate
    for a, b in zip([*out_a[:3], *bufs_a, *merged_grads], [*out_b[:3], *bufs_b, *separate_grads]):
        assert (a is None and b is None) or torch.equal(a, b)


@needs_interpreter
@pytest.mark.parametrize("inline", [True, False], ids=["merged", "separate"])
def test_separate_merges_match_torch(inline, monkeypatch):
    """The large-batch way (statistics and BN-gradient sums in their own launches) against the torch path."""
    monkeypatch.setattr(T, "_INLINE_CHUNKS", T._INLINE_CHUNKS if inline else 0)
    for pool, training in ((None, True), (None, False), (POOLS[1], True)):
        _, results = _forward_both((2, 2, 23, 23), pool, training, act=K.Act("silu"))
        _check_forward(results, torch.float32)
        ref, tri = _backward_both((2, 2, 23, 23), pool, training, act=K.Act("silu"))
        for name, a, b in zip(("grad_y", "grad_weight", "grad_bias"), tri, ref):
            assert_close_dtype(a.float(), b.float(), torch.float32, msg=name)


@needs_interpreter
def test_launches_per_training_step(launches, monkeypatch):
    """A launch costs host time a small batch's step is mostly made of: a training forward is two launches and its
    backward two while a channel has at most ``_INLINE_CHUNKS`` chunks, three each beyond; an eval backward that
    wants no BN gradient is one; a pool keeps its separate statistics merge."""
    y, weight, bias, rm, rv = _inputs((2, 3, 7, 9))
    kw = dict(momentum=0.1, eps=1e-5, act=K.Act("silu"))

    def step(training, output_mask=(True, True, True), pool=None):
        launches.clear()
        out, mean, invstd, idx = T.bn_act_forward_triton(y, weight, bias, rm.clone(), rv.clone(), training=training,
                                                         pool=pool, **kw)
        fwd = list(launches)
        launches.clear()
        T.bn_act_backward_triton(torch.ones_like(out), y, weight, bias, mean, invstd, idx, training=training,
                                 eps=1e-5, act=kw["act"], pool=pool, output_mask=output_mask)
        return fwd, list(launches)

    assert step(True) == (["_stats_partial_kernel", "_bn_act_fwd_kernel"], ["_bn_act_bwd_kernel"] * 2)
    assert step(False, (True, False, False)) == (["_bn_act_fwd_kernel"], ["_bn_act_bwd_kernel"])
    # that one launch (no BN gradient asked for in eval) gives the torch path's input gradient
    grad = seeded(*y.shape, seed=9)
    mean, invstd = rm, torch.rsqrt(rv + 1e-5)
    got = T.bn_act_backward_triton(grad, y, weight, bias, mean, invstd, None, training=False, eps=1e-5,
                                   act=kw["act"], output_mask=(True, False, False))
    want = K.bn_act_backward_torch(grad, y, weight, bias, mean, invstd, None, training=False, eps=1e-5,
                                   act=kw["act"], output_mask=(True, False, False))
    assert got[1] is None and got[2] is None
    assert_close_dtype(got[0], want[0], torch.float32)
    assert step(True, pool=POOLS[1])[0] == ["_stats_partial_kernel", "_stats_finalize_kernel",
                                            "_bn_act_pool_fwd_kernel"]
    monkeypatch.setattr(T, "_INLINE_CHUNKS", 0)
    assert step(True) == (["_stats_partial_kernel", "_stats_finalize_kernel", "_bn_act_fwd_kernel"],
                          ["_bn_act_bwd_kernel", "_grad_coef_kernel", "_bn_act_bwd_kernel"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape, spec", [((8, 64, 112, 112), POOLS[1]), ((3, 5, 33, 31), None),
                                         ((4, 7, 57, 45), POOLS[3]), ((16, 3, 128, 128), None)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("act", [K.RELU, K.Act("silu"), K.Act("hardswish")], ids=["relu", "silu", "hardswish"])
def test_gpu_triton_matches_torch(shape, spec, dtype, training, act):
    """Compiled kernels against the torch path at real sizes (up to 262k elements per channel: 256 chunks, so
    the statistics merge in their own launches; the smaller ones merge them in the normalize), forward and
    backward, by the error criterion against float64: two reduction orders over that many elements part by
    more than an elementwise fp32 tolerance, and in bf16 the kernel keeps dL/d(pre-activation) in fp32."""
    (y, weight, bias), results = _forward_both(shape, spec, training, dtype, device="cuda", channels_last=True,
                                               act=act)
    (ref, ref_bufs), (tri, tri_bufs) = results
    _, _, _, rm, rv = _inputs(shape, dtype, "cuda", True, gain=1.0 if act == K.RELU else 4.0)
    rm64, rv64 = rm.double(), rv.double()
    out64 = K.bn_act_forward_torch(y.double(), weight.double(), bias.double(), rm64, rv64, training=training,
                                   momentum=0.1, eps=1e-5, act=act, pool=spec)
    n = shape[0] * shape[2] * shape[3]  # elements per channel in each statistic and weight-gradient sum
    sums = {"mean", "invstd", "running_mean", "running_var", "grad_weight", "grad_bias"}

    def check(name, a, b, r):
        eps = torch.finfo(a.dtype).eps
        if name in sums:  # a sum of n terms in another order: log2(n) roundings of its scale, not one
            assert_within_eager_error(a, b, r, floor=eps * math.log2(n) * r.abs().max().item(), name=name)
            return
        fe, ee = (a.double() - r).abs(), (b.double() - r).abs()
        # Elementwise: on average as close as eager. The largest error sits where rounding put an input on the
        # other side of a kink (ReLU's 0, Hardswish's +-3), which either side may do: checked for SiLU only.
        assert fe.mean() <= 2 * ee.mean() + eps * r.abs().mean(), \
            f"{name}: mean error {fe.mean():.2e} > 2 x eager's {ee.mean():.2e}"
        if act.name == "silu":
            assert_within_eager_error(a, b, r, name=name)

    for name, a, b, r in (("output", tri[0], ref[0], out64[0]), ("mean", tri[1], ref[1], out64[1]),
                          ("invstd", tri[2], ref[2], out64[2]), ("running_mean", tri_bufs[0], ref_bufs[0], rm64),
                          ("running_var", tri_bufs[1], ref_bufs[1], rv64)):
        check(name, a, b, r)
    if ref[3] is not None:
        mismatch = (tri[3] != ref[3]).float().mean().item()  # window ties resolved by other roundings
        assert mismatch <= (1e-3 if dtype == torch.float32 else 0.02), f"window index mismatch {mismatch:.4f}"
    ref_g, tri_g = _backward_both(shape, spec, training, dtype, device="cuda", act=act)
    grad = seeded(*ref[0].shape, seed=9, dtype=dtype, device="cuda")
    g64 = K.bn_act_backward_torch(grad.double(), y.double(), weight.double(), bias.double(), ref[1].double(),
                                  ref[2].double(), ref[3], training=training, eps=1e-5, act=act, pool=spec)
    for name, a, b, r in zip(("grad_y", "grad_weight", "grad_bias"), tri_g, ref_g, g64):
        check(name, a, b, r)
