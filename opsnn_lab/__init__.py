"""opsnn_lab: training-time operator engineering for PyTorch.

Subpackages load on first use, so ``import opsnn_lab as ol`` stays cheap and
``ol.fusion`` / ``ol.precision`` / ``ol.consistency`` / ``ol.ops`` / ``ol.memory``
import only what a notebook actually touches.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_SUBMODULES = (
    "bench",
    "consistency",
    "debug",
    "fusion",
    "kernels",
    "memory",
    "models",
    "ops",
    "precision",
    "testing",
    "training",
    "validate",
    "widgets",
)
# public callables re-exported at the top level: name -> module that defines it
_FUNCTIONS = {
    "record": "opsnn_lab.recording",
    "train": "opsnn_lab.training",
}

__all__ = [*_SUBMODULES, *_FUNCTIONS, "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from opsnn_lab import consistency, fusion, memory, models, ops, precision  # noqa: F401
    from opsnn_lab.recording import record  # noqa: F401
    from opsnn_lab.training import train  # noqa: F401


def __getattr__(name: str):
    if name in _FUNCTIONS:
        value = getattr(importlib.import_module(_FUNCTIONS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"opsnn_lab.{name}")
    else:
        raise AttributeError(f"module 'opsnn_lab' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
