"""Lazy re-exports: a package lists ``name -> module`` and imports a module on first use."""

from __future__ import annotations

import importlib


def lazy_exports(namespace: dict, exports: dict[str, str]):
    """Return ``(__getattr__, __dir__)`` for a package whose names live in submodules."""
    package = namespace["__name__"]

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target = exports[name]
        module = importlib.import_module(target if target.startswith("opsnn_lab") else f"{package}.{target}")
        value = getattr(module, name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(exports) | {k for k in namespace if not k.startswith("_")})

    return __getattr__, __dir__
