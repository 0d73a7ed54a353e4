"""Several ``python -m opsnn_lab.train`` runs in one torchrun launch: one process group, imports paid once.

``torchrun ... tests/parallel/_many.py '<json list of argument lists>'``. Each run is the CLI's ``run``
on the same process group (it starts none and closes none of its own); a failing run fails the launch.
"""

from __future__ import annotations

import json
import sys

from opsnn_lab.parallel.cli import _check_args, parser, run
from opsnn_lab.parallel.runtime import init_distributed


def main(argv: list[str]) -> None:
    runs = json.loads(argv[0])
    ctx = init_distributed(timeout_s=60.0)
    try:
        for args in runs:
            parsed = parser().parse_args(args)
            _check_args(parsed)
            run(parsed)
    finally:
        ctx.close()


if __name__ == "__main__":
    main(sys.argv[1:])
