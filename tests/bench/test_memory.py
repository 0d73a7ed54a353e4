"""activation_bytes: exact bytes autograd saves, unique storages, parameters excluded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opsnn_lab.bench import activation_bytes, saved_tensors_report


def test_linear_saves_its_input_only():
    lin = nn.Linear(16, 32)
    x = torch.randn(8, 16, requires_grad=True)
    # addmm saves the input (8x16 fp32); the weight is a parameter and not counted
    assert activation_bytes(lambda: lin(x)) == 8 * 16 * 4


def test_views_of_one_storage_count_once():
    x = torch.randn(64, requires_grad=True)

    def fn():
        a = x * 2
        return (a[:32] * a[32:]).sum()  # saves two views of `a`

    assert activation_bytes(fn) == 64 * 4


def test_gelu_dropout_chain_eager_bytes():
    x = torch.randn(4, 10, requires_grad=True)
    torch.manual_seed(0)
    drop = nn.Dropout(0.5).train()
    report = saved_tensors_report(lambda: drop(torch.nn.functional.gelu(x)))
    # gelu saves x; on CPU eager dropout multiplies by a float mask and saves it (4 bytes an element,
    # where CUDA's native_dropout keeps a bool mask): the baseline fused dropout is measured against
    assert [r["dtype"] for r in report.tensors] == ["float32", "float32"]
    assert report.total_bytes == 2 * 4 * 10 * 4
    assert report.by_dtype() == {"float32": 320}


def test_no_grad_saves_nothing():
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        assert activation_bytes(lambda: lin(torch.randn(2, 4))) == 0


def test_exclude_and_bad_argument():
    x = torch.randn(8, requires_grad=True)
    y = x * 1.0
    assert activation_bytes(lambda: (y * y).sum(), exclude=(y,)) == 0
    with pytest.raises(TypeError, match="fn"):
        activation_bytes(42)
