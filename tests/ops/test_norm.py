import copy

import pytest
import torch
from torch import nn

from opsnn_lab import ops
from opsnn_lab.bench import activation_bytes
from opsnn_lab.measuring import _storage_key, saved_tensors_report
from opsnn_lab.testing import (
    assert_close_dtype,
    assert_within_eager_error,
    non_contiguous,
    seeded,
    triton_interpreter_ready,
)

H = 67  # odd width: a partly masked Triton block


def _hf(kind):
    transformers = pytest.importorskip("transformers")
    if kind == "llama":
        return transformers.models.llama.modeling_llama.LlamaRMSNorm(H, eps=1e-6)
    return transformers.models.gemma.modeling_gemma.GemmaRMSNorm(H, eps=1e-6)


def _module(kind, dtype=torch.float32):
    torch.manual_seed(0)
    norm = {"layer_norm": lambda: nn.LayerNorm(H), "rms_norm": lambda: nn.RMSNorm(H, eps=1e-6)}.get(
        kind, lambda: _hf(kind))()
    with torch.no_grad():  # non-trivial affine parameters, so weight and bias gradients are tested for real
        for p in norm.parameters():
            p.copy_(seeded(*p.shape, seed=hash(kind) % 97, scale=0.5) + (0.0 if kind == "gemma" else 1.0))
    return norm.to(dtype)


def _fused_cls(kind, add):
    rms = kind != "layer_norm"
    return {(False, False): ops.FusedLayerNorm, (False, True): ops.FusedAddLayerNorm,
            (True, False): ops.FusedRMSNorm, (True, True): ops.FusedAddRMSNorm}[(rms, add)]


def _eager_fn(norm, add):
    if add:
        def run(x, r):
            s = x + r
            return norm(s), s
        return run
    return norm


def _run(fn, inputs, params, seed=11):
    outs = fn(*inputs)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    grads = [seeded(*o.shape, seed=seed + i, dtype=o.dtype) for i, o in enumerate(outs)]
    leaves = list(inputs) + list(params)
    got = torch.autograd.grad(outs, leaves, grads)
    return [o.detach() for o in outs], list(got)


def _three_runs(norm64, norm, kind, add, dtype):
    """fp64 reference, eager in ``dtype`` and the fused op on the same inputs: (fused, inputs, triples)."""
    fused = _fused_cls(kind, add).from_modules(norm)
    inputs = _inputs((9, H), dtype, add)
    inputs64 = [t.detach().double().requires_grad_(True) for t in inputs]
    ref_out, ref_grads = _run(_eager_fn(norm64, add), inputs64, list(norm64.parameters()))
    eager_out, eager_grads = _run(_eager_fn(norm, add), inputs, list(norm.parameters()))
    got_out, got_grads = _run(fused, inputs, list(norm.parameters()))
    return fused, inputs, list(zip(got_out + got_grads, eager_out + eager_grads, ref_out + ref_grads))


def _inputs(shape, dtype, add, contiguous=True):
    x = seeded(*shape, seed=1, dtype=dtype, scale=2.0) + 0.3
    r = seeded(*shape, seed=2, dtype=dtype)
    xs = [x, r] if add else [x]
    if not contiguous:
        xs = [non_contiguous(t) for t in xs]
    return [t.requires_grad_(True) for t in xs]


KINDS = ["layer_norm", "rms_norm", "llama", "gemma"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("shape, contiguous", [((3, 5, H), True), ((7, H), False), ((0, H), True)])
def test_fp32_forward_and_every_gradient_match_eager(kind, add, shape, contiguous):
    norm = _module(kind)
    fused = _fused_cls(kind, add).from_modules(norm)
    params = list(norm.parameters())
    inputs = _inputs(shape, torch.float32, add, contiguous)
    want_out, want_grads = _run(_eager_fn(norm, add), inputs, params)
    got_out, got_grads = _run(fused, inputs, params)
    for got, want in zip(got_out + got_grads, want_out + want_grads):
        assert_close_dtype(got, want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_eager_error_vs_fp64(kind, add, dtype):
    _, _, triples = _three_runs(_module(kind, torch.float64), _module(kind, dtype), kind, add, dtype)
    n_out = 2 if add else 1
    names = [f"out{i}" if i < n_out else f"grad{i - n_out}" for i in range(len(triples))]
    for name, (got, eager, ref) in zip(names, triples):
        assert got.dtype == eager.dtype, name
        assert_within_eager_error(got, eager, ref, name=f"{kind} {name}")


@pytest.mark.parametrize("kind, add", [("layer_norm", False), ("layer_norm", True), ("llama", False),
                                       ("rms_norm", True)])
def test_saves_the_output_and_rstd_which_the_next_linear_shares(kind, add):
    norm = _module(kind)
    fused = _fused_cls(kind, add).from_modules(norm)
    linear = nn.Linear(H, 5)
    inputs = _inputs((6, 10, H), torch.float32, add)
    rows = 60

    def chain(norm_fn):
        out = norm_fn(*inputs)
        return linear(out[0] if add else out)
    assert activation_bytes(lambda: fused(*inputs)) == rows * H * 4 + rows * 4  # y and rstd
    assert activation_bytes(lambda: chain(fused)) == rows * H * 4 + rows * 4  # y stored once, for both ops
    # eager keeps its input (LayerNorm) or more (RMSNorm) besides the Linear's copy of y: >= 2 x
    assert activation_bytes(lambda: chain(_eager_fn(norm, add))) >= 2 * (rows * H * 4 + rows * 4)


@pytest.mark.parametrize("kind, add", [("layer_norm", False), ("layer_norm", True), ("rms_norm", True)])
def test_under_autocast_an_fp32_norm_saves_its_input_which_eager_shares(kind, add):
    """Under bf16 autocast the Linear reading an fp32 y saves its own bf16 copy, so a saved y would be one tensor
    more; the input (the residual stream's sum) is what eager's norm saves, and a scale on the stream (CAFormer's
    ``res_scale``) saves it too. Before, the fused op saved y: 1.023x eager's bytes on caformer_s18."""
    norm = _module(kind)
    fused = _fused_cls(kind, add).from_modules(norm)
    linear, gamma = nn.Linear(H, 5), nn.Parameter(torch.full((H,), 0.5))
    inputs = _inputs((6, 10, H), torch.float32, add)

    def block(norm_fn):
        out = norm_fn(*inputs)
        y, s = out if add else (out, inputs[0])
        return linear(y), gamma * s

    with torch.autocast("cpu", dtype=torch.bfloat16):
        keys, out = _saved_storages(lambda: fused(*inputs))
        got, want = activation_bytes(lambda: block(fused)), activation_bytes(lambda: block(_eager_fn(norm, add)))
        fused_out, eager_out = block(fused), block(_eager_fn(norm, add))
    y, s = (out[0], out[1]) if add else (out, inputs[0])
    assert _storage_key(s) in keys and _storage_key(y) not in keys
    assert got <= want, (got, want)
    for a, b in zip(fused_out, eager_out):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert fused._saves_output(torch.float32)  # outside autocast the same op saves y (test above)


def _saved_storages(fn):
    report = saved_tensors_report(fn)
    return {r["key"] for r in report.tensors}, report.output


@pytest.mark.parametrize("kind, add, cause", [("layer_norm", False, "zero_weight"), ("layer_norm", True, "bias_ratio"),
                                              ("layer_norm", False, "bias_ratio"), ("rms_norm", False, "zero_weight"),
                                              ("gemma", True, "zero_weight")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weights_near_zero_fall_back_to_saving_the_input_and_stay_exact(kind, add, cause, dtype):
    norm = _module(kind, torch.float64)
    with torch.no_grad():
        if cause == "zero_weight":  # y no longer holds xhat in these columns: (y - b) / w is 0 / 0
            norm.weight[::5] = -1.0 if kind == "gemma" else 0.0
        else:  # |b| / |w| = 1e9: (y - b) / w would amplify y's rounding error a billion times
            norm.weight[::5] = 1e-9
    fused, inputs, triples = _three_runs(norm, copy.deepcopy(norm).to(dtype), kind, add, dtype)
    for i, (got, eager, ref) in enumerate(triples):
        if dtype == torch.float32:
            assert_close_dtype(got, eager)
        else:
            assert_within_eager_error(got, eager, ref, name=f"{kind} #{i}")
    assert fused._recoverable is False  # decided at run time, from the parameters
    keys, out = _saved_storages(lambda: fused(*inputs))
    y, s = (out[0], out[1]) if add else (out, inputs[0])
    assert _storage_key(s) in keys and _storage_key(y) not in keys  # the input (or the sum), not the output


def test_fallback_follows_the_parameters_after_an_update():
    norm = _module("layer_norm")
    fused = ops.FusedLayerNorm.from_modules(norm)
    x = _inputs((4, H), torch.float32, False)[0]
    fused(x)
    assert fused._recoverable
    with torch.no_grad():
        norm.weight[3] = 0.0  # an optimizer step that zeroes one weight: the version changes, the choice follows
    fused(x).sum().backward()
    assert not fused._recoverable
    fused.save_output = False
    with torch.no_grad():
        norm.weight[3] = 1.0
    keys, y = _saved_storages(lambda: fused(x))  # opted out: the input, not the output
    assert _storage_key(x) in keys and _storage_key(y) not in keys


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("add", [False, True])
def test_save_output_false_saves_the_input_and_matches_eager(kind, add):
    """The choice for a norm whose output nothing keeps: the input (or the sum) is saved, never ``y``; a
    LayerNorm then runs aten's own forward and backward, so fp32 gives eager's bits."""
    norm = _module(kind)
    fused = _fused_cls(kind, add).from_modules(norm, save_output=False)
    assert fused.save_output is False
    inputs = _inputs((3, 5, H), torch.float32, add)
    keys, out = _saved_storages(lambda: fused(*inputs))
    y, s = (out[0], out[1]) if add else (out, inputs[0])
    assert _storage_key(s) in keys and _storage_key(y) not in keys
    params = list(norm.parameters())
    got_out, got_grads = _run(fused, inputs, params)
    want_out, want_grads = _run(_eager_fn(norm, add), inputs, params)
    for i, (got, want) in enumerate(zip(got_out + got_grads, want_out + want_grads)):
        if kind == "layer_norm":
            assert torch.equal(got, want), f"#{i}"
        else:
            assert_close_dtype(got, want)
    with pytest.raises(TypeError, match="save_output"):
        _fused_cls(kind, add).from_modules(norm, save_output="no")


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("forced", [None, "triton"])
def test_a_layer_norm_saving_its_input_runs_atens_where_triton_would_run(monkeypatch, add, forced):
    """On CUDA (here: the op told its input takes the Triton path) a LayerNorm whose output nothing keeps is
    aten's layer_norm, eager's kernels and bits; OPSNN_BACKEND=triton keeps the kernels."""
    import opsnn_lab.ops.norm as norm_ops

    monkeypatch.setattr(norm_ops, "uses_triton", lambda t: True)
    monkeypatch.setattr(norm_ops, "forced_backend", lambda: forced)
    norm = _module("layer_norm")
    fused = _fused_cls("layer_norm", add).from_modules(norm, save_output=False)
    inputs = [t.requires_grad_() for t in _inputs((3, 5, H), torch.float32, add)]
    out = fused(*inputs)
    y = out[0] if add else out
    assert (type(y.grad_fn).__name__ == "NativeLayerNormBackward0") == (forced is None)
    if forced is None:
        want = _eager_fn(norm, add)(*[t.detach() for t in inputs])
        assert torch.equal(y, want[0] if add else want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("add", [False, True])
def test_gpu_layer_norm_saving_its_input_is_eagers(add):
    """Eager's kernels, so eager's bits and time (the Triton launches took the H200's step to 3.3x eager's)."""
    norm = _module("layer_norm").cuda()
    fused = _fused_cls("layer_norm", add).from_modules(norm, save_output=False)
    inputs = [t.detach().cuda().requires_grad_() for t in _inputs((3, 5, H), torch.float32, add)]
    leaves = inputs + list(norm.parameters())
    results = []
    for fn in (fused, _eager_fn(norm, add)):
        outs = fn(*inputs)
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        grads = [seeded(*o.shape, seed=11 + i).cuda() for i, o in enumerate(outs)]
        results.append([o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, grads)))
    for i, (got, want) in enumerate(zip(*results)):
        assert torch.equal(got, want), f"#{i}"


def test_output_modified_in_place_is_refused_not_wrong():
    fused = ops.FusedLayerNorm.from_modules(_module("layer_norm"))
    x = _inputs((4, H), torch.float32, False)[0]
    y = fused(x)
    with pytest.raises(RuntimeError, match="inplace"):
        y.mul_(2.0)
        y.sum().backward()


def test_parameters_are_shared_and_state_dict_keys_unchanged():
    norm = _module("layer_norm")
    fused = ops.FusedLayerNorm.from_modules(norm)
    assert fused.weight is norm.weight and fused.bias is norm.bias
    assert fused.state_dict().keys() == norm.state_dict().keys()
    gemma = ops.FusedRMSNorm.from_modules(_module("gemma"))
    assert gemma.weight_offset == 1.0 and "weight_offset=1.0" in repr(gemma)
    assert ops.FusedRMSNorm.from_modules(_module("llama")).eps == 1e-6


def test_multi_dim_normalized_shape_and_default_rms_eps():
    ln = nn.LayerNorm((4, 6))
    x = seeded(3, 4, 6, seed=1, requires_grad=True)
    assert_close_dtype(ops.FusedLayerNorm.from_modules(ln)(x), ln(x))
    rms = nn.RMSNorm(6)  # eps=None: the dtype's machine epsilon
    assert ops.FusedRMSNorm.from_modules(rms).eps == torch.finfo(torch.float32).eps


class GatedRMSNorm(nn.Module):  # a forward with a second input: not an RMSNorm the op can replace
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.eps = 1e-6

    def forward(self, x, gate):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * gate


class ScaledRMSNorm(GatedRMSNorm):  # RMSNorm-shaped, but the weight is used in an unknown way
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) / self.weight


def test_supports_gives_reasons_and_from_modules_rejects_with_them():
    assert ops.FusedLayerNorm.supports(nn.LayerNorm(4))[0]
    assert ops.FusedRMSNorm.supports(nn.RMSNorm(4))[0]
    for module, words in [(nn.Linear(4, 4), "Linear"), (GatedRMSNorm(), "2 required inputs"),
                          (ScaledRMSNorm(), "weight's use")]:
        ok, reason = ops.FusedRMSNorm.supports(module)
        assert not ok and words in reason
        with pytest.raises(ValueError, match="norm"):
            ops.FusedAddRMSNorm.from_modules(module)
    ok, reason = ops.FusedLayerNorm.supports(nn.RMSNorm(4))
    assert not ok and "LayerNorm" in reason


def test_bad_arguments_name_the_argument():
    fused = ops.FusedAddLayerNorm.from_modules(nn.LayerNorm(4))
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="x"):
        fused(torch.zeros(2, 5), x)
    with pytest.raises(ValueError, match="residual"):
        fused(x, torch.zeros(3, 4))
    with pytest.raises(TypeError, match="x"):
        fused(x.long(), x)
    with pytest.raises(TypeError, match="weight"):
        ops.FusedLayerNorm(torch.ones(4))
    with pytest.raises(ValueError, match="eps"):
        ops.FusedLayerNorm(nn.Parameter(torch.ones(4)), eps=-1.0)
    with pytest.raises(ValueError, match="bias"):
        ops.FusedLayerNorm(nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(5)))


def test_add_variant_without_the_sum_gradient_and_in_place_guard():
    norm = _module("rms_norm")
    fused = ops.FusedAddRMSNorm.from_modules(norm)
    x, r = _inputs((4, H), torch.float32, True)
    y, s = fused(x, r)
    y.sum().backward()  # the sum output unused: its gradient is None inside backward
    x_grad = x.grad.clone()
    x.grad = r.grad = None
    norm(x + r).sum().backward()
    assert_close_dtype(x_grad, x.grad)
    x.grad = r.grad = None
    y, s = fused(x, r)  # saves y (the default): the sum may be written in place, y's gradients stay eager's
    s.add_(1.0)
    y.sum().backward()
    assert_close_dtype(x.grad, x_grad)
    y, s = ops.FusedAddRMSNorm.from_modules(norm, save_output=False)(x, r)
    with pytest.raises(RuntimeError, match="inplace"):  # the saved sum: refused, never wrong gradients
        s.add_(1.0)
        y.sum().backward()


def test_triton_interpreter_through_the_op(monkeypatch):
    if not triton_interpreter_ready():
        pytest.skip("needs triton with TRITON_INTERPRET=1")
    # saving the input, a LayerNorm on Triton still runs the kernels (not aten's layer_norm, as on the torch path)
    for kind, add, save_output in [("gemma", True, True), ("layer_norm", True, True), ("layer_norm", False, False)]:
        norm = _module(kind)
        fused = _fused_cls(kind, add).from_modules(copy.deepcopy(norm), save_output=save_output)
        inputs = _inputs((2, 9, H), torch.float32, add)
        want_out, want_grads = _run(_eager_fn(norm, add), inputs, list(norm.parameters()))
        monkeypatch.setenv("OPSNN_BACKEND", "triton")
        got_out, got_grads = _run(fused, inputs, list(fused.parameters()))
        monkeypatch.delenv("OPSNN_BACKEND")
        for got, want in zip(got_out + got_grads, want_out + want_grads):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_layer_norm_gradients_are_summed_in_fp32(dtype):
    # aten's bf16/fp16 LayerNorm keeps its statistics in the input dtype and sums the weight gradient in buffers
    # of it (at one thread ~2.5x the error of one fp32 sum rounded once); the fused op works in fp32 and rounds
    # once. On the same low-precision inputs and upstream gradient, its error in grad_x, grad_w and grad_b stays
    # within 1.25x that of the fp32 computation rounded to dtype, seed after seed.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def grads(fn, x, params, dy):
        return torch.autograd.grad(fn(x), [x, *params], dy)
    try:
        for seed in range(4):
            torch.manual_seed(seed)
            norm = nn.LayerNorm(H).to(dtype)
            nn.init.normal_(norm.weight), nn.init.normal_(norm.bias)
            fused = ops.FusedLayerNorm.from_modules(norm)
            fused.save_output = False  # the input-saving backward: the one aten runs in low precision
            x, dy = seeded(50, H, seed=seed, dtype=dtype), seeded(50, H, seed=seed + 100, dtype=dtype)
            got = grads(fused, x.requires_grad_(True), list(norm.parameters()), dy)
            want = {}
            for acc in (torch.float32, torch.float64):
                m = copy.deepcopy(norm).to(acc)
                want[acc] = grads(m, x.detach().to(acc).requires_grad_(True), list(m.parameters()), dy.to(acc))
            for name, g, g32, r in zip(["x", "weight", "bias"], got, want[torch.float32], want[torch.float64]):
                err, err32 = (g.double() - r).abs().max(), (g32.to(dtype).double() - r).abs().max()
                assert g.dtype == dtype and err <= 1.25 * err32 + 1e-6, (seed, name, float(err), float(err32))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["layer_norm", "llama"])
@pytest.mark.parametrize("add", [False, True])
def test_one_autograd_node_per_call_on_any_leading_dims(kind, add):
    # the Function takes (..., N) and returns x's shape as made: no reshape before it and no view after it on
    # the autograd graph (each was one more node, run on every backward); non-contiguous 3-D input included
    norm = _module(kind)
    fused = _fused_cls(kind, add).from_modules(norm)
    inputs = [non_contiguous(t.detach()).requires_grad_(True) for t in _inputs((3, 5, H), torch.float32, add)]
    outs = fused(*inputs)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    for out in outs:
        assert out.shape == (3, 5, H) and not out._is_view()
        assert out.grad_fn.name() == "AddNormFunctionBackward"
        assert {type(fn).__name__ for fn, _ in out.grad_fn.next_functions if fn is not None} == {"AccumulateGrad"}
    want_out, want_grads = _run(_eager_fn(norm, add), inputs, list(norm.parameters()))
    got_out, got_grads = _run(fused, inputs, list(norm.parameters()))
    for got, want in zip(got_out + got_grads, want_out + want_grads):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
