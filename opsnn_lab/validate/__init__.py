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

import importlib

# name -> submodule; loaded on first use so the pytest plugin and ``-h`` stay cheap (nbformat and
# papermill take seconds to import)
_EXPORTS = {
    "Outcome": "checks", "check_figure": "checks",
    "main": "cli",
    "ExpectationsError": "errors", "NotebookInputError": "errors", "ValidationInputError": "errors",
    "CellError": "execute", "Execution": "execute", "execute_notebook": "execute",
    "Expectations": "expectations", "FigureCheck": "expectations", "Variant": "expectations",
    "expectations_path": "expectations", "load_expectations": "expectations", "parse_expectations": "expectations",
    "RecordedFigure": "figures", "read_figures": "figures",
    "format_result": "report", "format_summary": "report", "junit_tree": "report", "write_junit": "report",
    "NotebookPlan": "runner", "NotebookResult": "runner", "plan_notebook": "runner", "run_plan": "runner",
    "validate_notebook": "runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'opsnn_lab.validate' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"opsnn_lab.validate.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*__all__, *globals()])
