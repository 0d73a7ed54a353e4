"""A region called with other plain arguments than its code was traced for is traced again for them.

Hugging Face code hands a layer ``attention_mask=None`` where no token is padding (the example batch usually has
none) and a tensor where a batch is padded. The region's code was traced for the example's values only, so every
padded batch ran the layer's original forward: BERT kept 0.83 of eager's activation bytes against 0.65.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab.bench import activation_bytes
from opsnn_lab.fusion.rewrite import FxForward
from opsnn_lab.testing import seeded
from tests.fusion._hf import transformers_with


class Layer(nn.Module):
    """Attention whose additive mask is None when nothing is padded (as Hugging Face code passes it), then a
    residual LayerNorm; ``slow=True`` calls with a flag whose branch fx cannot trace."""

    def __init__(self, d=16, p=0.1):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.drop, self.norm = nn.Dropout(p), nn.LayerNorm(d)

    def forward(self, x, mask=None, slow: bool = False, step: int = 0):
        q, k, v = (t.unflatten(-1, (2, -1)).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        scores = q @ k.transpose(-1, -2) * 0.25
        if mask is not None:
            scores = scores + mask
        out = (self.drop(torch.softmax(scores, -1)) @ v).transpose(1, 2).flatten(2)
        if slow:
            out = out * (2.0 if float(out.detach().abs().sum()) > 0 else 1.0)  # data-dependent: fx stops here
        return self.norm(x + out + step)


class Model(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(layers))

    def forward(self, x, keep=None, slow=False, step=0):
        if float(x.detach().abs().sum()) > 1e9:  # data-dependent: fx cannot trace this forward, the layers are regions
            x = x / 2
        mask = None if keep is None or bool(keep.all()) else (1.0 - keep[:, None, None, :].to(x.dtype)) * -1e4
        for layer in self.layers:
            x = layer(x, mask, slow, step)
        return x


def _fused():
    torch.manual_seed(0)
    model, x = Model().double().train(), seeded(2, 6, 16, dtype=torch.float64)
    keep = torch.ones(2, 6, dtype=torch.bool)
    fused, plan = ol.fusion.fuse(model, (x, keep))
    assert {d.route for d in plan.fused if d.pattern == "attention"} == {"fx:layers.0", "fx:layers.1"}
    for m in (model, fused):
        ol.consistency.make_reproducible(m, seed=2)
    return model, fused, x, keep


def _same(model, fused, *args):
    want, got = model(*args), fused(*args)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for w, g in zip(torch.autograd.grad(want.square().sum(), list(model.parameters())),
                    torch.autograd.grad(got.square().sum(), list(fused.parameters())), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def _regions(fused):
    return [p for p in ol.fusion.patches(fused).values() if isinstance(p, FxForward)]


def test_a_padded_batch_runs_the_region_traced_for_a_mask():
    model, fused, x, keep = _fused()
    padded = keep.clone()
    padded[0, -2:] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _same(model, fused, x, padded)
        _same(model, fused, x, keep)  # and the example's own values: the first code
    assert [list(r.alternates) for r in _regions(fused)] == [[(("slow", False), ("step", 0))]] * 2
    assert all(r.alternates[(("slow", False), ("step", 0))] is not None for r in _regions(fused))
    ratio = activation_bytes(lambda: fused(x, padded)) / activation_bytes(lambda: model(x, padded))
    assert ratio == pytest.approx(activation_bytes(lambda: fused(x, keep)) / activation_bytes(lambda: model(x, keep)),
                                  abs=0.05)
    assert ratio < 0.8  # fused: before, eager's bytes


def test_the_alternate_keeps_the_ops_and_follows_the_model():
    """Its ops are the first code's (one stream per dropout: the masks are eager's, above), a hook or a mode change
    reaches it as it reaches the first code, and the fused model pickles and copies with it."""
    model, fused, x, keep = _fused()
    padded = keep.clone()
    padded[1, -3:] = False
    fused(x, padded)
    for r in _regions(fused):
        (alt,) = r.alternates.values()
        assert {id(op) for op in alt.ops()} == {id(op) for op in r.ops()[:len(alt.ops())]}
    twin = torch.load(_saved(fused), weights_only=False)
    for m in (model, fused, twin):
        m.layers[0].drop.eval()  # another mode than the layer: runs unfused, as eager
        ol.consistency.make_reproducible(m, seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _same(model, fused, x, padded)
        model.set_step(0)
        _same(model, twin, x, padded)


def test_values_that_cannot_be_traced_run_unfused_with_a_warning_and_the_count_is_capped():
    model, fused, x, keep = _fused()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", RuntimeWarning)
        _same(model, fused, x, keep, True)
        _same(model, fused, x, keep, True)  # said once per region
    said = [str(w.message) for w in seen if "opsnn_lab.fusion" in str(w.message)]
    assert [m.split("`")[1] for m in said] == ["layers.0", "layers.1"], said
    assert "was fused for other arguments than this call's (`slow` False -> True), and its code cannot be traced" \
        in said[0]
    for step in range(1, 8):  # a plain argument taking many values: a few alternates, then the original forward
        _same(model, fused, x, keep, False, step)
    assert all(len(r.alternates) == FxForward.MAX_ALTERNATES for r in _regions(fused))


def _saved(module):
    import io

    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return buf


def test_a_region_pickled_before_alternates_existed_runs_its_original_forward_for_other_values():
    model, fused, x, keep = _fused()
    for r in _regions(fused):
        del r.__dict__["route"], r.__dict__["keys"], r.__dict__["alternates"]
    twin = torch.load(_saved(fused), weights_only=False)
    padded = keep.clone()
    padded[0, -1] = False
    ol.consistency.make_reproducible(twin, seed=2)
    _same(model, twin, x, padded)
    assert not any(r.alternates for r in _regions(twin))


class Halving:
    """An object argument whose class the code branches on (as Hugging Face code does on a cache's class)."""

    def scale(self, t):
        return t * 0.5


class ObjectLayer(Layer):
    def forward(self, x, mask=None, cache=None):
        h = super().forward(x, mask)
        return cache.scale(h) if isinstance(cache, Halving) else h


class ObjectModel(Model):
    def __init__(self):
        super().__init__(layers=1)
        self.layers = nn.ModuleList([ObjectLayer()])

    def forward(self, x, cache=None):
        if float(x.detach().abs().sum()) > 1e9:  # data-dependent: the layer is the region
            x = x / 2
        return self.layers[0](x, None, cache)


def test_an_object_argument_is_traced_with_its_class():
    """A call with an object where the example had None: the alternate is traced knowing the object's class, as
    the analysis traces its first code, so a branch on it is the one the call takes."""
    torch.manual_seed(0)
    model, x = ObjectModel().double().train(), seeded(2, 6, 16, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model, (x,))
    assert any(d.route == "fx:layers.0" for d in plan.fused)
    for m in (model, fused):
        ol.consistency.make_reproducible(m, seed=1)
    _same(model, fused, x, Halving())
    (alt,) = _regions(fused)[0].alternates.values()
    assert alt is not None


def test_tracing_a_call_leaves_the_random_state_the_call_draws_from():
    # a region traced for a call (here: use_cache=False, where the example passed a cache) runs its code on the
    # call's values to answer size questions; a router that draws noise (Phi-MoE's sparse mixer in training) drew
    # there, and the call's own draws moved: its layers routed other tokens than eager's (5e-2 apart)
    T = transformers_with("PhimoeConfig", "PhimoeForCausalLM")
    cfg = T.PhimoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg._attn_implementation = "eager"  # its attention regions trace then (the sweep's setting)
    torch.manual_seed(0)
    model = T.PhimoeForCausalLM(cfg).train()
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused, plan = ol.fusion.fuse(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    assert any(d.route.startswith("fx:model.layers") for d in plan.fused), plan.summary()
    losses = []
    for m in (model, fused):
        torch.manual_seed(3)
        out = m(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False)
        losses.append((out.loss, torch.rand(())))
    (want, after_want), (got, after_got) = losses
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert after_got == after_want  # the generator where eager leaves it
