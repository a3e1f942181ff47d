"""Level 1 of the two levels of scheduling: a topic's partitions as blocks of hash slots, and
their sticky assignment to brokers.

A topic has P partitions, fixed at creation; partition p holds the keys whose slot lies in
``[p*65536//P, (p+1)*65536//P)``. There is one hash and one slot space at both levels: each
partition's dispatcher (level 2) splits its block among the subscription's consumers, and the
union of a subscription's partition maps tiles 0..65535 again. P = 1 is one dispatcher over
the whole space.

The assignment of partitions to brokers is the sticky algorithm of RocketMQ's sticky-rebalance
proposal, as a pure function (:func:`assign_partitions`): keep every still-valid assignment a
balanced result allows, then give each unassigned partition to the broker with the fewest
(ties by id). Broker counts differ by at most one, and no balanced assignment keeps more
partitions where they were. An :class:`Assignment` carries a generation, +1 at every change,
so that a broker can refuse a stale one.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from keyfailover.core.errors import ConfigError
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hash

__all__ = [
    "MAX_PARTITIONS",
    "Assignment",
    "PartitionId",
    "assign_partitions",
    "check_partition_count",
    "partition_of_key",
    "partition_of_slot",
    "partition_slots",
    "partition_topic",
    "partitions_of_slots",
    "split_partition_topic",
]

MAX_PARTITIONS = HASH_RANGE_SIZE
"""The most partitions a topic may have: each holds at least one slot."""

PartitionId = tuple[str, int]
"""``(topic, partition index)``: what level 1 assigns."""


def check_partition_count(partitions: object) -> int:
    """``partitions`` if it is an int from 1 to 65536, else :class:`ConfigError`."""
    if type(partitions) is not int or not 1 <= partitions <= MAX_PARTITIONS:
        raise ConfigError(f"a topic's partition count must be an int from 1 to {MAX_PARTITIONS}, not {partitions!r}")
    return partitions


def partition_slots(partition: int, partitions: int) -> tuple[int, int]:
    """The inclusive ``(first, last)`` slots of ``partition`` (0-based) of a topic with ``partitions``."""
    check_partition_count(partitions)
    if type(partition) is not int or not 0 <= partition < partitions:
        raise ConfigError(f"partition must be an int from 0 to {partitions - 1}, not {partition!r}")
    return partition * HASH_RANGE_SIZE // partitions, (partition + 1) * HASH_RANGE_SIZE // partitions - 1


def partition_of_slot(slot: int, partitions: int) -> int:
    """The partition holding ``slot`` in a topic with ``partitions``.

    Slot s is in partition p when ``p*65536//P <= s < (p+1)*65536//P``, which is
    ``p = ((s + 1)*P - 1) // 65536``.
    """
    check_partition_count(partitions)
    if type(slot) is not int or not 0 <= slot < HASH_RANGE_SIZE:
        raise ConfigError(f"slot must be an int from 0 to {HASH_RANGE_SIZE - 1}, not {slot!r}")
    return ((slot + 1) * partitions - 1) // HASH_RANGE_SIZE


def partitions_of_slots(slots: npt.ArrayLike, partitions: int) -> npt.NDArray[np.int64]:
    """:func:`partition_of_slot` of every slot of an array (slots are not range-checked)."""
    check_partition_count(partitions)
    return ((np.asarray(slots, dtype=np.int64) + 1) * partitions - 1) // HASH_RANGE_SIZE


def partition_of_key(key: str | bytes, partitions: int) -> int:
    """The partition that holds ``key``'s messages (by :func:`~keyfailover.core.hashing.key_hash`)."""
    return partition_of_slot(key_hash(key), partitions)


PARTITION_SUFFIX = "-partition-"
"""Partition p of a topic T with P > 1 partitions is stored and served as the topic ``T-partition-p``
(Apache Pulsar's naming); a topic with one partition is served under its own name."""


def partition_topic(topic: str, partition: int, partitions: int) -> str:
    """The name partition ``partition`` of ``topic`` (of ``partitions``) is stored and served under."""
    partition_slots(partition, partitions)
    return topic if partitions == 1 else f"{topic}{PARTITION_SUFFIX}{partition}"


def split_partition_topic(name: str) -> tuple[str, int] | None:
    """``(topic, partition)`` when ``name`` has the form ``T-partition-p``, else None."""
    topic, suffix, index = name.rpartition(PARTITION_SUFFIX)
    if not suffix or not topic or not index.isascii() or not index.isdigit() or str(int(index)) != index:
        return None
    return topic, int(index)


def _broker_ids(brokers: Iterable[str]) -> list[str]:
    """``brokers`` sorted, each checked to be a non-empty str named once; else a ConfigError."""
    ids = list(brokers)
    for broker in ids:
        if not isinstance(broker, str) or not broker:
            raise ConfigError(f"a broker id must be a non-empty str, not {broker!r}")
    if len(set(ids)) != len(ids):
        twice = sorted({b for b in ids if ids.count(b) > 1})
        raise ConfigError(f"broker ids must be distinct; given more than once: {twice}")
    return sorted(ids)


def _partition_ids(partitions: Iterable[PartitionId]) -> list[PartitionId]:
    """``partitions`` sorted, each checked to be a ``(topic, index)`` pair named once; else a ConfigError."""
    ids = list(partitions)
    for partition in ids:
        if (
            type(partition) is not tuple
            or len(partition) != 2
            or not isinstance(partition[0], str)
            or type(partition[1]) is not int
            or partition[1] < 0
        ):
            raise ConfigError(f"a partition id must be a (topic, index >= 0) tuple, not {partition!r}")
    if len(set(ids)) != len(ids):
        raise ConfigError("partition ids must be distinct")
    return sorted(ids)


def assign_partitions(
    partitions: Iterable[PartitionId], brokers: Iterable[str], previous: Mapping[PartitionId, str]
) -> dict[PartitionId, str]:
    """Assign every partition to a live broker, keeping as much of ``previous`` as balance allows.

    With N partitions and B brokers each broker gets N // B or N // B + 1 partitions. A
    previous assignment is valid while its partition exists and its broker is live. The
    N % B brokers allowed one more are those with the most valid previous partitions (ties
    by id), and each broker keeps its valid previous partitions up to what it is allowed
    (the lowest partition ids first): so no balanced assignment keeps more. Then each
    partition left (in id order) goes to the broker with the fewest (ties by id).

    Without brokers nothing is assigned (an empty dict). Deterministic: the same arguments
    give the same result, whatever the iteration order of the arguments.
    """
    wanted = _partition_ids(partitions)
    live = _broker_ids(brokers)
    if not live:
        return {}
    existing = set(wanted)
    kept_before: dict[str, list[PartitionId]] = {broker: [] for broker in live}
    for partition, broker in previous.items():
        if partition in existing and broker in kept_before:
            kept_before[broker].append(partition)
    base, extra = divmod(len(wanted), len(live))
    owners: dict[PartitionId, str] = {}
    counts: dict[str, int] = {}
    for broker in sorted(live, key=lambda b: (-len(kept_before[b]), b)):
        mine = sorted(kept_before[broker])
        allowed = base
        if extra and len(mine) > base:
            allowed += 1
            extra -= 1
        for partition in mine[:allowed]:
            owners[partition] = broker
        counts[broker] = min(len(mine), allowed)
    # The fewest first, ties by id: a sorted list of (count, broker), kept sorted.
    order = sorted((count, broker) for broker, count in counts.items())
    for partition in wanted:
        if partition in owners:
            continue
        count, broker = order.pop(0)
        owners[partition] = broker
        bisect.insort(order, (count + 1, broker))
    return owners


@dataclass(frozen=True)
class Assignment:
    """One assignment of partitions to brokers, and its generation (+1 at every change)."""

    generation: int
    owners: Mapping[PartitionId, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if type(self.generation) is not int or self.generation < 0:
            raise ConfigError(f"an assignment's generation must be an int >= 0, not {self.generation!r}")
        object.__setattr__(self, "owners", MappingProxyType(dict(self.owners)))

    def rebalanced(self, partitions: Iterable[PartitionId], brokers: Iterable[str]) -> Assignment:
        """The sticky assignment of ``partitions`` to ``brokers`` after this one; the same object
        (same generation) when nothing changes."""
        owners = assign_partitions(partitions, brokers, self.owners)
        if owners == dict(self.owners):
            return self
        return Assignment(self.generation + 1, owners)

    def supersedes(self, other: Assignment) -> bool:
        """Whether this assignment is newer than ``other``: a broker applies only a newer one."""
        return self.generation > other.generation

    def partitions_of(self, broker: str) -> list[PartitionId]:
        """The partitions ``broker`` serves, sorted."""
        return sorted(p for p, owner in self.owners.items() if owner == broker)

    def moved(self, before: Assignment) -> list[PartitionId]:
        """The partitions whose broker differs from ``before`` (new and unassigned ones included), sorted."""
        keys = set(self.owners) | set(before.owners)
        return sorted(p for p in keys if self.owners.get(p) != before.owners.get(p))
