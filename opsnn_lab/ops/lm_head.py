"""The fused head + loss for Hugging Face language models: hidden states from the base model, then the head's
weight, never the logits.

``lm_head_loss(model, input_ids, labels)`` gives the loss a Hugging Face ``*ForCausalLM`` (and GPT-2's
``*LMHeadModel``) or a BERT-style ``*ForMaskedLM`` computes from ``model(input_ids, labels=labels).loss``, with
the same gradients for every parameter, while the ``tokens x vocabulary`` logits are never materialised:

* causal LM: ``hidden = model.base_model(...).last_hidden_state``; labels shifted by one as HF's
  ``ForCausalLMLoss`` does (pad with ``ignore_index``, drop the first); mean over the non-ignored tokens, or
  ``sum / num_items_in_batch`` when that is given (the Trainer's gradient-accumulation form);
* masked LM: ``hidden = model.cls.predictions.transform(model.base_model(...)[0])``, unshifted labels.

transformers is never imported here: the model is inspected through the attributes these classes share.
"""

from __future__ import annotations

import torch
from torch import nn

from opsnn_lab._checks import check_tensor, check_type
from opsnn_lab.ops.fused_linear_cross_entropy import linear_cross_entropy

__all__ = ["lm_head_loss", "lm_head_kind"]

_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


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
    head = model.get_output_embeddings()
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)[0]
    if kind == "causal":
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    else:
        hidden = model.cls.predictions.transform(hidden)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = linear_cross_entropy(hidden, head.weight, labels.to(hidden.device), head.bias, ignore_index, reduction,
                                label_smoothing, chunk_size)
    return loss if num_items_in_batch is None else loss / num_items_in_batch
