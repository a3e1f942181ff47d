"""Short import path for the Prometheus collector (it lives in :mod:`keyfailover.integrations.metrics`)."""

from keyfailover.integrations.metrics import (
    METRIC_NAMES,
    KeyFailoverCollector,
    ServerView,
    SubscriptionView,
    serve_metrics,
)

__all__ = ["METRIC_NAMES", "KeyFailoverCollector", "ServerView", "SubscriptionView", "serve_metrics"]
