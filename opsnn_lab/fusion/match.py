"""What every pattern row shares: the ``Match`` a finder returns and the checks chains have in common."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from opsnn_lab._hooks import has_hooks
from opsnn_lab.fusion.graph import Graph, Node, Probed, Ref, arg, canonical_module

__all__ = ["Match", "op_class", "act_kind", "act_module", "inplace_writer", "inplace_reason", "inner_act", "CONV_ACTS",
           "LINEAR_ACTS", "VIEW_OPS", "is_view_step", "past_views"]


@dataclass
class Match:
    pattern: str  # variant name, e.g. "conv_bn_relu_maxpool"
    nodes: list[Node]  # the chain, in execution order
    ok: bool
    reason: str
    viable: bool = False  # passed its own checks (may still be switched off or overlap a fused match)
    inputs: list[str] = field(default_factory=list)  # producers of the fused op's tensor inputs
    outputs: list[Node] = field(default_factory=list)  # nodes whose results the fused op returns
    params: dict = field(default_factory=dict)  # what the op is built from (modules, scale, p, ...)
    # the module paths naming a candidate some of whose steps run inside a looked-into module (a conv's own forward,
    # a frozen batch norm's): those steps have no module of their own, so ``modules`` would leave that module out
    named: list[str] | None = None
    # the view steps (``is_view_step``) between a chain's op and its pointwise activation, run by the model's own code
    # on the fused op's output: the op computes the activation before them, where it gives the same elements
    views: list[str] = field(default_factory=list)

    @property
    def modules(self) -> list[str]:
        if self.named is not None:
            return list(self.named)
        mods = [n.module for n in self.nodes if n.module]
        if self.pattern == "attention":
            return [self.nodes[0].scope, *mods]
        if not mods or self.pattern.startswith("add_"):  # steps inline in a forward: name where they run
            inline = [n.scope or "<model>" for n in self.nodes if n.kind == "function"]
            return list(dict.fromkeys([*inline, *mods]))
        return mods

    @property
    def key(self) -> tuple:
        return (self.pattern, tuple(self.modules))


def op_class(name: str):
    """``opsnn_lab.ops.<name>``, or raise with the reason it is unavailable."""
    return getattr(importlib.import_module("opsnn_lab.ops"), name)


def _op_support(name: str, *modules, build=None, **options) -> str:
    """'' if ``ops.<name>`` exists and accepts this chain, else why not (the op's own words).

    Uses the op's ``supports(...)`` when it has one, else tries ``build()`` (ops validate in their
    constructors and raise ValueError/TypeError naming the argument); ``options`` go to ``supports``.
    """
    try:
        cls = op_class(name)
    except (ImportError, AttributeError) as exc:
        return f"opsnn_lab.ops.{name} is not available ({type(exc).__name__}: {exc})"
    supports = getattr(cls, "supports", None)
    if supports is not None:
        ok, why = supports(*modules, **options)
        return "" if ok else f"{name}: {why}"
    if build is not None:
        try:
            build()
        except (ValueError, TypeError) as exc:
            return f"{name}: {exc}"
    return ""


def _others(g: Graph, node: Node, keep: Node | None) -> list[str]:
    return [u.label for u in g.users.get(node.name, []) if u is not keep]


def _consumer_reason(g: Graph, node: Node, nxt: Node) -> str:
    others = _others(g, node, nxt)
    return f"the output of `{node.label}` is also read by {', '.join(f'`{o}`' for o in others)}" if others else ""


# Activations each chain family names (DESIGN.md); whether an op fuses one is the op's own answer.
CONV_ACTS = frozenset({"relu", "relu6", "leaky_relu", "silu", "hardswish", "gelu", "gelu_tanh", "mish", "elu"})
LINEAR_ACTS = frozenset({"gelu", "gelu_tanh", "quick_gelu", "silu", "relu"})
# the norm -> activation rows (GroupNorm, InstanceNorm, BatchNorm after a conv) also take a PReLU module (its slope a
# parameter of the fused op)
NORM_ACTS = CONV_ACTS | {"prelu"}


def functional_prelu(act: Node, module) -> str:
    """The reason a PReLU called as ``F.prelu`` (no module to take its weight from) is declined, else ''."""
    if module is None and act_kind(act) == "prelu":
        return f"`{act.label}` is `F.prelu` with a weight of the forward's own; the op takes an nn.PReLU module"
    return ""


def act_kind(n: Node) -> str:
    """The activation's name as in torch.nn.functional / HF ACT2FN: ``gelu``, ``gelu_tanh``, ``silu``, ..."""
    if n.op == "gelu":
        approx = getattr(n.obj, "approximate", None) if n.obj is not None else arg(n, 1, "approximate", "none")
        return "gelu_tanh" if approx == "tanh" else "gelu"
    return n.op


def _act_name(n: Node) -> str:
    kind = act_kind(n)
    return {"gelu": "GELU", "gelu_tanh": "GELU(approximate='tanh')", "relu": "ReLU", "relu6": "ReLU6",
            "leaky_relu": "LeakyReLU", "silu": "SiLU", "quick_gelu": "QuickGELU", "hardswish": "Hardswish"}.get(kind,
                                                                                                              kind)


_TORCH_ACTS = {"gelu": lambda: nn.GELU(), "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "relu": nn.ReLU,
               "relu6": nn.ReLU6, "silu": nn.SiLU, "hardswish": nn.Hardswish, "leaky_relu": nn.LeakyReLU,
               "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "mish": nn.Mish}


def act_module(n: Node) -> nn.Module | None:
    """The activation as a torch.nn module the fused ops take (a functional call or a HF module mapped back)."""
    if n.obj is not None and type(n.obj).__module__.startswith("torch.nn"):
        return n.obj
    kind = act_kind(n)
    if kind == "leaky_relu" and n.obj is None:
        return nn.LeakyReLU(float(arg(n, 1, "negative_slope", 0.01)))
    if kind == "elu" and n.obj is None:  # F.elu(x, alpha): the op takes alpha 1 only, and says so
        return nn.ELU(float(arg(n, 1, "alpha", 1.0)))
    make = _TORCH_ACTS.get(kind)
    return make() if make is not None else n.obj


def _common_checks(g: Graph, nodes: list[Node]) -> str:
    for n in nodes:  # a module of the chain no longer computes its own output: its hooks would see the op's tensors
        if n.kind == "module" and n.obj is not None and has_hooks(n.obj):
            return (f"`{n.label}` has a hook of its own (forward, forward-pre or backward): fused, it would be called "
                    "with the fused op's tensors, not the ones it sees in eager; remove the hook to fuse this chain")
    for n in nodes:  # a forward set on the instance: an earlier fusion's patch, a library's wrapper (accelerate's)
        if n.kind == "module" and n.obj is not None and "forward" in n.obj.__dict__:
            return (f"`{n.label}` has a forward of its own set on the instance (this model was fused before, or a "
                    "library wraps that module's forward), which fusing would replace; fuse the model before that, "
                    "or `ol.fusion.revert(model)` first to plan it anew")
    for n in nodes:  # its weight is computed at each access (weight_norm, spectral_norm): the ops take Parameters
        if n.kind == "module" and n.obj is not None and parametrize.is_parametrized(n.obj):
            return (f"`{n.label}` has a parametrization ({', '.join(n.obj.parametrizations)}: weight_norm, "
                    "spectral_norm or torch.nn.utils.parametrize), computed from other Parameters at each access, "
                    "which the fused op would not read; fold it (`parametrize.remove_parametrizations(module, name, "
                    "leave_parametrized=True)`) to fuse this chain")
    for n in nodes:  # float64 chains only: in float32 and lower the op computes the activation as the module does
        if n.kind == "module" and n.obj is not None and n.obj in Probed.float32_inside and n.dtype == torch.float64:
            return (f"`{n.label}` computes {n.op} in float32 inside and casts back, which differs from {n.op} of its "
                    "float64 input by more than float64 rounding; the fused op computes in float64")
    for n in nodes:
        writer = next((u for u in g.users.get(n.name, []) if u.op == "setitem"), None)
        if writer is not None:
            return f"the output of `{n.label}` is modified in place by `{writer.label}` (item assignment)"
    dtypes = {}  # dtype -> the first output or parameters seen in it (one node may show both)
    for n in nodes:
        if n.dtype is not None:
            dtypes.setdefault(str(n.dtype).replace("torch.", ""), f"`{n.label}` returns")
        if n.obj is not None:
            for p in n.obj.parameters(recurse=False):
                dtypes.setdefault(str(p.dtype).replace("torch.", ""), f"`{n.label}` has parameters in")
    if len(dtypes) > 1:
        return "mixed dtypes: " + ", ".join(f"{who} {dt}" for dt, who in dtypes.items())
    return ""


def inplace_writer(g: Graph, node: Node) -> Node | None:
    """A reader of ``node``'s output that writes into it (``relu_``, ``+=``, an ``inplace=True`` activation)."""
    return next((u for u in g.users.get(node.name, []) if u.inplace and u.inputs[:1] == [node.name]), None)


def inplace_reason(g: Graph, node: Node) -> str:
    """Why a chain ending in ``node`` cannot be fused when a reader writes into its output ('' when none does)."""
    writer = inplace_writer(g, node)
    return f"the output of `{node.label}` is modified in place by `{writer.label}`" if writer is not None else ""


def _is_module(n: Node | None, op: str) -> bool:
    return n is not None and n.kind == "module" and n.op == op


def past_identities(g: Graph, node: Node, zero_dropouts: bool = False) -> tuple[list[Node], Node | None]:
    """``node``'s only reader, looking past ``nn.Identity`` modules each read only by the next (placeholders
    such as timm's ``drop_block`` or an Mlp's ``norm``): ``(the identities passed, that reader or None)``.
    The identities join the chain: a module-level rewrite passes their input through, as they do. With
    ``zero_dropouts``, a dropout module of p=0 is one too (MONAI's norm -> dropout -> activation blocks): a row
    whose op computes no dropout of its own passes it, and the chain runs unfused if its p changes later (its
    setting is watched as every step's is)."""
    passed, nxt = [], g.only_user(node)
    while (_is_module(nxt, "identity") or zero_dropouts and _zero_dropout(nxt)) and g.only_user(nxt) is not None:
        passed.append(nxt)
        nxt = g.only_user(nxt)
    return passed, nxt


def _zero_dropout(n: Node | None) -> bool:
    """A dropout module (any of torch.nn's) whose p is 0: it returns its input's values in training and eval."""
    return n is not None and n.kind == "module" and isinstance(n.obj, nn.modules.dropout._DropoutNd) \
        and float(n.obj.p) == 0.0


# Ops whose result is always a view of their input, never a copy, whatever its strides: a pointwise step after them
# computes on the same elements as before them, so a chain's activation can run before them (reshape and flatten copy
# some inputs, and are not here).
VIEW_OPS = frozenset({"view", "view_as", "unflatten", "permute", "transpose", "swapaxes", "movedim", "t", "T", "mT",
                      "squeeze", "unsqueeze", "narrow", "select", "getitem"})


def _basic_index(index) -> bool:
    """An index of ints, slices of ints, None and Ellipsis: ``t[index]`` is a view (a tensor or a list copies)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or (isinstance(i, int) and not isinstance(i, bool))
               or (isinstance(i, slice) and all(v is None or (isinstance(v, int) and not isinstance(v, bool))
                                                for v in (i.start, i.stop, i.step)))
               for i in items)


def is_view_step(n: Node) -> bool:
    """A call that views its one tensor argument: ``unflatten``, ``permute``, ``x[:, :, None]``, ... (``VIEW_OPS``),
    not in place, with constant arguments (``view(dtype)``, which reinterprets bits, is no rearrangement)."""
    if n.kind != "function" or n.op not in VIEW_OPS or n.inplace or len(set(n.inputs)) != 1:
        return False
    if not n.args or n.args[0] != Ref(n.inputs[0]):
        return False
    rest = [*n.args[1:], *n.kwargs.values()]
    if n.op == "getitem":
        return len(n.args) == 2 and not n.kwargs and _basic_index(n.args[1])
    flat = [v for a in rest for v in (a if isinstance(a, (tuple, list)) else (a,))]
    return all(isinstance(v, (int, str)) and not isinstance(v, bool) or v is None for v in flat)


def past_views(g: Graph, node: Node) -> tuple[list[Node], Node | None]:
    """``node``'s only reader past view steps each read only by the next (MagVit's and Cosmos' per-frame GroupNorm:
    ``norm(x).unflatten(0, (b, -1)).permute(0, 2, 1, 3, 4)`` before the activation; UNet1D's ``t[:, :, 0, :]``):
    ``(the views passed, that reader or None)``."""
    passed, nxt = [], g.only_user(node)
    while nxt is not None and is_view_step(nxt):
        passed.append(nxt)
        nxt = g.only_user(nxt)
    return passed, nxt


def act_reader(g: Graph, node: Node, acts, zero_dropouts: bool = False) -> tuple[list[Node], Node | None]:
    """The activation (a kind in ``acts``) reading ``node``: a direct reader, else the one behind ``nn.Identity``
    placeholders (timm's ConvMlp: ``fc1 -> norm (Identity) -> act``): ``(the identities passed, the activation)``,
    ``([], None)`` where there is none. A direct reader is taken even when ``node`` has others, so the candidate
    is reported with them as its reason."""
    act = next((u for u in g.users.get(node.name, []) if act_kind(u) in acts), None)
    if act is not None:
        return [], act
    passed, nxt = past_identities(g, node, zero_dropouts)
    return (passed, nxt) if passed and nxt is not None and act_kind(nxt) in acts else ([], None)


def _dropout_module(n: Node | None):
    if n is None:
        return None
    if n.obj is not None:
        return n.obj
    return nn.Dropout(float(arg(n, 1, "p", 0.5)))


def inner_act(norm: Node) -> Node | None:
    """The activation a probed norm module applies itself (timm's ``BatchNormAct2d``, ``GroupNormAct``:
    ``Probed.bn_act``), as a node of its own (not in the graph), or None."""
    act = Probed.bn_act.get(norm.obj) if norm.obj is not None else None
    if act is None:
        return None
    path = next(f"{norm.module}.{k}" for k, c in norm.obj.named_children() if c is act)
    return Node(f"{norm.name}.act", "module", canonical_module(act), [norm.name], module=path, obj=act)
