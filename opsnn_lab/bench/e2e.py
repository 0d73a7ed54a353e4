"""``python -m opsnn_lab.bench e2e``: the seed's BERT table, re-measured on the embedded encoder.

Variants (each trained from the same initial weights on the same batches):

* ``eager``: fp32 PyTorch, AdamW.
* ``amp``: ``torch.autocast`` (bf16 on CPU, fp16 on CUDA) + ``torch.amp.GradScaler``.
* ``opsnn``: ``ol.train(fuse=True, precision="fp16-master", seed=0)``: fused chains, fp16 gradient
  pipeline with dynamic scaling into fp32 master weights, reproducible dropout.
* ``opsnn-strict``: the same under ``strict()``.
* ``amp-fused``: ``ol.train(fuse=True, precision="bf16", seed=0)``: the fused chains under ``torch.autocast``
  (bf16), against ``amp``'s eager modules under it (the fused ops cast their matmul operands as autocast does).

Each variant runs twice, each run in its own process so peak memory is its own. Columns:
throughput against eager (samples/s, first step excluded), activation bytes of one training
forward against eager, peak process memory, NaN losses and skipped steps, final loss (mean of
the last five steps) against eager, and run-to-run agreement of the two runs' outputs on a fixed
batch (bit-identical, or their cosine similarity). Writes JSON and a markdown table, both saying
which machine they come from; a variant whose dtype this CPU only emulates (bf16 autocast without
AVX512-BF16/AMX runs ~26x slower than fp32) is marked as such in the table and in its JSON row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from opsnn_lab.bench.common import bench_dir, format_table, machine_line, write_json
from opsnn_lab.bench.machine import emulated_note

VARIANTS = ("eager", "amp", "opsnn", "opsnn-strict", "amp-fused")
_AUTOCAST = ("amp", "amp-fused")
SIZES = {  # (EncoderConfig overrides, batch, seq_len, vocab)
    "quick": (dict(hidden=32, layers=1, heads=2, intermediate=128), 4, 16, 64),
    "cpu": (dict(hidden=256, layers=2, heads=4, intermediate=1024), 16, 64, 512),
    "bert-base": (dict(hidden=768, layers=12, heads=12, intermediate=3072), 8, 128, 30522),
}


def _setup(size: str, seed: int):
    from opsnn_lab.models import EncoderConfig, MaskedTokenTask

    overrides, batch, seq, vocab = SIZES[size]
    task = MaskedTokenTask(vocab_size=vocab, seq_len=seq, batch_size=batch, seed=seed)
    torch.manual_seed(seed)
    cfg = EncoderConfig(vocab_size=vocab, max_len=max(seq, 128), **overrides)
    return task, task.model(cfg)


def _train_amp(model, task, steps, lr, device):
    from opsnn_lab.training import TrainResult

    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device.type)
    result, t0 = TrainResult(model=model), time.perf_counter()
    for step in range(steps):
        batch = {k: v.to(device) for k, v in task.batch(step).items()}
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            loss = task.loss(model, batch)
        scaler.scale(loss).backward()
        scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        result.skipped_steps += int(scaler.get_scale() < scale_before)
        result.losses.append(float(loss.detach()))
        if step == 0:
            t0 = time.perf_counter()
    result.seconds = time.perf_counter() - t0
    return result


class _Timer:
    """Callback: wall time from the end of the first step (compile/warm-up excluded)."""

    def on_train_start(self, model, optimizer): ...
    def on_step_start(self, step, batch): ...
    def on_after_backward(self, step, model, loss): ...
    def on_train_end(self, result): ...

    def on_step_end(self, step, model, loss):
        if not hasattr(self, "t0"):
            self.t0 = time.perf_counter()
        self.t1 = time.perf_counter()


def worker(variant: str, size: str, steps: int, lr: float, out: Path) -> None:
    import opsnn_lab as ol
    from opsnn_lab.bench import activation_bytes

    task, model = _setup(size, seed=0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    if variant == "amp":
        result = _train_amp(model, task, steps, lr, device)
        seconds = result.seconds
    else:
        timer = _Timer()
        kw = {} if variant == "eager" else dict(fuse=True, precision="fp16-master", seed=0,
                                                 strict=variant == "opsnn-strict")
        if variant == "amp-fused":
            kw = dict(fuse=True, precision="bf16", seed=0)
        result = ol.train(model, task, steps, lr=lr, callbacks=[timer], record_grad_amax=False, progress=False, **kw)
        seconds = timer.t1 - timer.t0
    trained = result.model
    eval_batch = task.batch(10**6)
    trained.train()
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    amp_dtype = torch.bfloat16 if variant == "amp-fused" else amp_dtype
    with torch.autocast(device.type, dtype=amp_dtype, enabled=variant in _AUTOCAST):
        act = activation_bytes(lambda: task.loss(trained, eval_batch))
    trained.eval()
    with torch.no_grad():
        logits = trained(eval_batch["input_ids"].to(device)).float().cpu()
    torch.save(logits, out.with_suffix(".pt"))
    losses = result.losses
    summary = {
        "variant": variant,
        "samples_per_s": task.batch_size * max(steps - 1, 1) / max(seconds, 1e-9),
        "activation_bytes": act,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "nan_steps": sum(not math.isfinite(v) for v in losses),
        "skipped_steps": result.skipped_steps,
        "final_loss": sum(losses[-5:]) / len(losses[-5:]),
        "losses": losses,
    }
    out.write_text(json.dumps(summary))


def _run(variant, size, steps, lr, tmp: Path, run: int) -> dict:
    out = tmp / f"{variant}-{run}.json"
    cmd = [sys.executable, "-m", "opsnn_lab.bench", "e2e", "--worker", variant, "--size", size,
           "--steps", str(steps), "--lr", str(lr), "--worker-out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode:
        raise RuntimeError(f"e2e worker {variant} failed:\n{proc.stderr[-3000:]}")
    data = json.loads(out.read_text())
    data["logits"] = torch.load(out.with_suffix(".pt"))
    return data


def _agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    cos = torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()
    return torch.equal(a, b), cos


def table_rows(rows: list[dict]) -> list[dict]:
    """Rows as the table shows them: an emulated variant reads ``amp (bf16 emulated on this CPU: ...)``."""
    return [{"variant": f"{r['variant']} ({r['emulated']})" if r.get("emulated") else r["variant"],
             **{k: v for k, v in r.items() if k not in ("variant", "emulated")}} for r in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opsnn_lab.bench e2e", description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(SIZES), default=None,
                    help="model size (default: bert-base on CUDA, cpu otherwise)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--quick", action="store_true", help="CI-sized: tiny model, 6 steps")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    size = args.size or ("quick" if args.quick else "bert-base" if torch.cuda.is_available() else "cpu")
    steps = 6 if args.quick else args.steps
    if args.worker:
        worker(args.worker, size, steps, args.lr, args.worker_out)
        return 0
    variants = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or "eager" not in variants:
        ap.error(f"--variants must include eager and name only {', '.join(VARIANTS)}; got {args.variants}")
    from tqdm.auto import tqdm

    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(v, r) for r in range(2) for v in variants]  # interleave variants across the two rounds
        for v, r in tqdm(jobs, desc="e2e runs", unit="run"):
            runs.setdefault(v, []).append(_run(v, size, steps, args.lr, Path(tmp), r))
    base = runs["eager"]
    base_tput = sum(r["samples_per_s"] for r in base) / 2
    rows = []
    for v in variants:
        a, b = runs[v]
        identical, cos = _agreement(a["logits"], b["logits"])
        rows.append({
            "variant": v,
            "throughput_ratio": (a["samples_per_s"] + b["samples_per_s"]) / 2 / base_tput,
            "activation_ratio": a["activation_bytes"] / base[0]["activation_bytes"],
            "peak_rss_mib": max(a["peak_rss_mib"], b["peak_rss_mib"]),
            "nan_steps": a["nan_steps"] + b["nan_steps"],
            "skipped_steps": a["skipped_steps"] + b["skipped_steps"],
            "final_loss": a["final_loss"],
            "loss_vs_eager": a["final_loss"] / base[0]["final_loss"] - 1,
            "runs_bit_identical": identical,
            "runs_cosine": cos,
        })
    note = None if torch.cuda.is_available() else emulated_note(torch.bfloat16)  # amp's dtype on CPU
    for row in rows:
        row["emulated"] = note if row["variant"] in _AUTOCAST else None
    table = format_table(table_rows(rows), floatfmt=".4f")
    machine = machine_line()
    print(f"{machine}\nsize={size} steps={steps}\n{table}")
    ops = next((r for r in rows if r["variant"] == "opsnn"), None)
    headline = {}
    if ops:
        headline = {"e2e opsnn activation ratio": round(ops["activation_ratio"], 3),
                    "e2e opsnn throughput ratio": round(ops["throughput_ratio"], 3),
                    "e2e opsnn final loss vs eager": f"{ops['loss_vs_eager']:+.2%}"}
    curves = {v: runs[v][0]["losses"] for v in variants}
    path = write_json("e2e", {"size": size, "steps": steps, "rows": rows, "loss_curves": curves,
                              "headline": headline}, args.out)
    (bench_dir(args.out) / "e2e.md").write_text(f"# e2e ({size}, {steps} steps)\n\n{machine}\n\n{table}\n")
    print(f"wrote {path}")
    return 0
