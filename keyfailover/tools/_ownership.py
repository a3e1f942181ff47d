"""What brokers of a cluster say about the partitions they serve, read back from their logs.

A broker logs ``broker ID serves 'T-partition-P' ... owner epoch E`` when it starts serving a
partition and ``broker ID stops serving 'T-partition-P' ... owner epoch E`` when it stops
(keyfailover/broker/server/_cluster.py); the demo and the chaos harness read these lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from keyfailover.core.partitions import split_partition_topic

__all__ = ["Ownership", "ownership_events"]

_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) broker (\S+) (serves|stops serving) '([^']+)'.*owner epoch (\d+)",
    re.MULTILINE,
)


@dataclass(frozen=True)
class Ownership:
    """A broker's line: it started (``serves``) or stopped serving ``partition`` at owner epoch ``epoch``.

    ``at`` is the line's wall-clock time (seconds since the epoch, to the millisecond).
    """

    at: float
    broker: str
    partition: int
    epoch: int
    serves: bool


def ownership_events(log: str, topic: str) -> list[Ownership]:
    """The lines of one broker's ``log`` about partitions of ``topic``, in log order."""
    found = []
    for at, broker, what, served, epoch in _LINE.findall(log):
        parts = split_partition_topic(served)
        if parts is not None and parts[0] == topic:
            when = datetime.strptime(at, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found.append(Ownership(when, broker, parts[1], int(epoch), what == "serves"))
    return found
