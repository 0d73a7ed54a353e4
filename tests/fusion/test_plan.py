"""FusionPlan as data: summary, totals, JSON round trip, HTML table."""

from __future__ import annotations

import html

import pytest
import torch

import opsnn_lab as ol
from opsnn_lab.fusion import Decision, FusionPlan
from opsnn_lab.models import ResNet, ResNetConfig
from opsnn_lab.testing import seeded


@pytest.fixture(scope="module")
def plan():
    torch.manual_seed(0)
    return ol.fusion.analyze(ResNet(ResNetConfig(width=8, blocks=(1, 1))), seeded(2, 3, 16, 16))


def test_summary_and_totals(plan):
    assert plan.summary() == {"conv_bn_relu_maxpool": {"fused": 1, "rejected": 0},
                              "conv_bn_relu": {"fused": 2, "rejected": 3}}
    assert plan.saved_bytes == sum(d.saved_bytes for d in plan.decisions if d.fused) > 0
    assert plan.activation_bytes > plan.estimated_activation_bytes > 0
    assert plan.analysis_seconds > 0
    assert "conv_bn_relu" in repr(plan) and "MiB" in repr(plan)


def test_json_round_trip(plan):
    back = FusionPlan.from_json(plan.to_json())
    assert back.decisions == plan.decisions
    assert back.routes == plan.routes and back.summary() == plan.summary()
    assert back.saved_bytes == plan.saved_bytes and back.graph["edges"] == plan.graph["edges"]
    with pytest.raises(ValueError, match="analyze"):
        back.replan(["qkv"])


def test_html_table_lists_every_decision(plan):
    page = plan._repr_html_()
    assert page.count("<tr style=") == len(plan.decisions)
    assert "feeds `stages.0.0.add`" in page.replace("&#x60;", "`")
    n_fused = sum(d.fused for d in plan.decisions)
    assert page.count("<td>fused</td>") == n_fused and page.count("<td>rejected</td>") == len(plan.decisions) - n_fused
    assert all(html.escape(d.reason) in page for d in plan.decisions if d.reason)  # every rejection says why
    assert page.count("<li>") == len(plan.routes)


def test_decision_key_and_graph(plan):
    d = plan.decisions[0]
    assert isinstance(d, Decision) and d.key == (d.pattern, tuple(d.modules))
    names = {n["name"] for n in plan.graph["nodes"]}
    assert {"conv1", "bn1", "relu", "maxpool"} <= names
    assert ["conv1", "bn1"] in plan.graph["edges"]
