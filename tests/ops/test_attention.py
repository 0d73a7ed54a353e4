import math

import pytest
import torch

from opsnn_lab.bench import activation_bytes
from opsnn_lab.kernels import rng
from opsnn_lab.ops import FusedAttention
from opsnn_lab.testing import assert_close_dtype, assert_within_eager_error, non_contiguous, seeded


def _inputs(b=2, h=3, t=7, d=5, dtype=torch.float32, masked=True):
    q, k, v = (seeded(b, h, t, d, seed=i, dtype=dtype, requires_grad=True) for i in range(3))
    mask = None
    if masked:  # padding mask as the encoder builds it: (B, 1, 1, T) of 0 / finfo.min
        keep = torch.ones(b, t, dtype=dtype)
        keep[0, -2:] = 0
        mask = (1.0 - keep[:, None, None, :]) * torch.finfo(dtype).min
    return q, k, v, mask


def _eager(q, k, v, mask, p=0.0, seed=0, step=0, scale=None, fp32_softmax=False):
    """The hand-written core of models.SelfAttention, with the counter-based mask for dropout; ``fp32_softmax``:
    Llama's form, ``softmax(s, dtype=torch.float32).to(q.dtype)``."""
    s = torch.matmul(q, k.transpose(-1, -2)) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        s = s + mask
    probs = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) if fp32_softmax else torch.softmax(s, dim=-1)
    if p > 0:
        keep = rng.dropout_mask(seed, step * rng.MAX_NUMEL, probs.shape, p)
        probs = probs * keep * (0.0 if p == 1 else 1.0 / (1 - p))
    return torch.matmul(probs, v)


def _fwd_bwd(fn, tensors):
    out = fn(*tensors)
    g = seeded(*out.shape, seed=99, dtype=out.dtype, device=out.device)
    leaves = [t for t in tensors if t is not None and t.requires_grad]
    return out.detach(), torch.autograd.grad(out, leaves, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [0.0, 0.2, 1.0])
@pytest.mark.parametrize("masked", [True, False])
def test_forward_and_every_gradient_match_eager(dtype, p, masked):
    q, k, v, mask = _inputs(dtype=dtype, masked=masked)
    att = FusedAttention(dropout_p=p, seed=3)
    att.set_rng(3, 2)
    out, grads = _fwd_bwd(att, (q, k, v, mask))
    ref, ref_grads = _fwd_bwd(lambda *a: _eager(*a, p=p, seed=3, step=2), (q, k, v, mask))
    assert_close_dtype(out, ref)
    for g, r in zip(grads, ref_grads):
        assert_close_dtype(g, r)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_low_precision_within_twice_eager_error(dtype, p):
    q64, k64, v64, m64 = _inputs(dtype=torch.float64)
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in (q64, k64, v64))
    mask = m64.clamp(min=-1e4).to(dtype)
    ref = _fwd_bwd(lambda *a: _eager(*a, p=p), (q64, k64, v64, m64.clamp(min=-1e4)))
    eager = _fwd_bwd(lambda *a: _eager(*a, p=p), (q, k, v, mask))
    fused = _fwd_bwd(FusedAttention(dropout_p=p, seed=0), (q, k, v, mask))
    for i, (f, e, r) in enumerate(zip((fused[0], *fused[1]), (eager[0], *eager[1]), (ref[0], *ref[1]))):
        assert_within_eager_error(f, e, r, name=f"tensor {i}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_an_fp32_softmax_keeps_fp32_probabilities_and_their_gradient(dtype, p):
    # Llama-style code takes the softmax in fp32 and casts back: fp32_softmax=True does the same, forward and
    # backward (there eager's autograd takes the softmax's gradient in fp32), within twice eager's error
    q64, k64, v64, m64 = _inputs(dtype=torch.float64)
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in (q64, k64, v64))
    mask = m64.clamp(min=-1e4).to(dtype)
    att = FusedAttention(dropout_p=p, seed=0, return_probs=True, fp32_softmax=True)  # return_probs: the own path
    ref = _fwd_bwd(lambda *a: _eager(*a, p=p), (q64, k64, v64, m64.clamp(min=-1e4)))
    eager = _fwd_bwd(lambda *a: _eager(*a, p=p, fp32_softmax=True), (q, k, v, mask))
    fused = _fwd_bwd(lambda *a: att(*a)[0], (q, k, v, mask))
    for i, (f, e, r) in enumerate(zip((fused[0], *fused[1]), (eager[0], *eager[1]), (ref[0], *ref[1]))):
        assert_within_eager_error(f, e, r, name=f"tensor {i}")
    probs = att(q, k, v, mask)[1]
    assert probs.dtype == dtype
    plain = FusedAttention(dropout_p=p, seed=0, return_probs=True)
    if dtype != torch.float32:  # the half softmax's error is larger than the fp32 one's, rounded once
        err = lambda o: (o.double() - ref[0]).abs().max()
        assert err(fused[0]) <= err(_fwd_bwd(lambda *a: plain(*a)[0], (q, k, v, mask))[0]) * 1.01 + 1e-6


def test_eval_mode_and_custom_scale_and_bool_mask():
    q, k, v, mask = _inputs()
    att = FusedAttention(scale=0.3, dropout_p=0.5).eval()
    assert_close_dtype(att(q, k, v, mask), _eager(q, k, v, mask, scale=0.3))
    assert att.rng_step == 0
    bool_mask = mask == 0  # True = attend
    train = FusedAttention(dropout_p=0.25, seed=1)
    out, grads = _fwd_bwd(train, (q, k, v, bool_mask))
    ref, ref_grads = _fwd_bwd(lambda *a: _eager(*a, p=0.25, seed=1), (q, k, v, mask))
    assert_close_dtype(out, ref)
    assert len(grads) == len(ref_grads) == 3  # q, k, v: a bool mask takes no gradient
    for g, r in zip(grads, ref_grads):
        assert_close_dtype(g, r)


def test_odd_shapes_non_contiguous_empty_and_mask_gradient():
    q = non_contiguous(seeded(1, 2, 5, 3, seed=4)).requires_grad_(True)
    k = seeded(1, 2, 9, 3, seed=5, requires_grad=True)
    v = seeded(1, 2, 9, 4, seed=6, requires_grad=True)
    mask = seeded(1, 1, 5, 9, seed=7, requires_grad=True)
    out, grads = _fwd_bwd(FusedAttention(dropout_p=0.3, seed=2), (q, k, v, mask))
    ref, ref_grads = _fwd_bwd(lambda *a: _eager(*a, p=0.3, seed=2), (q, k, v, mask))
    assert out.shape == (1, 2, 5, 4)
    assert_close_dtype(out, ref)
    for g, r in zip(grads, ref_grads):
        assert_close_dtype(g, r)
    empty = FusedAttention(dropout_p=0.3)(*(torch.zeros(0, 2, 4, 3) for _ in range(3)))
    assert empty.shape == (0, 2, 4, 3)


def test_no_t_by_t_tensor_saved():
    q, k, v, mask = _inputs(t=32, d=4)
    txt = 2 * 3 * 32 * 32 * 4
    eager_bytes = activation_bytes(lambda: _eager(q * 1, k * 1, v * 1, mask, p=0.1))
    for p in (0.0, 0.1):
        fused_bytes = activation_bytes(lambda p=p: FusedAttention(dropout_p=p)(q * 1, k * 1, v * 1, mask))
        assert fused_bytes < txt < eager_bytes, (p, fused_bytes, eager_bytes)


@pytest.mark.parametrize("tokens, fused_kernel", [(24, True), (6, False)])
def test_strided_features_take_the_fused_kernel_where_the_probabilities_are_larger(tokens, fused_kernel):
    """q, k, v as views of one (B, 3, heads, d, T) output permuted to (B, heads, T, d) (Visformer's channels-first
    attention): SDPA's math path, which saves the T x T probabilities as eager does, until the op hands it
    operands with contiguous features. With fewer keys than features the probabilities are the smaller tensor:
    the operands then go as they are."""
    b, h, d = 2, 3, 8
    qkv = seeded(b, 3 * h * d, tokens, seed=1, requires_grad=True)
    mask = seeded(b, 1, tokens, tokens, seed=2)

    def views():
        return (qkv * 1).reshape(b, 3, h, d, tokens).permute(1, 0, 2, 4, 3).unbind(0)

    op = FusedAttention()
    assert views()[0].stride(-1) != 1
    out, grads = _fwd_bwd(lambda x: op(*views(), mask), (qkv,))
    ref, ref_grads = _fwd_bwd(lambda x: _eager(*views(), mask), (qkv,))
    assert_close_dtype(out, ref)
    assert_close_dtype(grads[0], ref_grads[0])
    fused_bytes = activation_bytes(lambda: op(*views(), mask))
    eager_bytes = activation_bytes(lambda: _eager(*views(), mask))
    probs, outs = b * h * tokens * tokens * 4, b * h * tokens * d * 4
    if fused_kernel:  # the probabilities replaced by the output, a statistic per query and the mask SDPA keeps
        assert fused_bytes == eager_bytes - probs + outs + b * h * tokens * 4 + mask.numel() * 4 < eager_bytes
    else:
        assert fused_bytes == eager_bytes


def test_dropout_steps_and_reproducibility():
    q, k, v, mask = _inputs()
    att = FusedAttention(dropout_p=0.5, seed=9)
    a, b = att(q, k, v, mask), att(q, k, v, mask)
    assert not torch.equal(a, b) and att.rng_step == 2
    att.set_rng(9, 0)
    assert torch.equal(att(q, k, v, mask), a)


def test_bad_arguments_name_the_argument():
    q, k, v, mask = _inputs()
    att = FusedAttention()
    with pytest.raises(ValueError, match="k"):
        att(q, k[..., :4], v)
    with pytest.raises(ValueError, match="v"):
        att(q, k, v[..., :3, :])
    with pytest.raises(TypeError, match="v"):
        att(q, k, v.double())
    with pytest.raises(ValueError, match="mask"):
        att(q, k, v, torch.zeros(2, 1, 3, 4))
    with pytest.raises(TypeError, match="mask"):
        att(q, k, v, torch.zeros(2, 1, 1, 7, dtype=torch.int64))
    with pytest.raises(ValueError, match="dropout_p"):
        FusedAttention(dropout_p=2.0)
    with pytest.raises(ValueError, match="scale"):
        FusedAttention(scale=-1.0)
    with pytest.raises(TypeError, match="dropout"):
        FusedAttention.from_modules(torch.nn.ReLU())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_gpu_matches_eager(p):
    q, k, v, mask = (None if t is None else t.detach().cuda().requires_grad_(t.requires_grad)
                     for t in _inputs(b=8, h=12, t=128, d=64))
    out, grads = _fwd_bwd(FusedAttention(dropout_p=p, seed=1), (q, k, v, mask))
    ref, ref_grads = _fwd_bwd(lambda *a: _eager(*[t if t is None else t.cpu() for t in a], p=p, seed=1),
                              (q, k, v, mask))
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    for g, r in zip(grads, ref_grads):  # gradients of the CUDA leaves live on CUDA, whichever path made them
        torch.testing.assert_close(g.cpu(), r.cpu(), atol=1e-4, rtol=1e-4)


def test_batch_dims_broadcast_as_torch_broadcasts_them():
    # the op's own broadcast rule (torch.broadcast_shapes costs ~40 us a call on CPU): same result, same refusals
    import itertools

    from opsnn_lab.ops.attention import _broadcast

    dims = [(), (1,), (3,), (0,), (2, 1), (1, 3), (2, 3), (4, 1, 1), (0, 3)]
    for shapes in itertools.chain(itertools.product(dims, repeat=2), itertools.product(dims, repeat=3)):
        try:
            want = torch.broadcast_shapes(*shapes)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                _broadcast(*shapes)
            continue
        assert _broadcast(*shapes) == want, shapes


def _eager_probs(q, k, mask, p, seed, step):
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + (0 if mask is None else mask)
    probs = torch.softmax(s, dim=-1)
    if p > 0:
        probs = probs * rng.dropout_mask(seed, step * rng.MAX_NUMEL, probs.shape, p) * (1.0 / (1 - p))
    return probs


@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("training", [True, False])
def test_return_probs_gives_eagers_weights_and_refuses_their_gradient(p, training):
    # eager attention code returns its probabilities (after dropout, rescaled) beside the output: the op returns
    # the same two, with every gradient of the output as before; the weights are for reading
    q, k, v, mask = _inputs(dtype=torch.float64)
    k1 = k.detach()[:, :1].requires_grad_(True)  # one key/value head broadcast over the query heads
    v1 = v.detach()[:, :1].requires_grad_(True)
    att = FusedAttention(dropout_p=p, seed=3, return_probs=True).train(training)
    att.set_rng(3, 2)
    out, probs = att(q, k1, v1, mask)
    p_eff = p if training else 0.0
    want = _eager_probs(q, k1, mask, p_eff, 3, 2)
    assert probs.shape == (2, 3, 7, 7) and out.shape == (2, 3, 7, 5)
    torch.testing.assert_close(probs, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, torch.matmul(want, v1), rtol=1e-12, atol=1e-12)
    att.set_rng(3, 2)
    grads = torch.autograd.grad(att(q, k1, v1, mask)[0].sum(), (q, k1, v1))
    want_grads = torch.autograd.grad(torch.matmul(_eager_probs(q, k1, mask, p_eff, 3, 2), v1).sum(), (q, k1, v1))
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    out, probs = att(q, k1, v1, mask)
    with pytest.raises(RuntimeError, match="for reading only"):
        (out.sum() + probs.sum()).backward()
    with torch.no_grad():  # read without a graph: fine
        assert torch.equal(att(q, k1, v1, mask)[1].isfinite(), torch.ones_like(probs, dtype=torch.bool))


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_is_causal_and_enable_gqa_are_sdpas(p):
    # the op standing for an SDPA call: the same flags, the same result (its dropout from the counter stream,
    # as counter_sdpa draws it for make_reproducible), every gradient
    import torch.nn.functional as F

    from opsnn_lab.ops.attention import counter_sdpa

    q = seeded(2, 4, 6, 5, seed=1, dtype=torch.float64, requires_grad=True)
    k, v = (seeded(2, 2, 6, 5, seed=s, dtype=torch.float64, requires_grad=True) for s in (2, 3))
    att = FusedAttention(dropout_p=p, seed=5, is_causal=True, enable_gqa=True).train()
    att.set_rng(5, 0)
    out = att(q, k, v)
    want = (F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) if p == 0 else
            counter_sdpa(q, k, v, None, p, True, None, True, seed=5, offset=0))
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    with pytest.raises(TypeError, match="is_causal"):
        FusedAttention(is_causal=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("explicit", [False, True])  # SDPA (p = 0), or the op's own path (return_probs)
def test_a_wide_float_mask_is_added_to_half_scores_in_its_own_dtype(dtype, explicit):
    # T5's position bias stays fp32 under autocast; its attention adds it into half scores (one rounding) and
    # takes the softmax in fp32. The op's own path keeps the sum in fp32; the SDPA path takes the mask cast to the
    # scores' dtype, as autocast gives it to SDPA (older torch refuses another dtype): within eager's error
    errs = {"eager": [], "fused": []}
    for seed in range(3):
        q, k, v = (seeded(2, 3, 9, 8, seed=seed * 3 + i, dtype=torch.float64, scale=2.0) for i in range(3))
        bias = seeded(1, 3, 9, 9, seed=seed + 50, dtype=torch.float64, scale=8.0)
        ref = torch.softmax(q @ k.transpose(-1, -2) + bias, -1) @ v
        qh, kh, vh = (t.to(dtype) for t in (q, k, v))
        scores = (qh @ kh.transpose(-1, -2))
        scores += bias.float()  # in place into the half scores, as T5's attention does
        eager = torch.softmax(scores.float(), -1).to(dtype) @ vh
        fused = FusedAttention(scale=1.0, return_probs=explicit).eval()(qh, kh, vh, bias.float())
        fused = fused[0] if explicit else fused
        for name, out in (("eager", eager), ("fused", fused)):
            errs[name].append((out.double() - ref).abs().max().item())
    assert max(errs["fused"]) <= max(errs["eager"]) * 1.05, errs


def test_sdpa_gets_a_float_mask_of_the_querys_dtype(monkeypatch):
    # torch before 2.9 (and GPU kernels) refuse a float mask of another dtype than the query's
    from opsnn_lab.ops import attention as attention_mod

    seen = []
    sdpa = attention_mod.F.scaled_dot_product_attention

    def recorded(*args, attn_mask=None, **kwargs):
        seen.append(attn_mask.dtype)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(attention_mod.F, "scaled_dot_product_attention", recorded)
    q = seeded(2, 3, 4, 8, seed=1, dtype=torch.bfloat16)
    FusedAttention().eval()(q, q, q, seeded(2, 1, 4, 4, seed=2))
    assert seen == [torch.bfloat16]
