import json

import torch

from opsnn_lab.bench import precision


def test_step_time_ratio_reports_every_variant():
    out = precision.step_time_ratio(numel=20_000, repeat=1)
    assert set(out["ratio"]) == {"gradscaler_adamw_foreach", "master_fused", "master_fused_no_underflow_stats"}
    seconds, base = out["seconds"], out["seconds"]["gradscaler_adamw_foreach"]
    assert set(seconds) == set(out["ratio"]) and all(0 < t < 60 for t in seconds.values())
    # each ratio is that variant's time over the baseline's, measured in the same run
    assert out["ratio"] == {k: t / base for k, t in seconds.items()}
    # every variant steps the same transformer-like mix of about numel elements
    assert 0.8 * 20_000 <= out["numel"] <= 1.2 * 20_000 and out["tensors"] >= 13


def test_peak_grad_bytes_counts_what_is_alive():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    loss = model(torch.ones(3, 8)).sum()
    total = sum(p.numel() * 4 for p in model.parameters())
    assert precision.peak_grad_bytes(model, loss.backward) == total


def test_pipelined_saves_gradient_memory():
    mem = precision.pipelined_memory(hidden=16, layers=1)
    assert mem["plain"] == mem["param_grad_bytes"]
    assert mem["pipelined"] < mem["plain"] / 2 and 0.5 < mem["saved_fraction"] < 1.0


def test_main_writes_json(tmp_path):
    assert precision.main(["--numel", "20000", "--repeat", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "precision.json").read_text())
    assert data["benchmark"] == "precision" and data["pipelined_memory"]["saved_fraction"] > 0.5
