"""FusionExplorer in JupyterLab: the graph renders, a pattern checkbox re-plans and redraws it."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CELLS = [
    "import torch\n"
    "from opsnn_lab.models import ResNet, ResNetConfig\n"
    "from opsnn_lab.widgets import FusionExplorer\n"
    "torch.manual_seed(0)\n"
    "explorer = FusionExplorer(ResNet(ResNetConfig(width=4, blocks=(1, 1))), torch.randn(2, 3, 16, 16), height=500)\n"
    "explorer",
]

# Drawn markers by fill colour (plotly leaves empty traces out of the DOM, so trace order is no guide).
COUNTS = """() => { const n = {};
    for (const p of document.querySelectorAll('.js-plotly-plot .scatterlayer path.point')) {
        const c = p.style.fill; n[c] = (n[c] || 0) + 1; }
    return n; }"""
FUSED_CONV, REJECTED = "rgb(31, 119, 180)", "rgb(214, 39, 40)"


def test_checkbox_replans_the_graph(lab_notebook):
    nb = lab_notebook(cells=CELLS)
    page = nb.page
    page.wait_for_selector(".js-plotly-plot .scatterlayer path.point", timeout=90_000)
    page.wait_for_selector(".widget-checkbox input[type=checkbox]", timeout=60_000)
    before = page.evaluate(COUNTS)
    assert before.get(FUSED_CONV) == 10, before  # conv_bn_relu chains: stem of 4 + two of 3
    assert "conv_bn_relu_maxpool" in page.locator(".widget-html").last.inner_text()
    nb.screenshot("fusion_explorer_before")
    box = page.locator(".widget-checkbox", has_text="conv_bn_relu").locator("input[type=checkbox]").first
    box.click()
    page.wait_for_function(f"() => !({COUNTS})()['{FUSED_CONV}']", timeout=60_000)
    after = page.evaluate(COUNTS)
    assert after[REJECTED] == before[REJECTED] + 10, (before, after)  # the chains are now drawn as rejected
    # the summary is a widget of its own, whose update may reach the page after the plot's (a loaded machine)
    page.wait_for_function("() => { const h = document.querySelectorAll('.widget-html');"
                           " return h.length && h[h.length - 1].innerText.includes('switched off'); }", timeout=60_000)
    nb.screenshot("fusion_explorer_after")
