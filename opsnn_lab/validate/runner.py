"""Plan (check every input, execute nothing) and run the validation of one notebook."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from opsnn_lab.validate.checks import Outcome, check_figure, unchecked
from opsnn_lab.validate.errors import NotebookInputError
from opsnn_lab.validate.execute import Execution, execute_notebook
from opsnn_lab.validate.expectations import Expectations, FigureCheck, expectations_path, load_expectations
from opsnn_lab.validate.figures import read_figures
from opsnn_lab.validate.parameters import ParametersCell, check_known, find_parameters_cell

__all__ = ["NotebookPlan", "NotebookResult", "evaluate", "plan_notebook", "run_plan", "validate_notebook"]


@dataclass(frozen=True)
class NotebookPlan:
    """Everything known before execution: the parameters papermill gets and the checks that apply."""

    notebook: Path
    expectations: Expectations
    parameters_cell: ParametersCell
    parameters: dict = field(default_factory=dict)  # passed to papermill
    effective: dict = field(default_factory=dict)  # notebook defaults overridden by ``parameters``
    checks: dict[str, FigureCheck] = field(default_factory=dict)
    variants: tuple[str, ...] = ()  # the variants whose parameters match this run


@dataclass
class NotebookResult:
    plan: NotebookPlan
    execution: Execution
    outcomes: list[Outcome]

    @property
    def ok(self) -> bool:
        return self.execution.error is None and all(o.passed for o in self.outcomes)

    def outcome(self, figure: str) -> Outcome:
        return next(o for o in self.outcomes if o.figure == figure)


def read_notebook(notebook) -> object:
    path = Path(notebook)
    if not path.exists():
        raise NotebookInputError(f"{path}: no such notebook")
    if path.is_dir():
        raise NotebookInputError(f"{path}: is a directory, not a notebook")
    try:
        return nbformat.read(path, as_version=4)
    except Exception as err:  # noqa: BLE001 - JSON or nbformat schema errors: all mean "not a notebook"
        raise NotebookInputError(f"{path}: not a readable .ipynb notebook ({type(err).__name__}: {err})") from None


def plan_notebook(notebook, parameters: dict | None = None, *, expect=None,
                  variant: str | None = None) -> NotebookPlan:
    """Read the notebook and its expectations and check the parameters; raises ValidationInputError."""
    path = Path(notebook)
    nb = read_notebook(path)
    cell = find_parameters_cell(nb, str(path))
    exp_path = Path(expect) if expect is not None else expectations_path(path)
    if expect is None and not exp_path.exists():
        raise NotebookInputError(f"{path}: no expectations file {exp_path} (write one next to the notebook "
                                 f"with a [figures.NAME] table per recorded figure, or pass --expect FILE)")
    expectations = load_expectations(exp_path)
    for v in expectations.variants.values():
        check_known(cell, v.parameters, what=f"parameter in [variants.{v.name}] ({v.where})")
    passed = {}
    if variant is not None:
        if variant not in expectations.variants:
            known = ", ".join(expectations.variants) or "none"
            raise NotebookInputError(f"{exp_path}: no variant {variant!r} (variants: {known})")
        passed.update(expectations.variants[variant].parameters)
    passed.update(parameters or {})
    check_known(cell, passed)
    effective = cell.effective(passed)
    active = tuple(v.name for v in expectations.matching_variants(effective))
    if variant is not None and variant not in active:
        raise NotebookInputError(f"{path}: -p overrides a parameter of variant {variant!r}, so its checks "
                                 f"would not apply ({expectations.variants[variant].parameters})")
    return NotebookPlan(path, expectations, cell, passed, effective, expectations.checks_for(effective), active)


def evaluate(plan: NotebookPlan, execution: Execution) -> list[Outcome]:
    """One outcome per check (missing figures fail), then the recorded figures nothing checks."""
    figures = read_figures(execution.nb)
    stopped = execution.error.stopped() if execution.error else None
    outcomes = []
    for name, check in plan.checks.items():
        if name in figures:
            outcomes.append(check_figure(check, figures[name].value, cell=figures[name].cell))
        else:
            outcomes.append(check_figure(check, recorded=False, stopped=stopped))
    outcomes += [unchecked(n, f.value, f.cell) for n, f in figures.items() if n not in plan.checks]
    return outcomes


def run_plan(plan: NotebookPlan, *, output_path=None, kernel_name: str | None = None,
             timeout: float | None = None) -> NotebookResult:
    """Execute once and check; the executed copy is kept only where ``output_path`` says."""
    if output_path is not None:
        Path(output_path).parent.mkdir(parents=True, exist_ok=True)
        execution = execute_notebook(plan.notebook, output_path, plan.parameters, kernel_name=kernel_name,
                                     timeout=timeout)
        execution.output = Path(output_path)
    else:
        with tempfile.TemporaryDirectory(prefix="opsnn-validate-") as tmp:
            execution = execute_notebook(plan.notebook, Path(tmp) / plan.notebook.name, plan.parameters,
                                         kernel_name=kernel_name, timeout=timeout)
    return NotebookResult(plan, execution, evaluate(plan, execution))


def validate_notebook(notebook, parameters: dict | None = None, *, expect=None, variant: str | None = None,
                      output_dir=None, kernel_name: str | None = None,
                      timeout: float | None = None) -> NotebookResult:
    """Plan, execute and check one notebook (the Python form of ``python -m opsnn_lab.validate``)."""
    plan = plan_notebook(notebook, parameters, expect=expect, variant=variant)
    output = Path(output_dir) / plan.notebook.name if output_dir is not None else None
    return run_plan(plan, output_path=output, kernel_name=kernel_name, timeout=timeout)
