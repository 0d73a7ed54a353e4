"""The report of a validation run: a text table per notebook, and JUnit XML for CI systems."""

from __future__ import annotations

import platform
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from opsnn_lab.validate.runner import NotebookResult

__all__ = ["EXECUTE_CASE", "format_result", "format_summary", "junit_tree", "write_junit"]

EXECUTE_CASE = "execute"  # the extra testcase that carries a cell's traceback when execution broke
COLUMNS = ("figure", "expected", "got", "tolerance", "result")
_XML_BAD = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  " + "  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip() for r in rows]


def _result_text(o) -> str:
    label = {"pass": "pass", "fail": "FAIL", "missing": "MISSING", "unchecked": "unchecked"}[o.status]
    return f"{label}: {o.detail}" if o.detail else label


def _context(result: NotebookResult) -> str:
    plan = result.plan
    bits = []
    if plan.parameters:
        bits.append("parameters: " + ", ".join(f"{k}={v!r}" for k, v in plan.parameters.items()))
    if plan.variants:
        bits.append("variants: " + ", ".join(plan.variants))
    return f" ({'; '.join(bits)})" if bits else ""


def format_result(result: NotebookResult) -> str:
    """A header, the table (figure, expected, got, tolerance, result), and the broken cell if any."""
    status = "passed" if result.ok else "FAILED"
    lines = [f"{result.plan.notebook}: {status} in {result.execution.seconds:.1f} s{_context(result)}"]
    if result.outcomes:
        rows = [COLUMNS] + [(o.figure, o.expected, o.got, o.tolerance, _result_text(o)) for o in result.outcomes]
        lines += _table(rows)
    if result.execution.error is not None:
        lines.append("  execution stopped: " + result.execution.error.describe().replace("\n", "\n  "))
    if result.execution.output is not None:
        lines.append(f"  executed notebook: {result.execution.output}")
    return "\n".join(lines)


def format_summary(results: Sequence[NotebookResult]) -> str:
    outcomes = [o for r in results for o in r.outcomes if o.status != "unchecked"]
    good = sum(o.passed for o in outcomes)
    broken = sum(r.execution.error is not None for r in results)
    failed = sum(not r.ok for r in results)
    text = (f"{len(results)} notebook(s): {len(results) - failed} passed, {failed} failed; "
            f"{good} of {len(outcomes)} figure checks passed")
    return text + (f"; {broken} notebook(s) raised" if broken else "")


def _clean(text: str) -> str:
    return _XML_BAD.sub("?", text)


def _classname(notebook: Path) -> str:
    """``notebooks/00_quickstart.ipynb`` -> ``notebooks.00_quickstart`` (relative to the working dir)."""
    try:
        notebook = notebook.resolve().relative_to(Path.cwd().resolve())
    except (ValueError, OSError):
        notebook = Path(*notebook.parts[1:]) if notebook.is_absolute() else notebook
    return ".".join(notebook.with_suffix("").parts) or notebook.stem


def _suite(result: NotebookResult) -> ET.Element:
    notebook = result.plan.notebook
    classname = _classname(Path(notebook))
    suite = ET.Element("testsuite", name=str(notebook))
    failures = errors = skipped = 0
    props = ET.SubElement(suite, "properties")
    for key, value in result.plan.parameters.items():
        ET.SubElement(props, "property", name=f"parameter.{key}", value=_clean(repr(value)))
    for variant in result.plan.variants:
        ET.SubElement(props, "property", name="variant", value=variant)
    for o in result.outcomes:
        case = ET.SubElement(suite, "testcase", name=o.figure, classname=classname, time="0.000")
        if o.status == "unchecked":
            ET.SubElement(case, "skipped", message=_clean(f"recorded {o.got}, no expectation"))
            skipped += 1
        elif not o.passed:
            failure = ET.SubElement(case, "failure", message=_clean(o.message()), type=f"figure-{o.status}")
            failure.text = _clean(f"expected {o.expected}, got {o.got}, tolerance {o.tolerance}: {o.detail}")
            failures += 1
    error = result.execution.error
    if error is not None:
        case = ET.SubElement(suite, "testcase", name=EXECUTE_CASE, classname=classname,
                             time=f"{result.execution.seconds:.3f}")
        node = ET.SubElement(case, "error", message=_clean(error.summary()), type=error.ename)
        node.text = _clean(error.describe())
        errors += 1
    if not len(props):
        suite.remove(props)
    tests = len(result.outcomes) + (error is not None)
    suite.attrib.update(tests=str(tests), failures=str(failures), errors=str(errors), skipped=str(skipped),
                        time=f"{result.execution.seconds:.3f}",
                        timestamp=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S"),
                        hostname=platform.node() or "localhost")
    return suite


def junit_tree(results: Sequence[NotebookResult]) -> ET.ElementTree:
    """``<testsuites>`` with one ``<testsuite>`` per notebook and one ``<testcase>`` per figure."""
    root = ET.Element("testsuites", name="opsnn_lab.validate")
    suites = [_suite(r) for r in results]
    root.extend(suites)
    for key in ("tests", "failures", "errors"):
        root.set(key, str(sum(int(s.get(key)) for s in suites)))
    root.set("time", f"{sum(float(s.get('time')) for s in suites):.3f}")
    return ET.ElementTree(root)


def write_junit(results: Sequence[NotebookResult], path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tree = junit_tree(results)
    ET.indent(tree)
    tree.write(path, encoding="utf-8", xml_declaration=True)
    return path
