"""Tools for users: the ``keyfailover`` command line, the demo, the rebalancing evaluation."""
