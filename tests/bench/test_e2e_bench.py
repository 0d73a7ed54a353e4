"""The e2e benchmark runs CI-sized: every column present, the seed's invariants hold, the CPU is named."""

from __future__ import annotations

import json

import pytest
import torch

from opsnn_lab.bench import e2e, machine


@pytest.mark.slow
def test_quick_e2e(tmp_path):
    assert e2e.main(["--quick", "--variants", "eager,opsnn-strict", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "e2e.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"eager", "opsnn-strict"}
    strict = rows["opsnn-strict"]
    assert strict["runs_bit_identical"], "two strict runs with one seed must agree bit for bit"
    assert strict["nan_steps"] == 0
    assert strict["activation_ratio"] < 1.0, "fusion must save activation memory"
    assert abs(strict["loss_vs_eager"]) < 0.02
    md = (tmp_path / "e2e.md").read_text()
    assert md.startswith("# e2e (quick") and "\nmachine: " in md
    cpu = data["machine"]["cpu"]
    assert cpu["capability"] == torch.backends.cpu.get_cpu_capability()
    assert isinstance(cpu["bf16_gemm"]["native"], bool) and cpu["model"]


@pytest.mark.slow
def test_quick_e2e_fused_chains_keep_their_memory_win_under_autocast(tmp_path):
    assert e2e.main(["--quick", "--variants", "eager,amp,amp-fused", "--out", str(tmp_path)]) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "e2e.json").read_text())["rows"]}
    amp, fused = rows["amp"], rows["amp-fused"]
    assert fused["activation_ratio"] < 0.95 * amp["activation_ratio"]  # the fused ops run under autocast
    assert fused["nan_steps"] == 0 and abs(fused["final_loss"] / amp["final_loss"] - 1) < 0.05
    assert fused["runs_bit_identical"] or fused["runs_cosine"] > 0.9999


def test_rejects_unknown_variant():
    with pytest.raises(SystemExit):
        e2e.main(["--variants", "eager,turbo"])


def _fake_run(variant, size, steps, lr, tmp, run):
    """A worker's summary without the worker: amp 26x slower than eager, as on an AVX2-only CPU."""
    speed = {"eager": 100.0, "amp": 100.0 / 26, "opsnn": 105.0, "opsnn-strict": 99.0}[variant]
    return {"variant": variant, "samples_per_s": speed, "activation_bytes": 1000 if variant == "eager" else 500,
            "peak_rss_mib": 10.0, "nan_steps": 0, "skipped_steps": 0, "final_loss": 3.0, "losses": [4.0, 3.0],
            "logits": torch.ones(2, 3)}


@pytest.fixture
def cpu(monkeypatch):
    """``cpu(bf16_ratio, flags)``: the probe and cpuinfo say what the test needs."""

    def install(ratio, flags):
        monkeypatch.setattr(machine, "_read_cpuinfo", lambda: f"model name\t: Test CPU\nflags\t\t: {flags}\n")
        monkeypatch.setattr(machine, "probe_gemm_ratios", lambda: {"bf16": ratio, "fp16": ratio})
        machine.cpu_info(refresh=True)

    monkeypatch.setattr(e2e, "_run", _fake_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for var in machine.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    yield install
    machine._CACHE.clear()


def test_emulated_amp_is_marked_in_table_and_json(tmp_path, cpu, capsys):
    cpu(26.0, "avx avx2 fma")
    assert e2e.main(["--quick", "--variants", "eager,amp", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    note = "bf16 emulated on this CPU: no AVX512-BF16/AMX"
    assert f"| amp ({note}) |" in out
    machine_lines = [line for line in out.splitlines() if line.startswith("machine: Test CPU")]
    assert len(machine_lines) == 1 and out.index(machine_lines[0]) < out.index("| variant")
    data = json.loads((tmp_path / "e2e.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert rows["amp"]["emulated"] == note and rows["eager"]["emulated"] is None
    assert rows["amp"]["throughput_ratio"] == pytest.approx(1 / 26)
    assert data["machine"]["cpu"]["model"] == "Test CPU" and data["machine"]["cpu"]["bf16_gemm"]["native"] is False
    assert f"amp ({note})" in (tmp_path / "e2e.md").read_text()


def test_native_amp_is_not_marked(tmp_path, cpu, capsys):
    cpu(0.9, "avx2 avx512f avx512_bf16 amx_bf16")
    assert e2e.main(["--quick", "--variants", "eager,amp", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "emulated" not in out and "| amp " in out
    rows = {r["variant"]: r for r in json.loads((tmp_path / "e2e.json").read_text())["rows"]}
    assert rows["amp"]["emulated"] is None


def test_table_rows_label_only_the_emulated_variant():
    rows = [{"variant": "eager", "throughput_ratio": 1.0, "emulated": None},
            {"variant": "amp", "throughput_ratio": 0.04, "emulated": "bf16 emulated on this CPU: x"}]
    assert e2e.table_rows(rows) == [{"variant": "eager", "throughput_ratio": 1.0},
                                    {"variant": "amp (bf16 emulated on this CPU: x)", "throughput_ratio": 0.04}]
