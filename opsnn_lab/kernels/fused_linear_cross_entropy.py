"""Cross-entropy over a chunk of logits, loss and logit gradient in one pass: Triton kernel and torch reference.

The vocabulary head's loss is computed chunk by chunk (``ops.linear_cross_entropy``): each chunk's fp32 logits
``(C, V)`` are turned in place into ``d loss / d logits`` scaled per row, so the full ``(N, V)`` logits and
their softmax never exist. Per row: ``lse = logsumexp(z)``, ``loss = (1 - eps) (lse - z_t) + eps (lse -
mean(z))`` (``eps`` = label smoothing, as ``F.cross_entropy``), 0 for ignored rows; gradient ``softmax(z) -
(1 - eps) onehot(t) - eps / V`` times the row scale. One program per row, no atomics: the row losses are
summed afterwards in a fixed order.

The head's logits ``l`` may be mapped before the loss, as some language models do: ``z = scale * l``
(Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``) or, with ``softcap``, ``z = softcap * tanh(scale * l
/ softcap)`` (Gemma 2's ``final_logit_softcapping``). The chunk then holds ``l``, the loss is of ``z`` and the
gradient written is ``d loss / d l``: ``d loss / d z`` times ``scale`` (folded into the row scale), or times
``scale (1 - tanh^2)`` with a cap, evaluated in fp32.
"""

from __future__ import annotations

import torch

from opsnn_lab.kernels._dispatch import backend_for

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

__all__ = ["cross_entropy_chunk", "cross_entropy_chunk_reference"]

_BLOCK_V = 4096  # vocabulary columns per loop step of the Triton kernel (the row is tiled, V is unbounded)


# --------------------------------------------------------------------------- torch reference
def _mapped(logits, scale, softcap, in_place, want_slope):
    """``(z, slope)``: the logits mapped (in place when ``in_place``, else a copy) and, with a cap and
    ``want_slope``, ``dz / dl = scale (1 - tanh^2)`` (C, V); a plain scale has no slope tensor (folded by the
    caller into the row scale)."""
    z = logits if in_place else logits.clone()
    if softcap is None:
        return z.mul_(scale), None
    t = z.mul_(scale / softcap).tanh_()
    # scale - scale t^2 in one pass (a 0-d tensor broadcast by addcmul)
    slope = torch.addcmul(t.new_tensor(scale), t, t, value=-scale) if want_slope else None
    return t.mul_(softcap), slope


def cross_entropy_chunk_reference(logits, target, ignore_index, smoothing, row_scale=None, *, scratch=False,
                                  scale=1.0, softcap=None):
    """Torch path: ``(loss, lse)`` per row, both (C,) fp32; with ``row_scale`` (C,) fp32 the logits (C, V)
    fp32 are overwritten by the scaled gradient (ignored rows must have scale 0); without it, by the
    probabilities when ``scratch`` (else they are left alone). ``scale`` / ``softcap``: the logit map (module
    docstring); ``lse`` is then of the mapped logits."""
    slope = None
    if softcap is not None or scale != 1.0:
        logits, slope = _mapped(logits, scale, softcap, row_scale is not None or scratch, row_scale is not None)
        if row_scale is not None and slope is None:
            row_scale = row_scale * scale
        scratch = True  # the mapped chunk is this function's own (or the caller's to overwrite)
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    picked = logits.gather(1, safe[:, None]).squeeze(1)
    zmean = logits.mean(-1) if smoothing else None
    if row_scale is None and not scratch:
        lse = torch.logsumexp(logits, dim=-1)  # a (C, V) temporary: the logits are the caller's
    else:  # in place, no (C, V) temporary: aten's row softmax does max, exp-sum and scale while a row is in
        # cache (3.1 ms for 256 x 32000 fp32 on one core, against 6.5 ms for amax, sub, exp, sum and mul)
        m = logits.amax(-1)
        grad = torch.ops.aten._softmax.out(logits, 1, False, out=logits)
        lse = m - grad.amax(-1).log()  # the largest probability is exp(0) / sum(exp(z - max))
    if row_scale is not None:
        grad.mul_(row_scale[:, None])
        if smoothing:
            grad.sub_((row_scale * (smoothing / logits.shape[1]))[:, None])
        grad.scatter_add_(1, safe[:, None], (row_scale * (smoothing - 1.0))[:, None])
        if slope is not None:
            grad.mul_(slope)
    loss = lse - picked
    if smoothing:
        loss = loss.mul_(1.0 - smoothing).add_(lse - zmean, alpha=smoothing)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    return loss, lse


# --------------------------------------------------------------------------- Triton kernel
if triton is not None:

    @triton.jit
    def _map_logits(z, SCALE, CAP, HAS_CAP: tl.constexpr):
        """``CAP tanh(SCALE z / CAP)`` with a cap, else ``SCALE z``."""
        if HAS_CAP:
            return CAP * (1.0 - 2.0 / (tl.exp(2.0 * (z * (SCALE / CAP))) + 1.0))  # tanh saturates cleanly at +-1
        else:
            return z * SCALE

    @triton.jit
    def _cross_entropy_chunk_kernel(
        LOGITS,  # pointer to the (C, V) fp32 logits, overwritten by the scaled gradient when WANT_GRAD
        TARGET,  # pointer to the (C,) int64 targets
        ROW_SCALE,  # pointer to the (C,) fp32 gradient scale per row (0 for ignored rows)
        LOSS,  # pointer to the (C,) fp32 row losses (output)
        LSE,  # pointer to the (C,) fp32 row logsumexp (output)
        V,  # vocabulary size
        IGNORE,  # ignore_index
        SMOOTH,  # label smoothing in [0, 1]
        SCALE,  # the logit map's scale (1.0: none)
        CAP,  # its softcap, read when HAS_CAP
        MAPPED: tl.constexpr,  # SCALE != 1 or a cap: map the logits first
        HAS_CAP: tl.constexpr,
        WANT_GRAD: tl.constexpr,  # write the gradient over the logits
        BLOCK_V: tl.constexpr,  # columns per loop step
    ):
        # Bytes per row: read V fp32 twice (online logsumexp, then gradient) and write V fp32: 12 V; the
        # logits chunk stays in cache on CPU-sized chunks, and the (N, V) tensor never exists.
        row = tl.program_id(0).to(tl.int64)
        base = LOGITS + row * V
        cols = tl.arange(0, BLOCK_V)
        m = tl.full([BLOCK_V], -1e30, tl.float32)  # finite start: exp(m_old - m_new) stays defined
        d = tl.full([BLOCK_V], 0.0, tl.float32)
        zsum = tl.full([BLOCK_V], 0.0, tl.float32)
        for start in range(0, V, BLOCK_V):
            mask = start + cols < V
            z = tl.load(base + start + cols, mask=mask, other=float("-inf"))
            if MAPPED:  # masked lanes stay -inf (a capped -inf would be -CAP)
                z = tl.where(mask, _map_logits(z, SCALE, CAP, HAS_CAP), float("-inf"))
            m_new = tl.maximum(m, z)
            d = d * tl.exp(m - m_new) + tl.exp(z - m_new)
            m = m_new
            zsum += tl.where(mask, z, 0.0)
        m_row = tl.max(m, axis=0)
        lse = m_row + tl.log(tl.sum(d * tl.exp(m - m_row), axis=0))
        t = tl.load(TARGET + row)
        valid = t != IGNORE
        z_t = tl.load(base + tl.where(valid, t, 0))
        if MAPPED:
            z_t = _map_logits(z_t, SCALE, CAP, HAS_CAP)
        loss = (1.0 - SMOOTH) * (lse - z_t) + SMOOTH * (lse - tl.sum(zsum, axis=0) / V)
        tl.store(LOSS + row, tl.where(valid, loss, 0.0))
        tl.store(LSE + row, lse)
        if WANT_GRAD:
            scale = tl.load(ROW_SCALE + row)
            for start in range(0, V, BLOCK_V):
                mask = start + cols < V
                z = tl.load(base + start + cols, mask=mask, other=0.0)
                if MAPPED:
                    z = _map_logits(z, SCALE, CAP, HAS_CAP)
                g = tl.exp(z - lse) - SMOOTH / V - tl.where(start + cols == t, 1.0 - SMOOTH, 0.0)
                if HAS_CAP:  # dz / dl = SCALE (1 - tanh^2), tanh = z / CAP
                    g = g * (SCALE * (1.0 - (z / CAP) * (z / CAP)))
                elif MAPPED:
                    g = g * SCALE
                tl.store(base + start + cols, g * scale, mask=mask)


def _chunk_triton(logits, target, ignore_index, smoothing, row_scale, scale, softcap):
    c, v = logits.shape
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(loss)
    if c:
        block = min(_BLOCK_V, triton.next_power_of_2(v))
        _cross_entropy_chunk_kernel[(c,)](
            logits, target, row_scale if row_scale is not None else loss, loss, lse, v, ignore_index,
            float(smoothing), float(scale), float(softcap or 1.0), MAPPED=softcap is not None or scale != 1.0,
            HAS_CAP=softcap is not None, WANT_GRAD=row_scale is not None, BLOCK_V=block,
            num_warps=8 if block >= 2048 else 4)
    return loss, lse


def cross_entropy_chunk(logits, target, ignore_index=-100, smoothing=0.0, row_scale=None, *, scratch=False,
                        scale=1.0, softcap=None):
    """Row losses and logsumexp of a logits chunk; with ``row_scale``, the scaled gradient in place.

    logits: (C, V) contiguous fp32, or float64 (torch path), overwritten when ``row_scale`` is given; without it,
    left alone unless ``scratch`` (a chunk nobody reads afterwards, which the CPU path then uses for its softmax
    instead of making a (C, V) temporary); target: (C,) int64 with values in [0, V) or ``ignore_index``;
    row_scale: (C,) in the logits' dtype, 0 on ignored rows; ``scale`` (finite, > 0) and ``softcap`` (None or > 0):
    the logit map of the module docstring, the gradient written then being the one w.r.t. the unmapped logits.
    Returns ``(loss, lse)``, (C,) each, in the logits' dtype.
    """
    if logits.dtype not in (torch.float32, torch.float64) or logits.dim() != 2 or not logits.is_contiguous():
        raise ValueError(f"logits must be a contiguous 2-D fp32 or float64 chunk, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    if logits.dtype == torch.float32 and backend_for(logits) == "triton":
        return _chunk_triton(logits, target.contiguous(), ignore_index, smoothing, row_scale, scale, softcap)
    return cross_entropy_chunk_reference(logits, target, ignore_index, smoothing, row_scale, scratch=scratch,
                                         scale=scale, softcap=softcap)
