"""Peak tensor bytes of a ConsistencyChecker-traced training step over the untraced step's, per memory_limit.

The step is the consistency sweep's (``hf_consistency_sweep.py``: a tiny config, reproducible dropout, a
projected loss, every gradient); the peak is ``measuring.peak_bytes`` (tensor storages alive at once). Prints
the reference trace's and a compared trace's ratio and time per limit:

    python scripts/checker_memory.py FalconH1 --limits none 256MiB 64MiB
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

import opsnn_lab as ol
from opsnn_lab.measuring import peak_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_consistency_sweep as C  # noqa: E402 - the sweep's step
import hf_sweep as S  # noqa: E402 - the sweep's builders


def measure(name: str, limits: list) -> list[dict]:
    """One row per limit: untraced peak, the reference's and a compared trace's peak ratios, and their times."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, inputs = S.build_running(name, torch.float32, {})

        def step():
            C._step(model, inputs)

        step()
        plain = peak_bytes(step)
        rows = []
        for limit in limits:
            checker = ol.consistency.ConsistencyChecker(precision=1e-12, dump_on_failure=False, memory_limit=limit)

            def traced(checker=checker):
                with checker.trace(model):
                    step()

            t0 = time.perf_counter()
            ref = peak_bytes(traced)
            t1 = time.perf_counter()
            compared = peak_bytes(traced)
            t2 = time.perf_counter()
            rows.append({"model": name, "memory_limit": limit, "step_peak_MiB": plain / 2**20,
                         "reference_ratio": ref / plain, "compared_ratio": compared / plain,
                         "reference_s": t1 - t0, "compared_s": t2 - t1, "ok": checker.report.ok,
                         "summarised": f"{checker.last_trace.summarised}/{len(checker.last_trace)}"})
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a Hugging Face architecture as the sweeps name it (FalconH1, Llama, ...)")
    ap.add_argument("--limits", nargs="+", default=["none", "256MiB", "64MiB"], help="memory_limit values; 'none'")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = measure(args.model, [None if v == "none" else v for v in args.limits])
    for r in rows:
        print(f"{r['model']}: memory_limit {r['memory_limit']}: untraced peak {r['step_peak_MiB']:.0f} MiB; "
              f"reference {r['reference_ratio']:.2f}x ({r['reference_s']:.1f} s), compared "
              f"{r['compared_ratio']:.2f}x ({r['compared_s']:.1f} s); ok {r['ok']}, summarised {r['summarised']}")
    return rows


if __name__ == "__main__":
    main()
