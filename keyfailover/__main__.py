"""``python -m keyfailover``: the command line."""

import sys

from keyfailover.cli import main

sys.exit(main())
