"""Subscription types, as Apache Pulsar names them, and the single active consumer of a Failover subscription.

A subscription's type is that of its consumers: ``exclusive`` (one consumer), ``failover`` (one
active consumer, the others standing by), ``shared`` (any consumer takes any message: the
unordered consume mode) or ``key_shared`` (key ranges: the ordered consume mode).

Pulsar's ``AbstractDispatcherSingleActiveConsumer.pickAndScheduleActiveConsumer`` sorts a
Failover subscription's consumers by priority level, the lower value first, then by consumer
name, and counts those at the first level. A partition of a partitioned topic goes to the one at
its partition index modulo that count, so that a topic's partitions spread over the consumers of
the highest priority; any other topic goes to the first. Pulsar picks a non-partitioned topic's
consumer on a hash ring of the topic name instead; keyfailover takes the first, which the
consumers' priority levels and names alone decide.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal, TypeAlias

from keyfailover.core.errors import ConfigError

__all__ = ["SINGLE_ACTIVE", "SUBSCRIPTION_TYPES", "SubscriptionType", "active_consumer", "check_subscription_type"]

SubscriptionType: TypeAlias = Literal["exclusive", "failover", "shared", "key_shared"]
SUBSCRIPTION_TYPES: Final[tuple[SubscriptionType, ...]] = ("exclusive", "failover", "shared", "key_shared")
SINGLE_ACTIVE: Final[frozenset[SubscriptionType]] = frozenset({"exclusive", "failover"})
"""The types whose messages go to one consumer at a time, in log order: no delayed delivery, cumulative acks."""


def check_subscription_type(name: object) -> SubscriptionType:
    """``name`` as a subscription type; :class:`ConfigError` for anything else."""
    for known in SUBSCRIPTION_TYPES:
        if name == known:
            return known
    raise ConfigError(f"subscription type must be one of {', '.join(SUBSCRIPTION_TYPES)}, not {name!r}")


def active_consumer(consumers: Iterable[tuple[int, str]], partition: int = -1) -> str | None:
    """The name of the active consumer among ``consumers``, ``(priority level, name)`` pairs with distinct names,
    for ``partition``: a partition index, or -1 for a topic without partitions. None without consumers."""
    ranked = sorted(consumers)
    if not ranked:
        return None
    top = ranked[0][0]
    size = sum(1 for level, _ in ranked if level == top)
    return ranked[partition % size if partition >= 0 else 0][1]
