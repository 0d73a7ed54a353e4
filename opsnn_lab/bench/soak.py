"""``python -m opsnn_lab.bench soak [--steps N]``: the seed's 500k-step stability claim, on synthetic grads.

A small fp16 "model" (two parameter tensors) is driven by ``MasterWeightOptimizer`` + ``DynamicScaler``
through a gradient stream whose magnitude drifts over two decades, with injected faults every
``period`` steps: overflow bursts (1-4 steps of grads 1e6x too large), underflow droughts (5-50 steps
of grads 1e-10x too small) and single NaN steps. Grads are scaled by the live loss scale and cast to
fp16, as a real fp16 backward would hand them over.

Checks, reported in the JSON summary (``ok`` is all of them):
* no NaN/Inf ever reaches the fp32 masters or the fp16 params;
* every skipped step is accounted for: an injected fault, an underflow (true amax x scale below the
  threshold), or a natural overflow (true amax x scale above fp16's max as the scale probes upward);
  and every injected overflow/NaN step was skipped;
* the scale recovers after every burst (returns to its pre-burst value) before the next fault.
"""

from __future__ import annotations

import argparse
import math
import random

import torch

from opsnn_lab.bench.common import Timer, keeps_threads, machine_line, write_json
from opsnn_lab.precision import FP16_MAX, DynamicScaler, MasterWeightOptimizer
from opsnn_lab.precision.dynamic_scaler import ScalerHistory

__all__ = ["main", "run_soak", "fault_schedule"]

_BURST, _DROUGHT, _NAN = "burst", "drought", "nan"
_MULT = {_BURST: 1e6, _DROUGHT: 1e-10, _NAN: 1.0}


def fault_schedule(steps: int, period: int, seed: int) -> list[tuple[int, int, str]]:
    """``(start, length, kind)`` of each injected fault; one per ``period`` steps, after a warm-up period."""
    rng = random.Random(seed)
    out, kinds = [], []
    for start in range(period, steps, period):
        if not kinds:  # every kind once per three faults, in a shuffled order
            kinds = [_BURST, _DROUGHT, _NAN]
            rng.shuffle(kinds)
        kind = kinds.pop()
        length = {_BURST: rng.randint(1, 4), _DROUGHT: rng.randint(5, 50), _NAN: 1}[kind]
        out.append((start + rng.randrange(period // 4), length, kind))
    return out


def _fault_at(schedule, steps):
    kind = [None] * steps
    for start, length, k in schedule:
        for t in range(start, min(start + length, steps)):
            kind[t] = k
    return kind


def _account(hist: dict, truth_amax: list[float], faults: list, thr: float) -> dict:
    """Classify every step of one history chunk; returns counts, with ``unaccounted`` the failures."""
    c = {"applied": 0, "skipped": 0, "injected_skips": 0, "underflow_skips": 0, "natural_overflows": 0,
         "unaccounted": 0, "injected_applied": 0}
    for i, step in enumerate(hist["step"]):
        fault, scale, amax = faults[step], hist["scale"][i], truth_amax[i]
        if not hist["skipped"][i]:
            c["applied"] += 1
            if fault in (_BURST, _NAN):
                c["injected_applied"] += 1  # an injected overflow got through: a failure
            continue
        c["skipped"] += 1
        if fault in (_BURST, _NAN) and hist["overflow"][i]:
            c["injected_skips"] += 1
        elif hist["underflow"][i] and amax * scale < thr:
            c["underflow_skips"] += 1
        elif hist["overflow"][i] and amax * scale > FP16_MAX:
            c["natural_overflows"] += 1
        else:
            c["unaccounted"] += 1
    return c


def _recoveries(schedule, scales: list[float], steps: int) -> list[int | None]:
    """Steps from the end of each burst until the scale is back at its pre-burst value (None: never)."""
    out = []
    starts = [s for s, _, _ in schedule] + [steps]
    for j, (start, length, kind) in enumerate(schedule):
        if kind != _BURST or start >= steps:
            continue
        pre, end, nxt = scales[start], start + length, min(starts[j + 1], steps)
        back = next((t - end for t in range(end, nxt) if scales[t] >= pre), None)
        out.append(back)
    return out


def run_soak(steps: int = 500_000, *, period: int = 2000, growth_interval: int = 100, seed: int = 0,
             chunk: int = 10_000, progress: bool = True) -> dict:
    """Run the soak; returns the JSON-ready summary (see the module docstring)."""
    torch.manual_seed(seed)
    shapes = [(32, 16), (16,)]
    params = [torch.nn.Parameter(torch.randn(s).half()) for s in shapes]
    scaler = DynamicScaler(growth_interval=growth_interval, min_scale_patience=1000)
    opt = MasterWeightOptimizer(params, "adamw", lr=1e-4, scaler=scaler)
    pool = [[torch.randn(s) for s in shapes] for _ in range(64)]
    pool_amax = [max(float(t.abs().max()) for t in grads) for grads in pool]
    schedule = fault_schedule(steps, period, seed)
    faults = _fault_at(schedule, steps)
    totals: dict[str, int] = {}
    scales: list[float] = []
    truth: list[float] = []
    nonfinite_masters = 0
    from tqdm.auto import tqdm

    with Timer() as timer:
        for step in tqdm(range(steps), desc="soak", disable=not progress, mininterval=1.0):
            k = step % len(pool)
            drift = 2.0 ** (3.0 * math.sin(2 * math.pi * step / 50_000))  # ~2.5 decades of slow drift
            mult = drift * _MULT.get(faults[step], 1.0)
            s = scaler.scale
            for p, g in zip(params, pool[k]):
                p.grad = (g * (mult * s)).half()
            if faults[step] == _NAN:
                params[0].grad[0, 0] = float("nan")
            truth.append(pool_amax[k] * mult)
            opt.step()
            if (step + 1) % chunk == 0 or step + 1 == steps:
                hist = scaler.history.to_dict()
                counts = _account(hist, truth, faults, scaler.underflow_threshold)
                totals = {key: totals.get(key, 0) + v for key, v in counts.items()}
                scales += hist["scale"]
                truth = []
                scaler.history = ScalerHistory()  # keep memory flat over 500k steps
                nonfinite_masters += sum(int(not torch.isfinite(m).all()) for m in opt.masters)
                nonfinite_masters += sum(int(not torch.isfinite(p).all()) for p in params)
    recov = _recoveries(schedule, scales, steps)
    kinds = [k for _, _, k in schedule]
    summary = {
        "steps": steps, "seconds": timer.seconds, "steps_per_second": steps / timer.seconds,
        "faults": {k: kinds.count(k) for k in (_BURST, _DROUGHT, _NAN)},
        "counts": totals, "optimizer_steps_taken": opt.steps_taken, "optimizer_skipped": opt.skipped_steps,
        "nonfinite_master_checks": nonfinite_masters,
        "bursts_recovered": sum(r is not None for r in recov), "bursts": len(recov),
        "max_recovery_steps": max((r for r in recov if r is not None), default=0),
        "final_scale": scaler.scale,
    }
    summary["ok"] = (nonfinite_masters == 0 and totals.get("unaccounted", 0) == 0
                     and totals.get("injected_applied", 0) == 0 and summary["bursts_recovered"] == len(recov)
                     and opt.steps_taken == totals.get("applied", 0)
                     and opt.skipped_steps == totals.get("skipped", 0))
    return summary


@keeps_threads
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opsnn_lab.bench soak", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500_000)
    ap.add_argument("--period", type=int, default=2000, help="steps between injected faults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for soak.json (default build/bench)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    summary = run_soak(args.steps, period=args.period, seed=args.seed)
    c = summary["counts"]
    print(machine_line())
    print(f"{summary['steps']:,} steps in {summary['seconds']:.1f} s ({summary['steps_per_second']:.0f}/s); "
          f"faults {summary['faults']}")
    print(f"applied {c['applied']:,}, skipped {c['skipped']:,} = injected {c['injected_skips']:,} + underflow "
          f"{c['underflow_skips']:,} + natural overflow {c['natural_overflows']:,} + unaccounted {c['unaccounted']}")
    print(f"bursts recovered {summary['bursts_recovered']}/{summary['bursts']} (max {summary['max_recovery_steps']} "
          f"steps); non-finite master checks {summary['nonfinite_master_checks']}; ok={summary['ok']}")
    print(f"wrote {write_json('soak', summary, args.out)}")
    return 0 if summary["ok"] else 1
