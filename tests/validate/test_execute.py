"""Executing through papermill: a raising cell is named by its source index, with its traceback."""

import nbformat as nbf
import pytest

from opsnn_lab.validate import execute_notebook, read_figures


def write_notebook(path, *sources, parameters=None):
    nb = nbf.v4.new_notebook()
    nb.cells.append(nbf.v4.new_markdown_cell("# throwaway"))
    if parameters is not None:
        cell = nbf.v4.new_code_cell(parameters)
        cell.metadata["tags"] = ["parameters"]
        nb.cells.append(cell)
    nb.cells += [nbf.v4.new_code_cell(s) for s in sources]
    nbf.write(nb, path)
    return path


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """Executed once: cell 3 of the source raises after cell 2 recorded a figure."""
    root = tmp_path_factory.mktemp("broken")
    (root / "data.txt").write_text("from the notebook's folder")
    path = write_notebook(
        root / "broken.ipynb",
        "import opsnn_lab as ol\nol.record('steps', steps)\nol.record('data', open('data.txt').read())",
        "def inner():\n    return 1 / 0\n\ninner()",
        "ol.record('after', 1)",
        parameters="steps = 3")
    out = root / "out" / "broken.ipynb"
    out.parent.mkdir()
    return execute_notebook(path, out, {"steps": 5}), out


def test_raising_cell_is_named_by_source_index_with_traceback(broken):
    execution, _ = broken
    error = execution.error
    assert error is not None
    # source cells: 0 markdown, 1 parameters, 2 records, 3 raises; papermill's injected cell is not counted
    assert error.cell == 3 and error.execution_count == 4
    assert (error.ename, error.evalue) == ("ZeroDivisionError", "division by zero")
    assert error.summary() == "cell 3 (In [4]) raised ZeroDivisionError: division by zero"
    assert error.source.startswith("def inner():")
    assert "return 1 / 0" in error.traceback and "inner()" in error.traceback
    assert "\x1b[" not in error.traceback  # colours stripped for CI logs
    described = error.describe()
    assert described.splitlines()[0] == error.summary()
    assert "cell source:\n    def inner():" in described and "traceback:" in described


def test_figures_recorded_before_the_error_are_kept(broken):
    execution, out = broken
    figures = read_figures(execution.nb)
    assert figures["steps"].value == 5  # the -p value, injected after the parameters cell
    assert figures["data"].value == "from the notebook's folder"  # runs in the notebook's folder
    assert "after" not in figures
    assert out.exists() and read_figures(nbf.read(out, as_version=4))["steps"].value == 5
    assert execution.parameters == {"steps": 5} and execution.seconds > 0


def test_cell_timeout_names_the_running_cell(tmp_path):
    path = write_notebook(tmp_path / "slow.ipynb", "x = 1", "import time\ntime.sleep(60)")
    execution = execute_notebook(path, tmp_path / "out.ipynb", timeout=2)
    error = execution.error
    assert error is not None and error.cell == 2
    assert "Timeout" in error.ename or "timed out" in error.evalue.lower(), error
    assert error.source == "import time\ntime.sleep(60)"


def test_missing_kernel_fails_before_any_cell(tmp_path):
    path = write_notebook(tmp_path / "k.ipynb", "x = 1")
    execution = execute_notebook(path, tmp_path / "out.ipynb", kernel_name="no-such-kernel-opsnn")
    assert execution.error is not None and execution.error.cell is None
    assert execution.error.summary().startswith("execution failed: NoSuchKernel")
    assert "no-such-kernel-opsnn" in execution.error.evalue
    assert read_figures(execution.nb) == {}


def test_kernel_talks_over_ipc_without_a_tcp_warning(tmp_path, capfd):
    path = write_notebook(tmp_path / "ipc.ipynb", "import json, opsnn_lab as ol\n"
                          "from ipykernel.connect import get_connection_info\n"
                          "ol.record('transport', json.loads(get_connection_info())['transport'])")
    execution = execute_notebook(path, tmp_path / "out.ipynb")
    assert execution.error is None and read_figures(execution.nb)["transport"].value == "ipc"
    out, err = capfd.readouterr()
    assert "without encryption" not in out + err
