"""Rebalance policies: pure functions from (range map, measured load) to a new range map.

Two policies, both load-aware, and Pulsar's STICKY mode:

- :class:`MultiRangePolicy` (the default): a consumer may own several ranges, so a join
  takes about ``1/(n+1)`` of the traffic and a leave moves only the leaver's share, the
  least any balanced result can move.
- :class:`ContiguousPolicy`: PIP-34's Key_Failover literally, one contiguous range per
  consumer (split the busiest, merge into the less busy neighbour, shift boundaries).
- :class:`StickyPolicy`: Key_Shared STICKY, each consumer owns the ranges it declared; not
  load-aware, so not in :data:`POLICIES` (a dispatcher switches to it with ``set_policy``).

docs/evaluation.md compares them with Pulsar's, Flink's and RocketMQ's assignments.
"""

from keyfailover.core.errors import ConfigError
from keyfailover.core.rebalance._common import Load, Policy, moved_slots, range_traffic, reassign_rates
from keyfailover.core.rebalance._contiguous import SPLIT_MODES, ContiguousPolicy, SplitMode, balanced_cut
from keyfailover.core.rebalance._multi import DEFAULT_MAX_RANGES, MultiRangePolicy
from keyfailover.core.rebalance._sticky import MAX_STICKY_RANGES, UNASSIGNED, StickyPolicy

__all__ = [
    "DEFAULT_MAX_RANGES",
    "MAX_STICKY_RANGES",
    "POLICIES",
    "SPLIT_MODES",
    "UNASSIGNED",
    "ContiguousPolicy",
    "Load",
    "MultiRangePolicy",
    "Policy",
    "SplitMode",
    "StickyPolicy",
    "balanced_cut",
    "check_policy_choice",
    "moved_slots",
    "range_traffic",
    "reassign_rates",
]

POLICIES: dict[str, type[Policy]] = {policy.name: policy for policy in (MultiRangePolicy, ContiguousPolicy)}
"""Every policy by name, the default first."""


def check_policy_choice(policy: object, max_ranges: object, *, sticky: bool = False) -> None:
    """A policy name of :data:`POLICIES` (or ``"sticky"`` when ``sticky``) and a ``max_ranges`` that is an
    int of at least 1, or ConfigError."""
    names = (*POLICIES, StickyPolicy.name) if sticky else tuple(POLICIES)
    if not isinstance(policy, str) or policy not in names:
        raise ConfigError(f"policy must be one of {names}, not {policy!r}")
    if type(max_ranges) is not int or max_ranges < 1:
        raise ConfigError(f"max_ranges must be an int >= 1, not {max_ranges!r}")
