import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from opsnn_lab import ops
from opsnn_lab.bench import activation_bytes
from opsnn_lab.measuring import peak_bytes
from opsnn_lab.ops.fused_linear_cross_entropy import _chunk_rows, eager_linear_cross_entropy
from opsnn_lab.testing import (
    assert_close_dtype,
    assert_within_eager_error,
    non_contiguous,
    seeded,
    triton_interpreter_ready,
)

V, HID = 101, 24  # odd vocabulary


def _problem(shape=(4, 7), v=V, h=HID, dtype=torch.float32, bias=True, ignore=True, seed=0):
    hidden = seeded(*shape, h, seed=seed, dtype=dtype)
    weight = seeded(v, h, seed=seed + 1, dtype=dtype, scale=0.3)
    b = seeded(v, seed=seed + 2, dtype=dtype) if bias else None
    target = torch.randint(0, v, shape, generator=torch.Generator().manual_seed(seed))
    if ignore and target.numel():
        target.view(-1)[::3] = -100
    return hidden, weight, b, target


def _grads(fn, hidden, weight, bias, target, upstream=None, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    if not hidden.is_contiguous():
        leaves[0] = non_contiguous(leaves[0].detach()).requires_grad_(True)
    loss = fn(leaves[0], leaves[1], target, leaves[2] if bias is not None else None, **kw)
    g = torch.ones_like(loss) if upstream is None else upstream
    return loss.detach(), list(torch.autograd.grad(loss, leaves, g))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("recompute", [None, False, True])
def test_fp32_loss_and_every_gradient_match_eager(reduction, smoothing, recompute):
    hidden, weight, bias, target = _problem()
    upstream = seeded(*target.shape, seed=5) if reduction == "none" else torch.tensor(3.0)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    want_loss, want = _grads(eager_linear_cross_entropy, hidden, weight, bias, target, upstream, **kw)
    got_loss, got = _grads(ops.linear_cross_entropy, hidden, weight, bias, target, upstream, chunk_size=5,
                           recompute=recompute, **kw)
    assert got_loss.dtype == torch.float32 and got_loss.shape == want_loss.shape
    for g, w in zip([got_loss] + got, [want_loss] + want):
        assert_close_dtype(g, w)


def test_non_contiguous_hidden_no_bias_default_chunks():
    hidden, weight, _, target = _problem(shape=(3, 11), bias=False)
    hidden = non_contiguous(hidden)
    want_loss, want = _grads(eager_linear_cross_entropy, hidden, weight, None, target)
    got_loss, got = _grads(ops.linear_cross_entropy, hidden, weight, None, target)
    for g, w in zip([got_loss] + got, [want_loss] + want):
        assert_close_dtype(g, w)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("recompute", [False, True])
def test_all_ignored_batch_matches_torch(reduction, recompute):
    hidden, weight, bias, target = _problem()
    target.fill_(-100)
    want_loss, want = _grads(eager_linear_cross_entropy, hidden, weight, bias, target, reduction=reduction)
    got_loss, got = _grads(ops.linear_cross_entropy, hidden, weight, bias, target, reduction=reduction,
                           recompute=recompute)
    torch.testing.assert_close(got_loss, want_loss, equal_nan=True)  # mean: NaN (0 / 0), as F.cross_entropy
    assert torch.isnan(got_loss).all() == (reduction == "mean")
    for g, w in zip(got, want):
        assert torch.equal(g, w) and not g.any()


def test_empty_batch():
    hidden, weight, bias, target = _problem(shape=(0,))
    for reduction in ("mean", "sum", "none"):
        want_loss, want = _grads(eager_linear_cross_entropy, hidden, weight, bias, target, reduction=reduction)
        got_loss, got = _grads(ops.linear_cross_entropy, hidden, weight, bias, target, reduction=reduction)
        torch.testing.assert_close(got_loss, want_loss, equal_nan=True)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("dtype, upstream", [(torch.bfloat16, 1.0), (torch.float16, 1.0), (torch.float16, 2.0**12)])
@pytest.mark.parametrize("recompute", [False, True])
def test_low_precision_within_twice_eager_error_vs_fp64(dtype, upstream, recompute):
    hidden, weight, bias, target = _problem(shape=(6, 11), dtype=dtype, seed=3)
    g = torch.tensor(upstream)  # 2**12: a loss scale, the grads must not underflow before it arrives
    args64 = [t.double() for t in (hidden, weight, bias)]
    ref_loss, ref = _grads(eager_linear_cross_entropy, *args64[:2], args64[2], target, g.double(),
                           label_smoothing=0.1)
    eager_loss, eager = _grads(eager_linear_cross_entropy, hidden, weight, bias, target, g, label_smoothing=0.1)
    got_loss, got = _grads(ops.linear_cross_entropy, hidden, weight, bias, target, g, label_smoothing=0.1,
                           chunk_size=16, recompute=recompute)
    assert_within_eager_error(got_loss, eager_loss, ref_loss, name="loss")
    for name, a, e, r in zip(["hidden", "weight", "bias"], got, eager, ref):
        assert a.dtype == dtype, name
        assert_within_eager_error(a, e, r, name=f"grad {name}")


def test_fp16_gradients_survive_a_loss_scale():
    # 512 tokens, small weights: unscaled gradients (~1e-6) are fp16 subnormals; the loss scale (2**12) only
    # arrives in backward, so the op must keep them wider until then, as eager does by scaling first.
    hidden, weight, bias, target = _problem(shape=(512,), v=64, h=16, dtype=torch.float16, bias=False, seed=4)
    weight = (weight.float() * 3e-3).half()
    g = torch.tensor(2.0**12)
    _, ref = _grads(eager_linear_cross_entropy, hidden.double(), weight.double(), None, target, g.double())
    _, eager = _grads(eager_linear_cross_entropy, hidden, weight, None, target, g)
    _, got = _grads(ops.linear_cross_entropy, hidden, weight, None, target, g, recompute=False)
    for name, a, e, r in zip(["hidden", "weight"], got, eager, ref):
        assert_within_eager_error(a, e, r, name=f"grad {name}")


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("recompute", [False, True])
def test_never_holds_the_full_logits_forward_or_backward(recompute):
    hidden, weight, bias, target = _problem(shape=(96,), v=211, h=8)  # N x V = 20256 > V x H = 1688
    with _LargestTensor() as mode:
        _grads(ops.linear_cross_entropy, hidden, weight, bias, target, chunk_size=16, recompute=recompute)
    assert mode.largest <= 16 * 211  # one chunk of logits at most
    with _LargestTensor() as eager:
        _grads(eager_linear_cross_entropy, hidden, weight, bias, target)
    assert eager.largest >= 96 * 211  # the probe sees eager's full logits


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_loss_only_pass_makes_no_chunk_sized_temporary():
    """recompute's forward computes the loss alone: its softmax takes the chunk's place. aten's logsumexp would
    make a (C, V) ``z - max`` inside its kernel, which neither a dispatch mode nor ``peak_bytes`` sees."""
    hidden, weight, bias, target = _problem(shape=(96,), v=211, h=8)
    with _Ops() as seen:
        loss = ops.linear_cross_entropy(hidden, weight, target, bias, chunk_size=16, recompute=True)
    assert "_softmax" in seen.names and "logsumexp" not in seen.names
    torch.testing.assert_close(loss, eager_linear_cross_entropy(hidden, weight, target, bias))
    peak = peak_bytes(lambda: ops.linear_cross_entropy(hidden, weight, target, bias, chunk_size=16, recompute=True))
    assert peak < 1.5 * 16 * 211 * 4  # one chunk of logits


def test_saved_bytes_vs_eager():
    n, v, h = 256, 1000, 32
    head = nn.Linear(h, v)
    hidden, _, _, target = _problem(shape=(n,), v=v, h=h)
    hidden.requires_grad_(True)
    eager = activation_bytes(lambda: eager_linear_cross_entropy(hidden, head.weight, target, head.bias))
    fused = activation_bytes(lambda: ops.linear_cross_entropy(hidden, head.weight, target, head.bias))
    assert fused == (n * h + v * h + v) * 4  # grad_hidden, grad_W, grad_b
    assert eager >= n * v * 4 and fused / eager < 0.2
    # fewer rows than features: the default recomputes and saves the hidden states and targets only
    few = hidden[:16].detach().repeat(1, 4).requires_grad_(True)
    wide = nn.Linear(4 * h, v)
    few_target = target[:16].clone()
    saved = activation_bytes(lambda: ops.linear_cross_entropy(few, wide.weight, few_target, wide.bias))
    assert saved <= 16 * 4 * h * 4 + 16 * 8 + 8


def test_default_chunk_rows():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert _chunk_rows(2048, 32000, 512, None, cpu) == 512  # Liger's rule says 64: CPU GEMMs need thicker chunks
    assert _chunk_rows(2048, 32000, 512, None, cuda) == 256
    assert _chunk_rows(2048, 32000, 512, 96, cpu) == 96  # an explicit size is kept
    assert _chunk_rows(1 << 16, 32000, 4096, None, cpu) == 8192  # N / ceil(V / H) rows, a power of two
    assert _chunk_rows(0, 10, 4, None, cpu) == 512


def test_peak_memory_of_forward_and_backward_vs_eager():
    # The saved grad_W becomes weight.grad; eager allocates that .grad in backward too, on top of (N, V) logits,
    # their log-softmax and its gradient. Peak bytes of the whole step, .grad included, compare them fairly.
    n, v, h = 2048, 2000, 32
    head = nn.Linear(h, v, bias=False)
    hidden = torch.randn(n, h, requires_grad=True)
    target = torch.randint(0, v, (n,))

    def step(fn):
        head.weight.grad = hidden.grad = None
        return peak_bytes(lambda: fn(hidden, head.weight, target).backward())
    eager, fused = step(eager_linear_cross_entropy), step(ops.linear_cross_entropy)
    assert eager >= 3 * n * v * 4  # logits, log-softmax, the logits' gradient
    rows = _chunk_rows(n, v, h, None, hidden.device)
    assert rows < n  # the default chunks this problem
    chunk = rows * v * 4  # one chunk's logits; never two at once
    # grad_W (accumulated in place: no V x H temporary), grad_hidden, the chunk, per-row vectors (loss, row scale,
    # mask), small change
    assert fused <= v * h * 4 + n * h * 4 + chunk + 16 * n + 64 * 1024 and fused / eager < 0.25


def test_bf16_peak_holds_one_copy_of_the_chunk_at_a_time():
    # bf16: the chunk's fp32 logits become a bf16 gradient for the bf16 GEMMs; the fp32 chunk is freed before
    # the weight-gradient product (V x H, bf16) exists, so the two are never alive together
    n, v, h = 2048, 2000, 256
    weight = nn.Parameter(torch.randn(v, h).mul_(0.02).bfloat16())
    hidden = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, v, (n,))
    rows = _chunk_rows(n, v, h, None, hidden.device)
    fused = peak_bytes(lambda: ops.linear_cross_entropy(hidden, weight, target).backward())
    assert weight.grad.dtype == torch.bfloat16 and hidden.grad.dtype == torch.bfloat16
    # fp32 grad_W accumulator, the chunk in fp32 and in bf16 (the cast), bf16 grad_hidden, per-row vectors
    assert fused <= 4 * v * h + 6 * rows * v + 2 * n * h + 16 * n + 64 * 1024


def test_module_from_modules_shares_parameters_and_reads_the_loss():
    head = nn.Linear(HID, V)
    fused = ops.FusedLinearCrossEntropy.from_modules(head, nn.CrossEntropyLoss(reduction="sum", label_smoothing=0.2))
    assert fused.weight is head.weight and fused.bias is head.bias
    assert fused.reduction == "sum" and fused.label_smoothing == 0.2
    assert set(fused.state_dict()) == set(head.state_dict())
    hidden, _, _, target = _problem()
    want = nn.CrossEntropyLoss(reduction="sum", label_smoothing=0.2)(head(hidden).flatten(0, 1), target.flatten())
    assert_close_dtype(fused(hidden, target), want)
    ok, reason = ops.FusedLinearCrossEntropy.supports(head, nn.CrossEntropyLoss(weight=torch.ones(V)))
    assert not ok and "class weights" in reason
    assert not ops.FusedLinearCrossEntropy.supports(nn.Conv1d(3, 3, 1))[0]
    with pytest.raises(ValueError, match="head"):
        ops.FusedLinearCrossEntropy.from_modules(nn.Conv1d(3, 3, 1))


def test_bad_arguments_name_the_argument():
    hidden, weight, bias, target = _problem()
    f = ops.linear_cross_entropy
    for exc, name, call in [
        (TypeError, "hidden", lambda: f(hidden.long(), weight, target)),
        (TypeError, "weight", lambda: f(hidden, weight.double(), target)),
        (ValueError, "hidden", lambda: f(hidden[..., :5], weight, target)),
        (ValueError, "target", lambda: f(hidden, weight, target[:, :3])),
        (TypeError, "target", lambda: f(hidden, weight, target.float())),
        (ValueError, "target", lambda: f(hidden, weight, target.clamp(min=0) + V)),
        (ValueError, "bias", lambda: f(hidden, weight, target, bias[:5])),
        (ValueError, "reduction", lambda: f(hidden, weight, target, reduction="avg")),
        (ValueError, "label_smoothing", lambda: f(hidden, weight, target, label_smoothing=1.5)),
        (ValueError, "chunk_size", lambda: f(hidden, weight, target, chunk_size=0)),
        (TypeError, "ignore_index", lambda: f(hidden, weight, target, ignore_index=1.0)),
        (TypeError, "recompute", lambda: f(hidden, weight, target, recompute="yes")),
    ]:
        with pytest.raises(exc, match=name):
            call()


def test_triton_interpreter_through_the_op(monkeypatch):
    if not triton_interpreter_ready():
        pytest.skip("needs triton with TRITON_INTERPRET=1")
    hidden, weight, bias, target = _problem(shape=(2, 5))
    want_loss, want = _grads(eager_linear_cross_entropy, hidden, weight, bias, target, label_smoothing=0.1)
    monkeypatch.setenv("OPSNN_BACKEND", "triton")
    got_loss, got = _grads(ops.linear_cross_entropy, hidden, weight, bias, target, label_smoothing=0.1,
                           chunk_size=4)
    for g, w in zip([got_loss] + got, [want_loss] + want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


def test_deterministic_mode_takes_the_plain_mm_path_with_the_same_gradients():
    # strict() turns deterministic algorithms on and swaps aten's mm for a fixed-order one; addmm_ is not
    # swapped, so the weight gradient is accumulated with mm + add there (one V x H temporary more).
    n, v, h = 300, 500, 16
    head = nn.Linear(h, v, bias=False)
    hidden = torch.randn(n, h, requires_grad=True)
    target = torch.randint(0, v, (n,))
    results = []
    for deterministic in (False, True):
        head.weight.grad = hidden.grad = None
        torch.use_deterministic_algorithms(deterministic)
        try:
            peak = peak_bytes(lambda: ops.linear_cross_entropy(hidden, head.weight, target, chunk_size=128).backward())
        finally:
            torch.use_deterministic_algorithms(False)
        results.append((peak, head.weight.grad.clone(), hidden.grad.clone()))
    (fast_peak, *fast), (plain_peak, *plain) = results
    assert plain_peak > fast_peak  # the V x H product before it is added in
    for got, want in zip(plain, fast):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
