"""Pulsar producers against ``keyfailover serve --pulsar-port``: access modes, tombstones, and both keys.

The official ``pulsar-client`` wheel where it can say it; a raw connection for what it cannot: a producer
queued for exclusive access (the client only blocks), and a message with ``null_value`` (the Python
client can neither send one nor tell one apart from an empty payload).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pulsar
import pytest

from keyfailover.broker.pulsar import NULL_VALUE_PROPERTY, PulsarFrame, encode_message, parse_message
from keyfailover.broker.pulsar.PulsarApi_pb2 import (
    BaseCommand,
    Exclusive,
    ExclusiveWithFencing,
    MessageMetadata,
    ProducerFenced,
    WaitForExclusive,
)
from keyfailover.client import Client
from keyfailover.core.hashing import key_hash
from tests.pulsar_wire import RawPulsar, client, command, producer_command, send_frame, subscribe_command
from tests.server_process import ServerProcess
from tests.test_pulsar_client import stored
from tests.test_pulsar_server import connected

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data: Path = tmp_path_factory.mktemp("pulsar-producers") / "data"
    with ServerProcess(data, "--metrics-port", "0", "--pulsar-port", "0") as server:
        yield server


def next_message(raw: RawPulsar) -> PulsarFrame:
    """The next MESSAGE frame ``raw`` receives, skipping other commands."""
    while True:
        frame = raw.receive()
        if frame.command.type == BaseCommand.MESSAGE:
            return frame


def test_an_exclusive_producer_is_the_only_one(server: ServerProcess) -> None:
    """A second Exclusive producer is refused ProducerFenced and a Shared one ProducerBusy, at once (both final
    for the client); once the exclusive one closes, a shared one is welcome."""
    topic = "exclusive-only"
    with client(server.pulsar_url) as pc:
        holder = pc.create_producer(topic, producer_name="holder", access_mode=pulsar.ProducerAccessMode.Exclusive)
        holder.send(b"mine")
        with pytest.raises(pulsar.ProducerFenced):
            pc.create_producer(topic, producer_name="second", access_mode=pulsar.ProducerAccessMode.Exclusive)
        with pytest.raises(pulsar.ProducerBusy):
            pc.create_producer(topic, producer_name="shared")
        holder.close()
        shared = pc.create_producer(topic, producer_name="shared")
        shared.send(b"ours")
        with pytest.raises(pulsar.ProducerFenced):  # a shared producer is open now
            pc.create_producer(topic, producer_name="third", access_mode=pulsar.ProducerAccessMode.Exclusive)
    assert stored(server, topic) == 2


def test_a_producer_waiting_for_exclusive_access_gets_it_when_the_holder_leaves(server: ServerProcess) -> None:
    """WaitForExclusive: answered "not ready" while another producer holds the topic, then ready, with the next
    topic epoch, on the same request once it left; the official client's create_producer returns then."""
    topic = "wait-for-it"
    with client(server.pulsar_url) as pc, connected(server) as raw:
        holder = pc.create_producer(topic, producer_name="holder", access_mode=pulsar.ProducerAccessMode.Exclusive)
        waiting = producer_command(f"persistent://public/default/{topic}", request_id=7, name="raw-waiting")
        waiting.producer.producer_access_mode = WaitForExclusive
        raw.send(waiting)
        queued = raw.receive_type(BaseCommand.PRODUCER_SUCCESS).producer_success
        assert (queued.request_id, queued.producer_ready, queued.HasField("topic_epoch")) == (7, False, False)
        holder.close()
        ready = raw.receive_type(BaseCommand.PRODUCER_SUCCESS).producer_success
        assert (ready.request_id, ready.producer_name, ready.producer_ready) == (7, "raw-waiting", True)
        assert ready.topic_epoch == 2  # the holder had epoch 1
        # The client's own WaitForExclusive producer waits behind the raw one, and gets the topic when it leaves.
        opened: list[pulsar.Producer] = []
        thread = threading.Thread(
            target=lambda: opened.append(
                pc.create_producer(topic, producer_name="next", access_mode=pulsar.ProducerAccessMode.WaitForExclusive)
            )
        )
        thread.start()
        raw.send(command(BaseCommand.CLOSE_PRODUCER, producer_id=1, request_id=8))
        raw.receive_type(BaseCommand.SUCCESS)
        thread.join(timeout=30)
        assert opened, "the waiting producer was not granted once the topic was free"
        opened[0].send(b"at last")
    assert stored(server, topic) == 1


def test_an_exclusive_producer_with_fencing_takes_over(server: ServerProcess) -> None:
    """ExclusiveWithFencing: granted at once; the exclusive producer it fenced out is closed and its sends fail
    with ProducerFenced for good (its reconnection carries the old topic epoch); one waiting is refused."""
    topic = "fenced"
    with client(server.pulsar_url) as old_app, client(server.pulsar_url) as new_app, connected(server) as raw:
        old = old_app.create_producer(topic, producer_name="old", access_mode=pulsar.ProducerAccessMode.Exclusive)
        old.send(b"before")
        waiting = producer_command(f"persistent://public/default/{topic}", request_id=3, name="raw-waiting")
        waiting.producer.producer_access_mode = WaitForExclusive
        raw.send(waiting)
        assert not raw.receive_type(BaseCommand.PRODUCER_SUCCESS).producer_success.producer_ready
        new = new_app.create_producer(
            topic, producer_name="new", access_mode=pulsar.ProducerAccessMode.ExclusiveWithFencing
        )
        refused = raw.receive_type(BaseCommand.ERROR).error
        assert (refused.request_id, refused.error) == (3, ProducerFenced)
        assert "fenced out by the ExclusiveWithFencing producer 'new'" in refused.message
        new.send(b"after")
        with pytest.raises(pulsar.ProducerFenced):
            old.send(b"too late")
        with pytest.raises(pulsar.ProducerFenced):
            old.send(b"still too late")
        # A producer that comes back with the epoch it had cannot fence the new one out; the new one goes on.
        stale = producer_command(f"persistent://public/default/{topic}", producer_id=2, request_id=4, name="old")
        stale.producer.producer_access_mode = ExclusiveWithFencing
        stale.producer.topic_epoch = 1
        raw.send(stale)
        again = raw.receive_type(BaseCommand.ERROR).error
        assert (again.request_id, again.error) == (4, ProducerFenced)
        assert "the topic epoch is 2, past this producer's 1" in again.message
        new.send(b"more")
    with client(server.pulsar_url) as pc:
        consumer = pc.subscribe(
            topic,
            "check",
            consumer_type=pulsar.ConsumerType.KeyShared,
            initial_position=pulsar.InitialPosition.Earliest,
        )
        got = [consumer.receive(timeout_millis=10_000) for _ in range(3)]
    assert [message.data() for message in got] == [b"before", b"after", b"more"]


def test_a_message_with_an_ordering_key_and_a_partition_key_keeps_both(server: ServerProcess) -> None:
    """The sticky key is the ordering key: a STICKY consumer that declared only its slot gets the message, and
    sees both keys; a native consumer sees the ordering key as the key, the partition key as a property."""
    topic = "both-keys"
    slot = key_hash(b"order-1")
    assert key_hash("account-9") != slot
    policy = pulsar.ConsumerKeySharedPolicy(key_shared_mode=pulsar.KeySharedMode.Sticky, sticky_ranges=[(slot, slot)])
    with client(server.pulsar_url) as pc:
        consumer = pc.subscribe(
            topic, "s", consumer_type=pulsar.ConsumerType.KeyShared, key_shared_policy=policy, consumer_name="c"
        )
        producer = pc.create_producer(topic)
        producer.send(b"both", partition_key="account-9", ordering_key="order-1")
        producer.send(b"partition only", partition_key="order-1")
        got = [consumer.receive(timeout_millis=10_000) for _ in range(2)]
        for message in got:
            consumer.acknowledge(message)
        reader = pc.create_reader(topic, pulsar.MessageId.earliest)
        read = reader.read_next(timeout_millis=10_000)
    assert [(m.data(), m.partition_key(), m.ordering_key()) for m in got] == [
        (b"both", "account-9", "order-1"),
        (b"partition only", "order-1", ""),
    ]
    assert (read.partition_key(), read.ordering_key()) == ("account-9", "order-1")


def test_a_tombstone_comes_back_as_null(server: ServerProcess) -> None:
    """A message with null_value is stored as one and delivered with null_value (its payload empty); a message
    with an empty payload is not; a native consumer sees the marker among its properties."""
    topic = "tombstones"
    full = f"persistent://public/default/{topic}"
    with connected(server) as consumer, connected(server) as producer:
        consumer.send(subscribe_command(full))
        consumer.receive_type(BaseCommand.SUCCESS)
        consumer.send(command(BaseCommand.FLOW, consumer_id=1, messagePermits=10))
        producer.send(producer_command(full, name="raw-tombstones"))
        producer.receive_type(BaseCommand.PRODUCER_SUCCESS)
        for sequence_id in (0, 1):
            metadata = MessageMetadata(
                producer_name="raw-tombstones", sequence_id=sequence_id, publish_time=1, partition_key="k"
            )
            metadata.null_value = sequence_id == 0
            send = command(BaseCommand.SEND, producer_id=1, sequence_id=sequence_id)
            producer.send(encode_message(send, metadata.SerializeToString(), b""))
            producer.receive_type(BaseCommand.SEND_RECEIPT)
        delivered = [parse_message(next_message(consumer).rest) for _ in range(2)]
    assert [(m.metadata.null_value, m.metadata.partition_key, m.metadata.properties, m.payload) for m in delivered] == [
        (True, "k", (), b""),
        (False, "k", (), b""),
    ]
    with Client(server.url, connect_timeout=5.0) as native:
        first = native.subscribe(topic, "native", "native").receive(timeout=10)
    assert (first.payload, dict(first.properties)) == (b"", {NULL_VALUE_PROPERTY: "true"})


def test_a_fenced_producers_sends_on_the_way_are_dropped_unanswered(server: ServerProcess) -> None:
    """The fenced producer is told CLOSE_PRODUCER; a SEND of it that crossed that is neither stored nor answered
    (a SEND_ERROR would make the client drop the whole connection), and the connection goes on."""
    topic = "persistent://public/default/fenced-raw"
    with connected(server) as old, connected(server) as new:
        holder = producer_command(topic, name="old")
        holder.producer.producer_access_mode = Exclusive
        old.send(holder)
        assert old.receive_type(BaseCommand.PRODUCER_SUCCESS).producer_success.topic_epoch == 1
        fencer = producer_command(topic, name="new")
        fencer.producer.producer_access_mode = ExclusiveWithFencing
        new.send(fencer)
        assert new.receive_type(BaseCommand.PRODUCER_SUCCESS).producer_success.topic_epoch == 2
        assert old.receive_type(BaseCommand.CLOSE_PRODUCER).close_producer.producer_id == 1
        old.send(send_frame(0, b"too late", "k"), command(BaseCommand.PING))
        assert old.receive().command.type == BaseCommand.PONG
    assert stored(server, "fenced-raw") == 0
