"""What happens to an assignment: a consumer joins, a consumer leaves, a window of traffic is measured."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Event", "Join", "Leave", "Measured"]


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
