"""``python -m opsnn_lab.train``: see :mod:`opsnn_lab.parallel.cli`.

Importing this module sets the attribute ``opsnn_lab.train`` to it, which would hide the function
``ol.train``; the module is therefore callable and forwards to :func:`opsnn_lab.training.train`.
"""

import sys
import types


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from opsnn_lab.training import train

        return train(*args, **kwargs)


if __name__ == "__main__":
    from opsnn_lab.parallel.cli import main

    raise SystemExit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
