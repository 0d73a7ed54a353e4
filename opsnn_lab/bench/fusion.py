"""``python -m opsnn_lab.bench fusion``: how long analysis takes, and whether its estimate holds.

For a 12-layer BERT-base-shaped encoder (batch 8 x 128, the seed's setting) and the embedded ResNet:
wall time of ``ol.fusion.analyze`` on CPU (target: under 10 s for BERT-base), the activation bytes the
plan says fusion saves, and the saving ``activation_bytes`` measures before/after ``apply`` (parameters
excluded). Train mode, fp32. Prints a table; writes build/bench/fusion.json.

``--models hf``: the model matrix instead (Hugging Face BERT, RoBERTa, GPT-2, Llama, ResNet, EfficientNet,
ConvNeXt from tiny configs, plus the embedded encoder and CNN; dropout at the models' defaults): candidates,
fused, rejected with the top reasons, activation bytes fused/eager measured, analysis seconds; and analysis
+ apply of HF BERT-base (12 layers, 8x128) against the 10 s target. Writes build/bench/fusion_hf.json.
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
            counts[reason] = counts.get(reason, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:n]
    return "; ".join(f"{c}x {r[:80]}" for r, c in top)


def _hf_row(name: str) -> dict:
    from opsnn_lab.demos import zoo

    model, inputs = zoo.build(name, batch=2, seq=16)
    model.train()
    call = (lambda m: lambda: m(*inputs)) if isinstance(inputs, tuple) else (lambda m: lambda: m(**inputs))
    t0 = time.perf_counter()
    plan = ol.fusion.analyze(model, inputs)
    seconds = time.perf_counter() - t0
    fused = ol.fusion.apply(model, plan)
    before = activation_bytes(call(model), exclude=tuple(model.parameters()))
    after = activation_bytes(call(fused), exclude=tuple(fused.parameters()))
    return {"model": name, "candidates": len(plan.decisions), "fused": len(plan.fused),
            "rejected": len(plan.decisions) - len(plan.fused), "activation fused/eager": after / before,
            "analysis s": seconds, "top rejections": _top_reasons(plan), "summary": plan.summary()}


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
    print(format_table(rows, ["model", "candidates", "fused", "rejected", "activation fused/eager", "analysis s",
                              "top rejections"]))
    if base is not None:
        ok = base["wall s"] < TARGET_SECONDS
        print(f"HF BERT-base analysis + apply ({args.batch}x{args.seq}): {base['wall s']:.2f} s wall, "
              f"{base['cpu s']:.2f} s CPU (target < {TARGET_SECONDS:.0f} s); {'meets' if ok else 'MISSES'} the target")
    path = write_json("fusion_hf", {"rows": rows, "bert_base": base, "args": vars(args)}, args.out)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m opsnn_lab.bench fusion", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--no-measure", action="store_true", help="time the analysis only (skip apply + measure)")
    p.add_argument("--out", default=None, help="directory for fusion.json (default build/bench)")
    p.add_argument("--models", choices=("embedded", "hf"), default="embedded",
                   help="hf: the Hugging Face model matrix (tiny configs) and HF BERT-base analysis time")
    p.add_argument("--no-base", action="store_true", help="with --models hf: skip the BERT-base timing")
    args = p.parse_args(argv)
    if args.models == "hf":
        return main_hf(args)
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
