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

Under a checkpoint's recomputation (``replay=True``) each call takes the seed its forward counterpart took,
looked up by ``position()``. ``GlobalGenerators`` seeds torch's default generators for the forward's
remaining draws (composite functions, C++ ops) and reports Python/numpy draws.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from opsnn_lab._opaque import opaque_to_compile
from opsnn_lab._randomness import CHANNEL_DROPOUTS, DROPOUTS, LIKE, SAMPLERS
from opsnn_lab.ops.attention import SDPA_ARGS

__all__ = ["FunctionalRandomness"]

_KINDS_DROPOUT = "dropout"


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
    """Routes a forward's random torch calls to streams keyed by calling module + call index + step.

    ``replay=True``: a checkpoint recomputing part of the last forward inside the backward; each call takes
    the seed its forward counterpart took (``state.replay_seed``), found by its position in torch's global
    generator, which the checkpoint restored."""

    keys_random_calls = True  # how opsnn_lab._randomness finds the running forward's mode

    def __init__(self, state, replay: bool = False):
        super().__init__()
        self.state = state  # seed_pool._ReproducibleState: functional_seed(kind) names the stream
        self.replay = replay

    def seed_at(self, path: str, kind: str) -> int | None:
        """The seed of the next ``kind`` call of the module at ``path`` (``"<root>"``: the model): a fused op
        drawing in place of the call it absorbed (``_randomness.functional_seed``)."""
        return self._seed(kind, path)

    def enter(self, path: str) -> None:
        """A region's fx code is about to make a random call inline for its submodule at ``path`` (from the
        region): the call is keyed by that submodule, as its own call would be (``_randomness.enter_module``)."""
        self.state.enter_inlined(path)

    def exit(self) -> None:
        self.state.pop()

    def snapshot(self):
        """A function that puts the forward's call counts, module stack and draw log back where they stand now
        (``_randomness.draw_state``: the calls a region made before its guard missed are made again)."""
        local = self.state.local
        saved = (dict(local.calls), None if local.stack is None else list(local.stack), dict(local.log))

        def put_back() -> None:
            local.calls, stack, log = dict(saved[0]), saved[1], saved[2]
            local.stack = None if stack is None else list(stack)
            local.log.clear()
            local.log.update(log)

        return put_back

    def _seed(self, kind: str, path: str | None = None) -> int | None:
        if not self.replay:
            return self.state.functional_seed(kind, path)
        seed = self.state.replay_seed()
        if seed is None and kind == _KINDS_DROPOUT:
            raise RuntimeError(
                "make_reproducible: a checkpoint recomputed a dropout that none of the last forwards drew at this "
                "point of torch's generator stream; recompute with the forward's RNG state (torch.utils.checkpoint's "
                "default preserve_rng_state=True), or checkpoint module calls")
        return seed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in DROPOUTS:
            return self._dropout(func, args, kwargs)
        if func in CHANNEL_DROPOUTS:
            return self._channel_dropout(func, args, kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(args, kwargs)
        if (func in SAMPLERS or func in LIKE) and kwargs.get("generator") is None:
            return self._sample(func, args, kwargs)
        return func(*args, **kwargs)

    @opaque_to_compile  # its seed is keyed in Python: traced, every step would compile anew
    def _sample(self, func, args, kwargs):
        seed = self._seed("random")
        kwargs = {k: v for k, v in kwargs.items() if k != "generator"}  # an explicit generator=None
        if seed is None:  # a replay that matches no draw of the forward: as torch would
            return func(*args, **kwargs)
        if func in LIKE:
            x, rest = args[0], args[1:]
            dtype, device = kwargs.get("dtype") or x.dtype, torch.device(kwargs.get("device") or x.device)
            gen = torch.Generator(device=device).manual_seed(seed)
            if func is torch.randint_like:  # (input, high) or (input, low, high)
                low, high = (0, rest[0]) if len(rest) == 1 else rest[:2]
                low, high = kwargs.get("low", low), kwargs.get("high", high)
                return torch.randint(low, high, x.shape, generator=gen, dtype=dtype, device=device)
            return LIKE[func](x.shape, generator=gen, dtype=dtype, device=device)
        device = _device(args, kwargs)
        return func(*args, **kwargs, generator=torch.Generator(device=device).manual_seed(seed))

    @opaque_to_compile  # its seed is keyed in Python: traced, every step would compile anew
    def _dropout(self, func, args, kwargs):
        x, p, training = _dropout_args(func, args, kwargs)
        if not training or not isinstance(x, torch.Tensor):
            return func(*args, **kwargs)
        from opsnn_lab.ops.dropout import DropoutFunction

        seed = self._seed(_KINDS_DROPOUT)
        if p == 0.0:
            return x
        out = DropoutFunction.apply(x, p, seed, 0)
        inplace = kwargs.get("inplace", args[3] if func is F.dropout and len(args) > 3 else False)
        return x.copy_(out) if inplace else out  # the Function saves nothing, so x may be overwritten

    @opaque_to_compile  # its seed is keyed in Python: traced, every step would compile anew
    def _channel_dropout(self, func, args, kwargs):
        bound = dict(zip(("input", "p", "training", "inplace"), args))
        bound.update(kwargs)
        x, p = bound["input"], float(bound.get("p", 0.5))
        if not bound.get("training", True) or not isinstance(x, torch.Tensor):
            return func(*args, **kwargs)
        from opsnn_lab.kernels import rng

        seed = self._seed(_KINDS_DROPOUT)
        if p == 0.0:
            return x
        lead = 2 if x.dim() == CHANNEL_DROPOUTS[func] + 2 else 1  # batched: (N, C, ...); else (C, ...)
        keep = rng.dropout_mask(seed, 0, x.shape[:lead], p, x.device, dtype=x.dtype)
        out = x * keep.view(*x.shape[:lead], *([1] * (x.dim() - lead))) * (0.0 if p >= 1 else 1.0 / (1.0 - p))
        return x.copy_(out) if bound.get("inplace", False) else out

    @opaque_to_compile  # its seed is keyed in Python: traced, every step would compile anew
    def _attention(self, args, kwargs):
        """SDPA with dropout: the same result with the counter mask of ``"<module path>:dropout.<i>"``,
        since SDPA's own dropout draws from torch's generator."""
        bound = dict(zip(SDPA_ARGS, args))
        bound.update(kwargs)
        if float(bound.get("dropout_p", 0.0)) == 0.0:
            return F.scaled_dot_product_attention(*args, **kwargs)
        from opsnn_lab.ops.attention import counter_sdpa

        return counter_sdpa(**bound, seed=self._seed(_KINDS_DROPOUT))


def position(generator: torch.Generator | None = None) -> int:
    """A 62-bit draw from torch's global CPU generator: where a call sits in this forward's stream. A checkpoint
    restores that generator before it recomputes, so the recomputed call draws the same number."""
    return int(torch.randint(0, 1 << 62, (), generator=generator or torch.default_generator))


class GlobalGenerators:
    """torch's default generators around one reproducible training forward.

    ``enter``: the caller's states are put aside and the CPU generator (and the CUDA generator of each device the
    model lives on) seeded from ``seed``; ``exit`` puts the caller's states back. Random draws the seed pool does
    not key (composite functions such as ``F.gumbel_softmax``, ``F.rrelu``, ``F.alpha_dropout``, ``nn.init`` in a
    forward, C++ ops) then depend on (seed, step) and on nothing the caller drew before, and the caller's own
    stream (data order, augmentation) does not move with the model's randomness.
    ``exit`` also says whether Python's ``random`` or numpy's global generator moved during the forward: draws
    no torch generator controls, which no seed pool can make reproducible.

    ``torch.seed()`` inside the forward (reseeding from the operating system's entropy: Reformer's reversible
    layers pick their dropout seeds so) takes its seed from the seeded CPU generator instead, so it repeats with
    the step. ``Generator.seed()`` called on a generator object (Reformer on CUDA) cannot be intercepted."""

    def __init__(self, cuda_devices: tuple[int, ...] = ()):
        self.cuda_devices = cuda_devices
        self.saved = None
        self.torch_seed = None

    def enter(self, seed: int) -> None:
        cuda = [i for i in self.cuda_devices if torch.cuda.is_available()]
        self.saved = (torch.get_rng_state(), [(i, torch.cuda.get_rng_state(i)) for i in cuda], foreign_states())
        torch.default_generator.manual_seed(seed)
        for i in cuda:
            torch.cuda.default_generators[i].manual_seed(seed)
        self.torch_seed = torch.seed, torch.random.seed
        torch.seed = torch.random.seed = self._seed

    def _seed(self) -> int:
        """``torch.seed()`` within the forward: a seed drawn from the forward's CPU stream, set as torch's does."""
        seed = position()
        torch.default_generator.manual_seed(seed)
        for i in self.cuda_devices if torch.cuda.is_available() else ():
            torch.cuda.default_generators[i].manual_seed(seed)
        return seed

    def exit(self) -> list[str]:
        """Put the caller's states back; returns the foreign generators that moved (``"random"``, ``"numpy"``)."""
        if self.torch_seed is not None:
            torch.seed, torch.random.seed = self.torch_seed
            self.torch_seed = None
        if self.saved is None:
            return []
        cpu, cuda, foreign = self.saved
        self.saved = None
        torch.set_rng_state(cpu)
        for i, state in cuda:
            torch.cuda.set_rng_state(state, i)
        return moved_foreign(foreign, foreign_states())


def foreign_states() -> dict:
    """The global generators no torch generator controls: Python's ``random`` and, once imported, numpy's."""
    import random
    import sys

    states = {"random": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        states["numpy"] = np.random.get_state(legacy=False)
    return states


def restore_foreign_states(states: dict) -> None:
    import random
    import sys

    random.setstate(states["random"])
    if "numpy" in states:
        sys.modules["numpy"].random.set_state(states["numpy"])


def moved_foreign(before: dict, after: dict) -> list[str]:
    """The generators of ``before`` (``foreign_states()``) that drew since: ``"random"``, ``"numpy"``."""
    return [name for name in before if not _same_state(before[name], after.get(name))]


def _same_state(a, b) -> bool:
    if isinstance(a, dict):  # numpy: {"bit_generator", "state": {"state", "inc"} or {"key", "pos"}, ...}
        import numpy as np

        return a.keys() == (b or {}).keys() and all(
            np.array_equal(a[k], b[k]) if not isinstance(a[k], dict) else _same_state(a[k], b[k]) for k in a)
    return a == b
