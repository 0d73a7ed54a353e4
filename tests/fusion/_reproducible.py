"""A fused model trains as the unfused one: both made reproducible from one seed (the same dropout masks), one
forward and backward of the same loss, the outputs and every parameter gradient compared."""

from __future__ import annotations

import torch

import opsnn_lab as ol


def assert_trains_as_eager(model, fused, *inputs, seed: int = 7, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    """Outputs within ``rtol`` / ``atol`` (float64 models: 1e-12 on the outputs), gradients within ``rtol``."""
    runs = []
    for m in (model, fused):
        ol.consistency.make_reproducible(m, seed=seed)
        m.zero_grad(set_to_none=True)
        out = m(*inputs)
        out.sin().sum().backward()  # not autograd.grad: reentrant checkpointing takes backward() only
        runs.append((out.detach(), [p.grad for p in m.parameters()]))
    (out_a, grads_a), (out_b, grads_b) = runs
    torch.testing.assert_close(out_b, out_a, rtol=min(rtol, 1e-12), atol=atol)
    for (name, _), a, b in zip(model.named_parameters(), grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=name)
