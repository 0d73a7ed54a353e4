"""torch.nn's own transformer modules (``nn.Transformer``, ``nn.TransformerEncoder``/``Decoder`` and their
layers) call their children's forwards: the analysis looks into them as into user code, so the norms, the
residual adds and the MLPs of a model built from them are candidates like anyone else's. The encoder layer's
checks on its input (``src.dim() == 3``, ``src.is_nested``) trace with the example's rank, so fx rewrites
its MLP and residual norms. Fused, the model gives eager's outputs and gradients in train and eval, with and
without masks, and on unbatched (2-D) input, which runs the layer's original forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab.bench import activation_bytes
from opsnn_lab.fusion.graph import is_leaf_module

D, HEADS, FF = 32, 4, 64


def _encoder(norm_first: bool) -> nn.Module:
    layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=norm_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _grads(model, *args, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(*args, **kwargs)
    out.sin().sum().backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def _assert_same(model, fused, *args, **kwargs):
    out_a, grads_a = _grads(model, *args, **kwargs)
    out_b, grads_b = _grads(fused, *args, **kwargs)
    torch.testing.assert_close(out_b, out_a, rtol=1e-12, atol=1e-12)
    assert grads_a.keys() == grads_b.keys()
    for key, g in grads_a.items():
        torch.testing.assert_close(grads_b[key], g, rtol=1e-10, atol=1e-12, msg=key)


def test_composites_are_looked_into_and_multihead_attention_stays_one_op():
    composites = (nn.Transformer(D, HEADS, 1, 1, FF, batch_first=True), _encoder(False),
                  nn.TransformerDecoderLayer(D, HEADS, FF))
    for module in composites:
        assert not is_leaf_module(module)
    assert is_leaf_module(nn.MultiheadAttention(D, HEADS))  # reads out_proj's weight without calling it
    assert is_leaf_module(nn.LayerNorm(D))


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_fuses_its_mlp_and_residual_norms(norm_first):
    torch.manual_seed(0)
    model = _encoder(norm_first).double()
    x = torch.randn(2, 7, D, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    done = [(d.pattern, d.modules[-1], d.route) for d in plan.decisions if d.fused]
    norm = "norm2" if norm_first else "norm1"  # the residual norm a Linear (or the attention) reads
    # the encoder traces whole: the second layer's rank checks read a value the first computed after its dropouts,
    # and the argument's rank decides them (checked before the call runs); its one other guard follows a draw, so
    # the region keeps torch's generators at each call and puts them back before a miss runs the original
    assert done == [("linear_gelu_dropout_linear", f"layers.{i}.linear2", "fx:<model>") for i in range(2)] + \
        [("add_layer_norm", f"layers.{i}.{norm}", "fx:<model>") for i in range(2)]
    routes = {r["path"]: r for r in plan.routes}
    assert routes[""]["route"] == "fx" and routes[""]["leaves"] == [] and len(routes) == 1
    assert routes[""]["tensors"]["src"] == {"ndim": 3, "is_nested": False}
    assert fused.forward.restore_rng == {True: True}
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    _assert_same(model, fused, x)
    _assert_same(model, fused, x, src_key_padding_mask=pad)
    _assert_same(model, fused, x[0])  # unbatched: another rank than traced, the original forward
    model.eval()
    fused.eval()
    _assert_same(model, fused, x, src_key_padding_mask=pad)
    with torch.no_grad():  # inference: the original forward, the encoder's fast path included, eager's bits
        assert torch.equal(fused(x), model(x))
    eager = activation_bytes(lambda: model.train()(x), exclude=tuple(model.parameters()))
    ours = activation_bytes(lambda: fused.train()(x), exclude=tuple(fused.parameters()))
    assert ours < eager


def test_transformer_decoder_layers_fuse_their_mlp_and_residual_norms():
    torch.manual_seed(0)
    model = nn.Transformer(D, HEADS, 1, 1, FF, dropout=0.0, batch_first=True).double()
    src = torch.randn(2, 8, D, dtype=torch.float64)
    tgt = torch.randn(2, 5, D, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model.train(), (src, tgt))
    done = [(d.pattern, d.modules[-1], d.route) for d in plan.decisions if d.fused]
    # the model traces whole: its check that source and target batches agree (``src.size(1) != tgt.size(1)``) is
    # answered from the example and guarded (fusion/specialise.py); its layers see inputs of the example's rank
    assert done == [("linear_relu_dropout_linear", "encoder.layers.0.linear2", "fx:<model>"),
                    ("linear_relu_dropout_linear", "decoder.layers.0.linear2", "fx:<model>"),
                    ("add_layer_norm", "encoder.layers.0.norm1", "fx:<model>"),
                    ("add_layer_norm", "encoder.layers.0.norm2", "fx:<model>"),
                    ("add_layer_norm", "decoder.layers.0.norm2", "fx:<model>"),
                    ("add_layer_norm", "decoder.layers.0.norm3", "fx:<model>")]
    assert next(r for r in plan.routes if r["path"] == "")["answers"]
    mask = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    _assert_same(model, fused, src, tgt)
    _assert_same(model, fused, src, tgt, tgt_mask=mask, tgt_is_causal=True)
    _assert_same(model, fused, src[0], tgt[0])  # unbatched: the original forwards
    model.eval()
    fused.eval()
    _assert_same(model, fused, src, tgt, tgt_mask=mask)
    model.train()
    fused.train()
    eager = activation_bytes(lambda: model(src, tgt), exclude=tuple(model.parameters()))
    ours = activation_bytes(lambda: fused(src, tgt), exclude=tuple(fused.parameters()))
    assert ours < eager
    assert plan.saved_bytes == eager - ours
