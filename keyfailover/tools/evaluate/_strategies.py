"""Ways to give the keys to consumers, behind one small interface.

A strategy holds its current assignment in the form its real system keeps (a range map,
a hash ring, a queue table) and updates it on each event: a consumer joins, a consumer
leaves, or a window of measured traffic arrives (only load-aware strategies use it).
:meth:`Strategy.owners` then reports who owns each key of a population, placing each key
with that system's own hash: the keyfailover slot for the range maps, key groups and
queues, Pulsar's own hashes for Pulsar's selectors (:mod:`._pulsar`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal

import numpy as np
import numpy.typing as npt

from keyfailover.core.hashing import HASH_RANGE_SIZE
from keyfailover.core.ranges import RangeMap
from keyfailover.core.rebalance import ContiguousPolicy, Load, MultiRangePolicy, Policy, range_traffic
from keyfailover.tools.evaluate._events import Event, Join, Leave, Measured, Ownership
from keyfailover.tools.evaluate._pulsar import AutoSplitSelector, ConsistentHashingSelector, ConsumerAssignError
from keyfailover.tools.evaluate._scenarios import Population

__all__ = [
    "STRATEGIES",
    "Event",
    "FlinkKeyGroups",
    "Join",
    "KeyFailover",
    "KeyFailoverContiguous",
    "Leave",
    "Measured",
    "Ownership",
    "PulsarAutoSplit",
    "PulsarConsistent",
    "PulsarConsistent3",
    "RocketMQAveragely",
    "RocketMQSticky",
    "Strategy",
]

_SLOTS = np.arange(HASH_RANGE_SIZE)


class Strategy(ABC):
    """An assignment of the slots to consumers that events change."""

    name: ClassVar[str]

    def apply(self, event: Event) -> None:
        """Update the assignment for ``event``; the work a real system does at that moment."""
        if isinstance(event, Join):
            self.join(event.consumer)
        elif isinstance(event, Leave):
            self.leave(event.consumer)
        else:
            self.measured(event.traffic)

    @abstractmethod
    def join(self, consumer: str) -> None:
        """``consumer``, not yet a member, joins."""

    @abstractmethod
    def leave(self, consumer: str) -> None:
        """``consumer``, a member, leaves."""

    def measured(self, traffic: npt.NDArray[np.float64]) -> bool:
        """A window of measured traffic per slot arrived; True if the assignment changed.

        Strategies blind to load ignore it.
        """
        return False

    def owners(self, population: Population) -> Ownership:
        """Who owns each key of ``population`` now (by the keyfailover slot unless the system hashes otherwise)."""
        owned = self.ownership()
        return Ownership(owned.consumers, owned.index[population.key_slots])

    @abstractmethod
    def ownership(self) -> Ownership:
        """Who owns each of the 65536 keyfailover slots now (for a ring, the slot's own hash value)."""

    def ranges(self) -> int:
        """How many ranges of its hash space the assignment has: what a consumer must be told."""
        owned = self.ownership()
        return int(np.count_nonzero(np.diff(owned.index))) + 1 if len(owned.consumers) else 0


def _bucket_owners(table: npt.NDArray[np.intp], consumers: list[str]) -> Ownership:
    """Slot ``s`` is in bucket ``s % len(table)`` (hash modulo bucket count); ``table`` gives each bucket's owner."""
    return Ownership(tuple(consumers), table[_SLOTS % len(table)])


class KeyFailover(Strategy):
    """Ours: a policy of :mod:`keyfailover.core.rebalance`, fed as the dispatcher feeds it.

    Joins and leaves go to the policy with the last measured window as the per-slot
    traffic, and each window of measured traffic is one chance of a shift, as the
    dispatcher checks once per ``shift_interval``. For a policy that reads rates, a
    consumer's rate is the traffic its ranges carried in the last window.
    """

    name = "keyfailover"

    def __init__(self, policy: Policy | None = None) -> None:
        self._policy = MultiRangePolicy() if policy is None else policy
        self._ranges = RangeMap()
        self._traffic: npt.NDArray[np.float64] | None = None
        self._standby: list[str] = []

    def _load(self) -> Load:
        rates = range_traffic(self._ranges, self._traffic) if self._policy.reads_rates else {}
        return Load(rates, self._traffic)

    def join(self, consumer: str) -> None:
        self._ranges = self._policy.join(self._ranges, consumer, self._load())
        if consumer not in self._ranges:
            self._standby.append(consumer)

    def leave(self, consumer: str) -> None:
        planned = self._policy.leave(self._ranges, consumer, self._load(), self._standby)
        if consumer in self._standby:
            self._standby.remove(consumer)
        elif self._standby and self._standby[0] in planned:
            self._standby.pop(0)
        self._ranges = planned

    def measured(self, traffic: npt.NDArray[np.float64]) -> bool:
        self._traffic = traffic
        planned = self._policy.shift(self._ranges, self._load())
        if planned is None:
            return False
        self._ranges = planned
        return True

    def ownership(self) -> Ownership:
        if not len(self._ranges):
            return Ownership((), np.full(HASH_RANGE_SIZE, -1, dtype=np.intp))
        return Ownership(tuple(self._ranges.lookup_table()[1]), self._ranges.slot_owners().astype(np.intp))

    def ranges(self) -> int:
        return self._ranges.range_count()


class KeyFailoverContiguous(KeyFailover):
    """Ours with one contiguous range per consumer (PIP-34 literally)."""

    name = "keyfailover-contiguous"

    def __init__(self) -> None:
        super().__init__(ContiguousPolicy())


class PulsarAutoSplit(Strategy):
    """Apache Pulsar's ``HashRangeAutoSplitStickyKeyConsumerSelector`` (Key_Shared AUTO_SPLIT), computed as Pulsar does.

    A join splits the first widest range and the newcomer takes the lower half; a leaver's
    range goes to the next-higher range's consumer, the top one's to the consumer below
    (:class:`._pulsar.AutoSplitSelector`). Pulsar 4.x's slot is keyfailover's except that
    slot 0 becomes 1, which never changes an owner. Pulsar refuses a consumer when the
    widest range has one slot; here it then owns nothing until someone leaves.
    """

    name = "pulsar-autosplit"

    def __init__(self) -> None:
        self._selector = AutoSplitSelector(HASH_RANGE_SIZE)

    def join(self, consumer: str) -> None:
        try:
            self._selector.add_consumer(consumer)
        except ConsumerAssignError:
            return

    def leave(self, consumer: str) -> None:
        self._selector.remove_consumer(consumer)

    def ownership(self) -> Ownership:
        return self._selector.owners_of(_SLOTS)


class PulsarConsistent(Strategy):
    """Apache Pulsar 4.x's ``ConsistentHashingStickyKeyConsumerSelector`` (Key_Shared's default), as Pulsar computes it.

    100 points per consumer (``subscriptionKeySharedConsistentHashingReplicaPoints``) at
    ``m31(name + "\\0" + name index + "\\0" + i) % 65535 + 1``; a key's slot is
    ``m31(key) % 65535 + 1`` (not keyfailover's slot); a slot belongs to the first point
    at or above it, wrapping to the first; on a collision the earlier consumer keeps the
    point (:class:`._pulsar.ConsistentHashingSelector`).
    """

    name = "pulsar-consistent"
    version: ClassVar[Literal["4.x", "3.x"]] = "4.x"

    def __init__(self, points: int = 100) -> None:
        self._selector = ConsistentHashingSelector(points, self.version)

    def join(self, consumer: str) -> None:
        self._selector.add_consumer(consumer)

    def leave(self, consumer: str) -> None:
        self._selector.remove_consumer(consumer)

    def _hashes(self, population: Population) -> npt.NDArray[np.int32]:
        return population.key_pulsar4

    def owners(self, population: Population) -> Ownership:
        return self._selector.owners_of(self._hashes(population))

    def ownership(self) -> Ownership:
        """Owners of ring positions 0..65535 (4.x: the key slots, 0 unused; 3.x: the lowest positions only)."""
        return self._selector.owners_of(_SLOTS)

    def ranges(self) -> int:
        return sum(len(found) for found in self._selector.consumer_key_hash_ranges().values())


class PulsarConsistent3(PulsarConsistent):
    """Apache Pulsar 3.x's consistent hashing: the ring over the 31-bit hash itself, a later colliding point winning."""

    name = "pulsar-consistent-3.x"
    version = "3.x"

    def _hashes(self, population: Population) -> npt.NDArray[np.int32]:
        return population.key_pulsar3


class _Recomputed(Strategy):
    """A table of bucket owners (indexes into the members) recomputed on every change."""

    def __init__(self, buckets: int) -> None:
        self._members: list[str] = []
        self._table = np.full(buckets, -1, dtype=np.intp)

    @abstractmethod
    def _recompute(self) -> None:
        """Rebuild ``_table`` from ``_members``."""

    def join(self, consumer: str) -> None:
        self._members.append(consumer)
        self._recompute()

    def leave(self, consumer: str) -> None:
        self._members.remove(consumer)
        self._recompute()

    def ownership(self) -> Ownership:
        return _bucket_owners(self._table, self._members)


class FlinkKeyGroups(_Recomputed):
    """Apache Flink's key groups (``KeyGroupRangeAssignment``), one consumer per subtask.

    A key's group is its hash modulo ``max_parallelism`` (128); with parallelism ``p`` group
    ``g`` goes to subtask ``g * p // 128``, so each subtask holds a contiguous, even run of
    groups, recomputed on every change. Subtasks are numbered in join order (a newcomer is
    the last subtask, a leaver's successors move down one), the kindest order for
    stickiness. Members beyond the 128th get no group, as Flink cannot run them.
    """

    name = "flink-keygroups"

    def __init__(self, max_parallelism: int = 128) -> None:
        super().__init__(max_parallelism)
        self._max_parallelism = max_parallelism

    def _recompute(self) -> None:
        parallelism = min(len(self._members), self._max_parallelism)
        self._table = np.arange(self._max_parallelism, dtype=np.intp) * parallelism // self._max_parallelism
        if not parallelism:
            self._table[:] = -1


_QUEUES = 256
"""Virtual queues for the RocketMQ strategies: a key's queue is its hash modulo 256 (``SelectMessageQueueByHash``)."""


class RocketMQAveragely(_Recomputed):
    """Apache RocketMQ's ``AllocateMessageQueueAveragely`` over 256 virtual queues.

    Consumer ids are sorted; the i-th of n takes a contiguous block of ``256 // n`` queues,
    one more for each of the first ``256 % n``; recomputed from scratch on every change.
    """

    name = "rocketmq-averagely"

    def __init__(self) -> None:
        super().__init__(_QUEUES)

    def _recompute(self) -> None:
        self._members.sort()
        count = len(self._members)
        table = np.full(_QUEUES, -1, dtype=np.intp)
        if count:
            extra = _QUEUES % count
            for index in range(count):
                average = 1 if count >= _QUEUES else _QUEUES // count + (1 if index < extra else 0)
                start = index * average if index < extra else index * average + extra
                table[start : start + max(min(average, _QUEUES - start), 0)] = index
        self._table = table


class RocketMQSticky(Strategy):
    """The sticky allocation of the RocketMQ rebalancing proposal (apache/rocketmq #2149, PR #2169).

    Queues stay where they are; a leaver's queues go one by one to the consumer holding
    the fewest (ties: smallest id), then the first queue of the fullest consumer moves to
    the emptiest until their counts differ by at most one.
    """

    name = "sticky"

    def __init__(self) -> None:
        self._queues: dict[str, list[int]] = {}

    def _rebalance(self, unassigned: list[int]) -> None:
        if not self._queues:
            return
        for queue in unassigned:
            self._queues[min(self._queues, key=lambda c: (len(self._queues[c]), c))].append(queue)
        while True:
            order = sorted(self._queues, key=lambda c: (len(self._queues[c]), c))
            fewest, most = order[0], order[-1]
            if len(self._queues[most]) - len(self._queues[fewest]) <= 1:
                return
            self._queues[fewest].append(self._queues[most].pop(0))

    def join(self, consumer: str) -> None:
        unassigned = [] if self._queues else list(range(_QUEUES))
        self._queues[consumer] = []
        self._rebalance(unassigned)

    def leave(self, consumer: str) -> None:
        self._rebalance(sorted(self._queues.pop(consumer)))

    def ownership(self) -> Ownership:
        members = list(self._queues)
        table = np.full(_QUEUES, -1, dtype=np.intp)
        for index, consumer in enumerate(members):
            table[self._queues[consumer]] = index
        return _bucket_owners(table, members)


STRATEGIES: dict[str, type[Strategy]] = {
    strategy.name: strategy
    for strategy in (
        KeyFailover,
        KeyFailoverContiguous,
        PulsarConsistent,
        PulsarConsistent3,
        PulsarAutoSplit,
        FlinkKeyGroups,
        RocketMQAveragely,
        RocketMQSticky,
    )
}
"""Every strategy by name, ours first."""
