"""What brokers of a cluster say about the partitions they serve, read back from their logs.

A broker logs ``broker ID serves 'T-partition-P' ... owner epoch E`` when it starts serving a
partition and ``broker ID stops serving 'T-partition-P' ... owner epoch E`` when it stops
(keyfailover/broker/storage/postgresql.py); the demo and the chaos harness read these lines. A
broker whose lease lapsed (no answer from ZooKeeper within most of a session timeout) says
``broker ID pauses every partition: its lease lapsed at TIME`` and acts on none until it says
``broker ID resumes its partitions`` (keyfailover/broker/server/_cluster.py).

The same log says, for people rather than for these readers, what a new owner waits for and when it
gets it (``waits for the barrier of partition P of 'T', held by broker B``, ``holds the barrier``,
``waits to open partition P of 'T' ... PostgreSQL backend N ... holds its row``, ``fenced partition``),
and when a broker ``gives up its partitions`` (a pause outlasted) or ``lost its ZooKeeper session``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from keyfailover.core.partitions import split_partition_topic

__all__ = ["LeaseChange", "Ownership", "lease_events", "ownership_events"]

_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) broker (\S+) (serves|stops serving) '([^']+)'.*owner epoch (\d+)",
    re.MULTILINE,
)
_STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
_LEASE = re.compile(
    rf"^({_STAMP}) broker (\S+) (?:pauses every partition: its lease lapsed at ({_STAMP})|(resumes) its partitions)",
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
            found.append(Ownership(_time(at), broker, parts[1], int(epoch), what == "serves"))
    return found


@dataclass(frozen=True)
class LeaseChange:
    """A broker's lease lapsed at ``at`` (``lapsed``; said later, when the broker noticed) or was renewed."""

    at: float
    broker: str
    lapsed: bool


def _time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def lease_events(log: str) -> list[LeaseChange]:
    """The lapses and renewals of one broker's lease in its ``log``, in log order."""
    return [
        LeaseChange(_time(lapsed or said), broker, not resumed) for said, broker, lapsed, resumed in _LEASE.findall(log)
    ]
