"""Per-operator seed pool and ``make_reproducible``: every random op gets its own named stream.

``SeedPool(seed).seed_for(name, step)`` is a 64-bit BLAKE2b hash of ``(seed, step, name)`` (UTF-8),
never Python's per-process salted ``hash``, so it is the same in every process, on every machine,
and a new random op elsewhere in a model takes a stream of its own instead of shifting everyone
else's draws (which is what one global generator does).

``make_reproducible(model, seed)`` (in place; returns ``model``) makes every dropout of the model draw
a mask that depends only on ``(seed, module name, step, element offset)``:

* ``nn.Dropout`` modules become ``ol.ops.Dropout`` (counter-based; same ``p``, same train/eval mode;
  dropout has no state, so the state_dict is unchanged);
* modules that already carry a counter RNG (``ol.ops.Dropout``, the fused Linear-GELU-Dropout ops:
  the ``CounterRNG`` contract of :mod:`opsnn_lab.ops.dropout`) are seeded by their qualified name, and
  so are the fused ops an ``ol.fusion`` rewrite runs in place of a chain, under the name of the dropout
  module each absorbed (so a fused model draws the masks the unfused one draws); a dropout module a
  rewrite turned into a pass-through is left alone (its mask is drawn in the fused op);
* functional ``F.dropout`` / ``torch.dropout`` calls inside ``forward`` methods are intercepted by a
  ``TorchFunctionMode`` installed for the duration of each training forward and keyed by the module
  that made the call plus its call index within that module's forward:
  ``"<module path>:dropout.<i>"`` (``"<root>"`` stands for the model itself); so are channel dropouts,
  SDPA's dropout and every other random torch call (drop path), see ``consistency.functional``. In a fused
  model the keys are the unfused model's: a fused op that absorbed such a call draws that call's key each time it
  runs (the module's next index, however often the module runs in a forward), and a random call that a fused
  region's fx code makes inline for a submodule is keyed by that submodule (``opsnn_lab._randomness``).

torch's own generators: during a training forward the CPU generator (and the CUDA generator of each device
the model lives on) is seeded from (seed, step) and the caller's states are put back afterwards, so draws the
pool does not key (``F.gumbel_softmax``, ``F.rrelu``, alpha dropout, ``nn.init`` in a forward, C++ ops) are
reproducible too, and the caller's stream does not move. Draws from Python's ``random`` or numpy's global
generator are named in a ``RuntimeWarning`` (once per model): no torch generator controls them.

Activation checkpointing: every functional draw of a forward is logged under its position in torch's global
CPU stream (one 62-bit draw), which a checkpoint restores before it recomputes. A module called inside the
backward is a checkpoint recomputing; from then to the end of that recomputation, each functional call takes
the seed logged at its position (and counter-RNG modules replay their own log, see ``ops.dropout``), so
gradients equal the run without checkpointing: module calls checkpointed, a layer whose own ``forward`` is
checkpointed with its hooks outside (Hugging Face 5's ``GradientCheckpointingLayer``), a module called twice.
Not covered: random calls a checkpointed plain function makes before its first module call (recomputed with
torch's generator: a non-reentrant checkpoint raises ``CheckpointError``, a reentrant one differs).
A checkpoint around the whole model (``checkpoint(model, x)``) runs the model's own forward inside the backward:
that forward is found among the last 16 by the autograd node that asked for it (its sequence number lies within
the forward's) and run again at its step, its streams reseeded, the step counter left as it is; so a model called
twice before one backward (a siamese loss) recomputes each call with its own masks.

Step: the model carries a step counter. Every forward of the model in training mode uses the current
step and then advances it by one; eval-mode forwards use no randomness and do not advance. Before a
forward, every stream is reset to ``pool.seed_for(name, step)`` with call index 0, so a mask depends on
how many training forwards came before, never on how many draws other modules made.
``set_step(model, step)`` (or ``model.set_step(step)``) sets the step the next forward uses (to resume a
run); ``get_step(model)`` reads it.
"""

from __future__ import annotations

import collections
import functools
import warnings
import weakref

import torch
from torch import nn

from opsnn_lab._checks import check_type
from opsnn_lab._hooks import passive
from opsnn_lab._opaque import opaque_to_compile
from opsnn_lab.consistency.functional import FunctionalRandomness, GlobalGenerators, position
from opsnn_lab.consistency.pool import SeedPool, SeedStream, _check_seed, _check_step
from opsnn_lab.consistency.streams import ROOT, _replace_dropouts, counter_streams, link_streams
from opsnn_lab.ops.dropout import rerun_forward

__all__ = ["SeedPool", "SeedStream", "make_reproducible", "set_step", "get_step", "ROOT"]

_KEPT_FORWARDS = 16  # functional draws a checkpoint may replay: those of the last 16 training forwards
_FOREIGN = {"random": "Python's `random` module", "numpy": "numpy's global generator (np.random)"}


class _ForwardScope:
    """Per-forward bookkeeping (plain attributes, so a prepared model still deep-copies)."""

    def __init__(self):
        self.stack: list[str] | None = None
        self.calls: dict[tuple[str, str], int] = {}  # (module path, "dropout" | "random") -> calls so far
        self.mode = None  # the FunctionalRandomness mode of the running forward
        self.active = False  # between begin_forward and end_forward
        self.log: dict[int, int] = {}  # this forward's functional draws: stream position -> seed
        self.generators: GlobalGenerators | None = None
        self.replay_mode = None  # the mode a checkpoint's recomputation runs under (see push)
        self.rerun = False  # this forward runs a past one again inside the backward (rerun_forward)
        self.step = 0  # the step this forward draws at


def _gone():
    return None


_NEXT_SEQUENCE_NR = getattr(torch._C._autograd, "_get_sequence_nr", None)


def _sequence_nr() -> int | None:
    """The sequence number the next autograd node made on this thread takes (None where torch has no such call)."""
    return _NEXT_SEQUENCE_NR() if _NEXT_SEQUENCE_NR is not None else None


class _ReproducibleState:
    """What ``make_reproducible`` attaches to a model: pool, step, seeded modules, hooks."""

    def __init__(self, model: nn.Module, pool: SeedPool, functional: bool):
        self.pool = pool
        self.step = 0
        self.functional = functional
        self.model_ref = weakref.ref(model)
        self.local = _ForwardScope()  # module-path stack and call counts of the running forward
        self.logs: collections.deque = collections.deque(maxlen=_KEPT_FORWARDS)  # newest first
        self.forwards: collections.deque = collections.deque(maxlen=_KEPT_FORWARDS)  # [first node, end, step]
        self.warned: set[str] = set()
        self.handles: list = []

    def __deepcopy__(self, memo):
        """A copy of the model (``copy.deepcopy``, ``ol.fusion.apply``) carries its own state: its hooks are
        this state's bound methods, which deepcopy rebinds to the copy, and the copy seeds its own modules."""
        import copy

        new = _ReproducibleState.__new__(_ReproducibleState)
        memo[id(self)] = new
        model = self.model_ref()
        new.pool, new.step, new.functional = self.pool, self.step, self.functional
        new.model_ref = weakref.ref(memo.get(id(model), model)) if model is not None else self.model_ref
        new.local = _ForwardScope()
        new.logs, new.warned = collections.deque(maxlen=_KEPT_FORWARDS), set()
        new.forwards = collections.deque(maxlen=_KEPT_FORWARDS)
        new.handles = copy.deepcopy(self.handles, memo)
        return new

    def __getstate__(self):
        """Pickled with the model (``torch.save(model)``): the model itself in place of the weak reference, which
        does not pickle; what a running forward holds starts afresh."""
        return {"pool": self.pool, "step": self.step, "functional": self.functional, "model": self.model_ref(),
                "handles": self.handles}

    def __setstate__(self, state):
        state = dict(state)
        model = state.pop("model")
        self.__dict__.update(state)
        self.model_ref = weakref.ref(model) if model is not None else _gone
        self.local, self.logs, self.warned = _ForwardScope(), collections.deque(maxlen=_KEPT_FORWARDS), set()
        self.forwards = collections.deque(maxlen=_KEPT_FORWARDS)

    # -- hooks (bound methods, so a deep copy of the model calls its own state) -----------------
    # The root's two are opaque to torch.compile: Python bookkeeping (the step, the streams, the generators) that,
    # traced, would put each step's numbers into a new graph
    @opaque_to_compile
    def pre_hook(self, module, args) -> None:
        if not module.training:
            return
        if torch._C._current_graph_task_id() == -1:
            self.begin_forward()
        else:  # the model's own forward inside a backward: a checkpoint around the whole model recomputing
            self.rerun_forward()

    @opaque_to_compile
    def post_hook(self, module, args, output) -> None:
        self.end_forward()

    def push_hook(self, name: str, module, args) -> None:
        self.push(name)

    def pop_hook(self, module, args, output) -> None:
        self.pop()

    # -- per forward ------------------------------------------------------------------------
    def seeded_modules(self):
        model = self.model_ref()
        return counter_streams(model)

    def begin_forward(self, step: int | None = None) -> None:
        """Seed every stream for a training forward at ``step`` (default: the next one, which ``end_forward``
        counts)."""
        if step is None:
            step = self.step
            self.forwards.appendleft([_sequence_nr(), None, step])
        self.local.active, self.local.step = True, step
        for name, module in link_streams(self.seeded_modules()):
            module.set_rng(self.pool.seed_for(name, step), 0)
        self.local.stack = [ROOT]
        self.local.calls = {}
        if self.functional:
            self.local.log = {}
            self.logs.appendleft(self.local.log)
            self.local.generators = GlobalGenerators(self._cuda_devices())
            self.local.generators.enter(self.pool.seed_for(f"{ROOT}:global", step))
            self.local.mode = FunctionalRandomness(self)
            self.local.mode.__enter__()

    def end_forward(self) -> None:
        if not self.local.active:  # the forward switched to eval mode on its way: nothing began
            return
        self.local.active = False
        mode, generators = self.local.mode, self.local.generators
        if mode is not None:
            self.local.mode = None
            mode.__exit__(None, None, None)
        if generators is not None:
            self.local.generators = None
            self._warn_foreign(generators.exit())
        self.local.stack = None
        if self.local.rerun:
            self.local.rerun = False
            rerun_forward(False)
        else:
            if self.forwards:
                self.forwards[0][1] = _sequence_nr()
            self.step += 1

    def rerun_forward(self) -> None:
        """Run the training forward a checkpoint recomputes again, from its start and at its step (its streams
        reseeded, every draw fresh as then); ``end_forward`` leaves the step counter as it is. The forward is
        the one whose autograd nodes hold the node now asking for the recomputation, else the one that begins just
        after it (a reentrant checkpoint's node, made just before its forward, which runs without gradients)."""
        node = torch._C._current_autograd_node()
        nr = node._sequence_nr() if node is not None else None
        known = [(first, end, s) for first, end, s in self.forwards if first is not None] if nr is not None else []
        step = next((s for first, end, s in known if first <= nr < (end or first)), None)
        if step is None:
            step = next((s for first, _, s in known if nr == first - 1), None)
        if step is None:
            step = self.forwards[0][2] if self.forwards else self.step
            if "rerun" not in self.warned:
                self.warned.add("rerun")
                warnings.warn(
                    "make_reproducible: the model ran in training mode inside a backward, but not as the "
                    f"recomputation of one of its last {_KEPT_FORWARDS} training forwards; it draws the masks of "
                    f"step {step}", RuntimeWarning, stacklevel=3)
        self.local.rerun = True
        rerun_forward(True)
        self.begin_forward(step)

    def _cuda_devices(self) -> tuple[int, ...]:
        model = self.model_ref()
        if model is None:
            return ()
        return tuple(sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"}))

    def _warn_foreign(self, moved: list[str]) -> None:
        for name in moved:
            if name not in self.warned:
                self.warned.add(name)
                warnings.warn(
                    f"make_reproducible: this training forward drew from {_FOREIGN[name]}, which no torch generator "
                    "controls: those draws are not reproducible (draw them with torch, or from "
                    "ol.consistency.SeedPool(seed).generator(name, step))", RuntimeWarning, stacklevel=3)

    def functional_seed(self, kind: str = "dropout", path: str | None = None) -> int:
        """The seed of the next ``kind`` call (``dropout`` or ``random``) of the module at ``path`` (default: the
        innermost running module): ``"<module path>:<kind>.<i>"`` at this step; each kind counts its calls apart,
        so a new random op never shifts a dropout's key. A fused op that absorbed a functional call draws here in
        its place, under that call's module path, so the module's calls keep the keys and indices they have in the
        unfused model, however often the module runs in a forward."""
        if not path:
            path = self.local.stack[-1] if self.local.stack else ROOT
        calls = self.local.calls.get((path, kind), 0)
        self.local.calls[(path, kind)] = calls + 1
        seed = self.pool.seed_for(f"{path}:{kind}.{calls}", self.local.step)
        self.local.log[position()] = seed  # for a checkpoint that recomputes this call (replay_seed)
        return seed

    def replay_seed(self) -> int | None:
        """The seed a recomputed functional call took in its forward, found by its position in torch's global
        CPU stream (which the checkpoint restored), in the last forwards; None if no forward drew there."""
        at = position()
        return next((log[at] for log in self.logs if at in log), None)

    # -- module path tracking (for functional calls) -------------------------------------------
    def push(self, name: str) -> None:
        local = self.local
        if local.stack is not None:
            local.stack.append(name)
        elif self.functional and self.logs and torch._C._current_graph_task_id() != -1:
            self._enter_replay()

    def _enter_replay(self) -> None:
        """A module called inside the backward: a checkpoint recomputing part of a forward. From here to the end of
        the recomputation, functional random calls take the seeds their forward counterparts took (found by
        position, so a module called twice, or a layer whose own ``forward`` is checkpointed with its hooks outside,
        as Hugging Face's ``GradientCheckpointingLayer`` does, replays each call's own mask). The mode is never
        exited here: the recomputation runs inside one node of the backward, and the autograd engine restores the
        thread's mode stack when that node is done."""
        from torch.overrides import _get_current_function_mode_stack

        mode = self.local.replay_mode
        if mode is not None and any(m is mode for m in _get_current_function_mode_stack()):
            return
        self.local.replay_mode = FunctionalRandomness(self, replay=True)
        self.local.replay_mode.__enter__()

    def enter_inlined(self, path: str) -> None:
        """``push`` for a submodule a region's fx code runs inline: ``path`` is from the region, the innermost
        running module (the region's own hooks pushed it)."""
        top = self.local.stack[-1] if self.local.stack else ROOT
        self.push(path if top == ROOT else f"{top}.{path}")

    def pop(self) -> None:
        stack = self.local.stack
        if stack is not None and len(stack) > 1:
            stack.pop()


def _install_hooks(model: nn.Module, state: _ReproducibleState) -> None:
    state.handles.append(model.register_forward_pre_hook(state.pre_hook))
    state.handles.append(model.register_forward_hook(state.post_hook, always_call=True))
    if state.functional:
        for name, module in model.named_modules():
            if module is model:
                continue
            # passive: a fused region's fx code may inline this module (its calls are then named by the region)
            state.handles.append(module.register_forward_pre_hook(passive(functools.partial(state.push_hook, name))))
            state.handles.append(module.register_forward_hook(passive(state.pop_hook), always_call=True))


def make_reproducible(model: nn.Module, seed: int | SeedPool = 0, *, functional: bool = True) -> nn.Module:
    """Make every dropout of ``model`` draw masks that depend only on (seed, module name, step, offset).

    In place; returns ``model``. ``seed`` is an int or a ``SeedPool``. ``functional=False`` skips the
    interception of ``F.dropout`` calls: it costs a Python call per torch function and two hooks per
    module call in training forwards, ~7% of a training step of the 2-layer encoder (hidden 256,
    8 x 64 tokens, one CPU thread); the module part alone costs nothing measurable.

    Calling it again re-seeds the model and resets its step to 0. See the module docstring for the
    step semantics; ``set_step(model, n)`` resumes at step ``n``.
    """
    check_type("model", model, nn.Module)
    pool = seed if isinstance(seed, SeedPool) else SeedPool(_check_seed("seed", seed))
    check_type("functional", functional, bool)
    old = getattr(model, "_opsnn_reproducible", None)
    if old is not None:
        for handle in old.handles:
            handle.remove()
    _replace_dropouts(model)
    state = _ReproducibleState(model, pool, functional)
    _install_hooks(model, state)
    # plain attributes (not submodules, not buffers): the state_dict is unchanged
    object.__setattr__(model, "_opsnn_reproducible", state)
    # a partial, not a closure: it pickles with the model, and a deep copy's acts on the copy
    object.__setattr__(model, "set_step", functools.partial(set_step, model))
    for name, module in link_streams(state.seeded_modules()):  # seeded already, for calls outside a forward
        module.set_rng(pool.seed_for(name, 0), 0)
    return model


def _state(model: nn.Module) -> _ReproducibleState:
    check_type("model", model, nn.Module)
    state = getattr(model, "_opsnn_reproducible", None)
    if state is None:
        raise ValueError("model was not prepared by make_reproducible(model, seed)")
    return state


def set_step(model: nn.Module, step: int) -> None:
    """The step the next training forward of ``model`` uses (``make_reproducible`` starts at 0)."""
    _state(model).step = _check_step(step)


def get_step(model: nn.Module) -> int:
    """The step the next training forward of ``model`` will use."""
    return _state(model).step
