"""A Parameter or buffer put in place of one a fused op holds: ``torch.func.functional_call``, a new Parameter.

A fused op holds its modules' Parameter and buffer objects (fx code copies them onto its GraphModule too), so a
tensor put in their place was never read: ``functional_call(fused, params, x)`` computed with the model's own
weights (0.46 apart from the unfused model's result on the embedded encoder, 0.49 on GPT-2), and a Parameter
assigned after fusion (tying, resizing, a reset) was neither used nor trained. Each patch now records those
tensors and runs its chain or region unfused while one differs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call

import opsnn_lab as ol
from opsnn_lab.bench import activation_bytes
from opsnn_lab.models import Encoder, EncoderConfig
from opsnn_lab.testing import seeded


class ConvMLP(nn.Module):
    """Conv -> BN -> ReLU, then Linear -> GELU -> Linear and an RMSNorm: three module chains."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        self.norm = nn.RMSNorm(4)

    def forward(self, x):
        return self.norm(self.mlp(self.act(self.bn(self.conv(x))).mean((2, 3))))


def _settings():
    return ConvMLP().train().double(), (seeded(4, 3, 6, 6, dtype=torch.float64),)


def _encoder():  # eval: its dropouts off; with grad the fused ops and the regions' code run
    model = Encoder(EncoderConfig.tiny(layers=2)).eval().double()
    return model, (torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0)),)


MODELS = {"conv-bn-relu, MLP, RMSNorm (train)": _settings, "encoder: fx regions, chains (eval)": _encoder}


def _output(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("case", list(MODELS))
def test_functional_call_on_the_fused_model_computes_with_the_tensors_it_is_given(case):
    torch.manual_seed(0)
    model, inputs = MODELS[case]()
    fused, plan = ol.fusion.fuse(model, inputs)
    assert len(plan.fused) >= 3
    fused_bytes = activation_bytes(lambda: fused(*inputs))
    results = []
    for m in (model, fused):  # the same new tensors for both; buffers too (BatchNorm statistics move in them)
        given = {k: (v.detach() * 1.5 + 0.01).requires_grad_(v.requires_grad) for k, v in model.named_parameters()}
        given |= {k: v.clone() for k, v in model.named_buffers()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # said once per chain: tested below
            out = _output(functional_call(m, given, inputs))
        grads = torch.autograd.grad(out.square().sum(), [v for v in given.values() if v.requires_grad])
        results.append((out, grads, [v for v in given.values() if not v.requires_grad]))
    (want, want_grads, want_buffers), (got, got_grads, got_buffers) = results
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    for g, w in zip(got_buffers, want_buffers, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert activation_bytes(lambda: fused(*inputs)) == fused_bytes  # its own tensors back: fused again
        torch.testing.assert_close(_output(fused(*inputs)), _output(model(*inputs)), rtol=1e-10, atol=1e-10)


def test_a_parameter_assigned_after_fusion_is_used_and_trained():
    torch.manual_seed(0)
    model, inputs = _settings()
    fused, plan = ol.fusion.fuse(model, inputs)
    assert any(d.modules[0] == "mlp.0" for d in plan.fused), plan.decisions
    torch.manual_seed(1)
    new = torch.randn_like(model.mlp[0].weight)
    for m in (model, fused):
        m.mlp[0].weight = nn.Parameter(new.clone())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, fused)]
    for step in range(2):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", RuntimeWarning)
            got = fused(*inputs)
        want = model(*inputs)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        said = [str(w.message) for w in seen if "changed after" in str(w.message)]
        assert len(said) == (step == 0), said
        if said:
            assert ("`mlp.0` changed after the linear_gelu_linear chain at `mlp.0` was fused (`weight` is not the "
                    "tensor it held at fusion") in said[0], said[0]
        for out, opt in ((want, opts[0]), (got, opts[1])):
            opt.zero_grad()
            out.square().sum().backward()
            opt.step()
        torch.testing.assert_close(fused.mlp[0].weight, model.mlp[0].weight, rtol=1e-10, atol=1e-10)
