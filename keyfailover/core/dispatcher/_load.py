"""Measured load: exponentially weighted dispatch rates and decayed per-slot traffic.

Nothing here reads a clock: the dispatcher passes in its clock readings, so the same
readings give the same measurements (G6). The hot path only appends a slot to
``slot_log`` and bumps an integer per delivery; the folding into rates and the numpy
traffic array happens in :meth:`LoadMeter.sample`, at most a few times a second.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

__all__ = ["LoadMeter"]

_MAX_LOG = 1 << 20  # fold the slot log at least this often, clock or not


class LoadMeter:
    """EWMA rates per consumer and decayed traffic per hash slot, with one half-life."""

    __slots__ = ("_half_life", "_last_time", "_last_totals", "_rates", "_traffic", "slot_log")

    def __init__(self, range_size: int, half_life: float) -> None:
        if not half_life > 0.0 or math.isinf(half_life):
            raise ValueError(f"half_life must be a positive finite number of seconds, not {half_life!r}")
        self._half_life = half_life
        self.slot_log: array[int] = array("H")
        self._traffic: npt.NDArray[np.float64] = np.zeros(range_size, dtype=np.float64)
        self._rates: dict[str, float] = {}
        self._last_totals: dict[str, int] = {}
        self._last_time: float | None = None

    @property
    def traffic(self) -> npt.NDArray[np.float64]:
        """Recent messages per slot, decayed by the half-life (read-only view)."""
        view = self._traffic.view()
        view.flags.writeable = False
        return view

    @property
    def rates(self) -> dict[str, float]:
        """Dispatch rate (deliveries per second, EWMA) of every tracked consumer."""
        return dict(self._rates)

    def needs_fold(self) -> bool:
        """True when the slot log is long enough to be folded regardless of the clock."""
        return len(self.slot_log) >= _MAX_LOG

    def track(self, consumer: str, delivered_total: int) -> None:
        """Start measuring ``consumer``, whose delivery counter now reads ``delivered_total``."""
        self._rates[consumer] = 0.0
        self._last_totals[consumer] = delivered_total

    def forget(self, consumer: str) -> None:
        """Stop measuring ``consumer``."""
        self._rates.pop(consumer, None)
        self._last_totals.pop(consumer, None)

    def set_rates(self, rates: Mapping[str, float]) -> None:
        """Replace the rates of the given consumers (after a range change moved load)."""
        for consumer, rate in rates.items():
            if consumer in self._rates:
                self._rates[consumer] = rate

    def sample(self, now: float, delivered_totals: Mapping[str, int]) -> None:
        """Fold what happened since the last sample into the rates and the traffic array.

        With no time elapsed the traffic still folds (undecayed) and delivery counts
        keep accumulating until time moves, so no rate is computed over a zero interval.
        """
        if self.slot_log:
            counts = np.bincount(np.frombuffer(self.slot_log, dtype=np.uint16), minlength=len(self._traffic))
            self.slot_log = array("H")
        else:
            counts = None
        last = self._last_time
        elapsed = 0.0 if last is None else now - last
        if elapsed > 0.0:
            decay = 0.5 ** (elapsed / self._half_life)
            self._traffic *= decay
            for consumer, total in delivered_totals.items():
                delta = total - self._last_totals.get(consumer, total)
                self._last_totals[consumer] = total
                self._rates[consumer] = decay * self._rates.get(consumer, 0.0) + (1.0 - decay) * delta / elapsed
        if last is None or elapsed > 0.0:
            self._last_time = now
        if counts is not None:
            self._traffic += counts
