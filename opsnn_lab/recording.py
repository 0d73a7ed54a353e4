"""``opsnn_lab.record(name, value)``: key figures a notebook publishes for its tests.

A recorded figure is displayed as a rich output with the MIME type
``application/vnd.opsnn.record+json`` holding ``{"name": ..., "value": ...}``
(plus a short text/plain line for people). The executed notebook keeps it in the
cell's outputs, so ``opsnn_lab.validate`` and the notebook tests read it back
without parsing printed text.
"""

from __future__ import annotations

import json
import math
import numbers

RECORD_MIME = "application/vnd.opsnn.record+json"

__all__ = ["RECORD_MIME", "record", "to_jsonable"]


def to_jsonable(value, *, _path: str = "value"):
    """Convert numbers, tensors, numpy values, lists and small dicts to plain JSON types."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        v = float(value)
        return v if math.isfinite(v) else str(v)  # JSON has no NaN/Inf; keep them readable
    if hasattr(value, "tolist") and callable(value.tolist):  # torch.Tensor, numpy array/scalar
        return to_jsonable(value.tolist(), _path=_path)
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v, _path=f"{_path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{_path} has a non-string key {k!r}; recorded dicts need string keys")
            out[k] = to_jsonable(v, _path=f"{_path}[{k!r}]")
        return out
    raise TypeError(f"{_path} must be a number, string, list or dict of those, got {type(value).__name__}")


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def record(name: str, value):
    """Record a named figure in the running notebook (and return the JSON value).

    Outside IPython the figure is only returned, so library code can call it freely.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    payload = {"name": name, "value": to_jsonable(value)}
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover - IPython is a dependency of ipywidgets
        return payload["value"]
    if get_ipython() is not None:
        display({RECORD_MIME: payload, "text/plain": f"recorded {name} = {_short(payload['value'])}"},
                raw=True)
    return payload["value"]
