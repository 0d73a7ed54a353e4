"""The pattern table: one pure function per fusable chain, over the dataflow graph of graph.py.

Each function returns every *candidate* it sees, fused or not, with a reason a user can act on. Adding a
pattern is one function plus one ``Pattern`` row naming the op that replaces it (rewrite.py builds it).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from opsnn_lab.fusion import patterns_blocks as blocks
from opsnn_lab.fusion import patterns_gated as gated
from opsnn_lab.fusion import patterns_group_norm as group_norm
from opsnn_lab.fusion.graph import ACTIVATIONS, Graph, Node, Probed, is_transposed_linear
from opsnn_lab.fusion.match import (
    LINEAR_ACTS,
    NORM_ACTS,
    Match,
    _common_checks,
    _consumer_reason,
    _dropout_module,
    _is_module,
    _op_support,
    act_kind,
    act_module,
    act_reader,
    functional_prelu,
    inner_act,
    op_class,
    past_identities,
)
from opsnn_lab.fusion.patterns_attention import build_attention, build_qkv, find_attention, find_qkv, name_functional

__all__ = ["Match", "Pattern", "PATTERNS", "FAMILIES", "find_all", "op_class", "op_name", "pattern_of"]


# --------------------------------------------------------------------------- Conv -> BN -> act [-> MaxPool]
# a convolution's op -> the ops of its dimension's batch norm and max-pool (none after a 3-d one)
_CONV_KINDS = {"conv2d": ("batch_norm", "max_pool2d"), "conv1d": ("batch_norm1d", "max_pool1d"),
               "conv3d": ("batch_norm3d", None)}


def _batch_norm_like(g: Graph, node: Node) -> tuple[nn.Module, str] | None:
    """``(module, its path)`` where ``node`` is a batch norm module, or an op run inside one (a frozen batch norm's
    Python forward is looked into); else None."""
    obj, path = (node.obj, node.module) if node.kind == "module" else (g.modules.get(node.scope), node.scope)
    named = obj is not None and "batchnorm" in type(obj).__name__.lower()
    if obj is None or not (named or isinstance(obj, nn.modules.batchnorm._NormBase)) \
            or isinstance(obj, nn.modules.instancenorm._InstanceNorm):  # a norm per sample: the instance_norm row
        return None
    return obj, path


def _other_batch_norm(g: Graph, conv: Node) -> Match | None:
    """A declined candidate where a conv's output goes to a batch norm the op does not compute: a SyncBatchNorm,
    a frozen one (torchvision's, timm's ``FrozenBatchNorm2d``), another dimension's, a subclass with a forward of its
    own; None where no reader is one."""
    found = next(((u, hit) for u in g.users.get(conv.name, []) if (hit := _batch_norm_like(g, u))), None)
    if found is None:
        return None
    node, (bn, path) = found
    kind = type(bn).__name__
    if isinstance(bn, nn.SyncBatchNorm):
        why = (f"`{path}` is a SyncBatchNorm: under torch.distributed its batch statistics are all-reduced across "
               "ranks, and FusedConvBNAct takes each rank's own")
    elif "frozen" in kind.lower():
        why = (f"`{path}` is a {kind}, a fixed per-channel affine: its backward keeps no tensor, so a fused op would "
               "save nothing eager keeps")
    else:
        act = g.only_user(node) if node.kind == "module" else None
        why = _op_support("FusedConvBNAct", conv.obj, bn, act.obj if act is not None and act.obj is not None
                          else nn.ReLU()) or f"`{path}` ({kind}) is not a batch norm FusedConvBNAct computes"
    return Match("conv_bn_relu", [conv, node], False, why, inputs=conv.inputs[:1], outputs=[node],
                 named=[conv.module, path])


def _conv_inside(g: Graph, conv: Node) -> Match | None:
    """A declined candidate where a convolution run inside a conv module's own forward (one the probe did not find
    to compute a conv alone or a per-call 'same' padding: a fixed padding, a weight transform) feeds a BatchNorm."""
    if conv.kind != "function" or conv.op not in _CONV_KINDS:
        return None
    owner, norm = g.modules.get(conv.scope), _CONV_KINDS[conv.op][0]
    bn = next((u for u in g.users.get(conv.name, []) if _is_module(u, norm)), None)
    if not isinstance(owner, nn.modules.conv._ConvNd) or bn is None:
        return None
    return Match("conv_bn_relu", [conv, bn], False,
                 f"`{conv.scope}` is a {type(owner).__name__} whose own forward does more than a convolution (or pads "
                 "its input by a fixed amount, not 'same' for each size): FusedConvBNAct computes a plain "
                 "convolution, or a Conv2d padding 'same' per call", inputs=conv.inputs[:1], outputs=[bn],
                 named=[conv.scope, bn.module])


def find_conv_bn_relu(g: Graph) -> list[Match]:
    out = []
    for conv in g.nodes:
        inside = _conv_inside(g, conv)
        if inside is not None:
            out.append(inside)
            continue
        norm, pool_op = _CONV_KINDS.get(conv.op, (None, None)) if conv.kind == "module" else (None, None)
        bn = next((u for u in g.users.get(conv.name, []) if _is_module(u, norm)), None) if norm else None
        if bn is None:
            other = _other_batch_norm(g, conv) if norm else None
            out += [other] if other is not None else []
            continue
        m = Match("conv_bn_relu", [conv, bn], False, "", inputs=conv.inputs[:1], outputs=[bn])
        users = g.users.get(bn.name, [])
        inner = inner_act(bn)  # a BatchNorm module that applies its own activation (timm's BatchNormAct2d)
        passed, act = [], inner
        if inner is None and len(users) == 1:
            passed, act = past_identities(g, bn, zero_dropouts=True)
        m.reason = _consumer_reason(g, conv, bn)
        if not m.reason and act is None:
            m.reason = (f"the output of `{bn.label}` goes to {', '.join(f'`{u.label}`' for u in users)}"
                        if users else f"`{bn.label}` output is unused")
        elif not m.reason and act_kind(act) in ACTIVATIONS and act_kind(act) not in NORM_ACTS:
            m.reason = (f"`{bn.label}` feeds `{act.label}` ({act_kind(act)}), an activation FusedConvBNAct does not "
                        f"compute (it computes {', '.join(sorted(NORM_ACTS))})")
        elif not m.reason and act_kind(act) not in NORM_ACTS:
            m.reason = f"`{bn.label}` feeds `{act.label}` ({act.op}), not a ReLU or another activation"
        if m.reason:
            out.append(m)
            continue
        m.pattern = f"conv_bn_{act_kind(act)}"
        if not inner:
            m.nodes += [*passed, act]
            m.outputs = [act]
        passed, pool = past_identities(g, m.outputs[0])
        relu_mod = act.obj if inner else act_module(act)  # the act a BatchNorm applies: its own child, any class
        op = _conv_op(m.pattern)
        same = {"pad_same": True} if conv.obj in Probed.same_conv else {}  # probe.py: timm's Conv2dSame
        pooled = _is_module(pool, pool_op) and not _op_support(op, conv.obj, bn.obj, relu_mod, pool.obj, **same)
        if pooled:
            m.pattern, m.nodes, m.outputs = f"{m.pattern}_maxpool", [*m.nodes, *passed, pool], [pool]
        m.params = {"conv": conv.obj, "bn": bn.obj, "relu": relu_mod, "maxpool": pool.obj if pooled else None,
                    "pad_same": bool(same)}
        why = functional_prelu(act, relu_mod) or _op_support(op, conv.obj, bn.obj, relu_mod, m.params["maxpool"],
                                                             **same)
        m.reason = why or _common_checks(g, m.nodes)
        m.ok = not m.reason
        out.append(m)
    return out


# --------------------------------------------------------------------------- Linear -> GELU [-> Dropout] [-> Linear]
def find_linear_gelu_dropout(g: Graph) -> list[Match]:
    out = []
    for lin in g.nodes:
        if not _is_module(lin, "linear"):
            continue
        before, act = act_reader(g, lin, LINEAR_ACTS)
        if act is None:
            continue
        m = Match(f"linear_{act_kind(act)}", [lin, *before, act], False, "", inputs=lin.inputs[:1], outputs=[act])
        m.reason = _consumer_reason(g, lin, m.nodes[1])
        if m.reason:
            out.append(m)
            continue
        drop = None
        passed, nxt = past_identities(g, act)
        if nxt is not None and nxt.op == "dropout":
            drop = nxt
            m.nodes += [*passed, drop]
            m.pattern += "_dropout"
            passed, nxt = past_identities(g, drop)
        fc2 = nxt
        if _is_module(fc2, "linear"):
            m.pattern += "_linear"
            m.nodes += [*passed, fc2]
        m.outputs = [m.nodes[-1]]
        m.params = {"linear": lin.obj, "gelu": act_module(act),
                    "dropout": _dropout_module(drop), "linear2": fc2.obj if m.pattern.endswith("_linear") else None,
                    "transposed": [bool(n.obj is not None and is_transposed_linear(n.obj)) for n in (lin, fc2)
                                   if n is not None and n.op == "linear"]}
        name_functional(g, drop, m)
        name = _linear_op(m.pattern)
        mods = [m.params[k] for k in ("linear", "gelu", "dropout", "linear2")][:4 if m.params["linear2"] else 3]
        m.reason = _op_support(name, *mods) or _common_checks(g, m.nodes)  # the ops have supports()
        m.ok = not m.reason
        out.append(m)
    return out


# --------------------------------------------------------------------------- Conv2d -> act [-> Dropout] -> Conv2d
def find_conv_act_conv(g: Graph) -> list[Match]:
    """The MLP of channels-first blocks (1x1 convolutions) and any conv pair with an activation between: a conv
    whose one reader is an activation leading (past identities and a dropout) to a second conv."""
    out = []
    for conv in g.nodes:
        if not (_is_module(conv, "conv2d") or _is_module(conv, "conv1d")):
            continue
        before, act = act_reader(g, conv, LINEAR_ACTS)
        if act is None:
            continue
        passed, nxt = past_identities(g, act)
        drop = nxt if nxt is not None and nxt.op == "dropout" else None
        passed2, conv2 = past_identities(g, drop) if drop is not None else ([], nxt)
        if not _is_module(conv2, conv.op):
            continue  # a conv and its activation alone (or a conv of another dimension next): no op takes them
        m = Match(f"conv_{act_kind(act)}{'_dropout' if drop is not None else ''}_conv", [conv, *before, act], False,
                  "", inputs=conv.inputs[:1], outputs=[conv2])
        m.nodes += [*passed, *([drop] if drop is not None else []), *passed2, conv2]
        m.params = {"conv1": conv.obj, "act": act_module(act), "dropout": _dropout_module(drop), "conv2": conv2.obj}
        m.reason = (_consumer_reason(g, conv, m.nodes[1]) or _op_support("FusedConvActDropoutConv", *m.params.values())
                    or _common_checks(g, m.nodes))
        m.ok = not m.reason
        name_functional(g, drop, m)
        out.append(m)
    return out


def build_conv_act_conv(m: Match) -> nn.Module:
    p = m.params
    return op_class("FusedConvActDropoutConv").from_modules(p["conv1"], p["act"], p["dropout"], p["conv2"],
                                                            register_modules=False)


# --------------------------------------------------------------------------- the ops that replace them
def _conv_op(variant: str) -> str:
    """ReLU chains keep their seed-named op; every other activation goes to the general one."""
    return "FusedConvBNReLU" if variant.startswith("conv_bn_relu") and not variant.startswith("conv_bn_relu6") \
        else "FusedConvBNAct"


def _linear_op(variant: str) -> str:
    act = variant.removeprefix("linear_").removesuffix("_linear").removesuffix("_dropout")
    stem = "FusedLinearGELUDropout" if act == "gelu" else "FusedLinearActDropout"
    return stem + "Linear" if variant.endswith("_linear") else stem


def build_conv_bn_relu(m: Match) -> nn.Module:
    p = m.params
    return op_class(_conv_op(m.pattern)).from_modules(p["conv"], p["bn"], p["relu"], maxpool=p["maxpool"],
                                                      register_modules=False, pad_same=p.get("pad_same", False))


def build_linear_gelu_dropout(m: Match) -> nn.Module:
    p, op = m.params, op_class(_linear_op(m.pattern))
    if p["linear2"] is not None:
        return op.from_modules(p["linear"], p["gelu"], p["dropout"], p["linear2"], register_second=False)
    return op.from_modules(p["linear"], p["gelu"], p["dropout"])


@dataclass(frozen=True)
class Pattern:
    family: str  # the name users toggle; variants start with it
    find: object  # Graph -> list[Match]
    build: object  # Match -> the fused nn.Module (shares the matched modules' parameters)
    op: str  # opsnn_lab.ops class the rewrite builds
    chain: str  # what it matches, for tables and the widget legend
    prefix: str = ""  # variant names start with this (default: the family)
    # a match is fused only where it saves at least this share of its chain's activation bytes ...
    min_share: float = 0.0
    # ... because of this (said in the decision of a match that saves less)
    needs: str = ""
    # declined, with ``needs``, where the match's measured cost says it keeps more activation bytes than eager.
    # Not for qkv (fused for time: one GEMM). An attention core's cost counts a mask every layer shares once per
    # chain, so a core that saves less than that mask reads as keeping more (a few tokens, and only then)
    never_worse: bool = False
    # the fused op's output has its input's rank (a module patched with it keeps it: ranks.py); not so for a loss
    keeps_rank: bool = True


def _only(find, *names):
    def finder(g: Graph) -> list[Match]:
        return [m for m in find(g) if m.pattern in names]
    return finder


# measured (python -m opsnn_lab.bench ops): alone, a fused LayerNorm saving its output saves one statistic
# per row and takes 1.2-1.6x eager's time (saving its input, it is nn.LayerNorm's bytes and time); before a
# Linear it saves half the pair's bytes at eager's time
_LN_NEEDS = ("FusedLayerNorm rebuilds xhat from its output in backward, which costs time and pays only where "
             "the op reading that output (a Linear, a GELU, the QKV projection) saves it too")

# a channels-first MLP widening 4x saves 4/9 of its chain's bytes, one that keeps its width 1/3; a
# squeeze-excitation (a pooled 1 x 1 map, reduced 4x) 1/6 of a few kilobytes, for the fused op's host time
_CONV_MLP_NEEDS = ("the fused op drops the activation's output, which pays for its host time only where that output "
                   "is a large share of the chain's bytes (a squeeze-excitation's pooled maps are not)")

# without a second Linear the op saves the activation's input and hands its output on: where the reader of that
# output saves it as well (StarReLU squaring a ReLU's output), the pair keeps one tensor more than eager's
_LINEAR_ACT_NEEDS = ("the fused op saves the activation's input, which pays only where the activation would save it "
                     "too or a second Linear or a dropout joins the chain")

# eager keeps act(gate) only where the activation saves its input (a ReLU keeps its output, which the product reads)
_PRODUCT_NEEDS = ("the fused product drops act(gate), which pays only where the activation saves its input "
                  "(GELU, SiLU) and nothing else keeps its output")

# the fused core saves its inputs and, without dropout, its output and a statistic per row where eager saves the
# T x T probabilities: with fewer keys than the head's width (or attention across a few layers' outputs) that is more
_ATTENTION_NEEDS = ("the fused core keeps its output and a statistic per query (or recomputes the probabilities) in "
                    "place of eager's probabilities, which pays only where there are more keys than the head's width")

# GroupNorm's and InstanceNorm's backward read their input, not their output: eager keeps the normalised tensor
# only for an activation that saves its input (SiLU, GELU, ReLU6's hardtanh, ...); ReLU keeps its output, which
# the next op keeps anyway
_NORM_ACT_NEEDS = ("the fused op drops the normalised tensor, which pays only where the activation saves its input "
                     "(SiLU, GELU, Hardswish, ReLU6, LeakyReLU; a ReLU keeps its output, which the next op keeps too)")

PATTERNS: tuple[Pattern, ...] = (
    Pattern("conv_bn_relu", find_conv_bn_relu, build_conv_bn_relu, "FusedConvBNReLU",
            "Conv2d -> BatchNorm2d -> activation [-> MaxPool2d]; Conv1d / Conv3d with their BatchNorm too",
            "conv_bn_"),
    Pattern("conv_act_conv", find_conv_act_conv, build_conv_act_conv, "FusedConvActDropoutConv",
            "Conv2d (or Conv1d) -> activation [-> Dropout] -> Conv2d (a channels-first MLP)", "conv_", min_share=0.25,
            needs=_CONV_MLP_NEEDS),
    # before linear_<act>: its gate -> act pair is part of the gated MLP
    Pattern("gated_mlp", gated.find_gated_mlp, gated.build_gated_mlp, "FusedGatedMLP",
            "act(gate(x)) * up(x) [-> Dropout] -> down (Linear x3)"),
    # what stays of a gated MLP whose projections are not Linears (adapters, quantised layers): the product alone
    Pattern("gated_product", gated.find_gated_products, gated.build_gated_product, "FusedGatedProduct",
            "act(gate) * up, projections of any kind", min_share=0.1, needs=_PRODUCT_NEEDS),
    Pattern("linear_gelu_dropout", find_linear_gelu_dropout, build_linear_gelu_dropout, "FusedLinearGELUDropout",
            "Linear / Conv1D -> activation [-> Dropout] [-> Linear]", "linear_", needs=_LINEAR_ACT_NEEDS,
            never_worse=True),
    # after the MLP rows, which take a dropout between their activation and second Linear
    Pattern("dropout_linear", blocks.find_dropout_linears, blocks.build_dropout_linear, "FusedDropoutLinear",
            "Dropout -> Linear (LoRA's lora_A(lora_dropout(x)), a head after its dropout)"),
    Pattern("attention", find_attention, build_attention, "FusedAttention",
            "softmax(q @ k^T * scale [capped: c tanh(s / c)] + mask [+ bias]) -> dropout -> @ v",
            needs=_ATTENTION_NEEDS, never_worse=True, keeps_rank=False),
    Pattern("qkv", find_qkv, build_qkv, "FusedQKV", "three sibling Linear layers reading one tensor"),
    # the residual add before a norm first: when it cannot be rewritten, the norm alone still fuses
    Pattern("add_layer_norm", _only(blocks.find_add_norms, "add_layer_norm"), blocks.build_norm, "FusedAddLayerNorm",
            "a + b -> LayerNorm (returns both)", min_share=0.1, needs=_LN_NEEDS),
    Pattern("add_rms_norm", _only(blocks.find_add_norms, "add_rms_norm"), blocks.build_norm, "FusedAddRMSNorm",
            "a + b -> RMSNorm (returns both)"),
    Pattern("layer_norm", _only(blocks.find_norms, "layer_norm"), blocks.build_norm, "FusedLayerNorm",
            "nn.LayerNorm, or a module computing LayerNorm of its input", min_share=0.1, needs=_LN_NEEDS),
    Pattern("rms_norm", _only(blocks.find_norms, "rms_norm"), blocks.build_norm, "FusedRMSNorm",
            "nn.RMSNorm, or a module computing RMSNorm of its input (HF *RMSNorm, T5LayerNorm)"),
    Pattern("group_norm_act", group_norm.find_group_norm_acts, group_norm.build_group_norm_act, "FusedGroupNormAct",
            "GroupNorm -> activation (a diffusion UNet's ResNet block)", "group_norm_", min_share=0.1,
            needs=_NORM_ACT_NEEDS),
    Pattern("instance_norm_act", group_norm.find_instance_norm_acts, group_norm.build_instance_norm_act,
            "FusedInstanceNormAct", "InstanceNorm1d/2d/3d -> activation (a segmentation UNet's conv block)",
            "instance_norm_", min_share=0.1, needs=_NORM_ACT_NEEDS),
    Pattern("linear_cross_entropy", blocks.find_linear_cross_entropy, blocks.build_linear_cross_entropy,
            "FusedLinearCrossEntropy", "vocabulary head -> cross-entropy (logits read only by the loss)",
            keeps_rank=False),
)
FAMILIES = tuple(p.family for p in PATTERNS)


def pattern_of(name: str) -> Pattern:
    """The table row of a family or variant name ("conv_bn_relu_maxpool" -> the conv_bn_relu row)."""
    return max((p for p in PATTERNS if name.startswith(p.prefix or p.family)), key=lambda p: len(p.prefix or p.family))


def find_all(g: Graph, enabled=None, claims=None) -> list[Match]:
    """Every candidate of every pattern; overlapping candidates after a fused one are rejected, with why.

    ``claims(match) -> bool`` (default: every viable match): whether a viable match takes its nodes. The
    analysis passes "can be rewritten", so a chain no rewrite can carry leaves its nodes to a smaller one.
    """
    taken: dict[str, Match] = {}
    out = []
    for pat in PATTERNS:
        for m in pat.find(g):
            if m.ok and not m.inputs:  # e.g. an MLP over a position table: nothing the fused op could be fed
                m.ok, m.reason = False, (f"`{m.nodes[0].label}` reads a parameter or buffer, not a tensor the forward "
                                         "computes: the chain has no input a fused op could take")
            m.viable = m.ok
            clash = next((taken[n.name] for n in m.nodes if n.name in taken), None)
            if m.ok and clash is not None:
                m.ok, m.reason = False, f"overlaps the fused {clash.pattern} on {', '.join(clash.modules)}"
            if m.ok and enabled is not None and pat.family not in enabled and m.pattern not in enabled:
                m.ok, m.reason = False, f"pattern {m.pattern!r} is switched off"
            if m.ok and (claims is None or claims(m)):
                taken.update({n.name: m for n in m.nodes})
            if m.ok:
                m.reason = f"fused: {_describe(g, m)} into {_op_for(pat, m)}"
            out.append(m)
    return out


def op_name(m: Match) -> str:
    """The ``opsnn_lab.ops`` class a match is fused into."""
    return _op_for(pattern_of(m.pattern), m)


def _op_for(pat: Pattern, m: Match) -> str:
    if pat.prefix == "linear_":
        return _linear_op(m.pattern)
    return _conv_op(m.pattern) if pat.prefix == "conv_bn_" else pat.op


def _describe(g: Graph, m: Match) -> str:
    """The chain's steps; the inline steps of one module (a norm written in Python) under that module's name."""
    scopes = {n.scope for n in m.nodes}
    if len(scopes) == 1 and all(n.kind == "function" for n in m.nodes) and next(iter(scopes)) in g.modules:
        scope = next(iter(scopes))
        return f"{scope} ({type(g.modules[scope]).__name__}: {' -> '.join(n.op for n in m.nodes)})"
    return ' -> '.join(_short(n) for n in m.nodes)


def _short(n: Node) -> str:
    if not n.module:
        return n.op if n.kind == "function" else n.label
    inner = Probed.bn_act.get(n.obj) if n.obj is not None else None  # a BatchNorm applying its own act
    applies = "" if inner is None else f", with its {type(inner).__name__}"
    return f"{n.module} ({type(n.obj).__name__}{applies})"



