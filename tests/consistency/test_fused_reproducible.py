"""``make_reproducible`` and ``ol.fusion`` together, in either order: the fused model draws the masks the
unfused one draws (each fused op's stream is named after the dropout module it absorbed), the dropout a
rewrite turned into a pass-through is not swapped back in (it would drop a second time), analysis advances
no stream, and a deep copy of a prepared model drives its own streams."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab._hooks import passive
from opsnn_lab.consistency import get_step, make_reproducible
from opsnn_lab.consistency.streams import _absorbed_name, counter_streams
from opsnn_lab.models import Encoder, EncoderConfig
from opsnn_lab.testing import AroundRegion


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.5), nn.Linear(16, 8)).train(), torch.randn(32, 8)


def _encoder():
    torch.manual_seed(0)
    cfg = EncoderConfig.tiny()
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    return Encoder(cfg).train(), ids


class TwiceMLP(nn.Module):
    """One dropout module called twice per forward, once inside the fusable chain (Pvt's and many HF MLPs)."""

    def __init__(self, dropout):
        super().__init__()
        self.fc1, self.act, self.dropout, self.fc2 = nn.Linear(8, 16), nn.GELU(), dropout, nn.Linear(16, 8)

    def forward(self, x):
        return self.dropout(self.fc2(self.dropout(self.act(self.fc1(x)))))


def _twice():
    torch.manual_seed(0)
    return TwiceMLP(nn.Dropout(0.5)).train(), torch.randn(32, 8)


def _steps(model, x, n=2):
    outs = []
    for step in range(n):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)  # the global RNG must not matter
        out = model(x)
        out = out if isinstance(out, torch.Tensor) else out[0]
        out.square().sum().backward()
        outs.append((out.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    return outs


@pytest.mark.parametrize("make", [_mlp, _encoder, _twice], ids=["mlp", "encoder", "dropout_called_twice"])
@pytest.mark.parametrize("order", ["fuse_first", "seed_first"])
def test_a_fused_model_draws_the_masks_of_the_unfused_one(make, order):
    model, x = make()
    eager = make_reproducible(copy.deepcopy(model), seed=5)
    if order == "fuse_first":
        fused, plan = ol.fusion.fuse(model, (x,))
        make_reproducible(fused, seed=5)
    else:
        make_reproducible(model, seed=5)
        fused, plan = ol.fusion.fuse(model, (x,))
    assert any("dropout" in d.pattern for d in plan.fused)
    for (out, grads), (want, want_grads) in zip(_steps(fused, x), _steps(eager, x)):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        for k, g in want_grads.items():
            torch.testing.assert_close(grads[k], g, atol=1e-4 * g.abs().max().item() + 1e-6, rtol=1e-4, msg=k)
    assert get_step(fused) == get_step(eager) == 2


def test_the_pass_through_dropout_of_a_fused_chain_is_not_swapped_back_in():
    model, x = _mlp()
    fused, _ = ol.fusion.fuse(model, (x,))
    make_reproducible(fused, seed=1)
    assert type(fused[2]) is nn.Dropout and "forward" in fused[2].__dict__  # still the rewrite's pass-through
    seen = {}
    # passive: a hook of the user's would run the chain unfused (fusion.staleness.hooked); this one only looks
    fused[3].register_forward_pre_hook(passive(lambda m, a: seen.setdefault("x", a[0])))
    out = fused(x)
    assert torch.equal(seen["x"], out)  # fc2 passes the fused op's output through: no second dropout
    assert (out == 0).float().mean() < 0.05
    names = [n for n, _ in counter_streams(fused)]
    assert names == ["2"]  # the fused op, under the name of the dropout it absorbed


def test_analysis_advances_no_dropout_stream():
    model, x = _encoder()
    make_reproducible(model, seed=3)
    before = [(n, m.rng_seed, m.rng_step) for n, m in counter_streams(model)]
    ol.fusion.analyze(model, (x,))
    assert get_step(model) == 0
    assert [(n, m.rng_seed, m.rng_step) for n, m in counter_streams(model)] == before


def test_a_deep_copy_of_a_prepared_model_drives_its_own_streams():
    model, x = _mlp()
    make_reproducible(model, seed=2)
    first = model(x)  # step 0
    make_reproducible(model, seed=2)  # back to step 0
    twin = copy.deepcopy(model)
    twin(x)
    twin(x)
    assert get_step(twin) == 2 and get_step(model) == 0  # the copy's hooks advanced the copy only
    assert torch.equal(model(x), first)
    assert not torch.equal(twin(x), first)  # step 2 of the same streams


def test_a_counter_dropout_called_twice_keeps_its_masks_when_one_call_is_fused():
    # no make_reproducible: the model's own counter-based Dropout, whose stream the fused op takes turns on
    torch.manual_seed(0)
    model, x = TwiceMLP(ol.ops.Dropout(0.5, seed=11)).train(), torch.randn(32, 8)
    eager = copy.deepcopy(model)
    fused, plan = ol.fusion.fuse(model, (x,))
    assert [d.pattern for d in plan.fused] == ["linear_gelu_dropout_linear"]
    for (out, grads), (want, want_grads) in zip(_steps(fused, x), _steps(eager, x)):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        for k, g in want_grads.items():
            torch.testing.assert_close(grads[k], g, atol=1e-4 * g.abs().max().item() + 1e-6, rtol=1e-4, msg=k)
    assert fused.dropout.rng_step == eager.dropout.rng_step == 4  # two calls a step, on one counter


def test_share_rng_rejects_a_module_without_a_stream():
    with pytest.raises(TypeError, match="leader"):
        ol.ops.Dropout(0.1).share_rng(nn.Dropout(0.1))


class Draws(nn.Module):
    """SDPA with dropout (the fused core absorbs it) and then an inline F.dropout in the same module: the
    module's functional calls are "dropout.0" and "dropout.1", fused or not."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, 4, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        a = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.2 if self.training else 0.0)
        return nn.functional.dropout(self.out(a.transpose(1, 2).reshape(b, t, d)), 0.1, self.training)


def test_a_functional_call_after_an_absorbed_one_keeps_its_index_and_its_mask():
    torch.manual_seed(0)
    plain, x = AroundRegion(Draws()).train(), torch.randn(2, 6, 16)
    fused, plan = ol.fusion.fuse(copy.deepcopy(plain), (x,))
    (att,) = [d for d in plan.fused if d.pattern == "attention"]
    assert att.params["rng_name"] == "block:dropout.0"
    for m in (plain, fused):
        make_reproducible(m, 9)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-6)  # F.dropout: "block:dropout.1" in both


class Shared(AroundRegion):
    """``Draws`` called twice a forward (ALBERT's shared layer), a region of its own: its second call's functional
    draws are the module's "dropout.2" and "dropout.3", fused or not."""

    def forward(self, x):
        return super().forward(self.block(x))


def test_a_module_called_twice_draws_each_calls_masks_where_a_fused_op_absorbed_one_of_its_calls():
    torch.manual_seed(0)
    plain, x = Shared(Draws()).train(), torch.randn(2, 6, 16)
    fused, plan = ol.fusion.fuse(copy.deepcopy(plain), (x,))
    # one decision per call; the op both run draws under make_reproducible at the module's next call index
    assert [d.params["rng_name"] for d in plan.fused if d.pattern == "attention"] == ["block:dropout.0",
                                                                                      "block:dropout.2"]
    for m in (plain, fused):
        make_reproducible(m, 9)
    for (out, grads), (want, want_grads) in zip(_steps(fused, x), _steps(plain, x)):
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)  # 3e-2 apart when the op kept its own counter
        for k, g in want_grads.items():
            torch.testing.assert_close(grads[k], g, atol=1e-5 * g.abs().max().item() + 1e-7, rtol=1e-4, msg=k)


def stochastic_depth(x, p, training):
    """Per-sample drop path written as a helper fx cannot trace (its argument check), as torchvision's is."""
    if not torch.is_tensor(x):
        raise TypeError("x must be a tensor")
    if not training:
        return x
    return x * torch.empty(x.shape[0], 1, 1, 1, dtype=x.dtype).bernoulli_(1 - p) / (1 - p)


class DropPath(nn.Module):
    def __init__(self, p, helper: bool):
        super().__init__()
        self.p, self.helper = p, helper

    def forward(self, x):
        if self.helper:
            return stochastic_depth(x, self.p, self.training)
        return x * x.new_empty(x.shape[0], 1, 1, 1).bernoulli_(1 - self.p) / (1 - self.p) if self.training else x


class Residual(nn.Module):
    """Conv -> BN -> inline F.relu (fused through the region's fx code, which runs ``drop_path``'s forward inline),
    the drop path called twice a forward."""

    def __init__(self, helper: bool):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.drop_path = DropPath(0.5, helper)

    def forward(self, x):
        x = x + self.drop_path(self.conv2(nn.functional.relu(self.bn(self.conv(x)))))
        return x + self.drop_path(x.tanh())


@pytest.mark.parametrize("helper", [False, True], ids=["inline", "opaque_helper"])
@pytest.mark.parametrize("order", ["fuse_first", "seed_first"])
def test_a_random_call_a_region_runs_inline_is_keyed_by_its_submodule(helper, order):
    torch.manual_seed(0)
    model, x = nn.Sequential(Residual(helper), Residual(helper)).double().train(), torch.randn(8, 4, 6, 6).double()
    eager = make_reproducible(copy.deepcopy(model), seed=5)
    if order == "seed_first":
        make_reproducible(model, seed=5)
    fused, plan = ol.fusion.fuse(model, (x,))
    if order == "fuse_first":  # the code's keying calls are importable functions: a pickled model keeps them
        fused = pickle.loads(pickle.dumps(fused))
    make_reproducible(fused, seed=5)
    inlined = fused[0].__dict__["forward"].inlined[True]  # each block is a region; its drop path runs inline
    assert plan.summary()["conv_bn_relu"]["fused"] == 2 and "drop_path" in inlined
    for (out, grads), (want, want_grads) in zip(_steps(fused, x), _steps(eager, x)):  # 5.8 apart unkeyed
        torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
        for k, g in want_grads.items():
            torch.testing.assert_close(grads[k], g, atol=1e-12, rtol=1e-10, msg=k)


class InlineMLP(nn.Module):
    """Bart's feed-forward: fc1 -> act -> inline F.dropout -> fc2, then another inline F.dropout of the same module
    (the residual's); a 1x1-conv twin for channels-first blocks."""

    def __init__(self, conv: bool):
        super().__init__()
        make = (lambda i, o: nn.Conv2d(i, o, 1)) if conv else nn.Linear
        self.fc1, self.act, self.fc2 = make(8, 16), nn.GELU(), make(16, 8)

    def forward(self, x):
        h = nn.functional.dropout(self.act(self.fc1(x)), 0.3, self.training)
        return x + nn.functional.dropout(self.fc2(h), 0.2, self.training)


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv"])
def test_an_absorbed_inline_dropout_between_two_layers_draws_its_calls_mask(conv):
    torch.manual_seed(0)
    plain = AroundRegion(InlineMLP(conv)).train()
    x = torch.randn(4, 8, 3, 3) if conv else torch.randn(4, 6, 8)
    fused, plan = ol.fusion.fuse(copy.deepcopy(plain), (x,))
    (mlp,) = [d for d in plan.fused if d.pattern.endswith(("dropout_linear", "dropout_conv"))]
    assert mlp.params["rng_name"] == "block:dropout.0"
    for m in (plain, fused):
        make_reproducible(m, 2)
    for (out, grads), (want, want_grads) in zip(_steps(fused, x), _steps(plain, x)):  # 1.1 apart unnamed
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        for k, g in want_grads.items():
            torch.testing.assert_close(grads[k], g, atol=1e-5 * g.abs().max().item() + 1e-7, rtol=1e-4, msg=k)


class Wrapper(nn.Module):
    """What DDP, a Lightning module or a user's training wrapper does: the model under ``module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def _inline():
    torch.manual_seed(0)
    return AroundRegion(InlineMLP(False)).train(), torch.randn(4, 6, 8)


def _draws():
    torch.manual_seed(0)
    return AroundRegion(Draws()).train(), torch.randn(2, 6, 16)


@pytest.mark.parametrize("make", [_mlp, _encoder, _twice, _inline, _draws],
                         ids=["mlp", "encoder", "dropout_called_twice", "inline_dropout", "sdpa_dropout"])
@pytest.mark.parametrize("seeded", ["wrapper", "part"])
def test_a_fused_model_draws_the_unfused_masks_when_made_reproducible_from_another_root(make, seeded):
    """Fuse a model, then make a model that holds it reproducible (``seeded="wrapper"``); or fuse a wrapper and
    make the model inside it reproducible (``"part"``): the absorbed streams are named from there, as the
    unfused model's modules are (0.01-3.0 apart when they kept the fused model's paths)."""
    model, x = make()
    if seeded == "wrapper":
        eager = make_reproducible(Wrapper(copy.deepcopy(model)), seed=5)
        fused, plan = ol.fusion.fuse(model, (x,))
        fused = make_reproducible(Wrapper(pickle.loads(pickle.dumps(fused))), seed=5)
    else:
        eager = make_reproducible(copy.deepcopy(model), seed=5)
        fused_wrapper, plan = ol.fusion.fuse(Wrapper(model), (x,))
        fused = make_reproducible(fused_wrapper.module, seed=5)
    assert any(d.params.get("rng_name") or "dropout" in d.pattern for d in plan.fused)
    for (out, grads), (want, want_grads) in zip(_steps(fused, x), _steps(eager, x)):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        for k, g in want_grads.items():
            torch.testing.assert_close(grads[k], g, atol=1e-4 * g.abs().max().item() + 1e-6, rtol=1e-4, msg=k)


class _Op(nn.Module):
    def __init__(self, rng_name, rng_host):
        super().__init__()
        self.rng_name, self.rng_host = rng_name, rng_host


@pytest.mark.parametrize(("name", "at", "host", "want"), [
    ("mlp.drop", "mlp.fc1", "mlp.fc1", "mlp.drop"),  # walked from the fused model itself
    ("mlp.drop", "mlp.fc1", "module.mlp.fc1", "module.mlp.drop"),  # from a wrapper
    ("mlp.drop", "mlp.fc1", "fc1", "drop"),  # from the part `mlp`
    ("mlp.drop", "mlp.fc1", "", None),  # from the host itself: the absorbed module is outside it
    ("mlp.drop", "mlp.fc1", "other.fc1", None),  # a host seen elsewhere: not this model's path
    ("mlp.drop", "mlp", "", "drop"),  # from the host `mlp`: its `drop` is below it
    ("<root>:dropout.1", "", "module", "module:dropout.1"),  # an inline call of the fused model's own forward
    ("block:dropout.0", "block.fused_attention_0", "net.block.fused_attention_0", "net.block:dropout.0"),
    ("block:dropout.0", "block.fused_attention_0", "fused_attention_0", "<root>:dropout.0"),
    ("head.drop", "block.fc", "fc", None),  # from the part `block`: `head` is not in it
])
def test_an_absorbed_stream_is_named_from_the_model_walked(name, at, host, want):
    assert _absorbed_name(_Op(name, at), host) == want
