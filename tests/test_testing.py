"""opsnn_lab.testing's ``reloaded``: a module reloaded under other environment variables for a while, then exactly
the module it was (the same class objects), so what was made before still pickles; and its helpers for comparing
fused with eager models (``projected_loss``, ``eager_without_dropout``, ``AroundRegion``)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import opsnn_lab.ops.gated_mlp as gm_ops
from opsnn_lab.testing import reloaded


def test_reloaded_restores_the_namespace_and_the_environment(monkeypatch):
    monkeypatch.delenv("OPSNN_TEST_FLAG", raising=False)
    before = gm_ops.FusedGatedMLP
    made = object.__new__(before)  # an object of the module's class, made before the reload
    with reloaded(gm_ops, OPSNN_TEST_FLAG="1") as module:
        assert module is gm_ops and os.environ["OPSNN_TEST_FLAG"] == "1"
        assert gm_ops.FusedGatedMLP is not before  # reloading made a new class
    assert gm_ops.FusedGatedMLP is before and "OPSNN_TEST_FLAG" not in os.environ
    assert type(pickle.loads(pickle.dumps(made))) is before  # pickled by class name: it resolves to the same class


def test_reloaded_restores_a_variable_that_was_set(monkeypatch):
    monkeypatch.setenv("OPSNN_TEST_FLAG", "kept")
    with reloaded(gm_ops, OPSNN_TEST_FLAG="1"):
        pass
    assert os.environ["OPSNN_TEST_FLAG"] == "kept"


def test_projected_loss_reaches_what_a_sum_cancels():
    from opsnn_lab.testing import projected_loss

    x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out = torch.nn.functional.batch_norm(x, None, None, training=True)
    (g_sum,) = torch.autograd.grad(out.sum(), x, retain_graph=True)
    (g_proj,) = torch.autograd.grad(projected_loss([out]), x)
    assert float(g_sum.abs().max()) < 1e-5 < float(g_proj.abs().min(dim=0).values.max())
    assert torch.equal(projected_loss([out, out.double()]), projected_loss([out, out.double()]))
    assert projected_loss([out]) != projected_loss([out], seed=2)


def test_eager_without_dropout_zeroes_every_dropout_in_every_sub_config():
    T = pytest.importorskip("transformers")
    from opsnn_lab.testing import eager_without_dropout

    cfg = T.CLIPConfig(text_config=dict(attention_dropout=0.3), vision_config=dict(dropout=0.2))
    cfg.stage_drop_rates = [0.1, 0.2]  # per-stage lists too (CvT's drop_path_rate)
    assert eager_without_dropout(cfg) is cfg
    for c in (cfg, cfg.text_config, cfg.vision_config):
        assert c._attn_implementation == "eager"
        drops = {k: v for k, v in vars(c).items() if "drop" in k.lower() and isinstance(v, (float, list))}
        assert drops and all(v in (0.0, [0.0, 0.0]) for v in drops.values()), drops


def test_eager_with_dropout_sets_every_dropout_and_drop_path_but_not_a_layer_drop():
    T = pytest.importorskip("transformers")
    from opsnn_lab.testing import eager_with_dropout

    cfg = T.BartConfig(dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.2)
    cfg.vision_config = T.ViTConfig(hidden_dropout_prob=0.0)
    cfg.drop_path_rates = [0.0, 0.3]
    assert eager_with_dropout(cfg, 0.1) is cfg
    assert (cfg.dropout, cfg.activation_dropout, cfg.drop_path_rates) == (0.1, 0.1, [0.1, 0.1])
    assert cfg.encoder_layerdrop == 0.0 and cfg.vision_config.hidden_dropout_prob == 0.1
    assert cfg._attn_implementation == cfg.vision_config._attn_implementation == "eager"


def test_around_region_makes_its_block_the_fx_region():
    import opsnn_lab as ol
    from opsnn_lab.testing import AroundRegion, seeded

    class AddNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.ln = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)

        def forward(self, x, scale=1.0):
            return self.ln(x + self.fc(x) * scale)  # the add runs inline: only fx can fuse it with the norm

    torch.manual_seed(0)
    model, x = AroundRegion(AddNorm()), seeded(2, 3, 8)
    plan = ol.fusion.analyze(model.train(), (x, 2.0))
    routes = {r["path"]: r["route"] for r in plan.routes}
    assert routes[""] == "untraceable" and routes["block"] == "fx"
    assert [(d.pattern, d.route) for d in plan.decisions if d.fused] == [("add_layer_norm", "fx:block")]
    torch.testing.assert_close(model(x, 2.0), model.block(x, 2.0))
