"""Report rendering: plotly outputs become offline figures, records reach the front page."""

from __future__ import annotations

import json
import re

import nbformat
import pytest

from opsnn_lab.recording import RECORD_MIME
from opsnn_lab.report import PLOTLY_MIME, WIDGET_MIME, build_report, main, recorded_figures


def _executed_notebook(path, fail: bool = False):
    nb = nbformat.v4.new_notebook()
    fig = {"data": [{"type": "scatter", "x": [0, 1], "y": [1, 0]}], "layout": {"title": {"text": "t"}}}
    out = nbformat.v4.new_output("display_data", data={PLOTLY_MIME: fig, WIDGET_MIME: {"model_id": "x"},
                                                       "text/plain": "FigureWidget"})
    rec = nbformat.v4.new_output("display_data", data={RECORD_MIME: {"name": "answer", "value": 42},
                                                       "text/plain": "recorded answer = 42"})
    cell = nbformat.v4.new_code_cell("fig", outputs=[out, rec])
    nb.cells = [cell]
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {"x": "y" * 1000}}}
    nbformat.write(nb, path)


def test_render_without_execution(tmp_path):
    build = tmp_path / "build"
    (build / "notebooks").mkdir(parents=True)
    src = tmp_path / "demo.ipynb"
    _executed_notebook(build / "notebooks" / "demo.ipynb")
    _executed_notebook(src)
    index, pages = build_report([src], build, execute=False)
    assert pages == [{"stem": "demo", "error": None, "n_figs": 1, "figures": {"answer": 42}}]
    page = (build / "report" / "demo.html").read_text()
    assert page.count("Plotly.newPlot") == 1 and '<script src="plotly.min.js">' in page
    assert "y" * 1000 not in page and not re.search(r"<script[^>]+src=\"https?:", page)
    assert (build / "report" / "plotly.min.js").stat().st_size > 1_000_000
    front = index.read_text()
    assert "answer" in front and "42" in front and 'href="demo.html"' in front


def test_recorded_figures_last_wins():
    nb = nbformat.v4.new_notebook()
    outs = [nbformat.v4.new_output("display_data", data={RECORD_MIME: {"name": "a", "value": v}}) for v in (1, 2)]
    nb.cells = [nbformat.v4.new_code_cell("", outputs=outs)]
    assert recorded_figures(nb) == {"a": 2}


def test_failing_notebook_still_rendered(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("raise RuntimeError('boom')")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    src = tmp_path / "broken.ipynb"
    nbformat.write(nb, src)
    index, pages = build_report([src], tmp_path / "build")
    assert pages[0]["error"] and "PapermillExecutionError" in pages[0]["error"]
    html = (tmp_path / "build" / "report" / "broken.html").read_text()
    assert "This notebook failed" in html and "boom" in html
    assert "failed" in index.read_text()


def test_main_rejects_missing_notebook(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "nope.ipynb")])
    assert exc.value.code == 2
    assert "nope.ipynb" in capsys.readouterr().err


def test_bench_headlines_on_front_page(tmp_path):
    build = tmp_path / "build"
    (build / "bench").mkdir(parents=True)
    (build / "bench" / "ops.json").write_text(json.dumps({"headline": {"mlp activation ratio": 0.42}}))
    (build / "notebooks").mkdir()
    _executed_notebook(build / "notebooks" / "demo.ipynb")
    index, _ = build_report([build / "notebooks" / "demo.ipynb"], build, execute=False)
    assert "mlp activation ratio" in index.read_text() and "0.42" in index.read_text()
