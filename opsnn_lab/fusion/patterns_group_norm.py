"""Pattern rows for GroupNorm -> activation (a diffusion UNet's and VAE's ResNet blocks: GroupNorm -> SiLU before
each conv; wav2vec2's feature encoder: GroupNorm -> GELU) and InstanceNorm -> activation (nnU-Net's and MONAI's
Conv -> InstanceNorm -> LeakyReLU blocks, image-to-image generators). One pure finder over the dataflow graph for
both norms, every candidate returned with a reason, as in ``patterns.py``."""

from __future__ import annotations

from torch import nn

from opsnn_lab.fusion.graph import Graph
from opsnn_lab.fusion.match import (
    NORM_ACTS,
    Match,
    _common_checks,
    _consumer_reason,
    _is_module,
    _op_support,
    act_kind,
    act_module,
    act_reader,
    functional_prelu,
    inner_act,
    inplace_reason,
    op_class,
    past_views,
)

__all__ = ["find_group_norm_acts", "build_group_norm_act", "find_instance_norm_acts", "build_instance_norm_act"]


def find_group_norm_acts(g: Graph) -> list[Match]:
    """``act(group_norm(x))`` where only the activation reads the normalised tensor: the fused op saves x and the
    statistics, never the normalised tensor eager's activation keeps. Views between the two (a per-frame norm on
    ``(B * T, C, H, W)`` whose output is unflattened and permuted back before the activation) stay in the model's
    code, run on the op's output (``Match.views``)."""
    return _find_norm_acts(g, "group_norm", "FusedGroupNormAct")


def find_instance_norm_acts(g: Graph) -> list[Match]:
    """``act(instance_norm(x))`` (an ``nn.InstanceNorm1d`` / ``2d`` / ``3d`` module), as ``find_group_norm_acts``:
    a GroupNorm with one group per channel."""
    return _find_norm_acts(g, "instance_norm", "FusedInstanceNormAct")


def _find_norm_acts(g: Graph, op: str, fused: str) -> list[Match]:
    out = []
    for norm in g.nodes:
        if not _is_module(norm, op):
            continue
        inner = inner_act(norm)  # a GroupNorm module applying its own activation (timm's GroupNormAct)
        passed, act = ([], inner) if inner is not None else act_reader(g, norm, NORM_ACTS, zero_dropouts=True)
        views, behind = past_views(g, norm) if act is None and inner is None else ([], None)
        if views and behind is not None and act_kind(behind) in NORM_ACTS:
            act = behind  # the activation is pointwise: the op runs it before the views, on the norm's layout
        m = Match(f"{op}_act", [norm], False, "", inputs=norm.inputs[:1], outputs=[norm])
        users = g.users.get(norm.name, [])
        if inner is not None and act_kind(inner) not in NORM_ACTS:
            m.reason = (f"`{norm.label}` applies {type(inner.obj).__name__} itself, not one of "
                        f"{', '.join(sorted(NORM_ACTS))}")
            out.append(m)
            continue
        if act is None:
            past = f", past {', '.join(f'`{v.op}`' for v in views)}," if views else ""
            to = g.users.get(views[-1].name, []) if views else users
            m.reason = (f"the output of `{norm.label}`{past} goes to {', '.join(f'`{u.label}`' for u in to)}, not one "
                        f"activation of {', '.join(sorted(NORM_ACTS))}" if to else f"`{norm.label}` is unused")
            out.append(m)
            continue
        m.pattern = f"{op}_{act_kind(act)}"
        if inner is None:
            m.nodes, m.outputs, m.views = [norm, *passed, *views, act], [act], [v.name for v in views]
        module = act_module(act)
        m.params = {"norm": norm.obj, "act": module}
        m.reason = (("" if inner else _consumer_reason(g, norm, (passed or views or [act])[0]))
                    or functional_prelu(act, module)
                    or _op_support(fused, norm.obj, module) or inplace_reason(g, m.outputs[0])
                    or _common_checks(g, m.nodes))
        m.ok = not m.reason
        out.append(m)
    return out


def build_group_norm_act(m: Match) -> nn.Module:
    return op_class("FusedGroupNormAct").from_modules(m.params["norm"], m.params["act"], register=False)


def build_instance_norm_act(m: Match) -> nn.Module:
    return op_class("FusedInstanceNormAct").from_modules(m.params["norm"], m.params["act"], register=False)
