"""Run each strategy through each scenario and measure balance, what moved, and time.

After every membership event the strategy gets ``shifts`` windows of measured traffic:
the chances a load-aware policy has to shift boundaries before the next change (the
dispatcher checks once per ``shift_interval``). Two states are measured per event: right
after the change, and *settled* after those windows. Every figure that does not say
otherwise is about the settled state, and "what a change moved" always includes the
shifts it set off: one definition everywhere (the table, ``--json``, the goals, the docs).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from keyfailover.tools.evaluate._events import Join
from keyfailover.tools.evaluate._measures import balance, fair_level, hot_key, least_moved, stickiness
from keyfailover.tools.evaluate._scenarios import SEED, Membership, Population, Scenario
from keyfailover.tools.evaluate._strategies import Strategy

__all__ = ["BOUND", "JSON_KEYS", "SHIFTS_PER_EVENT", "Result", "Timing", "ideal", "run_strategy", "time_reassignments"]

SHIFTS_PER_EVENT = 4
"""Windows of measured traffic (shift chances) after each membership event.

The dispatcher checks for a shift once per ``shift_interval`` (30 s by default); four
chances stand for membership changes at least two minutes apart, as in a rolling restart
of pods or an autoscaler's cool-down.
"""

BOUND = "lower bound"
"""The row of what a perfectly balanced policy moves from a perfectly balanced state."""

JSON_KEYS = (
    "strategy",
    "scenario",
    "max_mean_traffic",
    "max_mean_at_change",
    "max_mean_final",
    "over_floor",
    "stddev_traffic",
    "stickiness_mean",
    "stickiness_min",
    "traffic_stickiness_mean",
    "join_traffic_moved",
    "leave_traffic_moved",
    "join_keys_moved",
    "leave_keys_moved",
    "join_vs_least",
    "leave_vs_least",
    "ranges_per_consumer",
    "reassign_ms_mean",
)


@dataclass(frozen=True)
class Result:
    """One strategy's measures over one scenario's events (or, as :data:`BOUND`, the ideal's)."""

    strategy: str
    scenario: str
    max_mean_traffic: float
    """Busiest consumer's traffic over the mean, settled after each event, averaged over events."""
    max_mean_at_change: float
    """The same right after each change, before any shift."""
    max_mean_final: float
    """Busiest over mean, settled after the last event (for the rolling restart: after the restart)."""
    over_floor: float
    """Settled max/mean over the best any assignment can reach (the hottest key is indivisible), averaged."""
    stddev_traffic: float
    """Standard deviation of the settled loads in mean units, averaged over events."""
    stickiness_mean: float
    """Fraction of keys keeping their consumer across a change and its shifts, averaged over events."""
    stickiness_min: float
    traffic_stickiness_mean: float
    """Fraction of traffic keeping its consumer across a change and its shifts, averaged over events."""
    join_traffic_moved: float
    """Fraction of traffic that changed consumer per join, its shifts included (mean over joins)."""
    leave_traffic_moved: float
    join_keys_moved: float
    """Fraction of keys that changed consumer per join, its shifts included."""
    leave_keys_moved: float
    join_vs_least: float
    """Traffic moved by the joins (shifts included) over the least any policy had to move from this
    strategy's states before them to a balanced state (:func:`least_moved`, summed over the joins)."""
    leave_vs_least: float
    """The same for the leaves."""
    ranges_per_consumer: float
    """Ranges of its hash space per member, settled, averaged over events."""
    hot_floor: float
    """The best max/mean any assignment can reach (the hottest key is indivisible), averaged over events."""
    hot_others: float
    """What the hottest key's owner carries besides it, in mean loads, averaged over events."""
    reassign_ms_mean: float
    reassign_ms_max: float
    shifts_per_event: float

    def json_row(self) -> dict[str, str | float]:
        """The ``--json`` object: exactly the keys of :data:`JSON_KEYS`."""
        return {key: getattr(self, key) for key in JSON_KEYS}


class _Owners:
    """Maps each strategy's :class:`Ownership` of the keys to one array of stable consumer numbers per key."""

    def __init__(self, strategy: Strategy, population: Population) -> None:
        self._strategy = strategy
        self._population = population
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
        owned = self._strategy.owners(self._population)
        numbers = np.array([self._numbers[c] for c in owned.consumers] + [-1], dtype=np.intp)
        return numbers[owned.index]


def run_strategy(strategy: Strategy, scenario: Scenario, shifts: int = SHIFTS_PER_EVENT) -> Result:
    """Run ``strategy`` (fresh) through ``scenario`` and measure every event."""
    windows = itertools.cycle(scenario.windows)
    population = scenario.population
    tracked = _Owners(strategy, population)
    traffic = population.key_traffic
    keys = np.ones_like(traffic)
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
    at_change: list[float] = []
    settled: list[float] = []
    over_floor: list[float] = []
    spread: list[float] = []
    sticky: list[float] = []
    traffic_sticky: list[float] = []
    moved: dict[str, list[tuple[float, float]]] = {"join": [], "leave": []}
    least = {"join": 0.0, "leave": 0.0}
    ranges: list[float] = []
    floors: list[float] = []
    others: list[float] = []
    times: list[float] = []
    for event in scenario.events:
        members_before = tracked.member_numbers()
        start = time.perf_counter()
        tracked.apply(event)
        times.append(time.perf_counter() - start)
        members = tracked.member_numbers()
        kind = "join" if isinstance(event, Join) else "leave"
        least[kind] += least_moved(before, traffic, members_before, members)
        at_change.append(balance(tracked.owners(), traffic, members).max_mean)
        settle()
        after = tracked.owners()
        settled_balance = balance(after, traffic, members)
        hot = hot_key(after, traffic, members)
        settled.append(settled_balance.max_mean)
        spread.append(settled_balance.stddev)
        over_floor.append(settled_balance.max_mean / hot.floor)
        floors.append(hot.floor)
        others.append(hot.others)
        sticky.append(stickiness(before, after, keys))
        traffic_sticky.append(stickiness(before, after, traffic))
        moved[kind].append((1.0 - traffic_sticky[-1], 1.0 - sticky[-1]))
        ranges.append(strategy.ranges() / max(len(members), 1))
        before = after
    total = float(traffic.sum())
    versus = {
        kind: sum(t for t, _ in moved[kind]) * total / least[kind] if least[kind] > 0.0 else 1.0 for kind in moved
    }
    return Result(
        strategy=strategy.name,
        scenario=scenario.name,
        max_mean_traffic=statistics.fmean(settled),
        max_mean_at_change=statistics.fmean(at_change),
        max_mean_final=settled[-1],
        over_floor=statistics.fmean(over_floor),
        stddev_traffic=statistics.fmean(spread),
        stickiness_mean=statistics.fmean(sticky),
        stickiness_min=min(sticky),
        traffic_stickiness_mean=statistics.fmean(traffic_sticky),
        join_traffic_moved=_mean(t for t, _ in moved["join"]),
        leave_traffic_moved=_mean(t for t, _ in moved["leave"]),
        join_keys_moved=_mean(k for _, k in moved["join"]),
        leave_keys_moved=_mean(k for _, k in moved["leave"]),
        join_vs_least=versus["join"],
        leave_vs_least=versus["leave"],
        ranges_per_consumer=statistics.fmean(ranges),
        hot_floor=statistics.fmean(floors),
        hot_others=statistics.fmean(others),
        reassign_ms_mean=1000.0 * statistics.fmean(times),
        reassign_ms_max=1000.0 * max(times),
        shifts_per_event=shift_count / len(scenario.events),
    )


def ideal(scenario: Scenario) -> Result:
    """The :data:`BOUND` row: what a perfectly balanced policy moves from a perfectly balanced state.

    A join moves the newcomer's fair share of the traffic, a leave the leaver's (the fair
    level, for a leaver holding no key heavier than it); a policy keeping keys as balanced
    as traffic moves the same share of keys: ``1/(n+1)`` on a join, ``1/n`` on a leave. Balance is
    the best any assignment can reach. One policy could move fewer keys by moving only
    the hottest ones; none can move less traffic and end balanced.
    """
    traffic = scenario.population.key_traffic
    total = float(traffic.sum())
    heaviest = np.sort(traffic)[::-1][:256]
    members = len(scenario.setup)
    moved: dict[str, list[tuple[float, float]]] = {"join": [], "leave": []}
    floors = []
    for event in scenario.events:
        if isinstance(event, Join):
            members += 1
            moved["join"].append((fair_level(total, heaviest, members) / total, 1.0 / members))
        else:
            moved["leave"].append((fair_level(total, heaviest, members) / total, 1.0 / members))
            members -= 1
        floors.append(max(1.0, float(heaviest[0]) * members / total) if members else 1.0)
    floor = statistics.fmean(floors)
    traffic_moved = [t for kind in moved.values() for t, _ in kind]
    keys_moved = [k for kind in moved.values() for _, k in kind]
    return Result(
        strategy=BOUND,
        scenario=scenario.name,
        max_mean_traffic=floor,
        max_mean_at_change=floor,
        max_mean_final=floors[-1],
        over_floor=1.0,
        stddev_traffic=0.0,
        stickiness_mean=1.0 - statistics.fmean(keys_moved),
        stickiness_min=1.0 - max(keys_moved),
        traffic_stickiness_mean=1.0 - statistics.fmean(traffic_moved),
        join_traffic_moved=_mean(t for t, _ in moved["join"]),
        leave_traffic_moved=_mean(t for t, _ in moved["leave"]),
        join_keys_moved=_mean(k for _, k in moved["join"]),
        leave_keys_moved=_mean(k for _, k in moved["leave"]),
        join_vs_least=1.0,
        leave_vs_least=1.0,
        ranges_per_consumer=1.0,
        hot_floor=floor,
        hot_others=0.0,
        reassign_ms_mean=0.0,
        reassign_ms_max=0.0,
        shifts_per_event=0.0,
    )


def _mean(values: Iterable[float]) -> float:
    found = list(values)
    return statistics.fmean(found) if found else 0.0


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
    """Median of one shift chance, for a strategy that uses measured load."""
    shift_p95_ms: float | None


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return 1000.0 * (time.perf_counter() - start)


def time_reassignments(strategy: Strategy, scenario: Scenario, consumers: int = 64, rounds: int = 50) -> Timing:
    """Time ``rounds`` leaves of a random member and joins of a newcomer once ``consumers`` have joined.

    Each change is followed by one window of the scenario's traffic, timed on its own as a
    shift chance.
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
