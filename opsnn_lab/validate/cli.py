"""``python -m opsnn_lab.validate NOTEBOOK... [-p name=value ...] [--junit report.xml]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from opsnn_lab.validate.errors import NotebookInputError, ValidationInputError
from opsnn_lab.validate.parameters import parse_assignment

__all__ = ["build_parser", "main"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m opsnn_lab.validate",
        description="Execute notebooks with papermill and check the figures they record with "
                    "opsnn_lab.record against NN_topic.expect.toml next to each notebook.",
        epilog="Exit status: 0 all checks passed, 1 a check failed or a cell raised, 2 bad input.")
    p.add_argument("notebooks", nargs="+", metavar="NOTEBOOK",
                   help="notebooks to validate; a directory means every *.ipynb in it")
    p.add_argument("-p", "--parameter", action="append", default=[], metavar="NAME=VALUE",
                   help="override a parameter of the cell tagged 'parameters' (Python literal or string)")
    p.add_argument("--variant", metavar="NAME",
                   help="run with the parameters of [variants.NAME] in the expectations file")
    p.add_argument("--expect", metavar="FILE", help="expectations file (default: NOTEBOOK.expect.toml)")
    p.add_argument("--junit", metavar="FILE", help="write a JUnit XML report (one testcase per figure)")
    p.add_argument("--output-dir", metavar="DIR", help="keep the executed notebooks in DIR")
    p.add_argument("--kernel", metavar="NAME", help="kernel name (default: the notebook's, else python3)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="per-cell execution timeout (default: 600)")
    return p


def expand_notebooks(args: list[str]) -> list[Path]:
    out = []
    for arg in args:
        path = Path(arg)
        if path.is_dir():
            found = sorted(p for p in path.glob("*.ipynb") if not p.name.endswith(".nbconvert.ipynb"))
            if not found:
                raise NotebookInputError(f"{path}: directory has no *.ipynb notebook")
            out += found
        else:
            out.append(path)
    return out


def _output_paths(notebooks: list[Path], output_dir) -> list[Path | None]:
    """One executed copy per notebook in ``output_dir``; same-named notebooks get a numeric suffix."""
    if output_dir is None:
        return [None] * len(notebooks)
    seen: dict[str, int] = {}
    out = []
    for nb in notebooks:
        n = seen.get(nb.name, 0)
        seen[nb.name] = n + 1
        out.append(Path(output_dir) / (nb.name if n == 0 else f"{nb.stem}-{n}{nb.suffix}"))
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from opsnn_lab.validate.report import format_result, format_summary, write_junit
    from opsnn_lab.validate.runner import plan_notebook, run_plan

    try:  # every input is checked before the first kernel starts
        overrides = dict(parse_assignment(a) for a in args.parameter)
        notebooks = expand_notebooks(args.notebooks)
        plans = [plan_notebook(nb, overrides, expect=args.expect, variant=args.variant) for nb in notebooks]
    except ValidationInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    results = []
    for plan, output in zip(plans, _output_paths(notebooks, args.output_dir)):
        print(f"executing {plan.notebook} ...", file=sys.stderr, flush=True)
        result = run_plan(plan, output_path=output, kernel_name=args.kernel, timeout=args.timeout)
        results.append(result)
        print(format_result(result), flush=True)
    print(format_summary(results))
    if args.junit:
        print(f"JUnit report: {write_junit(results, args.junit)}")
    return EXIT_OK if all(r.ok for r in results) else EXIT_FAILED
