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

An entry names its producer by id (``producers.id``; NULL for an unnamed producer's). A read
gives each message its producer's name from a map of the names read before (producers are few,
and a name never changes): an entry costs a dictionary lookup, and its messages share the name.

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
from typing import Any, Literal
from urllib.parse import quote

from keyfailover.broker.cursor import Cursor
from keyfailover.broker.storage._sqlite_checks import (
    check_count,
    check_cursor_row,
    check_iterable,
    check_letter,
    check_name,
    check_position,
    check_publish_time,
    check_subscription,
)
from keyfailover.broker.storage._sqlite_entries import (
    MAX_POSITION,
    POSITION_BITS,
    Append,
    decode_entry,
    entry_columns,
    entry_pages,
    topic_first_position,
    topic_last_position,
)
from keyfailover.broker.storage._sqlite_schema import SCHEMA_VERSION, migrate
from keyfailover.broker.storage.records import (
    DEAD_LETTER_SUFFIX,
    DELIVERY_SETTINGS,
    DeadLetterEntry,
    DeadLetterGroup,
    DeadLetterRecord,
    ExportRow,
    Key,
    LogStats,
    Message,
    PropertiesColumn,
    SchemaRecord,
    StoredMessage,
    TopicStats,
    check_schema,
    dead_letter_topic,
    publish_clock,
    schema_properties,
    schema_properties_text,
    stored_message,
)
from keyfailover.core.errors import CursorError, LogError, LogFileError
from keyfailover.core.partitions import MAX_PARTITIONS, split_partition_topic

__all__ = [
    "DEAD_LETTER_SUFFIX",
    "DELIVERY_SETTINGS",
    "LOG_FILE_NAME",
    "MAX_POSITION",
    "SCHEMA_VERSION",
    "Batch",
    "DeadLetterEntry",
    "DeadLetterRecord",
    "ExportRow",
    "Key",
    "Log",
    "LogSnapshot",
    "LogStats",
    "Message",
    "PropertiesColumn",
    "StoredMessage",
    "TopicStats",
    "dead_letter_topic",
    "publish_clock",
    "stored_message",
]
"""The log, and the records and limits it has exported from the start: those now live in
:mod:`keyfailover.broker.storage.records` and the log's private modules, and are named here too."""

Batch = tuple[str, str | None, Sequence[Message]] | tuple[str, str | None, Sequence[Message], PropertiesColumn]
"""``(topic, producer name or None, messages[, properties])``: one produce request."""

LOG_FILE_NAME = "keyfailover.db"
"""The log's file name inside a server's data directory."""

_PRODUCER_NAMES = 10_000
"""The most producer names a log keeps in memory for its reads (:meth:`Log._producer_name`)."""


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
        self._producer_names: dict[int, str] = {}  # producers.id -> name, of the producers read
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
        """The log's file."""
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
        now = publish_clock() if publish_time is None else check_publish_time(publish_time)
        with self._transaction() as db:
            writer = Append(db, now)
            results = [writer.add(*_check_batch(batch)) for batch in batches]
            writer.insert()
        return results

    def read(self, topic: str, after: int, limit: int) -> list[StoredMessage]:
        """Up to ``limit`` messages of ``topic`` at positions above ``after``, ascending; [] for an unknown topic."""
        topic = check_name(topic, "topic")
        after = check_count(after, "after")
        limit = check_count(limit, "limit")
        topic_id = self._topic_id(topic)
        if topic_id is None or after >= MAX_POSITION:
            return []
        base = topic_id << POSITION_BITS
        found: list[StoredMessage] = []
        with _rows(
            self._connection(),
            "SELECT id - ?, count, publish_time, data, producer FROM entries WHERE id > ? AND id <= ? ORDER BY id",
            (base, base + after, base + MAX_POSITION),
        ) as entries:
            for last, count, publish_time, data, producer in entries:
                if len(found) >= limit:
                    break
                messages = decode_entry(last, count, publish_time, data, self._producer_name(producer))
                skip = max(after - (last - count), 0)  # the first entry may begin at or before ``after``
                found += messages[skip : skip + limit - len(found)]
        return found

    def read_positions(self, topic: str, positions: Iterable[int]) -> dict[int, StoredMessage]:
        """The messages of ``topic`` at ``positions`` (to re-read payloads for replays); absent ones are left out."""
        topic = check_name(topic, "topic")
        wanted = sorted({check_position(p) for p in check_iterable(positions, "positions")})
        topic_id = self._topic_id(topic)
        if topic_id is None:
            return {}
        base = topic_id << POSITION_BITS
        wanted = [p for p in wanted if 1 <= p <= MAX_POSITION]
        db = self._connection()
        found: dict[int, StoredMessage] = {}
        index = 0
        while index < len(wanted):  # one query per entry holding some of them
            row = db.execute(
                "SELECT id - ?, count, publish_time, data, producer FROM entries WHERE id >= ? AND id <= ?"
                " ORDER BY id LIMIT 1",
                (base, base + wanted[index], base + MAX_POSITION),
            ).fetchone()
            if row is None:
                break
            last, count, publish_time, data, producer = row
            keys, payloads, _, times, properties = entry_columns(last, count, data)
            name = self._producer_name(producer)
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
                            name,
                        )
                    )
                index += 1
        return found

    def last_position(self, topic: str) -> int:
        """The position of the newest message of ``topic``; 0 if it has none. O(log n)."""
        topic_id = self._topic_id(check_name(topic, "topic"))
        return 0 if topic_id is None else topic_last_position(self._connection(), topic_id)

    def last_sequence(self, topic: str, producer: str) -> int:
        """The highest sequence id ``producer`` stored in ``topic``; -1 when it stored none."""
        (found,) = (
            self._connection()
            .execute(
                """SELECT max(e.last_seq) FROM entries e JOIN producers p ON e.producer = p.id
                   JOIN topics t ON p.topic = t.id WHERE t.name = ? AND p.name = ?""",
                (check_name(topic, "topic"), check_name(producer, "producer")),
            )
            .fetchone()
        )
        return -1 if found is None else int(found)

    def first_position(self, topic: str) -> int:
        """The position of the oldest message of ``topic``: 1, as nothing is trimmed; 1 for an unknown topic."""
        topic_id = self._topic_id(check_name(topic, "topic"))
        return 1 if topic_id is None else topic_first_position(self._connection(), topic_id)

    def position_at_time(
        self, topic: str, publish_time: int, after: int = 0, through: int = MAX_POSITION
    ) -> int | None:
        """The first position of ``topic`` above ``after`` and at most ``through`` whose publish time is at or after
        ``publish_time`` (µs since the Unix epoch); None when there is none. Messages without a publish time
        (stored before the log had them) count as older. A scan in position order: O(positions before it)."""
        topic_id = self._topic_id(check_name(topic, "topic"))
        if topic_id is None:
            return None
        base = topic_id << POSITION_BITS
        after, through = max(after, 0), min(through, MAX_POSITION)
        wanted = check_publish_time(publish_time)
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
                times = entry_columns(last, count, data)[3] or [latest] * count
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
        topic, subscription = check_subscription(topic, subscription)
        dlq = dead_letter_topic(topic, subscription)
        rows = [check_letter(letter, index) for index, letter in enumerate(check_iterable(letters, "letters"))]
        now = time.time()
        with self._transaction() as db:
            writer = Append(db, publish_clock())
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
        dlq = dead_letter_topic(*check_subscription(topic, subscription))
        limit = check_count(limit, "limit")
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
            writer = Append(db, publish_clock())
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

    def dead_letter_groups(self) -> list[DeadLetterGroup]:
        """Every subscription's dead letters counted by reason, sorted by topic, subscription and reason."""
        rows = self._connection().execute(
            "SELECT topic, subscription, reason, count(*), sum(replayed_at IS NULL), min(time) FROM dead_letters"
            " GROUP BY topic, subscription, reason ORDER BY topic, subscription, reason"
        )
        groups = []
        for served, subscription, reason, letters, waiting, oldest in rows:
            topic, partition = split_partition_topic(served) or (served, 0)
            groups.append(DeadLetterGroup(topic, partition, subscription, reason, letters, waiting, oldest))
        return groups

    def purge_dead_letters(self, topic: str, subscription: str) -> int:
        """Delete the subscription's dead-letter records, replayed or not, in one transaction; how many there were.

        The messages stay in the dead-letter topic (a topic like any other, which consumers may read) but are no
        longer listed as the subscription's dead letters, nor replayed.
        """
        dlq = dead_letter_topic(*check_subscription(topic, subscription))
        with self._transaction() as db:
            return int(db.execute("DELETE FROM dead_letters WHERE dlq_topic = ?", (dlq,)).rowcount)

    # -- cursors ---------------------------------------------------------------------

    def subscriptions(self, topic: str) -> list[str]:
        """The subscriptions of ``topic`` with a saved cursor, sorted."""
        rows = self._connection().execute(
            "SELECT subscription FROM cursors WHERE topic = ? ORDER BY subscription", (check_name(topic, "topic"),)
        )
        return [name for (name,) in rows]

    def has_cursor(self, topic: str, subscription: str) -> bool:
        """Whether the subscription has a saved cursor."""
        key = check_subscription(topic, subscription)
        found = self._connection().execute("SELECT 1 FROM cursors WHERE topic = ? AND subscription = ?", key)
        return found.fetchone() is not None

    def load_cursor(self, topic: str, subscription: str) -> Cursor:
        """The saved cursor of the subscription; a new one gets a cursor at 0 (nothing consumed).

        A new subscription's cursor is stored by the first :meth:`save_cursors` that names it.
        """
        key = check_subscription(topic, subscription)
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
        rows = [check_cursor_row(entry) for entry in check_iterable(cursors, "cursors")]
        with self._transaction() as db:
            db.executemany(
                "INSERT INTO cursors (topic, subscription, state) VALUES (?, ?, ?)"
                " ON CONFLICT (topic, subscription) DO UPDATE SET state = excluded.state",
                rows,
            )

    def load_consume_mode(self, topic: str, subscription: str) -> str | None:
        """The subscription's saved consume mode, or None when none was saved."""
        key = check_subscription(topic, subscription)
        row = (
            self._connection()
            .execute("SELECT consume_mode FROM subscription_settings WHERE topic = ? AND subscription = ?", key)
            .fetchone()
        )
        return None if row is None else str(row[0])

    def save_consume_mode(self, topic: str, subscription: str, mode: str) -> None:
        """Save the subscription's consume mode (``"ordered"`` or ``"unordered"``)."""
        key = check_subscription(topic, subscription)
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
        key = check_subscription(topic, subscription)
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
        key = check_subscription(topic, subscription)
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
        key = check_subscription(topic, subscription)
        with self._transaction() as db:
            return db.execute("DELETE FROM cursors WHERE topic = ? AND subscription = ?", key).rowcount > 0

    def delete_subscription(self, topic: str, subscription: str) -> bool:
        """Forget the subscription's cursor and settings; whether it had a cursor."""
        key = check_subscription(topic, subscription)
        with self._transaction() as db:
            db.execute("DELETE FROM subscription_settings WHERE topic = ? AND subscription = ?", key)
            db.execute("DELETE FROM delivery_settings WHERE topic = ? AND subscription = ?", key)
            return db.execute("DELETE FROM cursors WHERE topic = ? AND subscription = ?", key).rowcount > 0

    # -- schemas ---------------------------------------------------------------------

    def schemas(self, topic: str) -> list[SchemaRecord]:
        """Every version of ``topic``'s schema, oldest first; [] when it has none. ``topic`` is a topic, not a
        partition: a partitioned topic's partitions share its schema."""
        rows = self._connection().execute(
            "SELECT version, type, name, data, properties FROM schemas WHERE topic = ? ORDER BY version",
            (check_name(topic, "topic"),),
        )
        return [
            SchemaRecord(version, kind, name, bytes(data), schema_properties(properties))
            for version, kind, name, data, properties in rows
        ]

    def add_schema(self, topic: str, schema: SchemaRecord) -> bool:
        """Store ``schema`` as version ``schema.version`` of ``topic``'s schema when that is its next version (the
        number of versions it has); False, storing nothing, when it is not (another was added meanwhile)."""
        topic = check_name(topic, "topic")
        version, kind, name, data, properties = check_schema(schema)
        with self._transaction() as db:
            (count,) = db.execute("SELECT count(*) FROM schemas WHERE topic = ?", (topic,)).fetchone()
            if count != version:
                return False
            db.execute(
                "INSERT INTO schemas (topic, version, type, name, data, properties) VALUES (?, ?, ?, ?, ?, ?)",
                (topic, version, kind, name, data, schema_properties_text(properties)),
            )
        return True

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
        topic = check_name(topic, "topic")
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
            first, last = topic_first_position(db, topic_id), topic_last_position(db, topic_id)
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
        """The open connection; :class:`LogFileError` once the log is closed."""
        if self._db is None:
            raise LogFileError(f"the log {str(self._path)!r} is closed")
        return self._db

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed when the block ends, rolled back when it raises."""
        db = self._connection()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            db.rollback()
            raise

    def _create_schema(self) -> None:
        """Create the schema of a new log, or migrate an older log's, in one transaction."""
        with self._transaction() as db:
            migrate(db, self._path)

    def _topic_id(self, topic: str) -> int | None:
        """The id of ``topic``; None when it never held a message."""
        row = self._connection().execute("SELECT id FROM topics WHERE name = ?", (topic,)).fetchone()
        return None if row is None else int(row[0])

    def _producer_name(self, producer_id: int | None) -> str | None:
        """The name of the producer of id ``producer_id`` (an entry's), None for an unnamed producer's entry.

        Names are kept in memory once read, one object each: the messages read share it, and an entry costs
        a dictionary lookup. A name never changes nor goes (a producer's row lives as long as the log), so
        the map is only emptied when it passes ``_PRODUCER_NAMES`` names, which bounds it for a log of many
        short-lived producers (a Pulsar client's unnamed producer gets a new name each time).
        """
        if producer_id is None:
            return None
        name = self._producer_names.get(producer_id)
        if name is None:
            row = self._connection().execute("SELECT name FROM producers WHERE id = ?", (producer_id,)).fetchone()
            if row is None:
                raise LogFileError(f"an entry names producer id {producer_id}, which the log does not hold")
            if len(self._producer_names) >= _PRODUCER_NAMES:
                self._producer_names.clear()
            name = self._producer_names[producer_id] = str(row[0])
        return name


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
                name: (topic_id, topic_last_position(db, topic_id, table))
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
        base = topic_id << POSITION_BITS
        rows_sql = (
            f"SELECT id, key, payload, producer, seq, {self._publish_time}, {self._properties} FROM messages"
            " WHERE id > ? AND id <= ? ORDER BY id LIMIT ?"
        )
        entries_sql = (
            "SELECT id, count, producer, publish_time, data FROM entries WHERE id > ? AND id <= ? ORDER BY id LIMIT ?"
        )
        entries_end, page_entries = entry_pages(topic_id, last, chunk)
        producers: dict[int, str] = {}
        after = 0
        while after < last:
            with self._read():
                if not self._entries and db.execute("PRAGMA user_version").fetchone()[0] >= 7:
                    self._entries = True  # upgraded since the last page
                if self._entries:
                    rows = db.execute(entries_sql, (base + after, entries_end, page_entries))
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
            keys, payloads, seqs, times, properties = entry_columns(end, count, data)
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
        """Close the snapshot's connection."""
        self._db.close()

    def __enter__(self) -> LogSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def _rows(db: sqlite3.Connection, sql: str, parameters: Sequence[object]) -> Iterator[sqlite3.Cursor]:
    """The rows of a query, read as they are stepped through; the statement ends when the block does, so a
    reader that stops early leaves no read transaction open to hold the write-ahead log's checkpoints back."""
    cursor = db.execute(sql, parameters)
    try:
        yield cursor
    finally:
        cursor.close()


def _check_batch(batch: Batch) -> tuple[str, str | None, Sequence[Message], PropertiesColumn]:
    """``(topic, producer, messages, properties)`` of a batch of three or four items, the names checked."""
    try:
        topic, producer, messages, properties = batch if len(batch) == 4 else (*batch, None)
    except (TypeError, ValueError):
        raise LogError(
            f"a batch must be a (topic, producer, messages[, properties]) tuple, not {reprlib.repr(batch)}"
        ) from None
    if producer is not None:
        producer = check_name(producer, "producer name")
    if not isinstance(messages, Sequence):
        raise LogError(f"the messages of a batch must be a sequence, not {type(messages).__name__}")
    return check_name(topic, "topic"), producer, messages, properties
