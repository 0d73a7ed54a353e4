"""Interactive views (ipywidgets + plotly) over opsnn_lab's data objects.

Installed as ``opsnn_lab.widgets``. A widget never computes a statistic; it draws
what a pillar computed. Each view lives in its own module and loads on first use.
"""

from __future__ import annotations

import importlib

_WIDGETS = {
    "StepExplorer": "opsnn_lab.widgets.loss_view",
    "FusionExplorer": "opsnn_lab.widgets.fusion_explorer",
    "GradientHistogram": "opsnn_lab.widgets.gradient_histogram",
    "ScalerTuner": "opsnn_lab.widgets.scaler_tuner",
    "DivergenceViewer": "opsnn_lab.widgets.divergence_viewer",
}

__all__ = list(_WIDGETS)


def __getattr__(name: str):
    if name not in _WIDGETS:
        raise AttributeError(f"module 'opsnn_lab.widgets' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WIDGETS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
