"""The measures of the RocketMQ sticky-rebalancing proposal, over slots instead of queues.

An assignment is an array ``owner`` with one consumer number per slot (-1: nobody). A
weight array gives each slot its share of what is measured: messages for traffic, 1 for
the hash space, distinct keys for key stickiness. Every function works on any number of
slots, so hand-made cases with a few slots check them (apache/rocketmq issue #2149).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["Balance", "HotSlot", "balance", "consumer_loads", "hot_slot", "stickiness"]

Owners = npt.NDArray[np.intp]
Weights = npt.NDArray[np.float64]


def consumer_loads(owner: Owners, weights: Weights, consumers: Owners) -> Weights:
    """The summed weight of the slots of each of ``consumers`` (0 for one owning none)."""
    if owner.shape != weights.shape:
        raise ValueError(f"owner has shape {owner.shape} and weights {weights.shape}; expected the same shape")
    owned = owner >= 0
    size = max(int(consumers.max(initial=-1)), int(owner.max(initial=-1))) + 1
    totals = np.bincount(owner[owned], weights=weights[owned], minlength=size)
    return np.asarray(totals[consumers], dtype=np.float64)


class Balance(NamedTuple):
    """The balance degree of an assignment; both numbers use loads in units of the mean load."""

    max_mean: float
    """The busiest consumer's load over the mean: 1 is perfect balance."""
    stddev: float
    """``sqrt(1/N * sum((x_i - mu)^2))`` with each load ``x_i`` in units of the mean ``mu``: 0 is perfect."""


def balance(owner: Owners, weights: Weights, consumers: Owners) -> Balance:
    """The balance degree of the assignment among ``consumers`` (every member counts, owning slots or not).

    Loads are divided by their mean, so the standard deviation is comparable across
    scenarios and consumer counts (it is the coefficient of variation). With no consumer
    or no weight the assignment is perfectly balanced: ``(1.0, 0.0)``.
    """
    loads = consumer_loads(owner, weights, consumers)
    mean = float(loads.mean()) if loads.size else 0.0
    if mean <= 0.0:
        return Balance(1.0, 0.0)
    relative = loads / mean
    return Balance(float(relative.max()), float(relative.std()))


def stickiness(before: Owners, after: Owners, weights: Weights) -> float:
    """The fraction of the weight whose slots keep their consumer from ``before`` to ``after``.

    Slots owned by nobody before (the first consumer's arrival) do not count; with no
    weight left to count the change kept everything: 1.0.
    """
    if before.shape != after.shape or before.shape != weights.shape:
        raise ValueError(
            f"before {before.shape}, after {after.shape} and weights {weights.shape} must have the same shape"
        )
    counted = before >= 0
    total = float(weights[counted].sum())
    if total <= 0.0:
        return 1.0
    return float(weights[counted & (before == after)].sum()) / total


class HotSlot(NamedTuple):
    """How the hottest slot sits in an assignment; both numbers are in units of the mean load."""

    floor: float
    """The best max/mean any assignment can reach: the hottest slot cannot be split (at least 1)."""
    others: float
    """What the hottest slot's owner carries besides that slot."""


def hot_slot(owner: Owners, weights: Weights, consumers: Owners) -> HotSlot:
    """The granularity floor of the balance, and what the owner of the heaviest slot carries besides it."""
    loads = consumer_loads(owner, weights, consumers)
    mean = float(loads.mean()) if loads.size else 0.0
    if mean <= 0.0:
        return HotSlot(1.0, 0.0)
    hottest = int(np.argmax(weights))
    holder = float(consumer_loads(owner, weights, owner[hottest : hottest + 1])[0])
    return HotSlot(max(1.0, float(weights[hottest]) / mean), (holder - float(weights[hottest])) / mean)
