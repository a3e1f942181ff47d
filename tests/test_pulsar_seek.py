"""SEEK with the real ``pulsar-client`` wheel against ``keyfailover serve --pulsar-port``.

A seek resets the subscription's cursor for every consumer: the server sends each of them
CLOSE_CONSUMER, the client clears its receiver queue and subscribes again, and the subscription's
deliveries start at the message id (Pulsar's client drops that message itself unless the consumer
was made with ``start_message_id_inclusive``) or at the first message published at or after a time.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pulsar
import pytest

from keyfailover.broker.pulsar.PulsarApi_pb2 import BaseCommand, ConsumerNotFound, MetadataError
from keyfailover.client import Client, Timeout
from keyfailover.core.partitions import partition_of_key
from keyfailover.tools.services import PostgreSQL, ZooKeeper
from tests.pulsar_wire import QUIET, RawPulsar, client, command, connect_command
from tests.server_process import ServerProcess, wait_until
from tests.test_cluster_failover import running
from tests.tiers import starts_processes

KEYS = [f"account-{i}" for i in range(12)]


@pytest.fixture(scope="module")
@starts_processes
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data: Path = tmp_path_factory.mktemp("pulsar-seek") / "data"
    with ServerProcess(data, "--metrics-port", "0", "--pulsar-port", "0", "--session-timeout", "3") as server:
        yield server


def produce(pc: pulsar.Client, topic: str, first: int, count: int) -> list[pulsar.MessageId]:
    """Messages ``first`` to ``first + count - 1``, each keyed by its index modulo the keys; their ids."""
    producer = pc.create_producer(topic)
    try:
        return [producer.send(b"%d" % i, partition_key=KEYS[i % len(KEYS)]) for i in range(first, first + count)]
    finally:
        producer.close()


def subscribe(pc: pulsar.Client, topic: str, name: str, *, inclusive: bool = False) -> pulsar.Consumer:
    return pc.subscribe(
        topic,
        "seeking",
        consumer_type=pulsar.ConsumerType.KeyShared,
        consumer_name=name,
        initial_position=pulsar.InitialPosition.Earliest,
        start_message_id_inclusive=inclusive,
    )


def subscription_stats(server: ServerProcess, topic: str) -> dict[str, Any]:
    with urlopen(f"{server.admin_url}/stats", timeout=10) as response:
        found = json.loads(response.read())["subscriptions"]
    (stats,) = [s for s in found if s["topic"] == topic and s["subscription"] == "seeking"]
    return dict(stats)


def receive(consumers: list[pulsar.Consumer], count: int) -> list[tuple[int, str, int]]:
    """``count`` messages from ``consumers`` (each acked), as ``(consumer index, key, message index)`` in the
    order each consumer received them."""
    got: list[tuple[int, str, int]] = []
    deadline = time.monotonic() + 60
    while len(got) < count:
        assert time.monotonic() < deadline, f"received {len(got)} of {count} messages: {got}"
        for index, consumer in enumerate(consumers):
            with contextlib.suppress(pulsar.Timeout):
                message = consumer.receive(timeout_millis=50)
                got.append((index, message.partition_key(), int(message.data())))
                consumer.acknowledge(message)
    return got


def all_acked(server: ServerProcess, topic: str, count: int) -> None:
    """Wait until the server holds every ack of the ``count`` messages (the client groups its acks)."""
    wait_until(lambda: subscription_stats(server, topic)["mark_delete"] == count, "every ack at the server")


def per_key(got: list[tuple[int, str, int]]) -> dict[str, list[int]]:
    order: dict[str, list[int]] = defaultdict(list)
    for _, key, index in got:
        order[key].append(index)
    return dict(order)


def expected(indexes: range) -> dict[str, list[int]]:
    return per_key([(0, KEYS[i % len(KEYS)], i) for i in indexes])


def test_a_seek_to_a_message_id_delivers_exactly_the_messages_from_it_on_each_key_in_order(
    server: ServerProcess,
) -> None:
    with client(server.pulsar_url) as pc:
        ids = produce(pc, "seek-id", 0, 60)
        consumer = subscribe(pc, "seek-id", "inclusive", inclusive=True)
        assert sorted(i for _, _, i in receive([consumer], 60)) == list(range(60))
        all_acked(server, "seek-id", 60)
        consumer.seek(ids[25])  # returns once the consumer has subscribed again
        again = receive([consumer], 35)
        assert per_key(again) == expected(range(25, 60))


def test_pulsar_s_client_drops_the_sought_message_unless_it_asked_for_it_inclusive(server: ServerProcess) -> None:
    """As with Apache Pulsar's broker: the server delivers the message at the id again, and the client
    (``start_message_id_inclusive`` off, its default) drops that one message itself."""
    with client(server.pulsar_url) as pc:
        ids = produce(pc, "seek-exclusive", 0, 20)
        consumer = subscribe(pc, "seek-exclusive", "default")
        receive([consumer], 20)
        all_acked(server, "seek-exclusive", 20)
        consumer.seek(ids[10])
        again = receive([consumer], 9)
        assert per_key(again) == expected(range(11, 20))
        # Message 10 went out before 11 to 19 (the server has it in flight, unacked: the rest was acked), so
        # the client had it before them and dropped it without acking, as Pulsar's client does.
        wait_until(lambda: subscription_stats(server, "seek-exclusive")["backlog"] == 1, "11 to 19 acked")
        stats = subscription_stats(server, "seek-exclusive")
        assert (stats["mark_delete"], stats["dispatcher"]["consumers"]["default"]["unacked"]) == (10, 1)
        with pytest.raises(pulsar.Timeout):
            consumer.receive(timeout_millis=300)


def test_a_seek_by_publish_time_starts_at_the_first_message_published_at_or_after_it(server: ServerProcess) -> None:
    with client(server.pulsar_url) as pc:
        produce(pc, "seek-time", 0, 30)
        consumer = subscribe(pc, "seek-time", "timed")
        before = receive([consumer], 30)
        assert len(before) == 30
        # The next batch is published in a later millisecond than every message of the first one.
        last_ms = time.time_ns() // 1_000_000
        wait_until(lambda: time.time_ns() // 1_000_000 > last_ms, "the next millisecond")
        produce(pc, "seek-time", 30, 20)
        first_of_second = receive([consumer], 20)
        all_acked(server, "seek-time", 50)
        published = {index for _, _, index in first_of_second}
        assert published == set(range(30, 50))
        consumer.seek(last_ms + 1)
        assert per_key(receive([consumer], 20)) == expected(range(30, 50))
        consumer.seek(0)  # before every message: all of them again
        assert per_key(receive([consumer], 50)) == expected(range(50))
        consumer.seek(2**63 - 1)  # after every message: nothing until a new one
        produce(pc, "seek-time", 50, 1)
        assert receive([consumer], 1)[0][2] == 50


def test_a_seek_ends_every_consumer_of_the_subscription_and_both_get_the_messages_again_in_key_order(
    server: ServerProcess,
) -> None:
    with client(server.pulsar_url) as pc, client(server.pulsar_url) as other:
        ids = produce(pc, "seek-two", 0, 80)
        first = subscribe(pc, "seek-two", "first", inclusive=True)
        second = subscribe(other, "seek-two", "second", inclusive=True)
        assert sorted(i for _, _, i in receive([first, second], 80)) == list(range(80))
        all_acked(server, "seek-two", 80)
        first.seek(ids[40])
        again = receive([first, second], 40)
        assert per_key(again) == expected(range(40, 80))
        wait_until(
            lambda: sorted(subscription_stats(server, "seek-two")["dispatcher"]["consumers"]) == ["first", "second"],
            "both consumers subscribed again",
        )


def test_a_native_consumer_of_the_subscription_subscribes_again_after_a_pulsar_seek(server: ServerProcess) -> None:
    with client(server.pulsar_url) as pc, Client(server.url, connect_timeout=5.0) as kc:
        ids = produce(pc, "seek-mixed", 0, 60)
        native = kc.subscribe("seek-mixed", "seeking", "native")
        foreign = subscribe(pc, "seek-mixed", "pulsar", inclusive=True)
        got: list[tuple[str, str, int]] = []

        def take(count: int) -> None:
            deadline = time.monotonic() + 60
            while len(got) < count:
                assert time.monotonic() < deadline, f"received {len(got)} of {count} messages"
                with contextlib.suppress(Timeout):
                    message = native.receive(timeout=0.05)
                    assert isinstance(message.key, str)
                    got.append(("native", message.key, int(message.payload)))
                    native.acknowledge(message)
                with contextlib.suppress(pulsar.Timeout):
                    received = foreign.receive(timeout_millis=50)
                    got.append(("pulsar", received.partition_key(), int(received.data())))
                    foreign.acknowledge(received)

        take(60)
        all_acked(server, "seek-mixed", 60)
        got.clear()
        foreign.seek(ids[30])
        take(30)
        assert per_key([(0, key, index) for _, key, index in got]) == expected(range(30, 60))
        assert "native" in {by for by, _, _ in got}  # the native consumer subscribed again
        wait_until(
            lambda: sorted(subscription_stats(server, "seek-mixed")["dispatcher"]["consumers"]) == ["native", "pulsar"],
            "both consumers subscribed again",
        )


def test_a_seek_on_an_unknown_consumer_id_or_with_nothing_to_seek_to_is_refused_and_changes_nothing(
    server: ServerProcess,
) -> None:
    with client(server.pulsar_url) as pc:
        produce(pc, "seek-refused", 0, 10)
        consumer = subscribe(pc, "seek-refused", "watching")
        receive([consumer], 10)
        all_acked(server, "seek-refused", 10)
        assert server.pulsar_url is not None
        with RawPulsar(server.pulsar_url) as raw:
            raw.send(connect_command())
            raw.receive_type(BaseCommand.CONNECTED)
            unknown = command(BaseCommand.SEEK, consumer_id=99, request_id=7)
            unknown.seek.message_id.ledgerId, unknown.seek.message_id.entryId = 0, 1
            raw.send(unknown)
            error = raw.receive_type(BaseCommand.ERROR).error
        assert (error.request_id, error.error) == (7, ConsumerNotFound)
        assert "consumer id 99 is not open" in error.message
        with pytest.raises(pulsar.PulsarException):
            consumer.seek(pulsar.MessageId(ledger_id=5, entry_id=3))  # ledger 5: not a keyfailover message id
        stats = subscription_stats(server, "seek-refused")
        assert (stats["mark_delete"], stats["backlog"]) == (10, 0)
        assert list(stats["dispatcher"]["consumers"]) == ["watching"]
        with pytest.raises(pulsar.Timeout):
            consumer.receive(timeout_millis=300)


def test_seek_with_neither_a_message_id_nor_a_time_is_refused(server: ServerProcess) -> None:
    assert server.pulsar_url is not None
    with RawPulsar(server.pulsar_url) as raw:
        raw.send(connect_command())
        raw.receive_type(BaseCommand.CONNECTED)
        subscribe_raw = command(
            BaseCommand.SUBSCRIBE,
            topic="persistent://public/default/seek-empty",
            subscription="seeking",
            subType=3,
            consumer_id=1,
            request_id=1,
            consumer_name="raw",
        )
        raw.send(subscribe_raw)
        raw.receive_type(BaseCommand.SUCCESS)
        raw.send(command(BaseCommand.SEEK, consumer_id=1, request_id=2))
        error = raw.receive_type(BaseCommand.ERROR).error
    assert (error.request_id, error.error) == (2, MetadataError)
    assert "neither a message id nor a publish time" in error.message


def test_a_reader_seeks_to_a_message_id_and_to_a_time(server: ServerProcess) -> None:
    with client(server.pulsar_url) as pc:
        ids = produce(pc, "seek-reader", 0, 20)
        reader = pc.create_reader("seek-reader", pulsar.MessageId.earliest)
        assert [int(reader.read_next(10_000).data()) for _ in range(20)] == list(range(20))
        reader.seek(ids[12])  # a reader's start is exclusive by default: the client drops message 12
        assert [int(reader.read_next(10_000).data()) for _ in range(7)] == list(range(13, 20))
        reader.seek(0)
        assert [int(reader.read_next(10_000).data()) for _ in range(20)] == list(range(20))
        with pytest.raises(pulsar.Timeout):
            reader.read_next(300)
        reader.close()


def test_a_partitioned_consumer_seeks_by_time_on_every_partition_of_a_cluster(
    zookeeper: ZooKeeper, postgres: PostgreSQL
) -> None:
    """Each partition's seek goes to the broker serving it, which finds the position in PostgreSQL."""
    cluster = f"zk://{zookeeper.hosts}/kf-seek-{uuid.uuid4().hex[:8]}"
    with running(cluster, postgres, 2, 4, "--pulsar-port", "0") as (topic, brokers):
        pc = pulsar.Client(brokers[0].pulsar_url or "", operation_timeout_seconds=30, logger=QUIET)
        try:
            consumer = pc.subscribe(
                topic,
                "seeking",
                consumer_type=pulsar.ConsumerType.KeyShared,
                initial_position=pulsar.InitialPosition.Earliest,
            )
            producer = pc.create_producer(topic, message_router=router)
            for index in range(40):
                producer.send(b"%d" % index, partition_key=KEYS[index % len(KEYS)])
            receive([consumer], 40)
            last_ms = time.time_ns() // 1_000_000
            wait_until(lambda: time.time_ns() // 1_000_000 > last_ms, "the next millisecond")
            for index in range(40, 80):
                producer.send(b"%d" % index, partition_key=KEYS[index % len(KEYS)])
            receive([consumer], 40)
            consumer.seek(last_ms + 1)
            assert per_key(receive([consumer], 40)) == expected(range(40, 80))
        finally:
            pc.close()
    for broker in brokers:
        assert "Traceback" not in broker.errors(), broker.errors()


def router(message: pulsar.Message, partitions: int) -> int:
    """keyfailover's partition of the message's key (partition p holds a block of hash slots)."""
    return partition_of_key(message.partition_key(), partitions)


def test_no_traceback_in_the_server_log(server: ServerProcess) -> None:
    assert server.process is not None and server.process.poll() is None
    assert "Traceback" not in server.errors(), server.errors()


@pytest.mark.integration
def test_the_new_cursor_survives_a_restart_of_the_server(tmp_path: Path) -> None:
    data = tmp_path / "data"
    extra = ("--metrics-port", "0", "--pulsar-port", "0", "--session-timeout", "3")
    with ServerProcess(data, *extra) as first:
        with client(first.pulsar_url) as pc:
            ids = produce(pc, "seek-restart", 0, 30)
            consumer = subscribe(pc, "seek-restart", "before", inclusive=True)
            receive([consumer], 30)
            all_acked(first, "seek-restart", 30)
            consumer.seek(ids[20])
            consumer.close()
        first.kill()  # no shutdown code: the seek saved its cursor before it answered
    with ServerProcess(data, *extra) as second, client(second.pulsar_url) as pc:
        assert subscription_stats(second, "seek-restart")["mark_delete"] == 20
        consumer = subscribe(pc, "seek-restart", "after")
        assert per_key(receive([consumer], 10)) == expected(range(20, 30))
        all_acked(second, "seek-restart", 30)  # nothing left to come
