"""Session-wide test setup.

Triton decides between its interpreter and its compiler when it is first imported, so the
interpreter switch must be set before any test module imports it: without a GPU every Triton
kernel is tested under ``TRITON_INTERPRET=1`` against its torch reference.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    import pytest

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
