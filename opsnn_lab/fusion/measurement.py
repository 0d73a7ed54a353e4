"""``measure(model, fused, example_inputs)``: eager vs fused activation bytes and step time, side by side."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from opsnn_lab._checks import check_positive, check_type
from opsnn_lab._hooks import passive
from opsnn_lab.fusion.analysis import split_inputs
from opsnn_lab.fusion.runtime import flatten_tensors
from opsnn_lab.measuring import activation_bytes, interleaved_medians, saved_tensors_report

__all__ = ["measure", "Measurement", "activation_bytes_by_module"]


@dataclass
class Measurement:
    eager_bytes: int
    fused_bytes: int
    eager_seconds: float  # median forward + backward time (ratios only mean something on a loaded machine)
    fused_seconds: float
    max_abs_error: float  # largest output difference on the example inputs

    @property
    def activation_ratio(self) -> float:
        return self.fused_bytes / self.eager_bytes if self.eager_bytes else 1.0

    @property
    def speedup(self) -> float:
        return self.eager_seconds / self.fused_seconds if self.fused_seconds else float("nan")

    def to_dict(self) -> dict:
        return {**asdict(self), "activation_ratio": self.activation_ratio, "speedup": self.speedup}


def _step(model, args, kwargs):
    def run():
        outs = [t for t in flatten_tensors(model(*args, **kwargs)) if t.requires_grad]
        if outs:
            sum(t.float().sum() for t in outs).backward()
        model.zero_grad(set_to_none=True)
    return run


def measure(model: nn.Module, fused: nn.Module, example_inputs, repeat: int = 3) -> Measurement:
    """Activation bytes (``measuring.activation_bytes``, parameters excluded) and median step time of both models.

    Both run in their current mode; timings are interleaved so machine load hits both alike.
    """
    check_type("model", model, nn.Module)
    check_type("fused", fused, nn.Module)
    check_positive("repeat", repeat, integer=True)
    args, kwargs = split_inputs(example_inputs)
    nbytes = {}
    outs = {}
    for name, m in (("eager", model), ("fused", fused)):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            nbytes[name] = activation_bytes(lambda m=m, name=name: outs.setdefault(name, m(*args, **kwargs)),
                                            exclude=tuple(m.parameters()))
    err = max((float((a.detach().double() - b.detach().double()).abs().max()) for a, b in
               zip(flatten_tensors(outs["eager"]), flatten_tensors(outs["fused"])) if a.numel()), default=0.0)
    times = interleaved_medians({"eager": _step(model, args, kwargs), "fused": _step(fused, args, kwargs)},
                                warmup=1, repeat=repeat)
    return Measurement(nbytes["eager"], nbytes["fused"], times["eager"], times["fused"], err)


def activation_bytes_by_module(model: nn.Module, example_inputs, depth: int = 2) -> dict[str, int]:
    """Activation bytes of one forward, attributed to module paths cut at ``depth`` (``layers.3`` at depth 2).

    A storage counts once, for the module that saved it first (the innermost module running at the
    time); parameters are left out, and so is what a computation the forward dropped saved, as in
    ``activation_bytes``. Fused ops count for the block they sit in.
    """
    check_type("model", model, nn.Module)
    check_positive("depth", depth, integer=True)
    args, kwargs = split_inputs(example_inputs)
    paths = {id(m): name for name, m in model.named_modules()}
    stack = [""]

    def pre(module, _args):
        stack.append(".".join(paths.get(id(module), stack[-1]).split(".")[:depth]))

    def post(module, _args, _out):
        stack.pop()

    pre, post = passive(pre), passive(post)  # they measure the fused code as it runs: no region falls back
    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(pre),
                                                    m.register_forward_hook(post, always_call=True))]
    try:
        with torch.random.fork_rng(devices=[]):
            report = saved_tensors_report(lambda: model(*args, **kwargs), exclude=tuple(model.parameters()),
                                          where=lambda: stack[-1] or "<model>")
    finally:
        for h in handles:
            h.remove()
    out: dict[str, int] = {}
    for row in report.tensors:
        out[row["where"]] = out.get(row["where"], 0) + row["bytes"]
    return out
