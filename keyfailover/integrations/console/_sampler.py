"""Backlog and delivery latency per subscription, sampled on the server so a freshly opened page shows minutes.

One sample per live subscription every :data:`INTERVAL` seconds, the last :data:`KEEP` of each kept
(5 minutes): memory is bounded by the live subscriptions times :data:`KEEP`, and a subscription that is
no longer live loses its samples at the next round.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from keyfailover.broker.server import Server

__all__ = ["INTERVAL", "KEEP", "Sample", "Sampler"]

INTERVAL = 2.0
"""Seconds between samples."""
KEEP = 150
"""Samples kept per subscription: 5 minutes at :data:`INTERVAL`."""

Sample = dict[str, float | int | None]
"""``time`` (unix seconds), ``backlog``, ``delivered`` (first deliveries since the sample before) and
``delivery_seconds`` (their mean seconds from publish to delivery; None when there were none)."""


class Sampler:
    """The recent samples of every live subscription of ``server``, by ``(topic, subscription)``."""

    def __init__(self, server: Server, interval: float = INTERVAL, keep: int = KEEP) -> None:
        self._server = server
        self._interval = interval
        self._keep = keep
        self._series: dict[tuple[str, str], deque[Sample]] = {}
        self._totals: dict[tuple[str, str], tuple[int, float]] = {}  # delivery histogram count and sum, last seen

    def series(self, topic: str, name: str) -> list[Sample]:
        """The samples of the subscription ``name`` of ``topic``, oldest first (none when it is not sampled)."""
        return list(self._series.get((topic, name), ()))

    def sample(self) -> None:
        """Take one sample of every live subscription; forget the ones no longer live."""
        now = time.time()
        live: dict[tuple[str, str], list[int | float]] = {}
        for subscription in self._server.subscriptions().values():
            totals = live.setdefault((subscription.settings_topic, subscription.name), [0, 0, 0.0])
            totals[0] += subscription.backlog()
            totals[1] += subscription.delivery_seconds.count
            totals[2] += subscription.delivery_seconds.sum
        for key in set(self._series) - set(live):
            del self._series[key]
            self._totals.pop(key, None)
        for key, (backlog, count, seconds) in live.items():
            before_count, before_seconds = self._totals.get(key, (int(count), float(seconds)))
            delivered = int(count) - before_count
            mean = (float(seconds) - before_seconds) / delivered if delivered > 0 else None
            self._totals[key] = (int(count), float(seconds))
            series = self._series.setdefault(key, deque(maxlen=self._keep))
            series.append(
                {"time": now, "backlog": int(backlog), "delivered": max(delivered, 0), "delivery_seconds": mean}
            )

    async def run(self) -> None:
        """Sample every ``interval`` seconds until cancelled (with the server)."""
        while True:
            self.sample()
            await asyncio.sleep(self._interval)
