"""``opaque_to_compile``: ``torch.compiler.disable`` without loading Dynamo in a process that never compiles.

``torch.compiler.disable`` imports ``torch._dynamo`` when it decorates: seconds of imports (4-5 s on a loaded
2-core Xeon) paid by every process that imports the fusion engine, a notebook that fuses and never compiles
included. (DDP and FSDP2 load Dynamo themselves, so a distributed run pays it either way.) The decorator here
marks the function the way Dynamo reads it while tracing (``_torchdynamo_disable``: the call is not
inlined, the graph breaks around it), and makes the real disabled function on the first call made with
Dynamo loaded, so a call Dynamo hands back to Python also runs with compilation off below it. Without
Dynamo loaded nothing can be compiling: the function runs as is.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

__all__ = ["opaque_to_compile"]


def opaque_to_compile(fn: Callable) -> Callable:
    if "torch._dynamo" in sys.modules:  # already paid for: the plain decorator
        return torch.compiler.disable(fn)
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def opaque(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            from torch._dynamo.eval_frame import skip_code

            disabled.append(torch.compiler.disable(fn))
            skip_code(opaque.__code__)  # later calls: Dynamo runs this frame as is, the disabled fn below it
        return disabled[0](*args, **kwargs)

    opaque._torchdynamo_disable = True
    return opaque
