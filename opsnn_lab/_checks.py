"""Argument validation shared by every public entry point.

Errors name the argument and the allowed range, so a user reading a traceback
in a notebook knows what to change without opening the source.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch


def check_type(name: str, value, types, *, allow_none: bool = False):
    if value is None and allow_none:
        return value
    if not isinstance(value, types):
        want = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise TypeError(f"{name} must be {want}, got {type(value).__name__}")
    return value


def check_tensor(
    name: str,
    value,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    min_dim: int | None = None,
    dim: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if value.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name} must have dtype in ({allowed}), got {str(value.dtype).replace('torch.', '')}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(value.shape)}")
    if min_dim is not None and value.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(value.shape)}")
    if device is not None and value.device != torch.device(device):
        raise ValueError(f"{name} must be on {device}, got {value.device}")
    return value


def first_derivative_only(op: str) -> None:
    """At the top of a fused op's backward: raise when autograd records that backward to differentiate it again
    (``create_graph=True``: a gradient penalty, a Hessian-vector product). The hand-written backward has no
    derivative of its own, and the result would be silently wrong (1.8 apart on a Linear -> GELU -> Linear)."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{op} has no second derivative: a gradient of its gradient (create_graph=True: a "
                           "gradient penalty, a Hessian-vector product) would be wrong. Run that computation "
                           "unfused: the original model, a copy with ol.fusion.revert(copy), or fuse(model, "
                           "example, patterns=...) without this op's pattern")


def check_positive(name: str, value, *, allow_zero: bool = False, integer: bool = False):
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{name} must be {'an int' if integer else 'a number'}, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_range(name: str, value, low, high, *, low_inclusive=True, high_inclusive=True):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    lo_ok = value >= low if low_inclusive else value > low
    hi_ok = value <= high if high_inclusive else value < high
    if not (lo_ok and hi_ok):
        lb = "[" if low_inclusive else "("
        hb = "]" if high_inclusive else ")"
        raise ValueError(f"{name} must be in {lb}{low}, {high}{hb}, got {value}")
    return value


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40}


def check_bytes(name: str, value, *, allow_none: bool = False) -> int | None:
    """A size in bytes: an int >= 0, or a string such as ``"512MB"``, ``"2GiB"``, ``"1.5G"`` (K/M/G alone are
    binary units, as in ``ulimit``); returns the int."""
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", value)
        unit = m and _UNITS.get(m.group(2).lower())
        if not unit:
            raise ValueError(f"{name} must be a number of bytes or a size such as '512MB' or '2GiB', got {value!r}")
        return int(float(m.group(1)) * unit)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (bytes) or a str such as '2GiB', got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_choice(name: str, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(map(str, choices))}, got {value!r}")
    return value


def same_device(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming the first tensor whose device differs from the first one's."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    ref_name, ref = items[0]
    for k, v in items[1:]:
        if v.device != ref.device:
            raise ValueError(f"{k} is on {v.device} but {ref_name} is on {ref.device}; move them to one device")


def check_linear_input(x, linear, what: str = "the weights", weight=None) -> None:
    """``x`` can feed ``linear`` (an nn.Linear): a tensor with ``in_features`` in its last dim, the weight's
    dtype and device (``weight``: the weight as the op uses it, e.g. cast under autocast); else
    TypeError/ValueError naming ``x``."""
    weight = linear.weight if weight is None else weight
    check_tensor("x", x, min_dim=1)
    if x.shape[-1] != linear.in_features:
        raise ValueError(f"x must have {linear.in_features} features in its last dim, got shape {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"x has dtype {x.dtype} but {what} are {weight.dtype}; cast one of them")
    same_device(weight=weight, x=x)


def check_like(name: str, module, ref_name: str, ref) -> None:
    """``module``'s weight has ``ref``'s dtype (else TypeError) and device (else ValueError), naming both."""
    w, r = module.weight, ref.weight
    if w.dtype != r.dtype:
        raise TypeError(f"{name} has dtype {w.dtype} but {ref_name} has {r.dtype}")
    if w.device != r.device:
        raise ValueError(f"{name} is on {w.device} but {ref_name} is on {r.device}")
