"""The pytest plugin: ``pytest notebooks/`` gives one test per figure; a failure says which and by how much."""

from importlib.metadata import entry_points

import nbformat as nbf
import pytest

pytest_plugins = ["pytester"]

PLUGIN = "opsnn_lab.pytest_plugin"
# once pyproject registers the pytest11 entry point, loading it again with -p would register it twice
AUTOLOADED = any(ep.value == PLUGIN for ep in entry_points(group="pytest11"))
LOAD = [] if AUTOLOADED else ["-p", PLUGIN]


def write_notebook(folder, name, *sources, expect):
    nb = nbf.v4.new_notebook()
    cell = nbf.v4.new_code_cell("steps = 2")
    cell.metadata["tags"] = ["parameters"]
    count = nbf.v4.new_code_cell(f"with open('runs.txt', 'a') as f:\n    f.write('{name}\\n')")
    nb.cells = [cell, count, *(nbf.v4.new_code_cell(s) for s in sources)]
    nb.metadata["kernelspec"] = {"name": "python3", "language": "python", "display_name": "Python 3"}
    folder.mkdir(parents=True, exist_ok=True)
    nbf.write(nb, folder / f"{name}.ipynb")
    if expect is not None:
        (folder / f"{name}.expect.toml").write_text(expect)


def good(folder):
    write_notebook(folder, "good", "import opsnn_lab as ol\nol.record('loss', 1.02)\nol.record('steps', steps)",
                   expect="[figures.loss]\nvalue = 1.0\nrel = 0.05\n[figures.steps]\nvalue = 2\n"
                          "[variants.long]\nparameters = {steps = 50}\n[variants.long.figures.speed]\nmin = 1\n")


def bad(folder):
    write_notebook(folder, "bad", "import opsnn_lab as ol\nol.record('loss', 1.5)\nol.record('ratio', 0.25)\n"
                   "ol.record('extra', 7)",
                   "raise RuntimeError('boom')", "ol.record('late', 1)",
                   expect="[figures.loss]\nvalue = 1.0\nrel = 0.1\n[figures.ratio]\nmax = 0.5\n"
                          "[figures.late]\nmin = 0\n")


def test_one_test_per_figure_executing_each_notebook_once(pytester):
    good(pytester.path / "notebooks")
    bad(pytester.path / "notebooks")
    write_notebook(pytester.path / "notebooks", "plain", "x = 1", expect=None)  # no expectations: not collected
    result = pytester.runpytest(*LOAD, "notebooks", "-rf", "--junitxml=report.xml",
                                "--opsnn-output-dir", "executed")
    result.assert_outcomes(passed=4, failed=3, warnings=1)
    text = result.stdout.str()
    assert "\nfigure 'loss' is out of tolerance: got 1.5, expected 1.0 with tolerance rel 0.1: " \
           "off by +0.5 (+0.5 relative), allowed +-0.1" in text
    assert "expected 1.0 | got 1.5 | tolerance rel 0.1  (check at " in text
    assert "\nfigure 'late' was never recorded (execution stopped at cell 3 (In [4]))" in text
    assert "\ncell 3 (In [4]) raised RuntimeError: boom" in text
    assert "raise RuntimeError('boom')" in text  # the failing cell's source and traceback
    assert "FAILED notebooks/bad.ipynb::execute - cell 3 (In [4]) raised RuntimeError: boom" in text
    assert "FAILED notebooks/bad.ipynb::loss - figure 'loss' is out of tolerance" in text
    assert "FAILED notebooks/bad.ipynb::late - figure 'late' was never recorded" in text
    assert "UncheckedFigureWarning: bad.ipynb recorded 'extra' = 7 but" in text
    runs = (pytester.path / "notebooks" / "runs.txt").read_text().split()
    assert sorted(runs) == ["bad", "good"]  # one execution per notebook, shared by its figure tests
    assert sorted(p.name for p in (pytester.path / "executed" / "notebooks").iterdir()) == ["bad.ipynb", "good.ipynb"]
    report = (pytester.path / "report.xml").read_text()
    assert report.count("<testcase ") == 7 and 'name="loss"' in report


def test_collection_lists_execute_and_expected_figures(pytester):
    good(pytester.path / "nb")
    write_notebook(pytester.path / "nb" / ".ipynb_checkpoints", "good", "x = 1", expect="[figures.a]\nmax = 1\n")
    result = pytester.runpytest(*LOAD, "nb", "--collect-only", "-q")
    result.stdout.fnmatch_lines(["nb/good.ipynb::execute", "nb/good.ipynb::loss", "nb/good.ipynb::steps",
                                 "3 tests collected*"])
    variant = pytester.runpytest(*LOAD, "nb", "--collect-only", "-q", "--opsnn-variant", "long")
    variant.stdout.fnmatch_lines(["nb/good.ipynb::execute", "nb/good.ipynb::loss", "nb/good.ipynb::steps",
                                  "nb/good.ipynb::speed", "4 tests collected*"])
    deselected = pytester.runpytest(*LOAD, "nb", "--collect-only", "-q", "-m", "not notebooks")
    deselected.stdout.fnmatch_lines(["*3 deselected*"])


def test_nbval_runs_keep_notebooks_to_nbval_unless_asked(pytester):
    pytest.importorskip("nbval")
    good(pytester.path / "nb")
    plain = pytester.runpytest(*LOAD, "nb", "--collect-only", "-q", "--nbval-lax")
    assert "::execute" not in plain.stdout.str()
    both = pytester.runpytest(*LOAD, "nb", "--collect-only", "-q", "--nbval-lax", "--opsnn-validate")
    both.stdout.fnmatch_lines(["nb/good.ipynb::execute"])


def test_bad_input_is_a_collection_error_naming_file_line_parameter(pytester):
    folder = pytester.path / "nb"
    good(folder)
    write_notebook(folder, "broken_toml", "x = 1", expect="[figures.a]\nmax = 1\nmin = \n")
    result = pytester.runpytest(*LOAD, "nb", "--collect-only", "-q")
    result.stdout.fnmatch_lines([f"*{folder / 'broken_toml.expect.toml'}:3: malformed TOML*"])
    assert result.ret == pytest.ExitCode.INTERRUPTED  # collection errors stop the run
    (folder / "broken_toml.ipynb").unlink()
    unknown = pytester.runpytest(*LOAD, "nb", "--collect-only", "-q", "--opsnn-param", "stepz=3")
    unknown.stdout.fnmatch_lines(["*good.ipynb: unknown parameter 'stepz'*did you mean 'steps'?*"])
    usage = pytester.runpytest(*LOAD, "nb", "--collect-only", "--opsnn-param", "steps")
    usage.stderr.fnmatch_lines(["*--opsnn-param: parameter 'steps' must look like name=value*"])
