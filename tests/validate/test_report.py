"""The report: a table a person reads, and JUnit XML that follows the common JUnit schema."""

import re
import xml.etree.ElementTree as ET

import nbformat as nbf
import pytest

from opsnn_lab.recording import RECORD_MIME
from opsnn_lab.validate import (
    CellError,
    Execution,
    NotebookResult,
    format_result,
    format_summary,
    junit_tree,
    plan_notebook,
    write_junit,
)
from opsnn_lab.validate.runner import evaluate

# the common JUnit schema (Jenkins junit-10.xsd / Ant): allowed attributes, required ones, child order
ALLOWED = {
    "testsuites": {"name", "time", "tests", "failures", "errors", "disabled"},
    "testsuite": {"name", "tests", "failures", "errors", "skipped", "disabled", "time", "timestamp", "hostname",
                  "id", "package", "file", "log", "url", "version"},
    "testcase": {"name", "classname", "time", "assertions", "status", "file", "line"},
    "failure": {"message", "type"}, "error": {"message", "type"}, "skipped": {"message"},
    "property": {"name", "value"},
}
REQUIRED = {"testsuite": {"name", "tests"}, "testcase": {"name"}, "property": {"name", "value"}}
SUITE_ORDER = ["properties", "testcase", "system-out", "system-err"]
CASE_CHILDREN = {"skipped", "error", "failure", "system-out", "system-err"}
DECIMAL = re.compile(r"^\d+(\.\d+)?$")
TIMESTAMP = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}$")


def assert_junit_schema(root: ET.Element):
    """Structural check against the common JUnit schema's rules (no xmlschema needed)."""
    assert root.tag == "testsuites"
    for node in root.iter():
        assert set(node.attrib) <= ALLOWED.get(node.tag, set(node.attrib)), (node.tag, node.attrib)
        assert REQUIRED.get(node.tag, set()) <= set(node.attrib), (node.tag, node.attrib)
        for key in ("tests", "failures", "errors", "skipped", "disabled"):
            if key in node.attrib:
                assert node.get(key).isdigit(), (node.tag, key, node.get(key))
        if "time" in node.attrib:
            assert DECIMAL.match(node.get("time")), node.get("time")
    suites = list(root)
    assert suites and all(s.tag == "testsuite" for s in suites)
    for suite in suites:
        order = [SUITE_ORDER.index(child.tag) for child in suite]  # ValueError: an element not allowed here
        assert order == sorted(order), [c.tag for c in suite]
        assert TIMESTAMP.match(suite.get("timestamp", "2000-01-01T00:00:00"))
        cases = suite.findall("testcase")
        assert int(suite.get("tests")) == len(cases)
        for key, tag in (("failures", "failure"), ("errors", "error"), ("skipped", "skipped")):
            assert int(suite.get(key, 0)) == sum(case.find(tag) is not None for case in cases), key
        for case in cases:
            assert {child.tag for child in case} <= CASE_CHILDREN
            assert len(case.findall("skipped")) <= 1
            for bad in case.findall("failure") + case.findall("error"):
                assert bad.get("message"), "a failure needs a message"
    for key in ("tests", "failures", "errors"):
        assert int(root.get(key)) == sum(int(s.get(key)) for s in suites)
    assert float(root.get("time")) == pytest.approx(sum(float(s.get("time")) for s in suites), abs=2e-3)


def executed(tmp_path, name, expectations, records, error=None):
    """A planned notebook and a hand-made execution (outputs as papermill writes them)."""
    nb = nbf.v4.new_notebook()
    nb.cells = [nbf.v4.new_code_cell("steps = 2"), nbf.v4.new_code_cell("ol.record(...)")]
    nb.cells[0].metadata["tags"] = ["parameters"]
    nbf.write(nb, tmp_path / f"{name}.ipynb")
    (tmp_path / f"{name}.expect.toml").write_text(expectations)
    plan = plan_notebook(tmp_path / f"{name}.ipynb", {"steps": 3})
    nb.cells[1].outputs = [nbf.v4.new_output("display_data", data={RECORD_MIME: {"name": k, "value": v}})
                           for k, v in records.items()]
    execution = Execution(plan.notebook, nb, plan.parameters, 1.25, error)
    return NotebookResult(plan, execution, evaluate(plan, execution))


@pytest.fixture
def results(tmp_path):
    good = executed(tmp_path, "good", "[figures.loss]\nvalue = 2.0\nrel = 0.1\n", {"loss": 2.1, "extra": 1})
    error = CellError(1, 2, "ZeroDivisionError", "division by zero", "Traceback ...\nZeroDivisionError: x\x1b",
                      "1/0")
    bad = executed(tmp_path, "bad", "[figures.loss]\nvalue = 2.0\nrel = 0.1\n[figures.ratio]\nmax = 0.5\n"
                                    "[figures.late]\nmin = 0\n", {"loss": 2.5, "ratio": 0.25}, error)
    return good, bad


def test_table_shows_figure_expected_got_tolerance_result(results):
    good, bad = results
    text = format_result(bad)
    lines = text.splitlines()
    assert lines[0] == f"{bad.plan.notebook}: FAILED in 1.2 s (parameters: steps=3)"
    assert lines[1].split() == ["figure", "expected", "got", "tolerance", "result"]
    assert lines[2].split()[:5] == ["loss", "2.0", "2.5", "rel", "0.1"]
    assert "FAIL: off by +0.5 (+0.25 relative), allowed +-0.2" in lines[2]
    assert lines[3].split() == ["ratio", "<=", "0.5", "0.25", "-", "pass"]
    assert "MISSING: was never recorded (execution stopped at cell 1 (In [2]))" in lines[4]
    assert "execution stopped: cell 1 (In [2]) raised ZeroDivisionError: division by zero" in text
    assert "Traceback ..." in text
    good_text = format_result(good)
    assert good_text.splitlines()[0].startswith(f"{good.plan.notebook}: passed")
    assert "unchecked: recorded, no expectation" in good_text
    assert format_summary([good, bad]) == ("2 notebook(s): 1 passed, 1 failed; 2 of 4 figure checks passed; "
                                          "1 notebook(s) raised")


def test_junit_follows_the_common_schema_one_testcase_per_figure(results, tmp_path):
    path = write_junit(results, tmp_path / "deep" / "validate.xml")
    assert path.read_text().startswith("<?xml version='1.0' encoding='utf-8'?>")
    root = ET.parse(path).getroot()
    assert_junit_schema(root)
    good, bad = root.findall("testsuite")
    assert [c.get("name") for c in good.findall("testcase")] == ["loss", "extra"]
    assert good.find("testcase[@name='extra']/skipped") is not None
    assert (good.get("tests"), good.get("failures"), good.get("errors")) == ("2", "0", "0")
    assert [c.get("name") for c in bad.findall("testcase")] == ["loss", "ratio", "late", "execute"]
    assert (bad.get("tests"), bad.get("failures"), bad.get("errors")) == ("4", "2", "1")
    failure = bad.find("testcase[@name='loss']/failure")
    assert failure.get("message").startswith("figure 'loss' is out of tolerance: got 2.5, expected 2.0")
    assert bad.find("testcase[@name='late']/failure").get("type") == "figure-missing"
    error = bad.find("testcase[@name='execute']/error")
    assert error.get("type") == "ZeroDivisionError" and "Traceback ..." in error.text
    assert "\x1b" not in error.text  # control characters are not allowed in XML 1.0
    assert bad.find("testcase").get("classname").endswith(".bad")
    assert not bad.find("testcase").get("classname").startswith((".", "/"))
    assert bad.find("properties/property").attrib == {"name": "parameter.steps", "value": "3"}
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("6", "2", "1")


@pytest.mark.parametrize("mutate", [
    lambda root: root.find("testsuite").set("tests", "9"),
    lambda root: root.find("testsuite/testcase").attrib.pop("name"),
    lambda root: root.find("testsuite").insert(5, ET.Element("properties")),
    lambda root: root.find("testsuite/testcase").set("duration", "1"),
    lambda root: root.find(".//failure").attrib.pop("message"),
    lambda root: root.set("time", "soon"),
])
def test_schema_check_rejects_broken_reports(results, mutate):
    root = junit_tree(results).getroot()
    assert_junit_schema(root)
    mutate(root)
    with pytest.raises((AssertionError, ValueError)):
        assert_junit_schema(root)
