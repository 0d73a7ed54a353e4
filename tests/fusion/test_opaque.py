"""``opaque_to_compile``: Dynamo does not trace the call, and a process that never compiles never loads Dynamo."""

from __future__ import annotations

import subprocess
import sys

import pytest

from opsnn_lab._opaque import opaque_to_compile


def test_the_call_stays_outside_the_compiled_graph(monkeypatch):
    import torch._dynamo

    calls = []

    def side_effect(x):
        calls.append(1)  # traced, this would run once at compile time and never again
        return x * 2

    monkeypatch.delitem(sys.modules, "torch._dynamo")  # decorate as a process without Dynamo would
    opaque = opaque_to_compile(side_effect)
    monkeypatch.undo()
    assert opaque._torchdynamo_disable and not hasattr(opaque, "_torchdynamo_orig_callable")

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: opaque(x + 1) - 1, backend="eager")
    for i in range(3):
        assert torch.equal(compiled(torch.full((3,), float(i))), torch.full((3,), 2.0 * (i + 1) - 1))
    assert len(calls) == 3
    assert opaque(torch.ones(2)).tolist() == [2.0, 2.0] and len(calls) == 4


@pytest.mark.slow
def test_importing_the_fusion_engine_does_not_load_dynamo():
    code = ("import sys, opsnn_lab.fusion.api, opsnn_lab.fusion.rewrite, opsnn_lab.fusion.patch; "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
