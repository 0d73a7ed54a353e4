"""``ScalerTuner``: tune ``DynamicScaler`` settings with sliders against a recorded gradient trace."""

from __future__ import annotations

import html
import math
from pathlib import Path

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from opsnn_lab._checks import check_positive, check_range
from opsnn_lab.precision import FP16_MIN, DynamicScaler, GradientStats, GradientTrace
from opsnn_lab.widgets._base import StaticFigureMixin

__all__ = ["ScalerTuner", "as_trace"]

_WIDE = {"description_width": "initial"}


def as_trace(trace, name: str = "trace") -> GradientTrace:
    """A ``GradientTrace`` from a trace, a ``GradientStats`` or the path of a saved trace."""
    if isinstance(trace, GradientStats):
        return trace.trace()
    if isinstance(trace, (str, Path)):
        return GradientTrace.load(trace)
    if not isinstance(trace, GradientTrace):
        raise TypeError(f"{name} must be a GradientTrace, a GradientStats or a path to a saved trace, "
                        f"got {type(trace).__name__}")
    return trace


def _pow2(x: float) -> str:
    k = math.log2(x)
    return f"2**{int(k)}" if k == int(k) else repr(float(x))


class ScalerTuner(StaticFigureMixin, W.VBox):
    """Replays a ``GradientTrace`` through ``DynamicScaler`` for the settings on the sliders.

    Every change re-runs ``DynamicScaler(...).replay(trace.events())`` and redraws the scale
    trajectory (log2), the skipped steps (overflow / underflow growth), the overflow ceiling
    ``log2(65504 / amax)`` and the fp16 underflow fraction at the replayed scale. The replay is in
    ``tuner.result``; the settings as code in ``tuner.call`` (shown under the plot).
    Controls: ``init_scale_log2``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
    ``hysteresis``, ``underflow_growth``.
    """

    def __init__(self, trace, *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 100, hysteresis: int = 1,
                 underflow_growth: bool = True, min_scale: float = 1.0, max_scale: float = 2.0**24,
                 height: int = 480):
        self.trace = as_trace(trace)
        check_positive("min_scale", min_scale)
        check_range("max_scale", max_scale, min_scale, math.inf)
        check_range("init_scale", init_scale, min_scale, max_scale)
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        lo, hi = math.ceil(math.log2(min_scale)), math.floor(math.log2(max_scale))
        self.init_scale_log2 = W.IntSlider(value=min(max(round(math.log2(init_scale)), lo), hi), min=lo, max=hi,
                                           description="init scale (log2)", style=_WIDE, continuous_update=False)
        self.growth_factor = W.FloatSlider(value=growth_factor, min=1.25, max=8.0, step=0.25, style=_WIDE,
                                           description="growth factor", continuous_update=False)
        self.backoff_factor = W.FloatSlider(value=backoff_factor, min=0.05, max=0.95, step=0.05, style=_WIDE,
                                            description="backoff factor", continuous_update=False)
        self.growth_interval = W.IntSlider(value=growth_interval, min=1, max=max(2000, growth_interval), style=_WIDE,
                                           description="growth interval", continuous_update=False)
        self.hysteresis = W.IntSlider(value=hysteresis, min=1, max=16, description="hysteresis", style=_WIDE,
                                      continuous_update=False)
        self.underflow_growth = W.Checkbox(value=underflow_growth, description="grow on underflow (amax < FP16_MIN)",
                                           style=_WIDE)
        self.figure = self._make_figure(height)
        self.code = W.HTML()
        self.summary = W.HTML()
        self.result: dict = {}
        self.trace.underflow_fraction(1.0)  # build the cumulative histograms once, not on the first slider move
        self._events = self.trace.events()
        for control in self.controls:
            control.observe(self._redraw, names="value")
        self._redraw()
        left = W.VBox(self.controls[:3])
        right = W.VBox(self.controls[3:])
        super().__init__([W.HBox([left, right]), self.figure, self.code, self.summary])

    @property
    def controls(self) -> list[W.Widget]:
        return [self.init_scale_log2, self.growth_factor, self.backoff_factor, self.growth_interval,
                self.hysteresis, self.underflow_growth]

    def settings(self) -> dict:
        """The ``DynamicScaler`` keyword arguments the controls describe."""
        return {"init_scale": 2.0**self.init_scale_log2.value, "growth_factor": float(self.growth_factor.value),
                "backoff_factor": float(self.backoff_factor.value), "growth_interval": int(self.growth_interval.value),
                "hysteresis": int(self.hysteresis.value), "min_scale": self.min_scale, "max_scale": self.max_scale,
                "underflow_threshold": FP16_MIN if self.underflow_growth.value else None}

    def scaler(self) -> DynamicScaler:
        """A fresh ``DynamicScaler`` with the chosen settings, ready for training."""
        return DynamicScaler(**self.settings())

    @property
    def call(self) -> str:
        s = self.settings()
        return (f"DynamicScaler(init_scale={_pow2(s['init_scale'])}, growth_factor={s['growth_factor']:g}, "
                f"backoff_factor={s['backoff_factor']:g}, growth_interval={s['growth_interval']}, "
                f"hysteresis={s['hysteresis']}, min_scale={_pow2(s['min_scale'])}, "
                f"max_scale={_pow2(s['max_scale'])}, "
                f"underflow_threshold={'FP16_MIN' if s['underflow_threshold'] is not None else 'None'})")

    def _wrapped_call(self, width: int = 88) -> str:
        """``call`` broken between arguments, so the label never splits a name across lines."""
        head, args = self.call[:-1].split("(", 1)
        lines, line = [], ""
        for arg in args.split(", "):
            if line and len(line) + len(arg) + 2 > width - 4:
                lines.append(line + ",")
                line = ""
            line = f"{line}, {arg}" if line else arg
        return head + "(\n    " + "\n    ".join([*lines, line]) + ",\n)"

    def _make_figure(self, height: int) -> go.FigureWidget:
        fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.65, 0.35], vertical_spacing=0.06)
        steps = self.trace.step
        with np.errstate(divide="ignore"):
            ceiling = np.log2(self.trace.max_safe_scale("fp16"))
        ceiling = np.where(np.isfinite(ceiling), ceiling, None)  # gaps at non-finite steps (JSON has no NaN)
        fig.add_trace(go.Scatter(x=steps, y=ceiling, name="overflow ceiling",
                                 mode="lines", line=dict(color="rgba(150,150,150,0.6)", width=1)), row=1, col=1)
        fig.add_trace(go.Scatter(name="log2 scale", mode="lines", line=dict(color="#636EFA", width=2, shape="hv")),
                      row=1, col=1)
        fig.add_trace(go.Scatter(name="skipped: overflow", mode="markers",
                                 marker=dict(color="#EF553B", symbol="x", size=7)), row=1, col=1)
        fig.add_trace(go.Scatter(name="skipped: underflow growth", mode="markers",
                                 marker=dict(color="#FFA15A", symbol="triangle-up", size=7)), row=1, col=1)
        fig.add_trace(go.Scatter(name="fp16 underflow fraction", mode="lines", line=dict(color="#00CC96")),
                      row=2, col=1)
        fig.update_yaxes(title_text="log2 loss scale", row=1, col=1)
        fig.update_yaxes(title_text="underflow", tickformat=".3~%", rangemode="tozero", row=2, col=1)
        fig.update_xaxes(title_text="step", row=2, col=1)
        fig.update_layout(height=height, margin=dict(l=60, r=20, t=30, b=40), legend=dict(orientation="h", y=1.08))
        return go.FigureWidget(fig)

    def _replay(self) -> dict:
        res = self.scaler().replay(self._events)
        scale = np.asarray(res["scale"], dtype=np.float64)
        out = {k: np.asarray(v) for k, v in res.items()}
        out["underflow_fraction"] = self.trace.underflow_fraction(scale, "fp16") if len(scale) else scale
        return out

    def _redraw(self, *_):
        r = self.result = self._replay()
        steps = self.trace.step
        log2s = np.log2(r["scale"]) if len(steps) else np.zeros(0)
        over, under = r["overflow"].astype(bool), r["underflow"].astype(bool)
        with self.figure.batch_update():
            d = self.figure.data
            d[1].x, d[1].y = steps, log2s
            d[2].x, d[2].y = steps[over], log2s[over]
            d[3].x, d[3].y = steps[under], log2s[under]
            d[4].x, d[4].y = steps, r["underflow_fraction"]
        self.code.value = f"<pre><code>{html.escape(self._wrapped_call())}</code></pre>"
        self.summary.value = self._summary(r)

    def _summary(self, r: dict) -> str:
        n = len(self.trace)
        if not n:
            return "empty trace: nothing to replay"
        pinned = np.flatnonzero(r["pinned"])
        warn = (f"; <b style='color:#c00'>pinned at min_scale from step {int(self.trace.step[pinned[0]])}: a live "
                f"scaler raises ScalerPinnedError</b>" if len(pinned) else "")
        return (f"{n} steps: <b>{int(r['skipped'].sum())} skipped</b> ({int(r['overflow'].sum())} overflow, "
                f"{int(r['underflow'].sum())} underflow growth); final scale 2**{math.log2(r['scale'][-1]):.3g}; "
                f"mean fp16 underflow {float(np.mean(r['underflow_fraction'])):.3%}{warn}")
