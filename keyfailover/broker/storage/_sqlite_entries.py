"""The entries of the embedded log: how the messages of a produce request are laid out in one row of
the ``entries`` table, read back, appended, and rewritten from the row per message of a log of schema 6
or older.

An entry's id is ``topic_id << POSITION_BITS | the entry's last position``, so a topic's entries are
one range of the table's own b-tree, in position order. Its messages' keys, payloads, sequence ids,
publish times and properties go in one msgpack blob (:func:`entry_columns` reads it back); the module
docstring of :mod:`keyfailover.broker.storage.sqlite` says why.
"""

from __future__ import annotations

import bisect
import itertools
import reprlib
import sqlite3
from collections.abc import Iterator, Sequence

import msgpack  # type: ignore[import-untyped]

from keyfailover.broker.storage._sqlite_checks import check_key, check_message, check_payload, check_properties
from keyfailover.broker.storage.records import Key, Message, PropertiesColumn, StoredMessage, stored_message
from keyfailover.core.errors import LogError, LogFileError, SequenceError

__all__ = [
    "MAX_POSITION",
    "POSITION_BITS",
    "Append",
    "decode_entry",
    "entry_columns",
    "entry_pages",
    "rewrite_into_entries",
    "topic_first_position",
    "topic_last_position",
]

POSITION_BITS = 40
"""The low bits of an entry's id that hold its last position; the topic's id is above them."""
MAX_POSITION = (1 << POSITION_BITS) - 1
"""The last position a topic can hold (about 1.1e12)."""
_MAX_TOPIC_ID = (1 << (63 - POSITION_BITS)) - 1  # ids stay below 2**63
_MAX_SEQ = (1 << 63) - 1
_ENTRY_MESSAGES = 256
"""The most messages an entry holds: a produce request of more is stored in several."""
_ENTRY_BYTES = 1 << 20
"""The payload bytes past which an entry holds no further message (one larger message has an entry of its
own): a read of one position decodes its whole entry."""
_MIGRATE_BYTES = 32 << 20
"""The bytes of entries a rewrite of a log of schema 6 or older into entries holds before it inserts them (it
reads the old rows one at a time): what it needs in memory, whatever the size of the log and its messages."""


def topic_last_position(db: sqlite3.Connection, topic_id: int, table: str = "entries") -> int:
    """The last position of a topic (an entry's id, or a message's in the ``messages`` table of a log of
    schema 6 or older); 0 if it holds none. O(log n)."""
    base = topic_id << POSITION_BITS
    (row_id,) = db.execute(
        f"SELECT max(id) FROM {table} WHERE id > ? AND id <= ?", (base, base + MAX_POSITION)
    ).fetchone()
    return 0 if row_id is None else int(row_id) - base


def topic_first_position(db: sqlite3.Connection, topic_id: int) -> int:
    """The first position of a topic; 1 if it holds none. O(log n)."""
    base = topic_id << POSITION_BITS
    row = db.execute(
        "SELECT id, count FROM entries WHERE id > ? AND id <= ? ORDER BY id LIMIT 1", (base, base + MAX_POSITION)
    ).fetchone()
    return 1 if row is None else int(row[0]) - base - int(row[1]) + 1


def entry_pages(topic_id: int, last: int, chunk: int) -> tuple[int, int]:
    """How to read a topic's entries up to position ``last`` about ``chunk`` messages at a time: the highest id
    an entry holding ``last`` can have, and the entries a page holds. An entry holds ``_ENTRY_MESSAGES`` at
    most, so one holding ``last`` ends at most that many, less one, past it."""
    end = (topic_id << POSITION_BITS) + min(last + _ENTRY_MESSAGES - 1, MAX_POSITION)
    return end, max(chunk // _ENTRY_MESSAGES, 1)


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
                check_key(key)
        raise
    first_seq, last_seq = (None, None) if seqs is None else (min(seqs), max(seqs))
    return row_id, len(keys), producer, first_seq, last_seq, latest, data


_Columns = tuple[list[Key], list[bytes], list[int] | None, list[int | None] | None, list[bytes | None] | None]
"""An entry's data: its messages' keys, payloads, sequence ids, publish times and properties (None: no
sequence ids, the entry's publish time for all, no properties)."""


def entry_columns(last: int, count: int, data: bytes) -> _Columns:
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


def decode_entry(
    last: int, count: int, publish_time: int | None, data: bytes, producer: str | None = None
) -> list[StoredMessage]:
    """The messages of the entry whose last position is ``last``, in position order, each with the name of the
    entry's ``producer`` (None: unnamed)."""
    keys, payloads, _, times, properties = entry_columns(last, count, data)
    return list(
        map(
            stored_message,
            zip(
                range(last - count + 1, last + 1),
                keys,
                payloads,
                itertools.repeat(publish_time) if times is None else times,
                itertools.repeat(None) if properties is None else properties,
                itertools.repeat(producer),
                strict=False,
            ),
        )
    )


def rewrite_into_entries(db: sqlite3.Connection) -> None:
    """Move the messages of a log of schema 6 or older (a row per message) into entries, in the caller's
    transaction: a run of one topic and producer goes in entries as one append would store it."""
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


class Append:
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
        encoded = None if properties is None else check_properties(properties, len(messages))
        state = self._topic(topic)
        topic_id, last = state
        base = topic_id << POSITION_BITS
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
            seq, key, payload = check_message(message, index)
            if type(payload) is not bytes:
                payload = check_payload(payload, index)
            if key is not None and type(key) is not str and type(key) is not bytes:
                key = check_key(key)
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
        """``[id, last position]`` of topic ``name`` in this call, created on its first message."""
        state = self._topics.get(name)
        if state is None:
            db = self._db
            row = db.execute("SELECT id FROM topics WHERE name = ?", (name,)).fetchone()
            if row is not None:
                topic_id = int(row[0])
                state = [topic_id, topic_last_position(db, topic_id)]
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
        """``[id, highest sequence id]`` of producer ``name`` of a topic in this call, created on its first message."""
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
            seqs = entry_columns(last, count, data)[2]
            if seqs is None:
                raise LogFileError(f"the entry ending at position {last} has no sequence ids; its producer is named")
            index = bisect.bisect_left(seqs, seq)  # increasing within an entry
            if index < len(seqs) and seqs[index] == seq:
                return last - int(count) + 1 + index
            floor = int(last_seq) + 1  # a producer's entries have distinct last sequence ids
        return 0
