"""Attention core ``softmax(q @ k^T * scale + mask) -> dropout -> @ v`` without saving a T x T tensor.

Two paths, one semantics (the hand-written core in ``opsnn_lab.models.SelfAttention``):

* eval mode or ``dropout_p == 0``: ``F.scaled_dot_product_attention`` (its fused kernels save q, k, v,
  the output and the row log-sum-exp; no T x T tensor).
* training with ``dropout_p > 0``: SDPA's dropout draws from torch's own generator and cannot take our
  counter-based mask, and on CPU it falls back to the math path that saves the T x T probabilities.
  So this path is an explicit autograd Function that computes the scores in full but SAVES only q, k, v
  (and the caller's mask), regenerating the scores, the probabilities (same ops, same bits) and the
  dropout mask (``opsnn_lab.kernels.rng``, seed/step contract of ``opsnn_lab.ops.dropout``) in
  backward. It is exact, reproducible from (seed, step) and lean in saved memory; its forward and
  backward do materialize T x T temporaries (freed at once), so peak memory is not flash-attention's.
* ``return_probs=True`` (the core of eager attention code that also returns its weights, as Hugging Face's
  ``eager_attention_forward`` does): always the second path, which has the probabilities at hand.
* ``softcap=c`` (Gemma 2's scores ``c * tanh(s / c)`` before the mask): always the second path too (SDPA has no
  cap); its backward recomputes ``tanh`` with the scores, so the cap saves nothing T x T either, where eager keeps
  the ``tanh`` output beside the probabilities. The recomputed GEMM, ``tanh`` and softmax cost time: on CPU the
  capped core takes ~1.2-1.3x eager's time without dropout (``python -m opsnn_lab.bench ops``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab._checks import check_positive, check_range, check_tensor, check_type, first_derivative_only, same_device
from opsnn_lab.kernels import rng
from opsnn_lab.ops import _amp
from opsnn_lab.ops.dropout import CounterRNG

__all__ = ["FusedAttention", "AttentionDropoutFunction", "counter_sdpa", "SDPA_ARGS"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# F.scaled_dot_product_attention's parameters in order (counter_sdpa takes the same): for binding a call's arguments
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _broadcast(*shapes) -> torch.Size:
    """``torch.broadcast_shapes`` for plain int shapes: that one goes through symbolic-shape guards, ~40 us a call
    on CPU, more than the rest of a small attention step; RuntimeError as it raises."""
    out = [1] * max(len(s) for s in shapes)
    for shape in shapes:
        for i, d in enumerate(shape, len(out) - len(shape)):
            if out[i] == 1:
                out[i] = d
            elif d not in (1, out[i]):
                raise RuntimeError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
    return torch.Size(out)


def _batched(q, k, v, mask, bias=None):
    """q, k, v as 3-D (batch, T, d) tensors over their common batch dims, and the mask (and ``bias``, a second term
    added after it) as additive floats, in a list."""
    batch = _broadcast(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q3, k3, v3 = (t.expand(*batch, *t.shape[-2:]).reshape(-1, *t.shape[-2:]) for t in (q, k, v))
    terms = [_additive(t, q) for t in (mask, bias) if t is not None]
    return batch, q3, k3, v3, terms


def _additive(mask, q):
    if mask.dtype == torch.bool:  # SDPA's keep / discard
        return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    return mask


def _probs(q3, k3, scale, terms, batch, fp32=False, cap=None):
    """``(softmax(q k^T * scale + mask [+ bias]), tanh)`` as (batch, Tq, Tk): the additive ``terms`` are copied in
    (a second added onto the first: T5's position bias, then its mask), the GEMM adds onto them. A float term wider
    than bf16/fp16 scores (a T5 position bias, kept fp32 under autocast) makes the sum and the softmax run in its
    dtype, rounded once: eager attention code rounds that sum to the scores' dtype first. ``fp32``: the probabilities
    in fp32, as ``softmax(..., dtype=torch.float32)`` gives them (Llama-style code). ``cap``: the scores capped first
    (``_capped``), whose ``tanh`` backward reads; ``tanh`` is None without a cap."""
    want = torch.float32 if fp32 else q3.dtype
    dtype = q3.dtype
    for t in terms:
        dtype = torch.promote_types(dtype, t.dtype)
    if cap is not None:
        return _capped(q3, k3, scale, terms, batch, want, cap, dtype)
    if not terms:
        s = torch.baddbmm(q3.new_zeros(()), q3, k3.transpose(1, 2), beta=0, alpha=scale)
        return _softmax(s, want), None
    s = torch.empty(q3.shape[0], q3.shape[1], k3.shape[1], dtype=dtype, device=q3.device)
    full = s.view(*batch, *s.shape[1:])
    full.copy_(terms[0].expand(full.shape))
    for t in terms[1:]:
        full.add_(t)
    if dtype == q3.dtype:
        s.baddbmm_(q3, k3.transpose(1, 2), alpha=scale)
    else:
        s.add_(torch.baddbmm(q3.new_zeros(()), q3, k3.transpose(1, 2), beta=0, alpha=scale))
    return _softmax(s, want), None


def _capped(q3, k3, scale, terms, batch, want, cap, dtype):
    """``(softmax(cap * tanh(q k^T * scale / cap) + terms), tanh)``: the scores capped before the terms are added, in
    the scores' dtype and order, as Gemma 2's eager code computes them (a bf16 tanh takes ~0.6x an fp32 one on CPU,
    and this runs in forward and again in backward); ``tanh`` is what backward's ``1 - tanh^2`` reads. ``dtype``:
    the scores' and the terms' (a wide term, an fp32 bias beside half scores: the sum in its dtype)."""
    s = torch.baddbmm(q3.new_zeros(()), q3, k3.transpose(1, 2), beta=0, alpha=scale)
    t = torch.tanh(s.div_(cap))
    s = torch.mul(t, cap, out=s).to(dtype)
    full = s.view(*batch, *s.shape[1:])
    for term in terms:  # eager's order: the capped scores, then each term
        full.add_(term)
    return _softmax(s, want), t


def _softmax(s, want):
    """The softmax of the scores ``s`` in ``want``: computed in ``want`` where it is as wide, else (a wide term's
    sum) in ``s``'s dtype and rounded once."""
    if torch.promote_types(s.dtype, want) == want:
        return torch.softmax(s, dim=-1, dtype=want)
    return torch.softmax(s, dim=-1).to(want)


class _Dropout:
    """``t * keep`` for the step's (batch, Tq, Tk) tensors (row-major counters from ``offset``): on a GPU one pass
    per tensor that never writes the mask; elsewhere the mask is made once and reused."""

    def __init__(self, probs, batch, p, seed, offset):
        self.args = (seed, offset, p)
        self.keep = None
        self.identity = p == 0  # no mask at all (the core of a chain without dropout, run for its probabilities)
        if not self.identity and not rng.fuses_dropout_mul(probs):
            shape = (*batch, *probs.shape[1:])
            self.keep = rng.dropout_mask(seed, offset, shape, p, probs.device, dtype=probs.dtype).view(probs.shape)

    def __call__(self, t, out=None):
        if self.identity:
            return t if out is None or out is t else out.copy_(t)
        if self.keep is None:
            return rng.dropout_mul(t, *self.args, out=out)
        return torch.mul(t, self.keep) if out is None else out.mul_(self.keep)


class AttentionDropoutFunction(torch.autograd.Function):
    """``dropout(softmax(q k^T * scale + mask)) @ v`` saving only q, k, v (and the caller's mask).

    Backward recomputes the probabilities with the same ops (so the same bits) and regenerates the mask.
    The dropout rescale ``1 / (1 - p)`` is applied to the (T x d) results, never to a T x T tensor.

    ``return_probs=True`` also returns the probabilities after dropout, ``(batch, Tq, Tk)``, as eager attention
    code returns them (Hugging Face's ``attn_weights``): made by the forward anyway, kept by nothing here, and
    for reading only: a gradient reaching them raises (the saved-memory design has no T x T tensor to
    differentiate), rather than being dropped.
    """

    @staticmethod
    @_amp.no_autocast
    def forward(ctx, q, k, v, mask, scale, p, seed, offset, return_probs=False, fp32_softmax=False, bias=None,
                softcap=None):
        batch, q3, k3, v3, terms = _batched(q, k, v, mask, bias)
        probs = _probs(q3, k3, scale, terms, batch, fp32_softmax, softcap)[0]  # a cap's tanh: recomputed in backward
        _Dropout(probs, batch, p, seed, offset)(probs, out=probs)
        out = torch.bmm(probs.to(v3.dtype), v3).mul_(_keep_scale(p))
        ctx.save_for_backward(q, k, v, mask, bias)
        ctx.cfg = (scale, p, seed, offset, fp32_softmax, softcap)
        if not return_probs:
            return out  # (batch, T, d): viewed outside the Function, so the caller may modify it in place
        ctx.set_materialize_grads(False)
        probs = probs.mul_(_keep_scale(p)) if p else probs  # eager's attn_weights carry the rescale
        return out, probs.to(q.dtype)

    @staticmethod
    @_amp.no_autocast
    def backward(ctx, grad, grad_probs=None):
        first_derivative_only("FusedAttention")
        if grad_probs is not None:
            raise RuntimeError(
                "a fused attention (FusedAttention, return_probs=True) returns its attention probabilities for "
                "reading only, and a gradient reached them: a loss that depends on the attention weights needs "
                "the unfused attention (ol.fusion.revert(model), or fuse without the 'attention' pattern)")
        if grad is None:
            return (None,) * 12
        q, k, v, mask, bias = ctx.saved_tensors
        scale, p, seed, offset, fp32_softmax, softcap = ctx.cfg
        ks = _keep_scale(p)
        batch, q3, k3, v3, terms = _batched(q, k, v, mask, bias)
        g3 = grad.reshape(-1, *grad.shape[-2:])
        probs, tanh = _probs(q3, k3, scale, terms, batch, fp32_softmax, softcap)
        drop = _Dropout(probs, batch, p, seed, offset)
        grad_v = torch.bmm(drop(probs).to(g3.dtype).transpose(1, 2), g3).mul_(ks)
        # dS = softmax_backward(dropout(dO v^T), P), in the probabilities' dtype (fp32 for an fp32 softmax, as
        # autograd takes eager's); the 1 / (1 - p) of dropout moves onto dq, dk and dmask.
        dp = torch.bmm(g3, v3.transpose(1, 2)).to(probs.dtype)
        ds = torch._softmax_backward_data(drop(dp, out=dp), probs, -1, probs.dtype)
        del probs, dp, drop
        need = ctx.needs_input_grad
        # the terms' gradient is the sum's; the scores' goes through the cap, d(c tanh(s / c)) = (1 - tanh^2) ds,
        # in the scores' dtype as autograd takes eager's
        dterms = ds.to(q3.dtype) if need[3] or need[10] else None
        ds = ds.to(q3.dtype) if tanh is None else torch.ops.aten.tanh_backward(ds.to(tanh.dtype), tanh).to(q3.dtype)
        grad_q = torch.bmm(ds, k3).mul_(scale * ks) if need[0] else None
        grad_k = torch.bmm(ds.transpose(1, 2), q3).mul_(scale * ks) if need[1] else None
        grad_mask, grad_bias = (dterms.view(*batch, *ds.shape[1:]).sum_to_size(t.shape).mul(ks)
                                if wanted and t is not None and t.dtype != torch.bool else None
                                for t, wanted in ((mask, need[3]), (bias, need[10])))
        shaped = [None if g is None else g.view(*batch, *g.shape[1:]) for g in (grad_q, grad_k, grad_v)]
        return (*(_unbroadcast(g, t) for g, t in zip(shaped, (q, k, v))), grad_mask, None, None, None, None, None,
                None, grad_bias, None)


def _keep_scale(p: float) -> float:
    return 0.0 if p >= 1 else 1.0 / (1.0 - p)


def _unbroadcast(grad, like):
    return grad if grad is None or grad.shape == like.shape else grad.sum_to_size(like.shape)


def _check_qkv(q, k, v, mask, bias=None):
    check_tensor("q", q, dtypes=_FLOATS, min_dim=2)
    check_tensor("k", k, dtypes=(q.dtype,), min_dim=2)
    check_tensor("v", v, dtypes=(q.dtype,), min_dim=2)
    same_device(q=q, k=k, v=v, mask=mask)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have q's head dim {q.shape[-1]}, got shape {tuple(k.shape)}")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v must have k's sequence length {k.shape[-2]}, got shape {tuple(v.shape)}")
    try:
        batch = _broadcast(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(f"q, k, v batch dims do not broadcast: {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}") from None
    for name, t in (("mask", mask), ("bias", bias)):
        if t is None:  # bool, or a float term of q's dtype or a wider one (added in its own dtype)
            continue
        check_tensor(name, t, dtypes=(q.dtype, torch.bool) + (
            (torch.float32, torch.float64) if q.dtype in (torch.float16, torch.bfloat16) else ()))
        target = (*batch, q.shape[-2], k.shape[-2])
        try:
            ok = _broadcast(t.shape, target) == torch.Size(target)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"{name} must broadcast to {target}, got shape {tuple(t.shape)}")


def counter_sdpa(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                 scale: float | None = None, enable_gqa: bool = False, *, seed: int, offset: int = 0):
    """``F.scaled_dot_product_attention`` with its dropout drawn from the counter RNG at ``(seed, offset)``
    (``ol.consistency.make_reproducible`` routes SDPA calls with ``dropout_p > 0`` here). Same arguments
    and result; ``is_causal`` is the top-left aligned lower triangle, ``enable_gqa`` repeats each k/v head
    over its group of query heads. Saves q, k, v and the mask (``AttentionDropoutFunction``)."""
    check_range("dropout_p", dropout_p, 0.0, 1.0)
    with _amp.region(query) as cast:  # under autocast: q, k, v and a float mask cast, as SDPA's are
        query, key, value, attn_mask = _cast_operands(cast, query, key, value, attn_mask)
        return _counter_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed, offset)


def _cast_operands(cast, q, k, v, mask):
    # a float mask keeps its dtype: the core adds it to half scores in that dtype (_probs), one rounding less
    # than casting it as SDPA's autocast does
    return (*cast(q, k, v), mask)


def _fused_kernel_layout(query, key, value):
    """q, k and v with their features contiguous where there are more keys than v's width: SDPA's fused kernels
    take only such operands, and the math path it falls back to for strided ones (q, k, v as views of one QKV
    output with the tokens contiguous: Visformer) saves the T x T probabilities, as eager code does, where the
    fused kernels save the output and a statistic per query. The copies are those the math path makes anyway.
    With fewer keys than that the probabilities are the smaller tensor to keep: the operands go as they are."""
    if key.shape[-2] <= value.shape[-1] or (query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1):
        return query, key, value
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))


def _counter_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed, offset,
                  return_probs=False, fp32_softmax=False, bias=None, softcap=None):
    if is_causal:
        if attn_mask is not None:
            raise ValueError("attn_mask and is_causal=True cannot both be given (as in scaled_dot_product_attention)")
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
    if enable_gqa and key.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        if query.shape[-3] % key.shape[-3]:
            raise ValueError(f"enable_gqa: query's {query.shape[-3]} heads are not a multiple of key's "
                             f"{key.shape[-3]}")
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    _check_qkv(query, key, value, attn_mask, bias)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    own = dropout_p > 0.0 or return_probs or softcap is not None  # else SDPA's kernels, which have no cap
    if bias is not None and not own:  # SDPA takes one mask: the sum, in that order
        attn_mask = bias if attn_mask is None else _additive(attn_mask, query) + _additive(bias, query)
        bias = None
    if not own:
        if attn_mask is not None and attn_mask.is_floating_point() and attn_mask.dtype != query.dtype:
            # as autocast casts it for SDPA: torch < 2.9 (and some GPU kernels) refuse a float mask of another dtype
            attn_mask = attn_mask.to(query.dtype)
        query, key, value = _fused_kernel_layout(query, key, value)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale)
    batch = _broadcast(query.shape[:-2], key.shape[:-2])
    if dropout_p > 0.0 and math.prod(batch) * query.shape[-2] * key.shape[-2] > rng.MAX_NUMEL:
        raise ValueError("the attention matrix has more than 2**32 elements; split the batch")
    out = AttentionDropoutFunction.apply(query, key, value, attn_mask, scale, float(dropout_p), seed, offset,
                                         return_probs, fp32_softmax, bias, softcap)
    out, probs = out if return_probs else (out, None)
    out = out.view(*_broadcast(query.shape[:-2], key.shape[:-2], value.shape[:-2]), *out.shape[1:])
    return out if probs is None else (out, probs.view(*batch, *probs.shape[1:]))


class FusedAttention(CounterRNG, nn.Module):
    """``forward(q, k, v, mask=None, bias=None)``: ``dropout(softmax(q @ k^T * scale + mask + bias)) @ v``.

    q: (..., Tq, d), k: (..., Tk, d), v: (..., Tk, dv) of one float dtype; ``mask`` broadcastable to
    (..., Tq, Tk): float (added to the scores, e.g. 0 / finfo.min padding) or bool (True = attend), as in
    ``F.scaled_dot_product_attention``; ``bias`` a second such term added after it (T5's position bias and its
    mask: each saved as it is, each given its gradient). ``scale`` defaults to ``1 / sqrt(d)``. Dropout on the
    probabilities uses the counter-based RNG (``rng_seed``, ``rng_step``, ``set_rng``; see
    ``opsnn_lab.ops.dropout``); see this module's docstring for which path runs when. ``return_probs=True``:
    ``forward`` returns ``(out, probs)``, the probabilities after dropout as eager attention code returns them
    (always the explicit path then; the probabilities are for reading, a gradient reaching them raises).
    ``is_causal`` and ``enable_gqa`` are ``F.scaled_dot_product_attention``'s (the op then stands for an SDPA call
    with dropout, whose CPU math path saves the T x T probabilities: ``ol.fusion``'s ``attention`` pattern).
    ``fp32_softmax=True``: half-precision scores give fp32 probabilities, cast to v's dtype for ``@ v``, and the
    backward takes the softmax's gradient in fp32, as for Llama-style ``softmax(..., dtype=torch.float32)
    .to(q.dtype)`` code under autograd. ``mask_added=True``: the op stands for eager code computing ``scores + mask``,
    where a bool mask is a number (True adds 1, False 0; a BERT given a 4-d bool mask), not SDPA's keep / discard.
    ``softcap=c``: the scaled scores are capped to ``c * tanh(s / c)`` before the mask and bias are added (Gemma 2's
    ``attn_logit_softcapping``); always the explicit path (SDPA has no cap), which recomputes the ``tanh`` in
    backward and so keeps nothing T x T for it.
    """

    def __init__(self, scale: float | None = None, dropout_p: float = 0.0, *, seed: int | None = None,
                 return_probs: bool = False, is_causal: bool = False, enable_gqa: bool = False,
                 fp32_softmax: bool = False, mask_added: bool = False, softcap: float | None = None):
        super().__init__()
        self.scale = None if scale is None else float(check_positive("scale", scale))
        self.dropout_p = float(check_range("dropout_p", dropout_p, 0.0, 1.0))
        self.return_probs = check_type("return_probs", return_probs, bool)
        self.is_causal = check_type("is_causal", is_causal, bool)  # as SDPA's: a top-left lower triangle
        self.enable_gqa = check_type("enable_gqa", enable_gqa, bool)  # as SDPA's: k/v heads repeated per group
        self.fp32_softmax = check_type("fp32_softmax", fp32_softmax, bool)
        self.mask_added = check_type("mask_added", mask_added, bool)
        self.softcap = None if softcap is None else float(check_positive("softcap", softcap))
        self._init_rng(seed)

    @classmethod
    def from_modules(cls, dropout: nn.Module | None = None, *, scale: float | None = None,
                     seed: int | None = None, return_probs: bool = False,
                     softcap: float | None = None) -> FusedAttention:
        """The core of a hand-written attention whose probabilities go through ``dropout`` (or none)."""
        from opsnn_lab.ops.dropout import Dropout

        if dropout is not None and not isinstance(dropout, (nn.Dropout, Dropout)):
            raise TypeError(f"dropout must be nn.Dropout, opsnn_lab.ops.Dropout or None, got {type(dropout).__name__}")
        p = 0.0 if dropout is None else float(dropout.p)
        if seed is None and isinstance(dropout, Dropout):
            seed = dropout.rng_seed
        module = cls(scale, p, seed=seed, return_probs=return_probs, softcap=softcap)
        return module.train(True if dropout is None else dropout.training)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        with _amp.region(q) as cast:
            q, k, v, mask = _cast_operands(cast, q, k, v, mask)
            added = self.__dict__.get("mask_added", False)
            mask, bias = (t.to(q.dtype) if t is not None and t.dtype == torch.bool and added else t
                          for t in (mask, bias))  # scores + mask, as the eager code adds it (in the scores' dtype)
            if not self.enable_gqa:  # before the draw: a refused call does not advance the stream (GQA's heads
                _check_qkv(q, k, v, mask, bias)  # are checked once repeated)
            p, seed, offset = 0.0, 0, 0
            if self.training:
                seed, offset = self.next_draw(q if self.dropout_p > 0 else None)  # p = 0: nothing to replay
                p = self.dropout_p
            return _counter_sdpa(q, k, v, mask, p, self.is_causal, self.scale, self.enable_gqa, seed, offset,
                                 return_probs=self.return_probs, fp32_softmax=self.__dict__.get("fp32_softmax", False),
                                 bias=bias, softcap=self.__dict__.get("softcap"))

    def as_sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        """An ``F.scaled_dot_product_attention`` call (its arguments) whose dropout, in training, draws from this
        op's stream and saves nothing T x T; without dropout, the call itself (its kernels save no T x T tensor
        either). What ``ol.fusion``'s ``module:sdpa`` route runs in place of such a call."""
        if not self.training or not dropout_p:
            flags = {"enable_gqa": True} if enable_gqa else {}  # torch < 2.5 has no enable_gqa
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale, **flags)
        seed, offset = self.next_draw(query)
        return counter_sdpa(query, key, value, attn_mask, float(dropout_p), is_causal, scale, enable_gqa, seed=seed,
                            offset=offset)

    def extra_repr(self) -> str:
        flags = "".join(f", {k}=True" for k in ("return_probs", "is_causal", "enable_gqa", "fp32_softmax", "mask_added")
                        if getattr(self, k, False))
        cap = f", softcap={self.softcap}" if getattr(self, "softcap", None) is not None else ""
        return f"scale={self.scale}, dropout_p={self.dropout_p}, seed={self.rng_seed}{flags}{cap}"
