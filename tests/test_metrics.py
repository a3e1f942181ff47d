"""keyfailover.metrics: the collector's families and values for dispatchers in known states.

Every scrape goes through prometheus_client's text format and its parser, as Prometheus
would read it. Expected values come from the test's own account of what each consumer was
given and did (a :class:`Recorder` around the dispatcher) and from ``ranges()``, not from
the collector; time comes from a manual clock.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import replace
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from keyfailover.core.dispatcher import Delivery, Dispatcher
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hash
from keyfailover.core.histogram import Histogram
from keyfailover.integrations.metrics import (
    METRIC_NAMES,
    ClusterView,
    KeyFailoverCollector,
    ServedPartition,
    ServerView,
    SubscriptionView,
)

SUB = {"topic": "orders", "partition": "", "subscription": "billing"}  # one partition: partition is empty

# The metrics issues 4 and 12 ask for: family name -> (type, labels besides topic, partition and subscription).
CONSUMER = ("consumer",)
SPEC: dict[str, tuple[str, tuple[str, ...]]] = {
    "keyfailover_range_start": ("gauge", ("consumer", "range")),
    "keyfailover_range_end": ("gauge", ("consumer", "range")),
    "keyfailover_range_share": ("gauge", CONSUMER),
    "keyfailover_traffic_share": ("gauge", CONSUMER),
    "keyfailover_consumer_ranges": ("gauge", CONSUMER),
    "keyfailover_messages_dispatched": ("counter", CONSUMER),
    "keyfailover_messages_acked": ("counter", CONSUMER),
    "keyfailover_messages_redelivered": ("counter", CONSUMER),
    "keyfailover_dispatch_rate": ("gauge", CONSUMER),
    "keyfailover_unacked_messages": ("gauge", CONSUMER),
    "keyfailover_permits": ("gauge", CONSUMER),
    "keyfailover_draining_hashes": ("gauge", CONSUMER),
    "keyfailover_replay_messages": ("gauge", CONSUMER),
    "keyfailover_consumer_stuck": ("gauge", CONSUMER),
    "keyfailover_consumer_stalled": ("gauge", CONSUMER),
    "keyfailover_leases_expired": ("counter", CONSUMER),
    "keyfailover_backlog_messages": ("gauge", ()),
    "keyfailover_unassigned_share": ("gauge", ()),
    "keyfailover_delivery_latency_seconds": ("histogram", ()),
    "keyfailover_rebalances": ("counter", ("reason",)),
    "keyfailover_rebalance_duration_seconds": ("histogram", ()),
    "keyfailover_rebalance_stickiness": ("gauge", ()),
    "keyfailover_load_imbalance": ("gauge", ()),
    "keyfailover_consumers": ("gauge", ()),
    "keyfailover_range_map_epoch": ("gauge", ()),
    "keyfailover_dead_lettered": ("counter", ()),
    "keyfailover_dead_letters_unconfirmed": ("gauge", ()),
    "keyfailover_ack_timeout_seconds": ("gauge", ()),
    "keyfailover_backoff_messages": ("gauge", ()),
    "keyfailover_backoff_keys": ("gauge", ()),
    "keyfailover_rebalance_policy_info": ("gauge", ("policy", "max_ranges")),  # an info family, as text format shows it
    "keyfailover_consume_mode_info": ("gauge", ("mode",)),
}
SERVER_SPEC: dict[str, tuple[str, tuple[str, ...]]] = {
    "keyfailover_log_appended": ("counter", ()),
    "keyfailover_log_commit_seconds": ("histogram", ()),
    "keyfailover_entry_cache_bytes": ("gauge", ()),
    "keyfailover_entry_cache_hits": ("counter", ()),
    "keyfailover_entry_cache_misses": ("counter", ()),
    "keyfailover_connections": ("gauge", ()),
    "keyfailover_protocol_errors": ("counter", ("code",)),
}
# A broker of a cluster (issue 14): family name -> (type, labels).
CLUSTER_SPEC: dict[str, tuple[str, tuple[str, ...]]] = {
    "keyfailover_cluster_partition_served": ("gauge", ("topic", "partition")),
    "keyfailover_cluster_partition_owner_epoch": ("gauge", ("topic", "partition")),
    "keyfailover_cluster_coordinator": ("gauge", ()),
    "keyfailover_cluster_epoch": ("gauge", ()),
    "keyfailover_cluster_generation": ("gauge", ()),
    "keyfailover_cluster_assigned_partitions": ("gauge", ()),
    "keyfailover_cluster_brokers": ("gauge", ()),
    "keyfailover_cluster_partitions_acquired": ("counter", ()),
    "keyfailover_cluster_partitions_released": ("counter", ()),
    "keyfailover_cluster_partition_acquire_seconds": ("histogram", ()),
}


class Recorder:
    """Drives a dispatcher on a manual clock and keeps its own account of every consumer."""

    def __init__(self, *, shift_interval: float = 30.0, shift_min_traffic: float = 1000.0) -> None:
        self.now = 100.0
        self.dispatcher = Dispatcher(
            clock=lambda: self.now, shift_interval=shift_interval, shift_min_traffic=shift_min_traffic, half_life=60.0
        )
        self.keys: dict[int, str] = {}  # position -> key, every published message
        self.acked: set[int] = set()
        self.permits: Counter[str] = Counter()
        self.delivered: Counter[str] = Counter()
        self.acks: Counter[str] = Counter()
        self.redelivered: Counter[str] = Counter()
        self.inflight: defaultdict[str, dict[int, Delivery]] = defaultdict(dict)
        self.reasons: Counter[str] = Counter()

    def at(self, now: float) -> Recorder:
        self.now = now
        return self

    def join(self, *consumers: str) -> None:
        for consumer in consumers:
            self.dispatcher.add_consumer(consumer)
            self.reasons["join"] += 1

    def leave(self, consumer: str, reason: str = "leave") -> None:
        self.dispatcher.remove_consumer(consumer, reason=reason)
        self.reasons[reason] += 1
        for bookkeeping in (self.permits, self.delivered, self.acks, self.redelivered, self.inflight):
            bookkeeping.pop(consumer, None)

    def flow(self, consumer: str, permits: int) -> None:
        self.dispatcher.flow(consumer, permits)
        self.permits[consumer] += permits

    def publish(self, keys: Iterable[str]) -> None:
        for key in keys:
            position = len(self.keys)
            self.dispatcher.publish(position, key)
            self.keys[position] = key

    def poll(self) -> list[Delivery]:
        deliveries = self.dispatcher.poll()
        for delivery in deliveries:
            self.permits[delivery.consumer] -= 1
            self.delivered[delivery.consumer] += 1
            self.redelivered[delivery.consumer] += delivery.redelivery_count > 0
            self.inflight[delivery.consumer][delivery.position] = delivery
        return deliveries

    def ack(self, deliveries: Iterable[Delivery]) -> None:
        for delivery in deliveries:
            self.dispatcher.ack(delivery.consumer, delivery.position)
            del self.inflight[delivery.consumer][delivery.position]
            self.acks[delivery.consumer] += 1
            self.acked.add(delivery.position)

    def nack(self, delivery: Delivery) -> None:
        """The delivery and every later one of its key on that consumer go back to pending."""
        self.dispatcher.nack(delivery.consumer, delivery.position)
        held = self.inflight[delivery.consumer]
        for position in [p for p, d in held.items() if d.key == delivery.key and p >= delivery.position]:
            del held[position]

    def owner(self, key: str) -> str:
        slot = key_hash(key)
        (consumer,) = [c for start, end, c in self.dispatcher.ranges() if start <= slot <= end]
        return consumer

    def waiting(self) -> Counter[str]:
        """Messages neither acked nor in flight, by the consumer that now owns their key."""
        out = {p for deliveries in self.inflight.values() for p in deliveries}
        return Counter(self.owner(k) for p, k in self.keys.items() if p not in self.acked and p not in out)

    def draining(self) -> dict[str, int]:
        """Distinct slots of keys in flight on a consumer that no longer owns them (G1: blocked)."""
        return {
            consumer: len({key_hash(str(d.key)) for d in held.values() if self.owner(str(d.key)) != consumer})
            for consumer, held in self.inflight.items()
        }


def keys_in(recorder: Recorder, consumer: str, count: int, prefix: str) -> list[str]:
    """``count`` keys whose slots lie in ``consumer``'s current ranges."""
    owned = recorder.dispatcher.ranges_of(consumer)
    candidates = (f"{prefix}{i}" for i in range(200_000))
    found = (key for key in candidates if any(start <= key_hash(key) <= end for start, end in owned))
    return [next(found) for _ in range(count)]


def churned() -> Recorder:
    """Five joins, a leave, a timeout and a load shift; messages pending, in flight and redelivered."""
    r = Recorder(shift_interval=10.0, shift_min_traffic=50.0)
    r.join("c1")
    r.flow("c1", 30)
    r.publish(f"k{i}" for i in range(40))
    first = r.poll()
    r.at(101.0).join("c2")  # c1's keys in c2's half drain until c1 acks them
    r.at(102.5).ack(first)
    r.flow("c2", 20)
    second = r.poll()
    r.nack(second[0])
    r.poll()  # second[0] goes out again, to c2
    r.at(103.0).join("c3", "c4", "c5")
    for consumer in ("c3", "c4", "c5"):
        r.flow(consumer, 5)
    r.publish(f"m{i}" for i in range(60))
    r.poll()
    r.at(104.0).leave("c4", reason="timeout")
    r.at(104.5).leave("c5")
    r.poll()
    r.flow("c3", 200)
    r.publish(keys_in(r, "c3", 150, "hot"))
    r.ack([d for d in r.at(106.0).poll() if d.consumer == "c3"][:100])
    r.at(110.0).poll()  # 10 s after the start: checks the load and shifts a boundary away from c3
    r.reasons["shift"] += r.dispatcher.stats()["rebalances"].get("shift", 0)
    return r


def scrape(
    subscriptions: Callable[[], list[SubscriptionView]], server: Callable[[], ServerView] | None = None
) -> dict[str, Metric]:
    """Register a collector, render the text format and parse it back: family name -> family."""
    registry = CollectorRegistry()
    registry.register(KeyFailoverCollector(subscriptions, server))
    text = generate_latest(registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def scrape_dispatcher(dispatcher: Dispatcher, backlog: int | None = None) -> dict[str, Metric]:
    return scrape(lambda: [SubscriptionView("orders", "billing", dispatcher, backlog)])


def values(families: dict[str, Metric], sample: str, by: str, **labels: str) -> dict[str, float]:
    """The samples named ``sample`` whose labels include ``labels``, keyed by label ``by``."""
    family = families[sample.removesuffix("_total")]
    return {
        s.labels[by]: s.value
        for s in family.samples
        if s.name == sample and all(s.labels.get(name) == value for name, value in labels.items())
    }


def value(families: dict[str, Metric], sample: str, **labels: str) -> float:
    family = families[sample.removesuffix("_total").removesuffix("_sum").removesuffix("_count")]
    (found,) = [s.value for s in family.samples if s.name == sample and s.labels == labels]
    return found


def buckets(families: dict[str, Metric], name: str, **labels: str) -> dict[float, float]:
    """A histogram's cumulative buckets, upper bound -> count."""
    return {
        float(s.labels["le"]): s.value
        for s in families[name].samples
        if s.name == name + "_bucket" and {k: v for k, v in s.labels.items() if k != "le"} == labels
    }


# -- ranges and shares ------------------------------------------------------------------


def per_range(families: dict[str, Metric], sample: str, **labels: str) -> dict[tuple[str, str], float]:
    """A per-range family's samples whose labels include ``labels``, keyed by (consumer, range)."""
    return {
        (s.labels["consumer"], s.labels["range"]): s.value
        for s in families[sample].samples
        if all(s.labels.get(name) == value for name, value in labels.items())
    }


def numbered(ranges: list[tuple[int, int, str]]) -> dict[tuple[str, str], tuple[int, int]]:
    """``(consumer, n)`` -> the consumer's n-th range in hash order, counted from the sorted triples."""
    seen: Counter[str] = Counter()
    found = {}
    for start, end, consumer in ranges:
        found[(consumer, str(seen[consumer]))] = (start, end)
        seen[consumer] += 1
    return found


def test_per_range_series_and_per_consumer_shares_match_the_range_map() -> None:
    r = churned()
    d = r.dispatcher
    families = scrape_dispatcher(d)
    ranges = d.ranges()
    owners = [c for _, _, c in ranges]
    assert sorted(set(owners)) == ["c1", "c2", "c3"]
    # The multi-range policy gave some consumer at least 3 ranges, none of them adjacent.
    assert max(Counter(owners).values()) >= 3
    assert all(a != b for a, b in pairwise(owners))

    expected = numbered(ranges)
    assert per_range(families, "keyfailover_range_start", **SUB) == {key: s for key, (s, _) in expected.items()}
    assert per_range(families, "keyfailover_range_end", **SUB) == {key: e for key, (_, e) in expected.items()}
    assert values(families, "keyfailover_consumer_ranges", "consumer", **SUB) == dict(Counter(owners))
    widths: Counter[str] = Counter()
    for start, end, consumer in ranges:
        widths[consumer] += end - start + 1
    shares = values(families, "keyfailover_range_share", "consumer", **SUB)
    assert shares == {c: width / HASH_RANGE_SIZE for c, width in widths.items()}
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-12)

    traffic = np.asarray(d.traffic())
    loads: defaultdict[str, float] = defaultdict(float)
    for start, end, consumer in ranges:
        loads[consumer] += float(traffic[start : end + 1].sum())
    total = sum(loads.values())
    assert total > 0
    traffic_shares = values(families, "keyfailover_traffic_share", "consumer", **SUB)
    assert traffic_shares == pytest.approx({c: load / total for c, load in loads.items()})
    assert sum(traffic_shares.values()) == pytest.approx(1.0)
    mean = total / len(loads)
    assert value(families, "keyfailover_load_imbalance", **SUB) == pytest.approx(max(loads.values()) / mean)
    assert value(families, "keyfailover_consumers", **SUB) == 3
    assert value(families, "keyfailover_range_map_epoch", **SUB) == d.epoch == sum(r.reasons.values())
    assert value(families, "keyfailover_rebalance_policy_info", policy="multi", max_ranges="16", **SUB) == 1


def test_the_policy_bounds_the_range_series_and_is_reported() -> None:
    capped = Dispatcher(max_ranges=2)
    contiguous = Dispatcher(policy="contiguous")
    for dispatcher in (capped, contiguous):
        for index in range(9):
            dispatcher.add_consumer(f"c{index}")
    families = scrape(
        lambda: [
            SubscriptionView("orders", "capped", capped),
            SubscriptionView("orders", "contiguous", contiguous),
        ]
    )
    for subscription, dispatcher, policy, most in (
        ("capped", capped, "multi", 2),
        ("contiguous", contiguous, "contiguous", 1),
    ):
        labels = {"topic": "orders", "partition": "", "subscription": subscription}
        info = [
            s for s in families["keyfailover_rebalance_policy_info"].samples if s.labels["subscription"] == subscription
        ]
        assert [(s.labels, s.value) for s in info] == [(labels | {"policy": policy, "max_ranges": str(most)}, 1.0)]
        counts = values(families, "keyfailover_consumer_ranges", "consumer", **labels)
        assert counts == dict(Counter(c for _, _, c in dispatcher.ranges()))
        assert set(counts) == {f"c{index}" for index in range(9)} and max(counts.values()) <= most
        # At most `most` series per consumer, numbered from 0, whatever the policy did.
        starts = per_range(families, "keyfailover_range_start", **labels)
        assert set(starts) == {(c, str(n)) for c, count in counts.items() for n in range(int(count))}
        assert starts == {key: s for key, (s, _) in numbered(dispatcher.ranges()).items()}
    assert max(values(families, "keyfailover_consumer_ranges", "consumer", subscription="capped").values()) == 2


def test_each_subscription_sums_to_one_and_one_without_consumers_reports_zero() -> None:
    busy = churned().dispatcher
    pair = Recorder()
    pair.join("a", "b")
    empty = Recorder()
    empty.join("gone")
    empty.leave("gone")
    families = scrape(
        lambda: [
            SubscriptionView("orders", "billing", busy),
            SubscriptionView("orders", "audit", pair.dispatcher),
            SubscriptionView("payments", "billing", empty.dispatcher, backlog=12),
        ]
    )
    for topic, subscription, dispatcher in (("orders", "billing", busy), ("orders", "audit", pair.dispatcher)):
        labels = {"topic": topic, "subscription": subscription}
        shares = values(families, "keyfailover_range_share", "consumer", **labels)
        assert set(shares) == set(dispatcher.consumers())
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-12)
    gone = {"topic": "payments", "partition": "", "subscription": "billing"}
    assert value(families, "keyfailover_consumers", **gone) == 0
    assert values(families, "keyfailover_range_share", "consumer", **gone) == {}
    assert value(families, "keyfailover_backlog_messages", **gone) == 12  # the log's backlog, when given
    assert values(families, "keyfailover_rebalances_total", "reason", **gone) == {
        "join": 1,
        "leave": 1,
        "shift": 0,
        "timeout": 0,
        "stuck": 0,
        "recovered": 0,
        "backlog": 0,
    }
    # No traffic: the pair is even, and nothing moved any traffic.
    assert value(families, "keyfailover_load_imbalance", topic="orders", partition="", subscription="audit") == 1.0
    assert values(families, "keyfailover_traffic_share", "consumer", topic="orders", subscription="audit") == {
        "a": 0.0,
        "b": 0.0,
    }


def test_a_sticky_subscription_reports_what_its_consumers_declared_and_what_nobody_did() -> None:
    sticky = Dispatcher(policy="sticky")
    sticky.add_consumer("low", [(0, 8191), (8192, 16383)])  # adjacent: one range of the map
    sticky.add_consumer("third", [(32768, 49151)])
    auto = Recorder()
    auto.join("a", "b")
    families = scrape(
        lambda: [SubscriptionView("orders", "sticky", sticky), SubscriptionView("orders", "auto", auto.dispatcher)]
    )
    labels = {"topic": "orders", "partition": "", "subscription": "sticky"}
    shares = values(families, "keyfailover_range_share", "consumer", **labels)
    assert shares == {"low": 0.25, "third": 0.25}
    assert value(families, "keyfailover_unassigned_share", **labels) == 0.5
    assert value(families, "keyfailover_consumer_ranges", consumer="low", **labels) == 1
    assert value(families, "keyfailover_rebalance_policy_info", policy="sticky", max_ranges="1024", **labels) == 1
    assert value(families, "keyfailover_unassigned_share", topic="orders", partition="", subscription="auto") == 0


# -- per-consumer counters and gauges ---------------------------------------------------


def test_per_consumer_values_match_what_each_consumer_was_given_and_did() -> None:
    r = churned()
    stats = r.dispatcher.stats()
    families = scrape_dispatcher(r.dispatcher)
    consumers = {"c1", "c2", "c3"}

    def of(name: str) -> dict[str, float]:
        found = values(families, name, "consumer", **SUB)
        assert set(found) == consumers, name
        return found

    assert of("keyfailover_messages_dispatched_total") == {c: r.delivered[c] for c in consumers}
    assert of("keyfailover_messages_acked_total") == {c: r.acks[c] for c in consumers}
    assert of("keyfailover_messages_redelivered_total") == {c: r.redelivered[c] for c in consumers}
    assert of("keyfailover_unacked_messages") == {c: len(r.inflight[c]) for c in consumers}
    assert of("keyfailover_permits") == {c: r.permits[c] for c in consumers}
    waiting = r.waiting()
    assert of("keyfailover_replay_messages") == {c: waiting[c] for c in consumers}
    draining = r.draining()
    assert of("keyfailover_draining_hashes") == {c: draining.get(c, 0) for c in consumers}
    assert of("keyfailover_dispatch_rate") == {c: stats["consumers"][c]["rate"] for c in consumers}
    assert value(families, "keyfailover_backlog_messages", **SUB) == len(r.keys) - len(r.acked)
    # The scenario reaches every state these gauges describe, so none of the checks above is vacuous.
    assert sum(r.redelivered.values()) > 0
    assert all(of("keyfailover_dispatch_rate")[c] > 0 for c in consumers)
    assert sum(waiting.values()) > 0 and any(r.inflight[c] for c in consumers) and any(r.permits.values())


def test_rebalances_by_reason_and_stickiness_of_the_last_change() -> None:
    r = churned()
    families = scrape_dispatcher(r.dispatcher)
    assert r.reasons == Counter(join=5, leave=1, timeout=1, shift=1)
    reasons = values(families, "keyfailover_rebalances_total", "reason", **SUB)
    expected = ("join", "leave", "shift", "timeout", "stuck", "recovered", "backlog")
    assert reasons == {reason: r.reasons[reason] for reason in expected}
    assert reasons == {reason: r.dispatcher.stats()["rebalances"].get(reason, 0) for reason in reasons}
    last = r.dispatcher.rebalances()[-1]
    assert last.reason == "shift"
    assert value(families, "keyfailover_rebalance_stickiness", **SUB) == last.stickiness
    assert 0.0 < last.stickiness < 1.0


def test_draining_hashes_and_the_duration_of_a_rebalance() -> None:
    r = Recorder()
    r.join("c1")
    r.flow("c1", 30)
    r.publish(f"k{i}" for i in range(40))
    first = r.poll()
    r.at(101.0).join("c2")
    families = scrape_dispatcher(r.dispatcher)
    moved = {key_hash(str(d.key)) for d in first if r.owner(str(d.key)) == "c2"}
    assert moved, "the join moved no key in flight; the scenario needs one"
    assert values(families, "keyfailover_draining_hashes", "consumer", **SUB) == {"c1": len(moved), "c2": 0}
    # The first join drained at once (nothing was in flight): one observation of 0 s.
    assert value(families, "keyfailover_rebalance_duration_seconds_count", **SUB) == 1
    assert value(families, "keyfailover_rebalance_duration_seconds_sum", **SUB) == 0.0

    r.at(102.5).ack(first)
    families = scrape_dispatcher(r.dispatcher)
    assert values(families, "keyfailover_draining_hashes", "consumer", **SUB) == {"c1": 0, "c2": 0}
    assert value(families, "keyfailover_rebalance_duration_seconds_count", **SUB) == 2
    assert value(families, "keyfailover_rebalance_duration_seconds_sum", **SUB) == pytest.approx(1.5)
    cumulative = buckets(families, "keyfailover_rebalance_duration_seconds", **SUB)
    assert cumulative[0.001] == 1 and cumulative[1.0] == 1 and cumulative[2.5] == 2
    assert cumulative[float("inf")] == 2
    counts = [cumulative[bound] for bound in sorted(cumulative)]
    assert counts == sorted(counts)


# -- server-wide metrics ----------------------------------------------------------------


def test_server_metrics_come_from_the_server_view() -> None:
    commits = Histogram()
    for seconds in (0.002, 0.02, 0.2):
        commits.observe(seconds)
    view = ServerView(
        appended=7,
        commit_seconds=commits,
        entry_cache_bytes=4096,
        entry_cache_hits=5,
        entry_cache_misses=2,
        connections=3,
        protocol_errors={"bad_frame": 2, "auth": 1},
    )
    families = scrape(list, lambda: view)
    assert value(families, "keyfailover_log_appended_total") == 7
    assert value(families, "keyfailover_entry_cache_bytes") == 4096
    assert value(families, "keyfailover_entry_cache_hits_total") == 5
    assert value(families, "keyfailover_entry_cache_misses_total") == 2
    assert value(families, "keyfailover_connections") == 3
    assert values(families, "keyfailover_protocol_errors_total", "code") == {"bad_frame": 2, "auth": 1}
    assert value(families, "keyfailover_log_commit_seconds_count") == 3
    assert value(families, "keyfailover_log_commit_seconds_sum") == pytest.approx(0.222)
    cumulative = buckets(families, "keyfailover_log_commit_seconds")
    assert (cumulative[0.001], cumulative[0.0025], cumulative[0.025], cumulative[0.25]) == (0, 1, 2, 3)
    # Without a server view the families are still described, with no samples.
    bare = scrape(list)
    assert all(not bare[name].samples for name in SERVER_SPEC)


# -- a broker of a cluster -------------------------------------------------------------


def coordinator() -> ClusterView:
    """The coordinator of a two-broker cluster serving two of orders' four partitions and audit (one partition)."""
    waits = Histogram()
    for seconds in (0.004, 0.3, 1.2):
        waits.observe(seconds)
    return ClusterView(
        coordinator=True,
        epoch=3,
        generation=7,
        assigned=5,
        brokers=2,
        served=[ServedPartition("orders", 0, 4), ServedPartition("orders", 2, 2), ServedPartition("audit", None, 1)],
        acquired=3,
        released=1,
        acquire_seconds=waits,
    )


def test_a_broker_reports_what_it_serves_and_its_part_in_the_cluster() -> None:
    families = scrape(list, lambda: ServerView(cluster=coordinator()))
    served = {
        (s.labels["topic"], s.labels["partition"]): s.value
        for s in families["keyfailover_cluster_partition_served"].samples
    }
    assert served == {("orders", "0"): 1, ("orders", "2"): 1, ("audit", ""): 1}
    epochs = families["keyfailover_cluster_partition_owner_epoch"].samples
    assert {(s.labels["topic"], s.labels["partition"]): s.value for s in epochs} == {
        ("orders", "0"): 4,
        ("orders", "2"): 2,
        ("audit", ""): 1,
    }
    assert value(families, "keyfailover_cluster_coordinator") == 1
    assert value(families, "keyfailover_cluster_epoch") == 3
    assert value(families, "keyfailover_cluster_generation") == 7
    assert value(families, "keyfailover_cluster_assigned_partitions") == 5
    assert value(families, "keyfailover_cluster_brokers") == 2
    assert value(families, "keyfailover_cluster_partitions_acquired_total") == 3
    assert value(families, "keyfailover_cluster_partitions_released_total") == 1
    assert value(families, "keyfailover_cluster_partition_acquire_seconds_count") == 3
    assert value(families, "keyfailover_cluster_partition_acquire_seconds_sum") == pytest.approx(1.504)
    cumulative = buckets(families, "keyfailover_cluster_partition_acquire_seconds")
    assert (cumulative[0.005], cumulative[0.25], cumulative[0.5], cumulative[2.5]) == (1, 1, 2, 3)


def test_only_the_coordinator_reports_the_assigned_partitions_and_a_single_server_no_cluster_series() -> None:
    follower = replace(coordinator(), coordinator=False, served=[])
    families = scrape(list, lambda: ServerView(cluster=follower))
    assert value(families, "keyfailover_cluster_coordinator") == 0
    assert families["keyfailover_cluster_assigned_partitions"].samples == []
    assert families["keyfailover_cluster_partition_served"].samples == []
    assert value(families, "keyfailover_cluster_brokers") == 2
    single = scrape(list, lambda: ServerView(appended=1))
    assert all(not single[name].samples for name in CLUSTER_SPEC)
    assert value(single, "keyfailover_log_appended_total") == 1


# -- names, types, help ----------------------------------------------------------------


def test_every_family_is_named_typed_and_documented_as_the_issue_asks() -> None:
    r = churned()
    latency = Histogram()
    latency.observe(0.003)
    families = scrape(
        lambda: [SubscriptionView("orders", "billing", r.dispatcher, delivery_seconds=latency)],
        lambda: ServerView(appended=1, connections=1, protocol_errors={"bad_frame": 1}, cluster=coordinator()),
    )
    expected = SPEC | SERVER_SPEC | CLUSTER_SPEC
    assert {name: family.type for name, family in families.items()} == {n: t for n, (t, _) in expected.items()}
    sample_names: set[str] = set()
    for name, family in families.items():
        assert family.documentation.strip(), f"{name} has no help text"
        kind, extra = expected[name]
        scope = () if name in SERVER_SPEC | CLUSTER_SPEC else ("topic", "partition", "subscription")
        assert family.samples, f"{name} has no samples in a state that should give it some"
        for sample in family.samples:
            sample_names.add(sample.name)
            allowed = {"counter": {"_total"}, "gauge": {""}, "histogram": {"_bucket", "_sum", "_count"}}[kind]
            assert sample.name.removeprefix(name) in allowed, f"{sample.name} is not a series of {kind} {name}"
            bucket = ("le",) if sample.name.endswith("_bucket") else ()
            assert sorted(sample.labels) == sorted((*scope, *extra, *bucket)), sample
        if kind == "histogram":
            assert name.endswith("_seconds"), f"{name}: durations are in seconds, the base unit"
    assert sample_names == METRIC_NAMES


@pytest.mark.integration
def test_promtool_finds_no_convention_problem() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus; scripts/setup-system installs it)")
    r = churned()
    registry = CollectorRegistry()
    view = ServerView(appended=1, connections=1, protocol_errors={"bad_frame": 1}, cluster=coordinator())
    registry.register(KeyFailoverCollector(lambda: [SubscriptionView("orders", "billing", r.dispatcher)], lambda: view))
    done = subprocess.run(
        [promtool, "check", "metrics"], input=generate_latest(registry), capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr).decode()


# -- read at scrape time -----------------------------------------------------------------


def test_registering_reads_nothing_and_every_scrape_reads_live_state() -> None:
    calls: list[str] = []
    r = Recorder()
    r.join("c1")
    r.flow("c1", 10)
    r.publish(["a", "b", "c"])
    deliveries = r.poll()

    def views() -> list[SubscriptionView]:
        calls.append("collect")
        return [SubscriptionView("orders", "billing", r.dispatcher)]

    registry = CollectorRegistry()
    registry.register(KeyFailoverCollector(views))
    assert calls == []

    def acked() -> float:
        text = generate_latest(registry).decode()
        families = {family.name: family for family in text_string_to_metric_families(text)}
        return value(families, "keyfailover_messages_acked_total", consumer="c1", **SUB)

    assert acked() == 0
    r.ack(deliveries[:2])
    assert acked() == 2
    assert calls == ["collect", "collect"]


def test_stuck_consumers_expired_leases_and_dead_letters_are_reported() -> None:
    clock = {"now": 0.0}
    dispatcher = Dispatcher(clock=lambda: clock["now"], ack_timeout=5.0, max_redeliveries=0)
    for name in ("a", "b"):
        dispatcher.add_consumer(name)
        dispatcher.flow(name, 10)
    keys = [f"key-{i}" for i in range(50) if dispatcher.owner_of(f"key-{i}") == "a"][:2]
    for position, key in enumerate(keys, start=1):
        dispatcher.publish(position, key)
    dispatcher.poll()
    clock["now"] = 5.0
    dispatcher.poll()  # both leases expire: a is stuck, and with max_redeliveries 0 both are dead letters
    families = scrape_dispatcher(dispatcher)
    assert values(families, "keyfailover_consumer_stuck", "consumer", **SUB) == {"a": 1.0, "b": 0.0}
    assert values(families, "keyfailover_consumer_stalled", "consumer", **SUB) == {"a": 1.0, "b": 0.0}
    assert values(families, "keyfailover_leases_expired_total", "consumer", **SUB) == {"a": 2.0, "b": 0.0}
    assert value(families, "keyfailover_dead_lettered_total", **SUB) == 2
    assert value(families, "keyfailover_dead_letters_unconfirmed", **SUB) == 2
    assert value(families, "keyfailover_ack_timeout_seconds", **SUB) == 5.0
    assert values(families, "keyfailover_rebalances_total", "reason", **SUB)["stuck"] == 1
    dispatcher.dead_lettered([letter.position for letter in dispatcher.dead_letters()])
    assert value(scrape_dispatcher(dispatcher), "keyfailover_dead_letters_unconfirmed", **SUB) == 0


def test_messages_in_nack_backoff_are_reported() -> None:
    clock = {"now": 0.0}
    dispatcher = Dispatcher(clock=lambda: clock["now"], nack_backoff=2.0)
    dispatcher.add_consumer("a")
    dispatcher.flow("a", 10)
    for position, key in enumerate(["k", "k", "other", None], start=1):
        dispatcher.publish(position, key)
    dispatcher.poll()
    dispatcher.nack("a", 1)  # k waits with both its messages
    dispatcher.nack("a", 4)  # the keyless one waits alone
    families = scrape_dispatcher(dispatcher)
    assert value(families, "keyfailover_backoff_messages", **SUB) == 3
    assert value(families, "keyfailover_backoff_keys", **SUB) == 1
    clock["now"] = 2.0
    assert sorted(d.position for d in dispatcher.poll()) == [1, 2, 4]
    families = scrape_dispatcher(dispatcher)
    assert value(families, "keyfailover_backoff_messages", **SUB) == 0
    assert value(families, "keyfailover_backoff_keys", **SUB) == 0


def test_a_partition_dispatchers_traffic_shares_are_read_at_its_own_slots() -> None:
    """A dispatcher over one partition's block: its traffic array starts at the block's first slot."""
    from keyfailover.core.clock import ManualClock
    from keyfailover.core.partitions import partition_of_key, partition_slots

    clock = ManualClock()
    dispatcher = Dispatcher(clock=clock, slots=partition_slots(3, 4))
    for name in ("a", "b"):
        dispatcher.add_consumer(name)
        dispatcher.flow(name, 10_000)
    keys = [key for key in (f"k{i}" for i in range(4000)) if partition_of_key(key, 4) == 3]
    for position, key in enumerate(keys, start=1):
        dispatcher.publish(position, key)
    for delivery in dispatcher.poll():
        dispatcher.ack(delivery.consumer, delivery.position)
    clock.advance(2.0)
    dispatcher.poll()  # measures the traffic
    shares = values(scrape_dispatcher(dispatcher), "keyfailover_traffic_share", "consumer", **SUB)
    assert sum(shares.values()) == pytest.approx(1.0)
    assert all(share > 0.2 for share in shares.values()), shares


def test_delivery_latency_is_a_histogram_per_subscription_and_partition_when_a_log_gives_publish_times() -> None:
    dispatchers = [Dispatcher(), Dispatcher()]
    latencies = [Histogram(), Histogram()]
    for seconds in (0.0004, 0.002, 0.7):
        latencies[0].observe(seconds)
    latencies[1].observe(42.0)
    families = scrape(
        lambda: (
            [
                SubscriptionView("orders", "billing", d, partition=index, delivery_seconds=latency)
                for index, (d, latency) in enumerate(zip(dispatchers, latencies, strict=True))
            ]
            + [SubscriptionView("bare", "billing", Dispatcher())]
        )  # a dispatcher without a log knows no publish times
    )
    first = {"topic": "orders", "partition": "0", "subscription": "billing"}
    second = {**first, "partition": "1"}
    assert value(families, "keyfailover_delivery_latency_seconds_count", **first) == 3
    assert value(families, "keyfailover_delivery_latency_seconds_sum", **first) == pytest.approx(0.7024)
    cumulative = buckets(families, "keyfailover_delivery_latency_seconds", **first)
    assert (cumulative[0.001], cumulative[0.0025], cumulative[1.0], cumulative[float("inf")]) == (1, 2, 3, 3)
    assert value(families, "keyfailover_delivery_latency_seconds_count", **second) == 1
    topics = {s.labels["topic"] for s in families["keyfailover_delivery_latency_seconds"].samples}
    assert topics == {"orders"}


def test_the_partitions_of_a_topic_are_labelled_by_topic_and_partition() -> None:
    """Each partition's dispatcher holds its block of slots; its series say the topic and the partition, so
    the consumers' range shares add up to 1 over the partitions, and one consumer's ranges do not collide."""
    from keyfailover.core.partitions import partition_slots

    dispatchers = [Dispatcher(slots=partition_slots(index, 2)) for index in range(2)]
    for dispatcher in dispatchers:
        dispatcher.add_consumer("a")
        dispatcher.add_consumer("b")
    families = scrape(
        lambda: [SubscriptionView("orders", "billing", d, partition=index) for index, d in enumerate(dispatchers)]
    )
    for index, dispatcher in enumerate(dispatchers):
        labels = {"topic": "orders", "partition": str(index), "subscription": "billing"}
        assert value(families, "keyfailover_consumers", **labels) == 2
        assert per_range(families, "keyfailover_range_start", **labels) == {
            key: start for key, (start, _) in numbered(dispatcher.ranges()).items()
        }
    shares = [s.value for s in families["keyfailover_range_share"].samples if s.labels["topic"] == "orders"]
    assert len(shares) == 4 and sum(shares) == pytest.approx(1.0, abs=1e-12)
    assert {s.labels["partition"] for s in families["keyfailover_range_start"].samples} == {"0", "1"}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-1.0, 400.0, allow_nan=False), max_size=60))
def test_a_histogram_observes_a_batch_as_it_observes_each_value(values: list[float]) -> None:
    one_by_one, batched = Histogram(), Histogram()
    for value in values:
        one_by_one.observe(value)
    batched.observe_many(values)
    assert batched.cumulative() == one_by_one.cumulative()
    assert batched.count == one_by_one.count == len(values)
    assert batched.sum == pytest.approx(one_by_one.sum)
