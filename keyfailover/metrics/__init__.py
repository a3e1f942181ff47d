"""Prometheus metrics for keyfailover: a custom collector read at scrape time.

registry = CollectorRegistry()
registry.register(KeyFailoverCollector(lambda: [SubscriptionView("orders", "billing", dispatcher)]))
text = prometheus_client.generate_latest(registry)
"""

from keyfailover.metrics._collector import METRIC_NAMES, KeyFailoverCollector, ServerView, SubscriptionView

__all__ = ["METRIC_NAMES", "KeyFailoverCollector", "ServerView", "SubscriptionView"]
