"""Run ``python -m opsnn_lab.train`` under torchrun on 127.0.0.1 with a hard timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from opsnn_lab.parallel.runtime import free_port

TINY = ["--model", "encoder", "--size", "tiny", "--global-batch-size", "8"]


def torchrun_cmd(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), "-m", "opsnn_lab.train", *args]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": "1"}


def train(nproc: int, out: Path, *args: str, timeout: float = 240) -> dict:
    proc = subprocess.run(torchrun_cmd(nproc, [*TINY, *args, "--out", str(out)]), env=env(), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "metrics.json").read_text())


def rank_state(out: Path, rank: int) -> dict:
    return json.loads((out / "ranks" / f"rank{rank}.json").read_text())
