"""Pattern rows for the blocks of today's transformers: norms (with the residual add), head + loss (gated MLPs:
``patterns_gated.py``).

Like ``patterns.py``, one pure finder per row over the dataflow graph, each returning every candidate with a
reason. Norm modules written in Python (Hugging Face ``*RMSNorm``, T5's ``T5LayerNorm``, any user norm) are
recognised from the run-time record, not by class name: a module whose recorded inner nodes are only
pointwise and last-dim reduction ops, reading one tensor and one weight of the feature size, is *called again*
on its recorded input with a random weight (``torch.func.functional_call``, nothing modified), and the result
is compared with RMSNorm and LayerNorm of that input, weight ``w`` or ``1 + w``. The verdict is kept in
``Graph.memo`` (the tensors are released after the analysis, a replan must agree).
"""

from __future__ import annotations

import torch
from torch import nn

from opsnn_lab.fusion.graph import Graph, Node, arg
from opsnn_lab.fusion.match import (
    Match,
    _common_checks,
    _dropout_module,
    _is_module,
    _op_support,
    inplace_reason,
    inplace_writer,
    op_class,
    past_identities,
)
from opsnn_lab.fusion.patterns_attention import name_functional

__all__ = ["find_norms", "find_add_norms", "norm_verdicts", "find_dropout_linears", "find_linear_cross_entropy",
           "build_norm", "build_dropout_linear", "build_linear_cross_entropy"]


# --------------------------------------------------------------------------- LayerNorm / RMSNorm
# What a norm written in Python may record: casts, pointwise arithmetic, reductions over the last dim.
_NORM_OPS = frozenset({"to", "float", "type_as", "pow", "mul", "mean", "add", "rsqrt", "sqrt", "div", "reciprocal",
                       "sub", "var", "square", "layer_norm", "rms_norm", "var_mean", "neg", "half", "bfloat16",
                       "double", "type", "permute", "movedim", "contiguous",
                       # a channels-first norm shapes its weight to (C, 1, 1): HF ConvNeXt's weight[:, None, None]
                       "getitem", "view", "reshape", "unsqueeze"})
# how close a norm's output must be to the formula in its input's dtype (fp64: far below fp32's rounding, so an
# fp64 module that computes in fp32 inside, as Hugging Face's RMSNorms do, is told apart)
_TOL = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _recorded_eps(nodes: list[Node]) -> float | None:
    """The constant added to the mean square / variance (``mean(x^2) + eps``), or a functional norm's eps."""
    names = {n.name for n in nodes}
    reduced = {n.name for n in nodes if n.op in ("mean", "var")}
    for n in nodes:
        if n.op in ("layer_norm", "rms_norm"):
            eps = arg(n, 4 if n.op == "layer_norm" else 3, "eps", 1e-5 if n.op == "layer_norm" else None)
            return float(eps) if isinstance(eps, (int, float)) else None
        if n.op == "add" and n.inputs and set(n.inputs) <= reduced & names:
            eps = next((a for a in n.args if isinstance(a, (int, float)) and not isinstance(a, bool)), None)
            if eps is not None:
                return float(eps)
    return None


def _norm_form(module: nn.Module, x: torch.Tensor, eps_candidates, inner=(), centred_first=False
               ) -> tuple[str, float, float, int] | str:
    """``(kind, eps, weight_offset, dim)`` when ``module(x)`` is ``norm(x) * (w + offset) [+ b]`` over ``dim`` (-1,
    or 1 for a norm over the channels of an (N, C, *) input: timm's LayerNorm2d) (a module without parameters:
    ``norm(x)``), else why not. ``inner``: the dtypes the module's recorded steps ran in.
    ``centred_first``: try LayerNorm before RMSNorm (the recorded steps centre the input): on an input whose mean
    is already ~0 (another norm's output at init) both forms match, and the recorded one is the one to keep."""
    w, b = getattr(module, "weight", None), getattr(module, "bias", None)
    gen = torch.Generator().manual_seed(0)
    swap = {}
    if isinstance(w, nn.Parameter):
        swap["weight"] = torch.randn(w.shape, generator=gen, dtype=torch.float64).to(w)
    if isinstance(b, torch.Tensor):
        swap["bias"] = torch.randn(b.shape, generator=gen, dtype=torch.float64).to(b)
    try:
        with torch.no_grad():
            y = torch.func.functional_call(module, swap, (x.detach(),))
    except Exception as exc:  # noqa: BLE001 - a module that cannot be called on its input alone is not a norm
        return f"`{type(module).__name__}` cannot be called on its input alone ({type(exc).__name__})"
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return "its output is not one tensor of its input's shape"
    if y.dtype != x.dtype:
        why = "the weight's dtype promotes the result" if swap else "a cast inside"
        return f"it returns {y.dtype} for a {x.dtype} input ({why})"
    xf, yd = x.detach().double(), y.double()
    wd = swap["weight"].double() if "weight" in swap else 1.0
    bd = swap["bias"].double() if "bias" in swap else 0.0
    offsets = (0.0, 1.0) if "weight" in swap else (0.0,)
    tols = [(_TOL.get(x.dtype, 1e-4), None)]  # then the dtype a cast inside computes in, where it is coarser
    tols += [(_TOL[d], d) for d in inner if _TOL.get(d, 0.0) > tols[0][0]]
    # over the last dim, and over dim 1 of an (N, C, *) input whose C is the weight's size (its weight broadcast so)
    fits_last = "weight" not in swap or tuple(w.shape) == tuple(x.shape[x.dim() - w.dim():])
    fits_channels = x.dim() >= 3 and ("weight" not in swap or (w.dim() == 1 and x.shape[1] == w.shape[0]))
    # the weight and bias as each dim's norm applies them: over dim 1 a 1-D weight broadcasts as (C, 1, ..., 1)
    view = (-1,) + (1,) * (x.dim() - 2)
    affine = {-1: (wd, bd),
              1: (wd.reshape(view) if "weight" in swap else wd, bd.reshape(view) if "bias" in swap else bd)}
    dims = [-1] * fits_last + [1] * fits_channels
    kinds = ("layer", "rms") if centred_first else ("rms", "layer")
    for tol, lower in sorted(tols, key=lambda t: t[0]):
        for eps in dict.fromkeys(e for e in eps_candidates if e is not None):
            for dim in dims:
                centred = xf - xf.mean(dim, keepdim=True)
                forms = {"rms": xf * torch.rsqrt(xf.pow(2).mean(dim, keepdim=True) + eps),
                         "layer": centred * torch.rsqrt(centred.pow(2).mean(dim, keepdim=True) + eps)}
                w_, b_ = affine[dim]
                for kind in kinds:
                    for offset in offsets:
                        ref = forms[kind] * (w_ + offset) + b_
                        if not torch.allclose(yd, ref, rtol=tol, atol=tol * max(1.0, float(ref.abs().max()))):
                            continue
                        if lower is None:
                            return kind, float(eps), offset, dim
                        name = "RMSNorm" if kind == "rms" else "LayerNorm"
                        return (f"it casts to {str(lower).replace('torch.', '')} inside and computes {name} there, "
                                f"which differs from {name} of its {str(x.dtype).replace('torch.', '')} input by more "
                                f"than {str(x.dtype).replace('torch.', '')} rounding; Fused{name} computes in "
                                f"{'float64' if x.dtype == torch.float64 else 'float32'} and rounds once to the input "
                                "dtype")
    return "its output is neither RMSNorm nor LayerNorm of its input (last dim or channels) with its weight"


def _python_norm(g: Graph, scope: str, nodes: list[Node]):
    """``(Match | None)`` for the module at ``scope`` if its recorded nodes compute a norm of one tensor (with a
    1-D weight, or with no parameters at all: OLMo's ``F.layer_norm(x.float(), shape, None, None).to(dtype)``)."""
    module = g.modules.get(scope)
    if module is None:
        return None
    weight = getattr(module, "weight", None)
    weightless = next(module.parameters(), None) is None
    if not weightless and (not isinstance(weight, nn.Parameter) or weight.dim() != 1):
        return None
    names = {n.name for n in nodes}
    # an fx graph reads the weight as a node of its own (``get_attr``); the run-time record does not
    ext = list(dict.fromkeys(i for n in nodes for i in n.inputs if i not in names and g[i].op != "param"))
    ops = {n.op for n in nodes}
    if len(ext) != 1 or not ops <= _NORM_OPS or not ops & {"mean", "var", "layer_norm", "rms_norm", "var_mean"}:
        return None
    x, y = g[ext[0]], nodes[-1]
    key = ("norm", scope)
    fx_seen = x.shape is None and key in g.memo  # an fx graph (no shapes) of a norm the run-time record judged
    if not fx_seen and (x.shape is None or not x.shape or (not weightless and weight.shape[0] not in (
            x.shape[-1], x.shape[1] if len(x.shape) >= 3 else None))):
        return None
    escapes = [n for n in nodes[:-1] if any(u.name not in names for u in g.users.get(n.name, []))]
    if key not in g.memo:
        t = g.tensors.get(x.name)
        if t is None:
            return None  # an fx graph, or a run-time graph whose tensors are gone: nothing to check against
        inner = {n.dtype for n in nodes if n.dtype is not None and n.dtype != t.dtype}
        g.memo[key] = _norm_form(module, t, [_recorded_eps(nodes), getattr(module, "variance_epsilon", None),
                                             getattr(module, "eps", None)], inner,
                                 centred_first=bool(ops & {"layer_norm", "sub", "var", "var_mean"}))
        if isinstance(g.memo[key], tuple):  # the verdict (kind, eps, offset); a norm over dim 1 says so beside it
            kind, eps, offset, dim = g.memo[key]
            g.memo[key] = (kind, eps, offset)
            if dim == 1:
                g.memo[("norm_dim", scope)] = 1
        if isinstance(g.memo[key], tuple) and any(isinstance(p, torch.Tensor) and p.dtype != t.dtype
                                                  for p in (getattr(module, "weight", None),
                                                            getattr(module, "bias", None))):
            # a norm giving its input's dtype from parameters of another casts them (FP32LayerNorm): the op too
            g.memo[("norm_cast", scope)] = True
    form = g.memo[key]
    if isinstance(form, str):
        if "neither" in form or "cannot be called" in form:
            return None  # some other computation: not a candidate at all
        named = "layer_norm" if "LayerNorm" in form else "rms_norm" if "RMSNorm" in form else None
        return Match(named or ("rms_norm" if "rsqrt" in ops else "layer_norm"), nodes, False, f"`{scope}`: {form}",
                     inputs=[x.name], outputs=[y])
    if weightless and x.shape:  # the size its weight would have given: the record's, kept for fx graphs
        g.memo[("norm_shape", scope)] = (x.shape[1 if g.memo.get(("norm_dim", scope)) else -1],)
    m = _judged_norm(g, scope, module, nodes, x.name, y)
    if escapes:
        m.reason = f"`{escapes[0].label}` inside `{scope}` is also read outside it"
    elif m.params["kind"] == "rms" and isinstance(getattr(module, "bias", None), torch.Tensor):
        m.reason = f"`{scope}` is an RMSNorm with a bias; FusedRMSNorm has none"
    else:  # the inside may compute in fp32 on purpose: the dtype contract (y like x) was checked on the call
        m.reason = _common_checks(g, nodes[-1:])
    m.ok = not m.reason
    return m


def norm_verdicts(planned: dict) -> dict:
    """``Graph.memo`` entries for the Python norms of planned decisions (``{key: params}``): an fx graph traced again
    for the rewrite has no tensors to judge them by, and the plan says what the run-time record found."""
    out = {}
    for (pattern, modules), p in planned.items():
        if pattern.endswith(("rms_norm", "layer_norm")) and p and {"kind", "eps", "offset"} <= p.keys():
            out[("norm", modules[-1])] = (p["kind"], p["eps"], p["offset"])
            if p.get("shape"):  # a norm without parameters: the size it normalises
                out[("norm_shape", modules[-1])] = tuple(p["shape"])
            if p.get("cast_params"):
                out[("norm_cast", modules[-1])] = True
            if p.get("channel_dim"):
                out[("norm_dim", modules[-1])] = p["channel_dim"]
    return out


def find_norms(g: Graph) -> list[Match]:
    out = []
    for n in g.nodes:  # built-in modules: nn.LayerNorm, nn.RMSNorm
        if _is_module(n, "layer_norm") or _is_module(n, "rms_norm"):
            op = "FusedLayerNorm" if n.op == "layer_norm" else "FusedRMSNorm"
            m = Match(n.op, [n], False, "", inputs=n.inputs[:1], outputs=[n], params={"norm": n.obj, "kind": n.op})
            m.reason = _op_support(op, n.obj) or _common_checks(g, [n])
            m.ok = not m.reason
            out.append(_keep_input_if_written(g, m))
        elif n.kind == "module" and isinstance(g.memo.get(("norm", n.module)), tuple) and n.inputs:
            out.append(_keep_input_if_written(g, _judged_norm_call(g, n)))
    if not g.modules:
        return out
    by_scope: dict[str, list[Node]] = {}
    for n in g.nodes:
        if n.kind != "input" and n.kind != "output":
            by_scope.setdefault(n.scope, []).append(n)
    inner = {s.rpartition(".")[0] for s in by_scope if s}  # scopes with a user module running inside them
    for scope, nodes in by_scope.items():
        if scope and scope not in inner and all(n.kind == "function" for n in nodes):
            m = _python_norm(g, scope, nodes)
            if m is not None:
                out.append(_keep_input_if_written(g, m))
    return out


def _judged_norm(g: Graph, scope: str, module: nn.Module, nodes: list[Node], x: str, y: Node) -> Match:
    """The match of the norm ``module`` (at ``scope``) computing ``y`` from ``x``, from the verdict in ``g.memo``
    (the run-time record's): its kind, eps and weight offset, and for a norm without parameters the size it
    normalises. No checks yet."""
    kind, eps, offset = g.memo[("norm", scope)]
    m = Match(f"{kind}_norm", nodes, False, "", inputs=[x], outputs=[y],
              params={"norm": module, "kind": kind, "eps": eps, "offset": offset})
    if next(module.parameters(), None) is None:
        m.params["shape"] = g.memo.get(("norm_shape", scope))
    if g.memo.get(("norm_cast", scope)):
        m.params["cast_params"] = True
    if g.memo.get(("norm_dim", scope)):
        m.params["channel_dim"] = 1
    return m


def _judged_norm_call(g: Graph, n: Node) -> Match:
    """A norm module kept as one call in an fx graph (its own forward stops the tracer: Nemotron's LayerNorm1P
    under ``torch.autocast``), which the run-time record looked into and judged a norm: the same match, from that
    verdict."""
    m = _judged_norm(g, n.module, n.obj, [n], n.inputs[0], n)
    m.reason = _common_checks(g, [n])
    m.ok = not m.reason
    return m


def _keep_input_if_written(g: Graph, m: Match) -> Match:
    """A norm whose output a reader writes into (an ``inplace=True`` activation after it) saves its input, as
    eager's does: the output it would keep instead is gone by backward."""
    if m.params and inplace_writer(g, m.outputs[0]) is not None:
        m.params["save_output"] = False
    return m


def find_add_norms(g: Graph) -> list[Match]:
    """``norm(a + b)`` where the add is visible: the fused op returns ``(norm(a + b), a + b)``."""
    out = []
    for norm in find_norms(g):
        s = g.by_name.get(norm.inputs[0]) if norm.inputs else None
        if s is None or s.op != "add" or s.kind != "function" or len(s.inputs) != 2 or not norm.params:
            continue
        a, b = (g[i] for i in s.inputs)
        m = Match(f"add_{norm.pattern}", [s, *norm.nodes], False, "", inputs=list(s.inputs),
                  outputs=[norm.outputs[0], s], params=dict(norm.params))
        if s.inputs[0] == s.inputs[1] or len(s.args) > 2 or "alpha" in s.kwargs:
            m.reason = f"`{s.label}` is not a plain sum of two tensors"
        elif norm.params.get("channel_dim"):
            m.reason = ("the norm is over the channels of an (N, C, *) input: its op runs channels-last, and the "
                        "sum it would return, the residual stream, would change layout; the norm fuses alone")
        elif a.shape != s.shape or b.shape != s.shape or a.dtype != b.dtype:
            m.reason = f"`{s.label}` broadcasts or mixes dtypes ({a.shape} + {b.shape})"
        else:
            m.reason = norm.reason if not norm.ok else _common_checks(g, m.nodes)
        m.ok = not m.reason
        out.append(m)
    return out


class AddNorm(nn.Module):
    """``forward(a, b) -> (norm(a + b), a + b)`` by the fused op (under autocast too: it widens a bf16 ``a`` onto
    an fp32 ``b`` as eager's add does); where the sum's dtype is not the norm weight's under autocast, the add and
    the norm module's own forward, as the model computed them."""

    def __init__(self, op: nn.Module, norm: nn.Module):
        super().__init__()
        self.op = op
        object.__setattr__(self, "norm", norm)  # the model's module, not a child: no second copy of its weight

    def forward(self, a: torch.Tensor, b: torch.Tensor):
        wide = a if a.dtype == torch.promote_types(a.dtype, b.dtype) else b
        if self.op.defers_under_autocast(wide):
            s = a + b
            return self.norm(s), s
        return self.op(a, b)


def build_norm(m: Match) -> nn.Module:
    if m.pattern.startswith("add_"):
        return AddNorm(_build_norm(m), m.params["norm"])
    return _build_norm(m)


def _build_norm(m: Match) -> nn.Module:
    p, add = m.params, m.pattern.startswith("add_")
    name = ("FusedAdd" if add else "Fused") + ("RMSNorm" if p["kind"] in ("rms", "rms_norm") else "LayerNorm")
    cls, norm = op_class(name), p["norm"]
    keep_y = p.get("save_output", True)
    if "eps" not in p:  # a built-in module: the op reads it
        return cls.from_modules(norm, save_output=keep_y)
    bias = norm.bias if p["kind"] == "layer" and isinstance(getattr(norm, "bias", None), nn.Parameter) else None
    weight = getattr(norm, "weight", None) if "shape" not in p else None  # a norm without parameters: its size
    return cls(weight, bias, p["eps"], p.get("shape"), weight_offset=p["offset"], save_output=keep_y,
               cast_params=p.get("cast_params", False), channel_dim=p.get("channel_dim")).train(norm.training)


# --------------------------------------------------------------------------- Linear(Dropout(x))
def find_dropout_linears(g: Graph) -> list[Match]:
    """``linear(dropout(x))`` where only the Linear reads the dropped copy: LoRA's ``lora_A(lora_dropout(x))``
    (peft), a classifier after its dropout. The fused op saves x and regenerates the mask."""
    out = []
    for drop in g.nodes:
        if drop.op != "dropout" or not drop.inputs or not arg(drop, 2, "training", True):
            continue
        module = _dropout_module(drop)
        passed, lin = past_identities(g, drop)
        if not _is_module(lin, "linear") or not isinstance(module, nn.Module) or not getattr(module, "p", 0.0) > 0:
            continue  # p = 0 (peft's default adapter): an identity, nothing to save
        m = Match("dropout_linear", [drop, *passed, lin], False, "", inputs=drop.inputs[:1], outputs=[lin],
                  params={"dropout": module, "linear": lin.obj})
        name_functional(g, drop, m)
        m.reason = (_op_support("FusedDropoutLinear", module, lin.obj) or inplace_reason(g, lin)
                    or _common_checks(g, m.nodes))
        m.ok = not m.reason
        out.append(m)
    return out


def build_dropout_linear(m: Match) -> nn.Module:
    return op_class("FusedDropoutLinear").from_modules(m.params["dropout"], m.params["linear"], register=False)


# --------------------------------------------------------------------------- vocabulary head -> cross-entropy
_RESHAPES = frozenset({"view", "reshape", "float", "to", "contiguous", "getitem", "flatten", "type_as"})
RECIPE = ("compute the loss from the hidden states with ol.ops.lm_head_loss(model, input_ids, labels) "
          "(Hugging Face causal / masked LMs, the config's logit cap or scale included) or "
          "ol.ops.FusedLinearCrossEntropy.from_modules(head, logit_scale=..., softcap=...)(hidden, labels), "
          "which never hold the logits")


def _logit_map(n) -> bool:
    """A scale or a cap between the head and its loss (Cohere's ``* logit_scale``, Gemma 2's ``/ cap``, ``tanh``,
    ``* cap``): an elementwise op reading one tensor, which ``linear_cross_entropy``'s logit map computes."""
    return n.op in ("mul", "div", "tanh") and len(n.inputs) == 1


def find_linear_cross_entropy(g: Graph) -> list[Match]:
    """Candidates only: the rewrite replaces module calls of one input, a loss reads two (hidden, labels)."""
    out = []
    for ce in g.nodes:
        if ce.op != "cross_entropy" or not ce.inputs:
            continue
        path, z = [], g.producer(ce)
        while z is not None and z.kind == "function" and (z.op in _RESHAPES or _logit_map(z)):
            path.append(z)
            z = g.producer(z)
        if z is None or z.op != "linear":
            continue
        chain = [z, *reversed(path), ce]
        m = Match("linear_cross_entropy", chain, False, "", inputs=[*z.inputs[:1], *ce.inputs[1:2]], outputs=[ce],
                  params={"head": z.obj})
        others = [u for a, nxt in zip(chain, chain[1:]) for u in g.users.get(a.name, []) if u is not nxt]
        if others:
            who = "returned by the model's forward" if any(u.kind == "output" for u in others) else \
                f"also read by {', '.join(f'`{u.label}`' for u in others[:3])}"
            m.reason = f"the logits of `{z.label}` are {who}, so they are materialised anyway; {RECIPE}"
        else:
            m.reason = (f"the logits of `{z.label}` are read only by the loss, but the loss runs inline in "
                        f"`{ce.scope or '<model>'}`.forward on two tensors (hidden, labels); {RECIPE}")
        out.append(m)
    return out


def build_linear_cross_entropy(m: Match) -> nn.Module:
    return op_class("FusedLinearCrossEntropy").from_modules(m.params["head"])
