"""Execute notebooks and keep only the outputs of cells marked ``# NBVAL_CHECK_OUTPUT``.

nbval compares a cell's fresh output with the output committed in the notebook; every
other cell is committed without outputs. Run after changing a checked cell:
``python scripts/refresh_nbval_outputs.py notebooks/00_quickstart.ipynb``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import nbformat
import papermill as pm

MARK = "# NBVAL_CHECK_OUTPUT"


def refresh(path: Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / path.name
        pm.execute_notebook(str(path), str(out), kernel_name="python3", cwd=str(path.parent), progress_bar=False)
        executed = nbformat.read(out, as_version=4)
    nb = nbformat.read(path, as_version=4)
    by_source = {c.source: c for c in executed.cells if c.cell_type == "code"}
    kept = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if MARK in cell.source and cell.source in by_source:
            cell.outputs = by_source[cell.source].outputs
            cell.execution_count = by_source[cell.source].execution_count
            kept += 1
        else:
            cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)
    return kept


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"{arg}: kept the output of {refresh(Path(arg))} checked cell(s)")
