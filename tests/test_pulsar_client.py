"""The real ``pulsar-client`` wheel (Apache Pulsar's C++ client) against ``keyfailover serve --pulsar-port``.

Every test talks to a real server process on loopback through an unmodified Pulsar client:
Key_Shared with consumers joining and leaving, nacks, batching, a crash of the server
mid-stream, tokens, and the other subscription types (served since issue 40).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.request import Request, urlopen

import pulsar
import pytest
import trustme

from keyfailover.broker.pulsar import EVENT_TIME_PROPERTY
from keyfailover.broker.pulsar.PulsarApi_pb2 import (
    AuthenticationError,
    BaseCommand,
    CommandSubscribe,
    ConsumerAssignError,
)
from keyfailover.client import Client, Timeout
from keyfailover.core.hashing import key_hash
from keyfailover.core.partitions import partition_of_key
from keyfailover.core.rebalance import UNASSIGNED
from keyfailover.tools.services import free_port
from tests.pulsar_wire import QUIET, RawPulsar, client, connect_command, sticky_subscribe, subscribe_command
from tests.server_process import ServerProcess, run_cli, wait_until

pytestmark = pytest.mark.integration  # a server in a process of its own, which a test crashes

TOKEN = "pulsar-token-for-tests"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data: Path = tmp_path_factory.mktemp("pulsar") / "data"
    with ServerProcess(data, "--metrics-port", "0", "--pulsar-port", "0", "--session-timeout", "3") as server:
        yield server


def stored(server: ServerProcess, topic: str) -> int:
    """How many messages ``topic`` holds (its last position: positions have no gaps)."""
    with urlopen(f"{server.admin_url}/stats", timeout=10) as response:
        return int(json.loads(response.read())["topics"].get(topic, 0))


@dataclass
class Journal:
    """What consumers did, in one order: ``(consumer, "recv" | "ack" | "left", key, index)``."""

    events: list[tuple[str, str, str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def log(self, consumer: str, what: str, key: str = "", index: int = -1) -> None:
        with self.lock:
            self.events.append((consumer, what, key, index))

    def received(self) -> set[int]:
        with self.lock:
            return {index for _, what, _, index in self.events if what == "recv"}


class Reader(threading.Thread):
    """A Key_Shared consumer that receives, journals and acks until told to leave."""

    def __init__(self, pulsar_client: pulsar.Client, topic: str, name: str, journal: Journal) -> None:
        super().__init__(name=name, daemon=True)
        self.consumer = pulsar_client.subscribe(
            topic, "orders", consumer_type=pulsar.ConsumerType.KeyShared, consumer_name=name, receiver_queue_size=20
        )
        self.journal = journal
        self.leave = threading.Event()

    def run(self) -> None:
        name = self.name
        while not self.leave.is_set():
            try:
                message = self.consumer.receive(timeout_millis=100)
            except pulsar.Timeout:
                continue
            key, index = message.partition_key(), int(message.data())
            self.journal.log(name, "recv", key, index)
            self.journal.log(name, "ack", key, index)  # journaled before it is sent: the server sees it after
            self.consumer.acknowledge(message)
        self.consumer.close()
        self.journal.log(name, "left")


def check_key_order(events: list[tuple[str, str, str, int]], produced: dict[str, list[int]]) -> None:
    """Each key's first receipts come in produced order, and no consumer received a key's message while
    another one had a message of that key received and not acked (and had not left)."""
    first: dict[str, list[int]] = defaultdict(list)
    seen: set[int] = set()
    holding: dict[str, dict[str, int]] = defaultdict(dict)  # key -> consumer -> unacked receipts
    for consumer, what, key, index in events:
        if what == "left":
            for held in holding.values():
                held.pop(consumer, None)
        elif what == "recv":
            others = {c for c, n in holding[key].items() if n and c != consumer}
            assert not others, f"{consumer} received {key}#{index} while {others} held unacked messages of {key}"
            holding[key][consumer] = holding[key].get(consumer, 0) + 1
            if index not in seen:
                seen.add(index)
                first[key].append(index)
        else:
            holding[key][consumer] -= 1
    assert dict(first) == produced


def test_key_shared_keeps_each_key_in_order_while_consumers_join_and_leave(server: ServerProcess) -> None:
    topic = "persistent://public/default/join-leave"
    keys = [f"k{i}" for i in range(20)]
    journal = Journal()
    produced: dict[str, list[int]] = defaultdict(list)
    with client(server.pulsar_url) as pc:
        producer = pc.create_producer(topic, producer_name="orders")
        readers = [Reader(pc, topic, "a", journal), Reader(pc, topic, "b", journal)]
        for reader in readers:
            reader.start()

        def produce(start: int, stop: int) -> None:
            for index in range(start, stop):
                key = keys[index % len(keys)]
                produced[key].append(index)
                producer.send(str(index).encode(), partition_key=key)

        produce(0, 200)
        wait_until(lambda: len(journal.received()) >= 200, "the first 200 messages received")
        joiner = Reader(pc, topic, "c", journal)
        joiner.start()
        produce(200, 400)
        wait_until(lambda: len(journal.received()) >= 400, "the next 200 received with a third consumer")
        readers[0].leave.set()
        readers[0].join(timeout=30)
        produce(400, 600)
        wait_until(lambda: len(journal.received()) == 600, "every message received after a consumer left")
        for reader in (readers[1], joiner):
            reader.leave.set()
            reader.join(timeout=30)
    assert journal.received() == set(range(600))
    check_key_order(journal.events, dict(produced))
    assert {consumer for consumer, what, _, _ in journal.events if what == "recv"} >= {"b", "c"}
    assert stored(server, "join-leave") == 600


def test_a_nacked_message_comes_back_with_a_growing_redelivery_count(server: ServerProcess) -> None:
    topic = "persistent://public/default/nacks"
    with client(server.pulsar_url) as pc:
        consumer = pc.subscribe(
            topic, "retry", consumer_type=pulsar.ConsumerType.KeyShared, negative_ack_redelivery_delay_ms=10
        )
        pc.create_producer(topic).send(b"poison", partition_key="k")
        counts = []
        for _ in range(3):
            message = consumer.receive(timeout_millis=10_000)
            counts.append(message.redelivery_count())
            consumer.negative_acknowledge(message)
        message = consumer.receive(timeout_millis=10_000)
        consumer.acknowledge(message)
    assert counts == [0, 1, 2]
    assert (message.data(), message.redelivery_count()) == (b"poison", 3)


def dead_lettering(pc: pulsar.Client, topic: str, dlq: str) -> tuple[pulsar.Consumer, pulsar.Consumer]:
    """A consumer of ``topic`` whose client dead-letters a message to ``dlq`` when it fails a second time, and a
    consumer of ``dlq`` from its start."""
    consumer = pc.subscribe(
        topic,
        "work",
        consumer_type=pulsar.ConsumerType.KeyShared,
        negative_ack_redelivery_delay_ms=10,
        dead_letter_policy=pulsar.ConsumerDeadLetterPolicy(max_redeliver_count=1, dead_letter_topic=dlq),
    )
    dead = pc.subscribe(
        dlq, "inspect", consumer_type=pulsar.ConsumerType.KeyShared, initial_position=pulsar.InitialPosition.Earliest
    )
    return consumer, dead


def test_the_clients_dead_letter_policy_takes_only_the_message_that_failed(server: ServerProcess) -> None:
    """The client dead-letters a message whose redelivery count reached its ``max_redeliver_count``
    when it fails again. A nack takes the key's later message back too (G2): that one comes again
    with the count of its own failures (0), not of its deliveries, so it is retried, not dead-lettered."""
    topic, dlq = "persistent://public/default/client-dlq", "persistent://public/default/client-dlq-poison"
    with client(server.pulsar_url) as pc:
        consumer, dead = dead_lettering(pc, topic, dlq)
        producer = pc.create_producer(topic)
        for payload in (b"poison", b"next"):
            producer.send(payload, partition_key="k")
        seen = []

        def receive() -> pulsar.Message:
            message = consumer.receive(timeout_millis=10_000)
            seen.append((message.data(), message.redelivery_count()))
            return message

        consumer.negative_acknowledge(receive())  # poison, its first failure
        held = receive()  # next, held unacked while poison's nack takes it back
        consumer.negative_acknowledge(receive())  # poison again: over the limit, to the dead-letter topic
        consumer.negative_acknowledge(receive())  # next, its first failure: retried
        consumer.acknowledge(receive())  # next, acked
        letter = dead.receive(timeout_millis=10_000)
        dead.acknowledge(letter)
        with pytest.raises(pulsar.Timeout):
            dead.receive(timeout_millis=500)
    assert held.data() == b"next"
    assert seen == [(b"poison", 0), (b"next", 0), (b"poison", 1), (b"next", 0), (b"next", 1)]
    assert letter.data() == b"poison"


def test_the_clients_dead_letter_policy_keeps_the_messages_properties(server: ServerProcess) -> None:
    """The dead letter the client's own policy produces carries the message's properties, and the properties the
    client adds (where it came from). This client (C++ 4.2) leaves the event time out of the dead letter."""
    topic, dlq = "persistent://public/default/client-dlq-props", "persistent://public/default/client-dlq-props-dead"
    with client(server.pulsar_url) as pc:
        consumer, dead = dead_lettering(pc, topic, dlq)
        producer = pc.create_producer(topic)
        producer.send(b"poison", partition_key="k", properties={"trace": "t-9"}, event_timestamp=1_700_000_000_123)
        for _ in range(2):  # delivered, failed; delivered again, failed again: dead-lettered
            consumer.negative_acknowledge(consumer.receive(timeout_millis=10_000))
        letter = dead.receive(timeout_millis=10_000)
        dead.acknowledge(letter)
    assert letter.data() == b"poison"
    properties = letter.properties()
    assert properties.pop("ORIGIN_MESSAGE_ID").startswith("(0,")  # ledger 0, the message's log position, ...
    assert properties == {"trace": "t-9", "REAL_TOPIC": topic}


def batching_producer(pc: pulsar.Client, topic: str, batching: str, name: str | None = None) -> pulsar.Producer:
    """A producer of ``topic`` with batching ``"off"``, ``"default"`` or ``"key-based"`` (10 messages or 50 ms),
    named ``name`` (None: the server names it)."""
    return pc.create_producer(
        topic,
        producer_name=name,
        batching_enabled=batching != "off",
        batching_type=pulsar.BatchingType.KeyBased if batching == "key-based" else pulsar.BatchingType.Default,
        batching_max_messages=10,
        batching_max_publish_delay_ms=50,
    )


@pytest.mark.parametrize("batching", ["off", "default", "key-based"])
def test_batched_entries_are_split_so_each_message_goes_by_its_own_key(server: ServerProcess, batching: str) -> None:
    """The default batcher packs several keys in one entry; every message still arrives with its own key."""
    topic = f"batching-{batching}"
    with client(server.pulsar_url) as pc:
        consumer = pc.subscribe(topic, "check", consumer_type=pulsar.ConsumerType.KeyShared)
        producer = batching_producer(pc, topic, batching)
        for index in range(60):
            producer.send_async(f"k{index % 6}:{index}".encode(), None, partition_key=f"k{index % 6}")
        producer.flush()
        received = []
        for _ in range(60):
            message = consumer.receive(timeout_millis=10_000)
            received.append((message.partition_key(), message.data().decode()))
            consumer.acknowledge(message)
    assert all(data.startswith(key + ":") for key, data in received)
    by_key: dict[str, list[int]] = defaultdict(list)
    for key, data in received:
        by_key[key].append(int(data.split(":")[1]))
    assert by_key == {f"k{k}": list(range(k, 60, 6)) for k in range(6)}
    assert stored(server, topic) == 60


@pytest.mark.parametrize("batching", ["off", "default", "key-based"])
def test_properties_and_event_time_come_back_as_sent(server: ServerProcess, batching: str) -> None:
    """Each message's own properties and event time, batched or not, reach a Pulsar consumer as sent, and a native
    consumer as properties (the event time as keyfailover.event_time); both get the producer's name."""
    topic = f"properties-{batching}"
    sent: dict[int, tuple[dict[str, str], int]] = {}
    names: set[str | None] = set()
    with client(server.pulsar_url) as pc, Client(server.url, connect_timeout=5.0) as kc:
        consumer = pc.subscribe(topic, "check", consumer_type=pulsar.ConsumerType.KeyShared)
        native = kc.subscribe(topic, "native", "native")
        producer = batching_producer(pc, topic, batching, name="billing")
        for index in range(30):
            properties = {"index": str(index), "trace": f"t-{index % 4}", "ünï": "cödé"} if index % 3 else {}
            event_time = 1_700_000_000_000 + index if index % 2 else 0
            producer.send_async(
                str(index).encode(),
                None,
                properties=properties or None,
                partition_key=f"k{index % 6}",
                event_timestamp=event_time or None,
            )
            sent[index] = (properties, event_time)
        producer.flush()
        received: dict[int, tuple[dict[str, str], int]] = {}
        for _ in range(30):
            message = consumer.receive(timeout_millis=10_000)
            received[int(message.data())] = (message.properties(), message.event_timestamp())
            names.add(message.producer_name())
            consumer.acknowledge(message)
        natively: dict[int, dict[str, str]] = {}
        for _ in range(30):
            delivered = native.receive(timeout=10)
            natively[int(delivered.payload)] = dict(delivered.properties)
            names.add(delivered.producer)
            native.acknowledge(delivered)
    assert received == sent
    assert names == {"billing"}
    assert natively == {
        index: properties | ({EVENT_TIME_PROPERTY: str(event_time)} if event_time else {})
        for index, (properties, event_time) in sent.items()
    }


def test_a_native_producers_properties_reach_pulsar_consumers_and_readers(server: ServerProcess) -> None:
    """Properties a native producer sent are a Pulsar message's properties; a keyfailover.event_time holding an
    event time is its event time, anything else in it an ordinary property. Consumers and readers get the name of
    the producer, native or Pulsar, the latter named by the server when it gave no name."""
    topic = "native-properties"
    stamped = {"trace": "t-1", EVENT_TIME_PROPERTY: "1718000000123"}
    with client(server.pulsar_url) as pc, Client(server.url, connect_timeout=5.0) as kc:
        consumer = pc.subscribe(topic, "check", consumer_type=pulsar.ConsumerType.KeyShared)
        producer = kc.create_producer(topic, "billing")
        producer.send(b"a", "k", properties=stamped)
        producer.send(b"b", "k", properties={EVENT_TIME_PROPERTY: "soon"})
        producer.send(b"c", "k")
        unnamed = pc.create_producer(topic)
        unnamed.send(b"d", partition_key="k")
        got = []
        for _ in range(4):
            message = consumer.receive(timeout_millis=10_000)
            got.append((message.data(), message.properties(), message.event_timestamp(), message.producer_name()))
            consumer.acknowledge(message)
        reader = pc.create_reader(topic, pulsar.MessageId.earliest)
        read = [reader.read_next(timeout_millis=10_000) for _ in range(4)]
    assert unnamed.producer_name().startswith("pulsar-")
    expected = [
        (b"a", {"trace": "t-1"}, 1718000000123, "billing"),
        (b"b", {EVENT_TIME_PROPERTY: "soon"}, 0, "billing"),
        (b"c", {}, 0, "billing"),
        (b"d", {}, 0, unnamed.producer_name()),
    ]
    assert got == expected
    assert [
        (message.data(), message.properties(), message.event_timestamp(), message.producer_name()) for message in read
    ] == expected


def test_a_partitioned_topic_with_a_router_that_follows_keyfailovers_partitions(server: ServerProcess) -> None:
    """Partition p of a keyfailover topic holds a block of hash slots: the client's router sends each key there."""
    created = Request(f"{server.admin_url}/topics?topic=split&partitions=3", method="POST")
    with urlopen(created, timeout=10) as response:
        assert json.loads(response.read())["partitions"] == 3
    with client(server.pulsar_url) as pc:
        consumer = pc.subscribe("split", "all", consumer_type=pulsar.ConsumerType.KeyShared)
        producer = pc.create_producer(
            "split", message_router=lambda message, partitions: partition_of_key(message.partition_key(), partitions)
        )
        for index in range(90):
            producer.send(str(index).encode(), partition_key=f"k{index % 9}")
        by_key: dict[str, list[int]] = defaultdict(list)
        for _ in range(90):
            message = consumer.receive(timeout_millis=10_000)
            by_key[message.partition_key()].append(int(message.data()))
            consumer.acknowledge(message)
    assert by_key == {f"k{k}": list(range(k, 90, 9)) for k in range(9)}
    assert sum(stored(server, f"split-partition-{p}") for p in range(3)) == 90


def test_the_last_message_id_is_the_topics_last_position(server: ServerProcess) -> None:
    with client(server.pulsar_url) as pc:
        consumer = pc.subscribe("lastid", "all", consumer_type=pulsar.ConsumerType.KeyShared)
        assert consumer.get_last_message_id().entry_id() == -1  # nothing stored yet
        producer = pc.create_producer("lastid")
        ids = [producer.send(str(index).encode(), partition_key="k") for index in range(5)]
        last = consumer.get_last_message_id()
        assert (last.ledger_id(), last.entry_id()) == (ids[-1].ledger_id(), ids[-1].entry_id()) == (0, 5)


def test_what_is_not_served_fails_at_once_instead_of_being_retried_until_the_timeout(server: ServerProcess) -> None:
    """A non-persistent topic and a lookup naming an advertised listener are refused with NotAllowedError,
    which the client takes as final; an error it retries would end in its operation timeout (pulsar.Timeout)."""
    with client(server.pulsar_url, timeout=60) as pc, pytest.raises(pulsar.NotAllowedError):
        pc.create_producer("non-persistent://public/default/volatile")
    assert server.pulsar_url is not None
    named = pulsar.Client(server.pulsar_url, operation_timeout_seconds=60, listener_name="external", logger=QUIET)
    try:
        with pytest.raises(pulsar.NotAllowedError):
            named.create_producer("listened")
    finally:
        named.close()


def test_a_pattern_consumer_gets_the_messages_of_the_topics_its_pattern_matches(server: ServerProcess) -> None:
    with client(server.pulsar_url) as pc:
        producers = {name: pc.create_producer(name) for name in ("pattern-a", "pattern-b", "unpatterned")}
        for name, producer in producers.items():
            producer.send(name.encode(), partition_key="k")
        consumer = pc.subscribe(
            re.compile("persistent://public/default/pattern-.*"),
            "s",
            consumer_type=pulsar.ConsumerType.KeyShared,
            initial_position=pulsar.InitialPosition.Earliest,
        )
        got = sorted(consumer.receive(timeout_millis=10_000).data() for _ in range(2))
        assert got == [b"pattern-a", b"pattern-b"]
        with pytest.raises(pulsar.Timeout):
            consumer.receive(timeout_millis=300)


def test_a_reader_from_the_earliest_message_reads_the_log_in_order_and_follows_its_tail(server: ServerProcess) -> None:
    with client(server.pulsar_url) as pc:
        producer = pc.create_producer("readme")
        for index in range(30):
            producer.send(str(index).encode(), partition_key=f"k{index % 3}")
        reader = pc.create_reader("readme", pulsar.MessageId.earliest)
        taken = [reader.read_next(10_000) for _ in range(30)]
        assert [m.message_id().entry_id() for m in taken] == list(range(1, 31))
        assert [int(m.data()) for m in taken] == list(range(30))
        assert not reader.has_message_available()
        for index in range(30, 35):
            producer.send(str(index).encode(), partition_key=f"k{index % 3}")
        assert [int(reader.read_next(10_000).data()) for _ in range(5)] == list(range(30, 35))
        reader.close()
        again = pc.create_reader("readme", pulsar.MessageId.earliest)  # a reader keeps no cursor: from the start
        assert int(again.read_next(10_000).data()) == 0


def test_a_reader_of_a_partitioned_topic_reads_every_partition(server: ServerProcess) -> None:
    created = Request(f"{server.admin_url}/topics?topic=readparts&partitions=3", method="POST")
    with urlopen(created, timeout=10):
        pass
    with client(server.pulsar_url) as pc:
        route = partition_of_key
        producer = pc.create_producer("readparts", message_router=lambda message, n: route(message.partition_key(), n))
        for index in range(30):
            producer.send(str(index).encode(), partition_key=f"k{index % 5}")
        reader = pc.create_reader("readparts", pulsar.MessageId.earliest)
        by_key: dict[str, list[int]] = defaultdict(list)
        for _ in range(30):
            message = reader.read_next(10_000)
            by_key[message.partition_key()].append(int(message.data()))
    assert by_key == {f"k{k}": list(range(k, 30, 5)) for k in range(5)}


def test_a_reader_from_the_latest_or_from_a_message_id(server: ServerProcess) -> None:
    with client(server.pulsar_url) as pc:
        producer = pc.create_producer("readfrom")
        ids = [producer.send(str(index).encode(), partition_key="k") for index in range(20)]
        latest = pc.create_reader("readfrom", pulsar.MessageId.latest)
        after = pc.create_reader("readfrom", ids[9])
        including = pc.create_reader("readfrom", ids[9], start_message_id_inclusive=True)
        producer.send(b"new", partition_key="k")
        producer.send(b"newer", partition_key="k")
        assert [latest.read_next(10_000).data() for _ in range(2)] == [b"new", b"newer"]
        assert [after.read_next(10_000).data() for _ in range(12)] == [str(i).encode() for i in range(10, 20)] + [
            b"new",
            b"newer",
        ]
        assert including.read_next(10_000).data() == b"9"


def test_a_reader_at_the_latest_message_sees_a_message_on_its_way(server: ServerProcess) -> None:
    """A reader started at MessageId.latest that has taken nothing yet answers has_message_available() by
    comparing the mark-delete position with the last message id: the mark-delete position is what the
    application took, so a message sent to the reader and not yet read counts, whether or not it is on the wire."""
    with client(server.pulsar_url) as pc:
        producer = pc.create_producer("available")
        for index in range(20):
            reader = pc.create_reader("available", pulsar.MessageId.latest)
            producer.send(str(index).encode(), partition_key="k")
            assert reader.has_message_available(), f"round {index}: the message sent was not available"
            assert reader.read_next(10_000).data() == str(index).encode()
            assert not reader.has_message_available()
            reader.close()


def test_a_new_subscription_starts_at_the_initial_position_the_consumer_asks_for(server: ServerProcess) -> None:
    """Latest (Pulsar's default): only what comes after the subscription was made, kept for it while no
    consumer is there; Earliest: the whole log. An existing subscription keeps its place either way."""
    with client(server.pulsar_url) as pc:
        producer = pc.create_producer("positions")
        for index in range(5):
            producer.send(f"old-{index}".encode(), partition_key="k")
        latest = pc.subscribe("positions", "latest", consumer_type=pulsar.ConsumerType.KeyShared)
        earliest = pc.subscribe(
            "positions",
            "earliest",
            consumer_type=pulsar.ConsumerType.KeyShared,
            initial_position=pulsar.InitialPosition.Earliest,
        )
        latest.close()  # the subscription stays: what comes now is kept for it
        producer.send(b"new", partition_key="k")
        assert [earliest.receive(timeout_millis=10_000).data() for _ in range(6)] == [
            *(f"old-{index}".encode() for index in range(5)),
            b"new",
        ]
        again = pc.subscribe(
            "positions",
            "latest",
            consumer_type=pulsar.ConsumerType.KeyShared,
            initial_position=pulsar.InitialPosition.Earliest,  # it exists: its own place, not the earliest
        )
        assert again.receive(timeout_millis=10_000).data() == b"new"


def live_subscriptions(server: ServerProcess, topic: str) -> list[str]:
    with urlopen(f"{server.admin_url}/stats", timeout=10) as response:
        found = json.loads(response.read())["subscriptions"]
    return [s["subscription"] for s in found if s["topic"] == topic]


def test_unsubscribe_ends_the_subscription_and_is_refused_while_it_has_other_consumers(server: ServerProcess) -> None:
    with client(server.pulsar_url) as pc:
        first = pc.subscribe("leaving", "sub", consumer_type=pulsar.ConsumerType.KeyShared, consumer_name="first")
        second = pc.subscribe("leaving", "sub", consumer_type=pulsar.ConsumerType.KeyShared, consumer_name="second")
        with pytest.raises(pulsar.PulsarException):
            first.unsubscribe()  # second is still there: refused, nothing changes
        assert live_subscriptions(server, "leaving") == ["sub"]
        second.close()
        first.unsubscribe()  # the last consumer: the subscription ends
        assert live_subscriptions(server, "leaving") == []


def test_a_native_and_a_pulsar_consumer_share_one_subscription(server: ServerProcess) -> None:
    """Pulsar's and keyfailover's clients meet in one subscription: its ranges tile the slots between them,
    and each key's messages (produced by the Pulsar client) go to one of the two, in order."""
    with client(server.pulsar_url) as pc, Client(server.url, connect_timeout=5.0) as kc:
        native = kc.subscribe("mixed", "shared", "native")
        foreign = pc.subscribe("mixed", "shared", consumer_type=pulsar.ConsumerType.KeyShared, consumer_name="pulsar")
        with urlopen(f"{server.admin_url}/ranges?topic=mixed&subscription=shared", timeout=10) as response:
            owners = {entry["consumer"] for entry in json.loads(response.read())["ranges"]}
        assert owners == {"native", "pulsar"}
        producer = pc.create_producer("persistent://public/default/mixed")
        for index in range(200):
            producer.send(str(index).encode(), partition_key=f"k{index % 20}")
        got: dict[str, list[tuple[str, int]]] = defaultdict(list)
        while sum(map(len, got.values())) < 200:
            with contextlib.suppress(Timeout):
                message = native.receive(timeout=0.05)
                assert isinstance(message.key, str)
                got[message.key].append(("native", int(message.payload)))
                native.acknowledge(message)
            with contextlib.suppress(pulsar.Timeout):
                received = foreign.receive(timeout_millis=50)
                got[received.partition_key()].append(("pulsar", int(received.data())))
                foreign.acknowledge(received)
    assert {by for messages in got.values() for by, _ in messages} == {"native", "pulsar"}
    for key, messages in got.items():
        assert len({by for by, _ in messages}) == 1, f"{key} went to both consumers: {messages}"
        assert [index for _, index in messages] == list(range(int(key[1:]), 200, 20))


def test_a_server_crash_mid_stream_loses_nothing_and_stores_nothing_twice(tmp_path: Path) -> None:
    """The client resends what was not confirmed; the producer's name and sequence ids drop what was stored."""
    pulsar_port = free_port()
    options = ("--metrics-port", "0", "--pulsar-port", str(pulsar_port))
    first = ServerProcess(tmp_path / "data", *options).start()
    confirmed: list[int] = []
    failed: list[str] = []
    try:
        with client(first.pulsar_url, timeout=60) as pc:
            producer = pc.create_producer(
                "crash", producer_name="steady", send_timeout_millis=0, block_if_queue_full=True
            )

            def sent(result: pulsar.Result, _: pulsar.MessageId) -> None:
                if result == pulsar.Result.Ok:
                    confirmed.append(1)
                else:
                    failed.append(str(result))

            for index in range(300):
                producer.send_async(str(index).encode(), sent, partition_key=f"k{index % 7}")
            wait_until(lambda: len(confirmed) >= 100, "a third of the messages confirmed before the crash")
            first.kill()
            for index in range(300, 600):
                producer.send_async(str(index).encode(), sent, partition_key=f"k{index % 7}")
            second = ServerProcess(tmp_path / "data", *options, port=first.port).start()
            try:
                producer.flush()
                assert (len(confirmed), failed) == (600, [])
                assert stored(second, "crash") == 600
                consumer = pc.subscribe(
                    "crash",
                    "all",
                    consumer_type=pulsar.ConsumerType.KeyShared,
                    initial_position=pulsar.InitialPosition.Earliest,
                )
                payloads = []
                for _ in range(600):
                    message = consumer.receive(timeout_millis=10_000)
                    payloads.append(int(message.data()))
                    consumer.acknowledge(message)
                assert sorted(payloads) == list(range(600))
            finally:
                second.stop()
    finally:
        first.stop()


def test_a_token_is_required_when_the_server_has_one(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with ServerProcess(tmp_path / "data", "--token-file", str(token_file), "--pulsar-port", "0") as secured:
        with client(secured.pulsar_url, TOKEN) as pc:
            pc.create_producer("secured").send(b"with the token")
        with client(secured.pulsar_url, "wrong", timeout=3) as pc, pytest.raises(pulsar.PulsarException):
            pc.create_producer("secured")
        with RawPulsar(secured.pulsar_url or "") as raw:
            raw.send(connect_command("wrong"))
            frames = raw.until_closed()
        assert [frame.command.type for frame in frames] == [BaseCommand.ERROR]
        assert frames[0].command.error.error == AuthenticationError
        assert "wrong or missing token" in frames[0].command.error.message


def test_pulsar_ssl_with_a_token_and_a_client_that_trusts_another_authority(tmp_path: Path) -> None:
    """``--tls-cert`` serves the Pulsar port as ``pulsar+ssl://``: a client trusting the server's CA produces
    and consumes (its lookups answered with the TLS URL), one trusting another CA never connects."""
    authority = trustme.CA()
    issued = authority.issue_cert("127.0.0.1")
    ca, other_ca, cert, key = (tmp_path / name for name in ("ca.pem", "other-ca.pem", "server.pem", "server.key"))
    authority.cert_pem.write_to_path(str(ca))
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    options = ("--tls-cert", str(cert), "--tls-key", str(key), "--token-file", str(token_file), "--pulsar-port", "0")
    with ServerProcess(tmp_path / "data", *options) as secured:
        url = secured.pulsar_url or ""
        assert url.startswith("pulsar+ssl://127.0.0.1:")
        auth = pulsar.AuthenticationToken(TOKEN)
        trusted = pulsar.Client(url, authentication=auth, tls_trust_certs_file_path=str(ca), logger=QUIET)
        try:
            consumer = trusted.subscribe("secure", "all", consumer_type=pulsar.ConsumerType.KeyShared)
            producer = trusted.create_producer("secure")
            for index in range(20):
                producer.send(str(index).encode(), partition_key=f"k{index % 4}")
            received = []
            for _ in range(20):
                message = consumer.receive(timeout_millis=10_000)
                received.append(int(message.data()))
                consumer.acknowledge(message)
            assert sorted(received) == list(range(20))
        finally:
            trusted.close()
        stranger = pulsar.Client(
            url, authentication=auth, tls_trust_certs_file_path=str(other_ca), operation_timeout_seconds=3, logger=QUIET
        )
        try:
            with pytest.raises(pulsar.PulsarException):
                stranger.create_producer("secure")
        finally:
            stranger.close()


@pytest.mark.parametrize(
    ("consumer_type", "sub_type"),
    [
        (pulsar.ConsumerType.Exclusive, CommandSubscribe.Exclusive),
        (pulsar.ConsumerType.Shared, CommandSubscribe.Shared),
        (pulsar.ConsumerType.Failover, CommandSubscribe.Failover),
    ],
)
def test_the_other_subscription_types_are_served(
    server: ServerProcess, consumer_type: pulsar.ConsumerType, sub_type: int
) -> None:
    """Exclusive, Shared and Failover were refused before issue 40; tests/test_pulsar_subtypes.py has what they do."""
    name = CommandSubscribe.SubType.Name(sub_type)  # type: ignore[arg-type]
    with client(server.pulsar_url) as pc:
        pc.subscribe(f"served-{name}", "s", consumer_type=consumer_type).close()
    with RawPulsar(server.pulsar_url or "") as raw:
        raw.send(connect_command(), subscribe_command(f"persistent://public/default/raw-{name}", sub_type))
        assert raw.receive_type(BaseCommand.SUCCESS).success.request_id == 2


def sticky(name: str, pc: pulsar.Client, topic: str, *ranges: tuple[int, int]) -> pulsar.Consumer:
    """A Key_Shared STICKY consumer ``name`` of ``topic``'s subscription "s" declaring ``ranges``."""
    policy = pulsar.ConsumerKeySharedPolicy(key_shared_mode=pulsar.KeySharedMode.Sticky, sticky_ranges=list(ranges))
    return pc.subscribe(
        topic, "s", consumer_type=pulsar.ConsumerType.KeyShared, consumer_name=name, key_shared_policy=policy
    )


def take(consumer: pulsar.Consumer, count: int) -> list[tuple[str, int]]:
    """``count`` messages of ``consumer`` as (key, index), each acked."""
    taken = []
    for _ in range(count):
        message = consumer.receive(timeout_millis=10_000)
        taken.append((message.partition_key(), int(message.data())))
        consumer.acknowledge(message)
    return taken


def test_sticky_consumers_get_the_keys_of_their_own_ranges_and_undeclared_ones_wait(server: ServerProcess) -> None:
    """STICKY: each consumer gets exactly the keys whose hash lies in the ranges it declared, in order;
    the keys of a range nobody declared wait (nothing lost) until a consumer declaring it joins."""
    topic = "sticky-split"
    keys = [f"account-{i}" for i in range(40)]
    produced = [(keys[i % len(keys)], i) for i in range(200)]
    low_half = [(key, i) for key, i in produced if key_hash(key) <= 32767]
    high_half = [(key, i) for key, i in produced if key_hash(key) > 32767]
    assert low_half and high_half
    with client(server.pulsar_url) as pc:
        low = sticky("low", pc, topic, (0, 9999), (10000, 32767))
        producer = pc.create_producer(topic)
        for key, i in produced:
            producer.send(str(i).encode(), partition_key=key)
        assert take(low, len(low_half)) == low_half  # position order is each key's order
        assert owners(server, topic) == [(0, 32767, "low"), (32768, 65535, UNASSIGNED)]
        high = sticky("high", pc, topic, (32768, 65535))
        assert take(high, len(high_half)) == high_half
        assert owners(server, topic) == [(0, 32767, "low"), (32768, 65535, "high")]
        with pytest.raises(pulsar.Timeout):
            low.receive(timeout_millis=300)


def test_ranges_pulsar_sticky_gives_back_what_sticky_consumers_declared(server: ServerProcess) -> None:
    """``keyfailover ranges --pulsar-sticky`` of a STICKY subscription: each consumer's declared ranges
    (adjacent ones as one), the unassigned slots left out."""
    topic = "sticky-export"
    with client(server.pulsar_url) as pc:
        sticky("a", pc, topic, (0, 99), (100, 199), (5000, 5999))
        sticky("b", pc, topic, (60000, 65535))
        assert server.admin_url is not None
        where = ["--admin-url", server.admin_url, "--topic", topic, "--subscription", "s"]
        done = run_cli("ranges", *where, "--pulsar-sticky")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"a": [[0, 199], [5000, 5999]], "b": [[60000, 65535]]}


def owners(server: ServerProcess, topic: str) -> list[tuple[int, int, str]]:
    """The range map of ``topic``'s subscription "s", from the admin endpoint."""
    with urlopen(f"{server.admin_url}/ranges?topic={topic}&subscription=s", timeout=10) as response:
        snapshot = json.loads(response.read())
    return [(r["start"], r["end"], r["consumer"]) for r in snapshot["ranges"]]


def test_a_sticky_consumer_overlapping_another_is_refused_and_changes_nothing(server: ServerProcess) -> None:
    topic = "sticky-overlap"
    with client(server.pulsar_url) as pc:
        first = sticky("first", pc, topic, (0, 40000))
        with pytest.raises(pulsar.ConsumerAssignError):
            sticky("second", pc, topic, (30000, 65535))
        producer = pc.create_producer(topic)
        key = next(f"k{i}" for i in range(1000) if key_hash(f"k{i}") <= 40000)
        producer.send(b"1", partition_key=key)
        assert take(first, 1) == [(key, 1)]
    with RawPulsar(server.pulsar_url or "") as raw:
        raw.send(connect_command(), sticky_subscribe(f"persistent://public/default/{topic}", [(0, 10)], "raw"))
        raw.receive_type(BaseCommand.SUCCESS)
        raw.send(
            sticky_subscribe(f"persistent://public/default/{topic}", [(5, 20)], "raw2", consumer_id=2, request_id=2)
        )
        error = raw.receive_type(BaseCommand.ERROR).error
    assert error.error == ConsumerAssignError
    assert "overlaps [0, 10] of consumer 'raw'" in error.message


def test_an_auto_split_consumer_waits_until_the_sticky_ones_have_left(server: ServerProcess) -> None:
    topic = "sticky-then-auto"
    with client(server.pulsar_url) as pc:
        only = sticky("only", pc, topic, (0, 100))
        with pytest.raises(pulsar.ConsumerBusy):
            pc.subscribe(topic, "s", consumer_type=pulsar.ConsumerType.KeyShared, consumer_name="auto")
        producer = pc.create_producer(topic)
        for i in range(20):
            producer.send(str(i).encode(), partition_key=f"key-{i}")
        only.close()
        auto = pc.subscribe(topic, "s", consumer_type=pulsar.ConsumerType.KeyShared, consumer_name="auto")
        taken = take(auto, 20)  # every key, the undeclared ones included: nothing was lost
    assert sorted(i for _, i in taken) == list(range(20))


def test_the_server_logged_no_traceback(server: ServerProcess) -> None:
    assert "Traceback" not in server.errors(), server.errors()
