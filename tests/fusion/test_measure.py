"""measure() and activation_bytes_by_module(): the numbers the explorer and notebook show."""

from __future__ import annotations

import pytest
import torch

import opsnn_lab as ol
from opsnn_lab.bench import activation_bytes
from opsnn_lab.models import ResNet, ResNetConfig
from opsnn_lab.testing import seeded


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    model = ResNet(ResNetConfig(width=8, blocks=(1, 1))).train()
    x = seeded(2, 3, 16, 16)
    fused, plan = ol.fusion.fuse(model, x)
    return model, fused, plan, x


def test_measure_matches_activation_bytes(pair):
    model, fused, plan, x = pair
    m = ol.fusion.measure(model, fused, x, repeat=1)
    assert m.eager_bytes == activation_bytes(lambda: model(x), exclude=tuple(model.parameters()))
    assert m.fused_bytes == activation_bytes(lambda: fused(x), exclude=tuple(fused.parameters()))
    assert m.eager_bytes - m.fused_bytes == plan.saved_bytes
    assert m.activation_ratio == pytest.approx(m.fused_bytes / m.eager_bytes)
    assert m.max_abs_error < 1e-4 and m.eager_seconds > 0 and m.fused_seconds > 0
    assert set(m.to_dict()) >= {"eager_bytes", "fused_bytes", "activation_ratio", "speedup"}


def test_bytes_by_module_add_up_and_move_where_fused(pair):
    model, fused, _, x = pair
    before = ol.fusion.activation_bytes_by_module(model, x, depth=1)
    after = ol.fusion.activation_bytes_by_module(fused, x, depth=1)
    assert sum(before.values()) == activation_bytes(lambda: model(x), exclude=tuple(model.parameters()))
    assert sum(after.values()) == activation_bytes(lambda: fused(x), exclude=tuple(fused.parameters()))
    assert after["stages"] < before["stages"]  # the blocks' conv1-bn1-relu1 chains
    assert {"conv1", "bn1", "relu", "maxpool"} <= set(before)  # the stem, before fusion, per module
    deeper = ol.fusion.activation_bytes_by_module(model, x, depth=3)
    assert sum(deeper.values()) == sum(before.values()) and "stages.0.0" in deeper


def test_bad_arguments(pair):
    model, fused, _, x = pair
    with pytest.raises(TypeError, match="fused"):
        ol.fusion.measure(model, None, x)
    with pytest.raises(ValueError, match="repeat"):
        ol.fusion.measure(model, fused, x, repeat=0)
    with pytest.raises(ValueError, match="depth"):
        ol.fusion.activation_bytes_by_module(model, x, depth=0)
