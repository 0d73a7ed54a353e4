"""Graph fusion: analyse any model that runs, decide and explain each candidate, rewrite with fused ops.

``plan = analyze(model, example_inputs)`` -> ``FusionPlan`` (model untouched);
``apply(model, plan)`` -> a new module; ``fused, plan = fuse(model, example_inputs)``.
"""

from opsnn_lab._lazy import lazy_exports

_EXPORTS = {
    "analyze": "analysis",
    "Analysis": "analysis",
    "apply": "rewrite",
    "FusedSlot": "rewrite",
    "revert": "patch",
    "patches": "patch",
    "repack": "packing",
    "fuse": "api",
    "measure": "measurement",  # the module is not named `measure`: importing it would shadow the function
    "Measurement": "measurement",
    "activation_bytes_by_module": "measurement",
    "FusionPlan": "plan",
    "Decision": "plan",
    "PATTERNS": "patterns",
    "FAMILIES": "patterns",
    "Pattern": "patterns",
    "Match": "patterns",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
