"""Argument checks name the argument and the allowed range."""

from __future__ import annotations

import pytest
import torch

from opsnn_lab._checks import (
    check_bytes,
    check_choice,
    check_positive,
    check_range,
    check_tensor,
    check_type,
    same_device,
)


def test_check_tensor():
    t = torch.zeros(2, 3)
    assert check_tensor("x", t, dtypes=(torch.float32,), dim=2) is t
    with pytest.raises(TypeError, match=r"x must have dtype in \(float16\), got float32"):
        check_tensor("x", t, dtypes=(torch.float16,))
    with pytest.raises(ValueError, match="x must be 3-D"):
        check_tensor("x", t, dim=3)
    with pytest.raises(ValueError, match="at least 4 dims"):
        check_tensor("x", t, min_dim=4)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        check_tensor("x", [1])
    with pytest.raises(ValueError, match="x must be on meta"):
        check_tensor("x", t, device="meta")


def test_scalars():
    assert check_positive("lr", 0.1) == 0.1
    with pytest.raises(ValueError, match="lr must be > 0, got 0"):
        check_positive("lr", 0)
    with pytest.raises(TypeError, match="n must be an int"):
        check_positive("n", 1.0, integer=True)
    with pytest.raises(TypeError):
        check_positive("flag", True)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got 1"):
        check_range("p", 1, 0, 1, high_inclusive=False)
    with pytest.raises(ValueError, match="mode must be one of"):
        check_choice("mode", "x", {"a", "b"})
    with pytest.raises(TypeError, match="m must be int or float"):
        check_type("m", "s", (int, float))


def test_same_device():
    same_device(a=torch.zeros(1), b=torch.zeros(1), c=None)
    with pytest.raises(ValueError, match="b is on meta but a is on cpu"):
        same_device(a=torch.zeros(1), b=torch.zeros(1, device="meta"))


def test_check_linear_input_names_x():
    from torch import nn

    from opsnn_lab._checks import check_linear_input

    lin = nn.Linear(4, 3)
    check_linear_input(torch.ones(2, 4), lin)
    with pytest.raises(ValueError, match="x must have 4 features"):
        check_linear_input(torch.ones(2, 5), lin)
    with pytest.raises(TypeError, match="x has dtype torch.float64 but the weights are torch.float32"):
        check_linear_input(torch.ones(2, 4, dtype=torch.float64), lin)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        check_linear_input([1.0, 2.0], lin)


@pytest.mark.parametrize("value, want", [(0, 0), (4096, 4096), ("512MB", 512 * 10**6), ("2GiB", 2 * 2**30),
                                         ("1.5G", 3 * 2**29), (" 10 kb ", 10_000), ("64m", 64 * 2**20)])
def test_check_bytes_reads_sizes(value, want):
    assert check_bytes("limit", value) == want


@pytest.mark.parametrize("value, exc", [("lots", ValueError), ("-1MB", ValueError), ("3 parsecs", ValueError),
                                        (-1, ValueError), (1.5, TypeError), (True, TypeError), (None, TypeError)])
def test_check_bytes_names_the_argument(value, exc):
    with pytest.raises(exc, match="limit"):
        check_bytes("limit", value)
    assert check_bytes("limit", None, allow_none=True) is None
