"""Cross-rank consistency: every rank compares its step with rank 0's step, hashes first, tensors on demand.

Round 0 broadcasts rank 0's records (keys, hashes, statistics; no tensors: kilobytes). Each rank aligns
them with its own trace; a row whose hash differs is a candidate. Then, in rounds, every rank asks for the
outputs of its first candidates (forward, and backward) and rank 0 broadcasts just those tensors; a
candidate within tolerance makes room for the next one. Only the diverging ops' tensors ever travel.

``run_rank_check`` spawns a small 2-rank gloo job on 127.0.0.1 (one rank perturbed) for tests and
notebooks; its worker lives here so ``torch.multiprocessing.spawn`` can import it.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from opsnn_lab.consistency.tracer import OpRecord, Trace, portable, restore

__all__ = ["compare_with_rank0", "run_rank_check", "rank_check_worker"]


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
    from opsnn_lab.consistency.checker import compare_traces

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


# --------------------------------------------------------------------------- a small 2-rank job
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_check_worker(rank: int, world_size: int, port: int, perturb_rank: int, perturb: str, out_dir: str,
                      eps: float = 1e-4) -> None:
    """One rank: the tiny encoder (same seed everywhere), one traced step; ``perturb_rank`` nudges
    ``perturb``'s weight by ``eps``. Writes ``rank{r}.json`` (the report) under ``out_dir``."""
    from opsnn_lab.consistency.checker import ConsistencyChecker
    from opsnn_lab.models import EncoderConfig, MaskedTokenTask

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        task = MaskedTokenTask(batch_size=2, seq_len=8)
        torch.manual_seed(0)
        model = task.model(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))
        if rank == perturb_rank:
            w = model.get_parameter(f"{perturb}.weight")
            with torch.no_grad():
                w.add_(eps * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
        checker = ConsistencyChecker(dump_dir=os.path.join(out_dir, "dumps"))
        with checker.trace(model):
            task.loss(model, task.batch(0)).backward()
        Path(out_dir, f"rank{rank}.json").write_text(checker.report.to_json())
    finally:
        dist.destroy_process_group()


def run_rank_check(world_size: int = 2, perturb_rank: int = 1, perturb: str = "layers.0.mlp.fc1",
                   out_dir: str | os.PathLike | None = None, eps: float = 1e-4) -> list[dict]:
    """Spawn ``world_size`` gloo ranks on 127.0.0.1, perturb one; return each rank's report as a dict."""
    import torch.multiprocessing as mp

    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2, got {world_size!r}")
    if not isinstance(perturb_rank, int) or not 0 <= perturb_rank < world_size:
        raise ValueError(f"perturb_rank must be in [0, {world_size}), got {perturb_rank!r}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.fspath(out_dir) if out_dir is not None else tmp
        os.makedirs(out, exist_ok=True)
        mp.spawn(rank_check_worker, args=(world_size, _free_port(), perturb_rank, perturb, out, eps),
                 nprocs=world_size, join=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]
