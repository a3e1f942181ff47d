"""The shared log's schema in PostgreSQL: its tables, and the row a message is stored as.

A message to append is checked into a :data:`Row` (:func:`check_message`), and a row of ``kf_messages`` is
read back as a :class:`~keyfailover.broker.storage.records.StoredMessage` (:func:`message_from_row`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keyfailover.broker.storage.records import Key, Message, PropertiesColumn, StoredMessage
from keyfailover.core.errors import LogError, PropertiesError
from keyfailover.wire.properties import check_encoded

__all__ = [
    "Row",
    "check_message",
    "check_partition",
    "check_rows",
    "create_schema",
    "key_from_row",
    "message_from_row",
    "properties_from_row",
]

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
        epoch BIGINT NOT NULL,                -- the owner epoch it was written under (audits fencing)
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
    """CREATE TABLE IF NOT EXISTS kf_subscription_settings (
        topic TEXT NOT NULL,                  -- a topic, not a partition: settings hold for all of them
        subscription TEXT NOT NULL,
        consume_mode TEXT,                    -- ordered | unordered, NULL: the server's
        settings TEXT NOT NULL DEFAULT '{}',  -- JSON: the delivery settings the subscription sets itself
        PRIMARY KEY (topic, subscription)
    )""",
    """CREATE TABLE IF NOT EXISTS kf_dead_letters (
        topic TEXT NOT NULL,
        partition INTEGER NOT NULL,
        subscription TEXT NOT NULL,
        dlq_position BIGINT NOT NULL,         -- 1, 2, 3, ... per (topic, partition, subscription)
        position BIGINT NOT NULL,             -- where it was in its partition
        key BYTEA,
        key_is_text BOOLEAN NOT NULL,
        payload BYTEA NOT NULL,
        redelivery_count INTEGER NOT NULL,
        reason TEXT NOT NULL,
        time DOUBLE PRECISION NOT NULL,       -- unix seconds it was dead-lettered
        replayed_at BIGINT,                   -- its position in the partition once re-published
        PRIMARY KEY (topic, partition, subscription, dlq_position)
    )""",
    """CREATE TABLE IF NOT EXISTS kf_schemas (
        topic TEXT NOT NULL,                  -- a topic, not a partition: its partitions share its schema
        version BIGINT NOT NULL,              -- 0, 1, 2, ... without gaps
        type INTEGER NOT NULL,                -- Pulsar's Schema.Type
        name TEXT NOT NULL,
        data BYTEA NOT NULL,                  -- the schema definition
        properties TEXT NOT NULL,             -- JSON: an object of str to str
        PRIMARY KEY (topic, version)
    )""",
)

_ADDED_COLUMNS = (
    ("kf_messages", "publish_time", "BIGINT"),
    ("kf_dead_letters", "publish_time", "BIGINT"),
    ("kf_messages", "properties", "BYTEA"),
    ("kf_dead_letters", "properties", "BYTEA"),
)
"""Columns that came later (publish times, µs since the Unix epoch; encoded properties): the tables of an
older log gain them, NULL (unknown; none) in the rows stored before, without a rewrite. Added only where
missing: ALTER TABLE takes an exclusive lock on the table even when the column is there, which would stall
(and, queued between the locks of other brokers' appends, deadlock) every write while a broker starts."""


async def create_schema(connection: Any) -> None:
    """Create the tables that are missing and add the columns that came later, in the caller's transaction on
    ``connection``; brokers starting together create them one at a time."""
    await connection.execute("SELECT pg_advisory_xact_lock(7415)")  # one schema creator at a time
    for statement in _SCHEMA:
        await connection.execute(statement)
    for table, column, kind in _ADDED_COLUMNS:
        found = await connection.fetchval(
            "SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema() "
            "AND table_name = $1 AND column_name = $2",
            table,
            column,
        )
        if found is None:
            await connection.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")


def check_partition(topic: object, partition: object) -> None:
    """Refuse a topic that is no non-empty str, and a partition that is no int of at least 0."""
    if not isinstance(topic, str) or not topic:
        raise LogError(f"topic must be a non-empty str, not {topic!r}")
    if type(partition) is not int or partition < 0:
        raise LogError(f"partition must be an int >= 0, not {partition!r}")


Row = tuple[int | None, bytes | None, bool, bytes, int | None, bytes | None]
"""``(seq, key bytes, key was a str, payload, publish time, encoded properties)``: a message as :func:`check_message`
checked it."""


def check_rows(
    producer: str | None, messages: Sequence[Message], properties: PropertiesColumn, publish_time: int
) -> list[Row]:
    """The rows of one produce request, checked; ``properties`` one encoding (or None) per message, or None."""
    if properties is None:
        return [check_message(producer, message, publish_time) for message in messages]
    if len(properties) != len(messages):
        raise PropertiesError(
            f"a batch of {len(messages)} messages has properties for {len(properties)}; expected one encoding or "
            "None per message"
        )
    return [
        check_message(producer, message, publish_time, encoded)
        for message, encoded in zip(messages, properties, strict=True)
    ]


def check_message(
    producer: str | None, message: Message, publish_time: int | None, properties: bytes | None = None
) -> Row:
    """``(seq, key bytes, key was a str, payload, publish_time, properties)`` of one message to append, checked."""
    seq, key, payload = message
    if producer is not None and (type(seq) is not int or seq < 0):
        raise LogError(f"a named producer's message needs a sequence id >= 0, not {seq!r}")
    if not isinstance(payload, bytes):
        raise LogError(f"a payload must be bytes, not {type(payload).__name__}")
    if properties is not None:
        check_encoded(properties)
    if key is None:
        return seq, None, False, payload, publish_time, properties
    if isinstance(key, str):
        return seq, key.encode(), True, payload, publish_time, properties
    if isinstance(key, bytes):
        return seq, key, False, payload, publish_time, properties
    raise LogError(f"a key must be str, bytes or None, not {type(key).__name__}")


def message_from_row(row: Any, names: dict[str, str]) -> StoredMessage:
    """A ``kf_messages`` row (position, key, key_is_text, payload, publish_time, properties, producer) as the log's
    message. ``names`` are the producer names of the read so far, each one object that its messages share (a row
    gives a string of its own)."""
    at = row["publish_time"]
    producer = row["producer"]
    return StoredMessage(
        int(row["position"]),
        key_from_row(row["key"], row["key_is_text"]),
        bytes(row["payload"]),
        None if at is None else int(at),
        properties_from_row(row["properties"]),
        None if producer is None else names.setdefault(producer, producer),
    )


def properties_from_row(data: bytes | None) -> bytes | None:
    """Stored properties as bytes; None when the message has none."""
    return None if data is None else bytes(data)


def key_from_row(data: bytes | None, is_text: bool) -> Key:
    """A stored key as the producer gave it: a str when it was one, else bytes; None for no key."""
    if data is None:
        return None
    return bytes(data).decode() if is_text else bytes(data)
