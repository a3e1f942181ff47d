"""Pulsar's subscription types Exclusive, Failover and Shared against ``keyfailover serve --pulsar-port``.

The official ``pulsar-client`` wheel subscribes with each type; the raw wire helper plays a
consumer that is killed mid-stream and watches ACTIVE_CONSUMER_CHANGE, which the Python client
does not show. One server serves the whole module.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from urllib.request import Request, urlopen

import pulsar
import pytest

from keyfailover.broker.pulsar.PulsarApi_pb2 import BaseCommand, CommandAck, CommandSubscribe, NotAllowedError
from keyfailover.client import Client
from keyfailover.core.errors import KeyFailoverError
from keyfailover.core.partitions import partition_of_key
from tests.pulsar_wire import RawPulsar, client, command, connect_command, subscribe_command
from tests.server_process import ServerProcess, wait_until

pytestmark = pytest.mark.integration  # a server in a process of its own

EXCLUSIVE, FAILOVER, SHARED, KEY_SHARED = (
    pulsar.ConsumerType.Exclusive,
    pulsar.ConsumerType.Failover,
    pulsar.ConsumerType.Shared,
    pulsar.ConsumerType.KeyShared,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data: Path = tmp_path_factory.mktemp("subtypes") / "data"
    with ServerProcess(data, "--metrics-port", "0", "--pulsar-port", "0", "--session-timeout", "3") as server:
        yield server


@pytest.fixture
def pc(server: ServerProcess) -> Iterator[pulsar.Client]:
    with client(server.pulsar_url) as opened:
        yield opened


def subscribe(pc: pulsar.Client, topic: str, kind: pulsar.ConsumerType, name: str, **more: object) -> pulsar.Consumer:
    """Consumer ``name`` of ``topic``'s subscription "s", of type ``kind``, from the earliest message."""
    return pc.subscribe(
        topic,
        "s",
        consumer_type=kind,
        consumer_name=name,
        initial_position=pulsar.InitialPosition.Earliest,
        **more,
    )


def produce(pc: pulsar.Client, topic: str, indexes: range, keys: int = 7, **options: object) -> None:
    """One message per index, its payload the index, over ``keys`` keys."""
    producer = pc.create_producer(topic, **options)
    for index in indexes:
        producer.send(str(index).encode(), partition_key=f"k{index % keys}")
    producer.close()


def indexes(consumer: pulsar.Consumer, count: int, ack: bool = True) -> list[int]:
    """The payloads of ``count`` messages of ``consumer``, in the order received, each acked with ``ack``."""
    taken = []
    for _ in range(count):
        message = consumer.receive(timeout_millis=10_000)
        taken.append(int(message.data()))
        if ack:
            consumer.acknowledge(message)
    return taken


def receives_nothing(consumer: pulsar.Consumer) -> bool:
    with contextlib.suppress(pulsar.Timeout):
        consumer.receive(timeout_millis=300)
        return False
    return True


def describe(server: ServerProcess, topic: str) -> dict[str, object]:
    """The admin view of ``topic``'s subscription "s"."""
    with urlopen(f"{server.admin_url}/stats", timeout=10) as response:
        found: list[dict[str, object]] = json.loads(response.read())["subscriptions"]
    return next(s for s in found if s["topic"] == topic and s["subscription"] == "s")


def test_exclusive_refuses_a_second_consumer_and_delivers_in_order(server: ServerProcess, pc: pulsar.Client) -> None:
    """A second consumer of an Exclusive subscription, of any type, is refused with ConsumerBusy and changes
    nothing; the one consumer gets every message in log order, and a cumulative ack acks everything up to it:
    the consumer subscribing again gets only what came after."""
    topic = "exclusive-order"
    first = subscribe(pc, topic, EXCLUSIVE, "first")
    with pytest.raises(pulsar.ConsumerBusy):
        subscribe(pc, topic, EXCLUSIVE, "second")
    with pytest.raises(pulsar.ConsumerBusy):
        subscribe(pc, topic, SHARED, "third")
    produce(pc, topic, range(40))
    received = []
    for _ in range(40):
        message = first.receive(timeout_millis=10_000)
        received.append(int(message.data()))
        if int(message.data()) == 24:
            first.acknowledge_cumulative(message)
    assert received == list(range(40))
    first.close()
    again = subscribe(pc, topic, EXCLUSIVE, "again")
    assert indexes(again, 15) == list(range(25, 40))
    assert receives_nothing(again)
    assert describe(server, topic)["subscription_type"] == "exclusive"
    again.close()


def test_a_delivery_time_is_not_honoured_on_exclusive(pc: pulsar.Client) -> None:
    """Pulsar delays messages on Shared and Key_Shared subscriptions only: an Exclusive one gets them at once."""
    topic = "exclusive-undelayed"
    consumer = subscribe(pc, topic, EXCLUSIVE, "now")
    producer = pc.create_producer(topic)
    producer.send(b"0", partition_key="k", deliver_after=timedelta(hours=1))
    producer.send(b"1", partition_key="k")
    assert indexes(consumer, 2) == [0, 1]
    consumer.close()


def test_failover_delivers_to_the_first_by_name_and_moves_on_when_it_closes(
    server: ServerProcess, pc: pulsar.Client
) -> None:
    """Three Failover consumers: only the first by name receives; closed with messages unacked, those go to
    the next by name, in order, and so on."""
    topic = "failover-close"
    charlie = subscribe(pc, topic, FAILOVER, "charlie")
    alpha = subscribe(pc, topic, FAILOVER, "alpha")
    bravo = subscribe(pc, topic, FAILOVER, "bravo")
    assert describe(server, topic)["active_consumer"] == "alpha"
    produce(pc, topic, range(30))
    assert indexes(alpha, 10) == list(range(10))
    assert indexes(alpha, 20, ack=False) == list(range(10, 30))
    assert receives_nothing(bravo) and receives_nothing(charlie)
    alpha.close()
    assert indexes(bravo, 20) == list(range(10, 30))
    assert receives_nothing(charlie)
    produce(pc, topic, range(30, 35))
    assert indexes(bravo, 5) == list(range(30, 35))
    bravo.close()
    produce(pc, topic, range(35, 40))
    assert indexes(charlie, 5) == list(range(35, 40))
    charlie.close()


def test_a_failover_switch_waits_for_the_old_active_consumer_to_ack(server: ServerProcess, pc: pulsar.Client) -> None:
    """ "b" holds six unacked messages when "a" joins and becomes active: "b" drains, its acks are taken, and "a"
    never gets those messages (never two consumers holding one key), only what comes after."""
    topic = "failover-drain"
    b = subscribe(pc, topic, FAILOVER, "b")
    produce(pc, topic, range(6))
    held = [b.receive(timeout_millis=10_000) for _ in range(6)]
    assert [int(message.data()) for message in held] == list(range(6))
    a = subscribe(pc, topic, FAILOVER, "a")
    wait_until(lambda: describe(server, topic)["active_consumer"] == "a", "a active", 10)
    for message in held:
        b.acknowledge(message)
    produce(pc, topic, range(6, 10))
    assert indexes(a, 4) == list(range(6, 10))
    assert receives_nothing(a) and receives_nothing(b)
    a.close()
    b.close()


def test_a_killed_active_consumer_hands_its_unacked_messages_to_the_next_one(
    server: ServerProcess, pc: pulsar.Client
) -> None:
    """A raw Failover consumer is told ACTIVE_CONSUMER_CHANGE (active) after its SUCCESS, gets messages, and its
    connection breaks: the client's consumer next in name order gets them all, in order."""
    topic = "failover-killed"
    url = server.pulsar_url or ""
    with RawPulsar(url) as raw:
        sub = subscribe_command(f"persistent://public/default/{topic}", CommandSubscribe.Failover, consumer="a-raw")
        sub.subscribe.subscription = "s"
        sub.subscribe.initialPosition = CommandSubscribe.Earliest
        raw.send(connect_command(), sub)
        raw.receive_type(BaseCommand.SUCCESS)
        change = raw.receive_type(BaseCommand.ACTIVE_CONSUMER_CHANGE).active_consumer_change
        assert (change.consumer_id, change.is_active) == (1, True)
        standby = subscribe(pc, topic, FAILOVER, "b-client")
        raw.send(command(BaseCommand.FLOW, consumer_id=1, messagePermits=100))
        produce(pc, topic, range(12))
        got = [raw.receive_type(BaseCommand.MESSAGE).message.message_id.entryId for _ in range(12)]
        assert got == list(range(1, 13))
    assert indexes(standby, 12) == list(range(12))
    standby.close()


def test_a_standby_is_told_when_it_becomes_active(server: ServerProcess, pc: pulsar.Client) -> None:
    """ACTIVE_CONSUMER_CHANGE: a joiner behind the active consumer is told it is not active; when the active one
    leaves, it is told it is, and gets what its FLOW asked for while it stood by."""
    topic = "failover-told"
    active = subscribe(pc, topic, FAILOVER, "a-client")
    with RawPulsar(server.pulsar_url or "") as raw:
        sub = subscribe_command(f"persistent://public/default/{topic}", CommandSubscribe.Failover, consumer="z-raw")
        sub.subscribe.subscription = "s"
        raw.send(connect_command(), sub)
        raw.receive_type(BaseCommand.SUCCESS)
        assert raw.receive_type(BaseCommand.ACTIVE_CONSUMER_CHANGE).active_consumer_change.is_active is False
        raw.send(command(BaseCommand.FLOW, consumer_id=1, messagePermits=3))
        produce(pc, topic, range(5))
        assert indexes(active, 5) == list(range(5))
        active.close()
        assert raw.receive_type(BaseCommand.ACTIVE_CONSUMER_CHANGE).active_consumer_change.is_active is True
        produce(pc, topic, range(5, 10))
        got = [raw.receive_type(BaseCommand.MESSAGE).message.message_id.entryId for _ in range(3)]
        assert got == [6, 7, 8]  # its 3 permits: positions 6 to 8 hold indexes 5 to 7


def test_failover_spreads_the_partitions_of_a_partitioned_topic(server: ServerProcess, pc: pulsar.Client) -> None:
    """Partition i goes to the consumer at i modulo the count, in name order: with two consumers and three
    partitions, "a" gets partitions 0 and 2, "b" partition 1."""
    topic = "failover-split"
    created = Request(f"{server.admin_url}/topics?topic={topic}&partitions=3", method="POST")
    with urlopen(created, timeout=10):
        pass
    a = subscribe(pc, topic, FAILOVER, "a")
    b = subscribe(pc, topic, FAILOVER, "b")
    router = lambda message, partitions: partition_of_key(message.partition_key(), partitions)  # noqa: E731
    produce(pc, topic, range(60), keys=30, message_router=router)
    seen: dict[str, set[str]] = {"a": set(), "b": set()}
    total = 0
    while total < 60:
        for name, consumer in (("a", a), ("b", b)):
            with contextlib.suppress(pulsar.Timeout):
                message = consumer.receive(timeout_millis=200)
                seen[name].add(message.topic_name().rsplit("-", 1)[1])
                consumer.acknowledge(message)
                total += 1
    assert seen == {"a": {"0", "2"}, "b": {"1"}}
    a.close()
    b.close()


def test_shared_consumers_both_receive_one_key_and_nothing_is_lost(server: ServerProcess, pc: pulsar.Client) -> None:
    """Shared is the unordered consume mode: two consumers share even the messages of one key."""
    topic = "shared-one-key"
    first = subscribe(pc, topic, SHARED, "first", receiver_queue_size=5)
    second = subscribe(pc, topic, SHARED, "second", receiver_queue_size=5)
    produce(pc, topic, range(60), keys=1)
    got: dict[str, list[int]] = {"first": [], "second": []}
    while len(got["first"]) + len(got["second"]) < 60:
        for name, consumer in (("first", first), ("second", second)):
            with contextlib.suppress(pulsar.Timeout):
                message = consumer.receive(timeout_millis=200)
                got[name].append(int(message.data()))
                consumer.acknowledge(message)
    assert sorted(got["first"] + got["second"]) == list(range(60))
    assert got["first"] and got["second"]
    view = describe(server, topic)
    assert (view["subscription_type"], view["consume_mode"], view["saved_consume_mode"]) == (
        "shared",
        "unordered",
        "ordered",
    )
    first.close()
    second.close()


def test_another_type_is_refused_until_the_consumers_have_left(server: ServerProcess, pc: pulsar.Client) -> None:
    """A subscriber of another type than the connected consumers is refused with ConsumerBusy; once they have
    left, the next subscriber's type wins. A native consumer, which names no type, may not join a Failover one."""
    topic = "type-change"
    shared = subscribe(pc, topic, SHARED, "shared")
    for kind in (KEY_SHARED, EXCLUSIVE, FAILOVER):
        with pytest.raises(pulsar.ConsumerBusy):
            subscribe(pc, topic, kind, f"other-{kind}")
    shared.close()
    failover = subscribe(pc, topic, FAILOVER, "failover")
    assert describe(server, topic)["subscription_type"] == "failover"
    with Client(server.url) as native, pytest.raises(KeyFailoverError, match="Subscription is of different type"):
        native.subscribe(topic, "s", "native")
    failover.close()
    keyed = subscribe(pc, topic, KEY_SHARED, "keyed")
    assert describe(server, topic)["subscription_type"] == "key_shared"
    produce(pc, topic, range(3))
    assert indexes(keyed, 3) == [0, 1, 2]
    keyed.close()


@pytest.mark.parametrize(("kind", "refused"), [(CommandSubscribe.Shared, True), (CommandSubscribe.Failover, False)])
def test_a_cumulative_ack_is_refused_on_shared_and_taken_on_failover(
    server: ServerProcess, pc: pulsar.Client, kind: int, refused: bool
) -> None:
    """A cumulative ack asking for a response: on Shared, ACK_RESPONSE NotAllowedError and nothing acked (the
    messages come again); on Failover, every message up to it is acked."""
    topic = f"cumulative-{CommandSubscribe.SubType.Name(kind)}"  # type: ignore[arg-type]
    produce(pc, topic, range(3))
    with RawPulsar(server.pulsar_url or "") as raw:
        sub = subscribe_command(f"persistent://public/default/{topic}", kind, consumer="raw")
        sub.subscribe.subscription = "s"
        sub.subscribe.initialPosition = CommandSubscribe.Earliest
        raw.send(connect_command(), sub)
        raw.receive_type(BaseCommand.SUCCESS)  # a FLOW before it finds no consumer yet
        raw.send(command(BaseCommand.FLOW, consumer_id=1, messagePermits=10))
        for _ in range(3):
            raw.receive_type(BaseCommand.MESSAGE)
        ack = command(BaseCommand.ACK, consumer_id=1, ack_type=CommandAck.Cumulative, request_id=9)
        ack.ack.message_id.add(ledgerId=0, entryId=2)
        raw.send(ack)
        answer = raw.receive_type(BaseCommand.ACK_RESPONSE).ackResponse
    assert answer.request_id == 9 and answer.HasField("error") is refused
    if refused:
        assert answer.error == NotAllowedError and "not allowed on Shared and Key_Shared" in answer.message
    consumer = subscribe(pc, topic, SHARED if refused else FAILOVER, "again")
    assert sorted(indexes(consumer, 3 if refused else 1)) == ([0, 1, 2] if refused else [2])
    consumer.close()


def test_a_cumulative_ack_leaves_what_was_sent_after_its_message(server: ServerProcess, pc: pulsar.Client) -> None:
    """Position 1 is nacked and sent again after position 2: a cumulative ack of 2 acks 2 only, as the client may
    not have processed the second 1 yet (it comes again to the next consumer); one of a message not out with the
    consumer any more acks nothing."""
    topic = "cumulative-sent-order"
    produce(pc, topic, range(2), keys=2)
    with RawPulsar(server.pulsar_url or "") as raw:
        sub = subscribe_command(f"persistent://public/default/{topic}", CommandSubscribe.Exclusive, consumer="raw")
        sub.subscribe.subscription = "s"
        sub.subscribe.initialPosition = CommandSubscribe.Earliest
        raw.send(connect_command(), sub)
        raw.receive_type(BaseCommand.SUCCESS)
        raw.send(command(BaseCommand.FLOW, consumer_id=1, messagePermits=2))
        got = [raw.receive_type(BaseCommand.MESSAGE).message.message_id.entryId for _ in range(2)]
        assert got == [1, 2]
        redeliver = command(BaseCommand.REDELIVER_UNACKNOWLEDGED_MESSAGES, consumer_id=1)
        redeliver.redeliverUnacknowledgedMessages.message_ids.add(ledgerId=0, entryId=1)
        raw.send(redeliver, command(BaseCommand.FLOW, consumer_id=1, messagePermits=1))
        assert raw.receive_type(BaseCommand.MESSAGE).message.message_id.entryId == 1
        for request_id in (7, 8):  # the second: 2 is not out with the consumer any more
            ack = command(BaseCommand.ACK, consumer_id=1, ack_type=CommandAck.Cumulative, request_id=request_id)
            ack.ack.message_id.add(ledgerId=0, entryId=2)
            raw.send(ack)
            answer = raw.receive_type(BaseCommand.ACK_RESPONSE).ackResponse
            assert answer.HasField("error") is (request_id == 8), answer
    again = subscribe(pc, topic, EXCLUSIVE, "again")
    assert indexes(again, 1) == [0]
    assert receives_nothing(again)
    again.close()


def test_native_consumers_ask_for_failover_with_priorities_and_share_it_with_a_pulsar_consumer(
    server: ServerProcess, pc: pulsar.Client
) -> None:
    """A native consumer asks for a type (protocol version 9): "low" has priority level 1, "high" and the Pulsar
    consumer "pulsar" level 0, so "high" (before "pulsar" by name) is active, gets every slot, and when it
    closes with messages unacked, "pulsar" gets them."""
    topic = "native-failover"
    with Client(server.url) as native:
        low = native.subscribe(topic, "s", "a-low", subscription_type="failover", priority_level=1)
        high = native.subscribe(topic, "s", "high", subscription_type="failover")
        bystander = subscribe(pc, topic, FAILOVER, "pulsar")
        wait_until(lambda: (high.ranges, low.ranges) == ([(0, 65535)], []), "the active consumer's ranges", 10)
        producer = native.create_producer(topic)
        for index in range(6):
            producer.send(str(index).encode(), f"k{index}")
        producer.flush()
        taken = [high.receive(timeout=10) for _ in range(6)]
        assert [int(message.payload) for message in taken] == list(range(6))
        for message in taken[:2]:
            high.acknowledge_confirmed(message)
        high.close()
        assert indexes(bystander, 4) == [2, 3, 4, 5]
        bystander.close()
        producer.send(b"6", "k6")
        producer.flush()
        assert low.receive(timeout=10).payload == b"6"
        only = native.subscribe("native-exclusive", "s", "one", subscription_type="exclusive")
        with pytest.raises(KeyFailoverError, match="Exclusive consumer is already connected"):
            native.subscribe("native-exclusive", "s", "two", subscription_type="exclusive")
        only.close()
        with pytest.raises(KeyFailoverError, match="subscription type must be one of"):
            native.subscribe(topic, "s", "odd", subscription_type="Failover")  # type: ignore[arg-type]


def test_no_traceback_in_the_server_log(server: ServerProcess) -> None:
    assert server.process is not None and server.process.poll() is None
    assert "Traceback" not in server.errors(), server.errors()
