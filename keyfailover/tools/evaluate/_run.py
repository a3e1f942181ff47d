"""Run each strategy through each scenario and measure balance, stickiness and time.

After every membership event the strategy gets ``shifts`` windows of measured traffic:
the chances a load-aware policy has to shift boundaries before the next change (the
dispatcher checks once per ``shift_interval``). The state right after the change and
the state after those windows (``settled``) are measured apart, so the stickiness of a
join or leave itself and the movement of the shifts that follow are both on record.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from keyfailover.tools.evaluate._measures import Balance, HotSlot, balance, hot_slot, stickiness
from keyfailover.tools.evaluate._scenarios import SEED, Membership, Scenario
from keyfailover.tools.evaluate._strategies import Join, Strategy

__all__ = ["JSON_KEYS", "SHIFTS_PER_EVENT", "Result", "Timing", "run_strategy", "time_reassignments"]

SHIFTS_PER_EVENT = 4
"""Windows of measured traffic (shift chances) after each membership event.

The dispatcher checks for a shift once per ``shift_interval`` (30 s by default); four
chances stand for membership changes at least two minutes apart, as in a rolling restart
of pods or an autoscaler's cool-down. ``plan_shift`` settles in one plan, so more
chances change nothing and fewer than one would leave the change unbalanced.
"""

JSON_KEYS = (
    "strategy",
    "scenario",
    "max_mean_traffic",
    "stddev_traffic",
    "stickiness_mean",
    "stickiness_min",
    "reassign_ms_mean",
)


@dataclass(frozen=True)
class Result:
    """One strategy's measures over one scenario's events (balance averaged over the settled states)."""

    strategy: str
    scenario: str
    max_mean_traffic: float
    """Busiest consumer's traffic over the mean, after each event's shifts, averaged over events."""
    max_mean_final: float
    """The same after the last event."""
    max_mean_at_change: float
    """Busiest over mean right after each change, before any shift, averaged over events."""
    stddev_traffic: float
    stddev_space: float
    stickiness_mean: float
    """Fraction of keys keeping their consumer from one settled state to the next (the change and its shifts)."""
    stickiness_min: float
    change_stickiness_mean: float
    """Fraction of keys keeping their consumer across the change itself, before any shift."""
    change_stickiness_min: float
    traffic_stickiness_mean: float
    """Fraction of traffic keeping its consumer, the change and its shifts."""
    join_stickiness: float
    """Mean key stickiness of the joins themselves."""
    join_stickiness_settled: float
    """Mean key stickiness of the joins with the shifts that follow them."""
    hot_floor: float
    """The best max/mean the slots allow (the hottest slot is indivisible), averaged over events."""
    hot_others: float
    """What the hottest slot's owner carries besides it, in mean loads, averaged over events."""
    reassign_ms_mean: float
    reassign_ms_max: float
    shifts_per_event: float

    def json_row(self) -> dict[str, str | float]:
        """The ``--json`` object: exactly the keys of :data:`JSON_KEYS`."""
        return {key: getattr(self, key) for key in JSON_KEYS}


class _Owners:
    """Maps each strategy's :class:`Ownership` to one array of stable consumer numbers per slot."""

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        self._numbers: dict[str, int] = {}
        self.members: dict[str, None] = {}

    def apply(self, event: Membership) -> None:
        if isinstance(event, Join):
            self._numbers.setdefault(event.consumer, len(self._numbers))
            self.members[event.consumer] = None
        else:
            del self.members[event.consumer]
        self._strategy.apply(event)

    def member_numbers(self) -> npt.NDArray[np.intp]:
        return np.array([self._numbers[c] for c in self.members], dtype=np.intp)

    def owners(self) -> npt.NDArray[np.intp]:
        owned = self._strategy.ownership()
        numbers = np.array([self._numbers[c] for c in owned.consumers] + [-1], dtype=np.intp)
        return numbers[owned.index]


def run_strategy(strategy: Strategy, scenario: Scenario, shifts: int = SHIFTS_PER_EVENT) -> Result:
    """Run ``strategy`` (fresh) through ``scenario`` and measure every event."""
    windows = itertools.cycle(scenario.windows)
    tracked = _Owners(strategy)
    traffic = scenario.population.traffic
    keys = scenario.population.keys
    shift_count = 0

    def settle() -> None:
        nonlocal shift_count
        for _ in range(shifts):
            shift_count += strategy.measured(next(windows))

    strategy.measured(next(windows))
    for event in scenario.setup:
        tracked.apply(event)
        settle()
    shift_count = 0
    before = tracked.owners()
    at_change: list[Balance] = []
    settled: list[Balance] = []
    space: list[float] = []
    sticky: list[float] = []
    change_sticky: list[float] = []
    traffic_sticky: list[float] = []
    joins: list[tuple[float, float]] = []
    hot: list[HotSlot] = []
    times: list[float] = []
    for event in scenario.events:
        start = time.perf_counter()
        tracked.apply(event)
        times.append(time.perf_counter() - start)
        changed = tracked.owners()
        settle()
        after = tracked.owners()
        members = tracked.member_numbers()
        at_change.append(balance(changed, traffic, members))
        settled.append(balance(after, traffic, members))
        space.append(balance(after, np.ones_like(traffic), members).stddev)
        sticky.append(stickiness(before, after, keys))
        change_sticky.append(stickiness(before, changed, keys))
        traffic_sticky.append(stickiness(before, after, traffic))
        hot.append(hot_slot(after, traffic, members))
        if isinstance(event, Join):
            joins.append((change_sticky[-1], sticky[-1]))
        before = after
    return Result(
        strategy=strategy.name,
        scenario=scenario.name,
        max_mean_traffic=statistics.fmean(b.max_mean for b in settled),
        max_mean_final=settled[-1].max_mean,
        max_mean_at_change=statistics.fmean(b.max_mean for b in at_change),
        stddev_traffic=statistics.fmean(b.stddev for b in settled),
        stddev_space=statistics.fmean(space),
        stickiness_mean=statistics.fmean(sticky),
        stickiness_min=min(sticky),
        change_stickiness_mean=statistics.fmean(change_sticky),
        change_stickiness_min=min(change_sticky),
        traffic_stickiness_mean=statistics.fmean(traffic_sticky),
        join_stickiness=statistics.fmean(change for change, _ in joins) if joins else 1.0,
        join_stickiness_settled=statistics.fmean(total for _, total in joins) if joins else 1.0,
        hot_floor=statistics.fmean(h.floor for h in hot),
        hot_others=statistics.fmean(h.others for h in hot),
        reassign_ms_mean=1000.0 * statistics.fmean(times),
        reassign_ms_max=1000.0 * max(times),
        shifts_per_event=shift_count / len(scenario.events),
    )


@dataclass(frozen=True)
class Timing:
    """Median and worst milliseconds of one strategy's reassignments among ``consumers`` members."""

    strategy: str
    consumers: int
    join_ms: float
    leave_ms: float
    p95_ms: float
    """95th percentile of joins and leaves together (the slowest single call is mostly the machine's noise)."""
    shift_ms: float | None
    """Median of one shift chance (``plan_shift``), for a strategy that uses measured load."""
    shift_p95_ms: float | None


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return 1000.0 * (time.perf_counter() - start)


def time_reassignments(strategy: Strategy, scenario: Scenario, consumers: int = 64, rounds: int = 50) -> Timing:
    """Time ``rounds`` leaves of a random member and joins of a newcomer once ``consumers`` have joined.

    Each change is followed by one untimed-for-it window of the scenario's traffic, timed
    on its own as a shift chance.
    """
    windows = itertools.cycle(scenario.windows)
    strategy.measured(next(windows))
    members = [f"c{index}" for index in range(consumers)]
    for member in members:
        strategy.join(member)
        strategy.measured(next(windows))
    rng = np.random.default_rng([SEED, consumers])
    joins: list[float] = []
    leaves: list[float] = []
    shifts: list[float] = []
    for round_ in range(rounds):
        leaver = members.pop(int(rng.integers(len(members))))
        leaves.append(_timed(lambda: strategy.leave(leaver)))  # noqa: B023  (called at once)
        shifts.append(_timed(lambda: strategy.measured(next(windows))))
        newcomer = f"n{round_}"
        members.append(newcomer)
        joins.append(_timed(lambda: strategy.join(newcomer)))  # noqa: B023
        shifts.append(_timed(lambda: strategy.measured(next(windows))))
    load_aware = type(strategy).measured is not Strategy.measured
    return Timing(
        strategy.name,
        consumers,
        statistics.median(joins),
        statistics.median(leaves),
        _p95(joins + leaves),
        statistics.median(shifts) if load_aware else None,
        _p95(shifts) if load_aware else None,
    )


def _p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[18]
