"""FusionPlan and Decision: what analysis found, as data (JSON round trip, HTML table, totals)."""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field, fields

__all__ = ["Decision", "FusionPlan"]


@dataclass
class Decision:
    pattern: str  # "conv_bn_relu", "conv_bn_relu_maxpool", "linear_gelu_dropout[_linear]", "qkv", "attention"
    modules: list[str]  # qualified module names (attention: its scope first)
    fused: bool
    reason: str  # always set: what was fused into which op, or why not
    saved_bytes: int = 0  # activation bytes this chain alone saves per training step, at the example shapes
    traffic_bytes: int = 0  # estimated memory traffic avoided per step (forward + backward)
    route: str = ""  # "module:chain" | "module:qkv" | "module:whole" | "module:sdpa" | "fx:<region>" ('' if none)
    carriers: list[str] = field(default_factory=list)  # module routes: the modules whose forward is patched
    first: int = 0  # module:qkv: the sibling called first (it runs the packed GEMM)
    ops: list[str] = field(default_factory=list)  # canonical op of each chain step (a plan from JSON rebuilds)
    chain: list[str] = field(default_factory=list)  # node labels, in execution order
    nodes: list[str] = field(default_factory=list)  # node names in ``FusionPlan.graph`` (unique)
    shapes: list = field(default_factory=list)  # output shape of each chain node
    params: dict = field(default_factory=dict)  # scalars the op is built with (attention: scale, dropout_p)

    @property
    def key(self) -> tuple:
        return (self.pattern, tuple(self.modules))


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@dataclass
class FusionPlan:
    decisions: list[Decision]
    routes: list[dict] = field(default_factory=list)  # per traced/untraceable module: path, route, reason
    activation_bytes: int = 0  # eager bytes saved for backward, whole model, from the trace
    patterns: list[str] | None = None  # enabled pattern families (None: all)
    model: str = ""
    analysis_seconds: float = 0.0
    graph: dict = field(default_factory=dict, repr=False)  # nodes + edges of the run-time trace, for views
    # what the fused chains save together (cost.CostModel.fused_total); per-decision savings do not add up where
    # chains share storages (two norms reading one tensor). None: a plan from older JSON, which sums them.
    saved_together: int | None = None
    # modules holding parameters of which nothing ran in the recorded forward (layerdrop, a branch) -> why:
    # nothing of them was analysed, they run unfused
    not_analysed: dict = field(default_factory=dict)
    _analysis: object = field(default=None, repr=False, compare=False)

    # -- totals --------------------------------------------------------------------------------------------
    @property
    def fused(self) -> list[Decision]:
        return [d for d in self.decisions if d.fused]

    @property
    def saved_bytes(self) -> int:
        return self.saved_together if self.saved_together is not None else sum(d.saved_bytes for d in self.fused)

    @property
    def traffic_bytes(self) -> int:
        return sum(d.traffic_bytes for d in self.fused)

    @property
    def estimated_activation_bytes(self) -> int:
        """Eager activation bytes minus what the fused decisions save."""
        return self.activation_bytes - self.saved_bytes

    @property
    def activation_ratio(self) -> float:
        return self.estimated_activation_bytes / self.activation_bytes if self.activation_bytes else 1.0

    def summary(self) -> dict:
        """``{pattern: {"fused": n, "rejected": n}}``."""
        out: dict = {}
        for d in self.decisions:
            row = out.setdefault(d.pattern, {"fused": 0, "rejected": 0})
            row["fused" if d.fused else "rejected"] += 1
        return out

    def replan(self, patterns=None) -> FusionPlan:
        """The same analysis with other patterns switched on (cheap: no new trace)."""
        if self._analysis is None:
            raise ValueError("plan has no analysis attached (loaded from JSON); call ol.fusion.analyze again")
        return self._analysis.plan(patterns)

    # -- data ----------------------------------------------------------------------------------------------
    def to_json(self, **kw) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        data["decisions"] = [asdict(d) for d in self.decisions]
        return json.dumps(data, **kw)

    @classmethod
    def from_json(cls, text: str) -> FusionPlan:
        data = json.loads(text)
        data["decisions"] = [Decision(**d) for d in data["decisions"]]
        for d in data["decisions"]:
            d.shapes = [tuple(s) if isinstance(s, list) else s for s in d.shapes]
        return cls(**data)

    def __repr__(self) -> str:
        s = ", ".join(f"{k}: {v['fused']} fused/{v['rejected']} rejected" for k, v in self.summary().items())
        skipped = (f"; {len(self.not_analysed)} module{'s' if len(self.not_analysed) > 1 else ''} not analysed "
                   f"(not called in the analysis forward): {', '.join(self.not_analysed)}") if self.not_analysed else ""
        return (f"FusionPlan({self.model or 'model'}: {s or 'no candidates'}; saves {_mib(self.saved_bytes)} of "
                f"{_mib(self.activation_bytes)} activations{skipped})")

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr style='color:{'#1a7f37' if d.fused else '#9a6700'}'><td>{html.escape(d.pattern)}</td>"
            f"<td>{'fused' if d.fused else 'rejected'}</td><td>{html.escape(', '.join(d.modules))}</td>"
            f"<td style='text-align:right'>{_mib(d.saved_bytes)}</td><td>{html.escape(d.reason)}</td></tr>"
            for d in self.decisions)
        routes = "".join(f"<li><code>{html.escape(r['path'] or '<model>')}</code>: {html.escape(r['route'])}"
                         f"{' &mdash; ' + html.escape(r['reason']) if r['reason'] else ''}</li>" for r in self.routes)
        skipped = "".join(f"<li><code>{html.escape(p)}</code>: {html.escape(why)}</li>"
                          for p, why in self.not_analysed.items())
        skipped = f"<details open><summary>not analysed</summary><ul>{skipped}</ul></details>" if skipped else ""
        return (f"<div><b>{html.escape(repr(self))}</b>{skipped}"
                f"<table><thead><tr><th>pattern</th><th>decision</th><th>modules</th><th>saves</th><th>reason</th>"
                f"</tr></thead><tbody>{rows}</tbody></table>"
                f"<details><summary>tracing routes</summary><ul>{routes}</ul></details></div>")
