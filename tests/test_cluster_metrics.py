"""The cluster series of real brokers: two ``keyfailover serve --cluster`` processes over the test
session's ZooKeeper and PostgreSQL, each scraped on its own ``/metrics`` (``--metrics-port 0``).

What each broker says is checked against the cluster itself: ZooKeeper's assignment and
coordinator (``keyfailover cluster status``) and the owner epochs the brokers printed when they
opened each partition. Every wait polls for a settled state; nothing is timed.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.request import urlopen

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from keyfailover.client import Client
from keyfailover.core.partitions import partition_topic
from keyfailover.tools.services import PostgreSQL, ZooKeeper
from tests.server_process import ServerProcess, run_cli, wait_until
from tests.test_cluster_failover import WAIT, broker, served_by, status

PARTITIONS = 4
SERVED = "keyfailover_cluster_partition_served"
OWNER_EPOCH = "keyfailover_cluster_partition_owner_epoch"
_SERVES = re.compile(r"broker \S+ serves '([^']+)' at owner epoch (\d+)")


class Scrape:
    """One scrape of a broker's ``/metrics``, parsed as Prometheus would read it."""

    def __init__(self, process: ServerProcess) -> None:
        assert process.admin_url is not None
        with urlopen(f"{process.admin_url}/metrics", timeout=10) as response:
            text = response.read().decode()
        self.families: dict[str, Metric] = {family.name: family for family in text_string_to_metric_families(text)}

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        family = self.families[name.removesuffix("_total").removesuffix("_count")]
        return [(sample.labels, sample.value) for sample in family.samples if sample.name == name]

    def scalar(self, name: str) -> float | None:
        """The value of a series without labels; None when the broker does not export it."""
        found = self.samples(name)
        assert len(found) <= 1, found
        return found[0][1] if found else None

    def served(self) -> dict[tuple[str, str], float]:
        """(topic, partition) -> owner epoch, of every partition the broker serves."""
        served = {(labels["topic"], labels["partition"]) for labels, value in self.samples(SERVED) if value == 1}
        epochs = {(labels["topic"], labels["partition"]): value for labels, value in self.samples(OWNER_EPOCH)}
        assert set(epochs) == served, (epochs, served)
        return epochs


def broker_id(process: ServerProcess) -> str:
    return f"127.0.0.1:{process.port}"


def opened_at(process: ServerProcess) -> dict[str, int]:
    """Served name -> the owner epoch the broker printed when it last opened that partition."""
    return {served: int(epoch) for served, epoch in _SERVES.findall(process.errors())}


def settled(brokers: list[ServerProcess], cluster: str, topic: str) -> bool:
    """Every partition of ``topic`` served by one of ``brokers``, as ZooKeeper assigned it, and every one of
    them applied the assignment ZooKeeper holds now."""
    scrapes = [Scrape(process) for process in brokers]
    found = status(cluster)
    owners = {(t, p): owner for (t, p), owner in served_by(cluster).items() if t == topic}
    written = (found["assignment"]["epoch"], found["assignment"]["generation"])
    return (
        len(owners) == PARTITIONS
        and set(owners.values()) <= {broker_id(process) for process in brokers}
        and all(
            {p for (_, p) in scrape.served()} == {str(p) for (_, p), b in owners.items() if b == broker_id(process)}
            for process, scrape in zip(brokers, scrapes, strict=True)
        )
        and all(
            (scrape.scalar("keyfailover_cluster_epoch"), scrape.scalar("keyfailover_cluster_generation")) == written
            for scrape in scrapes
        )
    )


@dataclass(frozen=True)
class Cluster:
    url: str
    topic: str
    brokers: list[ServerProcess]


@pytest.fixture
def two_brokers(zookeeper: ZooKeeper, postgres: PostgreSQL) -> Iterator[Cluster]:
    """Two brokers with metrics in a fresh cluster, serving the partitions of a fresh topic as ZooKeeper
    assigned them; stopped afterwards."""
    url = f"zk://{zookeeper.hosts}/kf-metrics-{uuid.uuid4().hex[:8]}"
    brokers: list[ServerProcess] = []
    try:
        for _ in range(2):
            brokers.append(broker(url, postgres, "--metrics-port", "0"))
        topic = f"orders-{uuid.uuid4().hex[:6]}"
        created = run_cli("topics", "create", topic, "--partitions", str(PARTITIONS), "--cluster", url)
        assert created.returncode == 0, created.stderr
        wait_until(lambda: settled(brokers, url, topic), "both brokers serving what ZooKeeper assigned", WAIT)
        yield Cluster(url, topic, brokers)
    finally:
        for process in brokers:
            if process.process is not None and process.process.poll() is None:
                process.stop()


def test_two_brokers_serve_every_partition_once_and_one_of_them_coordinates(two_brokers: Cluster) -> None:
    cluster, topic, brokers = two_brokers.url, two_brokers.topic, two_brokers.brokers
    scrapes = [Scrape(process) for process in brokers]
    coordinator = status(cluster)["coordinator"]

    served = [scrape.served() for scrape in scrapes]
    assert sum(len(mine) for mine in served) == PARTITIONS
    assert set().union(*served) == {(topic, str(p)) for p in range(PARTITIONS)}
    assert [len(mine) for mine in served] == [2, 2], "the assignment gives each broker two partitions"
    for process, mine in zip(brokers, served, strict=True):
        printed = opened_at(process)
        assert mine == {(t, p): printed[partition_topic(t, int(p), PARTITIONS)] for t, p in mine}

    flags = {broker_id(p): s.scalar("keyfailover_cluster_coordinator") for p, s in zip(brokers, scrapes, strict=True)}
    assert flags == {b: 1.0 if b == coordinator else 0.0 for b in flags}, "exactly ZooKeeper's coordinator"
    assigned = {
        broker_id(p): s.scalar("keyfailover_cluster_assigned_partitions") for p, s in zip(brokers, scrapes, strict=True)
    }
    assert assigned == {b: PARTITIONS if b == coordinator else None for b in assigned}
    for scrape, mine in zip(scrapes, served, strict=True):
        assert scrape.scalar("keyfailover_cluster_brokers") == 2
        acquired = scrape.scalar("keyfailover_cluster_partitions_acquired_total")
        released = scrape.scalar("keyfailover_cluster_partitions_released_total")
        assert acquired is not None and released is not None and acquired - released == len(mine)
        assert scrape.scalar("keyfailover_cluster_partition_acquire_seconds_count") == acquired

    # A consumer of the topic: each broker reports the subscription of the partitions it serves,
    # labelled with the topic's own name and the partition.
    with Client("kf://" + ",".join(broker_id(p) for p in brokers)) as client:
        consumer = client.subscribe(topic, "billing", "c1")

        def reported() -> list[set[tuple[str, str]]]:
            return [
                {
                    (labels["topic"], labels["partition"])
                    for labels, value in Scrape(process).samples("keyfailover_consumers")
                    if labels["subscription"] == "billing" and value == 1
                }
                for process in brokers
            ]

        wait_until(lambda: reported() == [set(mine) for mine in served], "the consumer on every partition", WAIT)
        shares = [
            value
            for process in brokers
            for labels, value in Scrape(process).samples("keyfailover_range_share")
            if labels["topic"] == topic
        ]
        consumer.close()
    assert len(shares) == PARTITIONS, "c1 owns a block of the hash space per partition"
    assert sum(shares) == pytest.approx(1.0), "and the blocks make up the whole space"


def test_the_survivor_of_a_killed_coordinator_coordinates_and_serves_everything(two_brokers: Cluster) -> None:
    cluster, topic, brokers = two_brokers.url, two_brokers.topic, two_brokers.brokers
    coordinator = status(cluster)["coordinator"]
    (victim,) = [p for p in brokers if broker_id(p) == coordinator]
    (survivor,) = [p for p in brokers if p is not victim]
    before = Scrape(survivor)
    held = len(before.served())
    epoch = before.scalar("keyfailover_cluster_epoch")
    acquired = before.scalar("keyfailover_cluster_partitions_acquired_total")
    assert epoch is not None and acquired is not None
    assert before.scalar("keyfailover_cluster_coordinator") == 0
    victim.kill()
    wait_until(lambda: settled([survivor], cluster, topic), "the survivor serving every partition", WAIT)
    after = Scrape(survivor)
    assert after.scalar("keyfailover_cluster_coordinator") == 1
    assert after.scalar("keyfailover_cluster_assigned_partitions") == PARTITIONS
    assert after.scalar("keyfailover_cluster_brokers") == 1
    assert (after.scalar("keyfailover_cluster_epoch") or 0) > epoch, "a new coordinator, a new epoch"
    assert after.scalar("keyfailover_cluster_partitions_acquired_total") == acquired + PARTITIONS - held
    assert after.scalar("keyfailover_cluster_partition_acquire_seconds_count") == acquired + PARTITIONS - held
    printed = opened_at(survivor)
    assert after.served() == {
        (topic, str(p)): printed[partition_topic(topic, p, PARTITIONS)] for p in range(PARTITIONS)
    }
