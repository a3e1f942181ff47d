"""Six ways to give the 65536 hash slots to consumers, behind one small interface.

A strategy holds its current assignment in the form its real system keeps (a range map,
a hash ring, a queue table) and updates it on each event: a consumer joins, a consumer
leaves, or a window of measured traffic arrives (only load-aware strategies use it).
:meth:`Strategy.ownership` then reports who owns each slot. Every slot's hash is the
keyfailover hash (Pulsar's sticky-key hash), so all six strategies place the same keys.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hashes
from keyfailover.core.ranges import RangeMap
from keyfailover.core.rebalance import ContiguousPolicy, Load, MultiRangePolicy, Policy, range_traffic

__all__ = [
    "STRATEGIES",
    "Event",
    "FlinkKeyGroups",
    "Join",
    "KeyFailover",
    "Leave",
    "Measured",
    "Ownership",
    "PulsarAutoSplit",
    "PulsarConsistent",
    "RocketMQAveragely",
    "RocketMQSticky",
    "Strategy",
]

_SLOTS = np.arange(HASH_RANGE_SIZE)


@dataclass(frozen=True)
class Join:
    """``consumer`` joins."""

    consumer: str


@dataclass(frozen=True)
class Leave:
    """``consumer`` leaves."""

    consumer: str


@dataclass(frozen=True)
class Measured:
    """Messages per slot counted over the last measurement window."""

    traffic: npt.NDArray[np.float64]


Event = Join | Leave | Measured


@dataclass(frozen=True)
class Ownership:
    """Who owns each slot: ``consumers[index[slot]]``; an index of -1 means nobody.

    ``consumers`` may name one consumer many times (a hash ring lists its points).
    """

    consumers: tuple[str, ...]
    index: npt.NDArray[np.intp]


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

    @abstractmethod
    def ownership(self) -> Ownership:
        """Who owns each of the 65536 slots now."""


def _ceiling_owners(keys: list[int], owners: list[str]) -> Ownership:
    """A slot belongs to the first of the sorted ``keys`` at or above it; past the last, to the first."""
    if not keys:
        return Ownership((), np.full(HASH_RANGE_SIZE, -1, dtype=np.intp))
    index = np.searchsorted(np.asarray(keys), _SLOTS, side="left")
    index[index == len(keys)] = 0
    return Ownership(tuple(owners), index)


def _bucket_owners(table: npt.NDArray[np.intp], consumers: list[str]) -> Ownership:
    """Slot ``s`` is in bucket ``s % len(table)`` (hash modulo bucket count); ``table`` gives each bucket's owner."""
    return Ownership(tuple(consumers), table[_SLOTS % len(table)])


class KeyFailover(Strategy):
    """Ours: a policy of :mod:`keyfailover.core.rebalance`, fed as the dispatcher feeds it.

    Joins and leaves go to the policy with the last measured window as the per-slot
    traffic, and each window of measured traffic is one chance of a shift, as the
    dispatcher checks once per ``shift_interval``. A consumer's rate is the traffic its
    ranges carried in the last window.
    """

    name = "keyfailover"

    def __init__(self, policy: Policy | None = None) -> None:
        self._policy = MultiRangePolicy() if policy is None else policy
        self._ranges = RangeMap()
        self._traffic: npt.NDArray[np.float64] | None = None
        self._standby: list[str] = []

    def _load(self) -> Load:
        return Load(range_traffic(self._ranges, self._traffic), self._traffic)

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
            return _ceiling_owners([], [])
        return Ownership(tuple(self._ranges.lookup_table()[1]), self._ranges.slot_owners().astype(np.intp))


class KeyFailoverContiguous(KeyFailover):
    """Ours with one contiguous range per consumer (PIP-34 literally)."""

    name = "keyfailover-contiguous"

    def __init__(self) -> None:
        super().__init__(ContiguousPolicy())


class PulsarAutoSplit(Strategy):
    """Apache Pulsar's ``HashRangeAutoSplitStickyKeyConsumerSelector`` (Key_Shared AUTO_SPLIT).

    Range keys in a sorted map, a range being ``(lower key, key]`` and the first consumer
    starting at key 65536 (2 << 15). A join splits the first widest range at
    ``key - ((key - lower) >> 1)`` and the newcomer takes the lower half; a leaver's range
    goes to the next-higher key's consumer, except the top one's, which the consumer just
    below takes over. Pulsar refuses a consumer when the widest range has one slot; here it
    then owns nothing.
    """

    name = "pulsar-autosplit"

    def __init__(self) -> None:
        self._keys: list[int] = []
        self._owner: dict[int, str] = {}
        self._key_of: dict[str, int] = {}

    def _put(self, key: int, consumer: str) -> None:
        bisect.insort(self._keys, key)
        self._owner[key] = consumer
        self._key_of[consumer] = key

    def join(self, consumer: str) -> None:
        if not self._keys:
            self._put(HASH_RANGE_SIZE, consumer)
            return
        biggest, slots, lower = HASH_RANGE_SIZE, 0, 0
        for key in self._keys:
            if key - lower > slots:
                biggest, slots = key, key - lower
            lower = key
        if slots <= 1:
            return
        self._put(biggest - (slots >> 1), consumer)

    def leave(self, consumer: str) -> None:
        key = self._key_of.pop(consumer, None)
        if key is None:
            return
        at = bisect.bisect_left(self._keys, key)
        if key == HASH_RANGE_SIZE and len(self._keys) > 1:
            below = self._keys.pop(at - 1)
            heir = self._owner.pop(below)
            self._owner[key] = heir
            self._key_of[heir] = key
        else:
            del self._keys[at]
            del self._owner[key]

    def ownership(self) -> Ownership:
        return _ceiling_owners(self._keys, [self._owner[key] for key in self._keys])


class PulsarConsistent(Strategy):
    """Apache Pulsar's ``ConsistentHashingStickyKeyConsumerSelector`` (Key_Shared's default).

    Each consumer puts ``points`` (100 by default, ``subscriptionKeySharedConsistentHashingReplicaPoints``)
    on a ring at the sticky-key hash of ``name + "\\0" + name index + "\\0" + point index``; the
    NUL separators keep "consumer1" + "11" apart from "consumer11" + "1" (apache/pulsar
    #22050). As in Pulsar 4 (``makeStickyKeyHash``), points and keys share the 65536-slot
    range. A slot belongs to the first point at or above it, wrapping to the first. On a
    collision the earlier consumer keeps the point and the later one waits behind it.
    Every name here is distinct, so every name index is 0.
    """

    name = "pulsar-consistent"

    def __init__(self, points: int = 100) -> None:
        self._points = points
        self._ring: dict[int, list[str]] = {}
        self._sorted: list[int] = []

    def _hashes(self, consumer: str) -> list[int]:
        hashes = key_hashes(f"{consumer}\0{0}\0{index}" for index in range(self._points))
        return [int(h) for h in hashes.tolist()]

    def join(self, consumer: str) -> None:
        for point in self._hashes(consumer):
            holders = self._ring.get(point)
            if holders is None:
                self._ring[point] = [consumer]
                bisect.insort(self._sorted, point)
            else:
                holders.append(consumer)

    def leave(self, consumer: str) -> None:
        for point in self._hashes(consumer):
            holders = self._ring[point]
            holders.remove(consumer)
            if not holders:
                del self._ring[point]
                del self._sorted[bisect.bisect_left(self._sorted, point)]

    def ownership(self) -> Ownership:
        return _ceiling_owners(self._sorted, [self._ring[point][0] for point in self._sorted])


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
        PulsarAutoSplit,
        PulsarConsistent,
        FlinkKeyGroups,
        RocketMQAveragely,
        RocketMQSticky,
    )
}
"""Every strategy by name, ours first."""
