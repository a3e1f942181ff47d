"""The cluster's shared log in PostgreSQL: partitioned topics, producer dedup state and cursors,
with every write fenced by the partition's owner epoch.

A broker serves a partition only after :meth:`PostgresLog.open_partition`, which bumps the
partition's owner epoch and returns a :class:`Lease` carrying it. Every write for that
partition (an append, a cursor) locks the partition's row in the same transaction and checks
the epoch: once another broker has opened the partition, a broker that lost it (paused past its
ZooKeeper session, cut off from ZooKeeper) can never append or move a cursor again, even
before ZooKeeper tells it (as BookKeeper fences a ledger). It gets :class:`FencedError` and the
transaction stores nothing. A broker stopped in the middle of such a transaction (SIGSTOP, a
frozen machine) would hold the row, and so the new owner's epoch bump, until it woke: the new
owner ends that transaction instead (see :meth:`PostgresLog.open_partition`).

Messages of one partition get positions 1, 2, 3, ... without gaps. A named producer's messages
carry sequence ids; one stored for (partition, producer) already is a duplicate (a resend after
a failover): answered with the position it was stored at, not stored again. One below the
highest stored that was never stored is stored (a producer's batches may arrive out of order).
Each message has a publish time, as in the embedded log: the broker's wall clock when its
write began, in microseconds since the Unix epoch; NULL (unknown) for a message stored before
the log had the column. Its properties are kept as in the embedded log, encoded (a msgpack map
of str to str, :mod:`keyfailover.wire.properties`) in a nullable ``bytea``: NULL when it has
none. A dead letter, and a dead letter replayed, keeps its message's publish time and properties.

The store URL may name every member of a replicated PostgreSQL (a primary and its synchronous standbys
under Patroni): connections go to whichever member accepts writes (see
:mod:`keyfailover.broker.storage._postgresql_members`). While none does, or a connection drops under a
statement, or a statement gets no answer within :data:`STATEMENT_TIMEOUT` (its server froze), a call
raises :class:`StoreUnavailableError`, which is retriable: the pool connects to the new primary once
Patroni promotes one, and the owner epochs, which live in the replicated database, fence as before.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, ParamSpec, TypeVar

import asyncpg

from keyfailover.broker.cursor import Cursor
from keyfailover.broker.storage._cache import DEFAULT_ENTRY_CACHE_BYTES
from keyfailover.broker.storage._postgresql_members import UNREACHABLE as _UNREACHABLE
from keyfailover.broker.storage._postgresql_members import FailoverPool, connect_writable
from keyfailover.broker.storage._postgresql_members import described as _described
from keyfailover.broker.storage._postgresql_schema import (
    Row,
    check_message,
    check_partition,
    check_rows,
    create_schema,
    key_from_row,
    message_from_row,
    properties_from_row,
)
from keyfailover.broker.storage._store import Batch, Letter, NotServedError, Result, Store, StoreUnavailableError
from keyfailover.broker.storage.records import (
    DELIVERY_SETTINGS,
    DeadLetterGroup,
    DeadLetterRecord,
    Message,
    PropertiesColumn,
    SchemaRecord,
    StoredMessage,
    check_schema,
    publish_clock,
    schema_properties,
    schema_properties_text,
)
from keyfailover.core.errors import CursorError, LogError, LogFileError, PropertiesError

__all__ = [
    "APPLICATION_NAME",
    "CONNECT_TIMEOUT",
    "FENCE_PATIENCE",
    "STATEMENT_TIMEOUT",
    "FencedError",
    "Lease",
    "PartitionRow",
    "PostgresLog",
    "PostgresStore",
    "Row",
]

_log = logging.getLogger("keyfailover.server")
_ownership = logging.getLogger("keyfailover.ownership")  # every partition a broker starts or stops serving

APPLICATION_NAME = "keyfailover broker"
"""The ``application_name`` of a broker's connections to the shared log: a new owner ends only these."""

FENCE_PATIENCE = 0.25
"""Seconds a new owner's epoch bump waits for a transaction of the partition's previous owner before it ends
it. The new owner holds the partition's barrier, so the previous owner let the partition go or its ZooKeeper
session ended: a live one commits within milliseconds; one still holding the row after this is stopped."""

CONNECT_TIMEOUT = 5.0
"""Seconds a new connection to a member of the store may take: a member that does not answer within it
(frozen, cut off) is given up; the others are tried at the same time."""

STATEMENT_TIMEOUT = 10.0
"""Seconds a statement may wait for its server's answer before the call fails with
:class:`StoreUnavailableError`: a primary whose machine froze answers nothing, and Patroni replaces it
within its leader key's lifetime. A commit waiting for a synchronous standby that died waits about as long,
until Patroni lets the primary commit alone. A commit whose wait is cancelled so stays committed on the primary
alone, and is not acknowledged; its resend finds it stored, in a transaction that locks the partition's row, so
its own commit waits for the standby too, which then has everything before it: the duplicate is acknowledged only
once replicated, as the original would have been."""

_BUMP = """INSERT INTO kf_partitions (topic, partition, owner, owner_epoch) VALUES ($1, $2, $3, 1)
           ON CONFLICT (topic, partition) DO UPDATE
           SET owner = excluded.owner, owner_epoch = kf_partitions.owner_epoch + 1
           RETURNING owner_epoch, last_position"""

_BLOCKERS = """SELECT pid, application_name, state, wait_event, client_addr, client_port,
                      extract(epoch FROM now() - state_change)::float8 AS since, left(query, 120) AS query,
                      CASE WHEN $2 AND application_name = $3 AND wait_event = 'ClientRead'
                                AND state_change < now() - make_interval(secs => $4)
                           THEN pg_terminate_backend(pid) ELSE false END AS ended
               FROM pg_stat_activity WHERE pid = ANY(pg_blocking_pids($1)) ORDER BY pid"""
"""The backends keeping backend $1 from a lock, each ended (with $2) in the same statement when it is a broker's
($3) that has waited for its client since at least $4 seconds ago: idle in a transaction, or in a COPY, the way a
stopped broker leaves it. One that is working (a COMMIT waiting for a synchronous standby, which may commit) is
left alone, and so is one that began its wait just now (a live broker's connection, reused since it was listed)."""

T = TypeVar("T")
P = ParamSpec("P")


class FencedError(NotServedError):
    """A write under an owner epoch that is no longer the partition's: another broker opened it."""


def _reachable(method: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """``method``, with the store out of reach raised as :class:`StoreUnavailableError`."""

    @functools.wraps(method)
    async def reaching(*args: P.args, **kwargs: P.kwargs) -> T:
        """Call ``method``; the store out of reach is a :class:`StoreUnavailableError`."""
        try:
            return await method(*args, **kwargs)
        except _UNREACHABLE as exc:
            if isinstance(exc, asyncpg.DataError):  # an argument PostgreSQL cannot take: no retry cures it
                raise
            raise StoreUnavailableError(
                f"the log's PostgreSQL cannot be reached now: {_described(exc)}; what was asked may have been done "
                "or not: try again"
            ) from exc

    return reaching


@dataclass(frozen=True)
class Lease:
    """The right to write one partition, as long as ``epoch`` is its owner epoch."""

    topic: str
    partition: int
    owner: str
    epoch: int
    last_position: int
    """The partition's last position when it was opened."""


class PostgresLog:
    """The shared log; open it with :meth:`connect`, close it with :meth:`close`."""

    def __init__(self, pool: FailoverPool) -> None:
        self._pool = pool

    @classmethod
    async def connect(cls, dsn: str, *, max_size: int = 4) -> PostgresLog:
        """Connect to ``dsn`` and create the tables if missing; :class:`LogError` names an unreachable server,
        or each member of ``dsn`` and why none accepts writes.

        The connections name themselves :data:`APPLICATION_NAME` (``pg_stat_activity`` shows it). The pool
        keeps no floor of connections: while the store fails over, connections are made when a call needs
        one, not retried in the background."""
        pool = await asyncpg.create_pool(
            dsn,
            connect=connect_writable,
            min_size=0,
            max_size=max_size,
            timeout=CONNECT_TIMEOUT,
            command_timeout=STATEMENT_TIMEOUT,
            server_settings={"application_name": APPLICATION_NAME},
        )
        failover = FailoverPool(pool)
        try:
            async with failover.transaction() as connection:
                await create_schema(connection)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            await failover.close()
            raise LogError(f"cannot reach PostgreSQL at {_redacted(dsn)}: {_described(exc)}") from None
        return cls(failover)

    @property
    def pool(self) -> FailoverPool:
        """The connection pool."""
        return self._pool

    async def close(self) -> None:
        """Close the connection pool."""
        await self._pool.close()

    async def open_partition(self, topic: str, partition: int, owner: str) -> Lease:
        """Take ``partition`` of ``topic`` for ``owner``: bump its owner epoch (fencing every earlier lease).

        Call it only while holding the partition's barrier: then whatever else holds the partition's
        row is a transaction of an earlier owner, which let the partition go or whose ZooKeeper
        session ended. One that still holds it after :data:`FENCE_PATIENCE` belongs to a broker that
        stopped in the middle of a write (a frozen process, a dead machine whose connection PostgreSQL
        has not noticed): waiting would keep the partition unserved until it wakes, so the bump ends
        that broker's connection (``pg_terminate_backend``), if it waits for its client (idle in the
        transaction, or in a COPY) and has since :data:`FENCE_PATIENCE` ago. Its transaction is rolled
        back, and it had acknowledged nothing: it had not sent its commit. A blocker that is working (a
        commit waiting for a synchronous standby) or is not a keyfailover broker's connection is waited
        for. Each step is logged on ``keyfailover.ownership``.
        """
        check_partition(topic, partition)
        async with self._pool.acquire() as connection:
            bump = asyncio.ensure_future(connection.fetchrow(_BUMP, topic, partition, owner))
            seen: set[tuple[int, bool]] = set()
            try:
                while not (await asyncio.wait({bump}, timeout=FENCE_PATIENCE))[0]:
                    await self._end_blockers(connection.get_server_pid(), topic, partition, owner, seen)
                row = bump.result()
            finally:
                if not bump.done():  # cancelled while waiting: the statement is cancelled with it
                    bump.cancel()
                    await asyncio.wait({bump})
        if seen:
            _ownership.info(
                "broker %s fenced partition %d of %r at owner epoch %d", owner, partition, topic, row["owner_epoch"]
            )
        return Lease(topic, partition, owner, int(row["owner_epoch"]), int(row["last_position"]))

    async def _end_blockers(
        self, waiting: int, topic: str, partition: int, owner: str, seen: set[tuple[int, bool]]
    ) -> None:
        """End the stopped brokers' connections that keep backend ``waiting`` (an epoch bump) from the partition's
        row (see :data:`_BLOCKERS`); say what each blocker is, and whether it is ended, once (``seen``)."""
        before = await self.owner_epoch(topic, partition)  # read before a blocker is ended: the bump goes on then
        try:
            blockers = await self._pool.fetch(_BLOCKERS, waiting, True, APPLICATION_NAME, FENCE_PATIENCE)
        except asyncpg.InsufficientPrivilegeError as exc:
            if (-1, False) not in seen:
                seen.add((-1, False))
                _log.warning(
                    "broker %s cannot end the PostgreSQL connections that hold partition %d of %r (%s); it waits "
                    "for them. Grant the brokers' role pg_signal_backend, or run every broker as one role, so that "
                    "a new owner can fence a stopped one",
                    owner,
                    partition,
                    topic,
                    exc,
                )
            blockers = await self._pool.fetch(_BLOCKERS, waiting, False, APPLICATION_NAME, FENCE_PATIENCE)
        news = [b for b in blockers if (int(b["pid"]), bool(b["ended"])) not in seen]
        if not news:
            return
        holder = "no broker" if before is None else f"broker {before[0]} (owner epoch {before[1]})"
        for blocker in news:
            ended = bool(blocker["ended"])
            seen.add((int(blocker["pid"]), ended))
            if ended:
                then = "it ends that connection (its transaction is rolled back)"
            elif blocker["application_name"] == APPLICATION_NAME:
                then = f"it waits for it (working: {blocker['wait_event'] or 'on the CPU'})"
            else:
                then = "not a keyfailover broker's connection, so it waits for it"
            _ownership.info(
                "broker %s waits to open partition %d of %r, last opened by %s: PostgreSQL backend %d "
                "(%s, from %s:%s) holds its row, %s for %.2f s after %r; %s",
                owner,
                partition,
                topic,
                holder,
                blocker["pid"],
                blocker["application_name"] or "no application name",
                blocker["client_addr"],
                blocker["client_port"],
                blocker["state"],
                float(blocker["since"] or 0.0),
                blocker["query"],
                then,
            )

    async def append(
        self,
        lease: Lease,
        producer: str | None,
        messages: Sequence[Message],
        publish_time: int | None = None,
        properties: PropertiesColumn = None,
    ) -> list[tuple[int, bool]]:
        """Store ``messages``, each ``(seq, key, payload)``, in the leased partition, in one transaction.

        Returns ``(position, duplicate)`` per message, as the SQLite log does: a duplicate is
        answered with the position it was stored at. Each
        message stored gets ``publish_time`` (µs since the Unix epoch; by default the clock now)
        and its encoded ``properties`` (one per message, None for one without; None: none has any).
        Raises :class:`FencedError`, storing nothing, when the lease is no longer the partition's.
        """
        return (await self.append_batches(lease, [(producer, messages, properties)], publish_time))[0]

    async def append_batches(
        self,
        lease: Lease,
        batches: Sequence[tuple[str | None, Sequence[Message], PropertiesColumn]],
        publish_time: int | None = None,
    ) -> list[list[tuple[int, bool]]]:
        """Store several produce requests ``(producer, messages, properties)`` in the leased partition in one
        transaction (one COPY): as :meth:`append` each, in order; all or nothing."""
        now = publish_clock() if publish_time is None else publish_time
        checked = [
            (producer, check_rows(producer, messages, properties, now)) for producer, messages, properties in batches
        ]
        async with self._pool.transaction() as connection:
            return await self.append_in(connection, lease, checked)

    async def append_in(
        self, connection: Any, lease: Lease, checked: Sequence[tuple[str | None, Sequence[Row]]]
    ) -> list[list[tuple[int, bool]]]:
        """:meth:`append_batches` of checked rows inside the caller's transaction on ``connection``."""
        last = await self.check_lease(connection, lease)
        named = sorted({producer for producer, _ in checked if producer is not None})
        found = await connection.fetch(
            """SELECT producer, last_seq FROM kf_producers
               WHERE topic = $1 AND partition = $2 AND producer = ANY($3::text[])""",
            lease.topic,
            lease.partition,
            named,
        )
        highest = {str(row["producer"]): int(row["last_seq"]) for row in found}
        before = dict(highest)
        stored = await self._stored(connection, lease, checked, before)  # (producer, seq) -> position
        results: list[list[tuple[int, bool]]] = []
        records = []
        for producer, rows in checked:
            result: list[tuple[int, bool]] = []
            for seq, key, is_text, payload, published, encoded in rows:
                if producer is not None and seq is not None:
                    if seq > highest.get(producer, -1):
                        highest[producer] = seq
                    elif (producer, seq) in stored:
                        result.append((stored[producer, seq], True))
                        continue
                    # else sent after a higher seq and never stored (another key's batch went first): stored now
                last += 1
                if producer is not None and seq is not None:
                    stored[producer, seq] = last
                records.append(
                    (
                        lease.topic,
                        lease.partition,
                        last,
                        key,
                        is_text,
                        payload,
                        producer,
                        seq,
                        lease.epoch,
                        published,
                        encoded,
                    )
                )
                result.append((last, False))
            results.append(result)
        if records:
            await connection.copy_records_to_table(
                "kf_messages",
                records=records,
                columns=[
                    "topic",
                    "partition",
                    "position",
                    "key",
                    "key_is_text",
                    "payload",
                    "producer",
                    "seq",
                    "epoch",
                    "publish_time",
                    "properties",
                ],
            )
            await connection.execute(
                "UPDATE kf_partitions SET last_position = $3 WHERE topic = $1 AND partition = $2",
                lease.topic,
                lease.partition,
                last,
            )
            moved = [(producer, seq) for producer, seq in highest.items() if before.get(producer) != seq]
            await connection.executemany(
                """INSERT INTO kf_producers (topic, partition, producer, last_seq) VALUES ($1, $2, $3, $4)
                   ON CONFLICT (topic, partition, producer) DO UPDATE SET last_seq = excluded.last_seq""",
                [(lease.topic, lease.partition, producer, seq) for producer, seq in moved],
            )
        return results

    @staticmethod
    async def _stored(
        connection: Any, lease: Lease, checked: Sequence[tuple[str | None, Sequence[Row]]], highest: Mapping[str, int]
    ) -> dict[tuple[str, int], int]:
        """Where the messages of ``checked`` whose sequence ids are at or below their producer's ``highest``
        were stored before, by ``(producer, seq)`` (those never stored are not in it)."""
        wanted: dict[str, set[int]] = defaultdict(set)
        for producer, rows in checked:
            if producer is not None and producer in highest:
                below = highest[producer]
                wanted[producer].update(row[0] for row in rows if row[0] is not None and row[0] <= below)
        stored: dict[tuple[str, int], int] = {}
        if any(wanted.values()):
            # The lock the COPY after this takes, taken first: reading the table first and upgrading after
            # could deadlock with another transaction's waiting request for a stronger lock.
            await connection.execute("LOCK TABLE kf_messages IN ROW EXCLUSIVE MODE")
        for producer, seqs in sorted(wanted.items()):
            found = await connection.fetch(
                """SELECT seq, position FROM kf_messages
                   WHERE topic = $1 AND partition = $2 AND producer = $3 AND seq = ANY($4::bigint[])""",
                lease.topic,
                lease.partition,
                producer,
                sorted(seqs),
            )
            stored.update(((producer, int(row["seq"])), int(row["position"])) for row in found)
        return stored

    async def read(self, topic: str, partition: int, after: int, limit: int) -> list[StoredMessage]:
        """Up to ``limit`` messages of the partition after position ``after``, in position order."""
        check_partition(topic, partition)
        rows = await self._pool.fetch(
            """SELECT position, key, key_is_text, payload, publish_time, properties, producer FROM kf_messages
               WHERE topic = $1 AND partition = $2 AND position > $3 ORDER BY position LIMIT $4""",
            topic,
            partition,
            after,
            limit,
        )
        names: dict[str, str] = {}
        return [message_from_row(r, names) for r in rows]

    async def position_at_time(self, topic: str, partition: int, publish_time: int) -> int | None:
        """The first position of the partition whose publish time is at or after ``publish_time`` (µs since
        the Unix epoch), None when there is none; messages without a publish time count as older. The primary
        key walked in position order from the start: O(messages before it)."""
        check_partition(topic, partition)
        found = await self._pool.fetchval(
            """SELECT position FROM kf_messages WHERE topic = $1 AND partition = $2 AND publish_time >= $3
               ORDER BY position LIMIT 1""",
            topic,
            partition,
            publish_time,
        )
        return None if found is None else int(found)

    async def save_cursor(self, lease: Lease, subscription: str, cursor: Cursor) -> None:
        """Save a subscription's cursor of the leased partition; :class:`FencedError` if the lease is stale."""
        async with self._pool.transaction() as connection:
            await self.check_lease(connection, lease)
            await connection.execute(
                """INSERT INTO kf_cursors (topic, partition, subscription, state) VALUES ($1, $2, $3, $4)
                   ON CONFLICT (topic, partition, subscription) DO UPDATE SET state = excluded.state""",
                lease.topic,
                lease.partition,
                subscription,
                cursor.to_bytes(),
            )

    async def delete_cursor(self, lease: Lease, subscription: str) -> bool:
        """Forget a subscription's cursor of the leased partition; whether it had one (:class:`FencedError`
        if the lease is stale)."""
        async with self._pool.transaction() as connection:
            await self.check_lease(connection, lease)
            deleted = await connection.execute(
                "DELETE FROM kf_cursors WHERE topic = $1 AND partition = $2 AND subscription = $3",
                lease.topic,
                lease.partition,
                subscription,
            )
            return str(deleted) != "DELETE 0"

    async def load_cursor(self, topic: str, partition: int, subscription: str) -> Cursor:
        """The saved cursor of ``subscription`` on the partition (a new one at position 0 if none)."""
        state = await self._pool.fetchval(
            "SELECT state FROM kf_cursors WHERE topic = $1 AND partition = $2 AND subscription = $3",
            topic,
            partition,
            subscription,
        )
        return Cursor() if state is None else Cursor.from_bytes(bytes(state))

    async def owner_epoch(self, topic: str, partition: int) -> tuple[str, int] | None:
        """The partition's current ``(owner, owner epoch)``, None if no broker ever opened it."""
        row = await self._pool.fetchrow(
            "SELECT owner, owner_epoch FROM kf_partitions WHERE topic = $1 AND partition = $2", topic, partition
        )
        return None if row is None else (str(row["owner"]), int(row["owner_epoch"]))

    @staticmethod
    async def check_lease(connection: Any, lease: Lease) -> int:
        """Lock the partition's row for this transaction and check the lease; its last position."""
        row = await connection.fetchrow(
            """SELECT owner, owner_epoch, last_position FROM kf_partitions
               WHERE topic = $1 AND partition = $2 FOR UPDATE""",
            lease.topic,
            lease.partition,
        )
        if row is None or int(row["owner_epoch"]) != lease.epoch:
            now = "never opened" if row is None else f"opened by {row['owner']} at owner epoch {row['owner_epoch']}"
            raise FencedError(
                f"partition {lease.partition} of {lease.topic!r} was {now}; {lease.owner}'s lease at epoch "
                f"{lease.epoch} is stale, so nothing was written (expected the partition's current owner)"
            )
        return int(row["last_position"])


class PartitionRow(NamedTuple):
    """One partition of the shared log as :meth:`PostgresStore.partition_table` lists it."""

    topic: str
    partition: int
    owner: str
    """The broker that opened it last."""
    owner_epoch: int
    subscriptions: list[str]


Locate = Callable[[str], tuple[str, int]]
"""A served topic name -> ``(topic, partition)`` as the log keys it: ``T-partition-p`` -> ``(T, p)``."""


class PostgresStore(Store):
    """A cluster broker's :class:`Store`: the shared log in PostgreSQL, written only under leases.

    The broker serves a topic (a partition) from :meth:`acquire`, which bumps its owner epoch,
    to :meth:`release`; every write checks the lease in its transaction. A write refused
    because another broker took the partition meanwhile drops the lease and calls
    ``on_fenced(topic)``: the server stops serving it.
    """

    def __init__(self, dsn: str, locate: Locate, entry_cache_bytes: int = DEFAULT_ENTRY_CACHE_BYTES) -> None:
        super().__init__(entry_cache_bytes)
        self._dsn = dsn
        self.owner = ""
        """Who opens partitions (the broker id PostgreSQL records); set before the first :meth:`acquire`."""
        self._locate = locate
        self._log: PostgresLog | None = None
        self._leases: dict[str, Lease] = {}
        self.on_fenced: Callable[[str], None] = lambda topic: None

    @property
    def log(self) -> PostgresLog:
        """The shared log; :class:`LogError` before the store is opened."""
        if self._log is None:
            raise LogError("the PostgreSQL store is not open")
        return self._log

    def serves(self, topic: str) -> bool:
        """Whether this broker holds ``topic``'s lease: it writes only the topics it acquired."""
        return topic in self._leases

    def served(self) -> dict[str, Lease]:
        """The topics this broker serves now, with their leases."""
        return dict(self._leases)

    @_reachable
    async def acquire(self, topic: str) -> Lease:
        """Serve ``topic``: bump its owner epoch (fencing whoever had it) and learn its last position."""
        name, partition = self._locate(topic)
        lease = await self.log.open_partition(name, partition, self.owner)
        self._leases[topic] = lease
        self._last[topic] = lease.last_position
        _ownership.info("broker %s serves %r at owner epoch %d", self.owner, topic, lease.epoch)
        return lease

    def release(self, topic: str) -> None:
        """Stop serving ``topic``: nothing more is written for it by this broker."""
        lease = self._leases.pop(topic, None)
        self._last.pop(topic, None)
        self.entry_cache.drop(topic)  # what it held stays true, but another broker writes the topic on
        if lease is not None:
            _ownership.info("broker %s stops serving %r (owner epoch %d)", self.owner, topic, lease.epoch)

    def _lease(self, topic: str) -> Lease:
        """``topic``'s lease; :class:`NotServedError` when this broker does not serve it."""
        lease = self._leases.get(topic)
        if lease is None:
            raise NotServedError(f"this broker does not serve {topic!r} now; nothing was written")
        return lease

    def _fenced(self, topic: str, lease: Lease) -> None:
        """Stop serving ``topic`` when ``lease``, which another broker fenced, is still the one it holds."""
        if self._leases.get(topic) is lease:
            _log.warning("%s: fenced out of %r (another broker opened it); it stops serving it", self.owner, topic)
            self.release(topic)
            self.on_fenced(topic)

    async def _leased(self, topic: str, write: Callable[[Lease], Awaitable[T]]) -> T:
        """``write(lease)`` under ``topic``'s lease. Refused on its epoch (:class:`FencedError`), the broker
        stops serving the topic. So it does when the connection died under the write while another broker
        opened the partition (a new owner ends the connections of a stopped one): :class:`FencedError` too.
        When this broker let the topic go meanwhile, :class:`NotServedError`. Either way the client looks
        the topic up again and resends. When the store is out of reach, or the lease still holds after the
        connection died (a failover of the store), :class:`StoreUnavailableError`: the client resends here."""
        lease = self._lease(topic)
        try:
            return await write(lease)
        except FencedError:
            self._fenced(topic, lease)
            raise
        except _UNREACHABLE as exc:
            if isinstance(exc, asyncpg.DataError):  # an argument PostgreSQL cannot take: no retry cures it
                raise
            if self._leases.get(topic) is not lease:
                raise NotServedError(
                    f"this broker stopped serving {topic!r} while writing it (its connection to PostgreSQL was lost: "
                    f"{_described(exc)}); nothing of the write was acknowledged"
                ) from exc
            unknown = "the write may have been stored or not: a named producer's resend is stored once"
            try:
                now = await self.log.owner_epoch(lease.topic, lease.partition)
            except (*_UNREACHABLE, asyncpg.PostgresError):
                raise StoreUnavailableError(
                    f"the log's PostgreSQL cannot be reached to write {topic!r} ({_described(exc)}); {unknown}"
                ) from None
            if now is not None and now[1] == lease.epoch:
                raise StoreUnavailableError(
                    f"the connection to the log's PostgreSQL was lost writing {topic!r} ({_described(exc)}); {unknown}"
                ) from exc
            self._fenced(topic, lease)
            opened = "nobody" if now is None else f"{now[0]} at owner epoch {now[1]}"
            raise FencedError(
                f"partition {lease.partition} of {lease.topic!r} was opened by {opened} while {lease.owner} wrote it "
                f"at owner epoch {lease.epoch}, and its connection to PostgreSQL was ended; nothing of the write was "
                "acknowledged"
            ) from exc

    async def _open(self) -> dict[str, int]:
        """Connect to the shared log; no topic is served until :meth:`acquire`."""
        self._log = await PostgresLog.connect(self._dsn, max_size=8)
        return {}

    async def _shut(self) -> None:
        """Close the connection to the shared log."""
        if self._log is not None:
            await self._log.close()

    async def _write(self, batches: list[Batch], publish_time: int) -> list[Result | BaseException]:
        """Store each topic's batches in one transaction under its lease, the topics side by side. When a
        transaction of several batches is refused for a bad request, each of them is stored alone."""
        by_topic: dict[str, list[int]] = defaultdict(list)
        for index, (topic, _, _, _) in enumerate(batches):
            by_topic[topic].append(index)
        results: list[Result | BaseException] = [LogError("not written")] * len(batches)

        async def write(topic: str, indexes: list[int]) -> None:
            """Store the batches at ``indexes``, all of ``topic``, and set their results."""
            requests = [batches[i][1:] for i in indexes]
            try:
                stored = await self._leased(topic, lambda lease: self.log.append_batches(lease, requests, publish_time))
            except (LogError, PropertiesError, NotServedError, StoreUnavailableError) as exc:
                if len(indexes) > 1 and isinstance(exc, LogError | PropertiesError):  # a bad request: each alone
                    for at, i in enumerate(indexes):
                        await write(topic, [i])
                        if isinstance(results[i], StoreUnavailableError):  # the rest would go ahead of its resend
                            for j in indexes[at + 1 :]:
                                results[j] = results[i]
                            return
                    return
                for i in indexes:
                    results[i] = exc
                return
            for i, result in zip(indexes, stored, strict=True):
                results[i] = result

        await asyncio.gather(*(write(topic, indexes) for topic, indexes in by_topic.items()))
        return results

    @_reachable
    async def _read(self, topic: str, after: int, limit: int) -> list[StoredMessage]:
        """Up to ``limit`` messages of the partition ``topic`` names, above position ``after``."""
        name, partition = self._locate(topic)
        return await self.log.read(name, partition, after, limit)

    @_reachable
    async def position_at_time(self, topic: str, publish_time: int) -> int | None:
        """The first position of the partition ``topic`` names stored at or after ``publish_time``."""
        name, partition = self._locate(topic)
        return await self.log.position_at_time(name, partition, publish_time)

    @_reachable
    async def _partition_value(self, topic: str, sql: str, *arguments: object) -> Any:
        """The one value of ``sql`` for the partition ``topic`` names: its ``$1`` and ``$2`` are the
        partition's topic and number, then come ``arguments``; None when it finds no row."""
        name, partition = self._locate(topic)
        return await self.log.pool.fetchval(sql, name, partition, *arguments)

    async def last_sequence(self, topic: str, producer: str) -> int:
        """The highest sequence id ``producer`` stored in ``topic``; -1 when it stored none."""
        found = await self._partition_value(
            topic, "SELECT last_seq FROM kf_producers WHERE topic = $1 AND partition = $2 AND producer = $3", producer
        )
        return -1 if found is None else int(found)

    @_reachable
    async def _read_positions(self, topic: str, positions: Iterable[int]) -> dict[int, StoredMessage]:
        """The messages at ``positions`` of the partition ``topic`` names, those it holds."""
        name, partition = self._locate(topic)
        rows = await self.log.pool.fetch(
            """SELECT position, key, key_is_text, payload, publish_time, properties, producer FROM kf_messages
               WHERE topic = $1 AND partition = $2 AND position = ANY($3::bigint[])""",
            name,
            partition,
            list(positions),
        )
        names: dict[str, str] = {}
        return {int(r["position"]): message_from_row(r, names) for r in rows}

    @_reachable
    async def subscriptions(self, topic: str) -> list[str]:
        """The subscriptions with a saved cursor of the partition ``topic`` names, sorted."""
        name, partition = self._locate(topic)
        rows = await self.log.pool.fetch(
            "SELECT subscription FROM kf_cursors WHERE topic = $1 AND partition = $2 ORDER BY subscription",
            name,
            partition,
        )
        return [str(row["subscription"]) for row in rows]

    async def delete_cursor(self, topic: str, subscription: str) -> bool:
        """Forget the subscription's cursor under ``topic``'s lease; whether it had one."""
        return await self._leased(topic, lambda lease: self.log.delete_cursor(lease, subscription))

    async def has_cursor(self, topic: str, subscription: str) -> bool:
        """Whether the subscription has a saved cursor of the partition ``topic`` names."""
        found = await self._partition_value(
            topic, "SELECT 1 FROM kf_cursors WHERE topic = $1 AND partition = $2 AND subscription = $3", subscription
        )
        return found is not None

    @_reachable
    async def load_cursor(self, topic: str, subscription: str) -> Cursor:
        """The subscription's saved cursor; :class:`LogFileError` when it is unreadable."""
        name, partition = self._locate(topic)
        try:
            return await self.log.load_cursor(name, partition, subscription)
        except CursorError as exc:
            raise LogFileError(f"the cursor of {subscription!r} on {topic!r} is unreadable: {exc}") from exc

    async def save_cursors(self, cursors: Sequence[tuple[str, str, Cursor]]) -> None:
        """Save each ``(topic, subscription, cursor)`` under its topic's lease, one transaction each."""
        for topic, subscription, cursor in cursors:
            await self._leased(topic, partial(self.log.save_cursor, subscription=subscription, cursor=cursor))

    @_reachable
    async def _setting(self, topic: str, subscription: str, column: str) -> Any:
        """The subscription's saved ``column`` of ``kf_subscription_settings``; None when none was saved."""
        return await self.log.pool.fetchval(
            f"SELECT {column} FROM kf_subscription_settings WHERE topic = $1 AND subscription = $2",
            topic,
            subscription,
        )

    async def load_consume_mode(self, topic: str, subscription: str) -> str | None:
        """The subscription's saved consume mode, or None."""
        found = await self._setting(topic, subscription, "consume_mode")
        return None if found is None else str(found)

    @_reachable
    async def save_consume_mode(self, topic: str, subscription: str, mode: str) -> None:
        """Save the subscription's consume mode, ``"ordered"`` or ``"unordered"``."""
        if mode not in ("ordered", "unordered"):
            raise LogError(f"consume mode must be 'ordered' or 'unordered', not {mode!r}")
        await self.log.pool.execute(
            """INSERT INTO kf_subscription_settings (topic, subscription, consume_mode) VALUES ($1, $2, $3)
               ON CONFLICT (topic, subscription) DO UPDATE SET consume_mode = excluded.consume_mode""",
            topic,
            subscription,
            mode,
        )

    async def load_delivery_settings(self, topic: str, subscription: str) -> dict[str, float | int | None]:
        """The delivery settings the subscription has of its own; empty when none were saved."""
        found = await self._setting(topic, subscription, "settings")
        settings = {} if found is None else json.loads(found)
        return {name: settings[name] for name in DELIVERY_SETTINGS if name in settings}

    @_reachable
    async def save_delivery_settings(self, topic: str, subscription: str, settings: Mapping[str, object]) -> None:
        """Replace the subscription's own delivery settings; empty: none."""
        unknown = sorted(set(settings) - set(DELIVERY_SETTINGS))
        if unknown:
            raise LogError(f"unknown delivery settings {unknown}; expected some of {DELIVERY_SETTINGS}")
        await self.log.pool.execute(
            """INSERT INTO kf_subscription_settings (topic, subscription, settings) VALUES ($1, $2, $3)
               ON CONFLICT (topic, subscription) DO UPDATE SET settings = excluded.settings""",
            topic,
            subscription,
            json.dumps(dict(settings), sort_keys=True),
        )

    @_reachable
    async def schemas(self, topic: str) -> list[SchemaRecord]:
        """Every version of ``topic``'s schema, oldest first (any broker reads and adds them: a schema is no
        partition's, and its versions are added only where the one before is stored)."""
        rows = await self.log.pool.fetch(
            "SELECT version, type, name, data, properties FROM kf_schemas WHERE topic = $1 ORDER BY version", topic
        )
        return [
            SchemaRecord(
                int(row["version"]),
                int(row["type"]),
                row["name"],
                bytes(row["data"]),
                schema_properties(row["properties"]),
            )
            for row in rows
        ]

    @_reachable
    async def add_schema(self, topic: str, schema: SchemaRecord) -> bool:
        """Store ``schema`` as ``topic``'s next schema version in one statement; False when it is not the next one
        (the versions stored are counted, and a version stored by another broker at once is not stored twice)."""
        version, kind, name, data, properties = check_schema(schema)
        status = await self.log.pool.execute(
            """INSERT INTO kf_schemas (topic, version, type, name, data, properties)
               SELECT $1, $2, $3, $4, $5, $6 WHERE (SELECT count(*) FROM kf_schemas WHERE topic = $1) = $2
               ON CONFLICT (topic, version) DO NOTHING""",
            topic,
            version,
            kind,
            name,
            data,
            schema_properties_text(properties),
        )
        return bool(status == "INSERT 0 1")

    async def _dead_letter(self, topic: str, subscription: str, letters: Sequence[Letter]) -> list[int]:
        """Store the letters under ``topic``'s lease, numbered on from the subscription's last; their numbers."""
        rows = [
            (position, *check_message(None, (None, key, payload), publish_time, properties)[1:], count, reason)
            for position, key, payload, count, reason, publish_time, properties in letters
        ]
        now = time.time()

        async def store(lease: Lease) -> list[int]:
            """Copy the letters in one transaction that checks ``lease``."""
            async with self.log.pool.transaction() as connection:
                await PostgresLog.check_lease(connection, lease)
                last = await connection.fetchval(
                    """SELECT coalesce(max(dlq_position), 0) FROM kf_dead_letters
                       WHERE topic = $1 AND partition = $2 AND subscription = $3""",
                    lease.topic,
                    lease.partition,
                    subscription,
                )
                positions = list(range(int(last) + 1, int(last) + 1 + len(rows)))
                await connection.copy_records_to_table(
                    "kf_dead_letters",
                    records=[
                        (
                            lease.topic,
                            lease.partition,
                            subscription,
                            at,
                            position,
                            key,
                            is_text,
                            payload,
                            count,
                            reason,
                            now,
                            publish_time,
                            encoded,
                        )
                        for at, (position, key, is_text, payload, publish_time, encoded, count, reason) in zip(
                            positions, rows, strict=True
                        )
                    ],
                    columns=[
                        "topic",
                        "partition",
                        "subscription",
                        "dlq_position",
                        "position",
                        "key",
                        "key_is_text",
                        "payload",
                        "redelivery_count",
                        "reason",
                        "time",
                        "publish_time",
                        "properties",
                    ],
                )
            return positions

        return await self._leased(topic, store)

    @_reachable
    async def dead_letters(self, topic: str, subscription: str, limit: int) -> list[DeadLetterRecord]:
        """The subscription's dead letters in the partition ``topic`` names, oldest first, ``limit`` at most."""
        name, partition = self._locate(topic)
        rows = await self.log.pool.fetch(
            """SELECT dlq_position, position, key, key_is_text, payload, redelivery_count, reason, time, replayed_at,
                      publish_time, properties
               FROM kf_dead_letters WHERE topic = $1 AND partition = $2 AND subscription = $3
               ORDER BY dlq_position LIMIT $4""",
            name,
            partition,
            subscription,
            limit,
        )
        return [
            DeadLetterRecord(
                int(r["dlq_position"]),
                int(r["position"]),
                key_from_row(r["key"], r["key_is_text"]),
                bytes(r["payload"]),
                int(r["redelivery_count"]),
                str(r["reason"]),
                float(r["time"]),
                None if r["replayed_at"] is None else int(r["replayed_at"]),
                None if r["publish_time"] is None else int(r["publish_time"]),
                properties_from_row(r["properties"]),
            )
            for r in rows
        ]

    async def _replay_dead_letters(self, topic: str, subscription: str) -> list[StoredMessage]:
        """Append the dead letters not replayed yet to ``topic`` and mark each with its new position, in one
        transaction under the lease; the messages as stored."""
        self._lease(topic)  # not served: NotServedError before anything is read
        waiting = [r for r in await self.dead_letters(topic, subscription, 2**62) if r.replayed_at is None]
        if not waiting:
            return []
        rows = [check_message(None, (None, r.key, r.payload), r.publish_time, r.properties) for r in waiting]

        async def replay(lease: Lease) -> list[tuple[int, bool]]:
            """Append the rows and mark their letters in one transaction that checks ``lease``."""
            async with self.log.pool.transaction() as connection:
                [stored] = await self.log.append_in(connection, lease, [(None, rows)])
                await connection.executemany(
                    """UPDATE kf_dead_letters SET replayed_at = $5
                       WHERE topic = $1 AND partition = $2 AND subscription = $3 AND dlq_position = $4""",
                    [
                        (lease.topic, lease.partition, subscription, r.dlq_position, position)
                        for r, (position, _) in zip(waiting, stored, strict=True)
                    ],
                )
            return stored

        stored = await self._leased(topic, replay)
        return [
            StoredMessage(position, r.key, r.payload, r.publish_time, r.properties)
            for r, (position, _) in zip(waiting, stored, strict=True)
        ]

    @_reachable
    async def partition_table(self) -> list[PartitionRow]:
        """Every partition ever opened, sorted: its last owner and owner epoch, and its subscriptions with a
        saved cursor."""
        rows = await self.log.pool.fetch(
            """SELECT p.topic, p.partition, p.owner, p.owner_epoch,
                      array_remove(array_agg(c.subscription ORDER BY c.subscription), NULL) AS subscriptions
               FROM kf_partitions p LEFT JOIN kf_cursors c ON c.topic = p.topic AND c.partition = p.partition
               GROUP BY p.topic, p.partition, p.owner, p.owner_epoch ORDER BY p.topic, p.partition"""
        )
        return [
            PartitionRow(
                str(r["topic"]),
                int(r["partition"]),
                str(r["owner"]),
                int(r["owner_epoch"]),
                [str(name) for name in r["subscriptions"]],
            )
            for r in rows
        ]

    @_reachable
    async def dead_letter_groups(self) -> list[DeadLetterGroup]:
        """Every subscription's dead letters in the shared log, of every partition, counted by reason."""
        rows = await self.log.pool.fetch(
            """SELECT topic, partition, subscription, reason, count(*) AS count,
                      count(*) FILTER (WHERE replayed_at IS NULL) AS waiting, min(time) AS oldest
               FROM kf_dead_letters GROUP BY topic, partition, subscription, reason
               ORDER BY topic, partition, subscription, reason"""
        )
        return [
            DeadLetterGroup(
                str(r["topic"]),
                int(r["partition"]),
                str(r["subscription"]),
                str(r["reason"]),
                int(r["count"]),
                int(r["waiting"]),
                float(r["oldest"]),
            )
            for r in rows
        ]

    async def _purge_dead_letters(self, topic: str, subscription: str) -> int:
        """Delete the subscription's dead-letter records of the partition ``topic`` names, in one transaction
        under its lease (:class:`NotServedError` when this broker does not serve it: nothing deleted)."""

        async def purge(lease: Lease) -> int:
            async with self.log.pool.transaction() as connection:
                await self.log.check_lease(connection, lease)
                status = await connection.execute(
                    "DELETE FROM kf_dead_letters WHERE topic = $1 AND partition = $2 AND subscription = $3",
                    lease.topic,
                    lease.partition,
                    subscription,
                )
            return int(str(status).rsplit(" ", 1)[-1])

        return await self._leased(topic, purge)


def _redacted(dsn: str) -> str:
    """``dsn`` without a password."""
    if "@" not in dsn or "://" not in dsn:
        return dsn
    scheme, rest = dsn.split("://", 1)
    credentials, host = rest.rsplit("@", 1)
    return f"{scheme}://{credentials.split(':', 1)[0]}@{host}"
