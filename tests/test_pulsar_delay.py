"""Delayed delivery (Pulsar's ``deliver_at`` and ``deliver_after``) with the real ``pulsar-client`` wheel and natively.

Real time bounds only how long a test waits for a delivery; that a message did not come before its time is
checked against the delivery time the test itself gave it, read from the wall clock when the message arrived,
never by how fast anything went.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pulsar
import pytest

from keyfailover.client import Client
from keyfailover.tools.services import free_port
from keyfailover.wire.properties import DELIVER_AT_PROPERTY
from tests.pulsar_wire import client
from tests.server_process import ServerProcess

pytestmark = pytest.mark.integration  # a server in a process of its own, which a test restarts


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ServerProcess(tmp_path_factory.mktemp("delay") / "data", "--pulsar-port", "0") as started:
        yield started


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def test_a_delayed_message_comes_at_its_time_without_holding_back_its_key(server: ServerProcess) -> None:
    """On Key_Shared a delayed message waits for its time and the key's later message goes out meanwhile (its key's
    order does not hold for it, as in Pulsar); a reader, which Pulsar serves as an Exclusive subscription, gets it
    in position order, not delayed."""
    topic = "delayed"
    with client(server.pulsar_url) as pc:
        consumer = pc.subscribe(topic, "later", consumer_type=pulsar.ConsumerType.KeyShared)
        producer = pc.create_producer(topic)
        deliver_at = now_ms() + 2000
        producer.send(b"delayed", partition_key="k", deliver_at=deliver_at)
        producer.send(b"after it", partition_key="k", deliver_after=timedelta(milliseconds=0))
        producer.send(b"plain", partition_key="k", properties={"trace": "t-1"})
        first = [consumer.receive(timeout_millis=10_000) for _ in range(2)]
        assert [message.data() for message in first] == [b"after it", b"plain"]
        assert first[1].properties() == {"trace": "t-1"}
        for message in first:
            consumer.acknowledge(message)
        delayed = consumer.receive(timeout_millis=10_000)
        arrived = now_ms()
        assert delayed.data() == b"delayed"
        assert arrived >= deliver_at, f"delivered {deliver_at - arrived} ms before its time"
        assert delayed.properties() == {}  # the delivery time is not handed back as a property
        consumer.acknowledge(delayed)
        reader = pc.create_reader(topic, pulsar.MessageId.earliest)
        assert [reader.read_next(10_000).data() for _ in range(3)] == [b"delayed", b"after it", b"plain"]


def test_a_native_producer_delays_a_message_with_the_delivery_time_property(server: ServerProcess) -> None:
    topic = "delayed-native"
    with Client(server.url, connect_timeout=5.0) as kc:
        consumer = kc.subscribe(topic, "later", "c1")
        producer = kc.create_producer(topic)
        deliver_at = now_ms() + 1000
        producer.send(b"delayed", "k", properties={DELIVER_AT_PROPERTY: str(deliver_at)})
        producer.send(b"at once", "k")
        first = consumer.receive(timeout=10)
        assert first.payload == b"at once"
        consumer.acknowledge(first)
        delayed = consumer.receive(timeout=10)
        arrived = now_ms()
        assert delayed.payload == b"delayed"
        assert arrived >= deliver_at, f"delivered {deliver_at - arrived} ms before its time"
        assert dict(delayed.properties) == {DELIVER_AT_PROPERTY: str(deliver_at)}
        consumer.acknowledge(delayed)


def test_a_delayed_message_waits_for_its_time_across_a_server_restart(tmp_path: Path) -> None:
    """The delivery time is stored with the message: a server started again on the log does not deliver it early.
    The producer's name is stored too: the message read back from the log goes out under it, to the consumer and
    to a reader."""
    options = ("--metrics-port", "0", "--pulsar-port", str(free_port()))
    first = ServerProcess(tmp_path / "data", *options).start()
    try:
        with client(first.pulsar_url, timeout=30) as pc:
            consumer = pc.subscribe("restarted", "later", consumer_type=pulsar.ConsumerType.KeyShared)
            producer = pc.create_producer("restarted", producer_name="billing")
            deliver_at = now_ms() + 4000
            producer.send(b"delayed", partition_key="k", deliver_at=deliver_at)
            first.kill()
            second = ServerProcess(tmp_path / "data", *options, port=first.port).start()
            try:
                producer.send(b"after the restart", partition_key="k")
                arrived: dict[bytes, int] = {}
                names = set()
                for _ in range(2):
                    message = consumer.receive(timeout_millis=30_000)
                    arrived[message.data()] = now_ms()
                    names.add(message.producer_name())
                    consumer.acknowledge(message)
                assert set(arrived) == {b"delayed", b"after the restart"}
                assert arrived[b"delayed"] >= deliver_at, f"delivered {deliver_at - arrived[b'delayed']} ms early"
                assert names == {"billing"}
                reader = pc.create_reader("restarted", pulsar.MessageId.earliest)
                assert [reader.read_next(30_000).producer_name() for _ in range(2)] == ["billing", "billing"]
            finally:
                second.stop()
    finally:
        first.stop()
