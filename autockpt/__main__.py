"""``python -m autockpt``: the command line (see :mod:`autockpt.cli`)."""

import sys

from autockpt.cli import main

sys.exit(main())
