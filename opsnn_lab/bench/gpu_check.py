"""``python -m opsnn_lab.bench gpu_check``: everything that needs a CUDA GPU, in one command and one JSON.

1. ``pytest -m gpu`` (Triton kernels and fused ops against the reference on the device);
2. achieved GB/s of each Triton kernel (bytes each kernel must move, over its median time) against the
   device's copy bandwidth measured in the same run (and its nominal peak when the model is known);
3. the ops benchmark (``python -m opsnn_lab.bench ops``) on the GPU: fused vs eager vs torch.compile, at the
   CPU-sized shapes and again with ``--batch-scale`` (16 by default), where the kernels rather than their
   launches take the time;
4. a kernel profile of each row (:func:`kernel_profile`) at the CPU-sized shapes, or with ``--batch-scale``
   where one is given: kernels launched per step, the GPU's busy time against the step's wall time, and the
   fused step's costliest kernels;
5. whole models (:mod:`opsnn_lab.bench.models`: a Llama-style decoder with the fused head + loss, BERT-base,
   MobileNetV2, EfficientNet-B0): a training step fused/eager in time and activation bytes, fp32 and under bf16
   autocast;
6. where those steps spend their time (:mod:`opsnn_lab.bench.model_profile`): kernels and host waits per step,
   busy against wall time, the kernels the fused step adds and its costliest Python functions.

Writes ``build/bench/gpu_check.json``. On a machine without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from opsnn_lab.bench.common import format_table, machine_line, median_time, sync, write_json

__all__ = ["main", "kernel_bandwidth", "kernel_profile", "GPU_TEST_PATHS"]

NOMINAL_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10G": 600.0, "L4": 300.0}


def _nominal(name: str) -> float | None:
    return next((v for k, v in NOMINAL_GBS.items() if k in name), None)


def _copy_gbs(device) -> float:
    x = torch.empty(256 * 2**20 // 4, device=device)
    y = torch.empty_like(x)
    t = median_time(lambda: y.copy_(x), warmup=3, repeat=10, device=device)
    return 2 * x.nbytes / t / 1e9


def _rows_for(m: int, n: int, dtype: torch.dtype, device, timing: dict) -> list[dict]:
    from opsnn_lab.kernels import gelu_dropout as gd

    s = torch.finfo(dtype).bits // 8
    h = torch.randn(m, n, device=device, dtype=dtype)
    b = torch.randn(n, device=device, dtype=dtype) * 1e-3  # added into h in place on every timed call
    g = torch.randn(m, n, device=device, dtype=dtype)
    partial = 2 * 4 * ((m + 15) // 16) * n  # fp32 bias partials, written then read
    cases = {
        "gelu_dropout_fwd(bias)": (lambda: gd.gelu_dropout_fwd(h, 0.1, 1, 0, bias=b), 3 * s * m * n + s * n),
        "gelu_dropout_bwd(bias,out)": (lambda: gd.gelu_dropout_bwd(g, h, 0.1, 1, 0, want_bias=True, want_out=True),
                                       4 * s * m * n + partial),
    }
    rows = []
    for name, (fn, nbytes) in cases.items():
        t = median_time(fn, device=device, **timing)
        rows.append({"kernel": name, "shape": [m, n], "dtype": str(dtype).replace("torch.", ""),
                     "bytes": nbytes, "ms": t * 1e3, "gbs": nbytes / t / 1e9})
    return rows


def _rng_row(m: int, n: int, device, timing: dict) -> dict:
    from opsnn_lab.kernels import rng

    t = median_time(lambda: rng.random_bits16_triton(0, 0, m * n, device), device=device, **timing)
    return {"kernel": "rng_bits16", "shape": [m, n], "dtype": "int32", "bytes": 4 * m * n, "ms": t * 1e3,
            "gbs": 4 * m * n / t / 1e9}


def kernel_bandwidth(device="cuda", shapes=((1024, 3072), (16384, 3072)),
                     dtypes=(torch.float32, torch.bfloat16), warmup: int = 3, repeat: int = 20) -> list[dict]:
    """One row per (kernel, shape, dtype): bytes it must move, median seconds, GB/s."""
    rows, timing = [], {"warmup": warmup, "repeat": repeat}
    for m, n in shapes:
        for dtype in dtypes:
            rows += _rows_for(m, n, dtype, device, timing)
        rows.append(_rng_row(m, n, device, timing))
    return rows


_HOST_SYNCS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::item")  # reads that wait for the device
_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")  # the host blocked on the GPU


def _profiled(step, device, steps: int) -> dict:
    """Per step of ``step``: ``kernels``, host ``syncs`` (aten reads of a device value), ``waits`` (CUDA calls that
    block the host), ``busy_ms`` (kernel time summed), ``wall_ms``, and ``per_kernel`` {name: busy ms}."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.device(device).type == "cuda"
    step()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        wall = time.perf_counter() - t0
    want = DeviceType.CUDA if on_gpu else DeviceType.CPU
    # a CPU run counts the top-level aten calls (what a launch is on the GPU)
    events = [e for e in prof.events() if e.device_type == want and (on_gpu or e.cpu_parent is None)]
    per_kernel: dict[str, float] = {}
    for e in events:
        per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3 / steps
    host = [e.name for e in prof.events() if e.device_type == DeviceType.CPU]
    # the final sync(device) is outside the steps: one wait less
    waits = max(sum(name in _WAITS for name in host) - 1, 0) if on_gpu else 0
    return {"kernels": len(events) / steps, "syncs": sum(name in _HOST_SYNCS for name in host) / steps,
            "waits": waits / steps, "busy_ms": sum(per_kernel.values()), "wall_ms": wall * 1e3 / steps,
            "per_kernel": per_kernel}


def kernel_profile(chains, device="cuda", steps: int = 5, top: int = 5) -> list[dict]:
    """Per ``ops`` row (a :class:`~opsnn_lab.bench.ops.Chain`) and variant: kernels per forward+backward step, host
    syncs (``.item()``, ``nonzero``) per step, GPU busy ms (kernel time summed), wall ms, and the fused step's
    ``top`` costliest kernels. A step whose busy time is well under its wall time is bound by launches and Python,
    not by the kernels. On a CPU it counts aten calls instead of kernels (so the function is tested without a
    GPU)."""
    from opsnn_lab.bench.ops import _outputs, _step

    rows = []
    for chain in chains:
        grads = [torch.randn_like(o) for o in _outputs(chain.eager(*chain.inputs))]
        row = {"chain": chain.name}
        for variant in ("eager", "fused"):
            got = _profiled(_step(getattr(chain, variant), chain.inputs, grads), device, steps)
            row.update({f"{variant}_{key}": got[key] for key in ("kernels", "syncs", "busy_ms", "wall_ms")})
        worst = sorted(got["per_kernel"].items(), key=lambda kv: -kv[1])[:top]
        row["fused_top"] = [[name[:80], round(ms, 4)] for name, ms in worst]
        rows.append(row)
    return rows


# Where the tests marked gpu live (tests/bench/test_ops_bench.py keeps this list whole). Collecting only these
# lets a bare CUDA image without the notebook and widget stack (nbformat, plotly, anywidget) run them.
GPU_TEST_PATHS = ("tests/kernels", "tests/ops", "tests/consistency", "tests/test_memory.py",
                  "tests/fusion/test_gpu_models.py")


def _pytest(timeout: int) -> dict:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "--tb=short", "-p",
                               "no:cacheprovider", *GPU_TEST_PATHS], capture_output=True, text=True, timeout=timeout)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        tail = [ln for ln in lines if ln.startswith(("FAILED", "ERROR", "E  "))][:40] + lines[-3:]
        summary = tail[-1] if tail else ""
        print(f"pytest -m gpu: {summary}")
        return {"returncode": proc.returncode, "summary": summary, "tail": tail, "seconds": time.perf_counter() - t0}
    except subprocess.TimeoutExpired:
        return {"returncode": None, "summary": f"timed out after {timeout} s", "seconds": timeout}


def _ops_bench(no_compile: bool, batch_scale: int = 1) -> dict:
    from opsnn_lab.bench import ops

    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--device", "cuda", "--out", tmp, "--batch-scale", str(batch_scale)]
        argv += ["--no-compile"] if no_compile else []
        code = ops.main(argv)
        data = json.loads((Path(tmp) / "ops.json").read_text())
    return {"returncode": code, "rows": data["rows"], "skipped": data["skipped"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opsnn_lab.bench gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--skip-tests", action="store_true", help="do not run pytest -m gpu")
    ap.add_argument("--no-compile", action="store_true", help="ops benchmark without the torch.compile column")
    ap.add_argument("--test-timeout", type=int, default=300)
    ap.add_argument("--batch-scale", type=int, default=16,
                    help="second ops run with every batch this many times larger (default 16; 1: no second run)")
    ap.add_argument("--no-base-ops", action="store_true", help="skip the ops run at the CPU-sized shapes")
    ap.add_argument("--no-profile", action="store_true", help="skip the kernel profiles (per ops row and per model)")
    ap.add_argument("--no-models", action="store_true", help="skip the whole models (their training steps and profile)")
    ap.add_argument("--out", default=None, help="directory for gpu_check.json (default build/bench)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU present; nothing to check here "
              "(CPU figures: python -m opsnn_lab.bench ops)")
        return 0
    print(machine_line())
    name = torch.cuda.get_device_name()
    result = {"device": name, "copy_gbs": _copy_gbs("cuda"), "nominal_gbs": _nominal(name)}
    stages = [("tests", not args.skip_tests, lambda: _pytest(args.test_timeout)),
              ("kernels", True, lambda: _bandwidth(result["copy_gbs"])),
              ("ops", not args.no_base_ops, lambda: _ops_bench(args.no_compile)),
              ("ops_scaled", args.batch_scale > 1,
               lambda: {"batch_scale": args.batch_scale, **_ops_bench(args.no_compile, args.batch_scale)}),
              ("models", not args.no_models, _models),
              ("model_profile", not args.no_models and not args.no_profile, _model_profile),
              ("profile", not args.no_profile, lambda: _profile(args.batch_scale))]
    for key, wanted, run in stages:  # the JSON is written after each stage: a later failure loses nothing
        if wanted:
            result[key] = run()
            path = write_json("gpu_check", result, args.out)
    print(f"wrote {path}")
    codes = [result.get(k, {"returncode": 0})["returncode"] for k in ("tests", "ops", "ops_scaled")]
    return 1 if any(code != 0 for code in codes) else 0  # None: the tests timed out


def _bandwidth(copy_gbs: float) -> list[dict]:
    rows = kernel_bandwidth("cuda")
    for row in rows:
        row["of_copy"] = row["gbs"] / copy_gbs
        print(f"{row['kernel']:28s} {str(row['shape']):14s} {row['dtype']:9s} {row['gbs']:8.1f} GB/s "
              f"({row['of_copy']:.0%} of copy {copy_gbs:.0f} GB/s)")
    return rows


def _models() -> list[dict]:
    from opsnn_lab.bench.models import COLUMNS, model_rows

    rows = model_rows("cuda")
    print(format_table(rows, COLUMNS))
    return rows


def _model_profile() -> list[dict]:
    from opsnn_lab.bench.model_profile import model_profile, print_rows

    rows = model_profile("cuda")
    print_rows(rows)
    return rows


def _profile(batch_scale: int) -> list[dict]:
    from opsnn_lab.bench.ops import FULL, build_chains, scaled

    rows = kernel_profile(build_chains(scaled(FULL, batch_scale), "cuda")[0])
    print(format_table(rows, ["chain", "eager_kernels", "fused_kernels", "fused_syncs", "eager_busy_ms",
                              "eager_wall_ms", "fused_busy_ms", "fused_wall_ms"]))
    for row in rows:
        print(row["chain"], row["fused_top"])
    return rows
