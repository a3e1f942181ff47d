"""The shared PostgreSQL log (issue 14): positions, producer dedup, cursors, and owner-epoch fencing."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import asyncpg
import pytest

from keyfailover.broker.cursor import Cursor
from keyfailover.broker.storage import NotServedError
from keyfailover.broker.storage.postgresql import (
    APPLICATION_NAME,
    FencedError,
    Lease,
    PostgresLog,
    PostgresStore,
    Row,
)
from keyfailover.broker.storage.records import Key, SchemaRecord, StoredMessage, publish_clock
from keyfailover.core.errors import LogError, PropertiesError
from keyfailover.core.partitions import partition_topic, split_partition_topic
from keyfailover.tools.services import PostgreSQL, free_port
from keyfailover.wire.properties import encode_properties
from tests.aio import run_async
from tests.server_process import until

T = TypeVar("T")


def run(postgres: PostgreSQL, body: Callable[[PostgresLog, str], Awaitable[None]]) -> None:
    """Run ``body`` against a connected log, with a topic name no other test uses."""

    async def main() -> None:
        log = await PostgresLog.connect(postgres.dsn)
        try:
            await body(log, f"orders-{uuid.uuid4().hex[:8]}")
        finally:
            await log.close()

    run_async(main())


def test_messages_get_gapless_positions_per_partition_and_read_back_with_their_keys(postgres: PostgreSQL) -> None:
    async def body(log: PostgresLog, topic: str) -> None:
        lease = await log.open_partition(topic, 0, "b1")
        assert (lease.epoch, lease.last_position) == (1, 0)
        messages: list[tuple[int | None, Key, bytes]] = [
            (None, "acct-1", b"a"),
            (None, b"\x00k", b"b"),
            (None, None, b"c"),
        ]
        stored = await log.append(lease, None, messages, publish_time=5)
        assert stored == [(1, False), (2, False), (3, False)]
        other = await log.open_partition(topic, 1, "b1")
        assert await log.append(other, None, [(None, "acct-2", b"d")]) == [(1, False)]
        assert await log.read(topic, 0, 0, 10) == [
            StoredMessage(1, "acct-1", b"a", 5),
            StoredMessage(2, b"\x00k", b"b", 5),
            StoredMessage(3, None, b"c", 5),
        ]
        assert await log.read(topic, 0, 2, 10) == [StoredMessage(3, None, b"c", 5)]
        assert [m.position for m in await log.read(topic, 1, 0, 10)] == [1]

    run(postgres, body)


def test_a_resent_batch_is_not_stored_twice(postgres: PostgreSQL) -> None:
    async def body(log: PostgresLog, topic: str) -> None:
        lease = await log.open_partition(topic, 0, "b1")
        first = await log.append(lease, "p1", [(0, "k", b"a"), (1, "k", b"b")])
        # After a failover the producer resends what it had no receipt for, with one new message.
        again = await log.append(lease, "p1", [(1, "k", b"b"), (2, "k", b"c")])
        assert first == [(1, False), (2, False)]
        assert again == [(2, True), (3, False)]
        assert [m.payload for m in await log.read(topic, 0, 0, 10)] == [b"a", b"b", b"c"]

    run(postgres, body)


def test_a_broker_that_lost_its_partition_can_never_write_to_it_again(postgres: PostgreSQL) -> None:
    """The zombie bar: once another broker opened the partition, the old lease's appends and
    cursor saves fail on the owner epoch, in the same transaction, and store nothing."""

    async def body(log: PostgresLog, topic: str) -> None:
        old = await log.open_partition(topic, 0, "b1")
        await log.append(old, None, [(None, "k", b"before")])
        new = await log.open_partition(topic, 0, "b2")
        assert new.epoch == old.epoch + 1 and new.last_position == 1
        with pytest.raises(FencedError, match=r"opened by b2 at owner epoch 2; b1's lease at epoch 1 is stale"):
            await log.append(old, None, [(None, "k", b"zombie")])
        with pytest.raises(FencedError, match="stale"):
            await log.save_cursor(old, "billing", Cursor(1))
        assert await log.append(new, None, [(None, "k", b"after")]) == [(2, False)]
        assert [m.payload for m in await log.read(topic, 0, 0, 10)] == [b"before", b"after"]
        assert await log.load_cursor(topic, 0, "billing") == Cursor()
        await log.save_cursor(new, "billing", Cursor(2))
        assert await log.load_cursor(topic, 0, "billing") == Cursor(2)
        assert await log.owner_epoch(topic, 0) == ("b2", 2)

    run(postgres, body)


def test_concurrent_appends_under_one_lease_get_distinct_positions(postgres: PostgreSQL) -> None:
    async def body(log: PostgresLog, topic: str) -> None:
        lease = await log.open_partition(topic, 0, "b1")
        batches = [[(None, f"k{i}", f"{i}-{j}".encode()) for j in range(50)] for i in range(8)]
        results = await asyncio.gather(*(log.append(lease, None, batch) for batch in batches))
        positions = sorted(position for result in results for position, _ in result)
        assert positions == list(range(1, 401))
        read = await log.read(topic, 0, 0, 1000)
        assert [m.position for m in read] == positions

    run(postgres, body)


def test_bad_input_is_refused_and_stores_nothing(postgres: PostgreSQL) -> None:
    async def body(log: PostgresLog, topic: str) -> None:
        lease = await log.open_partition(topic, 0, "b1")
        with pytest.raises(LogError, match="a named producer's message needs a sequence id >= 0"):
            await log.append(lease, "p1", [(0, "k", b"a"), (None, "k", b"b")])
        with pytest.raises(LogError, match="a key must be str, bytes or None, not int"):
            await log.append(lease, None, [(None, 7, b"a")])  # type: ignore[list-item]
        with pytest.raises(LogError, match="partition must be an int >= 0"):
            await log.read(topic, -1, 0, 10)
        assert await log.read(topic, 0, 0, 10) == []

    run(postgres, body)


def test_an_unreachable_postgresql_is_named_without_its_password() -> None:
    dsn = f"postgresql://kf:secret@127.0.0.1:{free_port()}/keyfailover"
    with pytest.raises(
        LogError, match=r"cannot reach PostgreSQL at postgresql://kf@127\.0\.0\.1:\d+/keyfailover"
    ) as info:
        run_async(PostgresLog.connect(dsn))
    assert "secret" not in str(info.value)


def run_store(postgres: PostgreSQL, body: Callable[[PostgresStore, PostgresStore, str], Awaitable[None]]) -> None:
    """Run ``body`` with two brokers' stores (b1, b2) over the shared log and a fresh topic of 2 partitions."""
    topic = f"orders-{uuid.uuid4().hex[:8]}"

    def locate(served: str) -> tuple[str, int]:
        found = split_partition_topic(served)
        return found if found is not None else (served, 0)

    async def main() -> None:
        stores = [PostgresStore(postgres.dsn, locate), PostgresStore(postgres.dsn, locate)]
        for owner, store in zip(("b1", "b2"), stores, strict=True):
            store.owner = owner
            await store.start()
        try:
            await body(stores[0], stores[1], topic)
        finally:
            for store in stores:
                await store.close()

    run_async(main())


def test_a_store_groups_requests_of_several_producers_and_serves_only_what_it_leased(postgres: PostgreSQL) -> None:
    async def body(b1: PostgresStore, _: PostgresStore, topic: str) -> None:
        served = partition_topic(topic, 1, 2)
        assert not b1.serves(served)
        refused = b1.append(served, "p1", [(0, "k", b"x")])
        with pytest.raises(NotServedError, match="does not serve"):
            await refused
        await b1.acquire(served)
        assert b1.serves(served) and b1.last_position(served) == 0
        # Queued together: one group commit, one transaction, in order; a resend is answered as stored.
        first, second, third = (
            b1.append(served, "p1", [(0, "a", b"1"), (1, "a", b"2")]),
            b1.append(served, "p2", [(5, "b", b"3")]),
            b1.append(served, "p1", [(1, "a", b"2"), (2, "a", b"4")]),
        )
        assert [await first, await second, await third] == [
            [(1, False), (2, False)],
            [(3, False)],
            [(2, True), (4, False)],
        ]
        assert [m.payload for m in await b1.read(served, 0, 10)] == [b"1", b"2", b"3", b"4"]
        assert set(await b1.read_positions(served, [2, 4, 9])) == {2, 4}
        b1.entry_cache.drop(served)  # read back from PostgreSQL, not from memory: each with its producer's name
        from_log = await b1.read(served, 0, 10)
        assert [m.producer for m in from_log] == ["p1", "p1", "p2", "p1"]
        assert from_log[0].producer is from_log[3].producer  # one name object per producer of a read
        assert {p: m.producer for p, m in (await b1.read_positions(served, [3, 4])).items()} == {3: "p2", 4: "p1"}
        assert await b1.position_at_time(served, 0) == 1
        assert await b1.position_at_time(served, publish_clock() + 60_000_000) is None
        assert not await b1.has_cursor(served, "s")
        await b1.save_cursors([(served, "s", Cursor(2, []))])
        assert await b1.has_cursor(served, "s")
        assert await b1.subscriptions(served) == ["s"]
        assert await b1.load_cursor(served, "s") == Cursor(2, [])
        await b1.save_cursors([(served, "gone", Cursor(1, []))])
        assert await b1.delete_cursor(served, "gone") is True
        assert await b1.delete_cursor(served, "gone") is False
        assert await b1.subscriptions(served) == ["s"]
        b1.release(served)
        with pytest.raises(NotServedError):
            await b1.save_cursors([(served, "s", Cursor(3, []))])
        assert await b1.load_cursor(served, "s") == Cursor(2, [])

    run_store(postgres, body)


def test_the_last_sequence_of_a_producer(postgres: PostgreSQL) -> None:
    async def body(b1: PostgresStore, _: PostgresStore, topic: str) -> None:
        served = partition_topic(topic, 0, 2)
        await b1.acquire(served)
        assert await b1.last_sequence(served, "p") == -1
        await b1.append(served, "p", [(3, "a", b"1"), (7, "a", b"2")])
        await b1.append(served, "p2", [(9, "b", b"3")])
        await b1.append(served, "q", [(9, "b", b"4")])
        await b1.append(served, "p", [(5, "b", b"5")])
        assert await b1.last_sequence(served, "p") == 7
        assert await b1.last_sequence(served, "q") == 9

    run_store(postgres, body)


def test_position_at_time_is_the_first_message_of_the_partition_published_at_or_after_it(
    postgres: PostgreSQL,
) -> None:
    async def body(log: PostgresLog, topic: str) -> None:
        lease = await log.open_partition(topic, 0, "b1")
        other = await log.open_partition(topic, 1, "b1")
        for publish_time in (10, 20, 20, 30, 5):  # the last one is older: a replayed dead letter keeps its time
            await log.append(lease, None, [(None, "k", b"%d" % publish_time)], publish_time=publish_time)
        await log.append(other, None, [(None, "k", b"x")], publish_time=99)
        found = [await log.position_at_time(topic, 0, at) for at in (0, 5, 10, 11, 20, 21, 30)]
        assert found == [1, 1, 1, 2, 2, 4, 4]
        assert await log.position_at_time(topic, 0, 31) is None
        assert await log.position_at_time(topic, 1, 31) == 1
        assert await log.position_at_time(topic, 2, 0) is None

    run(postgres, body)


def test_a_sequence_id_below_the_highest_never_stored_is_stored_late(postgres: PostgreSQL) -> None:
    """As in the SQLite log: a seq below the highest is a duplicate only when it was stored."""

    async def body(b1: PostgresStore, _: PostgresStore, topic: str) -> None:
        served = partition_topic(topic, 0, 2)
        await b1.acquire(served)
        assert await b1.append(served, "p", [(1, "k", b"1"), (5, "k", b"5")]) == [(1, False), (2, False)]
        assert await b1.append(served, "p", [(3, "k", b"3"), (5, "k", b"5"), (6, "k", b"6")]) == [
            (3, False),
            (2, True),
            (4, False),
        ]
        assert await b1.append(served, "p", [(3, "j", b"3"), (4, "j", b"4")]) == [(3, True), (5, False)]
        stored = await b1.read(served, 0, 10)
        assert [message.payload for message in stored] == [b"1", b"5", b"3", b"6", b"4"]

    run_store(postgres, body)


def test_a_store_fenced_out_by_another_broker_stops_serving_and_writes_nothing(postgres: PostgreSQL) -> None:
    async def body(b1: PostgresStore, b2: PostgresStore, topic: str) -> None:
        served = partition_topic(topic, 0, 2)
        fenced: list[str] = []
        b1.on_fenced = fenced.append
        await b1.acquire(served)
        assert await b1.append(served, None, [(None, "k", b"old")]) == [(1, False)]
        await b2.acquire(served)  # the partition moved; b1 has not heard yet
        with pytest.raises(FencedError, match="lease at epoch 1 is stale"):
            await b1.append(served, None, [(None, "k", b"zombie")])
        assert fenced == [served] and not b1.serves(served)
        with pytest.raises(NotServedError):
            await b1.dead_letter(served, "s", [(1, "k", b"old", 3, "nack", None, None)])
        assert await b2.append(served, None, [(None, "k", b"new")]) == [(2, False)]
        assert [m.payload for m in await b2.read(served, 0, 10)] == [b"old", b"new"]

    run_store(postgres, body)


def test_settings_and_dead_letters_live_in_the_shared_log(postgres: PostgreSQL) -> None:
    async def body(b1: PostgresStore, b2: PostgresStore, topic: str) -> None:
        served = partition_topic(topic, 1, 2)
        await b1.save_consume_mode(topic, "s", "unordered")
        await b1.save_delivery_settings(topic, "s", {"ack_timeout": 5.0, "max_redeliveries": None})
        assert await b2.load_consume_mode(topic, "s") == "unordered"
        assert await b2.load_delivery_settings(topic, "s") == {"ack_timeout": 5.0, "max_redeliveries": None}
        with pytest.raises(LogError, match="unknown delivery settings"):
            await b1.save_delivery_settings(topic, "s", {"speed": 1})
        await b1.acquire(served)
        await b1.append(served, None, [(None, "k", b"poison")])
        (stored,) = await b1.read(served, 0, 10)
        assert await b1.dead_letter(served, "s", [(1, "k", b"poison", 3, "nack", stored.publish_time, None)]) == [1]
        await b2.acquire(served)  # the dead letters move with the partition
        (letter,) = await b2.dead_letters(served, "s", 10)
        assert (letter.position, letter.key, letter.payload, letter.reason, letter.replayed_at) == (
            1, "k", b"poison", "nack", None,
        )  # fmt: skip
        assert letter.publish_time == stored.publish_time is not None
        replayed = await b2.replay_dead_letters(served, "s")
        assert replayed == [StoredMessage(2, "k", b"poison", stored.publish_time)]  # its original publish time
        assert await b2.read(served, 1, 10) == replayed
        assert (await b2.dead_letters(served, "s", 10))[0].replayed_at == 2
        assert await b2.replay_dead_letters(served, "s") == []

    run_store(postgres, body)


def test_a_topic_s_schema_versions_are_shared_by_every_broker(postgres: PostgreSQL) -> None:
    async def body(b1: PostgresStore, b2: PostgresStore, topic: str) -> None:
        first = SchemaRecord(0, 4, "User", b'{"type": "string"}', (("k", "v"),))
        assert await b1.schemas(topic) == []
        assert not await b1.add_schema(topic, first._replace(version=1))  # not the next version
        assert await b1.add_schema(topic, first)
        assert not await b2.add_schema(topic, first._replace(name="late"))  # another broker added version 0
        assert await b2.add_schema(topic, first._replace(version=1, data=b'{"type": "long"}', properties=()))
        assert [(s.version, s.name, s.properties) for s in await b1.schemas(topic)] == [
            (0, "User", (("k", "v"),)),
            (1, "User", ()),
        ]

    run_store(postgres, body)


def test_dead_letters_are_counted_by_reason_and_purged_only_by_their_partition_s_owner(postgres: PostgreSQL) -> None:
    async def body(b1: PostgresStore, b2: PostgresStore, topic: str) -> None:
        served = partition_topic(topic, 1, 2)
        await b1.acquire(served)
        await b1.append(served, None, [(None, "k", b"a"), (None, "j", b"b"), (None, "i", b"c")])
        letters = [(1, "k", b"a", 3, "nack", None, None), (2, "j", b"b", 3, "nack", None, None)]
        await b1.dead_letter(served, "s", [*letters, (3, "i", b"c", 3, "ack timeout", None, None)])
        await b1.dead_letter(served, "other", [(1, "k", b"a", 3, "nack", None, None)])
        groups = [g for g in await b2.dead_letter_groups() if g.topic == topic]
        assert [(g.partition, g.subscription, g.reason, g.letters, g.waiting) for g in groups] == [
            (1, "other", "nack", 1, 1),
            (1, "s", "ack timeout", 1, 1),
            (1, "s", "nack", 2, 2),
        ]
        with pytest.raises(NotServedError):  # b2 does not serve it: refused, nothing deleted
            await b2.purge_dead_letters(served, "s")
        assert len(await b1.dead_letters(served, "s", 10)) == 3
        assert await b1.purge_dead_letters(served, "s") == 3
        assert await b1.dead_letters(served, "s", 10) == []
        assert len(await b1.dead_letters(served, "other", 10)) == 1, "another subscription's letters stay"
        assert await b1.purge_dead_letters(served, "s") == 0
        assert [m.payload for m in await b1.read(served, 0, 10)] == [b"a", b"b", b"c"], "the topic is untouched"

    run_store(postgres, body)


def test_a_store_stamps_each_group_commit_with_the_broker_clock(postgres: PostgreSQL) -> None:
    async def body(b1: PostgresStore, _: PostgresStore, topic: str) -> None:
        served = partition_topic(topic, 0, 2)
        await b1.acquire(served)
        before = publish_clock()
        await asyncio.gather(b1.append(served, "p1", [(0, "a", b"1")]), b1.append(served, None, [(None, "b", b"2")]))
        after = publish_clock()
        (at,) = {m.publish_time for m in await b1.read(served, 0, 10)}  # one commit: one time
        assert at is not None and before <= at <= after
        assert {m.publish_time for m in (await b1.read_positions(served, [1, 2])).values()} == {at}

    run_store(postgres, body)


def run_old_log(postgres: PostgreSQL, dropped: str, body: Callable[[PostgresLog, Lease], Awaitable[None]]) -> None:
    """Run ``body`` on a log of a database of its own that holds one message ``(0, "k", b"old")`` of producer "p",
    stored at publish time 4, from before the columns ``dropped`` (``DROP COLUMN ...`` clauses) were added: the
    log was connected again after they were dropped from both message tables, and ``body`` gets the lease."""
    database = f"old_{uuid.uuid4().hex[:8]}"
    dsn = postgres.dsn.rsplit("/", 1)[0] + f"/{database}"

    async def main() -> None:
        admin = await asyncpg.connect(postgres.dsn)
        await admin.execute(f"CREATE DATABASE {database}")
        try:
            log = await PostgresLog.connect(dsn)
            lease = await log.open_partition("t", 0, "b1")
            await log.append(lease, "p", [(0, "k", b"old")], publish_time=4)
            for table in ("kf_messages", "kf_dead_letters"):  # as the log was then
                await log.pool.execute(f"ALTER TABLE {table} {dropped}")
            await log.close()
            log = await PostgresLog.connect(dsn)
            try:
                await body(log, lease)
            finally:
                await log.close()
        finally:
            await admin.execute(f"DROP DATABASE {database} WITH (FORCE)")
            await admin.close()

    run_async(main())


def test_a_log_from_before_publish_times_gains_the_column_and_keeps_its_messages(postgres: PostgreSQL) -> None:
    """A log created before publish times (no column) in a database of its own: its messages are
    kept with an unknown publish time, and new ones get the broker's clock."""

    async def body(log: PostgresLog, lease: Lease) -> None:
        assert await log.read("t", 0, 0, 10) == [StoredMessage(1, "k", b"old", None, None, "p")]
        assert await log.append(lease, "p", [(0, "k", b"old"), (1, "k", b"new")], publish_time=9) == [
            (1, True),
            (2, False),
        ]
        assert await log.read("t", 0, 1, 10) == [StoredMessage(2, "k", b"new", 9, None, "p")]

    run_old_log(postgres, "DROP COLUMN publish_time, DROP COLUMN properties", body)


TRACE = encode_properties({"trace-id": "4bf92f35", "": "ünïcödé\x00"})
OTHER = encode_properties({"content-type": "application/json"})


def test_properties_are_stored_with_their_messages_and_kept_by_dead_letters(postgres: PostgreSQL) -> None:
    async def body(b1: PostgresStore, b2: PostgresStore, topic: str) -> None:
        served = partition_topic(topic, 0, 2)
        await b1.acquire(served)
        # two requests in one group commit, one with properties and one without
        await asyncio.gather(
            b1.append(served, "p", [(0, "a", b"1"), (1, "b", b"2")], [TRACE, None]),
            b1.append(served, None, [(None, "c", b"3")]),
        )
        stored = await b1.read(served, 0, 10)
        assert [(m.payload, m.properties) for m in stored] == [(b"1", TRACE), (b"2", None), (b"3", None)]
        assert (await b1.read_positions(served, [1]))[1].properties == TRACE
        assert await b1.append(served, "p", [(1, "b", b"2")], [OTHER]) == [(2, True)]  # a duplicate keeps its own
        assert (await b1.read_positions(served, [2]))[2].properties is None
        first = stored[0]
        letter = (1, "a", b"1", 3, "nack", first.publish_time, first.properties)
        assert await b1.dead_letter(served, "s", [letter]) == [1]
        await b2.acquire(served)  # the dead letters move with the partition
        (record,) = await b2.dead_letters(served, "s", 10)
        assert record.properties == TRACE
        (replayed,) = await b2.replay_dead_letters(served, "s")
        assert (replayed.position, replayed.properties, replayed.publish_time) == (4, TRACE, first.publish_time)
        assert await b2.read(served, 3, 10) == [replayed]

    run_store(postgres, body)


def test_bad_properties_store_nothing_and_the_other_requests_of_the_commit_go_on(postgres: PostgreSQL) -> None:
    async def body(b1: PostgresStore, _: PostgresStore, topic: str) -> None:
        served = partition_topic(topic, 1, 2)
        await b1.acquire(served)
        good = b1.append(served, None, [(None, "a", b"1")], [TRACE])
        bad = b1.append(served, "p", [(0, "b", b"2")], [b"\x81\xa1k\x01"])  # the value 1 is no str
        short = b1.append(served, "p", [(0, "b", b"2"), (1, "b", b"3")], [TRACE])
        assert await good == [(1, False)]
        with pytest.raises(PropertiesError, match="the value of property 'k' is int"):
            await bad
        with pytest.raises(PropertiesError, match="a batch of 2 messages has properties for 1"):
            await short
        assert [m.payload for m in await b1.read(served, 0, 10)] == [b"1"]
        assert await b1.last_sequence(served, "p") == -1

    run_store(postgres, body)


def test_a_log_from_before_properties_gains_the_columns_and_its_messages_have_none(postgres: PostgreSQL) -> None:
    async def body(log: PostgresLog, lease: Lease) -> None:
        assert await log.read("t", 0, 0, 10) == [StoredMessage(1, "k", b"old", 4, None, "p")]
        assert await log.append(lease, "p", [(1, "k", b"new")], publish_time=9, properties=[TRACE]) == [(2, False)]
        assert await log.read("t", 0, 1, 10) == [StoredMessage(2, "k", b"new", 9, TRACE, "p")]
        columns = await log.pool.fetch(
            "SELECT table_name FROM information_schema.columns WHERE column_name = 'properties' "
            "AND table_schema = current_schema() ORDER BY table_name"
        )
        assert [row[0] for row in columns] == ["kf_dead_letters", "kf_messages", "kf_schemas"]

    run_old_log(postgres, "DROP COLUMN properties", body)


async def within(work: Awaitable[T], what: str, seconds: float = 30.0) -> T:
    """``work``'s result; fails naming ``what`` when it takes more than ``seconds`` (instead of hanging)."""
    try:
        return await asyncio.wait_for(work, seconds)
    except TimeoutError:
        pytest.fail(f"{what}: not within {seconds} s")


def test_a_new_owner_ends_the_transaction_a_stopped_broker_left_open_on_its_partition(
    postgres: PostgreSQL, caplog: pytest.LogCaptureFixture
) -> None:
    """A broker stopped (SIGSTOP) between the statements of an append holds the partition's row: the new
    owner's epoch bump must not wait for it to wake. It ends that connection, the append is rolled back,
    and the log says who waited for what."""

    async def body(log: PostgresLog, topic: str) -> None:
        old = await log.open_partition(topic, 0, "b1")
        await log.append(old, None, [(None, "k", b"before")])
        async with log.pool.acquire() as stopped:
            transaction = stopped.transaction()
            await transaction.start()
            rows = [(None, b"k", True, b"never committed", 1, None)]
            await log.append_in(stopped, old, [(None, rows)])  # the broker stops here, before its commit
            new = await within(log.open_partition(topic, 0, "b2"), "the new owner's epoch bump")
            with pytest.raises(
                (asyncpg.PostgresConnectionError, asyncpg.InterfaceError, asyncpg.exceptions.InternalClientError)
            ):
                await transaction.commit()
        assert (new.epoch, new.last_position) == (2, 1)
        assert [m.payload for m in await log.read(topic, 0, 0, 10)] == [b"before"]
        assert await log.append(new, None, [(None, "k", b"after")]) == [(2, False)]

    with caplog.at_level(logging.INFO, logger="keyfailover.ownership"):
        run(postgres, body)
    said = caplog.text
    assert "broker b2 waits to open partition 0 of" in said
    assert "last opened by broker b1 (owner epoch 1): PostgreSQL backend" in said
    assert "(keyfailover broker, from 127.0.0.1:" in said and "idle in transaction" in said
    assert "it ends that connection (its transaction is rolled back)" in said
    assert "broker b2 fenced partition 0 of" in said and "at owner epoch 2" in said


def test_a_new_owner_waits_for_a_lock_that_is_not_a_broker_s(
    postgres: PostgreSQL, caplog: pytest.LogCaptureFixture
) -> None:
    """Only keyfailover brokers' connections are ended: an operator's session holding the partition's row
    is waited for (and named in the log), and the bump goes through once it commits."""

    async def body(log: PostgresLog, topic: str) -> None:
        await log.open_partition(topic, 0, "b1")
        operator = await asyncpg.connect(postgres.dsn, server_settings={"application_name": "psql"})
        try:
            transaction = operator.transaction()
            await transaction.start()
            await operator.execute("SELECT 1 FROM kf_partitions WHERE topic = $1 FOR UPDATE", topic)
            bump = asyncio.ensure_future(log.open_partition(topic, 0, "b2"))
            await until(lambda: "not a keyfailover broker's connection" in caplog.text, "the wait said")
            assert await operator.fetchval("SELECT 1") == 1 and not bump.done()
            await transaction.commit()
            new = await within(bump, "the bump after the operator's commit")
            assert new.epoch == 2
        finally:
            await operator.close()

    with caplog.at_level(logging.INFO, logger="keyfailover.ownership"):
        run(postgres, body)
    assert "(psql, from 127.0.0.1:" in caplog.text


def test_a_new_owner_waits_for_a_broker_s_connection_that_is_working(
    postgres: PostgreSQL, caplog: pytest.LogCaptureFixture
) -> None:
    """A broker's connection holding the partition's row while it works (here a statement that sleeps; in
    life a commit waiting for a synchronous standby, which may commit) is not ended: the bump waits, says
    for what, and goes on once that transaction commits, which it does."""

    async def body(log: PostgresLog, topic: str) -> None:
        await log.open_partition(topic, 0, "b1")
        working = await asyncpg.connect(postgres.dsn, server_settings={"application_name": APPLICATION_NAME})
        try:
            transaction = working.transaction()
            await transaction.start()
            await working.execute("SELECT 1 FROM kf_partitions WHERE topic = $1 FOR UPDATE", topic)
            sleeping = asyncio.ensure_future(working.execute("SELECT pg_sleep(1.5)"))
            bump = asyncio.ensure_future(log.open_partition(topic, 0, "b2"))
            await until(lambda: "it waits for it (working: PgSleep)" in caplog.text, "the wait said")
            await within(sleeping, "the working statement")
            await transaction.commit()  # not ended: its commit goes through
            assert (await within(bump, "the bump after the commit")).epoch == 2
        finally:
            await working.close()

    with caplog.at_level(logging.INFO, logger="keyfailover.ownership"):
        run(postgres, body)
    assert "it ends that connection" not in caplog.text


def test_a_write_whose_connection_a_new_owner_ended_is_refused_as_fenced(
    postgres: PostgreSQL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b1's append stops right after it took the partition's row (as a broker stopped by SIGSTOP between the
    statements of its transaction); b2 opens the partition, ending b1's connection; when b1 goes on, its
    write fails as fenced (clients look the partition up again and resend), b1 stops serving, and nothing
    of the write is stored."""

    async def body(b1: PostgresStore, b2: PostgresStore, topic: str) -> None:
        served = partition_topic(topic, 0, 2)
        fenced: list[str] = []
        b1.on_fenced = fenced.append
        await b1.acquire(served)
        assert await b1.append(served, None, [(None, "k", b"old")]) == [(1, False)]
        stopped, wake = asyncio.Event(), asyncio.Event()
        append_in = b1.log.append_in

        async def stopped_after_the_row(
            connection: Any, lease: Lease, checked: Sequence[tuple[str | None, Sequence[Row]]]
        ) -> list[list[tuple[int, bool]]]:
            await PostgresLog.check_lease(connection, lease)  # every write's first statement: it holds the row
            stopped.set()
            await wake.wait()
            return await append_in(connection, lease, checked)

        monkeypatch.setattr(b1.log, "append_in", stopped_after_the_row)
        stuck = b1.append(served, None, [(None, "k", b"stuck")])
        await within(stopped.wait(), "b1 holding the row")
        await within(b2.acquire(served), "b2 opening the partition")
        wake.set()
        with pytest.raises(FencedError, match=r"opened by b2 at owner epoch 2 while b1 wrote it at owner epoch 1"):
            await within(stuck, "b1's write")
        assert fenced == [served] and not b1.serves(served)
        assert await b2.append(served, None, [(None, "k", b"new")]) == [(2, False)]
        assert [m.payload for m in await b2.read(served, 0, 10)] == [b"old", b"new"]

    run_store(postgres, body)
