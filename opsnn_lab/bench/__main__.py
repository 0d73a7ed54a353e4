"""``python -m opsnn_lab.bench NAME [args]``: run one benchmark, or ``all``."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import opsnn_lab.bench as _bench

# modules the benchmarks share (no ``main``): measuring helpers and the row builders of ``ops``
_NOT_BENCHMARKS = {"allocator", "chains_conv", "chains_mlp", "chains_norm", "common", "machine", "memory"}


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(_bench.__path__)
                  if not m.name.startswith("_") and m.name not in _NOT_BENCHMARKS)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m opsnn_lab.bench {" + ",".join([*names, "all"]) + "} [options]")
        print("each benchmark takes --help; results go to build/bench/NAME.json")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "all":
        code = 0
        for n in names:
            print(f"\n=== {n} ===", flush=True)
            code |= importlib.import_module(f"opsnn_lab.bench.{n}").main(rest) or 0
        return code
    if name not in names:
        print(f"unknown benchmark {name!r}; choose from {', '.join(names)}", file=sys.stderr)
        return 2
    return importlib.import_module(f"opsnn_lab.bench.{name}").main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
