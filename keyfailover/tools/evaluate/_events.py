"""What happens to an assignment (a join, a leave, a measured window of traffic), and who owns what."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Event", "Join", "Leave", "Measured", "Ownership"]


@dataclass(frozen=True)
class Join:
    """``consumer`` joins."""

    consumer: str


@dataclass(frozen=True)
class Leave:
    """``consumer`` leaves."""

    consumer: str


@dataclass(frozen=True)
class Measured:
    """Messages per slot counted over the last measurement window."""

    traffic: npt.NDArray[np.float64]


Event = Join | Leave | Measured


@dataclass(frozen=True)
class Ownership:
    """Who owns each of many keys, slots or hashes: ``consumers[index[i]]``; an index of -1 means nobody.

    ``consumers`` may name one consumer many times (a range map lists a consumer per range).
    """

    consumers: tuple[str, ...]
    index: npt.NDArray[np.intp]
