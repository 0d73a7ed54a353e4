"""What every opsnn_lab widget shares: a static copy of its figure for non-live renderers.

A live JupyterLab shows the widget; a static renderer (nbconvert, the demo report,
GitHub) cannot run widgets. ``_repr_mimebundle_`` therefore adds the current figure as
``application/vnd.plotly.v1+json`` next to the widget view, and the report draws it.
"""

from __future__ import annotations

import json

PLOTLY_MIME = "application/vnd.plotly.v1+json"


class StaticFigureMixin:
    """Mix into an ipywidgets container that keeps its plotly figure(s) in ``figure`` or ``figures``."""

    def _static_figures(self) -> list:
        figs = getattr(self, "figures", None) or [getattr(self, "figure", None)]
        return [f for f in figs if f is not None]

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)
        figs = self._static_figures()
        if bundle is not None and figs:
            # Only one plotly output fits in a bundle; the first figure is the widget's main view.
            bundle[PLOTLY_MIME] = json.loads(figs[0].to_json())
        return bundle
