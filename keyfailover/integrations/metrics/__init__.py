"""Prometheus metrics for keyfailover: a custom collector read at scrape time::

    registry = CollectorRegistry()
    registry.register(KeyFailoverCollector(lambda: [SubscriptionView("orders", "billing", dispatcher)]))
    text = prometheus_client.generate_latest(registry)

:func:`serve_metrics` puts the same collector behind a server's ``/metrics``.
"""

from keyfailover.integrations.metrics._collector import (
    METRIC_NAMES,
    ClusterView,
    KeyFailoverCollector,
    ServedPartition,
    ServerView,
    SubscriptionView,
)
from keyfailover.integrations.metrics._server import serve_metrics

__all__ = [
    "METRIC_NAMES",
    "ClusterView",
    "KeyFailoverCollector",
    "ServedPartition",
    "ServerView",
    "SubscriptionView",
    "serve_metrics",
]
