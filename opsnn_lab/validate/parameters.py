"""Notebook parameters: the cell tagged ``parameters``, ``-p name=value`` parsing, unknown-name checks."""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass, field

from opsnn_lab.validate.errors import NotebookInputError

__all__ = ["UNKNOWN", "ParametersCell", "check_known", "find_parameters_cell", "parse_assignment"]

PARAMETERS_TAG = "parameters"


class _Unknown:
    def __repr__(self):
        return "<not a literal>"


UNKNOWN = _Unknown()  # default of a parameter whose value is an expression, not a literal


@dataclass(frozen=True)
class ParametersCell:
    """The tagged cell of one notebook: its index and ``name -> default`` (``UNKNOWN`` if not a literal)."""

    notebook: str
    index: int | None
    defaults: dict = field(default_factory=dict)
    inspectable: bool = True  # False for a kernel language whose assignments we cannot read

    def effective(self, overrides: dict) -> dict:
        """Defaults overridden by the values passed in; what the executed notebook will see."""
        return {**{k: v for k, v in self.defaults.items() if v is not UNKNOWN}, **overrides}


def parse_assignment(text: str) -> tuple[str, object]:
    """``"steps=20"`` -> ``("steps", 20)``: Python literals when they parse, else the string itself."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or not name.isidentifier():
        raise NotebookInputError(f"parameter {text!r} must look like name=value")
    return name, parse_value(raw.strip())


def parse_value(raw: str):
    lowered = {"true": True, "false": False, "none": None, "null": None}
    if raw.lower() in lowered:
        return lowered[raw.lower()]
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw


def declared_language(nb) -> str | None:
    meta = nb.get("metadata", {})
    return meta.get("kernelspec", {}).get("language") or meta.get("language_info", {}).get("name")


def find_parameters_cell(nb, notebook: str = "<notebook>") -> ParametersCell:
    """Read the cell tagged ``parameters``; names come from its top-level assignments."""
    tagged = [i for i, cell in enumerate(nb.cells) if PARAMETERS_TAG in cell.get("metadata", {}).get("tags", [])]
    if not tagged:
        return ParametersCell(notebook, None, {})
    index = tagged[0]
    if (declared_language(nb) or "python").lower() != "python":
        # papermill can inject into other kernels but reads assignments only for Python: accept any name
        return ParametersCell(notebook, index, {}, inspectable=False)
    return ParametersCell(notebook, index, _python_assignments(nb.cells[index].source, notebook, index))


def _python_assignments(source: str, notebook: str, index: int) -> dict:
    # IPython magics and shell escapes are not Python; blank them so ast can read the rest
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError as err:
        raise NotebookInputError(f"{notebook}: the cell tagged 'parameters' (cell {index}) is not valid "
                                 f"Python at its line {err.lineno}: {err.msg}") from None
    defaults = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            for name in _names(target):
                defaults[name] = _literal(value) if isinstance(target, ast.Name) else UNKNOWN
    return defaults


def _names(target) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _names(elt)]
    return []


def _literal(node):
    if node is None:
        return UNKNOWN
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return UNKNOWN


def check_known(cell: ParametersCell, names, what: str = "parameter") -> None:
    """Raise if any name is not assigned in the tagged cell (papermill itself only logs a warning)."""
    for name in names:
        if name in cell.defaults or (cell.index is not None and not cell.inspectable):
            continue
        if cell.index is None:
            raise NotebookInputError(f"{cell.notebook}: unknown {what} {name!r}: the notebook has no cell "
                                     f"tagged 'parameters', so it takes no parameters")
        known = ", ".join(sorted(cell.defaults)) or "none"
        close = difflib.get_close_matches(name, list(cell.defaults), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise NotebookInputError(f"{cell.notebook}: unknown {what} {name!r}: the cell tagged 'parameters' "
                                 f"(cell {cell.index}) assigns {known}{hint}")
