"""Cross-rank consistency: every rank compares its step with rank 0's step, hashes first, tensors on demand.

Round 0 broadcasts rank 0's records (keys, hashes, statistics; no tensors: kilobytes). Each rank aligns
them with its own trace; a row whose hash differs is a candidate. Then, in rounds, every rank asks for the
outputs of its first candidates (forward, and backward) and rank 0 broadcasts just those tensors; a
candidate within tolerance makes room for the next one. Only the diverging ops' tensors ever travel.

A runnable 2-rank example (one rank perturbed) is ``opsnn_lab.demos.consistency.run_rank_check``.
"""

from __future__ import annotations

import torch.distributed as dist

from opsnn_lab.consistency.compare import compare_traces
from opsnn_lab.consistency.records import OpRecord, Trace, portable, restore

__all__ = ["compare_with_rank0"]


def _meta_records(trace: Trace) -> list[dict]:
    return [r.meta() for r in trace.records]


def _remote_trace(metas: list[dict]) -> Trace:
    from opsnn_lab.consistency.stats import stats_from_dict

    recs = []
    for d in metas:
        d = dict(d)
        d["input_stats"] = [None if s is None else stats_from_dict(s) for s in d["input_stats"]]
        d["output_stats"] = [stats_from_dict(s) for s in d["output_stats"]]
        recs.append(OpRecord(**d))
    return Trace(recs, rank=0)


def _wanted(report, n: int) -> list[int]:
    """Reference indices to fetch: the current forward candidate and up to ``n - 1`` hash-only rows after
    it (a candidate within tolerance makes room for the next), and the current backward candidate."""
    out = []
    fwd, bwd = report.forward_divergence, report.backward_divergence
    if fwd is not None and report.rows[fwd.index].measured == "hash":
        rows = [r for r in report.rows[fwd.index:] if r.phase == "forward" and r.measured == "hash" and not r.exact]
        out += [r.ref_index for r in rows[:n]]
    if bwd is not None and report.rows[bwd.index].measured == "hash":
        out.append(report.rows[bwd.index].ref_index)
    return out


def compare_with_rank0(trace: Trace, precision: float | None, *, group=None, max_rounds: int = 12):
    """Collective: call on every rank after tracing the same step. Returns ``(report, records)``."""
    rank = dist.get_rank(group)
    trace.rank = rank
    box = [_meta_records(trace) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    ref = trace if rank == 0 else _remote_trace(box[0])
    fetched: list[int] = []
    for round_ in range(max_rounds):
        report, records = compare_traces(ref, trace, precision)
        want = [] if rank == 0 else _wanted(report, 2 ** round_)
        asks: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(asks, want, group=group)
        union = sorted({i for a in asks for i in a})
        if not union:
            break
        box = [None]
        if rank == 0:
            box = [{i: ([portable(t) for t in trace.records[i].outputs],
                        [portable(a) for a in trace.records[i].flat_args or []], trace.records[i].spec)
                    for i in union}]
        dist.broadcast_object_list(box, src=0, group=group)
        if rank != 0:
            for i, (outs, flat, spec) in box[0].items():
                rec = ref.records[i]
                rec.outputs, rec.flat_args, rec.spec = outs, [restore(a) for a in flat], spec
            fetched += want
    report.rank = rank
    report.exchanged = [f"{ref.records[i].phase} {ref.records[i].module_path} {ref.records[i].op}" for i in fetched]
    return report, records
