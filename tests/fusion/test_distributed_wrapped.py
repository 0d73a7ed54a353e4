"""A model already wrapped for data parallelism is refused with what to do instead (fuse first, then wrap): a
DistributedDataParallel model was analysed through the wrapper and fused nothing, silently; an FSDP2-sharded one
stopped in FSDP's own "does not support deepcopy"."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import opsnn_lab as ol
from opsnn_lab.parallel.runtime import destroy_process_group

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without distributed")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)).train()


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        destroy_process_group()


def test_a_ddp_model_is_refused_with_the_order_to_follow(one_rank):
    x = torch.randn(4, 8)
    ddp = nn.parallel.DistributedDataParallel(_mlp())
    for call in (lambda: ol.fusion.fuse(ddp, (x,)), lambda: ol.fusion.analyze(ddp, (x,))):
        with pytest.raises(ValueError, match=r"model: `<model>` is wrapped .*DistributedDataParallel.*fuse the model "
                                             r"before wrapping it"):
            call()
    plan = ol.fusion.analyze(ddp.module, (x,))
    with pytest.raises(ValueError, match="wrapped for data parallelism"):
        ol.fusion.apply(ddp, plan)
    fused, plan = ol.fusion.fuse(_mlp(), (x,))  # the order the message gives
    assert plan.fused
    nn.parallel.DistributedDataParallel(fused)(x).sum().backward()


def test_an_fsdp2_sharded_model_is_refused(one_rank):
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("no FSDP2 in this torch")
    model = _mlp()
    fsdp.fully_shard(model[0])
    fsdp.fully_shard(model)
    with pytest.raises(ValueError, match=r"`<model>` is wrapped for data parallelism \(FSDPSequential\)"):
        ol.fusion.fuse(model, (torch.randn(4, 8),))


def test_a_model_with_sharded_dtensor_parameters_is_refused(one_rank):
    tensor = pytest.importorskip("torch.distributed.tensor")
    model = _mlp()
    mesh = dist.device_mesh.init_device_mesh("cpu", (1,))
    model[0].weight = nn.Parameter(tensor.distribute_tensor(model[0].weight.detach(), mesh, [tensor.Shard(0)]))
    with pytest.raises(ValueError, match=r"model: its Parameter `0.weight` is a sharded DTensor"):
        ol.fusion.analyze(model, (torch.randn(4, 8),))
