"""``python -m keyfailover.tools.chaos produce|consume ...``: a worker process of a chaos run (:mod:`._worker`)."""

from keyfailover.tools.chaos._worker import main

main()
