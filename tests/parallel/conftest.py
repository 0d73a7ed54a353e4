"""A process group of one inside the test process (gloo, 127.0.0.1), torn down after the test module."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def world_of_one():
    import torch.distributed as dist

    from opsnn_lab.parallel.runtime import destroy_process_group, init_distributed

    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    ctx = init_distributed()
    try:
        yield ctx
    finally:
        if dist.is_initialized():
            destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
