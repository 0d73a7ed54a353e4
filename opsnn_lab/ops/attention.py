"""Attention core ``softmax(q @ k^T * scale + mask) -> dropout -> @ v`` without saving a T x T tensor.

Two paths, one semantics (the hand-written core in ``opsnn_lab.models.SelfAttention``):

* eval mode or ``dropout_p == 0``: ``F.scaled_dot_product_attention`` (its fused kernels save q, k, v,
  the output and the row log-sum-exp; no T x T tensor).
* training with ``dropout_p > 0``: SDPA's dropout draws from torch's own generator and cannot take our
  counter-based mask, and on CPU it falls back to the math path that saves the T x T probabilities.
  So this path is an explicit autograd Function that computes the scores in full but SAVES only q, k, v,
  the output and the log-sum-exp (like flash attention), regenerating the scores, the probabilities and
  the dropout mask (``opsnn_lab.kernels.rng``, seed/step contract of ``opsnn_lab.ops.dropout``) in
  backward. It is exact, reproducible from (seed, step) and lean in saved memory; its forward and
  backward do materialize T x T temporaries (freed at once), so peak memory is not flash-attention's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab._checks import check_positive, check_range, check_tensor, same_device
from opsnn_lab.kernels import rng
from opsnn_lab.ops.dropout import CounterRNG

__all__ = ["FusedAttention", "AttentionDropoutFunction"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _scores(q, k, scale, mask):
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is None:
        return s
    if mask.dtype == torch.bool:
        return s.masked_fill_(~mask, float("-inf")) if mask.shape == s.shape else s.masked_fill(~mask, float("-inf"))
    return s.add_(mask) if torch.broadcast_shapes(mask.shape, s.shape) == s.shape else s + mask


def _dropout_(probs, p, seed, offset):
    """In place: zero the dropped probabilities and rescale the kept ones (nothing to do for p = 0)."""
    if p == 0:
        return probs, None
    keep = rng.dropout_mask(seed, offset, probs.shape, p, probs.device)
    return probs.mul_(keep).mul_(0.0 if p >= 1 else 1.0 / (1.0 - p)), keep


class AttentionDropoutFunction(torch.autograd.Function):
    """``dropout(softmax(q k^T * scale + mask)) @ v`` saving q, k, v, out, logsumexp (no T x T tensor)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, p, seed, offset):
        s = _scores(q, k, scale, mask)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        out = torch.matmul(_dropout_(s.sub_(lse).exp_(), p, seed, offset)[0], v)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.cfg = (scale, p, seed, offset)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask, out, lse = ctx.saved_tensors
        scale, p, seed, offset = ctx.cfg
        probs = _scores(q, k, scale, mask).sub_(lse).exp_()
        dropped, keep = _dropout_(probs.clone(), p, seed, offset)
        grad_v = torch.matmul(dropped.transpose(-1, -2), grad)
        del dropped
        # dS = P * (dP - D), dP = dropout(dO v^T), D = rowsum(dO * O)  (flash-attention's backward with dropout)
        dp = torch.matmul(grad, v.transpose(-1, -2))
        if keep is not None:
            dp.mul_(keep).mul_(0.0 if p >= 1 else 1.0 / (1.0 - p))
        ds = dp.sub_((grad * out).sum(-1, keepdim=True)).mul_(probs)
        grad_q = torch.matmul(ds, k).mul_(scale) if ctx.needs_input_grad[0] else None
        grad_k = torch.matmul(ds.transpose(-1, -2), q).mul_(scale) if ctx.needs_input_grad[1] else None
        grad_mask = None
        if ctx.needs_input_grad[3] and mask is not None and mask.dtype != torch.bool:
            grad_mask = ds.sum_to_size(mask.shape)
        return _unbroadcast(grad_q, q), _unbroadcast(grad_k, k), _unbroadcast(grad_v, v), grad_mask, \
            None, None, None, None


def _unbroadcast(grad, like):
    return grad if grad is None or grad.shape == like.shape else grad.sum_to_size(like.shape)


def _check_qkv(q, k, v, mask):
    check_tensor("q", q, dtypes=_FLOATS, min_dim=2)
    check_tensor("k", k, dtypes=(q.dtype,), min_dim=2)
    check_tensor("v", v, dtypes=(q.dtype,), min_dim=2)
    same_device(q=q, k=k, v=v, mask=mask)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have q's head dim {q.shape[-1]}, got shape {tuple(k.shape)}")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v must have k's sequence length {k.shape[-2]}, got shape {tuple(v.shape)}")
    try:
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(f"q, k, v batch dims do not broadcast: {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}") from None
    if mask is not None:
        check_tensor("mask", mask, dtypes=(q.dtype, torch.bool))
        target = (*batch, q.shape[-2], k.shape[-2])
        try:
            ok = torch.broadcast_shapes(mask.shape, target) == torch.Size(target)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"mask must broadcast to {target}, got shape {tuple(mask.shape)}")


class FusedAttention(CounterRNG, nn.Module):
    """``forward(q, k, v, mask=None)``: ``dropout(softmax(q @ k^T * scale + mask)) @ v``.

    q: (..., Tq, d), k: (..., Tk, d), v: (..., Tk, dv) of one float dtype; ``mask`` broadcastable to
    (..., Tq, Tk): float (added to the scores, e.g. 0 / finfo.min padding) or bool (True = attend), as in
    ``F.scaled_dot_product_attention``. ``scale`` defaults to ``1 / sqrt(d)``. Dropout on the
    probabilities uses the counter-based RNG (``rng_seed``, ``rng_step``, ``set_rng``; see
    ``opsnn_lab.ops.dropout``); see this module's docstring for which path runs when.
    """

    def __init__(self, scale: float | None = None, dropout_p: float = 0.0, *, seed: int | None = None):
        super().__init__()
        self.scale = None if scale is None else float(check_positive("scale", scale))
        self.dropout_p = float(check_range("dropout_p", dropout_p, 0.0, 1.0))
        self._init_rng(seed)

    @classmethod
    def from_modules(cls, dropout: nn.Module | None = None, *, scale: float | None = None,
                     seed: int | None = None) -> FusedAttention:
        """The core of a hand-written attention whose probabilities go through ``dropout`` (or none)."""
        from opsnn_lab.ops.dropout import Dropout

        if dropout is not None and not isinstance(dropout, (nn.Dropout, Dropout)):
            raise TypeError(f"dropout must be nn.Dropout, opsnn_lab.ops.Dropout or None, got {type(dropout).__name__}")
        p = 0.0 if dropout is None else float(dropout.p)
        if seed is None and isinstance(dropout, Dropout):
            seed = dropout.rng_seed
        module = cls(scale, p, seed=seed)
        return module.train(True if dropout is None else dropout.training)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        _check_qkv(q, k, v, mask)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        p, seed, offset = 0.0, 0, 0
        if self.training:
            seed, offset = self.next_draw()
            p = self.dropout_p
        if p == 0.0:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        if math.prod(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])) * q.shape[-2] * k.shape[-2] > rng.MAX_NUMEL:
            raise ValueError("the attention matrix has more than 2**32 elements; split the batch")
        return AttentionDropoutFunction.apply(q, k, v, mask, scale, p, seed, offset)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, dropout_p={self.dropout_p}, seed={self.rng_seed}"
