"""The schema of the embedded log, and its migrations from every older version a log may have.

A log records its schema version as ``PRAGMA user_version``. Versions 2 to 6 each added tables or
nullable columns, which costs no rewrite; version 7 moved the messages from a row each into entries
(:func:`~keyfailover.broker.storage._sqlite_entries.rewrite_into_entries`); version 8 added the topics'
Pulsar schemas, a table.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from keyfailover.broker.storage._sqlite_entries import rewrite_into_entries
from keyfailover.core.errors import LogFileError

__all__ = ["SCHEMA_VERSION", "migrate"]

SCHEMA_VERSION = 8
"""``PRAGMA user_version`` of a log this module writes; versions 1 (no dead letters), 2 (no
per-subscription delivery settings), 3 (no partitioned topics), 4 (no publish times), 5 (no
properties), 6 (a row per message) and 7 (no schemas) are migrated."""

_SCHEMA = (
    "CREATE TABLE topics (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE)",
    """CREATE TABLE messages (
        id INTEGER PRIMARY KEY,  -- topic id << 40 | position
        key BLOB,                -- NULL, TEXT or BLOB: the storage class is the key's Python type
        payload BLOB NOT NULL,
        producer INTEGER,        -- producers.id of a named producer, else NULL
        seq INTEGER              -- that producer's sequence id
    )""",
    "CREATE INDEX messages_by_producer_seq ON messages (producer, seq) WHERE producer IS NOT NULL",
    "CREATE TABLE producers (id INTEGER PRIMARY KEY, topic INTEGER NOT NULL, name TEXT NOT NULL, UNIQUE (topic, name))",
    """CREATE TABLE cursors (
        topic TEXT NOT NULL,
        subscription TEXT NOT NULL,
        state BLOB NOT NULL,  -- Cursor.to_bytes()
        PRIMARY KEY (topic, subscription)
    ) WITHOUT ROWID""",
)
_VERSION_2 = (
    """CREATE TABLE subscription_settings (
        topic TEXT NOT NULL,
        subscription TEXT NOT NULL,
        consume_mode TEXT NOT NULL,  -- ordered | unordered
        PRIMARY KEY (topic, subscription)
    ) WITHOUT ROWID""",
    """CREATE TABLE dead_letters (
        dlq_topic TEXT NOT NULL,          -- <topic>-<subscription>-DLQ, a topic like any other
        dlq_position INTEGER NOT NULL,    -- where the message is stored in it
        topic TEXT NOT NULL,
        subscription TEXT NOT NULL,
        position INTEGER NOT NULL,        -- where it was in its topic
        redelivery_count INTEGER NOT NULL,
        reason TEXT NOT NULL,             -- why its last delivery came back
        time REAL NOT NULL,               -- unix seconds it was dead-lettered
        replayed_at INTEGER,              -- its position in the topic once re-published, else NULL
        PRIMARY KEY (dlq_topic, dlq_position)
    ) WITHOUT ROWID""",
)
_VERSION_3 = (
    """CREATE TABLE delivery_settings (
        topic TEXT NOT NULL,
        subscription TEXT NOT NULL,
        settings TEXT NOT NULL,  -- JSON: each of DELIVERY_SETTINGS the subscription sets itself
        PRIMARY KEY (topic, subscription)
    ) WITHOUT ROWID""",
)
_VERSION_4 = (
    """CREATE TABLE partitioned_topics (
        name TEXT PRIMARY KEY,
        partitions INTEGER NOT NULL  -- fixed at creation; partition p is the topic <name>-partition-<p>
    ) WITHOUT ROWID""",
)
_VERSION_5 = (
    # publish_clock() of the append; NULL: stored before schema 5 (unknown). Adding a column with
    # a NULL default rewrites nothing: the rows of a large log stay where they are.
    "ALTER TABLE messages ADD COLUMN publish_time INTEGER",
)
_VERSION_6 = (
    # The message's encoded properties (keyfailover.wire.properties); NULL: it has none.
    "ALTER TABLE messages ADD COLUMN properties BLOB",
)
_VERSION_7 = (
    """CREATE TABLE entries (
        id INTEGER PRIMARY KEY,  -- topic id << 40 | the last position of the entry
        count INTEGER NOT NULL,  -- its messages, at positions (id & MAX_POSITION) - count + 1 to id & MAX_POSITION
        producer INTEGER,        -- producers.id of a named producer, else NULL
        first_seq INTEGER,       -- the lowest and the highest sequence id of its messages (a named producer's)
        last_seq INTEGER,
        publish_time INTEGER,    -- the latest publish time of its messages; NULL: none known
        data BLOB NOT NULL       -- msgpack [keys, payloads, seqs | nil, publish times | nil, properties | nil]
    )""",
    # first_seq in the index too: a lookup of a sequence id scans the entries whose last_seq is at or
    # above it, in the index alone, and reads only those whose span holds it.
    "CREATE INDEX entries_by_producer_seq ON entries (producer, last_seq, first_seq) WHERE producer IS NOT NULL",
)
_VERSION_8 = (
    """CREATE TABLE schemas (
        topic TEXT NOT NULL,       -- a topic, not a partition: its partitions share its schema, as in Pulsar
        version INTEGER NOT NULL,  -- 0, 1, 2, ... without gaps
        type INTEGER NOT NULL,     -- Pulsar's Schema.Type
        name TEXT NOT NULL,
        data BLOB NOT NULL,        -- the schema definition
        properties TEXT NOT NULL,  -- JSON: an object of str to str
        PRIMARY KEY (topic, version)
    ) WITHOUT ROWID""",
)


def migrate(db: sqlite3.Connection, path: Path) -> None:
    """Create the schema in the new log at ``path``, or bring an older log's up to :data:`SCHEMA_VERSION`, in
    the caller's transaction; :class:`LogFileError` for a newer log, or an SQLite file that is no log."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version == SCHEMA_VERSION:
        return
    if version > SCHEMA_VERSION:
        raise LogFileError(
            f"the log {str(path)!r} has schema version {version}, newer than {SCHEMA_VERSION}, "
            "the newest this keyfailover reads"
        )
    if version == 0:
        if db.execute("SELECT count(*) FROM sqlite_schema").fetchone()[0]:
            raise LogFileError(f"{str(path)!r} is an SQLite database but not a keyfailover log")
        for statement in _SCHEMA:
            db.execute(statement)
    if version < 2:  # version 1 had no dead letters and no subscription settings
        for statement in _VERSION_2:
            db.execute(statement)
    if version < 3:  # version 2 had no per-subscription delivery settings
        for statement in _VERSION_3:
            db.execute(statement)
    if version < 4:  # version 3 had no partitioned topics
        for statement in _VERSION_4:
            db.execute(statement)
    if version < 5:  # version 4 had no publish times
        for statement in _VERSION_5:
            db.execute(statement)
    if version < 6:  # version 5 had no properties
        for statement in _VERSION_6:
            db.execute(statement)
    if version < 7:  # version 6 had a row per message
        for statement in _VERSION_7:
            db.execute(statement)
        rewrite_into_entries(db)
    for statement in _VERSION_8:  # version 7 had no schemas
        db.execute(statement)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
