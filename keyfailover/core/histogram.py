"""A fixed-bucket histogram of durations: plain counters, read at scrape time.

The core and the server record into it on rare events (a change drained, a commit
finished); ``keyfailover.integrations.metrics`` turns it into a Prometheus histogram family.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["DEFAULT_BUCKETS", "Histogram"]

DEFAULT_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


class Histogram:
    """Counts of observations per upper bound (seconds), their sum and their number."""

    __slots__ = ("_bounds", "_counts", "count", "sum")

    def __init__(self, bounds: Sequence[float] = DEFAULT_BUCKETS) -> None:
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bucket bounds must be strictly increasing and non-empty, not {bounds!r}")
        self._bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self._bounds) + 1)  # the last one is +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Record one observation."""
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self.count += 1
        self.sum += value

    def observe_many(self, values: npt.ArrayLike) -> None:
        """Record every value of ``values`` (one pass in numpy: for a batch, such as a frame of deliveries)."""
        found = np.asarray(values, dtype=np.float64)
        if not found.size:
            return
        buckets = np.bincount(np.searchsorted(self._bounds, found, side="left"), minlength=len(self._counts))
        counts = self._counts
        for index in np.flatnonzero(buckets).tolist():
            counts[index] += int(buckets[index])
        self.count += int(found.size)
        self.sum += float(found.sum())

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= it)`` for every bucket, ending with ``(inf, count)``."""
        total = 0
        buckets = []
        for bound, count in zip((*self._bounds, float("inf")), self._counts, strict=True):
            total += count
            buckets.append((bound, total))
        return buckets
