"""ScalerTuner in JupyterLab: typing a new init scale into the slider replays the trace and redraws."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CELLS = [
    "import numpy as np\n"
    "from opsnn_lab.precision import GradientTrace\n"
    "from opsnn_lab.widgets import ScalerTuner\n"
    "amax = np.full(200, 2.0**-2)  # 2**-2 * 2**18 overflows fp16, * 2**16 does not\n"
    "amax[::50] = np.inf           # 4 non-finite steps: skipped at any scale\n"
    "tuner = ScalerTuner(GradientTrace.from_amax(amax), init_scale=2.0**20, growth_interval=20)\n"
    "tuner",
]


def test_init_scale_slider_replays_and_redraws(lab_notebook):
    nb = lab_notebook(cells=CELLS)
    page = nb.page
    page.wait_for_selector(".widget-slider", timeout=60_000)
    # attached, not visible: the overflow ceiling of a constant-amax trace is a flat line (zero-height box)
    page.wait_for_selector(".js-plotly-plot .scatterlayer path.js-line", state="attached", timeout=60_000)
    page.wait_for_function("() => document.body.innerText.includes('init_scale=2**20')", timeout=30_000)
    before = nb.plot_paths()
    text_before = page.locator(".widget-html").all_inner_texts()
    assert any("skipped" in t for t in text_before), text_before
    skipped_before = next(t for t in text_before if "skipped" in t)
    nb.screenshot("scaler_tuner_before")

    nb.set_slider(0, 10)  # init scale (log2): the first slider
    page.wait_for_function("() => document.body.innerText.includes('init_scale=2**10')", timeout=30_000)
    page.wait_for_function(
        "(old) => { const ps = [...document.querySelectorAll('.js-plotly-plot .scatterlayer path.js-line')];"
        " return ps.length > 1 && ps[1].getAttribute('d') !== old; }", arg=before[1], timeout=30_000)
    after = nb.plot_paths()
    assert after[1] != before[1], "the scale trajectory was not redrawn"
    assert len(after) == len(before), "a redraw must update the traces, not add new ones"
    skipped_after = next(t for t in page.locator(".widget-html").all_inner_texts() if "skipped" in t)
    # from 2**20 the scale backs off through overflowing steps; from 2**10 only the 4 Inf steps skip
    assert "4 skipped" in skipped_after and skipped_after != skipped_before
    nb.screenshot("scaler_tuner_after")
