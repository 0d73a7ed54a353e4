"""FusedAttention with a second additive term, ``softmax(q k^T * scale + mask + bias)`` (T5's decoder: its position
bias, then its causal mask): forward and every gradient (both terms' included) against eager on the explicit path
(dropout, returned probabilities) and the SDPA one, float32 / float64, broadcast shapes, a bool term; bf16 within
twice eager's error; a term that does not broadcast is refused by name; each term is saved as it is."""

from __future__ import annotations

import math

import pytest
import torch

from opsnn_lab.kernels import rng
from opsnn_lab.measuring import activation_bytes
from opsnn_lab.ops import FusedAttention
from opsnn_lab.testing import assert_close_dtype, assert_within_eager_error, seeded

B, H, T, D = 2, 3, 7, 5


def _inputs(dtype=torch.float32):
    q, k, v = (seeded(B, H, T, D, seed=i, dtype=dtype, requires_grad=True) for i in range(3))
    bias = seeded(1, H, T, T, seed=4, dtype=dtype, requires_grad=True)  # a learned position bias, shared by the batch
    causal = torch.full((T, T), torch.finfo(dtype).min, dtype=dtype).triu(1)
    mask = causal.expand(B, 1, T, T).clone()
    mask[1, :, :, -2:] = torch.finfo(dtype).min  # and padding in the second sample
    return q, k, v, bias, mask


def _eager(q, k, v, first, second, p=0.0, seed=0, step=0):
    """T5's eager code: ``q k^T * scale``, plus its first term, plus its second; the counter mask for dropout."""
    s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    probs = torch.softmax(s + first + second, dim=-1)
    if p > 0:
        probs = probs * rng.dropout_mask(seed, step * rng.MAX_NUMEL, probs.shape, p) / (1 - p)
    return torch.matmul(probs, v)


def _fwd_bwd(fn, tensors):
    out = fn(*tensors)
    out = out[0] if isinstance(out, tuple) else out
    g = seeded(*out.shape, seed=99, dtype=out.dtype)
    return out.detach(), torch.autograd.grad(out, [t for t in tensors if t.requires_grad], g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p, return_probs", [(0.0, False), (0.0, True), (0.3, False)],
                         ids=["sdpa", "explicit", "dropout"])
def test_forward_and_every_gradient_match_eager(dtype, p, return_probs):
    q, k, v, bias, mask = _inputs(dtype)
    mask.requires_grad_(True)  # the mask's gradient too, where a model learns it
    att = FusedAttention(dropout_p=p, seed=3, return_probs=return_probs)
    att.set_rng(3, 2)
    out, grads = _fwd_bwd(lambda *a: att(a[0], a[1], a[2], a[3], a[4]), (q, k, v, bias, mask))
    ref, ref_grads = _fwd_bwd(lambda *a: _eager(*a, p=p, seed=3, step=2), (q, k, v, bias, mask))
    assert_close_dtype(out, ref)
    assert [g.shape for g in grads] == [t.shape for t in (q, k, v, bias, mask)]
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close_dtype(g, r, msg=f"grad {i}")


def test_bool_second_term_and_broadcast_shapes():
    q, k, v, bias, _ = _inputs(torch.float64)
    keep = torch.ones(B, 1, 1, T, dtype=torch.bool)
    keep[0, ..., -3:] = False
    att = FusedAttention(return_probs=True)  # SDPA's keep / discard for a bool term
    out, grads = _fwd_bwd(lambda *a: att(a[0], a[1], a[2], a[3], keep), (q, k, v, bias))
    additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    ref, ref_grads = _fwd_bwd(lambda *a: _eager(*a, additive), (q, k, v, bias))
    assert_close_dtype(out, ref)
    for g, r in zip(grads, ref_grads):
        assert_close_dtype(g, r)


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_bf16_within_twice_eager_error(p):
    q64, k64, v64, b64, m64 = _inputs(torch.float64)
    m64 = m64.clamp(min=-1e4)
    low = [t.detach().to(torch.bfloat16).requires_grad_(t.requires_grad) for t in (q64, k64, v64, b64, m64)]
    ref = _fwd_bwd(lambda *a: _eager(*a, p=p), (q64, k64, v64, b64, m64))
    eager = _fwd_bwd(lambda *a: _eager(*a, p=p), low)
    fused = _fwd_bwd(FusedAttention(dropout_p=p, seed=0), low)
    for i, (f, e, r) in enumerate(zip((fused[0], *fused[1]), (eager[0], *eager[1]), (ref[0], *ref[1]))):
        assert_within_eager_error(f, e, r, name=f"tensor {i}")


def test_each_term_is_saved_as_it_is_and_a_bad_one_is_named():
    q, k, v, bias, mask = _inputs()
    att = FusedAttention(dropout_p=0.1, seed=0)
    got = activation_bytes(lambda: att(q, k, v, mask, bias).sum(), exclude=(bias,))
    assert got == q.nbytes + k.nbytes + v.nbytes + mask.nbytes  # no (B, H, T, T) sum of the two, no probabilities
    with pytest.raises(ValueError, match=r"bias must broadcast to \(2, 3, 7, 7\)"):
        att(q, k, v, mask, torch.zeros(H, T, T + 1))
    with pytest.raises(TypeError, match="bias"):
        att(q, k, v, mask, torch.zeros(1, H, T, T, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_a_wide_learned_bias_keeps_eagers_precision_in_every_gradient(dtype, p):
    # LeViT's and T5's learned position bias stays fp32 under autocast: eager adds it to the half scores (an fp32
    # sum) and takes the softmax and its backward in fp32; the op's every gradient, the fp32 bias's included, and with
    # dropout, within twice eager's error against float64
    for seed in range(3):
        q64, k64, v64 = (seeded(B, H, T, D, seed=seed * 7 + i, dtype=torch.float64, scale=3.0, requires_grad=True)
                         for i in range(3))
        b64 = seeded(1, H, T, T, seed=seed + 40, dtype=torch.float64, scale=4.0, requires_grad=True)

        def eager(q, k, v, b):  # autocast's dtypes: half GEMMs, the fp32 bias promoting the sum
            s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(D))
            probs = torch.softmax(s + b, dim=-1)
            if p > 0:
                probs = probs * rng.dropout_mask(1, 0, probs.shape, p, dtype=probs.dtype) / (1 - p)
            return torch.matmul(probs.to(v.dtype), v)

        low = [t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64)] + [b64.detach().float().requires_grad_()]
        ref = _fwd_bwd(eager, (q64, k64, v64, b64))
        ours = _fwd_bwd(eager, low)
        att = FusedAttention(dropout_p=p, seed=1)
        att.set_rng(1, 0)
        fused = _fwd_bwd(att, low)
        assert fused[1][3].dtype == torch.float32
        for i, (f, e, r) in enumerate(zip((fused[0], *fused[1]), (ours[0], *ours[1]), (ref[0], *ref[1]))):
            assert_within_eager_error(f, e, r, name=f"tensor {i} (seed {seed})")
