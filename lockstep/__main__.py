"""``python -m lockstep``: the ``lockstep`` command (see :mod:`core.cli`)."""

import sys

import lockstep  # noqa: F401 - first: it loads Lockstep's own core, whatever folder this runs from
from core.cli import main

sys.exit(main())
