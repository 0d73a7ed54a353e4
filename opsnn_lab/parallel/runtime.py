"""Process-group setup from torchrun's environment, with teardown that never leaves a rank hanging.

``init_distributed()`` reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` (set by
``torchrun``); without them it starts a process group of one on 127.0.0.1 (DDP and FSDP2 need one).
gloo on CPU, NCCL on CUDA.
The collective timeout (default 60 s) bounds how long a rank waits for a peer that died: torchrun also
tears the job down when one worker exits, so a failing rank ends every rank.
"""

from __future__ import annotations

import datetime
import gc
import os
import signal
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistContext", "init_distributed", "free_port", "destroy_process_group"]


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    started: bool = False  # this context initialised the process group (and destroys it)

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        if self.started and dist.is_initialized():
            destroy_process_group()
            self.started = False


def destroy_process_group() -> None:
    """``dist.destroy_process_group()``, then collect the reference cycles that still hold the group's objects.

    Left to interpreter shutdown, such cycles (what a DDP model leaves behind) are freed after gloo's threads
    are gone and the process aborts with "terminate called without an active exception": 7 of 100 runs of the
    two-rank gloo all-reduce demo on a 2-core machine, 0 of 100 with the collection. Callers drop their own DDP
    models first.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _on_sigterm(signum, frame):  # torchrun sends SIGTERM to the survivors when one worker fails
    raise SystemExit(f"rank {os.environ.get('RANK', '0')}: stopped by signal {signum} (another rank failed "
                     "or the job was interrupted)")


def init_distributed(timeout_s: float = 60.0) -> DistContext:
    """Join the process group torchrun describes (or a world of one); idempotent."""
    if "RANK" not in os.environ:  # not under torchrun: a world of one on 127.0.0.1
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = DistContext(rank, world, local, device)
    if not dist.is_initialized():
        signal.signal(signal.SIGTERM, _on_sigterm)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
        ctx.started = True
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fail(message: str, code: int = 1):
    """Print ``message`` on stderr with the rank and leave with ``code`` (no traceback for expected failures)."""
    print(f"[opsnn_lab.train rank {os.environ.get('RANK', '0')}] {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)
