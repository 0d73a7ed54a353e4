"""Widget and statistics costs: ScalerTuner redraw on a long trace, GradientStats overhead per step.

``python -m opsnn_lab.bench widgets [--trace-steps 10000] [--repeat 15] [--train-repeat 30]``

* ScalerTuner: time from a slider change to the redrawn figure (replay through ``DynamicScaler`` +
  fp16 underflow at every replayed scale + the plotly update) on a synthetic 10,000-step trace with
  a realistic log2|g| histogram per step. Target: < 200 ms. Shown against the replay alone.
* GradientStats: a training step of the embedded tiny encoder with ``stats.record`` after backward
  against the same step without it, measured round-robin. Target: <= 10% overhead.
"""

from __future__ import annotations

import argparse
import copy

import numpy as np
import torch

from opsnn_lab.bench.common import format_table, interleaved_medians, keeps_threads, machine_line, write_json

TARGET_REDRAW_S = 0.200
TARGET_OVERHEAD = 0.10


def synthetic_trace(steps: int, seed: int = 0):
    """A trace shaped like a real run: log2|g| ~ N(-20 + drift, 4) per step, 2**17 elements, an amax
    spike every ~300 steps (overflows at 2**16) and a non-finite step every ~2,000."""
    from opsnn_lab.precision.grad_stats import EXP_MIN, N_BINS, N_EXP, GradientTrace

    rng = np.random.default_rng(seed)
    centre = -20.0 + np.cumsum(rng.normal(0, 0.02, steps))
    octaves = np.arange(N_EXP) + EXP_MIN + 0.5
    density = np.exp(-0.5 * ((octaves[None, :] - centre[:, None]) / 4.0) ** 2)
    counts = np.zeros((steps, N_BINS), dtype=np.int64)
    counts[:, :N_EXP] = np.round(density / density.sum(1, keepdims=True) * 2**17)
    amax = np.exp2(centre + 4.0 * 4.3)  # about the largest of 2**17 normal draws
    amax[rng.random(steps) < 1 / 300] *= 2.0**6
    amax[rng.random(steps) < 1 / 2000] = np.nan
    return GradientTrace.from_amax(amax, counts=counts)


def bench_tuner(trace_steps: int, repeat: int) -> list[dict]:
    from opsnn_lab.precision import DynamicScaler
    from opsnn_lab.widgets import ScalerTuner

    trace = synthetic_trace(trace_steps)
    tuner = ScalerTuner(trace, growth_interval=200)
    events = trace.events()
    values = iter(range(10**9))

    def move_slider():  # alternate between two settings so every call is a real change
        tuner.init_scale_log2.value = 12 if next(values) % 2 else 16

    t = interleaved_medians({"replay only": lambda: DynamicScaler(growth_interval=200).replay(events),
                             "underflow at replayed scales": lambda: trace.underflow_fraction(
                                 np.asarray(tuner.result["scale"])),
                             "slider -> redraw": move_slider}, repeat=repeat)
    base = t["replay only"]
    return [{"case": f"ScalerTuner, {trace_steps:,}-step trace: {k}", "median_ms": v * 1e3, "vs_replay": v / base,
             "vs_target": v / TARGET_REDRAW_S if k == "slider -> redraw" else float("nan")} for k, v in t.items()]


def bench_stats(repeat: int) -> list[dict]:
    import opsnn_lab as ol
    from opsnn_lab.models import EncoderConfig, MaskedTokenTask
    from opsnn_lab.precision import GradientStats

    torch.manual_seed(0)
    task = MaskedTokenTask(vocab_size=64, seq_len=32, batch_size=16)
    model = task.model(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))
    twin = copy.deepcopy(model)
    stats = GradientStats(twin)
    opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (model, twin)}
    batch = task.batch(0)

    def step(m, record: bool):
        opt = opts[id(m)]
        opt.zero_grad(set_to_none=True)
        task.loss(m, batch).backward()
        if record:
            stats.record(0)
        opt.step()

    ol.train(copy.deepcopy(model), task, 2, progress=False)  # warm the allocator and kernels
    t = interleaved_medians({"train step": lambda: step(model, False), "train step + GradientStats.record":
                             lambda: step(twin, True), "GradientStats.record alone": lambda: stats.record(0)},
                            repeat=repeat, warmup=3)
    base = t["train step"]
    n = sum(p.numel() for p in model.parameters())
    return [{"case": f"tiny encoder ({n:,} params): {k}", "median_ms": v * 1e3, "vs_step": v / base,
             "overhead": v / base - 1 if "+" in k else float("nan")} for k, v in t.items()]


@keeps_threads
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opsnn_lab.bench widgets", description=__doc__.splitlines()[0])
    ap.add_argument("--trace-steps", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=15, help="timed redraws per case")
    ap.add_argument("--train-repeat", type=int, default=30, help="timed training steps per case")
    ap.add_argument("--out", default=None, help="directory for widgets.json (default build/bench)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the shared CI machine: one thread gives the least noisy ratios
    tuner_rows = bench_tuner(args.trace_steps, args.repeat)
    print(machine_line())
    print(format_table(tuner_rows, ["case", "median_ms", "vs_replay", "vs_target"]))
    stats_rows = bench_stats(args.train_repeat)
    print(format_table(stats_rows, ["case", "median_ms", "vs_step", "overhead"]))
    redraw = next(r for r in tuner_rows if r["case"].endswith("slider -> redraw"))["median_ms"] / 1e3
    overhead = next(r for r in stats_rows if "+" in r["case"])["overhead"]
    print(f"ScalerTuner redraw {redraw * 1e3:.1f} ms (target < {TARGET_REDRAW_S * 1e3:.0f} ms): "
          f"{'met' if redraw < TARGET_REDRAW_S else 'MISSED'}; GradientStats overhead {overhead:+.1%} "
          f"(target <= {TARGET_OVERHEAD:.0%}): {'met' if overhead <= TARGET_OVERHEAD else 'MISSED'}")
    path = write_json("widgets", {"tuner": tuner_rows, "grad_stats": stats_rows, "redraw_s": redraw,
                                  "grad_stats_overhead": overhead, "targets": {"redraw_s": TARGET_REDRAW_S,
                                                                               "overhead": TARGET_OVERHEAD}},
                      args.out)
    print(f"wrote {path}")
    return 0
