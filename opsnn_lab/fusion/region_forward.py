"""``FxForward``: a region's rewritten code bound as its forward, with the guards that keep it eager's.

It runs the traced code (region_rewrite.py) in place of the region's forward where that code is what the call
computes: the plain arguments it was traced for (else a code traced for the call's own, ``_alternate``), the ranks
it relied on, no hook, setting, module, tensor or mode changed since fusion (staleness.py); otherwise the
original forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
import warnings

import torch
from torch import nn

from opsnn_lab._randomness import draw_state, draw_streams, streams_made
from opsnn_lab.fusion.instance import dropout_streams, host_rngs, instance_state, restore_instance_state
from opsnn_lab.fusion.patch_base import Patch, own_code
from opsnn_lab.fusion.region_rewrite import FusedSlot, inlined_paths, region_slots, slot_ops, trace_variants
from opsnn_lab.fusion.regions import (
    bind_call,
    concrete_args,
    error_line,
    facts_hold,
    object_facts,
    signature,
    tensor_facts,
)
from opsnn_lab.fusion.runtime import buffers_kept, flatten_tensors
from opsnn_lab.fusion.specialise import SpecialisationMiss
from opsnn_lab.fusion.staleness import modal, settings
from opsnn_lab.fusion.tracer import kwargs_values

__all__ = ["FxForward"]

_MISSING = object()


class FxForward(Patch):
    """A region's forward after an fx rewrite: the traced code in train or eval mode, the original otherwise.

    In eval mode without grad (``torch.no_grad``, ``inference_mode``) the original runs: no activation is saved
    there, so fusion gains nothing, and the original keeps its own inference path (``nn.TransformerEncoderLayer``'s
    fast path: the traced code was 1.22x its time). Its results are then eager's, bit for bit.

    Bound on the instance (``region.__dict__["forward"]``), never a class made at run time, so the model
    pickles. Arguments are bound to the original signature first and handed to the traced code parameter by
    parameter (fx keeps their order but renames a specialised one: ``height`` -> ``height_1``), so every
    keyword the original accepts (``output_hidden_states=``, ``return_dict=``) is accepted. A dict subclass
    the original returns (a Hugging Face ``ModelOutput``), which fx's code returns as a plain dict, is rebuilt.
    """

    warned = False  # defaults for a region pickled before these fields existed
    path = ""

    def __init__(self, host: nn.Module, variants: dict, concrete: dict, path: str = "", route: dict | None = None,
                 keys: dict | None = None):
        super().__init__(host)
        self.path = path  # the region's qualified name, for the warning a hook added later brings
        # how it was traced and what it fused, to trace it again for a call with other plain arguments
        # (``_alternate``); None for an alternate itself
        self.route, self.keys, self.alternates = route, keys, {}
        # a tuple argument the code was specialised for is a list in a plan from JSON
        self.variants = variants
        self.concrete = {k: tuple(v) if isinstance(v, list) else v for k, v in concrete.items()}
        self.output_types = {k: gm.meta.get("output_type") for k, gm in variants.items()}
        self.facts = {k: gm.meta.get("facts_read", {}) for k, gm in variants.items()}  # tensor ranks it relied on
        # the submodules whose forwards the traced code runs inline: if one gains hooks later (a user's, or Hugging
        # Face's output capture installed on first use), this region runs its original forward, so they fire
        self.inlined = {k: inlined_paths(host, gm) for k, gm in variants.items()}
        # the plain attributes of the region and of those submodules, which the code holds as constants (a dropout's
        # p, a drop path's rate) or a fused op took over: if one changes, this region runs its original forward
        self.recorded = {k: [host, *self._modules_now(k, self.inlined[k])] for k in variants}
        self.settings = {k: settings(self.recorded[k], slot_ops(gm)) for k, gm in variants.items()}
        # traced without the forward's wrapper (fusion.wrappers): with gradient checkpointing on, the wrapper
        # checkpoints (Hugging Face's layers), and so does this forward (``_checkpoint``)
        self.unwrapped = any(gm.meta.get("unwrapped") for gm in variants.values())
        # a guard comes after a draw (specialise.check_guards): the generators' state is kept at each call and put
        # back before the original forward runs on a miss, so it draws what eager draws
        self.restore_rng = {k: bool(gm.meta.get("restore_rng")) for k, gm in variants.items()}
        # the code switches gradients or autocast where the model's code does (tracer.py): kept at each call
        self.switches_modes = {k: _switches_modes(gm) for k, gm in variants.items()}
        self.modal_slots = {k: self._modal_slots(k, gm) for k, gm in variants.items()}

    def _modal_slots(self, key, gm) -> tuple:
        """``(exempt, groups)``: the modules (indices into ``[host, *inlined]``) whose mode a fused op takes over,
        Dropouts and BatchNorms it absorbed that the code runs nowhere else, and per fused slot, those of its own
        (``((slot, indices), ...)``). Each op runs in its modules' mode (``__call__``), so a BatchNorm frozen in
        eval mode in a training model keeps its chain, and the region, fused; before, the region ran unfused."""
        index = {p: i + 1 for i, p in enumerate(self.inlined.get(key, ()))}
        prefix = f"{self.path}." if self.path else ""
        elsewhere = {next(reversed(stack)).partition("@")[0] for n in gm.graph.nodes
                     if (stack := n.meta.get("nn_module_stack"))}
        groups = []
        for n in gm.graph.nodes:
            slot = gm.get_submodule(n.target) if n.op == "call_module" else None
            if not isinstance(slot, FusedSlot):
                continue
            paths = [p.removeprefix(prefix) for p in slot.fused_modules if p.startswith(prefix)]
            own = tuple(index[p] for p in paths if p in index and p not in elsewhere
                        and modal(self.host.get_submodule(p)))
            if own:
                groups.append((slot, own))
        return frozenset(i for _, own in groups for i in own), tuple(groups)

    def _odd_mode(self, modules) -> int | None:
        """A module the code runs inline in another mode than the host (the code holds the host's), or two that one
        fused op takes over in two modes (one op runs one); None when neither."""
        exempt, groups = self.modal_slots.get(self.host.training, (frozenset(), ()))
        host = self.host.training
        odd = next((i for i, m in enumerate(modules) if m is not None and i not in exempt and m.training != host), None)
        if odd is None:
            odd = next((i for _, own in groups for i in own if modules[i].training != modules[own[0]].training), None)
        return odd

    def ops(self) -> list[nn.Module]:
        return [op for gm in self.variants.values() for op in slot_ops(gm)] + \
            [op for alt in self.__dict__.get("alternates", {}).values() if alt is not None for op in alt.ops()]

    MAX_ALTERNATES = 4  # plain arguments that take many values (a step counter) would trace without end

    def _alternate(self, args, kwargs) -> FxForward | None:
        """The region traced for this call's plain arguments, where they differ from those it was traced for
        (None if they cannot be, or nothing planned fuses there): made on the first such call, kept for the next.

        Hugging Face code hands a layer ``attention_mask=None`` where every token is real (the example one
        usually is) and a tensor where a batch is padded, and ``use_cache`` or ``output_attentions`` flip between
        calls: the code was traced for the example's values only, so every padded batch ran the original forward
        (BERT: 0.83 of eager's activation bytes against 0.65). Traced again for such a call, with the plan's
        chains and the same ops (``region_slots``), the region stays fused; the new code checks hooks, settings and
        modes as the first does."""
        route, keys = self.__dict__.get("route"), self.__dict__.get("keys")
        if not route or keys is None:
            return None
        concrete = concrete_args(self.host, (args, kwargs))
        facts = {**tensor_facts(self.host, (args, kwargs)), **object_facts(self.host, (args, kwargs))}
        key = tuple(sorted(concrete.items()))
        if not facts_hold(self.facts.get(self.host.training, {}), bind_call(self.host, (args, kwargs)).arguments):
            key = (*key, ("facts", repr(sorted(facts.items()))))  # the same values, objects of other classes
        alternates = self.__dict__.setdefault("alternates", {})
        if key not in alternates:
            if len(alternates) >= self.MAX_ALTERNATES:
                return None
            alternates[key] = self._trace_alternate(concrete, facts, args, kwargs, len(alternates))
        return alternates[key]

    def _trace_alternate(self, concrete: dict, facts: dict, args, kwargs, n: int) -> FxForward | None:
        """``facts``: the call's tensor ranks, and the classes of its objects (a cache where the example had None),
        as the analysis gives its first trace (regions._first_trace)."""
        given = bind_call(self.host, (args, kwargs)).arguments
        differs = ", ".join(f"`{k}` {v!r} -> {concrete[k]!r}" if k in concrete else
                            f"`{k}` {v!r} -> a {type(given.get(k)).__name__}"
                            for k, v in self.concrete.items() if concrete.get(k, _MISSING) != v) or \
            "objects of other classes or tensors of other ranks"
        route = {**self.route, "concrete": concrete, "tensors": facts, "answers": None}
        example = dict(given)
        try:
            with _untouched(self.host, example, self.ops()):
                variants, done = trace_variants(self.host, route, self.keys, region_slots(self.host), f"alt{n}_",
                                                example)
        except Exception as exc:  # noqa: BLE001 - tracer errors have many types: this call's values stay unfused
            warnings.warn(f"opsnn_lab.fusion: the region `{self.path or '<model>'}` was fused for other arguments than "
                          f"this call's ({differs}), and its code cannot be traced for these "
                          f"({type(exc).__name__}: {error_line(exc)[:200]}); such calls run it unfused",
                          RuntimeWarning, stacklevel=5)
            return None
        # no alternates of its own (route None)
        return FxForward(self.host, variants, concrete, self.path) if done else None

    def _streams(self) -> list:
        """The counter streams the region's code may draw from (``_randomness.draw_streams``): found again once
        a stream was made anywhere since (``make_reproducible`` swaps its dropouts in after fusion)."""
        made, streams = self.__dict__.get("_draw_streams", (-1, None))
        if made != streams_made():
            made, streams = streams_made(), draw_streams(self.host)
            self.__dict__["_draw_streams"] = (made, streams)
        return streams

    def __getstate__(self):
        return {k: v for k, v in super().__getstate__().items() if k != "_draw_streams"}  # found after a load

    def __setstate__(self, state):  # a model saved before these fields existed: no rebuild, no hook check
        self.__dict__.update({"output_types": {}, "inlined": {}, "facts": {}, "unwrapped": False,
                              "restore_rng": {}, "switches_modes": {}, "settings": {}, "recorded": {}, "route": None,
                              "keys": None, "alternates": {}, "modal_slots": {}, **state})

    def _traced_for(self, bound) -> bool:
        """Whether the call's plain arguments are those the code was traced for."""
        return all(type(got := bound.arguments.get(k)) is type(v) and got == v for k, v in self.concrete.items())

    def _routes(self, gm) -> list[tuple[str, str, inspect._ParameterKind]]:
        """``(original parameter, traced parameter, its kind)`` per argument of the traced code, made once per
        variant (two signatures and a filter: ~10 us a call otherwise). By name: fx keeps a parameter's name or
        suffixes it (a specialised ``use_cache`` -> ``use_cache_1``, ``input`` -> ``input_1``); by position only
        where a name is neither. Positions alone went wrong where fx leaves out a parameter the original has (a
        keyword-only one: Bart's decoder layers), which fed each specialised value its default instead: a
        ``use_cache`` specialised False then failed fx's own check (``model.config.use_cache = False``)."""
        routes = self.__dict__.setdefault("_route_cache", {})
        key = self.host.training
        if key not in routes:
            traced = list(signature(type(gm).forward).parameters.items())[1:]
            names = list(signature(type(self.host).forward).parameters)[1:]
            by_name = [n if n in names else re.sub(r"_\d+$", "", n) for n, _ in traced]
            if not set(by_name) <= set(names):
                # a **kwargs the traced code took as {} or as constants: not an argument of the traced code
                facts = self.facts.get(key, {})
                by_name = [n for n in names if kwargs_values(facts.get(n, {})) is None]
                if len(by_name) != len(traced):
                    by_name = [name for name, _ in traced]
            routes[key] = [(source, name, p.kind) for source, (name, p) in zip(by_name, traced)]
        return routes[key]

    def _prepared(self):
        """``(traced code, the modules it runs inline)`` for a call now, the code None where the original must run."""
        gm = self.variants.get(self.host.training)
        key = self.host.training
        # a hook on a module the code runs inline, a module replaced, a setting the code holds as a constant changed
        inlined = self.inlined.get(key, ())
        modules = self._modules_at(key, inlined) if gm is not None else ()
        if gm is not None and self._stale(modules, inlined, self.recorded.get(key), self.settings.get(key, ()),
                                          f"the region `{self.path or '<model>'}`"):
            gm = None
        if not self.host.training and not torch.is_grad_enabled() or own_code():
            gm = None  # inference: nothing is saved for a backward, and the original may take a fast path (export, a
            # torch.func transform: the model's own code, patch.own_code)
        return gm, modules

    def __call__(self, *args, **kwargs):
        gm, modules = self._prepared()
        if gm is not None and self.unwrapped and getattr(self.host, "gradient_checkpointing", False) \
                and self.host.training and torch.is_grad_enabled():
            # the layer's wrapper would checkpoint it (Hugging Face's gradient_checkpointing_enable): the traced
            # code runs under that checkpoint, so the layer keeps nothing past its forward, fused or not, and its
            # recompute in backward runs the fused ops (and replays their dropout draws: CounterRNG.next_draw)
            checkpoint = _checkpoint(self.host, kwargs)
            if checkpoint is not None:
                return checkpoint(functools.partial(self._run, gm, modules, True, **kwargs), *args)
            gm = None  # the original: its wrapper checkpoints it
        return self._run(gm, modules, False, *args, **kwargs)

    def _run(self, gm, modules, inner: bool, /, *args, **kwargs):
        """The traced code ``gm`` on a call (None: the original forward). ``inner``: inside the checkpoint this
        forward runs under, where the original runs without its wrapper (which would checkpoint it again)."""
        key = self.host.training
        original = functools.partial(inspect.unwrap(type(self.host).forward) if inner else type(self.host).forward,
                                     self.host)
        bound = None if gm is None else bind_call(self.host, (args, kwargs))
        if bound is None:
            return original(*args, **kwargs)
        # other plain arguments, or an object of another class (None where the example had a cache: use_cache=False,
        # as training and gradient checkpointing set it) or a tensor of another rank: the code traced for them
        if not self._traced_for(bound) or not facts_hold(self.facts.get(key, {}), bound.arguments):
            alt = self._alternate(args, kwargs)
            if alt is None:
                return original(*args, **kwargs)
            return alt._run(*alt._prepared(), True, *args, **kwargs) if inner else alt(*args, **kwargs)
        pos, kw = _arguments(self._routes(gm), bound.arguments)
        if pos is None:
            return original(*args, **kwargs)
        for slot, own in self.modal_slots.get(key, ((), ()))[1]:
            slot.training = modules[own[0]].training  # its op runs in its modules' mode (FusedSlot.forward)
        put_back = draw_state(self._streams(), flatten_tensors((args, kwargs))) \
            if self.restore_rng.get(self.host.training) else None
        try:
            # the code's own gradient and autocast switches undone if it raises between them
            with modes_kept() if self.switches_modes.get(self.host.training) else contextlib.nullcontext():
                out = type(gm).forward(self.host, *pos, **kw)
        except SpecialisationMiss:  # sizes the traced code branched on differ here; what ran before can run again
            if put_back is not None:  # and draw again what it drew
                put_back()
            return original(*args, **kwargs)
        kind = self.output_types.get(self.host.training)
        if kind is not None and type(out) is dict:
            out = kind(**out) if dataclasses.is_dataclass(kind) else kind(out)
        return out


@contextlib.contextmanager
def _untouched(host: nn.Module, example: dict, ops=()):
    """Tracing a region for a call (its size questions run its code on the call's values) leaves what the call
    runs next as it found it: torch's generators (on the devices the call's tensors are on) and Python's and
    numpy's, the counter-RNG streams of the region and of its fused ``ops``, its buffers and plain attributes.
    Before, a router's noise drawn by the trace moved the draws of the call that followed (Phi-MoE's fused layers
    routed other tokens than eager's: 5e-2 apart)."""
    devices = sorted({t.device.index or 0 for t in flatten_tensors(example) if t.is_cuda})
    streams, buffers, state = dropout_streams(host), buffers_kept(host), instance_state(host)
    drawn = [(op, op.rng_seed, op.rng_step) for op in ops if hasattr(op, "set_rng")]
    try:
        with torch.random.fork_rng(devices=devices), host_rngs():
            yield
    finally:
        streams()
        buffers()
        restore_instance_state(state)
        for op, seed, step in drawn:
            op.set_rng(seed, step)


def _checkpoint(host: nn.Module, kwargs: dict):
    """The checkpoint function a layer's forward wrapper would run the layer under (Hugging Face's
    ``_gradient_checkpointing_func``, set by ``gradient_checkpointing_enable``), for the rewritten forward to run
    under the same; None where the wrapper would change the call first (a cache it drops under checkpointing):
    then the original runs, wrapper included."""
    func = host.__dict__.get("_gradient_checkpointing_func")
    if not callable(func):
        return None
    if kwargs.get("use_cache") or (not getattr(host, "_can_checkpoint_with_cache", False) and any(
            kwargs.get(k) is not None for k in ("cache", "layer_past"))):
        return None
    return func


def _arguments(routes, given: dict) -> tuple[list | None, dict]:
    """``(positional, keyword)`` arguments of the traced code for a call bound as ``given`` (the original forward's
    names, defaults applied). Named parameters go by keyword, but for those before a non-empty ``*args``, which
    must be positional for the extra values to reach ``*args`` (diffusers' HunyuanVideo blocks take ``forward(self,
    hidden_states, ..., freqs_cis=None, *args, **kwargs)`` and are called with seven positional values).
    ``(None, {})`` where such a parameter has no value here."""
    var = next((i for i, (source, _, kind) in enumerate(routes)
                if kind == inspect.Parameter.VAR_POSITIONAL and given.get(source)), -1)
    pos, kw = [], {}
    for i, (source, name, kind) in enumerate(routes):
        if source not in given:
            if i < var:
                return None, {}
            continue
        value = given[source]
        if kind == inspect.Parameter.VAR_POSITIONAL:
            pos.extend(value)
        elif kind == inspect.Parameter.VAR_KEYWORD:
            kw.update(value)
        elif kind == inspect.Parameter.POSITIONAL_ONLY or i < var:  # keyword-only ones come after *args
            pos.append(value)
        else:
            kw[name] = value
    return pos, kw


_MODE_SWITCHES = frozenset({torch._C._set_grad_enabled, getattr(torch.amp, "_enter_autocast", None)}) - {None}


def _switches_modes(gm) -> bool:
    return any(n.op == "call_function" and n.target in _MODE_SWITCHES for n in gm.graph.nodes)


@contextlib.contextmanager
def modes_kept():
    """Gradients and autocast (on each device type, with its dtype) as they were when the block began, at its end:
    traced code switches them where the model's code did (tracer.py), and a raise between a switch and its
    restore would leave them switched for the caller."""
    grad = torch.is_grad_enabled()
    autocast = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")}
    try:
        yield
    finally:
        torch._C._set_grad_enabled(grad)
        for d, (enabled, dtype) in autocast.items():
            torch.set_autocast_enabled(d, enabled)
            torch.set_autocast_dtype(d, dtype)
