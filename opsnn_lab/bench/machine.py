"""Where a benchmark ran: CPU model, cores, ISA, native or emulated bf16/fp16 GEMMs, library versions.

Every bench JSON carries ``machine_info()`` and every bench table has ``machine_line()`` above it, so a
figure never travels without its CPU. The same table flips from one CPU to the next: autocast's bf16 is
1.5x faster than fp32 where AMX runs it and 26x slower where it is emulated (AVX2 only).

Whether a low-precision GEMM is native is decided from two pieces of evidence, both recorded:
the CPU's flags (``/proc/cpuinfo``: ``amx_bf16``/``avx512_bf16``, ``amx_fp16``/``avx512_fp16``) and a
timed probe (a 128x128 GEMM in that dtype against fp32, one thread, best of 10). The probe also catches
a library held below the CPU's ISA (``ONEDNN_MAX_CPU_ISA=AVX2`` emulates bf16 on an AMX CPU). No extra
dependency: everything comes from the standard library, ``/proc/cpuinfo`` and torch.
"""

from __future__ import annotations

import os
import platform
import re
import time
from datetime import datetime, timezone

import torch

__all__ = ["machine_info", "cpu_info", "machine_line", "emulated_note", "gemm_verdict", "EMULATED_RATIO"]

# Probe time of a 128x128 GEMM against fp32 above which a dtype counts as emulated. Measured on an AMX
# Xeon (1 thread): bf16 on AMX 0.9-1.0x, fp16 on AVX512-FP16 1.9x, bf16 on AVX512-BF16 alone 2.2-2.7x;
# bf16 on plain AVX-512 5.7x, bf16/fp16 on AVX2 36-48x.
EMULATED_RATIO = 4.0
# the flags that make a dtype's GEMM native, and how a message names them
NATIVE_FLAGS = {"bf16": (("amx_bf16", "avx512_bf16"), "AVX512-BF16/AMX"),
                "fp16": (("amx_fp16", "avx512_fp16"), "AVX512-FP16/AMX-FP16")}
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
ENV_VARS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_CACHE: dict[str, dict] = {}


def _read_cpuinfo(path: str = "/proc/cpuinfo") -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # not Linux
        return None


def parse_cpuinfo(text: str | None) -> dict:
    """``{"model", "physical_cores", "flags"}`` from ``/proc/cpuinfo`` text (``None`` where unknown)."""
    if not text:
        return {"model": None, "physical_cores": None, "flags": None}
    model, flags, cores, phys = None, None, set(), "0"
    for line in text.splitlines():
        key, _, value = (s.strip() for s in line.partition(":"))
        if key == "model name" and model is None:
            model = value
        elif key == "flags" and flags is None:
            flags = set(value.split())
        elif key == "physical id":
            phys = value
        elif key == "core id":
            cores.add((phys, value))
    return {"model": model, "physical_cores": len(cores) or None,
            "flags": sorted(flags) if flags is not None else None}


def probe_gemm_ratios(n: int = 128, repeat: int = 10) -> dict[str, float]:
    """Time of an ``n x n`` GEMM in bf16 and fp16 over fp32 (best of ``repeat``, interleaved, one thread).

    One thread, because on a shared machine OpenMP barriers make multi-thread timings of a tiny GEMM
    swing 30x; the question is which instructions run, not how they scale. Takes 5-60 ms.
    """
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    pairs = {"fp32": (a, b), **{k: (a.to(d), b.to(d)) for k, d in _DTYPES.items()}}
    best = dict.fromkeys(pairs, float("inf"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for x, y in pairs.values():
            x @ y  # first call: library dispatch and packing
        for _ in range(repeat):
            for k, (x, y) in pairs.items():
                t0 = time.perf_counter()
                x @ y
                best[k] = min(best[k], time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return {k: best[k] / best["fp32"] for k in _DTYPES}


def gemm_verdict(dtype: str, ratio: float, flags: list[str] | None) -> dict:
    """Native or emulated, from the probe's ``ratio`` (dtype time / fp32 time) and the CPU ``flags``.

    Flags without speed (a library held below the CPU's ISA) or speed without flags both read emulated;
    without cpuinfo (not Linux) the probe decides alone. ``decided_by`` says which evidence ruled.
    """
    needed, name = NATIVE_FLAGS[dtype]
    fast = ratio < EMULATED_RATIO
    probe = f"probe {ratio:.1f}x fp32"
    if flags is None:
        native, why = fast, f"{probe} (no cpuinfo flags)"
    else:
        present = [f for f in needed if f in flags]
        if not present:
            native, why = False, f"cpuinfo: no {name} ({probe})"
        elif fast:
            native, why = True, f"cpuinfo {'+'.join(present)} and {probe} agree"
        else:
            native, why = False, f"{probe} despite cpuinfo {'+'.join(present)}: the library runs below the CPU's ISA"
    return {"native": native, "time_vs_fp32": round(ratio, 3), "decided_by": why}


def _versions() -> dict:
    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version (\S+?)(?:-Product)?\s", config)
    dnn = re.search(r"(?:MKL-DNN|oneDNN) v(\S+)", config)
    return {"mkl": mkl.group(1) if mkl and torch.backends.mkl.is_available() else None,
            "onednn": dnn.group(1) if dnn and torch.backends.mkldnn.is_available() else None}


def cpu_info(refresh: bool = False) -> dict:
    """The CPU block of ``machine_info()``; probed once per process (``refresh=True`` probes again)."""
    if refresh or "cpu" not in _CACHE:
        parsed = parse_cpuinfo(_read_cpuinfo())
        flags = parsed["flags"]
        ratios = probe_gemm_ratios()
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        _CACHE["cpu"] = {
            "model": parsed["model"] or platform.processor() or platform.machine(),
            "physical_cores": parsed["physical_cores"],
            "logical_cpus": os.cpu_count(),
            "usable_cpus": usable,
            "capability": torch.backends.cpu.get_cpu_capability(),
            "isa_flags": None if flags is None else [f for f in ISA_FLAGS if f in flags],
            **{f"{k}_gemm": gemm_verdict(k, ratios[k], flags) for k in _DTYPES},
        }
    return _CACHE["cpu"]


def machine_info() -> dict:
    """The block every bench JSON carries under ``"machine"``."""
    cpu = cpu_info()
    info = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "platform": platform.platform(),
        "processor": cpu["model"],
        "cpus": cpu["logical_cpus"],
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "torch": torch.__version__,
        **_versions(),
        "python": platform.python_version(),
        "env": {k: os.environ.get(k) for k in ENV_VARS},
        "cpu": cpu,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def machine_line(info: dict | None = None) -> str:
    """``machine_info()`` as the one line printed above a bench table."""
    info = info or machine_info()
    cpu = info["cpu"]
    cores = f"{cpu['physical_cores'] or cpu['logical_cpus']} cores ({cpu['usable_cpus']} usable)"
    gemms = ", ".join(f"{k} GEMM {'native' if v['native'] else 'EMULATED'} ({v['time_vs_fp32']:.1f}x fp32)"
                      for k in _DTYPES for v in [cpu[f"{k}_gemm"]])
    libs = ", ".join(f"{k} {info[k]}" for k in ("torch", "mkl", "onednn") if info.get(k))
    env = " ".join(f"{k}={v}" for k, v in info["env"].items() if v is not None)
    parts = [cpu["model"], cores, f"ATen {cpu['capability']}", gemms, libs, f"{info['threads']} threads"]
    if env:
        parts.append(env)
    if info.get("gpu"):
        parts.append(f"GPU {info['gpu']}")
    return "machine: " + ", ".join(parts)


def emulated_note(dtype: torch.dtype) -> str | None:
    """``"bf16 emulated on this CPU: no AVX512-BF16/AMX"`` when ``dtype``'s GEMM is not native, else None."""
    key = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    if key is None:
        return None
    verdict = cpu_info()[f"{key}_gemm"]
    if verdict["native"]:
        return None
    name = NATIVE_FLAGS[key][1]
    if verdict["decided_by"].startswith("cpuinfo: no"):
        return f"{key} emulated on this CPU: no {name}"
    limits = " ".join(f"{k}={v}" for k in ENV_VARS[:3] if (v := os.environ.get(k)))
    note = f"{key} emulated on this CPU: GEMM {verdict['time_vs_fp32']:.0f}x fp32"
    return f"{note} under {limits}" if limits else note
