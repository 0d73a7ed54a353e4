"""The base of every module-level patch (patch.py) and of a region's forward (region_forward.py): ``Patch``, an
object bound as ``module.__dict__["forward"]`` that checks, at each call, whether its fused code may run
(staleness.py), and ``own_code``, when none may.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from opsnn_lab.fusion.patterns import pattern_of
from opsnn_lab.fusion.staleness import drifted, hooked, mode_change, qualified, warn_changed, warn_hooked

__all__ = ["Patch", "own_code", "CONSTANT"]

CONSTANT = "_opsnn_constant_"  # the prefix of a constant tensor a rewritten region's code reads from the region


class Patch:
    """An instance ``forward``; ``host`` is the module it is bound on."""

    def __init__(self, host: nn.Module):
        self.host = host

    @property
    def __signature__(self) -> inspect.Signature:
        """The patched forward's signature, for code that reads ``inspect.signature(module.forward)``: Hugging
        Face's ``generate`` looks for ``attention_mask``, ``position_ids`` and ``logits_to_keep`` there, its Trainer
        for the dataset columns and loss keywords the model takes. A patch read ``(*args, **kwargs)`` (the root
        region of a fused Mamba, FNet, LayoutLM or ViT-family classifier)."""
        return inspect.signature(type(self.host).forward.__get__(self.host))

    @property
    def __code__(self):
        """The class forward's code object: ``torch.export`` reads ``module.forward.__code__`` (non-strict mode)."""
        return type(self.host).forward.__code__

    def keeps_rank(self) -> bool:
        """Whether the patched module's output has its input's rank (ranks.py reads it): its fused op's row says
        (``Pattern.keeps_rank``); a module that passes on what its chain's head computed says True."""
        pattern = self.__dict__.get("pattern")
        return pattern is not None and pattern_of(pattern).keeps_rank

    def ops(self) -> list[nn.Module]:
        """The fused ops this patch runs."""
        op = self.__dict__.get("op")
        return [op] if op is not None else []

    def _sync(self, op: nn.Module, mode: bool | None = None) -> None:
        mode = self.host.training if mode is None else mode  # model.train()/eval() set the host's flag
        if op.training != mode:
            op.train(mode)

    def _odd_mode(self, modules) -> int | None:
        """The index of a module in ``modules`` (the host first) whose training flag the fused code does not take:
        traced code runs every module it inlines in the host's mode (a Dropout set to eval inside a training
        layer, a frozen BatchNorm); None when all agree."""
        return next((i for i, m in enumerate(modules) if m is not None and m.training != self.host.training), None)

    def _modules_now(self, key, paths) -> list[nn.Module | None]:
        """The modules now at ``paths`` (from ``host``; None where nothing is), each read from its parent's children
        (~0.1 us): a module put in place of one after fusion (a LoRA wrapper, ``make_reproducible``'s counter twin
        of a Dropout) is the one returned, and a replaced parent shows at its own path."""
        found = self.__dict__.setdefault("_found", {})
        if key not in found:
            found[key] = [self._parent_of(p) for p in paths]
        return [held if name is None else held._modules.get(name) if held is not None else None
                for held, name in found[key]]

    def _parent_of(self, path) -> tuple:
        if isinstance(path, nn.Module):  # a patch pickled before it held paths holds the modules themselves
            return path, None
        parent, _, name = path.rpartition(".")
        try:
            return self.host.get_submodule(parent), name
        except AttributeError:
            return None, name

    def _modules_at(self, key, paths) -> list[nn.Module | None]:
        """``[host, *_modules_now(key, paths)]``: what ``_stale`` checks."""
        return [self.host, *self._modules_now(key, paths)]

    def _stale(self, modules, paths, recorded, recorded_settings, what: str) -> bool:
        """Whether the fused code must not run now: a module it runs inline (``modules``: the host and those now at
        ``paths``, ``_modules_at``) has a hook (``hooked``), was replaced or had a setting changed since fusion
        (``drifted``, against ``recorded`` - None for a patch pickled before it kept them - and
        ``recorded_settings``), or is in another mode than the fused code runs it in (``_odd_mode``); says so
        once."""
        hook, kind = hooked(m for m in modules[1:] if m is not None)
        if hook is not None:
            warn_hooked(self, qualified(self.host, self.path, hook), what, kind)
            return True
        drift = drifted(modules, recorded or modules, recorded_settings)
        if drift is None:
            odd = self._odd_mode(modules)
            drift = None if odd is None else (odd, mode_change(modules, odd))
        if drift is not None:
            warn_changed(self, self._where(paths, drift[0]), what, drift[1])
        return drift is not None

    def _where(self, paths, i: int) -> str:
        """The qualified name of module ``i`` of ``[host, *paths]``."""
        path = self.__dict__.get("path", "")
        return path if i == 0 else ".".join(p for p in (path, str(paths[i - 1])) if p)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_found"}  # found again after a load


def own_code() -> bool:
    """Whether every patch runs its module's own forward for this call: under ``torch.export`` (an exported program
    is the model's graph) and inside a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev`` over
    ``functional_call``: per-sample gradients, MAML), which refuses the fused ops' autograd Functions (they keep
    ``forward(ctx, ...)``, without the ``setup_context`` the transforms need). ~0.2 us; Dynamo folds it to False
    while compiling, where the fused ops are opaque calls."""
    return torch.compiler.is_exporting() or \
        (not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None)
