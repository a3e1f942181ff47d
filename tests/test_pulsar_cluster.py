"""Pulsar clients against a cluster: real ``keyfailover serve --cluster --pulsar-port`` brokers over the test
session's ZooKeeper and PostgreSQL, and the real ``pulsar-client`` wheel.

A client given one broker's Pulsar URL looks each partition up there: the broker answers Connect for
a partition it serves and Redirect to the Pulsar endpoint of the broker that serves it otherwise, so a
produce reaches each partition's owner (a broker refuses a partition it does not serve). When a broker
is killed, its partitions move and the client, looking them up again, follows them; so does a Reader.
"""

from __future__ import annotations

import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator

import pulsar
import pytest

from keyfailover.broker.pulsar import PROTOCOL_VERSION
from keyfailover.broker.pulsar.PulsarApi_pb2 import BaseCommand, CommandLookupTopicResponse
from keyfailover.core.partitions import partition_of_key, partition_topic
from keyfailover.tools.services import PostgreSQL, ZooKeeper
from tests.pulsar_wire import QUIET, RawPulsar, command, connect_command
from tests.server_process import ServerProcess, wait_until
from tests.test_cluster_failover import running, served_by

PARTITIONS = 4


@pytest.fixture
def cluster(zookeeper: ZooKeeper) -> Iterator[str]:
    """A fresh cluster root in the shared ZooKeeper."""
    yield f"zk://{zookeeper.hosts}/kf-pulsar-{uuid.uuid4().hex[:8]}"


def router(message: pulsar.Message, partitions: int) -> int:
    """keyfailover's partition of the message's key (partition p holds a block of hash slots)."""
    return partition_of_key(message.partition_key(), partitions)


def lookup(broker: ServerProcess, topic: str) -> CommandLookupTopicResponse:
    """LOOKUP of ``topic`` (a Pulsar name) asked of ``broker`` over a raw connection."""
    with RawPulsar(broker.pulsar_url or "") as raw:
        raw.send(connect_command(version=PROTOCOL_VERSION))
        raw.receive_type(BaseCommand.CONNECTED)
        raw.send(command(BaseCommand.LOOKUP, topic=topic, request_id=1))
        answer: CommandLookupTopicResponse = raw.receive_type(BaseCommand.LOOKUP_RESPONSE).lookupTopicResponse
        return answer


class Sends:
    """What a Pulsar producer's sends came to: the numbers of those confirmed, and of those failed with why."""

    def __init__(self) -> None:
        self.confirmed: list[int] = []
        self.failed: list[tuple[int, str]] = []
        self._lock = threading.Lock()

    def callback(self, index: int) -> Callable[[pulsar.Result, pulsar.MessageId], None]:
        """The send callback of message ``index``, run on the client's thread."""

        def done(result: pulsar.Result, _: pulsar.MessageId) -> None:
            """Record whether message ``index`` was confirmed."""
            with self._lock:
                if result == pulsar.Result.Ok:
                    self.confirmed.append(index)
                else:
                    self.failed.append((index, str(result)))

        return done


def check_first_deliveries_in_order(consumer: pulsar.Consumer, count: int) -> None:
    """Receive and acknowledge until messages 0 to ``count`` - 1, each numbered in its payload, have all come:
    each key's first deliveries come in the order of their numbers."""
    first_seen: dict[str, list[int]] = defaultdict(list)
    seen: set[int] = set()
    while len(seen) < count:
        message = consumer.receive(timeout_millis=30_000)
        index = int(message.data())
        if index not in seen:
            seen.add(index)
            first_seen[message.partition_key()].append(index)
        consumer.acknowledge(message)
    for key, indexes in first_seen.items():
        assert indexes == sorted(indexes), f"{key}: first deliveries out of order"


def pulsar_of(broker: ServerProcess) -> str:
    return (broker.pulsar_url or "").removeprefix("pulsar://")


def test_a_lookup_redirects_to_the_pulsar_endpoint_of_the_partitions_broker(cluster: str, postgres: PostgreSQL) -> None:
    with running(cluster, postgres, 2, PARTITIONS, "--pulsar-port", "0") as (topic, brokers):
        owners = served_by(cluster)
        by_id = {f"127.0.0.1:{b.port}": b for b in brokers}
        for partition in range(PARTITIONS):
            owner = by_id[owners[topic, partition]]
            for asked in brokers:
                answer = lookup(asked, f"persistent://public/default/{partition_topic(topic, partition, PARTITIONS)}")
                assert answer.authoritative
                assert answer.brokerServiceUrl == owner.pulsar_url
                expected = CommandLookupTopicResponse.Connect if asked is owner else CommandLookupTopicResponse.Redirect
                assert answer.response == expected


def test_pulsar_clients_reach_each_partitions_broker_and_follow_a_killed_brokers_partitions(
    cluster: str, postgres: PostgreSQL
) -> None:
    """A producer and a Key_Shared consumer given the first broker's URL: every message of every partition
    is stored by the partition's owner (another broker refuses it) and consumed, each key in order; then the
    second broker is killed mid-stream and its partitions' messages go on through the broker that takes them:
    nothing confirmed is lost."""
    count, keys = 600, 12
    with running(cluster, postgres, 2, PARTITIONS, "--pulsar-port", "0") as (topic, brokers):
        first, second = brokers
        client = pulsar.Client(first.pulsar_url or "", operation_timeout_seconds=30, logger=QUIET)
        try:
            consumer = client.subscribe(topic, "all", consumer_type=pulsar.ConsumerType.KeyShared)
            producer = client.create_producer(
                topic, producer_name="steady", message_router=router, send_timeout_millis=0, block_if_queue_full=True
            )
            sends = Sends()
            for index in range(count // 2):
                producer.send_async(str(index).encode(), sends.callback(index), partition_key=f"k{index % keys}")
            producer.flush()
            assert sends.failed == [] and sorted(sends.confirmed) == list(range(count // 2))
            second.kill()
            for index in range(count // 2, count):
                producer.send_async(str(index).encode(), sends.callback(index), partition_key=f"k{index % keys}")
            producer.flush()
            assert sends.failed == [] and sorted(sends.confirmed) == list(range(count))
            wait_until(
                lambda: set(served_by(cluster).values()) == {f"127.0.0.1:{first.port}"},
                "the killed broker's partitions served by the other",
            )
            check_first_deliveries_in_order(consumer, count)
        finally:
            client.close()
    assert "Traceback" not in first.errors(), first.errors()


def test_a_reader_follows_its_partition_to_the_broker_that_takes_it(cluster: str, postgres: PostgreSQL) -> None:
    """A Reader of one partition served by the broker that is then killed: after the move it goes on from
    the message after the last one it took (it subscribes again from there), no gap and nothing twice."""
    with running(cluster, postgres, 2, PARTITIONS, "--pulsar-port", "0") as (topic, brokers):
        first, second = brokers
        partition = next(p for (t, p), owner in served_by(cluster).items() if owner == f"127.0.0.1:{second.port}")
        served = partition_topic(topic, partition, PARTITIONS)
        client = pulsar.Client(first.pulsar_url or "", operation_timeout_seconds=30, logger=QUIET)
        try:
            producer = client.create_producer(served, producer_name="one")
            for index in range(40):
                producer.send(str(index).encode())
            reader = client.create_reader(served, pulsar.MessageId.earliest)
            taken = [int(reader.read_next(10_000).data()) for _ in range(20)]
            second.kill()
            wait_until(
                lambda: served_by(cluster).get((topic, partition)) == f"127.0.0.1:{first.port}",
                "the killed broker's partition served by the other",
            )
            taken += [int(reader.read_next(30_000).data()) for _ in range(20)]
            assert taken == list(range(40))
        finally:
            client.close()
