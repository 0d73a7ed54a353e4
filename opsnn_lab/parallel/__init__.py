"""Training across ranks on torch.distributed: DDP and FSDP2 wrapping, ordered reductions, run state.

``python -m opsnn_lab.train`` (see :mod:`opsnn_lab.parallel.cli`) is the command; ``ol.train(...,
parallel="ddp" | "fsdp")`` under ``torchrun`` is the same loop from Python.
"""

from opsnn_lab._lazy import lazy_exports

_EXPORTS = {
    "DistContext": "runtime",
    "init_distributed": "runtime",
    "pairwise_sum": "ordered_reduce",
    "PairwiseAccumulator": "ordered_reduce",
    "ordered_all_reduce": "ordered_reduce",
    "OrderedReduceScatter": "ordered_reduce",
    "layer_units": "wrap",
    "wrap_model": "wrap",
    "DistributedMasterWeightOptimizer": "optim",
    "master_weights": "state",
    "state_sha256": "state",
    "max_relative_difference": "state",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
