"""opsnn_lab.testing's ``reloaded``: a module reloaded under other environment variables for a while, then exactly
the module it was (the same class objects), so what was made before still pickles."""

from __future__ import annotations

import os
import pickle

import opsnn_lab.ops.gated_mlp as gm_ops
from opsnn_lab.testing import reloaded


def test_reloaded_restores_the_namespace_and_the_environment(monkeypatch):
    monkeypatch.delenv("OPSNN_TEST_FLAG", raising=False)
    before = gm_ops.FusedGatedMLP
    made = object.__new__(before)  # an object of the module's class, made before the reload
    with reloaded(gm_ops, OPSNN_TEST_FLAG="1") as module:
        assert module is gm_ops and os.environ["OPSNN_TEST_FLAG"] == "1"
        assert gm_ops.FusedGatedMLP is not before  # reloading made a new class
    assert gm_ops.FusedGatedMLP is before and "OPSNN_TEST_FLAG" not in os.environ
    assert type(pickle.loads(pickle.dumps(made))) is before  # pickled by class name: it resolves to the same class


def test_reloaded_restores_a_variable_that_was_set(monkeypatch):
    monkeypatch.setenv("OPSNN_TEST_FLAG", "kept")
    with reloaded(gm_ops, OPSNN_TEST_FLAG="1"):
        pass
    assert os.environ["OPSNN_TEST_FLAG"] == "kept"
