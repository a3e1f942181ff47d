"""The measures of the RocketMQ sticky-rebalancing proposal, over keys instead of queues, and a lower bound.

An assignment is an array ``owner`` with one consumer number per key (-1: nobody). A
weight array gives each key its share of what is measured: messages for traffic, 1 for
keys. Every function works on any number of items, so hand-made cases with a few keys
check them (apache/rocketmq issue #2149).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["Balance", "HotKey", "balance", "consumer_loads", "fair_level", "hot_key", "least_moved", "stickiness"]

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


class HotKey(NamedTuple):
    """How the hottest key sits in an assignment; both numbers are in units of the mean load."""

    floor: float
    """The best max/mean any assignment can reach: the hottest key cannot be split (at least 1)."""
    others: float
    """What the hottest key's owner carries besides that key."""


def hot_key(owner: Owners, weights: Weights, consumers: Owners) -> HotKey:
    """The granularity floor of the balance, and what the owner of the heaviest key carries besides it."""
    loads = consumer_loads(owner, weights, consumers)
    mean = float(loads.mean()) if loads.size else 0.0
    if mean <= 0.0:
        return HotKey(1.0, 0.0)
    hottest = int(np.argmax(weights))
    holder = float(consumer_loads(owner, weights, owner[hottest : hottest + 1])[0])
    return HotKey(max(1.0, float(weights[hottest]) / mean), (holder - float(weights[hottest])) / mean)


def fair_level(total: float, heaviest: Weights, members: int) -> float:
    """The fair load of a consumer holding no key heavier than it (water-filling).

    ``heaviest`` lists the heaviest keys, heaviest first (at least ``members`` of them, or
    all). A key heavier than the level is a consumer's load by itself: it is set aside
    with its consumer and the level is retaken over the others.
    """
    pinned = 0.0
    for count in range(members):
        level = (total - pinned) / (members - count)
        if count >= len(heaviest) or float(heaviest[count]) <= level:
            return level
        pinned += float(heaviest[count])
    return 0.0


def least_moved(owner: Owners, weights: Weights, before: Owners, after: Owners) -> float:
    """The least weight any policy must move to balance the members ``after`` from the assignment ``owner``.

    ``owner`` is the assignment among the members ``before``; a joiner owns nothing, a
    leaver's target is 0. Each remaining member's target is its fair share (a member whose
    heaviest key exceeds the fair level keeps that key as its share); what members carry
    over their targets must move (the transport bound). A leaver's key heavier than any
    receiver can take without going over its share forces that receiver to shed as well:
    the least such shedding is added. Keys are atoms; a policy whose atoms are coarser
    (slots, key groups) cannot do better than this.
    """
    loads = consumer_loads(owner, weights, before)
    load_of = dict(zip(before.tolist(), loads.tolist(), strict=True))
    peak = np.zeros(max(int(owner.max(initial=-1)), int(after.max(initial=-1)), int(before.max(initial=-1))) + 1)
    owned = owner >= 0
    np.maximum.at(peak, owner[owned], weights[owned])
    total = float(weights.sum())
    stay = [int(c) for c in after.tolist()]
    level = fair_level(total, np.sort(peak[stay])[::-1], len(stay))
    target = {c: max(level, float(peak[c])) for c in stay}
    moved = sum(max(load - target.get(c, 0.0), 0.0) for c, load in load_of.items())
    leavers = [c for c in load_of if c not in target]
    for leaver in leavers:
        hottest = float(peak[leaver])
        room = max((target[c] - load_of.get(c, 0.0) for c in stay), default=0.0)
        if hottest > room and stay:
            moved += min(max(load_of.get(c, 0.0) + hottest - max(level, hottest), 0.0) for c in stay)
    return float(moved)
