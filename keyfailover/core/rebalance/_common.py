"""What every rebalance policy shares: the measured load, the policy interface, and what a change moved."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from keyfailover.core.errors import RangeMapError
from keyfailover.core.ranges import RangeMap

__all__ = [
    "Load",
    "Policy",
    "check_min_traffic",
    "check_threshold",
    "check_traffic",
    "fair_shares",
    "moved_slots",
    "range_traffic",
    "reassign_rates",
]


@dataclass(frozen=True)
class Load:
    """What a policy measures: dispatch rate per consumer and recent traffic per slot, and who may gain.

    ``traffic`` has one non-negative entry per slot of the range map (decayed message
    counts); None means nothing was measured, and the policies fall back to widths.
    ``closed`` names the members that may not gain slots in this change: consumers that
    are not making progress (the dispatcher's ``stalled``: stuck, at their unacked limit,
    or silent for a while with no permits or with deliveries held), so that keys moved to
    them would only wait. :meth:`Policy.join` and :meth:`Policy.leave` honour it (a join's
    newcomer always may gain); when no member that may gain is left to take a leaver's
    slots, they plan as if nobody were closed. A shift ignores it.
    """

    rates: Mapping[str, float] = field(default_factory=dict)
    traffic: npt.NDArray[np.float64] | None = None
    closed: frozenset[str] = frozenset()

    def rate(self, consumer: str) -> float:
        """The measured dispatch rate of ``consumer``, 0.0 when it has none."""
        return float(self.rates.get(consumer, 0.0))


class Policy(ABC):
    """A rebalance policy: pure functions from (range map, measured load) to a new range map.

    No method mutates its arguments; each returns a new :class:`RangeMap` whose epoch is
    the old one plus one when anything moved (or the same map, copied, when nothing did).
    """

    name: ClassVar[str]
    reads_rates: ClassVar[bool]
    """Whether the policy reads ``Load.rates`` (the per-consumer dispatch rates), or only the traffic."""

    @property
    @abstractmethod
    def range_limit(self) -> int:
        """The most ranges the policy gives one consumer."""

    @abstractmethod
    def join(self, ranges: RangeMap, newcomer: str, load: Load) -> RangeMap:
        """The map after ``newcomer`` (owning nothing) joins; it may stay without a range (a standby).

        No member of ``load.closed`` but the newcomer gains a slot.
        """

    @abstractmethod
    def leave(self, ranges: RangeMap, leaver: str, load: Load, standby: Sequence[str] = ()) -> RangeMap:
        """The map after ``leaver`` leaves; ``standby`` lists members owning nothing, oldest first.

        The leaver's slots go to members (or the first standby) not in ``load.closed`` where
        the policy's shape allows; with no such member at all, as if nobody were closed.
        """

    @abstractmethod
    def shift(self, ranges: RangeMap, load: Load) -> RangeMap | None:
        """A map that restores balance after traffic drifted, or None when no change is worth making."""


def check_traffic(ranges: RangeMap, load: Load) -> npt.NDArray[np.float64] | None:
    """``load.traffic``, checked to have one entry per slot of ``ranges``."""
    traffic = load.traffic
    if traffic is not None and traffic.shape != (ranges.range_size,):
        raise RangeMapError(f"traffic has shape {traffic.shape}; expected ({ranges.range_size},), one entry per slot")
    return traffic


def check_threshold(threshold: object) -> float:
    """A shift threshold: a finite max/mean of at least 1."""
    if type(threshold) not in (int, float) or not 1.0 <= float(threshold) < float("inf"):  # type: ignore[arg-type]
        raise RangeMapError(f"shift threshold {threshold!r} is not a finite number >= 1; expected max/mean >= 1")
    return float(threshold)  # type: ignore[arg-type]


def check_min_traffic(min_traffic: object) -> float:
    """A shift's least measured traffic: a finite number of at least 0."""
    if type(min_traffic) not in (int, float) or not 0.0 <= float(min_traffic) < float("inf"):  # type: ignore[arg-type]
        raise RangeMapError(
            f"shift min_traffic {min_traffic!r} is not a finite number >= 0; expected the recent messages to act on"
        )
    return float(min_traffic)  # type: ignore[arg-type]


def fair_shares(
    heat: npt.NDArray[np.float64], total: float, slack: float
) -> tuple[npt.NDArray[np.float64], float, npt.NDArray[np.bool_]]:
    """Each member's fair share of ``total`` by water-filling, the level of the unpinned, and who is pinned.

    ``heat`` is each member's hottest slot. A member whose hottest slot exceeds ``slack``
    times the level is pinned: its share is that slot (a key never splits, so it keeps the
    key and little else). Pinning lowers the level of the others, so the pinned are the
    heaviest first, and pinning stops at the first that is not over. The level is 0 when
    every member is pinned.
    """
    count = len(heat)
    order = (-heat).argsort(kind="stable")
    heavy = heat[order].tolist()
    # Pin the heaviest while each is over the level of those left (held: what the pinned carry;
    # never below 0: when the pinned slots carry everything, rounding may leave a hair less).
    held = 0.0
    pinned = 0
    while pinned < count:
        level = max(total - held, 0.0) / (count - pinned)
        if heavy[pinned] <= level * slack:
            break
        held += heavy[pinned]
        pinned += 1
    else:
        level = 0.0
    target = np.full(count, level)
    target[order[:pinned]] = heavy[:pinned]
    is_pinned = np.zeros(count, dtype=bool)
    is_pinned[order[:pinned]] = True
    return target, level, is_pinned


def range_traffic(ranges: RangeMap, traffic: npt.NDArray[np.float64] | None) -> dict[str, float]:
    """Total traffic of each consumer's ranges (all zeros without traffic)."""
    arrays = ranges.arrays()
    if traffic is None:
        return dict.fromkeys(arrays.consumers, 0.0)
    if not len(arrays.starts):
        return {}
    # One pass of sums between range starts (the ranges tile the space): a cumulative sum
    # over every slot costs ten times as much in numpy.
    sums = np.add.reduceat(traffic, arrays.starts)
    totals = np.bincount(arrays.owner, weights=sums, minlength=len(arrays.consumers))
    return dict(zip(arrays.consumers, totals.tolist(), strict=True))


def moved_slots(old: RangeMap, new: RangeMap) -> list[tuple[int, int, str | None, str | None]]:
    """The maximal slot intervals whose owner differs between ``old`` and ``new``.

    Each item is ``(first, last, old owner, new owner)``; owners are None for an empty map.
    Vectorised over the common refinement of both maps' ranges: O(r log r) in numpy for r
    ranges, and Python work only per moved interval.
    """
    if old.range_size != new.range_size:
        raise RangeMapError(f"range sizes differ: {old.range_size} and {new.range_size}")
    size = old.range_size
    old_arrays, new_arrays = old.arrays(), new.arrays()
    names: list[str | None] = list(old_arrays.consumers)
    code = {name: index for index, name in enumerate(old_arrays.consumers)}
    for name in new_arrays.consumers:
        if name not in code:
            code[name] = len(names)
            names.append(name)
    names.append(None)  # code -1: nobody (an empty map)
    new_codes = np.fromiter((code[name] for name in new_arrays.consumers), np.intp, len(new_arrays.consumers))
    everything = np.array([size - 1], dtype=np.intp)
    nobody = np.array([-1], dtype=np.intp)
    old_ends, old_owner = (old_arrays.ends, old_arrays.owner) if len(old_arrays.ends) else (everything, nobody)
    new_ends = new_arrays.ends if len(new_arrays.ends) else everything
    new_owner = new_codes[new_arrays.owner] if len(new_arrays.ends) else nobody
    ends = np.union1d(old_ends, new_ends)  # the pieces [previous end + 1, end] lie inside one range of each map
    before = old_owner[np.searchsorted(old_ends, ends)]
    after = new_owner[np.searchsorted(new_ends, ends)]
    starts = np.concatenate(([0], ends[:-1] + 1))
    moved = before != after
    # A moved piece continues the previous one's interval when both pieces moved between the same two owners.
    continues = np.zeros_like(moved)
    continues[1:] = moved[1:] & moved[:-1] & (before[1:] == before[:-1]) & (after[1:] == after[:-1])
    firsts = np.flatnonzero(moved & ~continues)
    lasts = np.flatnonzero(moved & ~np.append(continues[1:], False))
    return [
        (int(starts[first]), int(ends[last]), names[before[first]], names[after[first]])
        for first, last in zip(firsts.tolist(), lasts.tolist(), strict=True)
    ]


def reassign_rates(
    old: RangeMap,
    new: RangeMap,
    rates: Mapping[str, float],
    traffic: npt.NDArray[np.float64] | None,
    moved: list[tuple[int, int, str | None, str | None]] | None = None,
) -> dict[str, float]:
    """Estimate each consumer's dispatch rate under ``new`` from its measured rate under ``old``.

    A moved slot interval carries the share of its old owner's rate that its traffic (or,
    without traffic, its width) is of all the old owner's ranges. Used right after a change
    so the next decision does not act on the stale rate of a consumer that just lost half.
    ``moved`` is ``moved_slots(old, new)`` when the caller has it already.
    """
    arrays = old.arrays()
    sizes = np.bincount(arrays.owner, arrays.ends - arrays.starts + 1, len(arrays.consumers))
    widths = dict(zip(arrays.consumers, sizes.tolist(), strict=True))
    weights = range_traffic(old, traffic) if traffic is not None else widths
    estimated = {consumer: float(rates.get(consumer, 0.0)) for consumer in new.consumers()}
    for first, last, old_owner, new_owner in moved_slots(old, new) if moved is None else moved:
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
