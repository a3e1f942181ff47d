"""The log behind one worker thread, with group commit of produce requests.

SQLite wants one writer; the event loop must never wait on a commit. Every log call runs
on a single worker thread, and produce requests that arrive while a commit is running are
stored together in the next transaction (group commit), so a producer is answered only
after the transaction holding its messages committed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from keyfailover.broker.storage.sqlite import Key, Log, StoredMessage, dead_letter_topic
from keyfailover.core.errors import KeyFailoverError
from keyfailover.core.histogram import Histogram

__all__ = ["Storage"]

_P = ParamSpec("_P")
_T = TypeVar("_T")
_log = logging.getLogger("keyfailover.server")

Batch = tuple[str, str | None, Sequence[tuple[int | None, Key, bytes]]]
Result = list[tuple[int, bool]]


class Storage:
    """Asynchronous access to a :class:`Log`: calls on one thread, appends group-committed."""

    def __init__(self, log: Log) -> None:
        self._log = log
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keyfailover-log")
        self._queue: list[tuple[Batch, asyncio.Future[Result]]] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._last: dict[str, int] = {}
        self._listeners: list[Callable[[str, list[StoredMessage]], None]] = []
        self._task: asyncio.Task[None] | None = None
        self.appended = 0  # messages stored (duplicates not counted)
        self.commit_seconds = Histogram()

    async def start(self) -> None:
        """Load what the log holds and start the committer."""
        topics = await self.call(self._log.topics)
        for topic in topics:
            self._last[topic] = await self.call(self._log.last_position, topic)
        self._task = asyncio.get_running_loop().create_task(self._commit_loop(), name="keyfailover-commit")

    @property
    def log(self) -> Log:
        return self._log

    def last_position(self, topic: str) -> int:
        """The last committed position of ``topic`` (0 when it has none)."""
        return self._last.get(topic, 0)

    def topics(self) -> list[str]:
        return sorted(self._last)

    def on_commit(self, listener: Callable[[str, list[StoredMessage]], None]) -> None:
        """Call ``listener(topic, stored)`` after each commit that stored messages in ``topic`` (ascending)."""
        self._listeners.append(listener)

    async def call(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Run one log call on the log's thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def append(
        self, topic: str, producer: str | None, messages: Sequence[tuple[int | None, Key, bytes]]
    ) -> asyncio.Future[Result]:
        """Queue messages for the next group commit; the future gives (position, duplicate) each."""
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        if self._closing:
            future.set_exception(KeyFailoverError("the server is shutting down; nothing was stored"))
            return future
        self._queue.append(((topic, producer, messages), future))
        self._wake.set()
        return future

    async def dead_letter(
        self, topic: str, subscription: str, letters: Sequence[tuple[int, Key, bytes, int, str]]
    ) -> list[int]:
        """Store dead letters in the subscription's dead-letter topic (:meth:`Log.dead_letter`); their positions."""
        positions = await self.call(self._log.dead_letter, topic, subscription, letters)
        stored = [StoredMessage(p, key, payload) for p, (_, key, payload, _, _) in zip(positions, letters, strict=True)]
        self._stored(dead_letter_topic(topic, subscription), stored)
        return positions

    async def replay_dead_letters(self, topic: str, subscription: str) -> list[StoredMessage]:
        """Re-publish the subscription's dead letters not replayed yet (:meth:`Log.replay_dead_letters`)."""
        stored = await self.call(self._log.replay_dead_letters, topic, subscription)
        self._stored(topic, stored)
        return stored

    async def close(self) -> None:
        """Commit what is queued, stop the committer and close the log."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
        await self.call(self._log.close)
        self._executor.shutdown(wait=True)

    async def _commit_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            queued, self._queue = self._queue, []
            if queued:
                await self._commit(queued)
            if self._closing and not self._queue:
                return

    async def _commit(self, queued: list[tuple[Batch, asyncio.Future[Result]]]) -> None:
        started = time.perf_counter()
        try:
            results = await self.call(self._log.append, [batch for batch, _ in queued])
        except Exception as exc:
            if isinstance(exc, KeyFailoverError) and len(queued) > 1:
                # One bad request must not fail the others: the log rolled back, so store them one by one.
                for one in queued:
                    await self._commit([one])
                return
            if not isinstance(exc, KeyFailoverError):
                _log.exception("log append failed; %d produce requests rejected", len(queued))
            for _, future in queued:
                if not future.done():
                    future.set_exception(exc)
            return
        self.commit_seconds.observe(time.perf_counter() - started)
        touched: dict[str, list[StoredMessage]] = {}
        for (batch, future), result in zip(queued, results, strict=True):
            topic = batch[0]
            stored = touched.setdefault(topic, [])
            before = len(stored)
            stored += [
                StoredMessage(position, key, payload)
                for (_, key, payload), (position, duplicate) in zip(batch[2], result, strict=True)
                if not duplicate
            ]
            self.appended += len(stored) - before
            if result:
                self._last[topic] = max(self._last.get(topic, 0), *(position for position, _ in result))
            if not future.done():
                future.set_result(result)
        for topic, stored in sorted(touched.items()):
            if stored:
                for listener in self._listeners:
                    listener(topic, stored)

    def _stored(self, topic: str, stored: list[StoredMessage]) -> None:
        """Account messages stored outside a group commit, and tell the listeners."""
        if not stored:
            return
        self.appended += len(stored)
        self._last[topic] = max(self._last.get(topic, 0), stored[-1].position)
        for listener in self._listeners:
            listener(topic, stored)
