"""``/metrics`` on a server's admin endpoint: the collector over a live :class:`Server`."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from keyfailover.broker.server import Response, Server
from keyfailover.integrations.metrics._collector import (
    ClusterView,
    KeyFailoverCollector,
    ServedPartition,
    ServerView,
    SubscriptionView,
)

__all__ = ["serve_metrics"]


def serve_metrics(server: Server) -> CollectorRegistry:
    """Add ``GET /metrics`` (Prometheus text) to ``server``'s admin endpoint; returns the registry.

    Call before ``server.start()``. The collector reads the server's subscriptions and counters
    at scrape time only.
    """

    def subscriptions() -> list[SubscriptionView]:
        views = []
        for (served, name), subscription in sorted(server.subscriptions().items()):
            topic, partition = _partition(server, served)
            views.append(
                SubscriptionView(
                    topic,
                    name,
                    subscription.dispatcher,
                    subscription.backlog(),
                    partition,
                    subscription.delivery_seconds,
                )
            )
        return views

    def totals() -> ServerView:
        storage = server.storage
        return ServerView(
            appended=storage.appended,
            commit_seconds=storage.commit_seconds,
            entry_cache_bytes=storage.entry_cache.bytes,
            entry_cache_hits=storage.entry_cache.hits,
            entry_cache_misses=storage.entry_cache.misses,
            connections=server.connection_count,
            protocol_errors=dict(server.protocol_errors),
            cluster=_cluster(server),
        )

    registry = CollectorRegistry()
    registry.register(KeyFailoverCollector(subscriptions, totals))

    async def metrics(_query: dict[str, str]) -> Response:
        return 200, CONTENT_TYPE_LATEST, generate_latest(registry)

    server.add_admin_route("/metrics", metrics)
    return registry


def _partition(server: Server, served: str) -> tuple[str, int | None]:
    """``(topic, partition)`` of a served topic name: the partition None for a topic of one partition."""
    topic, index, partitions = server.partition_of(served)
    return topic, index if partitions > 1 else None


def _cluster(server: Server) -> ClusterView | None:
    """The broker's part in its cluster; None for a single server, or a broker not in its cluster now."""
    broker = server.broker
    if broker is None or not broker.joined:
        return None
    state = broker.member.state
    served = [
        ServedPartition(*_partition(server, name), lease.epoch) for name, lease in sorted(broker.store.served().items())
    ]
    return ClusterView(
        coordinator=state.coordinator,
        epoch=state.applied[0],
        generation=state.applied[1],
        assigned=len(state.assignment.owners),
        brokers=len(state.addresses),
        served=served,
        acquired=broker.acquired,
        released=broker.released,
        acquire_seconds=broker.acquire_seconds,
    )
