"""Short import path for the Prometheus collector (it lives in :mod:`keyfailover.integrations.metrics`)."""

from keyfailover.integrations.metrics import (
    METRIC_NAMES,
    ClusterView,
    KeyFailoverCollector,
    ServedPartition,
    ServerView,
    SubscriptionView,
    serve_metrics,
)

__all__ = [
    "METRIC_NAMES",
    "ClusterView",
    "KeyFailoverCollector",
    "ServedPartition",
    "ServerView",
    "SubscriptionView",
    "serve_metrics",
]
