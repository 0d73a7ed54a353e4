"""The layers of STYLE.md hold in the source: arrows point down only, and the pillars have no import cycles.

Read with ``ast`` (nothing is imported), counting every import statement, also the ones inside functions:
a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "opsnn_lab"
PILLARS = ("kernels", "ops", "fusion", "precision", "consistency")
# what sits above the pillars: benchmarks, demos, the embedded demo models, the widgets, the training
# loop and its command line, the integrations, the notebook report and validation
ABOVE = ("opsnn_lab.bench", "opsnn_lab.demos", "opsnn_lab.models", "opsnn_lab.widgets", "opsnn_lab.training",
         "opsnn_lab.training_setup", "opsnn_lab.train", "opsnn_lab.parallel", "opsnn_lab.integrations",
         "opsnn_lab.report", "opsnn_lab.validate")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every opsnn_lab module ``path`` imports; ``from pkg import name`` counts as ``pkg.name`` as well."""
    this = module_name(path, root)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in out if m == "opsnn_lab" or m.startswith("opsnn_lab.")}


def pillar_files() -> list[Path]:
    return sorted(p for pillar in PILLARS for p in (PACKAGE / pillar).rglob("*.py"))


def test_the_scan_sees_the_pillars_and_their_imports():
    files = pillar_files()
    assert len(files) > 20
    seen = imported_modules(PACKAGE / "fusion" / "measurement.py")
    assert "opsnn_lab.measuring" in seen and "opsnn_lab.measuring.activation_bytes" in seen


def test_the_scan_reads_lazy_relative_and_from_package_imports(tmp_path):
    pkg = tmp_path / "opsnn_lab" / "fusion"
    pkg.mkdir(parents=True)
    src = pkg / "x.py"
    src.write_text("import torch\nfrom . import plan\n\ndef f():\n    from opsnn_lab import bench\n"
                   "    from ..models import Encoder\n    import opsnn_lab.widgets.fusion_explorer\n")
    got = imported_modules(src, root=tmp_path)
    assert {"opsnn_lab.fusion.plan", "opsnn_lab.bench", "opsnn_lab.models", "opsnn_lab.models.Encoder",
            "opsnn_lab.widgets.fusion_explorer"} <= got
    assert not any(m.startswith("torch") for m in got)


@pytest.mark.parametrize("pillar", PILLARS)
def test_no_pillar_imports_a_layer_above_it(pillar):
    bad = []
    for path in sorted((PACKAGE / pillar).rglob("*.py")):
        for mod in sorted(imported_modules(path)):
            if any(mod == up or mod.startswith(up + ".") for up in ABOVE):
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "a pillar reaches up a layer:\n" + "\n".join(bad)


def _graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imported_modules(path) if m in files and m != name} for name, path in files.items()}


def _cycles(graph: dict[str, set[str]], nodes: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), within ``nodes``."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in nodes:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph, set(graph)) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}, {"a", "b"}) == []


@pytest.mark.parametrize("pillar", PILLARS)
def test_no_import_cycle_inside_a_pillar(pillar):
    graph = _graph()
    # the pillar's modules, not its __init__: that one only re-exports them lazily (``_lazy.lazy_exports``)
    nodes = {m for m in graph if m.startswith(f"opsnn_lab.{pillar}.")}
    cycles = _cycles(graph, nodes)
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def _notebook_imports() -> list[tuple[str, str, list[str]]]:
    out = []
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        for cell in cells:
            if cell["cell_type"] != "code":
                continue
            src = "".join(cell["source"])
            tree = ast.parse("\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!"))))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("opsnn_lab"):
                    out.append((nb.name, node.module, [a.name for a in node.names]))
    return out


def _resolves(module: str, name: str) -> bool:
    try:
        if hasattr(importlib.import_module(module), name):
            return True
        return importlib.util.find_spec(f"{module}.{name}") is not None
    except ImportError:
        return False


def test_every_notebook_import_resolves():
    # the notebooks run as slow tests; a stale import path after a move should fail fast, here
    found = _notebook_imports()
    assert any(mod == "opsnn_lab.demos.precision" for _, mod, _ in found)
    missing = [f"{nb}: from {mod} import {name}" for nb, mod, names in found for name in names
               if not _resolves(mod, name)]
    assert not missing, "\n".join(missing)
