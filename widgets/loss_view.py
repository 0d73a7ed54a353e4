"""``StepExplorer``: a training run's loss curve with a slider over the steps shown."""

from __future__ import annotations

import ipywidgets as W
import plotly.graph_objects as go

from opsnn_lab._checks import check_positive
from opsnn_lab.widgets._base import StaticFigureMixin

__all__ = ["StepExplorer"]


class StepExplorer(StaticFigureMixin, W.VBox):
    """Loss (raw and smoothed) of a ``TrainResult``; the slider picks how many steps to show.

    ``explorer.steps.value = 10`` in Python does what dragging the slider does.
    """

    def __init__(self, result, window: int = 10, title: str = "training loss"):
        if not hasattr(result, "losses") or not hasattr(result, "smoothed"):
            raise TypeError(f"result must be a TrainResult (from opsnn_lab.train), got {type(result).__name__}")
        check_positive("window", window, integer=True)
        self.result = result
        self._smoothed = result.smoothed(window)
        n = max(len(result.losses), 1)
        self.steps = W.IntSlider(value=n, min=1, max=n, step=1, description="steps shown",
                                 continuous_update=False, style={"description_width": "initial"},
                                 layout=W.Layout(width="420px"))
        self.figure = go.FigureWidget(
            data=[go.Scatter(name="loss", mode="lines", line=dict(width=1, color="rgba(99,110,250,0.45)")),
                  go.Scatter(name=f"mean of {window}", mode="lines", line=dict(width=2.5, color="#EF553B"))],
            layout=go.Layout(title=title, xaxis_title="step", yaxis_title="loss", height=360,
                             margin=dict(l=60, r=20, t=50, b=50), legend=dict(x=0.75, y=0.95)))
        self.summary = W.HTML()
        self.steps.observe(self._redraw, names="value")
        self._redraw()
        super().__init__([self.steps, self.figure, self.summary])

    def _redraw(self, *_):
        n = self.steps.value
        xs = list(range(n))
        with self.figure.batch_update():
            self.figure.data[0].x, self.figure.data[0].y = xs, self.result.losses[:n]
            self.figure.data[1].x, self.figure.data[1].y = xs, self._smoothed[:n]
        if n and self.result.losses:
            self.summary.value = (f"step {n - 1}: loss <b>{self.result.losses[n - 1]:.4f}</b> "
                                  f"(started at {self.result.losses[0]:.4f})")
