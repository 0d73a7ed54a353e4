"""What a consistency check found: per-op rows with elementwise errors, the first divergence, the report.

Errors are elementwise (run against reference, both in float64): max abs error, max relative error with a
floor against tiny denominators, cosine similarity, ULP distance (same dtype only) and the fraction of
elements beyond ``|a - b| <= atol + rtol * |b|``. Statistics (min/max/mean/std/norm) are shown, never judged:
a LayerNorm output has a mean near zero, so its relative mean error is huge whatever happened upstream.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import asdict, dataclass, field

import torch

__all__ = ["Row", "Divergence", "ConsistencyReport", "tensor_errors", "tolerance_for", "merge_errors"]

# Per-dtype (atol, rtol) when precision=None: fp32 values that agree to ~100 ulp, looser below.
_DEFAULT_TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-6, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}
_ORD_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def tolerance_for(dtype: torch.dtype, precision: float | None) -> tuple[float, float]:
    """(atol, rtol): ``precision`` for both, or the dtype's default when ``precision`` is None."""
    if precision is not None:
        return float(precision), float(precision)
    if not (dtype.is_floating_point or dtype.is_complex):
        return 0.0, 0.0
    return _DEFAULT_TOL.get(dtype, (1e-6, 1e-5))


def _ordered(t: torch.Tensor) -> torch.Tensor:
    # IEEE bits -> integers whose difference counts representable values between two floats
    size = t.element_size()
    i = t.contiguous().view(_ORD_BITS[size]).to(torch.int64)
    return torch.where(i < 0, -(i + 2 ** (8 * size - 1)), i)


_EXACT = {"max_abs_err": 0.0, "max_rel_err": 0.0, "cosine": 1.0, "ulp": 0, "frac_beyond": 0.0, "exact": True}


def _ordered_native(i: torch.Tensor) -> torch.Tensor:
    # the same mapping as _ordered, in the integer width of the float (no int64 pass)
    m = i >> (8 * i.element_size() - 1)
    return (i ^ (m & (2 ** (8 * i.element_size() - 1) - 1))) - m


def _max_ulp(run: torch.Tensor, ref: torch.Tensor) -> int:
    """Largest ULP distance, in the float's own integer width; the rare pairs whose distance overflows
    that width (far apart across zero) are redone in float64, which holds them exactly."""
    bits = _ORD_BITS[run.element_size()]
    oa, ob = _ordered_native(run.contiguous().view(bits)), _ordered_native(ref.contiguous().view(bits))
    raw = oa - ob
    overflow = ((oa ^ ob) & (raw ^ oa)) < 0
    best = int(raw.abs_().masked_fill_(overflow, 0).max())
    if bool(overflow.any()):
        best = max(best, int((oa[overflow].double() - ob[overflow].double()).abs().max()))
    return best


def _finite_errors(run: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> dict:
    """Fast path for finite tensors of one float dtype: ~12 passes in that dtype (float32 for halves)."""
    x, y = (run, ref) if run.element_size() >= 4 else (run.float(), ref.float())
    d = torch.sub(x, y).abs_()
    ay = y.abs()
    rel = d / ay.clamp_min(max(atol, torch.finfo(x.dtype).tiny))
    stats = [d.max(), rel.max(), torch.linalg.vector_norm(x), torch.linalg.vector_norm(y), torch.linalg.vector_norm(d)]
    thr = ay.mul_(rtol).add_(atol)
    stats.append((d > thr).sum().to(d.dtype))
    max_abs, max_rel, nx, ny, nd, beyond = torch.stack(stats).tolist()
    if nx == 0 or ny == 0:
        cosine = 1.0 if nx == ny else 0.0
    else:  # x.y from three norms, written so that x ~ y loses no digits: 1 - (|d|^2 - (|x|-|y|)^2) / 2|x||y|
        cosine = max(-1.0, min(1.0, 1.0 - (nd * nd - (nx - ny) ** 2) / (2.0 * nx * ny)))
    exact = max_abs == 0.0 and torch.equal(run, ref)
    return {"max_abs_err": max_abs, "max_rel_err": max_rel, "cosine": cosine,
            "ulp": 0 if exact else _max_ulp(run, ref), "frac_beyond": beyond / d.numel(), "exact": exact}


def tensor_errors(run: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float, *, finite: bool = False) -> dict:
    """Elementwise errors of ``run`` against ``ref`` (see the module docstring).

    ``finite=True`` promises no NaN/Inf in either tensor (the tracer's statistics know) and takes the
    fast path when both have the same float dtype.
    """
    run, ref = run.detach(), ref.detach()
    if tuple(run.shape) != tuple(ref.shape):
        return {"max_abs_err": math.inf, "max_rel_err": math.inf, "cosine": math.nan, "ulp": None,
                "frac_beyond": 1.0, "exact": False}
    if run.numel() == 0:
        return dict(_EXACT)
    if run.device != ref.device:
        run = run.cpu()
        ref = ref.cpu()
    if finite and run.dtype == ref.dtype and run.dtype.is_floating_point and run.element_size() in _ORD_BITS:
        return _finite_errors(run, ref, atol, rtol)
    if run.is_complex() or ref.is_complex():
        run, ref = torch.view_as_real(run.to(torch.complex128)), torch.view_as_real(ref.to(torch.complex128))
    x, y = run.to(torch.float64), ref.to(torch.float64)
    same = (x == y) | (torch.isnan(x) & torch.isnan(y))
    d = torch.where(same, torch.zeros((), dtype=x.dtype, device=x.device), (x - y).abs())
    d = torch.nan_to_num(d, nan=math.inf)
    floor = max(atol, torch.finfo(torch.float64).tiny)
    rel = d / y.abs().nan_to_num(nan=0.0, posinf=0.0).clamp_min(floor)
    beyond = d > atol + rtol * y.abs().nan_to_num(nan=0.0, posinf=0.0)
    fx, fy = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), torch.nan_to_num(y, nan=0.0, posinf=0.0,
                                                                                      neginf=0.0)
    max_abs, max_rel, frac, dot, nx, ny = torch.stack([
        d.max(), rel.max(), beyond.to(torch.float64).mean(), (fx * fy).sum(), fx.norm(), fy.norm()]).tolist()
    cosine = _cosine(fx, fy, dot, nx, ny)
    ulp = None
    if run.dtype == ref.dtype and run.dtype.is_floating_point and run.element_size() in _ORD_BITS:
        ulp = int((_ordered(run) - _ordered(ref)).abs().max())
    exact = bool(same.all()) and run.dtype == ref.dtype
    return {"max_abs_err": max_abs, "max_rel_err": max_rel, "cosine": cosine, "ulp": ulp,
            "frac_beyond": frac, "exact": exact}


def _cosine(x: torch.Tensor, y: torch.Tensor, dot: float, nx: float, ny: float) -> float:
    if nx == 0 or ny == 0:
        return 1.0 if nx == ny else 0.0
    if nx * ny == 0 or dot == 0:  # denormal magnitudes: rescale before multiplying
        x, y = x / x.abs().max(), y / y.abs().max()
        dot, nx, ny = float((x * y).sum()), float(x.norm()), float(y.norm())
    return dot / (nx * ny)


def merge_errors(per_output: list[dict]) -> dict:
    """One row's errors from several outputs: the worst of each metric."""
    if not per_output:
        return dict(_EXACT)
    ulps = [e["ulp"] for e in per_output if e["ulp"] is not None]
    return {"max_abs_err": max(e["max_abs_err"] for e in per_output),
            "max_rel_err": max(e["max_rel_err"] for e in per_output),
            "cosine": min(e["cosine"] for e in per_output),
            "ulp": max(ulps) if ulps else None,
            "frac_beyond": max(e["frac_beyond"] for e in per_output),
            "exact": all(e["exact"] for e in per_output)}


@dataclass
class Row:
    """One aligned event (op, module output or parameter gradient) of the compared run."""

    index: int
    phase: str
    kind: str
    op: str
    module_path: str
    location: str
    occurrence: int
    run_index: int
    ref_index: int
    exact: bool
    diverged: bool
    max_abs_err: float
    max_rel_err: float
    cosine: float
    ulp: int | None
    frac_beyond: float
    atol: float
    rtol: float
    origin: str = ""            # "input" (a leaf input differs), "op" (same inputs, new output), "propagated"
    # "hash": only hashes and statistics here (another rank's, a file's), tensors to be fetched where they differ;
    # "statistics": an event summarised past a trace's memory limit, judged from its statistics only
    measured: str = "elementwise"
    run_stats: list = field(default_factory=list)
    ref_stats: list = field(default_factory=list)

    @property
    def short_op(self) -> str:
        return short_op(self.op)


def short_op(op: str) -> str:
    """``aten.addmm.default`` -> ``aten.addmm``."""
    parts = op.split(".")
    return ".".join(parts[:2]) if parts[0] == "aten" and len(parts) > 2 else op


@dataclass
class Divergence:
    """The first op (in execution order) whose output leaves the tolerance, with both runs' statistics."""

    op: str
    module_path: str
    location: str
    phase: str
    index: int
    max_abs_err: float
    max_rel_err: float
    cosine: float
    ulp: int | None
    frac_beyond: float
    origin: str
    input_stats: dict = field(default_factory=dict)    # {"reference": [...], "run": [...]}
    output_stats: dict = field(default_factory=dict)
    aten_op: str = ""
    measured: str = "elementwise"

    def __str__(self) -> str:
        where = f"{self.phase} divergence at {self.module_path or '<root>'} / {self.op} ({self.location})"
        if self.measured == "statistics":
            return (f"{where}: max abs err >= {self.max_abs_err:.3g} (from statistics: past the trace's "
                    f"memory limit), origin {self.origin}")
        return (f"{where}: max abs err {self.max_abs_err:.3g}, max rel err {self.max_rel_err:.3g}, "
                f"cosine {self.cosine:.6f}, origin {self.origin}")


@dataclass
class ConsistencyReport:
    """Rows for every aligned op of a compared run, in execution order, and its first divergences."""

    rows: list[Row] = field(default_factory=list)
    forward_divergence: Divergence | None = None
    backward_divergence: Divergence | None = None
    unaligned: list[str] = field(default_factory=list)   # module paths whose op sequences differ
    precision: float | None = 1e-6
    reference_only: bool = False
    dump_path: str | None = None
    dump_error: str | None = None
    rank: int | None = None
    exchanged: list = field(default_factory=list)   # distributed: ops whose tensors were fetched from rank 0

    @property
    def ok(self) -> bool:
        return self.forward_divergence is None and self.backward_divergence is None

    @property
    def first_divergence(self) -> Divergence | None:
        return self.forward_divergence or self.backward_divergence

    @property
    def max_abs_err(self) -> float:
        return max((r.max_abs_err for r in self.rows), default=0.0)

    def diverged_rows(self) -> list[Row]:
        return [r for r in self.rows if r.diverged]

    def unresolved_rows(self) -> list[Row]:
        """Events past a trace's memory limit whose bits differ while their statistics stay within tolerance:
        whether they diverge is unknown (a larger ``memory_limit`` keeps their tensors)."""
        return [r for r in self.rows if r.measured == "statistics" and not r.exact and not r.diverged]

    @property
    def unresolved_summary(self) -> str:
        """One line on the unresolved rows ('' when there are none)."""
        rows = self.unresolved_rows()
        if not rows:
            return ""
        first = rows[0]
        return (f"{len(rows)} events past the memory limit differ in bits within what their statistics show "
                f"(first: {first.phase} {first.module_path or '<root>'} / {first.short_op}); a larger "
                "memory_limit keeps their tensors")

    def to_dict(self) -> dict:
        d = {"ok": self.ok, "precision": self.precision, "reference_only": self.reference_only,
             "unaligned": self.unaligned, "dump_path": self.dump_path, "dump_error": self.dump_error,
             "rank": self.rank, "exchanged": self.exchanged, "unresolved": len(self.unresolved_rows()),
             "forward_divergence": asdict(self.forward_divergence) if self.forward_divergence else None,
             "backward_divergence": asdict(self.backward_divergence) if self.backward_divergence else None,
             "rows": [asdict(r) for r in self.rows]}
        return _finite(d)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __repr__(self) -> str:
        if self.reference_only:
            return f"ConsistencyReport(reference recorded: {len(self.rows)} events)"
        head = f"ConsistencyReport(ok={self.ok}, rows={len(self.rows)}, diverged={len(self.diverged_rows())}"
        lines = [head + ")"]
        lines += [f"  {d}" for d in (self.forward_divergence, self.backward_divergence) if d is not None]
        if self.unresolved_summary:
            lines.append(f"  {self.unresolved_summary}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        esc = html.escape
        if self.reference_only:
            return f"<b>ConsistencyReport</b>: reference recorded ({len(self.rows)} events)"
        colour = "#1a7f37" if self.ok else "#cf222e"
        out = [f"<div><b>ConsistencyReport</b> <span style='color:{colour}'>"
               f"{'ok' if self.ok else 'DIVERGED'}</span> - {len(self.rows)} events compared, "
               f"{len(self.diverged_rows())} beyond tolerance (precision {self.precision})</div>"]
        for d in (self.forward_divergence, self.backward_divergence):
            if d is not None:
                errors = (f"max abs &ge; {d.max_abs_err:.3g} (from statistics)" if d.measured == "statistics"
                          else f"max abs {d.max_abs_err:.3g}, max rel {d.max_rel_err:.3g}, cosine {d.cosine:.6f}")
                out.append(f"<div>first {d.phase} divergence: <code>{esc(d.module_path or '<root>')}</code> "
                           f"<code>{esc(d.op)}</code> at <code>{esc(d.location)}</code>: {errors} "
                           f"({esc(d.origin)})</div>")
        if self.unresolved_summary:
            out.append(f"<div>{esc(self.unresolved_summary)}</div>")
        if self.dump_path or self.dump_error:
            out.append(f"<div>dump: {esc(self.dump_path or 'failed: ' + str(self.dump_error))}</div>")
        shown = self.diverged_rows()[:20]
        if shown:
            head = "".join(f"<th>{h}</th>" for h in ("#", "phase", "module", "op", "max abs", "max rel",
                                                       "cosine", "ulp", "beyond", "origin"))
            body = "".join(
                f"<tr><td>{r.index}</td><td>{r.phase}</td><td>{esc(r.module_path)}</td><td>{esc(r.short_op)}</td>"
                f"<td>{r.max_abs_err:.3g}</td><td>{r.max_rel_err:.3g}</td><td>{r.cosine:.6f}</td>"
                f"<td>{r.ulp}</td><td>{r.frac_beyond:.2%}</td><td>{r.origin}</td></tr>" for r in shown)
            out.append(f"<table><tr>{head}</tr>{body}</table>")
        return "\n".join(out)


def _finite(v):
    """JSON has no NaN/Inf: write them as strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v
