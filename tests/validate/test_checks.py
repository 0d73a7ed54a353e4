"""Checking one recorded figure: tolerances, bounds, lists and dicts, and what a failure says."""

import pytest

from opsnn_lab.validate import FigureCheck, check_figure


def check(**kwargs):
    return FigureCheck(name="fig", where="x.expect.toml:1", **kwargs)


@pytest.mark.parametrize("kwargs, got, passed", [
    ({"value": 2.0, "rel": 0.1}, 2.19, True),
    ({"value": 2.0, "rel": 0.1}, 2.21, False),
    ({"value": 2.0, "rel": 0.1}, 1.79, False),
    ({"value": 2.0, "abs": 0.5}, 2.5, True),  # bounds of the tolerance are inclusive
    ({"value": 2.0, "abs": 0.5}, 2.51, False),
    ({"value": 0.0, "rel": 0.5}, 1e-9, False),  # rel of zero is zero: needs abs
    ({"value": 0.0, "rel": 0.5, "abs": 1e-6}, 1e-9, True),
    ({"value": 100.0, "rel": 0.01, "abs": 2.0}, 101.9, True),  # the larger of rel*|value| and abs
    ({"value": 3}, 3, True),
    ({"value": 3}, 3.0000001, True),  # default rel 1e-6
    ({"value": 3}, 3.00001, False),
    ({"min": 1}, 1, True),
    ({"min": 1}, 0.99, False),
    ({"max": 0.5}, 0.5, True),
    ({"max": 0.5}, 0.51, False),
    ({"min": 0, "max": 1}, [0.0, 0.5, 1.0], True),
    ({"min": 0, "max": 1}, {"a": 0.2, "b": 1.2}, False),
    ({"max": 1}, [], False),  # nothing to bound is not a pass
    ({"value": 2.0, "abs": 1, "max": 2.5}, 2.7, False),  # value and bound both apply
    ({"value": [1.0, 2.0], "abs": 0.1}, [1.05, 1.95], True),
    ({"value": [1.0, 2.0], "abs": 0.1}, [1.05, 2.5], False),
    ({"value": [1.0, 2.0]}, [1.0], False),
    ({"value": {"a": 1, "b": 2}}, {"a": 1, "b": 2}, True),
    ({"value": {"a": 1, "b": 2}}, {"a": 1}, False),
    ({"value": {"a": 1}}, {"a": 1, "c": 3}, False),
    ({"value": "conv_bn_relu"}, "conv_bn_relu", True),
    ({"value": "conv_bn_relu"}, "qkv", False),
    ({"value": True}, True, True),
    ({"value": True}, 1, False),
    ({"value": 1.0, "rel": 1.0}, "nan", False),  # how ol.record stores a NaN
    ({"max": 1e30}, "inf", False),
    ({"min": 0}, "nan", False),
    ({"value": 1.0}, "1.0", False),  # a string is not a number
    ({"max": 1.0}, None, False),
])
def test_pass_or_fail(kwargs, got, passed):
    outcome = check_figure(check(**kwargs), got)
    assert outcome.passed is passed, outcome.message()
    assert outcome.status == ("pass" if passed else "fail")


def test_out_of_tolerance_says_by_how_much():
    outcome = check_figure(check(value=2.5, rel=0.2), 3.3)
    assert outcome.status == "fail"
    assert (outcome.expected, outcome.got, outcome.tolerance) == ("2.5", "3.3", "rel 0.2")
    assert "off by +0.8 (+0.32 relative), allowed +-0.5" in outcome.detail
    assert outcome.message().startswith("figure 'fig' is out of tolerance: got 3.3, expected 2.5")


def test_bound_failure_says_by_how_much():
    outcome = check_figure(check(max=0.5, note="fused saves half"), 0.75)
    assert outcome.detail == "0.75 is above max 0.5 by 0.25 [fused saves half]"
    assert outcome.expected == "<= 0.5" and outcome.tolerance == "-"
    low = check_figure(check(min=1, max=2), 0.5)
    assert low.detail == "0.5 is below min 1 by 0.5" and low.expected == "in [1, 2]"


def test_list_failure_names_the_worst_element_and_counts_the_rest():
    outcome = check_figure(check(value=[1.0, 2.0, 3.0], abs=0.1), [1.2, 2.0, 4.0])
    assert outcome.detail == "[2]: off by +1 (+0.333 relative), allowed +-0.1 (2 elements fail)"
    keyed = check_figure(check(max=1), {"layer.0": 0.5, "layer.1": 3.0})
    assert keyed.detail == "['layer.1']: 3 is above max 1 by 2"


def test_missing_figure_fails_and_says_where_execution_stopped():
    outcome = check_figure(check(value=1.0), recorded=False, stopped="execution stopped at cell 3 (In [3])")
    assert not outcome.passed and outcome.status == "missing"
    assert outcome.detail == "was never recorded (execution stopped at cell 3 (In [3]))"
    assert outcome.message() == ("figure 'fig' was never recorded (execution stopped at cell 3 (In [3])) "
                                 "(expected 1.0)")


def test_got_is_shortened_for_the_table():
    outcome = check_figure(check(min=0), [0.123456789] * 20)
    assert outcome.passed and outcome.got.endswith("...") and len(outcome.got) == 48
    assert outcome.got.startswith("[0.123457, ")
