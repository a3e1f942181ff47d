"""``/metrics`` on a server's admin endpoint: the collector over a live :class:`Server`."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from keyfailover.broker.server import Response, Server
from keyfailover.integrations.metrics._collector import KeyFailoverCollector, ServerView, SubscriptionView

__all__ = ["serve_metrics"]


def serve_metrics(server: Server) -> CollectorRegistry:
    """Add ``GET /metrics`` (Prometheus text) to ``server``'s admin endpoint; returns the registry.

    Call before ``server.start()``. The collector reads the server's subscriptions and counters
    at scrape time only.
    """

    def subscriptions() -> list[SubscriptionView]:
        views = []
        for (served, name), subscription in sorted(server.subscriptions().items()):
            topic, index, partitions = server.partition_of(served)
            partition = index if partitions > 1 else None
            views.append(SubscriptionView(topic, name, subscription.dispatcher, subscription.backlog(), partition))
        return views

    def totals() -> ServerView:
        storage = server.storage
        return ServerView(
            appended=storage.appended,
            commit_seconds=storage.commit_seconds,
            connections=server.connection_count,
            protocol_errors=dict(server.protocol_errors),
        )

    registry = CollectorRegistry()
    registry.register(KeyFailoverCollector(subscriptions, totals))

    async def metrics(_query: dict[str, str]) -> Response:
        return 200, CONTENT_TYPE_LATEST, generate_latest(registry)

    server.add_admin_route("/metrics", metrics)
    return registry
