"""``python -m opsnn_lab.validate``: see ``opsnn_lab.validate`` for the expectations format."""

import sys

from opsnn_lab.validate.cli import main

sys.exit(main())
