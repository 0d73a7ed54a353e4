"""Planning and running one notebook: expectations pass, fail by an amount, or fail when never recorded."""

import nbformat as nbf
import pytest

from opsnn_lab.validate import (
    ExpectationsError,
    NotebookInputError,
    NotebookResult,
    plan_notebook,
    validate_notebook,
)
from opsnn_lab.validate.runner import evaluate

PASSING = """\
[figures.loss]
value = 0.75
rel = 0.01
[figures.hist]
value = [1, 2, 4]
[figures.summary]
value = {fused = 2, rejected = 1}
[figures.ratio]
max = 0.5

[variants.long]
parameters = { steps = 100 }
[variants.long.figures.loss]
max = 0.1
"""


def write_notebook(path, *sources, parameters="steps = 4\nscale = 3.0"):
    nb = nbf.v4.new_notebook()
    cell = nbf.v4.new_code_cell(parameters)
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [nbf.v4.new_markdown_cell("# throwaway"), cell, *(nbf.v4.new_code_cell(s) for s in sources)]
    nbf.write(nb, path)
    return path


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """One execution shared by every test here (a kernel start costs seconds)."""
    root = tmp_path_factory.mktemp("runner")
    nb = write_notebook(
        root / "fig.ipynb",
        "import opsnn_lab as ol\nol.record('loss', scale / steps)\nol.record('hist', [1, 2, steps])",
        "ol.record('summary', {'fused': 2, 'rejected': 1})\nol.record('ratio', 0.25)\nol.record('extra', 'x')")
    (root / "fig.expect.toml").write_text(PASSING)
    return root, validate_notebook(nb, output_dir=root / "executed")


def test_matching_expectations_pass(executed):
    root, result = executed
    assert isinstance(result, NotebookResult) and result.ok
    assert [(o.figure, o.status) for o in result.outcomes] == [
        ("loss", "pass"), ("hist", "pass"), ("summary", "pass"), ("ratio", "pass"), ("extra", "unchecked")]
    assert result.outcome("loss").got == "0.75" and result.outcome("loss").cell == 2
    assert result.execution.output == root / "executed" / "fig.ipynb" and result.execution.output.exists()
    assert result.plan.parameters == {} and result.plan.effective == {"steps": 4, "scale": 3.0}


def test_out_of_tolerance_fails_with_the_amount(executed):
    root, result = executed
    (root / "tight.toml").write_text("[figures.loss]\nvalue = 0.7\nrel = 0.05\n[figures.ratio]\nmax = 0.2\n")
    outcomes = evaluate(plan_notebook(root / "fig.ipynb", expect=root / "tight.toml"), result.execution)
    loss, ratio = outcomes[0], outcomes[1]
    assert (loss.status, loss.detail) == ("fail", "off by +0.05 (+0.0714 relative), allowed +-0.035")
    assert (ratio.status, ratio.detail) == ("fail", "0.25 is above max 0.2 by 0.05")
    assert not NotebookResult(result.plan, result.execution, outcomes).ok


def test_expected_figure_never_recorded_fails(executed):
    root, result = executed
    (root / "more.toml").write_text("[figures.loss]\nmin = 0\n[figures.throughput]\nmin = 1\n")
    outcomes = evaluate(plan_notebook(root / "fig.ipynb", expect=root / "more.toml"), result.execution)
    missing = next(o for o in outcomes if o.figure == "throughput")
    assert missing.status == "missing" and not missing.passed
    assert missing.detail == "was never recorded"
    assert not NotebookResult(result.plan, result.execution, outcomes).ok


def test_variant_parameters_and_checks(executed):
    root, _ = executed
    plan = plan_notebook(root / "fig.ipynb", variant="long")
    assert plan.parameters == {"steps": 100} and plan.variants == ("long",)
    assert plan.checks["loss"].max == 0.1 and plan.checks["hist"].value == [1, 2, 4]
    by_hand = plan_notebook(root / "fig.ipynb", {"steps": 100})  # -p matching a variant selects it too
    assert by_hand.variants == ("long",) and by_hand.checks["loss"].max == 0.1
    with pytest.raises(NotebookInputError, match="-p overrides a parameter of variant 'long'"):
        plan_notebook(root / "fig.ipynb", {"steps": 5}, variant="long")
    with pytest.raises(NotebookInputError, match=r"fig.expect.toml: no variant 'short' \(variants: long\)"):
        plan_notebook(root / "fig.ipynb", variant="short")


def test_unknown_parameter_is_named_before_execution(executed):
    root, _ = executed
    with pytest.raises(NotebookInputError) as info:
        plan_notebook(root / "fig.ipynb", {"scal": 2.0})
    assert str(info.value) == (f"{root / 'fig.ipynb'}: unknown parameter 'scal': the cell tagged 'parameters' "
                               "(cell 1) assigns scale, steps; did you mean 'scale'?")


def test_unknown_parameter_in_a_variant_names_its_line(tmp_path):
    nb = write_notebook(tmp_path / "v.ipynb", "pass")
    (tmp_path / "v.expect.toml").write_text(
        "[figures.a]\nmax = 1\n\n[variants.big]\nparameters = {epochs = 3}\n[variants.big.figures.a]\nmax = 2\n")
    with pytest.raises(NotebookInputError, match=r"unknown parameter in \[variants.big\] \(.*v.expect.toml:4\) "
                                                  r"'epochs'"):
        plan_notebook(nb)


def test_bad_input_names_the_file(tmp_path):
    with pytest.raises(NotebookInputError, match=r"nowhere.ipynb: no such notebook"):
        plan_notebook(tmp_path / "nowhere.ipynb")
    with pytest.raises(NotebookInputError, match="is a directory"):
        plan_notebook(tmp_path)
    (tmp_path / "junk.ipynb").write_text("{not json")
    with pytest.raises(NotebookInputError, match=r"junk.ipynb: not a readable .ipynb notebook"):
        plan_notebook(tmp_path / "junk.ipynb")
    nb = write_notebook(tmp_path / "lonely.ipynb", "pass")
    with pytest.raises(NotebookInputError, match=r"lonely.ipynb: no expectations file .*lonely.expect.toml"):
        plan_notebook(nb)
    (tmp_path / "lonely.expect.toml").write_text("[figures.a]\nvalue = 1\nrel = \n")
    with pytest.raises(ExpectationsError, match=r"lonely.expect.toml:3: malformed TOML"):
        plan_notebook(nb)
    with pytest.raises(ExpectationsError, match=r"other.toml: no such expectations file"):
        plan_notebook(nb, expect=tmp_path / "other.toml")
