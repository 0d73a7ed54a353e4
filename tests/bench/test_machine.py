"""The machine block: every bench JSON says which CPU, ISA and libraries its figures come from."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from opsnn_lab.bench import common, machine

# /proc/cpuinfo excerpts: the AVX2-only AMD EPYC of issue 13's figures, and an AMX Xeon (two cores, one socket)
EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7763 64-Core Processor
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse2 avx avx2 fma f16c
processor\t: 1
model name\t: AMD EPYC 7763 64-Core Processor
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse2 avx avx2 fma f16c
"""
XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
physical id\t: 0
core id\t\t: 0
flags\t\t: avx2 avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16
processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
physical id\t: 0
core id\t\t: 1
flags\t\t: avx2 avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16
"""


@pytest.fixture
def fake_cpu(monkeypatch):
    """Probe and cpuinfo replaced: ``fake_cpu(cpuinfo_text, {"bf16": ratio, "fp16": ratio})``."""

    def install(text, ratios):
        monkeypatch.setattr(machine, "_read_cpuinfo", lambda: text)
        monkeypatch.setattr(machine, "probe_gemm_ratios", lambda: dict(ratios))
        return machine.cpu_info(refresh=True)

    yield install
    machine._CACHE.clear()


def test_parse_cpuinfo():
    epyc = machine.parse_cpuinfo(EPYC)
    assert epyc == {"model": "AMD EPYC 7763 64-Core Processor", "physical_cores": 1,  # 2 threads of one core
                    "flags": ["avx", "avx2", "f16c", "fma", "fpu", "sse2"]}
    xeon = machine.parse_cpuinfo(XEON)
    assert xeon["physical_cores"] == 2 and "amx_bf16" in xeon["flags"]
    assert machine.parse_cpuinfo(None) == {"model": None, "physical_cores": None, "flags": None}


@pytest.mark.parametrize("ratio, flags, native, evidence", [
    (0.9, ["amx_bf16", "avx512_bf16"], True, "amx_bf16+avx512_bf16 and probe 0.9x fp32 agree"),
    (36.0, ["amx_bf16", "avx512_bf16"], False, "despite cpuinfo"),   # ONEDNN_MAX_CPU_ISA=AVX2 on an AMX CPU
    (26.0, ["avx2"], False, "cpuinfo: no AVX512-BF16/AMX"),
    (1.2, ["avx2", "avx512f"], False, "cpuinfo: no AVX512-BF16/AMX"),  # cheap, yet no bf16 instructions
    (1.0, None, True, "no cpuinfo flags"),
    (30.0, None, False, "no cpuinfo flags"),
])
def test_gemm_verdict(ratio, flags, native, evidence):
    v = machine.gemm_verdict("bf16", ratio, flags)
    assert v["native"] is native and evidence in v["decided_by"]
    assert v["time_vs_fp32"] == pytest.approx(ratio)


def test_fp16_needs_fp16_flags():
    assert not machine.gemm_verdict("fp16", 1.0, ["amx_bf16", "avx512_bf16"])["native"]
    assert machine.gemm_verdict("fp16", 1.9, ["avx512_fp16"])["native"]


def test_probe_measures_both_dtypes_and_restores_threads():
    threads = torch.get_num_threads()
    ratios = machine.probe_gemm_ratios(n=32, repeat=2)
    assert set(ratios) == {"bf16", "fp16"} and all(r > 0 for r in ratios.values())
    assert torch.get_num_threads() == threads


def test_probe_ratios_are_dtype_time_over_fp32(monkeypatch):
    # the GEMMs run for real, the clock is fake: fp32, bf16, fp16 take 2, 6, 10 ticks, round-robin
    ticks, state = itertools.cycle([2.0, 6.0, 10.0]), {"now": 0.0, "start": True}

    def clock():
        if not state["start"]:
            state["now"] += next(ticks)
        state["start"] = not state["start"]
        return state["now"]

    monkeypatch.setattr(machine.time, "perf_counter", clock)
    assert machine.probe_gemm_ratios(n=8, repeat=3) == {"bf16": 3.0, "fp16": 5.0}


def test_machine_block_keys_and_types(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    info = machine.machine_info()
    for key, typ in [("date", str), ("platform", str), ("processor", str), ("cpus", int), ("threads", int),
                     ("interop_threads", int), ("torch", str), ("python", str), ("env", dict), ("cpu", dict)]:
        assert isinstance(info[key], typ), key
    assert info["threads"] == torch.get_num_threads() and info["torch"] == torch.__version__
    assert info["mkl"] is None or isinstance(info["mkl"], str)
    assert info["onednn"] is None or isinstance(info["onednn"], str)
    if torch.backends.mkl.is_available():
        assert info["mkl"] and info["mkl"][0].isdigit()
    assert info["env"] == {"ATEN_CPU_CAPABILITY": None, "MKL_ENABLE_INSTRUCTIONS": None, "ONEDNN_MAX_CPU_ISA": "AVX2",
                           "OMP_NUM_THREADS": info["env"]["OMP_NUM_THREADS"]}
    cpu = info["cpu"]
    assert cpu["capability"] == torch.backends.cpu.get_cpu_capability()
    assert isinstance(cpu["model"], str) and cpu["model"]
    assert isinstance(cpu["logical_cpus"], int) and 1 <= cpu["usable_cpus"] <= cpu["logical_cpus"]
    assert cpu["physical_cores"] is None or 1 <= cpu["physical_cores"] <= cpu["logical_cpus"]
    assert cpu["isa_flags"] is None or set(cpu["isa_flags"]) <= set(machine.ISA_FLAGS)
    for key in ("bf16_gemm", "fp16_gemm"):
        assert isinstance(cpu[key]["native"], bool) and isinstance(cpu[key]["time_vs_fp32"], float)
        assert isinstance(cpu[key]["decided_by"], str) and "probe" in cpu[key]["decided_by"]
    assert ("gpu" in info) == torch.cuda.is_available()
    json.dumps(info)  # plain JSON, no default= needed


def test_the_block_is_probed_once_per_process(monkeypatch, fake_cpu):
    fake_cpu(XEON, {"bf16": 1.0, "fp16": 1.9})
    monkeypatch.setattr(machine, "probe_gemm_ratios", lambda: pytest.fail("probed twice"))
    assert machine.cpu_info()["bf16_gemm"]["native"]


def test_every_bench_json_carries_the_block(tmp_path, fake_cpu):
    fake_cpu(EPYC, {"bf16": 26.0, "fp16": 30.0})
    path = common.write_json("demo", {"rows": []}, tmp_path)
    data = json.loads(path.read_text())
    assert data["benchmark"] == "demo" and data["rows"] == []
    assert data["machine"]["cpu"]["model"] == "AMD EPYC 7763 64-Core Processor"
    assert data["machine"]["cpu"]["bf16_gemm"]["native"] is False


def test_machine_line(monkeypatch, fake_cpu):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    fake_cpu(EPYC, {"bf16": 26.0, "fp16": 30.0})
    line = machine.machine_line()
    assert line.startswith("machine: AMD EPYC 7763 64-Core Processor, 1 cores")
    assert "bf16 GEMM EMULATED (26.0x fp32)" in line and "fp16 GEMM EMULATED" in line
    assert "ATEN_CPU_CAPABILITY=avx2" in line and f"torch {torch.__version__}" in line
    assert "\n" not in line


def test_emulated_note(monkeypatch, fake_cpu):
    for var in machine.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    fake_cpu(EPYC, {"bf16": 26.0, "fp16": 30.0})
    assert machine.emulated_note(torch.bfloat16) == "bf16 emulated on this CPU: no AVX512-BF16/AMX"
    assert machine.emulated_note(torch.float16) == "fp16 emulated on this CPU: no AVX512-FP16/AMX-FP16"
    assert machine.emulated_note(torch.float32) is None
    fake_cpu(XEON, {"bf16": 0.9, "fp16": 1.9})
    assert machine.emulated_note(torch.bfloat16) is None
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    fake_cpu(XEON, {"bf16": 36.0, "fp16": 45.0})
    note = machine.emulated_note(torch.bfloat16)
    assert note == "bf16 emulated on this CPU: GEMM 36x fp32 under ONEDNN_MAX_CPU_ISA=AVX2"
