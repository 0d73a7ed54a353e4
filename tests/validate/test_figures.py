"""Reading recorded figures back from an executed notebook (built by hand: no kernel needed)."""

import nbformat as nbf

from opsnn_lab.recording import RECORD_MIME
from opsnn_lab.validate import read_figures
from opsnn_lab.validate.figures import source_cell_indices


def record_output(name, value):
    return nbf.v4.new_output("display_data", data={RECORD_MIME: {"name": name, "value": value},
                                                   "text/plain": f"recorded {name} = {value}"})


def tagged(cell, tag):
    cell.metadata["tags"] = [tag]
    return cell


def executed_notebook():
    """What papermill writes after a failure: an error banner first, the injected cell after parameters."""
    nb = nbf.v4.new_notebook()
    first = nbf.v4.new_code_cell("ol.record('loss', 3.0)")
    first.outputs = [record_output("loss", 3.0), nbf.v4.new_output("stream", text="hello\n")]
    later = nbf.v4.new_code_cell("ol.record('loss', 2.5); ol.record('hist', [1, 2])")
    later.outputs = [record_output("loss", 2.5), record_output("hist", [1, 2]),
                     nbf.v4.new_output("execute_result", data={"text/plain": "2"}, execution_count=4)]
    odd = nbf.v4.new_code_cell("display(...)")
    odd.outputs = [nbf.v4.new_output("display_data", data={RECORD_MIME: {"value": 1}}),  # no name: ignored
                   nbf.v4.new_output("display_data", data={RECORD_MIME: "not a dict"})]
    nb.cells = [
        tagged(nbf.v4.new_markdown_cell("An Exception was encountered"), "papermill-error-cell-tag"),
        nbf.v4.new_markdown_cell("# title"),                              # source 0
        tagged(nbf.v4.new_code_cell("steps = 3"), "parameters"),          # source 1
        tagged(nbf.v4.new_code_cell("steps = 5"), "injected-parameters"),
        first,                                                            # source 2
        later,                                                            # source 3
        odd,                                                              # source 4
    ]
    return nb


def test_source_cell_indices_skip_cells_papermill_added():
    assert source_cell_indices(executed_notebook()) == [None, 0, 1, None, 2, 3, 4]


def test_read_figures_keeps_last_value_and_source_cell():
    figures = read_figures(executed_notebook())
    assert set(figures) == {"loss", "hist"}
    assert (figures["loss"].value, figures["loss"].cell, figures["loss"].times) == (2.5, 3, 2)
    assert (figures["hist"].value, figures["hist"].cell, figures["hist"].times) == ([1, 2], 3, 1)


def test_notebook_without_records_has_no_figures():
    nb = nbf.v4.new_notebook()
    nb.cells = [nbf.v4.new_code_cell("1 + 1")]
    assert read_figures(nb) == {}


def test_round_trip_through_the_ipynb_file(tmp_path):
    path = tmp_path / "out.ipynb"
    nbf.write(executed_notebook(), path)
    assert read_figures(nbf.read(path, as_version=4))["hist"].value == [1, 2]
