"""Several ranges per consumer: every change moves about the least traffic a balanced result needs.

A consumer may own several ranges of the sorted map (at most ``max_ranges``; adjacent
ranges of one owner are one range). Each decision first computes the fair share of every
member by water-filling the measured traffic per slot (a consumer whose hottest slot is
heavier than a fair share is *pinned* at that slot: a key never splits, so it keeps the key
and little else), then moves weight from members above their share to members below it:

- **join**: the newcomer takes from the consumers above the new fair share, the busiest
  first, the low end of its tolerance band (``1 - tolerance`` times its fair share): about
  ``1/(n+1)`` of the traffic moves, a little under the least any perfectly balanced result
  can move. A piece is cut at the edge of one of the donor's heaviest ranges where the
  traffic splits, or is the range's hottest slot alone when that weighs what is needed
  (one key instead of a run of cold ones), or the narrowest run of slots inside the range
  that weighs it when that is at most half as wide as the best edge piece (keys are spread
  evenly over the slots, so a narrow run is few keys); a piece cut next to another donor is
  continued across the boundary (one range, not two); a surplus too small to be worth a
  range (under the tolerance) is taken from the busiest donors instead.
- **leave**: the leaver's ranges are carved, each in one pass, into consecutive pieces: the
  bottom for the neighbour below and the top for the neighbour above (boundary moves), the
  middle for the least busy consumers; only the leaver's share moves. A leaver's slot too
  hot for any member's room first goes to the member owning the fewest slots among those
  that can shed (its own hottest slot fits the room of another): what it sheds to make room
  is keys moved, and the narrowest sheds the fewest.
- **settle**: after a join or a leave, a member left over its cap (a hot slot that had to go
  somewhere) gives what it carries over its share to those under theirs, in the same change.
- **shift**: the settle step alone, when a member carries more than ``threshold`` times its
  fair share by more than the noise of its measured count.

A member in ``Load.closed`` (not making progress) never gains in a join or a leave: a
newcomer takes from it as from anyone, but the settle step runs among the open members
only (the closed neither give nor take there), and a leaver's slots go to the first open
standby, else are shared by the open members as if the closed were not there. The one
exception is a leaver's piece whose neighbours are both closed while every open member
owns ``max_ranges`` ranges: it goes to the less loaded neighbour. With no open member and
no open standby, a leave is planned as if nobody were closed.

Every consumer keeps at least one slot, a newcomer whose donors' excess lies in slots too
hot to move takes the least used slots, and a receiver owning ``max_ranges`` ranges takes
only pieces adjacent to its own. Every choice is deterministic (ties by position, then id).
See docs/evaluation.md.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from keyfailover.core._tiling import splice
from keyfailover.core.errors import RangeMapError
from keyfailover.core.ranges import Range, RangeMap
from keyfailover.core.rebalance._common import (
    Load,
    Policy,
    check_min_traffic,
    check_threshold,
    check_traffic,
    fair_shares,
)

__all__ = ["DEFAULT_MAX_RANGES", "MultiRangePolicy"]

DEFAULT_MAX_RANGES = 16
"""The most ranges one consumer may own unless configured otherwise."""

_FLOOR = 1e-3
"""Share of the measured traffic spread evenly over all slots, so that cold slots weigh a
little and cuts among them keep widths balanced (for keys not seen yet)."""

Side = Literal["low", "high"]

_CANDIDATES = 8
"""Ranges of a donor searched for a new piece (its heaviest): half of ``max_ranges`` by default;
the narrowest run carrying the amount is often in a lighter range (a warm key among cold ones)."""

_PIN_FLOOR_DIVISOR = 4.0
"""Slots lighter than the mean load over this are not searched for hot slots at first: a
consumer is pinned only by a slot heavier than the fair level, which falls below a quarter
of the mean only when pinned keys carry most of the traffic (then the search is redone)."""

_MIN_GRAIN = 0.0025
"""The least grain, as a share of a fair share: with threshold 1 the tolerance is 0, but a
piece of a quarter of a percent of a fair share is still not worth a range."""

_NARROWER = 2
"""A run of slots from inside a range is taken only when at most 1/this as wide as the best edge piece
(it splits the donor's range in two)."""

_HOT_BAND = 4.0
"""How many grains lighter than the amount a donor's hottest slot may be and still be taken alone."""


@dataclass(frozen=True)
class MultiRangePolicy(Policy):
    """Several ranges per consumer; see the module docstring.

    ``max_ranges`` bounds the ranges a consumer may own; ``threshold`` is the traffic
    max/mean above which :meth:`shift` acts, and sets the tolerance, half its margin: a
    consumer within ``1 ± (threshold - 1) / 2`` of its fair share is left alone;
    ``min_traffic`` is the measured traffic below which :meth:`shift` does nothing.
    """

    name: ClassVar[str] = "multi"
    reads_rates: ClassVar[bool] = False
    max_ranges: int = DEFAULT_MAX_RANGES
    threshold: float = 1.1
    min_traffic: float = 1000.0

    def __post_init__(self) -> None:
        if type(self.max_ranges) is not int or self.max_ranges < 1:
            raise RangeMapError(f"max_ranges must be an int >= 1, not {self.max_ranges!r}")
        check_threshold(self.threshold)
        check_min_traffic(self.min_traffic)

    @property
    def range_limit(self) -> int:
        """``max_ranges``."""
        return self.max_ranges

    @property
    def tolerance(self) -> float:
        """How far from its fair share (as a fraction of it) a consumer may end up."""
        return (self.threshold - 1.0) / 2.0

    def join(self, ranges: RangeMap, newcomer: str, load: Load) -> RangeMap:
        """The newcomer takes from the consumers above the new fair share, the busiest first.

        See the module docstring.
        """
        if newcomer in ranges:
            raise RangeMapError(f"{newcomer!r} already owns a range; expected a consumer without one")
        traffic, total = _measured(ranges, load)
        if not len(ranges):
            planned = ranges.copy()
            planned.assign_all(newcomer)
            return planned
        layout = _layout(ranges, traffic, total, self.max_ranges)
        layout.loads[newcomer] = 0.0
        members = [*ranges.consumers(), newcomer]
        shares = _shares(layout, members, 1.0 + self.tolerance)
        excess = np.maximum(shares.load - shares.target, 0.0)
        excess[-1] = 0.0
        gives = _from_the_top(excess, float(shares.target[-1]) * (1.0 - self.tolerance))
        room = np.where(excess > 0.0, shares.load - shares.target * (1.0 - 2.0 * self.tolerance), 0.0)
        gives = _consolidate(gives, room, self.tolerance * shares.level)
        layout.transfer(_named(members, gives), {newcomer: float(gives.sum())}, self._grain(shares.level))
        self._settle(layout, *_open(layout, members, load.closed - {newcomer}), 1.0 + self.tolerance)
        if not layout.count(newcomer):
            layout.give_idle(newcomer)
        return layout.plan(ranges)

    def leave(self, ranges: RangeMap, leaver: str, load: Load, standby: Sequence[str] = ()) -> RangeMap:
        """The leaver's ranges go whole to the first standby not in ``load.closed``, else are carved
        among the other members not in it (see the module docstring).

        A closed member gains nothing, but for a piece that no other member can take: one whose
        neighbours are both closed while every open member owns ``max_ranges`` ranges goes to the
        less loaded neighbour. With no open member and no open standby at all, the leave is
        planned as if nobody were closed.
        """
        if leaver not in ranges:
            return ranges.copy()
        members = [c for c in ranges.consumers() if c != leaver]
        closed = load.closed
        heirs = [s for s in standby if s not in closed]
        if not heirs and all(m in closed for m in members):
            closed, heirs = frozenset(), list(standby)  # nobody may gain: as if nobody were closed
        if heirs:
            heir = heirs[0]
            if heir in ranges:
                raise RangeMapError(f"standby {heir!r} already owns a range; expected a consumer without one")
            planned = ranges.copy()
            planned.reassign([(start, end, heir) for start, end in ranges.ranges_of(leaver)])
            return planned
        if len(ranges) == 1:
            planned = ranges.copy()
            planned.clear()
            return planned
        layout = _layout(ranges, *_measured(ranges, load), self.max_ranges)
        # The open members share what they and the leaver carry; the closed keep theirs.
        takers, held = _open(layout, members, closed)
        cap = 1.0 + self.tolerance
        shares = _shares(layout, takers, cap, None if held is None else held + layout.loads[leaver])
        shortfall = np.maximum(shares.target - shares.load, 0.0)
        takes = _from_the_top(shortfall, layout.loads[leaver])
        room = np.where(shortfall > 0.0, shares.target * cap - shares.load, 0.0)
        takes = _consolidate(takes, room, self.tolerance * shares.level)
        grain = self._grain(shares.level)
        receivers = _named(takers, takes)
        under_cap = dict(zip(takers, (shares.target * cap - shares.load).tolist(), strict=True))
        layout.rehome_hottest(leaver, under_cap, receivers)
        layout.carve(leaver, receivers, grain)
        left = layout.loads[leaver]
        if left > grain and layout.count(leaver):
            # What did not fit the fair shares goes where there is room under the caps, the emptiest first.
            now = np.fromiter(map(layout.loads.__getitem__, takers), np.float64, len(takers))
            room = np.maximum(shares.target * cap - now, 0.0)
            layout.transfer({leaver: left}, _named(takers, _from_the_top(room, left)), grain)
        layout.hand_to_neighbours(leaver, takers)
        self._settle(layout, takers, None if held is None else _carried(layout, takers), cap)
        return layout.plan(ranges)

    def shift(self, ranges: RangeMap, load: Load) -> RangeMap | None:
        """The settle step alone, when a member carries more than ``threshold`` times its fair share beyond noise."""
        traffic, total = _measured(ranges, load)
        if traffic is None or len(ranges) < 2 or total < max(self.min_traffic, 1e-300):
            return None
        layout = _layout(ranges, traffic, total, self.max_ranges)
        if not self._settle(layout, ranges.consumers(), None, self.threshold):
            return None
        return layout.plan(ranges)

    def _settle(self, layout: _Layout, members: list[str], total: float | None, trigger: float) -> bool:
        """If a member carries more than ``trigger`` times its fair share, move what members carry
        over their share to those under it; True if anything moved.

        After a join or a leave this restores balance in the same change where the slots did
        not allow the first moves to (a hot key that had to go somewhere); alone it is the
        shift. Only a member over its cap gives, and no receiver is filled past its share,
        so the excess over the caps only shrinks. A member counts as over only by more than
        the noise of its measured traffic (three standard deviations of a Poisson count),
        so that a sampling blip moves nothing. ``members`` are those taking part (after a
        change with closed members, the open ones) and ``total`` what they carry together
        (None: everything, when every member takes part).
        """
        cap = 1.0 + self.tolerance
        shares = _shares(layout, members, cap, total)
        load, target = shares.load, shares.target
        noise = layout.noise(target)
        over = load > target * cap + noise
        if not (over & (load > target * trigger + noise)).any():
            return False
        gives = np.where(over, load - target, 0.0)
        shortfall = np.maximum(target - load, 0.0)
        takes = _from_the_top(shortfall, float(gives.sum()))
        room = np.where(shortfall > 0.0, target * cap - load, 0.0)
        takes = _consolidate(takes, room, self.tolerance * shares.level)
        moves = len(layout.moves)
        layout.transfer(_named(members, gives), _named(members, takes), self._grain(shares.level))
        return len(layout.moves) > moves

    def _grain(self, level: float) -> float:
        """Leftovers below this weight are not worth another piece (never 0, even at threshold 1)."""
        return max(self.tolerance / 4.0, _MIN_GRAIN) * level


def _measured(ranges: RangeMap, load: Load) -> tuple[npt.NDArray[np.float64] | None, float]:
    """``load.traffic``, checked against ``ranges``, and its total (0 without traffic)."""
    traffic = check_traffic(ranges, load)
    return traffic, 0.0 if traffic is None else float(np.add.reduce(traffic))


def _layout(ranges: RangeMap, traffic: npt.NDArray[np.float64] | None, total: float, max_ranges: int) -> _Layout:
    """The planning layout: each slot weighs its measured traffic plus a thin even floor (its width without traffic).

    ``total`` is the traffic's, as :func:`_measured` gives it.
    """
    size = ranges.range_size
    if traffic is None or not total > 0.0:
        return _Layout(ranges, np.ones(size, dtype=np.float64), False, max_ranges)
    return _Layout(ranges, np.asarray(traffic, dtype=np.float64) + total * _FLOOR / size, True, max_ranges)


Vector = npt.NDArray[np.float64]


class _Shares(NamedTuple):
    """Every member's load and fair share, in the order of the members given."""

    load: Vector
    target: Vector
    level: float
    """The fair share of a member that is not pinned."""


def _shares(layout: _Layout, members: list[str], slack: float, total: float | None = None) -> _Shares:
    """Each member's load, and its fair share of ``total`` (None: the layout's) by water-filling
    (:func:`fair_shares`).

    A member whose hottest slot exceeds ``slack`` times the level is pinned at that slot's
    weight (it cannot be split). The layout knows only the peaks above its ``peak_floor``;
    a level whose cap falls below that asks for the exact peaks and is taken again.
    """
    count = len(members)
    load = np.fromiter(map(layout.loads.__getitem__, members), np.float64, count)
    whole = layout.total if total is None else total
    while True:
        hottest = layout.hottest()
        heat = np.fromiter(map(hottest.get, members, itertools.repeat(0.0, count)), np.float64, count)
        target, level, _ = fair_shares(heat, whole, slack)
        if level * slack >= layout.peak_floor:
            return _Shares(load, target, level)
        layout.exact_peaks()


def _open(layout: _Layout, members: list[str], closed: frozenset[str]) -> tuple[list[str], float | None]:
    """``members`` but the ``closed``, and what they carry together: None when none is closed (then
    they carry the layout's total, or all but a leaver's remains)."""
    if closed.isdisjoint(members):
        return members, None
    kept = [member for member in members if member not in closed]
    return kept, _carried(layout, kept)


def _carried(layout: _Layout, members: list[str]) -> float:
    """What ``members`` carry together."""
    return float(sum(map(layout.loads.__getitem__, members)))


def _named(members: list[str], amounts: Vector) -> dict[str, float]:
    """The positive ``amounts`` by member."""
    return {members[i]: float(amounts[i]) for i in np.flatnonzero(amounts > 0.0).tolist()}


def _from_the_top(amounts: Vector, total: float) -> Vector:
    """Take ``total`` out of ``amounts``, the largest first, leaving the rest as even as possible.

    Returns what each gives: ``max(0, amount - x)`` with ``x`` chosen so the gifts sum to
    ``total`` (all of every amount when ``total`` exceeds their sum).
    """
    positive = np.maximum(amounts, 0.0)
    if total <= 0.0:
        return np.zeros_like(positive)
    if total >= float(positive.sum()):
        return positive
    ordered = np.sort(positive)[::-1]
    running = ordered.cumsum()
    below = np.append(ordered[1:], 0.0)
    # Lowering the cut to the next amount down takes running[k] - (k + 1) * below[k] in all.
    taken = running - np.arange(1, len(ordered) + 1) * below
    k = min(int(taken.searchsorted(total)), len(ordered) - 1)  # rounding may put the total past the last
    cut = (float(running[k]) - total) / (k + 1)
    return np.maximum(positive - cut, 0.0)


def _consolidate(amounts: Vector, room: Vector, small: float) -> Vector:
    """Fold amounts under ``small`` into the largest, each up to its ``room``; returns the new amounts.

    Many slivers would each cost a range; a few consumers taking a little more (within
    the tolerance) cost none. The total stays the same: what no room can hold goes back
    to the slivers it came from, the largest first.
    """
    order = (-amounts).argsort(kind="stable")
    order = order[amounts[order] > 0.0]
    slivers = amounts < small
    result = np.where(slivers, 0.0, amounts)
    spare = float(amounts[slivers & (amounts > 0.0)].sum())
    if spare <= 0.0:
        return result
    for cap in (np.maximum(room - result, 0.0), np.where(slivers, amounts, 0.0)):
        # In order, each takes what it can hold until the spare is placed.
        holds = cap[order]
        before = holds.cumsum() - holds
        extra = (spare - before).clip(0.0, holds)
        result[order] += extra
        spare -= float(extra.sum())
        if spare <= 1e-12 * max(float(amounts.sum()), 1.0):
            break
    return result


class _Piece(NamedTuple):
    """Slots ``[low, high]`` to move, and their weight."""

    low: int
    high: int
    weight: float


class _Layout:
    """A working copy of a range map for planning: parallel sorted lists of ranges, and cumulative weights.

    Plain lists searched with :mod:`bisect`: a plan touches a few ranges of at most a few
    thousand, where a list insert (a memmove) is cheaper than a balanced tree.
    """

    def __init__(self, ranges: RangeMap, weights: npt.NDArray[np.float64], measured: bool, max_ranges: int) -> None:
        self.max_ranges = max_ranges
        self._weights = weights
        arrays = ranges.arrays()
        self.size = ranges.range_size
        self.total = float(np.add.reduce(weights))
        self._starts: list[int] = arrays.starts.tolist()
        self._ends: list[int] = list(ranges.lookup_table()[0])
        self._owners: list[str] = list(ranges.lookup_table()[1])
        count = len(arrays.consumers)
        sums = np.add.reduceat(weights, arrays.starts) if len(arrays.starts) else np.zeros(0)
        self.loads = dict(zip(arrays.consumers, np.bincount(arrays.owner, sums, count).tolist(), strict=True))
        # Each owner's heaviest slot, among the slots heavy enough to be pinned in all but
        # extreme skews (one comparison over the slots instead of a maximum per range); a
        # level below ``peak_floor`` asks for the exact peaks (see _shares).
        self.peak_floor = self.total / max(count, 1) / _PIN_FLOOR_DIVISOR
        self._peaks: dict[str, float] = {}
        self._find_peaks(self.peak_floor)
        # Each owner's range starts, built when first needed from the map as given (an owner's
        # set is built before any change touches it, so a set built later is still right).
        self._arrays = arrays
        self._sums = sums
        self._grouped: tuple[dict[str, int], npt.NDArray[np.intp], list[int]] | None = None  # see _starts_set
        self._starts_of: dict[str, set[int]] = {}
        # Per range start: its weight (of an owner's ranges as given, filled in when its starts are
        # indexed), and its heaviest slot with that slot's weight (found when first asked); both
        # forgotten when the range changes.
        self._range_weight: dict[int, float] = {}
        self._range_peak: dict[int, tuple[int, float]] = {}
        self._running: dict[int, npt.NDArray[np.float64]] = {}
        self.measured = measured
        self._stale: set[str] = set()  # owners that gave away their heaviest slot
        # Per donor, the largest limit no new-range piece of it fitted under since its ranges last
        # changed: a later search within that limit (a settle after the join, say) is skipped.
        self._no_piece: dict[str, float] = {}
        self.moves: list[Range] = []

    def _starts_set(self, owner: str) -> set[int]:
        """The starts of ``owner``'s ranges: built from the map as given when first asked for.

        The changes keep the set up to date from then on.
        """
        found = self._starts_of.get(owner)
        if found is None:
            grouped = self._grouped
            if grouped is None:
                # The map's range starts grouped by owner, sorted once for all owners (a shift
                # that finds nothing to do never needs them).
                arrays = self._arrays
                order = arrays.owner.argsort(kind="stable")
                group = arrays.owner[order].searchsorted(np.arange(len(arrays.consumers) + 1)).tolist()
                code = {consumer: index for index, consumer in enumerate(arrays.consumers)}
                grouped = self._grouped = (code, order, group)
            code, order, group = grouped
            index = code.get(owner)
            if index is None:
                found = set()
            else:
                mine = order[group[index] : group[index + 1]]
                starts = self._arrays.starts[mine].tolist()
                found = set(starts)
                self._range_weight.update(zip(starts, self._sums[mine].tolist(), strict=True))
            self._starts_of[owner] = found
        return found

    def noise(self, expected: Vector) -> Vector:
        """How far measured loads may stray from ``expected`` by chance (0 when nothing was measured)."""
        return 3.0 * np.sqrt(np.maximum(expected, 0.0)) if self.measured else np.zeros_like(expected)

    def _find_peaks(self, floor: float) -> None:
        """Each owner's heaviest slot among the slots heavier than ``floor`` (owners without one: 0)."""
        self._peaks.clear()
        heavy = np.flatnonzero(self._weights > floor)
        owners, ends = self._owners, self._ends
        for slot, heat in zip(heavy.tolist(), self._weights[heavy].tolist(), strict=True):
            owner = owners[bisect.bisect_left(ends, slot)]
            if heat > self._peaks.get(owner, 0.0):
                self._peaks[owner] = heat

    def exact_peaks(self) -> None:
        """Find every owner's heaviest slot, however light."""
        if self.peak_floor > 0.0:
            self.peak_floor = 0.0
            self._stale.clear()
            self._find_peaks(-1.0)

    def hottest(self) -> dict[str, float]:
        """Each owner's heaviest slot."""
        for owner in self._stale:
            peak = max(
                (float(self._weights[self._starts[i] : self._ends[i] + 1].max()) for i in self.indexes_of(owner)),
                default=0.0,
            )
            if peak > self.peak_floor:
                self._peaks[owner] = peak
            else:
                self._peaks.pop(owner, None)
        self._stale.clear()
        return self._peaks

    def weight(self, start: int, end: int) -> float:
        """The traffic of the slots ``start`` to ``end``, both included."""
        return float(np.add.reduce(self._weights[start : end + 1]))

    def range_weight(self, index: int) -> float:
        """The weight of the range at list position ``index`` (remembered until the range changes)."""
        start = self._starts[index]
        found = self._range_weight.get(start)
        if found is None:
            self._starts_set(self._owners[index])  # weighs the owner's ranges as given, if not done yet
            found = self._range_weight.get(start)
            if found is None:
                found = self._range_weight[start] = self.weight(start, self._ends[index])
        return found

    def range_peak(self, index: int) -> tuple[int, float]:
        """The heaviest slot of the range at list position ``index`` and its weight (remembered likewise)."""
        start = self._starts[index]
        found = self._range_peak.get(start)
        if found is None:
            slot = start + int(self._weights[start : self._ends[index] + 1].argmax())
            found = self._range_peak[start] = (slot, float(self._weights[slot]))
        return found

    def count(self, owner: str) -> int:
        """How many ranges ``owner`` holds."""
        found = self._starts_of.get(owner)
        return len(found if found is not None else self._starts_set(owner))

    def indexes_of(self, owner: str) -> list[int]:
        """The positions of ``owner``'s ranges in the lists, in hash order."""
        return sorted(map(partial(bisect.bisect_left, self._starts), self._starts_set(owner)))

    def range_at(self, index: int) -> tuple[int, int, str] | None:
        """The range at list position ``index``, or None past either end of the space."""
        if not 0 <= index < len(self._starts):
            return None
        return self._starts[index], self._ends[index], self._owners[index]

    def give(self, start: int, end: int, receiver: str) -> float:
        """Move ``[start, end]``, which lies inside one range, to ``receiver``; returns its weight."""
        at = bisect.bisect_right(self._starts, start) - 1
        donor = self._owners[at]
        starts_of = self._starts_of
        for owner in (donor, receiver):
            if owner not in starts_of:
                self._starts_set(owner)  # index both before the lists change
        # A range that gives its top keeps the head of its cumulative weights: the same sums, in the same order.
        kept = self._running.get(self._starts[at]) if self._ends[at] == end and self._starts[at] < start else None
        spliced = splice(self._starts, self._ends, self._owners, (start, end, receiver))
        assert spliced is not None, f"[{start}, {end}] is {receiver!r}'s already"
        removed, added = spliced
        range_weight, range_peak, running = self._range_weight, self._range_peak, self._running
        for range_start, _, owner in removed:
            starts_of[owner].discard(range_start)
            range_weight.pop(range_start, None)
            range_peak.pop(range_start, None)
            running.pop(range_start, None)
        for range_start, _, owner in added:
            starts_of[owner].add(range_start)
        if kept is not None:
            running[self._starts[at]] = kept[: start - self._starts[at]]
        self._no_piece.pop(donor, None)
        self._no_piece.pop(receiver, None)
        piece = self._weights[start : end + 1]
        heaviest = float(np.maximum.reduce(piece))
        if heaviest > self.peak_floor:
            if heaviest >= self._peaks.get(donor, 0.0):
                self._stale.add(donor)
            self._peaks[receiver] = max(self._peaks.get(receiver, 0.0), heaviest)
        weight = float(np.add.reduce(piece))
        self.loads[donor] -= weight
        self.loads[receiver] = self.loads.get(receiver, 0.0) + weight
        self.moves.append((start, end, receiver))
        return weight

    def running(self, index: int) -> npt.NDArray[np.float64]:
        """Cumulative weights across the range at list position ``index`` (remembered until it changes)."""
        start = self._starts[index]
        found = self._running.get(start)
        if found is None:
            found = self._running[start] = self._weights[start : self._ends[index] + 1].cumsum()
        return found

    def cut(self, index: int, side: Side, amount: float, limit: float) -> _Piece | None:
        """The piece at the ``side`` edge of range ``index`` whose weight is nearest ``amount``, at most ``limit``.

        The piece never splits a slot; of two equally near pieces the narrower wins. A
        consumer's only range is never taken whole (it would own nothing without being a
        standby). None when even one slot weighs more than ``limit``, or the range is a
        consumer's only slot.
        """
        start, end = self._starts[index], self._ends[index]
        if self._weights.item(start if side == "low" else end) > limit:
            return None  # the narrowest piece, the edge slot alone, is too heavy already
        run = self.running(index)  # run[k]: slots start .. start + k
        width = len(run)
        longest = width - 1 if self.count(self._owners[index]) == 1 else width
        if longest < 1:
            return None
        # Two candidates, the shorter first: the pieces whose weights bracket the amount.
        if side == "low":
            # The piece [start, start + k] weighs run[k], for k < longest.
            k = min(int(run.searchsorted(amount)), longest - 1)
            wider = _Piece(start, start + k, run.item(k))
            shorter = _Piece(start, start + k - 1, run.item(k - 1)) if k else wider
        else:
            # The piece [start + j, end] weighs total - run[j - 1] (all of it for j = 0), for j >= width - longest.
            total = run.item(-1)
            i = int(run.searchsorted(total - amount))
            lowest = width - longest
            j = min(max(i + 1, lowest), width - 1)
            shorter = _Piece(start + j, end, total - run.item(j - 1) if j > 0 else total)
            j = min(max(i, lowest), width - 1)
            wider = _Piece(start + j, end, total - run.item(j - 1) if j > 0 else total)
        if wider.weight > limit:
            return shorter if shorter.weight <= limit else None
        if shorter.weight > limit:
            return wider
        near_short = (abs(shorter.weight - amount), shorter.high - shorter.low)
        return wider if (abs(wider.weight - amount), wider.high - wider.low) < near_short else shorter

    def transfer(self, gives: dict[str, float], takes: dict[str, float], grain: float) -> None:
        """Move weight from donors (``gives``) to receivers (``takes``), as far as both allow.

        First across boundaries where a donor's range touches a receiver's (a boundary
        move, no new range), then as new ranges of receivers owning fewer than
        ``max_ranges``, each followed by the boundary moves it opened (a piece cut next to
        another donor is continued across the boundary). A first round cuts pieces of at
        most what the donor gives; a second lets a donor give more (a slot too heavy for
        its share) as long as the receiver still needs it. Both dicts are consumed in
        place; amounts under ``grain`` are left where they are.
        """
        for overshoot in (False, True):
            self._boundaries(self._touching(gives, takes, grain), gives, takes, grain, overshoot)
            self._new_ranges(gives, takes, grain, overshoot)

    def _touching(
        self, gives: dict[str, float], takes: dict[str, float], grain: float, owners_of: Iterable[str] | None = None
    ) -> list[tuple[int, Side]]:
        """``(range start, side)`` of each donor range edge that touches a receiver's range.

        Walks the ranges of ``owners_of`` if given, else of whichever side owns fewer
        ranges (a join has one receiver, a leave one donor).
        """
        if owners_of is None:
            donors = [d for d, amount in gives.items() if amount >= grain]
            receivers = [r for r, amount in takes.items() if amount >= grain]
            owners_of = donors if self._own_at_least(receivers, sum(map(self.count, donors))) else receivers
        owners, starts = self._owners, self._starts
        last = len(owners) - 1
        found: list[tuple[int, Side]] = []
        # A donor gives at least the grain, a receiver takes at least the grain (grain >= 0 > -1).
        for owner in sorted(owners_of):  # by name, whatever order they come in (G6)
            gives_here = gives.get(owner, -1.0) >= grain
            takes_here = takes.get(owner, -1.0) >= grain
            if not (gives_here or takes_here):
                continue
            for index in self.indexes_of(owner):
                if index > 0:
                    other = owners[index - 1]
                    if gives_here and takes.get(other, -1.0) >= grain:
                        found.append((starts[index], "low"))
                    elif takes_here and gives.get(other, -1.0) >= grain:
                        found.append((starts[index - 1], "high"))
                if index < last:
                    other = owners[index + 1]
                    if gives_here and takes.get(other, -1.0) >= grain:
                        found.append((starts[index], "high"))
                    elif takes_here and gives.get(other, -1.0) >= grain:
                        found.append((starts[index + 1], "low"))
        return found

    def _own_at_least(self, owners: Iterable[str], ranges: int) -> bool:
        """Whether ``owners`` own ``ranges`` ranges or more in all (counted only as far as needed)."""
        for owner in owners:
            ranges -= self.count(owner)
            if ranges <= 0:
                return True
        return ranges <= 0

    def _boundaries(
        self,
        edges: list[tuple[int, Side]],
        gives: dict[str, float],
        takes: dict[str, float],
        grain: float,
        overshoot: bool,
    ) -> None:
        """Move each of ``edges`` (a donor's range edge next to a receiver) by what both still allow."""
        starts, owners = self._starts, self._owners
        for start, side in edges:
            index = bisect.bisect_left(starts, start)
            if index == len(starts) or starts[index] != start:
                continue  # the range changed since; its new edges are found after the move that changed it
            other = index - 1 if side == "low" else index + 1
            if not 0 <= other < len(starts):
                continue
            donor, receiver = owners[index], owners[other]
            amount = min(gives.get(donor, 0.0), takes.get(receiver, 0.0))
            if amount < grain:
                continue
            piece = self.cut(index, side, amount, (takes[receiver] if overshoot else amount) + grain)
            if piece is not None:
                self._moved(donor, receiver, self.give(piece.low, piece.high, receiver), gives, takes)

    def _new_ranges(self, gives: dict[str, float], takes: dict[str, float], grain: float, overshoot: bool) -> None:
        """Receivers by need take pieces from donors by what they give, each piece a new range."""
        donors = sorted((d for d, amount in gives.items() if amount >= grain), key=lambda d: (-gives[d], d))
        receivers = sorted((r for r, amount in takes.items() if amount >= grain), key=lambda r: (-takes[r], r))
        failed = self._no_piece
        failed_here: set[str] = set()
        band = _HOT_BAND * grain
        for receiver in receivers:
            if self.count(receiver) >= self.max_ranges:
                continue
            for donor in donors:
                if takes[receiver] < band or self.count(receiver) >= self.max_ranges:
                    break  # this receiver is done: on to the next
                while donor != receiver and min(gives[donor], takes[receiver]) >= band:
                    amount = min(gives[donor], takes[receiver])
                    limit = (takes[receiver] if overshoot else amount) + grain
                    if limit <= failed.get(donor, -1.0):
                        break
                    piece = self._best_piece(donor, amount, limit, gives, grain)
                    if piece is None:
                        failed[donor] = limit
                        failed_here.add(donor)
                        break
                    weight = self.give(*piece, receiver)
                    self._moved(donor, receiver, weight, gives, takes)
                    self._boundaries(self._touching(gives, takes, grain, (receiver,)), gives, takes, grain, overshoot)
                    if weight < grain or self.count(receiver) >= self.max_ranges:
                        break
            # A donor that had nothing to fit this receiver's need fits no smaller one either.
            donors = [d for d in donors if gives[d] >= band and d not in failed_here]

    def _best_piece(
        self, donor: str, amount: float, limit: float, gives: dict[str, float], grain: float
    ) -> tuple[int, int] | None:
        """Where ``donor`` gives about ``amount`` (at most ``limit``) as a new range of a receiver.

        Candidates come from the donor's heaviest ranges: the piece at either edge nearest
        the amount, the range's hottest slot alone when it weighs within a few grains of the
        amount (one key carrying a share of traffic moves far fewer keys than a run of cold
        slots), and otherwise the narrowest run of slots inside the range weighing that much
        (:meth:`window`); taking from inside a range splits it, so these only while the donor
        owns fewer than ``max_ranges``. The hottest slot wins when it qualifies; otherwise
        the piece nearest the amount, then the narrowest (fewest keys; a run from inside
        counts ``_NARROWER`` times its width), then one next to another donor (the next
        piece continues it).
        """
        owners, starts, ends = self._owners, self._starts, self._ends
        last = len(owners) - 1
        ranges = self.count(donor)
        band = amount - _HOT_BAND * grain
        range_weight = self.range_weight
        indexes = sorted(self.indexes_of(donor), key=lambda i: -range_weight(i))
        best: tuple[int, int, int, int, int] | None = None
        for index in indexes[:_CANDIDATES]:
            for side, across in (("low", index - 1), ("high", index + 1)):
                piece = self.cut(index, side, amount, limit)  # type: ignore[arg-type]
                if piece is not None:
                    low, high, weight = piece
                    continues = 0 if 0 <= across <= last and gives.get(owners[across], 0.0) >= grain else 1
                    candidate = (self._error(weight, amount, grain), high - low + 1, continues, low, high)
                    if best is None or candidate < best:
                        best = candidate
            start, end = starts[index], ends[index]
            if (start == end and ranges > 1) or (start < end and ranges < self.max_ranges):
                hot, heat = self.range_peak(index)
                if band <= heat <= limit:
                    candidate = (0, 0, 0, hot, hot)
                    if best is None or candidate < best:
                        best = candidate
                elif start < end and self.range_weight(index) >= band:
                    window = self.window(index, max(band, grain), limit)
                    if window is not None:
                        low, high = window
                        candidate = (0, (high - low + 1) * _NARROWER, 0, low, high)
                        if best is None or candidate < best:
                            best = candidate
            if best is not None and best[0] == 0 and best[1] == 0:
                break  # a single slot of the right weight: nothing lighter can beat it
        return None if best is None else (best[3], best[4])

    def window(self, index: int, least: float, limit: float) -> tuple[int, int] | None:
        """The narrowest run of slots in range ``index`` weighing from ``least`` to ``limit`` (the lowest such run).

        One cumulative sum and one ``searchsorted``: for every first slot, the shortest run
        from it that weighs ``least``. None when no run weighs within the bounds.
        """
        run = self.running(index)
        width = len(run)
        before = np.concatenate(((0.0,), run[:-1]))
        last = np.minimum(run.searchsorted(before + least), width - 1)
        fits = (run[last] - before >= least) & (run[last] - before <= limit)
        if not fits.any():
            return None
        widths = np.where(fits, last - np.arange(width), width)
        first = int(widths.argmin())
        start = self._starts[index]
        return start + first, start + int(last[first])

    @staticmethod
    def _error(weight: float, amount: float, grain: float) -> int:
        """How far ``weight`` is from ``amount``, in grains (0 within one grain)."""
        error = abs(weight - amount)
        return 0 if error <= grain else int(error / grain) + 1

    @staticmethod
    def _moved(donor: str, receiver: str, weight: float, gives: dict[str, float], takes: dict[str, float]) -> None:
        """Book ``weight`` moved from ``donor`` to ``receiver``: both owe that much less."""
        gives[donor] -= weight
        takes[receiver] -= weight

    def carve(self, leaver: str, takes: dict[str, float], grain: float) -> None:
        """Cut ``leaver``'s ranges into consecutive pieces for the receivers in ``takes``, consumed in place.

        Each range, the heaviest first, is carved in one pass (one cumulative sum, one
        ``searchsorted`` for every cut): its bottom for the neighbour below and its top for
        the neighbour above when they take (boundary moves, no new range), the middle for
        the others in one queue, those taking most first, so a receiver the end of one range
        cut short continues in the next; each such piece is a new range of its receiver,
        which must own fewer than ``max_ranges``. Cuts fall between slots, at the slot
        boundary nearest each receiver's amount.
        """
        queue = sorted((r for r, amount in takes.items() if amount >= grain), key=lambda r: (-takes[r], r))
        heaviest_first = sorted(self.indexes_of(leaver), key=lambda i: -self.range_weight(i))
        for start, end in [(self._starts[i], self._ends[i]) for i in heaviest_first]:
            index = bisect.bisect_left(self._starts, start)
            below = self._owners[index - 1] if index > 0 else None
            above = self._owners[index + 1] if index + 1 < len(self._owners) else None
            order = [below] if below is not None and takes.get(below, 0.0) >= grain else []
            # The middle receivers are taken lazily, until the range is used up: a give to one
            # changes neither the amount nor the ranges of those after it.
            middle = (
                r for r in queue if takes[r] >= grain and r not in (below, above) and self.count(r) < self.max_ranges
            )
            to_above = above if above is not None and takes.get(above, 0.0) >= grain else None
            running = self.running(index)
            width = len(running)
            wanted = 0.0  # what the receivers so far asked for in all, before this range
            first = start
            for receiver in itertools.chain(order, middle):
                wanted += takes[receiver]
                # The slot boundary nearest the amount: the piece ends at slot cut - 1.
                at = int(running.searchsorted(wanted))
                lower = running.item(min(at, width) - 1) if at else 0.0
                upper = running.item(min(at, width - 1))
                cut = min(at + 1 if abs(upper - wanted) < abs(wanted - lower) else at, width)
                last = start + cut - 1
                if last < first:
                    continue
                takes[receiver] -= self.give(first, last, receiver)
                first = last + 1
                if first > end:
                    break
            if to_above is not None and first <= end:
                takes[to_above] -= self.give(first, end, to_above)  # the rest, to the neighbour above: a boundary move

    def rehome_hottest(self, leaver: str, room: dict[str, float], takes: dict[str, float]) -> None:
        """Give ``leaver``'s hottest slot, if no member has ``room`` for it, to the narrowest member that can shed.

        The member that takes such a slot must shed its other load (the settle step after
        the leave), and every slot it sheds is keys moved: the member owning the fewest
        slots sheds the fewest. It must be able to shed: its own hottest slot must fit the
        second largest room (the largest may be its own). ``takes`` is lowered by what the
        member received. Ties go to the name (G6).
        """
        indexes = self.indexes_of(leaver)
        if len(room) < 2 or (len(indexes) == 1 and self._starts[indexes[0]] == self._ends[indexes[0]]):
            return
        hot, heat = max(map(self.range_peak, indexes), key=lambda peak: peak[1])
        second, most = sorted(room.values())[-2:]
        if heat <= most:
            return
        hottest = self.hottest()
        able = {m for m in room if self.count(m) < self.max_ranges and hottest.get(m, 0.0) <= second}
        if not able:
            return
        widths = dict.fromkeys(able, 0)
        for start, end, owner in zip(self._starts, self._ends, self._owners, strict=True):
            if owner in widths:
                widths[owner] += end - start + 1
        into = min(able, key=lambda member: (widths[member], member))
        takes[into] = takes.get(into, 0.0) - self.give(hot, hot, into)

    def give_idle(self, newcomer: str) -> None:
        """Give ``newcomer`` the upper half of the least used range that can spare a slot.

        A join whose donors' excess lies in slots too hot to move would leave the newcomer
        owning nothing while others hold idle slots; this way it owns slots that keys may
        come to (and a later shift can weigh). Nothing happens when every range is one slot
        of a consumer owning no other.
        """
        best: tuple[float, int, int] | None = None
        for index, (start, end, owner) in enumerate(zip(self._starts, self._ends, self._owners, strict=True)):
            if start == end and self.count(owner) == 1:
                continue
            candidate = (self.range_weight(index) / (end - start + 1), -(end - start), start)
            if best is None or candidate < best:
                best = candidate
        if best is None:
            return
        start = best[2]
        index = bisect.bisect_left(self._starts, start)
        end = self._ends[index]
        low = start + (end - start + 1) // 2 if end > start else start
        self.give(low, end, newcomer)

    def hand_to_neighbours(self, leaver: str, receivers: list[str]) -> None:
        """Whatever ``leaver`` still owns goes to an adjacent neighbour among ``receivers``, the less loaded one
        (a boundary move).

        A range with no such neighbour goes to the least loaded of ``receivers`` owning fewer than
        ``max_ranges`` (a new range of it), and with none of those to the less loaded neighbour.
        """
        allowed = set(receivers)
        while self.count(leaver):
            index = self.indexes_of(leaver)[0]
            neighbours = [found[2] for found in (self.range_at(index - 1), self.range_at(index + 1)) if found]
            candidates = [owner for owner in neighbours if owner in allowed]
            if not candidates:
                candidates = [owner for owner in receivers if self.count(owner) < self.max_ranges] or neighbours
            into = min(candidates, key=lambda owner: (self.loads[owner], owner))
            self.give(self._starts[index], self._ends[index], into)

    def plan(self, ranges: RangeMap) -> RangeMap:
        """``ranges`` with every move applied, as one change (the layout's own lists: use it no more)."""
        if not self.moves:
            return ranges.copy()
        counts = {owner: len(starts) for owner, starts in self._starts_of.items()}
        return ranges._spliced_copy(self._starts, self._ends, self._owners, counts)
