"""Time in the dispatcher: from a range change until its last draining key is released.

A :class:`~keyfailover.core.dispatcher.Dispatcher` with the default shift settings runs on a
manual clock: Zipf(1.1) keys at a steady rate, consumers that ack each delivery a fixed
processing time after receiving it, and a few joins and leaves. Each change's
``RebalanceEvent.drain_seconds`` is read back: how long keys that moved stayed blocked
behind deliveries still unacked on their former owner (G1).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

from keyfailover.core.clock import ManualClock
from keyfailover.core.dispatcher import Dispatcher

__all__ = ["DrainTimes", "drain_times"]

TICK = 0.1
"""Seconds per simulation step."""
PROCESSING = 0.5
"""Seconds a consumer takes before it acks a delivery."""
PERMITS = 200
"""Deliveries each consumer may have outstanding."""


@dataclass(frozen=True)
class DrainTimes:
    """Drain times of one kind of range change (``join``, ``leave`` or ``shift``)."""

    reason: str
    changes: int
    mean_seconds: float
    max_seconds: float
    undrained: int
    """Changes whose keys were still blocked when the run ended."""


def drain_times(quick: bool = False, seed: int = 6, policy: str = "multi") -> list[DrainTimes]:
    """Run the scripted dispatcher scenario and summarise the drain time of each kind of change.

    ``policy`` is the dispatcher's rebalance policy (``"multi"`` or ``"contiguous"``).
    """
    seconds, per_tick = (60.0, 50) if quick else (240.0, 100)
    script = {0.0: ("join", "c0"), 0.1: ("join", "c1"), 0.2: ("join", "c2"), 0.3: ("join", "c3")}
    step = seconds / 8
    script |= {step: ("join", "c4"), 2 * step: ("leave", "c1"), 3 * step: ("join", "c1")}
    script |= {4 * step: ("leave", "c2"), 5 * step: ("join", "c2"), 6 * step: ("join", "c5")}
    rng = np.random.default_rng(seed)
    weights = np.arange(1, 10_001, dtype=np.float64) ** -1.1
    ranks = rng.choice(len(weights), size=int(seconds / TICK) * per_tick, p=weights / weights.sum())
    clock = ManualClock()
    dispatcher = Dispatcher(clock=clock, max_replay=50_000, policy=policy)
    outstanding: dict[str, deque[tuple[float, int]]] = {}
    position = 0
    for tick in range(int(seconds / TICK)):
        clock.now = tick * TICK
        action = script.get(round(clock.now, 1))
        if action is not None:
            kind, consumer = action
            if kind == "join":
                dispatcher.add_consumer(consumer)
                dispatcher.flow(consumer, PERMITS)
                outstanding[consumer] = deque()
            else:
                dispatcher.remove_consumer(consumer)
                del outstanding[consumer]
        for rank in ranks[tick * per_tick : (tick + 1) * per_tick].tolist():
            if not dispatcher.wants():
                break
            dispatcher.publish(position, f"key-{rank}")
            position += 1
        for delivery in dispatcher.poll():
            outstanding[delivery.consumer].append((clock.now, delivery.position))
        for consumer, waiting in outstanding.items():
            acked = 0
            while waiting and waiting[0][0] <= clock.now - PROCESSING:
                dispatcher.ack(consumer, waiting.popleft()[1])
                acked += 1
            if acked:
                dispatcher.flow(consumer, acked)
    summary = []
    events = dispatcher.rebalances()
    for reason in ("join", "leave", "shift"):
        # The four joins that build the group (0.0 to 0.3 s) are not measured.
        chosen = [event for event in events if event.reason == reason and event.time > 0.3 + TICK / 2]
        drained = [event.drain_seconds for event in chosen if event.drain_seconds is not None]
        summary.append(
            DrainTimes(
                reason,
                len(chosen),
                statistics.fmean(drained) if drained else 0.0,
                max(drained, default=0.0),
                len(chosen) - len(drained),
            )
        )
    return summary
