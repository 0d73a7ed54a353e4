"""The module-level rewrite (patch.py): each route, its guards, and the fused model behaving like the original
(hooks, state_dict both ways, deepcopy, torch.save/load, .to(dtype), autocast, revert)."""

from __future__ import annotations

import copy
import functools
import inspect
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.bench import activation_bytes
from opsnn_lab.fusion.patch import ChainHead, PassThrough, Patch, QKVMember, WholeForward
from opsnn_lab.testing import seeded


class Act(nn.Module):  # a user wrapper computing one activation (a chain step of its own)
    def forward(self, x):
        return F.gelu(x)


class ChainMLP(nn.Module):  # (a): every step is a module call
    def __init__(self, d=8):
        super().__init__()
        self.fc1, self.act, self.drop, self.fc2 = nn.Linear(d, 2 * d), Act(), nn.Dropout(0.0), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


class InlineMLP(nn.Module):  # (c): F.gelu inline; the module's one call computes exactly the chain
    def __init__(self, d=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class GQA(nn.Module):  # (b): q wider than k/v; called k first
    def __init__(self, d=8):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d // 2), nn.Linear(d, d // 2)

    def forward(self, x, swap: bool = False):
        k = self.k(x)
        q = self.q(x * 2 if swap else x)  # swap=True: a call pattern the analysis did not see
        v = self.v(x)
        return q.sum(-1, keepdim=True) + torch.cat([k, v], -1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.chain, self.inline, self.attn, self.out = ChainMLP(), InlineMLP(), GQA(), nn.Linear(8, 3)

    def forward(self, x, swap: bool = False, *, scale: float = 1.0):
        return self.out(self.attn(self.inline(self.chain(x)), swap=swap)) * scale


X = seeded(3, 5, 8)


def _fused(model=None, x=X):
    model = (model or Net()).train()
    torch.manual_seed(0)
    return ol.fusion.fuse(model, x)


def _grads(model, *args, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(*args, **kwargs)
    (out.double() * seeded(*out.shape, seed=3).double()).sum().backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def _same(a, b, *args, **kwargs):
    out_a, ga = _grads(a, *args, **kwargs)
    out_b, gb = _grads(b, *args, **kwargs)
    torch.testing.assert_close(out_b, out_a, atol=1e-5, rtol=1e-5)
    assert ga.keys() == gb.keys()
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], atol=1e-5, rtol=1e-5, msg=k)


def test_each_route_is_chosen_and_patched():
    torch.manual_seed(0)
    model = Net()
    fused, plan = _fused(model)
    routes = {d.modules[0]: d.route for d in plan.fused}
    assert routes == {"chain.fc1": "module:chain", "inline.fc1": "module:whole", "attn.k": "module:qkv"}
    assert plan.routes == []  # no tracer was needed
    patches = ol.fusion.patches(fused)
    assert isinstance(patches["chain.fc1"], ChainHead)
    assert all(isinstance(patches[p], PassThrough) for p in ("chain.act", "chain.drop", "chain.fc2"))
    assert isinstance(patches["inline"], WholeForward) and "inline.fc1" not in patches
    assert all(isinstance(patches[p], QKVMember) for p in ("attn.q", "attn.k", "attn.v"))
    qkv = next(d for d in plan.fused if d.pattern == "qkv")
    assert qkv.modules == ["attn.k", "attn.q", "attn.v"] and qkv.first == 0  # k runs first: the packed GEMM
    assert not ol.fusion.patches(model)  # the analysed model is untouched
    for cls in (type(m) for m in fused.modules()):  # every module keeps its class
        assert cls.__module__ in (__name__, "torch.nn.modules.linear", "torch.nn.modules.dropout")
    for mode in ("train", "eval"):
        getattr(model, mode)()
        getattr(fused, mode)()
        _same(model, fused, X)


def test_qkv_guard_falls_back_on_a_call_pattern_not_seen(monkeypatch):
    torch.manual_seed(0)
    model = Net()
    fused, _ = _fused(model)
    calls = []
    core = ol.fusion.patches(fused)["attn.q"].core
    real = core.op.forward
    monkeypatch.setattr(core.op, "forward", lambda x: calls.append(x) or real(x))
    _same(model, fused, X)
    assert len(calls) == 1  # one packed GEMM served q, k and v
    _same(model, fused, X, swap=True)  # q reads another tensor: q falls back, k/v still packed
    assert len(calls) == 2
    _same(model, fused, X, scale=0.5)  # keyword-only arguments pass through unchanged
    x = X.clone()
    k = fused.attn.k(x)  # k computes the packed result for x ...
    x.mul_(2)  # ... then x changes in place: q and v must not read the stale slices
    torch.testing.assert_close(fused.attn.q(x), model.attn.q(x))
    torch.testing.assert_close(fused.attn.v(x), model.attn.v(x))
    torch.testing.assert_close(k, model.attn.k(X))


def test_every_route_runs_under_inference_mode():
    """Inference tensors track no version counter (the packed QKV's cache read it and raised)."""
    torch.manual_seed(0)
    model = Net()
    fused, _ = _fused(model)
    for mode in ("train", "eval"):
        getattr(model, mode)()
        getattr(fused, mode)()
        with torch.inference_mode():
            torch.testing.assert_close(fused(X), model(X), atol=1e-5, rtol=1e-5)


def test_shared_module_is_rejected_with_its_reason():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x))) + self.act(x)  # act runs twice; once outside the chain

    model = Shared()
    plan = ol.fusion.analyze(model, seeded(2, 4))
    (d,) = plan.decisions
    # no module boundary may be patched (act's other call would change) ...
    assert "`act` runs 2 times per forward" in plan._analysis.why_not[d.key]
    # ... so the one call site is rewritten inside the traced forward instead
    assert d.fused and d.route == "fx:<model>" and not d.carriers
    fused = ol.fusion.apply(model, plan)
    assert type(ol.fusion.patches(fused)[""]).__name__ == "FxForward"
    torch.testing.assert_close(fused(seeded(2, 4)), model(seeded(2, 4)))


class SharedLayer(nn.Module):  # ALBERT's layer: q/k/v -> attention, then Linear -> GELU -> Linear, each residual
    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) * 0.25, -1) @ self.v(x)
        return x + self.fc2(self.act(self.fc1(x)))


class SharedDepth(nn.Module):
    """One layer called at every depth (ALBERT), in a forward torch.fx cannot trace: only module patches reach
    the chains, and each patch of the shared layer's modules runs at both calls."""

    def __init__(self, d=16, calls=2):
        super().__init__()
        self.inp, self.layer, self.calls = nn.Linear(d, d), SharedLayer(d), calls

    def forward(self, x):
        x = self.inp(x)
        for _ in range(self.calls):
            if x.sum() > -1e9:  # data-dependent control flow: not traceable
                x = self.layer(x)
        return x


def _measured_saving(model, fused, x):
    from opsnn_lab.measuring import activation_bytes

    return activation_bytes(lambda: model(x)) - activation_bytes(lambda: fused(x))


def test_a_shared_module_whose_every_call_is_the_chain_is_fused_at_every_call():
    torch.manual_seed(0)
    model, x = SharedDepth(), seeded(2, 6, 16)
    fused, plan = ol.fusion.fuse(model, x)
    for pattern, route, path in (("qkv", "module:qkv", "layer.q"), ("linear_gelu_tanh_linear", "module:chain",
                                                                     "layer.fc1")):
        sites = [d for d in plan.decisions if d.pattern == pattern]
        assert len(sites) == 2 and all(d.fused and d.route == route for d in sites), sites
        assert sites[0].reason.endswith(f"; `{path}` runs 2 times per forward, each call this chain: its one "
                                        "rewrite serves all")
    assert type(ol.fusion.patches(fused)["layer.fc1"]).__name__ == "ChainHead"
    torch.manual_seed(0)
    once = SharedDepth(calls=1)
    fused_once, plan_once = ol.fusion.fuse(once, x)
    assert plan.saved_bytes == 2 * plan_once.saved_bytes > 0  # each call is planned ...
    assert _measured_saving(model, fused, x) == 2 * _measured_saving(once, fused_once, x) > 0  # ... and fused
    _same(model, fused, x)


def test_a_shared_module_with_a_call_outside_the_chain_says_how_to_fuse_the_chain():
    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > -1e9:
                return self.fc2(self.act(self.fc1(x))) + self.act(x)  # act's second call is no chain
            return x

    (d,) = ol.fusion.analyze(Untraceable(), seeded(2, 4)).decisions
    assert not d.fused and d.reason.startswith(
        "cannot be rewritten: `act` runs 2 times per forward, 1 of them in this chain, and a module-level rewrite "
        "changes every call; to fuse this call site alone, `<model>`.forward must be traceable (the fx rewrite "
        "goes call by call) or call opsnn_lab.ops.FusedLinearGELUDropoutLinear there"), d.reason
    # and why it is not: fx's own error, with the model's line that stopped it
    line = inspect.getsourcelines(Untraceable.forward)[1] + 1
    assert d.reason.endswith("nor can fx trace `<model>` (TraceError: symbolically traced variables cannot be used as "
                             f"inputs to control flow at test_module_rewrite.py:{line} `if x.sum() > -1e9:`)"), d.reason


@pytest.mark.parametrize("traceable", [False, True])
def test_a_shared_norm_declined_at_one_call_is_fused_at_none(traceable):
    """A rewrite serves every call site of its module (a patch) or of its key (fx): a LayerNorm worth fusing
    before a Linear but declined before a Dropout is fused nowhere, so the plan's saving is what a step saves."""
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc, self.drop = nn.LayerNorm(16), nn.Linear(16, 16), nn.Dropout(0.0)

        def forward(self, x):
            if not traceable and x.sum() < -1e9:
                return x
            return self.drop(self.ln(self.fc(self.ln(x))))

    torch.manual_seed(0)
    model, x = Twice(), seeded(2, 6, 16, requires_grad=True)
    fused, plan = ol.fusion.fuse(model, x)
    first, second = [d for d in plan.decisions if d.pattern == "layer_norm"]
    assert second.saved_bytes < 0.1 * 2 * 6 * 16 * 4  # before the Dropout: declined for its bytes
    for d in (first, second):  # traceable: the fx route would fuse the declined call too, so it is not taken
        assert not d.fused, d
        assert d.reason.startswith("cannot be rewritten: `ln` runs 2 times per forward and its rewrite (module:chain) "
                                   "changes every call, but one is not fused (not fused: saves "), d.reason
        assert d.reason.endswith("; to fuse the others alone, call opsnn_lab.ops.FusedLayerNorm there")
    assert _measured_saving(model, fused, x) == plan.saved_bytes
    _same(model, fused, x)


def test_hooks_outside_chains_fire_and_signature_is_kept():
    torch.manual_seed(0)
    model = Net()
    fused, _ = _fused(model)
    seen = []
    fused.out.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    fused.attn.register_forward_pre_hook(lambda m, a, kw: seen.append("attn"), with_kwargs=True)
    fused(X, swap=False, scale=2.0)
    assert seen == ["attn", (3, 5, 3)]


class RootMLP(InlineMLP):
    def forward(self, x, scale: float = 1.0):
        return self.fc2(F.gelu(self.fc1(x))) * scale


def _signatures_hold(fused: nn.Module) -> list[str]:
    """The patched modules of ``fused``, each checked: ``inspect.signature(module.forward)`` is the class forward's."""
    patched = [(path, m) for path, m in fused.named_modules() if isinstance(m.__dict__.get("forward"), Patch)]
    for path, m in patched:
        assert inspect.signature(m.forward) == inspect.signature(type(m).forward.__get__(m)), path
    return sorted({type(m.__dict__["forward"]).__name__ for _, m in patched})


def test_a_patched_forward_keeps_the_signature_code_reads_from_it():
    """Hugging Face's ``generate`` and Trainer read ``inspect.signature(model.forward)`` (``logits_to_keep``,
    ``attention_mask``, the dataset columns to keep): a patched forward read ``(*args, **kwargs)``."""
    torch.manual_seed(0)
    assert _signatures_hold(_fused(Net())[0]) == ["ChainHead", "PassThrough", "QKVMember", "WholeForward"]
    fused, plan = ol.fusion.fuse(RootMLP(), (X,))  # the chain inline in the root's forward: a region at the root
    assert [d.route for d in plan.fused] == ["fx:<model>"], plan.decisions
    assert _signatures_hold(fused) == ["FxForward"]
    assert list(inspect.signature(fused.forward).parameters) == ["x", "scale"]
    encoder = ol.models.Encoder(ol.models.EncoderConfig.tiny(layers=1))
    fused, _ = ol.fusion.fuse(encoder, (torch.randint(0, 100, (2, 6)),))
    assert "FxForward" in _signatures_hold(fused)


def _recorder(seen: list):
    def hook(module, *args):
        seen.append([t.detach().clone() for a in args for t in (a if isinstance(a, tuple) else (a,))
                     if isinstance(t, torch.Tensor)])
    return hook


@pytest.mark.parametrize("where", ["chain.fc1", "chain.act", "chain.drop", "chain.fc2", "inline.fc1", "inline.fc2"])
@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward"])
def test_a_hook_added_after_fusion_runs_its_chain_unfused_while_it_is_there(where, kind):
    """Fused, the chain's first module runs the whole op and the others pass its result on (a whole-module route
    calls none of them): a hook added afterwards would see the fused op's tensors, or never fire. While it is
    there, the chain's modules run their own forwards, with one warning; removed, the chain runs fused again."""
    torch.manual_seed(0)
    model = Net().train()
    fused, plan = _fused(model)
    head = "chain.fc1" if where.startswith("chain") else "inline"
    assert any(where.startswith(d.modules[0].rpartition(".")[0]) for d in plan.fused)
    eager_bytes, fused_bytes = (activation_bytes(lambda m=m: m(X)) for m in (model, fused))
    assert fused_bytes < eager_bytes
    want, got = [], []
    getattr(model.get_submodule(where), f"register_{kind}_hook")(_recorder(want))
    handle = getattr(fused.get_submodule(where), f"register_{kind}_hook")(_recorder(got))
    with pytest.warns(RuntimeWarning, match=rf"`{where}` has a hook added after the \S+ chain at `{head}` was fused"):
        _same(model, fused, X)
    assert got and len(got) == len(want)
    for g, w in zip(got, want):
        assert [t.shape for t in g] == [t.shape for t in w]
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # said once per chain
        _same(model, fused, X)
        assert fused_bytes < activation_bytes(lambda: fused(X)) <= eager_bytes  # the other chains still fused
    handle.remove()
    got.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _same(model, fused, X)
        assert activation_bytes(lambda: fused(X)) == fused_bytes
    assert not got


def test_state_dict_round_trips_deepcopy_save_load_and_to():
    torch.manual_seed(0)
    model = Net()
    fused, _ = _fused(model)
    assert list(fused.state_dict()) == list(model.state_dict())
    other = Net()
    other.load_state_dict(fused.state_dict())  # fused -> original
    _same(model, other, X)
    torch.manual_seed(7)
    fresh = Net()
    fused.load_state_dict(fresh.state_dict())  # original -> fused (into the packed QKV buffer too)
    _same(fresh, fused, X)
    twin = copy.deepcopy(fused)
    assert ol.fusion.patches(twin)["chain.fc1"].host is twin.chain.fc1
    assert ol.fusion.patches(twin)["chain.fc1"].op.weight is twin.chain.fc1.weight  # shares the copy's Parameter
    _same(fresh, twin, X)
    buf = io.BytesIO()
    torch.save(fused, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert ol.fusion.patches(loaded).keys() == ol.fusion.patches(fused).keys()
    _same(fresh, loaded, X)
    double = copy.deepcopy(fused).to(torch.float64)
    out = double(X.double())
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, fresh.double()(X.double()), atol=1e-10, rtol=1e-10)


def test_autocast_bf16_runs_and_matches_eager_autocast():
    torch.manual_seed(0)
    model = Net()
    fused, _ = _fused(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = model(X), fused(X)
    assert b.dtype == a.dtype == torch.bfloat16
    torch.testing.assert_close(b, a, atol=1e-2, rtol=1e-2)
    b.float().sum().backward()
    assert all(p.grad is not None for p in fused.parameters())


def test_revert_restores_every_class_forward():
    torch.manual_seed(0)
    model = Net()
    fused, _ = _fused(model)
    ol.fusion.revert(fused)
    assert not ol.fusion.patches(fused)
    _same(model, fused, X)


def test_fx_region_keeps_keyword_arguments():
    """A functional chain inside one forward is rewritten with torch.fx; keywords still reach the region."""

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.0)

        def forward(self, q, k, v, output_probs: bool = False):
            probs = self.drop(torch.softmax(q @ k.transpose(-2, -1) * 0.5, dim=-1))
            out = probs @ v
            return (out, None) if output_probs else out

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attn()

        def forward(self, x, output_probs=False):
            return self.attn(x, x, x, output_probs=output_probs)

    model = Outer()
    x = seeded(2, 4, 8)
    fused, plan = ol.fusion.fuse(model, x)
    (d,) = plan.fused
    assert d.pattern == "attention" and d.route.startswith("fx:")
    torch.testing.assert_close(fused(x), model(x))
    out, none = fused(x, output_probs=True)  # not the traced call: the original code runs
    assert none is None
    torch.testing.assert_close(out, model(x))


def test_json_plan_applies_module_routes():
    torch.manual_seed(0)
    model = ChainMLP()
    plan = ol.fusion.analyze(model, X)
    fused = ol.fusion.apply(model, ol.fusion.FusionPlan.from_json(plan.to_json()))
    assert isinstance(ol.fusion.patches(fused)["fc1"], ChainHead)
    _same(model, fused, X)
    with pytest.raises(ValueError, match="was the plan made for this model"):
        ol.fusion.apply(nn.Sequential(nn.Linear(8, 8)), ol.fusion.FusionPlan.from_json(plan.to_json()))


class RMSNorm(nn.Module):  # written in Python, its epsilon a plain attribute: the module's one call is the chain
    def __init__(self, d=8, eps=1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.linspace(0.5, 1.5, d)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


class Settings(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()
        self.mlp, self.norm = ChainMLP(4), RMSNorm(4)

    def forward(self, x):
        h = self.act(self.bn(self.conv(x))).mean((2, 3))
        return self.norm(self.mlp(h))


@pytest.mark.parametrize(("where", "name", "value", "chain"), [
    ("mlp.drop", "p", 0.5, "the linear_gelu_dropout_linear chain at `mlp.fc1`"),
    ("norm", "variance_epsilon", 1.0, "the rms_norm chain at `norm`"),
    ("bn", "momentum", 0.5, None),  # the fused Conv->BN->act op reads these at every call: it stays fused
    ("bn", "eps", 1e-1, None),
])
def test_a_setting_changed_after_fusion_runs_its_chain_unfused_while_it_differs(where, name, value, chain):
    """A fused op may take its modules' settings as they are at fusion (a Dropout's p, a norm's epsilon); one
    changed afterwards (a dropout schedule) runs that chain unfused, with the new value and one warning, until it
    is set back. Before, the fused op went on with the old value. A setting the op reads at every call
    (``live_settings``: a BatchNorm's momentum and eps) keeps the chain fused."""
    torch.manual_seed(0)
    model, x = Settings().train(), seeded(4, 3, 6, 6)
    fused, plan = ol.fusion.fuse(model, (x,))
    assert {d.pattern for d in plan.fused} >= {"conv_bn_relu", "linear_gelu_dropout_linear", "rms_norm"}
    fused_bytes, eager_bytes = activation_bytes(lambda: fused(x)), activation_bytes(lambda: model(x))
    assert fused_bytes < eager_bytes  # (and both ran a step: the BatchNorm statistics moved alike)
    old = getattr(model.get_submodule(where), name)
    for m in (model, fused):
        setattr(m.get_submodule(where), name, value)
    for step in range(2):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", RuntimeWarning)
            torch.manual_seed(step)
            got, got_grads = _grads(fused, x)
        torch.manual_seed(step)
        want, want_grads = _grads(model, x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for k, g in want_grads.items():
            torch.testing.assert_close(got_grads[k], g, atol=1e-5, rtol=1e-5, msg=k)
        for k, b in model.named_buffers():
            torch.testing.assert_close(fused.get_buffer(k), b, atol=1e-6, rtol=1e-6, msg=k)
        said = [str(w.message) for w in seen if "changed after" in str(w.message)]
        assert len(said) == (step == 0 and chain is not None), said  # once per chain
        if said:
            assert f"`{where}` changed after {chain} was fused (a setting changed: {name} {old!r} -> {value!r})" \
                in said[0]
    if chain is None:
        assert activation_bytes(lambda: fused(x)) == fused_bytes
    for m in (model, fused):
        setattr(m.get_submodule(where), name, old)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert activation_bytes(lambda: fused(x)) == fused_bytes  # set back: fused again


def test_a_setting_check_ignores_the_stream_state_and_what_train_sets():
    torch.manual_seed(0)
    model = Settings()
    fused, _ = ol.fusion.fuse(model.train(), (seeded(2, 3, 6, 6),))
    ol.consistency.make_reproducible(fused, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for mode in (True, False, True):
            fused.train(mode)
            fused(seeded(2, 3, 6, 6)).sum().backward()


class LowRank(nn.Module):
    """What a LoRA library puts in place of a Linear: the Linear itself plus a low-rank update."""

    def __init__(self, base: nn.Linear, rank=2):
        super().__init__()
        self.base, self.a, self.b = base, nn.Linear(base.in_features, rank, bias=False), nn.Linear(rank,
                                                                                                    base.out_features)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


def test_a_module_replaced_inside_a_module_fused_whole_runs_it_unfused():
    """``inline`` is fused whole (its op holds fc1's weight): fc1 wrapped afterwards (LoRA applied to the fused
    model) went unseen, the op computing the old fc1. Now the module runs its own forward, with one warning."""
    torch.manual_seed(0)
    model = Net().train()
    fused, plan = _fused(model)
    assert isinstance(ol.fusion.patches(fused)["inline"], WholeForward)
    torch.manual_seed(1)
    low = LowRank(model.inline.fc1)
    model.inline.fc1 = low
    fused.inline.fc1 = LowRank(fused.inline.fc1)
    fused.inline.fc1.load_state_dict(low.state_dict())
    with pytest.warns(RuntimeWarning, match=r"`inline.fc1` changed after the linear_gelu_linear chain at "
                                            r"`inline` was fused \(replaced by a `LowRank`\)"):
        _same(model, fused, X)


def test_fusing_a_fused_model_again_keeps_its_fusion_and_touches_no_patched_module():
    """Running a notebook's fuse cell twice: the second analysis saw the patched modules' chains again and raised
    ("module 'attn.k' is already rewritten by another chain"). Now such a chain is declined, saying why, and the
    copy keeps the first fusion."""
    torch.manual_seed(0)
    model = Net().train()
    fused, plan = _fused(model)
    again, plan2 = ol.fusion.fuse(fused, X)
    assert not plan2.fused
    reasons = [d.reason for d in plan2.decisions]
    assert any("has a forward of its own set on the instance (this model was fused before" in r for r in reasons)
    assert set(ol.fusion.patches(again)) == set(ol.fusion.patches(fused))
    _same(model, again, X)
    assert activation_bytes(lambda: again(X)) == activation_bytes(lambda: fused(X))


def test_a_forward_a_library_set_on_the_instance_is_not_replaced():
    """A library's hook (accelerate's ``add_hook_to_module``) sets ``module.forward`` on the instance; fusing replaced
    it with the fused op's patch, so the hook's work (moving tensors between devices) silently stopped."""
    torch.manual_seed(0)
    model = Net().train()
    calls = []

    def hooked_forward(module, x):
        calls.append(1)
        return type(module).forward(module, x)

    model.chain.fc1.forward = functools.partial(hooked_forward, model.chain.fc1)  # as accelerate binds it
    fused, plan = _fused(model)
    mlp = next(d for d in plan.decisions if d.modules[0] == "chain.fc1")
    assert not mlp.fused and "`chain.fc1` has a forward of its own set on the instance" in mlp.reason
    calls.clear()
    _same(model, fused, X)
    assert len(calls) == 2  # the eager model's call and the fused copy's
