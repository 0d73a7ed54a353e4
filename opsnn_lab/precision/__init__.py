"""Mixed-precision gradient flow: local scaling, dynamic scaling, fp32 master weights, fp16 all-reduce."""

from opsnn_lab._lazy import lazy_exports

_EXPORTS = {
    "FP16_MAX": "local_scaler",
    "FP16_MIN": "local_scaler",
    "LocalScaler": "local_scaler",
    "DynamicScaler": "dynamic_scaler",
    "MasterWeightOptimizer": "master",
    "fp16_allreduce_hook": "comm_hook",
    "Fp16AllReduceState": "comm_hook",
    "ScalerPinnedError": "dynamic_scaler",
    "NonFiniteGradientError": "local_scaler",
    "GradientStats": "grad_stats",
    "GradientTrace": "grad_stats",
    "GradientRecorder": "grad_recorder",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
