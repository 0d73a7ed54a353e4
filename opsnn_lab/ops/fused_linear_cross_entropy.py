"""The vocabulary head and its cross-entropy as one op that never holds the logits.

``loss = F.cross_entropy(hidden @ W.T + b, target, ignore_index, reduction, label_smoothing)`` computed in
chunks of rows. For ``reduction="mean"|"sum"`` each chunk's logits become ``d loss / d logits`` in place and
are consumed at once: the gradients w.r.t. ``hidden``, ``W`` and ``b`` are accumulated IN THE FORWARD and
backward only scales them by the incoming gradient (a no-op for ``loss.backward()``), so the logits are never
recomputed. ``reduction="none"`` cannot pre-scale the weight gradient (each row has its own upstream
gradient), so it saves ``hidden`` and recomputes the logits chunk by chunk in backward (one more GEMM); so does
``recompute=True``, and the default when there are fewer rows than hidden features (then ``grad_W``, V x H,
would be larger than the logits eager saves).

Saved for backward (N tokens, hidden H, vocabulary V): eager saves ``hidden`` and the fp32 log-softmax
``N x V``; the fused op saves ``grad_hidden`` (N x H) and ``grad_W`` (V x H, in W's dtype; fp32 for fp16
weights, whose unscaled gradients would underflow before the loss scale arrives) and ``grad_b``.
Ratio ``(N H + V H) / (N H + N V)``: 0.26 at N=2048, H=512, V=32000 in fp32, 0.13 with bf16 weights.

Logit maps (keyword arguments): ``logit_scale`` multiplies the logits (Cohere's ``logit_scale``, Granite's ``1 /
logits_scaling``), ``softcap`` caps them as ``softcap * tanh(logits / softcap)`` after the scale (Gemma 2's
``final_logit_softcapping``); both are applied to each fp32 (float64) chunk, and the gradients go through them.

Numerics: logits are computed in the input dtype (as ``F.linear``) and upcast to fp32, as Hugging Face's loss
does; softmax, loss and gradients are fp32; the weight gradient is accumulated in fp32 across chunks and
rounded once. The loss is fp32. Float64 inputs stay float64 throughout, the loss too (before 2026-12-07 they
raised a dtype error). An all-ignored batch gives what ``F.cross_entropy`` gives: ``mean`` -> NaN with zero
gradients, ``sum`` -> 0.

Hugging Face recipe (see ``opsnn_lab.ops.lm_head_loss``, which does exactly this)::

    hidden = model.model(input_ids, attention_mask=mask).last_hidden_state      # causal LM: shift by one
    loss = linear_cross_entropy(hidden[:, :-1], model.lm_head.weight, labels[:, 1:])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab._checks import (
    check_choice,
    check_positive,
    check_range,
    check_tensor,
    check_type,
    first_derivative_only,
    same_device,
)
from opsnn_lab.kernels.fused_linear_cross_entropy import cross_entropy_chunk
from opsnn_lab.ops import _amp

__all__ = ["LinearCrossEntropyFunction", "FusedLinearCrossEntropy", "linear_cross_entropy"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_REDUCTIONS = ("mean", "sum", "none")


# Fewest rows per chunk. Each chunk reads W twice and reads and writes the fp32 grad_W (V x H) once: that traffic
# is paid per chunk, the GEMM work per row, so thin chunks lose time where memory bandwidth is short. Measured
# fused/eager step time on a 2-vCPU AVX-512 CPU, 2 threads, at (N, H, V) = (2048, 512, 32000), (4096, 768, 50257),
# (1024, 512, 128256), (8192, 256, 32000): 256 rows 1.11, 1.07, 1.11, 1.12; 512 rows 1.06, 1.02, 1.03, 1.06;
# 1024 rows 1.01, 1.01, 0.99, 1.03 (one thread: 1.04, 1.02, 1.01 at 256 rows). The H200 gave 1.06 at 256 rows.
_MIN_ROWS = {"cpu": 512}
_MIN_ROWS_DEFAULT = 256


def _chunk_rows(n: int, v: int, h: int, chunk_size: int | None, device: torch.device | None = None) -> int:
    if chunk_size:
        return chunk_size
    # Liger-Kernel's rule: a chunk's logits are about as large as the hidden states (N / ceil(V / H) rows).
    rows = math.ceil(max(n, 1) / math.ceil(v / h))
    floor = _MIN_ROWS.get(getattr(device, "type", None), _MIN_ROWS_DEFAULT)
    return max(floor, 1 << (rows - 1).bit_length())


def _wide(dtype):
    """The dtype of the logits chunk, the loss and the sums over chunks: fp32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _logits(hc, weight, bias):
    z = torch.addmm(bias, hc, weight.t()) if bias is not None else hc @ weight.t()
    return z.to(_wide(z.dtype))


def _chunks(n, rows):
    return ((a, min(a + rows, n)) for a in range(0, n, rows))


def _saved_dtype(dtype):
    # fp16 gradients are kept in fp32 until backward: they are unscaled here (the loss scale arrives with
    # grad_loss), and unscaled ~1/N values would underflow fp16. bf16 has fp32's range: kept in bf16.
    return torch.float32 if dtype == torch.float16 else dtype


def _grad_pass(h2, weight, bias, target, row_scale, cfg, need):
    """Loss rows and, per chunk, ``grad_h``, ``grad_w`` (fp32 accumulation), ``grad_b`` from the scaled logits grad."""
    ignore_index, smoothing, rows, scale, softcap = cfg
    need_h, need_w, need_b = need
    n, want, acc, wide = h2.shape[0], any(need), _saved_dtype(h2.dtype), _wide(h2.dtype)
    loss = torch.empty(n, dtype=wide, device=h2.device)
    # strict() (deterministic algorithms on) swaps aten's mm for a fixed-order one, not addmm_: plain mm there
    in_place = not torch.are_deterministic_algorithms_enabled()
    grad_h = torch.empty(h2.shape, dtype=acc, device=h2.device) if need_h else None
    w_acc = weight.to(acc) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=wide, device=h2.device) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=wide, device=h2.device) if need_b else None
    for a, b in _chunks(n, rows):
        hc = h2[a:b]
        z = _logits(hc, weight, bias)
        # the loss-only pass (recompute's forward) reads the chunk no more: its softmax may take the chunk's place
        loss[a:b] = cross_entropy_chunk(z, target[a:b], ignore_index, smoothing, row_scale[a:b] if want else None,
                                        scratch=not want, scale=scale, softcap=softcap)[0]
        if not want:
            del z
            continue
        # Plain mm for the logits and grad_h (no out=): strict() swaps aten's mm/addmm for fixed-order ones.
        zc = z.to(acc) if need_h or acc == torch.bfloat16 else z  # one cast, shared by both GEMMs
        if need_b:
            grad_b += z.sum(0)
        z = zc  # a bf16 copy frees the fp32 chunk before the GEMMs' outputs exist (bench row peak 0.253 -> 0.211)
        if need_h:
            grad_h[a:b] = z @ w_acc
        if need_w:  # fp32 sum over chunks; bf16 chunk GEMMs (fp32 inside) run ~7x faster than fp32 ones on CPU
            if acc == torch.bfloat16:
                grad_w += z.t() @ hc  # the bf16 product is widened inside the add: no fp32 copy of it
            elif in_place:  # no V x H temporary and no separate add pass (a fifth of the step at V = 32k)
                grad_w.addmm_(z.t(), hc.to(z.dtype))
            else:
                grad_w += z.t() @ hc.to(z.dtype)
        del z, zc  # before the next chunk's logits: one chunk alive at a time, not two
    grad_w = None if grad_w is None else grad_w.to(acc)
    grad_b = None if grad_b is None else grad_b.to(acc)
    return loss, grad_h, grad_w, grad_b


def _scale(grad, go, dtype):
    if grad is None:
        return None
    if go is not None:
        grad = grad * go.to(grad.dtype)
    return grad.to(dtype)


def _row_scale(t, ignore_index, reduction, n_valid, dtype):
    valid = (t != ignore_index).to(_wide(dtype))
    return valid / n_valid.clamp(min=1) if reduction == "mean" else valid


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Chunked ``cross_entropy(h @ W.T + b, t)``; saves the gradients, or ``h`` to recompute; never the logits."""

    @staticmethod
    @_amp.no_autocast
    def forward(ctx, hidden, weight, bias, target, ignore_index, reduction, smoothing, chunk_size, recompute,
                logit_scale=1.0, softcap=None):
        h2 = hidden.reshape(-1, hidden.shape[-1])
        t = target.reshape(-1)
        n_valid = (t != ignore_index).sum()
        rows = _chunk_rows(h2.shape[0], weight.shape[0], h2.shape[1], chunk_size, h2.device)
        cfg = (ignore_index, smoothing, rows, logit_scale, softcap)
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        if recompute is None:  # the saved weight gradient (V x H) would outweigh the logits (N x V) when N < H
            recompute = h2.shape[0] < h2.shape[1]
        ctx.recompute = recompute = recompute or reduction == "none" or not any(need)
        ctx.shape, ctx.reduction, ctx.cfg, ctx.dtype, ctx.need = hidden.shape, reduction, cfg, hidden.dtype, need
        if recompute:
            loss, *_ = _grad_pass(h2, weight, bias, t, None, cfg, (False, False, False))
            ctx.save_for_backward(h2, weight, bias, t, n_valid)
        else:
            row_scale = _row_scale(t, ignore_index, reduction, n_valid, h2.dtype)
            loss, grad_h, grad_w, grad_b = _grad_pass(h2, weight, bias, t, row_scale, cfg, need)
            ctx.save_for_backward(grad_h, grad_w, grad_b)
        if reduction == "none":
            return loss  # (N,): viewed as target outside the Function, so it may be modified in place
        total = loss.sum()
        return total / n_valid if reduction == "mean" else total  # 0 / 0 = NaN when all ignored, as torch

    @staticmethod
    @_amp.no_autocast
    def backward(ctx, grad_loss):
        first_derivative_only("FusedLinearCrossEntropy")
        go = grad_loss
        if ctx.recompute:
            h2, weight, bias, t, n_valid = ctx.saved_tensors
            row_scale = _row_scale(t, ctx.cfg[0], ctx.reduction, n_valid, ctx.dtype)
            row_scale = row_scale * grad_loss.reshape(-1).to(row_scale.dtype)
            _, grad_h, grad_w, grad_b = _grad_pass(h2, weight, bias, t, row_scale, ctx.cfg, ctx.need)
            go = None
        else:
            grad_h, grad_w, grad_b = ctx.saved_tensors
            # the usual grad_loss is 1 (loss.backward()): one host read of it for the three gradients, which
            # then skip a pass over each (grad_w is vocabulary x hidden)
            go = None if bool((grad_loss == 1).all()) else grad_loss
        grad_h, grad_w, grad_b = (_scale(g, go, ctx.dtype) for g in (grad_h, grad_w, grad_b))
        grad_h = None if grad_h is None else grad_h.view(ctx.shape)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None


def _check_map(logit_scale, softcap):
    check_range("logit_scale", logit_scale, 0.0, math.inf, low_inclusive=False, high_inclusive=False)
    if softcap is not None:
        check_range("softcap", softcap, 0.0, math.inf, low_inclusive=False, high_inclusive=False)


def _check_args(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, chunk_size, recompute):
    check_type("recompute", recompute, bool, allow_none=True)
    check_tensor("hidden", hidden, dtypes=_FLOATS, min_dim=1)
    check_tensor("weight", weight, dtypes=(hidden.dtype,), dim=2)
    check_tensor("target", target, dtypes=(torch.int64, torch.int32))
    check_type("ignore_index", ignore_index, int)
    check_choice("reduction", reduction, _REDUCTIONS)
    check_range("label_smoothing", label_smoothing, 0.0, 1.0)
    if chunk_size is not None:
        check_positive("chunk_size", chunk_size, integer=True)
    same_device(hidden=hidden, weight=weight, target=target, bias=bias)
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden must have weight's {weight.shape[1]} features in its last dim, "
                         f"got shape {tuple(hidden.shape)}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target must have shape {tuple(hidden.shape[:-1])} (hidden without its last dim), "
                         f"got {tuple(target.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(hidden.dtype,), dim=1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have {weight.shape[0]} elements (weight's rows), got {bias.shape[0]}")
    bad = (target != ignore_index) & ((target < 0) | (target >= weight.shape[0]))
    if bool(bad.any()):
        raise ValueError(f"target has values outside [0, {weight.shape[0]}) that are not ignore_index={ignore_index}")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, chunk_size: int | None = None,
                         recompute: bool | None = None, *, logit_scale: float = 1.0,
                         softcap: float | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), target, ...)`` without the logits.

    hidden: (..., H) float; weight: (V, H) and bias: (V,) in hidden's dtype; target: hidden.shape[:-1] ints in
    [0, V) or ``ignore_index``. Returns the fp32 loss (float64 for float64 inputs): a scalar, or target-shaped for
    ``reduction="none"``.
    ``chunk_size``: rows per chunk (default: the chunk's logits are about the size of ``hidden``, but at least 512
    rows on CPU and 256 elsewhere, where thinner chunks lose time; a smaller one lowers the peak).
    ``recompute``: False computes the gradients in the forward (saves ``grad_hidden`` and ``grad_W``); True saves
    ``hidden`` and recomputes the logits chunk by chunk in backward (one more GEMM, the fewest bytes); None
    (default) recomputes only when there are fewer rows than hidden features, where ``grad_W`` (V x H) would
    outweigh the logits (N x V) eager saves (BERT's masked rows, short sequences). ``reduction="none"`` always
    recomputes. ``logit_scale`` (> 0) and ``softcap`` (None or > 0): the loss is of ``softcap * tanh(logit_scale *
    logits / softcap)`` (without a cap, of ``logit_scale * logits``), computed in fp32.
    """
    check_tensor("hidden", hidden, dtypes=_FLOATS, min_dim=1)
    _check_map(logit_scale, softcap)
    with _amp.region(hidden) as cast:  # under autocast: the head's operands cast, the loss in fp32 (as eager's)
        hidden, weight, bias = cast(hidden, weight, bias)
        _check_args(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, chunk_size, recompute)
        loss = LinearCrossEntropyFunction.apply(hidden, weight, bias, target.long(), ignore_index, reduction,
                                                float(label_smoothing), chunk_size, recompute, float(logit_scale),
                                                None if softcap is None else float(softcap))
    return loss.view(target.shape) if reduction == "none" else loss


class FusedLinearCrossEntropy(nn.Module):
    """``CrossEntropyLoss(head(hidden), target)`` in one op; ``forward(hidden, target) -> loss``.

    Registers the head's own ``weight``/``bias`` Parameter objects (shared, tied weights stay tied). Contract:
    ``supports(head, loss=None)`` is ``(True, why)`` for an ``nn.Linear`` head and an optional
    ``nn.CrossEntropyLoss`` without class weights; ``from_modules`` raises ``ValueError`` with the reason otherwise.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, chunk_size: int | None = None,
                 recompute: bool | None = None, *, logit_scale: float = 1.0, softcap: float | None = None):
        super().__init__()
        check_type("weight", weight, nn.Parameter)
        check_type("bias", bias, nn.Parameter, allow_none=True)
        self.weight = weight
        self.register_parameter("bias", bias)
        self.ignore_index = check_type("ignore_index", ignore_index, int)
        self.reduction = check_choice("reduction", reduction, _REDUCTIONS)
        self.label_smoothing = float(check_range("label_smoothing", label_smoothing, 0.0, 1.0))
        if chunk_size is not None:
            check_positive("chunk_size", chunk_size, integer=True)
        self.chunk_size = chunk_size
        self.recompute = check_type("recompute", recompute, bool, allow_none=True)
        _check_map(logit_scale, softcap)
        self.logit_scale, self.softcap = float(logit_scale), None if softcap is None else float(softcap)

    @classmethod
    def supports(cls, head: nn.Module, loss: nn.Module | None = None) -> tuple[bool, str]:
        if not isinstance(head, nn.Linear):
            return False, f"head must be nn.Linear, got {type(head).__name__}"
        if loss is None:
            return True, "nn.Linear head"
        if not isinstance(loss, nn.CrossEntropyLoss):
            return False, f"loss must be nn.CrossEntropyLoss, got {type(loss).__name__}"
        if loss.weight is not None:
            return False, "CrossEntropyLoss has class weights; not supported"
        return True, "nn.Linear head + nn.CrossEntropyLoss"

    @classmethod
    def from_modules(cls, head: nn.Linear, loss: nn.CrossEntropyLoss | None = None, *, ignore_index: int = -100,
                     reduction: str = "mean", label_smoothing: float = 0.0,
                     chunk_size: int | None = None, recompute: bool | None = None, logit_scale: float = 1.0,
                     softcap: float | None = None) -> FusedLinearCrossEntropy:
        ok, reason = cls.supports(head, loss)
        if not ok:
            raise ValueError(f"head/loss: {reason}")
        if loss is not None:
            ignore_index, reduction, label_smoothing = loss.ignore_index, loss.reduction, loss.label_smoothing
        return cls(head.weight, head.bias, ignore_index, reduction, label_smoothing, chunk_size, recompute,
                   logit_scale=logit_scale, softcap=softcap)

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(hidden, self.weight, target, self.bias, self.ignore_index, self.reduction,
                                    self.label_smoothing, self.chunk_size, self.recompute,
                                    logit_scale=self.logit_scale, softcap=self.softcap)

    def extra_repr(self) -> str:
        return (f"in_features={self.weight.shape[1]}, vocab={self.weight.shape[0]}, bias={self.bias is not None}, "
                f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}"
                + (f", logit_scale={self.logit_scale}" if self.logit_scale != 1.0 else "")
                + (f", softcap={self.softcap}" if self.softcap is not None else ""))


def eager_linear_cross_entropy(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean",
                               label_smoothing=0.0, *, logit_scale=1.0, softcap=None):
    """The unfused oracle: ``F.cross_entropy(F.linear(hidden, weight, bias).float(), target, ...)``, the logit map
    applied in the head's dtype before the upcast, as Hugging Face's models do; float64 stays float64."""
    logits = F.linear(hidden, weight, bias)
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.to(_wide(logits.dtype))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing).view(
        target.shape if reduction == "none" else ())
