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
from keyfailover.broker.storage.records import DeadLetterRecord, StoredMessage
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
        return {topic: await self._call(self._log.last_position, topic) for topic in await self._call(self._log.topics)}

    async def _write(self, batches: list[Batch], publish_time: int) -> list[Result | BaseException]:
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
        await self._call(self._log.close)
        self._executor.shutdown(wait=True)

    async def _read(self, topic: str, after: int, limit: int) -> list[StoredMessage]:
        return await self._call(self._log.read, topic, after, limit)

    async def _read_positions(self, topic: str, positions: Iterable[int]) -> dict[int, StoredMessage]:
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
        return await self._call(self._log.last_sequence, topic, producer)

    async def subscriptions(self, topic: str) -> list[str]:
        return await self._call(self._log.subscriptions, topic)

    async def load_cursor(self, topic: str, subscription: str) -> Cursor:
        return await self._call(self._log.load_cursor, topic, subscription)

    async def has_cursor(self, topic: str, subscription: str) -> bool:
        return await self._call(self._log.has_cursor, topic, subscription)

    async def delete_cursor(self, topic: str, subscription: str) -> bool:
        return await self._call(self._log.delete_cursor, topic, subscription)

    async def save_cursors(self, cursors: Sequence[tuple[str, str, Cursor]]) -> None:
        await self._call(self._log.save_cursors, cursors)

    async def load_consume_mode(self, topic: str, subscription: str) -> str | None:
        return await self._call(self._log.load_consume_mode, topic, subscription)

    async def save_consume_mode(self, topic: str, subscription: str, mode: str) -> None:
        await self._call(self._log.save_consume_mode, topic, subscription, mode)

    async def load_delivery_settings(self, topic: str, subscription: str) -> dict[str, float | int | None]:
        return await self._call(self._log.load_delivery_settings, topic, subscription)

    async def save_delivery_settings(self, topic: str, subscription: str, settings: Mapping[str, object]) -> None:
        await self._call(self._log.save_delivery_settings, topic, subscription, settings)

    async def _dead_letter(self, topic: str, subscription: str, letters: Sequence[Letter]) -> list[int]:
        return await self._call(self._log.dead_letter, topic, subscription, letters)

    async def dead_letters(self, topic: str, subscription: str, limit: int) -> list[DeadLetterRecord]:
        return await self._call(self._log.dead_letters, topic, subscription, limit)

    async def _replay_dead_letters(self, topic: str, subscription: str) -> list[StoredMessage]:
        return await self._call(self._log.replay_dead_letters, topic, subscription)

    async def partition_counts(self) -> dict[str, int]:
        return await self._call(self._log.partition_counts)

    async def create_partitioned_topic(self, topic: str, partitions: int) -> bool:
        return await self._call(self._log.create_partitioned_topic, topic, partitions)
