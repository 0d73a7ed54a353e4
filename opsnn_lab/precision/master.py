"""fp32 master weights behind fp16/bf16 model parameters, updated by the fused precision-aware step.

The seed's stage 3 ("always update in FP32"): the model computes in low precision, an fp32 copy of
every parameter takes the optimizer step, and the low-precision parameter is rewritten from it. Small
updates that would vanish when added to a bf16 weight (|update| < weight * 2**-8) accumulate in the
master instead of being rounded away: that is the seed's "direction bias" of naive low-precision steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from opsnn_lab._checks import check_choice, check_positive, check_range, check_type
from opsnn_lab.kernels.fused_update import adamw_update_, sgd_update_
from opsnn_lab.precision.dynamic_scaler import DynamicScaler
from opsnn_lab.precision.local_scaler import amax_of, tensor_amaxes

__all__ = ["MasterWeightOptimizer"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _named_params(params) -> list[tuple[str, nn.Parameter]]:
    if isinstance(params, nn.Module):
        pairs = list(params.named_parameters())
    elif isinstance(params, Iterable):
        items = list(params)
        pairs = [(str(x[0]), x[1]) if isinstance(x, tuple) else (f"param[{i}]", x) for i, x in enumerate(items)]
    else:
        raise TypeError(f"params must be an nn.Module or an iterable of Parameters, got {type(params).__name__}")
    pairs = [(n, p) for n, p in pairs if p.requires_grad]
    if not pairs:
        raise ValueError("params must contain at least one parameter that requires grad")
    for n, p in pairs:
        if not isinstance(p, torch.Tensor) or p.dtype not in _FLOATS:
            raise TypeError(f"params: {n} must be an fp16/bf16/fp32 tensor, got "
                            f"{getattr(p, 'dtype', type(p).__name__)}")
    return pairs


class MasterWeightOptimizer:
    """AdamW or SGD-momentum on fp32 masters of low-precision parameters, with loss scaling built in.

    ``MasterWeightOptimizer(model_or_params, optimizer="adamw", lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=None (0.01 for adamw, 0 for sgd), momentum=0.9, nesterov=False, scaler=None,
    grad_dtype=None, pipelined=False)``.

    * ``scaler``: a ``DynamicScaler``; grads are read scaled, unscaled inside the fused update, and
      ``step()`` also calls ``scaler.update()``. Without one, grads are taken as they are.
    * ``grad_dtype``: route grads through this dtype before the update (``torch.float16`` on an fp32 or
      bf16 model reproduces an fp16 gradient pipeline: overflow becomes Inf, tiny values flush).
    * A step whose grads hold Inf/NaN anywhere changes nothing: masters, moments, step count and model
      weights stay bit-identical; ``skipped_steps`` counts it and ``last_nonfinite`` names the params.
    * ``pipelined=True``: each parameter is updated inside backward as soon as its grad is complete
      (``register_post_accumulate_grad_hook``) and the grad is freed at once, so all grads never exist
      together. A non-finite grad cannot be known before earlier parameters were updated, so this mode
      defines the step as *all parameters updated*: a parameter whose grad is non-finite takes the step
      with a zero grad (moments decay, no NaN reaches a master) and the scaler backs off. Underflow
      growth still raises the scale but cannot skip a step already applied. One backward per ``step()``.
    """

    def __init__(self, params, optimizer: str = "adamw", lr: float = 1e-3, *, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float | None = None, momentum: float = 0.9, nesterov: bool = False,
                 scaler: DynamicScaler | None = None, grad_dtype: torch.dtype | None = None, pipelined: bool = False):
        check_choice("optimizer", optimizer, ("adamw", "sgd"))
        check_positive("lr", lr)
        check_type("betas", betas, (tuple, list))
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):
            check_range(f"betas[{i}]", b, 0.0, 1.0, high_inclusive=False)
        check_positive("eps", eps)
        weight_decay = (0.01 if optimizer == "adamw" else 0.0) if weight_decay is None else weight_decay
        check_positive("weight_decay", weight_decay, allow_zero=True)
        check_range("momentum", momentum, 0.0, 1.0, high_inclusive=False)
        check_type("scaler", scaler, DynamicScaler, allow_none=True)
        if grad_dtype is not None:
            check_choice("grad_dtype", grad_dtype, _FLOATS)
        check_type("pipelined", pipelined, bool)
        if nesterov and (optimizer != "sgd" or momentum == 0):
            raise ValueError("nesterov needs optimizer='sgd' and momentum > 0")
        pairs = _named_params(params)
        self.names = [n for n, _ in pairs]
        self.params = [p for _, p in pairs]
        self.kind = optimizer
        self.defaults = {"lr": float(lr), "betas": (float(betas[0]), float(betas[1])), "eps": float(eps),
                         "weight_decay": float(weight_decay), "momentum": float(momentum), "nesterov": nesterov}
        self.param_groups = [{"params": self.params, **self.defaults}]
        self.scaler = scaler
        self.grad_dtype = grad_dtype
        self.pipelined = pipelined
        with torch.no_grad():
            self.masters = [p.detach().float().clone() for p in self.params]
        n_state = 2 if optimizer == "adamw" else (1 if momentum else 0)
        self.state = [[torch.zeros_like(m) for m in self.masters] for _ in range(n_state)]
        self.steps_taken = 0
        self.skipped_steps = 0
        self.last_nonfinite: list[str] = []
        if scaler is not None:
            scaler.attach(list(zip(self.names, self.params)))
        self._handles = []
        self._pending: dict | None = None
        if pipelined:
            self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                             for i, p in enumerate(self.params)]

    # ------------------------------------------------------------------ the step
    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def step(self) -> bool:
        """Apply one update (or finish the pipelined one). Returns False when the step was skipped."""
        if self.pipelined:
            return self._finish_pipelined(update_scaler=True)
        applied = self._scaled_step(self.scaler)
        if self.scaler is not None:
            self.scaler.update()
        return applied

    def _grads(self, idx: Iterable[int]) -> tuple[list[int], list[torch.Tensor]]:
        keep, grads = [], []
        for i in idx:
            g = self.params[i].grad
            if g is None:
                continue
            if g.layout != torch.strided:
                raise TypeError(f"{self.names[i]} has a sparse gradient (nn.Embedding(sparse=True)?); the fused "
                                "update takes dense ones: make it dense (sparse=False), or step it with a torch "
                                "optimizer that takes sparse gradients (SparseAdam, SGD) under DynamicScaler")
            keep.append(i)
            grads.append(g if self.grad_dtype is None or g.dtype == self.grad_dtype else g.to(self.grad_dtype))
        return keep, grads

    def _scaled_step(self, scaler: DynamicScaler | None) -> bool:
        """Check all grads, then update all parameters or none (``DynamicScaler.step`` calls this)."""
        if self.pipelined:
            return self._finish_pipelined(update_scaler=False)
        idx, grads = self._grads(range(len(self.params)))
        names = [self.names[i] for i in idx]
        if scaler is not None:
            check = scaler.check(grads, names)
            skip = scaler._skip_this_step()
            self.last_nonfinite = list(check.nonfinite)
        else:
            live = [(n, g) for n, g in zip(names, grads) if g.numel()]
            per = tensor_amaxes([g for _, g in live]).tolist() if live else []
            self.last_nonfinite = [n for (n, _), a in zip(live, per) if not math.isfinite(a)]
            skip = bool(self.last_nonfinite)
        if skip or not idx:
            self.skipped_steps += int(skip)
            return False
        self._apply(idx, grads, step=self.steps_taken + 1)
        self.steps_taken += 1
        return True

    def _apply(self, idx: list[int], grads: list[torch.Tensor], step: int) -> None:
        g = self.param_groups[0]
        inv_scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        params = [self.params[i].data for i in idx]
        masters = [self.masters[i] for i in idx]
        states = [[s[i] for i in idx] for s in self.state]
        if self.kind == "adamw":
            adamw_update_(params, grads, masters, *states, step=step, lr=g["lr"], beta1=g["betas"][0],
                          beta2=g["betas"][1], eps=g["eps"], weight_decay=g["weight_decay"], inv_scale=inv_scale)
        else:
            sgd_update_(params, grads, masters, states[0] if states else [], step=step, lr=g["lr"],
                        momentum=g["momentum"], weight_decay=g["weight_decay"], nesterov=g["nesterov"],
                        inv_scale=inv_scale)

    # ------------------------------------------------------------------ pipelined mode
    def _make_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            self._pipelined_update(i)
        return hook

    def _pipelined_update(self, i: int) -> None:
        pend = self._pending
        if pend is None:
            pend = self._pending = {"updated": set(), "nonfinite": [], "check": []}
        _, grads = self._grads([i])
        if not grads:
            return
        g = grads[0]
        if self.scaler is not None:
            check = self.scaler.check([g], [self.names[i]])
            finite = self.names[i] not in check.nonfinite
        else:
            finite = math.isfinite(float(amax_of([g])))
        if not finite:
            pend["nonfinite"].append(self.names[i])
            g = torch.zeros_like(g)  # the parameter takes this step with no gradient (see class docstring)
        with torch.no_grad():
            self._apply([i], [g], step=self.steps_taken + 1)
        pend["updated"].add(i)
        self.params[i].grad = None  # free it now: this is the memory the pipelined mode saves

    def _finish_pipelined(self, update_scaler: bool) -> bool:
        pend, self._pending = self._pending, None
        if pend is None or not pend["updated"]:
            return False
        self.steps_taken += 1
        self.last_nonfinite = pend["nonfinite"]
        if self.scaler is not None:
            self.scaler._check.applied = True
            if update_scaler:
                self.scaler.update()
        return True

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {"kind": self.kind, "param_groups": [{k: v for k, v in self.param_groups[0].items() if k != "params"}],
                "names": list(self.names), "masters": [m.clone() for m in self.masters],
                "state": [[t.clone() for t in s] for s in self.state], "steps_taken": self.steps_taken,
                "skipped_steps": self.skipped_steps,
                "scaler": None if self.scaler is None else self.scaler.state_dict()}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore masters, moments, counters and the scaler; model weights are rewritten from the masters."""
        check_type("state", state, Mapping)
        if state.get("kind") != self.kind or len(state.get("masters", ())) != len(self.masters):
            raise ValueError(f"state is for a {state.get('kind')!r} optimizer over {len(state.get('masters', ()))} "
                             f"parameters; this one is {self.kind!r} over {len(self.masters)}")
        if len(state["state"]) != len(self.state):
            raise ValueError(f"state holds {len(state['state'])} moment lists, expected {len(self.state)}")
        with torch.no_grad():
            for m, src in zip(self.masters, state["masters"]):
                if m.shape != src.shape:
                    raise ValueError(f"state: master of shape {tuple(src.shape)} does not fit {tuple(m.shape)}")
                m.copy_(src)
            for mine, theirs in zip(self.state, state["state"]):
                for t, src in zip(mine, theirs):
                    t.copy_(src)
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
        self.param_groups[0].update(state["param_groups"][0])
        self.steps_taken = int(state["steps_taken"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])

    def __repr__(self) -> str:
        n = sum(m.numel() for m in self.masters)
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in self.params})
        return (f"MasterWeightOptimizer({self.kind}, {len(self.params)} params / {n} elements in {'/'.join(dtypes)}, "
                f"lr={self.lr:g}, pipelined={self.pipelined}, scaler={self.scaler!r})")
