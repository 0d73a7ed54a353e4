"""``ConsistencyChecker``: trace a step at operator level, compare it with a reference, name the first divergence.

    checker = ConsistencyChecker(precision=1e-6, check_gradients=True, dump_on_failure=True,
                                 dump_dir="consistency_dumps")
    with checker.trace(model):          # the first trace is the reference
        outputs = model(inputs); loss.backward()
    with checker.trace(model):          # later traces are compared with it
        ...
    checker.report.first_divergence     # op, module path, source line, statistics of both runs, errors

Alignment: events are keyed by (phase, kind, module path, op, occurrence). Where a module's op sequence
differs between the runs (a fused op against the chain it replaced) its ops are not paired; the module's
forward outputs and the parameter gradients still are, so the comparison happens at module boundaries.
Ordering is by execution, judging by elementwise errors: the first forward divergence is the first op
whose output leaves the tolerance; the first backward divergence is the first backward op that leaves it
for a reason of its own (a changed leaf input such as a weight, or the same inputs giving new outputs),
not because a diverged forward activation or upstream gradient reached it.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections import defaultdict

import torch

from opsnn_lab._checks import check_positive, check_type
from opsnn_lab.consistency.report import (
    ConsistencyReport,
    Divergence,
    Row,
    merge_errors,
    short_op,
    tensor_errors,
    tolerance_for,
)
from opsnn_lab.consistency.tracer import OpRecord, OpTracer, Trace, summarize

__all__ = ["ConsistencyChecker", "compare_traces"]


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


def make_row(i: int, run: OpRecord, ref: OpRecord, precision) -> Row:
    e, atol, rtol, measured = _errors(run, ref, precision)
    diverged = (not e["exact"]) if measured == "hash" else e["frac_beyond"] > 0
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
                      output_stats={"reference": row.ref_stats, "run": row.run_stats}, aten_op=row.op)


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


# --------------------------------------------------------------------------- the checker
class ConsistencyChecker:
    """Record steps at operator level and compare them (see the module docstring)."""

    def __init__(self, precision: float | None = 1e-6, check_gradients: bool = True, dump_on_failure: bool = True,
                 dump_dir: str | os.PathLike = "consistency_dumps"):
        if precision is not None:
            check_positive("precision", precision)
        self.precision = precision
        self.check_gradients = check_type("check_gradients", check_gradients, bool)
        self.dump_on_failure = check_type("dump_on_failure", dump_on_failure, bool)
        self.dump_dir = os.fspath(check_type("dump_dir", dump_dir, (str, os.PathLike)))
        self.reference: Trace | None = None
        self.last_trace: Trace | None = None
        self.report: ConsistencyReport | None = None
        self.step = 0

    def __repr__(self) -> str:
        ref = f"{len(self.reference)} events" if self.reference is not None else "none"
        return (f"ConsistencyChecker(precision={self.precision}, check_gradients={self.check_gradients}, "
                f"dump_on_failure={self.dump_on_failure}, dump_dir={self.dump_dir!r}, reference={ref})")

    @contextlib.contextmanager
    def trace(self, model: torch.nn.Module | None = None, *, across_ranks: bool | None = None):
        """Record the step run inside the block; the first one becomes the reference.

        Under an initialised ``torch.distributed`` group of more than one rank (or ``across_ranks=True``)
        every rank's trace is compared with rank 0's trace of the same step instead.
        """
        check_type("model", model, torch.nn.Module, allow_none=True)
        tracer = OpTracer(model, check_gradients=self.check_gradients)
        with tracer:
            yield tracer
        self._finish(tracer.trace, across_ranks)

    def _finish(self, trace: Trace, across_ranks: bool | None) -> None:
        self.last_trace = trace
        self.step += 1
        if across_ranks is None:
            across_ranks = (torch.distributed.is_available() and torch.distributed.is_initialized()
                            and torch.distributed.get_world_size() > 1)
        if across_ranks:
            from opsnn_lab.consistency.distributed import compare_with_rank0

            self.report, records = compare_with_rank0(trace, self.precision)
            self._dump(records, trace, None, sub=f"rank{self.report.rank}")
        elif self.reference is None:
            self.reference = trace
            self.report = ConsistencyReport(precision=self.precision, reference_only=True,
                                            rows=[make_row(i, r, r, self.precision)
                                                  for i, r in enumerate(trace.records)])
        else:
            self.check(trace)

    def check(self, trace: Trace, reference: Trace | None = None) -> ConsistencyReport:
        """Compare ``trace`` with ``reference`` (default: the checker's reference); sets ``self.report``."""
        reference = reference or self.reference
        if reference is None:
            raise ValueError("reference is None: trace a reference step first or load_reference(path)")
        self.report, records = compare_traces(reference, trace, self.precision)
        self._dump(records, trace, reference)
        return self.report

    def compare(self, fn_a, fn_b, *, model_a: torch.nn.Module | None = None,
                model_b: torch.nn.Module | None = None) -> ConsistencyReport:
        """Run ``fn_a()`` then ``fn_b()`` (e.g. unfused vs fused, CPU vs GPU) and compare b against a.

        Both start from the same CPU (and CUDA) random state, so dropout draws the same masks where the
        code paths draw the same numbers. Modules are discovered from the calls themselves; pass
        ``model_a``/``model_b`` to name parameter gradients from a model that is not called directly.
        """
        if not callable(fn_a):
            raise TypeError(f"fn_a must be callable, got {type(fn_a).__name__}")
        if not callable(fn_b):
            raise TypeError(f"fn_b must be callable, got {type(fn_b).__name__}")
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        state = torch.get_rng_state(), (torch.cuda.get_rng_state_all() if cuda else None)
        traces = []
        for fn, model in ((fn_a, model_a), (fn_b, model_b)):
            torch.set_rng_state(state[0])
            if cuda:
                torch.cuda.set_rng_state_all(state[1])
            with OpTracer(model, check_gradients=self.check_gradients) as tracer:
                fn()
            traces.append(tracer.trace)
        self.last_trace = traces[1]
        self.report, records = compare_traces(traces[0], traces[1], self.precision)
        self._dump(records, traces[1], traces[0])
        return self.report

    def save_reference(self, path: str | os.PathLike, *, tensors: bool = True) -> None:
        """Write the reference trace to ``path``; another process compares against it with ``load_reference``."""
        if self.reference is None:
            raise ValueError("no reference yet: run one traced step first")
        self.reference.save(path, tensors=tensors)

    def load_reference(self, path: str | os.PathLike) -> Trace:
        self.reference = Trace.load(path)
        return self.reference

    def reset(self) -> None:
        """Forget the reference; the next trace becomes the new one."""
        self.reference = self.last_trace = self.report = None

    def _dump(self, records: dict, run: Trace, ref: Trace | None, sub: str = "") -> None:
        report = self.report
        if report is None or report.ok or not self.dump_on_failure:
            return
        from opsnn_lab.consistency.dump import write_dump

        try:
            report.dump_path = str(write_dump(os.path.join(self.dump_dir, sub), report, records, run, ref))
        except Exception as exc:  # a failed dump (read-only dir, disk full) must never lose the report
            report.dump_error = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"consistency dump under {self.dump_dir!r} failed ({report.dump_error}); "
                          "the report is still in checker.report", RuntimeWarning, stacklevel=3)
