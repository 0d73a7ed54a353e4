"""pytest plugin: ``pytest notebooks/`` validates each notebook that has an ``.expect.toml``.

Every ``NN_topic.ipynb`` with ``NN_topic.expect.toml`` next to it becomes a collector with one test per
expected figure (``NN_topic.ipynb::final_loss``) plus ``NN_topic.ipynb::execute``, which fails with the
cell index and traceback when a cell raises. The notebook executes once per session, on its first test;
all its tests share that execution. Items carry the ``notebooks`` marker (``-m "not notebooks"`` skips
them). When nbval is active (``--nbval``/``--nbval-lax``) notebooks are left to nbval unless
``--opsnn-validate`` is given too, so ``make test`` does not execute each notebook twice.

Load it with ``-p opsnn_lab.pytest_plugin`` (or the ``pytest11`` entry point). Options mirror
``python -m opsnn_lab.validate``: ``--opsnn-param NAME=VALUE``, ``--opsnn-variant``,
``--opsnn-output-dir``, ``--opsnn-kernel``, ``--opsnn-timeout``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from opsnn_lab.validate.errors import ValidationInputError
from opsnn_lab.validate.expectations import expectations_path

if TYPE_CHECKING:  # the runner imports nbformat and papermill (seconds): only when a notebook is collected
    from opsnn_lab.validate.checks import Outcome
    from opsnn_lab.validate.execute import CellError
    from opsnn_lab.validate.runner import NotebookResult

EXECUTE_ITEM = "execute"
_PARAMS = pytest.StashKey[dict]()


class UncheckedFigureWarning(UserWarning):
    """A notebook recorded a figure that its expectations file does not check."""


class FigureCheckFailed(Exception):
    def __init__(self, outcome: Outcome):
        super().__init__(outcome.message())
        self.outcome = outcome


class NotebookCellFailed(Exception):
    def __init__(self, error: CellError):
        super().__init__(error.summary())
        self.error = error


def pytest_addoption(parser):
    group = parser.getgroup("opsnn-validate", "notebook validation with recorded figures (opsnn_lab)")
    group.addoption("--opsnn-validate", action="store_true",
                    help="validate notebooks that have an .expect.toml even when nbval is active")
    group.addoption("--opsnn-param", action="append", default=[], metavar="NAME=VALUE",
                    help="override a parameter of every validated notebook")
    group.addoption("--opsnn-variant", metavar="NAME", help="run with the parameters of [variants.NAME]")
    group.addoption("--opsnn-output-dir", metavar="DIR", help="keep the executed notebooks in DIR")
    group.addoption("--opsnn-kernel", metavar="NAME", help="kernel name (default: the notebook's)")
    group.addoption("--opsnn-timeout", type=float, default=600.0, metavar="SECONDS",
                    help="per-cell execution timeout (default: 600)")


def pytest_configure(config):
    config.addinivalue_line("markers", "notebooks: executes notebooks (papermill/nbval)")
    from opsnn_lab.validate.parameters import parse_assignment

    try:
        config.stash[_PARAMS] = dict(parse_assignment(a) for a in config.getoption("opsnn_param") or [])
    except ValidationInputError as err:
        raise pytest.UsageError(f"--opsnn-param: {err}") from None


def _enabled(config) -> bool:
    if config.getoption("opsnn_validate", False):
        return True
    # nbval collects the same files to compare text outputs; one execution per notebook is enough
    return not any(config.getoption(name, False) for name in ("nbval", "nbval_lax"))


def pytest_collect_file(file_path: Path, parent):
    if (file_path.suffix == ".ipynb" and ".ipynb_checkpoints" not in file_path.parts
            and expectations_path(file_path).exists() and _enabled(parent.config)):
        return NotebookFile.from_parent(parent, path=file_path)
    return None


class NotebookFile(pytest.File):
    """One notebook: plans at collection (bad input is a collection error), executes once on demand."""

    plan = None
    _result: NotebookResult | None = None

    def collect(self):
        from opsnn_lab.validate.runner import plan_notebook

        config = self.config
        try:
            self.plan = plan_notebook(self.path, config.stash[_PARAMS],
                                      variant=config.getoption("opsnn_variant", None))
        except ValidationInputError as err:
            raise self.CollectError(str(err)) from None
        self.add_marker("notebooks")
        yield NotebookExecutionItem.from_parent(self, name=EXECUTE_ITEM)
        for figure in self.plan.checks:
            name = figure if figure != EXECUTE_ITEM else f"figure[{figure}]"
            yield FigureItem.from_parent(self, name=name, figure=figure)

    def result(self) -> NotebookResult:
        from opsnn_lab.validate.runner import run_plan

        if self._result is None:
            self._result = run_plan(self.plan, output_path=self._output_path(),
                                    kernel_name=self.config.getoption("opsnn_kernel", None),
                                    timeout=self.config.getoption("opsnn_timeout", None))
        return self._result

    def _output_path(self) -> Path | None:
        out = self.config.getoption("opsnn_output_dir", None)
        if out is None:
            return None
        try:
            relative = self.path.relative_to(self.config.rootpath)
        except ValueError:
            relative = Path(self.path.name)
        return Path(out) / relative


class NotebookExecutionItem(pytest.Item):
    """Passes when every cell ran; fails with the cell index, its source and the traceback."""

    def runtest(self):
        result = self.parent.result()
        for o in result.outcomes:
            if o.status == "unchecked":
                warnings.warn_explicit(
                    f"{self.path.name} recorded {o.figure!r} = {o.got} but "
                    f"{result.plan.expectations.path} has no [figures.{o.figure}]",
                    UncheckedFigureWarning, filename=str(result.plan.expectations.path), lineno=1)
        if result.execution.error is not None:
            raise NotebookCellFailed(result.execution.error)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, NotebookCellFailed):
            return f"{excinfo.value.error.describe()}\n(notebook {self.path})"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"{self.path.name}::{self.name}"


class FigureItem(pytest.Item):
    """One recorded figure against its check; the failure says what was expected and by how much."""

    def __init__(self, *, figure: str, **kwargs):
        super().__init__(**kwargs)
        self.figure = figure

    def runtest(self):
        outcome = self.parent.result().outcome(self.figure)
        self.user_properties.append(("got", outcome.got))
        if not outcome.passed:
            raise FigureCheckFailed(outcome)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, FigureCheckFailed):
            o = excinfo.value.outcome
            check = self.parent.plan.checks[self.figure]
            return (f"{o.message()}\n"
                    f"  expected {o.expected} | got {o.got} | tolerance {o.tolerance}  (check at {check.where})")
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"{self.path.name}::{self.name}"
