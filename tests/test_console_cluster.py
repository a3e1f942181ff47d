"""The console's cluster view on two real brokers: both listed and reachable, the coordinator, and every
partition with the broker ZooKeeper gave it and the owner epoch it opened it at."""

from __future__ import annotations

import json
from typing import Any
from urllib.request import urlopen

from keyfailover.core.partitions import partition_topic
from tests.server_process import ServerProcess
from tests.test_cluster_failover import served_by, status
from tests.test_cluster_metrics import PARTITIONS, Cluster, broker_id, opened_at, two_brokers

__all__ = ["two_brokers"]  # the fixture, used here


def cluster_view(process: ServerProcess) -> Any:
    assert process.admin_url is not None
    with urlopen(f"{process.admin_url}/console/cluster", timeout=10) as response:
        return json.load(response)


def test_each_broker_shows_the_whole_cluster(two_brokers: Cluster) -> None:
    found = status(two_brokers.url)
    owners = {(t, p): b for (t, p), b in served_by(two_brokers.url).items() if t == two_brokers.topic}
    printed = {**opened_at(two_brokers.brokers[0])}
    for process in two_brokers.brokers[1:]:
        for served, epoch in opened_at(process).items():
            printed[served] = max(epoch, printed.get(served, 0))
    for process in two_brokers.brokers:
        view = cluster_view(process)
        assert (view["cluster"], view["joined"], view["broker"]) == (True, True, broker_id(process))
        assert view["coordinator"] == found["coordinator"]
        assert (view["epoch"], view["generation"]) == (found["assignment"]["epoch"], found["assignment"]["generation"])
        assert {b["id"]: b["reachable"] for b in view["brokers"]} == {broker_id(p): True for p in two_brokers.brokers}
        rows = {(p["topic"], p["partition"]): p for p in view["partitions"] if p["topic"] == two_brokers.topic}
        assert {key: row["broker"] for key, row in rows.items()} == owners
        assert {key: row["owner_epoch"] for key, row in rows.items()} == {
            (t, p): printed[partition_topic(t, p, PARTITIONS)] for t, p in owners
        }
