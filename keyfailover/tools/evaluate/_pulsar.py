"""Apache Pulsar's Key_Shared consumer selectors, computed slot for slot as Pulsar computes them.

A Key_Shared subscription hands each message to the consumer its selector picks for the
message's sticky-key hash. These are pure-Python re-implementations, written from Pulsar's
Java, of the two selectors the evaluation compares keyfailover with:

- :class:`ConsistentHashingSelector`: ``ConsistentHashingStickyKeyConsumerSelector``, Pulsar's
  default, in its 4.x form (a ring over ``[1, 65535]``; on a collision the first consumer keeps
  the point) or its 3.x form (a ring over ``[0, 2^31 - 1]``; a later consumer takes the point).
- :class:`AutoSplitSelector`: ``HashRangeAutoSplitStickyKeyConsumerSelector`` (AUTO_SPLIT), one
  algorithm in 3.x and 4.x.

A consumer is known by a unique id and carries a consumer name, which need not be unique
(Pulsar tells same-name consumers apart by a name index). ``select(hash)``,
``consumer_key_hash_ranges()`` and ``key_hash(key)`` answer exactly as Pulsar's ``select``,
``getConsumerKeyHashRanges`` and ``makeStickyKeyHash`` do, quirks included; ``owners_of``
answers ``select`` for a whole numpy array of hashes at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import count
from operator import itemgetter
from typing import Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt
from sortedcontainers import SortedDict

from keyfailover.core.errors import ConfigError, ConsumerError, DuplicateConsumerError, KeyFailoverError
from keyfailover.core.hashing import (
    HASH_RANGE_SIZE,
    key_bytes,
    murmur3_31,
    pulsar3_hash,
    pulsar3_hashes,
    pulsar4_consistent_hash,
    pulsar4_consistent_hashes,
)
from keyfailover.tools.evaluate._events import Ownership

__all__ = [
    "AutoSplitSelector",
    "ConsistentHashingSelector",
    "ConsumerAssignError",
    "HashOutOfRangeError",
    "PulsarVersion",
]

PulsarVersion = Literal["4.x", "3.x"]

_INT_MAX = 2**31 - 1
"""Java's ``Integer.MAX_VALUE``: Pulsar 3.x's ring spans ``[0, _INT_MAX]``."""


class ConsumerAssignError(KeyFailoverError, RuntimeError):
    """The selector refused a consumer, as Pulsar does with ``ConsumerAssignException``; nothing changed."""


class HashOutOfRangeError(KeyFailoverError, ValueError):
    """A hash given to ``select`` or ``owners_of`` is not one the selector's hashes can be."""


class _Table(NamedTuple):
    """A selector's sorted map as arrays: ``consumers[owners[i]]`` holds ``keys[i]``."""

    consumers: tuple[str, ...]
    keys: npt.NDArray[np.int64]
    owners: npt.NDArray[np.intp]


class _Selector(ABC):
    """What the selectors share: consumers by id, and selection by ceiling in a sorted map.

    ``_ring`` maps sorted keys to values, and ``_owner(value)`` is the consumer a value
    selects; a hash belongs to the first key at or above it, and past the last key to the
    first (auto-split's top key is its range size, so it never wraps).
    """

    def __init__(self, owner: Callable[[Any], str]) -> None:
        self._names: dict[str, str] = {}  # consumer id -> consumer name, in the order added
        self._ring: Any = SortedDict()
        self._owner = owner
        self._table: _Table | None = None  # built from _ring when needed, dropped at every change

    @abstractmethod
    def key_hash(self, key: str | bytes) -> int:
        """The hash Pulsar's ``makeStickyKeyHash`` gives ``key`` (UTF-8 bytes of a ``str``) for this selector."""

    @abstractmethod
    def key_hashes(self, keys: Iterable[str | bytes]) -> npt.NDArray[np.int32]:
        """:meth:`key_hash` of many keys at once, in input order."""

    @abstractmethod
    def key_hash_range(self) -> tuple[int, int]:
        """The first and last hash :meth:`key_hash` can give."""

    @abstractmethod
    def consumer_key_hash_ranges(self) -> dict[str, list[tuple[int, int]]]:
        """Each consumer's inclusive hash ranges, as Pulsar's ``getConsumerKeyHashRanges`` reports them."""

    @abstractmethod
    def _add(self, consumer_id: str, name: str) -> None:
        """Put a new consumer in ``_ring``, or raise before changing anything."""

    @abstractmethod
    def _remove(self, consumer_id: str, name: str) -> None:
        """Take a present consumer out of ``_ring``."""

    def add_consumer(self, consumer_id: str, name: str | None = None) -> None:
        """Add a consumer known by ``consumer_id``, named ``name`` (its id by default)."""
        if not isinstance(consumer_id, str) or not consumer_id:
            raise ConsumerError(f"consumer id must be a non-empty str, not {consumer_id!r}")
        if consumer_id in self._names:
            raise DuplicateConsumerError(f"consumer {consumer_id!r} is already added; remove it before adding it again")
        if name is None:
            name = consumer_id
        if not isinstance(name, str):
            raise ConsumerError(f"consumer name must be a str, not {type(name).__name__}")
        try:
            name.encode()
        except UnicodeEncodeError as exc:
            raise ConsumerError(
                f"consumer name {name!r} is not valid Unicode ({exc.reason} at index {exc.start}); "
                "expected a str that encodes to UTF-8"
            ) from None
        self._add(consumer_id, name)
        self._names[consumer_id] = name
        self._table = None

    def remove_consumer(self, consumer_id: str) -> None:
        """Remove a consumer; removing one that is not there does nothing, as in Pulsar."""
        name = self._names.pop(consumer_id, None)
        if name is not None:
            self._remove(consumer_id, name)
            self._table = None

    def select(self, hash_: int) -> str | None:
        """The consumer Pulsar's ``select(hash)`` picks, None when there is none; O(log points).

        ``hash_`` lies in ``[0, key_hash_range()[1]]``: 0, Pulsar 4.x's "no hash", is accepted
        because Pulsar's own tests select it.
        """
        self._check_hashes(hash_, hash_)
        if not self._ring:
            return None
        at = self._ring.bisect_left(hash_)
        return self._owner(self._ring.peekitem(at if at < len(self._ring) else 0)[1])

    def owners_of(self, hashes: npt.NDArray[np.integer[Any]]) -> Ownership:
        """:meth:`select` of every hash in an integer array at once (numpy searchsorted over the ring)."""
        array = np.asarray(hashes)
        if array.dtype.kind not in "iu":
            raise HashOutOfRangeError(f"hashes must be an integer array, not an array of {array.dtype}")
        if array.size:
            self._check_hashes(int(array.min()), int(array.max()))
        table = self._ring_table()
        if not len(table.keys):
            return Ownership(table.consumers, np.full(array.shape, -1, dtype=np.intp))
        at = np.searchsorted(table.keys, array, side="left")
        at[at == len(table.keys)] = 0
        return Ownership(table.consumers, table.owners[at])

    def _ring_table(self) -> _Table:
        """``_ring`` as numpy arrays, built once after each change, as ``SortedDict.items()`` is slow."""
        if self._table is None:
            position = {consumer: index for index, consumer in enumerate(self._names)}
            keys = list(self._ring)
            owners = map(position.__getitem__, map(self._owner, map(self._ring.__getitem__, keys)))
            self._table = _Table(
                tuple(self._names),
                np.array(keys, dtype=np.int64),
                np.fromiter(owners, dtype=np.intp, count=len(keys)),
            )
        return self._table

    def _ranges_from(
        self, starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64], owners: npt.NDArray[np.intp]
    ) -> dict[str, list[tuple[int, int]]]:
        """Ranges ``[starts[i], ends[i]]`` of ``consumers[owners[i]]`` grouped by consumer, keeping their order.

        Consumers come in the order of their first range. Grouping is numpy work, so the Python
        work is one ``zip`` per consumer, not one step per range.
        """
        consumers = self._ring_table().consumers
        order = np.argsort(owners, kind="stable")
        grouped = owners[order]
        cuts = np.flatnonzero(np.diff(grouped)) + 1
        firsts = np.concatenate(([0], cuts))
        bounds = [*firsts.tolist(), len(order)]
        sorted_starts, sorted_ends = starts[order].tolist(), ends[order].tolist()
        ranges: dict[str, list[tuple[int, int]]] = {}
        for group in np.argsort(order[firsts]).tolist():
            low, high = bounds[group], bounds[group + 1]
            ranges[consumers[grouped[low]]] = list(zip(sorted_starts[low:high], sorted_ends[low:high], strict=True))
        return ranges

    def _check_hashes(self, lowest: int, highest: int) -> None:
        last = self.key_hash_range()[1]
        if lowest < 0 or highest > last:
            wrong = lowest if lowest < 0 else highest
            raise HashOutOfRangeError(f"hash {wrong} is outside [0, {last}], the hashes this selector selects for")


@dataclass
class _NameIndex:
    name: str
    index: int
    references: int


class _NameIndexTracker:
    """Pulsar's ``ConsumerNameIndexTracker``: a distinct index for each consumer of one name.

    A consumer gets the lowest index not in use for its name, holds it while it holds
    references (one per ring point), and frees it at the last release, so a consumer that
    leaves and rejoins gets its index, and its ring points, back.
    """

    def __init__(self) -> None:
        self._in_use: dict[str, set[int]] = {}
        self._entries: dict[str, _NameIndex] = {}

    def acquire(self, consumer_id: str, name: str, references: int) -> int:
        """Add references to the consumer's index, allocating one first if it has none; return the index."""
        entry = self._entries.get(consumer_id)
        if entry is None:
            in_use = self._in_use.setdefault(name, set())
            index = next(i for i in count() if i not in in_use)
            in_use.add(index)
            entry = self._entries[consumer_id] = _NameIndex(name, index, 0)
        entry.references += references
        return entry.index

    def release(self, consumer_id: str, references: int) -> None:
        """Drop references to the consumer's index; at zero its index is free and it is forgotten."""
        entry = self._entries[consumer_id]
        entry.references -= references
        if entry.references == 0:
            in_use = self._in_use[entry.name]
            in_use.remove(entry.index)
            if not in_use:
                del self._in_use[entry.name]
            del self._entries[consumer_id]

    def index_of(self, consumer_id: str) -> int | None:
        """The consumer's index, or None when it holds no reference."""
        entry = self._entries.get(consumer_id)
        return None if entry is None else entry.index


class ConsistentHashingSelector(_Selector):
    """Pulsar's ``ConsistentHashingStickyKeyConsumerSelector``, as in Pulsar ``version`` 4.x or 3.x.

    A consumer puts ``points`` points on a ring (Pulsar's
    ``subscriptionKeySharedConsistentHashingReplicaPoints``, 100 by default), point ``i`` at
    the hash of ``name + "\\0" + name index + "\\0" + i``; a hash belongs to the first point at
    or above it, past the last point to the first.

    - 4.x: points and keys hash to ``m31 % 65535 + 1`` in ``[1, 65535]``. On a collision the
      point stays with the consumer that had it and later ones queue behind it; the first in
      the queue takes over when the holder leaves.
    - 3.x: points and keys hash to ``m31`` in ``[0, 2^31 - 1]``. On a collision the later
      consumer takes the point and the earlier one loses it for good; a consumer that lost
      every point is forgotten (its name index is freed), and removing it then does nothing.

    Adding or removing a consumer is O(points log ring size).
    """

    def __init__(self, points: int = 100, version: PulsarVersion = "4.x") -> None:
        if type(points) is not int or points < 1:
            raise ConfigError(f"points must be an int of at least 1 (points per consumer on the ring), not {points!r}")
        if version not in ("4.x", "3.x"):
            raise ConfigError(f"version must be '4.x' or '3.x', not {version!r}")
        # 4.x keeps at a point the list of consumers there, its holder first; 3.x keeps one id.
        super().__init__(itemgetter(0) if version == "4.x" else str)
        self._points = points
        self._version = version
        self._name_indexes = _NameIndexTracker()

    def key_hash(self, key: str | bytes) -> int:
        """The hash this Pulsar version places ``key`` by."""
        return pulsar4_consistent_hash(key) if self._version == "4.x" else pulsar3_hash(key)

    def key_hashes(self, keys: Iterable[str | bytes]) -> npt.NDArray[np.int32]:
        """:meth:`key_hash` of each of ``keys``, as one array."""
        return pulsar4_consistent_hashes(keys) if self._version == "4.x" else pulsar3_hashes(keys)

    def key_hash_range(self) -> tuple[int, int]:
        """``(1, 65535)`` in 4.x (Pulsar's ``getKeyHashRange``); ``(0, 2^31 - 1)``, every ``m31``, in 3.x."""
        return (1, HASH_RANGE_SIZE - 1) if self._version == "4.x" else (0, _INT_MAX)

    def _point_hashes(self, name: str, name_index: int) -> list[int]:
        labels = [f"{name}\0{name_index}\0{point}" for point in range(self._points)]
        hashes: list[int] = self.key_hashes(labels).tolist()
        return hashes

    def _add(self, consumer_id: str, name: str) -> None:
        name_index = self._name_indexes.acquire(consumer_id, name, self._points)
        for point in self._point_hashes(name, name_index):
            if self._version == "4.x":
                holders = self._ring.get(point)
                if holders is None:
                    self._ring[point] = [consumer_id]
                else:
                    holders.append(consumer_id)
            else:
                replaced = self._ring.get(point)
                self._ring[point] = consumer_id
                if replaced is not None:
                    self._name_indexes.release(replaced, 1)

    def _remove(self, consumer_id: str, name: str) -> None:
        name_index = self._name_indexes.index_of(consumer_id)
        if name_index is None:  # 3.x: later consumers took every point it had
            return
        for point in self._point_hashes(name, name_index):
            if self._version == "4.x":
                holders = self._ring[point]
                if holders[0] == consumer_id:
                    del holders[0]
                else:
                    holders[1:] = [holder for holder in holders[1:] if holder != consumer_id]
                if not holders:
                    del self._ring[point]
            elif self._ring.get(point) == consumer_id:
                del self._ring[point]
                self._name_indexes.release(consumer_id, 1)
        if self._version == "4.x":
            self._name_indexes.release(consumer_id, self._points)

    def consumer_key_hash_ranges(self) -> dict[str, list[tuple[int, int]]]:
        """Each consumer's ranges in ascending order, consumers in ring order, as Pulsar reports them.

        - 4.x: ranges start at 1; consecutive points of one consumer make one range; the
          wrap-around range ``[last point + 1, 65535]`` is the first point's consumer's, joined
          to the range before it when that is the same consumer.
        - 3.x: ranges start at 0, one per point, never joined; the wrap-around range
          ``[last point + 1, 2^31 - 2]`` is appended to the first point's consumer's (Pulsar
          ends it at ``Integer.MAX_VALUE - 1``, so hash ``2^31 - 1`` is in no reported range,
          though ``select`` gives it to the first point's consumer).
        """
        if not self._ring:
            return {}
        if self._version == "3.x":
            return self._ranges_3x()
        _, keys, owners = self._ring_table()
        last = HASH_RANGE_SIZE - 1
        if keys[-1] != last:  # the wrap-around range is the first point's
            keys, owners = np.append(keys, last), np.append(owners, owners[0])
        # A run of points of one consumer makes one range, from the point before the run.
        firsts = np.flatnonzero(np.diff(owners)) + 1
        starts = np.concatenate(([1], keys[firsts - 1] + 1))
        ends = np.append(keys[firsts - 1], last)
        # Pulsar then merges a consumer's adjacent ranges; after the joins above no two are adjacent.
        return self._ranges_from(starts, ends, owners[np.concatenate(([0], firsts))])

    def _ranges_3x(self) -> dict[str, list[tuple[int, int]]]:
        _, keys, owners = self._ring_table()
        ranges = self._ranges_from(np.concatenate(([0], keys[:-1] + 1)), keys, owners)
        last = int(keys[-1])
        if last != _INT_MAX - 1:
            # Java's int overflow: after a point at Integer.MAX_VALUE, Pulsar reports [MIN_VALUE, MAX_VALUE - 1].
            wrap_start = last + 1 if last < _INT_MAX else -(2**31)
            ranges[self._owner(self._ring.peekitem(0)[1])].append((wrap_start, _INT_MAX - 1))
        return ranges


class AutoSplitSelector(_Selector):
    """Pulsar's ``HashRangeAutoSplitStickyKeyConsumerSelector`` (Key_Shared AUTO_SPLIT), 3.x and 4.x alike.

    Each consumer holds one key of a sorted map and the range ``(key below, key]``. The first
    consumer takes key ``range_size``; a newcomer splits the first widest range ``(lower, key]``
    at ``key - ((key - lower) >> 1)`` and takes the lower part; a leaver's key goes away, so the
    consumer above takes its range, except the top key ``range_size``, which the consumer just
    below takes over. Pulsar refuses a newcomer when no range is wider than one slot:
    :meth:`add_consumer` then raises :class:`ConsumerAssignError`. Adding is O(consumers).
    """

    def __init__(self, range_size: int = HASH_RANGE_SIZE) -> None:
        if type(range_size) is not int or not 2 <= range_size <= 2**30 or range_size & (range_size - 1):
            raise ConfigError(
                f"range_size must be a power of two from 2 to 2^30 (a positive Java int), as Pulsar requires, "
                f"not {range_size!r}"
            )
        super().__init__(str)
        self._range_size = range_size
        self._key_of: dict[str, int] = {}

    def key_hash(self, key: str | bytes) -> int:
        """Pulsar 4.x's ``m31 % range_size``, with 0 made 1.

        Pulsar 3.x selects with ``m31 % range_size`` itself; slots 0 and 1 always belong to one
        consumer, so both versions pick the same consumer for every key.
        """
        return murmur3_31(key_bytes(key)) % self._range_size or 1

    def key_hashes(self, keys: Iterable[str | bytes]) -> npt.NDArray[np.int32]:
        """:meth:`key_hash` of each of ``keys``, as one array."""
        slots = pulsar3_hashes(keys) % np.int32(self._range_size)
        slots[slots == 0] = 1
        return slots

    def key_hash_range(self) -> tuple[int, int]:
        """``(0, range_size - 1)``, Pulsar's ``getKeyHashRange``."""
        return 0, self._range_size - 1

    def _add(self, consumer_id: str, name: str) -> None:
        if not self._ring:
            key = self._range_size
        else:
            widest, slots, lower = self._range_size, 0, 0
            for upper in self._ring:
                if upper - lower > slots:
                    widest, slots = upper, upper - lower
                lower = upper
            if slots <= 1:
                raise ConsumerAssignError(
                    f"cannot add consumer {consumer_id!r}: every range of the {len(self._ring)} consumers "
                    "is one slot wide, and a newcomer needs one at least two slots wide to split"
                )
            key = widest - (slots >> 1)
        self._ring[key] = consumer_id
        self._key_of[consumer_id] = key

    def _remove(self, consumer_id: str, name: str) -> None:
        key = self._key_of.pop(consumer_id)
        if key == self._range_size and len(self._ring) > 1:
            below, heir = self._ring.peekitem(-2)
            del self._ring[below]
            self._ring[key] = heir
            self._key_of[heir] = key
        else:
            del self._ring[key]

    def consumer_key_hash_ranges(self) -> dict[str, list[tuple[int, int]]]:
        """Each consumer's one range ``[key below + 1, key]`` (the lowest from 0), in ascending order.

        As in Pulsar, the top range ends at ``range_size``, one past the last hash.
        """
        _, keys, owners = self._ring_table()
        if not len(keys):
            return {}
        return self._ranges_from(np.concatenate(([0], keys[:-1] + 1)), keys, owners)
