"""The entry cache: the messages each topic stored last, kept in memory up to a bound in bytes.

A subscription that keeps up with its producers, or drains a backlog stored a moment ago,
reads what was just written. Answering those reads from memory spares the log a read and the
server a hop to the log's thread (Apache Pulsar's broker keeps such a cache of recent entries
for the same reason). Only committed messages enter it, and a stored position never changes,
so a cached message is always what the log would give. Per topic the cache holds one run of
consecutive positions; a commit that does not continue the run starts a new one. The oldest
messages (of all topics together) leave first once the bound is passed.

A run keeps its messages as columns (keys, payloads, publish times, properties, producer names:
lists of strings, bytes and ints; the messages a commit stored of one producer share its name
object) and makes a :class:`StoredMessage` only when one is read. The garbage collector does not
track such objects (only the few lists holding them), where it would walk every cached message
tuple (a named tuple stays tracked for life) at each of its middle and full collections: with the
default bound, pauses of about 65 ms every ~200,000 messages stored.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from keyfailover.broker.storage.records import Key, StoredMessage, stored_message

__all__ = ["DEFAULT_ENTRY_CACHE_BYTES", "ENTRY_OVERHEAD", "EntryCache"]

DEFAULT_ENTRY_CACHE_BYTES = 128 * 1024 * 1024
ENTRY_OVERHEAD = 128
"""Bytes a cached message takes besides its key's and payload's characters and its properties: the key and
payload objects' headers and a slot in each column (a commit's messages share one publish time object, and
those of one producer its name)."""


class _Run:
    """Consecutive messages of one topic, as columns: index i is position ``start + i``; from ``head`` on cached."""

    __slots__ = ("bytes", "head", "keys", "payloads", "producers", "properties", "start", "times", "topic")

    def __init__(self, topic: str, start: int) -> None:
        self.topic = topic
        self.start = start
        self.keys: list[Key] = []
        self.payloads: list[bytes] = []
        self.times: list[int | None] = []
        self.properties: list[bytes | None] = []
        self.producers: list[str | None] = []
        self.head = 0
        self.bytes = 0

    def first(self) -> int:
        """The first position the run still caches."""
        return self.start + self.head

    def last(self) -> int:
        """The run's last position."""
        return self.start + len(self.keys) - 1

    def messages(self, begin: int, end: int) -> list[StoredMessage]:
        """The messages at indexes ``begin`` to ``end - 1``, made in one pass in C."""
        return list(
            map(
                stored_message,
                zip(
                    range(self.start + begin, self.start + end),
                    self.keys[begin:end],
                    self.payloads[begin:end],
                    self.times[begin:end],
                    self.properties[begin:end],
                    self.producers[begin:end],
                    strict=True,
                ),
            )
        )

    def message(self, index: int) -> StoredMessage:
        """The message at ``index``."""
        return stored_message(
            (
                self.start + index,
                self.keys[index],
                self.payloads[index],
                self.times[index],
                self.properties[index],
                self.producers[index],
            )
        )

    def size(self, index: int) -> int:
        """What the message at ``index`` is counted as (see :func:`columns_bytes`)."""
        key, properties = self.keys[index], self.properties[index]
        return (
            ENTRY_OVERHEAD
            + len(self.payloads[index])
            + (len(key) if key else 0)
            + (len(properties) if properties else 0)
        )

    def forget(self, count: int) -> None:
        """Drop the ``count`` oldest messages (the columns are shortened once half of them is dropped)."""
        self.head += count
        if self.head * 2 >= len(self.keys):
            head = self.head
            del self.keys[:head], self.payloads[:head], self.times[:head], self.properties[:head], self.producers[:head]
            self.start += head
            self.head = 0


def columns_bytes(keys: Sequence[Key], payloads: Sequence[bytes], properties: Sequence[bytes | None]) -> int:
    """What messages are counted as in the cache: each ``ENTRY_OVERHEAD`` plus the lengths of its payload, key
    and properties (characters of a str key), summed column by column in C."""
    return (
        ENTRY_OVERHEAD * len(payloads)
        + sum(map(len, payloads))
        + sum(map(len, filter(None, keys)))  # None and empty keys add nothing
        + sum(map(len, filter(None, properties)))
    )


class EntryCache:
    """The most recently stored messages of each topic, at most ``max_bytes`` in all (0: nothing is kept).

    Not thread-safe: the server's event loop owns it.
    """

    def __init__(self, max_bytes: int) -> None:
        if type(max_bytes) is not int or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, not {max_bytes!r}")
        self.max_bytes = max_bytes
        self.bytes = 0
        """Bytes cached now (as :func:`columns_bytes` counts them)."""
        self.hits = 0
        """Messages given out from memory."""
        self.misses = 0
        """Reads that found nothing here and went to the log."""
        self._runs: dict[str, _Run] = {}
        self._chunks: deque[tuple[_Run, int, int]] = deque()  # (run, messages, bytes) as added, oldest first

    def __len__(self) -> int:
        """Messages cached now."""
        return sum(len(run.keys) - run.head for run in self._runs.values())

    def add(self, topic: str, stored: Sequence[StoredMessage]) -> None:
        """Cache ``stored``, messages of ``topic`` just stored, ascending (as :meth:`add_columns` does)."""
        if stored:
            positions, keys, payloads, times, properties, producers = zip(*stored, strict=True)
            self.add_columns(topic, positions[0], positions[-1], keys, payloads, times, properties, producers)

    def add_columns(  # noqa: PLR0917  (a commit's columns, each a list the caller made)
        self,
        topic: str,
        first: int,
        last: int,
        keys: Sequence[Key],
        payloads: Sequence[bytes],
        times: Sequence[int | None],
        properties: Sequence[bytes | None],
        producers: Sequence[str | None],
    ) -> None:
        """Cache the messages of ``topic`` at positions ``first`` to ``last``, just stored, by column; then drop
        the oldest past the bound.

        Messages that do not follow the topic's cached run at the next position start a new run
        (the old one is dropped), and columns of another length than ``last - first + 1`` (a gap
        in their positions) are not cached at all.
        """
        count = len(keys)
        if not len(payloads) == len(times) == len(properties) == len(producers) == count:
            raise ValueError(
                f"columns of {count} keys, {len(payloads)} payloads, {len(times)} publish times, "
                f"{len(properties)} properties and {len(producers)} producer names; expected one of each per message"
            )
        if not count or not self.max_bytes:
            return
        run = self._runs.get(topic)
        if run is not None and run.last() + 1 != first:
            self.drop(topic)
            run = None
        if last - first != count - 1:
            return  # not consecutive: what the log holds between them is not here
        if run is None:
            run = self._runs[topic] = _Run(topic, first)
        size = columns_bytes(keys, payloads, properties)
        run.keys += keys
        run.payloads += payloads
        run.times += times
        run.properties += properties
        run.producers += producers
        run.bytes += size
        self.bytes += size
        self._chunks.append((run, count, size))
        while self.bytes > self.max_bytes:
            self._evict()

    def _evict(self) -> None:
        """Drop the oldest messages added, the whole oldest chunk if that is not more than needed (a dropped
        run's bytes were counted off when it was dropped)."""
        run, count, size = self._chunks.popleft()
        if run.bytes == 0:
            return
        excess = self.bytes - self.max_bytes
        if size > excess:  # part of the chunk is enough: its oldest messages, one by one
            head = run.head
            freed = taken = 0
            while freed < excess:
                freed += run.size(head + taken)
                taken += 1
            self._chunks.appendleft((run, count - taken, size - freed))
            count, size = taken, freed
        run.forget(count)
        run.bytes -= size
        self.bytes -= size
        if run.head == len(run.keys):
            del self._runs[run.topic]

    def drop(self, topic: str) -> None:
        """Forget every cached message of ``topic``."""
        run = self._runs.pop(topic, None)
        if run is not None:
            self.bytes -= run.bytes
            run.bytes = 0
            run.keys, run.payloads, run.times, run.properties, run.producers = [], [], [], [], []
            run.head = 0

    def read(self, topic: str, after: int, limit: int) -> list[StoredMessage] | None:
        """Up to ``limit`` messages of ``topic`` from position ``after + 1`` on, or None when that one is not
        cached (a read of the log is needed). A list is never empty, and may be shorter than the log's answer:
        it ends where the cache does."""
        run = self._runs.get(topic)
        bad = type(after) is not int or type(limit) is not int or limit < 1  # the log says what is wrong
        if run is None or bad or not run.first() <= after + 1 <= run.last():
            self.misses += 1
            return None
        begin = after + 1 - run.start
        found = run.messages(begin, min(begin + limit, len(run.keys)))
        self.hits += len(found)
        return found

    def get_many(self, topic: str, positions: Iterable[int]) -> tuple[dict[int, StoredMessage], list[int]]:
        """The cached messages of ``topic`` at ``positions``, and the positions not cached (in the order given)."""
        run = self._runs.get(topic)
        if run is None:
            return {}, list(positions)
        found: dict[int, StoredMessage] = {}
        missing: list[int] = []
        low, high, start = run.first(), run.last(), run.start
        for position in positions:
            if type(position) is int and low <= position <= high:
                found[position] = run.message(position - start)
            else:
                missing.append(position)
        self.hits += len(found)
        if missing:
            self.misses += 1
        return found, missing
