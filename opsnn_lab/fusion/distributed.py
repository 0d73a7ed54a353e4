"""Models already wrapped for data-parallel training, which fusion refuses with what to do instead.

Fusion copies the model and rewrites its own modules; the wrappers of ``torch.distributed`` own their module's
Parameters. A ``DistributedDataParallel`` model was analysed through the wrapper and came out with nothing fused, and
one sharded by FSDP2's ``fully_shard`` stopped in FSDP's "does not support deepcopy". Fused first, the model wraps and
shards as the unfused one does (``opsnn_lab.parallel.wrap_model``, ``tests/fusion/test_hf_behaviour.py``)."""

from __future__ import annotations

from torch import nn

__all__ = ["check_not_distributed"]


def _wrapper_classes() -> tuple[type, ...]:
    classes: list[type] = [nn.parallel.DistributedDataParallel]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        classes.append(FullyShardedDataParallel)
    except ImportError:  # a torch built without distributed
        pass
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # torch 2.4, 2.5
        except ImportError:
            FSDPModule = None  # noqa: N806
    if FSDPModule is not None:
        classes.append(FSDPModule)
    return tuple(classes)


def check_not_distributed(model: nn.Module, name: str = "model") -> None:
    """``ValueError`` naming the argument and the wrapped module when ``model`` holds a data-parallel wrapper
    (DistributedDataParallel, FSDP1, FSDP2) or Parameters sharded as DTensors."""
    classes = _wrapper_classes()
    for path, m in model.named_modules():
        if isinstance(m, classes):
            raise ValueError(f"{name}: `{path or '<model>'}` is wrapped for data parallelism ({type(m).__name__}); "
                             "fuse the model before wrapping it: `fused, plan = ol.fusion.fuse(model, example)`, then "
                             "wrap or shard `fused` as you would `model` (opsnn_lab.parallel.wrap_model does both)")
    for pname, p in model.named_parameters():
        if type(p.data).__name__ == "DTensor":
            raise ValueError(f"{name}: its Parameter `{pname}` is a sharded DTensor; fuse the model before sharding or "
                             "parallelising it, then shard `fused` as you would `model`")
