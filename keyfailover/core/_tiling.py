"""Ranges as parallel sorted lists: the one routine that gives slots to a consumer.

A tiling is three lists of equal length: ``starts`` and ``ends`` (sorted, each range
``[starts[i], ends[i]]`` right after the previous one) and ``owners``; no two adjacent
ranges have one owner. :class:`~keyfailover.core.ranges.RangeMap` and the planning
layout of the multi-range policy both keep their ranges this way and change them only
through :func:`splice`.
"""

from __future__ import annotations

import bisect

__all__ = ["splice"]


def splice(
    starts: list[int], ends: list[int], owners: list[str], move: tuple[int, int, str]
) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]] | None:
    """Apply ``move = (start, end, owner)``: give slots ``[start, end]`` to ``owner`` in place.

    None when ``owner`` held them all already.

    Ranges cut by the new one keep their remainders, and the new range merges with an
    adjacent range of the same owner. Returns ``(removed, added)``: the ranges that left
    the lists and the ones that entered them. O(k + log r) for the k ranges touched, plus
    the list shift (a memmove). The lists must tile a space that contains ``[start, end]``.
    """
    start, end, owner = move
    first = bisect.bisect_right(starts, start) - 1
    last = bisect.bisect_left(ends, end)
    if first == last:  # the usual move, inside one range
        if owners[first] == owner:
            return None
    elif all(owners[i] == owner for i in range(first, last + 1)):
        return None
    low, high = first, last + 1
    added: list[tuple[int, int, str]] = []
    if starts[first] < start:
        if owners[first] == owner:
            start = starts[first]
        else:
            added.append((starts[first], start - 1, owners[first]))
    elif first > 0 and owners[first - 1] == owner:
        low -= 1
        start = starts[low]
    tail: tuple[int, int, str] | None = None
    if ends[last] > end:
        if owners[last] == owner:
            end = ends[last]
        else:
            tail = (end + 1, ends[last], owners[last])
    elif high < len(starts) and owners[high] == owner:
        end = ends[high]
        high += 1
    added.append((start, end, owner))
    if tail is not None:
        added.append(tail)
    removed = list(zip(starts[low:high], ends[low:high], owners[low:high], strict=True))
    starts[low:high], ends[low:high], owners[low:high] = zip(*added, strict=True)
    return removed, added
