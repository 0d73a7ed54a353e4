"""``GradientHistogram``: layers x log2|g| heatmap of a recorded step, with fp16/bf16 ranges drawn on it."""

from __future__ import annotations

import math

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from opsnn_lab.precision.grad_stats import FORMATS
from opsnn_lab.widgets._base import StaticFigureMixin
from opsnn_lab.widgets.scaler_tuner import as_trace

__all__ = ["GradientHistogram"]

_WIDE = {"description_width": "initial"}
_KIND_COLORS = {"underflow": "#636EFA", "subnormal": "#FECB52", "overflow": "#EF553B"}
# fill of the representable bands; the heatmap reads through them
_BANDS = {"fp16": ("rgba(0,204,150,0.10)", "rgba(254,203,82,0.16)", "#00CC96"),
          "bf16": ("rgba(171,99,250,0.08)", "rgba(171,99,250,0.16)", "#AB63FA")}


class GradientHistogram(StaticFigureMixin, W.VBox):
    """Per-module (or per-parameter) histograms of log2|g| for one recorded step, and where fp16/bf16
    would cut them.

    Left: a heatmap, one row per module (``by="module"``: weight and bias merged) or per parameter, one
    column per octave of the UNSCALED gradient (the two outer columns hold everything below / above the
    display bins); each row is the share of that row's nonzero elements. The fp16 and bf16 ranges at
    the loss scale are drawn as bands in the same unscaled coordinates: scaling by ``2**k`` moves the
    bands ``k`` octaves left. Right: per row underflow / subnormal / overflow fractions in the chosen
    format at that scale.

    Controls: ``step`` (row of the trace), ``fmt`` (fp16/bf16), ``recorded_scale`` (use the scale
    recorded with the step), ``scale_log2`` (the scale to use otherwise), ``by`` (module/parameter).
    """

    def __init__(self, stats_or_trace, *, fmt: str = "fp16", by: str = "module", height: int | None = None):
        source = as_trace(stats_or_trace, "stats_or_trace")
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
        if by not in ("module", "parameter"):
            raise ValueError(f"by must be 'module' or 'parameter', got {by!r}")
        self._views = {"module": source.by_module(), "parameter": source}
        self.trace = self._views[by]
        n = len(self.trace)
        if n == 0:
            raise ValueError("stats_or_trace holds no recorded steps; record at least one step first")
        self.step = W.IntSlider(value=n - 1, min=0, max=n - 1, description="recorded step #", style=_WIDE,
                                continuous_update=False, layout=W.Layout(width="420px"))
        self.fmt = W.ToggleButtons(options=list(FORMATS), value=fmt, description="format", style=_WIDE)
        self.by = W.ToggleButtons(options=["module", "parameter"], value=by, description="rows", style=_WIDE)
        self.recorded_scale = W.Checkbox(value=True, description="use the recorded loss scale", style=_WIDE)
        self.scale_log2 = W.IntSlider(value=int(round(math.log2(self.trace.scale[-1]))), min=-16, max=40,
                                      description="loss scale (log2)", style=_WIDE, continuous_update=False,
                                      disabled=True)
        rows = len(source.names)
        self.figure = self._make_figure(height or max(320, 60 + 18 * rows))
        self.summary = W.HTML()
        self.recorded_scale.observe(self._toggle_scale, names="value")
        for control in (self.step, self.fmt, self.scale_log2):
            control.observe(self._redraw, names="value")
        self.by.observe(self._switch_rows, names="value")
        self._redraw()
        super().__init__([W.HBox([self.step, self.fmt]), W.HBox([self.recorded_scale, self.scale_log2, self.by]),
                          self.figure, self.summary])

    # ---------------------------------------------------------------- state
    @property
    def index(self) -> int:
        return int(self.step.value)

    @property
    def scale(self) -> float:
        """The loss scale the bands and fractions are drawn for."""
        return float(self.trace.scale[self.index]) if self.recorded_scale.value else 2.0**self.scale_log2.value

    def _toggle_scale(self, change):
        self.scale_log2.disabled = bool(change["new"])
        if change["new"]:
            self.scale_log2.value = int(round(math.log2(self.trace.scale[self.index])))
        self._redraw()

    def _switch_rows(self, change):
        self.trace = self._views[change["new"]]
        names = self.trace.names
        with self.figure.batch_update():
            for trace_ in self.figure.data:
                trace_.y = names
        self._redraw()

    # ---------------------------------------------------------------- drawing
    def _make_figure(self, height: int) -> go.FigureWidget:
        lo, hi = self.trace.bins
        names = self.trace.names
        fig = make_subplots(rows=1, cols=2, shared_yaxes=True, column_widths=[0.72, 0.28], horizontal_spacing=0.02)
        x = np.arange(lo - 1, hi + 1) + 0.5  # outer columns: the "< lo" and ">= hi" tails
        fig.add_trace(go.Heatmap(x=x, y=names, colorscale="Viridis", zmin=0,
                                 colorbar=dict(title="share", x=1.0, len=0.8, thickness=12),
                                 hovertemplate="%{y}<br>log2|g| in [%{x:.1f} ± 0.5)<br>share %{z:.2%}"
                                               "<extra></extra>"), row=1, col=1)
        for kind, color in _KIND_COLORS.items():
            fig.add_trace(go.Bar(y=names, orientation="h", name=kind, marker_color=color,
                                 hovertemplate="%{y}: %{x:.3%}<extra>" + kind + "</extra>"), row=1, col=2)
        fig.update_xaxes(title_text="log2 |g| (unscaled)", range=[lo - 1, hi + 1], row=1, col=1)
        fig.update_xaxes(title_text="fraction", tickformat=".0%", rangemode="tozero", row=1, col=2)
        fig.update_yaxes(autorange="reversed", row=1, col=1)
        fig.update_layout(height=height, barmode="group", margin=dict(l=10, r=60, t=50, b=40),
                          legend=dict(orientation="h", x=0.72, y=1.12))
        return go.FigureWidget(fig)

    def _band_shapes(self, k: float) -> list[dict]:
        """Representable ranges of fp16 and bf16 at scale 2**k, in unscaled log2 coordinates."""
        lo, hi = self.trace.bins
        clip = lambda v: min(max(v, lo - 1), hi + 1)
        shapes = []
        for name, f in FORMATS.items():
            normal, sub, line = _BANDS[name]
            y0, y1 = (1.0, 1.04) if name == "bf16" else (0.0, 1.0)  # bf16 as a strip above: its range is huge
            a, b, c = f.min_subnormal_log2 - k, f.min_normal_log2 - k, f.overflow_log2 - k
            shapes.append(dict(type="rect", xref="x", yref="paper", x0=clip(a), x1=clip(b), y0=y0, y1=y1,
                               fillcolor=sub, line_width=0, layer="above"))
            shapes.append(dict(type="rect", xref="x", yref="paper", x0=clip(b), x1=clip(c), y0=y0, y1=y1,
                               fillcolor=normal, line_width=0, layer="above"))
            for v, dash in ((a, "dot"), (b, "dash"), (c, "solid")):
                if lo - 1 <= v <= hi + 1:
                    shapes.append(dict(type="line", xref="x", yref="paper", x0=v, x1=v, y0=y0, y1=y1,
                                       line=dict(color=line, width=2, dash=dash), name=f"{name} 2**{v + k:g}"))
        return shapes

    def _redraw(self, *_):
        i, s, fmt = self.index, self.scale, self.fmt.value
        hist = self.trace.param_hist[i].astype(np.float64)
        share = hist / np.maximum(hist.sum(1, keepdims=True), 1)
        # empty octaves stay transparent (None: JSON has no NaN), so the range bands show through
        share = np.where(share == 0, None, share).tolist()
        frac = self.trace.layer_fractions(i, scale=s, fmt=fmt)
        k = math.log2(s)
        with self.figure.batch_update():
            self.figure.data[0].z = share
            for trace_ in self.figure.data[1:]:
                trace_.x = frac[trace_.name]
            self.figure.layout.shapes = self._band_shapes(k)
            self.figure.layout.title = (f"step {int(self.trace.step[i])}: log2|g| per {self.by.value}; {fmt} ranges at "
                                        f"loss scale 2**{k:.3g} (bands: green normal, yellow subnormal)")
        self.summary.value = self._summary(i, s, fmt, frac)

    def _summary(self, i: int, s: float, fmt: str, frac: dict) -> str:
        whole = {kind: float(v[i]) for kind, v in self.trace.fractions(s, fmt).items()}
        worst = int(np.argmax(frac["underflow"]))
        nonfinite = [n for n, c in zip(self.trace.names, self.trace.param_nonfinite[i]) if c]
        text = (f"{fmt} at scale 2**{math.log2(s):.3g}, whole model: underflow <b>{whole['underflow']:.3%}</b>, "
                f"subnormal {whole['subnormal']:.3%}, overflow <b>{whole['overflow']:.3%}</b>; most underflow in "
                f"<code>{self.trace.names[worst]}</code> ({frac['underflow'][worst]:.3%})")
        if nonfinite:
            text += f"; <b style='color:#c00'>Inf/NaN in {', '.join(nonfinite[:6])}</b>"
        return text
