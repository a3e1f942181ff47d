"""A clock for the sans-IO core that moves only when told: simulations, demos, tests, benchmarks."""

from __future__ import annotations

__all__ = ["ManualClock"]


class ManualClock:
    """Seconds that change only by :meth:`advance` or by setting :attr:`now`; pass it as ``clock=``."""

    __slots__ = ("now",)

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward."""
        self.now += seconds
