"""Dumps of a divergence: the diverging op's tensors from both runs, the report, and a replay script.

A dump holds only the diverging ops (kilobytes to megabytes), never every tensor of the step::

    <dump_dir>/divergence_000/
        forward_op.pt    args/kwargs, outputs and the gradients of that op, from the run and the reference
        backward_op.pt   the same for the first backward divergence (when there is one)
                         (neither for an event past a trace's memory limit: it kept statistics only)
        report.json      the whole report
        replay.py        ``python replay.py`` reruns each op from its dump and prints the errors

Everything is written under ``dump_dir`` and nowhere else; the replay script imports only torch.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from opsnn_lab.consistency.records import portable, unflatten

__all__ = ["write_dump", "REPLAY_SCRIPT"]

REPLAY_SCRIPT = '''"""Rerun the diverging op(s) of this dump and print their errors (needs only torch)."""
import sys
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten

HERE = Path(__file__).resolve().parent


def errors(run, ref, floor):
    x, y = run.detach().double().flatten(), ref.detach().double().flatten()
    if x.shape != y.shape:
        return float("inf"), float("inf"), float("nan")
    if x.numel() == 0:
        return 0.0, 0.0, 1.0
    d = torch.where(x == y, torch.zeros_like(x), (x - y).abs()).nan_to_num(nan=float("inf"))
    rel = d / y.abs().nan_to_num(nan=0.0, posinf=0.0).clamp_min(floor)
    nx, ny = x.norm().item(), y.norm().item()
    cos = 1.0 if nx == ny == 0 else (torch.dot(x, y).item() / (nx * ny) if nx and ny else 0.0)
    return d.max().item(), rel.max().item(), cos


def restore(a):
    # memory formats and layouts are stored by name ("__torch_attr__", "contiguous_format")
    if isinstance(a, tuple) and len(a) == 2 and a[0] == "__torch_attr__":
        return getattr(torch, a[1])
    if isinstance(a, (list, tuple)):
        return type(a)(restore(x) for x in a)
    if isinstance(a, dict):
        return {k: restore(v) for k, v in a.items()}
    return a


def resolve(name):
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def replay(path):
    d = torch.load(path, weights_only=False)
    op = resolve(d["aten_op"])
    outs = {}
    for side in ("run", "reference"):
        args, kwargs = restore(d[side]["args"]), restore(d[side]["kwargs"])
        out = op(*args, **kwargs)
        outs[side] = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        same = all(torch.equal(a, b) for a, b in zip(outs[side], d[side]["outputs"]))
        print(f"{path.name}: {side} replayed bit-identical to its recorded outputs: {same}")
    print(f"{path.name}: {d['phase']} {d['module_path'] or '<root>'} {d['aten_op']} at {d['location']}")
    for i, (a, b) in enumerate(zip(outs["run"], d["reference"]["outputs"])):
        mae, mre, cos = errors(a, b, d["floor"])
        print(f"{path.name}: output {i}: max_abs_err={mae:.9e} max_rel_err={mre:.9e} cosine={cos:.9f}")


if __name__ == "__main__":
    names = sys.argv[1:] or sorted(p.name for p in HERE.glob("*_op.pt"))
    for name in names:
        replay(HERE / name)
'''


def _side(rec, grads) -> dict:
    flat = [portable(a) for a in rec.flat_args or []]
    args, kwargs = unflatten(flat, rec.spec) if rec.flat_args is not None else ((), {})
    return {"args": args, "kwargs": kwargs, "outputs": [t.detach().cpu() for t in rec.outputs or []],
            "grads": [{"op": g.op, "outputs": [t.detach().cpu() for t in g.outputs or []]} for g in grads]}


def _grads(trace_records: list, fwd_index: int) -> list:
    return [r for r in trace_records if r.phase == "backward" and r.forward_index == fwd_index]


def _next_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    taken = {p.name for p in root.iterdir()}
    n = 0
    while f"divergence_{n:03d}" in taken:
        n += 1
    out = root / f"divergence_{n:03d}"
    out.mkdir()
    return out


def write_dump(dump_dir: str | os.PathLike, report, records: dict, run_trace=None, ref_trace=None) -> Path:
    """Write the report's first forward and backward divergences under ``dump_dir``; return the folder."""
    out = _next_dir(Path(dump_dir))
    for div in (report.forward_divergence, report.backward_divergence):
        if div is None:
            continue
        run, ref = records[div.index]
        payload = {"aten_op": div.aten_op, "phase": div.phase, "module_path": div.module_path,
                   "location": div.location, "max_abs_err": div.max_abs_err, "max_rel_err": div.max_rel_err,
                   "floor": max(report.rows[div.index].atol, 2.2250738585072014e-308),
                   "run": _side(run, _grads(run_trace.records, run.index) if run_trace else []),
                   "reference": _side(ref, _grads(ref_trace.records, ref.index) if ref_trace else [])}
        if run.kind == "op" and not (run.summarised or ref.summarised):  # summarised: no tensors to replay
            torch.save(payload, out / f"{div.phase}_op.pt")
    (out / "report.json").write_text(report.to_json(indent=1))
    (out / "replay.py").write_text(REPLAY_SCRIPT)
    return out
