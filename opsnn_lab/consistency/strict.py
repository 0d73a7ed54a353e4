"""``strict()``: the FP32 consistency mode, as a context manager and as a global switch.

While strict mode is on:

* ``torch.use_deterministic_algorithms(True)`` (without NaN-filling ``torch.empty``, see
  ``_STRICT_SETTINGS``); TF32 and reduced-precision fp16/bf16 GEMM reductions
  off; cuDNN deterministic, benchmark off; oneDNN deterministic; ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
  (cuBLAS needs a fixed workspace to be deterministic); ``is_strict()`` is True, which opsnn_lab's
  Triton kernels read to take their atomic-free paths.
* the ATen ops whose result depends on batch size, position in the batch or thread count
  (``mm``, ``addmm``, ``bmm`` -- hence ``linear`` and ``matmul`` --, ``sum``, ``mean``, the softmax
  backward, the layer_norm backward, ``gelu``, ``weight_norm``'s ``_weight_norm_interface`` and its
  backward; softmax/log_softmax forward, log_softmax backward and
  layer_norm forward are already fixed-order natively, which the tests check) are replaced on CPU (and CUDA, when
  present) by the fixed-reduction-order versions in :mod:`opsnn_lab.consistency.fixed_order` (GEMMs, sums,
  gelu) and :mod:`opsnn_lab.consistency.fixed_rows` (row formulas over the fixed sum),
  through a ``torch.library`` registration that is destroyed when strict mode ends, which puts the
  native kernels back.
* on CPU, the convolution backward, whose oneDNN kernels split some weight-gradient reductions over
  threads: it runs on one intra-op thread (:mod:`opsnn_lab.consistency.fixed_conv`; a double backward
  through a 1-d or 2-d convolution takes a differentiable fixed-order composite instead); and oneDNN is off
  (``torch.backends.mkldnn.enabled``), so convolutions run aten's own sample-by-sample kernels: oneDNN's
  1x1 convolution forward split its reduction over threads too. The forward runs on one intra-op thread as
  well: aten's per-sample GEMM, where its batch loop runs inline, lets MKL split a deep reduction over threads.
* on CPU, batch norm forward and backward, whose statistics and weight/bias gradients aten reduces per thread
  where the channels are innermost (``(N, C)`` inputs, channels-last maps): they run on one intra-op thread
  (:mod:`opsnn_lab.consistency.fixed_batch_norm`).
* on CPU, ``_grouped_mm`` (mixture-of-experts layers): one fixed-order ``mm`` per group
  (:mod:`opsnn_lab.consistency.fixed_grouped_mm`).

Which GEMM paths give those bits is not assumed from one CPU: each GEMM shape is probed once per
process on the running machine (:mod:`opsnn_lab.consistency.gemm_probe`; ``strict_probe_report()``
lists the probes and the path each chose), falling back to a one-thread reference path where a faster
path does not give the reference's bits (MKL restricted to AVX2, at 2 threads).

A sample's outputs and input gradients then have the same bits whatever the batch size and its
position in the batch, and all outputs and gradients the same bits whatever ``torch.set_num_threads``
says. opsnn_lab's fused Conv -> BN -> ReLU (-> MaxPool) keeps the input's layout under strict mode (its
channels-last path would add aten's row-split batch-norm reductions). Every setting is restored when the
last user leaves. Outputs stay within the fp32 tolerance of the default mode (the reductions are
reordered, not approximated).

Cost (``python -m opsnn_lab.bench consistency --no-trace``: 4-layer encoder, hidden 256, 8 x 64
tokens, 2 threads, on a 2-core CPU shared with other jobs): 1.06-1.08x the default step, wall and CPU
time (1.10-1.17x before GEMM operands whose column-major layout gives the row-major bits stopped being
copied and the layer_norm/softmax backward stopped allocating a fresh temporary per elementwise op);
entering and leaving costs about 0.1 ms.

Usage::

    with ol.consistency.strict():      # on inside the block, restored after it
        loss = task.loss(model, batch); loss.backward()
    ol.consistency.strict(True)        # or strict.enable(): on until strict(False) / strict.disable()

The registration is process-wide (the dispatcher has no per-thread kernels): other threads see
strict kernels while any thread is inside ``strict()``. Entering and leaving are serialised by a lock
and counted, so blocks nest and may be entered from several threads.
"""

from __future__ import annotations

import os
import sys
import threading
import types
import warnings

import torch

from opsnn_lab._checks import check_type
from opsnn_lab.consistency import fixed_batch_norm, fixed_conv, fixed_grouped_mm
from opsnn_lab.consistency import fixed_order as fo
from opsnn_lab.consistency import fixed_rows as fr
from opsnn_lab.consistency.gemm_probe import strict_probe_report

__all__ = ["strict", "is_strict", "OVERRIDDEN_OPS", "strict_probe_report"]

_CUBLAS_WORKSPACE = ":4096:8"


def _layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    return fr.layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask)


# ATen overload -> fixed-order implementation (same schema)
OVERRIDDEN_OPS = {
    "mm": lambda a, b: fo.fixed_mm(a, b),
    "addmm": lambda bias, a, b, *, beta=1, alpha=1: fo.fixed_addmm(bias, a, b, beta=beta, alpha=alpha),
    "bmm": lambda a, b: fo.fixed_bmm(a, b),
    "sum": fo.fixed_sum_default,
    "sum.dim_IntList": fo.fixed_sum,
    "mean": fo.fixed_mean_default,
    "mean.dim": fo.fixed_mean,
    "_softmax_backward_data": fr.softmax_backward,
    "native_layer_norm_backward": _layer_norm_backward,
    "gelu": fo.gelu,
    "gelu_backward": fo.gelu_backward,
    "_weight_norm_interface": fr.weight_norm_interface,
    "_weight_norm_interface_backward": fr.weight_norm_interface_backward,
}


def _matmul_precision() -> str | None:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # legacy allow_tf32 flags and the per-backend API were mixed: leave it alone
        return None


def _read_settings() -> dict:
    cuda_mm = torch.backends.cuda.matmul
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "fill_uninitialized": torch.utils.deterministic.fill_uninitialized_memory,
        "matmul_precision": _matmul_precision(),
        "cuda_tf32": cuda_mm.allow_tf32,
        "cuda_fp16_reduced": cuda_mm.allow_fp16_reduced_precision_reduction,
        "cuda_bf16_reduced": cuda_mm.allow_bf16_reduced_precision_reduction,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "mkldnn_deterministic": getattr(torch.backends.mkldnn, "deterministic", None),
        "mkldnn_enabled": torch._C._get_mkldnn_enabled(),
        "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


def _write_settings(s: dict) -> None:
    cuda_mm = torch.backends.cuda.matmul
    torch.use_deterministic_algorithms(s["deterministic"], warn_only=s["deterministic_warn_only"])
    torch.utils.deterministic.fill_uninitialized_memory = s["fill_uninitialized"]
    cuda_mm.allow_tf32 = s["cuda_tf32"]
    cuda_mm.allow_fp16_reduced_precision_reduction = s["cuda_fp16_reduced"]
    cuda_mm.allow_bf16_reduced_precision_reduction = s["cuda_bf16_reduced"]
    torch.backends.cudnn.allow_tf32 = s["cudnn_tf32"]
    torch.backends.cudnn.deterministic = s["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = s["cudnn_benchmark"]
    if s["mkldnn_deterministic"] is not None:
        torch.backends.mkldnn.deterministic = s["mkldnn_deterministic"]
    torch._C._set_mkldnn_enabled(s["mkldnn_enabled"])
    if s["matmul_precision"] is not None:  # after the legacy flags: it is the one read back
        torch.set_float32_matmul_precision(s["matmul_precision"])
    if s["cublas_workspace"] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = s["cublas_workspace"]


_STRICT_SETTINGS = {
    "deterministic": True,
    "deterministic_warn_only": False,
    # Deterministic mode would also fill every torch.empty with NaN: ~7% of an encoder step on CPU, and
    # no fixed-order op reads memory it did not write. Reading uninitialised memory is a bug strict
    # mode does not paper over.
    "fill_uninitialized": False,
    "matmul_precision": "highest",
    "cuda_tf32": False,
    "cuda_fp16_reduced": False,
    "cuda_bf16_reduced": False,
    "cudnn_tf32": False,
    "cudnn_deterministic": True,
    "cudnn_benchmark": False,
    # oneDNN's 1x1 convolution forward splits its reduction over threads (other bits at 1 and 2 threads);
    # aten's own CPU convolution works sample by sample, each in one thread: the same bits at any thread
    # count and batch size, at up to ~4x the time for a 7x7 kernel (same for 1x1)
    "mkldnn_enabled": False,
}


def _dispatch_keys() -> list[str]:
    return ["CPU", "CUDA"] if torch.cuda.is_available() else ["CPU"]


class _StrictState:
    """Reference-counted activation: the first user applies, the last one restores."""

    def __init__(self):
        self.lock = threading.RLock()
        self.depth = 0  # open ``with strict()`` blocks, all threads together
        self.global_on = False  # strict(True) / strict.enable()
        self.saved: dict | None = None
        self.library = None

    @property
    def active(self) -> bool:
        return self.saved is not None

    def _activate(self) -> None:
        self.saved = _read_settings()
        settings = dict(self.saved, **_STRICT_SETTINGS)
        if self.saved["matmul_precision"] is None:
            settings["matmul_precision"] = None
        if settings["mkldnn_deterministic"] is not None:
            settings["mkldnn_deterministic"] = True
        settings["cublas_workspace"] = self.saved["cublas_workspace"] or _CUBLAS_WORKSPACE
        _write_settings(settings)
        lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - deliberately overrides aten kernels
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            for key in _dispatch_keys():
                for op, fn in OVERRIDDEN_OPS.items():
                    lib.impl(op, fn, key)
            # at the autograd key: it redispatches below autograd to aten's kernel, on one intra-op thread
            lib.impl("convolution_backward", fixed_conv.convolution_backward, "AutogradCPU", with_keyset=True)
            lib.impl("convolution", fixed_conv.convolution, "CPU")  # below autograd, inference mode included
            # below autograd: aten's own graph, its kernels on one intra-op thread
            lib.impl("native_batch_norm", fixed_batch_norm.native_batch_norm, "CPU")
            lib.impl("native_batch_norm_backward", fixed_batch_norm.native_batch_norm_backward, "CPU")
            lib.impl("_grouped_mm", fixed_grouped_mm.grouped_mm, "CPU")  # experts: one fixed-order mm per group
        self.library = lib

    def _deactivate(self) -> None:
        self.library._destroy()  # unregisters every kernel above: the native ones are back
        self.library = None
        saved, self.saved = self.saved, None
        _write_settings(saved)

    def update(self, depth_delta: int = 0, global_on: bool | None = None) -> None:
        with self.lock:
            self.depth += depth_delta
            if global_on is not None:
                self.global_on = global_on
            want = self.global_on or self.depth > 0
            if want and not self.active:
                self._activate()
            elif not want and self.active:
                self._deactivate()


_STATE = _StrictState()


class _StrictBlock:
    """What ``strict(...)`` returns: a context manager (strict inside the ``with`` block)."""

    def __init__(self, previous_global: bool | None = None):
        self._previous_global = previous_global  # set when strict(True/False) already switched
        self._entered = False

    def __enter__(self):
        if self._previous_global is None:
            _STATE.update(depth_delta=1)
            self._entered = True
        return self

    def __exit__(self, *exc):
        if self._entered:
            self._entered = False
            _STATE.update(depth_delta=-1)
        elif self._previous_global is not None:
            _STATE.update(global_on=self._previous_global)  # `with strict(True):` undoes its switch
        return False

    def __repr__(self):
        return f"strict(active={is_strict()})"


class _Strict:
    """``strict()`` -> context manager; ``strict(True)`` / ``strict(False)`` -> global switch.

    ``strict(True)`` turns strict mode on now and leaves it on until ``strict(False)``
    (``strict.enable()`` / ``strict.disable()`` are the same). Used as ``with strict(True):`` it
    switches back to the previous global state at the end of the block. ``strict(False)`` clears the
    global switch only; open ``with strict():`` blocks stay strict until they end.
    """

    def __call__(self, enabled: bool | None = None) -> _StrictBlock:
        if enabled is None:
            return _StrictBlock()
        check_type("enabled", enabled, bool)
        with _STATE.lock:
            previous = _STATE.global_on
            _STATE.update(global_on=enabled)
        return _StrictBlock(previous_global=previous)

    def enable(self) -> None:
        _STATE.update(global_on=True)

    def disable(self) -> None:
        _STATE.update(global_on=False)

    def __repr__(self):
        return f"<opsnn_lab.consistency.strict (active={is_strict()})>"


strict = _Strict()


def is_strict() -> bool:
    """True while strict mode is on (some ``with strict():`` block is open or ``strict(True)``)."""
    return _STATE.active


enable = strict.enable
disable = strict.disable


class _CallableModule(types.ModuleType):
    """This module answers to ``strict(...)`` too.

    Importing ``opsnn_lab.consistency.strict`` binds the package attribute ``strict`` to this module,
    shadowing the ``strict`` object the package exports; making the module callable keeps
    ``ol.consistency.strict()`` / ``.enable()`` / ``.disable()`` working in either import order.
    """

    def __call__(self, enabled: bool | None = None) -> _StrictBlock:
        return strict(enabled)


sys.modules[__name__].__class__ = _CallableModule
