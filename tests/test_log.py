"""Log: round trips, positions, group commit, producer dedup, rollback, cursors, and real crash durability."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyfailover.broker.cursor import Cursor
from keyfailover.broker.storage import _executor as executor_module
from keyfailover.broker.storage import _sqlite_entries as entries_module
from keyfailover.broker.storage import sqlite as sqlite_module
from keyfailover.broker.storage._executor import SQLiteStore
from keyfailover.broker.storage._store import Batch, Result, StoreUnavailableError
from keyfailover.broker.storage.records import Key, SchemaRecord, StoredMessage, publish_clock
from keyfailover.broker.storage.sqlite import MAX_POSITION, SCHEMA_VERSION, Log, LogSnapshot
from keyfailover.core.errors import (
    InvalidKeyError,
    KeyFailoverError,
    LogError,
    LogFileError,
    PropertiesError,
    SequenceError,
)
from keyfailover.wire.properties import decode_properties, encode_properties
from tests.aio import run_async

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def log(tmp_path: Path) -> Iterator[Log]:
    with Log(tmp_path / "log.db") as opened:
        yield opened


def _contents(log: Log) -> dict[str, list[StoredMessage]]:
    return {topic: log.read(topic, 0, 1_000_000) for topic in log.topics()}


def _payloads(log: Log, topic: str) -> list[bytes]:
    return [message.payload for message in log.read(topic, 0, 1_000_000)]


def as_version_6(path: Path) -> None:
    """Rewrite the log at ``path`` as a server of schema 6 left it: a row per message, in the table and
    index of that schema (written out here as it was), every other table as it is."""
    with LogSnapshot(path) as snapshot:
        exported = {topic: list(snapshot.messages(topic)) for topic in snapshot.topics()}
    with sqlite3.connect(path) as db:
        db.execute(
            """CREATE TABLE messages (
                id INTEGER PRIMARY KEY, key BLOB, payload BLOB NOT NULL, producer INTEGER, seq INTEGER,
                publish_time INTEGER, properties BLOB
            )"""
        )
        db.execute("CREATE INDEX messages_by_producer_seq ON messages (producer, seq) WHERE producer IS NOT NULL")
        for topic, rows in exported.items():
            (topic_id,) = db.execute("SELECT id FROM topics WHERE name = ?", (topic,)).fetchone()
            producers = dict(db.execute("SELECT name, id FROM producers WHERE topic = ?", (topic_id,)))
            db.executemany(
                "INSERT INTO messages VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    ((topic_id << 40) + position, key, payload, producers.get(name), seq, at, properties)
                    for position, key, payload, name, seq, at, properties in rows
                ],
            )
        db.execute("DROP TABLE entries")
        db.execute("DROP TABLE schemas")
        db.execute("PRAGMA user_version = 6")
    db.close()


# -- keys, payloads, positions ---------------------------------------------------------

KEYS: list[Key] = [None, "", b"", "k", b"k", "ünïcödé 🎉", "a\x00b", b"\x00\xff\xfe", "x" * 10_000, bytes(range(256))]


def test_keys_of_every_kind_round_trip_with_their_type(log: Log) -> None:
    log.append([("t", None, [(None, key, b"p") for key in KEYS])])
    stored = log.read("t", 0, 100)
    assert [m.key for m in stored] == KEYS
    assert [type(m.key) for m in stored] == [type(key) for key in KEYS]


def test_payloads_of_every_size_round_trip(log: Log) -> None:
    payloads = [b"", b"\x00", bytes(range(256)), os.urandom(1 << 20), b"y" * 5000]
    log.append([("t", None, [(None, None, p) for p in payloads])])
    assert _payloads(log, "t") == payloads
    assert all(type(p) is bytes for p in _payloads(log, "t"))


def test_bytes_like_payloads_and_subclassed_keys_are_stored_as_plain_values(log: Log) -> None:
    class Text(str):
        pass

    class Blob(bytes):
        pass

    messages: list[Any] = [(None, Text("a"), bytearray(b"1")), (None, Blob(b"b"), memoryview(b"2"))]
    log.append([("t", None, messages)])
    stored = log.read("t", 0, 10)
    assert [(m.key, m.payload) for m in stored] == [("a", b"1"), (b"b", b"2")]
    assert [type(m.key) for m in stored] == [str, bytes]
    assert [type(m.payload) for m in stored] == [bytes, bytes]


@pytest.fixture(scope="module")
def shared_log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Log]:
    """One log for every example of a property test; each example writes a topic of its own."""
    with Log(tmp_path_factory.mktemp("log") / "log.db", synchronous="normal") as opened:
        yield opened


@settings(max_examples=100, deadline=None)
@given(
    st.uuids().map(str),
    # Up to 130 messages: past one and two of the INSERT statements of 50 rows, with rows left over.
    st.lists(st.tuples(st.none() | st.text() | st.binary(), st.binary(max_size=64)), min_size=1, max_size=130),
)
def test_any_keys_and_payloads_round_trip(shared_log: Log, topic: str, messages: list[tuple[Key, bytes]]) -> None:
    last = shared_log.last_position(topic)
    positions = range(last + 1, last + len(messages) + 1)
    appended = shared_log.append([(topic, None, [(None, k, p) for k, p in messages])], publish_time=last)
    assert appended == [[(p, False) for p in positions]]
    stored = shared_log.read(topic, last, 200)
    assert stored == [StoredMessage(p, k, v, last) for p, (k, v) in zip(positions, messages, strict=True)]
    assert [type(m.key) for m in stored] == [type(k) for k, _ in messages]


# -- properties ---------------------------------------------------------------------------

TRACE = encode_properties({"trace-id": "4bf92f35", "content-type": "application/json"})
EMPTY_KEY = encode_properties({"": "ünïcödé 🎉\x00"})


def test_properties_round_trip_beside_messages_without_them(log: Log) -> None:
    messages = [(None, "a", b"1"), (None, "b", b"2"), (None, None, b"3")]
    assert log.append([("t", None, messages, [TRACE, None, EMPTY_KEY])], publish_time=7) == [
        [(1, False), (2, False), (3, False)]
    ]
    log.append([("t", None, [(None, "c", b"4")])], publish_time=8)  # a batch without properties: three items
    expected = [
        StoredMessage(1, "a", b"1", 7, TRACE),
        StoredMessage(2, "b", b"2", 7, None),
        StoredMessage(3, None, b"3", 7, EMPTY_KEY),
        StoredMessage(4, "c", b"4", 8, None),
    ]
    assert log.read("t", 0, 10) == expected
    assert log.read_positions("t", [3, 1]) == {1: expected[0], 3: expected[2]}
    assert decode_properties(log.read("t", 0, 1)[0].properties) == {
        "trace-id": "4bf92f35",
        "content-type": "application/json",
    }
    with LogSnapshot(log.path) as snapshot:
        assert [row[6] for row in snapshot.messages("t")] == [TRACE, None, EMPTY_KEY, None]


@settings(max_examples=50, deadline=None)
@given(
    st.uuids().map(lambda uuid: f"properties-{uuid}"),
    st.lists(st.none() | st.dictionaries(st.text(max_size=20), st.text(max_size=40), max_size=5), max_size=120),
)
def test_any_properties_round_trip(shared_log: Log, topic: str, each: list[dict[str, str] | None]) -> None:
    encoded = [encode_properties(properties) for properties in each]
    last = shared_log.last_position(topic)
    shared_log.append([(topic, None, [(None, "k", b"x")] * len(each), encoded)], publish_time=1)
    stored = shared_log.read(topic, last, 200)
    assert [m.properties for m in stored] == encoded
    assert [decode_properties(m.properties) for m in stored] == [properties or {} for properties in each]


def test_a_batch_mixing_messages_with_and_without_properties_stores_each_as_sent(log: Log) -> None:
    """123 messages, every third with properties and every fifth without a key, in one entry: each comes back
    at its position as it was sent."""
    messages = [(None, f"k{i % 7}" if i % 5 else None, b"payload %d" % i) for i in range(123)]
    properties = [TRACE if i % 3 == 0 else None for i in range(123)]
    assert log.append([("t", None, messages, properties)], publish_time=5) == [[(p, False) for p in range(1, 124)]]
    assert log.read("t", 0, 200) == [
        StoredMessage(i + 1, key, payload, 5, properties[i]) for i, (_, key, payload) in enumerate(messages)
    ]


def test_a_duplicate_keeps_the_properties_it_was_stored_with(log: Log) -> None:
    log.append([("t", "p", [(1, "k", b"v")], [TRACE])])
    assert log.append([("t", "p", [(1, "k", b"v"), (2, "k", b"w")], [EMPTY_KEY, EMPTY_KEY])]) == [
        [(1, True), (2, False)]
    ]
    assert [m.properties for m in log.read("t", 0, 10)] == [TRACE, EMPTY_KEY]


@pytest.mark.parametrize(
    ("properties", "match"),
    [
        ([TRACE], r"a batch of 2 messages has properties for 1; expected one encoding or None per message"),
        ({"k": "v"}, r"a batch of 2 messages has properties for dict"),
        ([None, {"k": "v"}], r"message 1: encoded properties must be bytes, not dict"),
        ([None, b"\x80"], r"message 1: .*an empty map"),
        ([b"\x81\xa1k\x01", None], r"message 0: the value of property 'k' is int"),
    ],
)
def test_bad_properties_store_nothing(log: Log, properties: Any, match: str) -> None:
    log.append([("t", None, [(None, "k", b"0")])])
    batches: Any = [("other", None, [(None, "k", b"x")]), ("t", "p", [(1, "k", b"1"), (2, "k", b"2")], properties)]
    with pytest.raises(PropertiesError, match=match):
        log.append(batches)
    assert _contents(log) == {"t": log.read("t", 0, 1)} and log.last_position("t") == 1
    assert log.last_sequence("t", "p") == -1


def test_dead_letters_keep_their_properties_in_the_dead_letter_topic_and_when_replayed(log: Log) -> None:
    log.append([("t", None, [(None, "a", b"1"), (None, "b", b"2")], [TRACE, None])], publish_time=100)
    letters = [(1, "a", b"1", 2, "nack", 100, TRACE), (2, "b", b"2", 2, "nack", 100, None)]
    assert log.dead_letter("t", "s", letters) == [1, 2]
    assert [m.properties for m in log.read("t-s-DLQ", 0, 10)] == [TRACE, None]
    assert [r.properties for r in log.dead_letters("t", "s")] == [TRACE, None]
    assert log.replay_dead_letters("t", "s") == [
        StoredMessage(3, "a", b"1", 100, TRACE),
        StoredMessage(4, "b", b"2", 100, None),
    ]
    assert [m.properties for m in log.read("t", 2, 10)] == [TRACE, None]


def test_a_version_5_log_gains_properties_and_its_messages_have_none(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    with Log(path) as log:
        log.append([("t", "p", [(0, "a", b"1")])], publish_time=5)
        log.dead_letter("t", "s", [(1, "a", b"1", 0, "nack", 5, None)])
    as_version_6(path)
    with sqlite3.connect(path) as db:  # as version 5 left it: no properties column
        db.execute("ALTER TABLE messages DROP COLUMN properties")
        db.execute("PRAGMA user_version = 5")
    db.close()
    with LogSnapshot(path) as snapshot:  # an export reads it as it is, before any server migrated it
        assert list(snapshot.messages("t")) == [(1, "a", b"1", "p", 0, 5, None)]
    with Log(path) as log:
        assert log.read("t", 0, 10) == [StoredMessage(1, "a", b"1", 5, None, "p")]
        assert [r.properties for r in log.dead_letters("t", "s")] == [None]
        log.append([("t", "p", [(1, "b", b"2")], [TRACE])], publish_time=6)
        assert log.read("t", 1, 10) == [StoredMessage(2, "b", b"2", 6, TRACE, "p")]
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8
    db.close()
    with LogSnapshot(path) as snapshot:
        assert [row[6] for row in snapshot.messages("t")] == [None, TRACE]


def test_a_commit_caches_what_a_read_of_the_log_gives_and_tells_its_listeners(tmp_path: Path) -> None:
    """The entry cache takes each commit's new messages by column, properties and all, leaving out a batch's
    retries of stored messages: what it answers equals the log's own read; listeners hear each topic."""

    async def committed() -> tuple[list[str], list[StoredMessage] | None, list[tuple[int, bool]]]:
        store = SQLiteStore(Log(tmp_path / "log.db"))
        await store.start()
        heard: list[str] = []
        store.on_commit(heard.append)
        try:
            # Each answered within seconds, or the commit loop died (a failing test, not a hung one).
            await asyncio.wait_for(store.append("t", "p", [(1, "a", b"1"), (2, "b", b"2")], [None, TRACE]), 30)
            again = [(2, "b", b"2"), (3, "c", b"3"), (4, "d", b"4")]  # 2 stored already
            retried = await asyncio.wait_for(store.append("t", "p", again, [TRACE, None, TRACE]), 30)
            await asyncio.wait_for(store.append("u", None, [(None, "e", b"5")]), 30)
            return heard, store.entry_cache.read("t", 0, 10), retried
        finally:
            await store.close()

    heard, cached, retried = run_async(committed())
    assert retried == [(2, True), (3, False), (4, False)]
    assert heard == ["t", "t", "u"]
    with Log(tmp_path / "log.db") as log:
        assert cached is not None and cached == log.read("t", 0, 10)
    assert [(m.position, m.key, m.properties, m.producer) for m in cached] == [
        (1, "a", None, "p"),
        (2, "b", TRACE, "p"),
        (3, "c", None, "p"),
        (4, "d", TRACE, "p"),
    ]


def test_positions_are_consecutive_per_topic_across_calls(log: Log) -> None:
    assert log.append([("a", None, [(None, "k", b"a1"), (None, "k", b"a2")])]) == [[(1, False), (2, False)]]
    assert log.append([("b", None, [(None, "k", b"b1")])]) == [[(1, False)]]
    assert log.append([("a", None, [(None, "k", b"a3")])]) == [[(3, False)]]
    assert log.append([("b", None, [(None, "k", b"b2")]), ("a", None, [(None, "k", b"a4")])]) == [
        [(2, False)],
        [(4, False)],
    ]
    assert [m.position for m in log.read("a", 0, 10)] == [1, 2, 3, 4]
    assert _payloads(log, "a") == [b"a1", b"a2", b"a3", b"a4"]
    assert _payloads(log, "b") == [b"b1", b"b2"]
    assert (log.last_position("a"), log.last_position("b")) == (4, 2)
    assert log.topics() == ["a", "b"]


def test_group_commit_stores_several_batches_in_one_call(log: Log) -> None:
    results = log.append(
        [
            ("orders", "p1", [(0, "k1", b"o1"), (1, "k2", b"o2")]),
            ("payments", None, [(None, None, b"y1")]),
            ("orders", "p2", [(0, "k1", b"o3")]),
            ("orders", None, []),
            ("orders", None, [(None, b"k3", b"o4")]),
        ]
    )
    assert results == [[(1, False), (2, False)], [(1, False)], [(3, False)], [], [(4, False)]]
    assert _payloads(log, "orders") == [b"o1", b"o2", b"o3", b"o4"]
    assert _payloads(log, "payments") == [b"y1"]


def test_every_message_of_an_append_has_the_broker_clock_of_its_commit(log: Log) -> None:
    before = publish_clock()
    log.append([("a", "p", [(0, "k", b"1"), (1, "k", b"2")]), ("b", None, [(None, None, b"3")])])
    after = publish_clock()
    (first,) = {m.publish_time for topic in ("a", "b") for m in log.read(topic, 0, 10)}
    assert first is not None and before <= first <= after
    assert {m.publish_time for m in log.read_positions("a", [1, 2]).values()} == {first}
    log.append([("a", "p", [(1, "k", b"2"), (2, "k", b"4")])])  # a retry of seq 1, and a new message
    later = publish_clock()
    retried, new = log.read("a", 1, 10)
    assert retried.publish_time == first  # not stored again
    assert new.publish_time is not None and after <= new.publish_time <= later


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True])
def test_a_publish_time_must_be_microseconds_since_the_epoch(log: Log, bad: Any) -> None:
    with pytest.raises(LogError, match="a publish time must be an int of microseconds since the Unix epoch"):
        log.append([("t", None, [(None, "k", b"v")])], publish_time=bad)
    assert log.topics() == []


def test_an_empty_append_or_empty_batch_creates_nothing(log: Log) -> None:
    assert log.append([]) == []
    assert log.append([("t", "p", [])]) == [[]]
    assert log.topics() == []


# -- producer dedup --------------------------------------------------------------------


def test_a_retry_returns_the_original_positions_and_stores_nothing(log: Log) -> None:
    batch = [(10, "k", b"m10"), (11, "k", b"m11"), (12, "k", b"m12")]
    log.append([("other", None, [(None, None, b"x")]), ("t", None, [(None, None, b"first")])])
    assert log.append([("t", "p", batch)]) == [[(2, False), (3, False), (4, False)]]
    assert log.append([("t", "p", batch)]) == [[(2, True), (3, True), (4, True)]]
    assert log.last_position("t") == 4
    assert _payloads(log, "t") == [b"first", b"m10", b"m11", b"m12"]


def test_a_partially_duplicate_batch_stores_only_the_new_messages(log: Log) -> None:
    log.append([("t", "p", [(1, None, b"1"), (2, None, b"2"), (3, None, b"3")])])
    log.append([("t", None, [(None, None, b"anonymous")])])
    assert log.append([("t", "p", [(2, None, b"2"), (3, None, b"3"), (4, None, b"4"), (5, None, b"5")])]) == [
        [(2, True), (3, True), (5, False), (6, False)]
    ]
    assert _payloads(log, "t") == [b"1", b"2", b"3", b"anonymous", b"4", b"5"]


def test_the_same_sequence_id_twice_in_one_call_is_stored_once(log: Log) -> None:
    results = log.append(
        [
            ("t", "p", [(7, "k", b"seven"), (8, "k", b"eight")]),
            ("t", None, [(None, "k", b"anonymous")]),
            ("t", "p", [(8, "k", b"eight"), (9, "k", b"nine")]),
        ]
    )
    assert results == [[(1, False), (2, False)], [(3, False)], [(2, True), (4, False)]]
    assert _payloads(log, "t") == [b"seven", b"eight", b"anonymous", b"nine"]


def test_a_sequence_id_below_the_highest_never_stored_is_stored_late(log: Log) -> None:
    """Batches of one producer may come out of order (Pulsar's key-based batching sends each key's on its
    own): a seq below the highest is a duplicate only when it was stored, else it is stored now."""
    log.append([("t", "p", [(1, None, b"1"), (5, None, b"5")])])
    assert log.append([("t", "p", [(3, None, b"3"), (5, None, b"5"), (6, None, b"6")])]) == [
        [(3, False), (2, True), (4, False)]
    ]
    assert log.append([("t", "p", [(3, None, b"3"), (4, None, b"4")]), ("t", "p", [(2, None, b"2")])]) == [
        [(3, True), (5, False)],
        [(6, False)],
    ]
    assert _payloads(log, "t") == [b"1", b"5", b"3", b"6", b"4", b"2"]
    assert log.last_sequence("t", "p") == 6


def test_producers_are_per_topic_and_per_name(log: Log) -> None:
    message = [(1, None, b"m")]
    assert log.append([("a", "p", message), ("b", "p", message), ("a", "q", message), ("a", "p", message)]) == [
        [(1, False)],
        [(1, False)],
        [(2, False)],
        [(1, True)],
    ]


def test_a_message_is_read_back_with_its_producer_s_name_one_object_per_producer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads and reads by position give each message the name of the producer that stored it (None: unnamed, a
    dead letter, a replay), one name object per producer however many entries, also past the names kept."""
    with Log(tmp_path / "log.db") as log:
        log.append([("t", "billing", [(1, "a", b"1"), (2, "b", b"2")]), ("t", None, [(None, "c", b"3")])])
        log.append([("t", "billing", [(3, "a", b"4")]), ("t", "audit", [(1, "a", b"5")])])
        found = log.read("t", 0, 10)
        assert [m.producer for m in found] == ["billing", "billing", None, "billing", "audit"]
        assert found[0].producer is found[3].producer
        assert [m.producer for m in log.read_positions("t", [2, 3, 5]).values()] == ["billing", None, "audit"]
        assert log.dead_letter("t", "s", [(1, "a", b"1", 3, "nack", found[0].publish_time, None)]) == [1]
        assert [m.producer for m in log.replay_dead_letters("t", "s")] == [None]
        assert log.read("t", 5, 10)[0].producer is None
        assert log.read("t-s-DLQ", 0, 10)[0].producer is None
        monkeypatch.setattr(sqlite_module, "_PRODUCER_NAMES", 1)  # a log of more producers than names kept
    with Log(tmp_path / "log.db") as log:
        for _ in range(2):
            assert [m.producer for m in log.read("t", 0, 5)] == ["billing", "billing", None, "billing", "audit"]


def test_the_last_sequence_of_a_producer(log: Log) -> None:
    assert log.last_sequence("t", "p") == -1
    log.append([("t", "p", [(3, "a", b"1"), (7, "a", b"2")]), ("t", "p2", [(9, "b", b"3")])])
    log.append([("t", "q", [(9, None, b"4")]), ("u", "p", [(11, None, b"5")]), ("t", "p", [(5, "b", b"6")])])
    assert log.last_sequence("t", "p") == 7
    assert log.last_sequence("t", "q") == 9
    assert log.last_sequence("u", "p") == 11
    assert log.last_sequence("nowhere", "p") == -1


def test_dedup_state_survives_reopening(tmp_path: Path) -> None:
    with Log(tmp_path / "log.db") as log:
        log.append([("t", "p", [(100, None, b"a"), (101, None, b"b")])])
    with Log(tmp_path / "log.db") as log:
        assert log.append([("t", "p", [(101, None, b"b"), (102, None, b"c")])]) == [[(2, True), (3, False)]]


# -- rejected calls change nothing -----------------------------------------------------


def _seeded(log: Log) -> None:
    log.append([("t", "p", [(5, "k", b"five")]), ("u", None, [(None, None, b"u1")])])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([(7, None, b"7"), (6, None, b"6")], "sequence id 6 of producer 'p' follows 7 in the same batch"),
        ([(7, None, b"7"), (7, None, b"7")], "sequence id 7 of producer 'p' follows 7"),
        ([(6, None, b"6"), (None, None, b"x")], "has sequence id None; expected an int"),
        ([(-1, None, b"x")], "has sequence id -1"),
        ([(True, None, b"x")], "has sequence id True"),
        ([(1.0, None, b"x")], "has sequence id 1.0"),
        ([(2**63, None, b"x")], "has sequence id 9223372036854775808"),
    ],
)
def test_bad_sequence_ids_roll_the_whole_call_back(log: Log, messages: list[Any], match: str) -> None:
    _seeded(log)
    before = _contents(log)
    with pytest.raises(SequenceError, match=match):
        log.append([("u", None, [(None, None, b"u2")]), ("new", None, [(None, None, b"n")]), ("t", "p", messages)])
    assert _contents(log) == before
    assert log.topics() == ["t", "u"]
    # the producer's highest stored sequence id did not move either
    assert log.append([("t", "p", [(6, None, b"six")])]) == [[(2, False)]]


def test_a_sequence_id_without_a_producer_name_is_rejected(log: Log) -> None:
    with pytest.raises(SequenceError, match="message 0 has sequence id 3 but its batch has no producer name"):
        log.append([("t", None, [(3, None, b"x")])])
    assert log.topics() == []


@pytest.mark.parametrize(
    ("batches", "error", "match"),
    [
        ([("t", None)], LogError, "a batch must be a \\(topic, producer, messages\\[, properties\\]\\) tuple"),
        ([("", None, [])], LogError, "topic must be a non-empty str"),
        ([(b"t", None, [])], LogError, "topic must be a non-empty str"),
        ([("t\ud800", None, [])], LogError, "topic 't\\\\ud800' is not valid Unicode"),
        ([("t", "", [])], LogError, "producer name must be a non-empty str"),
        ([("t", 3, [])], LogError, "producer name must be a non-empty str"),
        ([("t", None, iter([]))], LogError, "messages of a batch must be a sequence"),
        ([("t", None, [(None, None)])], LogError, "message 0 must be a \\(seq, key, payload\\) tuple"),
        (
            [("t", None, [(None, None, b""), None])],
            LogError,
            "message 1 must be a \\(seq, key, payload\\) tuple, not None",
        ),
        ([("t", None, [(None, None, "text")])], LogError, "the payload of message 0 must be bytes, not str"),
        ([("t", "p", [(1, None, None)])], LogError, "payload of message 0 must be bytes, not NoneType"),
        ([("t", None, [(None, 42, b"x")])], InvalidKeyError, "key must be str, bytes or None, not int"),
        ([("t", None, [(None, bytearray(b"k"), b"x")])], InvalidKeyError, "not bytearray"),
        ([("t", None, [(None, "ok", b"x"), (None, "bad\ud800", b"x")])], InvalidKeyError, "not valid Unicode"),
    ],
)
def test_malformed_input_rolls_back_and_says_what_was_expected(
    log: Log, batches: Any, error: type[Exception], match: str
) -> None:
    _seeded(log)
    before = _contents(log)
    with pytest.raises(error, match=match):
        log.append([("t", None, [(None, None, b"first batch of the call")]), *batches])
    assert _contents(log) == before


@pytest.mark.parametrize("batches", [42, None, iter([("t", None, [(None, None, b"x")])])])
def test_batches_must_be_a_sequence(log: Log, batches: Any) -> None:
    with pytest.raises(LogError, match="batches must be a sequence of \\(topic, producer, messages\\)"):
        log.append(batches)
    assert log.topics() == []


def test_error_messages_stay_short_for_huge_arguments(log: Log) -> None:
    with pytest.raises(SequenceError) as raised:
        log.append([("t", "p", [(-1, "k" * 100_000, b"x" * 1_000_000)])])
    assert len(str(raised.value)) < 200
    with pytest.raises(LogError) as rejected:
        log.append([("t" * 100_000,)])  # type: ignore[list-item]
    assert len(str(rejected.value)) < 200


def test_a_topic_cannot_pass_its_last_position(tmp_path: Path) -> None:
    with Log(tmp_path / "log.db") as log:
        log.append([("t", None, [(None, None, b"first")])])
    with sqlite3.connect(tmp_path / "log.db") as db:
        (topic_id,) = db.execute("SELECT id FROM topics WHERE name = 't'").fetchone()
        entry = msgpack.packb([[None], [b"\x00"], None, None, None])
        last_but_one = (topic_id << 40) + MAX_POSITION - 1
        db.execute("INSERT INTO entries (id, count, data) VALUES (?, 1, ?)", (last_but_one, entry))
    db.close()
    with Log(tmp_path / "log.db") as log:
        assert log.append([("t", None, [(None, None, b"last")])]) == [[(MAX_POSITION, False)]]
        with pytest.raises(LogError, match=f"topic 't' would pass its last possible position {MAX_POSITION}"):
            log.append([("u", None, [(None, None, b"u")]), ("t", None, [(None, None, b"one too many")])])
        assert log.topics() == ["t"]
        assert log.last_position("t") == MAX_POSITION


def test_the_number_of_topics_is_bounded(tmp_path: Path) -> None:
    Log(tmp_path / "log.db").close()
    with sqlite3.connect(tmp_path / "log.db") as db:
        db.execute("INSERT INTO topics (id, name) VALUES (?, 'last')", ((1 << 23) - 1,))
    db.close()
    with Log(tmp_path / "log.db") as log:
        assert log.append([("last", None, [(None, None, b"x")])]) == [[(1, False)]]
        with pytest.raises(LogError, match="the log holds its maximum of 8388607 topics"):
            log.append([("one more", None, [(None, None, b"x")])])
        assert log.topics() == ["last"]


def test_log_errors_are_of_the_hierarchy_and_the_expected_builtin() -> None:
    assert issubclass(LogError, KeyFailoverError) and issubclass(LogError, ValueError)
    assert issubclass(SequenceError, LogError)
    assert issubclass(LogFileError, KeyFailoverError) and issubclass(LogFileError, OSError)


# -- reads -----------------------------------------------------------------------------


def test_read_returns_positions_after_up_to_limit(log: Log) -> None:
    log.append([("t", None, [(None, f"k{i}", b"%d" % i) for i in range(1, 11)])], publish_time=7)
    assert [m.position for m in log.read("t", 0, 3)] == [1, 2, 3]
    assert [m.position for m in log.read("t", 3, 3)] == [4, 5, 6]
    assert [m.position for m in log.read("t", 8, 100)] == [9, 10]
    assert log.read("t", 10, 100) == []
    assert log.read("t", 5, 0) == []
    assert log.read("t", MAX_POSITION, 10) == []
    assert log.read("t", 2**70, 10) == []
    assert log.read("t", 4, 1) == [StoredMessage(5, "k5", b"5", 7)]


def test_position_at_time_is_the_first_message_published_at_or_after_it(log: Log) -> None:
    for publish_time in (10, 20, 20, 30, 5):  # the last one is older: a replayed dead letter keeps its time
        log.append([("t", None, [(None, "k", b"%d" % publish_time)])], publish_time=publish_time)
    log.append([("u", None, [(None, "k", b"x")])], publish_time=99)
    assert [log.position_at_time("t", at) for at in (0, 5, 10, 11, 20, 21, 30)] == [1, 1, 1, 2, 2, 4, 4]
    assert log.position_at_time("t", 31) is None
    assert log.position_at_time("unknown", 0) is None
    with pytest.raises(LogError, match="publish time must be an int"):
        log.position_at_time("t", -1)
    # Within (after, through]: what a seek scans per call, chunk by chunk.
    assert [log.position_at_time("t", 0, after, after + 2) for after in (0, 2, 4)] == [1, 3, 5]
    assert log.position_at_time("t", 21, 0, 3) is None
    assert log.position_at_time("t", 21, 3, 5) == 4


def test_position_at_time_looks_inside_an_entry_from_where_a_call_begins(log: Log) -> None:
    """One entry of one publish time, and one (dead letters, which keep theirs) of a time per message, some
    unknown: a call that begins or ends inside an entry finds the first message in its bounds."""
    log.append([("t", None, [(None, "k", b"%d" % i) for i in range(5)])], publish_time=7)
    assert [log.position_at_time("t", 7, after) for after in range(6)] == [1, 2, 3, 4, 5, None]
    times = [30, 10, 20, None, 40]
    log.dead_letter("t", "s", [(i + 1, "k", b"x", 1, "nack", at, None) for i, at in enumerate(times)])
    dlq = "t-s-DLQ"
    assert [log.position_at_time(dlq, 15, after) for after in range(6)] == [1, 3, 3, 5, 5, None]
    assert log.position_at_time(dlq, 35) == 5 and log.position_at_time(dlq, 41) is None
    assert log.position_at_time(dlq, 15, 1, 2) is None and log.position_at_time(dlq, 0, 3, 4) is None


def test_a_seek_by_time_over_the_embedded_log_finds_the_same_position_chunk_by_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(executor_module, "SEEK_CHUNK", 3)
    written = Log(tmp_path / "log.db")
    for publish_time in (10, 20, 20, 30, 5, 40, 50):
        written.append([("t", None, [(None, "k", b"x")])], publish_time=publish_time)
    written.close()

    async def found() -> list[int | None]:
        store = SQLiteStore(Log(tmp_path / "log.db"))
        await store.start()
        try:
            return [await store.position_at_time("t", at) for at in (0, 11, 21, 31, 41, 50, 51)]
        finally:
            await store.close()

    assert run_async(found()) == [1, 2, 4, 6, 7, 7, None]


def test_topics_never_see_each_others_messages(log: Log) -> None:
    log.append(
        [("a", None, [(None, None, b"a")]), ("b", None, [(None, None, b"b1"), (None, None, b"b2")])], publish_time=3
    )
    assert _payloads(log, "a") == [b"a"]
    assert log.read_positions("a", [1, 2]) == {1: StoredMessage(1, None, b"a", 3)}


def test_read_positions_returns_the_stored_ones(log: Log) -> None:
    log.append([("t", None, [(None, b"k%d" % i, b"%d" % i) for i in range(1, 1201)])], publish_time=0)
    wanted = [1200, 3, 3, 700, 1, 0, -5, 5000, MAX_POSITION + 1]
    expected = {p: StoredMessage(p, b"k%d" % p, b"%d" % p, 0) for p in (1, 3, 700, 1200)}
    assert log.read_positions("t", wanted) == expected
    every = log.read_positions("t", range(1, 1300))  # more than one query's worth
    assert sorted(every) == list(range(1, 1201))
    assert every[999].payload == b"999"
    assert log.read_positions("t", []) == {}


def test_unknown_topics_are_empty(log: Log) -> None:
    assert log.read("nope", 0, 10) == []
    assert log.read_positions("nope", [1]) == {}
    assert log.last_position("nope") == 0
    assert log.first_position("nope") == 1
    assert log.subscriptions("nope") == []
    assert log.load_cursor("nope", "s") == Cursor()
    assert log.topics() == []


def test_first_and_last_position(log: Log) -> None:
    log.append([("t", None, [(None, None, b"x")] * 3)])
    assert (log.first_position("t"), log.last_position("t")) == (1, 3)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda log: log.read("t", -1, 10), "after must be a non-negative int"),
        (lambda log: log.read("t", 0, -1), "limit must be a non-negative int"),
        (lambda log: log.read("t", 0, 2.5), "limit must be a non-negative int"),
        (lambda log: log.read("", 0, 1), "topic must be a non-empty str"),
        (lambda log: log.read_positions("t", [1, "2"]), "a position must be an int"),
        (lambda log: log.read_positions("t", 5), "positions must be iterable"),
        (lambda log: log.last_position(None), "topic must be a non-empty str"),
        (lambda log: log.first_position(7), "topic must be a non-empty str"),
        (lambda log: log.subscriptions(""), "topic must be a non-empty str"),
        (lambda log: log.load_cursor("t", ""), "subscription must be a non-empty str"),
        (lambda log: log.delete_subscription("t", None), "subscription must be a non-empty str"),
        (lambda log: log.save_cursors(3), "cursors must be iterable"),
        (lambda log: log.save_cursors([("t", "s")]), "a cursor entry must be a \\(topic, subscription, Cursor\\)"),
        (lambda log: log.save_cursors([("t", "s", 5)]), "the cursor of 's' on topic 't' must be a Cursor, not int"),
        (lambda log: log.save_cursors([("t", "s", Cursor(1)), ("", "s", Cursor())]), "topic must be"),
    ],
)
def test_bad_arguments_raise_log_errors_and_change_nothing(log: Log, call: Any, match: str) -> None:
    _seeded(log)
    before = (_contents(log), log.subscriptions("t"))
    with pytest.raises(LogError, match=match):
        call(log)
    assert (_contents(log), log.subscriptions("t")) == before


# -- cursors ---------------------------------------------------------------------------


def test_a_new_subscription_starts_at_zero_and_is_stored_on_save(log: Log) -> None:
    cursor = log.load_cursor("t", "s")
    assert cursor == Cursor()
    assert log.subscriptions("t") == []
    cursor.ack(1)
    log.save_cursors([("t", "s", cursor)])
    assert log.subscriptions("t") == ["s"]
    assert log.load_cursor("t", "s") == Cursor(1)


def test_save_cursors_stores_many_and_overwrites(log: Log) -> None:
    log.save_cursors([("t", "b", Cursor(2, [5])), ("t", "a", Cursor()), ("u", "a", Cursor(9))])
    log.save_cursors([("t", "b", Cursor(3, [7, 8]))])
    assert log.subscriptions("t") == ["a", "b"]
    assert log.subscriptions("u") == ["a"]
    assert log.load_cursor("t", "b") == Cursor(3, [7, 8])
    assert log.load_cursor("u", "a") == Cursor(9)
    assert log.has_cursor("t", "a") and not log.has_cursor("u", "b")  # a saved cursor at 0 is one
    assert log.delete_cursor("t", "b") is True
    assert log.delete_cursor("t", "b") is False
    assert not log.has_cursor("t", "b") and log.load_cursor("t", "b") == Cursor()


def test_delete_subscription(log: Log) -> None:
    log.save_cursors([("t", "a", Cursor(4)), ("t", "b", Cursor(5))])
    assert log.delete_subscription("t", "a") is True
    assert log.delete_subscription("t", "a") is False
    assert log.subscriptions("t") == ["b"]
    assert log.load_cursor("t", "a") == Cursor()


def test_an_unreadable_stored_cursor_is_a_file_error(tmp_path: Path) -> None:
    with Log(tmp_path / "log.db") as log:
        log.save_cursors([("t", "s", Cursor(3))])
    with sqlite3.connect(tmp_path / "log.db") as db:
        db.execute("UPDATE cursors SET state = x'09'")
    db.close()
    with (
        Log(tmp_path / "log.db") as log,
        pytest.raises(LogFileError, match="the cursor of 's' on topic 't' is unreadable"),
    ):
        log.load_cursor("t", "s")


# -- the file --------------------------------------------------------------------------


def test_everything_survives_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    with Log(path, synchronous="normal") as log:
        log.append([("t", "p", [(1, "k", b"a"), (2, None, b"b")]), ("u", None, [(None, b"x", b"c")])])
        log.save_cursors([("t", "s", Cursor(1, [3]))])
        before = (_contents(log), log.topics(), log.subscriptions("t"), log.last_position("t"))
    with Log(str(path)) as log:
        assert (_contents(log), log.topics(), log.subscriptions("t"), log.last_position("t")) == before
        assert log.load_cursor("t", "s") == Cursor(1, [3])
        assert log.append([("t", None, [(None, None, b"d")])]) == [[(3, False)]]


def test_the_file_is_in_wal_mode_with_a_schema_version(tmp_path: Path) -> None:
    Log(tmp_path / "log.db").close()
    db = sqlite3.connect(tmp_path / "log.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    db.close()


def test_a_topic_s_schema_versions_are_added_in_order_and_read_back(tmp_path: Path) -> None:
    first = SchemaRecord(0, 4, "User", b'{"type": "string"}', (("a", "1"), ("b", "2")))
    second = SchemaRecord(1, 4, "User", b'{"type": "long"}')
    with Log(tmp_path / "log.db") as log:
        assert log.schemas("t") == []
        assert not log.add_schema("t", second)  # not the next version: nothing is stored
        assert log.add_schema("t", first)
        assert not log.add_schema("t", first._replace(name="other"))  # version 0 exists already
        assert log.add_schema("t", second)
        with pytest.raises(LogError, match="version must be an int of 0 or more"):
            log.add_schema("t", second._replace(version=-1))
        with pytest.raises(LogError, match="name must hold no NUL"):
            log.add_schema("t", second._replace(name="a\x00b"))
    with Log(tmp_path / "log.db") as log:  # the versions survive a restart
        assert log.schemas("t") == [first, second]
        assert log.schemas("t-partition-0") == []


def test_a_version_7_log_gains_the_schemas_table_and_keeps_its_messages(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    with Log(path) as log:
        log.append([("t", "p", [(0, "a", b"1")])], publish_time=5)
    with sqlite3.connect(path) as db:  # as version 7 left it: no schemas
        db.execute("DROP TABLE schemas")
        db.execute("PRAGMA user_version = 7")
    db.close()
    with Log(path) as log:
        assert log.read("t", 0, 10) == [StoredMessage(1, "a", b"1", 5, None, "p")]
        assert log.schemas("t") == []
        assert log.add_schema("t", SchemaRecord(0, 1, "s", b""))
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8
    db.close()


def test_stats(log: Log) -> None:
    log.append([("t", None, [(None, None, b"x" * 100)] * 5), ("u", None, [(None, None, b"y")])])
    stats = log.stats()
    assert stats["path"] == str(log.path)
    assert stats["topics"] == {
        "t": {"messages": 5, "first_position": 1, "last_position": 5},
        "u": {"messages": 1, "first_position": 1, "last_position": 1},
    }
    assert stats["file_bytes"] >= 500


def test_a_missing_folder_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(LogFileError, match="does not exist; create it first"):
        Log(tmp_path / "missing" / "log.db")
    assert not (tmp_path / "missing").exists()


def test_a_file_that_is_not_a_database_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    path.write_bytes(b"this is not an SQLite file" * 100)
    with pytest.raises(LogFileError, match="is not a keyfailover log"):
        Log(path)


def test_a_foreign_sqlite_database_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE people (name TEXT)")
    db.close()
    with pytest.raises(LogFileError, match="is an SQLite database but not a keyfailover log"):
        Log(path)


def test_a_newer_schema_version_is_an_error(tmp_path: Path) -> None:
    Log(tmp_path / "log.db").close()
    with sqlite3.connect(tmp_path / "log.db") as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(LogFileError, match=f"has schema version {SCHEMA_VERSION + 1}, newer than"):
        Log(tmp_path / "log.db")


def test_a_closed_log_refuses_calls(tmp_path: Path) -> None:
    log = Log(tmp_path / "log.db")
    log.close()
    log.close()
    with pytest.raises(LogFileError, match="is closed"):
        log.read("t", 0, 1)
    with pytest.raises(LogFileError, match="is closed"):
        log.append([("t", None, [(None, None, b"x")])])


def test_synchronous_must_be_full_or_normal(tmp_path: Path) -> None:
    with pytest.raises(LogError, match="synchronous must be 'full' or 'normal', not 'off'"):
        Log(tmp_path / "log.db", synchronous="off")  # type: ignore[arg-type]


# -- crash durability: a real process, killed ------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys
    from keyfailover.broker.storage.sqlite import Log

    log = Log(sys.argv[1], synchronous=sys.argv[2])
    seq = 0
    while True:
        batch = []
        for _ in range(50):
            seq += 1
            batch.append((seq, "key-%d" % (seq % 7), b"payload-%d" % seq))
        [result] = log.append([("crash", "writer", batch)])
        print(result[-1][0], flush=True)
    """
)


@pytest.mark.integration
@pytest.mark.parametrize("synchronous", ["full", "normal"])
def test_every_acknowledged_append_survives_sigkill(tmp_path: Path, synchronous: str) -> None:
    path = tmp_path / "log.db"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), synchronous],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert writer.stdout is not None
    printed: list[int] = []
    try:
        while len(printed) < 40:
            line = writer.stdout.readline()
            assert line, f"the writer stopped: {writer.communicate()[1].decode()}"
            printed.append(int(line))
        os.kill(writer.pid, signal.SIGKILL)
        # The lines it printed before it died: read through the same buffered reader as the first ones
        # (communicate() reads the pipe beneath it and would skip the lines that reader already holds).
        rest = writer.stdout.read()
        writer.wait()
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert writer.returncode == -signal.SIGKILL
    printed += [int(line) for line in rest.split()]
    with Log(path) as log:
        last = log.last_position("crash")
        assert last >= printed[-1]
        assert last % 50 == 0  # a transaction is all or nothing
        stored = log.read("crash", 0, last)
        assert [m.position for m in stored] == list(range(1, last + 1))
        assert all(m.payload == b"payload-%d" % m.position for m in stored)
        assert all(m.key == f"key-{m.position % 7}" for m in stored)
        assert printed == list(range(50, printed[-1] + 1, 50))
        # the writer's producer state survived too: a retry of its last batch is a duplicate
        retry = [(seq, None, b"payload-%d" % seq) for seq in range(last - 49, last + 1)]
        assert log.append([("crash", "writer", retry)]) == [[(p, True) for p in range(last - 49, last + 1)]]


def test_dead_letters_are_stored_with_where_they_came_from_and_replayed_once(log: Log) -> None:
    messages: list[tuple[int | None, Key, bytes]] = [(None, "a", b"1"), (None, b"b", b"2"), (None, None, b"3")]
    log.append([("t", None, messages)], publish_time=100)
    assert log.dead_letters("t", "s") == []
    letters = [(1, "a", b"1", 2, "nack", 100, None), (3, None, b"3", 0, "ack timeout", None, None)]
    assert log.dead_letter("t", "s", letters) == [1, 2]
    # each keeps the publish time of the message it was (None: unknown, as for a message of an old log)
    assert log.read("t-s-DLQ", 0, 10) == [StoredMessage(1, "a", b"1", 100), StoredMessage(2, None, b"3", None)]
    records = log.dead_letters("t", "s")
    found = [
        (r.dlq_position, r.position, r.key, r.payload, r.redelivery_count, r.reason, r.replayed_at, r.publish_time)
        for r in records
    ]
    assert found == [(1, 1, "a", b"1", 2, "nack", None, 100), (2, 3, None, b"3", 0, "ack timeout", None, None)]
    assert log.dead_letters("t", "s", limit=1) == records[:1]
    assert log.dead_letters("t", "other") == []
    replayed = [StoredMessage(4, "a", b"1", 100), StoredMessage(5, None, b"3", None)]
    assert log.replay_dead_letters("t", "s") == replayed
    assert log.read("t", 3, 10) == replayed
    assert [r.replayed_at for r in log.dead_letters("t", "s")] == [4, 5]
    assert log.replay_dead_letters("t", "s") == []
    log.dead_letter("t", "s", [(2, b"b", b"2", 1, "consumer removed", 100, None)])
    assert log.replay_dead_letters("t", "s") == [StoredMessage(6, b"b", b"2", 100)]


@pytest.mark.parametrize(
    ("letter", "message"),
    [
        (
            (1, "a", b"1", 2, "nack", None),
            "must be a \\(position, key, payload, redelivery_count, reason, publish_time, ",
        ),
        (("1", "a", b"1", 2, "nack", None, None), "a position must be an int"),
        ((1, 7, b"1", 2, "nack", None, None), "a message key must be str, bytes or None"),
        ((1, "a", "text", 2, "nack", None, None), "payload"),
        ((1, "a", b"1", -1, "nack", None, None), "redelivery_count must be a non-negative int"),
        ((1, "a", b"1", 2, "", None, None), "reason must be a non-empty str"),
        ((1, "a", b"1", 2, "nack", -5, None), "a publish time must be an int of microseconds"),
        ((1, "a", b"1", 2, "nack", None, b"\x80"), "an empty map"),
        ((1, "a", b"1", 2, "nack", None, {"k": "v"}), "encoded properties must be bytes, not dict"),
    ],
)
def test_a_bad_dead_letter_stores_nothing(log: Log, letter: object, message: str) -> None:
    log.append([("t", None, [(None, "a", b"1")])])
    with pytest.raises(KeyFailoverError, match=message):
        log.dead_letter("t", "s", [(1, "a", b"1", 0, "nack", None, None), letter])  # type: ignore[list-item]
    assert log.dead_letters("t", "s") == [] and log.read("t-s-DLQ", 0, 10) == []


def test_a_version_1_log_gains_the_dead_letter_table_and_keeps_everything(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    with Log(path) as log:
        log.append([("t", None, [(None, "a", b"1")])])
        log.save_cursors([("t", "s", Cursor(1, []))])
    as_version_6(path)
    with sqlite3.connect(path) as db:  # as version 1 left it: no dead letters, no subscription settings
        db.execute("ALTER TABLE messages DROP COLUMN properties")
        db.execute("ALTER TABLE messages DROP COLUMN publish_time")
        db.execute("DROP TABLE dead_letters")
        db.execute("DROP TABLE subscription_settings")
        db.execute("DROP TABLE delivery_settings")
        db.execute("DROP TABLE partitioned_topics")
        db.execute("PRAGMA user_version = 1")
    db.close()
    with Log(path) as log:
        assert log.read("t", 0, 10) == [StoredMessage(1, "a", b"1", None)]
        assert log.load_cursor("t", "s") == Cursor(1, [])
        assert log.dead_letter("t", "s", [(1, "a", b"1", 0, "nack", None, None)]) == [1]
        assert log.load_consume_mode("t", "s") is None
        log.save_consume_mode("t", "s", "unordered")
        assert log.load_consume_mode("t", "s") == "unordered"
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8
    db.close()


def test_a_version_2_log_gains_the_delivery_settings_table_and_keeps_its_consume_modes(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    with Log(path) as log:
        log.save_consume_mode("t", "s", "unordered")
    as_version_6(path)
    with sqlite3.connect(path) as db:  # as version 2 left it: no per-subscription delivery settings
        db.execute("ALTER TABLE messages DROP COLUMN properties")
        db.execute("ALTER TABLE messages DROP COLUMN publish_time")
        db.execute("DROP TABLE delivery_settings")
        db.execute("DROP TABLE partitioned_topics")
        db.execute("PRAGMA user_version = 2")
    db.close()
    with Log(path) as log:
        assert log.load_consume_mode("t", "s") == "unordered"
        assert log.load_delivery_settings("t", "s") == {}
        log.save_delivery_settings("t", "s", {"ack_timeout": 5.0})
        assert log.load_delivery_settings("t", "s") == {"ack_timeout": 5.0}
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    db.close()


def test_a_version_3_log_gains_partitioned_topics_and_keeps_its_settings(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    with Log(path) as log:
        log.save_delivery_settings("t", "s", {"ack_timeout": 5.0})
    as_version_6(path)
    with sqlite3.connect(path) as db:  # as version 3 left it: no partitioned topics
        db.execute("ALTER TABLE messages DROP COLUMN properties")
        db.execute("ALTER TABLE messages DROP COLUMN publish_time")
        db.execute("DROP TABLE partitioned_topics")
        db.execute("PRAGMA user_version = 3")
    db.close()
    with Log(path) as log:
        assert log.load_delivery_settings("t", "s") == {"ack_timeout": 5.0}
        assert log.partition_counts() == {}
        assert log.create_partitioned_topic("orders", 4)
        assert log.partition_counts() == {"orders": 4}
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    db.close()


def test_a_version_4_log_gains_publish_times_and_keeps_its_messages_with_unknown_ones(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    with Log(path) as log:
        messages: list[tuple[int | None, Key, bytes]] = [(0, "a", b"1"), (1, b"b", b"2")]
        log.append([("t", "p", messages)])
        log.create_partitioned_topic("orders", 2)
    as_version_6(path)
    with sqlite3.connect(path) as db:  # as version 4 left it: messages without a publish time
        db.execute("ALTER TABLE messages DROP COLUMN properties")
        db.execute("ALTER TABLE messages DROP COLUMN publish_time")
        db.execute("PRAGMA user_version = 4")
    db.close()
    with LogSnapshot(path) as snapshot:  # an export reads it as it is, before any server migrated it
        assert list(snapshot.messages("t")) == [(1, "a", b"1", "p", 0, None, None), (2, b"b", b"2", "p", 1, None, None)]
    with Log(path) as log:
        assert log.read("t", 0, 10) == [
            StoredMessage(1, "a", b"1", None, None, "p"),
            StoredMessage(2, b"b", b"2", None, None, "p"),
        ]
        assert log.append([("t", "p", [(1, b"b", b"2"), (2, None, b"3")])]) == [[(2, True), (3, False)]]
        before = publish_clock()
        log.append([("t", None, [(None, None, b"4")])])
        (newest,) = log.read("t", 3, 10)
        assert newest.publish_time is not None and before <= newest.publish_time <= publish_clock()
        assert log.dead_letter("t", "s", [(1, "a", b"1", 0, "nack", None, None)]) == [1]
        assert [r.publish_time for r in log.dead_letters("t", "s")] == [None]
        assert log.partition_counts() == {"orders": 2}
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8
    db.close()


def test_partitioned_topics_are_created_once_with_a_fixed_count(tmp_path: Path) -> None:
    with Log(tmp_path / "log.db") as log:
        assert log.create_partitioned_topic("orders", 8) is True
        assert log.create_partitioned_topic("orders", 8) is False  # the same again: nothing to do
        with pytest.raises(LogError, match=r"exists with 8 partitions; .* cannot be created again with 3"):
            log.create_partitioned_topic("orders", 3)
        log.append([("plain", None, [(None, "a", b"1")])])
        with pytest.raises(LogError, match="already holds messages as a topic of one partition"):
            log.create_partitioned_topic("plain", 2)
        assert log.create_partitioned_topic("plain", 1) is True  # one partition: the topic as it is
        for bad in (0, 65537, "2", True):
            with pytest.raises(LogError, match="partition count must be an int from 1 to 65536"):
                log.create_partitioned_topic("other", bad)  # type: ignore[arg-type]
        with pytest.raises(LogError, match="names a partition"):
            log.create_partitioned_topic("orders-partition-3", 2)
        assert log.partition_counts() == {"orders": 8, "plain": 1}


def test_delivery_settings_are_saved_per_subscription_replaced_and_forgotten(tmp_path: Path) -> None:
    with Log(tmp_path / "log.db") as log:
        log.save_delivery_settings("t", "s", {"ack_timeout": 5.0, "max_redeliveries": None})
        log.save_delivery_settings("t", "other", {"nack_backoff": 1, "nack_backoff_max": 8.0})
        assert log.load_delivery_settings("t", "s") == {"ack_timeout": 5.0, "max_redeliveries": None}
        log.save_delivery_settings("t", "s", {"max_redeliveries": 3})  # replaces, does not merge
        assert log.load_delivery_settings("t", "s") == {"max_redeliveries": 3}
        assert log.load_delivery_settings("t", "other") == {"nack_backoff": 1, "nack_backoff_max": 8.0}
        log.save_delivery_settings("t", "other", {})
        assert log.load_delivery_settings("t", "other") == {}
        log.save_cursors([("t", "s", Cursor(0, []))])
        log.delete_subscription("t", "s")
        assert log.load_delivery_settings("t", "s") == {}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"ack_timout": 5.0}, "unknown delivery setting 'ack_timout'; expected one of"),
        ({"ack_timeout": "5"}, "delivery setting ack_timeout must be a finite number or None"),
        ({"ack_timeout": float("inf")}, "must be a finite number or None"),
        ({"max_redeliveries": True}, "must be a finite number or None"),
        ([("ack_timeout", 5.0)], "delivery settings must be a mapping"),
    ],
)
def test_bad_delivery_settings_are_refused_and_change_nothing(tmp_path: Path, settings: object, message: str) -> None:
    with Log(tmp_path / "log.db") as log:
        log.save_delivery_settings("t", "s", {"ack_timeout": 1.0})
        with pytest.raises(LogError, match=message):
            log.save_delivery_settings("t", "s", settings)  # type: ignore[arg-type]
        assert log.load_delivery_settings("t", "s") == {"ack_timeout": 1.0}


# -- entries -----------------------------------------------------------------------------


def _entries(path: Path) -> list[tuple[int, int]]:
    """``(last position, count)`` of every entry in the log file at ``path``."""
    with sqlite3.connect(path) as db:
        rows = [(row_id & MAX_POSITION, count) for row_id, count in db.execute("SELECT id, count FROM entries")]
    db.close()
    return rows


def test_a_large_batch_is_stored_in_entries_of_at_most_entry_messages(tmp_path: Path) -> None:
    most = entries_module._ENTRY_MESSAGES
    assert 256 <= most < 1000
    with Log(tmp_path / "log.db") as log:
        log.append([("t", "p", [(seq, f"k{seq}", b"%d" % seq) for seq in range(2500)])], publish_time=9)
        log.append([("t", None, [(None, "k", b"one")])], publish_time=10)
        ends = [*range(most, 2500, most), 2500]
        assert _entries(tmp_path / "log.db") == [
            *((end, end - start) for start, end in zip([0, *ends], ends, strict=False)),
            (2501, 1),
        ]
        assert log.read("t", 990, 20) == [
            StoredMessage(p, f"k{p - 1}", b"%d" % (p - 1), 9, None, "p") for p in range(991, 1011)
        ]
        assert log.read_positions("t", [1000, 1001, 2501]) == {
            1000: StoredMessage(1000, "k999", b"999", 9, None, "p"),
            1001: StoredMessage(1001, "k1000", b"1000", 9, None, "p"),
            2501: StoredMessage(2501, "k", b"one", 10),
        }
        assert log.append([("t", "p", [(1999, "k1999", b"1999"), (2500, "new", b"new")])]) == [
            [(2000, True), (2502, False)]
        ]
        assert log.last_sequence("t", "p") == 2500
        assert log.position_at_time("t", 10) == 2501
        assert log.stats()["topics"]["t"] == {"messages": 2502, "first_position": 1, "last_position": 2502}


def test_large_payloads_cut_entries_at_a_mebibyte_and_a_larger_one_has_its_own(tmp_path: Path) -> None:
    big = [os.urandom(300_000) for _ in range(7)]
    huge = os.urandom(3 << 20)
    with Log(tmp_path / "log.db") as log:
        log.append([("t", None, [(None, "k", payload) for payload in [*big[:4], huge, *big[4:]]])])
        assert _entries(tmp_path / "log.db") == [(3, 3), (4, 1), (5, 1), (8, 3)]
        assert [m.payload for m in log.read("t", 0, 10)] == [*big[:4], huge, *big[4:]]
        assert log.read_positions("t", [5])[5].payload == huge


def test_reads_cross_entry_boundaries_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With entries of three messages, every read of every start and limit, and every set of single positions,
    gives what a row per message would."""
    monkeypatch.setattr(entries_module, "_ENTRY_MESSAGES", 3)
    with Log(tmp_path / "log.db") as log:
        for size in (1, 5, 2, 7, 3):
            last = log.last_position("t")
            log.append([("t", None, [(None, f"k{last + i}", b"%d" % (last + i)) for i in range(1, size + 1)])], 1)
        every = [StoredMessage(p, f"k{p}", b"%d" % p, 1) for p in range(1, 19)]
        assert [count for _, count in _entries(tmp_path / "log.db")] == [1, 3, 2, 2, 3, 3, 1, 3]
        for after in range(20):
            for limit in range(20):
                assert log.read("t", after, limit) == every[after : after + limit], (after, limit)
        for first in range(1, 19):
            wanted = range(first, 19, 4)
            assert log.read_positions("t", wanted) == {p: every[p - 1] for p in wanted}


def test_an_export_begun_before_an_upgrade_reads_on_in_entries(tmp_path: Path) -> None:
    """A server upgrades a log of a row per message while an export reads it: the export goes on in entries,
    from where it was, and stops at its snapshot's last message though the upgrade put it in one entry with
    messages an older server stored after the snapshot began."""
    path = tmp_path / "log.db"
    with Log(path) as log:
        log.append([("t", "p", [(seq, f"k{seq}", b"%d" % seq) for seq in range(1, 11)])], publish_time=5)
    as_version_6(path)
    with LogSnapshot(path) as snapshot:
        exported = list(snapshot.messages("t"))
        rows = snapshot.messages("t", chunk=3)
        begun = [next(rows) for _ in range(4)]
        with sqlite3.connect(path) as db:  # an older server stores the producer's next batch
            (topic_id, producer_id) = db.execute("SELECT topic, id FROM producers WHERE name = 'p'").fetchone()
            db.executemany(
                "INSERT INTO messages VALUES (?, ?, ?, ?, ?, ?, NULL)",
                [((topic_id << 40) + seq, f"k{seq}", b"%d" % seq, producer_id, seq, 6) for seq in range(11, 21)],
            )
        db.close()
        Log(path).close()  # a server of this version starts on the folder: schema 6 -> 7
        assert _entries(path) == [(20, 20)]  # one producer, increasing sequence ids: one entry
        assert begun + list(rows) == exported
    assert [row[0] for row in exported] == list(range(1, 11))


def test_a_migration_inserts_as_it_goes_and_cuts_entries_by_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rewrite into entries holds about _MIGRATE_BYTES of them at a time, whatever the log's size, and
    cuts a producer's run of large messages into entries of at most _ENTRY_BYTES of payload, as appends do."""
    monkeypatch.setattr(entries_module, "_ENTRY_BYTES", 20_000)
    monkeypatch.setattr(entries_module, "_MIGRATE_BYTES", 50_000)
    path = tmp_path / "log.db"
    payloads = [os.urandom(3000) for _ in range(60)]
    with Log(path) as log:
        for start in range(0, 60, 4):  # batches of 4 of one producer: the migration joins them into runs
            log.append([("t", "p", [(seq, "k", payloads[seq]) for seq in range(start, start + 4)])])
        log.append([("u", None, [(None, "k", b"u")])])
        before = {topic: log.read(topic, 0, 100) for topic in log.topics()}
    as_version_6(path)
    inserted: list[int] = []
    insert = entries_module._insert_entries

    def counting(db: sqlite3.Connection, entries: list[Any]) -> None:
        inserted.append(sum(len(entry[-1]) for entry in entries))
        insert(db, entries)

    monkeypatch.setattr(entries_module, "_insert_entries", counting)
    with Log(path) as log:
        assert {topic: log.read(topic, 0, 100) for topic in log.topics()} == before
    assert [count for _, count in _entries(path)] == [*[6] * 10, 1]  # 6 x 3000 bytes <= 20,000; then topic u
    assert len(inserted) >= 3 and max(inserted) < 50_000 + 20_000  # the bound, and one entry past it


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"\xc1", "is unreadable"),  # not msgpack
        (msgpack.packb([1, [b"x"], None, None, None]), "is unreadable"),  # a column not a list
        (msgpack.packb([["k"], [b"x"], 5, None, None]), "is unreadable"),
        (msgpack.packb([["k"], [b"x"], None, None]), "is unreadable"),  # four columns
        (msgpack.packb([["k", "l"], [b"x"], None, None, None]), "does not hold the 1 messages"),
        (msgpack.packb([["k"], [b"x"], None, None, None]), "has no sequence ids; its producer is named"),
    ],
)
def test_a_corrupt_entry_is_a_log_file_error_for_every_reader(tmp_path: Path, data: bytes, problem: str) -> None:
    """A damaged entry is reported as such by reads, the export and a retry's dedup lookup, never as a
    TypeError or a retry stored again; the failed append stores nothing."""
    path = tmp_path / "log.db"
    with Log(path) as log:
        log.append([("t", "p", [(1, "k", b"x")])])
    with sqlite3.connect(path) as db:
        db.execute("UPDATE entries SET data = ?", (data,))
    db.close()
    error = f"the entry ending at position 1 {problem}"
    readable = problem.startswith("has no")  # keys and payloads are whole: only a dedup lookup needs the ids
    with Log(path) as log:
        with pytest.raises(LogFileError, match=error):
            log.append([("t", "p", [(1, "k", b"x")])])  # a retry: its original's entry is looked up
        assert log.last_position("t") == 1
        if readable:
            assert [m.payload for m in log.read("t", 0, 10)] == [b"x"] == [log.read_positions("t", [1])[1].payload]
        else:
            for read in (lambda: log.read("t", 0, 10), lambda: log.read_positions("t", [1])):
                with pytest.raises(LogFileError, match=error):
                    read()
    with LogSnapshot(path) as snapshot:
        if readable:
            assert [row[2] for row in snapshot.messages("t")] == [b"x"]
        else:
            with pytest.raises(LogFileError, match=error):
                list(snapshot.messages("t"))


def test_a_version_6_log_is_rewritten_into_entries_and_keeps_everything(tmp_path: Path) -> None:
    """A row per message (schema 6) becomes entries when a server opens the log: every message, its
    producer and sequence id, publish time and properties stay; dedup finds messages of either layout."""
    path = tmp_path / "log.db"
    with Log(path) as log:
        mixed: list[tuple[int | None, Key, bytes]] = [(0, "a", b"0"), (2, b"b", b"2"), (4, None, b"4")]
        log.append([("t", "p", mixed)], publish_time=5)
        log.append([("t", "p", [(1, "a", b"1"), (3, "a", b"3")], [TRACE, None])], publish_time=6)  # stored late
        log.append([("t", "q", [(seq, "c", b"c%d" % seq) for seq in range(1500)])], publish_time=7)
        log.append([("t", None, [(None, "d", b"d")]), ("u", None, [(None, "e", b"e")])], publish_time=8)
        log.dead_letter("t", "s", [(1, "a", b"0", 2, "nack", 5, TRACE), (6, "c", b"c0", 2, "nack", 7, None)])
        before = {topic: log.read(topic, 0, 10_000) for topic in log.topics()}
    with LogSnapshot(path) as snapshot:
        exported = {topic: list(snapshot.messages(topic)) for topic in snapshot.topics()}
    as_version_6(path)
    with LogSnapshot(path) as snapshot:  # an export reads the old layout as it is
        assert {topic: list(snapshot.messages(topic, chunk=7)) for topic in snapshot.topics()} == exported
    with Log(path) as log:
        assert {topic: log.read(topic, 0, 10_000) for topic in log.topics()} == before
        # runs of one producer with increasing sequence ids make an entry each, of at most _ENTRY_MESSAGES
        most = entries_module._ENTRY_MESSAGES
        q = [*[most] * (1500 // most), 1500 % most]
        assert [count for last, count in _entries(path) if last <= 1506] == [3, 2, *q, 1, 1, 2]
        assert log.append([("t", "p", [(3, "a", b"3"), (5, "f", b"5")]), ("t", "q", [(1499, "c", b"c1499")])]) == [
            [(5, True), (1507, False)],
            [(1505, True)],
        ]
        assert [r.properties for r in log.dead_letters("t", "s")] == [TRACE, None]
        assert log.last_sequence("t", "p") == 5 and log.last_sequence("t", "q") == 1499
        assert log.position_at_time("t", 7) == 6
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8
        assert db.execute("SELECT count(*) FROM sqlite_schema WHERE name LIKE 'messages%'").fetchone() == (0,)
    db.close()
    with LogSnapshot(path) as snapshot:
        assert list(snapshot.messages("u")) == exported["u"]
        assert list(snapshot.messages("t", chunk=1))[:1506] == exported["t"]


class _StoreOutOnce(SQLiteStore):
    """A store whose first write finds it out of reach, after the test let it go on: what came in
    meanwhile waits in the queue for the next commit, which finds the store back."""

    def __init__(self, log: Log) -> None:
        super().__init__(log)
        self.writing = asyncio.Event()
        self.go_on = asyncio.Event()
        self._out = True

    async def _write(self, batches: list[Batch], publish_time: int) -> list[Result | BaseException]:
        """The first call: wait for ``go_on``, then fail every batch out of reach; the others: write."""
        if not self._out:
            return await super()._write(batches, publish_time)
        self._out = False
        self.writing.set()
        await self.go_on.wait()
        return [StoreUnavailableError("no member of the store accepts writes")] * len(batches)


def test_a_producer_s_requests_that_came_in_during_a_refused_write_are_refused_too_never_stored_ahead(
    tmp_path: Path,
) -> None:
    """Stored by the next commit, the later request would go before the refused one's resend: out of order."""

    async def run() -> tuple[list[BaseException | None], list[StoredMessage]]:
        store = _StoreOutOnce(Log(tmp_path / "log.db"))
        store.store_wait = 0.0  # out of reach for longer than the store waits
        await store.start()
        try:
            first = store.append("t", "p", [(1, "a", b"1")])
            await asyncio.wait_for(store.writing.wait(), 30)
            later = store.append("t", "p", [(2, "a", b"2")])
            other = store.append("t", "q", [(1, "a", b"3")])  # another producer: not held back
            window: list[asyncio.Future[Result]] = []  # sent before the refusal was answered: refused too
            first.add_done_callback(lambda _: window.append(store.append("t", "p", [(3, "a", b"4")])))
            store.go_on.set()
            done: list[Result | BaseException] = list(
                await asyncio.wait_for(asyncio.gather(first, later, other, return_exceptions=True), 30)
            )
            done += await asyncio.wait_for(asyncio.gather(*window, return_exceptions=True), 30)
            # Once answered, the store holds nothing against the producer: the server does, per connection.
            await asyncio.wait_for(store.append("t", "p", [(5, "a", b"5")]), 30)
            return [d if isinstance(d, BaseException) else None for d in done], await store.read("t", 0, 10)
        finally:
            await store.close()

    errors, stored = run_async(run())
    assert isinstance(errors[0], StoreUnavailableError)
    assert isinstance(errors[1], StoreUnavailableError) and "resend from the refused one" in str(errors[1])
    assert errors[2] is None
    assert isinstance(errors[3], StoreUnavailableError)
    assert [m.payload for m in stored] == [b"3", b"5"]


def test_a_duplicate_above_the_last_position_known_is_counted_and_read_only_then(tmp_path: Path) -> None:
    """A commit whose answer was lost in a failover of the store: stored, but never counted by the server. A read
    does not go past the last position the server knows (a row there may be undone by the failover); the
    producer's resend, a duplicate, counts it, and the listeners hear of it, so the subscriptions read it."""

    async def run() -> tuple[list[StoredMessage], list[tuple[int, bool]], list[str], list[StoredMessage]]:
        store = SQLiteStore(Log(tmp_path / "log.db"))
        await store.start()
        heard: list[str] = []
        store.on_commit(heard.append)
        try:
            with Log(tmp_path / "log.db") as beside:  # the commit the server never saw succeed
                beside.append([("t", "p", [(1, "a", b"1"), (2, "a", b"2")])], publish_clock())
            unseen = await store.read("t", 0, 10)
            resent = await asyncio.wait_for(store.append("t", "p", [(1, "a", b"1"), (2, "a", b"2")]), 30)
            return unseen, resent, heard, await store.read("t", 0, 10)
        finally:
            await store.close()

    unseen, resent, heard, read = run_async(run())
    assert unseen == []
    assert resent == [(1, True), (2, True)]
    assert heard == ["t"]
    assert [m.payload for m in read] == [b"1", b"2"]


def test_a_group_commit_that_finds_the_store_out_of_reach_is_written_once_it_is_back_in_order(
    tmp_path: Path,
) -> None:
    """Within the wait, nothing is refused: the requests that came in meanwhile are stored after, in order."""

    async def run() -> tuple[list[Result], list[StoredMessage]]:
        store = _StoreOutOnce(Log(tmp_path / "log.db"))
        await store.start()
        try:
            first = store.append("t", "p", [(1, "a", b"1")])
            await asyncio.wait_for(store.writing.wait(), 30)
            later = store.append("t", "p", [(2, "a", b"2")])
            store.go_on.set()
            done = await asyncio.wait_for(asyncio.gather(first, later), 30)
            return list(done), await store.read("t", 0, 10)
        finally:
            await store.close()

    done, stored = run_async(run())
    assert done == [[(1, False)], [(2, False)]]
    assert [m.payload for m in stored] == [b"1", b"2"]
