"""An optimizer built on the model before it was fused: ``fuse`` returns a copy, so it steps nothing the fused
model trains. Said once, at that optimizer's first step (fusion/originals.py)."""

from __future__ import annotations

import gc
import warnings
import weakref

import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab.testing import seeded


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)), seeded(3, 4)


def _steps(model, opt, x, n=2) -> list[str]:
    said = []
    for _ in range(n):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        said += [str(w.message) for w in seen if str(w.message).startswith("opsnn_lab.fusion")]
    return said


def test_an_optimizer_of_the_original_model_is_told_at_its_first_step():
    model, x = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    fused, plan = ol.fusion.fuse(model, (x,))
    assert plan.fused
    before = [p.detach().clone() for p in fused.parameters()]
    said = _steps(fused, opt, x)
    assert len(said) == 1 and "this AdamW steps the Parameters of a model that was fused" in said[0], said
    assert "fused.parameters()" in said[0]
    assert all(torch.equal(p, q) for p, q in zip(fused.parameters(), before))  # indeed: nothing trained


def test_an_optimizer_of_the_fused_model_or_of_the_original_trained_alone_is_not_told():
    model, x = _mlp()
    fused, _ = ol.fusion.fuse(model, (x,))
    assert _steps(fused, torch.optim.SGD(fused.parameters(), lr=0.1), x) == []
    assert _steps(model, torch.optim.SGD(model.parameters(), lr=0.1), x) == []  # its own gradients


def test_the_models_are_not_kept_alive():
    model, x = _mlp()
    fused, plan = ol.fusion.fuse(model, (x,))
    refs = [weakref.ref(model), weakref.ref(fused)]
    del model, fused, plan  # the plan holds the analysed model
    gc.collect()
    assert all(r() is None for r in refs)


def test_both_models_still_convert_by_swapping_their_parameters():
    """A weak reference to a Parameter makes ``torch.utils.swap_tensors`` refuse it: the models are held weakly,
    not their Parameters."""
    model, x = _mlp()
    fused, _ = ol.fusion.fuse(model, (x,))
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.double(), fused.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert all(p.dtype == torch.float64 for p in [*model.parameters(), *fused.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert len(_steps(fused, opt, x.double(), n=1)) == 1  # still told
