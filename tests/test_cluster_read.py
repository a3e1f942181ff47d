"""Reads by position in a cluster: real brokers over the test session's ZooKeeper and PostgreSQL, a client
that knows only one of them reading every partition from the broker serving it, before and after a move."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from keyfailover.client import Client
from keyfailover.core.partitions import partition_of_key, partition_topic
from keyfailover.tools.services import PostgreSQL, ZooKeeper
from keyfailover.wire.protocol import MAX_READ, Entries, Error, ErrorCode, Read
from tests.server_process import RawConnection, wait_until
from tests.test_cluster_failover import WAIT, running, served_by

PARTITIONS = 4


@pytest.fixture
def cluster(zookeeper: ZooKeeper) -> Iterator[str]:
    """A fresh cluster root in the shared ZooKeeper."""
    yield f"zk://{zookeeper.hosts}/kf-read-{uuid.uuid4().hex[:8]}"


def test_a_read_follows_each_partition_to_its_broker_and_after_the_partition_moves(
    cluster: str, postgres: PostgreSQL
) -> None:
    keys = [f"account-{i}" for i in range(60)]
    with running(cluster, postgres, 2, PARTITIONS) as (topic, brokers):
        first, second = brokers
        owners = served_by(cluster)
        moved = next(p for (t, p), owner in owners.items() if t == topic and owner == f"127.0.0.1:{second.port}")
        expected = {p: [k for k in keys if partition_of_key(k, PARTITIONS) == p] for p in range(PARTITIONS)}
        with Client(f"kf://127.0.0.1:{first.port}", connect_timeout=WAIT) as client:
            producer = client.create_producer(topic, "reader-test")
            for key in keys:
                producer.send(key.encode(), key)
            producer.close()
            for partition in range(PARTITIONS):
                entries = client.read(topic, partition, limit=MAX_READ)
                assert [m.key for m in entries.messages] == expected[partition]
                assert entries.through == entries.last == len(expected[partition])
            assert client.log_ends(topic) == [len(expected[p]) for p in range(PARTITIONS)]
            # The broker a client did not name refuses a partition it does not serve: not_owner.
            with RawConnection(first.port) as raw:
                raw.connect()
                raw.send(Read(req=1, topic=partition_topic(topic, moved, PARTITIONS), after=0, limit=5))
                refusal = raw.receive()
                assert isinstance(refusal, Error) and (refusal.code, refusal.req) == (ErrorCode.NOT_OWNER, 1)
            second.kill()
            wait_until(
                lambda: served_by(cluster).get((topic, moved)) == f"127.0.0.1:{first.port}",
                "the killed broker's partition served by the other",
                timeout=WAIT,
            )
            entries = client.read(topic, moved, after=1, limit=MAX_READ, timeout=WAIT)
            assert [m.key for m in entries.messages] == expected[moved][1:]
            with RawConnection(first.port) as raw:
                raw.connect()
                raw.send(Read(req=2, topic=partition_topic(topic, moved, PARTITIONS), after=0, limit=0))
                assert raw.receive() == Entries(req=2, through=0, last=len(expected[moved]), messages=[])
        assert "Traceback" not in first.errors(), first.errors()
