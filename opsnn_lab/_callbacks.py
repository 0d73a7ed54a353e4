"""The training-loop hook protocol, below every layer so a pillar can ship a callback.

``ol.train`` (``opsnn_lab/training.py``, above the pillars) calls these methods; pillars such as
``precision.GradientStats`` subclass :class:`Callback` without importing the loop that drives them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing the loop here would point an arrow up
    import torch
    from torch import nn

    from opsnn_lab.training import TrainResult


class Callback:
    """Base class for training-loop hooks; override what you need."""

    def on_train_start(self, model: nn.Module, optimizer) -> None: ...
    def on_step_start(self, step: int, batch: dict) -> None: ...
    def on_after_backward(self, step: int, model: nn.Module, loss: torch.Tensor) -> None: ...
    def on_step_end(self, step: int, model: nn.Module, loss: float) -> None: ...
    def on_train_end(self, result: TrainResult) -> None: ...
