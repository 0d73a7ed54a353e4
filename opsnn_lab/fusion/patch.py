"""The module-level rewrite: decided from the run-time dataflow record, applied by instance patching.

No tracer has to accept the model's code. Each fused chain is rewritten at module boundaries the run-time
trace saw (``runtime.ModuleCall``), in one of three ways (``Decision.route``):

* ``module:chain`` (a) the chain's steps are separate module calls, one after the other, each reading the
  previous step's output: the first module's forward becomes the fused op, the others pass their input
  through. Every module keeps its class, its parameters and buffers at their qualified names. A step that runs
  inline between two of them may be an identity in the recorded call: a ``dropout`` with p=0 (BART's and
  Whisper's ``F.dropout(h, p=activation_dropout)`` between ``activation_fn`` and ``fc2``). It still runs, on the
  fused op's output, where it must stay an identity: each pass-through checks that it receives the tensor the
  fused op returned (``x is`` that tensor) and raises otherwise (that dropout given p > 0 later, a call the
  analysis did not see), so a fused result never goes on wrong. A hook added to one of the chain's modules after
  fusion makes the chain run unfused while it is there (``hooked``; every module its own forward, so the hook
  sees eager's tensors), with one warning; so does a setting of one changed since (``changed``: a Dropout's
  ``p`` the op took as it was).
* ``module:qkv`` (b) sibling Linears reading one tensor: a shared core runs one packed GEMM on the first
  call and the siblings read their slice, guarded by the input tensor's identity and ``_version``. A call
  the analysis did not see (another input, an in-place change in between, another order) runs the plain
  Linear. Works for grouped-query attention (k/v narrower than q).
* ``module:whole`` (c) one module call computes exactly the chain (its input -> chain -> its output,
  nothing else recorded inside, nothing else escapes): that module's forward becomes the fused op.
* ``module:sdpa`` (d) an attention core that is one ``F.scaled_dot_product_attention`` call inside a forward fx
  cannot trace (GPT-2's updates a key/value cache first), one such call per call of that module: the module
  runs its own code, and that call runs the fused core (``FusedAttention.as_sdpa``: its dropout from the op's
  counter stream, nothing T x T saved). Under ``make_reproducible`` the call is left to its functional
  interception, which runs the same core on the stream it names, so fused and unfused draw the same masks.

A patch is an object bound as ``module.__dict__["forward"]`` (module-level classes only: ``torch.save``
pickles it, ``copy.deepcopy`` copies it with the Parameters it shares); ``revert(model)`` removes every
patch. Under ``torch.autocast`` a fused op computes what autocast computes (``opsnn_lab.ops._amp``: its matmul
operands cast to autocast's dtype, autocast off inside), so autocast training keeps the memory win; a norm fed
another dtype than its weight runs its module's own forward (the module decides its output dtype).
Under ``torch.compile`` a fused op is an opaque call (``torch.compiler.disable``: Dynamo breaks the graph
around it, so its Python-side dropout stream never becomes a guard), and a QKV sibling runs its plain Linear,
which Inductor compiles with the rest. ``torch.export`` gets the model's own code from every patch: an exported
program is the model's graph (fused ops, which read data pointers and draw in Python, would not trace; and what
they save for a backward is no concern of an exported graph), with the model's outputs. So does a ``torch.func``
transform (``own_code``).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from opsnn_lab._opaque import opaque_to_compile
from opsnn_lab.fusion import owners
from opsnn_lab.fusion.packing import RepackAfterApply, fused_ops, repack, repack_after_load
from opsnn_lab.fusion.patch_base import CONSTANT, Patch, own_code
from opsnn_lab.fusion.routes import Route, inline_view
from opsnn_lab.fusion.runtime import tensor_version
from opsnn_lab.fusion.staleness import (
    changed,
    displaced,
    hooked,
    mode_change,
    op_mode,
    settings,
    warn_changed,
    warn_hooked,
)
from opsnn_lab.ops._amp import autocast_dtype

# Patch, own_code, CONSTANT (patch_base.py) and the packing names (packing.py) are re-exported: imports and pickles
# made before they moved find them here
__all__ = ["install", "revert", "Patch", "patches", "CONSTANT", "fused_ops", "repack", "RepackAfterApply",
           "repack_after_load", "own_code"]


def _defers(op: nn.Module, x) -> bool:
    """Under autocast, a norm fed another dtype than its weight runs the replaced modules' own forwards. Outside
    autocast nothing defers, and the op's weight need not be read through its links (a second relink per call)."""
    defers = getattr(op, "defers_under_autocast", None)
    return defers is not None and autocast_dtype(x) is not None and owners.call(op, x, run=defers)


class ChainHead(Patch):
    """The first module of a chain: runs the fused op (or, under autocast, every step's own forward).

    A hook put on one of the chain's modules after fusion (``hooked``) would see the fused op's tensors, and a
    setting changed since (``changed``: a Dropout's ``p``, a norm's ``eps``; or one of a module whose forward runs
    an identity step of the chain inline, ``inline_hosts``: Bart's ``activation_dropout``, 0 when fused) is not
    the op's: while either holds, every module of the chain runs its own forward (``unfused``; the pass-throughs
    follow), with a warning the first time. So does a module of the chain no longer in its place in the model
    (``displaced``: wrapped by an adapter that calls it inside, or replaced), whose caller expects that module's
    own output."""

    warned = False  # defaults for a patch pickled before these fields existed
    unfused = False
    paths: tuple[str, ...] = ()
    settings: tuple = ()
    inline_hosts: tuple = ()
    places: tuple = ()
    viewed = False

    def __init__(self, host: nn.Module, op: nn.Module, steps: list[nn.Module], pattern: str, path: str = "",
                 paths: tuple[str, ...] = (), inline_hosts: tuple = (), places: tuple = (), viewed: bool = False):
        super().__init__(host)
        self.op, self.steps, self.pattern, self.path = op, steps, pattern, path
        self.paths = tuple(paths)  # the steps' qualified names, for the warning
        self.inline_hosts = tuple(inline_hosts)  # (path, module) pairs
        self.places = tuple(places)  # per step, (parent, name) where the model holds it (None: the model itself)
        self.settings = settings([*steps, *(m for _, m in self.inline_hosts)], [op])
        self.last = None  # weakref to the tensor the last call returned: the pass-throughs check they receive it
        # under autocast, that tensor itself until the chain's last step has run: a forward may cast it to that
        # Linear's weight dtype on the way (T5's `wo`), after which nothing else holds it
        self.held = None
        # the model views the output before a later step (``Route.after``): under ``inference_mode`` a view keeps
        # no reference to it, so it is held (as under autocast) until the chain's last step has run
        self.viewed = viewed

    def __call__(self, x):
        if own_code():  # exporting, a torch.func transform: the model's own code (see the module docstring)
            self.unfused, self.last, self.held = True, None, None
            return type(self.host).forward(self.host, x)
        return self._call(x)

    @opaque_to_compile  # opaque to torch.compile: the op draws its dropout stream in Python
    def _call(self, x):
        hook, kind = hooked(self.steps)
        change = None
        if hook is None:
            change = displaced(self.steps, self.places) or \
                changed([*self.steps, *(m for _, m in self.inline_hosts)], self.settings)
        mode, odd = op_mode(self.steps)
        if change is None and odd is not None:
            change = (odd, mode_change(self.steps, odd))
        self.unfused = hook is not None or change is not None
        if self.unfused:
            i = next(i for i, m in enumerate(self.steps) if m is hook) if hook is not None else change[0]
            n = len(self.steps)
            where = self.inline_hosts[i - n][0] if i >= n else \
                self.paths[i] if i < len(self.paths) else type(self.steps[i]).__name__
            what = f"the {self.pattern} chain at `{self.path or '<model>'}`"
            if hook is not None:
                warn_hooked(self, where, what, kind)
            else:
                warn_changed(self, where, what, change[1])
            self.last = self.held = None
            return type(self.host).forward(self.host, x)
        if _defers(self.op, x):
            for step in self.steps:
                x = type(step).forward(step, x)
        else:
            self._sync(self.op, mode)
            x = owners.call(self.op, x)
        self.last = weakref.ref(x) if isinstance(x, torch.Tensor) else None
        self.held = x if isinstance(x, torch.Tensor) and (self.viewed or torch.is_autocast_enabled(x.device.type)) \
            else None
        return x

    def __getstate__(self):
        return {**super().__getstate__(), "last": None, "held": None}  # a weakref does not pickle


class PassThrough(Patch):
    """A later module of a chain: its step already ran inside the fused op, whose output it must receive."""

    def __init__(self, host: nn.Module, head: ChainHead | None = None, path: str = "", after: str = ""):
        super().__init__(host)
        self.head, self.path, self.after = head, path, after  # after: an inline identity step run just before

    def keeps_rank(self) -> bool:
        return True

    def __call__(self, x):
        if self.head is not None and self.head.unfused:  # a hook on the chain: every module runs its own forward
            return type(self.host).forward(self.host, x)
        if self.head is None or (not self.after and torch.compiler.is_compiling()):
            return x  # compiled: the unchecked pass-through keeps the graph whole (no inline step to guard)
        return self._check(x)

    @opaque_to_compile
    def _check(self, x):
        last = self.head.last() if self.head.last is not None else None
        held = self.head.held
        if self.head.steps and self.host is self.head.steps[-1]:
            self.head.held = None
        if x is last:
            return x
        if self.after and inline_view(self.after) and _view_of(x, last if last is not None else held):
            return x  # the model's views of the fused output (the op ran this pointwise step before them)
        if held is not None and _cast_of(x, held):
            # the forward cast the chain's output to this Linear's weight dtype (T5's `wo` under autocast); the
            # fused op's output is already what autocast makes of that Linear's output
            return held
        step, host = self.after.rpartition('.')[2], self.after.rpartition('.')[0] or '<model>'
        what = (f"the `{step}` run inline in `{host}`.forward before it viewed that output when the chain was fused "
                "and does not now (another code path, a copy?), or a forward hook replaced an output;"
                if self.after and inline_view(self.after) else
                f"the `{step}` run inline in `{host}`.forward before it was an identity when the chain was fused "
                "(p=0) and is not now (p > 0?), or a forward hook replaced an output; set that p back to 0, or"
                if self.after else
                "a call the analysis did not see (this module called on its own, or a forward hook replacing an "
                "output);")
        raise RuntimeError(f"`{self.path}` passes on the output of the fused {self.head.pattern} chain "
                           f"(`{self.head.path}` computes it whole), but received another tensor: {what} "
                           "ol.fusion.revert(model) undoes the rewrite (fusing again plans it anew)")


def _view_of(x, last: torch.Tensor | None) -> bool:
    """Whether ``x`` views ``last``'s memory: one storage (a view made under ``inference_mode`` has no ``_base``)."""
    if not isinstance(x, torch.Tensor) or last is None or x.device != last.device:
        return False
    return x.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()


def _cast_of(x, last: torch.Tensor) -> bool:
    """Whether ``x`` is ``last`` converted to another dtype (``.to(dtype)``), judged by its autograd node or,
    without one, by its values."""
    if not isinstance(x, torch.Tensor) or x.shape != last.shape or x.dtype == last.dtype:
        return False
    fn = x.grad_fn
    if fn is not None:
        return fn.name() == "ToCopyBackward0" and bool(fn.next_functions) and fn.next_functions[0][0] is last.grad_fn
    return last.grad_fn is None and torch.equal(x, last.to(x.dtype))


class WholeForward(Patch):
    """A module whose one call computes exactly the chain. A hook put on a module inside it after fusion
    (``hooked``), or a setting of it or of a module inside changed since (``changed``), makes it run its own
    forward while that holds (the host's own hooks see the tensors they see in eager either way)."""

    warned = False
    settings: tuple = ()

    def __init__(self, host: nn.Module, op: nn.Module, pattern: str, path: str = ""):
        super().__init__(host)
        self.op, self.pattern, self.path = op, pattern, path
        self.inner = [n for n, _ in host.named_modules() if n]
        self.recorded = [host, *self._modules_now("inner", self.inner)]
        self.settings = settings(self.recorded, [op])

    def __call__(self, x):
        if own_code():  # the model's own code (see the module docstring)
            return type(self.host).forward(self.host, x)
        return self._call(x)

    @opaque_to_compile
    def _call(self, x):
        inner = self.__dict__.get("inner", ())
        modules = self._modules_at("inner", inner)
        if self._stale(modules, inner, self.__dict__.get("recorded"), self.settings,
                       f"the {self.pattern} chain at `{self.path}`") or _defers(self.op, x):
            return type(self.host).forward(self.host, x)
        self._sync(self.op, op_mode(modules)[0])
        return owners.call(self.op, x)

    def _odd_mode(self, modules) -> int | None:
        return op_mode(modules)[1]  # one op: the modules whose forward depends on the mode must agree


class SDPACallSite(Patch):
    """A module whose forward makes one ``F.scaled_dot_product_attention`` call: its own code runs, that call runs
    the fused core (route ``module:sdpa``)."""

    def __init__(self, host: nn.Module, op: nn.Module, pattern: str):
        super().__init__(host)
        self.op, self.pattern = op, pattern

    def __call__(self, *args, **kwargs):
        if own_code():  # the model's own code (see the module docstring)
            return type(self.host).forward(self.host, *args, **kwargs)
        return self._call(*args, **kwargs)

    @opaque_to_compile
    def _call(self, *args, **kwargs):
        self._sync(self.op)
        if not self.op.training:
            return type(self.host).forward(self.host, *args, **kwargs)
        with _SDPARedirect(self.op):
            return type(self.host).forward(self.host, *args, **kwargs)


class _SDPARedirect(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` -> ``op.as_sdpa``; every other call runs as it is."""

    def __init__(self, op: nn.Module):
        super().__init__()
        self.op = op

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not _reproducible_forward():
            return self.op.as_sdpa(*args, **kwargs)
        return func(*args, **kwargs)


def _reproducible_forward() -> bool:
    """Whether ``make_reproducible``'s functional interception is active around this call (it then runs the
    fused core itself, on the stream it names)."""
    from opsnn_lab.consistency.functional import FunctionalRandomness

    return any(isinstance(m, FunctionalRandomness) for m in _get_current_function_mode_stack())


class QKVCore:
    """One packed GEMM for three sibling Linears; results wait for the siblings' calls on the same input."""

    def __init__(self, op: nn.Module, first: int):
        self.op, self.first = op, first
        self.clear()

    def clear(self) -> None:
        self.x, self.version, self.outs, self.read = None, -1, None, [True, True, True]

    def get(self, i: int, x: torch.Tensor, host: nn.Linear) -> torch.Tensor:
        cached = self.x is not None and self.x() is x and tensor_version(x) == self.version and not self.read[i]
        if cached:
            self.read[i] = True
            out = self.outs[i]
            if all(self.read):
                self.clear()  # drop the references: the outputs belong to the caller now
            return out
        if i != self.first or torch.compiler.is_compiling() or own_code():
            return F.linear(x, host.weight, host.bias)  # a call pattern the analysis did not see: plain Linear
        self.op.train(host.training)
        self.outs = owners.call(self.op, x)
        self.x, self.version, self.read = weakref.ref(x), tensor_version(x), [False, False, False]
        self.read[i] = True
        return self.outs[i]

    def __getstate__(self):
        return {"op": self.op, "first": self.first}

    def __setstate__(self, state):
        self.op, self.first = state["op"], state["first"]
        self.clear()

    def __deepcopy__(self, memo):
        import copy

        new = QKVCore.__new__(QKVCore)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new


class QKVMember(Patch):
    def __init__(self, host: nn.Module, core: QKVCore, index: int):
        super().__init__(host)
        self.core, self.index = core, index

    def keeps_rank(self) -> bool:
        return True  # a Linear's output, from the packed projection

    def ops(self) -> list[nn.Module]:
        return [self.core.op]

    def __call__(self, x):
        return self.core.get(self.index, x, self.host)


def install(model: nn.Module, route: Route, op: nn.Module, pattern: str) -> None:
    """Bind the patches of one fused chain on ``model`` (the copy ``apply`` returns)."""
    mods = [model.get_submodule(p) for p in route.carriers]
    for mod in mods:
        if isinstance(mod.__dict__.get("forward"), Patch):
            raise ValueError(f"module {route.carriers[mods.index(mod)]!r} is already rewritten by another chain")
    if route.kind == "chain":
        after = route.after or ("",) * len(mods)
        # whose forward runs an identity step (a view has no setting to watch)
        hosts = dict.fromkeys(a.rpartition(".")[0] for a in after if a and not inline_view(a))
        places = tuple((model.get_submodule(p.rpartition(".")[0]), p.rpartition(".")[2]) if p else None
                       for p in route.carriers)
        head = mods[0].__dict__["forward"] = ChainHead(mods[0], op, mods, pattern, route.carriers[0],
                                                           route.carriers,
                                                           tuple((p, model.get_submodule(p)) for p in hosts), places,
                                                           any(inline_view(a) for a in after))
        for mod, path, inline in zip(mods[1:], route.carriers[1:], after[1:]):
            mod.__dict__["forward"] = PassThrough(mod, head, path, inline)
    elif route.kind == "whole":
        mods[0].__dict__["forward"] = WholeForward(mods[0], op, pattern, route.carriers[0])
    elif route.kind == "qkv":
        core = QKVCore(op, route.first)
        for i, mod in enumerate(mods):
            mod.__dict__["forward"] = QKVMember(mod, core, i)
    elif route.kind == "sdpa":
        mods[0].__dict__["forward"] = SDPACallSite(mods[0], op, pattern)
    else:
        raise ValueError(f"route kind must be 'chain', 'qkv', 'whole' or 'sdpa', got {route.kind!r}")


def patches(model: nn.Module) -> dict[str, Patch]:
    """Qualified module name -> the patch bound on it."""
    return {name: m.__dict__["forward"] for name, m in model.named_modules()
            if isinstance(m.__dict__.get("forward"), Patch)}


def revert(model: nn.Module) -> nn.Module:
    """Remove every module-level patch (in place): each module runs its class's forward again. The constants a
    rewritten region's code read (``region_rewrite.keep_constants``) and the repack after conversion and loading
    (``RepackAfterApply``, ``repack_after_load``) go with it."""
    for m in model.modules():
        if isinstance(m.__dict__.get("forward"), Patch):
            del m.__dict__["forward"]
        if isinstance(m.__dict__.get("_apply"), RepackAfterApply):
            del m.__dict__["_apply"]
        for key in [k for k, h in m._load_state_dict_post_hooks.items() if h is repack_after_load]:
            del m._load_state_dict_post_hooks[key]
        for name in [k for k in m.__dict__ if k.startswith(CONSTANT)]:
            del m.__dict__[name]
    return model
