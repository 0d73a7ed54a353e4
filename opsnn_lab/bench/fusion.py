"""``python -m opsnn_lab.bench fusion``: how long analysis takes, and whether its estimate holds.

For a 12-layer BERT-base-shaped encoder (batch 8 x 128, the seed's setting) and the embedded ResNet:
wall time of ``ol.fusion.analyze`` on CPU (target: under 10 s for BERT-base), the activation bytes the
plan says fusion saves, and the saving ``activation_bytes`` measures before/after ``apply`` (parameters
excluded). Train mode, fp32. Prints a table; writes build/bench/fusion.json.
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m opsnn_lab.bench fusion", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--no-measure", action="store_true", help="time the analysis only (skip apply + measure)")
    p.add_argument("--out", default=None, help="directory for fusion.json (default build/bench)")
    args = p.parse_args(argv)
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
