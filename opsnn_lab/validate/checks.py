"""Compare one recorded figure with its check, and say by how much it is off."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from opsnn_lab.validate.expectations import FigureCheck

__all__ = ["DEFAULT_ABS", "DEFAULT_REL", "Outcome", "check_figure", "format_value", "unchecked"]

# a value without rel/abs is compared like pytest.approx's defaults: exact up to float noise
DEFAULT_REL = 1e-6
DEFAULT_ABS = 1e-12
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "infinity": math.inf, "-infinity": -math.inf}


@dataclass(frozen=True)
class Outcome:
    """One row of the report. ``status``: pass, fail, missing (never recorded) or unchecked (no check)."""

    figure: str
    status: str
    expected: str = "-"
    got: str = "-"
    tolerance: str = "-"
    detail: str = ""
    cell: int | None = None

    @property
    def passed(self) -> bool:
        return self.status in ("pass", "unchecked")

    def message(self) -> str:
        """One line a CI log or pytest failure shows: which figure, what was expected, by how much."""
        if self.status == "missing":
            return f"figure {self.figure!r} {self.detail} (expected {self.expected})"
        tol = f" with tolerance {self.tolerance}" if self.tolerance != "-" else ""
        verdict = "passes" if self.passed else "is out of tolerance"
        text = f"figure {self.figure!r} {verdict}: got {self.got}, expected {self.expected}{tol}"
        return f"{text}: {self.detail}" if self.detail else text


def unchecked(name: str, value, cell: int | None = None) -> Outcome:
    return Outcome(name, "unchecked", got=format_value(value), detail="recorded, no expectation", cell=cell)


def check_figure(check: FigureCheck, value=None, *, recorded: bool = True, cell: int | None = None,
                 stopped: str | None = None) -> Outcome:
    """``stopped``: why execution ended early ("execution stopped at cell 3"), quoted for a missing figure."""
    expected, tolerance = _expected_text(check), _tolerance_text(check)
    if not recorded:
        detail = "was never recorded" + (f" ({stopped})" if stopped else "")
        return Outcome(check.name, "missing", expected, "-", tolerance, _with_note(detail, check))
    problems: list[tuple[float, str]] = []
    if check.value is not None:
        _compare(check.value, value, "", check, problems)
    if check.min is not None or check.max is not None:
        _bounds(value, check, problems)
    got = format_value(value)
    if not problems:
        return Outcome(check.name, "pass", expected, got, tolerance, cell=cell)
    severity, worst = max(problems, key=lambda p: p[0])
    detail = worst if len(problems) == 1 else f"{worst} ({len(problems)} elements fail)"
    return Outcome(check.name, "fail", expected, got, tolerance, _with_note(detail, check), cell)


def _with_note(detail: str, check: FigureCheck) -> str:
    return f"{detail} [{check.note}]" if check.note else detail


def _as_number(x):
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str) and x.strip().lower() in _NONFINITE:  # how ol.record stores non-finite floats
        return _NONFINITE[x.strip().lower()]
    return None


def _compare(expected, got, path: str, check: FigureCheck, out: list):
    label = path or "value"
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            out.append((math.inf, f"{label} is {_kind(got)}, expected a table"))
            return
        for key in expected.keys() - got.keys():
            out.append((math.inf, f"{path}[{key!r}] is missing"))
        for key in got.keys() - expected.keys():
            out.append((math.inf, f"{path}[{key!r}] is not expected"))
        for key in expected.keys() & got.keys():
            _compare(expected[key], got[key], f"{path}[{key!r}]", check, out)
    elif isinstance(expected, list):
        if not isinstance(got, list):
            out.append((math.inf, f"{label} is {_kind(got)}, expected a list"))
        elif len(got) != len(expected):
            out.append((math.inf, f"{label} has {len(got)} elements, expected {len(expected)}"))
        else:
            for i, (e, g) in enumerate(zip(expected, got)):
                _compare(e, g, f"{path}[{i}]", check, out)
    elif _as_number(expected) is not None:
        _compare_number(float(expected), got, path, check, out)
    elif type(got) is not type(expected) or got != expected:  # True is not 1 here
        out.append((math.inf, f"{label} is {format_value(got)}, expected {format_value(expected)}"))


def _compare_number(expected: float, got, path: str, check: FigureCheck, out: list):
    g = _as_number(got)
    prefix = f"{path}: " if path else ""
    if g is None:
        out.append((math.inf, f"{prefix}got {_kind(got)} {format_value(got)}, expected a number"))
        return
    tol = _tolerance(check, expected)
    diff = g - expected
    if abs(diff) <= tol:  # False for NaN
        return
    rel = f" ({diff / abs(expected):+.3g} relative)" if expected else ""
    severity = abs(diff) / tol if tol > 0 and math.isfinite(diff) else math.inf
    out.append((severity, f"{prefix}off by {diff:+.4g}{rel}, allowed +-{tol:.4g}"))


def _tolerance(check: FigureCheck, expected: float) -> float:
    if check.rel is None and check.abs is None:
        return max(DEFAULT_REL * abs(expected), DEFAULT_ABS)
    return max((check.rel or 0.0) * abs(expected), check.abs or 0.0)


def _bounds(got, check: FigureCheck, out: list):
    leaves = list(_numeric_leaves(got, ""))
    if not leaves:
        out.append((math.inf, f"got {_kind(got)} with no number to bound"))
    for path, g in leaves:
        prefix = f"{path}: " if path else ""
        if g is None:
            out.append((math.inf, f"{prefix}is not a number"))
        elif math.isnan(g):
            out.append((math.inf, f"{prefix}is nan"))
        elif check.min is not None and g < check.min:
            out.append((_excess(check.min - g, check.min), f"{prefix}{g:.6g} is below min {check.min:g} "
                                                            f"by {check.min - g:.4g}"))
        elif check.max is not None and g > check.max:
            out.append((_excess(g - check.max, check.max), f"{prefix}{g:.6g} is above max {check.max:g} "
                                                            f"by {g - check.max:.4g}"))


def _excess(amount: float, bound: float) -> float:
    return amount / abs(bound) if bound else math.inf


def _numeric_leaves(value, path: str):
    if isinstance(value, dict):
        for key, v in value.items():
            yield from _numeric_leaves(v, f"{path}[{key!r}]")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _numeric_leaves(v, f"{path}[{i}]")
    else:
        yield path, _as_number(value)


def _kind(value) -> str:
    return {dict: "a table", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def format_value(value, width: int = 48) -> str:
    """Short, stable text for a figure: floats with 6 significant digits, long lists cut."""
    text = json.dumps(_rounded(value), separators=(", ", ": "))
    return text if len(text) <= width else text[: width - 3] + "..."


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else str(value)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def _expected_text(check: FigureCheck) -> str:
    parts = [] if check.value is None else [format_value(check.value, 32)]
    if check.min is not None and check.max is not None:
        parts.append(f"in [{check.min:g}, {check.max:g}]")
    elif check.min is not None:
        parts.append(f">= {check.min:g}")
    elif check.max is not None:
        parts.append(f"<= {check.max:g}")
    return "; ".join(parts)


def _tolerance_text(check: FigureCheck) -> str:
    if check.value is None or _as_number(_first_leaf(check.value)) is None:
        return "-"
    if check.rel is None and check.abs is None:
        return f"rel {DEFAULT_REL:g}"
    parts = [f"rel {check.rel:g}"] if check.rel is not None else []
    if check.abs is not None:
        parts.append(f"abs {check.abs:g}")
    return ", ".join(parts)


def _first_leaf(value):
    while isinstance(value, (list, dict)) and value:
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
    return value
