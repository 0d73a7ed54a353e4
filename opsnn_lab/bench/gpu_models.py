"""Whole models on a GPU for ``python -m opsnn_lab.bench gpu_check``: a training step of eager against the fused
model, fp32 and under bf16 ``torch.autocast``.

Per (model, precision): forward+backward time fused/eager (interleaved medians), activation bytes fused/eager
(parameters excluded) and the relative loss difference. Models from Hugging Face configs at GPU widths:

* ``llama``: ``LlamaForCausalLM``, hidden 1024, intermediate 2816, 4 layers, GQA 16/8 heads, vocabulary 32000,
  8 x 512 tokens; the fused side is the fused model with the fused head + loss (``ol.ops.lm_head_loss``);
* ``bert``: ``BertForMaskedLM`` at BERT-base shapes (12 layers, 768 hidden), 16 x 128 tokens;
* ``mobilenet_v2`` and ``efficientnet`` (B0 widths): 224 x 224 images, batch 32.

``quick=True`` builds the test zoo's tiny models instead (the function's own test runs it on a CPU). A model
that fails (to build, fuse or run) gets a row with its error, so one failure does not lose the others.
"""

from __future__ import annotations

import copy

import torch

import opsnn_lab as ol
from opsnn_lab.bench.common import interleaved_medians
from opsnn_lab.measuring import activation_bytes

__all__ = ["model_rows", "MODELS"]

MODELS = ("llama", "bert", "mobilenet_v2", "efficientnet")


def _gpu_model(name: str):
    import transformers as T

    gen = torch.Generator().manual_seed(0)
    if name == "llama":
        cfg = T.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                            num_key_value_heads=8, vocab_size=32000, max_position_embeddings=512, bos_token_id=0,
                            eos_token_id=0, pad_token_id=0)
        ids = torch.randint(1, cfg.vocab_size, (8, 512), generator=gen)
        return T.LlamaForCausalLM(cfg), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    if name == "bert":
        from opsnn_lab.demos import zoo

        return zoo.build("bert", size="base", batch=16, seq=128)
    if name == "mobilenet_v2":
        return T.MobileNetV2Model(T.MobileNetV2Config(image_size=224)), {
            "pixel_values": torch.randn(32, 3, 224, 224, generator=gen)}
    if name == "efficientnet":
        cfg = T.EfficientNetConfig(image_size=224, width_coefficient=1.0, depth_coefficient=1.0, hidden_dim=1280)
        return T.EfficientNetModel(cfg), {
            "pixel_values": torch.randn(32, 3, 224, 224, generator=gen)}
    raise ValueError(f"name must be one of {MODELS}, got {name!r}")


def _loss(model, inputs: dict, head_loss: bool):
    if head_loss:  # the fused head + cross-entropy: the logits are never held
        ids = inputs["input_ids"]
        return ol.ops.lm_head_loss(model, ids, inputs["labels"], attention_mask=inputs["attention_mask"])
    out = model(**inputs)
    loss = getattr(out, "loss", None)
    return loss if loss is not None else out.to_tuple()[0].float().square().mean()


def _row(name: str, model, inputs: dict, device, repeat: int) -> list[dict]:
    model = model.to(device).train()
    inputs = {k: v.to(device) for k, v in inputs.items()}
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), inputs)
    head_loss = ol.ops.lm_head_kind(fused)[0] is not None and "labels" in inputs and "input_ids" in inputs
    rows = []
    for amp in (False, True):
        def step(m, fused_side, amp=amp):
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=amp):
                loss = _loss(m, inputs, head_loss and fused_side)
            loss.backward()
            return loss

        losses = [float(step(m, side).detach()) for m, side in ((model, False), (fused, True))]
        times = interleaved_medians({"eager": lambda: step(model, False), "fused": lambda: step(fused, True)},
                                    warmup=2, repeat=repeat, device=device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=amp):
            eager_b = activation_bytes(lambda: _loss(model, inputs, False), exclude=tuple(model.parameters()))
            fused_b = activation_bytes(lambda: _loss(fused, inputs, head_loss), exclude=tuple(fused.parameters()))
        rows.append({"model": name, "precision": "bf16 autocast" if amp else "fp32", "fused": len(plan.fused),
                     "candidates": len(plan.decisions), "time fused/eager": times["fused"] / times["eager"],
                     "eager ms": times["eager"] * 1e3, "bytes fused/eager": fused_b / eager_b,
                     "loss rel diff": abs(losses[1] - losses[0]) / max(abs(losses[0]), 1e-12)})
    return rows


def model_rows(device="cuda", names=MODELS, quick: bool = False, repeat: int = 10) -> list[dict]:
    """Rows as described in the module docstring; ``quick``: the zoo's tiny models (any device)."""
    from tqdm.auto import tqdm

    rows = []
    for name in tqdm(names, desc="models", unit="model"):
        try:
            if quick:
                from opsnn_lab.demos import zoo

                model, inputs = zoo.build(name, dropout=0.0)
            else:
                model, inputs = _gpu_model(name)
            rows += _row(name, model, inputs, device, repeat)
        except Exception as exc:  # report and go on: one model's failure must not lose the other rows
            rows.append({"model": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows
