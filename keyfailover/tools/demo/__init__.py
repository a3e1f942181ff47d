"""The main job: consumers that join, leave and stall, with every guarantee checked.

:func:`run_server_demo` (``keyfailover demo``) starts a real ``keyfailover serve`` on a free
loopback port with a temporary data directory, produces keyed account events and runs
consumers on threads: two at first, a third that joins, a fourth that joins and stalls
(keeps its deliveries unacked), the first leaving, and the stalled one removed at last,
whose unacked events then go to the new owners. It checks that every event the server
confirmed was consumed, none was stored twice, and each account's events were first
delivered in the order they were produced.

:func:`run_core_demo` (``keyfailover demo --core``) runs the same story on the dispatcher
core alone, on a simulated clock, and checks each delivery as it happens: in per-key
order, one consumer per key at a time, nothing lost.

Both print who owns what after every change, one line per consumer (it may own several
ranges of the hash space: how many, its share of the slots, the first few), and a final table.

:func:`run_cluster_demo` (``keyfailover demo --cluster``) starts ZooKeeper, a Patroni group of
two PostgreSQL servers and three brokers, runs the account events through a topic of six
partitions, kills the coordinator broker and shows its partitions move to the others, then kills
the store's primary and shows Patroni promote its standby, with the same checks.

One module per demo (``_core``, ``_server``, ``_cluster``); ``_report`` holds what they report
and print, ``_traffic`` the events and consumers of the demos with real processes, and their checks.
"""

from keyfailover.tools.demo._cluster import run_cluster_demo
from keyfailover.tools.demo._core import run_core_demo
from keyfailover.tools.demo._report import DemoReport
from keyfailover.tools.demo._server import run_server_demo

__all__ = ["DemoReport", "run_cluster_demo", "run_core_demo", "run_server_demo"]
