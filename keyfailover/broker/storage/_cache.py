"""The entry cache: the messages each topic stored last, kept in memory up to a bound in bytes.

A subscription that keeps up with its producers, or drains a backlog stored a moment ago,
reads what was just written. Answering those reads from memory spares the log a read and the
server a hop to the log's thread (Apache Pulsar's broker keeps such a cache of recent entries
for the same reason). Only committed messages enter it, and a stored position never changes,
so a cached message is always what the log would give. Per topic the cache holds one run of
consecutive positions; a commit that does not continue the run starts a new one. The oldest
messages (of all topics together) leave first once the bound is passed.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable, Sequence

from keyfailover.broker.storage.sqlite import StoredMessage

__all__ = ["DEFAULT_ENTRY_CACHE_BYTES", "ENTRY_OVERHEAD", "EntryCache"]

DEFAULT_ENTRY_CACHE_BYTES = 128 * 1024 * 1024
ENTRY_OVERHEAD = 232
"""Bytes a cached message takes besides its key, payload and properties (the tuple, its ints, the objects' headers)."""


class _Run:
    """Consecutive messages of one topic: ``messages[head:]`` are cached, positions ``first`` on."""

    __slots__ = ("bytes", "head", "messages", "topic")

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.messages: list[StoredMessage] = []
        self.head = 0
        self.bytes = 0

    def first(self) -> int:
        return self.messages[self.head].position

    def last(self) -> int:
        return self.messages[-1].position

    def forget(self, count: int) -> None:
        """Drop the ``count`` oldest messages (the list is shortened once half of it is dropped)."""
        self.head += count
        if self.head * 2 >= len(self.messages):
            del self.messages[: self.head]
            self.head = 0


def entry_bytes(message: StoredMessage) -> int:
    """What ``message`` is counted as in the cache."""
    key = message.key
    properties = message.properties
    return (
        ENTRY_OVERHEAD
        + len(message.payload)
        + (0 if key is None else len(key))
        + (0 if properties is None else len(properties))
    )


_key = operator.itemgetter(1)
_payload = operator.itemgetter(2)
_properties = operator.itemgetter(4)


def entries_bytes(messages: Sequence[StoredMessage]) -> int:
    """The sum of :func:`entry_bytes` of ``messages``, each part summed in C rather than a call per message."""
    return (
        ENTRY_OVERHEAD * len(messages)
        + sum(map(len, map(_payload, messages)))
        + sum(map(len, filter(None, map(_key, messages))))  # None and empty keys add nothing
        + sum(map(len, filter(None, map(_properties, messages))))
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
        """Bytes cached now (as :func:`entry_bytes` counts them)."""
        self.hits = 0
        """Messages given out from memory."""
        self.misses = 0
        """Reads that found nothing here and went to the log."""
        self._runs: dict[str, _Run] = {}
        self._chunks: deque[tuple[_Run, int, int]] = deque()  # (run, messages, bytes) as added, oldest first

    def __len__(self) -> int:
        """Messages cached now."""
        return sum(len(run.messages) - run.head for run in self._runs.values())

    def add(self, topic: str, stored: list[StoredMessage]) -> None:
        """Cache ``stored``, messages of ``topic`` just committed, ascending; then drop the oldest past the bound.

        Messages that do not follow the topic's cached run at the next position start a new run
        (the old one is dropped), and a list with a gap in its positions is not cached at all.
        """
        if not stored or not self.max_bytes:
            return
        first = stored[0].position
        run = self._runs.get(topic)
        if run is not None and run.last() + 1 != first:
            self.drop(topic)
            run = None
        if stored[-1].position - first != len(stored) - 1:
            return  # not consecutive: what the log holds between them is not here
        if run is None:
            run = self._runs[topic] = _Run(topic)
        size = entries_bytes(stored)
        run.messages += stored
        run.bytes += size
        self.bytes += size
        self._chunks.append((run, len(stored), size))
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
            messages, head = run.messages, run.head
            freed = taken = 0
            while freed < excess:
                freed += entry_bytes(messages[head + taken])
                taken += 1
            self._chunks.appendleft((run, count - taken, size - freed))
            count, size = taken, freed
        run.forget(count)
        run.bytes -= size
        self.bytes -= size
        if run.head == len(run.messages):
            del self._runs[run.topic]

    def drop(self, topic: str) -> None:
        """Forget every cached message of ``topic``."""
        run = self._runs.pop(topic, None)
        if run is not None:
            self.bytes -= run.bytes
            run.bytes = 0
            run.messages = []
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
        start = run.head + after + 1 - run.first()
        found = run.messages[start : start + limit]
        self.hits += len(found)
        return found

    def get_many(self, topic: str, positions: Iterable[int]) -> tuple[dict[int, StoredMessage], list[int]]:
        """The cached messages of ``topic`` at ``positions``, and the positions not cached (in the order given)."""
        run = self._runs.get(topic)
        if run is None:
            return {}, list(positions)
        found: dict[int, StoredMessage] = {}
        missing: list[int] = []
        low, high, offset = run.first(), run.last(), run.head - run.first()
        messages = run.messages
        for position in positions:
            if type(position) is int and low <= position <= high:
                found[position] = messages[offset + position]
            else:
                missing.append(position)
        self.hits += len(found)
        if missing:
            self.misses += 1
        return found, missing
