"""``python -m parity``: see :mod:`parity.cli` (``--help``)."""

import sys

from .cli import main

sys.exit(main())
