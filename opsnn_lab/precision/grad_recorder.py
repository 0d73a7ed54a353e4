"""Record a ``GradientTrace`` from any training loop: hooks on the model, no ``ol.train`` needed.

``GradientRecorder(model)`` registers a post-accumulate-grad hook on every trainable parameter. The
first hook of a backward queues one callback on the autograd engine, which runs when that backward
has finished and hands the complete ``.grad`` s to :class:`GradientStats` (one histogram pass per
step). So the user's own loop records with no call of its own::

    rec = GradientRecorder(model, scale=scaler.get_scale, scaled=True)   # torch.amp.GradScaler, or none
    for batch in loader:
        loss = model(**batch).loss; scaler.scale(loss).backward(); ...  # unchanged
    ScalerTuner(rec.trace())

``every=k`` records the last backward of each group of ``k`` (the complete gradient under ``k``-step
gradient accumulation), numbered ``0, 1, 2, ...`` like optimizer steps; ``pause()``/``resume()`` skip
stretches (evaluation with grads, say), ``remove()`` detaches the hooks.
"""

from __future__ import annotations

import torch
from torch import nn

from opsnn_lab._checks import check_positive, check_type
from opsnn_lab.precision.grad_stats import DEFAULT_BINS, GradientStats, GradientTrace

__all__ = ["GradientRecorder"]


class GradientRecorder:
    """Hooks that fill a :class:`GradientStats` after every backward of ``model``.

    ``scale``/``scaled``/``bins``: as for ``GradientStats`` (``scale`` may be a callable such as
    ``GradScaler.get_scale``, read when each backward ends). ``backwards`` counts backward passes.
    """

    def __init__(self, model: nn.Module, *, scale=1.0, scaled: bool = False, bins: tuple[int, int] = DEFAULT_BINS,
                 every: int = 1):
        check_type("model", model, nn.Module)
        check_positive("every", every, integer=True)
        self.stats = GradientStats(model, bins=bins, scale=scale, scaled=scaled)
        self.every = every
        self.backwards = 0
        self.active = True
        self._queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.stats.params]

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._queued or not self.active:
            return
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self._queued = False
        self.backwards += 1
        if self.backwards % self.every == 0:
            self.stats.record(self.backwards // self.every - 1)

    def pause(self) -> None:
        self.active = False

    def resume(self) -> None:
        self.active = True

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __len__(self) -> int:
        return len(self.stats)

    def trace(self) -> GradientTrace:
        return self.stats.trace()

    def save(self, path):
        return self.stats.save(path)

    def __repr__(self) -> str:
        return (f"GradientRecorder({len(self.stats.params)} parameters, {len(self)} steps recorded, "
                f"{'active' if self.active and self._handles else 'paused'})")
