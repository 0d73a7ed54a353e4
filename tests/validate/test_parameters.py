"""The cell tagged ``parameters``: its names and defaults, ``-p`` values, and unknown names."""

import nbformat as nbf
import pytest

from opsnn_lab.validate import NotebookInputError
from opsnn_lab.validate.parameters import UNKNOWN, check_known, find_parameters_cell, parse_assignment


def notebook(params_source=None, *, kernel=None, language=None):
    nb = nbf.v4.new_notebook()
    cells = [nbf.v4.new_markdown_cell("# t"), nbf.v4.new_code_cell("import math")]
    if params_source is not None:
        cell = nbf.v4.new_code_cell(params_source)
        cell.metadata["tags"] = ["parameters"]
        cells.append(cell)
    nb.cells = cells + [nbf.v4.new_code_cell("x = 1")]
    if kernel:
        nb.metadata["kernelspec"] = {"name": kernel, "language": language, "display_name": kernel}
    return nb


@pytest.mark.parametrize("text, expected", [
    ("steps=20", ("steps", 20)),
    ("lr = 1e-3", ("lr", 1e-3)),
    ("dtype=float16", ("dtype", "float16")),
    ("dtype='float16'", ("dtype", "float16")),
    ("flag=true", ("flag", True)),
    ("flag=False", ("flag", False)),
    ("device=None", ("device", None)),
    ("sizes=[1, 2]", ("sizes", [1, 2])),
    ("path=/tmp/a=b", ("path", "/tmp/a=b")),
    ("empty=", ("empty", "")),
])
def test_parse_assignment(text, expected):
    assert parse_assignment(text) == expected


@pytest.mark.parametrize("text", ["steps", "=3", "2x=1", "a b=1"])
def test_parse_assignment_rejects_non_assignments(text):
    with pytest.raises(NotebookInputError, match="must look like name=value"):
        parse_assignment(text)


def test_defaults_come_from_the_tagged_cell():
    source = ("%matplotlib inline\nsteps = 20  # training steps\nlr: float = 1e-3\n"
              "device = 'cuda' if math.pi > 4 else 'cpu'\na, b = 1, 2\nsizes = [\n  1,\n  2,\n]\n")
    cell = find_parameters_cell(notebook(source), "nb.ipynb")
    assert cell.index == 2
    assert cell.defaults == {"steps": 20, "lr": 1e-3, "device": UNKNOWN, "a": UNKNOWN, "b": UNKNOWN,
                             "sizes": [1, 2]}
    assert cell.effective({"steps": 5}) == {"steps": 5, "lr": 1e-3, "sizes": [1, 2]}


def test_unknown_parameter_names_notebook_cell_and_suggestion():
    cell = find_parameters_cell(notebook("steps = 20\nlr = 0.1\n"), "nb.ipynb")
    check_known(cell, ["steps", "lr"])
    with pytest.raises(NotebookInputError) as info:
        check_known(cell, ["stepz"])
    assert str(info.value) == ("nb.ipynb: unknown parameter 'stepz': the cell tagged 'parameters' (cell 2) "
                               "assigns lr, steps; did you mean 'steps'?")


def test_notebook_without_parameters_cell_takes_no_parameters():
    cell = find_parameters_cell(notebook(None), "nb.ipynb")
    assert cell.index is None and cell.defaults == {}
    check_known(cell, [])
    with pytest.raises(NotebookInputError, match="nb.ipynb: unknown parameter 'steps': the notebook has no cell "
                                                  "tagged 'parameters'"):
        check_known(cell, ["steps"])


def test_invalid_python_in_parameters_cell_is_named():
    with pytest.raises(NotebookInputError, match=r"nb.ipynb: the cell tagged 'parameters' \(cell 2\) is not "
                                                  r"valid Python at its line 2"):
        find_parameters_cell(notebook("a = 1\nb = = 2\n"), "nb.ipynb")


def test_other_kernel_language_accepts_any_name():
    """papermill injects into R or Julia notebooks but reads assignments only in Python."""
    cell = find_parameters_cell(notebook("steps <- 20\n", kernel="ir", language="R"), "nb.ipynb")
    assert cell.index == 2 and not cell.inspectable
    check_known(cell, ["steps", "anything"])
    python = find_parameters_cell(notebook("steps = 2\n", kernel="python3", language="Python"), "nb.ipynb")
    assert python.inspectable and python.defaults == {"steps": 2}
