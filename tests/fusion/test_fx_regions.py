"""A region rewritten by torch.fx keeps the contract of the forward it replaces: the arguments it specialised
(fx renames them: ``height`` -> ``height_1``), the class of a dict it returns (a Hugging Face ``ModelOutput``),
and the hooks of the submodules whose forwards its code runs inline."""

from __future__ import annotations

import copy
import functools
import inspect
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab._hooks import has_hooks
from opsnn_lab.fusion.rewrite import FxForward
from opsnn_lab.measuring import activation_bytes
from opsnn_lab.models import Encoder, EncoderConfig
from opsnn_lab.testing import AroundRegion, seeded


class Out(dict):
    """A dict subclass a forward returns (as ``ModelOutput`` is)."""


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * 0.5


class Block(nn.Module):
    """The residual add before the LayerNorm runs inline here, so only fx can fuse it (``add_layer_norm``)."""

    def __init__(self):
        super().__init__()
        self.inner = Scale()
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x, height: int, width: int):
        h = self.inner(x) * (height / width)
        return Out(out=self.head(self.ln(x + h)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        if x.sum() > 1e9:  # data-dependent: fx cannot trace the model, so `block` is the region
            x = x * 0.5
        return self.block(x, 4, 2)["out"]


def _fused(model, x):
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    assert [d.pattern for d in plan.decisions if d.fused] == ["add_layer_norm"]
    assert isinstance(fused.block.__dict__["forward"], FxForward)
    return fused


def test_specialised_arguments_reach_the_traced_code_and_the_output_keeps_its_class():
    torch.manual_seed(0)
    model, x = Model().double(), seeded(3, 5, 8, dtype=torch.float64)
    fused = _fused(model, x)
    out = fused.block(x, 4, 2)  # fx named the specialised ints height_1 / width_1: they are passed by position
    assert type(out) is Out and list(out) == ["out"]
    torch.testing.assert_close(out["out"], model.block(x, 4, 2)["out"], rtol=1e-12, atol=1e-12)
    other = fused.block(x, 6, 2)  # a value it was not specialised for: the original forward
    torch.testing.assert_close(other["out"], model.block(x, 6, 2)["out"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_hook_on_a_module_the_fx_code_would_inline_fires(when):
    torch.manual_seed(0)
    model, x = Model().double(), seeded(3, 5, 8, dtype=torch.float64, requires_grad=True)
    seen = []
    hook = lambda m, i, o: seen.append(o.detach().clone())  # noqa: E731
    if when == "before":  # the analysis sees it: the traced code calls `inner` instead of inlining it
        model.block.inner.register_forward_hook(hook)
    fused = _fused(model, x)
    forward = fused.block.__dict__["forward"]
    if when == "after":  # inlined by the traced code: the region runs its original forward from now on
        assert "inner" in forward.inlined[True]
        fused.block.inner.register_forward_hook(hook)
    else:
        assert "inner" not in forward.inlined[True]
    seen.clear()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = fused(x)
    said = [str(w.message) for w in said if issubclass(w.category, RuntimeWarning)]
    assert said == ([] if when == "before" else [  # the region's code is the original's again, and the user hears it
        "opsnn_lab.fusion: `block.inner` has a hook added after the region `block` was fused; it runs unfused (each "
        "module's own forward, so the hook sees the tensors it sees in eager) while the hook is there, and saves no "
        "memory. Fusing again with the hook in place plans around that module"])
    (grad_got,) = torch.autograd.grad(got.sum(), x)
    assert len(seen) == 1
    want = model.block.inner(x)
    torch.testing.assert_close(seen[0], want.detach(), rtol=0, atol=0)
    ref = model(x)
    (grad_ref,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_got, grad_ref, rtol=1e-12, atol=1e-12)


def test_opsnn_lab_own_hooks_do_not_make_a_region_fall_back():
    torch.manual_seed(0)
    model, x = Model().double(), seeded(3, 5, 8, dtype=torch.float64)
    fused = _fused(model, x)
    inlined = [fused.block.get_submodule(p) for p in fused.block.__dict__["forward"].inlined[True]]
    assert fused.block.inner in inlined
    ol.consistency.make_reproducible(fused, seed=1)  # names functional random calls with hooks on every module
    assert all(m._forward_hooks for m in inlined)
    assert not any(has_hooks(m) for m in inlined)  # passive: the fused code keeps running
    by_module = ol.fusion.activation_bytes_by_module(fused, (x,))  # measures with hooks on every module too
    assert sum(by_module.values()) > 0
    fused.block.inner.register_forward_hook(lambda m, i, o: None)
    assert has_hooks(fused.block.inner)


def test_hugging_face_hidden_states_and_attentions_from_a_fused_model_and_nothing_left_behind():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=32, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.ViTModel(cfg).double().train()
    x = seeded(2, 3, 16, 16, dtype=torch.float64)
    hooks_before = sum(len(m._forward_hooks) for m in model.modules())
    fused, plan = ol.fusion.fuse(model, {"pixel_values": x})
    assert any(d.fused for d in plan.decisions)
    # the output-capturing hooks the analysis installed for a while are gone: both models pickle
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks_before
    pickle.dumps(model)
    pickle.dumps(fused)
    for kw in ({}, {"output_hidden_states": True, "output_attentions": True}):
        want, got = model(pixel_values=x, **kw), fused(pixel_values=x, **kw)
        assert type(got) is type(want) and list(got.keys()) == list(want.keys())
        for key in want.keys():
            a, b = want[key], got[key]
            for t_a, t_b in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                torch.testing.assert_close(t_b, t_a, rtol=1e-12, atol=1e-12, msg=key)
            assert len(a if isinstance(a, tuple) else (a,)) == len(b if isinstance(b, tuple) else (b,)), key


def test_hugging_face_capture_hooks_left_after_a_call_asking_for_attentions_keep_the_regions_fused():
    """A call asking for attentions installs Hugging Face's capturing hooks for good, among them on the decoder
    layer's `encoder_attn`, which a decoder alone (BartForCausalLM) never calls, so the layer's fx code does not
    call it either: that region then ran its original forward on every later call (silently; with the hook check,
    with a warning). The hooks record only in a call that collects: that call runs the original and records, every
    other one the fused code, without a word."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.BartForCausalLM(cfg).double().train()
    ids = {"input_ids": torch.randint(3, 64, (2, 7))}
    fused, plan = ol.fusion.fuse(model, ids)
    layer = fused.model.decoder.layers[0]
    assert any(d.route == "fx:model.decoder.layers.0" for d in plan.fused)
    assert "encoder_attn" in layer.__dict__["forward"].inlined[True]
    fused_bytes = activation_bytes(lambda: fused(**ids).logits)
    assert fused_bytes < activation_bytes(lambda: model(**ids).logits)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        kw = {"output_hidden_states": True, "output_attentions": True}
        want, got = model(**ids, **kw), fused(**ids, **kw)
        assert has_hooks(layer.encoder_attn)  # installed by that call, and kept
        for key in ("logits", "attentions", "hidden_states"):
            a, b = want[key], got[key]
            assert len(a if isinstance(a, tuple) else (a,)) == len(b if isinstance(b, tuple) else (b,)), key
            for t_a, t_b in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                torch.testing.assert_close(t_b, t_a, rtol=1e-12, atol=1e-12, msg=key)
        assert activation_bytes(lambda: fused(**ids).logits) == fused_bytes
        torch.testing.assert_close(fused(**ids).logits, model(**ids).logits, rtol=1e-12, atol=1e-12)


class CachingBlock(Block):
    """Caches a tensor in ``self`` in eval mode, keyed by device (as LeViT's attention biases are)."""

    def __init__(self):
        super().__init__()
        self.cache = {}

    def forward(self, x, height: int, width: int):
        if not self.training:
            key = str(x.device)
            if key not in self.cache:
                self.cache[key] = self.inner.fc.bias * 0
            x = x + self.cache[key]
        return super().forward(x, height, width)


def test_tracing_leaves_no_fx_proxy_in_a_cache_the_forward_fills():
    torch.manual_seed(0)
    model, x = Model().double(), seeded(3, 5, 8, dtype=torch.float64)
    model.block = CachingBlock().double()
    fused = _fused(model, x)  # traced in train and in eval mode
    assert fused.block.cache == {} and model.block.cache == {}
    pickle.dumps(fused)  # a proxy left in the cache held the tracer, which does not pickle
    fused.eval()
    model.eval()
    torch.testing.assert_close(fused(x), model(x), rtol=1e-12, atol=1e-12)  # (the traced code recomputes it)


class WritesAfterTheChain(nn.Module):
    """A gated MLP inline in a traceable forward, then writes whose results the code ignores."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = (nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False),
                                         nn.Linear(16, 8, bias=False))

    def forward(self, x):
        y = self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))
        y.mul_(2.0)  # fx's dead-code rule called these pure and dropped them from the rewritten code
        y += 1.0
        torch.nn.functional.relu(y, inplace=True)
        return y


def test_writes_whose_result_is_ignored_survive_the_rewrite():
    torch.manual_seed(0)
    model, x = WritesAfterTheChain().double(), seeded(3, 5, 8, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    assert [(d.pattern, d.route) for d in plan.decisions if d.fused] == [("gated_mlp_silu", "fx:<model>")]
    want, got = model(x), fused(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (g_want,) = torch.autograd.grad(want.square().sum(), x)
    (g_got,) = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)


def _add_shortcut(x, shortcut):
    """Writes into ``x`` and returns None, as torchvision's MViT adds its pooled shortcut (a leaf for fx)."""
    x.add_(shortcut)


torch.fx.wrap("_add_shortcut")


class CallsForTheirEffect(nn.Module):
    """A residual add -> LayerNorm (a chain only fx rewrites) after a wrapped call whose result the code ignores."""

    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.out = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x) * 1.0
        _add_shortcut(h, x)
        return self.out(self.norm(h + x))


def test_a_call_whose_result_the_code_ignores_survives_the_rewrite():
    """fx's dead-code rule took the wrapped ``_add_shortcut`` (no reader, not named as in-place) for pure: the rewritten
    training code dropped it, and torchvision's MViT-V2 trained 0.94 off eager (its eval mode ran the original)."""
    torch.manual_seed(0)
    model, x = CallsForTheirEffect().double(), seeded(3, 5, 8, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    assert ("add_layer_norm", "fx:<model>") in [(d.pattern, d.route) for d in plan.decisions if d.fused]
    want, got = model(x), fused(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (g_want,) = torch.autograd.grad(want.square().sum(), x)
    (g_got,) = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)


class RankChecks(nn.Module):
    """Checks on its input's rank, as library layers make them (``x.dim()``, ``*x.shape[:-1]``): a plain fx
    trace stops at the first; the retry with the example's rank traces it, and a call of another rank runs
    the original forward (traced with a 3-D example, a 2-D call would skip the unsqueeze)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), nn.Dropout(0.0), nn.Linear(16, 8)

    def forward(self, x):
        if x.dim() == 2:
            x = x.unsqueeze(0)
        if x.is_nested:
            raise ValueError("x: nested tensors are not supported")
        lead = x.shape[:-1]
        y = self.fc2(self.drop(nn.functional.gelu(self.fc1(x))))
        return y.reshape(*lead, -1) * 2


class HoldsRankChecks(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = RankChecks()

    def forward(self, x):
        if x.sum() > 1e9:  # data-dependent: `block` is the region
            x = x * 0.5
        return self.block(x)


def _fused_block(holder):
    """``holder``'s model in float64, an input, the fused model and its ``block`` region (fx-rewritten MLP)."""
    torch.manual_seed(0)
    model, x = holder().double(), seeded(3, 5, 8, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    assert [(d.pattern, d.route) for d in plan.decisions if d.fused] == [("linear_gelu_dropout_linear", "fx:block")]
    return model, x, fused, next(r for r in plan.routes if r["path"] == "block")


def test_rank_checks_trace_with_the_example_rank_and_other_ranks_run_the_original():
    model, x, fused, region = _fused_block(HoldsRankChecks)
    assert region["route"] == "fx" and region["tensors"] == {"x": {"ndim": 3, "is_nested": False}}
    assert fused.block.__dict__["forward"].facts[True] == {"x": {"ndim": 3, "is_nested": False}}
    for mode in ("train", "eval"):
        model.train(mode == "train")
        fused.train(mode == "train")
        for inp in (x, seeded(5, 8, seed=1, dtype=torch.float64, requires_grad=True)):  # 3-D traced, 2-D guarded
            want, got = model(inp), fused(inp)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            (g_want,) = torch.autograd.grad(want.square().sum(), inp)
            (g_got,) = torch.autograd.grad(got.square().sum(), inp)
            torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)


def test_the_guard_compares_rank_and_nestedness_and_wants_a_tensor():
    from opsnn_lab.fusion.regions import facts_hold

    facts = {"x": {"ndim": 3, "is_nested": False}}
    assert facts_hold(facts, {"x": torch.zeros(1, 2, 3), "y": 1})
    assert not facts_hold(facts, {"x": torch.zeros(2, 3)})
    assert not facts_hold(facts, {"x": None})
    assert not facts_hold(facts, {})
    nested = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3)], layout=torch.jagged)
    assert not facts_hold(facts, {"x": nested})
    assert facts_hold({}, {})


class RankOfAnInnerValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), nn.Dropout(0.0), nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc1(x)
        if h.dim() != 3:  # the rank of a value the forward computed: answered from the example, and guarded
            raise ValueError("fc1 must give a 3-D value")
        return self.fc2(self.drop(nn.functional.gelu(h))) * 2


class RankOfAValueAfterAStep(RankOfAnInnerValue):
    def __init__(self, pre: nn.Module):
        super().__init__()
        self.pre = pre

    def forward(self, x):
        h = self.pre(x)
        if h.dim() != 3:  # after a step a call missing the guard would run again
            raise ValueError("fc1 must give a 3-D value")
        return self.fc2(self.drop(nn.functional.gelu(self.fc1(h)))) * 2


def test_rank_of_a_computed_value_is_the_examples_and_after_a_step_with_state_stops_the_tracer_and_says_where():
    torch.manual_seed(0)
    model = HoldsRankChecks().double()
    model.block = RankOfAnInnerValue().double()
    x = seeded(3, 5, 8, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    region = next(r for r in plan.routes if r["path"] == "block")
    assert region["route"] == "fx" and [a[2] for a in region["answers"]] == [False]
    torch.testing.assert_close(fused(x), model(x), rtol=1e-12, atol=1e-12)
    # after a dropout the rank is x's (a fact checked before the call runs): no guard, the MLP fuses
    model.block = RankOfAValueAfterAStep(nn.Dropout(0.1)).double()
    plan = ol.fusion.analyze(model.train(), (x,))
    region = next(r for r in plan.routes if r["path"] == "block")
    assert region["route"] == "fx" and region["tensors"]["x"]["ndim"] == 3
    # after a BatchNorm, which updates its statistics, the rank is not worked out: fx stops and says where
    model.block = RankOfAValueAfterAStep(nn.BatchNorm1d(5)).double()
    plan = ol.fusion.analyze(model.train(), (x,))
    region = next(r for r in plan.routes if r["path"] == "block")
    assert region["route"] == "untraceable"
    assert "if h.dim() != 3" in region["reason"] and "`pre` has buffers" in region["reason"], region["reason"]
    (mlp,) = [d for d in plan.decisions if d.pattern == "linear_gelu_dropout_linear"]
    assert not mlp.fused and "nor can fx trace `block`" in mlp.reason


def test_inference_in_eval_mode_runs_the_original_forward_and_training_without_grad_does_not():
    torch.manual_seed(0)
    model, x = HoldsRankChecks().double(), seeded(3, 5, 8, dtype=torch.float64)
    fused, _ = ol.fusion.fuse(model.train(), (x,))
    (slot,) = [m for n, m in fused.block.named_children() if n.startswith("fused_")]
    calls = []
    slot.register_forward_hook(lambda *_: calls.append(1))
    for training, grad, runs_fused in ((False, False, False), (False, True, True), (True, False, True)):
        model.train(training)
        fused.train(training)
        calls.clear()
        with torch.set_grad_enabled(grad):
            got, want = fused(x), model(x)
        assert len(calls) == runs_fused, (training, grad)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with torch.inference_mode():
        fused.eval()
        calls.clear()
        assert torch.equal(fused(x), model.eval()(x)) and not calls


def _scaled(x, scale=1.0, **unused):
    return x * scale


class TakesKwargs(nn.Module):
    """A forward that passes ``**kwargs`` on (Hugging Face attention: ``interface(..., **kwargs)``): a plain
    trace cannot unpack the ``**kwargs`` proxy; the retry takes the call's empty ``**kwargs`` as ``{}``, and a
    call that passes keywords runs the original forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), nn.Dropout(0.0), nn.Linear(16, 8)

    def forward(self, x, **kwargs):
        y = self.fc2(self.drop(nn.functional.gelu(self.fc1(x))))
        return Out(out=_scaled(y, **kwargs), rank=x.dim())


class HoldsTakesKwargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = TakesKwargs()

    def forward(self, x, **kwargs):
        if x.sum() > 1e9:  # data-dependent: `block` is the region
            x = x * 0.5
        return self.block(x, **kwargs)["out"]


def test_an_empty_kwargs_is_traced_as_empty_and_a_call_with_keywords_runs_code_traced_for_them():
    model, x, fused, region = _fused_block(HoldsTakesKwargs)
    assert region["tensors"]["kwargs"] == {"empty": True}
    forward = fused.block.__dict__["forward"]
    calls = []
    hook = fused.block.fused_linear_gelu_dropout_linear_0.register_forward_hook(lambda *_: calls.append(1))
    out = fused.block(x)
    assert type(out) is Out and out["rank"] == 3 and calls == [1]  # the traced code, its output class kept
    torch.testing.assert_close(out["out"], model.block(x)["out"], rtol=1e-12, atol=1e-12)
    got, want = fused(x, scale=3.0), model(x, scale=3.0)  # keywords: an alternate traced for them, fused too
    assert calls == [1, 1] and forward.facts[True]["kwargs"] == {"empty": True}
    assert len(forward.alternates) == 1
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (g_want,) = torch.autograd.grad(want.square().sum(), x)
    (g_got,) = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)
    hook.remove()
    restored = pickle.loads(pickle.dumps(fused))
    torch.testing.assert_close(restored(x), model(x), rtol=1e-12, atol=1e-12)


class HoldsScaledKwargs(HoldsTakesKwargs):
    """Passes plain values into the block's ``**kwargs`` (a mixture-of-experts layer's ``output_router_logits``)."""

    scale = 2.0

    def forward(self, x):
        if x.sum() > 1e9:
            x = x * 0.5
        return self.block(x, scale=self.scale)["out"]


def test_a_kwargs_of_plain_values_is_traced_as_constants_and_another_value_runs_code_traced_for_it():
    model, x, fused, region = _fused_block(HoldsScaledKwargs)
    assert region["tensors"]["kwargs"] == {"constant": {"scale": 2.0}}
    calls = []
    fused.block.fused_linear_gelu_dropout_linear_0.register_forward_hook(lambda *_: calls.append(1))
    for scale in (2.0, 3.0, 2):  # 2 (an int) is not the traced float: each value its own code, fused
        model.scale = fused.scale = scale
        calls.clear()
        got, want = fused(x), model(x)
        assert calls == [1], scale
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(fused.block.__dict__["forward"].alternates) == 2
    again = ol.fusion.apply(model, ol.fusion.analyze(model.train(), (x,)))  # from the plan's facts, JSON-safe
    torch.testing.assert_close(again(x), model(x), rtol=1e-12, atol=1e-12)


def _shifted(x, scale=1.0, shift=None, **unused):
    return x * scale + (0.0 if shift is None else shift)


class TakesTensorKwargs(TakesKwargs):
    def forward(self, x, **kwargs):
        y = self.fc2(self.drop(nn.functional.gelu(self.fc1(x))))
        return Out(out=_shifted(y, **kwargs), rank=x.dim())


class HoldsTensorKwargs(nn.Module):
    """Passes a tensor and a plain value into the block's ``**kwargs`` (Hugging Face layers: ``position_ids=``)."""

    def __init__(self):
        super().__init__()
        self.block = TakesTensorKwargs()
        self.shift = nn.Parameter(torch.linspace(-1, 1, 8))
        self.extra: dict = {}

    def forward(self, x):
        if x.sum() > 1e9:
            x = x * 0.5
        return self.block(x, scale=2.0, shift=self.shift * 1.0, **self.extra)["out"]


def test_a_kwargs_holding_tensors_is_read_from_the_call_and_other_keys_run_code_traced_for_them():
    model, x, fused, region = _fused_block(HoldsTensorKwargs)
    assert region["tensors"]["kwargs"] == {"constant": {"scale": 2.0}, "tensors": ["shift"]}
    calls = []
    hook = fused.block.fused_linear_gelu_dropout_linear_0.register_forward_hook(lambda *_: calls.append(1))
    for extra in ({}, {"flag": True}):  # another key: an alternate traced for it, fused too
        model.extra = fused.extra = extra
        calls.clear()
        got, want = fused(x), model(x)
        assert calls == [1], extra
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        g_want = torch.autograd.grad(want.sin().sum(), (x, model.shift))
        g_got = torch.autograd.grad(got.sin().sum(), (x, fused.shift))
        for a, b in zip(g_want, g_got):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    hook.remove()
    model.extra = fused.extra = {}
    torch.testing.assert_close(pickle.loads(pickle.dumps(fused))(x), model(x), rtol=1e-12, atol=1e-12)
    again = ol.fusion.apply(model, ol.fusion.FusionPlan.from_json(ol.fusion.analyze(model.train(), (x,)).to_json()))
    torch.testing.assert_close(again(x), model(x), rtol=1e-12, atol=1e-12)


def test_the_kwargs_guard_wants_the_keys_constants_and_tensors_it_was_traced_with():
    from opsnn_lab.fusion.regions import facts_hold

    facts = {"kwargs": {"constant": {"scale": 2.0}, "tensors": ["shift"]}}
    assert facts_hold(facts, {"kwargs": {"scale": 2.0, "shift": torch.zeros(3)}})
    assert not facts_hold(facts, {"kwargs": {"scale": 3.0, "shift": torch.zeros(3)}})
    assert not facts_hold(facts, {"kwargs": {"scale": 2.0, "shift": 1.0}})
    assert not facts_hold(facts, {"kwargs": {"scale": 2.0}})
    assert not facts_hold(facts, {"kwargs": {"scale": 2.0, "shift": torch.zeros(3), "more": 1}})


class Reverse(torch.autograd.Function):
    """The identity forward, the negated gradient backward (a gradient-reversal layer): fx traced its forward
    inline, and the rewritten model lost the backward."""

    @staticmethod
    def forward(ctx, x, weight):
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        return -grad, None


class ReversesThenNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.ln(x + Reverse.apply(self.fc(x), 2.0))  # residual add + LayerNorm inline: only fx fuses it


def test_a_custom_autograd_function_stays_one_call_and_keeps_its_backward():
    torch.manual_seed(0)
    model, x = AroundRegion(ReversesThenNorms()).double(), seeded(3, 5, 8, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    assert [(d.pattern, d.route) for d in plan.decisions if d.fused] == [("add_layer_norm", "fx:block")]
    code = fused.block.__dict__["forward"].variants[True].code
    assert "apply_function" in code and f"{__name__}:Reverse" in code
    want, got = model(x), fused(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_want = torch.autograd.grad(want.sin().sum(), (x, model.block.fc.weight))
    g_got = torch.autograd.grad(got.sin().sum(), (x, fused.block.fc.weight))
    for a, b in zip(g_want, g_got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    restored = pickle.loads(pickle.dumps(fused))
    torch.testing.assert_close(torch.autograd.grad(restored(x).sin().sum(), x)[0], g_want[0], rtol=1e-12, atol=1e-12)


class ByValue(nn.Module):
    """Routes by the values of its input (as a mixture-of-experts block does): fx cannot trace this forward."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h):
        return self.a(h) if h.sum() > 0 else self.b(h)


class RoutedLayer(nn.Module):
    """A pre-norm block around a child fx cannot trace: its residual add and norm are still the layer's own code."""

    def __init__(self):
        super().__init__()
        self.ln1, self.fc, self.ln2, self.route = nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8), ByValue()
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        h = x + self.fc(self.ln1(x))
        return h + self.out(self.route(self.ln2(h)))


class RoutedStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([RoutedLayer(), RoutedLayer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            if x.sum() > 1e9:  # data-dependent here too: the layers are the regions
                x = x * 0.5
        return x


def test_a_child_fx_cannot_trace_stays_one_call_and_the_code_around_it_is_rewritten():
    torch.manual_seed(0)
    model, x = RoutedStack().double(), seeded(3, 5, 8, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    routes = {r["path"]: r for r in plan.routes}
    assert [routes[f"layers.{i}"]["leaves"] for i in range(2)] == [["route"], ["route"]]
    assert routes["layers.0.route"]["route"] == "untraceable"  # visited as a region of its own: it stays as is
    assert [(d.pattern, d.modules[-1], d.route) for d in plan.decisions if d.fused and d.pattern.startswith("add")] \
        == [("add_layer_norm", f"layers.{i}.ln2", f"fx:layers.{i}") for i in range(2)]
    for sign in (1.0, -1.0):  # both branches of the child, which runs its own forward in the rewritten layer
        inp = (x.detach() * sign).requires_grad_()
        want, got = model(inp), fused(inp)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        g_want = torch.autograd.grad(want.sin().sum(), [inp, *model.parameters()], allow_unused=True)
        g_got = torch.autograd.grad(got.sin().sum(), [inp, *fused.parameters()], allow_unused=True)
        for a, b in zip(g_got, g_want):  # the branch not taken has no gradient, in both
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    again = ol.fusion.apply(model, ol.fusion.FusionPlan.from_json(plan.to_json()))
    torch.testing.assert_close(again(x), model(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pickle.loads(pickle.dumps(fused))(x), model(x), rtol=1e-12, atol=1e-12)


class PairByValue(ByValue):
    """Returns ``(tensor, None)``: kept as one call, the traced code would see a proxy where None is."""

    def forward(self, h):
        return super().forward(h), None


class PairLayer(RoutedLayer):
    def __init__(self):
        super().__init__()
        self.route = PairByValue()

    def forward(self, x):
        h = x + self.fc(self.ln1(x))
        y, extra = self.route(self.ln2(h))
        return h + self.out(y if extra is None else y + extra)


class LayerNorm1P(nn.LayerNorm):
    """A LayerNorm subclass with a forward of its own, ``(1 + weight)``, that fx cannot trace (Nemotron's norm)."""

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):  # fx cannot read a device type from a proxy
            return nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class OwnNormLayer(RoutedLayer):
    def __init__(self):
        super().__init__()
        self.ln2 = LayerNorm1P(8)

    def forward(self, x):  # the norm's output read by a Linear, which keeps it: an nn.LayerNorm here would fuse
        h = x + self.fc(self.ln1(x))
        return h + self.out(self.ln2(h))


class EvalStops(RoutedLayer):
    """Traces in train mode; in eval mode its forward branches on values, which the analysis never traced."""

    def __init__(self):
        super().__init__()
        self.route = nn.Linear(8, 8)

    def forward(self, x):
        h = x + self.fc(self.ln1(x))
        if not self.training and h.sum() > 1e9:
            h = h * 0.5
        return h + self.out(self.route(self.ln2(h)))


@pytest.mark.parametrize("layer, untraceable", [(PairLayer, True), (OwnNormLayer, False), (EvalStops, False)])
def test_children_fx_cannot_trace_are_kept_only_where_the_traced_code_stays_right(layer, untraceable):
    """A child returning more than one tensor is not kept as a call (its ``None`` would be a proxy); a LayerNorm
    subclass with its own forward, kept as a call, is not taken for an nn.LayerNorm but for what the run-time
    record found it to compute; a region whose eval-mode trace fails runs its original forward in eval mode."""
    torch.manual_seed(0)
    model = RoutedStack().double()
    model.layers = nn.ModuleList([layer(), layer()]).double()
    x = seeded(3, 5, 8, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    route = next(r for r in plan.routes if r["path"] == "layers.0")
    assert route["route"] == ("untraceable" if untraceable else "fx"), route
    if layer is OwnNormLayer:
        assert route["leaves"] == ["ln2"]
        # not an nn.LayerNorm by its class: the norm the run-time record found its ops to compute, (1 + weight)
        assert [(d.route, d.params) for d in plan.decisions if d.fused and d.pattern == "add_layer_norm"] == [
            (f"fx:layers.{i}", {"kind": "layer", "eps": 1e-5, "offset": 1.0}) for i in range(2)]
    for mode in ("train", "eval"):
        model.train(mode == "train")
        fused.train(mode == "train")
        want, got = model(x), fused(x)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        g_want = torch.autograd.grad(want.sin().sum(), [x, *model.parameters()], allow_unused=True)
        g_got = torch.autograd.grad(got.sin().sum(), [x, *fused.parameters()], allow_unused=True)
        for a, b in zip(g_got, g_want):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if layer is EvalStops:
        assert set(fused.layers[0].__dict__["forward"].variants) == {True}
    model.train()
    again = ol.fusion.apply(model, ol.fusion.FusionPlan.from_json(plan.to_json()))  # from the plan alone
    torch.testing.assert_close(again(x), model(x), rtol=1e-12, atol=1e-12)


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return (self.fc(x),)


class NamesAChildSelf(nn.Module):
    """A submodule named ``self`` (ConvBERT's ``attention.self``) that stays one call in the traced code (it has a
    hook, as Hugging Face's output capture puts there): fx names the result of that call ``self`` too, which
    would shadow the module in the code (``self.out`` on a tuple)."""

    def __init__(self):
        super().__init__()
        self.self, self.out, self.ln = _Inner(), nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.ln(x + self.out(self.self(x)[0]))


def test_a_child_named_self_keeps_the_traced_code_working():
    torch.manual_seed(0)
    model, x = NamesAChildSelf().double(), seeded(2, 3, 8, dtype=torch.float64, requires_grad=True)
    calls = []
    model.self.register_forward_hook(lambda *_: calls.append(1))
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    assert [d.pattern for d in plan.decisions if d.fused] == ["add_layer_norm"]
    assert "self.self(" in fused.__dict__["forward"].variants[True].code
    calls.clear()
    got = fused(x)
    assert calls == [1]  # the hook fired in the traced code
    want = model(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (g_got,) = torch.autograd.grad(got.square().sum(), x)
    (g_want,) = torch.autograd.grad(want.square().sum(), x)
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)


class _Rotate(nn.Module):
    """A function made a module (as Hugging Face's kernel-hub wrappers make ``apply_rotary_pos_emb`` one)."""

    def forward(self, x):
        return torch.cat([-x[..., 4:], x[..., :4]], dim=-1)


class HiddenHelperBlock(nn.Module):
    """Calls a stateless module kept out of the module tree (in a plain dict), with a residual add + LayerNorm
    inline: fx stopped at that call ("module is not installed as a submodule"), so nothing here fused."""

    def __init__(self, helper_params=False):
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)
        helper = _Rotate() if not helper_params else nn.Linear(8, 8)
        self.__dict__["_kernel_funcs"] = {"rotate": helper}

    def forward(self, x):
        return self.fc(self.ln(x + self._kernel_funcs["rotate"](x)))


@pytest.mark.parametrize("helper_params", [False, True])
def test_a_stateless_helper_module_outside_the_tree_is_traced_as_its_code(helper_params):
    model = HiddenHelperBlock(helper_params).train()
    x = seeded(3, 8, seed=1, requires_grad=True)
    fused, plan = ol.fusion.fuse(model, (x,))
    fused_patterns = [d.pattern for d in plan.decisions if d.fused]
    if helper_params:  # a helper with parameters is state fx code cannot name: still refused, with the reason
        assert "add_layer_norm" not in fused_patterns
        assert any("not installed as a submodule" in d.reason for d in plan.decisions if d.pattern == "add_layer_norm")
        return
    assert "add_layer_norm" in fused_patterns
    torch.testing.assert_close(fused(x), model(x))
    grads = [torch.autograd.grad(m(x).square().sum(), (x, m.fc.weight)) for m in (model, fused)]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a)


class Special:
    """An object argument (as a key/value cache is) whose class a forward branches on."""


class BranchesOnClass(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x, cache):
        h = self.fc(x) * (2.0 if isinstance(cache, Special) else 3.0)  # a plain fx proxy: never Special
        return self.ln(x + h)


class HoldsBranching(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = BranchesOnClass()

    def forward(self, x, cache):
        if x.sum() > 1e9:  # data-dependent: `block` is the region
            x = x * 0.5
        return self.block(x, cache)


def test_an_object_argument_keeps_its_class_in_the_traced_code_and_guards_the_rewrite():
    model = HoldsBranching().train()
    x = seeded(3, 8, seed=2, requires_grad=True)
    fused, plan = ol.fusion.fuse(model, (x, Special()))
    assert [d.pattern for d in plan.decisions if d.fused] == ["add_layer_norm"]
    for cache in (Special(), object()):  # the example's class: the traced code; another: the original forward
        torch.testing.assert_close(fused(x, cache), model(x, cache))
        grads = [torch.autograd.grad(m(x, cache).square().sum(), (x, m.block.fc.weight)) for m in (model, fused)]
        for a, b in zip(*grads):
            torch.testing.assert_close(b, a)


class ReadsBuffers(nn.Module):
    """A forward computing from its buffers (``order.flip(0)``, as timm's BEiT reshapes its relative-position index)
    and making constant tensors, in the region of an inline GELU chain (fx's)."""

    def __init__(self, scale_by_flag: bool = False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.register_buffer("order", torch.arange(8), persistent=False)
        self.register_buffer("flag", torch.tensor(False))
        self.scale_by_flag = scale_by_flag

    def forward(self, x):
        x = x[..., self.order.flip(0)]
        if self.scale_by_flag and self.flag:  # a branch on a buffer's value
            x = x * 2.0
        y = self.fc2(nn.functional.gelu(self.fc1(x)))
        two = torch.tensor([2.0], dtype=torch.float64)
        return y * two + torch.ones(8, dtype=torch.float64) - two  # one constant read twice


def _step(model, x):
    out = model(x)
    return [out, *torch.autograd.grad(out.sin().sum(), (x, model.block.fc1.weight, model.block.fc2.bias))]


def _same(model, fused, x):
    for a, b in zip(_step(model, x), _step(fused, x)):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_buffers_the_forward_computes_from_are_read_at_each_call_and_its_constants_stay_with_the_region():
    model, x = AroundRegion(ReadsBuffers()).double(), seeded(3, 8, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    assert [(d.pattern, d.route) for d in plan.decisions if d.fused] == [("linear_gelu_linear", "fx:block")]
    code = fused.block.__dict__["forward"].variants[True].code
    assert "self.order" in code and "flip" in code  # traced: not a constant made from the example's buffer
    _same(model, fused, x)  # before: AttributeError, the constants were left on the tracer's root
    for m in (model, fused):  # a buffer changed in place and one replaced: the traced code reads the new values
        m.block.order.copy_(torch.randperm(8, generator=torch.Generator().manual_seed(1)))
    _same(model, fused, x)
    for m in (model, fused):
        m.block.order = torch.arange(8).roll(3)
    _same(model, fused, x)
    for restored in (pickle.loads(pickle.dumps(fused)), __import__("copy").deepcopy(fused)):
        _same(model, restored, x)
    fused.eval()
    model.eval()
    _same(model, fused, x)  # eval with grad: the eval-mode code, with its own constants
    constants = [k for k in fused.block.__dict__ if k.startswith(ol.fusion.patch.CONSTANT)]
    assert len(constants) == 4  # two per mode (the one read twice kept once)
    ol.fusion.revert(fused)
    assert not [k for k in fused.block.__dict__ if k.startswith(ol.fusion.patch.CONSTANT)]
    _same(model, fused, x)


def test_a_branch_on_a_buffers_value_is_not_frozen_at_the_examples_value():
    model = AroundRegion(ReadsBuffers(scale_by_flag=True)).double()
    x = seeded(3, 8, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    for m in (model, fused):  # the user turns the flag on after fusing
        m.block.flag.fill_(True)
    _same(model, fused, x)  # before: the traced code had taken the example's False for good (output 2x off)
    route = next(r for r in plan.routes if r["path"] == "block")
    assert route["route"] != "fx" and "control flow" in route["reason"]


class CountsCalls(ReadsBuffers):
    """Updates a buffer in place in its forward (a step counter, a running average)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls.add_(1)
        return super().forward(x)


def test_a_buffer_the_forward_updates_in_place_moves_in_the_fused_model_as_in_eager():
    model = AroundRegion(CountsCalls()).double()
    x = seeded(3, 8, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    assert [(d.pattern, d.route) for d in plan.decisions if d.fused] == [("linear_gelu_linear", "fx:block")]
    start = int(model.block.calls)
    for _ in range(3):
        _same(model, fused, x)
    # before buffers were traced values the update ran once, at trace time, and the traced code had none
    assert int(fused.block.calls) == int(model.block.calls) == start + 3


class Noisy(nn.Module):
    """Conv -> BN -> inline ReLU (fused through fx code) plus noise drawn from plain sizes (``torch.rand(4, 1, 1)``):
    fx runs such a call once while it traces, and the code would replay that draw at every call."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)

    def forward(self, x):
        return nn.functional.relu(self.bn(self.conv(x))) + torch.rand(4, 1, 1) + torch.randn(1, dtype=x.dtype)


def test_a_random_factory_of_plain_sizes_draws_again_at_every_call_of_the_fused_code():
    torch.manual_seed(0)
    model, x = AroundRegion(Noisy()).train(), seeded(2, 4, 5, 5)
    fused, plan = ol.fusion.fuse(model, (x,))
    assert plan.summary()["conv_bn_relu"]["fused"] == 1 and isinstance(fused.block.__dict__["forward"], FxForward)
    assert not torch.equal(fused(x), fused(x))  # a fresh draw each call, as the model's own code makes
    eager = ol.consistency.make_reproducible(AroundRegion(Noisy()), 4)  # ... and the unfused model's draws
    eager.load_state_dict(model.state_dict())
    ol.consistency.make_reproducible(fused, 4)
    for _ in range(2):
        torch.testing.assert_close(fused(x), eager(x), rtol=1e-5, atol=1e-6)


class Reorder(nn.Module):
    """Conv -> BN -> inline ReLU, then rows put back in order by item assignment (``inv[perm] = arange``, as the
    grouped mixture-of-experts forward restores its token order): fx's proxy has no item assignment."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)

    def forward(self, x):
        y = nn.functional.relu(self.bn(self.conv(x)))
        perm = y.flatten(1).sum(1).argsort()
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return y[perm][inv] * 2


def test_item_assignment_is_one_call_of_the_traced_code_and_is_kept():
    torch.manual_seed(0)
    model, x = AroundRegion(Reorder()).double().train(), seeded(5, 4, 6, 6, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    assert plan.summary()["conv_bn_relu"]["fused"] == 1 and isinstance(fused.block.__dict__["forward"], FxForward)
    code = fused.block.__dict__["forward"].variants[True].code
    assert "setitem" in code  # the write survives dead-code elimination: its result is None, its effect is not
    x2 = seeded(7, 4, 6, 6, dtype=torch.float64)  # another batch: another permutation, computed at run time
    for inp in (x, x2):
        got, want = fused(inp), model(inp)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        g_got = torch.autograd.grad(got.square().sum(), list(fused.parameters()))
        g_want = torch.autograd.grad(want.square().sum(), list(model.parameters()))
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


class MaskedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x, mask=None):
        h = x + self.fc(x)  # inline residual add + LayerNorm: fx fuses it
        if mask is not None:
            h = h * mask
        return self.ln(h)


class BuildsAMaskWhenTraced(nn.Module):
    """Passes its block None, as Hugging Face's mask helpers do in eager where no token is padded, but builds a mask
    while fx traces (those helpers skip that shortcut under tracing). The block has a hook: a call, and a region."""

    def __init__(self):
        super().__init__()
        self.block = MaskedBlock()
        self.block.register_forward_hook(lambda *_: None)

    def forward(self, x):
        mask = torch.ones_like(x) if torch.fx._symbolic_trace.is_fx_tracing() else None
        return self.block(x, mask)


def test_a_parent_that_traced_would_call_its_child_region_otherwise_runs_its_own_forward():
    torch.manual_seed(0)
    model, x = BuildsAMaskWhenTraced().double(), seeded(2, 5, 8, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    routes = {r["path"]: r for r in plan.routes}
    assert routes[""]["route"] == "untraceable"
    assert "calls `block` with a computed value for `mask`, which the recorded call passed as None" in \
        routes[""]["reason"]
    assert routes["block"]["route"] == "fx"
    assert [(d.pattern, d.route) for d in plan.decisions if d.fused] == [("add_layer_norm", "fx:block")]
    (slot,) = [m for n, m in fused.block.named_children() if n.startswith("fused_")]
    calls = []
    slot.register_forward_hook(lambda *_: calls.append(1))
    torch.testing.assert_close(fused(x), model(x), rtol=1e-12, atol=1e-12)
    assert calls == [1]  # the block's fused op runs


class Annotated(nn.Module):
    """A forward annotated in a file with ``from __future__ import annotations`` (as this one is): its annotations
    are strings, which fx made globals of the traced code, and the fused model did not pickle (``torch.save``)."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc(x)
        return self.ln(x + (h if mask is None else h * mask))


def test_a_forward_with_string_annotations_is_rewritten_and_the_fused_model_pickles():
    torch.manual_seed(0)
    model, x = AroundRegion(Annotated()).double().train(), seeded(2, 3, 8, dtype=torch.float64)
    assert isinstance(inspect.signature(Annotated.forward).parameters["x"].annotation, str)
    fused, plan = ol.fusion.fuse(model, (x,))
    assert [d.pattern for d in plan.fused] == ["add_layer_norm"] and plan.fused[0].route.startswith("fx:")
    restored = pickle.loads(pickle.dumps(fused))
    torch.testing.assert_close(restored(x), model(x), rtol=1e-12, atol=1e-12)


class ReadsSettings(nn.Module):
    """A forward reading a plain attribute: the traced code holds ``alpha`` as a constant. (Its Dropout is called
    as a module there, which reads its p at every call.)"""

    def __init__(self):
        super().__init__()
        self.fc, self.ln, self.drop, self.alpha = nn.Linear(8, 8), nn.LayerNorm(8), nn.Dropout(0.0), 0.5

    def forward(self, x):
        return self.ln(x + self.alpha * self.drop(self.fc(x)))


def _encoder():
    cfg = EncoderConfig.tiny()
    torch.manual_seed(0)
    return Encoder(cfg).train(), torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("where", "name", "value"), [
    ("block", "alpha", 2.0),
    ("block.drop", "p", 0.3),  # read at every call: no change to see
    ("layers.0.attention.attn_dropout", "p", 0.0),  # the fused attention core absorbed it: the op holds 0.1
])
@pytest.mark.parametrize("reproducible", [False, True])
def test_a_setting_the_traced_code_holds_changed_after_fusion_runs_the_original_forward(where, name, value,
                                                                                      reproducible):
    """Changed after fusion, such a setting runs the region's original forward (with one warning) until it is set
    back; ``make_reproducible`` swapping a Dropout for its counter twin does not hide the change."""
    if where.startswith("block"):
        torch.manual_seed(0)
        model, x = AroundRegion(ReadsSettings()).double().train(), seeded(2, 3, 8, dtype=torch.float64)
    else:
        model, x = _encoder()
    fused, plan = ol.fusion.fuse(model, (x,))
    region = where.split(".")[0] if where.startswith("block") else "layers.0"
    assert f"fx:{region}" in {d.route for d in plan.fused}
    if reproducible:
        for m in (model, fused):
            ol.consistency.make_reproducible(m, 4)
        assert type(fused.get_submodule("block.drop" if region == "block" else where)) is ol.ops.Dropout
    fused_bytes, _ = activation_bytes(lambda: fused(x)), activation_bytes(lambda: model(x))  # a step each
    old = getattr(model.get_submodule(where), name)
    for m in (model, fused):
        setattr(m.get_submodule(where), name, value)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", RuntimeWarning)
        torch.manual_seed(1)
        got = fused(x)
    said = [str(w.message) for w in seen if "changed after" in str(w.message)]
    if name == "p" and region == "block":
        assert not said
    else:
        assert len(said) == 1 and f"`{where}` changed after the region `{region}` was fused (a setting changed: " \
            f"{name} {old!r} -> {value!r})" in said[0]
    torch.manual_seed(1)
    want = model(x)
    if reproducible or region == "block":  # (unseeded, the encoder's fused MLP draws from its own stream)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for m in (model, fused):
        setattr(m.get_submodule(where), name, old)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert activation_bytes(lambda: fused(x)) == fused_bytes


def test_a_module_the_traced_code_holds_replaced_after_fusion_runs_the_original_forward():
    """The fused add + LayerNorm holds ``ln``: a new LayerNorm put in its place went unseen."""
    torch.manual_seed(0)
    model, x = AroundRegion(ReadsSettings()).double().train(), seeded(2, 3, 8, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model, (x,))
    assert [d.pattern for d in plan.fused] == ["add_layer_norm"]
    new = nn.LayerNorm(8, eps=0.5).double()
    with torch.no_grad():
        new.weight.uniform_(0.5, 1.5)
    model.block.ln, fused.block.ln = new, copy.deepcopy(new)
    with pytest.warns(RuntimeWarning, match=r"`block.ln` changed after the region `block` was fused \(replaced by a "
                                            r"`LayerNorm`\)"):
        got = fused(x)
    torch.testing.assert_close(got, model(x), rtol=1e-12, atol=1e-12)


def _renamed_keyword(fn):
    """A decorator as transformers' ``deprecate_kwarg(..., expose_in_signature=True)``: the wrapper's signature
    shows a keyword-only ``past`` (the old name of ``cache``) that the wrapped function does not have."""
    @functools.wraps(fn)
    def wrapper(self, *args, past=None, **kwargs):
        if past is not None:
            kwargs["cache"] = past
        return fn(self, *args, **kwargs)

    params = list(inspect.signature(fn).parameters.values())
    wrapper.__signature__ = inspect.signature(fn).replace(
        parameters=[*params, inspect.Parameter("past", inspect.Parameter.KEYWORD_ONLY, default=None)])
    return wrapper


class RenamedKeywordLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    @_renamed_keyword
    def forward(self, x, extra=None, cache=None, use_cache: bool = True):
        h = self.fc2(F.gelu(self.fc1(x)))
        return h * 2 if use_cache else h


class CallsWithoutCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = RenamedKeywordLayer()

    def forward(self, x):
        if float(x.abs().sum()) > 1e9:  # data-dependent: fx cannot trace this forward, the layer is the region
            x = x / 2
        return self.layer(x, None, cache=None, use_cache=False)


def test_a_specialised_argument_reaches_the_traced_code_by_name_when_the_signatures_differ_in_length():
    """The region's arguments went to the traced code by position once the original signature had a parameter
    fx's code lacks (a decorator's keyword-only one: Bart's decoder layers): each specialised value was dropped
    and the traced code took its default, so ``use_cache`` specialised False failed fx's own check
    (``AssertionError: use_cache has been specialized to have value False``) on the fused model's first call,
    for any Bart-family model whose config says ``use_cache=False`` (as training scripts set it)."""
    torch.manual_seed(0)
    model, x = CallsWithoutCache().double().train(), seeded(3, 8, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model, (x,))
    assert [d.route for d in plan.fused] == ["fx:layer"]
    torch.testing.assert_close(fused(x), model(x), rtol=1e-12, atol=1e-12)
    assert activation_bytes(lambda: fused(x)) < activation_bytes(lambda: model(x))


def test_mbart_fused_with_use_cache_off_runs_and_matches_eager():
    """MBart's decoder calls its layers with the keyword the layer's decorator renames (``past_key_values``)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MBartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0, use_cache=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MBartForCausalLM(cfg).double().train()
    ids = {"input_ids": torch.randint(3, 64, (2, 7)), "labels": torch.randint(3, 64, (2, 7))}
    fused, plan = ol.fusion.fuse(model, ids)
    assert any(d.route == "fx:model.decoder.layers.0" for d in plan.fused)
    want, got = model(**ids), fused(**ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=1e-12)


def _attend(q, k, v, training, p):
    """Eager attention code as Hugging Face writes it: the output and the probabilities."""
    probs = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1)
    probs = F.dropout(probs, p, training)
    return probs @ v, probs


class TwoCores(nn.Module):
    """Two attention cores in one forward (DiffLlama's differential attention): one key, two chains; the first
    call's probabilities are returned, as its weights."""

    def __init__(self, d=16, p=0.0):
        super().__init__()
        self.p = p
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (2, -1)).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        o1, p1 = _attend(q, k, v, self.training, self.p)
        o2, _ = _attend(q, k, 2 * v, self.training, self.p)
        return self.o((o1 - 0.5 * o2).transpose(1, 2).flatten(2)), p1


class DropsTheWeights(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.attn = TwoCores(p=p)

    def forward(self, x):
        if float(x.abs().sum()) > 1e9:  # data-dependent: fx cannot trace this forward, the layer is the region
            x = x / 2
        return self.attn(x)[0]


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_two_chains_of_one_key_in_a_region_get_an_op_each(p):
    """Both cores have the key (attention, the module); the region's rewrite built one op for the key, so the
    second call got the first's (output, probabilities) tuple where its code reads a tensor (a TypeError; DiffLlama
    with ``use_cache=False``) and, with dropout, both drew from the first's stream. Each now has its own op."""
    torch.manual_seed(0)
    model, x = DropsTheWeights(p).double().train(), seeded(2, 12, 16, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model, (x,))
    cores = [d for d in plan.fused if d.pattern == "attention"]
    assert [(d.route, d.params["rng_name"]) for d in cores] == [("fx:attn", "attn:dropout.0"),
                                                               ("fx:attn", "attn:dropout.1")]
    for m in (model, fused):
        ol.consistency.make_reproducible(m, seed=5)
    want, got = model(x), fused(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grads = [torch.autograd.grad(out.square().sum(), list(m.parameters())) for out, m in ((want, model), (got, fused))]
    for g, w in zip(*reversed(grads), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert activation_bytes(lambda: fused(x)) < activation_bytes(lambda: model(x))


class ReturnsTheWeights(DropsTheWeights):
    def forward(self, x):
        if float(x.abs().sum()) > 1e9:
            x = x / 2
        return self.attn(x)  # the first core's probabilities leave the model: a loss may use them


def test_a_key_whose_region_code_would_fuse_a_site_the_record_turned_down_is_not_fused():
    """The first core's probabilities are read after the region (returned by the model), so the run-time record
    turns that site down; the region's code, which sees only its own output, finds both sites viable and fused them
    both, and a loss on those probabilities raised in backward (the op returns them for reading only)."""
    torch.manual_seed(0)
    model, x = ReturnsTheWeights(0.0).double().train(), seeded(2, 12, 16, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model, (x,))
    cores = [d for d in plan.decisions if d.pattern == "attention"]
    assert len(cores) == 2 and not any(d.fused for d in cores)
    assert "the code of `attn` holds 2 of its chains a call, and one of them is not viable" in cores[1].reason
    (want, want_p), (got, got_p) = model(x), fused(x)
    torch.testing.assert_close(got_p, want_p, rtol=1e-12, atol=1e-12)
    loss = [(o.square().sum() + p.square().sum()) for o, p in ((want, want_p), (got, got_p))]
    for g, w in zip(torch.autograd.grad(loss[1], list(fused.parameters())),
                    torch.autograd.grad(loss[0], list(model.parameters())), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


class TakesArgs(nn.Module):
    """diffusers' HunyuanVideo block: ``forward(self, x, y, mask=None, *args, **kwargs)``, called with more
    positional values than it names."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm, self.out = nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x, y, mask=None, *args, **kwargs):
        h = self.proj(x) + y
        return (self.out(self.norm(h)) + h) * args[1]


class PassesArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = TakesArgs()

    def forward(self, x, y):
        if float(x.sum()) > 1e9:  # data-dependent: the root is not traced, the block is
            y = y * 2
        return self.block(x, y, None, None, 3.0)


def test_extra_positional_values_reach_the_traced_codes_star_args():
    torch.manual_seed(0)
    model = PassesArgs().double().train()
    x, y = (torch.randn(4, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    fused, plan = ol.fusion.fuse(model, (x, y))
    assert [f"{d.pattern}@{d.route}" for d in plan.decisions if d.fused] == ["add_layer_norm@fx:block"]
    got, want = fused(x, y), model(x, y)  # the block raised "got multiple values for argument 'x'"
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grads = [torch.autograd.grad(out.square().sum(), [x, y]) for out in (want, got)]
    for g_want, g_got in zip(*grads):
        torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)
