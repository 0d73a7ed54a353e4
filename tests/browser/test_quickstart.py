"""The quickstart notebook in JupyterLab: widgets render and the slider drives the plot."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_quickstart_slider_redraws_plot(lab_notebook):
    nb = lab_notebook(REPO / "notebooks" / "00_quickstart.ipynb")
    page = nb.page
    page.wait_for_selector(".widget-slider", timeout=60_000)
    page.wait_for_selector(".js-plotly-plot .scatterlayer path.js-line", timeout=60_000)
    before = nb.plot_paths()
    assert before and all(before), "the loss plot drew no line"
    nb.screenshot("quickstart_before")
    nb.set_slider(0, 10)
    page.wait_for_function(
        "(old) => { const p = document.querySelector('.js-plotly-plot .scatterlayer path.js-line');"
        " return p && p.getAttribute('d') !== old; }", arg=before[0], timeout=30_000)
    after = nb.plot_paths()
    assert after != before
    # 10 points instead of 150: the redrawn path is much shorter
    assert len(after[0]) < len(before[0]) / 3
    # the label is its own widget message, which may arrive after the plot's on a loaded machine: wait for it
    page.wait_for_function(
        "() => { const h = document.querySelector('.widget-html');"
        " return h && h.innerText.includes('step 9'); }", timeout=30_000)
    assert "step 9" in page.locator(".widget-html").first.inner_text()
    nb.screenshot("quickstart_after")
