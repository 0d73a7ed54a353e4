"""The torch calls that draw random numbers, and the ``make_reproducible`` forward running on this thread.

Three layers meet here without importing one another: ``consistency`` keys every random call of a training forward
by the module that makes it and its call index (``consistency.functional.FunctionalRandomness``); a fusion
rewrite's fx code runs some submodules' forwards inline, so it says which submodule a random call belongs to
(``enter_module`` / ``exit_module`` around the call); a fused op that absorbed an inline ``F.dropout`` draws the
seed that call would have drawn (``functional_seed``). The running forward is found on torch's function-mode stack
(a mode with ``keys_random_calls``), 0.1-0.4 us; outside one, every helper here does nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack

__all__ = ["DROPOUTS", "CHANNEL_DROPOUTS", "SAMPLERS", "LIKE", "RANDOM_METHODS", "draws_random", "running",
           "functional_seed", "enter_module", "exit_module", "draw_streams", "draw_state", "stream_made",
           "streams_made"]

DROPOUTS = frozenset({F.dropout, torch.dropout}
                     | ({torch.Tensor.dropout} if hasattr(torch.Tensor, "dropout") else set()))
CHANNEL_DROPOUTS = {F.dropout1d: 1, F.dropout2d: 2, F.dropout3d: 3}  # -> spatial dims of a batched input
# random functions that take ``generator=``; the first tensor argument (if any) gives the device
SAMPLERS = frozenset({torch.rand, torch.randn, torch.randint, torch.randperm, torch.bernoulli, torch.multinomial,
                      torch.normal, torch.poisson, torch.Tensor.bernoulli_, torch.Tensor.uniform_,
                      torch.Tensor.normal_, torch.Tensor.exponential_, torch.Tensor.random_,
                      torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_,
                      torch.Tensor.bernoulli})
LIKE = {torch.rand_like: torch.rand, torch.randn_like: torch.randn,  # drawn as the factory (generator=)
        torch.randint_like: torch.randint}
# the same calls as fx records them: functions by object, Tensor methods by name (``x.bernoulli_(p)``)
_FUNCTIONS = DROPOUTS | set(CHANNEL_DROPOUTS) | SAMPLERS | set(LIKE) | {F.scaled_dot_product_attention}
RANDOM_METHODS = frozenset(f.__name__ for f in _FUNCTIONS if getattr(torch.Tensor, f.__name__, None) is f)


def draws_random(op: str, target) -> bool:
    """Whether an fx node (``op``, ``target``) is a call ``make_reproducible`` keys (SDPA: its dropout)."""
    if op == "call_method":
        return target in RANDOM_METHODS
    return op == "call_function" and target in _FUNCTIONS


def running():
    """The mode of the innermost ``make_reproducible`` forward running on this thread, or None."""
    if not torch._C._len_torch_function_stack() or torch.compiler.is_compiling():
        return None  # compiled code takes no mode's keys (make_reproducible runs eager)
    for mode in reversed(_get_current_function_mode_stack()):
        if getattr(mode, "keys_random_calls", False):
            return mode
    return None


_STREAMS_MADE = [0]  # counter streams made so far in this process (``stream_made``): a cache of streams checks it


def stream_made() -> None:
    """A counter stream was made (``CounterRNG``): lists of streams found before may miss it."""
    _STREAMS_MADE[0] += 1


def streams_made() -> int:
    return _STREAMS_MADE[0]


def draw_streams(module):
    """The counter streams (objects with ``next_draw``) a call of ``module`` may draw from: its modules', and the
    fused ops a fusion rewrite runs for them (a slot's, a patched forward's), which are not children."""
    out, seen = [], set()
    for m in module.modules():  # instance dicts and class attributes: nn.Module's __getattr__ is slow to miss
        for obj in (m, m.__dict__.get("op"), getattr(m.__dict__.get("forward"), "op", None)):
            if obj is not None and hasattr(type(obj), "next_draw") and id(obj) not in seen:
                seen.add(id(obj))
                out.append(obj)
    return out


def draw_state(streams, tensors=()):
    """Where every source of a forward's draws stands now: torch's generators (the CPU one, and each CUDA
    device's that ``tensors`` are on), each counter stream of ``streams`` (``CounterRNG`` objects), and the
    running ``make_reproducible`` forward's call counts. Returns ``put_back()``, which sets them all back: a
    region whose guard misses after it drew runs its original forward from there, and draws what eager draws."""
    cuda = sorted({t.device.index or 0 for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    cpu, cuda_states = torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in cuda]
    counters = [stream.snapshot() for stream in streams]
    mode = running()
    scope = mode.snapshot() if mode is not None and hasattr(mode, "snapshot") else None

    def put_back() -> None:
        torch.set_rng_state(cpu)
        for device, state in cuda_states:
            torch.cuda.set_rng_state(state, device)
        for restore in counters:
            restore()
        if scope is not None:
            scope()

    return put_back


def functional_seed(name: str, kind: str = "dropout") -> int | None:
    """The seed the running forward gives the next ``kind`` call of the module ``name`` names (``"<module
    path>:dropout.<i>"``, the stream of an absorbed call: its path part), as it would give that module's own
    call; None outside a ``make_reproducible`` forward."""
    mode = running()
    return None if mode is None else mode.seed_at(name.rpartition(":")[0], kind)


def enter_module(path: str, *_after) -> None:
    """Before a random call that the submodule at ``path`` (from the running region) makes in fx code which runs
    its forward inline: the call is keyed by that submodule, as in the model the rewrite left alone. ``_after``:
    values the code computed before (unused: they make fx record this call when it traces the code)."""
    mode = running()
    if mode is not None:
        mode.enter(path)


def exit_module(_done=None) -> None:
    """After that call (its result is the argument: the code runs this after the call, never before)."""
    mode = running()
    if mode is not None:
        mode.exit()
