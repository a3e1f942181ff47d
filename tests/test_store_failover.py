"""The log failing over under traffic: brokers on a Patroni group, its primary killed, then frozen.

Two ``keyfailover serve --cluster`` brokers take the group's URL naming every member as ``--store``.
A producer sends steadily through them while the primary is SIGKILLed (Patroni and PostgreSQL, as a
machine that dies), the killed member comes back as a standby, and then the new primary is SIGSTOPped
(as a machine that freezes). The brokers follow whichever member Patroni promotes; the producer waits
through each switch, refused with the retriable ``store_unavailable`` and resending: no send fails, no
acknowledged message is lost, each key's order holds, no (producer, sequence id) is stored twice,
and each partition had one writer at a time.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any

import asyncpg
import pulsar
import pytest

from keyfailover.broker.storage._postgresql_members import member_urls
from keyfailover.client import Client
from keyfailover.core.partitions import partition_of_key
from keyfailover.tools.services import PatroniGroup, ServiceError, ZooKeeper, free_port
from tests.aio import run_async
from tests.pulsar_wire import QUIET
from tests.server_process import ServerProcess, run_cli, wait_until
from tests.test_cluster_failover import (
    WAIT,
    Traffic,
    check_one_writer,
    check_order,
    consume_all,
    running,
    url_of,
)
from tests.test_pulsar_cluster import Sends, check_first_deliveries_in_order, router


def _promoted(group: PatroniGroup, other_than: str) -> bool:
    """Whether Patroni runs a member other than ``other_than`` as the primary now."""
    try:
        return group.primary() != other_than
    except ServiceError:  # no primary yet
        return False


def _stored_twice(dsn: str, topic: str) -> list[Any]:
    """The (partition, sequence id) pairs of the traffic producer stored more than once."""

    async def fetch() -> list[Any]:
        connection = await asyncpg.connect(dsn)
        try:
            return list(
                await connection.fetch(
                    "SELECT partition, seq FROM kf_messages WHERE topic = $1 AND producer = 'traffic'", topic
                )
            )
        finally:
            await connection.close()

    rows: list[Any] = []

    def fetched() -> bool:
        # A member that was just killed or frozen may still take the connection and then reset it: try again.
        try:
            rows[:] = run_async(fetch())
        except (OSError, asyncpg.InterfaceError, asyncpg.PostgresError) as exc:
            print(f"reading the stored messages back failed ({exc!r}); trying again")
            return False
        return True

    wait_until(fetched, "the stored messages read back from the primary", timeout=WAIT)
    counts = Counter((int(row["partition"]), int(row["seq"])) for row in rows)
    return [pair for pair, count in counts.items() if count > 1]


def _flows_again(traffic: Traffic, what: str) -> None:
    """Wait until 200 more messages were acknowledged after ``what``."""
    before = traffic.sent()
    started = time.monotonic()
    wait_until(lambda: traffic.sent() > before + 200, f"traffic acknowledged again after {what}", timeout=WAIT)
    print(f"traffic acknowledged again {time.monotonic() - started:.2f} s after {what}")


def _stop_and_check(
    client: Client, traffic: Traffic, group: PatroniGroup, topic: str, brokers: list[ServerProcess]
) -> None:
    """Stop the traffic: no send failed, every acknowledged message is consumed in each key's order, each
    partition had one writer at a time, and none of the producer's messages was stored twice."""
    traffic.stop()
    assert traffic.failed == []
    check_order(traffic.acked, consume_all(client, topic, traffic.acked))
    check_one_writer(group, topic, 2, brokers)
    assert _stored_twice(group.dsn, topic) == []


@pytest.mark.slow
def test_brokers_follow_the_primary_through_a_kill_and_a_freeze_and_nothing_acknowledged_is_lost(
    zookeeper: ZooKeeper, patroni: PatroniGroup
) -> None:
    standby = next(name for name in patroni.names if name != patroni.primary())
    only_standby = patroni.dsn.replace(",".join(f"127.0.0.1:{patroni.ports[n]}" for n in patroni.names), "")
    only_standby = only_standby.replace("@/", f"@127.0.0.1:{patroni.ports[standby]}/")
    said = _serve_refused(zookeeper, only_standby)
    assert f"127.0.0.1:{patroni.ports[standby]}" in said and "a standby, read-only" in said
    cluster = f"zk://{zookeeper.hosts}/kf-store-failover-{uuid.uuid4().hex[:8]}"
    with running(cluster, patroni, 2, 2) as (topic, brokers):
        keys = [f"key-{i}" for i in range(8)]
        assert {partition_of_key(k, 2) for k in keys} == {0, 1}
        with Client(url_of(brokers)) as client:
            traffic = Traffic(client, topic, keys).start()
            wait_until(lambda: traffic.sent() > 300, "traffic through both partitions")
            first = patroni.primary()
            patroni.kill(first)
            wait_until(lambda: _promoted(patroni, first), "the standby promoted", timeout=WAIT)
            _flows_again(traffic, "the primary's kill")
            patroni.restart(first)
            second = patroni.wait_until_ready()
            patroni.suspend(second)
            try:
                wait_until(lambda: _promoted(patroni, second), "the rejoined member promoted", timeout=WAIT)
                _flows_again(traffic, "the primary froze")
            finally:
                patroni.resume(second)
            # Read the store back once the woken primary stepped down: until then it takes a connection, then drops it.
            assert patroni.wait_until_ready() == first
            _stop_and_check(client, traffic, patroni, topic, brokers)
        assert all(process.process is not None and process.process.poll() is None for process in brokers)


@pytest.mark.slow
def test_partitions_of_a_broker_killed_while_the_store_fails_over_are_served_once_a_primary_writes(
    zookeeper: ZooKeeper, patroni: PatroniGroup
) -> None:
    """The survivor is given the dead broker's partitions while no member accepts writes: it opens them once
    Patroni promotes the standby, so traffic to every partition is acknowledged again."""
    cluster = f"zk://{zookeeper.hosts}/kf-store-failover-{uuid.uuid4().hex[:8]}"
    with running(cluster, patroni, 2, 2) as (topic, brokers):
        keys = [f"key-{i}" for i in range(8)]
        with Client(url_of(brokers)) as client:
            traffic = Traffic(client, topic, keys).start()
            wait_until(lambda: traffic.sent() > 300, "traffic through both partitions")
            first = patroni.primary()
            patroni.kill(first)
            brokers[0].kill()
            wait_until(lambda: _promoted(patroni, first), "the standby promoted", timeout=WAIT)
            acked = {key: len(numbers) for key, numbers in traffic.acked.items()}
            wait_until(
                lambda: all(len(traffic.acked[key]) > acked.get(key, 0) + 20 for key in keys),
                "every key acknowledged again, through the survivor",
                timeout=WAIT,
            )
            _stop_and_check(client, traffic, patroni, topic, brokers)


@pytest.mark.slow
def test_a_pulsar_producer_waits_through_a_primary_kill_and_each_key_stays_in_order(
    zookeeper: ZooKeeper, patroni: PatroniGroup
) -> None:
    """The official Pulsar client sends through the kill: refused with ServiceNotReady, its connection closed,
    it reconnects and resends in order; every send is confirmed, nothing stored twice, each key in order."""
    count, keys = 600, 12
    cluster = f"zk://{zookeeper.hosts}/kf-store-pulsar-{uuid.uuid4().hex[:8]}"
    with running(cluster, patroni, 2, 2, "--pulsar-port", "0") as (topic, brokers):
        client = pulsar.Client(brokers[0].pulsar_url or "", operation_timeout_seconds=30, logger=QUIET)
        try:
            consumer = client.subscribe(topic, "all", consumer_type=pulsar.ConsumerType.KeyShared)
            producer = client.create_producer(
                topic, producer_name="traffic", message_router=router, send_timeout_millis=0, block_if_queue_full=True
            )
            sends = Sends()
            for index in range(count):
                if index == count // 3:
                    patroni.kill(patroni.primary())
                producer.send_async(str(index).encode(), sends.callback(index), partition_key=f"k{index % keys}")
            producer.flush()
            assert sends.failed == [] and sorted(sends.confirmed) == list(range(count))
            check_first_deliveries_in_order(consumer, count)
        finally:
            client.close()
        assert _stored_twice(patroni.dsn, topic) == []


def _serve_refused(zookeeper: ZooKeeper, store: str) -> str:
    """Run a broker on ``store`` that must refuse to start: its stderr, one line without a traceback."""
    cluster = f"zk://{zookeeper.hosts}/kf-store-refused-{uuid.uuid4().hex[:8]}"
    done = run_cli("serve", "--cluster", cluster, "--store", store, "--port", str(free_port()))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done.stderr


def test_a_store_url_with_no_reachable_member_is_refused_in_one_line_naming_each(zookeeper: ZooKeeper) -> None:
    first, second = free_port(), free_port()
    said = _serve_refused(
        zookeeper, f"postgresql://kf@127.0.0.1:{first},127.0.0.1:{second}/kf?target_session_attrs=read-write"
    )
    assert f"127.0.0.1:{first}: connection refused" in said
    assert f"127.0.0.1:{second}: connection refused" in said


def test_a_url_naming_every_member_gives_one_url_per_member_with_the_rest_unchanged() -> None:
    dsn = "postgresql://kf:secret@10.0.0.1:5432,10.0.0.2:5433/kf?target_session_attrs=read-write"
    assert member_urls(dsn) == [
        "postgresql://kf:secret@10.0.0.1:5432/kf?target_session_attrs=read-write",
        "postgresql://kf:secret@10.0.0.2:5433/kf?target_session_attrs=read-write",
    ]
    assert member_urls("postgresql://127.0.0.1:5432/kf") == ["postgresql://127.0.0.1:5432/kf"]
    assert member_urls("postgresql://a,b/kf") == ["postgresql://a/kf", "postgresql://b/kf"]
