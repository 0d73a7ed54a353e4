"""analyze() on the embedded models and on functional / odd forms: candidates, reasons, routes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.models import Encoder, EncoderConfig, ResNet
from opsnn_lab.testing import assert_within_eager_error, seeded


def _tiny_encoder(**kw):
    torch.manual_seed(0)
    return Encoder(EncoderConfig.tiny(**kw))


def _ids(b=2, t=16):
    return torch.randint(0, 100, (b, t), generator=torch.Generator().manual_seed(0))


def test_encoder_finds_every_pattern_in_every_layer():
    plan = ol.fusion.analyze(_tiny_encoder(layers=3), _ids())
    assert plan.summary() == {"linear_gelu_dropout_linear": {"fused": 3, "rejected": 0},
                              "attention": {"fused": 3, "rejected": 0}, "qkv": {"fused": 3, "rejected": 0},
                              # residual add + LayerNorm after attention and after the MLP; the embedding's
                              # add broadcasts (positions), and its LayerNorm alone feeds a Dropout, which
                              # does not keep the norm's output: fusing it would save one statistic per row
                              "add_layer_norm": {"fused": 6, "rejected": 1}, "layer_norm": {"fused": 0, "rejected": 7},
                              # the MLP's Dropout -> Linear, which the MLP row takes whole
                              "dropout_linear": {"fused": 0, "rejected": 3}}
    emb = next(d for d in plan.decisions if d.pattern == "layer_norm" and d.modules == ["embedding_norm"])
    assert emb.reason.startswith("not fused: saves ") and "under 10%" in emb.reason, emb.reason
    assert 0 < emb.saved_bytes < 0.1 * 2 * 16 * 32 * 4
    qkv = [d for d in plan.decisions if d.pattern == "qkv"]
    assert qkv[1].modules == ["layers.1.attention.query", "layers.1.attention.key", "layers.1.attention.value"]
    att = next(d for d in plan.decisions if d.pattern == "attention")
    assert att.modules == ["layers.0.attention", "layers.0.attention.attn_dropout"]
    assert att.params == {"scale": pytest.approx(0.25), "dropout_p": 0.1, "mask_added": True}  # scores + mask
    # module calls carry the MLP and QKV chains; the attention is functional code inside one forward (fx)
    assert all(d.route.startswith("fx:layers.") if d.pattern in ("attention", "add_layer_norm")
               else d.route.startswith("module:") for d in plan.decisions if d.fused)
    root = plan.routes[0]
    assert root["path"] == "" and root["route"] == "untraceable" and "control flow" in root["reason"]
    assert all(d.reason for d in plan.decisions)


class _NormThen(nn.Module):
    """``then(norm(x [+ r]))``: a LayerNorm (after a residual add) and the op that reads its output."""

    def __init__(self, then: nn.Module, add: bool):
        super().__init__()
        self.norm, self.then, self.add = nn.LayerNorm(32), then, add

    def forward(self, x, r):
        return self.then(self.norm(x + r if self.add else x))


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("then, fused", [(nn.Linear(32, 32), True), (nn.GELU(), True),  # both save their input
                                         (nn.Dropout(0.1), False), (nn.Identity(), False)])  # keeps a mask / nothing
def test_a_layer_norm_fuses_where_its_output_is_kept_anyway(then, fused, add):
    # FusedLayerNorm saves its output instead of its input: half the bytes where the next op (a Linear, a
    # GELU) saves that output too, and nothing saved (one statistic per row) where the next op keeps its
    # own tensor or none, while the fused backward costs more time: there the plan says why it declines
    x, r = seeded(4, 8, 32, seed=1).requires_grad_(), seeded(4, 8, 32, seed=2)
    plan = ol.fusion.analyze(_NormThen(then, add), (x, r))
    name = "add_layer_norm" if add else "layer_norm"
    d = next(d for d in plan.decisions if d.pattern == name)
    assert d.fused == fused, d.reason
    if fused:
        assert d.saved_bytes >= 4 * 8 * 32 * 4  # the norm's input (or the sum) is no longer kept
    else:
        assert d.reason.startswith("not fused: saves ") and "pays only where" in d.reason, d.reason
        assert d.saved_bytes < 0.1 * 4 * 8 * 32 * 4
        assert not any(d2.fused for d2 in plan.decisions if "layer_norm" in d2.pattern)


def test_resnet_decisions_and_reasons():
    torch.manual_seed(0)
    plan = ol.fusion.analyze(ResNet(), seeded(2, 3, 32, 32))
    by = {d.modules[0]: d for d in plan.decisions}
    assert by["conv1"].pattern == "conv_bn_relu_maxpool" and by["conv1"].fused
    assert by["conv1"].modules == ["conv1", "bn1", "relu", "maxpool"]
    assert by["stages.0.0.conv1"].fused and by["stages.1.0.conv1"].fused
    assert "feeds `stages.0.0.add`" in by["stages.0.0.conv2"].reason  # the residual sum comes before relu2
    assert not by["stages.1.0.downsample.0"].fused
    assert all(d.route == "module:chain" for d in plan.decisions if d.fused)
    assert plan.routes == []  # every chain is carried by module calls: no tracer ran


def test_model_rng_and_buffers_untouched():
    model = _tiny_encoder()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    storages = {n: p.data_ptr() for n, p in model.named_parameters()}
    model.eval()
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    ol.fusion.analyze(model, _ids())
    torch.testing.assert_close(torch.rand(3), expected)
    assert not model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])
    assert not any(type(m).__name__ == "FusedSlot" for m in model.modules())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == storages  # no weight was repacked


class Functional(nn.Module):
    """Every activation written a different way."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1, groups=2, dilation=1), nn.BatchNorm2d(4)
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)
        self.relu6_conv, self.relu6_bn = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        x = self.bn2(self.conv2(x)).relu()
        x = F.relu6(self.relu6_bn(self.relu6_conv(x)))
        h = x.mean((2, 3))
        return self.fc2(F.dropout(F.gelu(self.fc1(h)), 0.0, self.training))


def test_functional_forms_match():
    plan = ol.fusion.analyze(Functional(), seeded(2, 3, 6, 6))
    by = {d.modules[0]: d for d in plan.decisions}
    assert by["conv"].fused and by["conv"].chain == ["conv", "bn", "relu"]
    assert by["conv2"].fused  # method call .relu(); grouped conv is supported by the op
    assert "ReLU6" in by["relu6_conv"].reason or "relu6" in by["relu6_conv"].reason
    assert by["fc1"].pattern == "linear_gelu_dropout_linear" and by["fc1"].fused


def test_mixed_dtypes_rejected():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU())
    model[0].to(torch.bfloat16)
    plan = ol.fusion.analyze(model, seeded(2, 3, 4, 4, dtype=torch.bfloat16))
    (d,) = plan.decisions
    assert not d.fused and d.reason == "mixed dtypes: `0` returns bfloat16, `1` has parameters in float32"


class _Block(nn.Module):
    """Norm -> q/k/v -> attention, norm -> Linear -> GELU -> Linear, each residual: every Linear row and a norm."""

    def __init__(self, d=32):
        super().__init__()
        self.ln1, self.q, self.k, self.v = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.ln2, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.ln1(x)
        x = x + F.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class _TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Block(), _Block()

    def forward(self, x):
        return self.b(self.a(x))


def _fwd_bwd(model, x):
    x = x.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    y = model(x)
    (y.double() * 1.3).sin().sum().backward()
    return [y.detach(), x.grad] + [p.grad for _, p in model.named_parameters()]


def _autocast_step(model, x):
    x = x.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    (y.double() * 1.3).sin().sum().backward()
    return {"output": y.detach(), "x": x.grad, **{k: p.grad for k, p in model.named_parameters()}}


def test_a_plan_made_under_autocast_is_the_plan_made_outside():
    """The analysis records the model's own dtypes (autocast off while it runs): under autocast it once saw bf16
    Linear outputs of fp32 weights and refused every Linear chain as 'mixed dtypes'."""
    torch.manual_seed(0)
    model, x = _TwoBlocks(), seeded(2, 8, 32)
    outside = ol.fusion.analyze(model, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, inside = ol.fusion.fuse(model, x)
        assert torch.is_autocast_enabled("cpu")  # the caller's region is left as it was
    assert [d.__dict__ for d in inside.decisions] == [d.__dict__ for d in outside.decisions]
    assert inside.routes == outside.routes and inside.activation_bytes == outside.activation_bytes
    assert {d.pattern for d in inside.fused} >= {"qkv", "linear_gelu_linear", "layer_norm"}, inside
    for a, b in zip(_fwd_bwd(model, x), _fwd_bwd(fused, x)):  # outside autocast: eager's fp32 numbers
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    # the fused model under autocast: every output and gradient within 2x eager-autocast's error against fp64
    eager, got = _autocast_step(model, x), _autocast_step(fused, x)
    double = copy.deepcopy(model).double()
    xd = x.double().requires_grad_()
    yd = double(xd)
    (yd * 1.3).sin().sum().backward()
    truth = {"output": yd.detach(), "x": xd.grad, **{k: p.grad for k, p in double.named_parameters()}}
    for k, ref in truth.items():
        assert_within_eager_error(got[k], eager[k], ref, name=k)


def test_patterns_switched_off_are_explained():
    plan = ol.fusion.analyze(_tiny_encoder(), _ids(), patterns=["qkv"])
    off = [d for d in plan.decisions if d.pattern != "qkv" and "broadcasts" not in d.reason]
    assert off and all(not d.fused and "switched off" in d.reason and d.saved_bytes == 0 for d in off)
    assert all(d.fused for d in plan.decisions if d.pattern == "qkv")
    again = plan.replan(None)
    assert again.summary()["attention"] == {"fused": 2, "rejected": 0}


def test_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        ol.fusion.analyze("not a model", _ids())
    with pytest.raises(TypeError, match="example_inputs"):
        ol.fusion.analyze(_tiny_encoder(), 3)
    with pytest.raises(ValueError, match="patterns"):
        ol.fusion.analyze(_tiny_encoder(), _ids(), patterns=["conv_bn_tanh"])
    with pytest.raises(ValueError, match="patterns"):
        ol.fusion.analyze(_tiny_encoder(), _ids(), patterns=["group_norm_tanh"])
    for name in ("group_norm_silu", "conv_gelu_conv", "conv_silu_dropout_conv"):  # variants of the newer rows
        ol.fusion.analyze(_tiny_encoder(), _ids(), patterns=[name])
    with pytest.raises(TypeError, match="patterns"):
        ol.fusion.analyze(_tiny_encoder(), _ids(), patterns="qkv")


def test_no_candidates_and_empty_batch():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    plan = ol.fusion.analyze(model, seeded(3, 4))
    assert plan.decisions == [] and plan.summary() == {} and plan.saved_bytes == 0
    fused = ol.fusion.apply(model, plan)
    torch.testing.assert_close(fused(seeded(3, 4)), model(seeded(3, 4)))
    empty = ol.fusion.analyze(_tiny_encoder(), torch.zeros(0, 8, dtype=torch.long))
    assert empty.summary()["qkv"] == {"fused": 1 + 1, "rejected": 0}
    assert all(d.saved_bytes == 0 for d in empty.decisions)  # nothing to save for nothing
    fused_empty = ol.fusion.apply(_tiny_encoder(), empty)
    assert fused_empty(torch.zeros(0, 8, dtype=torch.long)).shape == (0, 8, 128)


def test_reproducible_models_keep_their_patterns():
    model = ol.consistency.make_reproducible(_tiny_encoder(), seed=0)
    assert any(type(m).__module__.startswith("opsnn_lab.ops") for m in model.modules())
    fused, plan = ol.fusion.fuse(model, _ids())
    assert plan.summary()["linear_gelu_dropout_linear"] == {"fused": 2, "rejected": 0}
    assert plan.summary()["attention"] == {"fused": 2, "rejected": 0}
    model.eval()
    fused.eval()
    torch.testing.assert_close(fused(_ids()), model(_ids()), atol=1e-5, rtol=1e-5)


class _Mlp(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _LayerDrop(nn.Module):
    """BART's layerdrop: in training, layer ``i`` is skipped when a uniform draw falls under ``p[i]``."""

    def __init__(self, p=(0.3, 0.3, 0.3)):
        super().__init__()
        self.p, self.layers, self.head = p, nn.ModuleList(_Mlp() for _ in p), nn.Linear(16, 4)

    def forward(self, x):
        for p, layer in zip(self.p, self.layers):
            if self.training and torch.rand([]) < p:
                continue
            x = x + layer(x)
        return self.head(x)


class _Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos, self.neg = _Mlp(), _Mlp()

    def forward(self, x):
        return self.pos(x) if x.mean() > 0 else self.neg(x)


def _forwards(model, x, **kw):
    """The plan, and how many forwards of ``model`` ``analyze`` ran."""
    calls = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        return ol.fusion.analyze(model, x, **kw), len(calls)
    finally:
        hook.remove()


def _assert_same_step(model, fused, x, seed=1):
    """Outputs and every gradient (the input's too), from the same layerdrop draws."""
    results = []
    for m in (model, fused):
        xi = x.detach().clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        y = m(xi)
        (y * seeded(*y.shape, seed=3)).sum().backward()
        results.append([y.detach(), xi.grad] + [p.grad for _, p in sorted(m.named_parameters())])
    for a, b in zip(*results):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_a_layer_a_layerdrop_skipped_is_recorded_in_another_forward():
    """One recorded forward left the layers layerdrop skipped in it unfused, silently, and the plan depended on
    the RNG (BART with layerdrop 0.5 fused 1, 2 or 0 of its 4 qkv at seeds 0, 1, 2). Forwards are recorded until
    every layer ran in one of them; the caller's RNGs do not move."""
    import random

    import numpy as np

    torch.manual_seed(0)
    model, x = _LayerDrop(), seeded(2, 5, 16)
    torch.manual_seed(0)
    assert bool((torch.rand(3) < 0.3).any())  # the first recorded forward skips a layer
    torch.manual_seed(0)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    plan, forwards = _forwards(model, x)
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert (np.random.get_state()[1] == states[2]).all()
    assert 1 < forwards <= 8 and plan.not_analysed == {}
    assert [d.modules[0] for d in plan.fused] == [f"layers.{i}.fc1" for i in range(3)]
    assert "not analysed" not in repr(plan)
    fused = ol.fusion.apply(model, plan)
    _assert_same_step(model, fused, x)
    _assert_same_step(model.eval(), fused.eval(), x)


def test_a_layerdrop_drawn_from_numpy_is_recorded_again_and_numpy_left_where_it_was():
    """numpy's Mersenne Twister regenerates its key only every 624 draws: a draw moves its position alone, which
    the analysis must see (and put back) as well."""
    import numpy as np

    class NumpyDrop(_LayerDrop):
        def forward(self, x):
            for p, layer in zip(self.p, self.layers):
                if not (self.training and np.random.rand() < p):
                    x = x + layer(x)
            return self.head(x)

    torch.manual_seed(0)
    model, x = NumpyDrop(), seeded(2, 5, 16)
    np.random.seed(3)
    np.random.rand()  # the key is generated: the forward's draws move the position only
    skipped = (np.random.rand(3) < 0.3).any()
    np.random.seed(3)
    np.random.rand()
    before = np.random.get_state(legacy=False)
    plan, forwards = _forwards(model, x)
    after = np.random.get_state(legacy=False)
    assert skipped and forwards > 1  # one forward before: numpy's key had not moved
    assert after["state"]["pos"] == before["state"]["pos"] and (after["state"]["key"] == before["state"]["key"]).all()


def test_a_layer_no_recorded_forward_ran_is_listed_as_not_analysed():
    torch.manual_seed(0)
    model, x = _LayerDrop(p=(0.0, 1.0, 0.0)), seeded(2, 5, 16)
    plan, forwards = _forwards(model, x)
    assert forwards == 8  # the forward drew random numbers each time: it could have run layer 1, and never did
    assert plan.not_analysed == {"layers.1": "not called in any of the 8 analysis forwards (skipped by layerdrop or "
                                             "a branch): not analysed, it runs unfused"}
    assert repr(plan).endswith("; 1 module not analysed (not called in the analysis forward): layers.1)")
    assert "layers.1" in plan._repr_html_()
    assert ol.fusion.FusionPlan.from_json(plan.to_json()).not_analysed == plan.not_analysed
    assert [d.modules[0] for d in plan.fused] == ["layers.0.fc1", "layers.2.fc1"]
    fused = ol.fusion.apply(model, plan)
    _assert_same_step(model.eval(), fused.eval(), x)  # layer 1 runs too, unfused


def test_a_branch_not_taken_is_listed_after_one_forward():
    """A data-dependent branch takes the same way on the same inputs: one forward, and the other branch listed."""
    torch.manual_seed(0)
    model, x = _Branch(), seeded(2, 5, 16).abs()
    plan, forwards = _forwards(model, x)
    assert forwards == 1
    assert plan.not_analysed == {"neg": "not called in the analysis forward (skipped by layerdrop or a branch): "
                                        "not analysed, it runs unfused"}
    assert [d.modules[0] for d in plan.fused] == ["pos.fc1"]
    fused = ol.fusion.apply(model, plan)
    _assert_same_step(model, fused, x)
    _assert_same_step(model, fused, -x)  # the branch not analysed runs as it is


@pytest.mark.parametrize("name", ["llama", "encoder"])
def test_fusing_keeps_nothing_of_the_model_or_its_example_forward_alive(name):
    """The analysis records the example forward with saved-tensor hooks; those stay with the autograd graph, and a
    hook holding the record, or handing back an op's own saved output, made a cycle through C++ that the collector
    cannot see: every analysis kept the model's parameters and the forward's activations (22 GB over a sweep)."""
    import gc
    import weakref

    from opsnn_lab.demos import zoo

    model, inputs = zoo.build(name, dropout=0.0)
    param = weakref.ref(next(model.parameters()))
    fused, plan = ol.fusion.fuse(model.train(), inputs)
    out = fused(*inputs) if isinstance(inputs, tuple) else fused(**inputs)
    fused_param = weakref.ref(next(fused.parameters()))
    del model, fused, plan, out
    gc.collect()
    assert param() is None and fused_param() is None
