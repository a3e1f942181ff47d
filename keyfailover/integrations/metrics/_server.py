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
        return [
            SubscriptionView(topic, name, s.dispatcher, s.backlog())
            for (topic, name), s in sorted(server.subscriptions().items())
        ]

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
