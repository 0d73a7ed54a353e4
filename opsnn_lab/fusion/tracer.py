"""torch.fx tracing of one region, widened beyond ``symbolic_trace`` (which stops at data-dependent control flow,
loops over tensor sizes and isinstance checks on its proxies):

1. a plain helper function that stops the tracer (argument checks, for instance) is retried as an opaque call
   (``autowrap_functions``), so it still runs on real tensors in the rewritten model;
2. non-tensor arguments seen on the example call (``mask=None``, flags, tuples of them) are specialised by the caller
   (``regions.concrete_args``), and the rewritten forward guards on them at run time (fallback: original code);
3. given ``facts`` (``regions.tensor_facts``), the tensor arguments' rank and nestedness are those of the example
   call, so a forward's checks on them (``x.dim() == 3``, ``(*x.shape[:-1], -1)``, ``x.is_nested``) read plain
   values, and a ``**kwargs`` the call left empty is ``{}`` (Hugging Face forwards pass it on: ``f(..., **kwargs)``),
   one it filled with plain values only is those values (``output_router_logits=False``); each fact the traced
   code relied on is guarded at run time the same way. Sizes stay symbolic;
4. ``unwrap``: a forward wrapped by a ``(self, *args, **kwargs)`` decorator is traced as the function it wraps
   (``wrappers.py``: Hugging Face's gradient-checkpointing layers; the caller checks that the wrapper passes the
   call through);
5. a submodule whose own forward stops the tracer (a mixture-of-experts block routing tokens by their values) is
   kept as one call (``leaves``), so the code around it (a decoder layer's residual adds and norms) is still
   rewritten, and the submodule runs as it is;
6. a custom ``torch.autograd.Function`` called on traced values stays one call (``apply_function``): fx would
   trace its ``forward`` inline and drop its ``backward``, so the rewritten model would get other gradients;
7. given the ``example`` call's arguments, a branch on sizes (``if q_length > 1``), an iteration over a shape
   (``(*x.shape[:-1], -1)``) or a split, or a traced dtype handed to ``torch.finfo`` takes the example's answer,
   guarded at run time (specialise.py); the answers are kept (``gm.meta["answers"]``) and replayed, question by
   question, when the rewrite traces again (``answers=``).

``library_hooks`` installs the hooks a library adds on first use while the analysis and the rewrite trace.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import operator
import os
import sys
import traceback
import types

import torch
import torch.fx as fx
from torch import nn

from opsnn_lab._hooks import _HOOK_DICTS, has_hooks
from opsnn_lab._randomness import enter_module, exit_module
from opsnn_lab.fusion import checkpointing
from opsnn_lab.fusion.graph import is_leaf_module
from opsnn_lab.fusion.instance import instance_state, restore_instance_state
from opsnn_lab.fusion.specialise import (
    Answers,
    GuardAfterState,
    answerable,
    check_guards,
    expect,
    expect_dtype,
    expect_len,
    runs_real_code,
)
from opsnn_lab.fusion.wrappers import unwrapped_forward

__all__ = ["trace_region", "library_hooks", "kwargs_values", "apply_function", "power"]


def kwargs_values(fact: dict) -> dict | None:
    """The values a ``**kwargs`` fact says the traced code took (``{}`` for ``{"empty": True}``, else its
    ``"constant"``), or None for a tensor argument's fact and for a ``**kwargs`` holding tensors (``"tensors"``:
    the traced code takes that argument and reads them from it)."""
    if fact.get("empty"):
        return {}
    return None if "tensors" in fact else fact.get("constant")


def _blocker(exc: BaseException, module: nn.Module):
    """The plain function called from ``forward`` that raised, if any (a candidate for autowrap)."""
    frames = traceback.extract_tb(exc.__traceback__)
    fwd_file = inspect.getsourcefile(type(module).forward)
    for outer, inner in zip(frames, frames[1:]):
        if outer.name == "forward" and outer.filename == fwd_file:
            fn = type(module).forward.__globals__.get(inner.name)
            if isinstance(fn, types.FunctionType):
                return fn
    return None


class _Proxy(fx.Proxy):
    """fx's proxy, whose ``len()`` the tracer may answer from the example (``len(x.shape)``; Python asks it too when
    a star builds a tuple: ``(*x.shape[:-1], -1)``)."""

    def __len__(self) -> int:
        return self.tracer.length(self)

    def __setitem__(self, key, value) -> None:
        """``x[i] = v`` is one call of the code (fx's proxy has no item assignment; the grouped mixture-of-experts
        forward restores its token order so: ``inv_perm[perm] = arange``); the rewrite keeps it, a write."""
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


class _InputProxy(_Proxy):
    """A tensor argument of the traced forward whose rank and nestedness are the example's: ``dim()``, ``ndim``,
    ``is_nested`` are plain values and ``shape`` / ``size()`` a tuple of one size proxy per dimension (so it
    slices and unpacks). Each fact read is noted in ``tracer.facts_read`` for the run-time guard."""

    def __init__(self, node: fx.Node, tracer, name: str, facts: dict):
        super().__init__(node, tracer)
        self._name, self._facts = name, facts

    def _read(self, fact: str):
        self.tracer.facts_read.setdefault(self._name, {})[fact] = self._facts[fact]
        return self._facts[fact]

    def _sizes(self) -> tuple:
        size = super().__getattr__("size")
        return tuple(size(i) for i in range(self._read("ndim")))

    def __getattr__(self, k):
        if k in ("ndim", "is_nested"):
            return self._read(k)
        if k in ("dim", "ndimension"):
            ndim = self._read("ndim")
            return lambda: ndim
        if k == "shape":
            return self._sizes()
        if k == "size":
            size = super().__getattr__("size")
            return lambda *a, **kw: size(*a, **kw) if a or kw else self._sizes()
        return super().__getattr__(k)


class _ObjectProxy(fx.Proxy):
    """An object argument of the traced forward (a key/value cache): ``isinstance`` checks against the class of
    the example's argument, as Python's ``isinstance`` falls back on ``__class__``. fx's plain proxy answers
    False to every class, so ``if isinstance(cache, EncoderDecoderCache)`` took the other branch, silently; the
    rewritten forward runs only for an argument of this class (``regions.facts_hold``). A class that cannot be
    imported by name makes ``isinstance`` raise, so the region is not traced."""

    def __init__(self, node: fx.Node, tracer, type_name: str):
        super().__init__(node, tracer)
        self._type_name = type_name

    @property
    def __class__(self):  # noqa: D105 - read by isinstance
        module, _, qualname = self._type_name.partition(":")
        try:
            cls = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
        except (ImportError, AttributeError):
            raise fx.proxy.TraceError(f"isinstance on an argument of class {self._type_name}, which cannot be "
                                      "found by name") from None
        return cls


class _Tracer(fx.Tracer):
    """Keeps opsnn_lab.ops modules (e.g. the counter-based Dropout) as calls, as the run-time trace does.

    ``output_type``: the class of the value the forward returned when it is a dict subclass (a Hugging Face
    ``ModelOutput``): fx's code returns a plain dict there, which the rewritten forward turns back into it.
    ``tensor_facts``: the example's facts per tensor argument (``tensor_facts``), given only on the retry.
    """

    output_type: type | None = None
    flat_output_type: type | None = None
    _depth = 0
    # a buffer the code reads is a traced value (fx would run the ops on it at trace time and keep the result as a
    # constant: stale once the buffer changes, moves or is loaded)
    proxy_buffer_attributes = True

    def __init__(self, autowrap_functions=(), tensor_facts=None, leaves=(), example=None, answers=None, held=None):
        # the rewrite's keying calls (region_rewrite._name_inlined_draws) stay calls when fx traces the rewritten code
        # again: it does so to unpickle a region (this class is the GraphModule's ``_tracer_cls``)
        super().__init__(autowrap_functions=(*autowrap_functions, enter_module, exit_module))
        self.held = dict(held or {})  # tuple arguments the code sees as constants (fx's own would flatten them)
        self.example, self.given = example, answers
        self.answers: Answers | None = None
        self.tensor_facts, self.facts_read = dict(tensor_facts or {}), {}
        self.empty_kwargs: list[fx.Node] = []  # their placeholders, dropped from the graph after the trace
        self.kept_kwargs: list[fx.Node] = []  # those of a **kwargs holding tensors, kept
        self.leaves, self.leaf_ids = tuple(leaves), set()
        self.failed_child: str | None = None  # the innermost submodule whose forward raised, by path

    def trace(self, root, concrete_args=None):
        self.leaf_ids = {id(root.get_submodule(p)) for p in self.leaves}
        self.answers = Answers(root, self.example, self.given)
        self.start_mode = self.grad_mode = torch.is_grad_enabled()
        self.entry_mode = None
        with _tracing_patches(self):
            return super().trace(root, concrete_args)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        """A node, after a switch of the gradient mode where the code switched it (``torch.no_grad()``,
        ``set_grad_enabled``, a ``@torch.no_grad()`` forward): fx records no such switch, so the traced code ran the
        ops of a no-grad block with gradients on, and a fused model computed other gradients than the model (a
        recurrent block's no-grad steps backpropagated). Back to the mode the trace began in is back to the
        call's own mode (read where the code had not switched it yet), at the end of a block and at the output."""
        mode = torch.is_grad_enabled()
        if kind in ("call_function", "call_method", "call_module") and mode != self.grad_mode:
            if self.entry_mode is None:
                self.entry_mode = super().create_node("call_function", torch.is_grad_enabled, (), {})
            to = self.entry_mode if mode == self.start_mode else mode
            super().create_node("call_function", torch._C._set_grad_enabled, (to,), {})
            self.grad_mode = mode
        elif kind == "output" and self.grad_mode != self.start_mode:
            super().create_node("call_function", torch._C._set_grad_enabled, (self.entry_mode,), {})
        return super().create_node(kind, target, args, kwargs, name, type_expr)

    def to_bool(self, obj: fx.Proxy) -> bool:
        return self._ask(obj, expect) if self._can_answer(obj) else super().to_bool(obj)

    def iter(self, obj: fx.Proxy):
        if not self._can_answer(obj, "len"):
            return super().iter(obj)
        return iter([obj[i] for i in range(self._ask(obj, expect_len))])

    def length(self, obj: fx.Proxy) -> int:
        return self._ask(obj, expect_len) if self._can_answer(obj, "len") else fx.Proxy.__len__(obj)

    def dtype(self, obj: fx.Proxy) -> torch.dtype:
        """The example's dtype where the code hands a traced one to ``torch.finfo`` / ``torch.iinfo``."""
        if not self._can_answer(obj):
            raise TypeError(f"{obj} is a traced value, not a dtype")
        return getattr(torch, self._ask(obj, expect_dtype))

    def _ask(self, obj: fx.Proxy, guard):
        """The example's answer (``bool`` for ``expect``, ``len`` for ``expect_len``, a dtype's name for
        ``expect_dtype``), and its guard node, which keeps the line of model code that asked (for the messages of
        ``check_guards``)."""
        user = [f for f in traceback.extract_stack() if not f.filename.startswith((_TORCH_DIR, _OWN_DIR, "<"))]
        where = f"{os.path.basename(user[-1].filename)}:{user[-1].lineno} `{(user[-1].line or '').strip()}`" \
            if user else ""
        got = self.answers.answer(obj.node, {expect: "bool", expect_len: "len"}.get(guard, "dtype"), where)
        self.create_proxy("call_function", guard, (obj, got), {}).node.meta["where"] = where
        return got

    def _can_answer(self, obj: fx.Proxy, kind: str = "bool") -> bool:
        return self.answers is not None and self.answers.active and answerable(obj.node, kind)

    def call_module(self, m, forward, args, kwargs):
        if _hidden_function(m, self):
            # a function made a module but not registered under the root (Hugging Face's kernel-hub wrappers:
            # `apply_rotary_pos_emb` kept in `self._kernel_funcs`): no state and no hooks, so its code is traced in
            # place, as the function it stands for (fx would stop: "module is not installed as a submodule")
            return forward(*args, **kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_child is None:  # the innermost call sees the error first
                self.failed_child = next((p for p, sub in self.root.named_modules() if sub is m), None)
            raise

    def proxy(self, node: fx.Node):
        name = str(node.target).lstrip("*")
        if node.op == "placeholder" and name in self.held:  # a tuple of plain values, guarded by the caller
            return self.held[name]
        if node.op == "placeholder" and name in self.tensor_facts:
            facts = self.tensor_facts[name]
            if "tensors" in facts:  # **kwargs holding tensors: its constants as they are, each tensor read from it
                self.facts_read[name] = dict(facts)
                self.kept_kwargs.append(node)
                whole = _Proxy(node, self)
                return {**facts["constant"], **{k: whole[k] for k in facts["tensors"]}}
            taken = kwargs_values(facts)
            if taken is not None:  # **kwargs: the forward sees {} or its constants (guarded)
                self.facts_read[name] = dict(facts)
                self.empty_kwargs.append(node)
                return dict(taken)
            if "type" in facts:  # an object argument (a cache): isinstance sees the example's class
                self.facts_read[name] = dict(facts)
                return _ObjectProxy(node, self, facts["type"])
            return _InputProxy(node, self, name, self.tensor_facts[name])
        return _Proxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # A module already rewritten at module level (patch.py) stays a call, so its patch runs; so does one
        # with hooks, so they fire (Hugging Face records hidden states and attentions with forward hooks).
        # Built-in modules are leaves as in fx, except the composites the run-time trace looks into too
        # (graph.is_leaf_module: nn.TransformerEncoderLayer runs its Linears and norms as a user module would).
        patched = callable(m.__dict__.get("forward"))
        return patched or has_hooks(m) or is_leaf_module(m) or id(m) in self.leaf_ids

    def create_arg(self, a):
        if self._depth == 0:  # the last top-level value turned into graph arguments is the forward's output
            self.output_type = type(a) if isinstance(a, dict) and type(a) is not dict else None
            # fx's flattened output (see _drop_empty_kwargs) is a list holding the value: its class
            self.flat_output_type = next((type(v) for v in a if isinstance(v, dict) and type(v) is not dict),
                                         None) if type(a) is list and len(a) == 1 else None
        self._depth += 1
        try:
            return super().create_arg(a)
        finally:
            self._depth -= 1


def apply_function(function: str, *args, **kwargs):
    """``Function.apply(*args, **kwargs)`` for the custom autograd Function named ``"module:qualname"``: one node
    of traced code (fx's arguments cannot hold a class; a name also pickles with the rewritten model)."""
    cls = _FUNCTIONS.get(function)
    if cls is None:
        module, _, qualname = function.partition(":")
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        _FUNCTIONS[function] = cls
    return cls.apply(*args, **kwargs)


_FUNCTIONS: dict[str, type] = {}  # by name: those traced in this process (a class defined in a function too)
_APPLY = torch.autograd.Function.__dict__["apply"]  # the classmethod every custom Function inherits


@contextlib.contextmanager
def _tracing_patches(tracer: _Tracer):
    """While ``tracer`` traces: ``SomeFunction.apply`` on traced values makes one ``apply_function`` node,
    ``torch.finfo`` / ``torch.iinfo`` of a traced dtype take the example's (guarded), ``torch.is_tensor`` of a
    tensor argument is True (guarded) and of any other traced value stops the trace, and a random factory of plain
    sizes is a call of the code (``_FACTORIES``), and an autocast block is recorded (``enter_autocast``)."""
    def apply(cls, *args, **kwargs):
        proxies = _proxies(args, kwargs)
        if not proxies:
            return _APPLY.__func__(cls, *args, **kwargs)
        name = f"{cls.__module__}:{cls.__qualname__}"
        _FUNCTIONS[name] = cls
        return proxies[0].tracer.create_proxy("call_function", apply_function, (name, *args), kwargs)

    def info(real):
        def of(type=None):  # noqa: A002 - torch.finfo's parameter name
            if isinstance(type, fx.Proxy):
                type = tracer.dtype(type)
            return real() if type is None else real(type)
        return of

    def drawn(real):
        def factory(*args, **kwargs):
            if _proxies(args, kwargs) or kwargs.get("generator") is not None:
                return real(*args, **kwargs)
            return tracer.create_proxy("call_function", real, args, kwargs)
        return factory

    def is_tensor(obj):
        if not isinstance(obj, fx.Proxy):
            return _IS_TENSOR(obj)
        if isinstance(obj, _InputProxy):  # a tensor argument of the example: guarded to be one at each call
            obj.tracer.facts_read.setdefault(obj._name, {})
            return True
        # fx would say False for every traced value, tensor or not, and the code would take that branch silently
        # (diffusers' UNet2DModel wrapped its timestep tensor in torch.tensor([...]))
        raise fx.proxy.TraceError(f"torch.is_tensor of a traced value (`{obj.node.name}`) is not known here")

    def assign(module, name, value):
        # fx records no assignment: the code would drop it, computed (``self.count += 1``, an EMA written ``self.avg
        # = m * self.avg + ...``, the frames a causal conv keeps for its next call, MagVit's ``self.prev_features =
        # x[:, :, -2:].clone()``) or not (a cache cleared for the next video, ``self.prev_features = None``).
        # Stopping here keeps the module writing one call. Only a write of the value the attribute holds is left
        # out, unless a module kept as one call (which runs no code while tracing) may have changed it by then.
        if runs_real_code() or (module is tracer.root and name.startswith(_FX_CONSTANTS)):
            return _SETATTR(module, name, value)  # an answer's step run for real; fx's constant tensors of the code
        traced = []
        fx.node.map_aggregate(value, lambda v: traced.append(v) if isinstance(v, fx.Proxy) else None)
        if traced or not _holds(module, name, value) or _inside_leaf(tracer, module):
            what = "a buffer or Parameter" if name in module.__dict__.get("_buffers", ()) or \
                name in module.__dict__.get("_parameters", ()) else "an attribute"
            how = "a computed value" if traced else f"{type(value).__name__}"
            raise fx.proxy.TraceError(f"`{type(module).__name__}.{name}` ({what}) is assigned {how} in the forward, "
                                      "which traced code would not write")
        _SETATTR(module, name, value)

    def enter_autocast(block):
        # fx records no autocast block: a region's `with torch.autocast(..., enabled=False)` around a float32
        # computation (a rotary table, a router) ran under the caller's autocast. The block becomes two nodes, as
        # torch.export records it, the block's own settings taken as the code gave them.
        if runs_real_code():
            return _AUTOCAST_ENTER(block)
        block._opsnn_entered = tracer.create_proxy("call_function", torch.amp._enter_autocast, (
            block.device, block.fast_dtype, block._enabled, block._cache_enabled), {})
        return block

    def exit_autocast(block, *exc):
        entered = block.__dict__.pop("_opsnn_entered", None)
        if entered is None:
            return _AUTOCAST_EXIT(block, *exc)
        tracer.create_proxy("call_function", torch.amp._exit_autocast, (entered,), {})
        return False

    torch.autograd.Function.apply = classmethod(apply)
    torch.finfo, torch.iinfo, torch.is_tensor = info(_FINFO), info(_IINFO), is_tensor
    nn.Module.__setattr__ = assign
    for name, real in _FACTORIES.items():
        setattr(torch, name, drawn(real))
    if _AUTOCAST_RECORDED:
        _AUTOCAST.__enter__, _AUTOCAST.__exit__ = enter_autocast, exit_autocast
    try:
        yield
    finally:
        _AUTOCAST.__enter__, _AUTOCAST.__exit__ = _AUTOCAST_ENTER, _AUTOCAST_EXIT
        nn.Module.__setattr__ = _SETATTR
        torch.autograd.Function.apply = _APPLY
        torch.finfo, torch.iinfo, torch.is_tensor = _FINFO, _IINFO, _IS_TENSOR
        for name, real in _FACTORIES.items():
            setattr(torch, name, real)


def _proxies(args, kwargs) -> list:
    """The traced values among a call's arguments (in containers too)."""
    found = []
    fx.node.map_aggregate((args, kwargs), lambda a: found.append(a) if isinstance(a, fx.Proxy) else None)
    return found


_FINFO, _IINFO, _IS_TENSOR = torch.finfo, torch.iinfo, torch.is_tensor
_AUTOCAST = torch.amp.autocast_mode.autocast
_AUTOCAST_ENTER, _AUTOCAST_EXIT = _AUTOCAST.__enter__, _AUTOCAST.__exit__
_AUTOCAST_RECORDED = hasattr(torch.amp, "_enter_autocast")  # torch's own graph calls for an autocast block
_SETATTR = nn.Module.__setattr__
# random factories called with plain sizes only (``torch.rand(8)``): fx would run them once, while it traces, and
# the code would replay that one draw as a constant at every call; each is one call of the traced code instead
_FACTORIES = {name: getattr(torch, name) for name in ("rand", "randn", "randint", "randperm")}


def _hidden_function(m: nn.Module, tracer: fx.Tracer) -> bool:
    """Whether ``m`` is a stateless, hook-free module that is not one of the traced root's submodules."""
    paths = getattr(tracer, "submodule_paths", None)  # fx's {module: path} of the root, made by trace()
    registered = m in paths if paths is not None else any(sub is m for sub in tracer.root.modules())
    if registered or has_hooks(m):
        return False
    return next(m.parameters(), None) is None and next(m.buffers(), None) is None


_TORCH_DIR = os.path.dirname(os.path.dirname(fx.__file__)) + os.sep  # not torchvision's, which starts alike
_OWN_DIR = os.path.dirname(__file__) + os.sep
_RETRIES = 8  # traces of one region: each retry keeps one more helper or submodule opaque


@contextlib.contextmanager
def library_hooks(model: nn.Module):
    """The hooks a library adds on first use, installed while the analysis and the rewrite look at the model,
    then removed (they hold closures that do not pickle, and ``model`` must leave as it came): Hugging Face
    models record ``output_hidden_states`` / ``output_attentions`` with forward hooks on their layers, installed
    the first time a call asks for them. With them present, a region's fx code calls those layers instead of
    inlining them, so the outputs are recorded whenever a later call asks."""
    install = _hf_hook_installer()
    if install is None:
        yield
        return
    before = {m: ({k: set(getattr(m, k)) for k in _HOOK_DICTS}, m.__dict__.get(_HF_FLAG, _ABSENT))
              for m in model.modules()}
    try:
        for module in model.modules():
            if getattr(module, "_can_record_outputs", None):
                try:
                    install(module)
                except Exception:  # noqa: BLE001 - a model this installer does not know: its first call will
                    pass
        yield
    finally:
        for m, (kept, flag) in before.items():
            for k, keys in kept.items():
                hooks = getattr(m, k)
                for key in [key for key in hooks if key not in keys]:
                    del hooks[key]
            if flag is _ABSENT:
                m.__dict__.pop(_HF_FLAG, None)
            else:
                m.__dict__[_HF_FLAG] = flag


_HF_FLAG = "_output_capturing_hooks_installed"  # set on each model the installer hooked
_ABSENT = object()


def _hf_hook_installer():
    """transformers' installer of its output-capturing hooks, where transformers is loaded and has one."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # another transformers version: nothing to install here
        return None
    return maybe_install_capturing_hooks


def trace_region(module: nn.Module, concrete: dict, training: bool, wrapped=(),
                 facts: dict | None = None, unwrap: bool = False, leaves=(),
                 leaf_ok=None, example: dict | None = None, answers: list | None = None) -> tuple[fx.GraphModule, list]:
    """fx-trace ``module`` in train or eval mode (flags restored), autowrapping helpers that stop the tracer.

    ``leaves``: submodules (paths from ``module``) kept as one call each. ``leaf_ok(path)``: whether a submodule
    whose own forward stops the tracer may be kept so too (the caller knows it returned one tensor: the traced
    code gets a proxy for its result, and a tuple holding None would take the wrong branch at an ``is None``);
    the final list is ``gm.meta["leaves"]``.

    ``facts`` (from ``tensor_facts``) gives the tensor arguments the example's rank; the facts the code read
    are in ``gm.meta["facts_read"]``, for the caller to guard on. ``unwrap``: trace the function the forward's
    wrapper wraps (``gm.meta["unwrapped"]``; see wrappers.py). ``example`` (the call's arguments by name) answers
    the code's questions on sizes, ``answers`` replays those of an earlier trace; what was answered is in
    ``gm.meta["answers"]`` (specialise.py).

    The modules' own attributes are restored afterwards too: a forward that caches in ``self`` (LeViT's
    eval-mode attention biases) would otherwise keep fx proxies there, which do not pickle."""
    flags = {m: m.training for m in module.modules()}
    state = instance_state(module)
    module.train(training)
    wrapped, leaves = list(wrapped), list(leaves)
    # fx specialises plain values itself; a tuple of them it would flatten into its own calling convention, so the
    # tracer hands it to the code as a constant (a plan from JSON holds it as a list)
    plain = {k: v for k, v in concrete.items() if not isinstance(v, (tuple, list))}
    held = {k: tuple(v) for k, v in concrete.items() if isinstance(v, (tuple, list))}
    try:
        for _ in range(_RETRIES):
            tracer = _Tracer(tuple(wrapped), facts, leaves, example, answers, held)
            try:
                with unwrapped_forward(module) if unwrap else contextlib.nullcontext(), checkpointing.refused():
                    graph = tracer.trace(module, concrete_args=plain or None)
                try:
                    draws_before_guard = check_guards(graph, module, tracer.tensor_facts, tracer.facts_read)
                except GuardAfterState as exc:  # a child's code asked: that child may be kept as one call
                    tracer.failed_child = exc.module or None
                    raise
                flattened_output = _drop_empty_kwargs(graph, tracer)
                _keep_negative_bases(graph)
                for node in graph.nodes:  # the call of a submodule named ``self`` (ConvBERT's attention.self):
                    if node.name == "self":  # fx names its result ``self``, which shadows the module in the code
                        node._rename("self_module")
                    if isinstance(node.type, str):  # an annotation left a string (``from __future__ import
                        node.type = None  # annotations``): fx makes it a global of the code, which cannot pickle
                gm = fx.GraphModule(tracer.root, graph, type(module).__name__)
                gm.meta["output_type"] = flattened_output or tracer.output_type
                gm.meta["facts_read"] = tracer.facts_read
                gm.meta["restore_rng"] = draws_before_guard  # a guard's miss puts the generators back first
                gm.meta["unwrapped"] = unwrap
                gm.meta["leaves"] = leaves
                gm.meta["answers"] = tracer.answers.asked if tracer.answers.active else None
                return gm, wrapped
            except Exception as exc:  # noqa: BLE001 - any tracer failure sends us one level down
                fn = _blocker(exc, module)
                if fn is not None and fn not in wrapped:
                    wrapped.append(fn)
                elif tracer.failed_child and tracer.failed_child not in leaves and leaf_ok and \
                        leaf_ok(tracer.failed_child):
                    leaves.append(tracer.failed_child)
                else:
                    raise
        raise RuntimeError("too many helper functions and submodules stop the tracer")
    finally:
        for m, flag in flags.items():
            m.training = flag
        restore_instance_state(state)


_FX_CONSTANTS = ("_tensor_constant", "_torchbind_obj")  # fx.Tracer.create_arg's names on the root


def _holds(module: nn.Module, name: str, value) -> bool:
    """Whether ``module.name`` is ``value`` already (a write that changes nothing)."""
    for where in (module.__dict__.get("_parameters", {}), module.__dict__.get("_buffers", {}),
                  module.__dict__.get("_modules", {}), module.__dict__):
        if name in where:
            return where[name] is value
    return False


def _inside_leaf(tracer, module: nn.Module) -> bool:
    """Whether ``module`` is, or is inside, a module the trace keeps as one call."""
    paths = {id(m): p for p, m in tracer.root.named_modules()}
    path = paths.get(id(module))
    if path is None:
        return False
    parts = path.split(".") if path else []
    return any(tracer.is_leaf_module(tracer.root.get_submodule(".".join(parts[:i])), ".".join(parts[:i]))
               for i in range(1, len(parts) + 1))


def power(base, exponent):
    """``base ** exponent``, called by name in traced code (``_keep_negative_bases``)."""
    return base ** exponent


def _keep_negative_bases(graph: fx.Graph) -> None:
    """fx writes ``operator.pow(-1, x)`` as ``-1 ** x``, which Python reads as ``-(1 ** x)``: Cosmos' wavelet
    filters, ``h * (-1) ** arange``, came out all of one sign. Such a power is called by name instead."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.pow and node.args \
                and isinstance(node.args[0], (int, float)) and repr(node.args[0]).startswith("-"):  # -0.0 too
            node.target = power


def _drop_empty_kwargs(graph: fx.Graph, tracer: _Tracer) -> type | None:
    """Remove the ``**kwargs`` placeholders the forward saw as ``{}``. That ``{}`` was the one container among
    the forward's arguments, for which fx generated code that flattens the arguments and the output against
    specs kept on the GraphModule (``_PyTreeCodeGen``; the rewritten forward runs with the region as ``self``,
    which has none): the output is given its structure back and the code is plain fx code again. Returns the
    output's class when it is a dict subclass (``_Tracer.output_type``: fx saw only the flattened values). A
    ``**kwargs`` holding tensors and a tuple the code took as a constant keep their placeholders, and need plain
    code as well (fx's flattening code is not valid Python with a ``**kwargs`` in it)."""
    if not (tracer.empty_kwargs or tracer.kept_kwargs or tracer.held):
        return None
    for node in tracer.empty_kwargs:
        graph.erase_node(node)
    info = getattr(graph._codegen, "pytree_info", None)
    if info is None:
        return None
    kind = None
    if info.out_spec is not None:
        import torch.utils._pytree as pytree

        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        output.args = (pytree.tree_unflatten(list(output.args[0]), info.out_spec),)
        kind = info.out_spec.type if isinstance(info.out_spec.type, type) and \
            issubclass(info.out_spec.type, dict) and info.out_spec.type is not dict else None
        if info.out_spec.is_leaf():  # a class pytree does not know (a dict subclass): one leaf, the value
            kind = tracer.flat_output_type
    graph._codegen = fx.graph.CodeGen()
    return kind
