"""``FusionExplorer``: a model's dataflow graph with its fusion decisions; toggle patterns, apply, measure.

The widget draws what ``opsnn_lab.fusion`` computed (``FusionPlan.graph`` and ``.decisions``; ``measure``
for the numbers). Layout is layered top-down by dataflow depth. Repeated blocks (``layers.1`` ...
``layers.11`` of an encoder) are collapsed to one node each so a 12-layer model stays readable; the first
block is drawn in full, and plotly's zoom handles the rest.
"""

from __future__ import annotations

import html
import re

import ipywidgets as W
import plotly.graph_objects as go
from torch import nn

import opsnn_lab as ol
from opsnn_lab._checks import check_type
from opsnn_lab.fusion.patterns import FAMILIES, pattern_of
from opsnn_lab.widgets._base import StaticFigureMixin

__all__ = ["FusionExplorer", "PATTERN_COLORS"]

_FIXED = {"conv_bn_relu": "#1f77b4", "linear_gelu_dropout": "#2ca02c", "attention": "#9467bd", "qkv": "#ff7f0e",
          "gated_mlp": "#17becf", "layer_norm": "#bcbd22", "add_layer_norm": "#8c564b", "rms_norm": "#e377c2",
          "add_rms_norm": "#aec7e8", "linear_cross_entropy": "#ffbb78"}
_SPARE = ("#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5")
# one colour per pattern family the engine knows (a family added later takes a spare colour, never a KeyError)
_UNFIXED = [f for f in FAMILIES if f not in _FIXED]
PATTERN_COLORS = {f: _FIXED.get(f) or _SPARE[_UNFIXED.index(f) % len(_SPARE)] for f in FAMILIES}
_REJECTED, _OTHER, _BLOCK = "#d62728", "#b0b0b0", "#7f7f7f"
_NUMBERED = re.compile(r"^(.*?\.)?(\d+)(\.|$)")


def _family(pattern: str) -> str:
    """The table row a variant belongs to (``linear_gelu_tanh_linear`` -> ``linear_gelu_dropout``)."""
    try:
        return pattern_of(pattern).family
    except ValueError:  # a name no row knows (a plan from another version): its own colour group
        return max((f for f in PATTERN_COLORS if pattern.startswith(f)), key=len, default=pattern)


def _block_of(name: str, repeated: set) -> str | None:
    """``layers.3.mlp.fc1`` -> ``layers.3`` when ``layers`` holds repeated numbered children."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and ".".join(parts[:i]) in repeated:
            return ".".join(parts[: i + 1])
    return None


def graph_layout(graph: dict, collapse: bool = True) -> tuple[dict, list, dict]:
    """Positions of (possibly collapsed) nodes: ``(pos {id: (x, y)}, edges [(a, b)], members {id: [names]})``."""
    names = [n["name"] for n in graph["nodes"]]
    children: dict[str, set] = {}
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            if part.isdigit():
                children.setdefault(".".join(parts[:i]), set()).add(part)
    repeated = {p for p, c in children.items() if len(c) >= 3} if collapse else set()  # 3+ alike: a stack
    first = {p: min(c, key=int) for p, c in children.items() if p in repeated}
    node_id, members = {}, {}
    for name in names:
        block = _block_of(name, repeated)
        parent, _, idx = (block or "").rpartition(".")
        nid = block if block and idx != first.get(parent) else name
        node_id[name] = nid
        members.setdefault(nid, []).append(name)
    depth: dict[str, int] = {}
    edges = []
    for a, b in graph["edges"]:
        ia, ib = node_id[a], node_id[b]
        if ia != ib and (ia, ib) not in edges:
            edges.append((ia, ib))
    incoming: dict[str, list] = {}
    for a, b in edges:
        incoming.setdefault(b, []).append(a)
    for nid in members:  # execution order is a topological order
        depth[nid] = 1 + max((depth.get(a, 0) for a in incoming.get(nid, [])), default=-1)
    rows: dict[int, list] = {}
    for nid in members:
        rows.setdefault(depth[nid], []).append(nid)
    pos = {nid: (i - (len(row) - 1) / 2, -d) for d, row in rows.items() for i, nid in enumerate(row)}
    return pos, edges, members


class FusionExplorer(StaticFigureMixin, W.VBox):
    """Graph + decisions of ``ol.fusion.analyze(model, example_inputs)``.

    ``explorer.pattern_boxes["qkv"].value = False`` re-plans without QKV fusion (as clicking does);
    ``explorer.apply_button.click()`` applies the plan and fills ``explorer.measurements``.
    """

    def __init__(self, model: nn.Module, example_inputs, collapse: bool = True, height: int = 720):
        check_type("model", model, nn.Module)
        check_type("collapse", collapse, bool)
        self.model, self.example_inputs = model, example_inputs
        self.plan = self._base = ol.fusion.analyze(model, example_inputs)
        self.measurement = None
        self.pos, self.edges, self.members = graph_layout(self.plan.graph, collapse)
        self._nodes = {n["name"]: n for n in self.plan.graph["nodes"]}
        self.pattern_boxes = {f: W.Checkbox(value=True, description=f, indent=False,
                                            layout=W.Layout(width="200px")) for f in ol.fusion.FAMILIES}
        for box in self.pattern_boxes.values():
            box.observe(self._replan, names="value")
        self.apply_button = W.Button(description="apply & measure", button_style="primary", icon="bolt")
        self.apply_button.on_click(self._apply)
        self.figure = go.FigureWidget(layout=go.Layout(
            height=height, showlegend=True, hovermode="closest", dragmode="pan", margin=dict(l=10, r=10, t=40, b=10),
            title=f"{self.plan.model}: dataflow graph (scroll to zoom)", xaxis=dict(visible=False),
            yaxis=dict(visible=False), legend=dict(orientation="h", y=1.02, x=0)))
        self._init_traces()
        self.table = W.HTML()
        self.measurements = W.HTML("<i>press “apply & measure” to run eager vs fused on the example inputs</i>")
        self._redraw()
        controls = W.HBox([*self.pattern_boxes.values(), self.apply_button])
        super().__init__([controls, self.figure, self.measurements, self.table])

    # -- drawing --------------------------------------------------------------------------------------------
    def _init_traces(self) -> None:
        ex, ey = [], []
        for a, b in self.edges:
            (x0, y0), (x1, y1) = self.pos[a], self.pos[b]
            ex += [x0, x1, None]
            ey += [y0, y1, None]
        traces = [go.Scatter(x=ex, y=ey, mode="lines", line=dict(color="#d0d0d0", width=1), hoverinfo="skip",
                             name="dataflow", showlegend=False)]
        for fam, color in PATTERN_COLORS.items():
            traces.append(go.Scatter(mode="markers+text", name=f"fused: {fam}", textposition="middle right",
                                     marker=dict(size=13, color=color, line=dict(width=1, color="#333"))))
        traces.append(go.Scatter(mode="markers+text", name="rejected (hover for why)", textposition="middle right",
                                 marker=dict(size=13, color=_REJECTED, symbol="x")))
        traces.append(go.Scatter(mode="markers", name="other ops", marker=dict(size=7, color=_OTHER)))
        traces.append(go.Scatter(mode="markers+text", name="repeated block", textposition="middle right",
                                 marker=dict(size=16, color=_BLOCK, symbol="square")))
        for t in traces:
            t.hoverlabel = dict(align="left")
        self.figure.add_traces(traces)

    def _categories(self) -> dict[str, tuple[str, str]]:
        """node name -> (category, hover line) under the current plan."""
        cat: dict[str, tuple[str, str]] = {}
        for d in self.plan.decisions:
            for name in d.nodes:
                if d.fused:
                    cat[name] = (_family(d.pattern), f"<b>{d.pattern}</b> fused, saves {d.saved_bytes / 2**20:.2f} MiB")
                elif name not in cat or cat[name][0] == "rejected":
                    cat[name] = ("rejected", f"<b>{d.pattern}</b> rejected: {html.escape(d.reason)}")
        return cat

    def _hover(self, name: str, extra: str) -> str:
        n = self._nodes[name]
        shape = "x".join(map(str, n["shape"])) if n["shape"] else ""
        return f"{html.escape(n['label'])}<br>{n['type']} {shape}" + (f"<br>{extra}" if extra else "")

    def _redraw(self) -> None:
        cat = self._categories()
        groups: dict[str, dict[str, list]] = {k: {"x": [], "y": [], "text": [], "hover": []}
                                              for k in [*PATTERN_COLORS, "rejected", "other", "block"]}
        for nid, names in self.members.items():
            x, y = self.pos[nid]
            if len(names) > 1 or nid not in self._nodes:  # a collapsed block
                fused = [c for c in (cat.get(n) for n in names) if c and c[0] != "rejected"]
                rej = sum(1 for n in names if cat.get(n, ("",))[0] == "rejected")
                g, text = groups["block"], nid
                hover = f"<b>{nid}</b> ({len(names)} ops, collapsed)<br>{len(fused)} ops in fused chains, " \
                        f"{rej} in rejected ones"
            else:
                kind, extra = cat.get(nid, ("other", ""))
                g, hover = groups[kind], self._hover(nid, extra)
                text = self._nodes[nid]["label"].rsplit(".", 1)[-1] if kind != "other" else ""
            g["x"].append(x)
            g["y"].append(y)
            g["text"].append(text)
            g["hover"].append(hover)
        with self.figure.batch_update():
            for trace, key in zip(self.figure.data[1:], [*PATTERN_COLORS, "rejected", "other", "block"]):
                g = groups[key]
                trace.x, trace.y, trace.hovertext = g["x"], g["y"], g["hover"]
                trace.hoverinfo = "text"
                if trace.mode and "text" in trace.mode:
                    trace.text = g["text"]
        self.table.value = self.plan._repr_html_()

    # -- events ---------------------------------------------------------------------------------------------
    def _replan(self, *_) -> None:
        enabled = [f for f, box in self.pattern_boxes.items() if box.value]
        self.plan = self._base.replan(enabled)
        self._redraw()

    def _apply(self, *_) -> None:
        self.apply_button.disabled = True
        try:
            fused = ol.fusion.apply(self.model, self.plan)
            self.measurement = ol.fusion.measure(self.model, fused, self.example_inputs)
            self.measurements.value = _measurement_html(self.measurement, self.plan)
        finally:
            self.apply_button.disabled = False


def _measurement_html(m, plan) -> str:
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    rows = [("activation bytes", mib(m.eager_bytes), mib(m.fused_bytes), f"{m.activation_ratio:.2f}x"),
            ("step time (fwd+bwd, median)", f"{m.eager_seconds * 1e3:.1f} ms", f"{m.fused_seconds * 1e3:.1f} ms",
             f"{m.speedup:.2f}x speed-up"),
            ("plan's estimate", mib(plan.activation_bytes), mib(plan.estimated_activation_bytes),
             f"{plan.activation_ratio:.2f}x")]
    body = "".join(f"<tr><td>{a}</td><td>{b}</td><td>{c}</td><td>{d}</td></tr>" for a, b, c, d in rows)
    return (f"<table><thead><tr><th></th><th>eager</th><th>fused</th><th>ratio</th></tr></thead><tbody>{body}"
            f"</tbody></table><small>max |eager - fused| on the example inputs: {m.max_abs_error:.2e}</small>")
