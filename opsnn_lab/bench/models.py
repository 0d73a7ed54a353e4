"""``python -m opsnn_lab.bench models [--device cpu|cuda] [--quick]``: whole models, a training step of eager
against the fused model (``ol.fusion.fuse``), fp32 and under bf16 ``torch.autocast``.

Per (model, precision): forward+backward time fused/eager (interleaved medians), activation bytes fused/eager
(parameters excluded), peak bytes of the step fused/eager (``peak_bytes``: activations, temporaries and the
``.grad`` tensors made afresh, what the step adds to the parameters) and the relative loss difference. Models from
Hugging Face configs, sized per device:

* ``llama``: ``LlamaForCausalLM``, vocabulary 32000, GQA; the fused side is the fused model with the fused
  head + loss (``ol.ops.lm_head_loss``). GPU: hidden 1024, intermediate 2816, 4 layers, 16/8 heads, 8 x 512
  tokens; CPU: hidden 512, intermediate 1376, 4 layers, 8/4 heads, 2 x 256 tokens;
* ``gemma2``: ``Gemma2ForCausalLM`` at the Llama row's sizes (head width 64), its attention scores capped by
  ``50 tanh(s / 50)`` and its logits by ``30 tanh(l / 30)`` (eager attention: Gemma 2 has no SDPA path); the fused
  side takes the fused head + loss with the cap (``ol.ops.lm_head_loss`` reads it from the config);
* ``bert``: ``BertForMaskedLM`` at BERT-base shapes (12 layers, 768 hidden): GPU 16 x 128 tokens, CPU 4 x 128;
* ``mobilenet_v2`` and ``efficientnet`` (B0 widths): GPU 32 x 224 x 224 images, CPU 8 x 160 x 160.

The bf16 rows are left out on a CPU whose GEMMs emulate bf16 (AVX2 only, ~25x fp32), as in ``bench ops``.
``--quick`` builds the test zoo's tiny models instead. A model that fails (to build, fuse or run) gets a row
with its error, so one failure does not lose the others. ``python -m opsnn_lab.bench gpu_check`` runs the GPU
sizes. Writes ``build/bench/models.json``.
"""

from __future__ import annotations

import argparse
import copy

import torch

import opsnn_lab as ol
from opsnn_lab.bench.common import (
    format_table,
    interleaved_medians,
    keeps_threads,
    machine_line,
    step_peak_bytes,
    write_json,
)
from opsnn_lab.measuring import activation_bytes

__all__ = ["main", "model_rows", "model_arguments", "parse_model_arguments", "training_steps", "each_model", "MODELS",
           "SIZES"]

MODELS = ("llama", "gemma2", "bert", "mobilenet_v2", "efficientnet")
# per device kind: Llama (hidden, intermediate, heads, kv heads, batch, tokens), BERT-base batch, image batch and side
SIZES = {"cuda": {"llama": (1024, 2816, 16, 8, 8, 512), "bert": 16, "images": (32, 224)},
         "cpu": {"llama": (512, 1376, 8, 4, 2, 256), "bert": 4, "images": (8, 160)}}


def _model(name: str, device_type: str):
    import transformers as T

    size = SIZES["cuda" if device_type == "cuda" else "cpu"]
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "llama":
        hidden, inter, heads, kv, batch, seq = size["llama"]
        cfg = T.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=4,
                            num_attention_heads=heads, num_key_value_heads=kv, vocab_size=32000,
                            max_position_embeddings=seq, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        ids = torch.randint(1, cfg.vocab_size, (batch, seq), generator=gen)
        return T.LlamaForCausalLM(cfg), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    if name == "gemma2":
        hidden, inter, heads, kv, batch, seq = size["llama"]
        cfg = T.Gemma2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=4,
                             num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                             query_pre_attn_scalar=hidden // heads, vocab_size=32000, max_position_embeddings=seq,
                             bos_token_id=0, eos_token_id=0, pad_token_id=0)
        ids = torch.randint(1, cfg.vocab_size, (batch, seq), generator=gen)
        return T.Gemma2ForCausalLM(cfg), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    if name == "bert":
        from opsnn_lab.demos import zoo

        return zoo.build("bert", size="base", batch=size["bert"], seq=128)
    batch, side = size["images"]
    images = {"pixel_values": torch.randn(batch, 3, side, side, generator=gen)}
    if name == "mobilenet_v2":
        return T.MobileNetV2Model(T.MobileNetV2Config(image_size=side)), images
    if name == "efficientnet":
        cfg = T.EfficientNetConfig(image_size=side, width_coefficient=1.0, depth_coefficient=1.0, hidden_dim=1280)
        return T.EfficientNetModel(cfg), images
    raise ValueError(f"name must be one of {MODELS}, got {name!r}")


def _loss(model, inputs: dict, head_loss: bool):
    if head_loss:  # the fused head + cross-entropy: the logits are never held
        ids = inputs["input_ids"]
        return ol.ops.lm_head_loss(model, ids, inputs["labels"], attention_mask=inputs["attention_mask"])
    from opsnn_lab.demos.zoo import training_loss

    return training_loss(model(**inputs))


def training_steps(model, inputs: dict, device):
    """The model and a fused copy on ``device`` in train mode, the plan, the inputs there, whether the fused side
    takes the fused head + loss, and ``step(m, fused_side, amp)``: one forward + backward, returning the loss."""
    model = model.to(device).train()
    inputs = {k: v.to(device) for k, v in inputs.items()}
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), inputs)
    head_loss = ol.ops.lm_head_kind(fused)[0] is not None and {"labels", "input_ids"} <= set(inputs)
    kind = torch.device(device).type

    def step(m, fused_side: bool, amp: bool):
        with torch.autocast(kind, dtype=torch.bfloat16, enabled=amp):
            loss = _loss(m, inputs, head_loss and fused_side)
        loss.backward()
        return loss

    return model, fused, plan, inputs, head_loss, step


def each_model(names, device, quick: bool, rows_of) -> list[dict]:
    """``rows_of(name, model, inputs)`` for each model, built as the module docstring says (``quick``: the zoo's
    tiny models); a model that fails gets a row with its error, and the others go on."""
    from tqdm.auto import tqdm

    rows = []
    for name in tqdm(names, desc="models", unit="model"):
        try:
            if quick:
                from opsnn_lab.demos import zoo

                model, inputs = zoo.build(name, dropout=0.0)
            else:
                model, inputs = _model(name, torch.device(device).type)
            rows += rows_of(name, model, inputs)
        except Exception as exc:  # report and go on: one model's failure must not lose the other rows
            rows.append({"model": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def _row(name: str, model, inputs: dict, device, repeat: int, precisions) -> list[dict]:
    model, fused, plan, inputs, head_loss, step = training_steps(model, inputs, device)
    kind = torch.device(device).type
    rows = []
    for amp in precisions:
        losses = [float(step(m, side, amp).detach()) for m, side in ((model, False), (fused, True))]
        times = interleaved_medians({"eager": lambda amp=amp: step(model, False, amp),
                                     "fused": lambda amp=amp: step(fused, True, amp)},
                                    warmup=2, repeat=repeat, device=device)
        with torch.autocast(kind, dtype=torch.bfloat16, enabled=amp):
            eager_b = activation_bytes(lambda: _loss(model, inputs, False), exclude=tuple(model.parameters()))
            fused_b = activation_bytes(lambda: _loss(fused, inputs, head_loss), exclude=tuple(fused.parameters()))
        peaks = [step_peak_bytes(lambda m=m, side=side, amp=amp: step(m, side, amp), m.parameters())
                 for m, side in ((model, False), (fused, True))]
        rows.append({"model": name, "precision": "bf16 autocast" if amp else "fp32", "fused": len(plan.fused),
                     "candidates": len(plan.decisions), "time fused/eager": times["fused"] / times["eager"],
                     "eager ms": times["eager"] * 1e3, "bytes fused/eager": fused_b / eager_b,
                     "peak fused/eager": peaks[1] / peaks[0], "eager peak MB": peaks[0] / 2**20,
                     "loss rel diff": abs(losses[1] - losses[0]) / max(abs(losses[0]), 1e-12)})
    return rows


def model_rows(device="cuda", names=MODELS, quick: bool = False, repeat: int = 10, bf16: bool = True) -> list[dict]:
    """Rows as described in the module docstring; ``quick``: the zoo's tiny models; ``bf16=False``: fp32 only."""
    precisions = (False, True) if bf16 else (False,)
    return each_model(names, device, quick, lambda name, model, inputs: _row(name, model, inputs, device, repeat,
                                                                             precisions))


COLUMNS = ["model", "precision", "fused", "candidates", "time fused/eager", "eager ms", "bytes fused/eager",
           "peak fused/eager", "eager peak MB", "loss rel diff", "error"]


def model_arguments(name: str, doc: str) -> argparse.ArgumentParser:
    """The arguments of ``python -m opsnn_lab.bench NAME`` over these models: --device, --models, --quick,
    --threads, --out."""
    ap = argparse.ArgumentParser(prog=f"python -m opsnn_lab.bench {name}", description=doc.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", nargs="*", default=list(MODELS),
                    help=f"of {', '.join(MODELS)} (with --quick: any model of opsnn_lab.demos.zoo)")
    ap.add_argument("--quick", action="store_true", help="the test zoo's tiny models")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads for the run (1 gives steadier ratios on a shared, loaded CPU)")
    ap.add_argument("--out", default=None, help=f"directory for {name}.json (default build/bench)")
    return ap


def parse_model_arguments(ap: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """Parsed, the models checked against the sizes (or the zoo with --quick), the thread count set."""
    args = ap.parse_args(argv)
    from opsnn_lab.demos import zoo

    known = zoo.MODELS if args.quick else MODELS
    if unknown := [m for m in args.models if m not in known]:
        ap.error(f"--models must name models of {sorted(known)}, got {unknown}")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


@keeps_threads
def main(argv: list[str] | None = None) -> int:
    from opsnn_lab.bench.allocator import steady
    from opsnn_lab.bench.machine import emulated_note

    ap = model_arguments("models", __doc__)
    ap.add_argument("--repeat", type=int, default=None, help="timed rounds per variant (default 10, CPU 7)")
    args = parse_model_arguments(ap, argv)
    on_cpu = torch.device(args.device).type == "cpu"
    allocator = steady() if on_cpu else "cuda caching allocator"  # no variant pays for the other's page faults
    why = emulated_note(torch.bfloat16) if on_cpu else None
    if why:
        print(f"bf16 autocast rows left out: {why}")
    repeat = args.repeat or (7 if on_cpu else 10)
    rows = model_rows(args.device, args.models, quick=args.quick, repeat=repeat, bf16=why is None)
    print(machine_line())
    print(format_table(rows, [c for c in COLUMNS if any(c in r for r in rows)]))
    print(f"allocator: {allocator}")
    path = write_json("models", {"device": args.device, "quick": args.quick, "repeat": repeat,
                                 "threads": torch.get_num_threads(), "rows": rows,
                                 "allocator": allocator, "skipped": [why] if why else []}, args.out)
    print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0
