"""Fusion with Hugging Face's gradient checkpointing on, enabled before ``fuse`` or after it (a Trainer with
``gradient_checkpointing=True`` enables it when training starts): the fused layers run under the same checkpoint,
their ops again in backward with the same dropout masks, every gradient is eager's, and the plan's figure is what a
checkpointed step keeps (a chain inside a checkpointed layer saves nothing across the step, and says so)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import opsnn_lab as ol
from opsnn_lab.demos import zoo
from opsnn_lab.measuring import activation_bytes
from tests.fusion._reproducible import assert_trains_as_eager

pytest.importorskip("transformers")


# transformers' "use_cache=True is incompatible with checkpointing"
pytestmark = pytest.mark.filterwarnings("ignore")


def _ops_called(model, monkeypatch) -> dict:
    """``{module the op is installed on: calls}`` of the model's fused ops from here on, counted at their classes (a
    hook on a module a traced region runs would make the region run unfused, as it should for a user's hook)."""
    from opsnn_lab.fusion.patch import patches

    names = {id(op): name for name, patch in patches(model).items() for op in patch.ops()}
    calls = {}
    for cls in {type(op) for patch in patches(model).values() for op in patch.ops()}:
        def counted(self, *args, _forward=cls.forward, **kwargs):
            name = names.get(id(self), "?")
            calls[name] = calls.get(name, 0) + 1
            return _forward(self, *args, **kwargs)
        monkeypatch.setattr(cls, "forward", counted)
    return calls


def _steps(models, inputs):
    out = []
    for m in models:
        ol.consistency.make_reproducible(m, seed=5)
        loss = m(**inputs).loss
        out.append((loss.detach(), torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)))
    return out


def _same_training(eager, fused, inputs):
    (loss_a, grads_a), (loss_b, grads_b) = _steps((eager, fused), inputs)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    largest = max(float(g.abs().max()) for g in grads_a if g is not None)
    for (name, _), a, b in zip(eager.named_parameters(), grads_a, grads_b):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * largest, msg=name)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_checkpointing_on_before_fuse_plans_what_a_step_keeps(name, monkeypatch):
    model, inputs = zoo.build(name, batch=2, seq=16, dropout=0.1)
    model.train().gradient_checkpointing_enable()
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), inputs)
    # weighed on what the layers compute (their recompute), not on the nothing a checkpointed trace sees
    names = {d.pattern for d in plan.fused}
    assert {"qkv", "add_rms_norm"} <= names and any(n.startswith("gated_mlp") for n in names), plan.summary()
    inside = [d for d in plan.fused if d.modules[0].startswith("model.layers.")]
    assert inside and all(d.saved_bytes == 0 and "runs under gradient checkpointing" in d.reason for d in inside)
    outside = [d for d in plan.fused if not d.modules[0].startswith("model.layers.")]
    assert outside and all(d.saved_bytes > 0 for d in outside)  # the final norm
    eager = activation_bytes(lambda: model(**inputs).loss, exclude=tuple(model.parameters()))
    measured = eager - activation_bytes(lambda: fused(**inputs).loss, exclude=tuple(fused.parameters()))
    assert plan.saved_bytes == measured > 0
    assert plan.activation_bytes == eager  # what the step keeps, the layers' inputs their checkpoints keep included
    assert all(m.gradient_checkpointing for m in model.model.layers)  # the flags as they were
    calls = _ops_called(fused, monkeypatch)
    loss = fused(**inputs).loss
    forward = dict(calls)
    loss.backward()
    in_layers = [n for n in forward if n.startswith("model.layers.")]
    assert "model.layers.0" in in_layers  # the layer's own region (its residual add + RMSNorm), checkpointed too
    assert all(calls[n] == 2 * forward[n] for n in in_layers), (forward, calls)  # again in backward
    _same_training(model, fused, inputs)


def test_checkpointing_enabled_after_fuse_runs_the_fused_layers_under_the_checkpoint(monkeypatch):
    model, inputs = zoo.build("gemma2", batch=2, seq=16, dropout=0.1)
    model.train()
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), inputs)
    assert any(d.pattern == "attention" for d in plan.fused)
    for m in (model, fused):
        m.gradient_checkpointing_enable()
    calls = _ops_called(fused, monkeypatch)
    loss = fused(**inputs).loss
    forward = dict(calls)
    loss.backward()
    # the decoder layers' own regions (their residual add + RMSNorm) and the attention regions inside them
    for region in ("model.layers.0", "model.layers.1", "model.layers.0.self_attn", "model.layers.1.self_attn"):
        assert forward.get(region) and calls[region] == 2 * forward[region], (region, forward, calls)
    eager_bytes = activation_bytes(lambda: model(**inputs).loss, exclude=tuple(model.parameters()))
    fused_bytes = activation_bytes(lambda: fused(**inputs).loss, exclude=tuple(fused.parameters()))
    assert fused_bytes < eager_bytes  # the layers still checkpointed: nothing of theirs kept, fused or not
    _same_training(model, fused, inputs)


def test_a_call_without_the_examples_cache_runs_code_traced_for_it(monkeypatch):
    # the example call hands each layer a cache object (use_cache defaults on); a training call with
    # use_cache=False hands it None: that call's code is traced for it, fused, not the original
    model, inputs = zoo.build("gemma2", batch=2, seq=16, dropout=0.0)
    model.train()
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), inputs)
    calls = _ops_called(fused, monkeypatch)
    out = fused(**inputs, use_cache=False)
    assert calls.get("model.layers.0") and calls.get("model.layers.0.self_attn"), calls
    torch.testing.assert_close(out.loss, model(**inputs, use_cache=False).loss, rtol=1e-6, atol=1e-6)


def test_a_model_fx_traces_whole_keeps_its_checkpointed_layers_out_of_that_trace(monkeypatch):
    # MegatronBert's model forward traces whole with the layers' flags off, not with them on: the regions are
    # traced as the rewrite traces them, flags on (before, the whole-model region failed its rewrite with a
    # warning and its chains ran unfused while the plan's figure went negative)
    from tests.fusion._hf import transformers_with

    T = transformers_with("MegatronBertForMaskedLM")
    torch.manual_seed(0)
    cfg = T.MegatronBertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, max_position_embeddings=64)
    model = T.MegatronBertForMaskedLM(cfg).train()
    ids = torch.randint(3, 100, (2, 8))
    inputs = {"input_ids": ids, "labels": ids}
    model.gradient_checkpointing_enable()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed rewrite warns
        fused, plan = ol.fusion.fuse(copy.deepcopy(model), inputs)
    in_layers = [d for d in plan.fused if d.pattern == "add_layer_norm" and ".layer." in d.modules[0]]
    assert len(in_layers) >= 2 and all("runs under gradient checkpointing" in d.reason for d in in_layers)
    eager = activation_bytes(lambda: model(**inputs).loss, exclude=tuple(model.parameters()))
    assert plan.saved_bytes == eager - activation_bytes(lambda: fused(**inputs).loss, exclude=tuple(fused.parameters()))
    assert plan.activation_bytes == eager
    calls = _ops_called(fused, monkeypatch)
    fused(**inputs).loss.backward()
    assert any(n.startswith("bert.encoder.layer.0") for n in calls), calls
    _same_training(model, fused, inputs)


def _swin(T):
    cfg = T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 1], num_heads=[2, 2], window_size=2,
                       num_labels=3, drop_path_rate=0.1, hidden_dropout_prob=0.1)
    images = {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([0, 2])}
    return T.SwinForImageClassification(cfg), images


def _yoso(T):
    cfg = T.YosoConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=64, use_expectation=True)
    ids = torch.randint(3, 100, (2, 8))
    return T.YosoForMaskedLM(cfg), {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("build", [_swin, _yoso], ids=["layers-in-checkpointed-stages", "autograd-function-saves"])
def test_what_a_checkpointed_layer_holds_is_dropped_with_it(build):
    # Swin checkpoints its stages and the layers inside them (an inner layer's inputs go with the stage's
    # activations); Yoso's attention is an autograd Function saving its own tensors, which no recorded op made:
    # counted as kept before (the plan's eager total 13.8 MB over a 21.8 MB step on Swin at 224 px)
    from tests.fusion._hf import transformers_with

    T = transformers_with("SwinForImageClassification", "YosoForMaskedLM")
    torch.manual_seed(0)
    model, inputs = build(T)
    model.train().gradient_checkpointing_enable()
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), inputs)
    assert plan.fused
    eager = activation_bytes(lambda: model(**inputs).loss, exclude=tuple(model.parameters()))
    assert plan.activation_bytes == eager
    assert plan.saved_bytes == eager - activation_bytes(lambda: fused(**inputs).loss, exclude=tuple(fused.parameters()))
    _same_training(model, fused, inputs)


class _Block(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1, self.act, self.drop, self.fc2 = (torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                                   torch.nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


class _Checkpointed(torch.nn.Module):
    """Blocks called through ``torch.utils.checkpoint`` in the model's own forward (as timm's
    ``set_grad_checkpointing()`` does), the last one not."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks[:-1]:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.blocks[-1](x)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_models_own_checkpoint_calls_are_analysed_as_they_compute(reentrant):
    torch.manual_seed(0)
    model = _Checkpointed(reentrant).double().train()
    x = torch.randn(2, 12, 16, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    mlps = [d for d in plan.decisions if d.pattern.startswith("linear_gelu")]
    assert len(mlps) == 3 and all(d.fused for d in mlps), [d.reason for d in mlps]  # weighed on what they compute
    inside = [d for d in mlps if not d.modules[0].startswith("blocks.2")]
    assert all(d.saved_bytes == 0 and "inside a torch.utils.checkpoint call" in d.reason for d in inside)
    assert [d for d in mlps if d.modules[0].startswith("blocks.2")][0].saved_bytes > 0
    # a residual add in one checkpointed block and the next block's norm: one op cannot run in both; and the model's
    # forward, which calls the checkpoint, is not traced whole (fx would record the blocks' ops inline, uncheckpointed)
    across = [d for d in plan.decisions if d.pattern == "add_layer_norm"]
    assert len(across) == 2 and not any(d.fused for d in across)
    assert all("calls torch.utils.checkpoint" in d.reason for d in across), [d.reason for d in across]
    eager = activation_bytes(lambda: model(x).sum(), exclude=tuple(model.parameters()))
    measured = eager - activation_bytes(lambda: fused(x).sum(), exclude=tuple(fused.parameters()))
    assert plan.saved_bytes == measured > 0 and plan.activation_bytes == eager
    import torch.utils.checkpoint as cp

    assert cp.CheckpointFunction.__name__ == "CheckpointFunction"  # put back
    assert_trains_as_eager(model, fused, x)


def test_a_chain_across_two_checkpointed_units_is_declined_with_both_named():
    from types import SimpleNamespace

    from opsnn_lab.fusion.checkpointing import crossing

    chain = SimpleNamespace(nodes=[SimpleNamespace(name="add"), SimpleNamespace(name="norm")])
    assert crossing(chain, {}) == "" and crossing(chain, {"add": 3, "norm": 3}) == ""
    why = crossing(chain, {"add": "model.layers.0"})
    assert why.startswith("not fused:") and "`model.layers.0`" in why and "outside any checkpoint" in why
    assert "torch.utils.checkpoint call 1" in crossing(chain, {"add": 1, "norm": 2})
