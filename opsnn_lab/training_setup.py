"""What ``ol.train``'s switchboard arguments set up before the loop runs.

Kept apart from the loop so the loop reads as a loop: ``prepare`` returns the model to
train (fused, reproducible, in the chosen precision), its optimizer, the loss scaler,
the callbacks that record, and an autocast context factory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["Setup", "prepare"]


@dataclass
class Setup:
    model: nn.Module
    optimizer: object
    scaler: object = None
    callbacks: list = field(default_factory=list)
    extras: dict = field(default_factory=dict)
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    forward_backward: Callable | None = None  # across ranks: replaces the loop's loss + backward


class _TraceFirstStep:
    """Records the first training step with a ConsistencyChecker (the reference a later run compares to)."""

    def __init__(self, checker):
        self.checker, self._ctx = checker, None

    def on_train_start(self, model, optimizer):
        self.model = model

    def on_step_start(self, step, batch):
        if self.checker.reference is None and self._ctx is None:
            self._ctx = self.checker.trace(self.model)
            self._ctx.__enter__()

    def on_after_backward(self, step, model, loss):
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)

    def on_step_end(self, step, model, loss): ...
    def on_train_end(self, result): ...


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _move_optimizer(optimizer: torch.optim.Optimizer, original: nn.Module, fused: nn.Module) -> None:
    """Point an optimizer built on ``original`` at the same-named Parameters of its fused copy (``fuse`` returns a
    copy: left as it was, the optimizer stepped tensors without gradients and nothing trained), its state too."""
    twins = {id(p): q for (_, p), (_, q) in zip(original.named_parameters(), fused.named_parameters(), strict=True)}
    for group in optimizer.param_groups:
        group["params"] = [twins.get(id(p), p) for p in group["params"]]
    for p in [p for p in optimizer.state if id(p) in twins]:
        optimizer.state[twins[id(p)]] = optimizer.state.pop(p)


def _optimizer(model, optimizer, lr):
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None:
        return torch.optim.AdamW(params, lr=lr)
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer(params)
    return optimizer


def prepare(model: nn.Module, task, *, fuse: bool, precision: str, seed: int | None, record: bool, lr: float,
            optimizer, start_step: int, parallel: str | None = None, strict: bool = False,
            block_rows: int | None = None) -> Setup:
    extras: dict = {}
    ctx = None
    if parallel is not None:
        from opsnn_lab.parallel.runtime import init_distributed

        ctx = extras["dist"] = init_distributed()
    if seed is not None:
        torch.manual_seed(seed)
    if fuse:
        from opsnn_lab import fusion

        example = task.inputs(task.batch(start_step)) if hasattr(task, "inputs") else None
        if example is None:
            raise TypeError("fuse=True needs a task with inputs(batch) giving the model's example inputs")
        original = model
        model, plan = fusion.fuse(model, example)
        extras["fusion_plan"] = plan
        if isinstance(optimizer, torch.optim.Optimizer):
            _move_optimizer(optimizer, original, model)
    if seed is not None:
        from opsnn_lab.consistency import make_reproducible

        # across ranks (not strict): each rank's rows get their own masks; strict keeps the seed so a
        # world of one draws the same masks (see opsnn_lab.parallel.step for what strict asks of dropout)
        make_reproducible(model, seed=seed + (1_000_003 * ctx.rank if ctx is not None and not strict else 0))
    device = _device_of(model)
    scaler, autocast = None, contextlib.nullcontext
    if precision in ("fp16-master", "bf16-master"):
        if optimizer is not None:
            raise ValueError(f"precision={precision!r} brings its own optimizer (MasterWeightOptimizer); "
                             "pass optimizer=None")
        from opsnn_lab.precision import DynamicScaler, MasterWeightOptimizer

        grad_dtype = None
        if precision == "bf16-master":
            model.to(torch.bfloat16)
        elif device.type == "cuda":
            model.half()
        else:
            grad_dtype = torch.float16  # CPU: fp32 compute, fp16 gradient pipeline
        if precision == "fp16-master":
            scaler = DynamicScaler()
        if ctx is not None:
            from opsnn_lab.parallel.optim import DistributedMasterWeightOptimizer as MasterWeightOptimizer

            model = _wrap(model, parallel, ctx, precision, strict, extras, scaler)
        kw = {"uniform_update": strict} if ctx is not None else {}
        optimizer = MasterWeightOptimizer(model, lr=lr, scaler=scaler, grad_dtype=grad_dtype, **kw)
    else:
        if ctx is not None:
            model = _wrap(model, parallel, ctx, precision, strict, extras)
        optimizer = _optimizer(model, optimizer, lr)
        if precision == "bf16":
            autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    callbacks = []
    if record:
        from opsnn_lab.consistency import ConsistencyChecker
        from opsnn_lab.precision import GradientStats

        # under a loss scaler .grad holds g * scale: the statistics divide it out, as the notebooks do
        stats = GradientStats(model, scale=scaler, scaled=True) if scaler is not None else GradientStats(model)
        checker = ConsistencyChecker(dump_on_failure=False)
        callbacks += [stats, _TraceFirstStep(checker)]
        extras.update(gradient_stats=stats, consistency=checker)
    forward_backward = None
    if ctx is not None:
        from opsnn_lab.parallel.step import make_forward_backward

        extras.update(optimizer=optimizer, scaler=scaler)  # the run's state, for hashes and checkpoints

        forward_backward = make_forward_backward(task, ctx, parallel=parallel, scaler=scaler, autocast=autocast,
                                                 strict=strict, block_rows=block_rows,
                                                 comms=extras.get("ordered_comms", ()))
    return Setup(model, optimizer, scaler, callbacks, extras, autocast, forward_backward)


def _wrap(model, parallel, ctx, precision, strict, extras, scaler=None):
    """DDP (fp16 comm hook for fp16-master, unless strict sums in its own order) or FSDP2."""
    from opsnn_lab.parallel.wrap import wrap_model

    model.to(ctx.device)
    wrapped, state = wrap_model(model, parallel, device=ctx.device,
                                fp16_hook=precision == "fp16-master" and not strict, ordered_grads=strict,
                                scaler=scaler)
    if parallel == "ddp":
        extras["comm_state"] = state
    else:
        extras["ordered_comms"] = state
    return wrapped
