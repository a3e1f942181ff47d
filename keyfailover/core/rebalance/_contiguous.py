"""PIP-34's Key_Failover as proposed: one contiguous range per consumer, load-aware.

- **join** splits the range of the busiest consumer (by measured dispatch rate; ties by
  widest range, then id). In ``"traffic"`` mode the cut goes where that consumer's recent
  per-slot traffic halves; in ``"midpoint"`` mode (and when there is no traffic) at half
  the width. A range of width 1 is never split; with nothing left to split the newcomer
  waits as a standby without a range. Nobody but the newcomer gains, so ``Load.closed``
  changes nothing here.
- **leave** hands the leaver's range to the oldest standby if there is one, otherwise
  merges it into the adjacent neighbour with the lower dispatch rate. Members in
  ``Load.closed`` (not making progress) are passed over: the other neighbour or a standby
  takes it; only when both neighbours and every standby are closed does a closed one grow.
- **shift**, when traffic max/mean passes a threshold, moves the boundaries as little as
  possible so that every consumer fits under a cap just above its fair share (a consumer
  holding a key heavier than a fair share keeps that key and little else): the fix for the
  skew that made Pulsar drop auto-split (PR #6791: after a rolling restart one consumer took
  over 90% of traffic).

With contiguous ranges, restoring balance after a change moves boundaries down the chain
of neighbours, so it moves more keys than a ring would; :mod:`._multi` lifts that limit.
See docs/evaluation.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import numpy.typing as npt

from keyfailover.core.errors import RangeMapError
from keyfailover.core.ranges import RangeMap
from keyfailover.core.rebalance._common import (
    Load,
    Policy,
    check_min_traffic,
    check_threshold,
    check_traffic,
    fair_shares,
)

__all__ = ["SPLIT_MODES", "ContiguousPolicy", "SplitMode", "balanced_cut"]

SplitMode = Literal["traffic", "midpoint"]
SPLIT_MODES: tuple[SplitMode, ...] = ("traffic", "midpoint")


@dataclass(frozen=True)
class ContiguousPolicy(Policy):
    """One contiguous range per consumer (PIP-34 literally): split the busiest, merge into the less busy neighbour.

    ``split`` is ``"traffic"`` or ``"midpoint"``; ``threshold`` and ``min_traffic`` govern
    :meth:`shift` (see the module docstring).
    """

    name: ClassVar[str] = "contiguous"
    reads_rates: ClassVar[bool] = True
    split: SplitMode = "traffic"
    threshold: float = 1.1
    min_traffic: float = 1000.0

    def __post_init__(self) -> None:
        if not isinstance(self.split, str) or self.split not in SPLIT_MODES:
            raise RangeMapError(f"split mode {self.split!r} is unknown; expected one of {SPLIT_MODES}")
        check_threshold(self.threshold)
        check_min_traffic(self.min_traffic)

    @property
    def range_limit(self) -> int:
        """One range per consumer."""
        return 1

    def join(self, ranges: RangeMap, newcomer: str, load: Load) -> RangeMap:
        """The newcomer takes the upper part of the busiest range; a standby when no range has two slots."""
        if newcomer in ranges:
            raise RangeMapError(f"{newcomer!r} already owns a range; expected a consumer without one")
        traffic = check_traffic(ranges, load)
        _check_contiguous(ranges)
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
        ((start, end),) = ranges.ranges_of(busiest)
        at = balanced_cut(traffic if self.split == "traffic" else None, start, end)
        planned.assign(at, end, newcomer)
        return planned

    def leave(self, ranges: RangeMap, leaver: str, load: Load, standby: Sequence[str] = ()) -> RangeMap:
        """The leaver's range goes whole to the first standby, else merges into the less busy neighbour;
        members of ``load.closed`` are passed over.

        Ties on rate go to the narrower neighbour, then the smaller id. A leaver without a
        range leaves the map as it is. Only a neighbour or a standby can take the range whole
        (one range each): when both neighbours are closed and every standby too, nobody open
        can take it, and it goes as if nobody were closed (to the first standby, else the
        less busy neighbour, which grows although closed).
        """
        _check_contiguous(ranges)
        planned = ranges.copy()
        if leaver not in ranges:
            return planned
        ((start, end),) = ranges.ranges_of(leaver)
        size = ranges.range_size
        neighbours = [
            owner
            for slot in (start - 1, end + 1)
            if 0 <= slot < size and (owner := ranges.owner_of(slot)) is not None and owner != leaver
        ]
        closed = load.closed
        heirs = [s for s in standby if s not in closed]
        takers = [n for n in neighbours if n not in closed]
        if not (heirs or takers):
            heirs, takers = list(standby), neighbours  # nobody open can take it: as if nobody were closed
        if heirs:
            heir = heirs[0]
            if heir in ranges:
                raise RangeMapError(f"standby {heir!r} already owns a range; expected a consumer without one")
            planned.assign(start, end, heir)
            return planned
        if not takers:
            planned.clear()
            return planned
        into = min(takers, key=lambda n: (load.rate(n), ranges.width(n), n))
        planned.assign(start, end, into)
        return planned

    def shift(self, ranges: RangeMap, load: Load) -> RangeMap | None:
        """Move the boundaries as little as possible so that every consumer fits under its cap.

        See the module docstring.
        """
        _check_contiguous(ranges)
        return _plan_shift(ranges, load, self.threshold, self.min_traffic)


def _check_contiguous(ranges: RangeMap) -> None:
    """A RangeMapError unless every consumer of ``ranges`` owns exactly one range."""
    if ranges.range_count() != len(ranges):
        raise RangeMapError(
            f"the contiguous policy needs one range per consumer; this map has {ranges.range_count()} ranges "
            f"for {len(ranges)} consumers"
        )


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


def _plan_shift(ranges: RangeMap, load: Load, threshold: float, min_traffic: float) -> RangeMap | None:
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
    traffic = check_traffic(ranges, load)
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
    _, level, pinned = fair_shares(floors, total, slack)
    return np.where(pinned, floors, level * slack), pinned


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
