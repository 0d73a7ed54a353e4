"""Fixed-reduction-order implementations of the ATen ops that ``strict()`` replaces.

Why each op is here (measured bitwise on the CPU build this package is tested on, MKL + AVX-512, and
under ``ATEN_CPU_CAPABILITY=avx2``/``default``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``, ``ONEDNN_MAX_CPU_ISA=AVX2``):

* ``mm``/``addmm``: MKL picks its GEMM kernel from the problem shape and the operands' layouts, so
  row 0 of ``x @ W.T`` has different bits for 1-7 rows than for 8+, and a gradient that arrives
  transposed for one batch size and row-major for another changes bits too. Here the rows are zero
  padded to whole ``ROW_BLOCK`` s and the reference path runs one GEMM of exactly ``ROW_BLOCK`` rows per
  block, row-major, with one thread; a reduction longer than ``K_BLOCK`` is cut into fixed blocks summed
  left to right. Faster paths (one GEMM over all the padded rows; a packed column-major left operand
  kept uncopied; the running thread count) are used for a GEMM shape only where
  :mod:`opsnn_lab.consistency.gemm_probe` found, on this machine, that they give the reference's bits:
  MKL on AVX-512 does for every shape the tests meet; MKL restricted to AVX2 splits rows over threads
  into 6-row panels whose remainder rows take another kernel, and falls back to the reference at 2
  threads.
* ``bmm``: each matrix of a batch is one fixed-shape GEMM, but ``matmul`` hands it views whose
  layout depends on the batch size (``(B, H, T, d) -> (B*H, T, d)`` is a view for B = 1, a copy for
  B > 1), so the reference path packs both operands row-major and runs with one thread; keeping packed
  column-major operands, and the running thread count, are probed the same way; plus the K blocking.
* ``sum``/``mean``: a full reduction over more than 32768 elements is split across threads by
  TensorIterator (two-pass reduction), so its bits depend on ``torch.set_num_threads``. Here the
  reduced axes go last and are summed in fixed blocks of ``SUM_BLOCK`` (each block by one thread),
  then the block sums the same way, recursively.
* the softmax backward, the layer_norm backward and weight norm: row formulas over ``fixed_sum``, in
  :mod:`opsnn_lab.consistency.fixed_rows`.
* ``gelu``/``gelu_backward``: the vectorised loop and its scalar tail use different erf
  approximations (27 of 100 elements differ), and where the tail falls depends on the tensor size and
  on how threads split it; the input is padded so every element takes the vectorised path.

Forward softmax/log_softmax, the log_softmax backward and the layer_norm forward are row-local with a
per-row order fixed by the row length on this build, so the native kernels are kept
(``tests/consistency/test_strict.py`` checks each bitwise across batch sizes and thread counts).
Each function calls only ``out=`` overloads of the ops it replaces, which are not overridden.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from opsnn_lab.consistency import gemm_probe as gp

__all__ = [
    "ROW_BLOCK",
    "K_BLOCK",
    "SUM_BLOCK",
    "fixed_mm",
    "fixed_addmm",
    "fixed_bmm",
    "fixed_sum",
    "fixed_sum_default",
    "fixed_mean",
    "fixed_mean_default",
    "gelu",
    "gelu_backward",
]

ROW_BLOCK = 64  # rows per GEMM: >= 8 keeps MKL on its blocked kernel; 64 costs nothing against one big GEMM
K_BLOCK = 4096  # longest reduction one GEMM performs; longer ones are blocked and summed in order
CHUNKED_GEMM = False  # True: skip the one-GEMM candidates (one batched call of fixed-shape GEMMs first)
SUM_BLOCK = 4096  # longest row one sum reduces; far below TensorIterator's 32768-element parallel grain
_ELEMENTWISE_ALIGN = 64  # pad elementwise ops to whole AVX-512 double-vectors (2 x 16 fp32) per thread


def _pad_rows(a: torch.Tensor, rows: int) -> torch.Tensor:
    """Row-major ``a`` (M, K) zero padded to ``rows`` rows."""
    m, k = a.shape
    if rows == m:
        return a
    buf = a.new_zeros(rows, k)
    buf[:m].copy_(a)
    return buf


def _rows_layout(a: torch.Tensor) -> torch.Tensor:
    """The left operand as packed row-major matrices, whatever layout it arrived in.

    MKL picks its kernel from the operands' layouts, and the layout of an activation can depend on
    the batch size (``(B, H, T, d) -> (B*H, T, d)`` is a view for B = 1 and a copy for B > 1; the
    gradient reaching ``mm`` is transposed for 8 rows and not for 512), so it is fixed here.
    """
    if a.stride(-1) == 1 and (a.stride(-2) == a.shape[-1] or a.shape[-2] == 1):
        return a
    return a.contiguous()


def _is_column_major(a: torch.Tensor) -> bool:
    return a.dim() == 2 and a.stride(-2) == 1 and a.stride(-1) == a.shape[-2] and a.shape[-1] > 1


def _cols_layout(b: torch.Tensor) -> torch.Tensor:
    """The right operand of ``mm`` packed, keeping its orientation.

    In ``linear`` it is the weight (transposed in the forward, plain in the input gradient), whose
    orientation is fixed by the call site, so it is not copied into a canonical one.
    """
    rows, cols = b.shape[-2], b.shape[-1]
    if b.stride(-1) == 1 and (b.stride(-2) == cols or rows == 1):
        return b
    if b.stride(-2) == 1 and (b.stride(-1) == rows or cols == 1):
        return b
    if b.stride(-2) == 1:  # column-major with a stride gap: pack it column-major
        return b.transpose(-1, -2).contiguous().transpose(-1, -2)
    return b.contiguous()


def _full_bias(bias: torch.Tensor, m: int, rows: int, n: int) -> torch.Tensor:
    if bias.dim() == 2 and bias.shape[0] == m and m not in (1, rows):  # a full (M, N) bias
        bias = _pad_rows(bias.contiguous(), rows)
    return bias.expand(rows, n)


def _mm_path(path: str, a, b, bias, beta, alpha, m: int, rows: int) -> torch.Tensor:
    """``beta * bias + alpha * (a @ b)`` along one path (see :mod:`gemm_probe`), rows padded to ``rows``.

    ``one``: one GEMM over the padded rows, a packed column-major ``a`` kept as it is; ``one-copy``:
    the same with ``a`` copied row-major; ``chunked``: one batched call of GEMMs of exactly ROW_BLOCK
    rows; ``reference``: one GEMM of ROW_BLOCK rows per block, each run with one thread.
    """
    n = b.shape[1]
    if not (path == "one" and rows == m and _is_column_major(a)):
        a = _pad_rows(_rows_layout(a), rows)
    b = _cols_layout(b)
    if path in ("one", "one-copy"):
        out = a.new_empty(rows, n)
        if bias is None:
            return torch.mm(a, b, out=out)[:m]
        return torch.addmm(_full_bias(bias, m, rows, n), a, b, beta=beta, alpha=alpha, out=out)[:m]
    chunks = rows // ROW_BLOCK
    if path == "reference":
        out = a.new_empty(rows, n)
        full = None if bias is None else _full_bias(bias, m, rows, n)
        with gp.one_thread():
            for s in range(0, rows, ROW_BLOCK):
                if full is None:
                    torch.mm(a[s:s + ROW_BLOCK], b, out=out[s:s + ROW_BLOCK])
                else:
                    torch.addmm(full[s:s + ROW_BLOCK], a[s:s + ROW_BLOCK], b, beta=beta, alpha=alpha,
                                out=out[s:s + ROW_BLOCK])
        return out[:m]
    out = a.new_empty(chunks, ROW_BLOCK, n)
    torch.bmm(a.unflatten(0, (chunks, ROW_BLOCK)), b.unsqueeze(0).expand(chunks, *b.shape), out=out)
    out = out.view(rows, n)[:m]
    if bias is None:
        return out
    if alpha != 1:
        out = out.mul_(alpha)
    return out if beta == 0 else out.add_(bias if beta == 1 else bias * beta)


def _layout(x: torch.Tensor) -> str:
    return "col" if x.stride(-2) == 1 and x.stride(-1) == x.shape[-2] and x.shape[-1] > 1 else "row"


def _mm_rows(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, beta=1, alpha=1) -> torch.Tensor:
    """``beta * bias + alpha * (a @ b)`` for (M, K) @ (K, N), M zero padded to whole ROW_BLOCKs.

    Padding matters: MKL runs fewer than 8 rows through other kernels than 8 or more. The path is
    the fastest one that gave the reference path's bits for this GEMM on this machine (probed once,
    :mod:`opsnn_lab.consistency.gemm_probe`): on MKL with AVX-512 one GEMM over the padded rows with
    a column-major ``a`` uncopied; on MKL restricted to AVX2 at 2 threads, the one-thread reference.
    """
    m, k = a.shape
    n = b.shape[1]
    rows = -(-m // ROW_BLOCK) * ROW_BLOCK
    a_col = rows == m and _is_column_major(a)
    b = _cols_layout(b)
    b_layout = _layout(b)
    bias_shape = None if bias is None else tuple(bias.shape)
    key = ("mm", a.dtype, "col" if a_col else "row", b_layout, bias_shape, beta, alpha, m, k, n,
           torch.get_num_threads(), ROW_BLOCK, CHUNKED_GEMM, a.device.type)
    path = gp._CACHE.get(key)
    if path is None:
        candidates = ["chunked"] if CHUNKED_GEMM else (["one"] if a_col else []) + ["one-copy", "chunked"]
        gen = gp.generator()
        pa = gp.random_like_layout((m, k), "col" if a_col else "row", a, gen)
        pb = gp.random_like_layout((k, n), b_layout, b, gen)
        pbias = None if bias is None else gp.random_like_layout(tuple(bias.shape), "row", bias, gen)

        def run(p, x=pa):
            return _mm_path(p, x, pb, pbias, beta, alpha, m, rows)

        def row_local(want):  # the reference's rows of a block, reversed, come back reversed
            if bias is not None and bias.dim() == 2 and bias.shape[0] == m and m > 1:
                return None  # a bias row per row: reversing the rows of ``a`` alone proves nothing
            head = min(m, ROW_BLOCK)
            flipped = pa.clone(memory_format=torch.contiguous_format)
            flipped[:head] = flipped[:head].flip(0)
            return torch.equal(run("reference", flipped)[:head].flip(0), want[:head])

        path = gp.choose(key, candidates, "reference", run, row_local)
    return _mm_path(path, a, b, bias, beta, alpha, m, rows)


def fixed_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` whose row i depends only on ``a[i]`` and ``b``, and not on the thread count."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        return a.new_zeros(m, n)
    if k <= K_BLOCK:
        return _mm_rows(a, b)
    out = None
    for start in range(0, k, K_BLOCK):  # fixed K blocks, accumulated left to right
        part = _mm_rows(a[:, start:start + K_BLOCK], b[start:start + K_BLOCK])
        out = part.clone() if out is None else out.add_(part)
    return out


def fixed_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k > K_BLOCK or k == 0:
        prod = fixed_mm(a, b)
        if alpha != 1:
            prod = prod.mul_(alpha)
        return prod.contiguous() if beta == 0 else torch.add(prod, bias if beta == 1 else bias * beta)
    if beta == 0:
        bias = bias.new_zeros(())  # addmm ignores bias values when beta is 0, NaN included
    return _mm_rows(a, b, bias, beta, alpha)


def _bmm_tag(x: torch.Tensor) -> str:
    """``row``/``col``: packed row- or column-major matrices (kept by the ``keep`` path); else ``other``."""
    rows, cols = x.shape[-2], x.shape[-1]
    if x.stride(0) == rows * cols or x.shape[0] == 1:
        if x.stride(-1) == 1 and x.stride(-2) == cols:
            return "row"
        if x.stride(-2) == 1 and x.stride(-1) == rows:
            return "col"
    return "other"


def _bmm_path(path: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``keep``: packed column-major operands uncopied; ``copy``: both row-major; ``reference``: ``copy``
    with one thread. A reduction longer than K_BLOCK is summed over fixed K blocks, left to right."""
    if path == "keep":
        a = a if _bmm_tag(a) != "other" else a.contiguous()
        b = b if _bmm_tag(b) != "other" else b.contiguous()
    else:
        a, b = _rows_layout(a), _rows_layout(b)
    bsz, m, k = a.shape
    out = a.new_empty(bsz, m, b.shape[2])
    with gp.one_thread() if path == "reference" else nullcontext():
        if k <= K_BLOCK or out.numel() == 0:
            return torch.bmm(a, b, out=out)
        part = torch.empty_like(out)
        torch.bmm(a[..., :K_BLOCK], b[:, :K_BLOCK], out=out)
        for start in range(K_BLOCK, k, K_BLOCK):
            torch.bmm(a[..., start:start + K_BLOCK], b[:, start:start + K_BLOCK], out=part)
            out.add_(part)
    return out


def fixed_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm`` whose matrices' bits depend neither on the batch size nor on the thread count.

    Both operands are activations whose orientation can depend on the batch size (matmul's reshape of
    a transposed (B, H, d, T) view is a transposed view for B = 1, a row-major copy for B > 1), so the
    reference path makes both row-major; packed column-major operands are kept where the probe
    (:mod:`opsnn_lab.consistency.gemm_probe`) found that gives the same bits.
    """
    bsz, m, k = a.shape
    n = b.shape[2]
    ta, tb = _bmm_tag(a), _bmm_tag(b)
    key = ("bmm", a.dtype, ta, tb, bsz, m, k, n, torch.get_num_threads(), K_BLOCK, a.device.type)
    path = gp._CACHE.get(key)
    if path is None:
        if bsz == 0 or m == 0 or n == 0:
            return a.new_zeros(bsz, m, n)
        candidates = (["keep"] if "col" in (ta, tb) else []) + ["copy"]
        gen = gp.generator()
        pa = gp.random_like_layout((bsz, m, k), ta, a, gen)
        pb = gp.random_like_layout((bsz, k, n), tb, b, gen)

        def run(p):
            return _bmm_path(p, pa, pb)

        def batch_local(want):  # the first and last matrices alone give their rows of the whole batch
            return all(torch.equal(_bmm_path("reference", pa[i:i + 1], pb[i:i + 1])[0], want[i])
                       for i in {0, bsz - 1})

        path = gp.choose(key, candidates, "reference", run, batch_local)
    return _bmm_path(path, a, b)


# --------------------------------------------------------------------------- reductions
def _reduce_dims(x: torch.Tensor, dim) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % max(x.dim(), 1) for d in dims}) if x.dim() else []


def _row_sum(rows: torch.Tensor) -> torch.Tensor:
    """Sum each row of ``rows`` (outer, L): fixed blocks of SUM_BLOCK, each summed by one thread."""
    while rows.shape[1] > SUM_BLOCK:
        outer, length = rows.shape
        blocks = -(-length // SUM_BLOCK)
        if blocks * SUM_BLOCK != length:
            rows = torch.nn.functional.pad(rows, (0, blocks * SUM_BLOCK - length))
        partial = rows.new_empty(outer, blocks)
        torch.sum(rows.view(outer, blocks, SUM_BLOCK), -1, out=partial)
        rows = partial
    out = rows.new_empty(rows.shape[0])
    return torch.sum(rows, -1, out=out)


def fixed_sum(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
    """``x.sum(dim)`` with a summation order fixed by the shape alone."""
    if dtype is not None:
        x = x.to(dtype)
    elif not (x.is_floating_point() or x.is_complex()):
        x = x.to(torch.int64)  # integer and bool sums promote to int64, as ATen does
    if x.dim() == 0:  # a scalar is its own sum (a 0-d tensor has no dims to permute)
        return x.clone()
    red = _reduce_dims(x, dim)
    keep = [d for d in range(x.dim()) if d not in red]
    out_shape = [x.shape[d] for d in keep]
    outer = math.prod(out_shape)
    length = math.prod(x.shape[d] for d in red)
    if (red == list(range(len(red))) and x.is_floating_point() and x.is_contiguous()
            and 0 < length <= SUM_BLOCK and outer > 1):
        # Leading axes of a contiguous tensor (bias gradients): the native column sum adds each column
        # top to bottom and splits threads over columns only, so no transposing copy is needed.
        result = torch.sum(x.view(length, outer), 0, out=x.new_empty(outer)).view(out_shape)
        for d in red if keepdim else ():
            result = result.unsqueeze(d)
        return result
    rows = x.permute(*keep, *red).reshape(outer, length)
    if length == 0:
        result = x.new_zeros(outer)
    elif not x.is_floating_point():
        result = torch.sum(rows, -1, out=rows.new_empty(outer))  # integer sums are exact in any order
    else:
        result = _row_sum(rows)
    result = result.view(out_shape)
    if keepdim:
        for d in red:
            result = result.unsqueeze(d)
    return result


def fixed_sum_default(x: torch.Tensor, *, dtype=None) -> torch.Tensor:
    return fixed_sum(x, None, False, dtype=dtype)


def fixed_mean(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
    # ATen's CPU mean is sum / n as well; the division is exact-order elementwise.
    total = fixed_sum(x, dim, keepdim, dtype=dtype)
    count = math.prod(x.shape[d] for d in _reduce_dims(x, dim)) if x.dim() else 1
    return total.div_(count) if count else total.fill_(float("nan"))


def fixed_mean_default(x: torch.Tensor, *, dtype=None) -> torch.Tensor:
    return fixed_mean(x, None, False, dtype=dtype)


# --------------------------------------------------------------------------- elementwise
def _padded_elementwise(op, *tensors: torch.Tensor, **kwargs) -> torch.Tensor:
    """Apply an elementwise ``op`` (an ``out=`` overload) so every element takes the vector path.

    The flat input is padded so that each thread's share is a whole number of vector pairs; lanes
    are independent, so an element's bits no longer depend on the size of the tensor it is in.
    """
    shape = tensors[0].shape
    n = tensors[0].numel()
    align = _ELEMENTWISE_ALIGN * max(torch.get_num_threads(), 1)
    padded = -(-n // align) * align
    flat = []
    for t in tensors:
        f = t.reshape(-1)
        if padded != n:
            f = torch.nn.functional.pad(f, (0, padded - n))
        flat.append(f.contiguous())
    out = flat[0].new_empty(padded)
    op(*flat, **kwargs, out=out)
    return out[:n].view(shape)


def gelu(x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    return _padded_elementwise(torch.ops.aten.gelu.out, x, approximate=approximate)


def gelu_backward(grad: torch.Tensor, x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    grad, x = torch.broadcast_tensors(grad, x)
    return _padded_elementwise(lambda g, v, out, approximate: torch.ops.aten.gelu_backward.grad_input(
        g, v, approximate=approximate, grad_input=out), grad, x, approximate=approximate)
