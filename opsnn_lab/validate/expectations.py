"""Read ``NN_topic.expect.toml``: the checks for a notebook's recorded figures (format in the package doc)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from opsnn_lab.validate.errors import ExpectationsError

__all__ = ["Expectations", "FigureCheck", "Variant", "expectations_path", "load_expectations",
           "parse_expectations"]

CHECK_KEYS = ("value", "rel", "abs", "min", "max", "note")
VARIANT_KEYS = ("parameters", "figures")
TOP_KEYS = ("figures", "variants")


@dataclass(frozen=True)
class FigureCheck:
    """What one recorded figure must satisfy; ``where`` is ``file:line`` of its table."""

    name: str
    value: object = None
    rel: float | None = None
    abs: float | None = None
    min: float | None = None
    max: float | None = None
    note: str | None = None
    where: str = ""


@dataclass(frozen=True)
class Variant:
    """Checks that replace the base ones (per figure) when the run's parameters match ``parameters``."""

    name: str
    parameters: dict
    figures: dict[str, FigureCheck]
    where: str = ""

    def matches(self, parameters: dict) -> bool:
        return all(k in parameters and same_value(parameters[k], v) for k, v in self.parameters.items())


@dataclass(frozen=True)
class Expectations:
    path: Path | None
    figures: dict[str, FigureCheck] = field(default_factory=dict)
    variants: dict[str, Variant] = field(default_factory=dict)

    def matching_variants(self, parameters: dict) -> list[Variant]:
        return [v for v in self.variants.values() if v.matches(parameters)]

    def checks_for(self, parameters: dict) -> dict[str, FigureCheck]:
        """Base checks, overridden figure by figure by every matching variant (in file order)."""
        checks = dict(self.figures)
        for variant in self.matching_variants(parameters):
            checks.update(variant.figures)
        return checks


def same_value(a, b) -> bool:
    """Parameter equality as a user means it: ``1 == 1.0``, but ``True`` is not ``1``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if _is_number(a) and _is_number(b):
        return float(a) == float(b)
    return a == b


def expectations_path(notebook) -> Path:
    """``notebooks/00_quickstart.ipynb`` -> ``notebooks/00_quickstart.expect.toml``."""
    return Path(notebook).with_suffix(".expect.toml")


def load_expectations(path) -> Expectations:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ExpectationsError(path, "no such expectations file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ExpectationsError(path, f"cannot read expectations file: {err}") from None
    return parse_expectations(text, path)


def parse_expectations(text: str, path="<expectations>") -> Expectations:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        match = re.search(r"at line (\d+)", str(err))
        raise ExpectationsError(path, f"malformed TOML: {err}",
                                int(match.group(1)) if match else None) from None
    parser = _Parser(text, path)
    parser.only_keys(data, (), TOP_KEYS)
    figures = parser.figures(data.get("figures", {}), ())
    variants = {}
    raw_variants = data.get("variants", {})
    parser.require_table(raw_variants, ("variants",))
    for name, raw in raw_variants.items():
        variants[name] = parser.variant(name, raw)
    if not figures and not variants:
        raise ExpectationsError(path, "no [figures.NAME] table: nothing to check", 1)
    return Expectations(Path(path), figures, variants)


class _Parser:
    """Turns the TOML dict into checks; errors carry the line of the offending table or key."""

    def __init__(self, text: str, path):
        self.lines = text.splitlines()
        self.path = path

    def fail(self, keys: tuple, message: str):
        raise ExpectationsError(self.path, message, _line_of(self.lines, keys))

    def where(self, keys: tuple) -> str:
        line = _line_of(self.lines, keys)
        return f"{self.path}:{line}" if line else str(self.path)

    def require_table(self, value, keys: tuple):
        if not isinstance(value, dict):
            self.fail(keys, f"[{'.'.join(keys)}] must be a table, got {type(value).__name__}")

    def only_keys(self, table: dict, keys: tuple, allowed: tuple):
        for key in table:
            if key not in allowed:
                where = f"[{'.'.join(keys)}]" if keys else "top level"
                self.fail((*keys, key), f"{where}: unknown key {key!r} (allowed: {', '.join(allowed)})")

    def variant(self, name: str, raw) -> Variant:
        keys = ("variants", name)
        self.require_table(raw, keys)
        self.only_keys(raw, keys, VARIANT_KEYS)
        params = raw.get("parameters")
        if not isinstance(params, dict) or not params:
            self.fail(keys, f"[variants.{name}] needs parameters = {{name = value, ...}} saying when it applies")
        figures = self.figures(raw.get("figures", {}), keys)
        if not figures:
            self.fail(keys, f"[variants.{name}] has no [variants.{name}.figures.NAME] table")
        return Variant(name, dict(params), figures, self.where(keys))

    def figures(self, raw, prefix: tuple) -> dict[str, FigureCheck]:
        keys = (*prefix, "figures")
        self.require_table(raw, keys)
        return {name: self.check(name, table, (*keys, name)) for name, table in raw.items()}

    def check(self, name: str, table, keys: tuple) -> FigureCheck:
        label = f"[{'.'.join(keys)}]"
        if not isinstance(table, dict):
            self.fail(keys, f"{label} must be a table with keys {', '.join(CHECK_KEYS)}")
        self.only_keys(table, keys, CHECK_KEYS)
        if not any(k in table for k in ("value", "min", "max")):
            self.fail(keys, f"{label} needs at least one of value, min, max")
        for key in ("rel", "abs", "min", "max"):
            if key in table and not _is_number(table[key]):
                self.fail((*keys, key), f"{label}: {key} must be a number, got {table[key]!r}")
        for key in ("rel", "abs"):
            if key in table and ("value" not in table or not table[key] >= 0):
                self.fail((*keys, key), f"{label}: {key} must be >= 0 and comes with a value")
        if "min" in table and "max" in table and table["min"] > table["max"]:
            self.fail((*keys, "min"), f"{label}: min {table['min']} is above max {table['max']}")
        if "value" in table:
            self.check_value(table["value"], (*keys, "value"), label)
        if "note" in table and not isinstance(table["note"], str):
            self.fail((*keys, "note"), f"{label}: note must be a string")
        return FigureCheck(name=name, where=self.where(keys), **table)

    def check_value(self, value, keys: tuple, label: str):
        if isinstance(value, dict):
            for v in value.values():
                self.check_value(v, keys, label)
        elif isinstance(value, list):
            for v in value:
                self.check_value(v, keys, label)
        elif not isinstance(value, (str, bool, int, float)):
            self.fail(keys, f"{label}: value must be a number, string, boolean, array or table, "
                            f"got {type(value).__name__}")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not (
        isinstance(x, float) and math.isnan(x))


def _key_re(key: str) -> str:
    return rf"(?:{re.escape(key)}|\"{re.escape(key)}\"|'{re.escape(key)}')"


def _header_re(keys: tuple) -> re.Pattern:
    return re.compile(r"^\s*\[\s*" + r"\s*\.\s*".join(_key_re(k) for k in keys) + r"\s*\]")


def _line_of(lines: list[str], keys: tuple) -> int | None:
    """1-based line of the table ``keys`` (or of its deepest key found), for error messages."""
    for n in range(len(keys), 0, -1):
        header = _header_re(keys[:n])
        for i, line in enumerate(lines):
            if not header.match(line):
                continue
            if n == len(keys):
                return i + 1
            assign = re.compile(rf"^\s*{_key_re(keys[n])}\s*[.=]")
            for j in range(i + 1, len(lines)):
                if lines[j].lstrip().startswith("["):
                    break
                if assign.match(lines[j]):
                    return j + 1
            return i + 1
    if keys:  # a top-level dotted key such as ``figures.loss.max = 1``
        dotted = re.compile(r"^\s*" + r"\s*\.\s*".join(_key_re(k) for k in keys[:1]) + r"\s*[.=]")
        for i, line in enumerate(lines):
            if line.lstrip().startswith("["):
                break
            if dotted.match(line):
                return i + 1
    return None
