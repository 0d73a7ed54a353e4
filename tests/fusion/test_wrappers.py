"""A forward wrapped by a ``(self, *args, **kwargs)`` decorator (Hugging Face's gradient-checkpointing layers) is
traced as the function it wraps when the wrapper passes the example call through; the rewritten forward leaves
the wrapper out, except with ``gradient_checkpointing`` on, where the original runs. A wrapper that changes the
result keeps its module untraced, and the plan says why."""

from __future__ import annotations

import functools
import pickle
import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import opsnn_lab as ol
from opsnn_lab.fusion.wrappers import ArgumentState, RecordedCall, forward_wrapper, passes_through, unwrapped_forward
from opsnn_lab.testing import seeded

CALLS = []


def checkpointed(forward):
    """As Hugging Face wraps a layer's forward: checkpoint when asked, else pass the call through."""

    @functools.wraps(forward)
    def forward_with_checkpointing(self, *args, **kwargs):
        CALLS.append(type(self).__name__)
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(functools.partial(forward, self, **kwargs), *args, use_reentrant=False)
        return forward(self, *args, **kwargs)

    return forward_with_checkpointing


def as_tuple(forward):
    """A wrapper that changes what the call returns."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return (forward(self, *args, **kwargs),)

    return wrapper


class Layer(nn.Module):
    """A pre-norm block whose residual sum feeds its second norm (``add_layer_norm``: only fx can fuse it)."""

    gradient_checkpointing = False

    def __init__(self):
        super().__init__()
        self.ln1, self.fc, self.ln2, self.out = nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)

    @checkpointed
    def forward(self, x, scale: float = 1.0, **kwargs):  # a **kwargs under a *args wrapper: fx cannot trace it
        h = x + self.fc(self.ln1(x)) * scale
        return h + self.out(self.ln2(h))


class SubLayer(Layer):
    """Inherits the wrapped forward."""


class TupleLayer(Layer):
    forward = as_tuple(Layer.forward.__wrapped__)


class Stack(nn.Module):
    def __init__(self, cls=Layer):
        super().__init__()
        self.layers = nn.ModuleList([cls(), cls()])

    def forward(self, x):
        if x.sum() > 1e9:  # data-dependent: the model does not trace, its layers are the regions
            x = x * 0.5
        for layer in self.layers:
            x = layer(x)
            x = x[0] if isinstance(x, tuple) else x
        return x


def _grads(model, x):
    out = model(x)
    w = seeded(*out.shape, seed=3, dtype=out.dtype)
    return out, torch.autograd.grad((out * w).sum(), [x, *model.parameters()])


def _fuse(cls):
    torch.manual_seed(0)
    model, x = Stack(cls).double().train(), seeded(2, 5, 8, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model, (x,))
    return model, x, fused, plan


def _assert_same(model, fused, x):
    (want, g_want), (got, g_got) = _grads(model, x), _grads(fused, x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_pass_through_wrapper_is_traced_through_and_left_out_of_the_rewritten_forward():
    for cls in (Layer, SubLayer):
        model, x, fused, plan = _fuse(cls)
        assert [d.route for d in plan.decisions if d.fused and d.pattern == "add_layer_norm"] == [
            "fx:layers.0", "fx:layers.1"]
        route = next(r for r in plan.routes if r["path"] == "layers.0")
        assert route["unwrapped"] == "checkpointed.<locals>.forward_with_checkpointing (test_wrappers.py)"
        assert type(model.layers[0]).forward is type(fused.layers[0]).forward  # the class got its wrapper back
        assert "forward" not in cls.__dict__ or cls is Layer
        CALLS.clear()
        _assert_same(model, fused, x)
        assert CALLS == [cls.__name__] * 2  # the original model's two layers only
        restored = pickle.loads(pickle.dumps(fused))
        torch.testing.assert_close(restored(x), model(x), rtol=1e-12, atol=1e-12)


def test_with_gradient_checkpointing_on_the_wrapper_runs():
    model, x, fused, _ = _fuse(Layer)
    for m in (model, fused):
        for layer in m.layers:
            layer.gradient_checkpointing = True
    CALLS.clear()
    _assert_same(model, fused, x)
    assert CALLS == ["Layer"] * 4


def test_a_wrapper_that_changes_the_result_keeps_its_module_untraced():
    model, x, fused, plan = _fuse(TupleLayer)
    route = next(r for r in plan.routes if r["path"] == "layers.0")
    assert route["route"] == "untraceable" and "wrapper (test_wrappers.py)" in route["reason"]
    assert "returns other values" in route["reason"]
    assert not [d for d in plan.decisions if d.fused and d.pattern == "add_layer_norm"]
    _assert_same(model, fused, x)


def test_forward_wrapper_names_only_varargs_wrappers():
    assert forward_wrapper(nn.Linear(2, 2)) == ""
    assert forward_wrapper(Layer()).startswith("checkpointed.<locals>.")

    class Plain(nn.Module):  # functools.wraps with a plain signature: fx reads it, nothing to unwrap
        def f(self, x):
            return x

        forward = functools.wraps(f)(lambda self, x: x)

    assert forward_wrapper(Plain()) == ""
    layer = SubLayer()
    with unwrapped_forward(layer):
        assert type(layer).forward is Layer.forward.__wrapped__
    assert "forward" not in SubLayer.__dict__ and SubLayer.forward is Layer.forward


class Cache:
    """A key/value cache as Hugging Face passes one: each layer appends its keys in place."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []


class CacheAttention(nn.Module):
    """Reads and grows the cache; a module with hooks, so the layer's trace keeps it one call (as Hugging Face's
    attention, which records attention weights through hooks)."""

    def __init__(self):
        super().__init__()
        self.register_forward_hook(lambda module, args, out: None)

    def forward(self, h, cache):
        if cache is None or h.sum() > 1e9:
            return h
        cache.keys.append(h)
        if len(cache.keys) > 2:
            raise RuntimeError("the cache holds more keys than the calls so far")
        return h * (1.0 / len(cache.keys))


class CachedLayer(Layer):
    def __init__(self):
        super().__init__()
        self.attn = CacheAttention()

    @checkpointed
    def forward(self, x, cache=None, **kwargs):
        h = x + self.attn(self.fc(self.ln1(x)), cache)
        return h + self.out(self.ln2(h))


class CachedStack(Stack):
    def __init__(self, use_cache):
        super().__init__(CachedLayer)
        self.use_cache = use_cache

    def forward(self, x):
        if x.sum() > 1e9:
            x = x * 0.5
        cache = Cache() if self.use_cache else None
        for layer in self.layers:
            x = layer(x, cache=cache)
        return x


def test_a_layer_given_a_cache_it_grows_is_checked_from_the_cache_as_it_was_and_fuses():
    """The replay that checks the wrapper starts from the cache as the call found it (each later layer has grown it
    since; replayed on that, CacheAttention raises), and the fused model fills its own cache as eager's."""
    torch.manual_seed(0)
    x = seeded(2, 5, 8, dtype=torch.float64, requires_grad=True)
    for use_cache in (True, False):
        model = CachedStack(use_cache).double().train()
        fused, plan = ol.fusion.fuse(model, (x,))
        assert [r["route"] for r in plan.routes if r["path"] in ("layers.0", "layers.1")] == ["fx", "fx"], plan.routes
        assert [d.route for d in plan.decisions if d.fused and d.pattern == "add_layer_norm"] == [
            "fx:layers.0", "fx:layers.1"]
        _assert_same(model, fused, x)


def test_the_replay_restores_the_cache_the_model_left_and_without_the_call_state_says_what_to_do():
    torch.manual_seed(0)
    layer = CachedLayer().double()
    h = seeded(2, 5, 8, dtype=torch.float64)
    cache = Cache()
    call = RecordedCall((h,), {"cache": cache}, ArgumentState([h, cache]))
    layer(h, cache=cache)
    cache.keys.append(h.clone())  # a later layer's keys
    grown = list(cache.keys)
    assert passes_through(layer, call, lambda: None) == ""
    assert len(cache.keys) == 2 and all(a is b for a, b in zip(cache.keys, grown))  # as the model left it
    why = passes_through(layer, ((h,), {"cache": cache}), lambda: None)  # replayed on the grown cache
    assert why.startswith("RuntimeError: the cache holds more keys"), why
    copied = pickle.loads(pickle.dumps(call))
    assert torch.equal(copied[0][0], h) and list(copied[1]) == ["cache"] and copied.state is None


def test_argument_state_restores_attributes_and_containers_by_reference_within_its_limit():
    class Holder:
        def __init__(self):
            self.items, self.table, self.count, self.inner = [torch.ones(2)], {"a": 1}, 0, types.SimpleNamespace(k=None)

    holder = Holder()
    first = holder.items[0]
    state = ArgumentState([holder, torch.zeros(1), 3])
    holder.items.append(torch.zeros(2))
    holder.items[0] = torch.full((2,), 5.0)
    holder.table["b"] = 2
    holder.count, holder.inner.k, holder.extra = 4, torch.ones(1), "new"
    state.restore()
    assert len(holder.items) == 1 and holder.items[0] is first and holder.table == {"a": 1}
    assert holder.count == 0 and holder.inner.k is None and not hasattr(holder, "extra")
    assert state.complete and not ArgumentState([[[i] for i in range(50)]], limit=10).complete
    assert ArgumentState([torch.ones(1), 2.0, "s", nn.Linear(1, 1)]).items == []


def test_a_wrapper_is_replayed_once_per_class_and_flags_and_only_where_a_chain_needs_the_region(monkeypatch):
    from opsnn_lab.fusion import regions

    replays = []
    real = regions.passes_through
    monkeypatch.setattr(regions, "passes_through", lambda m, *a: replays.append(m) or real(m, *a))
    model, x, fused, plan = _fuse(Layer)  # two layers of one class: one replay
    assert [type(m).__name__ for m in replays] == ["Layer"]
    assert [d.route for d in plan.decisions if d.fused and d.pattern == "add_layer_norm"] == [
        "fx:layers.0", "fx:layers.1"]
    replays.clear()
    model.layers[1].gradient_checkpointing = True  # another flag: replayed again (the rewrite then runs the original)
    ol.fusion.analyze(model, (x,))
    assert replays == [model.layers[0], model.layers[1]]
    replays.clear()

    class NothingToFuse(Layer):  # a wrapped forward whose code holds no chain that needs fx: not replayed
        @checkpointed
        def forward(self, x, **kwargs):
            return x + self.out(self.fc(x))

    model = Stack(Layer).double().train()
    model.layers[1] = NothingToFuse().double()
    plan = ol.fusion.analyze(model, (x,))
    assert replays == [model.layers[0]]  # the region of the first layer holds add_layer_norm, the second none
    assert {r["path"]: r["route"] for r in plan.routes if r["path"].startswith("layers.")} == {
        "layers.0": "fx", "layers.1": "fx"}
