"""Test helpers shared by opsnn_lab's own tests and usable in yours.

* ``seeded(shape, seed=...)`` -- inputs that depend only on the seed.
* ``TOLERANCES`` -- the per-dtype ``(atol, rtol)`` table every numerical test uses.
* ``assert_close_dtype`` -- compare with the dtype's tolerance.
* ``assert_within_eager_error`` -- the low-precision criterion: the fused result's error
  against an fp64 reference is at most ``factor`` x eager PyTorch's error in the same dtype.
* ``run_fwd_bwd`` -- forward + backward with a fixed upstream gradient, returns output and grads.
* ``threads(n)`` -- run a block with ``n`` intra-op threads (the count is restored after it).
* ``projected_loss(outputs)`` -- a fixed random projection of every output: no symmetry cancels it.
* ``eager_without_dropout(config)`` -- a Hugging Face config with every dropout 0 and eager attention, so a
  fused and an unfused model compare in train mode; ``eager_with_dropout(config, p)``: every dropout ``p`` (the two
  compare under ``ol.consistency.make_reproducible``).
* ``AroundRegion(block)`` -- a model fx cannot trace whole around ``block``, which is then the region the fusion
  rewrites with fx (the form for code only fx can fuse: inline adds, norms, attention).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from collections.abc import Callable, Sequence

import torch
from torch import nn

from opsnn_lab.consistency.gemm_probe import threads  # re-exported: the thread-count context strict mode uses

__all__ = [
    "TOLERANCES",
    "DTYPES",
    "seeded",
    "tolerance",
    "assert_close_dtype",
    "assert_within_eager_error",
    "run_fwd_bwd",
    "non_contiguous",
    "triton_interpreter_ready",
    "reloaded",
    "threads",
    "projected_loss",
    "eager_without_dropout",
    "eager_with_dropout",
    "AroundRegion",
]

# (atol, rtol) per dtype. fp32: 1e-5 relative is what the fused ops promise against eager.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}
DTYPES = list(TOLERANCES)


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCES[dtype]


def seeded(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu",
           scale: float = 1.0, requires_grad: bool = False) -> torch.Tensor:
    """A normal tensor that depends only on ``seed`` (drawn in fp32 on CPU, then moved)."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` in a non-contiguous layout (every other column of a wider buffer)."""
    wide = torch.empty(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t.detach())
    assert not view.is_contiguous() or t.shape[-1] <= 1
    return view.requires_grad_(t.requires_grad)


def assert_close_dtype(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                       msg: str = "") -> None:
    atol, rtol = TOLERANCES[dtype or expected.dtype]
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=rtol, msg=msg or None)


def _max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - ref.double()).abs().max().item()


def assert_within_eager_error(fused: torch.Tensor, eager: torch.Tensor, ref64: torch.Tensor,
                              factor: float = 2.0, floor: float | None = None, name: str = "output") -> None:
    """Low-precision criterion: ``|fused - ref64| <= factor * |eager - ref64| + floor`` (max norms).

    ``floor`` defaults to one ulp of the dtype at the reference's magnitude, so a case where eager
    happens to be exact does not demand exactness from the fused op.
    """
    fused_err, eager_err = _max_err(fused, ref64), _max_err(eager, ref64)
    if floor is None:
        eps = torch.finfo(fused.dtype).eps
        floor = eps * (ref64.abs().max().item() if ref64.numel() else 0.0)
    assert fused_err <= factor * eager_err + floor, (
        f"{name}: fused error {fused_err:.3e} > {factor} x eager error {eager_err:.3e} (+ floor {floor:.1e})")


def run_fwd_bwd(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor] = (),
                grad_seed: int = 123) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Run ``fn(*inputs)``, backpropagate a seeded upstream gradient, return (output, grads).

    Grads are returned for every input that requires grad, then every param, in order.
    """
    out = fn(*inputs)
    grad_out = seeded(*out.shape, seed=grad_seed, dtype=out.dtype, device=out.device)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad] + list(params)
    for t in leaves:
        t.grad = None
    out.backward(grad_out)
    return out.detach(), [None if t.grad is None else t.grad.detach().clone() for t in leaves]


def projected_loss(outputs: Sequence[torch.Tensor], seed: int = 1) -> torch.Tensor:
    """``sum(t * r_t)`` over ``outputs``, each ``r_t`` a fixed random tensor of ``t``'s shape and dtype: a loss whose
    gradient reaches every output element (a plain sum of BatchNorm outputs is 0 by symmetry)."""
    g = torch.Generator().manual_seed(seed)
    return sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype).to(t.device)).sum() for t in outputs)


def eager_without_dropout(config):
    """``config`` (a Hugging Face ``PretrainedConfig``), changed in place and returned: every dropout probability
    (float, or one per stage in a list) 0, in its sub-configs too, and eager attention (the softmax written out,
    so the attention chain is visible to ``ol.fusion``)."""
    return eager_with_dropout(config, 0.0)


def eager_with_dropout(config, p: float):
    """``eager_without_dropout`` with every dropout and drop-path probability ``p`` instead (a layer drop stays 0:
    it skips whole layers, and a tiny model has two): the inline ``F.dropout`` calls, attention dropouts and
    stochastic depths a config controls all draw, as in training."""
    for k, v in list(vars(config).items()):
        rate = 0.0 if "layerdrop" in k.lower() else p
        if "drop" in k.lower() and isinstance(v, float):
            setattr(config, k, rate)
        elif "drop" in k.lower() and isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
            setattr(config, k, [rate] * len(v))
        elif hasattr(v, "to_dict") and hasattr(v, "model_type"):
            eager_with_dropout(v, p)
    config._attn_implementation = "eager"
    return config


def triton_interpreter_ready() -> bool:
    """True when triton's interpreter can run opsnn_lab's kernels on this CPU.

    Triton picks interpreter or compiler when first imported (``tests/conftest.py`` sets
    ``TRITON_INTERPRET=1`` before that). If triton was imported earlier anyway, its jit'd standard
    library (``tl.sum``, ``tl.zeros``) was built for the compiler; rebuilding those two modules under
    the interpreter fixes that for the rest of the process.
    """
    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton.language as tl

    if type(tl.sum).__name__ != "InterpretedFunction":
        importlib.reload(tl.standard)
        importlib.reload(tl)
    return type(tl.sum).__name__ == "InterpretedFunction"


@contextlib.contextmanager
def reloaded(*modules, **env: str):
    """Set ``env`` and reload ``modules`` in that order (a kernel module picks its backend at import); yields the
    last one. Afterwards the variables and every module's namespace are exactly as before: the original classes
    and functions, not copies made by reloading again, so objects made before (a fused model, which pickles by
    class) still match their module's names."""
    saved_env = {k: os.environ.get(k) for k in env}
    saved = [(m, dict(m.__dict__)) for m in modules]
    try:
        os.environ.update(env)
        for m in modules:
            importlib.reload(m)
        yield modules[-1] if modules else None
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for m, namespace in saved:
            m.__dict__.clear()
            m.__dict__.update(namespace)


class AroundRegion(nn.Module):
    """``block(x, ...)`` behind a branch on ``x``'s values, which fx cannot trace: the analysis then traces
    ``block`` (registered as ``self.block``) as a region of its own."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x, *args, **kwargs):
        if x.sum() > 1e9:  # data-dependent
            x = x * 0.5
        return self.block(x, *args, **kwargs)
