"""Chaos testing: faults on a real cluster, every run recorded, every invariant checked.

Built in steps for ``keyfailover chaos`` (issue 15). Here so far:

- :mod:`._records`: what a run records, as JSON lines (sends and receipts, deliveries,
  acks, dead letters, brokers serving partitions, consumers' ranges, faults, the store's roles).
- :mod:`._checkers`: pure functions from the records to verdicts (lost, unanswered, duplicated,
  order, two owners, held twice, unowned partitions and ranges, dead-letter accounting, writes resumed
  after a fault on the replicated store).
- :mod:`._schedule`: the seeded fault schedule (kill, suspend, loss on brokers, consumers,
  the coordinator, ZooKeeper, the replicated store's primary).
- :mod:`._harness`: the cluster, the traffic and the faults (:func:`run_chaos`).
- :mod:`._measures`, :mod:`._report`: what a run measured, strategies under its faults, report.md.
- :func:`chaos`: all of it, for ``keyfailover chaos``.
"""

from keyfailover.tools.chaos._chaos import ChaosOutcome, chaos
from keyfailover.tools.chaos._checkers import (
    RESUME_MARGIN,
    StoreFailover,
    Verdict,
    check_all,
    dead_letter_accounting,
    duplicated,
    held_twice,
    lost,
    order,
    settled_unanswered,
    store_failovers,
    two_owners,
    unanswered,
    unowned_partitions,
    unowned_ranges,
    writes_resumed,
)
from keyfailover.tools.chaos._harness import ChaosError, ChaosRun, ChaosSettings, run_chaos
from keyfailover.tools.chaos._records import (
    UNANSWERED,
    Acked,
    DeadLettered,
    Delivered,
    Fault,
    Produced,
    RangeMap,
    Record,
    RecordError,
    RecordWriter,
    Served,
    StoreRoles,
    from_json,
    read_records,
    to_json,
)
from keyfailover.tools.chaos._schedule import FAULTS, TARGETS, PlannedFault, ScheduleError, plan_faults

__all__ = [
    "FAULTS",
    "RESUME_MARGIN",
    "TARGETS",
    "UNANSWERED",
    "Acked",
    "ChaosError",
    "ChaosOutcome",
    "ChaosRun",
    "ChaosSettings",
    "DeadLettered",
    "Delivered",
    "Fault",
    "PlannedFault",
    "Produced",
    "RangeMap",
    "Record",
    "RecordError",
    "RecordWriter",
    "ScheduleError",
    "Served",
    "StoreFailover",
    "StoreRoles",
    "Verdict",
    "chaos",
    "check_all",
    "dead_letter_accounting",
    "duplicated",
    "from_json",
    "held_twice",
    "lost",
    "order",
    "plan_faults",
    "read_records",
    "run_chaos",
    "settled_unanswered",
    "store_failovers",
    "to_json",
    "two_owners",
    "unanswered",
    "unowned_partitions",
    "unowned_ranges",
    "writes_resumed",
]
