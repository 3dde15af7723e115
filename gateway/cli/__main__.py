"""``python -m gateway.cli``: the same as the ``kvgate`` command."""

import sys

from gateway.cli import main

sys.exit(main())
