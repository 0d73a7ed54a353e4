"""Comparing two traces: align their events, measure each pair's errors, name the first divergence.

Alignment: events are keyed by (phase, kind, module path, op, occurrence). Where a module's op sequence
differs between the runs (a fused op against the chain it replaced) its ops are not paired; the module's
forward outputs and the parameter gradients still are, so the comparison happens at module boundaries.
Ordering is by execution, judging by elementwise errors: the first forward divergence is the first op
whose output leaves the tolerance; the first backward divergence is the first backward op that leaves it
for a reason of its own (a changed leaf input such as a weight, or the same inputs giving new outputs),
not because a diverged forward activation or upstream gradient reached it.

``checker`` (one process) and ``distributed`` (rank against rank 0) both build on ``compare_traces``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from opsnn_lab.consistency.records import OpRecord, Trace
from opsnn_lab.consistency.report import (
    ConsistencyReport,
    Divergence,
    Row,
    merge_errors,
    short_op,
    tensor_errors,
    tolerance_for,
)
from opsnn_lab.consistency.stats import summarize

__all__ = ["compare_traces", "make_row"]


# --------------------------------------------------------------------------- alignment and rows
def _align(ref: Trace, run: Trace) -> tuple[list[tuple[OpRecord, OpRecord]], list[str]]:
    def sequences(tr: Trace) -> dict:
        seq = defaultdict(list)
        for r in tr.records:
            if r.kind == "op":
                seq[(r.phase, r.module_path)].append(r.op)
        return seq

    ref_seq, run_seq = sequences(ref), sequences(run)
    bad = {k for k in set(ref_seq) | set(run_seq) if ref_seq.get(k) != run_seq.get(k)}
    by_key = ref.by_key()
    pairs = []
    for r in run.records:
        if r.kind == "op" and (r.phase, r.module_path) in bad:
            continue
        q = by_key.get(r.key)
        if q is not None:
            pairs.append((r, q))
    return pairs, sorted({path or "<root>" for _, path in bad})


def _dtype(stats) -> torch.dtype:
    return getattr(torch, stats.dtype, torch.float32) if stats else torch.float32


def _tolerance(a: torch.dtype, b: torch.dtype, precision) -> tuple[float, float]:
    # two dtypes (fp32 against bf16): the looser of the two defaults
    return max(tolerance_for(a, precision), tolerance_for(b, precision))


def _errors(run: OpRecord, ref: OpRecord, precision) -> tuple[dict, float, float, str]:
    first = (run.output_stats[0] if run.output_stats else None), (ref.output_stats[0] if ref.output_stats else None)
    atol, rtol = _tolerance(_dtype(first[0]), _dtype(first[1]), precision)
    same_hash = len(run.output_stats) == len(ref.output_stats) and all(
        a.hash == b.hash and a.shape == b.shape and a.dtype == b.dtype
        for a, b in zip(run.output_stats, ref.output_stats))
    if same_hash:
        return merge_errors([]), atol, rtol, "hash"
    if run.summarised or ref.summarised:
        return _statistics_errors(run.output_stats, ref.output_stats, precision), atol, rtol, "statistics"
    if run.outputs is None or ref.outputs is None or len(run.outputs) != len(ref.outputs):
        nan = float("nan")
        return ({"max_abs_err": nan, "max_rel_err": nan, "cosine": nan, "ulp": None, "frac_beyond": nan,
                 "exact": False}, atol, rtol, "hash")
    errs = []
    for a, b, sa, sb in zip(run.outputs, ref.outputs, run.output_stats, ref.output_stats):
        ta, tr_ = _tolerance(a.dtype, b.dtype, precision)
        finite = sa.nan == sa.inf == sb.nan == sb.inf == 0
        errs.append(tensor_errors(a, b, ta, tr_, finite=finite))
    return merge_errors(errs), atol, rtol, "elementwise"


def _statistics_errors(run: list, ref: list, precision) -> dict:
    """What the statistics of two tensors whose bits differ prove, for an event summarised past a trace's memory
    limit: ``max_abs_err`` is a lower bound, the largest change of the minimum or the maximum (each moves by at
    most the largest elementwise change), and ``beyond`` says whether that bound alone leaves the tolerance at
    the reference's largest magnitude (some element is then beyond ``atol + rtol * |ref|``); otherwise the bits
    differ by an unknown amount. A changed shape, dtype or count of NaN/Inf is beyond as well. The elementwise
    fraction beyond is unknown (NaN)."""
    nan = math.nan
    bound, beyond = 0.0, len(run) != len(ref)
    for a, b in zip(run, ref):
        if a.shape != b.shape or a.dtype != b.dtype or a.nan != b.nan or a.inf != b.inf:
            bound, beyond = math.inf, True
            continue
        if a.hash == b.hash or not math.prod(a.shape):
            continue
        atol, rtol = _tolerance(_dtype(a), _dtype(b), precision)
        gap = max(abs(a.min - b.min), abs(a.max - b.max))
        bound = max(bound, gap)
        beyond |= gap > atol + rtol * max(abs(b.min), abs(b.max))
    return {"max_abs_err": bound, "max_rel_err": nan, "cosine": nan, "ulp": None,
            "frac_beyond": nan, "exact": False, "beyond": beyond}


def make_row(i: int, run: OpRecord, ref: OpRecord, precision) -> Row:
    e, atol, rtol, measured = _errors(run, ref, precision)
    if measured == "hash":
        diverged = not e["exact"]
    elif measured == "statistics":
        diverged = e.pop("beyond")
    else:
        diverged = e["frac_beyond"] > 0
    return Row(i, run.phase, run.kind, run.op, run.module_path, run.location, run.occurrence, run.index,
               ref.index, e["exact"], bool(diverged), e["max_abs_err"], e["max_rel_err"], e["cosine"], e["ulp"],
               e["frac_beyond"], atol, rtol, measured=measured,
               run_stats=[s.as_dict() for s in run.output_stats], ref_stats=[s.as_dict() for s in ref.output_stats])


_RANDOM = tuple(f"aten.{n}" for n in ("rand.", "rand_like", "randn", "randint", "randperm", "normal", "uniform_",
                                        "random_", "exponential_", "bernoulli_", "geometric_", "cauchy_",
                                        "log_normal_"))


def _origin(row: Row, run: OpRecord, ref: OpRecord, differs_at: dict, seen_difference: bool) -> str:
    """Why a row's output differs (bitwise): a leaf input differs ("input"), nothing upstream differs ("op"),
    an upstream row differs ("propagated"), or an input comes from a restructured module ("unaligned")."""
    if row.exact:
        return ""
    if row.kind != "op":
        return "propagated" if seen_difference else "op"
    if row.op.startswith(_RANDOM):  # a generator's inputs give only shape and dtype: new bits are its own
        return "op"
    for a, b in zip(run.input_stats, ref.input_stats):
        if a is not None and b is not None and (a.hash != b.hash or a.shape != b.shape):
            return "input"
    produced = [p for p in run.input_producers if p is not None and p >= 0]
    if any(differs_at.get(p, False) for p in produced):
        return "propagated"
    if any(p not in differs_at for p in produced):
        return "unaligned"   # the difference enters from a module whose ops have no counterpart (fused)
    return "op"


def _backward_root(rows: list[Row], records: dict) -> Row | None:
    """The earliest backward row that differs for a reason of its own and feeds a row beyond tolerance."""
    beyond = [r for r in rows if r.phase == "backward" and r.diverged]
    if not beyond:
        return None
    by_run = {r.run_index: r for r in rows}
    stack, seen, roots = list(beyond), set(), []
    while stack:
        row = stack.pop()
        if row.index in seen:
            continue
        seen.add(row.index)
        if row.origin in ("input", "op", "unaligned"):
            roots.append(row)
        for p in records[row.index][0].input_producers:
            up = by_run.get(p) if p is not None else None
            if up is not None and up.phase == "backward" and not up.exact:
                stack.append(up)
    return min(roots, key=lambda r: r.index) if roots else beyond[0]


def _divergence(row: Row, run: OpRecord, ref: OpRecord) -> Divergence:
    def inputs(rec: OpRecord) -> list:
        held = rec.input_tensors()
        if held:
            return [summarize(t).as_dict() for t in held]
        return [s.as_dict() if s is not None else None for s in rec.input_stats]

    return Divergence(short_op(row.op), row.module_path, row.location, row.phase, row.index, row.max_abs_err,
                      row.max_rel_err, row.cosine, row.ulp, row.frac_beyond, row.origin,
                      input_stats={"reference": inputs(ref), "run": inputs(run)},
                      output_stats={"reference": row.ref_stats, "run": row.run_stats}, aten_op=row.op,
                      measured=row.measured)


def compare_traces(ref: Trace, run: Trace, precision: float | None = 1e-6) -> tuple[ConsistencyReport, dict]:
    """Compare ``run`` with ``ref``; return the report and ``{row index: (run record, ref record)}``.

    The forward divergence is the first forward row beyond tolerance. The backward divergence is the
    earliest backward row that differs on its own account (a changed leaf such as a weight, or the same
    inputs giving other bits) among those feeding a backward row beyond tolerance; when every backward
    difference is inherited from the forward pass, the first backward row beyond tolerance.
    """
    pairs, unaligned = _align(ref, run)
    rows, records, differs_at = [], {}, {}
    seen = {"forward": False, "backward": False}
    for i, (a, b) in enumerate(pairs):
        row = make_row(i, a, b, precision)
        row.origin = _origin(row, a, b, differs_at, seen[row.phase] or seen["forward"])
        differs_at[a.index] = not row.exact
        seen[row.phase] |= not row.exact
        rows.append(row)
        records[i] = (a, b)
    report = ConsistencyReport(rows=rows, unaligned=unaligned, precision=precision)
    first = {"forward": next((r for r in rows if r.phase == "forward" and r.diverged), None),
             "backward": _backward_root(rows, records)}
    for phase, row in first.items():
        if row is not None:
            setattr(report, f"{phase}_divergence", _divergence(row, *records[row.index]))
    return report, records
