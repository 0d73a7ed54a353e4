"""Process-group teardown: what still holds the group is collected while the interpreter is whole."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist

from opsnn_lab.parallel.runtime import DistContext, destroy_process_group


def test_destroy_collects_the_cycles_that_hold_a_ddp_model():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    was_enabled = gc.isenabled()
    gc.disable()  # only the helper's own collection may free the cycle
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
        ddp(torch.randn(4, 3)).sum().backward()
        cycle = [ddp]
        cycle.append(cycle)
        alive = weakref.ref(ddp)
        del ddp, cycle
        assert alive() is not None  # garbage, left for a collection
        destroy_process_group()
        assert alive() is None
        assert not dist.is_initialized()
    finally:
        if was_enabled:
            gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_destroy_without_a_group_is_a_no_op():
    assert not dist.is_initialized()
    destroy_process_group()
    assert not dist.is_initialized()


def test_a_context_destroys_only_the_group_it_started():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        DistContext(started=False).close()
        assert dist.is_initialized()  # someone else's group: left alone
        ctx = DistContext(started=True)
        ctx.close()
        assert not dist.is_initialized() and not ctx.started
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
