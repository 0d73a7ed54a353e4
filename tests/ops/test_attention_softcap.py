"""The attention core with its scores capped before the mask (Gemma 2's ``attn_logit_softcapping``):
``softmax(c * tanh(q k^T * scale / c) + mask) -> dropout -> @ v``, against the eager code, forward and every
gradient (the mask's too), and what it keeps for backward."""

import math

import pytest
import torch

from opsnn_lab.bench import activation_bytes
from opsnn_lab.kernels import rng
from opsnn_lab.ops import FusedAttention
from opsnn_lab.testing import assert_close_dtype, assert_within_eager_error, non_contiguous, seeded


def _eager(q, k, v, mask=None, bias=None, *, cap, p=0.0, seed=0, step=0, scale=None, fp32_softmax=False):
    """Gemma 2's eager attention core: scale, divide by the cap, tanh, multiply back, add the mask (and a second
    term), softmax (in fp32 and cast back for ``fp32_softmax``), the counter-based dropout, ``@ v``."""
    s = torch.matmul(q, k.transpose(-1, -2)) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    s = torch.tanh(s / cap) * cap
    for t in (mask, bias):
        if t is not None:
            s = s + t
    probs = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) if fp32_softmax else torch.softmax(s, dim=-1)
    if p > 0:
        keep = rng.dropout_mask(seed, step * rng.MAX_NUMEL, probs.shape, p)
        probs = probs * keep * (1.0 / (1 - p))
    return torch.matmul(probs, v)


def _inputs(b=2, h=3, tq=7, tk=7, d=5, dtype=torch.float64, scale=4.0):
    # scores of a few units times `scale`: the cap (2.0 below) bends them hard, so a missing 1 - tanh^2 shows
    q, k, v = (seeded(b, h, t, d, seed=i, dtype=dtype, scale=s, requires_grad=True)
               for i, (t, s) in enumerate(((tq, scale), (tk, scale), (tk, 1.0))))
    keep = torch.ones(b, tk, dtype=dtype)
    keep[0, -2:] = 0
    mask = (1.0 - keep[:, None, None, :]) * torch.finfo(dtype).min
    return q, k, v, mask


def _fwd_bwd(fn, tensors):
    out = fn(*tensors)
    g = seeded(*out.shape, seed=99, dtype=out.dtype, device=out.device)
    leaves = [t for t in tensors if t is not None and t.requires_grad]
    return out.detach(), torch.autograd.grad(out, leaves, g)


def _same(fused, eager):
    assert_close_dtype(fused[0], eager[0])
    assert len(fused[1]) == len(eager[1])
    for g, r in zip(fused[1], eager[1]):
        assert_close_dtype(g, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("masked", [True, False])
def test_forward_and_every_gradient_match_eager(dtype, p, masked):
    q, k, v, mask = _inputs(dtype=dtype)
    mask = mask if masked else None
    att = FusedAttention(dropout_p=p, seed=3, softcap=2.0)
    att.set_rng(3, 2)
    fused = _fwd_bwd(att, (q, k, v, mask))
    _same(fused, _fwd_bwd(lambda *a: _eager(*a, cap=2.0, p=p, seed=3, step=2), (q, k, v, mask)))
    # the cap is applied: uncapped eager differs by far more than rounding
    plain = _eager(q, k, v, mask, cap=1e9, p=p, seed=3, step=2)
    assert (fused[0] - plain).abs().max() > 1e-2


def test_odd_shapes_non_contiguous_broadcast_heads_and_the_terms_gradients():
    # more keys than queries, q as a strided view, one k/v head over three query heads, a float mask and a second
    # term (a position bias) both taking gradients: through the sum, not through the cap
    q = non_contiguous(seeded(2, 3, 5, 4, seed=4, scale=3.0, dtype=torch.float64)).requires_grad_(True)
    k = seeded(2, 1, 9, 4, seed=5, scale=3.0, dtype=torch.float64, requires_grad=True)
    v = seeded(2, 1, 9, 6, seed=6, dtype=torch.float64, requires_grad=True)
    mask = seeded(2, 1, 5, 9, seed=7, dtype=torch.float64, requires_grad=True)
    bias = seeded(1, 3, 5, 9, seed=8, dtype=torch.float64, requires_grad=True)
    att = FusedAttention(dropout_p=0.3, seed=2, softcap=1.5, scale=0.7)
    fused = _fwd_bwd(att, (q, k, v, mask, bias))
    assert fused[0].shape == (2, 3, 5, 6)
    _same(fused, _fwd_bwd(lambda *a: _eager(*a, cap=1.5, p=0.3, seed=2, scale=0.7), (q, k, v, mask, bias)))
    empty = FusedAttention(dropout_p=0.3, softcap=2.0)(*(torch.zeros(0, 2, 4, 3) for _ in range(3)))
    assert empty.shape == (0, 2, 4, 3)


def test_eval_bool_mask_causal_and_returned_probabilities():
    q, k, v, mask = _inputs()
    keep = mask == 0  # SDPA's bool mask: True attends
    att = FusedAttention(dropout_p=0.5, softcap=2.0).eval()
    assert_close_dtype(att(q, k, v, keep), _eager(q, k, v, mask, cap=2.0))
    assert att.rng_step == 0
    causal = FusedAttention(softcap=2.0, is_causal=True).eval()
    tri = torch.full((7, 7), float("-inf"), dtype=q.dtype).triu(1)
    assert_close_dtype(causal(q, k, v), _eager(q, k, v, tri, cap=2.0))
    weights = FusedAttention(softcap=2.0, return_probs=True).eval()
    out, probs = weights(q, k, v, mask)
    s = torch.tanh(q @ k.transpose(-1, -2) / math.sqrt(5) / 2.0) * 2.0 + mask
    assert_close_dtype(probs, torch.softmax(s, -1))
    assert_close_dtype(out, _eager(q, k, v, mask, cap=2.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("fp32_softmax", [False, True])
def test_low_precision_within_twice_eager_error(dtype, p, fp32_softmax):
    q64, k64, v64, m64 = _inputs()
    m64 = m64.clamp(min=-1e4)
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in (q64, k64, v64))
    mask = m64.to(dtype)
    ref = _fwd_bwd(lambda *a: _eager(*a, cap=2.0, p=p), (q64, k64, v64, m64))
    eager = _fwd_bwd(lambda *a: _eager(*a, cap=2.0, p=p, fp32_softmax=fp32_softmax), (q, k, v, mask))
    att = FusedAttention(dropout_p=p, seed=0, softcap=2.0, fp32_softmax=fp32_softmax)
    fused = _fwd_bwd(att, (q, k, v, mask))
    assert fused[0].dtype == dtype
    for i, (f, e, r) in enumerate(zip((fused[0], *fused[1]), (eager[0], *eager[1]), (ref[0], *ref[1]))):
        assert_within_eager_error(f, e, r, name=f"tensor {i}")


def test_saves_no_t_by_t_tensor_where_eager_saves_three():
    # eager keeps the tanh, the probabilities and (with dropout) the mask and the dropped probabilities; the fused
    # core keeps q, k, v and the mask whatever the dropout
    q, k, v, mask = _inputs(tq=32, tk=32, d=4, dtype=torch.float32)
    txt = 2 * 3 * 32 * 32 * 4
    for p in (0.0, 0.1):
        eager = activation_bytes(lambda p=p: _eager(q * 1, k * 1, v * 1, mask, cap=2.0, p=p))
        fused = activation_bytes(lambda p=p: FusedAttention(dropout_p=p, softcap=2.0)(q * 1, k * 1, v * 1, mask))
        assert fused < txt and eager >= 2 * txt, (p, fused, eager)


def test_bad_softcap_is_refused_by_name_and_shown():
    for bad, err in ((0.0, ValueError), (-1.0, ValueError), ("50", TypeError)):
        with pytest.raises(err, match="softcap"):
            FusedAttention(softcap=bad)
    assert "softcap=50.0" in repr(FusedAttention(softcap=50))
    assert "softcap" not in repr(FusedAttention())
    drop = torch.nn.Dropout(0.1)
    assert FusedAttention.from_modules(drop, softcap=30.0).softcap == 30.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_capped_core_within_twice_eager_error(dtype):
    # the GPU's own path (its counter dropout pass, cuBLAS): against float64 on the CPU, no worse than twice
    # eager's error in the same dtype on the GPU
    q64, k64, v64, m64 = _inputs(b=4, h=8, tq=128, tk=128, d=64)
    m64 = m64.clamp(min=-1e4)
    ref = _fwd_bwd(lambda *a: _eager(*a, cap=2.0), (q64, k64, v64, m64))
    q, k, v = (t.detach().cuda().to(dtype).requires_grad_(True) for t in (q64, k64, v64))
    mask = m64.cuda().to(dtype)
    eager = _fwd_bwd(lambda *a: _eager(*a, cap=2.0, fp32_softmax=True), (q, k, v, mask))
    fused = _fwd_bwd(FusedAttention(softcap=2.0, fp32_softmax=True), (q, k, v, mask))
    for i, (f, e, r) in enumerate(zip((fused[0], *fused[1]), (eager[0], *eager[1]), (ref[0], *ref[1]))):
        assert_within_eager_error(f.cpu(), e.cpu(), r, name=f"tensor {i}")
