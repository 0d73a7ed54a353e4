"""Three Linear layers reading the same input (query/key/value) as one GEMM with a split epilogue.

Which weight the GEMM reads, and why it is still the original parameters:
``from_modules(..., pack=True)`` (default) moves the three weights (and the biases, when all three
have one) into one contiguous buffer and re-points each original Parameter's ``.data`` at its slice.
The Parameter objects, their values, ``requires_grad`` and any optimizer holding them are unchanged; the
GEMM then reads the buffer directly, no copy per call, and an optimizer step on any of the three
Parameters is seen at once because it writes into the buffer. ``torch.cat`` per call would instead copy
3 x out x in weights every forward (7 MB at BERT-base).

Every call checks that the three Parameters still sit back to back in one storage; if something
re-pointed one of them (``module.to(...)``, ``param.data = ...``), that call falls back to ``torch.cat``
(correct, one copy), and ``repack()`` restores the zero-copy layout (a model ``ol.fusion`` fused does so itself
after ``.to()``: ``fusion.packing.RepackAfterApply``). Gradients come from one GEMM and
are handed back as slices of one buffer.
"""

from __future__ import annotations

import torch
from torch import nn

from opsnn_lab._checks import check_like, check_linear_input, check_type, first_derivative_only
from opsnn_lab.ops import _amp

__all__ = ["FusedQKV", "QKVFunction"]


def _adjacent(tensors: list[torch.Tensor]) -> bool:
    """True when the tensors are contiguous and back to back in one storage, in order."""
    ptr = tensors[0].data_ptr()
    for t in tensors:  # addresses first: each storage lookup makes a Python object (run every call)
        if t.data_ptr() != ptr or not t.is_contiguous():
            return False
        ptr += t.numel() * t.element_size()
    base = tensors[0].untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() == base for t in tensors[1:])


@torch.no_grad()
def pack(params: list) -> None:
    """Move ``params`` into one buffer, rows after rows, and re-point each one's ``.data`` at its slice (the
    Parameter objects stay). Nothing when one is None, when they are adjacent already, or when they differ in
    dtype or device (a conversion half done: concatenating would change one's dtype)."""
    if any(p is None for p in params) or _adjacent(params) or len({(p.dtype, p.device) for p in params}) > 1:
        return
    buf = torch.cat([p.detach() for p in params])
    for p, part in zip(params, buf.split([p.shape[0] for p in params])):
        p.data = part


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The row-wise concatenation: a view when the tensors are adjacent, else a copy."""
    rows = sum(t.shape[0] for t in tensors)
    if _adjacent(tensors):
        return tensors[0].as_strided((rows, *tensors[0].shape[1:]), tensors[0].stride())
    return torch.cat(tensors)


def _joined_bias(biases, outs, like):
    if all(b is None for b in biases):
        return None
    return _joined([like.new_zeros(o) if b is None else b for b, o in zip(biases, outs)])


def qkv_split(y: torch.Tensor, x: torch.Tensor, outs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``QKVFunction``'s (M, q + k + v) result as q, k, v with ``x``'s leading dims: one ``narrow`` view each
    (not ``split``: autograd refuses in-place writes to the outputs of a multi-view op, and ``q *= scale`` on a
    Linear's output is common)."""
    starts = [sum(outs[:i]) for i in range(len(outs))]
    return tuple(y.narrow(1, a, o).view(*x.shape[:-1], o) for a, o in zip(starts, outs))


class QKVFunction(torch.autograd.Function):
    """``(x @ Wq.T + bq, x @ Wk.T + bk, x @ Wv.T + bv)`` from one GEMM; the outputs are column slices of it."""

    @staticmethod
    @_amp.no_autocast
    def forward(ctx, x, wq, wk, wv, bq, bk, bv):
        weights, outs = [wq, wk, wv], [wq.shape[0], wk.shape[0], wv.shape[0]]
        x2 = x.reshape(-1, x.shape[-1])
        w = _joined(weights)
        b = _joined_bias([bq, bk, bv], outs, wq)
        y = torch.addmm(b, x2, w.t()) if b is not None else x2 @ w.t()
        ctx.save_for_backward(x2, wq, wk, wv)
        ctx.outs, ctx.lead, ctx.has_bias = outs, x.shape[:-1], (bq is not None, bk is not None, bv is not None)
        return y  # (M, q + k + v): split and viewed outside the Function (see qkv_split), so each part may be
        # modified in place; autograd gathers the parts' gradients into one (M, q + k + v) gradient

    @staticmethod
    @_amp.no_autocast
    def backward(ctx, gy):
        first_derivative_only("FusedQKV")
        x2, wq, wk, wv = ctx.saved_tensors
        need_x, need_wq, need_wk, need_wv, need_bq, need_bk, need_bv = ctx.needs_input_grad
        grad_x = (gy @ _joined([wq, wk, wv])).view(*ctx.lead, x2.shape[1]) if need_x else None
        grad_w = [None] * 3
        if need_wq or need_wk or need_wv:
            grad_w = list((gy.t() @ x2).split(ctx.outs, dim=0))
        grad_b = [None] * 3
        if any(need and has for need, has in zip((need_bq, need_bk, need_bv), ctx.has_bias)):
            grad_b = [s if has else None for s, has in zip(gy.sum(0).split(ctx.outs), ctx.has_bias)]
        grad_w = [g if need else None for g, need in zip(grad_w, (need_wq, need_wk, need_wv))]
        grad_b = [g if need else None for g, need in zip(grad_b, (need_bq, need_bk, need_bv))]
        return (grad_x, *grad_w, *grad_b)


def _check_linears(q, k, v) -> None:
    for name, lin in (("q", q), ("k", k), ("v", v)):
        check_type(name, lin, nn.Linear)
    for name, lin in (("k", k), ("v", v)):
        if lin.in_features != q.in_features:
            raise ValueError(f"{name} must have in_features={q.in_features} like q (they read the same input), "
                             f"got {lin.in_features}")
        check_like(name, lin, "q", q)


class FusedQKV(nn.Module):
    """``forward(x) -> (q(x), k(x), v(x))`` as one GEMM over the three Linears' own Parameters.

    Contract: the three ``nn.Linear`` modules stay the source of truth (see the module docstring for
    packing). ``register=True`` (default) registers them as submodules ``q``, ``k``, ``v`` (state_dict keys
    ``q.weight`` ...); ``register=False`` only references them, for a rewrite that leaves the original
    Linears at their own paths so their keys stay there and appear once. Output features may differ
    (e.g. grouped-query attention); in_features, dtype and device must match. Biases may be mixed.
    """

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear, *, pack: bool = True, register: bool = True):
        super().__init__()
        _check_linears(q, k, v)
        if check_type("register", register, bool):
            self.q, self.k, self.v = q, k, v
        else:
            object.__setattr__(self, "_refs", (q, k, v))
        if check_type("pack", pack, bool):
            self.repack()

    @classmethod
    def from_modules(cls, q: nn.Linear, k: nn.Linear, v: nn.Linear, *, pack: bool = True,
                     register: bool = True) -> FusedQKV:
        return cls(q, k, v, pack=pack, register=register)

    @property
    def linears(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return (self.q, self.k, self.v) if "q" in self._modules else self.__dict__["_refs"]

    @property
    def packed(self) -> bool:
        """Whether the next forward reads the weights without a copy."""
        return _adjacent([lin.weight for lin in self.linears])

    def repack(self) -> None:
        """Move the weights (and biases, if all three have one) into one buffer; Parameters keep identity."""
        for attr in ("weight", "bias"):
            pack([getattr(lin, attr) for lin in self.linears])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.linears
        with _amp.region(x) as cast:  # under autocast: its matmul casts, autocast off inside
            x, *w = cast(x, q.weight, k.weight, v.weight, q.bias, k.bias, v.bias)
            check_linear_input(x, q, weight=w[0])
            out = QKVFunction.apply(x, *w)
        return qkv_split(out, x, (q.out_features, k.out_features, v.out_features))

    def extra_repr(self) -> str:
        q, k, v = self.linears
        return f"in_features={q.in_features}, out_features=({q.out_features}, {k.out_features}, {v.out_features})"
