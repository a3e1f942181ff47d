"""The storage interface the server talks to, with the group commit both backends share.

A server keeps nothing that matters outside its :class:`Store`: messages, producer sequence
ids, cursors, consume modes, delivery settings, dead letters, partition counts and the topics' schemas. Two
backends implement it: :class:`~keyfailover.broker.storage.SQLiteStore`, the embedded log of
one server (the default), and :class:`~keyfailover.broker.storage.postgresql.PostgresStore`,
the shared log of a cluster. Names are the topics a server serves: partition p of a topic
with P > 1 partitions is the topic ``<topic>-partition-<p>``.

Produce requests that arrive while a write is running are written together in the next one
(group commit), so a producer is answered only after the transaction holding its messages
committed, and the event loop never waits on the disk or the network. Every message of one
group commit gets the same publish time: the broker's wall clock as the commit began
(:func:`~keyfailover.broker.storage.records.publish_clock`, microseconds since the Unix epoch).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import operator
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from keyfailover.broker.cursor import Cursor
from keyfailover.broker.storage._cache import DEFAULT_ENTRY_CACHE_BYTES, EntryCache
from keyfailover.broker.storage.records import (
    DeadLetterEntry,
    DeadLetterGroup,
    DeadLetterRecord,
    Key,
    PropertiesColumn,
    SchemaRecord,
    StoredMessage,
    dead_letter_topic,
    publish_clock,
)
from keyfailover.core.errors import KeyFailoverError
from keyfailover.core.histogram import Histogram

__all__ = ["Batch", "Letter", "NotServedError", "Result", "Store", "StoreUnavailableError", "TopicDirectory"]

_log = logging.getLogger("keyfailover.server")
_key, _payload, _duplicate = operator.itemgetter(1), operator.itemgetter(2), operator.itemgetter(1)
_position = operator.itemgetter(0)

STORE_WAIT = 20.0
"""Seconds a group commit goes on trying while the store is out of reach before it refuses its requests: more
than a failover of a Patroni group with its default ``ttl`` of 10 s takes on loopback (writes acknowledged
again 10-13 s after a primary's SIGKILL), less than a Pulsar client's default send timeout of 30 s."""
_STORE_RETRY = (0.05, 0.5)  # seconds between those tries: the first, the most

Batch = tuple[str, str | None, Sequence[tuple[int | None, Key, bytes]], PropertiesColumn]
"""``(topic, producer or None, messages, properties)``: one produce request; each message ``(seq, key, payload)``,
``properties`` the encoded properties of each message, or None when none of them has any."""
Result = list[tuple[int, bool]]
"""``(position, duplicate)`` per message of a batch."""
Letter = DeadLetterEntry
"""``(position, key, payload, redelivery_count, reason, publish_time, properties)``: a message going to a
dead-letter topic."""


class TopicDirectory(Protocol):
    """Where a server's partitioned topics are recorded: its embedded log, or a cluster's ZooKeeper."""

    async def partition_counts(self) -> dict[str, int]:
        """Every topic created with partitions, and how many it has."""
        ...

    async def create_partitioned_topic(self, topic: str, partitions: int) -> bool:
        """Create ``topic`` with ``partitions``; False if it exists with as many (refused with another count)."""
        ...


class NotServedError(KeyFailoverError, RuntimeError):
    """A write for a topic (partition) this server does not serve: another broker does, or none."""


class StoreUnavailableError(KeyFailoverError, ConnectionError):
    """The log cannot be reached now: no member of a replicated store accepts writes, or the connection to it
    dropped. Retriable: a write it refused may or may not have been stored, and a named producer's resend of
    it is stored once."""


class Store(ABC):
    """Asynchronous storage for one server: every call runs off the event loop."""

    def __init__(self, entry_cache_bytes: int = DEFAULT_ENTRY_CACHE_BYTES) -> None:
        self.entry_cache = EntryCache(entry_cache_bytes)
        """What was stored last, answering reads of it without the backend (:mod:`._cache`)."""
        self._queue: list[tuple[Batch, asyncio.Future[Result]]] = []
        self._refusing: dict[tuple[str, str], int] = {}  # (topic, producer) -> the first sequence id refused
        self.store_wait = STORE_WAIT
        """Seconds a group commit goes on trying while the store is out of reach: :data:`STORE_WAIT`."""
        self._wake = asyncio.Event()
        self._closing = False
        self._last: dict[str, int] = {}
        self._listeners: list[Callable[[str], None]] = []
        self._task: asyncio.Task[None] | None = None
        self.appended = 0  # messages stored (duplicates not counted)
        self.commit_seconds = Histogram()

    # -- what each backend provides ----------------------------------------------------

    @abstractmethod
    async def _open(self) -> dict[str, int]:
        """Open the backend; the last position of every topic this server serves from the start."""

    @abstractmethod
    async def _write(self, batches: list[Batch], publish_time: int) -> list[Result | BaseException]:
        """Store the batches, each message with ``publish_time``; per batch its result, or the error that
        stored none of it."""

    @abstractmethod
    async def _shut(self) -> None:
        """Close the backend (everything queued was written)."""

    @abstractmethod
    async def _read(self, topic: str, after: int, limit: int) -> list[StoredMessage]:
        """Up to ``limit`` messages of ``topic`` above position ``after``, ascending, from the backend."""

    @abstractmethod
    async def _read_positions(self, topic: str, positions: Iterable[int]) -> dict[int, StoredMessage]:
        """The messages of ``topic`` at ``positions`` (those that exist), from the backend."""

    @abstractmethod
    async def position_at_time(self, topic: str, publish_time: int) -> int | None:
        """The first position of ``topic`` whose publish time is at or after ``publish_time`` (µs since the
        Unix epoch), None when there is none (a seek by time: messages without a publish time count as older)."""

    @abstractmethod
    async def last_sequence(self, topic: str, producer: str) -> int:
        """The highest sequence id ``producer`` stored in ``topic``; -1 when it stored none."""

    @abstractmethod
    async def subscriptions(self, topic: str) -> list[str]:
        """The subscriptions of ``topic`` with a saved cursor, sorted."""

    @abstractmethod
    async def load_cursor(self, topic: str, subscription: str) -> Cursor:
        """The subscription's saved cursor; a new subscription's is at 0."""

    @abstractmethod
    async def has_cursor(self, topic: str, subscription: str) -> bool:
        """Whether the subscription has a saved cursor (it was created here before)."""

    @abstractmethod
    async def delete_cursor(self, topic: str, subscription: str) -> bool:
        """Forget the subscription's saved cursor (an unsubscribe); whether it had one."""

    @abstractmethod
    async def save_cursors(self, cursors: Sequence[tuple[str, str, Cursor]]) -> None:
        """Save ``(topic, subscription, cursor)`` triples."""

    @abstractmethod
    async def load_consume_mode(self, topic: str, subscription: str) -> str | None:
        """The subscription's saved consume mode, or None."""

    @abstractmethod
    async def save_consume_mode(self, topic: str, subscription: str, mode: str) -> None:
        """Save the subscription's consume mode."""

    @abstractmethod
    async def load_delivery_settings(self, topic: str, subscription: str) -> dict[str, float | int | None]:
        """The delivery settings the subscription has of its own."""

    @abstractmethod
    async def save_delivery_settings(self, topic: str, subscription: str, settings: Mapping[str, object]) -> None:
        """Replace the subscription's own delivery settings (empty: none)."""

    @abstractmethod
    async def _dead_letter(self, topic: str, subscription: str, letters: Sequence[Letter]) -> list[int]:
        """Store the letters in the subscription's dead-letter topic; their positions there."""

    @abstractmethod
    async def dead_letters(self, topic: str, subscription: str, limit: int) -> list[DeadLetterRecord]:
        """The subscription's dead letters, oldest first."""

    @abstractmethod
    async def _replay_dead_letters(self, topic: str, subscription: str) -> list[StoredMessage]:
        """Re-publish the dead letters not replayed yet to ``topic``; the messages as stored there."""

    @abstractmethod
    async def dead_letter_groups(self) -> list[DeadLetterGroup]:
        """Every subscription's dead letters (in the topics this store can read) counted by reason."""

    @abstractmethod
    async def _purge_dead_letters(self, topic: str, subscription: str) -> int:
        """Delete the subscription's dead-letter records in ``topic``; how many there were."""

    @abstractmethod
    async def schemas(self, topic: str) -> list[SchemaRecord]:
        """Every version of ``topic``'s schema, oldest first; ``topic`` is a topic, not a partition (its partitions
        share its schema)."""

    @abstractmethod
    async def add_schema(self, topic: str, schema: SchemaRecord) -> bool:
        """Store ``schema`` as ``topic``'s next schema version; False, storing nothing, when ``schema.version`` is
        not the next one (another was added meanwhile: read them again)."""

    @abstractmethod
    def serves(self, topic: str) -> bool:
        """Whether this server may write ``topic`` now."""

    # -- the shared part ---------------------------------------------------------------

    async def start(self) -> None:
        """Open the backend and start the committer."""
        self._last.update(await self._open())
        self._task = asyncio.get_running_loop().create_task(self._commit_loop(), name="keyfailover-commit")

    def last_position(self, topic: str) -> int:
        """The last committed position of ``topic`` (0 when it has none)."""
        return self._last.get(topic, 0)

    def topics(self) -> list[str]:
        """The topics this server serves that hold messages."""
        return sorted(self._last)

    async def read(self, topic: str, after: int, limit: int) -> list[StoredMessage]:
        """Up to ``limit`` messages of ``topic`` above position ``after``, ascending.

        From the entry cache when it holds position ``after + 1`` (then up to where it ends:
        fewer than the log has, maybe, never none); else from the backend. Never above the last position
        this server knows of a topic it serves: a row there is of a commit it did not see succeed, which a
        failover of the store may undo (a commit whose wait for a synchronous standby was cancelled stays
        visible on the old primary, and the new one gives its position to another message).
        """
        found = self.entry_cache.read(topic, after, limit)
        if found is None:
            found = await self._read(topic, after, limit)
            if self.serves(topic):
                last = self._last.get(topic, 0)
                found = list(itertools.takewhile(lambda message: message.position <= last, found))
            return found
        await asyncio.sleep(0)  # no backend call awaited: let the event loop's other work in
        return found

    async def read_positions(self, topic: str, positions: Iterable[int]) -> dict[int, StoredMessage]:
        """The messages of ``topic`` at ``positions`` (those that exist): the cached ones from memory."""
        found, missing = self.entry_cache.get_many(topic, positions)
        if missing:
            found.update(await self._read_positions(topic, missing))
        return found

    def on_commit(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(topic)`` after each commit that stored messages in ``topic`` (they are in the entry
        cache then, when it has room)."""
        self._listeners.append(listener)

    def append(
        self,
        topic: str,
        producer: str | None,
        messages: Sequence[tuple[int | None, Key, bytes]],
        properties: PropertiesColumn = None,
    ) -> asyncio.Future[Result]:
        """Queue messages for the next group commit; the future gives (position, duplicate) each.

        ``properties``: each message's encoded properties (None for one without), or None when no
        message has any.
        """
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        if self._closing:
            future.set_exception(KeyFailoverError("the server is shutting down; nothing was stored"))
            return future
        if self._refusing:
            refusal = self._refused_after((topic, producer, messages, properties))
            if refusal is not None:
                future.set_exception(refusal)
                return future
        self._queue.append(((topic, producer, messages, properties), future))
        self._wake.set()
        return future

    async def dead_letter(self, topic: str, subscription: str, letters: Sequence[Letter]) -> list[int]:
        """Store dead letters in the subscription's dead-letter topic; their positions there."""
        positions = await self._dead_letter(topic, subscription, letters)
        stored = [
            StoredMessage(p, key, payload, publish_time, properties)
            for p, (_, key, payload, _, _, publish_time, properties) in zip(positions, letters, strict=True)
        ]
        self._stored(dead_letter_topic(topic, subscription), stored)
        return positions

    async def replay_dead_letters(self, topic: str, subscription: str) -> list[StoredMessage]:
        """Re-publish the subscription's dead letters not replayed yet."""
        stored = await self._replay_dead_letters(topic, subscription)
        self._stored(topic, stored)
        return stored

    async def purge_dead_letters(self, topic: str, subscription: str) -> int:
        """Delete the subscription's dead-letter records (replayed or not); how many there were. The messages stay
        in the dead-letter topic for anyone reading it."""
        return await self._purge_dead_letters(topic, subscription)

    async def close(self) -> None:
        """Commit what is queued, stop the committer and close the backend."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
        await self._shut()

    async def _commit_loop(self) -> None:
        """Write what was queued while the last write ran, one group commit at a time, until closed."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            queued, self._queue = self._queue, []
            if queued:
                await self._commit(queued)
            if self._closing and not self._queue:
                return

    async def _commit(self, queued: list[tuple[Batch, asyncio.Future[Result]]]) -> None:
        """Write the queued produce requests in one group commit, answer each, and put the new messages in the
        entry cache before the listeners hear of their topics."""
        started = time.perf_counter()
        now = publish_clock()
        results = await self._write_waiting([batch for batch, _ in queued], now)
        self.commit_seconds.observe(time.perf_counter() - started)
        refused = self._withdraw_after_refusals(queued, results)
        new_columns = []  # per batch with new messages: what the entry cache takes, once every future is set
        touched: dict[str, None] = {}  # the topics whose last position moved, in the order first moved
        for (batch, future), result in zip(queued, results, strict=True):
            if isinstance(result, BaseException):
                if not future.done():
                    future.set_exception(result)
                continue
            topic, producer, messages, properties = batch
            highest = max(map(_position, result), default=0)
            if highest > self._last.get(topic, 0):
                # New messages, or duplicates above the last known: those of a commit whose answer was lost
                # when the store failed over (stored, but never counted here). Either way readers may go on.
                self._last[topic] = highest
                touched[topic] = None
            new = len(result) - sum(map(_duplicate, result))
            if new:
                placed = result
                if new < len(result):  # retries of stored messages among them: the new ones only
                    fresh = [not duplicate for _, duplicate in result]
                    messages = list(itertools.compress(messages, fresh))
                    properties = None if properties is None else list(itertools.compress(properties, fresh))
                    placed = list(itertools.compress(result, fresh))
                first, last = placed[0][0], placed[-1][0]
                self.appended += new
                new_columns.append(
                    (topic, producer, first, last, messages, [None] * new if properties is None else properties)
                )
            if not future.done():
                future.set_result(result)
        for topic, producer, first, last, messages, properties in new_columns:
            self.entry_cache.add_columns(
                topic,
                first,
                last,
                list(map(_key, messages)),
                list(map(_payload, messages)),
                [now] * len(messages),
                properties,
                [producer] * len(messages),
            )
        for topic in touched:
            for listener in self._listeners:
                listener(topic)
        if refused:  # forgotten once the refusals just set are answered: their callbacks run first
            asyncio.get_running_loop().call_soon(self._forget_refusals, refused)

    async def _write_waiting(self, batches: list[Batch], publish_time: int) -> list[Result | BaseException]:
        """:meth:`_write`, the requests the store was out of reach for written again, with backoff, for up to
        :attr:`store_wait` seconds: a failover of the store takes about that long, and a request held here is
        stored as soon as a new primary writes, while one refused waits for its producer's backoff. The
        requests queued meanwhile wait behind these, in order. What still finds the store out of reach is
        refused, retriable."""
        results: list[Result | BaseException] = [StoreUnavailableError()] * len(batches)
        pending = list(range(len(batches)))
        deadline = time.monotonic() + self.store_wait
        delay = _STORE_RETRY[0]
        while True:
            try:
                written = await self._write([batches[i] for i in pending], publish_time)
            except StoreUnavailableError as exc:  # out of reach as a whole
                written = [exc] * len(pending)
            except Exception as exc:  # the backend failed as a whole: every request fails with it
                _log.exception("log append failed; %d produce requests rejected", len(pending))
                written = [exc] * len(pending)
            for i, result in zip(pending, written, strict=True):
                results[i] = result
            pending = [i for i in pending if isinstance(results[i], StoreUnavailableError)]
            if not pending or self._closing or time.monotonic() + delay > deadline:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, _STORE_RETRY[1])
        if pending:
            _log.warning("log append failed: %s; %d produce requests refused", results[pending[0]], len(pending))
        return results

    def _withdraw_after_refusals(
        self, queued: list[tuple[Batch, asyncio.Future[Result]]], results: Sequence[Result | BaseException]
    ) -> list[tuple[str, str]]:
        """Refuse the later produce requests of each named producer the store refused a request of, out of
        reach, in this commit: the next commit may find the store back, and stored then they would go before
        the refused one's resend, out of the producer's order. Those queued meanwhile are refused now; those
        that come until the refusals are answered are refused by :meth:`append` (the server then refuses the
        producer's later requests itself, until the resend, which starts at or below the refused one). The
        producers refused, for :meth:`_forget_refusals` once the refusals are answered."""
        refused: dict[tuple[str, str], int] = {}
        for ((topic, producer, messages, _), _), result in zip(queued, results, strict=True):
            if producer is not None and isinstance(result, StoreUnavailableError) and messages:
                first = messages[0][0]
                if first is not None:
                    refused[topic, producer] = min(first, refused.get((topic, producer), first))
        if not refused:
            return []
        self._refusing.update(refused)
        kept = []
        for batch, future in self._queue:
            refusal = self._refused_after(batch)
            if refusal is None:
                kept.append((batch, future))
            elif not future.done():
                future.set_exception(refusal)
        self._queue = kept
        return list(refused)

    def _refused_after(self, batch: Batch) -> StoreUnavailableError | None:
        """Why ``batch`` must not be stored: it follows a request of its producer refused just now; else None."""
        topic, producer, messages, _ = batch
        refused = None if producer is None else self._refusing.get((topic, producer))
        if refused is None or not messages or messages[0][0] is None or messages[0][0] <= refused:
            return None
        return StoreUnavailableError(
            f"an earlier produce of {producer!r} to {topic!r} (sequence id {refused}) was refused with the store "
            "out of reach; nothing of this one was stored: resend from the refused one, in order"
        )

    def _forget_refusals(self, keys: list[tuple[str, str]]) -> None:
        """The refusals of ``keys`` are answered: the server holds the producers' later requests back now."""
        for key in keys:
            self._refusing.pop(key, None)

    def _stored(self, topic: str, stored: list[StoredMessage]) -> None:
        """Account messages stored outside a group commit, and tell the listeners."""
        if not stored:
            return
        self.appended += len(stored)
        self._last[topic] = max(self._last.get(topic, 0), stored[-1].position)
        self.entry_cache.add(topic, stored)
        for listener in self._listeners:
            listener(topic)
