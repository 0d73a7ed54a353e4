"""The consistency pillar across ranks, runnable: a small 2-rank gloo job with one rank perturbed.

``run_rank_check`` spawns the ranks on 127.0.0.1 for notebook 03 and the tests; each rank traces one
step of the tiny encoder under ``ConsistencyChecker`` (which compares it with rank 0's step through
``consistency.distributed.compare_with_rank0``). The worker is a module-level function so that
``torch.multiprocessing.spawn`` can import it by name.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from opsnn_lab.consistency import ConsistencyChecker
from opsnn_lab.models import EncoderConfig, MaskedTokenTask

__all__ = ["run_rank_check", "rank_check_worker"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_check_worker(rank: int, world_size: int, port: int, perturb_rank: int, perturb: str, out_dir: str,
                      eps: float = 1e-4) -> None:
    """One rank: the tiny encoder (same seed everywhere), one traced step; ``perturb_rank`` nudges
    ``perturb``'s weight by ``eps``. Writes ``rank{r}.json`` (the report) under ``out_dir``."""
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
