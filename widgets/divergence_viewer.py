"""``DivergenceViewer``: a ConsistencyReport's per-op errors along execution order.

Log-scale error per op (execution order on x), the tolerance as a line, the first divergence marked,
a forward/backward toggle, a module-path filter, a metric choice, and a selection (dropdown, or a click on
a point) that shows both runs' statistics for that op. Everything drawn comes from the report's rows.
"""

from __future__ import annotations

import html
import math

import ipywidgets as W
import plotly.graph_objects as go

from opsnn_lab.widgets._base import StaticFigureMixin

__all__ = ["DivergenceViewer"]

_METRICS = {"max abs error": "max_abs_err", "max rel error": "max_rel_err", "ULP distance": "ulp",
            "fraction beyond tolerance": "frac_beyond"}
_STATS = ("shape", "dtype", "min", "max", "mean", "std", "norm", "nan", "inf", "hash")
# zero errors cannot sit on a log axis; they are drawn on this floor (the axis says so)
_FLOOR = 1e-12


def _y(value) -> float | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return max(float(value), _FLOOR)


class DivergenceViewer(StaticFigureMixin, W.VBox):
    """Explore a ``ConsistencyReport``. ``viewer.phase.value = "backward"`` does what clicking the toggle does."""

    def __init__(self, report, title: str = "per-op error along execution order"):
        if not hasattr(report, "rows") or not hasattr(report, "first_divergence"):
            raise TypeError(f"report must be a ConsistencyReport, got {type(report).__name__}")
        self.report = report
        self.phase = W.ToggleButtons(options=["forward", "backward", "all"], value="forward", description="phase")
        self.module_filter = W.Text(value="", placeholder="e.g. layers.0.mlp", description="module",
                                    continuous_update=False)
        self.metric = W.Dropdown(options=list(_METRICS), value="max abs error", description="metric")
        self.op_select = W.Dropdown(options=[("(none)", None)], value=None, description="op",
                                    layout=W.Layout(width="640px"))
        self.details = W.HTML()
        self.figure = go.FigureWidget(
            data=[go.Scatter(name="per-op error", mode="markers+lines", line=dict(width=1, color="#636efa"),
                             marker=dict(size=6)),
                  go.Scatter(name="tolerance (atol)", mode="lines", line=dict(dash="dash", color="#00a15c"),
                             line_shape="hv", hoverinfo="skip"),
                  go.Scatter(name="first divergence", mode="markers",
                             marker=dict(symbol="star", size=16, color="#ef553b")),
                  go.Scatter(name="selected", mode="markers",
                             marker=dict(symbol="circle-open", size=16, line=dict(width=2), color="black"))],
            layout=go.Layout(title=title, xaxis_title="event (execution order)", height=380,
                             yaxis=dict(type="log", title="max abs error"),
                             margin=dict(l=70, r=20, t=50, b=50), legend=dict(orientation="h", y=-0.2)))
        self.figure.data[0].on_click(self._clicked)
        for control in (self.phase, self.module_filter, self.metric):
            control.observe(self._redraw, names="value")
        self.op_select.observe(self._show_selected, names="value")
        first = report.first_divergence
        if first is not None:
            self.phase.value = first.phase   # triggers the first draw
        self._redraw()
        if first is not None:
            self.op_select.value = first.index
        controls = W.HBox([self.phase, self.metric])
        super().__init__([controls, self.module_filter, self.figure, self.op_select, self.details])

    # ----------------------------------------------------------------- data
    def visible_rows(self) -> list:
        """Rows drawn under the current phase and module filter, in execution order."""
        needle = self.module_filter.value.strip()
        return [r for r in self.report.rows
                if (self.phase.value == "all" or r.phase == self.phase.value)
                and (not needle or needle in r.module_path)]

    def _first_row(self):
        d = self.report.first_divergence
        if d is None:
            return None
        if self.phase.value not in ("all", d.phase):
            d = getattr(self.report, f"{self.phase.value}_divergence", None)
        return d

    # ----------------------------------------------------------------- drawing
    def _redraw(self, *_):
        rows = self.visible_rows()
        key = _METRICS[self.metric.value]
        xs = [r.index for r in rows]
        labels = [f"{r.phase} {r.module_path or '<root>'} {r.short_op} #{r.occurrence}" for r in rows]
        first = self._first_row()
        shown = {r.index for r in rows}
        with self.figure.batch_update():
            err = self.figure.data[0]
            err.x, err.y, err.text = xs, [_y(getattr(r, key)) for r in rows], labels
            err.hovertemplate = "%{text}<br>" + self.metric.value + " %{y:.3g}<extra></extra>"
            tol = self.figure.data[1]
            if key in ("max_abs_err", "max_rel_err"):
                tol.x = xs
                tol.y = [_y(r.atol if key == "max_abs_err" else r.rtol) for r in rows]
            else:
                tol.x, tol.y = [], []
            mark = self.figure.data[2]
            if first is not None and first.index in shown:
                row = self.report.rows[first.index]
                mark.x, mark.y = [first.index], [_y(getattr(row, key))]
            else:
                mark.x, mark.y = [], []
            self.figure.layout.yaxis.title = f"{self.metric.value} (zeros drawn at {_FLOOR:g})"
        options = [("(none)", None)] + list(zip(labels, xs))
        keep = self.op_select.value if self.op_select.value in shown else None
        self.op_select.options = options
        self.op_select.value = keep
        self._show_selected()

    def _clicked(self, trace, points, state):
        if points.point_inds:
            self.op_select.value = trace.x[points.point_inds[0]]

    def _show_selected(self, *_):
        idx = self.op_select.value
        sel = self.figure.data[3]
        if idx is None:
            sel.x, sel.y = [], []
            self.details.value = self._summary()
            return
        row = self.report.rows[idx]
        sel.x, sel.y = [idx], [_y(getattr(row, _METRICS[self.metric.value]))]
        self.details.value = self._summary() + _stats_table(row)

    def _summary(self) -> str:
        r = self.report
        if r.ok:
            return f"<b style='color:#1a7f37'>ok</b>: {len(r.rows)} events within tolerance"
        parts = []
        for d in (r.forward_divergence, r.backward_divergence):
            if d is not None:
                bound = "&ge; " if d.measured == "statistics" else ""
                parts.append(f"first {d.phase} divergence: <code>{html.escape(d.module_path or '<root>')}</code> "
                             f"<code>{html.escape(d.op)}</code> at <code>{html.escape(d.location)}</code> "
                             f"(max abs {bound}{d.max_abs_err:.3g}, {html.escape(d.origin)})")
        unresolved = getattr(r, "unresolved_summary", "")
        if unresolved:
            parts.append(html.escape(unresolved))
        return "<br>".join(parts)


def _stats_table(row) -> str:
    """Both runs' output statistics for one row, side by side."""
    if getattr(row, "measured", "") == "statistics":  # past the trace's memory limit: no tensors, a lower bound
        errors = (f"max abs &ge; {row.max_abs_err:.3g} (from statistics, past the memory limit; "
                  f"{'beyond tolerance' if row.diverged else 'within what they show'})")
    else:
        errors = (f"max abs {row.max_abs_err:.3g}, max rel {row.max_rel_err:.3g}, cosine {row.cosine:.6f}, "
                  f"ulp {row.ulp}, beyond {row.frac_beyond:.2%}")
    head = (f"<div><b>{html.escape(row.module_path or '<root>')}</b> <code>{html.escape(row.op)}</code> "
            f"({row.phase}, {html.escape(row.location)}): {errors}"
            f"{', ' + html.escape(row.origin) if row.origin else ''}</div>")
    cells = []
    for i, (ref, run) in enumerate(zip(row.ref_stats, row.run_stats)):
        body = "".join(f"<tr><td>{k}</td><td>{_fmt(ref.get(k))}</td><td>{_fmt(run.get(k))}</td></tr>"
                       for k in _STATS)
        cells.append(f"<table><tr><th>output {i}</th><th>reference</th><th>run</th></tr>{body}</table>")
    return head + "".join(cells)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return html.escape(str(v))
