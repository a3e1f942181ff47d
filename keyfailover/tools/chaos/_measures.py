"""What a chaos run measured, and how other strategies would have fared under its faults.

From the records (:mod:`._records`): counts, the latency from a send's receipt to its first
delivery, throughput per second, partitions per broker and ranges per consumer over time, and
how long each fault left partitions unserved.

From the faults: the membership changes they caused (a killed process leaves and rejoins at its
restart; a suspension longer than the session timeout for a broker, or than the ack timeout for
a consumer, is a leave at its end and a rejoin at SIGCONT), replayed through strategies with
the run's own key traffic, as the RocketMQ sticky-rebalance proposal measures them:

- level 1, partitions over brokers: keyfailover's sticky assignment against RocketMQ's
  ``AllocateMessageQueueAveragely``; balance degree (std-dev of partitions per broker in mean
  units), stickiness (partitions keeping their broker per change) and reassignment time;
- level 2, keys over consumers: keyfailover's policy against Pulsar's consistent hashing and
  auto-split (``keyfailover evaluate``'s strategies, computed as Pulsar computes them).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from keyfailover.core.partitions import PartitionId, assign_partitions
from keyfailover.tools.chaos._checkers import gaps
from keyfailover.tools.chaos._records import Delivered, Fault, Produced, RangeMap, Record, Served
from keyfailover.tools.evaluate import Join, Leave, Population, Scenario, run_strategy
from keyfailover.tools.evaluate._strategies import KeyFailover, PulsarAutoSplit, PulsarConsistent

__all__ = [
    "LEVEL_2",
    "Membership",
    "RunMeasures",
    "StrategyMeasures",
    "level_1",
    "level_2",
    "memberships",
    "run_measures",
]

LEVEL_2 = (KeyFailover, PulsarConsistent, PulsarAutoSplit)


@dataclass(frozen=True)
class RunMeasures:
    """What a chaos run measured: sends, deliveries, latency and throughput, and who served what when."""

    sent: int
    confirmed: int
    delivered: int
    redelivered: int
    latency_ms: dict[str, float]
    """Receipt of a send to its first delivery: p50, p90, p99, max (empty without deliveries)."""
    throughput: dict[str, list[int]]
    """Per second from the schedule's start: ``confirmed`` sends and ``delivered`` first deliveries."""
    partitions_per_broker: dict[str, list[tuple[float, int]]]
    """Each broker's count of partitions served, at each change (seconds from the start)."""
    ranges_per_consumer: dict[str, list[tuple[float, int]]]
    """Each consumer's count of ranges over all partitions, at each change of the polled maps."""
    unserved_after_fault: list[tuple[str, float]]
    """Per fault: its line and the longest a partition went unserved, starting within the fault."""


def run_measures(records: Sequence[Record], started: float, partitions: int) -> RunMeasures:
    """The measures of a run from its records; ``started`` is the schedule's start on the records' clock."""
    produced = [r for r in records if isinstance(r, Produced)]
    delivered = [r for r in records if isinstance(r, Delivered)]
    receipts = {(p.key, p.value): p.t for p in produced if p.ok}
    first: dict[tuple[str, int], float] = {}
    for d in sorted(delivered, key=lambda d: d.t):
        first.setdefault((d.key, d.value), d.t)
    waits = [1000.0 * (at - receipts[m]) for m, at in first.items() if m in receipts]
    latency = {}
    if waits:
        values = np.asarray(waits)
        latency = {name: float(np.percentile(values, q)) for name, q in (("p50", 50), ("p90", 90), ("p99", 99))}
        latency["max"] = float(values.max())
    end = max((r.t for r in records), default=started)
    seconds = max(int(end - started) + 1, 1)

    def per_second(times: list[float]) -> list[int]:
        counts = np.bincount(
            np.clip(np.asarray(times, dtype=np.float64) - started, 0, None).astype(int), minlength=seconds
        )
        return [int(count) for count in counts[:seconds]]

    throughput = {
        "confirmed": per_second([p.t for p in produced if p.ok]),
        "delivered": per_second(list(first.values())),
    }
    return RunMeasures(
        sent=len(produced),
        confirmed=len(receipts),
        delivered=len(first),
        redelivered=len(delivered) - len(first),
        latency_ms=latency,
        throughput=throughput,
        partitions_per_broker=_served_counts(records, started),
        ranges_per_consumer=_range_counts(records, started),
        unserved_after_fault=_unserved_after_faults(records, partitions, end),
    )


def _served_counts(records: Sequence[Record], started: float) -> dict[str, list[tuple[float, int]]]:
    changes: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for served in (r for r in records if isinstance(r, Served)):
        changes[served.broker].append((served.t, +1))
        if served.until is not None:
            changes[served.broker].append((served.until, -1))
    counts = {}
    for broker, steps in sorted(changes.items()):
        running, series = 0, []
        for at, step in sorted(steps):
            running += step
            series.append((at - started, running))
        counts[broker] = series
    return counts


def _range_counts(records: Sequence[Record], started: float) -> dict[str, list[tuple[float, int]]]:
    maps: dict[int, tuple[tuple[int, int, str], ...]] = {}
    series: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for snapshot in (r for r in records if isinstance(r, RangeMap)):
        maps[snapshot.partition] = snapshot.ranges
        owned = Counter(consumer for ranges in maps.values() for _, _, consumer in ranges)
        for consumer in set(owned) | set(series):
            if not series[consumer] or series[consumer][-1][1] != owned.get(consumer, 0):
                series[consumer].append((snapshot.t - started, owned.get(consumer, 0)))
    return dict(sorted(series.items()))


def _unserved_after_faults(records: Sequence[Record], partitions: int, end: float) -> list[tuple[str, float]]:
    served: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for s in (r for r in records if isinstance(r, Served)):
        served[s.partition].append((s.t, end if s.until is None else s.until))
    faults = [f for f in records if isinstance(f, Fault)]
    starts = [f for f in faults if f.action == "start"]
    found = []
    for fault in starts:
        heal = next((f.t for f in faults if f.target == fault.target and f.action == "end" and f.t >= fault.t), end)
        longest = 0.0
        for partition in range(partitions):
            for gap_start, gap_end in gaps(served.get(partition, []), end):
                if fault.t <= gap_start <= heal:
                    longest = max(longest, gap_end - gap_start)
        found.append((f"{fault.kind} {fault.target}", longest))
    return found


@dataclass(frozen=True)
class Membership:
    """A member leaving (``joins`` False) or joining at ``t``."""

    t: float
    member: str
    joins: bool


def memberships(records: Sequence[Record], prefix: str, timeout: float) -> list[Membership]:
    """The leaves and joins the faults on targets named ``prefix``N caused (see the module docstring)."""
    faults = sorted((f for f in records if isinstance(f, Fault) and f.target.startswith(prefix)), key=lambda f: f.t)
    changes = []
    begun: dict[str, Fault] = {}
    for fault in faults:
        if fault.action == "start":
            begun[fault.target] = fault
            continue
        start = begun.pop(fault.target, None)
        if start is None:
            continue
        if fault.kind == "kill":
            changes += [Membership(start.t, fault.target, False), Membership(fault.t, fault.target, True)]
        elif fault.kind == "suspend" and fault.t - start.t > timeout:
            changes += [Membership(start.t + timeout, fault.target, False), Membership(fault.t, fault.target, True)]
    return sorted(changes, key=lambda change: change.t)


@dataclass(frozen=True)
class StrategyMeasures:
    """How one assignment strategy handled the run's membership changes, at one level."""

    level: int
    strategy: str
    changes: int
    balance_sd: float
    """Std-dev of the load per member in mean units, averaged over the states after each change."""
    stickiness: float
    """Fraction of partitions (level 1) or keys (level 2) keeping their member per change."""
    reassign_ms: float


def _averagely(partitions: list[PartitionId], brokers: list[str]) -> dict[PartitionId, str]:
    """RocketMQ's AllocateMessageQueueAveragely: sorted members take contiguous blocks of the sorted queues."""
    members = sorted(brokers)
    if not members:
        return {}
    owners = {}
    base, extra = divmod(len(partitions), len(members))
    at = 0
    for index, member in enumerate(members):
        take = base + (1 if index < extra else 0)
        for partition in partitions[at : at + take]:
            owners[partition] = member
        at += take
    return owners


def level_1(brokers: list[str], partitions: int, changes: Sequence[Membership]) -> list[StrategyMeasures]:
    """Partitions over brokers under ``changes``: sticky (ours) against RocketMQ's averagely."""
    ids: list[PartitionId] = [("t", p) for p in range(partitions)]
    strategies: dict[str, Callable[[list[str], dict[PartitionId, str]], dict[PartitionId, str]]] = {
        "keyfailover sticky": lambda live, previous: assign_partitions(ids, live, previous),
        "rocketmq-averagely": lambda live, _: _averagely(ids, live),
    }
    found = []
    for name, assign in strategies.items():
        live = list(brokers)
        owners = assign(live, {})
        spreads, kept, times = [], [], []
        for change in changes:
            live = [*live, change.member] if change.joins else [b for b in live if b != change.member]
            began = time.perf_counter()
            after = assign(live, owners)
            times.append(1000.0 * (time.perf_counter() - began))
            kept.append(sum(after.get(p) == owner for p, owner in owners.items()) / max(len(owners), 1))
            counts = np.asarray([sum(1 for b in after.values() if b == member) for member in live], dtype=np.float64)
            spreads.append(float(counts.std() / counts.mean()) if counts.size and counts.mean() else 0.0)
            owners = after
        found.append(StrategyMeasures(1, name, len(changes), _mean(spreads), _mean(kept, 1.0), _mean(times)))
    return found


def level_2(consumers: list[str], key_counts: dict[str, int], changes: Sequence[Membership]) -> list[StrategyMeasures]:
    """Keys over consumers under ``changes``, with the run's traffic: ours against Pulsar's selectors.

    Nothing (an empty list) without changes or traffic, or when a change would leave no consumer.
    """
    members = len(consumers)
    for change in changes:
        members += 1 if change.joins else -1
        if members < 1:
            return []
    if not changes or not key_counts:
        return []
    count = max(int(key.rsplit("-", 1)[1]) for key in key_counts) + 1
    shares = np.full(count, 1e-9)
    for key, sent in key_counts.items():
        shares[int(key.rsplit("-", 1)[1])] += sent
    population = Population.of(shares, int(sum(key_counts.values())))
    rng = np.random.default_rng(0)
    events = tuple(Join(c.member) if c.joins else Leave(c.member) for c in changes)
    scenario = Scenario(
        "chaos",
        "the run's keys and consumer changes",
        population,
        tuple(Join(consumer) for consumer in consumers),
        events,
        tuple(population.window(rng) for _ in range(4)),
    )
    found = []
    for strategy in LEVEL_2:
        result = run_strategy(strategy(), scenario)
        found.append(
            StrategyMeasures(
                2, result.strategy, len(events), result.stddev_traffic, result.stickiness_mean, result.reassign_ms_mean
            )
        )
    return found


def _mean(values: Sequence[float], empty: float = 0.0) -> float:
    return statistics.fmean(values) if values else empty
