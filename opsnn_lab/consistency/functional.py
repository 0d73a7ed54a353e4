"""The randomness a model's ``forward`` draws through torch functions, keyed by (module, call index, step).

``make_reproducible`` installs ``FunctionalRandomness`` (a ``TorchFunctionMode``) for each training forward
(and for a checkpoint's recomputation of a module, see ``seed_pool``). Inside it:

* ``F.dropout`` / ``torch.dropout`` draw the counter mask of ``"<module path>:dropout.<i>"`` (the mask of
  ``ops.Dropout``: the same on CPU and GPU);
* ``F.dropout1d/2d/3d`` draw a counter mask over (batch, channel) with that key, zeroing whole channels;
* ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` (Hugging Face's default attention) runs
  ``ops.attention.counter_sdpa`` with that key;
* every other random torch function (``torch.rand``/``randn``/``randint``/``bernoulli``/``multinomial``,
  ``rand_like``..., ``Tensor.bernoulli_``/``uniform_``/``normal_``..., which is how stochastic depth /
  drop path is written) draws from a ``torch.Generator`` seeded with ``"<module path>:random.<i>"``. That
  is reproducible on one device type; CPU and CUDA generators differ, as torch's do. A call that passes
  its own ``generator=`` is left alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["FunctionalRandomness"]

_DROPOUTS = {F.dropout, torch.dropout} | ({torch.Tensor.dropout} if hasattr(torch.Tensor, "dropout") else set())
_CHANNEL_DROPOUTS = {F.dropout1d: 1, F.dropout2d: 2, F.dropout3d: 3}  # -> spatial dims of a batched input
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# random functions that take ``generator=``; the first tensor argument (if any) gives the device
_SAMPLERS = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.bernoulli, torch.multinomial,
             torch.normal, torch.poisson, torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_,
             torch.Tensor.exponential_, torch.Tensor.random_, torch.Tensor.geometric_, torch.Tensor.log_normal_,
             torch.Tensor.cauchy_, torch.Tensor.bernoulli}
_LIKE = {torch.rand_like: torch.rand, torch.randn_like: torch.randn}  # no generator=: drawn as the factory


def _dropout_args(func, args, kwargs):
    """``(input, p, training)`` of an ``F.dropout`` / ``torch.dropout`` call."""
    names = ("input", "p", "training", "inplace") if func is F.dropout else ("input", "p", "train")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound.get("input"), float(bound.get("p", 0.5)), bool(bound.get("training", bound.get("train", True)))


def _device(args, kwargs) -> torch.device:
    t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if t is not None:
        return t.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.get_default_device()


class FunctionalRandomness(TorchFunctionMode):
    """Routes a forward's random torch calls to streams keyed by calling module + call index + step."""

    def __init__(self, state):
        super().__init__()
        self.state = state  # seed_pool._ReproducibleState: functional_seed(kind) names the stream

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            return self._dropout(func, args, kwargs)
        if func in _CHANNEL_DROPOUTS:
            return self._channel_dropout(func, args, kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(args, kwargs)
        if (func in _SAMPLERS or func in _LIKE) and kwargs.get("generator") is None:
            return self._sample(func, args, kwargs)
        return func(*args, **kwargs)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = torch.Generator(device=device)
        gen.manual_seed(self.state.functional_seed("random"))
        return gen

    def _sample(self, func, args, kwargs):
        if func in _LIKE:
            x = args[0]
            dtype, device = kwargs.get("dtype") or x.dtype, kwargs.get("device") or x.device
            return _LIKE[func](x.shape, generator=self._generator(torch.device(device)), dtype=dtype, device=device)
        return func(*args, **kwargs, generator=self._generator(_device(args, kwargs)))

    def _dropout(self, func, args, kwargs):
        x, p, training = _dropout_args(func, args, kwargs)
        if not training or not isinstance(x, torch.Tensor):
            return func(*args, **kwargs)
        from opsnn_lab.ops.dropout import DropoutFunction

        seed = self.state.functional_seed()
        if p == 0.0:
            return x
        out = DropoutFunction.apply(x, p, seed, 0)
        inplace = kwargs.get("inplace", args[3] if func is F.dropout and len(args) > 3 else False)
        return x.copy_(out) if inplace else out  # the Function saves nothing, so x may be overwritten

    def _channel_dropout(self, func, args, kwargs):
        bound = dict(zip(("input", "p", "training", "inplace"), args))
        bound.update(kwargs)
        x, p = bound["input"], float(bound.get("p", 0.5))
        if not bound.get("training", True) or not isinstance(x, torch.Tensor):
            return func(*args, **kwargs)
        from opsnn_lab.kernels import rng

        seed = self.state.functional_seed()
        if p == 0.0:
            return x
        lead = 2 if x.dim() == _CHANNEL_DROPOUTS[func] + 2 else 1  # batched: (N, C, ...); else (C, ...)
        keep = rng.dropout_mask(seed, 0, x.shape[:lead], p, x.device, dtype=x.dtype)
        out = x * keep.view(*x.shape[:lead], *([1] * (x.dim() - lead))) * (0.0 if p >= 1 else 1.0 / (1.0 - p))
        return x.copy_(out) if bound.get("inplace", False) else out

    def _attention(self, args, kwargs):
        """SDPA with dropout: the same result with the counter mask of ``"<module path>:dropout.<i>"``,
        since SDPA's own dropout draws from torch's generator."""
        bound = dict(zip(_SDPA_ARGS, args))
        bound.update(kwargs)
        if float(bound.get("dropout_p", 0.0)) == 0.0:
            return F.scaled_dot_product_attention(*args, **kwargs)
        from opsnn_lab.ops.attention import counter_sdpa

        return counter_sdpa(**bound, seed=self.state.functional_seed())
