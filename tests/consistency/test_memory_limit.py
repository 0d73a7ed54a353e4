"""ConsistencyChecker(memory_limit=...): a trace holds the tensors of its first events up to the limit; every
later event keeps statistics and hashes, and is judged from them."""

from __future__ import annotations

import math

import pytest
import torch

from opsnn_lab.consistency import ConsistencyChecker
from opsnn_lab.consistency.compare import compare_traces
from opsnn_lab.consistency.records import OpRecord, Trace
from opsnn_lab.consistency.stats import summarize
from opsnn_lab.consistency.tracer import OpTracer
from opsnn_lab.measuring import peak_bytes
from tests.consistency.test_checker import TASK, NoisyGELU, make_model, perturb, traced_step


def held_bytes(trace: Trace) -> int:
    storages = {}
    for rec in trace.records:
        for t in [*(rec.outputs or []), *rec.input_tensors()]:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("limit", [0, 20_000, "200kB"])
def test_a_trace_holds_a_prefix_of_its_events_within_the_limit(limit):
    model, checker = make_model(), ConsistencyChecker(dump_on_failure=False, memory_limit=limit)
    traced_step(checker, model)
    ref = checker.reference
    flags = [rec.summarised for rec in ref.records]
    first = flags.index(True)
    assert all(flags[first:]) and not any(flags[:first])  # a prefix is held, everything after summarised
    assert held_bytes(ref) <= checker.memory_limit
    assert ref.memory_limit == checker.memory_limit
    for rec in ref.records[first:]:
        assert rec.outputs is None and rec.flat_args is None and rec.output_stats
        assert len(rec.input_stats) == len(rec.input_producers)


def test_summarised_events_have_the_statistics_of_a_full_trace():
    model = make_model()
    full, light = ConsistencyChecker(dump_on_failure=False), ConsistencyChecker(dump_on_failure=False,
                                                                                memory_limit=0)
    traced_step(full, model)
    traced_step(light, model)
    theirs = full.reference.by_key()
    # backward may differ by copies: a held gradient cannot be stolen by autograd, which copies it instead
    forward = [r for r in light.reference.records if r.phase == "forward" or r.kind == "grad"]
    assert len(forward) > 50 and all(r.summarised for r in forward)

    def same(a, b):  # bits and extremes exactly; sums in float32, grouped in one and not in the other (std,
        # from the norm and the mean, cancels: not compared)
        assert (a.hash, a.shape, a.dtype, a.min, a.max, a.nan, a.inf) == (b.hash, b.shape, b.dtype, b.min, b.max,
                                                                         b.nan, b.inf)
        assert [a.mean, a.norm] == pytest.approx([b.mean, b.norm], rel=1e-5, abs=1e-6)

    for rec in forward:
        other = theirs[rec.key]
        assert len(rec.output_stats) == len(other.output_stats), rec.key
        for a, b in zip(rec.output_stats, other.output_stats):
            same(a, b)
        assert [s is None for s in rec.input_stats] == [s is None for s in other.input_stats], rec.key
        for a, b in zip(rec.input_stats, other.input_stats):
            if a is not None:
                same(a, b)


def test_the_limit_bounds_the_traced_step_peak():
    model = make_model()

    def step():
        model.zero_grad(set_to_none=True)
        TASK.loss(model, TASK.batch(0)).backward()

    step()
    plain = peak_bytes(step)
    peaks = {}
    for limit in (None, plain // 4):
        checker = ConsistencyChecker(dump_on_failure=False, memory_limit=limit)

        def traced(checker=checker):
            with checker.trace(model):
                step()

        traced()  # the hash's weight caches fill once per process
        checker.reset()
        peaks[limit] = peak_bytes(traced), peak_bytes(traced)  # the reference, then a compared step
        assert checker.report.ok
    (ref, compared), limit = peaks[plain // 4], plain // 4
    assert min(peaks[None]) > 3 * plain  # every op's tensors held
    # the step's own peak, the held tensors, and the end of the step summarising them (the small ones
    # together: one concatenation and one product buffer as large)
    assert compared < plain + 3 * limit, (plain, compared)
    # the reference also copies the leaves it holds (weights, at most the limit again)
    assert ref < plain + 5 * limit, (plain, ref)


def test_a_repeated_step_is_exact_past_the_limit():
    model, checker = make_model(), ConsistencyChecker(dump_on_failure=False, memory_limit=0)
    traced_step(checker, model)
    report = traced_step(checker, model)
    assert report.ok and not report.unresolved_rows() and all(r.exact for r in report.rows)
    assert len(report.rows) == len(checker.reference)


@pytest.mark.parametrize("name", ["layers.0.mlp.fc1", "layers.1.attention.value", "head"])
def test_a_weight_perturbation_is_named_from_statistics(name):
    reports = {}
    for limit in (None, 0):
        model, checker = make_model(), ConsistencyChecker(dump_on_failure=False, memory_limit=limit)
        traced_step(checker, model)
        perturb(model, name)
        reports[limit] = traced_step(checker, model)
    full, light = reports[None], reports[0]
    for phase, op in (("forward", "aten.addmm"), ("backward", "aten.mm")):
        a, b = getattr(full, f"{phase}_divergence"), getattr(light, f"{phase}_divergence")
        assert (b.module_path, b.op, b.origin) == (name, op, "input") == (a.module_path, a.op, a.origin)
        assert b.measured == "statistics" and a.measured == "elementwise"
        assert 0 < b.max_abs_err <= a.max_abs_err  # a lower bound of the elementwise error
        assert math.isnan(b.max_rel_err) and math.isnan(b.cosine)
    assert "from statistics" in str(light.forward_divergence) and "from statistics" in repr(light)
    assert "max abs &ge;" in light._repr_html_()


def test_a_planted_nondeterministic_op_is_named_past_the_limit():
    model, checker = make_model(), ConsistencyChecker(dump_on_failure=False, memory_limit=0)
    model.layers[1].mlp.act = NoisyGELU()
    traced_step(checker, model)
    report = traced_step(checker, model)
    fwd = report.forward_divergence
    assert (fwd.module_path, fwd.op, fwd.origin) == ("layers.1.mlp.act", "aten.randn_like", "op")
    assert all(r.exact for r in report.rows if r.phase == "forward" and r.index < fwd.index)


def test_within_the_limit_a_divergence_is_measured_elementwise():
    # a limit above what the whole step holds changes nothing: every row as without a limit
    model = make_model()
    probe = ConsistencyChecker(dump_on_failure=False)
    traced_step(probe, model)
    limit = 2 * held_bytes(probe.reference) + 2**20
    reports = []
    for checker in (ConsistencyChecker(dump_on_failure=False),
                    ConsistencyChecker(dump_on_failure=False, memory_limit=limit)):
        model = make_model()
        traced_step(checker, model)
        assert checker.reference.summarised == 0
        perturb(model, "layers.1.mlp.fc2")
        reports.append(traced_step(checker, model))
    assert [(r.key_fields(), r.max_abs_err) for r in map(_Key, reports[0].rows)] == \
        [(r.key_fields(), r.max_abs_err) for r in map(_Key, reports[1].rows)]


class _Key:
    def __init__(self, row):
        self.row, self.max_abs_err = row, row.max_abs_err

    def key_fields(self):
        r = self.row
        return r.phase, r.kind, r.module_path, r.op, r.occurrence, r.diverged, r.measured


def _summarised(stats: list, key=("forward", "op", "m", "aten.mul.default", 0)) -> OpRecord:
    phase, kind, path, op, occurrence = key
    return OpRecord(0, phase, kind, op, path, "x.py:1", occurrence, output_stats=stats, summarised=True)


def test_statistics_judge_only_what_they_prove():
    g = torch.Generator().manual_seed(0)
    b = torch.randn(1000, generator=g)
    cases = {
        "permuted": b.flip(0),  # same values elsewhere: bits differ, min/max/mean do not move
        "interior nudge": b + torch.where((b.abs() < 1.0), 1e-3, 0.0),  # min and max untouched
        "max moved": b + torch.where(b == b.max(), 1e-3, 0.0),
        "rounding": torch.nextafter(b, torch.full_like(b, math.inf)),  # one ulp each: within tolerance
    }
    for name, a in cases.items():
        ref, run = Trace([_summarised([summarize(b)])]), Trace([_summarised([summarize(a)])])
        report, _ = compare_traces(ref, run, precision=1e-6)
        row = report.rows[0]
        assert row.measured == "statistics" and not row.exact, name
        # sound: never beyond unless some element is, elementwise
        elementwise = ((a - b).abs() > 1e-6 + 1e-6 * b.abs()).any().item()
        assert not row.diverged or elementwise, name
        assert row.max_abs_err <= (a - b).abs().max().item(), name
        if name == "max moved":
            assert row.diverged and report.forward_divergence is not None
        if name in ("permuted", "interior nudge"):
            assert not row.diverged and report.unresolved_rows() == [row] and report.ok
            assert "differ in bits within what their statistics show" in repr(report)
    # a NaN appearing, or another shape, is beyond whatever the tolerance
    nan = b.clone()
    nan[3] = float("nan")
    for a in (nan, b[:-1]):
        ref, run = Trace([_summarised([summarize(b)])]), Trace([_summarised([summarize(a)])])
        report, _ = compare_traces(ref, run, precision=1.0)
        assert report.rows[0].diverged


def test_a_limited_reference_saves_loads_and_compares(tmp_path):
    model, checker = make_model(), ConsistencyChecker(dump_on_failure=False, memory_limit=20_000)
    traced_step(checker, model)
    checker.save_reference(tmp_path / "ref.pt")
    other = ConsistencyChecker(dump_on_failure=False, memory_limit=20_000)
    loaded = other.load_reference(tmp_path / "ref.pt")
    assert loaded.memory_limit == 20_000 and loaded.summarised == checker.reference.summarised > 0
    assert all(r.outputs is None for r in loaded.records if r.summarised)
    assert traced_step(other, model).ok
    perturb(model, "head")
    report = traced_step(other, model)
    assert report.forward_divergence.module_path == "head"


def test_a_dump_past_the_limit_writes_the_report_but_no_op_to_replay(tmp_path):
    model = make_model()
    checker = ConsistencyChecker(dump_dir=tmp_path / "dumps", memory_limit=0)
    traced_step(checker, model)
    perturb(model, "head")
    report = traced_step(checker, model)
    assert not report.ok and report.dump_path
    written = {p.name for p in (tmp_path / "dumps").glob("*/*")}
    assert "report.json" in written and not any(n.endswith("_op.pt") for n in written)


def test_compare_takes_the_limit_too():
    model = make_model()
    checker = ConsistencyChecker(dump_on_failure=False, memory_limit=0)

    def step():
        model.zero_grad(set_to_none=True)
        TASK.loss(model, TASK.batch(0)).backward()

    report = checker.compare(step, step, model_a=model, model_b=model)
    assert report.ok and checker.last_trace.summarised == len(checker.last_trace)


@pytest.mark.parametrize("value, exc", [("lots", ValueError), ("-1MB", ValueError), (-1, ValueError),
                                        (1.5, TypeError), (True, TypeError)])
def test_bad_memory_limit_is_named(value, exc):
    with pytest.raises(exc, match="memory_limit"):
        ConsistencyChecker(memory_limit=value)
    with pytest.raises(exc, match="memory_limit"):
        OpTracer(memory_limit=value)


def test_memory_limit_units():
    assert ConsistencyChecker(memory_limit="512MB").memory_limit == 512 * 10**6
    assert ConsistencyChecker(memory_limit="2GiB").memory_limit == 2 * 2**30
    assert ConsistencyChecker(memory_limit="1.5G").memory_limit == 3 * 2**29
    assert ConsistencyChecker(memory_limit=4096).memory_limit == 4096
    assert "memory_limit=4096" in repr(ConsistencyChecker(memory_limit=4096))


def test_past_the_limit_an_in_place_op_copies_no_activation():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):  # outside the tracer's mode: sees the copies the tracer makes
        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.clone.default:
                self.bytes += out.numel() * out.element_size()
            return out

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(inplace=True),
                                torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(inplace=True))
    x = torch.randn(8, 3, 32, 32)
    copied = {}
    for limit in (None, 0):
        checker = ConsistencyChecker(dump_on_failure=False, memory_limit=limit)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with Copies() as copies, checker.trace(model):
                model(x).sum().backward()
        assert checker.report.ok and any(r.op == "aten.relu_.default" for r in checker.reference.records)
        copied[limit] = copies.bytes
    activation = 8 * 16 * 32 * 32 * 4
    assert copied[None] >= 2 * activation  # held: each relu_ keeps its input as it was (copy-on-write)
    assert copied[0] < activation // 8  # past the limit: nothing kept, nothing copied (a relu_ copied its input)
