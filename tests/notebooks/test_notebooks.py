"""Every notebook in notebooks/ validates with its CI defaults, and is committed clean.

The validation runs through ``opsnn_lab.validate`` (papermill + the figures recorded with ``ol.record``
checked against ``NN_topic.expect.toml``), the same path as ``python -m opsnn_lab.validate`` in CI.
nbval (``make test``) separately compares the text of cells marked ``# NBVAL_CHECK_OUTPUT``, with the
sanitizers in ``sanitize.cfg`` next to this file.
"""

import re
from pathlib import Path

import nbformat
import pytest

from opsnn_lab.validate import expectations_path, format_result, validate_notebook

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb") if not p.name.endswith(".nbconvert.ipynb"))
SANITIZE = Path(__file__).with_name("sanitize.cfg")
NBVAL_MARK = "# NBVAL_CHECK_OUTPUT"


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebook in {ROOT / 'notebooks'}"


@pytest.mark.notebooks
@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_figures_meet_expectations(notebook, tmp_path):
    expect = expectations_path(notebook)
    assert expect.exists(), (f"{notebook.name} has no {expect.name}: every notebook records its key figures "
                             "with ol.record and ships their checks")
    result = validate_notebook(notebook, output_dir=tmp_path)  # CI defaults: the parameters cell as committed
    assert result.ok, "\n" + format_result(result)
    assert any(o.status == "pass" for o in result.outcomes), f"{notebook.name} checked no figure"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_clean_with_one_parameters_cell(notebook):
    nb = nbformat.read(notebook, as_version=4)
    # Cells marked for nbval keep their reference output (that is what nbval compares against);
    # every other cell is committed without outputs.
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)
             and NBVAL_MARK not in c.source]
    assert not dirty, (f"{notebook.name}: cells {dirty} carry outputs; commit notebooks without outputs "
                       f"(scripts/refresh_nbval_outputs.py keeps only the {NBVAL_MARK} ones)")
    assert "widgets" not in nb.metadata, f"{notebook.name}: saved widget state in the metadata; clear it"
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{notebook.name}: {len(tagged)} cells tagged 'parameters' ({tagged}); need one"
    first_code = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    assert tagged[0] == first_code, (f"{notebook.name}: the cell tagged 'parameters' is cell {tagged[0]}; it must "
                                     f"be the first code cell ({first_code}) so papermill injects after it")


@pytest.mark.parametrize("text, expected", [
    ("id 123e4567-e89b-12d3-a456-426614174000", "id UUID"),
    ('{"uid": "3f2a", "x": [1]}', '{"uid": "UID", "x": [1]}'),
    ('<div id="a3b1c2"></div>', '<div id="DIV-ID"></div>'),
    ("<Linear object at 0x7f3a2b1c4d50>", "<Linear object at 0xADDRESS>"),
    ("trained in 1.23 s (45ms per step)", "trained in TIME (TIME per step)"),
    ("saved 2026-12-02T09:56:10.223664+00:00", "saved DATETIME"),
    ("10/10 [00:01<00:00, 5.23it/s]", "10/10 [ELAPSED<ETA, RATE]"),
    ("wrote /tmp/pytest-of-root/pytest-3/out.ipynb", "wrote TMPPATH"),
    (r"wrote C:\Users\bob\AppData\Local\Temp\x.json", "wrote TMPPATH"),
    ("step 3 loss 2.5000 over 12 samples", "step 3 loss 2.5000 over 12 samples"),  # figures stay
])
def test_sanitizers_remove_run_to_run_noise_only(text, expected):
    nbval = pytest.importorskip("nbval.plugin")
    patterns = nbval.get_sanitize_patterns(SANITIZE.read_text())
    assert len(patterns) == SANITIZE.read_text().count("\nregex: ")
    for regex, replace in patterns:
        text = re.sub(regex, replace, text)
    assert text == expected
