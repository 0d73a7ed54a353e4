"""``python -m opsnn_lab.validate``: exit status, the table, JUnit, and clear errors for bad input."""

import subprocess
import sys
import xml.etree.ElementTree as ET

import nbformat as nbf
import pytest

from opsnn_lab.validate import main

EXPECT = "[figures.loss]\nvalue = 1.0\nrel = 0.1\n[figures.steps]\nvalue = 3\n"


def write_notebook(path, *sources, expect=EXPECT):
    nb = nbf.v4.new_notebook()
    cell = nbf.v4.new_code_cell("steps = 2\nloss = 1.0")
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell, *(nbf.v4.new_code_cell(s) for s in sources)]
    nb.metadata["kernelspec"] = {"name": "python3", "language": "python", "display_name": "Python 3"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbf.write(nb, path)
    if expect is not None:
        path.with_suffix(".expect.toml").write_text(expect)
    return path


@pytest.fixture(scope="module")
def notebooks(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    ok = write_notebook(root / "ok" / "ok.ipynb",
                        "import opsnn_lab as ol\nol.record('loss', loss)\nol.record('steps', steps)")
    broken = write_notebook(root / "bad" / "broken.ipynb",
                            "import opsnn_lab as ol\nol.record('loss', loss * 1.5)",
                            "raise RuntimeError('diverged at step ' + str(steps))",
                            "ol.record('steps', steps)")
    return root, ok, broken


@pytest.fixture(scope="module")
def failing_run(notebooks):
    """One real command line run over a directory and a file, paths relative as a user types them."""
    root, ok, broken = notebooks
    cmd = [sys.executable, "-m", "opsnn_lab.validate", "ok", "bad/broken.ipynb", "-p", "steps=3",
           "--junit", "build/validate.xml", "--output-dir", "build/executed"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=300)


def test_failure_exits_1_with_table_and_traceback(failing_run, notebooks):
    assert failing_run.returncode == 1, failing_run.stderr
    out = failing_run.stdout
    assert "ok/ok.ipynb: passed" in out and "bad/broken.ipynb: FAILED" in out
    assert "(parameters: steps=3)" in out
    assert "FAIL: off by +0.5 (+0.5 relative), allowed +-0.1" in out
    assert "MISSING: was never recorded (execution stopped at cell 2 (In [4]))" in out
    assert [line.split()[:4] for line in out.splitlines() if line.startswith("  loss")] == [
        ["loss", "1.0", "1.0", "rel"], ["loss", "1.0", "1.5", "rel"]]  # figure, expected, got, tolerance
    assert "execution stopped: cell 2 (In [4]) raised RuntimeError: diverged at step 3" in out
    assert "raise RuntimeError('diverged at step ' + str(steps))" in out  # the cell's source and traceback
    assert out.strip().splitlines()[-2] == ("2 notebook(s): 1 passed, 1 failed; 2 of 4 figure checks passed; "
                                            "1 notebook(s) raised")


def test_failure_run_writes_junit_and_keeps_executed_notebooks(failing_run, notebooks):
    root, _, _ = notebooks
    tree = ET.parse(root / "build" / "validate.xml").getroot()
    suites = tree.findall("testsuite")
    assert [[c.get("name") for c in s.findall("testcase")] for s in suites] == [
        ["loss", "steps"], ["loss", "steps", "execute"]]
    assert (tree.get("tests"), tree.get("failures"), tree.get("errors")) == ("5", "2", "1")
    assert suites[0].find("testcase").get("classname") == "ok.ok"
    assert sorted(p.name for p in (root / "build" / "executed").iterdir()) == ["broken.ipynb", "ok.ipynb"]
    assert not (root / "ok" / "build").exists()  # not written relative to the notebook's folder


def test_passing_notebook_exits_0(notebooks, capsys):
    _, ok, _ = notebooks
    assert main([str(ok), "-p", "steps=3"]) == 0
    out = capsys.readouterr().out
    assert f"{ok}: passed" in out and "1 notebook(s): 1 passed, 0 failed; 2 of 2 figure checks passed" in out


def bad_input(argv, capsys):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""  # nothing was executed
    return captured.err.strip()


def test_missing_notebook_is_named(notebooks, capsys, tmp_path):
    _, ok, _ = notebooks
    assert bad_input([ok, tmp_path / "gone.ipynb"], capsys) == f"error: {tmp_path / 'gone.ipynb'}: no such notebook"
    assert "directory has no *.ipynb" in bad_input([tmp_path], capsys)


def test_malformed_expectations_name_file_and_line(capsys, tmp_path):
    nb = write_notebook(tmp_path / "m.ipynb", "pass", expect="[figures.loss]\nvalue = 1\nrel = oops\n")
    err = bad_input([nb], capsys)
    assert err.startswith(f"error: {tmp_path / 'm.expect.toml'}:3: malformed TOML"), err
    (tmp_path / "other.toml").write_text("[figures.loss]\nvalu = 1\n")
    err = bad_input([nb, "--expect", tmp_path / "other.toml"], capsys)
    assert err.startswith(f"error: {tmp_path / 'other.toml'}:2: [figures.loss]: unknown key 'valu'"), err


def test_unknown_parameter_is_named(notebooks, capsys):
    _, ok, _ = notebooks
    err = bad_input([ok, "-p", "stpes=4"], capsys)
    assert err == (f"error: {ok}: unknown parameter 'stpes': the cell tagged 'parameters' (cell 0) assigns "
                   "loss, steps; did you mean 'steps'?")
    assert "must look like name=value" in bad_input([ok, "-p", "steps"], capsys)


def test_notebook_without_expectations_is_an_error(capsys, tmp_path):
    nb = write_notebook(tmp_path / "plain.ipynb", "pass", expect=None)
    assert "no expectations file" in bad_input([nb], capsys)


def test_help_documents_the_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for option in ("-p NAME=VALUE", "--junit FILE", "--expect FILE", "--output-dir DIR", "--variant NAME"):
        assert option in text
