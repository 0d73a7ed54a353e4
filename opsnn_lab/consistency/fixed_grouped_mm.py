"""``aten::_grouped_mm`` as one fixed-order GEMM per group, for ``strict()``.

Mixture-of-experts layers (Hugging Face's experts since transformers 5) multiply each expert's slice of the sorted
tokens by that expert's weights in one ``_grouped_mm``, whose CPU kernel's bits follow the thread count. Here each
group is a ``torch.mm`` (strict()'s fixed-order GEMM), so every thread count gets the same bits. The four forms:

* 2-d x 3-d, ``offs`` over the rows of ``self``: ``out[s:e] = self[s:e] @ mat2[g]`` (the experts' forward);
* 3-d x 2-d, ``offs`` over the columns of ``mat2``: ``out[:, s:e] = self[g] @ mat2[:, s:e]``;
* 2-d x 2-d, ``offs`` over the shared axis: ``out[g] = self[:, s:e] @ mat2[s:e]`` (the weight gradient);
* 3-d x 3-d, no ``offs``: one batched product.

Rows (columns) past the last offset are zeros; an empty group gives zeros. ``bias`` (one row per group) is added;
``out_dtype`` is the dtype the products are computed and returned in.
"""

from __future__ import annotations

import torch

__all__ = ["grouped_mm"]


def _groups(offs: torch.Tensor):
    ends = [int(e) for e in offs.tolist()]
    return list(zip([0, *ends[:-1]], ends))


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``aten::_grouped_mm`` (same schema) from per-group ``torch.mm`` calls."""
    dtype = out_dtype or a.dtype
    a, b = a.to(dtype), b.to(dtype)
    if a.dim() == 3 and b.dim() == 3:
        out = torch.bmm(a, b)
        return out if bias is None else out + bias.to(dtype)[:, None, :]
    if offs is None:
        raise ValueError(f"_grouped_mm of a {a.dim()}-d and a {b.dim()}-d tensor needs offs")
    groups = _groups(offs)

    def biased(product, g):
        return product if bias is None else product + bias[g].to(dtype)

    if a.dim() == 2 and b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1])
        for g, (s, e) in enumerate(groups):
            out[s:e] = biased(torch.mm(a[s:e], b[g]), g)
        return out
    if a.dim() == 3 and b.dim() == 2:
        out = a.new_zeros(a.shape[1], b.shape[-1])
        for g, (s, e) in enumerate(groups):
            out[:, s:e] = biased(torch.mm(a[g], b[:, s:e]), g)
        return out
    if a.dim() == 2 and b.dim() == 2:
        out = a.new_zeros(len(groups), a.shape[0], b.shape[-1])
        for g, (s, e) in enumerate(groups):
            if e > s:
                out[g] = torch.mm(a[:, s:e], b[s:e])
        return out if bias is None else out + bias.to(dtype)[:, None, :]
    raise ValueError(f"_grouped_mm takes 2-d or 3-d tensors, got {a.dim()}-d and {b.dim()}-d")
