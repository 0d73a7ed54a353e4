"""DivergenceViewer in JupyterLab: the error plot renders, the phase toggle and module filter redraw it."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CELLS = [
    "import torch\n"
    "from opsnn_lab.debug import ConsistencyChecker\n"
    "from opsnn_lab.models import EncoderConfig, MaskedTokenTask\n"
    "from opsnn_lab.widgets import DivergenceViewer\n"
    "task = MaskedTokenTask(batch_size=2, seq_len=8)\n"
    "torch.manual_seed(0)\n"
    "model = task.model(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))\n"
    "checker = ConsistencyChecker(dump_on_failure=False)\n"
    "nudge = 1e-4 * torch.randn(256, 64, generator=torch.Generator().manual_seed(1))\n"
    "for step in range(2):\n"
    "    if step:\n"
    "        with torch.no_grad():\n"
    "            model.layers[0].mlp.fc1.weight.add_(nudge)\n"
    "    model.zero_grad(set_to_none=True)\n"
    "    with checker.trace(model):\n"
    "        task.loss(model, task.batch(0)).backward()\n"
    "viewer = DivergenceViewer(checker.report)\n"
    "viewer",
]

POINTS = ("() => document.querySelectorAll('.js-plotly-plot .scatterlayer .trace')[0]"
          ".querySelectorAll('path.point').length")


def test_viewer_renders_and_controls_redraw(lab_notebook):
    nb = lab_notebook(cells=CELLS)
    page = nb.page
    page.wait_for_selector(".js-plotly-plot .scatterlayer path.js-line", state="attached", timeout=60_000)
    page.wait_for_function("() => document.body.innerText.includes('first forward divergence')", timeout=30_000)
    details = " ".join(page.locator(".widget-html").all_inner_texts())
    assert "layers.0.mlp.fc1" in details and "aten.addmm" in details and "reference" in details
    # the first divergence is drawn as its own (star) trace
    assert page.locator(".js-plotly-plot .scatterlayer .trace").count() >= 3
    forward_points = page.evaluate(POINTS)
    assert forward_points > 50
    before = nb.plot_paths()
    nb.screenshot("divergence_viewer_forward")

    page.locator(".widget-toggle-button", has_text="backward").click()
    page.wait_for_function(
        "(old) => { const p = document.querySelector('.js-plotly-plot .scatterlayer path.js-line');"
        " return p && p.getAttribute('d') !== old; }", arg=before[0], timeout=30_000)
    assert page.evaluate(POINTS) != forward_points

    box = page.locator(".widget-text input").first
    box.fill("layers.0.mlp.fc1")
    box.press("Enter")
    page.wait_for_function(f"() => ({POINTS})() < 10", timeout=30_000)
    assert 1 <= page.evaluate(POINTS) < 10
    nb.screenshot("divergence_viewer_backward_fc1")
