"""BatchNorm modules that apply their own activation, as timm's ``BatchNormAct2d`` does: a ``BatchNorm2d``
subclass whose forward is ``act(drop(batch_norm(x)))`` with ``drop`` an ``nn.Identity``.

``FusedConvBNAct`` reads only a BatchNorm's tensors and settings (weight, bias, running statistics,
``num_batches_tracked``, eps, momentum), so such a module fuses when its forward is known to compute exactly
``act(BatchNorm2d(x))``. That is checked on a probe, in train and in eval mode, against a plain
``nn.BatchNorm2d`` with the same state: the output and every updated buffer must match. The module's
buffers and mode flags are restored afterwards; the probe calls ``forward`` (no hooks fire) under
``no_grad`` and ``fork_rng``. The verdict is kept per module (its forward does not change while it lives).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

__all__ = ["inner_activation", "computes_batch_norm", "probe_matches", "PROBE_RTOL"]

PROBE_RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # bn -> (act or None, bool)


def inner_activation(bn: nn.Module) -> tuple[bool, nn.Module | None]:
    """``(True, act)`` when ``bn``'s children are at most one module besides ``nn.Identity`` ones (``act``, or
    None when there is none), else ``(False, None)``."""
    others = [c for c in bn.children() if not isinstance(c, nn.Identity)]
    return (len(others) <= 1, others[0] if len(others) == 1 else None)


def probe_matches(y, ref) -> bool:
    """``y`` is a tensor like ``ref`` and equal to it to ``ref``'s dtype rounding (relative to its largest value)."""
    if not isinstance(y, torch.Tensor) or y.shape != ref.shape or y.dtype != ref.dtype:
        return False
    tol = PROBE_RTOL[ref.dtype]
    return bool(torch.allclose(y, ref, rtol=tol, atol=tol * max(ref.abs().max().item() if ref.numel() else 0.0, 1.0)))


def _probe(bn: nn.BatchNorm2d, act: nn.Module | None) -> bool:
    like = bn.running_mean if bn.running_mean is not None else bn.weight
    if like is None or like.dtype not in PROBE_RTOL or like.device.type == "meta":
        return False
    ref = nn.BatchNorm2d(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                         device=like.device, dtype=like.dtype)
    buffers = dict(bn.named_buffers(recurse=False))
    saved = {k: b.detach().clone() for k, b in buffers.items()}
    modes = {m: m.training for m in bn.modules()}
    x = torch.randn(2, bn.num_features, 3, 3, generator=torch.Generator().manual_seed(0)).to(like.device, like.dtype)
    devices = [like.device] if like.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            if bn.affine:
                ref.weight.copy_(bn.weight)
                ref.bias.copy_(bn.bias)
            for training in (True, False):
                for k, b in buffers.items():  # both start from the module's statistics
                    b.copy_(saved[k])
                    if k in ref._buffers and ref._buffers[k] is not None:
                        ref._buffers[k].copy_(saved[k])
                bn.train(training)
                ref.train(training)
                want = ref(x) if act is None else act.forward(ref(x))
                if not probe_matches(bn.forward(x), want):
                    return False
                for k, v in ref.named_buffers():  # the statistics moved as BatchNorm2d moves them
                    if k not in buffers or not _same_buffer(buffers[k], v):
                        return False
        return True
    except Exception:  # noqa: BLE001 - a forward that cannot take a plain NCHW tensor is not this op
        return False
    finally:
        with torch.no_grad():
            for k, b in buffers.items():
                b.copy_(saved[k])
        for m, flag in modes.items():
            m.training = flag


def _same_buffer(got: torch.Tensor, want: torch.Tensor) -> bool:
    if want.dtype in PROBE_RTOL:
        return probe_matches(got, want)
    return got.dtype == want.dtype and torch.equal(got, want)  # num_batches_tracked


def computes_batch_norm(bn: nn.Module, act: nn.Module | None = None) -> bool:
    """Whether ``bn`` (a BatchNorm2d, any forward) computes ``act(BatchNorm2d(x))``, or BatchNorm2d alone
    with ``act=None``; ``act`` must then be ``bn``'s one child besides ``nn.Identity`` ones (or it has none)."""
    if not isinstance(bn, nn.BatchNorm2d):
        return False
    ok, inner = inner_activation(bn)
    if not ok or inner is not act:
        return False
    cached = _VERDICTS.get(bn)
    if cached is None or cached[0] is not act:
        cached = (act, _probe(bn, act))
        _VERDICTS[bn] = cached
    return cached[1]
