"""Which values of a traced forward have a structure its tensor arguments' ranks alone decide (specialise.py).

Attention code unpacks a shape it built from sizes: ``context.view(*context.size()[:-2], hidden)``. fx asks for
the number of those sizes, and the tracer answers from the example (a guard, ``expect_len``). When a dropout
runs before that question, a call that missed the guard would draw its masks twice, so the region was not
traced; yet that number is ``rank(context) - 1``, and ``context``'s rank follows from the ranks of the forward's
tensor arguments through every step in between (a dropout keeps it, a matmul and a view set it by rule). Such a
question needs no guard in the middle of the code: the ranks are checked when the call comes in
(``regions.facts_hold``), before anything runs.

The same holds for a branch on a rank: Hugging Face diffusers' transformer blocks add the attention output (after
its dropout) to the residual and ask ``if hidden_states.ndim == 4``. ``rank_inputs`` names the tensor arguments
whose ranks decide such a value (a rank, and Python's arithmetic and comparisons on ranks and constants).

``structure_inputs`` says which tensor arguments decide a value's structure (a tensor's rank, the number of sizes
in a tuple), or None where sizes or values may: a ``squeeze`` (it drops the dimensions of size 1), a ``flatten``
at a traced dimension, slicing a tuple of sizes at a traced bound, repeating it a traced number of times,
indexing with a tensor, a module of a class not listed here (its forward may do anything), a function outside
torch and Python's arithmetic. (A split makes as many pieces as the sizes give, each of its input's rank: a
question on the number of pieces is not one on ranks.)
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

from opsnn_lab.fusion.graph import ACTIVATIONS, canonical_module

__all__ = ["structure_inputs", "rank_inputs"]

TENSOR, TUPLE, SCALAR, RANK = "tensor", "tuple", "scalar", "rank"  # RANK: a scalar that ranks alone decide

# a result whose rank follows sizes (``squeeze`` drops the dimensions of size 1) or is not a tensor's
_BY_SIZE = frozenset({"squeeze", "squeeze_", "tolist"})
# a result whose rank follows the value of a traced int or string argument (``flatten(1, k)``)
_BY_VALUE = frozenset({"flatten", "tensordot", "einsum"})
_VALUE_FLAGS = frozenset({"keepdim", "as_tuple", "return_inverse", "return_counts", "return_indices"})
_TUPLE_METHODS = frozenset({"size", "stride"})  # with no argument: one entry per dimension
_RANK_METHODS = frozenset({"dim", "ndimension"})
_SCALAR_METHODS = frozenset({"dim", "ndimension", "numel", "nelement", "element_size", "is_contiguous", "get_device",
                             "is_floating_point", "is_complex"})
_SCALAR_ATTRS = frozenset({"ndim", "dtype", "device", "is_cuda", "is_nested", "layout", "is_sparse",
                           "is_quantized", "requires_grad"})
# modules whose output has their input's rank or one set by rule from it: torch.nn's own classes of these kinds,
# any module the analysis names as one of these ops (Hugging Face's activations and Conv1D, probed ones), and a
# module fusion patched with an op that keeps its input's rank (so a region traced again for its rewrite, where
# that module is one call, drops the guards its analysis dropped)
_TORCH_MODULES = (nn.modules.dropout._DropoutNd, nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase,
                  nn.Linear, nn.modules.conv._ConvNd, nn.Embedding, nn.Identity, nn.Softmax, nn.LogSoftmax,
                  nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd, nn.modules.activation.Hardswish,
                  nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.ELU, nn.Softplus,
                  nn.RMSNorm)
_SHAPED_OPS = ACTIVATIONS | {"linear", "layer_norm", "rms_norm", "batch_norm", "dropout", "identity", "embedding",
                             "softmax", "conv2d", "max_pool2d", "conv1d", "conv3d", "batch_norm1d", "batch_norm3d",
                             "max_pool1d"}


def _keeps_rank(m: nn.Module) -> bool:
    patch = m.__dict__.get("forward")  # a module fusion patched (patch.py) runs the fused op: that op's rule
    if patch is not None:
        return bool(getattr(patch, "keeps_rank", lambda: False)())
    return (type(m).__module__.startswith("torch.nn.modules") and isinstance(m, _TORCH_MODULES)) or \
        canonical_module(m) in _SHAPED_OPS


def structure_inputs(node: fx.Node, facts: dict, root: nn.Module) -> set[str] | None:
    """The names of the tensor arguments (placeholders with a rank in ``facts``) whose ranks decide the structure of
    ``node``'s value when that value is a tuple of sizes; None otherwise (see the module docstring)."""
    kinds: dict[fx.Node, tuple[str, frozenset] | None] = {}
    for n in _cone(node):
        kinds[n] = _kind(n, facts, root, kinds)
    got = kinds[node]
    return set(got[1]) if got is not None and got[0] == TUPLE else None


def rank_inputs(node: fx.Node, facts: dict, root: nn.Module) -> set[str] | None:
    """The names of the tensor arguments whose ranks decide ``node``'s value when that value is a rank or Python's
    arithmetic / comparison of ranks and constants (``h.ndim == 4``, ``x.dim() - 1``); None otherwise."""
    kinds: dict[fx.Node, tuple[str, frozenset] | None] = {}
    for n in _cone(node):
        kinds[n] = _kind(n, facts, root, kinds)
    got = kinds[node]
    return set(got[1]) if got is not None and got[0] == RANK else None


def _cone(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node it depends on, each after its inputs."""
    order, seen, stack = [], set(), [(node, False)]
    while stack:
        n, done = stack.pop()
        if done:
            order.append(n)
            continue
        if n in seen:
            continue
        seen.add(n)
        stack.append((n, True))
        stack.extend((d, False) for d in n.all_input_nodes if d not in seen)
    return order


def _kind(n: fx.Node, facts: dict, root: nn.Module, kinds: dict):
    """``(kind, the tensor arguments deciding it)`` for ``n`` given its inputs' kinds, or None."""
    deps = [kinds[d] for d in n.all_input_nodes]
    if any(d is None for d in deps):
        return None
    inputs = frozenset().union(*(d[1] for d in deps))
    if n.op == "placeholder":
        name = str(n.target).lstrip("*")
        fact = facts.get(name) or {}
        return (TENSOR, frozenset({name})) if "ndim" in fact and not fact.get("is_nested") else None
    if n.op == "get_attr":
        try:
            value = operator.attrgetter(n.target)(root)
        except AttributeError:
            return None
        return (TENSOR, frozenset()) if isinstance(value, torch.Tensor) else None
    if n.op == "call_module":
        return (TENSOR, inputs) if _keeps_rank(root.get_submodule(n.target)) else None
    kind = _result(n, kinds)
    return None if kind is None else (kind, inputs)


def _result(n: fx.Node, kinds: dict) -> str | None:
    """The kind of a function's or method's result, or None where its structure may follow sizes or values."""
    def kind_of(a):
        return kinds[a][0] if isinstance(a, fx.Node) else (TUPLE if isinstance(a, (tuple, list)) else SCALAR)

    first = kind_of(n.args[0]) if n.args else None
    if n.op == "call_method":
        if n.target in _RANK_METHODS and first == TENSOR and len(n.args) == 1 and not n.kwargs:
            return RANK
        if n.target in _TUPLE_METHODS:
            return TUPLE if first == TENSOR and len(n.args) == 1 and not n.kwargs else SCALAR
        if n.target in _SCALAR_METHODS:
            return SCALAR
        return _torch_op(n, str(n.target), kind_of) if hasattr(torch.Tensor, n.target) else None
    target = n.target
    if target is getattr:
        if n.args[1] == "shape" and first == TENSOR:
            return TUPLE
        if n.args[1] == "ndim" and first == TENSOR:
            return RANK
        return SCALAR if n.args[1] in _SCALAR_ATTRS else None
    if target is operator.getitem:
        return _getitem(n, first, kind_of)
    module = getattr(target, "__module__", None) or ""
    if module in ("_operator", "operator", "builtins", "math"):
        return _arithmetic(n, kind_of)
    if module.split(".")[0] == "torch" or target is torch.Size:
        return TUPLE if target is torch.Size else _torch_op(n, getattr(target, "__name__", ""), kind_of)
    return None


def _getitem(n: fx.Node, base: str, kind_of) -> str | None:
    index = n.args[1]
    if base == TUPLE:  # sizes: a constant slice keeps a tuple of known length, one entry is a size
        if isinstance(index, slice):
            bounds = (index.start, index.stop, index.step)
            return TUPLE if not any(isinstance(b, fx.Node) for b in bounds) else None
        return SCALAR if kind_of(index) in (SCALAR, RANK) else None
    if base == TENSOR:  # ints, slices, None and Ellipsis set the rank by rule; a tensor index by its dtype: refused
        parts = index if isinstance(index, tuple) else (index,)
        return TENSOR if all(kind_of(p) in (SCALAR, RANK) or isinstance(p, slice) for p in parts) else None
    return None


def _arithmetic(n: fx.Node, kind_of) -> str | None:
    operands = (*n.args, *n.kwargs.values())
    traced = [a for a in operands if isinstance(a, fx.Node)]
    if traced and all(kind_of(a) == RANK for a in traced) and \
            all(isinstance(a, (fx.Node, bool, int, float, type(None))) for a in operands):
        return RANK  # ``h.ndim == 4``, ``x.dim() - 1``: ranks and constants
    kinds = [SCALAR if k == RANK else k for k in map(kind_of, operands)]
    if TENSOR in kinds:  # fx's record of ``-x``, ``a + b``, ``q @ k``: broadcast or matmul ranks
        return TENSOR if n.target not in (operator.setitem, operator.delitem) else None
    if TUPLE not in kinds:
        return SCALAR
    if n.target is operator.add and all(k == TUPLE for k in kinds):
        return TUPLE  # sizes + (hidden,)
    if n.target is operator.mul and not any(isinstance(a, fx.Node) and kind_of(a) in (SCALAR, RANK)
                                             for a in n.args):
        return TUPLE  # a tuple repeated a constant number of times
    return None


def _torch_op(n: fx.Node, name: str, kind_of) -> str | None:
    """Any other op of torch: its result's rank (each piece's, for a split) follows its inputs' ranks by rule."""
    if name in _BY_SIZE or any(k in _VALUE_FLAGS and isinstance(v, fx.Node) for k, v in n.kwargs.items()):
        return None
    if name in _BY_VALUE and any(kind_of(a) in (SCALAR, RANK) for a in n.all_input_nodes):
        return None
    return TENSOR
