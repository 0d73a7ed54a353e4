"""A ``transformers.TrainerCallback`` that records a ``GradientTrace`` during ``Trainer.train()``.

    from opsnn_lab.integrations.transformers import GradientTraceCallback
    cb = GradientTraceCallback()
    Trainer(model, args, train_dataset=ds, callbacks=[cb]).train()
    ScalerTuner(cb.trace)          # the sliders replay this run's gradients

The gradients are read by :class:`opsnn_lab.precision.GradientRecorder` hooks when each optimizer
step's last backward ends (``gradient_accumulation_steps`` respected), i.e. before the Trainer clips
them. ``trace.npz`` is written next to each checkpoint (``checkpoint-<step>/gradient_trace.npz``) and
into ``output_dir`` when training ends, by the main process only. Under fp16 mixed precision the
Trainer's gradients carry its loss scale: pass ``scale=`` (a number or callable) with ``scaled=True``.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import TrainerCallback

from opsnn_lab.precision.grad_recorder import GradientRecorder
from opsnn_lab.precision.grad_stats import GradientTrace

__all__ = ["GradientTraceCallback", "TRACE_NAME"]

TRACE_NAME = "gradient_trace.npz"


class GradientTraceCallback(TrainerCallback):
    """Records the gradient statistics of every optimizer step of ``Trainer.train()``.

    ``scale``/``scaled``/``bins``: passed to :class:`GradientRecorder`. ``save``: write the npz files.
    After training, ``trace`` is the ``GradientTrace`` and ``paths`` lists the files written.
    """

    def __init__(self, *, scale=1.0, scaled: bool = False, bins=None, save: bool = True):
        self._kw = {"scale": scale, "scaled": scaled, **({"bins": bins} if bins is not None else {})}
        self.save = bool(save)
        self.recorder: GradientRecorder | None = None
        self.paths: list[Path] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("GradientTraceCallback needs the Trainer's model (model=None was passed)")
        if self.recorder is not None:
            self.recorder.remove()
        self.recorder = GradientRecorder(model, every=max(1, int(args.gradient_accumulation_steps)), **self._kw)

    @property
    def trace(self) -> GradientTrace:
        if self.recorder is None:
            raise RuntimeError("nothing recorded yet: pass the callback to a Trainer and call train()")
        return self.recorder.trace()

    def _write(self, folder: str | os.PathLike) -> None:
        path = Path(folder) / TRACE_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        self.recorder.save(path)
        self.paths.append(path)

    def on_save(self, args, state, control, **kwargs):
        if self.save and self.recorder is not None and state.is_world_process_zero:
            self._write(Path(args.output_dir) / f"checkpoint-{state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        if self.recorder is None:
            return
        if self.save and state.is_world_process_zero:
            self._write(args.output_dir)
        self.recorder.remove()
