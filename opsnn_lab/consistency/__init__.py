"""Training consistency: per-operator seed pool, strict FP32 mode, and the consistency checker."""

from opsnn_lab._lazy import lazy_exports

_EXPORTS = {
    "SeedPool": "seed_pool",
    "make_reproducible": "seed_pool",
    "set_step": "seed_pool",
    "get_step": "seed_pool",
    "SeedStream": "seed_pool",
    "strict": "strict",
    "is_strict": "strict",
    "ConsistencyChecker": "checker",
    "ConsistencyReport": "report",
    "Divergence": "report",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
