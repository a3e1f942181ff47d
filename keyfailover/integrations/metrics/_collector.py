"""A prometheus-client custom collector over the dispatchers' state, read at scrape time.

Nothing here runs per message: the core keeps plain counters and the collector turns them
into metric families when Prometheus scrapes (prometheus_client's custom-collector model).

A consumer may own several ranges (the multi-range policy, at most ``max_ranges`` each, 16
by default; the contiguous policy gives one). ``keyfailover_range_start`` and
``keyfailover_range_end`` have one series per range, labelled by ``consumer`` and ``range``,
the range's ordinal among that consumer's ranges in hash order ("0", "1", ...). The ordinal
rather than the first slot keeps the series count bounded by consumers x ``max_ranges`` for
the life of a subscription: a boundary shift changes the values, not the label set, so it
creates no series. The per-consumer families (shares, counters, ``keyfailover_consumer_ranges``)
have one series per consumer, and ``keyfailover_rebalance_policy_info`` one per subscription.

Every subscription series carries ``topic``, ``partition`` and ``subscription``. Partition p of a
topic T with P > 1 partitions (served as ``T-partition-p``) is labelled ``topic="T"``,
``partition="p"``, its dispatcher holding only that partition's block of slots; a topic of one
partition has ``partition=""``. Prometheus stores a label with an empty value as no label, so the
series of a single server's topics are the same series they were before partitions existed.

A broker of a cluster adds the ``keyfailover_cluster_*`` families (a single server has none): what
it serves, with each partition's owner epoch in PostgreSQL (labelled by ``topic`` and ``partition``
as above), whether it is the coordinator, the epoch and generation of the assignment it applied,
the brokers it knows, and the partitions it took over and gave up. Only the coordinator exports
``keyfailover_cluster_assigned_partitions``, so an alert can compare it with the partitions served
over all brokers without counting it once per broker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from keyfailover.core.dispatcher import Dispatcher
from keyfailover.core.hashing import HASH_RANGE_SIZE
from keyfailover.core.histogram import Histogram
from keyfailover.core.rebalance import UNASSIGNED

__all__ = ["METRIC_NAMES", "ClusterView", "KeyFailoverCollector", "ServedPartition", "ServerView", "SubscriptionView"]

REASONS = ("join", "leave", "shift", "timeout", "stuck", "recovered", "backlog")


@dataclass(frozen=True)
class SubscriptionView:
    """One subscription to report: its dispatcher and, with a log behind it, its backlog and the
    delivery latency of its messages.

    ``partition`` is the partition's index for one of a topic's P > 1 partitions (``topic`` is then
    the topic's own name, not ``T-partition-p``), None for a topic of one partition.
    """

    topic: str
    subscription: str
    dispatcher: Dispatcher
    backlog: int | None = None
    partition: int | None = None
    delivery_seconds: Histogram | None = None
    """Seconds from each message's publish time (the broker's clock as it was stored) to its first
    delivery; None without a log (a bare dispatcher knows no publish times)."""


@dataclass(frozen=True)
class ServedPartition:
    """A partition a broker serves: ``partition`` as in :class:`SubscriptionView`, and its owner epoch."""

    topic: str
    partition: int | None
    owner_epoch: int


@dataclass(frozen=True)
class ClusterView:
    """One broker's part in its cluster (level 1), as the broker knows it now."""

    coordinator: bool
    epoch: int
    """The coordinator epoch of the assignment the broker applied last."""
    generation: int
    """The generation of that assignment."""
    assigned: int
    """Partitions in that assignment (exported by the coordinator only)."""
    brokers: int
    """Brokers known, as of that assignment."""
    served: Sequence[ServedPartition] = ()
    acquired: int = 0
    released: int = 0
    acquire_seconds: Histogram = field(default_factory=Histogram)
    """From the assignment that gave the broker a partition to serving it."""


@dataclass(frozen=True)
class ServerView:
    """Server-wide counters: the log's appends and commit times, connections, protocol errors; and for a
    broker of a cluster, its part in it."""

    appended: int = 0
    commit_seconds: Histogram = field(default_factory=Histogram)
    entry_cache_bytes: int = 0
    entry_cache_hits: int = 0
    entry_cache_misses: int = 0
    connections: int = 0
    protocol_errors: Mapping[str, int] = field(default_factory=dict)
    cluster: ClusterView | None = None


_SUB = ["topic", "partition", "subscription"]
_CON = [*_SUB, "consumer"]
_RANGE = [*_CON, "range"]
_PARTITION = ["topic", "partition"]

# name -> (kind, help, labels); an info family's labels are those besides its value's.
_SPECS: dict[str, tuple[str, str, list[str]]] = {
    "keyfailover_range_start": (
        "gauge",
        "First hash slot of one of the consumer's ranges (inclusive); range is its ordinal among them in hash order.",
        _RANGE,
    ),
    "keyfailover_range_end": (
        "gauge",
        "Last hash slot of one of the consumer's ranges (inclusive); range is its ordinal among them in hash order.",
        _RANGE,
    ),
    "keyfailover_range_share": (
        "gauge",
        "Fraction of the 65536-slot hash space the consumer owns, all its ranges together.",
        _CON,
    ),
    "keyfailover_traffic_share": (
        "gauge",
        "Fraction of recent keyed messages that fall in the consumer's ranges.",
        _CON,
    ),
    "keyfailover_consumer_ranges": ("gauge", "Ranges the consumer owns (0 for a standby).", _CON),
    "keyfailover_messages_dispatched": ("counter", "Messages delivered to the consumer (redeliveries included).", _CON),
    "keyfailover_messages_acked": ("counter", "Messages the consumer acknowledged.", _CON),
    "keyfailover_messages_redelivered": ("counter", "Deliveries to the consumer that were redeliveries.", _CON),
    "keyfailover_dispatch_rate": (
        "gauge",
        "Measured dispatch rate used by the rebalance policy, messages per second.",
        _CON,
    ),
    "keyfailover_unacked_messages": ("gauge", "Messages delivered to the consumer and not yet acknowledged.", _CON),
    "keyfailover_permits": ("gauge", "Deliveries the consumer will still accept (flow permits).", _CON),
    "keyfailover_draining_hashes": (
        "gauge",
        "Hash slots blocked for their new owner until this consumer acks them.",
        _CON,
    ),
    "keyfailover_replay_messages": ("gauge", "Messages waiting in the replay buffer for this consumer's keys.", _CON),
    "keyfailover_consumer_stuck": (
        "gauge",
        "1 while the consumer is stuck: a lease of it expired and it owns no range until it acks or asks for more.",
        _CON,
    ),
    "keyfailover_consumer_stalled": (
        "gauge",
        "1 while the consumer makes no progress (stuck, at its unacked limit, or no ack, nack or extension for a "
        "half-life while it has no permits or holds deliveries): joins and leaves give it no slots.",
        _CON,
    ),
    "keyfailover_leases_expired": (
        "counter",
        "Deliveries to the consumer taken back because their ack deadline passed.",
        _CON,
    ),
    "keyfailover_dead_lettered": (
        "counter",
        "Messages given up on after max_redeliveries and moved to <topic>-<subscription>-DLQ.",
        _SUB,
    ),
    "keyfailover_dead_letters_unconfirmed": (
        "gauge",
        "Dead letters not yet stored in the dead-letter topic (they still count against the buffer bound).",
        _SUB,
    ),
    "keyfailover_ack_timeout_seconds": ("gauge", "The subscription's ack deadline (0: no leases).", _SUB),
    "keyfailover_backoff_messages": (
        "gauge",
        "Messages waiting for a nack backoff to end (in ordered mode with every later message of their keys).",
        _SUB,
    ),
    "keyfailover_backoff_keys": ("gauge", "Keys held back by a nack backoff (ordered mode).", _SUB),
    "keyfailover_backlog_messages": ("gauge", "Messages stored and not yet acknowledged by the subscription.", _SUB),
    "keyfailover_delivery_latency_seconds": (
        "histogram",
        "Time from a message's publish time (the broker's wall clock as it was stored) to its first delivery.",
        _SUB,
    ),
    "keyfailover_rebalances": ("counter", "Range-map changes, by reason.", [*_SUB, "reason"]),
    "keyfailover_rebalance_duration_seconds": (
        "histogram",
        "Time from a range change until the last key it blocked was released.",
        _SUB,
    ),
    "keyfailover_rebalance_stickiness": (
        "gauge",
        "Fraction of recent traffic that kept its consumer at the last range change.",
        _SUB,
    ),
    "keyfailover_load_imbalance": ("gauge", "Recent traffic of the busiest consumer over the mean (1 is even).", _SUB),
    "keyfailover_consumers": ("gauge", "Consumers attached to the subscription (standbys included).", _SUB),
    "keyfailover_unassigned_share": (
        "gauge",
        "Fraction of the 65536-slot hash space a sticky subscription's consumers did not declare: its keys wait.",
        _SUB,
    ),
    "keyfailover_range_map_epoch": ("gauge", "Range map epoch: +1 at every change.", _SUB),
    "keyfailover_rebalance_policy": (
        "info",
        "The subscription's rebalance policy and the most ranges it gives one consumer.",
        _SUB,
    ),
    "keyfailover_consume_mode": (
        "info",
        "The subscription's consume mode: ordered (key ranges, per-key order) or unordered (any consumer).",
        _SUB,
    ),
    "keyfailover_log_appended": ("counter", "Messages stored in the log (retried duplicates not counted).", []),
    "keyfailover_log_commit_seconds": ("histogram", "Time of one group commit to the log.", []),
    "keyfailover_entry_cache_bytes": (
        "gauge",
        "Bytes of the messages stored last that the server keeps in memory for reads (serve --entry-cache-mb).",
        [],
    ),
    "keyfailover_entry_cache_hits": ("counter", "Messages read from the entry cache instead of the log.", []),
    "keyfailover_entry_cache_misses": ("counter", "Reads that the entry cache could not answer: the log did.", []),
    "keyfailover_connections": ("gauge", "Open client connections.", []),
    "keyfailover_protocol_errors": ("counter", "Error frames sent to clients, by code.", ["code"]),
    "keyfailover_cluster_partition_served": ("gauge", "1 for each partition this broker serves.", _PARTITION),
    "keyfailover_cluster_partition_owner_epoch": (
        "gauge",
        "Owner epoch of a partition this broker serves (PostgreSQL: +1 at every opening, every write checks it).",
        _PARTITION,
    ),
    "keyfailover_cluster_coordinator": ("gauge", "1 while this broker is the cluster's coordinator, else 0.", []),
    "keyfailover_cluster_epoch": ("gauge", "Coordinator epoch of the assignment this broker applied last.", []),
    "keyfailover_cluster_generation": ("gauge", "Generation of the assignment this broker applied last.", []),
    "keyfailover_cluster_assigned_partitions": (
        "gauge",
        "Partitions in the cluster's assignment; exported by the coordinator only.",
        [],
    ),
    "keyfailover_cluster_brokers": (
        "gauge",
        "Brokers in the cluster, as of the assignment this broker applied last.",
        [],
    ),
    "keyfailover_cluster_partitions_acquired": (
        "counter",
        "Partitions this broker started serving: assigned to it when it joined, at a rebalance or a failover.",
        [],
    ),
    "keyfailover_cluster_partitions_released": (
        "counter",
        "Partitions this broker stopped serving: moved to another, its session lost, or it stopped.",
        [],
    ),
    "keyfailover_cluster_partition_acquire_seconds": (
        "histogram",
        "Time from the assignment that gave this broker a partition to serving it (the wait for the old owner too).",
        [],
    ),
}

_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "info": ("_info",), "histogram": ("_bucket", "_sum", "_count")}

METRIC_NAMES: frozenset[str] = frozenset(
    name + suffix for name, (kind, _, _) in _SPECS.items() for suffix in _SUFFIXES[kind]
)
"""Every sample name the collector exports: counters end in ``_total``, info in ``_info``, histograms as usual."""


_FAMILY_TYPES: dict[str, Callable[..., Metric]] = {
    "gauge": GaugeMetricFamily,
    "counter": CounterMetricFamily,
    "info": InfoMetricFamily,
    "histogram": HistogramMetricFamily,
}

_CONSUMER_COUNTS = {
    "keyfailover_messages_dispatched": "delivered",
    "keyfailover_messages_acked": "acked",
    "keyfailover_messages_redelivered": "redelivered",
    "keyfailover_dispatch_rate": "rate",
    "keyfailover_unacked_messages": "unacked",
    "keyfailover_permits": "permits",
    "keyfailover_draining_hashes": "draining_hashes",
    "keyfailover_replay_messages": "replay",
}
"""The consumer families exported as they are from the dispatcher's stats: family name -> stats key."""


class _Families:
    """The metric families of one scrape, empty until the collector adds the samples it reads."""

    def __init__(self) -> None:
        self.by_name: dict[str, Metric] = {
            name: _FAMILY_TYPES[kind](name, help_text, labels=labels)
            for name, (kind, help_text, labels) in _SPECS.items()
        }

    def add(self, name: str, labels: list[str], value: float) -> None:
        """Add one sample to the gauge or counter ``name``."""
        family = self.by_name[name]
        assert isinstance(family, GaugeMetricFamily | CounterMetricFamily)
        family.add_metric(labels, value)

    def info(self, name: str, labels: list[str], value: dict[str, str]) -> None:
        """Add one sample to the info family ``name``."""
        family = self.by_name[name]
        assert isinstance(family, InfoMetricFamily)
        family.add_metric(labels, value)

    def histogram(self, name: str, labels: list[str], histogram: Histogram) -> None:
        """Add ``histogram`` as one sample of the histogram family ``name``: its cumulative buckets and sum."""
        family = self.by_name[name]
        assert isinstance(family, HistogramMetricFamily)
        buckets = [("+Inf" if bound == float("inf") else repr(bound), count) for bound, count in histogram.cumulative()]
        family.add_metric(labels, buckets, histogram.sum)


class KeyFailoverCollector(Collector):
    """Yields keyfailover's metric families from live state on every ``collect()``."""

    def __init__(
        self,
        subscriptions: Callable[[], Iterable[SubscriptionView]],
        server: Callable[[], ServerView] | None = None,
    ) -> None:
        self._subscriptions = subscriptions
        self._server = server

    def describe(self) -> Iterator[Metric]:
        """The families without samples, so registering does not call the sources."""
        return iter(_Families().by_name.values())

    def collect(self) -> Iterator[Metric]:
        """Every family, with the samples read now from the subscriptions and the server."""
        families = _Families()
        for view in self._subscriptions():
            _subscription(families, view)
        if self._server is not None:
            server = self._server()
            families.add("keyfailover_log_appended", [], server.appended)
            families.histogram("keyfailover_log_commit_seconds", [], server.commit_seconds)
            families.add("keyfailover_entry_cache_bytes", [], server.entry_cache_bytes)
            families.add("keyfailover_entry_cache_hits", [], server.entry_cache_hits)
            families.add("keyfailover_entry_cache_misses", [], server.entry_cache_misses)
            families.add("keyfailover_connections", [], server.connections)
            for code, count in sorted(server.protocol_errors.items()):
                families.add("keyfailover_protocol_errors", [code], count)
            if server.cluster is not None:
                _cluster(families, server.cluster)
        return iter(families.by_name.values())


def _cluster(families: _Families, view: ClusterView) -> None:
    for served in view.served:
        labels = [served.topic, _partition_label(served.partition)]
        families.add("keyfailover_cluster_partition_served", labels, 1)
        families.add("keyfailover_cluster_partition_owner_epoch", labels, served.owner_epoch)
    families.add("keyfailover_cluster_coordinator", [], 1 if view.coordinator else 0)
    families.add("keyfailover_cluster_epoch", [], view.epoch)
    families.add("keyfailover_cluster_generation", [], view.generation)
    if view.coordinator:
        families.add("keyfailover_cluster_assigned_partitions", [], view.assigned)
    families.add("keyfailover_cluster_brokers", [], view.brokers)
    families.add("keyfailover_cluster_partitions_acquired", [], view.acquired)
    families.add("keyfailover_cluster_partitions_released", [], view.released)
    families.histogram("keyfailover_cluster_partition_acquire_seconds", [], view.acquire_seconds)


def _partition_label(partition: int | None) -> str:
    """A partition's index, or "" for a topic of one partition (no label, as Prometheus stores it)."""
    return "" if partition is None else str(partition)


def _subscription(families: _Families, view: SubscriptionView) -> None:
    dispatcher = view.dispatcher
    sub = [view.topic, _partition_label(view.partition), view.subscription]
    stats = dispatcher.stats()
    traffic = np.asarray(dispatcher.traffic())  # entry i is slot first + i
    prefix = np.concatenate(([0.0], np.cumsum(traffic)))
    first = dispatcher.slots[0]
    total = float(prefix[-1])
    loads: list[float] = []
    for consumer, info in sorted(stats["consumers"].items()):
        labels = [*sub, consumer]
        owned: list[tuple[int, int]] = info["ranges"]
        families.add("keyfailover_consumer_ranges", labels, len(owned))
        if owned:
            for ordinal, (start, end) in enumerate(owned):
                families.add("keyfailover_range_start", [*labels, str(ordinal)], start)
                families.add("keyfailover_range_end", [*labels, str(ordinal)], end)
            width = sum(end - start + 1 for start, end in owned)
            families.add("keyfailover_range_share", labels, width / HASH_RANGE_SIZE)
            load = sum(float(prefix[end + 1 - first] - prefix[start - first]) for start, end in owned)
            loads.append(load)
            families.add("keyfailover_traffic_share", labels, load / total if total > 0 else 0.0)
        for name, key in _CONSUMER_COUNTS.items():
            families.add(name, labels, info[key])
        families.add("keyfailover_consumer_stuck", labels, 1.0 if info["stuck"] else 0.0)
        families.add("keyfailover_consumer_stalled", labels, 1.0 if info["stalled"] else 0.0)
        families.add("keyfailover_leases_expired", labels, info["expired"])
    # Without a log behind it, the backlog is what the dispatcher holds unacknowledged.
    backlog = view.backlog if view.backlog is not None else stats["held"]
    families.add("keyfailover_backlog_messages", sub, backlog)
    if view.delivery_seconds is not None:
        families.histogram("keyfailover_delivery_latency_seconds", sub, view.delivery_seconds)
    for reason in REASONS:
        families.add("keyfailover_rebalances", [*sub, reason], stats["rebalances"].get(reason, 0))
    families.histogram("keyfailover_rebalance_duration_seconds", sub, dispatcher.drain_histogram())
    events = dispatcher.rebalances()
    families.add("keyfailover_rebalance_stickiness", sub, events[-1].stickiness if events else 1.0)
    mean = sum(loads) / len(loads) if loads else 0.0
    families.add("keyfailover_load_imbalance", sub, max(loads) / mean if mean > 0 else 1.0)
    families.add("keyfailover_consumers", sub, len(stats["consumers"]))
    unassigned = sum(end - start + 1 for start, end, owner in dispatcher.ranges() if owner == UNASSIGNED)
    families.add("keyfailover_unassigned_share", sub, unassigned / HASH_RANGE_SIZE)
    families.add("keyfailover_range_map_epoch", sub, stats["epoch"])
    families.add("keyfailover_dead_lettered", sub, stats["dead_lettered"])
    families.add("keyfailover_dead_letters_unconfirmed", sub, stats["dead_letters_unconfirmed"])
    families.add("keyfailover_ack_timeout_seconds", sub, stats["ack_timeout"])
    families.add("keyfailover_backoff_messages", sub, stats["backoff_messages"])
    families.add("keyfailover_backoff_keys", sub, stats["backoff_keys"])
    policy = dispatcher.policy
    families.info("keyfailover_rebalance_policy", sub, {"policy": policy.name, "max_ranges": str(policy.range_limit)})
    families.info("keyfailover_consume_mode", sub, {"mode": dispatcher.consume_mode})
