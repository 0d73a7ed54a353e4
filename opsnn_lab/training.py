"""The training loop every notebook and benchmark shares, and its switchboard.

``train(model, task, steps)`` runs ``steps`` optimizer steps on a task that has
``batch(step)`` and ``loss(model, batch)`` (see ``opsnn_lab.models``), shows a tqdm
bar, and records per-step loss and per-parameter gradient amax. Features plug in
through callbacks (``on_step_start``, ``on_after_backward``, ``on_step_end``).

The switchboard turns the pillars on for one run::

    ol.train(model, task, steps, fuse=True, precision="fp16-master", seed=0, strict=False, record=True)

``fuse`` rewrites the model with fused ops (``result.model`` is the trained, fused copy;
the plan is ``result.extras["fusion_plan"]``); ``precision`` picks the gradient pipeline
(see ``PRECISIONS``); ``seed`` makes every dropout mask depend only on (seed, module, step);
``strict`` runs the loop in the FP32 consistency mode; ``record`` keeps what every widget
needs: gradient statistics, the scaler history and a consistency trace of the first step.
"""

from __future__ import annotations

import contextlib
import html
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from opsnn_lab._callbacks import Callback
from opsnn_lab._checks import check_choice, check_positive, check_type

__all__ = ["TrainResult", "Callback", "train", "PRECISIONS"]

# fp32: plain fp32. bf16: autocast to bf16. fp16-master: fp32 master weights updated by the fused
# precision-aware step, gradients through fp16 with a DynamicScaler (on CUDA the model itself runs
# in fp16; on CPU, where fp16 matmuls are slow, the model computes in fp32 and only the gradient
# pipeline is fp16). bf16-master: bf16 model, fp32 masters, no loss scaling (bf16 has fp32's range).
PRECISIONS = ("fp32", "bf16", "fp16-master", "bf16-master")


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_amax: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0
    extras: dict = field(default_factory=dict)
    model: nn.Module | None = field(default=None, repr=False)
    skipped_steps: int = 0
    precision: str | None = None  # the switchboard's precision, when ol.train ran it

    @property
    def steps(self) -> int:
        return len(self.losses)

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else math.nan

    def smoothed(self, window: int = 10) -> list[float]:
        """Running mean of the loss over ``window`` steps (for plots and comparisons)."""
        out, acc = [], 0.0
        for i, v in enumerate(self.losses):
            acc += v
            if i >= window:
                acc -= self.losses[i - window]
            out.append(acc / min(i + 1, window))
        return out

    def to_dict(self) -> dict:
        return {"losses": self.losses, "grad_amax": self.grad_amax, "seconds": self.seconds,
                "extras": {k: v for k, v in self.extras.items() if _jsonable(v)}}

    def _summary(self) -> str:
        first = self.losses[0] if self.losses else math.nan
        parts = [f"{self.steps} steps in {self.seconds:.2f} s", f"loss {first:.4f} → {self.final_loss:.4f}"]
        if self.precision is not None:
            parts.append(f"precision {self.precision}")
        plan = self.extras.get("fusion_plan") if isinstance(self.extras, dict) else None
        if plan is not None:
            parts.append(f"{sum(bool(getattr(d, 'fused', False)) for d in getattr(plan, 'decisions', ()))} fused")
        if self.skipped_steps:
            parts.append(f"{self.skipped_steps} skipped")
        return ", ".join(parts)

    def __repr__(self) -> str:
        # every loss and every gradient amax would be ~100 KB for 150 steps: the fields hold them
        return f"TrainResult({self._summary()})"

    def _repr_html_(self) -> str:
        return f"<b>TrainResult</b>: {html.escape(self._summary())}"


def _jsonable(v) -> bool:
    return isinstance(v, (int, float, str, bool, list, dict, type(None)))


def train(
    model: nn.Module,
    task,
    steps: int = 100,
    *,
    lr: float = 1e-3,
    optimizer: torch.optim.Optimizer | Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer] | None = None,
    callbacks: Sequence[Callback] = (),
    record_grad_amax: bool = True,
    progress: bool | None = None,
    start_step: int = 0,
    desc: str = "train",
    fuse: bool = False,
    precision: str = "fp32",
    seed: int | None = None,
    strict: bool = False,
    record: bool = False,
    parallel: str | None = None,
    block_rows: int | None = None,
) -> TrainResult:
    """Train ``model`` on ``task`` for ``steps`` steps and return the recorded history.

    ``optimizer`` is an optimizer instance, a factory taking the parameters, or None for
    AdamW(lr) (or the master-weight optimizer the ``precision`` asks for). ``progress=None``
    shows a bar when the run is long enough to want one. See the module docstring for the
    switchboard arguments ``fuse``, ``precision``, ``seed``, ``strict`` and ``record``.
    ``parallel="ddp" | "fsdp"`` trains across the ranks ``torchrun`` started (``task.batch(step)`` is
    the global batch; see :mod:`opsnn_lab.parallel`); with ``strict``, ``block_rows`` sets the row
    blocks whose gradients are summed in a fixed tree.
    """
    check_type("model", model, nn.Module)
    if not (hasattr(task, "batch") and hasattr(task, "loss")):
        raise TypeError("task must provide batch(step) and loss(model, batch), e.g. opsnn_lab.models.MaskedTokenTask")
    check_positive("steps", steps, allow_zero=True, integer=True)
    check_positive("lr", lr)
    check_choice("precision", precision, PRECISIONS)
    for name, flag in (("fuse", fuse), ("strict", strict), ("record", record)):
        check_type(name, flag, bool)
    if seed is not None:
        check_positive("seed", seed, allow_zero=True, integer=True)
    if parallel is not None:
        check_choice("parallel", parallel, ("ddp", "fsdp"))
    if block_rows is not None:
        check_positive("block_rows", block_rows, integer=True)
    from opsnn_lab.training_setup import prepare

    setup = prepare(model, task, fuse=fuse, precision=precision, seed=seed, record=record, lr=lr,
                    optimizer=optimizer, start_step=start_step, parallel=parallel, strict=strict,
                    block_rows=block_rows)
    model, optimizer, scaler = setup.model, setup.optimizer, setup.scaler
    callbacks = [*setup.callbacks, *callbacks]
    params = [p for p in model.parameters() if p.requires_grad]
    names = {p: n for n, p in model.named_parameters()}
    result = TrainResult(grad_amax={names[p]: [] for p in params} if record_grad_amax else {},
                         extras=setup.extras, model=model, precision=precision)
    model.train()
    with contextlib.ExitStack() as stack:
        if strict:
            from opsnn_lab.consistency import strict as strict_mode

            stack.enter_context(strict_mode())
        _loop(model, task, steps, optimizer, scaler, callbacks, result, params, names, record_grad_amax,
              progress, start_step, desc, setup.autocast, setup.forward_backward)
    if scaler is not None:
        result.extras["scaler_history"] = scaler.history
    result.skipped_steps = getattr(optimizer, "skipped_steps", 0)
    for cb in callbacks:
        cb.on_train_end(result)
    return result


def _loop(model, task, steps, optimizer, scaler, callbacks, result, params, names, record_grad_amax,
          progress, start_step, desc, autocast, forward_backward=None) -> None:
    for cb in callbacks:
        cb.on_train_start(model, optimizer)

    from tqdm.auto import tqdm

    bar = tqdm(range(start_step, start_step + steps), desc=desc, leave=False,
               disable=(not progress) if progress is not None else steps < 20, mininterval=0.5)
    t0 = time.perf_counter()
    for step in bar:
        batch = task.batch(step)
        for cb in callbacks:
            cb.on_step_start(step, batch)
        optimizer.zero_grad(set_to_none=True)
        if forward_backward is not None:
            loss = forward_backward(model, batch)
        else:
            with autocast():
                loss = task.loss(model, batch)
            (scaler.scale_loss(loss) if scaler is not None else loss).backward()
        for cb in callbacks:
            cb.on_after_backward(step, model, loss)
        if record_grad_amax:
            amaxes = torch.stack([p.grad.detach().abs().max() if p.grad is not None and p.grad.numel()
                                  else torch.zeros((), device=p.device) for p in params]).float().tolist()
            unscale = 1.0 / scaler.scale if scaler is not None else 1.0  # grads carry the loss scale
            for p, a in zip(params, amaxes):
                result.grad_amax[names[p]].append(a * unscale)
        optimizer.step()
        value = float(loss.detach())
        result.losses.append(value)
        for cb in callbacks:
            cb.on_step_end(step, model, value)
        bar.set_postfix(loss=f"{value:.4f}", refresh=False)
    result.seconds = time.perf_counter() - t0
