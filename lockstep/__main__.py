"""``python -m lockstep``: the ``lockstep`` command (see :mod:`core.cli`)."""

import sys

import lockstep.cli

sys.exit(lockstep.cli.main())
