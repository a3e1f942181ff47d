"""Load-aware rebalance policy: pure functions from (range map, measured load) to a new map.

This is PIP-34's Key_Failover as proposed, with the load-aware parts Pulsar never shipped:

- **join** splits the range of the busiest consumer (by measured dispatch rate; ties by
  widest range, then id). In ``"traffic"`` mode the cut goes where that consumer's recent
  per-slot traffic halves; in ``"midpoint"`` mode (and when there is no traffic) at half
  the width. A range of width 1 is never split; with nothing left to split the newcomer
  waits as a standby without a range.
- **leave** hands the leaver's range to the oldest standby if there is one, otherwise
  merges it into the adjacent neighbour with the lower dispatch rate.
- **shift**, when traffic max/mean passes a threshold, moves the boundaries as little as
  possible so that every consumer fits under a cap just above its fair share (a consumer
  holding a key heavier than a fair share keeps that key and little else): the fix for the
  skew that made Pulsar drop auto-split (PR #6791: after a rolling restart one consumer took
  over 90% of traffic). See docs/evaluation.md.

No function here mutates its arguments; each returns a new :class:`RangeMap`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from keyfailover.core.errors import RangeMapError
from keyfailover.core.ranges import RangeMap

__all__ = [
    "SPLIT_MODES",
    "Load",
    "SplitMode",
    "balanced_cut",
    "moved_slots",
    "plan_join",
    "plan_leave",
    "plan_shift",
    "range_traffic",
    "reassign_rates",
]

SplitMode = Literal["traffic", "midpoint"]
SPLIT_MODES: tuple[SplitMode, ...] = ("traffic", "midpoint")


@dataclass(frozen=True)
class Load:
    """What the policy measures: dispatch rate per consumer and recent traffic per slot.

    ``traffic`` has one non-negative entry per slot of the range map (decayed message
    counts); None means nothing was measured, and the policy falls back to widths.
    """

    rates: Mapping[str, float] = field(default_factory=dict)
    traffic: npt.NDArray[np.float64] | None = None

    def rate(self, consumer: str) -> float:
        return float(self.rates.get(consumer, 0.0))


def _check_traffic(ranges: RangeMap, load: Load) -> npt.NDArray[np.float64] | None:
    traffic = load.traffic
    if traffic is not None and traffic.shape != (ranges.range_size,):
        raise RangeMapError(f"traffic has shape {traffic.shape}; expected ({ranges.range_size},), one entry per slot")
    return traffic


def balanced_cut(traffic: npt.NDArray[np.float64] | None, start: int, end: int) -> int:
    """The cut ``at`` in ``[start + 1, end]`` that best halves the traffic of ``[start, end]``.

    ``[start, at - 1]`` and ``[at, end]`` then carry traffic as equal as the slots allow;
    among equally good cuts the one nearest the middle of the width wins. Without traffic
    the cut is the midpoint. Requires ``end > start``.
    """
    if end <= start:
        raise RangeMapError(f"cannot cut [{start}, {end}]: a range of width 1 has no cut")
    midpoint = start + (end - start + 1) // 2
    if traffic is None:
        return midpoint
    cumulative = np.cumsum(traffic[start:end])  # cumulative[k - 1] = traffic left of start + k
    total = float(cumulative[-1] + traffic[end])
    if total <= 0.0:
        return midpoint
    middle = midpoint - start
    i = int(np.searchsorted(cumulative, total / 2.0, side="left"))
    # The two candidate cut values nearest the half, one on each side; each is shared by a
    # run of cuts (a plateau of the cumulative sum), and all cuts in both runs that are
    # equally good compete on nearness to the middle of the width.
    candidates = {min(max(k, 1), end - start) for k in (i, i + 1)}
    best = min(abs(2.0 * float(cumulative[k - 1]) - total) for k in candidates)
    choices = []
    for k in candidates:
        left = cumulative[k - 1]
        if abs(2.0 * float(left) - total) == best:
            lo = int(np.searchsorted(cumulative, left, side="left")) + 1
            hi = int(np.searchsorted(cumulative, left, side="right"))
            choices.append(min(max(middle, lo), hi))
    return start + min(choices, key=lambda k: (abs(k - middle), k))


def range_traffic(ranges: RangeMap, traffic: npt.NDArray[np.float64] | None) -> dict[str, float]:
    """Total traffic of each consumer's range (all zeros without traffic)."""
    if traffic is None:
        return {consumer: 0.0 for consumer in ranges.consumers()}
    prefix = np.concatenate(([0.0], np.cumsum(traffic)))
    return {consumer: float(prefix[end + 1] - prefix[start]) for start, end, consumer in ranges.ranges()}


def plan_join(ranges: RangeMap, newcomer: str, load: Load, split: SplitMode = "traffic") -> RangeMap:
    """The map after ``newcomer`` joins: it takes the upper part of the busiest range.

    Returns an unchanged copy (the newcomer is then a standby) when no range has two slots.
    """
    if split not in SPLIT_MODES:
        raise RangeMapError(f"split mode {split!r} is unknown; expected one of {SPLIT_MODES}")
    if newcomer in ranges:
        raise RangeMapError(f"{newcomer!r} already owns a range; expected a consumer without one")
    traffic = _check_traffic(ranges, load)
    planned = ranges.copy()
    if not len(ranges):
        planned.assign_all(newcomer)
        return planned
    candidates = [
        (-load.rate(consumer), -(end - start), consumer) for start, end, consumer in ranges.ranges() if end > start
    ]
    if not candidates:
        return planned
    _, _, busiest = min(candidates)
    start, end = ranges.range_of(busiest) or (0, 0)
    at = balanced_cut(traffic if split == "traffic" else None, start, end)
    planned.split(busiest, newcomer, at)
    return planned


def plan_leave(ranges: RangeMap, leaver: str, load: Load, standby: Sequence[str] = ()) -> RangeMap:
    """The map after ``leaver`` leaves.

    Its range goes whole to the first of ``standby`` if any; otherwise it merges into the
    adjacent neighbour with the lower dispatch rate (ties: narrower range, then id). A
    leaver without a range leaves the map as it is.
    """
    planned = ranges.copy()
    if leaver not in ranges:
        return planned
    if standby:
        planned.replace(leaver, standby[0])
        return planned
    neighbours = [n for n in ranges.neighbours(leaver) if n is not None]
    if not neighbours:
        planned.remove_last(leaver)
        return planned
    into = min(neighbours, key=lambda n: (load.rate(n), ranges.width(n), n))
    planned.merge(leaver, into)
    return planned


def plan_shift(ranges: RangeMap, load: Load, threshold: float = 1.1, min_traffic: float = 1000.0) -> RangeMap | None:
    """Boundaries moved as little as possible so that every consumer fits under its cap, or None.

    Acts only when the traffic max/mean over consumers exceeds ``threshold`` and the
    measured total is at least ``min_traffic``. A consumer's cap is the fair level times
    ``1 + (threshold - 1) / 2``, the level being the mean; a consumer whose hottest slot
    alone exceeds that keeps the slot (a key never splits) as its cap, and the level is
    retaken over the others. Where the slots and the order of the consumers allow no
    better, the others' caps (then all) are raised as little as needed. The new
    boundaries are the nearest to the current ones under the caps (one sweep each way;
    the one moving less traffic is kept): what a consumer carries over its cap goes to the
    nearest consumers with room, through every boundary on the way, in one plan. None
    when every consumer is within its cap (a lone hot slot is never just handed to a
    neighbour), or over it by less than a quarter of the threshold's margin (2.5% at 1.1),
    so that measurement noise does not move boundaries back and forth. O(n log s) for n
    consumers and s slots.
    """
    if threshold < 1.0:
        raise RangeMapError(f"shift threshold {threshold!r} is below 1; expected max/mean >= 1")
    traffic = _check_traffic(ranges, load)
    count = len(ranges)
    if traffic is None or count < 2:
        return None
    size = ranges.range_size
    ends = np.asarray(ranges.lookup_table()[0], dtype=np.intp)
    starts = np.concatenate(([0], ends[:-1] + 1))
    prefix = np.concatenate(([0.0], np.cumsum(traffic)))
    heaviest = float((prefix[ends + 1] - prefix[starts]).max())
    total = float(prefix[-1])
    if total < min_traffic or total <= 0.0 or heaviest * count <= threshold * total:
        return None
    caps, pinned = _shift_caps(traffic, starts, total, 1.0 + (threshold - 1.0) / 2.0)
    loads = prefix[ends + 1] - prefix[starts]
    if bool((loads <= caps).all()):
        return None
    if _sweep(prefix, caps, starts) is None:
        # Raise the caps as little as the slots and the order allow: the others' first, a
        # pinned consumer's too only if that is not enough (the current map fits at ``high``).
        raised = np.where(pinned, 0.0, 1.0)
        worst = float(np.divide(loads, caps, out=np.zeros_like(loads), where=loads > 0.0).max())
        if _sweep(prefix, caps * (1.0 + raised * (worst - 1.0)), starts) is None:
            raised[:] = 1.0
        low, high = 1.0, worst
        for _ in range(10):
            middle = (low + high) / 2.0
            fits = _sweep(prefix, caps * (1.0 + raised * (middle - 1.0)), starts) is not None
            low, high = (low, middle) if fits else (middle, high)
        caps = caps * (1.0 + raised * (high - 1.0))
    if bool((loads <= caps * (1.0 + (threshold - 1.0) / 4.0)).all()):
        return None  # too little to gain: measurement noise would move boundaries back and forth
    plans = []
    forward = _sweep(prefix, caps, starts)
    if forward is not None:
        plans.append(forward)
    backward = _sweep(total - prefix[::-1], caps[::-1], size - np.append(starts[1:], size)[::-1])
    if backward is not None:
        plans.append(np.concatenate(([0], size - backward[1:][::-1])))
    if not plans:
        return None
    best = min(plans, key=lambda plan: float(np.abs(prefix[plan] - prefix[starts]).sum()))
    new_ends = np.append(best[1:], size)
    if float((prefix[new_ends] - prefix[best]).max()) >= heaviest * (1.0 - 1e-9):
        return None
    owners = ranges.consumers()
    return RangeMap.from_ranges(
        [(int(start), int(end) - 1, owner) for start, end, owner in zip(best, new_ends, owners, strict=True)],
        size,
        ranges.epoch + 1,
    )


def _shift_caps(
    traffic: npt.NDArray[np.float64], starts: npt.NDArray[np.intp], total: float, slack: float
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
    """Each consumer's cap, and which consumers are pinned by a slot heavier than the fair level.

    A cap is ``slack`` times the fair level, or for a pinned consumer its hottest slot. The
    level is the mean over the consumers whose hottest slot is within their cap
    (water-filling): a key heavier than a fair share stays whole on its consumer, which
    takes nothing else of weight, and the others share what is left.
    """
    floors = np.maximum.reduceat(traffic, starts)
    pinned = np.zeros(len(starts), dtype=bool)
    while True:
        # Never below 0: when the pinned slots carry everything, rounding may leave a hair less.
        level = max(total - float(floors[pinned].sum()), 0.0) / max(len(starts) - int(pinned.sum()), 1)
        newly = ~pinned & (floors > level * slack)
        if not newly.any():
            return np.where(pinned, floors, level * slack), pinned
        pinned |= newly


def _sweep(
    prefix: npt.NDArray[np.float64], caps: npt.NDArray[np.float64], current: npt.NDArray[np.intp]
) -> npt.NDArray[np.intp] | None:
    """The consumers' starts nearest ``current`` with each load within its cap, or None if none fit.

    ``prefix`` is the cumulative traffic (one more entry than slots); each consumer keeps at
    least one slot. Right to left it finds each consumer's earliest start that leaves the
    rest coverable; left to right it keeps each start where it is, clamped between that and
    the latest start its predecessor's cap allows.
    """
    count = len(current)
    size = len(prefix) - 1
    earliest = np.zeros(count, dtype=np.intp)
    end = size
    for k in range(count - 1, 0, -1):
        start = max(int(np.searchsorted(prefix, prefix[end] - caps[k], side="left")), k)
        if start >= end:
            return None
        earliest[k] = end = start
    if prefix[end] > caps[0]:
        return None
    planned = np.zeros(count, dtype=np.intp)
    for k in range(1, count):
        previous = int(planned[k - 1])
        latest = int(np.searchsorted(prefix, prefix[previous] + caps[k - 1], side="right")) - 1
        lower, upper = max(int(earliest[k]), previous + 1), min(latest, size - (count - k))
        if lower > upper:
            return None
        planned[k] = min(max(int(current[k]), lower), upper)
    return planned


def moved_slots(old: RangeMap, new: RangeMap) -> list[tuple[int, int, str | None, str | None]]:
    """The maximal slot intervals whose owner differs between ``old`` and ``new``.

    Each item is ``(first, last, old owner, new owner)``; owners are None for an empty map.
    O(n) in the number of ranges of both maps.
    """
    if old.range_size != new.range_size:
        raise RangeMapError(f"range sizes differ: {old.range_size} and {new.range_size}")
    size = old.range_size
    unowned: list[tuple[int, int, str | None]] = [(0, size - 1, None)]
    old_list: list[tuple[int, int, str | None]] = list(old.ranges()) or unowned
    new_ranges: list[tuple[int, int, str | None]] = list(new.ranges()) or unowned
    moved: list[tuple[int, int, str | None, str | None]] = []
    i = j = 0
    slot = 0
    while slot < size:
        _, old_end, old_owner = old_list[i]
        _, new_end, new_owner = new_ranges[j]
        last = min(old_end, new_end)
        if old_owner != new_owner:
            if moved and moved[-1][1] == slot - 1 and moved[-1][2:] == (old_owner, new_owner):
                moved[-1] = (moved[-1][0], last, old_owner, new_owner)
            else:
                moved.append((slot, last, old_owner, new_owner))
        slot = last + 1
        if old_end == last:
            i += 1
        if new_end == last:
            j += 1
    return moved


def reassign_rates(
    old: RangeMap, new: RangeMap, rates: Mapping[str, float], traffic: npt.NDArray[np.float64] | None
) -> dict[str, float]:
    """Estimate each consumer's dispatch rate under ``new`` from its measured rate under ``old``.

    A moved slot interval carries the share of its old owner's rate that its traffic (or,
    without traffic, its width) is of the old owner's range. Used right after a change so
    the next decision does not act on the stale rate of a consumer that just lost half.
    """
    widths = {consumer: float(end - start + 1) for start, end, consumer in old.ranges()}
    weights = range_traffic(old, traffic) if traffic is not None else widths
    estimated = {consumer: float(rates.get(consumer, 0.0)) for consumer in new.consumers()}
    for first, last, old_owner, new_owner in moved_slots(old, new):
        if old_owner is None:
            continue
        whole = weights[old_owner]
        if traffic is not None and whole > 0.0:
            part = float(traffic[first : last + 1].sum()) / whole
        else:
            part = (last - first + 1) / widths[old_owner]
        share = float(rates.get(old_owner, 0.0)) * part
        if old_owner in estimated:
            estimated[old_owner] -= share
        if new_owner is not None:
            estimated[new_owner] += share
    return {consumer: max(rate, 0.0) for consumer, rate in estimated.items()}
