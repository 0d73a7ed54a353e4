"""FusionExplorer in plain Python: toggles re-plan and redraw, the button applies and measures."""

from __future__ import annotations

import pytest
import torch

from opsnn_lab.fusion import FAMILIES
from opsnn_lab.models import Encoder, EncoderConfig, ResNet, ResNetConfig
from opsnn_lab.testing import seeded
from opsnn_lab.widgets import FusionExplorer
from opsnn_lab.widgets.fusion_explorer import PATTERN_COLORS, _family


@pytest.fixture(scope="module")
def resnet_explorer():
    torch.manual_seed(0)
    return FusionExplorer(ResNet(ResNetConfig(width=4, blocks=(1, 1))), seeded(2, 3, 16, 16))


def _trace(w, name):
    return next(t for t in w.figure.data if t.name == name)


def test_toggle_replans_and_redraws(resnet_explorer):
    w = resnet_explorer
    assert len(_trace(w, "fused: conv_bn_relu").x) == 10  # stem chain of 4 + two chains of 3
    rejected_before = len(_trace(w, "rejected (hover for why)").x)
    html_before = w.table.value
    w.pattern_boxes["conv_bn_relu"].value = False
    try:
        assert w.plan.summary()["conv_bn_relu"]["fused"] == 0
        assert len(_trace(w, "fused: conv_bn_relu").x) == 0
        assert len(_trace(w, "rejected (hover for why)").x) == rejected_before + 10
        assert "switched off" in w.table.value and w.table.value != html_before
        assert any("switched off" in h for h in _trace(w, "rejected (hover for why)").hovertext)
    finally:
        w.pattern_boxes["conv_bn_relu"].value = True
    assert len(_trace(w, "fused: conv_bn_relu").x) == 10


def test_rejections_carry_their_reason_on_hover(resnet_explorer):
    hovers = _trace(resnet_explorer, "rejected (hover for why)").hovertext
    assert any("feeds" in h and "not a ReLU" in h for h in hovers)


def test_button_applies_and_measures(resnet_explorer):
    w = resnet_explorer
    assert w.measurement is None
    w.apply_button.click()
    m = w.measurement
    assert m is not None and 0 < m.fused_bytes < m.eager_bytes
    assert m.eager_seconds > 0 and m.fused_seconds > 0 and m.max_abs_error < 1e-4
    assert "activation bytes" in w.measurements.value and "step time" in w.measurements.value
    assert not w.apply_button.disabled


def test_repeated_blocks_collapse():
    torch.manual_seed(0)
    w = FusionExplorer(Encoder(EncoderConfig.tiny(layers=4)), torch.zeros(1, 8, dtype=torch.long))
    blocks = _trace(w, "repeated block")
    assert list(blocks.text) == ["layers.1", "layers.2", "layers.3"]
    assert len(w.members["layers.2"]) > 20  # the whole layer folded into one node
    assert "layers.0.mlp.fc1" in w.members  # the first layer is drawn in full
    full = FusionExplorer(Encoder(EncoderConfig.tiny(layers=2)), torch.zeros(1, 8, dtype=torch.long),
                          collapse=False)
    assert len(_trace(full, "repeated block").x) == 0
    # every family the plan fused is drawn in its own legend entry (the norms and the head + loss too)
    fused = {d.pattern for d in full.plan.decisions if d.fused}
    assert {"layer_norm", "add_layer_norm"} & fused, fused
    drawn = {t.name.removeprefix("fused: ") for t in full.figure.data if t.name.startswith("fused: ") and len(t.x)}
    assert {_family(p) for p in fused} <= drawn, (fused, drawn)


def test_every_pattern_family_has_a_colour_of_its_own():
    assert set(PATTERN_COLORS) == set(FAMILIES)
    assert len(set(PATTERN_COLORS.values())) == len(PATTERN_COLORS)


def test_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        FusionExplorer("resnet", seeded(1, 3, 8, 8))
    with pytest.raises(TypeError, match="collapse"):
        FusionExplorer(ResNet(), seeded(1, 3, 8, 8), collapse="yes")
