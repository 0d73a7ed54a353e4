"""The demo report opens from the file system and every plotly figure in it renders."""

from __future__ import annotations

from pathlib import Path

import pytest

from opsnn_lab.report import build_report

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_report_figures_render_offline(browser, tmp_path):
    index, pages = build_report([REPO / "notebooks" / "00_quickstart.ipynb"], tmp_path)
    assert not pages[0]["error"], pages[0]["error"]
    assert pages[0]["n_figs"] >= 1
    context = browser.new_context(viewport={"width": 1200, "height": 900}, offline=True)
    page = context.new_page()
    page.goto(index.as_uri())
    assert "final_loss" in page.content()
    page.click("text=00_quickstart")
    page.wait_for_load_state("load")
    figures = page.locator(".opsnn-figure")
    assert figures.count() == pages[0]["n_figs"]
    page.wait_for_function("() => [...document.querySelectorAll('.opsnn-figure')]"
                           ".every(d => d.querySelector('svg.main-svg .scatterlayer path'))", timeout=30_000)
    shots = REPO / "build" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shots / "report_quickstart.png"), full_page=False)
    context.close()
