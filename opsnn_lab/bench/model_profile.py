"""Where a whole model's fused training step spends its time: the kernels and host waits the fused step adds
over eager, and the Python functions that take its host time.

Per model of :mod:`opsnn_lab.bench.models` and precision: kernels, host syncs (aten reads of a device value) and
waits (CUDA calls that block the host) per step, GPU busy ms against wall ms for eager and fused, the kernels
whose summed time grew most, and the fused step's costliest Python functions by own time (``cProfile``, which
slows Python down: read them as shares, not as times). A step whose wall time is well over its busy time is
bound by the host; a wait in it means the host cannot run ahead of the GPU, so every microsecond of Python
after it adds to the step. Run by ``python -m opsnn_lab.bench gpu_check``, or alone:
``python -m opsnn_lab.bench model_profile [--device cpu|cuda] [--quick] [--models ...]``; on a CPU it counts
top-level aten calls instead of kernels (and no waits). Writes ``build/bench/model_profile.json``.
"""

from __future__ import annotations

import cProfile
import pstats

from opsnn_lab.bench.common import format_table, keeps_threads, machine_line, write_json
from opsnn_lab.measuring import sync

__all__ = ["main", "model_profile", "host_functions", "COLUMNS"]

COLUMNS = ["model", "precision", "eager_kernels", "fused_kernels", "fused_syncs", "fused_waits", "eager_busy_ms",
           "eager_wall_ms", "fused_busy_ms", "fused_wall_ms", "error"]


def host_functions(step, device, steps: int = 3, top: int = 12) -> list[list]:
    """``top`` functions by own time over ``steps`` calls of ``step``: ``[where, own ms, calls]`` per step."""
    step()
    sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    sync(device)
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]  # (file, line, name) -> (cc, nc, tt, ct, callers)
    return [[f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line}:{name}"[:90], round(tt * 1e3 / steps, 3),
             round(nc / steps, 1)] for (file, line, name), (_, nc, tt, _, _) in rows]


def _rows(name: str, model, inputs: dict, device, steps: int, top: int, precisions) -> list[dict]:
    from opsnn_lab.bench.gpu_check import _profiled
    from opsnn_lab.bench.models import training_steps

    model, fused, _, _, _, step = training_steps(model, inputs, device)
    rows = []
    for amp in precisions:
        row, got = {"model": name, "precision": "bf16 autocast" if amp else "fp32"}, {}
        for variant, m in (("eager", model), ("fused", fused)):
            got[variant] = _profiled(lambda m=m, v=variant, amp=amp: step(m, v == "fused", amp), device, steps)
            row.update({f"{variant}_{k}": got[variant][k] for k in ("kernels", "syncs", "waits", "busy_ms", "wall_ms")})
        eager_k, fused_k = got["eager"]["per_kernel"], got["fused"]["per_kernel"]
        grew = {k: fused_k.get(k, 0.0) - eager_k.get(k, 0.0) for k in set(eager_k) | set(fused_k)}
        row["kernels_grown"] = [[k[:80], round(ms, 4)] for k, ms in sorted(grew.items(), key=lambda kv: -kv[1])[:top]
                                if ms > 0]
        row["host_top"] = host_functions(lambda amp=amp: step(fused, True, amp), device, steps, top)
        rows.append(row)
    return rows


def model_profile(device="cuda", names=None, quick: bool = False, steps: int = 3, top: int = 8,
                  bf16: bool = True) -> list[dict]:
    """Rows as described in the module docstring; ``quick``: the zoo's tiny models (any of
    ``opsnn_lab.demos.zoo``); a model that fails gets a row with its error."""
    from opsnn_lab.bench.models import MODELS, each_model

    precisions = (False, True) if bf16 else (False,)
    return each_model(names or MODELS, device, quick,
                      lambda name, model, inputs: _rows(name, model, inputs, device, steps, top, precisions))


def print_rows(rows: list[dict]) -> None:
    print(format_table(rows, [c for c in COLUMNS if any(c in r for r in rows)]))
    for row in rows:
        if "error" not in row:
            print(row["model"], row["precision"], "kernels grown:", row["kernels_grown"])
            print(row["model"], row["precision"], "host:", row["host_top"])


@keeps_threads
def main(argv: list[str] | None = None) -> int:
    from opsnn_lab.bench.models import model_arguments, parse_model_arguments

    ap = model_arguments("model_profile", __doc__)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per variant")
    ap.add_argument("--top", type=int, default=8, help="kernels and Python functions listed per row")
    ap.add_argument("--no-bf16", action="store_true", help="fp32 only")
    args = parse_model_arguments(ap, argv)
    if args.steps < 1 or args.top < 1:
        ap.error(f"--steps and --top must be >= 1, got {args.steps} and {args.top}")
    rows = model_profile(args.device, args.models, quick=args.quick, steps=args.steps, top=args.top,
                         bf16=not args.no_bf16)
    print(machine_line())
    print_rows(rows)
    path = write_json("model_profile", {"device": args.device, "quick": args.quick, "steps": args.steps,
                                        "rows": rows}, args.out)
    print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0
