"""``python -m opsnn_lab.bench fusion``: how long analysis takes, and whether its estimate holds.

For a 12-layer BERT-base-shaped encoder (batch 8 x 128, the seed's setting) and the embedded ResNet:
wall time of ``ol.fusion.analyze`` on CPU (target: under 10 s for BERT-base), the activation bytes the
plan says fusion saves, and the saving ``activation_bytes`` measures before/after ``apply`` (parameters
excluded). Train mode, fp32. Prints a table; writes build/bench/fusion.json.

``--models hf``: the model matrix instead (Hugging Face BERT, RoBERTa, GPT-2, Llama, Phi-3, Falcon,
Bloom, T5, ResNet, EfficientNet, MobileNetV2, ConvNeXt from tiny configs, plus the embedded encoder and CNN;
dropout at the models' defaults):
candidates, fused, rejected with the top reasons, activation bytes fused/eager measured (fp32, and under bf16
``torch.autocast`` against eager under autocast), analysis seconds;
analysis + apply of HF BERT-base (12 layers, 8x128) against the 10 s target; and a Llama-style decoder
(``LlamaForCausalLM`` from a config, Llama-7B proportions scaled to the CPU, 4x512 tokens, vocabulary 32000)
trained with the fused head + loss (``ol.ops.lm_head_loss`` on the fused model) against the 0.6 target.
Writes build/bench/fusion_hf.json.

``--models timm``: the same columns for timm's models (``zoo.TIMM_MODELS``: ResNet, EfficientNet, MobileNet
v2/v3, LCNet, RegNet with its ``BatchNormAct2d``, ViT, InceptionNeXt's ConvMlp with its ``norm`` placeholder,
CAFormer's StarReLU MLPs), built without weights, 2x3x96x96, training. timm is
not a dependency (it needs torchvision); without it the command says so and returns 2.
Writes build/bench/fusion_timm.json. ``--models torchvision``: the same for ``zoo.TORCHVISION_MODELS`` (ResNet,
MobileNetV3, EfficientNet, RegNet, ShuffleNet, MNASNet, DenseNet, GoogLeNet, ConvNeXt), built without weights;
writes build/bench/fusion_torchvision.json. ``--models peft``: a Llama-style decoder (hidden 256, 4 layers,
2x256 tokens) under LoRA fine-tuning with peft (``zoo.PEFT_MODELS``: r=16 on every projection, ``lora_dropout``
0 or 0.05, SDPA or the eager attention) and without adapters; writes build/bench/fusion_peft.json.
"""

from __future__ import annotations

import argparse
import re
import time

import torch
from tqdm.auto import tqdm

import opsnn_lab as ol
from opsnn_lab.bench.common import format_table, machine_line, write_json
from opsnn_lab.measuring import activation_bytes
from opsnn_lab.models import Encoder, EncoderConfig, ResNet, ResNetConfig

TARGET_SECONDS = 10.0


def _cases(args) -> dict:
    cfg = EncoderConfig.bert_base(layers=args.layers)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    images = torch.randn(args.batch, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    return {f"BERT-base encoder, {args.layers} layers, {args.batch}x{args.seq}": (lambda: Encoder(cfg), (ids,)),
            f"ResNet-18 widths, {args.batch}x3x64x64": (lambda: ResNet(ResNetConfig.resnet18_stem()), (images,))}


def _run(make, inputs, measure: bool) -> dict:
    torch.manual_seed(0)
    model = make().train()
    t0, c0 = time.perf_counter(), time.process_time()
    plan = ol.fusion.analyze(model, inputs)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    # CPU seconds next to wall seconds: on a shared machine the wall time mostly measures the neighbours.
    row = {"analysis s": seconds, "analysis cpu s": cpu, "fused": len(plan.fused),
           "rejected": len(plan.decisions) - len(plan.fused),
           "eager MiB": plan.activation_bytes / 2**20, "planned saving MiB": plan.saved_bytes / 2**20,
           "summary": plan.summary()}
    if measure:
        fused = ol.fusion.apply(model, plan)
        before = activation_bytes(lambda: model(*inputs), exclude=tuple(model.parameters()))
        after = activation_bytes(lambda: fused(*inputs), exclude=tuple(fused.parameters()))
        row.update({"measured saving MiB": (before - after) / 2**20, "activation ratio": after / before,
                    "estimate rel err": abs(plan.saved_bytes - (before - after)) / max(before - after, 1)})
    return row


def _top_reasons(plan, n=2) -> str:
    counts: dict[str, int] = {}
    for d in plan.decisions:
        if not d.fused:
            reason = re.sub(r"`[^`]*`", "`..`", d.reason)  # one line per kind of reason, not per module
            reason = re.sub(r"(overlaps the fused \w+) on .*", r"\1", reason)
            counts[reason] = counts.get(reason, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:n]
    return "; ".join(f"{c}x {r[:80]}" for r, c in top)


def _hf_row(name: str) -> dict:
    from opsnn_lab.demos import zoo

    return _row(name, *zoo.build(name, batch=2, seq=16))


def _row(name: str, model, inputs) -> dict:
    model.train()
    call = (lambda m: lambda: m(*inputs)) if isinstance(inputs, tuple) else (lambda m: lambda: m(**inputs))
    t0 = time.perf_counter()
    plan = ol.fusion.analyze(model, inputs)
    seconds = time.perf_counter() - t0
    fused = ol.fusion.apply(model, plan)
    ratio = {}
    for amp in (False, True):  # fp32, then bf16 autocast (the fused ops cast their matmul operands as autocast does)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            before = activation_bytes(call(model), exclude=tuple(model.parameters()))
            after = activation_bytes(call(fused), exclude=tuple(fused.parameters()))
        ratio[amp] = after / before
    return {"model": name, "candidates": len(plan.decisions), "fused": len(plan.fused),
            "rejected": len(plan.decisions) - len(plan.fused), "activation fused/eager": ratio[False],
            "bf16 autocast fused/eager": ratio[True], "analysis s": seconds, "top rejections": _top_reasons(plan),
            "summary": plan.summary()}


LM_SHAPE = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=32000)  # Llama-7B's proportions, widths scaled to the CPU
LM_TARGET, EFFICIENTNET_TARGET = 0.6, 0.8


def _lm_head_row(batch: int = 4, seq: int = 512) -> dict:
    """HF LlamaForCausalLM from a config, training step's forward: activation bytes of
    ``model(input_ids, labels=...).loss`` (eager) against ``ol.ops.lm_head_loss`` on the fused model."""
    import transformers as T

    cfg = T.LlamaConfig(**LM_SHAPE, max_position_embeddings=seq, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(cfg).train()
    ids = torch.randint(1, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    fused, plan = ol.fusion.fuse(model, inputs)
    excl = tuple(model.parameters())
    eager = activation_bytes(lambda: model(**inputs).loss, exclude=excl)
    hf_loss = activation_bytes(lambda: fused(**inputs).loss, exclude=excl)
    head_only = activation_bytes(lambda: ol.ops.lm_head_loss(model, ids, ids, attention_mask=mask), exclude=excl)
    both = activation_bytes(lambda: ol.ops.lm_head_loss(fused, ids, ids, attention_mask=mask), exclude=excl)
    return {"shape": f"hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, {cfg.num_hidden_layers} layers, "
                     f"GQA {cfg.num_attention_heads}/{cfg.num_key_value_heads}, vocab {cfg.vocab_size}, "
                     f"{batch}x{seq} tokens, fp32",
            "eager MiB": eager / 2**20, "fused model + fused head + loss": both / eager,
            "fused model, HF loss": hf_loss / eager, "eager model + fused head + loss": head_only / eager,
            "summary": plan.summary()}


def _bert_base_seconds(batch: int, seq: int) -> dict:
    from opsnn_lab.demos import zoo

    model, inputs = zoo.build("bert", size="base", batch=batch, seq=seq)
    t0, c0 = time.perf_counter(), time.process_time()
    plan = ol.fusion.analyze(model.train(), inputs)
    ol.fusion.apply(model, plan)
    return {"wall s": time.perf_counter() - t0, "cpu s": time.process_time() - c0, "fused": len(plan.fused)}


def main_hf(args) -> int:
    import warnings

    from opsnn_lab.demos import zoo

    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in tqdm(list(zoo.MODELS), desc="model matrix"):
            rows.append(_hf_row(name))
        base = _bert_base_seconds(args.batch, args.seq) if not args.no_base else None
        lm = _lm_head_row() if not args.no_lm else None
    print(machine_line())
    print(format_table(rows, ["model", "candidates", "fused", "rejected", "activation fused/eager",
                              "bf16 autocast fused/eager", "analysis s", "top rejections"]))
    eff = next(r["activation fused/eager"] for r in rows if r["model"] == "efficientnet")
    print(f"EfficientNet activation bytes fused/eager {eff:.3f} (target <= {EFFICIENTNET_TARGET}); "
          f"{'meets' if eff <= EFFICIENTNET_TARGET else 'MISSES'} the target")
    if lm is not None:
        ratio = lm["fused model + fused head + loss"]
        print(f"HF LlamaForCausalLM ({lm['shape']}), eager {lm['eager MiB']:.0f} MiB: fused model + fused head + loss "
              f"{ratio:.3f} (target <= {LM_TARGET}; {'meets' if ratio <= LM_TARGET else 'MISSES'} it); "
              f"fused model with HF's loss {lm['fused model, HF loss']:.3f}; eager model + fused head + loss "
              f"{lm['eager model + fused head + loss']:.3f}")
    if base is not None:
        ok = base["wall s"] < TARGET_SECONDS
        print(f"HF BERT-base analysis + apply ({args.batch}x{args.seq}): {base['wall s']:.2f} s wall, "
              f"{base['cpu s']:.2f} s CPU (target < {TARGET_SECONDS:.0f} s); {'meets' if ok else 'MISSES'} the target")
    path = write_json("fusion_hf", {"rows": rows, "bert_base": base, "lm_head": lm, "args": vars(args)}, args.out)
    print(f"wrote {path}")
    return 0


_LIBRARIES = {  # --models name -> (models, builder name in zoo, what to say when it is missing)
    "timm": ("TIMM_MODELS", "build_timm", "pip install timm (it needs torchvision; install the torchvision built "
             "for your torch first, or pip may replace your torch)"),
    "torchvision": ("TORCHVISION_MODELS", "build_torchvision", "install the torchvision built for your torch "
                    "(pip may otherwise replace your torch)"),
    "peft": ("PEFT_MODELS", "build_peft", "pip install peft"),
}


def main_library(args, library: str) -> int:
    """One row per model of a model library opsnn_lab does not depend on; 2 with a clear line without it."""
    import importlib
    import warnings

    from opsnn_lab.demos import zoo

    names, builder, hint = _LIBRARIES[library]
    try:
        lib = importlib.import_module(library)
    except ImportError:
        print(f"--models {library} needs {library}, which is not installed: {hint}")
        return 2
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in tqdm(getattr(zoo, names), desc=f"{library} models"):
            rows.append(_row(name, *getattr(zoo, builder)(name)))
    print(machine_line())
    print(format_table(rows, ["model", "candidates", "fused", "rejected", "activation fused/eager",
                              "bf16 autocast fused/eager", "analysis s", "top rejections"]))
    path = write_json(f"fusion_{library}", {"rows": rows, library: getattr(lib, "__version__", "?"),
                                            "args": vars(args)}, args.out)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m opsnn_lab.bench fusion", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--no-measure", action="store_true", help="time the analysis only (skip apply + measure)")
    p.add_argument("--out", default=None, help="directory for fusion.json (default build/bench)")
    p.add_argument("--models", choices=("embedded", "hf", *_LIBRARIES), default="embedded",
                   help="hf: the Hugging Face model matrix (tiny configs) and HF BERT-base analysis time; "
                        "timm / torchvision: their CNNs (and timm's ViT) from their configs; peft: a Llama-style "
                        "decoder under LoRA fine-tuning (each needs the library)")
    p.add_argument("--no-base", action="store_true", help="with --models hf: skip the BERT-base timing")
    p.add_argument("--no-lm", action="store_true",
                   help="with --models hf: skip the Llama-style decoder trained with the fused head + loss")
    args = p.parse_args(argv)
    if args.models == "hf":
        return main_hf(args)
    if args.models in _LIBRARIES:
        return main_library(args, args.models)
    rows = []
    for name, (make, inputs) in tqdm(_cases(args).items(), desc="fusion bench"):
        rows.append({"model": name, **_run(make, inputs, not args.no_measure)})
    columns = ["model", "analysis s", "analysis cpu s", "fused", "rejected", "eager MiB", "planned saving MiB"]
    if not args.no_measure:
        columns += ["measured saving MiB", "estimate rel err", "activation ratio"]
    print(machine_line())
    print(format_table(rows, columns))
    bert = rows[0]["analysis s"]
    print(f"BERT-base analysis: {bert:.2f} s wall, {rows[0]['analysis cpu s']:.2f} s CPU "
          f"(target < {TARGET_SECONDS:.0f} s on CPU, "
          f"{torch.get_num_threads()} threads); {'meets' if bert < TARGET_SECONDS else 'MISSES'} the target")
    path = write_json("fusion", {"target_seconds": TARGET_SECONDS, "rows": rows, "args": vars(args)}, args.out)
    print(f"wrote {path}")
    return 0
