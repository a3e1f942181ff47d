"""``python -m keyfailover.tools.cli``: the command line."""

import sys

from keyfailover.tools.cli import main

sys.exit(main())
