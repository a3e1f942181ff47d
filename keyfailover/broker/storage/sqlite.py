"""The embedded durable log: append-only topics, producer dedup state and cursors in one SQLite file.

SQLite in WAL mode is the embedded default: nothing to install, one file per data
directory, and a commit is durable when :meth:`Log.append` returns (``synchronous="full"``
syncs the write-ahead log on every commit; ``"normal"`` survives a crash of the process
but not of the machine).

Messages are stored in *entries*: the messages of one produce request (one producer, one
topic, consecutive positions), up to ``_ENTRY_MESSAGES`` of them and about ``_ENTRY_BYTES`` of
payload, in one row of a rowid table whose id is ``topic_id << 40 | the entry's last position``
(Apache BookKeeper's entries and Pulsar's batches do the same). An append adds one row per
produce request, not one per message: its keys, payloads, sequence ids, publish times and
properties go in one msgpack blob, which cost a third of the CPU of a row per message (0.4-0.5
against 1.4-1.7 µs a message, batches of 1000). A read is one range scan of the table's own
b-tree from the first entry whose last position is at or after the one asked for, and large
payloads go to overflow pages without widening the tree. An entry of a named producer carries
the lowest and highest of its sequence ids, indexed, so that a retried message finds the
position it was stored at. A log of schema 6 or older, a row per message, is rewritten into
entries when a server first opens it (:class:`LogSnapshot` reads either without writing).

Every message has a publish time: the broker's wall clock when its group commit began, in
integer microseconds since the Unix epoch (the same for every message of one commit). A
message stored before schema 5 has none (NULL: unknown). A message may carry properties,
stored as their one encoding (:mod:`keyfailover.wire.properties`, a msgpack map of str to
str) in a nullable column: NULL for a message without them, so a log of such messages pays a
NULL's one byte of record header per message, and a log of schema 5 gains the column without a
rewrite. A dead letter, and a dead letter replayed, keeps the publish time and the properties
of the message it was.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
import os
import reprlib
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypedDict, TypeVar
from urllib.parse import quote

import msgpack  # type: ignore[import-untyped]

from keyfailover.broker.cursor import Cursor
from keyfailover.core.errors import (
    CursorError,
    InvalidKeyError,
    LogError,
    LogFileError,
    PropertiesError,
    SequenceError,
)
from keyfailover.core.partitions import MAX_PARTITIONS, split_partition_topic
from keyfailover.wire.properties import check_encoded

__all__ = [
    "DEAD_LETTER_SUFFIX",
    "DELIVERY_SETTINGS",
    "LOG_FILE_NAME",
    "MAX_POSITION",
    "SCHEMA_VERSION",
    "DeadLetterEntry",
    "DeadLetterRecord",
    "ExportRow",
    "Key",
    "Log",
    "LogSnapshot",
    "LogStats",
    "PropertiesColumn",
    "StoredMessage",
    "TopicStats",
    "dead_letter_topic",
    "publish_clock",
]

_T = TypeVar("_T")

Key = str | bytes | None
Message = tuple[int | None, Key, bytes]
"""``(sequence id or None, key, payload)``: one message to append."""
PropertiesColumn = Sequence[bytes | None] | None
"""The encoded properties (:func:`~keyfailover.wire.properties.encode_properties`) of each message of a
batch, None for a message without them; None for a batch none of whose messages has any (so a batch
without properties costs nothing per message)."""
Batch = tuple[str, str | None, Sequence[Message]] | tuple[str, str | None, Sequence[Message], PropertiesColumn]
"""``(topic, producer name or None, messages[, properties])``: one produce request."""
DeadLetterEntry = tuple[int, Key, bytes, int, str, int | None, bytes | None]
"""``(position, key, payload, redelivery_count, reason, publish_time or None, properties or None)``: a message
going to a dead-letter topic."""

LOG_FILE_NAME = "keyfailover.db"
"""The log's file name inside a server's data directory."""

ExportRow = tuple[int, Key, bytes, str | None, int | None, int | None, bytes | None]
"""``(position, key, payload, producer name or None, sequence id or None, publish time or None, encoded
properties or None)``: one stored message."""

SCHEMA_VERSION = 7
"""``PRAGMA user_version`` of a log this module writes; versions 1 (no dead letters), 2 (no
per-subscription delivery settings), 3 (no partitioned topics), 4 (no publish times), 5 (no
properties) and 6 (a row per message) are migrated."""

DELIVERY_SETTINGS = ("ack_timeout", "max_redeliveries", "nack_backoff", "nack_backoff_max", "max_replay")
"""The settings a subscription may have of its own (the rest come from the server's)."""

DEAD_LETTER_SUFFIX = "-DLQ"


def publish_clock() -> int:
    """The broker's wall clock as a publish time: integer microseconds since the Unix epoch."""
    return time.time_ns() // 1000


def dead_letter_topic(topic: str, subscription: str) -> str:
    """The dead-letter topic of a subscription: ``<topic>-<subscription>-DLQ`` (Apache Pulsar's naming)."""
    return f"{topic}-{subscription}{DEAD_LETTER_SUFFIX}"


_POSITION_BITS = 40
MAX_POSITION = (1 << _POSITION_BITS) - 1
"""The last position a topic can hold (about 1.1e12)."""
_MAX_TOPIC_ID = (1 << (63 - _POSITION_BITS)) - 1  # ids stay below 2**63
_MAX_SEQ = (1 << 63) - 1

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
_ENTRY_MESSAGES = 256
"""The most messages an entry holds: a produce request of more is stored in several."""
_ENTRY_BYTES = 1 << 20
"""The payload bytes past which an entry holds no further message (one larger message has an entry of its
own): a read of one position decodes its whole entry."""
_MIGRATE_BYTES = 32 << 20
"""The bytes of entries a rewrite of a log of schema 6 or older into entries holds before it inserts them (it
reads the old rows one at a time): what it needs in memory, whatever the size of the log and its messages."""


class StoredMessage(NamedTuple):
    """One message as the log holds it (a named tuple: the server makes one per message).

    ``publish_time`` is the broker's wall clock when it was stored, in microseconds since the
    Unix epoch (:func:`publish_clock`); None when unknown (stored before the log had them).
    ``properties`` are the message's properties as stored, encoded (a msgpack map of str to str:
    :func:`~keyfailover.wire.properties.decode_properties` gives the mapping); None when it has
    none. They stay encoded because the server only passes them on: a native delivery carries the
    same bytes.
    """

    position: int
    key: Key
    payload: bytes
    publish_time: int | None
    properties: bytes | None = None


stored_message = functools.partial(tuple.__new__, StoredMessage)
"""A ``StoredMessage`` from a tuple ``(position, key, payload, publish_time, properties)``, in C (one per message
read or stored: the named tuple's own constructor is a Python function)."""


class DeadLetterRecord(NamedTuple):
    """A dead-lettered message: where it is in the dead-letter topic, where it came from, and why."""

    dlq_position: int
    position: int
    key: Key
    payload: bytes
    redelivery_count: int
    reason: str
    time: float
    replayed_at: int | None
    publish_time: int | None
    """The publish time of the message it was (µs since the Unix epoch), None when unknown."""
    properties: bytes | None = None
    """The encoded properties of the message it was, None when it had none."""


class TopicStats(TypedDict):
    messages: int
    first_position: int
    last_position: int


class LogStats(TypedDict):
    path: str
    file_bytes: int
    """Size of the database file plus its write-ahead log."""
    topics: dict[str, TopicStats]


class Log:
    """One SQLite database file holding every topic's messages, producer dedup state and subscription cursors.

    Calls may come from any thread, but from one at a time (the server runs them all on one
    worker thread). Each call that writes is one transaction: it stores everything or, when
    it raises, nothing.
    """

    def __init__(self, path: str | os.PathLike[str], *, synchronous: Literal["full", "normal"] = "full") -> None:
        """Open the log at ``path``, creating the file and its schema if missing (its folder must exist)."""
        if synchronous not in ("full", "normal"):
            raise LogError(f"synchronous must be 'full' or 'normal', not {synchronous!r}")
        self._path = Path(path)
        if not self._path.parent.is_dir():
            raise LogFileError(f"the folder {str(self._path.parent)!r} of the log does not exist; create it first")
        try:
            db = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise LogFileError(f"cannot open the log {str(self._path)!r}: {exc}") from None
        self._db: sqlite3.Connection | None = db
        try:
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode != "wal":
                raise LogFileError(f"the log {str(self._path)!r} cannot use a write-ahead log (journal mode {mode})")
            db.execute(f"PRAGMA synchronous = {synchronous.upper()}")
            db.execute("PRAGMA journal_size_limit = 67108864")  # truncate a grown WAL back to 64 MiB
            self._create_schema()
        except sqlite3.DatabaseError as exc:
            self.close()
            raise LogFileError(f"{str(self._path)!r} is not a keyfailover log: {exc}") from None
        except BaseException:
            self.close()
            raise

    @property
    def path(self) -> Path:
        return self._path

    # -- messages --------------------------------------------------------------------

    def append(self, batches: Sequence[Batch], publish_time: int | None = None) -> list[list[tuple[int, bool]]]:
        """Store the messages of many produce requests in one transaction (group commit).

        ``batches`` holds ``(topic, producer, messages)`` with ``messages`` a sequence of
        ``(seq, key, payload)``, or ``(topic, producer, messages, properties)`` with ``properties``
        the encoded properties of each message (:data:`PropertiesColumn`; each checked, a
        :class:`PropertiesError` when it is no valid encoding). Topics are created on first use;
        each message gets the next position of its topic (1, 2, 3, ... without gaps). A named
        producer's messages need sequence ids, increasing within a batch; a message whose ``seq``
        is stored for (topic, producer) already, in this call or before, is a duplicate: not
        stored again, answered with ``(position it was stored at, True)``. A ``seq`` below the
        highest stored that was never stored is stored (batches of one producer may arrive out
        of order: Pulsar's key-based batching sends each key's on its own). Returns ``(position,
        duplicate)`` per message per batch, after the commit. Raises, storing nothing, on a bad
        argument. Every message stored gets ``publish_time`` (µs since the Unix epoch; by default
        :func:`publish_clock` now).
        """
        if not isinstance(batches, Sequence):
            raise LogError(f"batches must be a sequence of (topic, producer, messages), not {type(batches).__name__}")
        now = publish_clock() if publish_time is None else _publish_time(publish_time)
        with self._transaction() as db:
            writer = _Append(db, now)
            results = [writer.add(*_batch(batch)) for batch in batches]
            writer.insert()
        return results

    def read(self, topic: str, after: int, limit: int) -> list[StoredMessage]:
        """Up to ``limit`` messages of ``topic`` at positions above ``after``, ascending; [] for an unknown topic."""
        topic = _name(topic, "topic")
        after = _count(after, "after")
        limit = _count(limit, "limit")
        topic_id = self._topic_id(topic)
        if topic_id is None or after >= MAX_POSITION:
            return []
        base = topic_id << _POSITION_BITS
        found: list[StoredMessage] = []
        with _rows(
            self._connection(),
            "SELECT id - ?, count, publish_time, data FROM entries WHERE id > ? AND id <= ? ORDER BY id",
            (base, base + after, base + MAX_POSITION),
        ) as entries:
            for last, count, publish_time, data in entries:
                if len(found) >= limit:
                    break
                messages = _decode(last, count, publish_time, data)
                skip = max(after - (last - count), 0)  # the first entry may begin at or before ``after``
                found += messages[skip : skip + limit - len(found)]
        return found

    def read_positions(self, topic: str, positions: Iterable[int]) -> dict[int, StoredMessage]:
        """The messages of ``topic`` at ``positions`` (to re-read payloads for replays); absent ones are left out."""
        topic = _name(topic, "topic")
        wanted = sorted({_position(p) for p in _iterable(positions, "positions")})
        topic_id = self._topic_id(topic)
        if topic_id is None:
            return {}
        base = topic_id << _POSITION_BITS
        wanted = [p for p in wanted if 1 <= p <= MAX_POSITION]
        db = self._connection()
        found: dict[int, StoredMessage] = {}
        index = 0
        while index < len(wanted):  # one query per entry holding some of them
            row = db.execute(
                "SELECT id - ?, count, publish_time, data FROM entries WHERE id >= ? AND id <= ? ORDER BY id LIMIT 1",
                (base, base + wanted[index], base + MAX_POSITION),
            ).fetchone()
            if row is None:
                break
            last, count, publish_time, data = row
            keys, payloads, _, times, properties = _columns(last, count, data)
            first = last - count + 1
            while index < len(wanted) and wanted[index] <= last:
                position = wanted[index]
                if position >= first:
                    at = position - first
                    found[position] = stored_message(
                        (
                            position,
                            keys[at],
                            payloads[at],
                            publish_time if times is None else times[at],
                            None if properties is None else properties[at],
                        )
                    )
                index += 1
        return found

    def last_position(self, topic: str) -> int:
        """The position of the newest message of ``topic``; 0 if it has none. O(log n)."""
        topic_id = self._topic_id(_name(topic, "topic"))
        return 0 if topic_id is None else _last_position(self._connection(), topic_id)

    def last_sequence(self, topic: str, producer: str) -> int:
        """The highest sequence id ``producer`` stored in ``topic``; -1 when it stored none."""
        (found,) = (
            self._connection()
            .execute(
                """SELECT max(e.last_seq) FROM entries e JOIN producers p ON e.producer = p.id
                   JOIN topics t ON p.topic = t.id WHERE t.name = ? AND p.name = ?""",
                (_name(topic, "topic"), _name(producer, "producer")),
            )
            .fetchone()
        )
        return -1 if found is None else int(found)

    def first_position(self, topic: str) -> int:
        """The position of the oldest message of ``topic``: 1, as nothing is trimmed; 1 for an unknown topic."""
        topic_id = self._topic_id(_name(topic, "topic"))
        return 1 if topic_id is None else _first_position(self._connection(), topic_id)

    def position_at_time(
        self, topic: str, publish_time: int, after: int = 0, through: int = MAX_POSITION
    ) -> int | None:
        """The first position of ``topic`` in ``(after, through]`` whose publish time is at or after
        ``publish_time`` (µs since the Unix epoch); None when there is none. Messages without a publish time
        (stored before the log had them) count as older. A scan in position order: O(positions before it)."""
        topic_id = self._topic_id(_name(topic, "topic"))
        if topic_id is None:
            return None
        base = topic_id << _POSITION_BITS
        after, through = max(after, 0), min(through, MAX_POSITION)
        wanted = _publish_time(publish_time)
        with _rows(
            self._connection(),
            "SELECT id - ?, count, publish_time, data FROM entries WHERE id > ? AND id <= ? AND publish_time >= ?"
            " ORDER BY id",  # an entry's publish_time is its latest: only those with one at or after it
            (base, base + after, base + MAX_POSITION, wanted),
        ) as entries:
            for last, count, latest, data in entries:
                first = last - count + 1
                if first > through:
                    return None
                times = _columns(last, count, data)[3] or [latest] * count
                for position in range(max(first, after + 1), min(last, through) + 1):
                    at = times[position - first]
                    if at is not None and at >= wanted:
                        return position
        return None

    def topics(self) -> list[str]:
        """Every topic that holds messages, sorted."""
        return [name for (name,) in self._connection().execute("SELECT name FROM topics ORDER BY name")]

    # -- dead letters ----------------------------------------------------------------

    def dead_letter(self, topic: str, subscription: str, letters: Sequence[DeadLetterEntry]) -> list[int]:
        """Store ``(position, key, payload, redelivery_count, reason, publish_time, properties)`` letters in the
        subscription's dead-letter topic, with where each came from and why, in one transaction; their
        positions there. Each keeps its ``publish_time`` (µs since the Unix epoch, None: unknown) and its
        encoded ``properties`` (None: none).
        """
        topic, subscription = _subscription_key(topic, subscription)
        dlq = dead_letter_topic(topic, subscription)
        rows = [_letter(letter, index) for index, letter in enumerate(_iterable(letters, "letters"))]
        now = time.time()
        with self._transaction() as db:
            writer = _Append(db, publish_clock())
            stored = writer.add(
                dlq,
                None,
                [(None, key, payload) for _, key, payload, _, _, _, _ in rows],
                [row[6] for row in rows],
                kept=[row[5] for row in rows],
            )
            writer.insert()
            db.executemany(
                "INSERT INTO dead_letters (dlq_topic, dlq_position, topic, subscription, position, redelivery_count,"
                " reason, time) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (dlq, dlq_position, topic, subscription, position, count, reason, now)
                    for (dlq_position, _), (position, _, _, count, reason, _, _) in zip(stored, rows, strict=True)
                ],
            )
        return [dlq_position for dlq_position, _ in stored]

    def dead_letters(self, topic: str, subscription: str, limit: int = 1000) -> list[DeadLetterRecord]:
        """The subscription's dead letters, oldest first (at most ``limit``), with their messages."""
        dlq = dead_letter_topic(*_subscription_key(topic, subscription))
        limit = _count(limit, "limit")
        topic_id = self._topic_id(dlq)
        if topic_id is None:
            return []
        rows = (
            self._connection()
            .execute(
                "SELECT dlq_position, position, redelivery_count, reason, time, replayed_at FROM dead_letters"
                " WHERE dlq_topic = ? ORDER BY dlq_position LIMIT ?",
                (dlq, limit),
            )
            .fetchall()
        )
        stored = self.read_positions(dlq, [row[0] for row in rows])
        return [
            DeadLetterRecord(
                at, position, m.key, m.payload, count, reason, time_, replayed_at, m.publish_time, m.properties
            )
            for at, position, count, reason, time_, replayed_at in rows
            if (m := stored.get(at)) is not None
        ]

    def replay_dead_letters(self, topic: str, subscription: str) -> list[StoredMessage]:
        """Re-publish to ``topic`` every dead letter of the subscription not replayed yet, in one transaction.

        Each is marked with its new position, so a second call replays only newer ones, and keeps
        its original publish time and properties. Returns the messages as stored in ``topic`` (every subscription
        of it gets them).
        """
        waiting = [
            record for record in self.dead_letters(topic, subscription, MAX_POSITION) if record.replayed_at is None
        ]
        if not waiting:
            return []
        dlq = dead_letter_topic(topic, subscription)
        with self._transaction() as db:
            writer = _Append(db, publish_clock())
            stored = writer.add(
                topic,
                None,
                [(None, record.key, record.payload) for record in waiting],
                [record.properties for record in waiting],
                kept=[record.publish_time for record in waiting],
            )
            writer.insert()
            db.executemany(
                "UPDATE dead_letters SET replayed_at = ? WHERE dlq_topic = ? AND dlq_position = ?",
                [(position, dlq, record.dlq_position) for (position, _), record in zip(stored, waiting, strict=True)],
            )
        return [
            StoredMessage(position, record.key, record.payload, record.publish_time, record.properties)
            for (position, _), record in zip(stored, waiting, strict=True)
        ]

    # -- cursors ---------------------------------------------------------------------

    def subscriptions(self, topic: str) -> list[str]:
        """The subscriptions of ``topic`` with a saved cursor, sorted."""
        rows = self._connection().execute(
            "SELECT subscription FROM cursors WHERE topic = ? ORDER BY subscription", (_name(topic, "topic"),)
        )
        return [name for (name,) in rows]

    def has_cursor(self, topic: str, subscription: str) -> bool:
        """Whether the subscription has a saved cursor."""
        key = _subscription_key(topic, subscription)
        found = self._connection().execute("SELECT 1 FROM cursors WHERE topic = ? AND subscription = ?", key)
        return found.fetchone() is not None

    def load_cursor(self, topic: str, subscription: str) -> Cursor:
        """The saved cursor of the subscription; a new one gets a cursor at 0 (nothing consumed).

        A new subscription's cursor is stored by the first :meth:`save_cursors` that names it.
        """
        key = _subscription_key(topic, subscription)
        row = (
            self._connection().execute("SELECT state FROM cursors WHERE topic = ? AND subscription = ?", key).fetchone()
        )
        if row is None:
            return Cursor()
        try:
            return Cursor.from_bytes(row[0])
        except CursorError as exc:
            raise LogFileError(f"the cursor of {subscription!r} on topic {topic!r} is unreadable: {exc}") from exc

    def save_cursors(self, cursors: Iterable[tuple[str, str, Cursor]]) -> None:
        """Save ``(topic, subscription, cursor)`` triples in one transaction."""
        rows = [_cursor_row(entry) for entry in _iterable(cursors, "cursors")]
        with self._transaction() as db:
            db.executemany(
                "INSERT INTO cursors (topic, subscription, state) VALUES (?, ?, ?)"
                " ON CONFLICT (topic, subscription) DO UPDATE SET state = excluded.state",
                rows,
            )

    def load_consume_mode(self, topic: str, subscription: str) -> str | None:
        """The subscription's saved consume mode, or None when none was saved."""
        key = _subscription_key(topic, subscription)
        row = (
            self._connection()
            .execute("SELECT consume_mode FROM subscription_settings WHERE topic = ? AND subscription = ?", key)
            .fetchone()
        )
        return None if row is None else str(row[0])

    def save_consume_mode(self, topic: str, subscription: str, mode: str) -> None:
        """Save the subscription's consume mode (``"ordered"`` or ``"unordered"``)."""
        key = _subscription_key(topic, subscription)
        if mode not in ("ordered", "unordered"):
            raise LogError(f"consume mode must be 'ordered' or 'unordered', not {reprlib.repr(mode)}")
        with self._transaction() as db:
            db.execute(
                "INSERT INTO subscription_settings (topic, subscription, consume_mode) VALUES (?, ?, ?)"
                " ON CONFLICT (topic, subscription) DO UPDATE SET consume_mode = excluded.consume_mode",
                (*key, mode),
            )

    def load_delivery_settings(self, topic: str, subscription: str) -> dict[str, float | int | None]:
        """The delivery settings the subscription has of its own (empty when none were saved)."""
        key = _subscription_key(topic, subscription)
        row = (
            self._connection()
            .execute("SELECT settings FROM delivery_settings WHERE topic = ? AND subscription = ?", key)
            .fetchone()
        )
        if row is None:
            return {}
        settings = json.loads(row[0])
        return {name: settings[name] for name in DELIVERY_SETTINGS if name in settings}

    def save_delivery_settings(self, topic: str, subscription: str, settings: Mapping[str, object]) -> None:
        """Save the subscription's own delivery settings, replacing those saved before (empty: none)."""
        key = _subscription_key(topic, subscription)
        if not isinstance(settings, Mapping):
            raise LogError(f"delivery settings must be a mapping, not {reprlib.repr(settings)}")
        for name, value in settings.items():
            if name not in DELIVERY_SETTINGS:
                raise LogError(f"unknown delivery setting {reprlib.repr(name)}; expected one of {DELIVERY_SETTINGS}")
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if value is not None and not number:
                raise LogError(f"delivery setting {name} must be a finite number or None, not {reprlib.repr(value)}")
        with self._transaction() as db:
            if not settings:
                db.execute("DELETE FROM delivery_settings WHERE topic = ? AND subscription = ?", key)
                return
            db.execute(
                "INSERT INTO delivery_settings (topic, subscription, settings) VALUES (?, ?, ?)"
                " ON CONFLICT (topic, subscription) DO UPDATE SET settings = excluded.settings",
                (*key, json.dumps(dict(settings), sort_keys=True)),
            )

    def delete_cursor(self, topic: str, subscription: str) -> bool:
        """Forget the subscription's cursor (its settings stay); whether it had one."""
        key = _subscription_key(topic, subscription)
        with self._transaction() as db:
            return db.execute("DELETE FROM cursors WHERE topic = ? AND subscription = ?", key).rowcount > 0

    def delete_subscription(self, topic: str, subscription: str) -> bool:
        """Forget the subscription's cursor and settings; whether it had a cursor."""
        key = _subscription_key(topic, subscription)
        with self._transaction() as db:
            db.execute("DELETE FROM subscription_settings WHERE topic = ? AND subscription = ?", key)
            db.execute("DELETE FROM delivery_settings WHERE topic = ? AND subscription = ?", key)
            return db.execute("DELETE FROM cursors WHERE topic = ? AND subscription = ?", key).rowcount > 0

    # -- partitioned topics ----------------------------------------------------------

    def partition_counts(self) -> dict[str, int]:
        """Every topic created with partitions, and how many it has."""
        rows = self._connection().execute("SELECT name, partitions FROM partitioned_topics ORDER BY name")
        return {name: int(count) for name, count in rows}

    def create_partitioned_topic(self, topic: str, partitions: int) -> bool:
        """Record that ``topic`` has ``partitions``; False when it was created with as many already.

        Refused (:class:`LogError`) when it was created with another count, when it holds
        messages as a topic of one partition, or when its name is a partition's.
        """
        topic = _name(topic, "topic")
        if type(partitions) is not int or not 1 <= partitions <= MAX_PARTITIONS:
            raise LogError(f"a topic's partition count must be an int from 1 to {MAX_PARTITIONS}, not {partitions!r}")
        if split_partition_topic(topic) is not None:
            raise LogError(f"{topic!r} names a partition (<topic>-partition-<p>); expected a topic name without it")
        with self._transaction() as db:
            row = db.execute("SELECT partitions FROM partitioned_topics WHERE name = ?", (topic,)).fetchone()
            if row is not None:
                if int(row[0]) != partitions:
                    raise LogError(
                        f"topic {topic!r} exists with {row[0]} partitions; a topic's partition count is fixed at "
                        f"creation, so it cannot be created again with {partitions}"
                    )
                return False
            if partitions > 1 and self._topic_id(topic) is not None:
                raise LogError(
                    f"topic {topic!r} already holds messages as a topic of one partition; it cannot get {partitions}"
                )
            db.execute("INSERT INTO partitioned_topics (name, partitions) VALUES (?, ?)", (topic, partitions))
        return True

    # -- the file --------------------------------------------------------------------

    def stats(self) -> LogStats:
        """Messages and first and last position per topic, and the size of the file with its write-ahead log."""
        db = self._connection()
        topics: dict[str, TopicStats] = {}
        for topic_id, name in db.execute("SELECT id, name FROM topics ORDER BY name").fetchall():
            first, last = _first_position(db, topic_id), _last_position(db, topic_id)
            topics[name] = TopicStats(messages=last - first + 1, first_position=first, last_position=last)
        size = sum(os.stat(f).st_size for f in (self._path, Path(f"{self._path}-wal")) if f.exists())
        return LogStats(path=str(self._path), file_bytes=size, topics=topics)

    def close(self) -> None:
        """Close the file (idempotent); every later call raises :class:`LogFileError`."""
        if self._db is not None:
            self._db.close()
            self._db = None

    def __enter__(self) -> Log:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise LogFileError(f"the log {str(self._path)!r} is closed")
        return self._db

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        db = self._connection()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            db.rollback()
            raise

    def _create_schema(self) -> None:
        with self._transaction() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version == SCHEMA_VERSION:
                return
            if version > SCHEMA_VERSION:
                raise LogFileError(
                    f"the log {str(self._path)!r} has schema version {version}, newer than {SCHEMA_VERSION}, "
                    "the newest this keyfailover reads"
                )
            if version == 0:
                if db.execute("SELECT count(*) FROM sqlite_schema").fetchone()[0]:
                    raise LogFileError(f"{str(self._path)!r} is an SQLite database but not a keyfailover log")
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
            _rewrite_into_entries(db)  # version 6 had a row per message
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _topic_id(self, topic: str) -> int | None:
        row = self._connection().execute("SELECT id FROM topics WHERE name = ?", (topic,)).fetchone()
        return None if row is None else int(row[0])


_EntryRow = tuple[int, int, int | None, int | None, int | None, int | None, bytes]
"""``(id, count, producer id, first seq, last seq, publish time, data)``: one row of the entries table."""
_Times = int | None | list[int | None]
"""The publish times of messages: one for all of them, or one each."""


def _entry_rows(
    base: int,
    producer: int | None,
    first: int,
    *,
    keys: list[Key],
    payloads: list[bytes],
    seqs: list[int] | None,
    times: _Times,
    properties: list[bytes | None] | None,
) -> Iterator[_EntryRow]:
    """The entries of messages of one topic (id ``base``) and producer at consecutive positions from ``first``:
    ``_ENTRY_MESSAGES`` at most each, and no more than ``_ENTRY_BYTES`` of payload unless one message alone."""
    count = len(keys)
    start = 0
    while start < count:
        end = min(start + _ENTRY_MESSAGES, count)
        if sum(map(len, payloads[start:end])) > _ENTRY_BYTES:
            size, end = len(payloads[start]), start + 1
            while end < count and end - start < _ENTRY_MESSAGES and size + len(payloads[end]) <= _ENTRY_BYTES:
                size += len(payloads[end])
                end += 1
        whole = start == 0 and end == count  # the usual case: no copies
        yield _entry(
            base + first + end - 1,
            producer,
            keys=keys if whole else keys[start:end],
            payloads=payloads if whole else payloads[start:end],
            seqs=seqs if whole or seqs is None else seqs[start:end],
            times=times if whole or not isinstance(times, list) else times[start:end],
            properties=properties if whole or properties is None else properties[start:end],
        )
        start = end


def _entry(
    row_id: int,
    producer: int | None,
    *,
    keys: list[Key],
    payloads: list[bytes],
    seqs: list[int] | None,
    times: _Times,
    properties: list[bytes | None] | None,
) -> _EntryRow:
    """One row of the entries table; its publish time is the latest of its messages' (NULL: none known)."""
    if isinstance(times, list):
        known = [at for at in times if at is not None]
        latest = max(known) if known else None
        if times.count(times[0]) == len(times):
            times = times[0]  # all alike: the column says it
    else:
        latest = times
    try:
        data = msgpack.packb([keys, payloads, seqs, times if isinstance(times, list) else None, properties])
    except UnicodeEncodeError:  # names were checked, payloads are bytes: a str key has no UTF-8 form
        for key in keys:
            if type(key) is str:
                _key(key)
        raise
    first_seq, last_seq = (None, None) if seqs is None else (min(seqs), max(seqs))
    return row_id, len(keys), producer, first_seq, last_seq, latest, data


_Columns = tuple[list[Key], list[bytes], list[int] | None, list[int | None] | None, list[bytes | None] | None]
"""An entry's data: its messages' keys, payloads, sequence ids, publish times and properties (None: no
sequence ids, the entry's publish time for all, no properties)."""


def _columns(last: int, count: int, data: bytes) -> _Columns:
    """The columns of the entry whose last position is ``last``, checked to hold ``count`` messages."""
    try:
        keys, payloads, seqs, times, properties = msgpack.unpackb(data)
        whole = len(keys) == len(payloads) == count and all(
            column is None or len(column) == count for column in (seqs, times, properties)
        )
    except (ValueError, TypeError) as exc:  # not msgpack, not five columns, or a column not a list
        problem = f"{type(exc).__name__}: {exc}"
        raise LogFileError(f"the entry ending at position {last} is unreadable ({problem})") from None
    if not whole:
        raise LogFileError(f"the entry ending at position {last} does not hold the {count} messages it should")
    return keys, payloads, seqs, times, properties


def _decode(last: int, count: int, publish_time: int | None, data: bytes) -> list[StoredMessage]:
    """The messages of the entry whose last position is ``last``, in position order."""
    keys, payloads, _, times, properties = _columns(last, count, data)
    return list(
        map(
            stored_message,
            zip(
                range(last - count + 1, last + 1),
                keys,
                payloads,
                itertools.repeat(publish_time) if times is None else times,
                itertools.repeat(None) if properties is None else properties,
                strict=False,
            ),
        )
    )


def _rewrite_into_entries(db: sqlite3.Connection) -> None:
    """Move the messages of a log of schema 6 or older (a row per message) into entries, in the caller's
    transaction: a run of one topic and producer goes in entries as one append would store it."""
    for statement in _VERSION_7:
        db.execute(statement)
    rows = db.execute("SELECT id, key, payload, producer, seq, publish_time, properties FROM messages ORDER BY id")
    entries: list[_EntryRow] = []
    held = 0  # the bytes of the entries not inserted yet
    run: list[tuple[int, Key, bytes, int | None, int | None, int | None, bytes | None]] = []
    run_bytes = 0  # the payload bytes of the run
    for row in rows:
        if run and (
            row[0] != run[-1][0] + 1
            or row[3] != run[-1][3]
            or (row[3] is not None and row[4] <= run[-1][4])
            or len(run) >= _ENTRY_MESSAGES
            or run_bytes + len(row[2]) > _ENTRY_BYTES
        ):  # another topic or producer, sequence ids that do not increase (two batches), or a full entry
            for entry in _run_entries(run):
                entries.append(entry)
                held += len(entry[-1])
            run, run_bytes = [], 0
            if held >= _MIGRATE_BYTES:
                _insert_entries(db, entries)
                entries, held = [], 0
        run.append(row)
        run_bytes += len(row[2])
    if run:
        entries += _run_entries(run)
    _insert_entries(db, entries)
    db.execute("DROP TABLE messages")  # its index goes with it


def _insert_entries(db: sqlite3.Connection, entries: list[_EntryRow]) -> None:
    """Insert rows of the entries table (an append's, a migration's)."""
    db.executemany(
        "INSERT INTO entries (id, count, producer, first_seq, last_seq, publish_time, data)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        entries,
    )


def _run_entries(
    run: list[tuple[int, Key, bytes, int | None, int | None, int | None, bytes | None]],
) -> Iterator[_EntryRow]:
    """The entries of rows of the messages table at consecutive ids, of one producer (or none)."""
    first_id, producer = run[0][0], run[0][3]
    base = first_id & ~MAX_POSITION
    properties = [row[6] for row in run]
    return _entry_rows(
        base,
        producer,
        first_id - base,
        keys=[row[1] for row in run],
        payloads=[row[2] for row in run],
        seqs=None if producer is None else [seq for *_, seq, _, _ in run if seq is not None],
        times=[row[5] for row in run],
        properties=properties if any(data is not None for data in properties) else None,
    )


class _Append:
    """One :meth:`Log.append` call: the topics and producers it touched, and entries not yet inserted.

    Each batch becomes one entry (more when it is large: :func:`_entry_rows`). Entries are inserted
    at the end, or earlier when a duplicate must look up the position of a message stored earlier
    in the same call.
    """

    __slots__ = ("_db", "_entries", "_now", "_producers", "_topics")

    def __init__(self, db: sqlite3.Connection, now: int) -> None:
        self._db = db
        self._now = now  # the publish time of the messages this call stores
        self._entries: list[_EntryRow] = []
        self._topics: dict[str, list[int]] = {}  # name -> [id, last position]
        self._producers: dict[tuple[int, str], list[int]] = {}  # (topic id, name) -> [id, last seq]

    def add(
        self,
        topic: str,
        producer: str | None,
        messages: Sequence[Message],
        properties: PropertiesColumn = None,
        kept: Sequence[int | None] | None = None,
    ) -> list[tuple[int, bool]]:
        """Queue the rows of one batch; ``(position, duplicate)`` for each of its messages.

        Each message gets this call's publish time, or with ``kept`` the one it had where it
        was stored before (a dead letter, a replay), and its encoded ``properties`` (checked).
        """
        if not messages:
            return []
        encoded = None if properties is None else _properties(properties, len(messages))
        state = self._topic(topic)
        topic_id, last = state
        base = topic_id << _POSITION_BITS
        producer_state = None if producer is None else self._producer(topic_id, producer)
        producer_id, last_seq = (None, -1) if producer_state is None else producer_state
        previous = -1
        first = last + 1
        keys: list[Key] = []
        payloads: list[bytes] = []
        seqs: list[int] | None = None if producer_id is None else []
        times: list[int | None] | None = None if kept is None else []
        with_properties: list[bytes | None] | None = None if encoded is None else []
        out: list[tuple[int, bool]] = []
        for index, message in enumerate(messages):
            seq, key, payload = _unpack(message, index)
            if type(payload) is not bytes:
                payload = _payload(payload, index)
            if key is not None and type(key) is not str and type(key) is not bytes:
                key = _key(key)
            if producer_id is None:
                if seq is not None:
                    raise SequenceError(
                        f"message {index} has sequence id {reprlib.repr(seq)} but its batch has no producer name; "
                        "expected None, or a producer name with the batch"
                    )
            else:
                if type(seq) is not int or not 0 <= seq <= _MAX_SEQ:
                    raise SequenceError(
                        f"message {index} of producer {reprlib.repr(producer)} has sequence id {reprlib.repr(seq)}; "
                        "expected an int in [0, 2**63 - 1]"
                    )
                if seq <= previous:
                    raise SequenceError(
                        f"sequence id {seq} of producer {reprlib.repr(producer)} follows {previous} in the same "
                        "batch; expected increasing sequence ids"
                    )
                previous = seq
                if seq > last_seq:
                    last_seq = seq
                elif stored := self._stored_position(producer_id, seq):
                    out.append((stored, True))
                    continue
                # else sent after a higher seq and never stored (another key's batch went first): stored now
                if seqs is not None:
                    seqs.append(seq)
            last += 1
            keys.append(key)
            payloads.append(payload)
            if times is not None:
                times.append(kept[index])  # type: ignore[index]
            if with_properties is not None:
                with_properties.append(encoded[index])  # type: ignore[index]
            out.append((last, False))
        if last > MAX_POSITION:
            raise LogError(f"topic {reprlib.repr(topic)} would pass its last possible position {MAX_POSITION}")
        if keys:
            if with_properties is not None and not any(with_properties):
                with_properties = None
            self._entries += _entry_rows(
                base,
                producer_id,
                first,
                keys=keys,
                payloads=payloads,
                seqs=seqs,
                times=self._now if times is None else times,
                properties=with_properties,
            )
        state[1] = last
        if producer_state is not None:
            producer_state[1] = last_seq
        return out

    def insert(self) -> None:
        """Insert the entries not inserted yet."""
        if self._entries:
            _insert_entries(self._db, self._entries)
            self._entries.clear()

    def _topic(self, name: str) -> list[int]:
        state = self._topics.get(name)
        if state is None:
            db = self._db
            row = db.execute("SELECT id FROM topics WHERE name = ?", (name,)).fetchone()
            if row is not None:
                topic_id = int(row[0])
                state = [topic_id, _last_position(db, topic_id)]
            else:
                topic_id = db.execute("INSERT INTO topics (name) VALUES (?)", (name,)).lastrowid or 0
                if topic_id > _MAX_TOPIC_ID:
                    raise LogError(
                        f"topic {name!r} cannot be created: the log holds its maximum of {_MAX_TOPIC_ID} topics"
                    )
                state = [topic_id, 0]
            self._topics[name] = state
        return state

    def _producer(self, topic_id: int, name: str) -> list[int]:
        key = (topic_id, name)
        state = self._producers.get(key)
        if state is None:
            db = self._db
            row = db.execute("SELECT id FROM producers WHERE topic = ? AND name = ?", key).fetchone()
            if row is not None:
                producer_id = int(row[0])
                (last_seq,) = db.execute(
                    "SELECT max(last_seq) FROM entries WHERE producer = ?", (producer_id,)
                ).fetchone()
                state = [producer_id, -1 if last_seq is None else int(last_seq)]
            else:
                state = [db.execute("INSERT INTO producers (topic, name) VALUES (?, ?)", key).lastrowid or 0, -1]
            self._producers[key] = state
        return state

    def _stored_position(self, producer_id: int, seq: int) -> int:
        """Where ``producer_id`` stored the message of ``seq``; 0 when it stored none.

        The entries whose sequence ids span ``seq`` come first in the index from ``seq`` up, and are few
        (a producer's batches overlap only when sent out of order). They are read one query each, with
        ``LIMIT 1``: a statement stepped past its last row scans the rest of the index range, so a
        query for all of them would scan every later entry of the producer even when the first holds
        ``seq``. A stored message is found in O(log n) a candidate; an id never stored costs one scan
        of the producer's later index rows."""
        self.insert()  # the original may be in an entry of this call
        floor = seq
        while found := self._db.execute(
            "SELECT id, count, data, last_seq FROM entries WHERE producer = ? AND last_seq >= ? AND first_seq <= ?"
            " ORDER BY last_seq LIMIT 1",
            (producer_id, floor, seq),
        ).fetchone():
            row_id, count, data, last_seq = found
            last = int(row_id) & MAX_POSITION
            seqs = _columns(last, count, data)[2]
            if seqs is None:
                raise LogFileError(f"the entry ending at position {last} has no sequence ids; its producer is named")
            index = bisect.bisect_left(seqs, seq)  # increasing within an entry
            if index < len(seqs) and seqs[index] == seq:
                return last - int(count) + 1 + index
            floor = int(last_seq) + 1  # a producer's entries have distinct last sequence ids
        return 0


class LogSnapshot:
    """A read-only view of a log file as of its last commit before the snapshot was made.

    It has a connection of its own, writes nothing, and is safe while a server writes the
    same file. It notes each topic's last position when made, then reads up to there in
    short read transactions (messages are never changed or deleted), so a long export does
    not pin the write-ahead log and stop the server's checkpoints. It reads a log of any schema
    version a server migrates (nothing is migrated: it writes nothing), a row per message before
    schema 7, and reads on in entries when a server upgrades the log during an export; a message
    stored before schema 5 has no publish time, one stored before schema 6 no properties. When no
    server runs, SQLite leaves the empty ``-wal`` and ``-shm`` files it keeps beside a WAL
    database, which the next server uses as usual.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        if not path.is_file():
            raise LogFileError(f"there is no keyfailover log at {str(path)!r}; expected a server's --data-dir")
        try:
            db = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, isolation_level=None)
            version = db.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.Error as exc:
            raise LogFileError(f"cannot read the log {str(path)!r}: {exc}") from None
        if not 1 <= version <= SCHEMA_VERSION:
            db.close()
            raise LogFileError(
                f"the log {str(path)!r} has schema version {version}; this keyfailover reads versions 1 to "
                f"{SCHEMA_VERSION}"
            )
        self._db = db
        self._entries = version >= 7  # before, a row per message
        self._publish_time = "publish_time" if version >= 5 else "NULL"  # schema 5 added the column
        self._properties = "properties" if version >= 6 else "NULL"  # and schema 6 this one
        table = "entries" if self._entries else "messages"
        with self._read():
            self._topics = {
                name: (topic_id, _last_position(db, topic_id, table))
                for topic_id, name in db.execute("SELECT id, name FROM topics ORDER BY name").fetchall()
            }

    def topics(self) -> list[str]:
        """Every topic the snapshot has, sorted."""
        return list(self._topics)

    def messages(self, topic: str, chunk: int = 65_536) -> Iterator[ExportRow]:
        """Every message of ``topic`` in the snapshot, in position order, read ``chunk`` rows at a time.

        Each page is read in a short transaction of its own, in the layout the log has then: a server
        may upgrade a log of a row per message into entries while an export runs, and an upgraded
        entry may then hold the snapshot's last message and later ones (so entries are read up to
        ``_ENTRY_MESSAGES - 1`` positions past it, and what is past it is left out)."""
        found = self._topics.get(topic)
        if found is None:
            raise LogError(f"topic {topic!r} is not in the log; expected one of {self.topics()}")
        topic_id, last = found
        db = self._db
        base = topic_id << _POSITION_BITS
        rows_sql = (
            f"SELECT id, key, payload, producer, seq, {self._publish_time}, {self._properties} FROM messages"
            " WHERE id > ? AND id <= ? ORDER BY id LIMIT ?"
        )
        entries_sql = (
            "SELECT id, count, producer, publish_time, data FROM entries WHERE id > ? AND id <= ? ORDER BY id LIMIT ?"
        )
        entries_end = base + min(last + _ENTRY_MESSAGES - 1, MAX_POSITION)
        producers: dict[int, str] = {}
        after = 0
        while after < last:
            with self._read():
                if not self._entries and db.execute("PRAGMA user_version").fetchone()[0] >= 7:
                    self._entries = True  # upgraded since the last page
                if self._entries:
                    rows = db.execute(entries_sql, (base + after, entries_end, max(chunk // _ENTRY_MESSAGES, 1)))
                else:
                    rows = db.execute(rows_sql, (base + after, base + last, chunk))
                page = rows.fetchall()
                named = 2 if self._entries else 3  # the producer column
                if any(row[named] is not None and row[named] not in producers for row in page):
                    producers = dict(db.execute("SELECT id, name FROM producers WHERE topic = ?", (topic_id,)))
            if not page:
                return
            if self._entries:
                yield from self._entry_messages(page, base, after, last, producers)
            else:
                for row_id, key, payload, producer, seq, at, properties in page:
                    yield row_id - base, key, payload, producers.get(producer), seq, at, properties
            after = page[-1][0] - base

    @staticmethod
    def _entry_messages(
        page: list[Any], base: int, after: int, last: int, producers: dict[int, str]
    ) -> Iterator[ExportRow]:
        """The messages of a page of entries at positions in ``(after, last]``."""
        for row_id, count, producer, publish_time, data in page:
            end = row_id - base
            keys, payloads, seqs, times, properties = _columns(end, count, data)
            rows: Iterator[ExportRow] = zip(
                range(end - count + 1, end + 1),
                keys,
                payloads,
                itertools.repeat(producers.get(producer)),
                itertools.repeat(None) if seqs is None else seqs,
                itertools.repeat(publish_time) if times is None else times,
                itertools.repeat(None) if properties is None else properties,
            )
            if end - count < after or end > last:  # an entry made by an upgrade during the export
                rows = (row for row in rows if after < row[0] <= last)
            yield from rows

    @contextmanager
    def _read(self) -> Iterator[None]:
        """One short read transaction."""
        self._db.execute("BEGIN")
        try:
            yield
        finally:
            self._db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> LogSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _last_position(db: sqlite3.Connection, topic_id: int, table: str = "entries") -> int:
    """The last position of a topic (an entry's id, or a message's in the ``messages`` table of a log of
    schema 6 or older); 0 if it holds none. O(log n)."""
    base = topic_id << _POSITION_BITS
    (row_id,) = db.execute(
        f"SELECT max(id) FROM {table} WHERE id > ? AND id <= ?", (base, base + MAX_POSITION)
    ).fetchone()
    return 0 if row_id is None else int(row_id) - base


def _first_position(db: sqlite3.Connection, topic_id: int) -> int:
    """The first position of a topic; 1 if it holds none. O(log n)."""
    base = topic_id << _POSITION_BITS
    row = db.execute(
        "SELECT id, count FROM entries WHERE id > ? AND id <= ? ORDER BY id LIMIT 1", (base, base + MAX_POSITION)
    ).fetchone()
    return 1 if row is None else int(row[0]) - base - int(row[1]) + 1


@contextmanager
def _rows(db: sqlite3.Connection, sql: str, parameters: Sequence[object]) -> Iterator[sqlite3.Cursor]:
    """The rows of a query, read as they are stepped through; the statement ends when the block does, so a
    reader that stops early leaves no read transaction open to hold the write-ahead log's checkpoints back."""
    cursor = db.execute(sql, parameters)
    try:
        yield cursor
    finally:
        cursor.close()


def _batch(batch: Batch) -> tuple[str, str | None, Sequence[Message], PropertiesColumn]:
    """``(topic, producer, messages, properties)`` of a batch of three or four items, the names checked."""
    try:
        topic, producer, messages, properties = batch if len(batch) == 4 else (*batch, None)
    except (TypeError, ValueError):
        raise LogError(
            f"a batch must be a (topic, producer, messages[, properties]) tuple, not {reprlib.repr(batch)}"
        ) from None
    if producer is not None:
        producer = _name(producer, "producer name")
    if not isinstance(messages, Sequence):
        raise LogError(f"the messages of a batch must be a sequence, not {type(messages).__name__}")
    return _name(topic, "topic"), producer, messages, properties


def _properties(properties: Sequence[bytes | None], count: int) -> Sequence[bytes | None]:
    """``properties``, one encoding or None per message of a batch of ``count``, each checked."""
    if not isinstance(properties, Sequence) or len(properties) != count:
        shown = len(properties) if isinstance(properties, Sequence) else type(properties).__name__
        raise PropertiesError(
            f"a batch of {count} messages has properties for {shown}; expected one encoding or None per message"
        )
    for index, data in enumerate(properties):
        if data is not None:
            try:
                check_encoded(data)
            except PropertiesError as exc:
                raise PropertiesError(f"message {index}: {exc}") from None
    return properties


def _unpack(message: Message, index: int) -> Message:
    try:
        seq, key, payload = message
    except (TypeError, ValueError):
        raise LogError(f"message {index} must be a (seq, key, payload) tuple, not {reprlib.repr(message)}") from None
    return seq, key, payload


def _payload(payload: object, index: int) -> bytes:
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    raise LogError(f"the payload of message {index} must be bytes, not {type(payload).__name__}")


def _key(key: object) -> Key:
    if isinstance(key, str):
        try:
            key.encode()
        except UnicodeEncodeError as exc:
            raise InvalidKeyError(
                f"key {reprlib.repr(key)} is not valid Unicode ({exc.reason} at index {exc.start}); "
                "expected a str that encodes to UTF-8"
            ) from None
        return str(key)
    if isinstance(key, bytes):
        return bytes(key)
    raise InvalidKeyError(f"a message key must be str, bytes or None, not {type(key).__name__}")


def _subscription_key(topic: object, subscription: object) -> tuple[str, str]:
    """``(topic, subscription)``, each checked as :func:`_name` does."""
    return _name(topic, "topic"), _name(subscription, "subscription")


def _name(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise LogError(f"{what} must be a non-empty str, not {reprlib.repr(value)}")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise LogError(
            f"{what} {reprlib.repr(value)} is not valid Unicode; expected a str that encodes to UTF-8"
        ) from None
    return str(value)


def _count(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise LogError(f"{what} must be a non-negative int, not {reprlib.repr(value)}")
    return value


def _position(value: object) -> int:
    if type(value) is not int:
        raise LogError(f"a position must be an int, not {reprlib.repr(value)}")
    return value


def _iterable(value: Iterable[_T], what: str) -> Iterable[_T]:
    if not isinstance(value, Iterable):
        raise LogError(f"{what} must be iterable, not {type(value).__name__}")
    return value


def _publish_time(value: object) -> int:
    if type(value) is not int or value < 0:
        raise LogError(f"a publish time must be an int of microseconds since the Unix epoch, not {value!r}")
    return value


def _letter(value: object, index: int) -> DeadLetterEntry:
    if not isinstance(value, tuple) or len(value) != 7:
        raise LogError(
            f"dead letter {index} must be a (position, key, payload, redelivery_count, reason, publish_time, "
            f"properties) tuple, not {reprlib.repr(value)}"
        )
    position, key, payload, count, reason, publish_time, properties = value
    if key is not None and type(key) is not str and type(key) is not bytes:
        key = _key(key)
    return (
        _position(position),
        key,
        _payload(payload, index),
        _count(count, "redelivery_count"),
        _name(reason, "reason"),
        None if publish_time is None else _publish_time(publish_time),
        None if properties is None else check_encoded(properties),
    )


def _cursor_row(entry: tuple[str, str, Cursor]) -> tuple[str, str, bytes]:
    try:
        topic, subscription, cursor = entry
    except (TypeError, ValueError):
        raise LogError(
            f"a cursor entry must be a (topic, subscription, Cursor) tuple, not {reprlib.repr(entry)}"
        ) from None
    if not isinstance(cursor, Cursor):
        raise LogError(
            f"the cursor of {reprlib.repr(subscription)} on topic {reprlib.repr(topic)} must be a Cursor, "
            f"not {type(cursor).__name__}"
        )
    return *_subscription_key(topic, subscription), cursor.to_bytes()
