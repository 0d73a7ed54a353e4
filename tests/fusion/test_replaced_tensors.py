"""A Parameter or buffer put in place of one a fused op holds: ``torch.func.functional_call``, a new Parameter,
``load_state_dict(assign=True)``.

Some fused ops hold their modules' Parameter objects, so a tensor put in their place was never read:
``functional_call(fused, params, x)`` computed with the model's own weights (0.46 apart from the unfused model's
result on the embedded encoder, 0.49 on GPT-2), and a Parameter assigned after fusion (tying, resizing, a reset) was
neither used nor trained. Then each patch ran its chain unfused while a tensor differed; now each op reads what its
modules hold at each call (fusion/owners.py) and stays fused. Only a tensor of another shape than at fusion makes
a chain run unfused, with a warning.
"""

from __future__ import annotations

import copy
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
    own = {k: v for k, v in fused.named_parameters()}
    results = []
    for m in (model, fused):  # the same new tensors for both; buffers too (BatchNorm statistics move in them)
        leaves = {k: (v.detach() * 1.5 + 0.01).requires_grad_(v.requires_grad) for k, v in model.named_parameters()}
        given = {k: v * 1.0 for k, v in leaves.items()} | {k: v.clone() for k, v in model.named_buffers()}
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # nothing runs unfused
            if m is fused:  # the fused ops run: the fused model's bytes, not eager's (on copies of the buffers)
                again = {k: v.clone() if k in dict(model.named_buffers()) else v for k, v in given.items()}
                assert activation_bytes(lambda again=again: functional_call(fused, again, inputs),
                                        tuple(again.values())) == fused_bytes
            out = _output(functional_call(m, given, inputs))
        grads = torch.autograd.grad(out.square().sum(), [v for v in leaves.values() if v.requires_grad])
        results.append((out, grads, [v for v in given.values() if not v.requires_grad]))
    (want, want_grads, want_buffers), (got, got_grads, got_buffers) = results
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    for g, w in zip(got_buffers, want_buffers, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    # no op keeps the caller's tensors (non-leaf ones here, which deepcopy refuses): its own back
    for op in ol.fusion.patch.fused_ops(fused):
        assert all(any(p is q for q in own.values()) for p in op.parameters())
    copy.deepcopy(fused)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert activation_bytes(lambda: fused(*inputs)) == fused_bytes
        torch.testing.assert_close(_output(fused(*inputs)), _output(model(*inputs)), rtol=1e-10, atol=1e-10)


def test_a_parameter_assigned_after_fusion_is_used_and_trained_fused():
    torch.manual_seed(0)
    model, inputs = _settings()
    fused, plan = ol.fusion.fuse(model, inputs)
    assert any(d.modules[0] == "mlp.0" for d in plan.fused), plan.decisions
    fused_bytes = activation_bytes(lambda: fused(*inputs))
    torch.manual_seed(1)
    new = torch.randn_like(model.mlp[0].weight)
    for m in (model, fused):
        m.mlp[0].weight = nn.Parameter(new.clone())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, fused)]
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            got = fused(*inputs)
            assert activation_bytes(lambda: fused(*inputs)) == fused_bytes
        want = model(*inputs)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        for out, opt in ((want, opts[0]), (got, opts[1])):
            opt.zero_grad()
            out.square().sum().backward()
            opt.step()
        torch.testing.assert_close(fused.mlp[0].weight, model.mlp[0].weight, rtol=1e-10, atol=1e-10)


def test_a_state_dict_loaded_with_assign_is_what_the_fused_model_computes_with():
    """``load_state_dict(sd, assign=True)`` (the low-memory load: a model built on the meta device, an mmap'd
    checkpoint) puts the checkpoint's own tensors in every module."""
    torch.manual_seed(0)
    model, inputs = _encoder()
    fused, plan = ol.fusion.fuse(model, inputs)
    fused_bytes = activation_bytes(lambda: fused(*inputs))
    torch.manual_seed(1)
    other, _ = _encoder()
    for m in (model, fused):
        m.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = _output(fused(*inputs))
        assert activation_bytes(lambda: fused(*inputs)) == fused_bytes
    want = _output(model(*inputs))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(want, _output(other(*inputs)) * 0 + want.mean())  # not a constant: a real model
    grads = [torch.autograd.grad(o.square().sum(), list(m.parameters()), allow_unused=True)
             for o, m in ((got, fused), (want, model))]
    for g, w in zip(*grads, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_a_tensor_of_another_shape_runs_the_chain_unfused_and_says_so():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)).double()
    inputs = (seeded(3, 4, dtype=torch.float64),)
    fused, plan = ol.fusion.fuse(model, inputs)
    assert [d.pattern for d in plan.fused] == ["linear_gelu_linear"], plan.decisions
    for m in (model, fused):  # the head resized: 6 outputs
        torch.manual_seed(2)
        m[2].weight, m[2].bias = nn.Parameter(torch.randn(6, 8, dtype=torch.float64)), \
            nn.Parameter(torch.randn(6, dtype=torch.float64))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", RuntimeWarning)
        got = fused(*inputs)
    torch.testing.assert_close(got, model(*inputs), rtol=1e-12, atol=1e-12)
    said = [str(w.message) for w in seen if "changed after" in str(w.message)]
    assert len(said) == 1 and "`weight` is of shape (6, 8), where the fused code was made for shape (4, 8)" in said[0]


class _Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


def test_a_parametrization_registered_after_fusion_runs_the_chain_unfused_with_it():
    """``weight`` leaves the module's Parameters (``parametrize``: computed at each access): no tensor to read."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)).double()
    inputs = (seeded(3, 4, dtype=torch.float64),)
    fused, _ = ol.fusion.fuse(model, inputs)
    for m in (model, fused):
        torch.nn.utils.parametrize.register_parametrization(m[0], "weight", _Doubled())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", RuntimeWarning)
        got = fused(*inputs)
    torch.testing.assert_close(got, model(*inputs), rtol=1e-12, atol=1e-12)
    said = [str(w.message) for w in seen if "changed after" in str(w.message)]
    assert len(said) == 1 and "`weight` is gone, where the fused code was made for shape (8, 4)" in said[0], said


@pytest.mark.parametrize("case", list(MODELS))
def test_torch_func_transforms_over_functional_call_run_the_models_own_code(case):
    """``torch.func.grad`` / ``vmap`` (per-sample gradients, MAML) refuse the fused ops' autograd Functions; the
    fused model runs its modules' own code inside them (``patch.own_code``), fused again outside."""
    torch.manual_seed(0)
    model, inputs = MODELS[case]()
    fused, plan = ol.fusion.fuse(model, inputs)
    fused_bytes = activation_bytes(lambda: fused(*inputs))
    params = {k: v.detach() * 1.5 for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())
    grads = []
    for m in (model, fused):
        def loss(p, m=m):
            given = p | {k: v.clone() for k, v in buffers.items()}
            return _output(functional_call(m, given, inputs)).square().sum()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            grads.append(torch.func.grad(loss)(params))
    for name in params:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-10, atol=1e-10, msg=name)
    if case.startswith("encoder"):  # per-sample gradients (no BatchNorm: its batch statistics mix the samples)
        ids = inputs[0]
        per_sample = [torch.func.vmap(torch.func.grad(lambda p, row, m=m: _output(functional_call(
            m, p, (row[None],))).square().sum()), in_dims=(None, 0))(params, ids) for m in (model, fused)]
        for name in params:
            torch.testing.assert_close(per_sample[1][name], per_sample[0][name], rtol=1e-10, atol=1e-10)
    assert activation_bytes(lambda: fused(*inputs)) == fused_bytes
