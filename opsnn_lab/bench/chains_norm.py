"""Normalisation and vocabulary-head rows of ``python -m opsnn_lab.bench ops``.

Rows (names follow the fusion pattern names; ``+linear`` rows measure the norm with the Linear it feeds):

* ``layer_norm+linear`` / ``add_layer_norm+linear``: ``nn.LayerNorm`` (after ``x + residual``) feeding an
  ``nn.Linear(768, 768)`` (BERT's query projection), BERT-base width, for eager and fused alike. This is
  where the fused norm's memory goes: it saves its output ``y`` and the row ``rstd`` and recovers ``xhat`` from
  ``y`` in backward, and ``y`` is what the Linear saves anyway, so it is stored once; eager stores the norm's
  input (or the sum), mean and rstd, and the Linear's copy of ``y``: ``(H + 1) / (2 H + 2)`` = 0.5 in fp32.
* ``rms_norm+linear`` / ``add_rms_norm+linear`` / ``add_rms_norm+linear[bf16]``: Hugging Face's
  ``LlamaRMSNorm`` as it is written (pow / mean / rsqrt / mul, fp32 upcast, copied here so the benchmark does
  not import transformers) feeding ``nn.Linear(1024, 1024)`` (q_proj), Llama-7B width scaled to 1024; bf16 as
  Llama trains. Eager saves ``x`` (an fp32 copy in bf16), ``x * rstd``, ``rstd`` and the Linear's input.
* ``layer_norm`` / ``add_layer_norm`` / ``rms_norm`` / ``add_rms_norm`` / ``add_rms_norm[bf16]`` /
  ``rms_norm[nn.RMSNorm]``: the norm alone, for the time and for the record: with no consumer there is
  nothing to share, and ``y`` is as large as ``x``. The LayerNorm rows build the op as a norm whose output
  nothing keeps should be built, ``save_output=False``: it saves what ``nn.LayerNorm`` saves (ratio 1.0)
  and runs aten's kernels; RMSNorm ``(H + 1) / (2 H + 1)``, 0.5002, against HF's, which keeps ``x * rstd``
  as well (``nn.RMSNorm`` on CPU saves the input and its normalised copy).
* ``layer_norm[save_output]``: the LayerNorm alone saving its output anyway (the default, right before a
  Linear): bytes ``(H + 1) / (H + 2)``, and the time recovering ``xhat`` from ``y`` costs where nothing pays
  for it.
* ``linear_cross_entropy`` / ``linear_cross_entropy[bf16]``: the vocabulary head + ``F.cross_entropy`` at
  vocabulary 32000, 2048 tokens, hidden 512 (``QUICK``: 64 tokens, vocabulary 1000, hidden 32). Eager upcasts the
  logits to fp32 before the loss, as Hugging Face's loss does. Two memory figures, because the fused op computes
  the gradients in the forward: ``bytes`` (saved for backward, the headline measure elsewhere) counts its
  ``grad_W`` (V x H), which is not an activation: backward hands it to the weight as its ``.grad``, the same
  V x H tensor eager allocates in its own backward. So ``bytes`` reads ``(NH + VH) / (NH + NV)`` (0.262 in fp32
  at these widths: it misses 0.25 by construction, not by waste). ``peak`` is the fairer one for this row: the
  peak bytes alive during forward + backward (``measuring.peak_bytes``), with every ``.grad`` set to None
  first so both sides allocate theirs; eager holds the (N, V) logits, their log-softmax and its gradient, the
  fused op one chunk of logits. The target (0.25) is read on ``peak``.
* ``linear_cross_entropy[softcap]``: the same head with Gemma 2's final logit cap (``30 * tanh(logits / 30)``)
  between it and the loss, fp32; eager computes the cap as Gemma 2's forward does, on the full logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NORM_CHAINS", "NORM_BUILDERS", "LlamaRMSNorm", "TARGETS"]

TARGETS = {"bytes_fused_vs_eager[*rms_norm+linear, *layer_norm+linear]": 0.5,
           "peak_fused_vs_eager[linear_cross_entropy]": 0.25,
           "time_fused_vs_eager[linear_cross_entropy]": 1.10}
LCE_FULL = dict(tokens=2048, vocab=32000, hidden=512)
LCE_QUICK = dict(tokens=64, vocab=1000, hidden=32)


class LlamaRMSNorm(nn.Module):
    """Hugging Face's ``LlamaRMSNorm``, verbatim."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class _AddNorm(nn.Module):
    """Eager ``s = x + residual; return norm(s), s``: the residual stream continues with ``s``."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x, residual):
        s = x + residual
        return self.norm(s), s


class _NormLinear(nn.Module):
    """``linear(norm(x [, residual]))``: the norm with the op that reads its output (returns the sum too)."""

    def __init__(self, norm: nn.Module, linear: nn.Linear):
        super().__init__()
        self.norm, self.linear = norm, linear

    def forward(self, *inputs):
        out = self.norm(*inputs)
        return (self.linear(out[0]), out[1]) if isinstance(out, tuple) else self.linear(out)


def _norm_chain(s, device, dtype, name):
    from opsnn_lab import ops
    from opsnn_lab.bench.ops import Chain

    quick = s["hidden"] < 256
    if "layer_norm" in name:
        width = s["hidden"]
        norm = nn.LayerNorm(width)
    else:
        width = s["hidden"] if quick else 1024
        norm = nn.RMSNorm(width, eps=1e-6) if "nn.RMSNorm" in name else LlamaRMSNorm(width)
    dtype = torch.bfloat16 if name.endswith("[bf16]") else dtype
    norm = norm.to(device, dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
        if getattr(norm, "bias", None) is not None:
            norm.bias.normal_(0.0, 0.1)
    add = name.startswith("add_")
    fused_cls = {(False, False): ops.FusedLayerNorm, (False, True): ops.FusedAddLayerNorm,
                 (True, False): ops.FusedRMSNorm, (True, True): ops.FusedAddRMSNorm}[("rms" in name, add)]
    # alone, a LayerNorm's output is kept by nothing: saving it gains no bytes and its recovery costs time
    keep_y = "+linear" in name or "rms" in name or name.endswith("[save_output]")
    fused = fused_cls.from_modules(norm, save_output=keep_y)
    shape = (s["batch"], s["tokens"], width)
    inputs = tuple(torch.randn(*shape, device=device, dtype=dtype, requires_grad=True) for _ in range(1 + add))
    eager = _AddNorm(norm) if add else norm
    note = f"{type(norm).__name__}, {shape}"
    if "+linear" in name:
        linear = nn.Linear(width, width).to(device, dtype)
        eager, fused, note = _NormLinear(eager, linear), _NormLinear(fused, linear), note + f" -> Linear({width})"
    return Chain(name, eager, fused, inputs, note=note)


def _lce_chain(s, device, dtype, name):
    from opsnn_lab import ops
    from opsnn_lab.bench.ops import Chain

    p = dict(LCE_QUICK if s["hidden"] < 256 else LCE_FULL)
    p["tokens"] *= s.get("batch_scale", 1)
    dtype = torch.bfloat16 if name.endswith("[bf16]") else dtype
    head = nn.Linear(p["hidden"], p["vocab"], bias=False).to(device, dtype)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02)
    hidden = torch.randn(p["tokens"], p["hidden"], device=device, dtype=dtype, requires_grad=True)
    target = torch.randint(0, p["vocab"], (p["tokens"],), device=device)
    target[::7] = -100  # some padding, as in a real batch

    cap = 30.0 if name.endswith("[softcap]") else None

    def eager(h, t):
        logits = head(h)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return F.cross_entropy(logits.float(), t)

    fused = ops.FusedLinearCrossEntropy.from_modules(head, softcap=cap)
    return Chain(name, eager, fused, (hidden, target), params=(head.weight,),
                 note=f"{p['tokens']} tokens, hidden {p['hidden']}, vocab {p['vocab']}, {str(dtype)[6:]}"
                 + (f", logits capped at {cap:g}" if cap else ""))


def _builder(build, name):
    return lambda s, device, dtype: build(s, device, dtype, name)


_NORMS = ("layer_norm+linear", "add_layer_norm+linear", "rms_norm+linear", "add_rms_norm+linear",
          "add_rms_norm+linear[bf16]", "layer_norm", "add_layer_norm", "layer_norm[save_output]", "rms_norm",
          "add_rms_norm", "add_rms_norm[bf16]", "rms_norm[nn.RMSNorm]")
_LCE = ("linear_cross_entropy", "linear_cross_entropy[bf16]", "linear_cross_entropy[softcap]")
NORM_CHAINS = _NORMS + _LCE
NORM_BUILDERS = {**{n: _builder(_norm_chain, n) for n in _NORMS}, **{n: _builder(_lce_chain, n) for n in _LCE}}
