"""Expectations files: the documented format parses; every malformed file names its file and line."""

import pytest

from opsnn_lab.validate import ExpectationsError, expectations_path, load_expectations, parse_expectations

GOOD = """\
[figures.final_loss]
value = 2.3
rel = 0.2
note = "20 steps"

[figures.ratio]
max = 0.5

[figures.per_layer]
value = [1.0, 2.0]
abs = 0.05
min = 0

[variants.full]
parameters = { steps = 2000 }
[variants.full.figures.final_loss]
max = 0.5

[variants.fp16]
parameters = { dtype = "float16", steps = 2000 }
[variants.fp16.figures.ratio]
max = 0.3
"""


def test_documented_format_parses(tmp_path):
    path = tmp_path / "00_x.expect.toml"
    path.write_text(GOOD)
    exp = load_expectations(path)
    loss = exp.figures["final_loss"]
    assert (loss.value, loss.rel, loss.abs, loss.note) == (2.3, 0.2, None, "20 steps")
    assert loss.where == f"{path}:1"
    assert exp.figures["ratio"].max == 0.5 and exp.figures["ratio"].value is None
    assert exp.figures["per_layer"].value == [1.0, 2.0] and exp.figures["per_layer"].min == 0
    assert list(exp.variants) == ["full", "fp16"]
    assert exp.variants["fp16"].parameters == {"dtype": "float16", "steps": 2000}
    assert exp.variants["full"].figures["final_loss"].where == f"{path}:16"


def test_expectations_path_sits_next_to_the_notebook(tmp_path):
    assert expectations_path(tmp_path / "03_topic.ipynb") == tmp_path / "03_topic.expect.toml"


@pytest.mark.parametrize("parameters, active, loss_check, ratio_max", [
    ({"steps": 20}, [], ("value", 2.3), 0.5),
    ({"steps": 2000}, ["full"], ("max", 0.5), 0.5),
    ({"steps": 2000.0, "dtype": "float16"}, ["full", "fp16"], ("max", 0.5), 0.3),  # 2000.0 == 2000
    ({"dtype": "float16"}, [], ("value", 2.3), 0.5),  # every variant parameter must match
])
def test_variants_override_base_checks_figure_by_figure(parameters, active, loss_check, ratio_max):
    exp = parse_expectations(GOOD, "x.expect.toml")
    assert [v.name for v in exp.matching_variants(parameters)] == active
    checks = exp.checks_for(parameters)
    key, expected = loss_check
    assert getattr(checks["final_loss"], key) == expected
    assert checks["ratio"].max == ratio_max
    assert checks["per_layer"].value == [1.0, 2.0]  # not overridden by any variant: still applies


def test_boolean_parameter_does_not_match_integer():
    exp = parse_expectations("[variants.on]\nparameters = {flag = true}\n[variants.on.figures.a]\nmax = 1\n")
    assert not exp.variants["on"].matches({"flag": 1})
    assert exp.variants["on"].matches({"flag": True})


@pytest.mark.parametrize("text, line, words", [
    ("[figures.loss]\nvalue = 2.3\nrel = \n", 3, "malformed TOML"),
    ("[figures.loss]\nvalue = 2.3\n[figures.loss]\nmax = 1\n", 3, "malformed TOML"),
    ("[figures.a]\nmax = 1\n\n[figures.loss]\nvalue = 2.3\ntol = 0.1\n", 6, "unknown key 'tol'"),
    ("[figures.a]\nmax = 1\n[figures.loss]\nnote = 'x'\n", 3, "needs at least one of value, min, max"),
    ("[figures.loss]\nmax = 1\nrel = 0.1\n", 3, "rel must be >= 0 and comes with a value"),
    ("[figures.loss]\nvalue = 1\nabs = -0.1\n", 3, "abs must be >= 0"),
    ("[figures.loss]\nvalue = 1\nrel = 'big'\n", 3, "rel must be a number"),
    ("[figures.loss]\nmin = 2\nmax = 1\n", 2, "min 2 is above max 1"),
    ("[figures.loss]\nvalue = 1979-05-27\n", 2, "value must be a number"),
    ("[figures]\nloss = 3\n", 2, "must be a table"),
    ("title = 'x'\n[figures.a]\nmax = 1\n", 1, "top level: unknown key 'title'"),
    ("[figures.a]\nmax = 1\n[variants.big]\nfigures.a.max = 2\n", 3, "needs parameters"),
    ("[variants.big]\nparameters = {steps = 9}\n", 1, "has no [variants.big.figures.NAME]"),
    ("[variants.big]\nparameters = {steps = 9}\nextra = 1\n[variants.big.figures.a]\nmax = 1\n", 3,
     "unknown key 'extra'"),
    ("# nothing yet\n", 1, "nothing to check"),
])
def test_malformed_file_names_file_and_line(tmp_path, text, line, words):
    path = tmp_path / "nb.expect.toml"
    path.write_text(text)
    with pytest.raises(ExpectationsError) as info:
        load_expectations(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert words in message
    assert info.value.line == line and info.value.path == str(path)
    assert isinstance(info.value, ValueError)


def test_missing_or_unreadable_file_is_named(tmp_path):
    with pytest.raises(ExpectationsError, match=r"nope\.expect\.toml: no such expectations file"):
        load_expectations(tmp_path / "nope.expect.toml")
    bad = tmp_path / "latin.expect.toml"
    bad.write_bytes(b"[figures.a]\nnote = '\xe9'\nmax = 1\n")
    with pytest.raises(ExpectationsError, match=r"latin\.expect\.toml: cannot read"):
        load_expectations(bad)
