"""``ConsistencyChecker``: trace a step at operator level, compare it with a reference, name the first divergence.

    checker = ConsistencyChecker(precision=1e-6, check_gradients=True, dump_on_failure=True,
                                 dump_dir="consistency_dumps")
    with checker.trace(model):          # the first trace is the reference
        outputs = model(inputs); loss.backward()
    with checker.trace(model):          # later traces are compared with it
        ...
    checker.report.first_divergence     # op, module path, source line, statistics of both runs, errors

A trace holds every op's tensors until it is compared (the reference: for as long as it is the reference),
several times what the step itself holds at its peak. ``memory_limit`` ("2GiB", or bytes) bounds that: a
trace holds the tensors of its first events up to the limit, and each event after it keeps statistics and
hashes only, summarised as it is recorded. Rows past the limit are compared by hash and judged from their
statistics (``Row.measured == "statistics"``: beyond tolerance where the minimum or maximum alone moved beyond
it); ``report.unresolved_rows()`` lists those whose bits differ while their statistics cannot tell.

``checker.last_trace`` is the latest step's trace. The reference copies the parameters, inputs and
gradients it read; a compared trace holds them by reference (its statistics and hashes are from the end
of the step, and ``Trace.save(tensors=True)`` refuses once an optimizer step has changed them).

How two traces are aligned and which row counts as the first divergence: ``consistency/compare.py``.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

from opsnn_lab._checks import check_bytes, check_positive, check_type
from opsnn_lab.consistency.compare import compare_traces, make_row
from opsnn_lab.consistency.report import ConsistencyReport
from opsnn_lab.consistency.tracer import OpTracer, Trace, gc_paused

__all__ = ["ConsistencyChecker", "compare_traces"]


class ConsistencyChecker:
    """Record steps at operator level and compare them (see the module docstring)."""

    def __init__(self, precision: float | None = 1e-6, check_gradients: bool = True, dump_on_failure: bool = True,
                 dump_dir: str | os.PathLike = "consistency_dumps", *, memory_limit: int | str | None = None):
        if precision is not None:
            check_positive("precision", precision)
        self.precision = precision
        self.check_gradients = check_type("check_gradients", check_gradients, bool)
        self.dump_on_failure = check_type("dump_on_failure", dump_on_failure, bool)
        self.dump_dir = os.fspath(check_type("dump_dir", dump_dir, (str, os.PathLike)))
        self.memory_limit = check_bytes("memory_limit", memory_limit, allow_none=True)
        self.reference: Trace | None = None
        self.last_trace: Trace | None = None
        self.report: ConsistencyReport | None = None
        self.step = 0

    def __repr__(self) -> str:
        ref = f"{len(self.reference)} events" if self.reference is not None else "none"
        return (f"ConsistencyChecker(precision={self.precision}, check_gradients={self.check_gradients}, "
                f"dump_on_failure={self.dump_on_failure}, dump_dir={self.dump_dir!r}, "
                f"memory_limit={self.memory_limit}, reference={ref})")

    @contextlib.contextmanager
    def trace(self, model: torch.nn.Module | None = None, *, across_ranks: bool | None = None):
        """Record the step run inside the block; the first one becomes the reference.

        Under an initialised ``torch.distributed`` group of more than one rank (or ``across_ranks=True``)
        every rank's trace is compared with rank 0's trace of the same step instead.
        """
        check_type("model", model, torch.nn.Module, allow_none=True)
        if across_ranks is None:
            across_ranks = (torch.distributed.is_available() and torch.distributed.is_initialized()
                            and torch.distributed.get_world_size() > 1)
        # only a trace that becomes the reference outlives this call: a compared one is summarised, compared
        # and dumped before the caller's optimizer step, so its leaves need no copy
        keep = not across_ranks and self.reference is None
        # the previous step's trace goes before this one records: two steps' tensors are never held at once
        # (the peak stays one step's), and the memory it frees is what this step's ops allocate again
        self.last_trace = None
        tracer = OpTracer(model, check_gradients=self.check_gradients, copy_leaves=keep,
                          reference=None if across_ranks else self.reference, memory_limit=self.memory_limit)
        with gc_paused():  # the comparison allocates a row per op too (see gc_paused)
            with tracer:
                yield tracer
            self._finish(tracer.trace, across_ranks)

    def _finish(self, trace: Trace, across_ranks: bool) -> None:
        self.last_trace = trace
        self.step += 1
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
        changed = trace.changed_since_recorded()
        if changed:
            raise ValueError(f"trace: {changed} parameters/inputs/gradients it holds by reference changed after "
                             "its step, so its tensors are no longer the step's; check it right after the step "
                             "(as trace() does) or record it with OpTracer(copy_leaves=True)")
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
            with OpTracer(model, check_gradients=self.check_gradients, memory_limit=self.memory_limit) as tracer:
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
