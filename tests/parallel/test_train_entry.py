"""``python -m opsnn_lab.train`` is a module, ``ol.train`` a function: importing one keeps the other working."""

from __future__ import annotations

import subprocess
import sys

import pytest

import opsnn_lab as ol
from opsnn_lab.models import MaskedTokenTask
from opsnn_lab.parallel.cli import parser


def test_importing_the_module_keeps_ol_train_callable():
    import opsnn_lab.train  # noqa: F401  (sets the attribute opsnn_lab.train to the module)

    task = MaskedTokenTask(batch_size=2, seq_len=8, vocab_size=16)
    result = ol.train(task.model(hidden=16, layers=1, heads=2, intermediate=32, vocab_size=16, max_len=8), task, 2)
    assert result.steps == 2


def test_cli_arguments_and_bad_values(tmp_path):
    args = parser().parse_args(["--model", "cnn", "--parallel", "fsdp", "--strict", "--precision", "bf16-master"])
    assert (args.model, args.parallel, args.strict, args.precision) == ("cnn", "fsdp", True, "bf16-master")
    with pytest.raises(SystemExit):
        parser().parse_args(["--precision", "fp8"])
    bad = subprocess.run([sys.executable, "-m", "opsnn_lab.train", "--steps", "0", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--steps must be a positive integer" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "opsnn_lab.train", "--inject-overflow", "x", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--inject-overflow" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "opsnn_lab.train", "--strict", "--dropout", "0.1", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--strict trains without dropout (got --dropout 0.1)" in bad.stderr
