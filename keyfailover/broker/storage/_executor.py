"""The embedded SQLite log behind one worker thread: the default :class:`Store` of one server.

SQLite wants one writer; the event loop must never wait on a commit. Every log call runs on a
single worker thread, and the group commit of :class:`Store` writes the produce requests
that arrived during a commit together in the next transaction.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from keyfailover.broker.cursor import Cursor
from keyfailover.broker.storage._cache import DEFAULT_ENTRY_CACHE_BYTES
from keyfailover.broker.storage._store import Batch, Letter, Result, Store
from keyfailover.broker.storage.records import DeadLetterGroup, DeadLetterRecord, SchemaRecord, StoredMessage
from keyfailover.broker.storage.sqlite import Log
from keyfailover.core.errors import KeyFailoverError

__all__ = ["SQLiteStore"]

SEEK_CHUNK = 100_000
"""Positions a seek by time scans per call on the log's thread (about 13 ms on this project's machine)."""

_P = ParamSpec("_P")
_T = TypeVar("_T")


class SQLiteStore(Store):
    """A :class:`Log` as a :class:`Store`: calls on one thread, appends group-committed."""

    def __init__(self, log: Log, entry_cache_bytes: int = DEFAULT_ENTRY_CACHE_BYTES) -> None:
        super().__init__(entry_cache_bytes)
        self._log = log
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keyfailover-log")

    async def _call(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Run one log call on the log's thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def serves(self, topic: str) -> bool:
        """Always: the embedded log is one server's, and it serves every topic."""
        return True

    async def _open(self) -> dict[str, int]:
        """The last position of every topic of the log."""
        return {topic: await self._call(self._log.last_position, topic) for topic in await self._call(self._log.topics)}

    async def _write(self, batches: list[Batch], publish_time: int) -> list[Result | BaseException]:
        """Append the batches in one transaction; when one is bad, each alone, so only that one fails."""
        try:
            return list(await self._call(self._log.append, batches, publish_time))
        except KeyFailoverError as exc:
            if len(batches) == 1:
                return [exc]
        # One bad request must not fail the others: the log rolled back, so store them one by one.
        results: list[Result | BaseException] = []
        for batch in batches:
            results += await self._write([batch], publish_time)
        return results

    async def _shut(self) -> None:
        """Close the log, then its thread."""
        await self._call(self._log.close)
        self._executor.shutdown(wait=True)

    async def _read(self, topic: str, after: int, limit: int) -> list[StoredMessage]:
        """The log's read, on its thread."""
        return await self._call(self._log.read, topic, after, limit)

    async def _read_positions(self, topic: str, positions: Iterable[int]) -> dict[int, StoredMessage]:
        """The log's read of positions, on its thread."""
        return await self._call(self._log.read_positions, topic, positions)

    async def position_at_time(self, topic: str, publish_time: int) -> int | None:
        """Scanned in chunks of positions, each a call of its own on the log's thread, so that a seek over a
        long topic lets the group commits of every producer run in between (one scan would stall them)."""
        last = self.last_position(topic)
        after = 0
        while after < last:
            through = min(after + SEEK_CHUNK, last)
            found = await self._call(self._log.position_at_time, topic, publish_time, after, through)
            if found is not None:
                return found
            after = through
        return None

    async def last_sequence(self, topic: str, producer: str) -> int:
        """The highest sequence id ``producer`` stored in ``topic``; -1 when it stored none."""
        return await self._call(self._log.last_sequence, topic, producer)

    async def subscriptions(self, topic: str) -> list[str]:
        """The subscriptions of ``topic`` with a saved cursor, sorted."""
        return await self._call(self._log.subscriptions, topic)

    async def load_cursor(self, topic: str, subscription: str) -> Cursor:
        """The subscription's saved cursor; a new subscription's is at 0."""
        return await self._call(self._log.load_cursor, topic, subscription)

    async def has_cursor(self, topic: str, subscription: str) -> bool:
        """Whether the subscription has a saved cursor."""
        return await self._call(self._log.has_cursor, topic, subscription)

    async def delete_cursor(self, topic: str, subscription: str) -> bool:
        """Forget the subscription's saved cursor; whether it had one."""
        return await self._call(self._log.delete_cursor, topic, subscription)

    async def save_cursors(self, cursors: Sequence[tuple[str, str, Cursor]]) -> None:
        """Save ``(topic, subscription, cursor)`` triples in one transaction."""
        await self._call(self._log.save_cursors, cursors)

    async def load_consume_mode(self, topic: str, subscription: str) -> str | None:
        """The subscription's saved consume mode, or None."""
        return await self._call(self._log.load_consume_mode, topic, subscription)

    async def save_consume_mode(self, topic: str, subscription: str, mode: str) -> None:
        """Save the subscription's consume mode."""
        await self._call(self._log.save_consume_mode, topic, subscription, mode)

    async def load_delivery_settings(self, topic: str, subscription: str) -> dict[str, float | int | None]:
        """The delivery settings the subscription has of its own."""
        return await self._call(self._log.load_delivery_settings, topic, subscription)

    async def save_delivery_settings(self, topic: str, subscription: str, settings: Mapping[str, object]) -> None:
        """Replace the subscription's own delivery settings; empty: none."""
        await self._call(self._log.save_delivery_settings, topic, subscription, settings)

    async def _dead_letter(self, topic: str, subscription: str, letters: Sequence[Letter]) -> list[int]:
        """Store the letters in the subscription's dead-letter topic in one transaction; their positions there."""
        return await self._call(self._log.dead_letter, topic, subscription, letters)

    async def dead_letters(self, topic: str, subscription: str, limit: int) -> list[DeadLetterRecord]:
        """The subscription's dead letters, oldest first."""
        return await self._call(self._log.dead_letters, topic, subscription, limit)

    async def _replay_dead_letters(self, topic: str, subscription: str) -> list[StoredMessage]:
        """Re-publish the dead letters not replayed yet in one transaction; the messages as stored."""
        return await self._call(self._log.replay_dead_letters, topic, subscription)

    async def dead_letter_groups(self) -> list[DeadLetterGroup]:
        """Every subscription's dead letters counted by reason."""
        return await self._call(self._log.dead_letter_groups)

    async def _purge_dead_letters(self, topic: str, subscription: str) -> int:
        """Delete the subscription's dead-letter records in one transaction; how many there were."""
        return await self._call(self._log.purge_dead_letters, topic, subscription)

    async def schemas(self, topic: str) -> list[SchemaRecord]:
        """Every version of ``topic``'s schema, oldest first."""
        return await self._call(self._log.schemas, topic)

    async def add_schema(self, topic: str, schema: SchemaRecord) -> bool:
        """Store ``schema`` as ``topic``'s next schema version; False when it is not the next one."""
        return await self._call(self._log.add_schema, topic, schema)

    async def partition_counts(self) -> dict[str, int]:
        """Every topic created with partitions, and how many it has."""
        return await self._call(self._log.partition_counts)

    async def create_partitioned_topic(self, topic: str, partitions: int) -> bool:
        """Record ``topic``'s partitions; False when it has as many already."""
        return await self._call(self._log.create_partitioned_topic, topic, partitions)
