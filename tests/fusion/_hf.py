"""Hugging Face ``transformers`` for a test that builds one of its classes, or a skip saying what is missing."""

from __future__ import annotations

import pytest


def transformers_with(*names: str):
    """The ``transformers`` module, the test skipped where it is not installed or lacks one of ``names``."""
    T = pytest.importorskip("transformers")
    missing = [n for n in names if not hasattr(T, n)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not in transformers {T.__version__}")
    return T
