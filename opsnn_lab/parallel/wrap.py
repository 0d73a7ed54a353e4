"""Wrap a (fused) model for data parallelism: DDP with the fp16 comm hook, or FSDP2 per layer plus the root.

A fused op is held outside the module tree (``FusedSlot`` keeps it as a plain attribute, so state_dict
keys stay those of the replaced modules) and some fused ops register the replaced modules' Parameter
objects on themselves. FSDP2 only knows the owning modules: it swaps sharded and unsharded parameters
there, and a fused op that kept the original Parameter would compute with a stale tensor and send its
gradient nowhere. A fused op reads, at every call, the parameter its owning module holds at that moment
(``opsnn_lab.fusion.owners``), so it shards exactly like the modules it replaced.
"""

from __future__ import annotations

from torch import nn

from opsnn_lab._checks import check_choice, check_type

__all__ = ["layer_units", "shardable_units", "follow_owners", "wrap_model", "PARALLEL"]

PARALLEL = ("ddp", "fsdp")


def layer_units(model: nn.Module) -> list[str]:
    """Qualified names of the model's repeated layers: FSDP2 shards each one, then the root.

    The children of every ``nn.ModuleList``, and the non-container children of ``nn.Sequential``s
    (descending through nested containers: a ResNet's stages hold its blocks). A unit is not searched
    further, so one parameter belongs to one unit.
    """
    check_type("model", model, nn.Module)
    units: list[str] = []

    def visit(prefix: str, module: nn.Module, in_container: bool) -> None:
        is_container = isinstance(module, (nn.ModuleList, nn.Sequential))
        if in_container and not is_container and any(True for _ in module.parameters()):
            units.append(prefix)
            return
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child, is_container)

    visit("", model, False)
    return units


def _inside(path: str, unit: str) -> bool:
    return path == unit or path.startswith(unit + ".")


def shardable_units(model: nn.Module) -> list[str]:
    """:func:`layer_units` less those a fused op outside the unit reads from.

    A fused chain called from above its layer bypasses the layer's forward, where FSDP2 gathers the
    layer's parameters; such a layer stays in its parent's group (today: a whole-model rewrite of a
    CNN calls its blocks' fused conv-bn-relu from the root).
    """
    slots = [(path, slot.fused_modules) for path, slot in model.named_modules()
             if isinstance(getattr(slot, "fused_modules", None), list)
             and isinstance(slot.__dict__.get("op"), nn.Module)]
    return [u for u in layer_units(model)
            if not any(not _inside(path, u) and any(_inside(m, u) for m in mods) for path, mods in slots)]


def follow_owners(model: nn.Module) -> int:
    """Link each fused op of ``model`` to the modules that own its tensors (``fusion.owners.link``), so it reads
    the Parameter its owner holds at each call; returns the number of links.

    ``ol.fusion.fuse`` links them already; this links a model fused by an opsnn_lab that did not (call it before
    ``fully_shard``, while the Parameter objects are still shared)."""
    from opsnn_lab.fusion import owners
    from opsnn_lab.fusion.packing import fused_ops

    return owners.link(model, fused_ops(model))


def wrap_model(model: nn.Module, parallel: str, *, device=None, fp16_hook: bool = False,
               ordered_grads: bool = False, scaler=None):
    """Return ``(wrapped, hook_state)``.

    ``ddp``: ``DistributedDataParallel(model)``; ``fp16_hook`` registers ``fp16_allreduce_hook`` with an
    ``Fp16AllReduceState`` (returned, it counts the bytes sent); ``scaler``: the loss scaler the gradients
    carry (identical on every rank), so the hook sends its fp16 payload and nothing else. ``fsdp``:
    ``fully_shard`` on every :func:`shardable_units` module, then on the root; ``ordered_grads`` installs an
    :class:`~opsnn_lab.parallel.ordered_reduce.OrderedReduceScatter` per FSDP module (the strict mode).
    """
    check_choice("parallel", parallel, PARALLEL)
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device is not None and device.type == "cuda" else None
        ddp = DDP(model, device_ids=ids)
        state = None
        if fp16_hook:
            from opsnn_lab.precision import Fp16AllReduceState, fp16_allreduce_hook

            state = Fp16AllReduceState(scaler=scaler)
            ddp.register_comm_hook(state, fp16_allreduce_hook)
        return ddp, state
    from torch.distributed.fsdp import fully_shard

    follow_owners(model)
    units = [model.get_submodule(name) for name in shardable_units(model)]
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    comms = []
    for module in [*units, model]:
        module.set_force_sum_reduction_for_comms(True)  # gloo has no AVG; divide after the sum instead
        if ordered_grads:
            from opsnn_lab.parallel.ordered_reduce import OrderedReduceScatter

            comm = OrderedReduceScatter()
            module.set_custom_reduce_scatter(comm)
            module.set_gradient_divide_factor(1.0)
            comms.append(comm)
    return model, comms
