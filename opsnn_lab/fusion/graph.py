"""One small dataflow graph that both the run-time tracer and the fx tracer produce.

Patterns match on this graph, so a pattern is written once and finds ``nn.GELU()``, ``F.gelu`` and a
wrapper module around ``F.gelu`` alike: every node carries a canonical ``op`` name ("linear", "gelu",
"matmul", ...) whatever form the call took in the model's code.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Node", "Graph", "Ref", "canonical_function", "canonical_module", "is_leaf_module", "arg",
           "is_transposed_linear", "probe_modules", "ACTIVATIONS"]

# Module classes -> canonical op names; functions are named by their __name__ (see canonical_function).
_MODULE_OPS = {
    nn.Conv2d: "conv2d", nn.BatchNorm2d: "batch_norm", nn.Linear: "linear", nn.ReLU: "relu", nn.ReLU6: "relu6",
    nn.LeakyReLU: "leaky_relu", nn.GELU: "gelu", nn.SiLU: "silu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid",
    nn.Hardtanh: "hardtanh", nn.ELU: "elu", nn.Mish: "mish", nn.Dropout: "dropout", nn.MaxPool2d: "max_pool2d",
    nn.Softmax: "softmax", nn.LayerNorm: "layer_norm", nn.Embedding: "embedding", nn.Hardswish: "hardswish",
    nn.Identity: "identity", nn.RMSNorm: "rms_norm", nn.CrossEntropyLoss: "cross_entropy",
}
# Hugging Face modules by class name (no import of transformers needed): activations -> the name used in
# torch.nn.functional / ACT2FN; Conv1D is a Linear whose weight is stored transposed (in, out).
_HF_MODULES = {
    "GELUActivation": "gelu", "NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh", "FastGELUActivation": "gelu_tanh", "QuickGELUActivation": "quick_gelu",
    "SiLUActivation": "silu", "MishActivation": "mish", "LinearActivation": "identity",
    "ReLUSquaredActivation": "relu_squared", "Conv1D": "linear",
}
_ALIASES = {
    "truediv": "div", "rmul": "mul", "radd": "add", "iadd": "add", "imul": "mul", "rtruediv": "rdiv",
    "bmm": "matmul", "rmatmul": "matmul", "max_pool2d_with_indices": "max_pool2d", "relu_": "relu",
    "gelu_": "gelu", "dropout_": "dropout", "native_dropout": "dropout",
}
ACTIVATIONS = frozenset({"relu", "relu6", "leaky_relu", "gelu", "gelu_tanh", "quick_gelu", "silu", "tanh",
                         "sigmoid", "hardtanh", "elu", "mish", "hardswish", "selu", "softplus", "relu_squared"})


def _hf_op(module: nn.Module) -> str | None:
    """The canonical op of a Hugging Face activation / Conv1D module, or None."""
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return None
    return _HF_MODULES.get(cls.__name__)


def is_transposed_linear(module: nn.Module | None) -> bool:
    """Hugging Face ``Conv1D``: ``x @ W + b`` with ``W`` of shape (in, out), i.e. a Linear with W transposed."""
    return module is not None and _hf_op(module) == "linear"


def canonical_function(fn) -> str:
    """``F.gelu``, ``torch.relu``, ``Tensor.__mul__``, ``operator.mul``, ``"softmax"`` -> one lower-case name."""
    name = fn if isinstance(fn, str) else getattr(fn, "__name__", None) or type(fn).__name__
    if name == "__get__" and hasattr(fn, "__self__"):  # a property such as Tensor.mT
        name = getattr(fn.__self__, "__name__", name)
    if fn is operator.getitem:
        return "getitem"
    name = name.strip("_") if name not in ("T", "mT") else name
    return _ALIASES.get(name, name)


def canonical_module(module: nn.Module) -> str:
    hf = _hf_op(module)
    if hf is not None:
        return hf
    if module in _ACTIVATION_LIKE:
        return _ACTIVATION_LIKE[module]
    for cls in type(module).__mro__:
        if cls in _MODULE_OPS:
            return _MODULE_OPS[cls]
    if type(module).__module__.startswith("opsnn_lab.ops") and type(module).__name__ == "Dropout":
        return "dropout"  # the counter-based dropout ol.consistency.make_reproducible swaps in
    return type(module).__name__.lower()


# nn.Linear subclasses whose own forward computes F.linear (Falcon's ``FalconLinear``: ``x @ W.T + b``), as
# probe_linears() found them before a trace: each runs as one Linear; any other subclass forward is looked into.
_LINEAR_LIKE: weakref.WeakSet = weakref.WeakSet()
_PROBE_RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _own_forward(module: nn.Module) -> type | None:
    return next((c for c in type(module).__mro__ if "forward" in vars(c)), None)


def _computes_linear(module: nn.Linear) -> bool:
    """Whether ``module(x)`` equals ``F.linear(x, weight, bias)`` (to the dtype's rounding) on a probe input."""
    w, b = module.weight, module.bias
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype not in _PROBE_RTOL or w.device.type == "meta":
        return False
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    devices = [w.device] if w.device.type == "cuda" else []
    try:  # forward, not __call__: the user's hooks do not see the probe, nor does their RNG stream move
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            y, ref = module.forward(x), F.linear(x, w, b)
    except Exception:  # a forward that cannot take a plain (5, in) tensor is not a Linear
        return False
    if not isinstance(y, torch.Tensor) or y.shape != ref.shape or y.dtype != ref.dtype:
        return False
    tol = _PROBE_RTOL[w.dtype]
    return bool(torch.allclose(y, ref, rtol=tol, atol=tol * max(ref.abs().max().item(), 1.0)))


# Parameter-free modules of unknown class whose forward computes one pointwise activation (Bloom's BloomGelu,
# a hand-written NewGELU or Swish), named by behaviour as probe_modules() found them: each runs as that op.
_ACTIVATION_LIKE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _bare(module: nn.Module) -> bool:
    """No parameters, buffers or children: all it can compute is a function of its input."""
    return not (module._parameters or module._buffers or module._modules)


def _unknown(module: nn.Module) -> bool:
    builtin = type(module).__module__.startswith(("torch.", "opsnn_lab."))
    return not builtin and _hf_op(module) is None and canonical_module(module) not in ACTIVATIONS


def probe_modules(model: nn.Module) -> None:
    """Mark what the model's own classes compute, by calling them once on a probe (before a trace: a tracer
    must not see the probe): nn.Linear subclasses whose forward computes F.linear, and parameter-free modules
    that compute exactly one activation the fused ops take (see ``opsnn_lab.ops._mlp_parts``)."""
    from opsnn_lab.ops._mlp_parts import activation_name  # ops sits beside fusion; import on use

    for m in model.modules():
        if isinstance(m, nn.Linear) and _own_forward(m) is not nn.Linear and m not in _LINEAR_LIKE \
                and _computes_linear(m):
            _LINEAR_LIKE.add(m)
        elif _bare(m) and _unknown(m) and m not in _ACTIVATION_LIKE:
            name, _ = activation_name(m)
            if name is not None:
                _ACTIVATION_LIKE[m] = name


def is_leaf_module(module: nn.Module) -> bool:
    """fx's rule, plus opsnn_lab's own ops: built-in modules run as a unit; user modules are looked into."""
    mod = type(module).__module__
    if _hf_op(module) is not None:  # one op, whatever Python its forward is written in
        return True
    forward_from = _own_forward(module)
    if forward_from is not None and forward_from in _MODULE_OPS:  # a subclass keeping e.g. Conv2d's forward
        return True
    if module in _LINEAR_LIKE or module in _ACTIVATION_LIKE:  # probed: computes F.linear / one activation
        return True
    builtin = mod.startswith("torch.nn") or mod.startswith("torch.ao.nn") or mod.startswith("opsnn_lab.ops")
    return builtin and not isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict))


@dataclass(frozen=True)
class Ref:
    """A tensor argument: the name of the node that produced it."""

    name: str


@dataclass
class Node:
    name: str
    kind: str  # "input" | "module" | "function" | "output"
    op: str  # canonical op name
    inputs: list[str] = field(default_factory=list)  # producer names of tensor arguments, in argument order
    args: tuple = ()  # positional arguments, tensors as Ref
    kwargs: dict = field(default_factory=dict)
    module: str | None = None  # qualified name of the module that ran (module nodes)
    scope: str = ""  # qualified name of the user module whose forward issued the call
    obj: nn.Module | None = None  # the module object (module nodes)
    shape: tuple | None = None  # first tensor output (run-time graphs only)
    dtype: torch.dtype | None = None
    nbytes: int = 0
    ref: object = None  # the fx.Node (fx graphs only)

    @property
    def label(self) -> str:
        return self.module or f"{self.scope + '.' if self.scope else ''}{self.op}"


class Graph:
    """Nodes in execution order plus their users."""

    def __init__(self, nodes: list[Node]):
        self.nodes = nodes
        # Run-time graphs only: node name -> its output tensor (while the analysis runs), module path -> module,
        # and what finders concluded from them (kept after the tensors are released, so a replan agrees).
        self.tensors: dict[str, torch.Tensor] = {}
        self.modules: dict[str, nn.Module] = {}
        self.memo: dict = {}
        self.by_name = {n.name: n for n in nodes}
        self.users: dict[str, list[Node]] = {n.name: [] for n in nodes}
        for n in nodes:
            for i in dict.fromkeys(n.inputs):
                if i in self.users:
                    self.users[i].append(n)

    def __getitem__(self, name: str) -> Node:
        return self.by_name[name]

    def producer(self, node: Node, index: int = 0) -> Node | None:
        """The node producing ``node``'s ``index``-th tensor argument."""
        return self.by_name.get(node.inputs[index]) if index < len(node.inputs) else None

    def only_user(self, node: Node) -> Node | None:
        users = self.users.get(node.name, [])
        return users[0] if len(users) == 1 else None

    def __len__(self) -> int:
        return len(self.nodes)


def arg(node: Node, index: int, name: str, default=None):
    """A call argument by position or keyword (``F.softmax(x, -1)`` and ``x.softmax(dim=-1)`` alike)."""
    if name in node.kwargs:
        return node.kwargs[name]
    if index < len(node.args):
        return node.args[index]
    return default
