"""The fused head + loss for Hugging Face language models: hidden states from the base model, then the head's
weight, never the logits.

``lm_head_loss(model, input_ids, labels)`` gives the loss a Hugging Face ``*ForCausalLM`` (and GPT-2's
``*LMHeadModel``) or a BERT-style ``*ForMaskedLM`` computes from ``model(input_ids, labels=labels).loss``, with
the same gradients for every parameter, while the ``tokens x vocabulary`` logits are never materialised:

* causal LM: ``hidden = model.base_model(...).last_hidden_state``; labels shifted by one as HF's
  ``ForCausalLMLoss`` does (pad with ``ignore_index``, drop the first); mean over the non-ignored tokens, or
  ``sum / num_items_in_batch`` when that is given (the Trainer's gradient-accumulation form);
* masked LM: ``hidden = model.cls.predictions.transform(model.base_model(...)[0])``, unshifted labels.

transformers is never imported here: the model is inspected through the attributes these classes share. Those
attributes do not say everything a class's forward does between its base model and its loss (RoBERTa's and BERT's
causal heads put a dense + GELU + LayerNorm transform before the decoder, MiniCPM3 scales the hidden states, a
permutation LM does not shift its labels), so the first call on a model checks: the model's own loss and this one
on the first tokens of the batch's first row, in eval mode without gradients (``_verify``); a class that computes
another loss raises ``ValueError`` naming both, instead of training on a loss the model does not define.
"""

from __future__ import annotations

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


def lm_head_kind(model: nn.Module) -> tuple[str | None, str]:
    """``("causal" | "masked", why)`` when ``lm_head_loss`` can run ``model``, else ``(None, reason)``."""
    name = type(model).__name__
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear):
        return None, f"{name}: get_output_embeddings() is not an nn.Linear head"
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, attr, None) not in (None, 1.0):
            return None, f"{name}: config.{attr} transforms the logits before the loss; not fused"
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
    kind = _verify(model, kind, input_ids, labels, attention_mask, ignore_index, model_kwargs)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = _fused(model, kind, input_ids, labels, attention_mask, ignore_index, reduction, label_smoothing,
                  chunk_size, model_kwargs)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def _fused(model, kind, input_ids, labels, attention_mask, ignore_index, reduction, label_smoothing, chunk_size,
           model_kwargs) -> torch.Tensor:
    head = model.get_output_embeddings()
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)[0]
    shift, through = _KINDS[kind]
    if through == "transform":
        hidden = model.cls.predictions.transform(hidden)
    elif through == "parent":
        hidden = _before_head(model, head, hidden)
    if shift:  # else the labels are the logits' targets as given (MBart's, Marian's ForCausalLM; masked LMs)
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return linear_cross_entropy(hidden, head.weight, labels.to(hidden.device), head.bias, ignore_index, reduction,
                                label_smoothing, chunk_size)


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


def _verify(model, kind, input_ids, labels, attention_mask, ignore_index, model_kwargs) -> str:
    """Once per model and dtype: the model's own loss and ``_fused``'s on the first ``_CHECK_TOKENS`` tokens of
    the first row (eval mode, no gradients; the model's labels in its own ``-100`` convention); a causal LM whose
    labels the model does not shift (the ``*ForCausalLM`` of MBart, Marian, Pegasus, PLBart) is taken so. Returns
    the kind to compute; raises ``ValueError`` where no kind gives the model's loss to the dtype's rounding."""
    head = model.get_output_embeddings()
    key = (kind, head.weight.dtype)
    verdicts = model.__dict__.setdefault(_VERIFIED, {})
    if "parent" not in verdicts:
        verdicts["parent"] = _head_parent(model, head)
    if key not in verdicts:
        verdicts[key] = _compare(model, kind, input_ids, labels, attention_mask, ignore_index, model_kwargs)
    verdict = verdicts[key]
    if verdict not in _KINDS:
        raise ValueError(verdict)
    return verdict


def _compare(model, kind, input_ids, labels, attention_mask, ignore_index, model_kwargs) -> str:
    rows, tokens = input_ids.shape
    n = min(tokens, _CHECK_TOKENS)

    def first(t):
        return t[:1, :n] if isinstance(t, torch.Tensor) and t.shape[:2] == (rows, tokens) else t

    ids, mask, kwargs = first(input_ids), first(attention_mask), {k: first(v) for k, v in model_kwargs.items()}
    own = first(labels).masked_fill(first(labels) == ignore_index, -100)
    if not (own != -100).any():  # nothing to compare on: the row's own tokens as labels
        own = ids.clone()
    tol = 1e-4 if model.get_output_embeddings().weight.dtype in (torch.float32, torch.float64) else 3e-2
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            want = float(model(input_ids=ids, attention_mask=mask, labels=own, **kwargs).loss)
            got = {}
            kinds = ("causal", "causal_head", "unshifted", "unshifted_head") if kind == "causal" else \
                ("masked", "masked_head")
            for k in kinds:
                if _KINDS[k][1] == "parent" and model.__dict__[_VERIFIED]["parent"] is None:
                    continue  # no module between the model and its head
                try:
                    got[k] = float(_fused(model, k, ids, own, mask, -100, "mean", 0.0, None, kwargs))
                except Exception as e:  # a head whose module reads it (MobileBERT's): not this kind
                    got[k] = f"{type(e).__name__}"
                    continue
                if want == want and abs(got[k] - want) <= tol * max(1.0, abs(want)):
                    return k
    finally:
        for m, training in modes:
            m.training = training
    tried = ", ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in got.items())
    return (f"model: {type(model).__name__}'s own loss on the first {n} tokens is {want:.6g}, lm_head_loss's "
            f"({tried}): its forward does more between the base model and the loss than the head (a transform or "
            "a scale before it); compute the logits as the model does, or fuse the model and let the "
            "plan's linear_cross_entropy rows say what they can take")
