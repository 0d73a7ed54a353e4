"""Dumps: only the diverging ops, only under dump_dir, a replay that reproduces the error, never a lost report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opsnn_lab.consistency import ConsistencyChecker
from opsnn_lab.models import EncoderConfig, MaskedTokenTask

TASK = MaskedTokenTask(batch_size=2, seq_len=8)


def _run_pair(checker, name="layers.0.mlp.fc1", eps=1e-4):
    torch.manual_seed(0)
    model = TASK.model(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))
    for step in range(2):
        if step == 1 and eps:
            w = model.get_parameter(f"{name}.weight")
            with torch.no_grad():
                w.add_(eps * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
        model.zero_grad(set_to_none=True)
        with checker.trace(model):
            TASK.loss(model, TASK.batch(0)).backward()
    return checker.report


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_dump_holds_the_diverging_ops_and_replay_reproduces_the_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checker = ConsistencyChecker(dump_dir="dumps")
    report = _run_pair(checker)
    assert not report.ok and report.dump_error is None
    out = Path(report.dump_path)
    assert out.parent.resolve() == (tmp_path / "dumps").resolve()
    assert {p.name for p in out.iterdir()} == {"forward_op.pt", "backward_op.pt", "report.json", "replay.py"}
    # nothing written next to dump_dir (the checkout, the cwd)
    assert _files(tmp_path) == {"dumps"} | {f"dumps/{p}" for p in _files(tmp_path / "dumps")}
    assert json.loads((out / "report.json").read_text())["forward_divergence"]["module_path"] == "layers.0.mlp.fc1"
    # a dump is the diverging ops' tensors, kilobytes, not the whole step
    assert sum(p.stat().st_size for p in out.iterdir()) < 1_000_000
    fwd = torch.load(out / "forward_op.pt", weights_only=False)
    assert fwd["aten_op"] == "aten.addmm.default" and fwd["run"]["grads"] and fwd["reference"]["grads"]
    before = _files(tmp_path)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    res = subprocess.run([sys.executable, "replay.py"], capture_output=True, text=True, env=env,
                         cwd=out, timeout=120)
    assert res.returncode == 0, res.stderr
    assert _files(tmp_path) == before   # replaying writes nothing
    assert "forward_op.pt: run replayed bit-identical to its recorded outputs: True" in res.stdout
    errs = {m.group(1): float(m.group(2)) for m in
            re.finditer(r"(\w+)_op\.pt: output 0: max_abs_err=(\S+)", res.stdout)}
    assert errs["forward"] == pytest.approx(report.forward_divergence.max_abs_err, rel=1e-6)
    assert errs["backward"] == pytest.approx(report.backward_divergence.max_abs_err, rel=1e-6)


def test_second_failure_gets_its_own_folder(tmp_path):
    checker = ConsistencyChecker(dump_dir=tmp_path / "d")
    first = _run_pair(checker).dump_path
    checker.reset()
    second = _run_pair(checker).dump_path
    assert first != second and Path(first).exists() and Path(second).exists()


def test_failed_dump_warns_and_keeps_the_report(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    checker = ConsistencyChecker(dump_dir=blocker / "dumps")   # mkdir fails even as root
    with pytest.warns(RuntimeWarning, match="dump"):
        report = _run_pair(checker)
    assert not report.ok and report.first_divergence.module_path == "layers.0.mlp.fc1"
    assert report.dump_path is None and "Error" in report.dump_error
    assert checker.report is report
    assert _files(tmp_path) == {"a_file"}


def test_disk_full_during_write_warns_and_keeps_the_report(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    checker = ConsistencyChecker(dump_dir=tmp_path / "dumps")
    with pytest.warns(RuntimeWarning, match="No space left"):
        report = _run_pair(checker)
    assert report.forward_divergence.op == "aten.addmm" and "No space" in report.dump_error


def test_no_dump_when_ok_or_disabled(tmp_path):
    assert _run_pair(ConsistencyChecker(dump_dir=tmp_path / "a"), eps=0.0).ok
    report = _run_pair(ConsistencyChecker(dump_on_failure=False, dump_dir=tmp_path / "b"))
    assert not report.ok and report.dump_path is None
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
