"""Drop-in ``nn.Dropout`` whose mask depends only on (seed, step, element): nothing saved for backward.

Every fused op with dropout shares the counter-RNG contract of ``CounterRNG``:

* ``module.rng_seed`` (int in [0, 2**64)) and ``module.rng_step`` (int >= 0) pick the stream.
* Each forward in training mode draws with ``offset = rng_step * rng.MAX_NUMEL`` (element ``e`` of the
  row-major output uses counter ``offset + e``), then increments ``rng_step`` -- whether or not ``p > 0``,
  so step counts stay aligned across modules. Eval-mode forwards neither draw nor advance.
* ``set_rng(seed, step=0)`` sets both (``ol.consistency.make_reproducible`` calls it with the seed of the
  module's qualified name). ``seed=None`` at construction draws one from torch's global generator, so
  ``torch.manual_seed`` makes a freshly built model reproducible, as with ``nn.Dropout``.
* The seed and step are plain attributes, not state_dict entries: fusing or swapping dropout modules
  never changes a model's state_dict keys.
* A fused op that absorbed an inline ``F.dropout`` (``rng_name`` ``"<module path>:dropout.<i>"``) draws, inside a
  ``make_reproducible`` training forward, the seed that forward gives that module's next functional dropout, with
  offset 0, as the call it replaces would; elsewhere it draws from its own counter.

The backward regenerates the mask from (seed, offset) instead of keeping eager dropout's bool mask
(1 byte per element).

Activation checkpointing (``torch.utils.checkpoint``, reentrant or not; HF's ``gradient_checkpointing_enable``)
runs a training-mode forward again inside the backward, where eager dropout gets its mask back because the
checkpoint restores torch's RNG state. A counter stream is replayed instead: each draw logs its step and a
fingerprint of its input (shape, dtype and a few sampled values); a forward run by the autograd engine takes
the step of the logged draw of the same forward whose input it recomputes (the oldest not yet replayed in
this backward, so one module applied twice replays both calls in order) and advances nothing. When no
logged input matches (a recomputation that is not bitwise), the one logged draw of the same shape is used,
and where even that is ambiguous it raises rather than train on a mask the forward never used. A checkpoint
around a whole model prepared by ``make_reproducible`` is different: the model's forward is run again from its
start, its streams seeded as for that forward (``rerun_forward``), so every draw is made afresh as it was then.
"""

from __future__ import annotations

import threading
from collections import deque

import torch
from torch import nn

from opsnn_lab._checks import check_range, check_tensor, check_type, first_derivative_only
from opsnn_lab._opaque import opaque_to_compile
from opsnn_lab._randomness import functional_seed, stream_made
from opsnn_lab.kernels import rng

__all__ = ["CounterRNG", "Dropout", "DropoutFunction"]


_LOGGED = 64  # draws kept per module for a checkpoint's recomputation to replay
_SAMPLES = 8  # input values fingerprinted per draw


_RERUN = threading.local()


def rerun_forward(on: bool) -> None:
    """Mark (or unmark) this thread as running a whole training forward again inside the backward, its streams
    reseeded as for that forward (``consistency.seed_pool``): draws are then fresh, not replayed from the logs."""
    _RERUN.on = on


def _in_backward() -> bool:
    """Whether a checkpoint is recomputing on this thread: the autograd engine runs a backward here, and not a whole
    forward that was reseeded to draw afresh."""
    return torch._C._current_graph_task_id() != -1 and not getattr(_RERUN, "on", False)


def _fingerprint(x: torch.Tensor | None):
    if x is None:
        return None
    x = x.detach()
    idx = torch.arange(0, x.numel(), max(1, x.numel() // _SAMPLES), device=x.device)[:_SAMPLES]
    return tuple(x.shape), x.dtype, torch.take(x, idx)


def _same_shape(a, b) -> bool:
    return a is None or b is None or a[:2] == b[:2]


def _same_values(a, b) -> bool:
    return a is None or b is None or (a[:2] == b[:2] and torch.equal(a[2], b[2]))


class CounterRNG:
    """Mixin giving a module a counter-RNG stream: ``rng_seed``, ``rng_step``, ``set_rng``, ``next_draw``,
    ``share_rng``."""

    rng_seed: int
    rng_step: int

    def _init_rng(self, seed: int | None) -> None:
        stream_made()  # a region caching the streams it may draw from looks again (fusion.rewrite.FxForward)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.set_rng(seed, 0)

    def set_rng(self, seed: int, step: int = 0) -> None:
        """Use stream ``seed`` from call number ``step`` on."""
        rng.seed_keys(seed)  # validates the seed
        check_type("step", step, int)
        if isinstance(step, bool) or not 0 <= step < 2**31:
            raise ValueError(f"step must be an int in [0, 2**31), got {step!r}")
        self.rng_seed, self.rng_step = seed, step
        self._drawn: deque = deque(maxlen=_LOGGED)  # (forward number, step, input fingerprint)
        self._forwards, self._replaying, self._replayed = 0, None, set()

    def share_rng(self, leader: CounterRNG | None) -> None:
        """Draw from ``leader``'s stream from now on (``None`` or ``self``: from this module's own).

        One named stream run by several modules: a dropout module called twice in a forward, one call of which
        a fused op absorbed, draws the masks the module alone draws only if both calls take turns on one
        counter. A plain attribute, not a child: nothing moves in the module tree or the state_dict."""
        if leader is not None and not isinstance(leader, CounterRNG):
            raise TypeError(f"leader must be a CounterRNG module or None, got {type(leader).__name__}")
        object.__setattr__(self, "_rng_leader", None if leader is self else leader)

    def snapshot(self):
        """A function that puts this stream (or the one it shares) back where it stands now: its step and the log
        a checkpoint's recomputation replays from (``_randomness.draw_state``)."""
        leader = self.__dict__.get("_rng_leader")
        if leader is not None:
            return leader.snapshot()
        if not hasattr(self, "_drawn"):  # a module pickled before the replay log existed
            self.set_rng(self.rng_seed, self.rng_step)
        saved = (self.rng_step, list(self._drawn), self._forwards, self._replaying, set(self._replayed))

        def put_back() -> None:
            self.rng_step, drawn, self._forwards, self._replaying, replayed = saved
            self._drawn.clear()
            self._drawn.extend(drawn)
            self._replayed = set(replayed)

        return put_back

    def next_draw(self, x: torch.Tensor | None = None) -> tuple[int, int]:
        """``(seed, offset)`` for this training-mode call on input ``x``; advances ``rng_step``, except in a
        checkpoint's recomputation, which replays the draw of the forward it recomputes. A module sharing
        another's stream (``share_rng``) draws from that one."""
        # it absorbed an inline F.dropout: under make_reproducible, that call's seed, keyed by the call's path in
        # the model being made reproducible (``rng_stream``, set as its streams are linked), else in the fused one
        name = self.__dict__.get("rng_stream") or self.__dict__.get("rng_name")
        if name and ":" in name:
            seed = functional_seed(name)
            if seed is not None:
                return seed, 0
        if x is not None and not getattr(self, "p", 1.0) > 0:
            x = None  # no mask to replay: the draw only keeps the step count, and a fingerprint costs ~5 us
        leader = self.__dict__.get("_rng_leader")
        if leader is not None:
            return leader.next_draw(x)
        if not hasattr(self, "_drawn"):  # a module pickled before the replay log existed
            self.set_rng(self.rng_seed, self.rng_step)
        if _in_backward() and self._drawn:
            return self.rng_seed, self._replay(_fingerprint(x)) * rng.MAX_NUMEL
        if self._replaying is not None:  # the first draw after a backward starts the next forward
            self._forwards, self._replaying, self._replayed = self._forwards + 1, None, set()
        step = self.rng_step
        self.rng_step += 1
        self._drawn.append((self._forwards, step, _fingerprint(x)))
        return self.rng_seed, step * rng.MAX_NUMEL

    def _replay(self, fp) -> int:
        gid = torch._C._current_graph_task_id()
        if self._replaying != gid:  # a new backward: every draw of the last forward may be replayed again
            self._replaying, self._replayed = gid, set()
        last = [d for d in self._drawn if d[0] == self._forwards]
        fresh = [d for d in last if d[1] not in self._replayed]
        found = next((d for d in fresh if _same_values(d[2], fp)), None) \
            or next((d for d in last if _same_values(d[2], fp)), None)
        if found is None:
            shaped = [d for d in last if _same_shape(d[2], fp)]
            if len(shaped) != 1:
                raise RuntimeError(
                    f"{type(self).__name__}: a forward run inside the backward (activation checkpointing) "
                    f"matches {len(shaped)} of this module's {len(last)} dropout draws in the last forward; "
                    "its mask cannot be replayed. Checkpoint a region where this module runs once per input "
                    "shape, or make the recomputation deterministic")
            found = shaped[0]
        self._replayed.add(found[1])
        return found[1]


def _scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def apply_mask(x: torch.Tensor, p: float, seed: int, offset: int) -> torch.Tensor:
    """``x * keep / (1 - p)`` with the counter-based keep-mask of ``x``'s shape (a new tensor)."""
    return rng.dropout_mul(x, seed, offset, p, _scale(p))


class DropoutFunction(torch.autograd.Function):
    """Dropout that saves nothing: backward regenerates the mask from ``(seed, offset)``."""

    @staticmethod
    def forward(ctx, x, p, seed, offset):
        ctx.rng = (p, seed, offset)
        return apply_mask(x, p, seed, offset)

    @staticmethod
    def backward(ctx, grad):
        first_derivative_only("the counter-RNG dropout")
        return apply_mask(grad, *ctx.rng), None, None, None


def _check_numel(x: torch.Tensor) -> None:
    if x.numel() > rng.MAX_NUMEL:
        raise ValueError(f"x has {x.numel()} elements; one dropout draw supports at most 2**32")


class Dropout(CounterRNG, nn.Module):
    """``nn.Dropout(p)`` with a counter-based mask (see the module docstring for the seed/step contract).

    Same scaling as ``nn.Dropout`` (kept elements times ``1 / (1 - p)``; ``p = 1`` gives zeros), identity in
    eval mode or for ``p = 0``. ``p`` is quantized to multiples of 2**-16 for drawing (``rng``). Always
    out of place; ``inplace`` is accepted for signature compatibility only.
    """

    def __init__(self, p: float = 0.5, inplace: bool = False, *, seed: int | None = None):
        super().__init__()
        self.p = float(check_range("p", p, 0.0, 1.0))
        self.inplace = bool(check_type("inplace", inplace, bool))
        self._init_rng(seed)

    @classmethod
    def from_module(cls, dropout: nn.Module, *, seed: int | None = None) -> Dropout:
        """The counter-RNG twin of an ``nn.Dropout`` (same ``p``, same train/eval mode)."""
        check_type("dropout", dropout, (nn.Dropout, Dropout))
        module = cls(dropout.p, seed=seed)
        module.train(dropout.training)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x)
        if not self.training:
            return x
        return self._train(x)

    @opaque_to_compile  # the stream's step lives in Python: traced, each step's seed and offset made a new graph
    def _train(self, x: torch.Tensor) -> torch.Tensor:
        seed, offset = self.next_draw(x)
        if self.p == 0.0:
            return x
        _check_numel(x)
        return DropoutFunction.apply(x, self.p, seed, offset)

    def extra_repr(self) -> str:
        return f"p={self.p}, seed={self.rng_seed}, step={self.rng_step}"
