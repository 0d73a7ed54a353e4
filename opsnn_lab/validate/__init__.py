"""Validation notebooks: execute with papermill, check recorded figures with tolerances, report for CI.

A notebook publishes its key figures with ``opsnn_lab.record(name, value)`` (a number, a list of
numbers, or a small dict; stored in the executed notebook under the MIME type
``application/vnd.opsnn.record+json``). Next to ``NN_topic.ipynb`` lives ``NN_topic.expect.toml``::

    [figures.final_loss]        # one table per recorded figure name
    value = 2.3                 # expected value ...
    rel = 0.2                   # ... within max(rel * |value|, abs); neither given: rel 1e-6, abs 1e-12
    note = "20 steps, seed 0"   # optional: quoted in the failure message

    [figures.activation_ratio]
    max = 0.5                   # bounds are inclusive; min and max may be combined, and with value

    [figures.per_layer]         # a list (or dict) figure: value compared element by element,
    value = [1.0, 2.0]          # min/max applied to every number in it
    abs = 0.05

    [variants.full]             # checks for another parameter set
    parameters = { steps = 2000 }
    [variants.full.figures.final_loss]
    max = 0.5

Keys of a figure table: ``value``, ``rel``, ``abs``, ``min``, ``max``, ``note``; anything else is an
error naming the file and line. A variant applies when every one of its ``parameters`` equals the run's
value (the default in the cell tagged ``parameters``, or the one passed with ``-p``); its figure tables
replace the base tables of the same name, other base tables still apply. ``--variant NAME`` runs with
the variant's parameters. Strings and booleans are compared exactly; recorded non-finite floats
(stored as ``"nan"``/``"inf"``) fail every numeric check.

A figure that is expected but never recorded fails; a figure recorded without a check is reported as
``unchecked``. A cell that raises fails the notebook and the report names the cell (its index in the
source notebook, counting from 0) with its source and traceback.

Command line (exit status 0 passed, 1 failed, 2 bad input)::

    python -m opsnn_lab.validate notebooks/*.ipynb [-p name=value ...] [--variant NAME]
        [--expect FILE] [--junit build/validate.xml] [--output-dir build/executed]

From pytest, ``pytest notebooks/`` collects every ``*.ipynb`` that has an ``.expect.toml`` (plugin
``opsnn_lab.pytest_plugin``), one test per figure.
"""

from __future__ import annotations

from opsnn_lab.validate.checks import Outcome, check_figure
from opsnn_lab.validate.cli import main
from opsnn_lab.validate.errors import ExpectationsError, NotebookInputError, ValidationInputError
from opsnn_lab.validate.execute import CellError, Execution, execute_notebook
from opsnn_lab.validate.expectations import (
    Expectations,
    FigureCheck,
    Variant,
    expectations_path,
    load_expectations,
    parse_expectations,
)
from opsnn_lab.validate.figures import RecordedFigure, read_figures
from opsnn_lab.validate.report import format_result, format_summary, junit_tree, write_junit
from opsnn_lab.validate.runner import NotebookPlan, NotebookResult, plan_notebook, run_plan, validate_notebook

__all__ = [
    "CellError", "Execution", "Expectations", "ExpectationsError", "FigureCheck", "NotebookInputError",
    "NotebookPlan", "NotebookResult", "Outcome", "RecordedFigure", "ValidationInputError", "Variant",
    "check_figure", "execute_notebook", "expectations_path", "format_result", "format_summary", "junit_tree",
    "load_expectations", "main", "parse_expectations", "plan_notebook", "read_figures", "run_plan",
    "validate_notebook", "write_junit",
]
