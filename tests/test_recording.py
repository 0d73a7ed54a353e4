"""ol.record: JSON-safe values, shown in a notebook under its own MIME type."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import opsnn_lab as ol
from opsnn_lab.recording import RECORD_MIME, to_jsonable


def test_to_jsonable_converts_common_types():
    value = {"t": torch.tensor([1.5, 2.0]), "n": np.float32(0.25), "i": np.int64(3), "s": "x",
             "nested": [torch.tensor(1), (2, 3.0)], "nan": math.nan}
    assert to_jsonable(value) == {"t": [1.5, 2.0], "n": 0.25, "i": 3, "s": "x", "nested": [1, [2, 3.0]],
                                  "nan": "nan"}


def test_to_jsonable_rejects_objects_naming_the_path():
    with pytest.raises(TypeError, match=r"value\['a'\]\[1\]"):
        to_jsonable({"a": [1, object()]})
    with pytest.raises(TypeError, match="string key"):
        to_jsonable({1: 2})


def test_record_outside_ipython_returns_value():
    assert ol.record("x", torch.tensor(2.5)) == 2.5


def test_record_rejects_bad_name():
    with pytest.raises(ValueError, match="name"):
        ol.record("", 1)


def test_record_displays_mime_bundle(monkeypatch):
    shown = []
    import IPython
    import IPython.display

    monkeypatch.setattr(IPython, "get_ipython", lambda: object())
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append((obj, raw)))
    ol.record("loss", [1, 2])
    (bundle, raw), = shown
    assert raw and bundle[RECORD_MIME] == {"name": "loss", "value": [1, 2]}
    assert "loss" in bundle["text/plain"]
