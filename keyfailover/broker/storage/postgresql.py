"""The cluster's shared log in PostgreSQL: partitioned topics, producer dedup state and cursors,
with every write fenced by the partition's owner epoch.

A broker serves a partition only after :meth:`PostgresLog.open_partition`, which bumps the
partition's owner epoch and returns a :class:`Lease` carrying it. Every write for that
partition (an append, a cursor) locks the partition's row in the same transaction and checks
the epoch: once another broker has opened the partition, a broker that lost it (paused past its
ZooKeeper session, cut off from ZooKeeper) can never append or move a cursor again, even
before ZooKeeper tells it (as BookKeeper fences a ledger). It gets :class:`FencedError` and the
transaction stores nothing.

Messages of one partition get positions 1, 2, 3, ... without gaps. A named producer's messages
carry sequence ids; one at or below the highest stored for (partition, producer) is a duplicate
(a resend after a failover): answered with the position it was stored at, not stored again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from keyfailover.broker.cursor import Cursor
from keyfailover.broker.storage.sqlite import Key, Message, StoredMessage
from keyfailover.core.errors import KeyFailoverError, LogError

__all__ = ["FencedError", "Lease", "PostgresLog"]

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS kf_partitions (
        topic TEXT NOT NULL,
        partition INTEGER NOT NULL,
        owner TEXT NOT NULL,
        owner_epoch BIGINT NOT NULL,          -- +1 each time a broker opens the partition
        last_position BIGINT NOT NULL DEFAULT 0,
        PRIMARY KEY (topic, partition)
    )""",
    """CREATE TABLE IF NOT EXISTS kf_messages (
        topic TEXT NOT NULL,
        partition INTEGER NOT NULL,
        position BIGINT NOT NULL,
        key BYTEA,                            -- NULL: keyless
        key_is_text BOOLEAN NOT NULL,         -- the key was a str (stored as its UTF-8 bytes)
        payload BYTEA NOT NULL,
        producer TEXT,
        seq BIGINT,
        PRIMARY KEY (topic, partition, position)
    )""",
    """CREATE INDEX IF NOT EXISTS kf_messages_by_producer_seq
        ON kf_messages (topic, partition, producer, seq) WHERE producer IS NOT NULL""",
    """CREATE TABLE IF NOT EXISTS kf_producers (
        topic TEXT NOT NULL,
        partition INTEGER NOT NULL,
        producer TEXT NOT NULL,
        last_seq BIGINT NOT NULL,
        PRIMARY KEY (topic, partition, producer)
    )""",
    """CREATE TABLE IF NOT EXISTS kf_cursors (
        topic TEXT NOT NULL,
        partition INTEGER NOT NULL,
        subscription TEXT NOT NULL,
        state BYTEA NOT NULL,                 -- Cursor.to_bytes()
        PRIMARY KEY (topic, partition, subscription)
    )""",
)


class FencedError(KeyFailoverError, RuntimeError):
    """A write under an owner epoch that is no longer the partition's: another broker opened it."""


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

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    @classmethod
    async def connect(cls, dsn: str, *, min_size: int = 1, max_size: int = 4) -> PostgresLog:
        """Connect to ``dsn`` and create the tables if missing; :class:`LogError` names an unreachable server."""
        try:
            pool = await asyncpg.create_pool(dsn, min_size=min_size, max_size=max_size, timeout=10)
        except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
            raise LogError(f"cannot reach PostgreSQL at {_redacted(dsn)}: {exc}") from None
        async with pool.acquire() as connection, connection.transaction():
            await connection.execute("SELECT pg_advisory_xact_lock(7415)")  # one schema creator at a time
            for statement in _SCHEMA:
                await connection.execute(statement)
        return cls(pool)

    async def close(self) -> None:
        await self._pool.close()

    async def open_partition(self, topic: str, partition: int, owner: str) -> Lease:
        """Take ``partition`` of ``topic`` for ``owner``: bump its owner epoch (fencing every earlier lease)."""
        _check_partition(topic, partition)
        row = await self._pool.fetchrow(
            """INSERT INTO kf_partitions (topic, partition, owner, owner_epoch) VALUES ($1, $2, $3, 1)
               ON CONFLICT (topic, partition) DO UPDATE
               SET owner = excluded.owner, owner_epoch = kf_partitions.owner_epoch + 1
               RETURNING owner_epoch, last_position""",
            topic,
            partition,
            owner,
        )
        return Lease(topic, partition, owner, int(row["owner_epoch"]), int(row["last_position"]))

    async def append(self, lease: Lease, producer: str | None, messages: Sequence[Message]) -> list[tuple[int, bool]]:
        """Store ``messages`` (``(seq, key, payload)``) in the leased partition, in one transaction.

        Returns ``(position, duplicate)`` per message, as the SQLite log does: a duplicate is
        answered with the position it was stored at (0 if the producer skipped that seq).
        Raises :class:`FencedError`, storing nothing, when the lease is no longer the partition's.
        """
        rows = [_message(producer, message) for message in messages]
        async with self._pool.acquire() as connection, connection.transaction():
            last = await self._check_lease(connection, lease)
            highest = -1
            if producer is not None:
                found = await connection.fetchval(
                    "SELECT last_seq FROM kf_producers WHERE topic = $1 AND partition = $2 AND producer = $3",
                    lease.topic,
                    lease.partition,
                    producer,
                )
                highest = -1 if found is None else int(found)
            results: list[tuple[int, bool]] = []
            records = []
            duplicates: list[tuple[int, int]] = []  # (index in results, seq)
            for seq, key, is_text, payload in rows:
                if seq is not None and seq <= highest:
                    duplicates.append((len(results), seq))
                    results.append((0, True))
                    continue
                if seq is not None:
                    highest = seq
                last += 1
                records.append((lease.topic, lease.partition, last, key, is_text, payload, producer, seq))
                results.append((last, False))
            if records:
                await connection.copy_records_to_table(
                    "kf_messages",
                    records=records,
                    columns=["topic", "partition", "position", "key", "key_is_text", "payload", "producer", "seq"],
                )
                await connection.execute(
                    "UPDATE kf_partitions SET last_position = $3 WHERE topic = $1 AND partition = $2",
                    lease.topic,
                    lease.partition,
                    last,
                )
                if producer is not None:
                    await connection.execute(
                        """INSERT INTO kf_producers (topic, partition, producer, last_seq) VALUES ($1, $2, $3, $4)
                           ON CONFLICT (topic, partition, producer) DO UPDATE SET last_seq = excluded.last_seq""",
                        lease.topic,
                        lease.partition,
                        producer,
                        highest,
                    )
            if duplicates:
                stored = await connection.fetch(
                    """SELECT seq, position FROM kf_messages
                       WHERE topic = $1 AND partition = $2 AND producer = $3 AND seq = ANY($4::bigint[])""",
                    lease.topic,
                    lease.partition,
                    producer,
                    [seq for _, seq in duplicates],
                )
                at = {int(row["seq"]): int(row["position"]) for row in stored}
                for index, seq in duplicates:
                    results[index] = (at.get(seq, 0), True)
        return results

    async def read(self, topic: str, partition: int, after: int, limit: int) -> list[StoredMessage]:
        """Up to ``limit`` messages of the partition after position ``after``, in position order."""
        _check_partition(topic, partition)
        rows = await self._pool.fetch(
            """SELECT position, key, key_is_text, payload FROM kf_messages
               WHERE topic = $1 AND partition = $2 AND position > $3 ORDER BY position LIMIT $4""",
            topic,
            partition,
            after,
            limit,
        )
        return [
            StoredMessage(int(r["position"]), _stored_key(r["key"], r["key_is_text"]), bytes(r["payload"]))
            for r in rows
        ]

    async def save_cursor(self, lease: Lease, subscription: str, cursor: Cursor) -> None:
        """Save a subscription's cursor of the leased partition; :class:`FencedError` if the lease is stale."""
        async with self._pool.acquire() as connection, connection.transaction():
            await self._check_lease(connection, lease)
            await connection.execute(
                """INSERT INTO kf_cursors (topic, partition, subscription, state) VALUES ($1, $2, $3, $4)
                   ON CONFLICT (topic, partition, subscription) DO UPDATE SET state = excluded.state""",
                lease.topic,
                lease.partition,
                subscription,
                cursor.to_bytes(),
            )

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
    async def _check_lease(connection: Any, lease: Lease) -> int:
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


def _check_partition(topic: object, partition: object) -> None:
    if not isinstance(topic, str) or not topic:
        raise LogError(f"topic must be a non-empty str, not {topic!r}")
    if type(partition) is not int or partition < 0:
        raise LogError(f"partition must be an int >= 0, not {partition!r}")


def _message(producer: str | None, message: Message) -> tuple[int | None, bytes | None, bool, bytes]:
    """``(seq, key bytes, key was a str, payload)`` of one message to append, checked."""
    seq, key, payload = message
    if producer is not None and (type(seq) is not int or seq < 0):
        raise LogError(f"a named producer's message needs a sequence id >= 0, not {seq!r}")
    if not isinstance(payload, bytes):
        raise LogError(f"a payload must be bytes, not {type(payload).__name__}")
    if key is None:
        return seq, None, False, payload
    if isinstance(key, str):
        return seq, key.encode(), True, payload
    if isinstance(key, bytes):
        return seq, key, False, payload
    raise LogError(f"a key must be str, bytes or None, not {type(key).__name__}")


def _stored_key(data: bytes | None, is_text: bool) -> Key:
    if data is None:
        return None
    return bytes(data).decode() if is_text else bytes(data)


def _redacted(dsn: str) -> str:
    """``dsn`` without a password."""
    if "@" not in dsn or "://" not in dsn:
        return dsn
    scheme, rest = dsn.split("://", 1)
    credentials, host = rest.rsplit("@", 1)
    return f"{scheme}://{credentials.split(':', 1)[0]}@{host}"
