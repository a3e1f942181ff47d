"""A subscription's durable position: the mark-delete position plus the acked ranges above it.

As in a Pulsar managed cursor, every position at or below the *mark-delete position* is
acknowledged, and the positions acknowledged individually above it are kept as disjoint
ranges. Acks arrive nearly in order, so the ranges stay few even after millions of acks:
a stalled key leaves holes, and everything acked between two holes is one range. The
same ranges, delta-encoded and compressed, are the cursor's stored form.
"""

from __future__ import annotations

import struct
import zlib
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain

import numpy as np

from keyfailover.core.errors import CursorError
from keyfailover.wire._ints import is_within_int_range

__all__ = ["Cursor"]

FORMAT_VERSION = 1
"""Version byte that starts :meth:`Cursor.to_bytes`; :meth:`Cursor.from_bytes` reads only this one."""

_HEADER = struct.Struct("<BQI")  # format version, mark_delete, number of acked ranges
_LIMIT = 1 << 63  # positions are signed 64-bit integers in SQLite
_MERGE_AT = 8192
"""Acks held back before they are merged into the ranges, at the least (at most as many as there are ranges)."""


def _check_position(value: object, what: str, minimum: int) -> int:
    """``value`` if it is an int from ``minimum`` to 2**63 - 1; else a CursorError naming ``what``."""
    if type(value) is not int or not minimum <= value < _LIMIT:
        raise CursorError(f"{what} must be an int in [{minimum}, 2**63 - 1], not {value!r}")
    return value


def _malformed(reason: str) -> CursorError:
    """The error for cursor bytes that are not what :meth:`Cursor.to_bytes` writes."""
    return CursorError(f"cursor bytes are malformed: {reason}; expected the output of Cursor.to_bytes()")


class Cursor:
    """A subscription's durable position: ``mark_delete`` plus the acked positions above it.

    The acked positions above ``mark_delete`` are sorted, disjoint, non-adjacent inclusive
    ranges ``[_starts[i], _ends[i]]`` for ``i >= _head``; ranges below ``_head`` were
    absorbed into ``mark_delete`` and are dropped in bulk. The bounds are int64 arrays (16
    bytes a range: a consumer that never acks leaves one range per message it holds). With
    ``r`` ranges:

    - :meth:`ack` is O(1) for the next position after ``mark_delete`` and for a position
      at or after the end of the newest range (the usual cases); otherwise O(log r) to find
      the range plus a list shift of the ranges after it (acks land near the newest ones);
    - :meth:`is_acked` is O(1) at or below ``mark_delete``, else O(log r);
    - :meth:`to_bytes` and :meth:`from_bytes` are O(r) at numpy speed.

    :meth:`ack_many` only notes its positions in ``_pending``, their highest in ``_pending_top``.
    They are merged into the ranges at numpy speed, all at once, when ``_MERGE_AT`` of them or as
    many as there are ranges are noted, or when anything reads the state: every reader calls
    :meth:`_settle` first. A batch of acks so costs O(log n) a position, not a Python step each.
    """

    __slots__ = ("_ends", "_head", "_mark_delete", "_pending", "_pending_top", "_starts")

    __hash__ = None  # type: ignore[assignment]  # mutable, so unhashable

    def __init__(self, mark_delete: int = 0, acked: Iterable[int] = ()) -> None:
        """Start at ``mark_delete`` with ``acked`` also acked; positions contiguous to it are absorbed.

        O(n log n) for n acked positions.
        """
        mark_delete = _check_position(mark_delete, "mark_delete", 0)
        try:
            positions = sorted({_check_position(p, "an acked position", 1) for p in acked})
        except TypeError:
            raise CursorError(f"acked must be an iterable of positions, not {type(acked).__name__}") from None
        starts = array("q")
        ends = array("q")
        for position in positions:
            if position <= mark_delete:
                continue
            if ends and position == ends[-1] + 1:
                ends[-1] = position
            else:
                starts.append(position)
                ends.append(position)
        head = 0
        if starts and starts[0] == mark_delete + 1:
            mark_delete = ends[0]
            head = 1
        self._mark_delete = mark_delete
        self._starts = starts
        self._ends = ends
        self._head = head
        self._pending: list[int] = []
        self._pending_top = 0

    @property
    def mark_delete(self) -> int:
        """The mark-delete position: every position at or below it is acked (0: none is)."""
        if self._pending:
            self._settle()
        return self._mark_delete

    @property
    def acked(self) -> frozenset[int]:
        """The positions above :attr:`mark_delete` acked individually; O(number of them)."""
        self._settle()
        return frozenset(chain.from_iterable(range(s, e + 1) for s, e in self._ranges()))

    @property
    def acked_ranges(self) -> list[tuple[int, int]]:
        """The acked positions above :attr:`mark_delete` as sorted inclusive ``(first, last)`` ranges."""
        self._settle()
        return list(self._ranges())

    @property
    def last_acked(self) -> int:
        """The highest acked position (0: none is); every position above it is unacked. O(1), merges nothing."""
        settled = self._ends[-1] if self._head < len(self._ends) else self._mark_delete
        return max(settled, self._pending_top)

    def ack(self, position: int) -> None:
        """Acknowledge ``position`` (idempotent), advancing :attr:`mark_delete` over every contiguous run."""
        position = _check_position(position, "an acked position", 1)
        self._settle()
        self._ack(position)

    def ack_many(self, positions: Sequence[int]) -> None:
        """Acknowledge each of ``positions`` as :meth:`ack` does; all are checked first (a bad one: none is acked).

        They are noted and merged in bulk later, as the class says: amortised O(log n) a position."""
        if not positions:
            return
        if not is_within_int_range(positions, 1, _LIMIT - 1):
            for position in positions:
                _check_position(position, "an acked position", 1)
        pending = self._pending
        pending += positions
        self._pending_top = max(self._pending_top, *positions)
        if len(pending) >= _MERGE_AT and len(pending) >= len(self._starts) - self._head:
            self._settle()

    def _ack(self, position: int) -> None:
        """Mark one ``position`` acked: advance the mark-delete position through acked ranges, or add it to a range."""
        mark_delete = self._mark_delete
        if position <= mark_delete:
            return
        starts, ends, head = self._starts, self._ends, self._head
        if position == mark_delete + 1:
            if head < len(starts) and starts[head] == position + 1:
                self._mark_delete = ends[head]
                self._drop_head()
            else:
                self._mark_delete = position
            return
        if head == len(starts) or position > ends[-1] + 1:
            starts.append(position)
            ends.append(position)
            return
        if position == ends[-1] + 1:
            ends[-1] = position
            return
        i = bisect_right(starts, position, head) - 1
        if i >= head and position <= ends[i]:
            return
        # position is below ends[-1] and outside every range, so a range i + 1 follows it.
        joins_previous = i >= head and ends[i] + 1 == position
        joins_next = starts[i + 1] == position + 1
        if joins_previous and joins_next:
            ends[i] = ends[i + 1]
            del starts[i + 1], ends[i + 1]
        elif joins_previous:
            ends[i] = position
        elif joins_next:
            starts[i + 1] = position
        else:
            starts.insert(i + 1, position)
            ends.insert(i + 1, position)

    def is_acked(self, position: int) -> bool:
        """Whether ``position`` is acknowledged."""
        position = _check_position(position, "a position", 1)
        self._settle()
        if position <= self._mark_delete:
            return True
        i = bisect_right(self._starts, position, self._head) - 1
        return i >= self._head and position <= self._ends[i]

    def unacked_after(self, after: int, up_to: int) -> Iterator[int]:
        """The positions in ``(after, up_to]`` not acked, ascending: what a restarted subscription redelivers.

        Arguments are checked, and the ranges taken, when called; the iterator does not see
        later acks. O(ranges in the interval + positions yielded).
        """
        after = _check_position(after, "after", 0)
        up_to = _check_position(up_to, "up_to", 0)
        self._settle()
        first = max(after, self._mark_delete) + 1
        lo = max(bisect_right(self._starts, first, self._head) - 1, self._head)
        hi = bisect_right(self._starts, up_to, self._head)
        return _gaps(first, up_to, self._starts[lo:hi], self._ends[lo:hi])

    def copy(self) -> Cursor:
        """An independent cursor in the same state; O(ranges), a memory copy."""
        self._settle()
        return Cursor._of(self._mark_delete, self._starts[self._head :], self._ends[self._head :])

    def to_bytes(self) -> bytes:
        """The stored form: a versioned header, then the ranges as zlib-compressed delta-encoded uint64s.

        Scattered acks cost a few bytes per range; an in-order subscription is a 21-byte header.
        """
        self._settle()
        head = self._head
        count = len(self._starts) - head
        points = np.empty(2 * count + 1, dtype="<i8")
        points[0] = self._mark_delete
        points[1::2] = np.frombuffer(self._starts, dtype=np.int64)[head:]
        points[2::2] = np.frombuffer(self._ends, dtype=np.int64)[head:]
        deltas = points[1:]
        np.subtract(deltas, points[:-1], out=deltas)  # in place: gap to each range's first, then its length - 1
        # The deltas are positive, so their int64 bytes are their uint64 bytes.
        return _HEADER.pack(FORMAT_VERSION, self._mark_delete, count) + zlib.compress(deltas.data, 1)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Cursor:
        """The cursor :meth:`to_bytes` stored; :class:`CursorError` if ``data`` is not such bytes."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise CursorError(f"cursor bytes must be bytes, not {type(data).__name__}")
        data = bytes(data)
        if len(data) < _HEADER.size:
            raise _malformed(f"{len(data)} bytes are shorter than the {_HEADER.size}-byte header")
        version, mark_delete, count = _HEADER.unpack_from(data)
        if version != FORMAT_VERSION:
            raise CursorError(f"cursor bytes have format version {version}; expected {FORMAT_VERSION}")
        if mark_delete >= _LIMIT:
            raise _malformed(f"mark_delete {mark_delete} is beyond 2**63 - 1")
        try:
            body = zlib.decompress(data[_HEADER.size :])
        except zlib.error as exc:
            raise _malformed(f"the ranges do not decompress ({exc})") from None
        if len(body) != 16 * count:
            raise _malformed(f"{len(body)} bytes of ranges for {count} ranges of 16 bytes")
        deltas = np.frombuffer(body, dtype="<u8")
        if count and int(deltas[0::2].min()) < 2:
            raise _malformed("a range touches mark_delete or the range before it")
        points = np.cumsum(deltas, dtype=np.uint64)
        # Each delta is below 2**64, so an overflowing sum shows as a decrease.
        if count and (bool(np.any(points[1:] < points[:-1])) or int(points[-1]) >= _LIMIT - mark_delete):
            raise _malformed("a range ends beyond 2**63 - 1")
        absolute = points.astype(np.int64) + mark_delete
        return cls._of(mark_delete, array("q", absolute[0::2].tobytes()), array("q", absolute[1::2].tobytes()))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Cursor):
            return NotImplemented
        return self.mark_delete == other.mark_delete and self.acked_ranges == other.acked_ranges

    def __repr__(self) -> str:
        ranges = self.acked_ranges
        shown = ", ".join(f"({s}, {e})" for s, e in ranges[:4])
        more = f", ... ({len(ranges)} ranges)" if len(ranges) > 4 else ""
        return f"Cursor(mark_delete={self._mark_delete}, acked_ranges=[{shown}{more}])"

    @classmethod
    def _of(cls, mark_delete: int, starts: array[int], ends: array[int]) -> Cursor:
        """A cursor made from its parts, unchecked: ``mark_delete`` and the acked ranges beyond it."""
        cursor = cls.__new__(cls)
        cursor._mark_delete = mark_delete
        cursor._starts = starts
        cursor._ends = ends
        cursor._head = 0
        cursor._pending = []
        cursor._pending_top = 0
        return cursor

    def _settle(self) -> None:
        """Merge the noted acks into the ranges: sort them, make runs of them, and merge those with the ranges
        (an interval union at numpy speed), then absorb a first range that starts after :attr:`mark_delete`."""
        if not self._pending:
            return
        noted = np.unique(np.array(self._pending, dtype=np.int64))
        self._pending = []
        self._pending_top = 0
        noted = noted[noted > self._mark_delete]
        if not len(noted):
            return
        breaks = np.flatnonzero(np.diff(noted) != 1)
        head = self._head
        starts = np.concatenate(
            (np.frombuffer(self._starts, dtype=np.int64)[head:], noted[np.concatenate(([0], breaks + 1))])
        )
        ends = np.concatenate((np.frombuffer(self._ends, dtype=np.int64)[head:], noted[np.append(breaks, -1)]))
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], np.maximum.accumulate(ends[order])
        # A range starts a new one unless it overlaps or touches the ones before it (whose end is the running max).
        first = np.flatnonzero(np.concatenate(([True], starts[1:] > ends[:-1] + 1)))
        starts, ends = starts[first], ends[np.append(first[1:] - 1, -1)]
        if starts[0] == self._mark_delete + 1:
            self._mark_delete = int(ends[0])
            starts, ends = starts[1:], ends[1:]
        self._starts = array("q", starts.tobytes())
        self._ends = array("q", ends.tobytes())
        self._head = 0

    def _ranges(self) -> Iterator[tuple[int, int]]:
        """The live acked ranges beyond the mark-delete position, as inclusive pairs."""
        head = self._head
        return zip(self._starts[head:], self._ends[head:], strict=True)

    def _drop_head(self) -> None:
        """Drop the first acked range, compacting the arrays once at least half of them is dropped."""
        head = self._head + 1
        if head * 2 >= len(self._starts):  # at least half are dead: compact, O(1) amortised per range
            del self._starts[:head], self._ends[:head]
            head = 0
        self._head = head


def _gaps(first: int, last: int, starts: array[int], ends: array[int]) -> Iterator[int]:
    """The positions from ``first`` to ``last`` that no acked range holds, in order."""
    position = first
    for start, end in zip(starts, ends, strict=True):
        if end < position:
            continue
        yield from range(position, min(start, last + 1))
        position = end + 1
    yield from range(position, last + 1)
