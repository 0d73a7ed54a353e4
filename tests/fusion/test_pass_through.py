"""patch.py's pass-throughs: a chain with an inline identity step (BART's and Whisper's p=0 ``F.dropout`` between
``activation_fn`` and ``fc2``), and the check each pass-through makes that it receives the fused op's output."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.fusion.patch import PassThrough, fused_ops
from opsnn_lab.testing import seeded


class BartLayer(nn.Module):
    """BART's MLP: ``fc2(F.dropout(activation_fn(fc1(x)), p=activation_dropout))``, the dropout inline; the branch on
    the data keeps torch.fx out, so the module-level route is the only one."""

    def __init__(self, d=16, p=0.0):
        super().__init__()
        self.fc1, self.activation_fn, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)
        self.norm, self.activation_dropout = nn.LayerNorm(d), p

    def forward(self, x):
        if x.isnan().any():
            raise ValueError("nan input")
        h = self.activation_fn(self.fc1(x))
        h = F.dropout(h, p=self.activation_dropout, training=self.training)
        return self.norm(x + self.fc2(h))


class Bart(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.layers = nn.ModuleList(BartLayer(p=p) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


X = seeded(2, 5, 16)


def _step(model, x=X):
    x = x.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    y = model(x)
    (y * seeded(*y.shape, seed=3)).sum().backward()
    return [y.detach(), x.grad] + [p.grad for _, p in sorted(model.named_parameters())]


def _same(a, b, x=X):
    for u, v in zip(_step(a, x), _step(b, x)):
        torch.testing.assert_close(v, u, atol=1e-5, rtol=1e-5)


def _set_p(model, p):
    for layer in model.layers:
        layer.activation_dropout = p


def _fused(p=0.0):
    torch.manual_seed(0)
    model = Bart(p).train()
    return model, *ol.fusion.fuse(model, X)


def test_a_p0_inline_dropout_between_two_steps_is_fused_and_checked():
    """Rejected before: "`dropout` runs inline in `layers.0`.forward, not in a module call of its own"."""
    model, fused, plan = _fused()
    mlps = [d for d in plan.decisions if d.pattern == "linear_gelu_dropout_linear"]
    assert [d.fused for d in mlps] == [True, True] and all(d.route == "module:chain" for d in mlps)
    assert mlps[0].carriers == ["layers.0.fc1", "layers.0.activation_fn", "layers.0.fc2"]
    assert mlps[0].reason.endswith(
        "; the `dropout` run inline in `layers.0`.forward before `layers.0.fc2` has p=0 here and runs as it is on the "
        "fused output: a setting of `layers.0` changed later (that p) runs the chain unfused, and `layers.0.fc2` "
        "checks at each call that it receives the fused op's output"), mlps[0].reason
    patches = ol.fusion.patches(fused)
    assert patches["layers.0.fc2"].after == "layers.0.dropout" and patches["layers.0.activation_fn"].after == ""
    _same(model, fused)
    _same(model.eval(), fused.eval())


def test_p_set_above_0_after_fusing_runs_the_chain_unfused_until_it_is_0_again():
    """The layer's ``activation_dropout`` is a setting of the module whose forward runs that dropout inline: changed,
    the chain runs its modules' own forwards, the dropout between them (it raised before: the pass-through got the
    dropped tensor instead of the fused op's output)."""
    model, fused, _ = _fused()
    _set_p(model, 0.1)
    _set_p(fused, 0.1)
    with pytest.warns(RuntimeWarning, match=r"`layers.0` changed after the linear_gelu_dropout_linear chain at "
                                            r"`layers.0.fc1` was fused \(a setting changed: activation_dropout 0.0 -> "
                                            r"0.1\)"):
        torch.manual_seed(3)
        got = _step(fused, X)
    torch.manual_seed(3)
    for u, v in zip(got, _step(model, X)):  # the same draws: every module's own forward, in eager's order
        torch.testing.assert_close(u, v, atol=1e-5, rtol=1e-5)
    _same(model.eval(), fused.eval())
    _set_p(model, 0.0)
    _set_p(fused, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _same(model.train(), fused.train())


def test_a_pass_through_given_another_tensor_than_the_fused_output_raises():
    model, fused, _ = _fused()
    with pytest.raises(RuntimeError, match=r"`layers.0.fc2` passes on the output of the fused "
                                           r"linear_gelu_dropout_linear chain \(`layers.0.fc1` computes it whole\), "
                                           r"but received another tensor"):
        fused.layers[0].fc2(torch.randn(2, 3, fused.layers[0].fc2.in_features))


def test_a_p_above_0_at_analysis_keeps_the_chain_unfused():
    model, fused, plan = _fused(p=0.1)
    mlps = [d for d in plan.decisions if d.pattern == "linear_gelu_dropout_linear"]
    assert not any(d.fused for d in mlps)
    assert "`dropout` runs inline in `layers.0`.forward, not in a module call of its own" in mlps[0].reason
    _same(model.eval(), fused.eval())


def test_json_plan_deepcopy_and_save_keep_the_check():
    model, fused, plan = _fused()
    again = ol.fusion.apply(model, ol.fusion.FusionPlan.from_json(plan.to_json()))
    twin = copy.deepcopy(fused)
    buf = io.BytesIO()
    torch.save(fused, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    for other in (again, twin, loaded):
        assert ol.fusion.patches(other)["layers.1.fc2"].after == "layers.1.dropout"
        _same(model, other)
        _set_p(other, 0.5)
        _set_p(model, 0.5)
        with pytest.warns(RuntimeWarning, match=r"activation_dropout 0.0 -> 0.5\)"):
            _same(model, other)  # the layer's setting is watched in each: unfused, the dropout as in eager
        _set_p(model, 0.0)


def test_a_pass_through_called_on_its_own_raises_instead_of_returning_its_input():
    """It returned its input unchanged: ``fc2(h)`` gave ``h``. Every pass-through now checks."""
    model, fused, _ = _fused()
    fc2 = fused.layers[0].fc2
    assert isinstance(fc2.__dict__["forward"], PassThrough)
    with pytest.raises(RuntimeError, match="a call the analysis did not see"):
        fused.layers[0].activation_fn(seeded(2, 64))
    fused(X)  # the chain itself still runs
    # a hook replacing fc1's output: the chain runs unfused while it is there, so the new output goes on as in eager
    hooks = [m.layers[0].fc1.register_forward_hook(lambda m, a, out: out * 2) for m in (model, fused)]
    with pytest.warns(RuntimeWarning, match="`layers.0.fc1` has a hook added after the .* chain at `layers.0.fc1`"):
        _same(model, fused)
    for hook in hooks:
        hook.remove()
    _same(model, fused)
    assert not ol.fusion.patches(fused)["layers.0.fc1"].unfused


class CastBeforeDown(nn.Module):
    """T5's ``DenseReluDense``: the activation is cast to ``wo``'s weight dtype before ``wo`` (a no-op outside
    autocast; under it, a new fp32 tensor that nothing else holds)."""

    def __init__(self, d=16):
        super().__init__()
        self.wi, self.act, self.dropout, self.wo = nn.Linear(d, 4 * d, bias=False), nn.ReLU(), nn.Dropout(0.0), \
            nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        if x.isnan().any():  # keeps fx out: the module-level route (wi computes the chain, wo passes it on)
            raise ValueError("nan input")
        h = self.dropout(self.act(self.wi(x)))
        if h.dtype != self.wo.weight.dtype:
            h = h.to(self.wo.weight.dtype)
        return self.wo(h)


@pytest.mark.parametrize("grad", [True, False])
def test_a_cast_to_the_last_linear_dtype_under_autocast_passes_on_the_fused_output(grad):
    torch.manual_seed(0)
    model = CastBeforeDown().train()
    fused, plan = ol.fusion.fuse(model, X)
    assert [d.pattern for d in plan.decisions if d.fused] == ["linear_relu_dropout_linear"]
    x = X.detach().clone().requires_grad_(grad)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
        want, got = model(x), fused(x)  # raised "received another tensor" at `wo` before
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    if grad:
        (g_want,) = torch.autograd.grad(want.float().square().sum(), x)
        (g_got,) = torch.autograd.grad(got.float().square().sum(), x)
        torch.testing.assert_close(g_got, g_want, rtol=3e-2, atol=3e-2)
    head = fused.wi.__dict__["forward"]
    assert head.held is None  # the chain's last step released the output it held for the cast


def test_a_call_on_another_tensor_of_the_same_shape_still_raises_under_autocast():
    torch.manual_seed(0)
    model = CastBeforeDown().train()
    fused, _ = ol.fusion.fuse(model, X)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused.wi(X)
        with pytest.raises(RuntimeError, match="received another tensor"):
            fused.wo(torch.randn(2, 5, 16))  # the shape and dtype a cast of its output would have


class SquareLayer(nn.Module):
    """``fc2(gelu(fc1(x)))`` with ``fc1`` and ``fc2`` both d -> d: a step's input and the chain's output have one
    shape, so an adapter computed on the wrong one would not fail on a shape."""

    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, d), nn.GELU(), nn.Linear(d, d)

    def forward(self, x):
        if x.isnan().any():  # a branch on the data: the module-level route
            raise ValueError("nan input")
        return x + self.fc2(self.act(self.fc1(x)))


class Adapter(nn.Module):
    """A LoRA-style wrapper put in a Linear's place after fusion: the Linear's own output plus a low-rank update of
    its input (what PEFT's ``get_peft_model`` does to the modules it targets)."""

    def __init__(self, base: nn.Linear, r: int = 2):
        super().__init__()
        self.base = base
        self.down, self.up = nn.Linear(base.in_features, r, bias=False), nn.Linear(r, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


@pytest.mark.parametrize("change", ["wrap_fc1", "wrap_fc2", "replace_fc2"])
def test_a_step_wrapped_or_replaced_after_fusing_runs_the_chain_unfused(change):
    """The head checks each step is still where the model held it: a wrapper around ``fc1`` expects ``fc1``'s own
    output (the chain's is another tensor), one around ``fc2`` gets the chain's output as its input (the same shape
    here, so its update would have been computed on the wrong tensor without a word)."""
    torch.manual_seed(0)
    model = SquareLayer().train()
    fused, plan = ol.fusion.fuse(model, X)
    assert [d.pattern for d in plan.fused] == ["linear_gelu_linear"]
    op = fused_ops(fused)[0]
    for m in (model, fused):
        torch.manual_seed(1)
        name = change.rpartition("_")[2]
        setattr(m, name, Adapter(getattr(m, name)) if change.startswith("wrap") else nn.Linear(16, 16))
    calls = []
    op.register_forward_hook(lambda *a: calls.append(1))
    with pytest.warns(RuntimeWarning, match=rf"`{name}` changed after the linear_gelu_linear chain .* \(replaced by "
                      rf"a `{'Adapter' if change.startswith('wrap') else 'Linear'}` in its parent\)"):
        _same(model, fused)
    assert not calls
    if change.startswith("wrap"):  # the original back in its place: fused again
        for m in (model, fused):
            setattr(m, name, getattr(m, name).base)
        _same(model, fused)
        assert calls
