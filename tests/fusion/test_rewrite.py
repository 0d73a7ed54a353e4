"""apply(): a new module, same state_dict, same numbers, in train and eval, under any optimizer."""

from __future__ import annotations

import collections
import copy
import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab.models import Encoder, EncoderConfig, ResNet, ResNetConfig
from opsnn_lab.testing import seeded


def _encoder(p=0.1):
    torch.manual_seed(0)
    return Encoder(EncoderConfig.tiny(layers=2, dropout=p, attn_dropout=p))


def _resnet():
    torch.manual_seed(0)
    return ResNet(ResNetConfig(width=8, blocks=(1, 1)))


IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
IMAGES = seeded(3, 3, 20, 20)
# Train mode compares with dropout p=0: the fused ops draw their masks from a counter-based RNG.
CASES = {"encoder": (_encoder, (IDS,)), "resnet": (_resnet, (IMAGES,))}


def _step(model, inputs):
    model.zero_grad()
    out = model(*inputs)
    (out * seeded(*out.shape, seed=3)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(model, fused, inputs):
    out_a, grads_a = _step(model, inputs)
    out_b, grads_b = _step(fused, inputs)
    torch.testing.assert_close(out_b, out_a, atol=1e-5, rtol=1e-5)
    assert grads_a.keys() == grads_b.keys()
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_outputs_and_every_gradient_match(case, mode):
    make, inputs = CASES[case]
    model = (make(0.0) if case == "encoder" and mode == "train" else make())
    getattr(model, mode)()
    fused, plan = ol.fusion.fuse(model, inputs)
    assert fused is not model and plan.fused
    fx = [d for d in plan.fused if d.route.startswith("fx:")]
    assert sum(type(m).__name__ == "FusedSlot" for m in fused.modules()) == len(fx)
    patched = {k for k, v in ol.fusion.patches(fused).items() if type(v).__name__ != "FxForward"}
    assert sorted(patched) == sorted(p for d in plan.fused if d.route.startswith("module:") for p in d.carriers)
    assert not ol.fusion.patches(model)
    assert not any(type(m).__name__ == "FusedSlot" for m in model.modules())
    assert list(fused.state_dict()) == list(model.state_dict())
    for (k, a), b in zip(model.state_dict().items(), fused.state_dict().values()):
        assert torch.equal(a, b), k
    _assert_same(model, fused, inputs)
    fused.train(mode == "eval")  # switching mode after the rewrite switches the fused ops too
    model.train(mode == "eval")
    if case == "resnet" or mode == "train":
        _assert_same(model, fused, inputs)


@pytest.mark.parametrize("opt", [torch.optim.SGD, torch.optim.AdamW])
def test_training_steps_match(opt):
    model = _resnet().train()
    fused, _ = ol.fusion.fuse(model, (IMAGES,))
    opts = [opt(m.parameters(), lr=1e-2) for m in (model, fused)]
    for step in range(3):
        for m, o in zip((model, fused), opts):
            _step(m, (seeded(3, 3, 20, 20, seed=step),))
            o.step()
    for (k, a), b in zip(model.state_dict().items(), fused.state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4, msg=k)  # incl. BN running stats


def test_state_dict_loads_both_ways_and_copies_work():
    model = _encoder().eval()
    fused, _ = ol.fusion.fuse(model, (IDS,))
    other = _encoder()
    torch.nn.init.normal_(other.head.weight)
    other.load_state_dict(fused.state_dict())  # fused -> original architecture
    fused.load_state_dict(model.state_dict())  # original -> fused
    twin = copy.deepcopy(fused).double()  # a copy converts its own parameters, the fused ops follow
    _assert_same(other.eval(), fused, (IDS,))
    torch.testing.assert_close(twin(IDS).float(), model(IDS), atol=1e-5, rtol=1e-5)


def test_unplanned_calls_fall_back_to_the_original_code():
    model = _encoder().eval()
    fused, plan = ol.fusion.fuse(model, (IDS,))  # traced with attention_mask=None -> mask=None specialised
    mask = torch.ones_like(IDS)
    mask[:, -3:] = 0
    torch.testing.assert_close(fused(IDS, mask), model(IDS, mask), atol=1e-5, rtol=1e-5)
    with_mask = ol.fusion.analyze(model, (IDS, mask))  # planned with a mask: the mask is a real input
    fused_mask = ol.fusion.apply(model, with_mask)
    assert with_mask.summary()["attention"]["fused"] == 2
    torch.testing.assert_close(fused_mask(IDS, mask), model(IDS, mask), atol=1e-5, rtol=1e-5)


def test_apply_from_a_json_plan_and_bad_arguments():
    model = _resnet().eval()
    plan = ol.fusion.analyze(model, (IMAGES,))
    fused = ol.fusion.apply(model, ol.fusion.FusionPlan.from_json(plan.to_json()))
    _assert_same(model, fused, (IMAGES,))
    with pytest.raises(TypeError, match="plan"):
        ol.fusion.apply(model, {"decisions": []})
    with pytest.raises(TypeError, match="model"):
        ol.fusion.apply(None, plan)
    with pytest.raises(ValueError, match="was the plan made for this model"):
        ol.fusion.apply(_encoder(), plan)


def test_dropout_p_survives_the_rewrite():
    """Each fused op keeps its own dropout p and, in train mode, drops that share of its elements."""
    from opsnn_lab.ops import FusedAttention, FusedLinearGELUDropoutLinear

    torch.manual_seed(0)
    cfg = EncoderConfig.tiny(layers=2, dropout=0.3, attn_dropout=0.6)  # two values: a swap shows too
    fused, _ = ol.fusion.fuse(Encoder(cfg).train(), (IDS,))
    ops = [getattr(m, "op", m) for m in fused.modules()]  # a slot calls its op; a child op is its own
    ops += [p.op for p in ol.fusion.patches(fused).values() if hasattr(p, "op")]  # module-level chains
    attn = [o for o in ops if isinstance(o, FusedAttention)]
    mlps = [o for o in ops if isinstance(o, FusedLinearGELUDropoutLinear)]
    assert [o.dropout_p for o in attn] == [0.6] * cfg.layers and [o.p for o in mlps] == [0.3] * cfg.layers
    # attention on v = identity returns its dropped probabilities: the zeros are the dropped share
    t = 64
    q, k, eye = seeded(1, 1, t, 8), seeded(1, 1, t, 8, seed=1), torch.eye(t).expand(1, 1, t, t)
    for o in attn:
        out = o.train()(q, k, eye)
        assert abs((out == 0).float().mean().item() - 0.6) < 0.04
        assert torch.equal(o.eval()(q, k, eye) == 0, torch.zeros_like(out, dtype=torch.bool))
    # the MLP with fc2 selecting the first features and GELU kept positive returns its dropped activations
    x = seeded(256, cfg.hidden)
    for layer, o in zip(fused.layers, mlps):
        with torch.no_grad():
            layer.mlp.fc1.bias.fill_(4.0)
            layer.mlp.fc2.weight.copy_(torch.eye(cfg.hidden, cfg.intermediate))
            layer.mlp.fc2.bias.zero_()
            out = o.train()(x)
        assert out.shape == (256, cfg.hidden) and abs((out == 0).float().mean().item() - 0.3) < 0.03


class _SharedLayer(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.ln, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class _Shared(nn.Module):
    """ALBERT's sharing: one layer called twice. Its LayerNorm is add_layer_norm on the second call (the first
    call's residual add precedes it) and layer_norm alone on the first, in one traced forward."""

    def __init__(self):
        super().__init__()
        self.inp, self.layer = nn.Linear(32, 32), _SharedLayer()

    def forward(self, x):
        x = self.inp(x)
        for _ in range(2):
            x = self.layer(x)
        return x


def test_a_node_two_planned_matches_could_take_is_rewritten_once():
    from opsnn_lab.measuring import activation_bytes

    torch.manual_seed(0)
    model, x = _Shared(), seeded(2, 8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.fx warned "erase_node(...) on an already erased node"
        fused, plan = ol.fusion.fuse(model, x)
    names = {(d.pattern, tuple(d.modules)) for d in plan.fused}
    assert {("add_layer_norm", ("layer", "layer.ln")), ("layer_norm", ("layer.ln",))} <= names, plan.decisions
    gm = ol.fusion.patches(fused)[""].variants[True]
    for slot, mod in gm.named_children():
        if isinstance(mod, ol.fusion.FusedSlot):  # one call per fused decision: no dead extra op left in the code
            calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == slot]
            assert len(calls) == sum((d.pattern, d.modules) == (mod.pattern, mod.fused_modules) for d in plan.fused)
    # the plan's saving is what a step saves (it measured 2,112 bytes less before: the dead LayerNorm's)
    assert activation_bytes(lambda: model(x)) - activation_bytes(lambda: fused(x)) == plan.saved_bytes
    _assert_same(model, fused, (x,))


def test_one_linear_at_both_ends_of_a_chain_fuses_in_traced_code():
    """``shared(gelu(shared(x)))``: the fused op reads one weight twice; its two gradients add up as eager's do."""
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.shared = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            return self.shared(torch.nn.functional.gelu(self.shared(self.inp(x))))

    torch.manual_seed(0)
    model, x = Twice(), seeded(2, 5, 16)
    fused, plan = ol.fusion.fuse(model, x)
    (d,) = plan.decisions
    assert d.fused and d.route == "fx:<model>" and d.modules == ["shared", "shared"], d.reason
    _assert_same(model, fused, (x,))


class _Block(nn.Module):
    """A traceable residual block: ``ln(x + fc2(gelu(fc1(x))))`` fuses as linear_gelu_linear + add_layer_norm."""

    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.fc2, self.ln = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class _Steps(nn.Module):
    """Not an nn.Sequential, but its forward runs its children in turn all the same."""

    def __init__(self, *steps):
        super().__init__()
        for i, step in enumerate(steps):
            self.add_module(f"s{i}", step)

    def forward(self, x):
        for step in self.children():
            x = step(x)
        return x


def _containers():
    torch.manual_seed(0)
    block = _Block()
    return {"nested": nn.Sequential(_Block(), nn.Sequential(_Block(), nn.Linear(16, 16))),
            "one block twice": nn.Sequential(block, block, nn.Linear(16, 8)),
            "loop over children": _Steps(_Block(), _Block(), nn.Linear(16, 8))}


@pytest.mark.parametrize("case", ["nested", "one block twice", "loop over children"])
def test_a_container_keeps_its_steps_and_its_blocks_fuse(case):
    """The whole model traces, but a fused op registered on a container would become one more of its steps
    (apply raised "module is not installed as a submodule"): its blocks are the regions instead."""
    model, x = _containers()[case], seeded(2, 5, 16)
    fused, plan = ol.fusion.fuse(model, x)
    routes = {r["path"]: r for r in plan.routes}
    assert routes[""]["route"] == "container" and "runs its children in turn" in routes[""]["reason"]
    fx = {d.route for d in plan.fused if d.route.startswith("fx:")}
    assert fx == {"nested": {"fx:0", "fx:1.0"}, "one block twice": {"fx:0"},
                  "loop over children": {"fx:s0", "fx:s1"}}[case], plan.decisions
    assert {d.pattern for d in plan.fused} == {"linear_gelu_linear", "add_layer_norm"}
    assert len(plan.fused) == 4  # one block twice: each key fused at both of its call sites
    assert [type(m) for m in fused.children()] == [type(m) for m in model.children()]
    assert not any(isinstance(m, ol.fusion.FusedSlot) for m in fused.children())
    _assert_same(model, fused, (x,))
    fused.eval()
    model.eval()
    _assert_same(model, fused, (x,))


def test_a_chain_across_a_containers_steps_says_why_it_is_not_rewritten():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return x + self.fc(x)

    torch.manual_seed(0)
    model, x = nn.Sequential(Residual(), nn.LayerNorm(16), nn.Linear(16, 8)), seeded(2, 5, 16)
    fused, plan = ol.fusion.fuse(model, x)
    d = next(d for d in plan.decisions if d.pattern == "add_layer_norm")
    assert not d.fused and "its steps run in different children of `<model>`, which runs its children in turn" \
        in d.reason, d.reason
    assert next(d for d in plan.decisions if d.pattern == "layer_norm").fused  # the LayerNorm alone still fuses
    assert len(fused) == 3
    _assert_same(model, fused, (x,))


class _ReadsTheSumFirst(nn.Module):
    """The residual sum is read (its ``.shape``, then ``view``) before its LayerNorm, as in FocalNet's layers: the
    fused ``add_layer_norm`` call must come before that read, not at the norm."""

    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        h = x + self.fc(x)
        b, n, c = h.shape
        flat = h.view(b * n, c)
        return self.head(self.norm(h)).reshape(b * n, c) + flat


def test_an_output_read_before_the_chain_ends_gets_its_value_first():
    torch.manual_seed(0)
    model, x = _ReadsTheSumFirst().double(), seeded(2, 5, 8, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    assert [(d.pattern, d.route) for d in plan.decisions if d.fused] == [("add_layer_norm", "fx:<model>")]
    code = fused.__dict__["forward"].variants[True].code
    assert code.index("fused_add_layer_norm_0(") < code.index(".view(")
    got, want = fused(x), model(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    w = seeded(*want.shape, seed=3, dtype=torch.float64)
    g_got = torch.autograd.grad((got * w).sum(), [x, *fused.parameters()])
    g_want = torch.autograd.grad((want * w).sum(), [x, *model.parameters()])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


class _TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_ReadsTheSumFirst(), _ReadsTheSumFirst()])

    def forward(self, x):
        if x.sum() > 1e9:  # data-dependent: each block is its own fx region
            x = x * 0.5
        for block in self.blocks:
            x = block(x).reshape(x.shape)
        return x


def _failing_on_marked_hosts(monkeypatch) -> None:
    """An fx region whose module has ``fail_here`` set fails its rewrite (after its fused ops are registered)."""
    from opsnn_lab.fusion import rewrite

    real = rewrite.FxForward.__init__

    def fails_on_a_marked_host(self, host, *args, **kwargs):
        if getattr(host, "fail_here", False):
            raise RuntimeError("simulated tracer failure")
        real(self, host, *args, **kwargs)

    monkeypatch.setattr(rewrite.FxForward, "__init__", fails_on_a_marked_host)


def test_a_region_whose_rewrite_fails_runs_unfused_and_the_plan_says_so(monkeypatch):
    torch.manual_seed(0)
    model, x = _TwoBlocks().double().train(), seeded(2, 5, 8, dtype=torch.float64, requires_grad=True)
    plan = ol.fusion.analyze(model, (x,))
    assert [d.route for d in plan.decisions if d.fused] == ["fx:blocks.0", "fx:blocks.1"]
    saved, as_json = plan.saved_bytes, plan.to_json()
    model.blocks[1].fail_here = True  # the copy apply() makes has it too
    _failing_on_marked_hosts(monkeypatch)
    with pytest.warns(RuntimeWarning, match="fx rewrite of `blocks.1` failed .*simulated tracer failure"):
        fused = ol.fusion.apply(model, plan)
    assert [d.route for d in plan.decisions if d.fused] == ["fx:blocks.0"]
    (dropped,) = [d for d in plan.decisions if "simulated" in d.reason]
    assert not dropped.fused and dropped.route == "" and 0 < plan.saved_bytes < saved
    assert "forward" in fused.blocks[0].__dict__ and "forward" not in fused.blocks[1].__dict__
    assert not [n for n, _ in fused.blocks[1].named_children() if n.startswith("fused_")]
    _assert_same(model, fused, (x,))
    with pytest.raises(ValueError, match="was the plan made for this model"):  # a plan from JSON still raises
        ol.fusion.apply(model, ol.fusion.FusionPlan.from_json(as_json))


class _FirstBlockCheckpointed(_TwoBlocks):
    def forward(self, x):
        x = torch.utils.checkpoint.checkpoint(self.blocks[0], x, use_reentrant=False).reshape(x.shape)
        return self.blocks[1](x).reshape(x.shape)


def test_a_failed_rewrite_beside_a_checkpoint_leaves_the_plans_figure_what_the_step_keeps(monkeypatch):
    # the plan's figure is taken again without the failed region's chains: a chain inside a checkpoint saves
    # nothing across the step there too (before, it was counted as saving what it saves in the recompute)
    from opsnn_lab.measuring import activation_bytes

    torch.manual_seed(0)
    model, x = _FirstBlockCheckpointed().double().train(), seeded(2, 5, 8, dtype=torch.float64, requires_grad=True)
    plan = ol.fusion.analyze(model, (x,))
    assert [d.route for d in plan.decisions if d.fused] == ["fx:blocks.0", "fx:blocks.1"]
    model.blocks[1].fail_here = True
    _failing_on_marked_hosts(monkeypatch)
    with pytest.warns(RuntimeWarning, match="fx rewrite of `blocks.1` failed"):
        fused = ol.fusion.apply(model, plan)
    kept = [activation_bytes(lambda m=m: m(x).sum(), exclude=tuple(m.parameters())) for m in (model, fused)]
    assert plan.saved_bytes == kept[0] - kept[1] == 0
    _assert_same(model, fused, (x,))


@dataclass
class PerLayerConfig:
    """A config whose global ``head_dim`` field raises when read (Gemma-4's per-layer attributes)."""

    head_dim: int = 8

    def __getattribute__(self, name):
        if name == "head_dim":
            raise AttributeError("head_dim is a per-layer attribute")
        return super().__getattribute__(name)


class StateCachingMLP(nn.Module):
    """Keeps its last hidden state, graph and all, in a plain attribute and in a buffer (recurrent models cache
    their state so): ``copy.deepcopy`` refuses such tensors."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)
        self.register_buffer("last_mean", torch.zeros(8), persistent=False)
        self.state = None
        self.config = PerLayerConfig()

    def forward(self, x):
        y = self.fc2(self.act(self.fc1(x)))
        self.state, self.last_mean = [y[:, :2]], y.mean(0)
        return y


def test_a_model_caching_graph_tensors_in_attributes_fuses_and_stays_as_it_was():
    torch.manual_seed(0)
    model, x = StateCachingMLP(), seeded(4, 8, requires_grad=True)
    model(x).sum().backward()  # the caches now hold tensors with their autograd graph
    with pytest.raises(RuntimeError, match="deepcopy"):
        copy.deepcopy(model)
    cached = model.state[0]
    fused, plan = ol.fusion.fuse(model, (x,))
    assert [d.pattern for d in plan.fused] == ["linear_gelu_linear"]
    # the model keeps its own cache (the analysis's forward writes it again, as any forward does)
    assert torch.equal(model.state[0], cached) and model.state[0].grad_fn is not None
    assert fused.state[0].grad_fn is None and torch.equal(fused.state[0], cached)  # copied, detached
    torch.testing.assert_close(fused(x), model(x), rtol=1e-6, atol=1e-6)


class PromptCache:
    """An object around an OrderedDict (OmDet-Turbo's LRU cache of text embeddings), with a property that raises."""

    def __init__(self):
        self.entries = collections.OrderedDict()

    @property
    def broken(self):
        raise AttributeError("never read")


class CachesInAnObject(StateCachingMLP):
    def __init__(self):
        super().__init__()
        self.prompts, self.itself = PromptCache(), None

    def forward(self, x):
        y = super().forward(x)
        self.prompts.entries[x.shape[0]] = y.sum(0)  # computed: it carries the forward's autograd graph
        self.itself = self.prompts  # a cycle through the object
        return y


def test_a_model_caching_graph_tensors_inside_another_object_fuses():
    """``fuse`` copies the model; a tensor with its graph inside an object the model holds (left by the user's own
    forward) stopped that copy. The analysis's forwards write there too, and what they wrote is put back."""
    torch.manual_seed(0)
    model, x = CachesInAnObject(), seeded(4, 8, requires_grad=True)
    model(x)
    before = model.prompts.entries[4]
    fused, plan = ol.fusion.fuse(model, (x,))
    assert [d.pattern for d in plan.fused] == ["linear_gelu_linear"]
    assert list(model.prompts.entries.items()) == [(4, before)]  # the user's entry, with its graph, as it was
    cached = fused.prompts.entries[4]
    assert cached.grad_fn is None and torch.equal(cached, before.detach())
    assert fused.prompts is not model.prompts and fused.itself is fused.prompts
    torch.testing.assert_close(fused(x), model(x), rtol=1e-6, atol=1e-6)
