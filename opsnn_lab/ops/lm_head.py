"""The fused head + loss for Hugging Face language models: hidden states from the base model, then the head's
weight, never the logits.

``lm_head_loss(model, input_ids, labels)`` gives the loss a Hugging Face ``*ForCausalLM`` (and GPT-2's
``*LMHeadModel``) or a BERT-style ``*ForMaskedLM`` computes from ``model(input_ids, labels=labels).loss``, with
the same gradients for every parameter, while the ``tokens x vocabulary`` logits are never materialised:

* causal LM: ``hidden = model.base_model(...).last_hidden_state``; labels shifted by one as HF's
  ``ForCausalLMLoss`` does (pad with ``ignore_index``, drop the first); mean over the non-ignored tokens, or
  ``sum / num_items_in_batch`` when that is given (the Trainer's gradient-accumulation form);
* masked LM: ``hidden = model.cls.predictions.transform(model.base_model(...)[0])``, unshifted labels;
* a logit map between the head and the loss, read from the config: ``final_logit_softcapping`` (Gemma 2 and
  later: ``cap * tanh(logits / cap)``) and a scale, ``logit_scale`` / ``logits_scaling`` / ``lm_head_multiplier``
  (Cohere multiplies by it, Granite divides, HyperCLOVA X and Falcon-H1 multiply: the check below tells which),
  computed by ``linear_cross_entropy``'s ``logit_scale`` / ``softcap``.

transformers is never imported here: the model is inspected through the attributes these classes share. Those
attributes do not say everything a class's forward does between its base model and its loss (RoBERTa's and BERT's
causal heads put a dense + GELU + LayerNorm transform before the decoder, MiniCPM3 scales the hidden states, a
permutation LM does not shift its labels), so the first call on a model checks: the model's own loss and this one
on the first tokens of the batch's first row, in eval mode without gradients (``_verify``), and the logits the
model returns against the mapped head's; a class that computes another loss raises ``ValueError`` naming both,
instead of training on a loss the model does not define.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from opsnn_lab._checks import check_tensor, check_type
from opsnn_lab.ops.fused_linear_cross_entropy import linear_cross_entropy

__all__ = ["lm_head_loss", "lm_head_kind"]

_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
_VERIFIED = "_opsnn_lm_head_verified"  # on the model's __dict__: {(kind, dtype): None | the error}
_CHECK_TOKENS = 16
# kind -> (labels shifted by one, what the hidden states go through first: nothing, BERT's cls.predictions.transform,
# or the module holding the head with the head left out)
_KINDS = {"causal": (True, None), "causal_head": (True, "parent"), "unshifted": (False, None),
          "unshifted_head": (False, "parent"), "masked": (False, "transform"), "masked_head": (False, "parent")}
_CAP_ATTR = "final_logit_softcapping"
# config attributes naming a scale of the logits; whether the model multiplies or divides by it is the check's to find
_SCALE_ATTRS = ("logit_scale", "logits_scaling", "lm_head_multiplier")


def lm_head_kind(model: nn.Module) -> tuple[str | None, str]:
    """``("causal" | "masked", why)`` when ``lm_head_loss`` can run ``model``, else ``(None, reason)``."""
    name = type(model).__name__
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear):
        return None, f"{name}: get_output_embeddings() is not an nn.Linear head"
    if not isinstance(getattr(model, "base_model", None), nn.Module) or model.base_model is model:
        return None, f"{name}: no base_model separate from the head"
    if name.endswith(_CAUSAL_SUFFIXES):
        return "causal", f"{name}: base model -> lm_head, labels shifted by one"
    predictions = getattr(getattr(model, "cls", None), "predictions", None)
    if name.endswith("ForMaskedLM") and getattr(predictions, "decoder", None) is head \
            and isinstance(getattr(predictions, "transform", None), nn.Module):
        return "masked", f"{name}: base model -> cls.predictions.transform -> decoder"
    return None, f"{name}: neither a *ForCausalLM / *LMHeadModel nor a BERT-style *ForMaskedLM"


def lm_head_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, *, ignore_index: int = -100,
                 label_smoothing: float = 0.0, num_items_in_batch: int | torch.Tensor | None = None,
                 chunk_size: int | None = None, **model_kwargs) -> torch.Tensor:
    """``model(input_ids, attention_mask=..., labels=labels).loss`` through ``linear_cross_entropy``.

    input_ids, labels: (B, T) ints (labels ``ignore_index`` where no loss); ``model_kwargs`` go to the base model.
    Raises ``ValueError`` naming ``model`` when its head is not one of the supported forms (see ``lm_head_kind``).
    """
    kind, reason = lm_head_kind(check_type("model", model, nn.Module))
    if kind is None:
        raise ValueError(f"model: {reason}")
    check_tensor("input_ids", input_ids, dtypes=(torch.int64, torch.int32), dim=2)
    check_tensor("labels", labels, dtypes=(torch.int64, torch.int32), dim=2)
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
    verdict = _verify(model, kind, input_ids, labels, attention_mask, ignore_index, model_kwargs)
    reduction = "mean" if num_items_in_batch is None else "sum"
    hidden = _hidden(model, verdict[0], input_ids, attention_mask, model_kwargs)
    loss = _loss(model, verdict, hidden, labels, ignore_index, reduction, label_smoothing, chunk_size)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def _hidden(model, kind, input_ids, attention_mask, model_kwargs) -> torch.Tensor:
    """What the head reads: the base model's hidden states, through what ``kind`` puts between them and the head."""
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)[0]
    through = _KINDS[kind][1]
    if through == "transform":
        hidden = model.cls.predictions.transform(hidden)
    elif through == "parent":
        hidden = _before_head(model, model.get_output_embeddings(), hidden)
    return hidden


def _loss(model, verdict, hidden, labels, ignore_index, reduction, label_smoothing, chunk_size) -> torch.Tensor:
    kind, scale, softcap = verdict
    head = model.get_output_embeddings()
    if _KINDS[kind][0]:  # else the labels are the logits' targets as given (MBart's, Marian's ForCausalLM; masked LMs)
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return linear_cross_entropy(hidden, head.weight, labels.to(hidden.device), head.bias, ignore_index, reduction,
                                label_smoothing, chunk_size, logit_scale=scale, softcap=softcap)


def _number(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return float(value) if ok else None


def _logit_maps(model: nn.Module) -> list[tuple[float, float | None]]:
    """``(scale, softcap)`` candidates from the model's config: the cap if it names one, with each scale it names
    taken both as a factor and as a divisor (1.0 when it names none)."""
    config = getattr(model, "config", None)
    cap = _number(getattr(config, _CAP_ATTR, None))
    scales = [_number(getattr(config, a, None)) for a in _SCALE_ATTRS]
    scales = [x for v in scales if v is not None and v != 1.0 for x in (v, 1.0 / v)] or [1.0]
    return [(scale, cap) for scale in scales]


def _head_parent(model: nn.Module, head: nn.Module):
    """``(parent, name)`` of the module holding ``head`` when that is not the model itself (BERT's
    ``cls.predictions``, RoBERTa's ``lm_head``: a transform, then the decoder), else None."""
    for module in model.modules():
        for name, child in module._modules.items():
            if child is head:
                return None if module is model else (module, name)
    return None


def _before_head(model: nn.Module, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` through the head's parent module with the head left out: what that module feeds the head."""
    parent, name = model.__dict__[_VERIFIED]["parent"]
    parent._modules[name] = nn.Identity()
    try:
        return parent(hidden)
    finally:
        parent._modules[name] = head


def _verify(model, kind, input_ids, labels, attention_mask, ignore_index, model_kwargs) -> tuple:
    """Once per model and dtype: the model's own loss and this module's on the first ``_CHECK_TOKENS`` tokens of
    the first row (eval mode, no gradients; the model's labels in its own ``-100`` convention), and the model's
    logits against the mapped head's; a causal LM whose labels the model does not shift (the ``*ForCausalLM`` of
    MBart, Marian, Pegasus, PLBart) is taken so. Returns ``(kind, scale, softcap)``; raises ``ValueError`` where no
    kind and logit map give the model's loss and logits to the dtype's rounding. The config is read once here:
    a cap or scale changed afterwards is not seen."""
    head = model.get_output_embeddings()
    key = (kind, head.weight.dtype)
    verdicts = model.__dict__.setdefault(_VERIFIED, {})
    if "parent" not in verdicts:
        verdicts["parent"] = _head_parent(model, head)
    if key not in verdicts:
        verdicts[key] = _compare(model, kind, input_ids, labels, attention_mask, ignore_index, model_kwargs)
    verdict = verdicts[key]
    if isinstance(verdict, str):
        raise ValueError(verdict)
    return verdict


def _compare(model, kind, input_ids, labels, attention_mask, ignore_index, model_kwargs) -> tuple | str:
    rows, tokens = input_ids.shape
    n = min(tokens, _CHECK_TOKENS)

    def first(t):
        return t[:1, :n] if isinstance(t, torch.Tensor) and t.shape[:2] == (rows, tokens) else t

    ids, mask, kwargs = first(input_ids), first(attention_mask), {k: first(v) for k, v in model_kwargs.items()}
    own = first(labels).masked_fill(first(labels) == ignore_index, -100)
    if not (own != -100).any():  # nothing to compare on: the row's own tokens as labels
        own = ids.clone()
    head = model.get_output_embeddings()
    tol = 1e-4 if head.weight.dtype in (torch.float32, torch.float64) else 3e-2
    maps = _logit_maps(model)
    kinds = ("causal", "causal_head", "unshifted", "unshifted_head") if kind == "causal" else ("masked", "masked_head")
    modes = [(m, m.training) for m in model.modules()]
    got = {}
    try:
        model.eval()
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, labels=own, **kwargs)
            want, logits = float(out.loss), getattr(out, "logits", None)
            for k in kinds:
                if _KINDS[k][1] == "parent" and model.__dict__[_VERIFIED]["parent"] is None:
                    continue  # no module between the model and its head
                try:
                    hidden = _hidden(model, k, ids, mask, kwargs)
                    raw = nn.functional.linear(hidden, head.weight, head.bias).double()  # the head's, unmapped
                except Exception as e:  # a head whose module reads it (MobileBERT's), hidden states it cannot read
                    got[k] = f"{type(e).__name__}"  # (RemBert's, before its transform): not this kind
                    continue
                for scale, cap in maps:
                    name = describe((k, scale, cap))
                    got[name] = float(_loss(model, (k, scale, cap), hidden, own, -100, "mean", 0.0, None))
                    if not (_close(got[name], want, tol) and _same_logits(logits, raw, scale, cap, tol)):
                        continue
                    if cap is None or _cap_reached(model, head, (ids, mask, own, kwargs), hidden, raw, (k, scale, cap),
                                                   tol):
                        return k, scale, cap
                    got[name] = "differs once the logits reach the cap"
    finally:
        for m, training in modes:
            m.training = training
    tried = ", ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in got.items())
    return (f"model: {type(model).__name__}'s own loss on the first {n} tokens is {want:.6g}, lm_head_loss's "
            f"({tried}): its forward does more between the base model and the loss than the head (a transform or "
            "a scale before it); compute the logits as the model does, or fuse the model and let the "
            "plan's linear_cross_entropy rows say what they can take")


def describe(verdict) -> str:
    """A verdict ``(kind, scale, softcap)`` as text: ``"causal"``, ``"causal x0.0625"``, ``"causal cap 30"``."""
    kind, scale, cap = verdict
    return kind + (f" x{scale:.6g}" if scale != 1.0 else "") + (f" cap {cap:g}" if cap else "")


def _close(got: float, want: float, tol: float) -> bool:
    return want == want and abs(got - want) <= tol * max(1.0, abs(want))


def _cap_reached(model, head, batch, hidden, raw, verdict, tol) -> bool:
    """The model's loss and logits with its head's output scaled (a forward hook) so that the mapped logits reach
    4x the cap, against this module's: a cap the model does not apply (or applies otherwise) is invisible on the
    small logits of a fresh model, and shows here. ``raw``: the head's logits on ``hidden``, unmapped."""
    kind, scale, cap = verdict
    largest = float(raw.abs().max())
    if not largest > 0:
        return False
    factor = 4.0 * cap / (scale * largest)
    ids, mask, own, kwargs = batch
    handle = head.register_forward_hook(lambda module, args, out: out * factor)
    try:
        out = model(input_ids=ids, attention_mask=mask, labels=own, **kwargs)
    finally:
        handle.remove()
    mapped = (kind, scale * factor, cap)
    loss = float(_loss(model, mapped, hidden, own, -100, "mean", 0.0, None))
    return _close(loss, float(out.loss), tol) and _same_logits(getattr(out, "logits", None), raw, scale * factor,
                                                               cap, tol)


def _same_logits(logits, raw, scale, cap, tol) -> bool:
    """The model's returned logits against the head's (``raw``, float64) through the map, elementwise (a scale the
    loss barely feels, on small logits, shows here); True where the model returns none of that shape."""
    if not isinstance(logits, torch.Tensor) or logits.shape != raw.shape:
        return True
    z = raw * scale
    if cap:
        z = torch.tanh(z / cap) * cap
    ref = logits.double()
    return bool(((z - ref).abs() <= tol * max(1.0, float(ref.abs().max()))).all())
