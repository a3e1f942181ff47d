"""Key_Shared STICKY (Pulsar's ``HashRangeExclusiveStickyKeyConsumerSelector``): each consumer owns the
hash ranges it declared, and nothing else.

Nothing moves by load: a join gives the joiner exactly its declared ranges, a leave leaves them
to nobody, and there is no shift. Slots that no present consumer declared belong to the reserved
owner :data:`UNASSIGNED`, so that the map still tiles the space (snapshots, metrics and Spark read
it as they read any map); their messages wait, as Pulsar's do, until a consumer declaring them
joins. The declarations live in a mapping the caller owns (the dispatcher keeps one per
subscription, checked there for overlaps): the policy only reads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Final

from keyfailover.core.errors import RangeMapError
from keyfailover.core.ranges import Range, RangeMap
from keyfailover.core.rebalance._common import Load, Policy

__all__ = ["MAX_STICKY_RANGES", "UNASSIGNED", "StickyPolicy"]

UNASSIGNED: Final = "<unassigned>"
"""The owner of the slots no consumer of a sticky subscription declared; never a consumer's id."""

MAX_STICKY_RANGES: Final = 1024
"""The most hash ranges one sticky consumer may declare: each costs the range map, its snapshots and
the metrics a range, and a subscribe is checked against every other consumer's."""


class StickyPolicy(Policy):
    """Every consumer owns the ranges ``declared[consumer]`` (inclusive slots of the map's space).

    ``declared`` holds the non-overlapping ranges of every present consumer (an empty list for one
    with nothing in this space), and of no consumer that left: while it holds anyone, the map is
    not empty (all of it unassigned, if need be); empty, the map is. The policy reads it at each
    join and leave and never changes it.
    """

    name: ClassVar[str] = "sticky"
    reads_rates: ClassVar[bool] = False

    def __init__(self, declared: Mapping[str, Sequence[tuple[int, int]]]) -> None:
        self._declared = declared

    @property
    def range_limit(self) -> int:
        """Whatever a consumer declares: at most :data:`MAX_STICKY_RANGES` (fewer once touching ones merge)."""
        return MAX_STICKY_RANGES

    def join(self, ranges: RangeMap, newcomer: str, load: Load) -> RangeMap:
        """The map with ``newcomer``'s declared ranges given to it (from :data:`UNASSIGNED`)."""
        if newcomer in ranges:
            raise RangeMapError(f"{newcomer!r} already owns a range; expected a consumer without one")
        if newcomer not in self._declared:
            raise RangeMapError(f"{newcomer!r} declared no ranges; a sticky consumer must declare its ranges")
        return self._tiling(ranges, [*_members(ranges), newcomer])

    def leave(self, ranges: RangeMap, leaver: str, load: Load, standby: Sequence[str] = ()) -> RangeMap:
        """The map with ``leaver``'s ranges unassigned; empty once no consumer is left."""
        return self._tiling(ranges, [member for member in _members(ranges) if member != leaver])

    def shift(self, ranges: RangeMap, load: Load) -> RangeMap | None:
        """Never: a sticky consumer's ranges are its own."""
        return None

    def _tiling(self, ranges: RangeMap, members: list[str]) -> RangeMap:
        """The map in which each of ``members`` owns its declared ranges and the rest is unassigned."""
        size = ranges.range_size
        owned = sorted(
            (start, min(end, size - 1), member)
            for member in members
            for start, end in self._declared[member]
            if start < size
        )
        tiles: list[Range] = []
        at = 0
        for start, end, member in owned:
            if start < at:
                raise RangeMapError(f"{member!r}'s range [{start}, {end}] overlaps another's; expected disjoint ranges")
            if start > at:
                tiles.append((at, start - 1, UNASSIGNED))
            tiles.append((start, end, member))
            at = end + 1
        if at < size and (tiles or self._declared):
            tiles.append((at, size - 1, UNASSIGNED))
        planned = RangeMap.from_ranges(tiles, size, ranges.epoch + 1)
        return ranges.copy() if planned.ranges() == ranges.ranges() else planned


def _members(ranges: RangeMap) -> list[str]:
    """The consumers of ``ranges``, without the unassigned owner."""
    return [consumer for consumer in ranges.consumers() if consumer != UNASSIGNED]
