"""The progress bar of ``keyfailover produce``: one line on stderr, redrawn in place."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress"]

_WIDTH = 30


class Progress:
    """Messages sent and stored, their rate, and how much of the input is read.

    ``total`` is the size of the input in bytes, or None when it is unknown (a pipe): then
    the line has counts and a rate but no bar. :meth:`update` redraws at most every
    ``interval`` seconds of ``clock``; :meth:`finish` always draws the last state and ends
    the line.
    """

    def __init__(
        self,
        stream: TextIO,
        total: int | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        interval: float = 0.2,
    ) -> None:
        self._stream = stream
        self._total = total
        self._clock = clock
        self._interval = interval
        self._start = clock()
        self._drawn = float("-inf")

    def render(self, sent: int, stored: int, done: int) -> str:
        """The line for ``sent`` messages handed to the producer, ``stored`` confirmed, ``done`` bytes read."""
        elapsed = self._clock() - self._start
        rate = f"{stored / elapsed:,.0f} msg/s" if elapsed > 0 else "- msg/s"
        counts = f"{sent:,} sent, {stored:,} stored, {rate}"
        if not self._total:
            return counts
        fraction = min(done / self._total, 1.0)
        filled = int(fraction * _WIDTH)
        return f"[{'#' * filled}{'.' * (_WIDTH - filled)}] {fraction:4.0%} {counts}"

    def update(self, sent: int, stored: int, done: int) -> None:
        """Redraw the bar in place, at most once per interval."""
        now = self._clock()
        if now - self._drawn >= self._interval:
            self._drawn = now
            self._stream.write("\r" + self.render(sent, stored, done))
            self._stream.flush()

    def finish(self, sent: int, stored: int, done: int) -> None:
        """Draw the bar a last time and end its line."""
        self._stream.write("\r" + self.render(sent, stored, done) + "\n")
        self._stream.flush()
