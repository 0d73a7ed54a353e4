"""The cost model's saved bytes agree with activation_bytes measured before/after apply (within 10%)."""

from __future__ import annotations

import pytest
import torch

import opsnn_lab as ol
from opsnn_lab.bench import activation_bytes
from opsnn_lab.models import Encoder, EncoderConfig, ResNet, ResNetConfig
from opsnn_lab.testing import seeded


def _measured(model, fused, inputs):
    # Parameters are not activations; excluding them by storage also drops saved views such as weight.t().
    before = activation_bytes(lambda: model(*inputs), exclude=tuple(model.parameters()))
    after = activation_bytes(lambda: fused(*inputs), exclude=tuple(fused.parameters()))
    return before, after


CASES = {
    "encoder": (lambda: Encoder(EncoderConfig.tiny(layers=2)),
                lambda: (torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0)),)),
    "resnet": (lambda: ResNet(ResNetConfig(width=8, blocks=(1, 1))), lambda: (seeded(2, 3, 24, 24),)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_saved_bytes_match_measurement(case):
    make, inputs = CASES[case]
    torch.manual_seed(0)
    model = make().train()
    fused, plan = ol.fusion.fuse(model, inputs())
    before, after = _measured(model, fused, inputs())
    assert plan.saved_bytes > 0
    assert abs(plan.saved_bytes - (before - after)) <= 0.1 * (before - after)
    assert abs(plan.activation_bytes - before) <= 0.01 * before  # the trace counts like activation_bytes
    assert plan.estimated_activation_bytes == plan.activation_bytes - plan.saved_bytes
    assert 0 < plan.activation_ratio < 1


def test_per_decision_costs_are_from_shapes():
    torch.manual_seed(0)
    model = Encoder(EncoderConfig.tiny(layers=2))
    small = ol.fusion.analyze(model, (torch.zeros(2, 8, dtype=torch.long),))
    large = ol.fusion.analyze(model, (torch.zeros(4, 8, dtype=torch.long),))
    mlp_small = next(d for d in small.decisions if d.pattern.startswith("linear_gelu"))
    mlp_large = next(d for d in large.decisions if d.pattern.startswith("linear_gelu"))
    assert mlp_large.saved_bytes == 2 * mlp_small.saved_bytes  # twice the batch, twice the bytes
    assert mlp_small.traffic_bytes > 0
    # a rejected chain saves nothing, except one declined for saving too little: it shows what it would save
    declined = [d for d in small.decisions if d.reason.startswith("not fused: saves")]
    assert [d.modules for d in declined] == [["embedding_norm"]]
    assert all(0 < d.saved_bytes < 0.1 * 2 * 8 * 32 * 4 for d in declined)
    rejected = [d for d in small.decisions if not d.fused and d not in declined]
    assert rejected and all(d.saved_bytes == 0 and d.traffic_bytes == 0 for d in rejected)
    assert small.traffic_bytes == sum(d.traffic_bytes for d in small.fused)
