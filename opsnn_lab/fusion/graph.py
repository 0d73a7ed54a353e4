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

__all__ = ["Node", "Graph", "Ref", "canonical_function", "canonical_module", "is_leaf_module", "arg",
           "is_transposed_linear", "Probed", "own_forward", "ACTIVATIONS"]

# Module classes -> canonical op names; functions are named by their __name__ (see canonical_function).
_MODULE_OPS = {
    nn.Conv2d: "conv2d", nn.BatchNorm2d: "batch_norm", nn.Linear: "linear", nn.ReLU: "relu", nn.ReLU6: "relu6",
    nn.LeakyReLU: "leaky_relu", nn.GELU: "gelu", nn.SiLU: "silu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid",
    nn.Hardtanh: "hardtanh", nn.ELU: "elu", nn.Mish: "mish", nn.Dropout: "dropout", nn.MaxPool2d: "max_pool2d",
    nn.Softmax: "softmax", nn.LayerNorm: "layer_norm", nn.Embedding: "embedding", nn.Hardswish: "hardswish",
    nn.Identity: "identity", nn.RMSNorm: "rms_norm", nn.CrossEntropyLoss: "cross_entropy", nn.GroupNorm: "group_norm",
    nn.Conv1d: "conv1d", nn.Conv3d: "conv3d", nn.BatchNorm1d: "batch_norm1d", nn.BatchNorm3d: "batch_norm3d",
    nn.MaxPool1d: "max_pool1d", nn.InstanceNorm1d: "instance_norm", nn.InstanceNorm2d: "instance_norm",
    nn.InstanceNorm3d: "instance_norm",
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
    if module in Probed.activation:
        return Probed.activation[module]
    for cls in type(module).__mro__:
        if cls in _MODULE_OPS:  # a subclass with a forward of its own (Nemotron's LayerNorm1P: 1 + weight) is that op
            # only where probe.py found it to compute it (FalconLinear; timm's BatchNormAct2d: its BatchNorm)
            if own_forward(module) is own_forward(cls) or module in Probed.linear or module in Probed.bn_act \
                    or module in Probed.same_conv:
                return _MODULE_OPS[cls]
            break
    if type(module).__module__.startswith("opsnn_lab.ops") and type(module).__name__ == "Dropout":
        return "dropout"  # the counter-based dropout ol.consistency.make_reproducible swaps in
    return type(module).__name__.lower()


class Probed:
    """What probe.py found the model's own classes to compute (filled before a trace, read by the trace).

    * ``linear``: nn.Linear subclasses whose own forward computes ``F.linear`` (Falcon's ``FalconLinear``);
    * ``activation``: parameter-free modules of unknown class -> the one activation they compute (BloomGelu);
    * ``bn_act``: BatchNorm2d and GroupNorm subclasses whose forward is ``act(norm(x))`` (timm's
      ``BatchNormAct2d``, ``GroupNormAct``) -> that act child, or None where they compute the norm alone;
    * ``same_conv``: Conv2d subclasses whose forward pads TensorFlow's 'same' way for each call, then convolves
      (timm's ``Conv2dSame``, EfficientNet-PyTorch's ``Conv2dDynamicSamePadding``);
    * ``float32_inside``: activations of ``activation`` computing in float32 on a float64 input (diffusers'
      ``FP32SiLU``): a chain holding one is fused only where it does not run in float64.
    Each runs as one op, with the canonical name of what it computes; anything else is looked into."""

    linear: weakref.WeakSet = weakref.WeakSet()
    activation: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    bn_act: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    same_conv: weakref.WeakSet = weakref.WeakSet()
    float32_inside: weakref.WeakSet = weakref.WeakSet()

    @classmethod
    def leaf(cls, module: nn.Module) -> bool:
        return module in cls.linear or module in cls.activation or module in cls.bn_act or module in cls.same_conv


def own_forward(module) -> type | None:
    """The class in the MRO of ``module`` (an instance or a class) whose ``forward`` it runs."""
    cls = module if isinstance(module, type) else type(module)
    return next((c for c in cls.__mro__ if "forward" in vars(c)), None)


def is_leaf_module(module: nn.Module) -> bool:
    """fx's rule, plus opsnn_lab's own ops: built-in modules run as a unit; user modules are looked into."""
    mod = type(module).__module__
    if _hf_op(module) is not None:  # one op, whatever Python its forward is written in
        return True
    forward_from = own_forward(module)  # a subclass keeping e.g. Conv2d's or BatchNorm2d's forward:
    if any(isinstance(module, k) and forward_from is own_forward(k) for k in _MODULE_OPS):
        return True
    if Probed.leaf(module):  # one op by what it computes (probe.py)
        return True
    builtin = mod.startswith("torch.nn") or mod.startswith("torch.ao.nn") or mod.startswith("opsnn_lab.ops")
    return builtin and not isinstance(module, _COMPOSITES)


# Built-in modules whose forward calls their children's forwards: their Linears, norms and activations are the
# model's, so the tracer looks into them as into user code. (nn.MultiheadAttention is not one: it reads its
# out_proj's weight without calling it.)
_COMPOSITES = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Transformer, nn.TransformerEncoder,
               nn.TransformerDecoder, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


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
    inplace: bool = False  # it wrote into its first tensor argument and returned it (run-time graphs only)

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
        # the fx region whose code this graph is (its path, '' for the root), None for the run-time graph: an
        # "output" node there is what the region returns, which the run-time graph shows the model reading or not
        self.region: str | None = None
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
