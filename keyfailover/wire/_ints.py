"""One check for many integers at once, done in C: how frames and cursors validate lists of positions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

_INT_TYPE: Final = {int}


def is_within_int_range(values: Sequence[Any], low: int, high: int) -> bool:
    """Whether every value is an ``int`` (not a bool or a subclass) from ``low`` to ``high``; True when empty.

    Cheap for a long list (one pass each in ``set``, ``min`` and ``max``); a caller that gets
    False walks the values itself to name the bad one.
    """
    return not values or (set(map(type, values)) == _INT_TYPE and low <= min(values) and max(values) <= high)
