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


def _statuses(index_html: str) -> dict[str, str]:
    """``{stem: "ok, 4 figures, 1 plot"}`` as each notebook's heading on the front page reads."""
    return dict(re.findall(r'<h2><a href="([^"]+)\.html">[^<]*</a> <small class="[^"]*">([^<]*)</small>', index_html))


def _code_notebook(path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_failing_notebook_still_rendered_and_fails_the_command(tmp_path, capfd):
    bad = _code_notebook(tmp_path / "broken.ipynb", "x = 1", "raise RuntimeError('boom')")
    # the good notebook runs after the bad one and records the transport its kernel talks over
    good = _code_notebook(tmp_path / "good.ipynb", "import json, opsnn_lab as ol\n"
                          "from ipykernel.connect import get_connection_info\n"
                          "ol.record('transport', json.loads(get_connection_info())['transport'])")
    build = tmp_path / "build"
    assert main([str(bad), str(good), "--build", str(build)]) == 1
    out, err = capfd.readouterr()
    for stem in ("broken", "good"):
        assert (build / "report" / f"{stem}.html").exists() and (build / "notebooks" / f"{stem}.ipynb").exists()
    html = (build / "report" / "broken.html").read_text()
    assert "This notebook failed" in html and "boom" in html and "PapermillExecutionError" in html
    assert "This notebook failed" not in (build / "report" / "good.html").read_text()
    index = (build / "report" / "index.html").read_text()
    assert _statuses(index) == {"broken": "failed, 0 figures, 0 plots", "good": "ok, 1 figure, 0 plots"}
    assert re.search(r"^FAILED broken: .*PapermillExecutionError", out, re.MULTILINE)
    assert re.search(r"^ok +good: 1 figure, 0 plots$", out, re.MULTILINE)
    # kernels talk over Unix sockets: no "Kernel is running over TCP without encryption" per notebook
    assert recorded_figures(nbformat.read(build / "notebooks" / "good.ipynb", as_version=4)) == {"transport": "ipc"}
    assert "without encryption" not in out + err and "TCP" not in out + err


def test_main_exits_zero_when_every_notebook_is_ok(tmp_path):
    build = tmp_path / "build"
    (build / "notebooks").mkdir(parents=True)
    _executed_notebook(build / "notebooks" / "demo.ipynb")
    assert main([str(build / "notebooks" / "demo.ipynb"), "--build", str(build), "--no-execute"]) == 0
    assert _statuses((build / "report" / "index.html").read_text()) == {"demo": "ok, 1 figure, 1 plot"}


def test_index_counts_the_figures_it_shows(tmp_path):
    """The heading counts the rows of the table under it (recorded figures) and the page's plots."""
    build = tmp_path / "build"
    (build / "notebooks").mkdir(parents=True)
    nb = nbformat.v4.new_notebook()
    recs = [nbformat.v4.new_output("display_data", data={RECORD_MIME: {"name": f"r{i}", "value": i}})
            for i in range(4)]
    recs.append(nbformat.v4.new_output("display_data", data={RECORD_MIME: {"name": "r0", "value": 9}}))
    fig = {"data": [{"type": "bar", "x": [0], "y": [1]}], "layout": {}}
    plots = [nbformat.v4.new_output("display_data", data={PLOTLY_MIME: fig}) for _ in range(2)]
    nb.cells = [nbformat.v4.new_code_cell("", outputs=recs), nbformat.v4.new_code_cell("", outputs=plots)]
    nbformat.write(nb, build / "notebooks" / "four.ipynb")
    index, pages = build_report([build / "notebooks" / "four.ipynb"], build, execute=False)
    front = index.read_text()
    assert _statuses(front) == {"four": "ok, 4 figures, 2 plots"}
    table = front[front.index('href="four.html"'):front.index("<h2>Benchmarks")]
    assert table.count("<tr>") == 4 == len(pages[0]["figures"])


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
