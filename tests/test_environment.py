"""environment.yml installs what the README's setup (the Makefile) installs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def _pip_section() -> list[str]:
    lines = (REPO / "environment.yml").read_text().splitlines()
    start = lines.index("  - pip:")
    out = []
    for line in lines[start + 1:]:
        m = re.match(r"^\s{6}- (.+)$", line)
        if not m:
            break
        out.append(m.group(1).strip().strip('"'))
    return out


def _makefile_var(name: str) -> str:
    m = re.search(rf"^{name} \?= (.+)$", (REPO / "Makefile").read_text(), re.M)
    assert m, f"Makefile has no {name}"
    return m.group(1).strip()


def test_environment_matches_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = re.search(r'pip install -q -e "\.\[([a-z,]+)\]"', (REPO / "Makefile").read_text()).group(1).split(",")
    expected = set(project["dependencies"])
    for extra in extras:
        expected |= set(project["optional-dependencies"][extra])
    pip = _pip_section()
    assert pip[0] == _makefile_var("TORCH_SPEC"), "environment.yml must pin the same torch first"
    assert pip[-1] == "-e ."
    assert set(pip[1:-1]) == expected


def test_environment_python_satisfies_requires_python():
    env = (REPO / "environment.yml").read_text()
    version = re.search(r"- python=(\d+)\.(\d+)", env).groups()
    minimum = re.search(r">=(\d+)\.(\d+)", tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
                        ["requires-python"]).groups()
    assert tuple(map(int, version)) >= tuple(map(int, minimum))


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    assert "make test" in readme and "make demo" in readme
    ci = [ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith("#")]
    assert ci[-1] == "make test"
