"""The example CI workflow installs with the README's command and runs a validate command that parses."""

import re
import shlex
from pathlib import Path

import yaml

from opsnn_lab.validate.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "validate.yml"


def steps():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    (job,) = workflow["jobs"].values()
    return job["steps"]


def test_installs_with_make_setup():
    runs = [s.get("run", "") for s in steps()]
    assert any(re.match(r"make setup\b", r.strip()) for r in runs)
    assert re.search(r"^setup:", (ROOT / "Makefile").read_text(), re.MULTILINE)


def test_runs_the_validate_command_with_junit():
    (step,) = [s for s in steps() if "opsnn_lab.validate" in s.get("run", "")]
    command = step["run"].replace("\\\n", " ")
    line = next(x for x in command.splitlines() if "-m opsnn_lab.validate" in x)
    argv = shlex.split(line.split("|")[0])
    assert argv[:4] == ["python", "-m", "opsnn_lab.validate", "notebooks/*.ipynb"]
    args = build_parser().parse_args(argv[3:])  # every option the workflow uses exists
    assert args.junit == "build/validate.xml"
    assert step.get("shell") == "bash"  # pipefail: a failing validation fails the step despite `tee`
