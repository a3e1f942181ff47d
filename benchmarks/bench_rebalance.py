"""The cost of one join, one leave and one shift chance with 64 and 1000 consumers, against consistent hashing.

Run: ``python benchmarks/bench_rebalance.py [--quick]``. For each group size, every system
starts with the same consumers (built by joins) and goes through rounds of one newcomer
joining and one random member leaving; every join and every leave is timed on its own,
and the table shows the median and the slowest.

- the pure policies on a ``RangeMap`` (``MultiRangePolicy``, the default, and
  ``ContiguousPolicy``), deciding on a measured window of Zipf(1.1) traffic over 100,000
  keys (the evaluation's), with a shift chance on the next window timed after each change;
- ``Dispatcher.add_consumer`` / ``remove_consumer`` (the default policy) holding 50,000
  messages (10,000 with ``--quick``) with keys drawn Zipf(1.1), most in flight unacked, so a
  change re-routes keys, marks draining keys and hands a leaver's messages back;
- the peers: Apache Pulsar 4.x's consistent-hashing selector as keyfailover's evaluation
  computes it (100 points per consumer), and uhashring's ``HashRing.add_node`` /
  ``remove_node`` (160 vnodes per node, the column the others are compared with).
"""

from __future__ import annotations

import itertools
import random
import statistics
from collections.abc import Sequence
from functools import partial
from typing import Protocol

import numpy as np
import numpy.typing as npt
import uhashring
from _common import SEED, consumer_ids, format_count, parse_quick, print_table, timed, zipf_keys

from keyfailover import ContiguousPolicy, Dispatcher, Load, MultiRangePolicy, Policy, RangeMap
from keyfailover.core.clock import ManualClock
from keyfailover.tools.evaluate import build_scenario
from keyfailover.tools.evaluate._pulsar import ConsistentHashingSelector

WINDOW = 50
TICK = 0.01


class Membership(Protocol):
    """A system whose members join and leave; ``settle`` is the work between changes (a shift chance, or none)."""

    def join(self, cid: str) -> None: ...
    def leave(self, cid: str) -> None: ...
    def settle(self) -> float | None: ...


class PolicyMembership:
    """A pure rebalance policy on a ``RangeMap``, fed measured windows of Zipf traffic."""

    def __init__(self, policy: Policy, members: Sequence[str], windows: Sequence[npt.NDArray[np.float64]]) -> None:
        self._policy = policy
        self._windows = itertools.cycle(windows)
        self._load = Load({}, next(self._windows))
        self._ranges = RangeMap()
        for cid in members:
            self.join(cid)
            self.settle()

    def join(self, cid: str) -> None:
        self._ranges = self._policy.join(self._ranges, cid, self._load)

    def leave(self, cid: str) -> None:
        self._ranges = self._policy.leave(self._ranges, cid, self._load)

    def settle(self) -> float:
        """One shift chance on the next window; returns its seconds."""
        self._load = Load({}, next(self._windows))
        seconds, planned = timed(partial(self._policy.shift, self._ranges, self._load))
        if planned is not None:
            self._ranges = planned
        return seconds

    def state(self) -> str:
        """Ranges per consumer, for the note under the table."""
        return f"{self._ranges.range_count() / max(len(self._ranges), 1):.1f} ranges per consumer"


class DispatcherMembership:
    """A ``Dispatcher`` with ``messages`` published, polled and left unacked."""

    def __init__(self, members: Sequence[str], rng: np.random.Generator, messages: int) -> None:
        self._clock = ManualClock()
        self._dispatcher = Dispatcher(clock=self._clock)
        for cid in members:
            self._dispatcher.add_consumer(cid)
            self._dispatcher.flow(cid, WINDOW)
        for position, key in enumerate(zipf_keys(rng, messages)):
            self._dispatcher.publish(position, key)
        self._dispatcher.poll()
        self._joined: str | None = None

    def join(self, cid: str) -> None:
        self._dispatcher.add_consumer(cid)
        self._joined = cid

    def leave(self, cid: str) -> None:
        self._dispatcher.remove_consumer(cid)

    def settle(self) -> None:
        if self._joined is not None:
            self._dispatcher.flow(self._joined, WINDOW)
            self._joined = None
        self._dispatcher.poll()
        self._clock.advance(TICK)

    def state(self) -> str:
        """Messages held, in flight and waiting, for the note under the table."""
        stats = self._dispatcher.stats()
        inflight = sum(consumer["unacked"] for consumer in stats["consumers"].values())
        return (
            f"{format_count(stats['held'])} messages held, {format_count(inflight)} in flight unacked, "
            f"{format_count(stats['replay'])} waiting"
        )


class PulsarMembership:
    """Apache Pulsar 4.x's consistent-hashing selector (100 points per consumer): a peer."""

    def __init__(self, members: Sequence[str]) -> None:
        self._selector = ConsistentHashingSelector(100, "4.x")
        for cid in members:
            self._selector.add_consumer(cid)

    def join(self, cid: str) -> None:
        self._selector.add_consumer(cid)

    def leave(self, cid: str) -> None:
        self._selector.remove_consumer(cid)

    def settle(self) -> None:
        """Nothing to do between changes."""


class RingMembership:
    """uhashring's consistent-hash ring: the peer every row is compared with."""

    def __init__(self, members: Sequence[str]) -> None:
        self._ring = uhashring.HashRing(nodes=list(members))

    def join(self, cid: str) -> None:
        self._ring.add_node(cid)

    def leave(self, cid: str) -> None:
        self._ring.remove_node(cid)

    def settle(self) -> None:
        """Nothing to do between changes."""


def churn(system: Membership, members: Sequence[str], rounds: int) -> tuple[list[float], list[float], list[float]]:
    """Seconds of each join, each leave and each shift chance over ``rounds`` of one join then one random leave."""
    rng = random.Random(SEED)
    live = list(members)
    joins: list[float] = []
    leaves: list[float] = []
    shifts: list[float] = []
    for i in range(rounds):
        newcomer = f"n{i}"
        joins.append(timed(partial(system.join, newcomer))[0])
        live.append(newcomer)
        if (seconds := system.settle()) is not None:
            shifts.append(seconds)
        leaver = live.pop(rng.randrange(len(live)))
        leaves.append(timed(partial(system.leave, leaver))[0])
        if (seconds := system.settle()) is not None:
            shifts.append(seconds)
    return joins, leaves, shifts


def measure(consumers: int, rounds: int, messages: int) -> list[list[str]]:
    """The table rows for one group size."""
    members = consumer_ids(consumers)
    rng = np.random.default_rng(SEED)
    windows = build_scenario("zipf").windows
    multi = PolicyMembership(MultiRangePolicy(), members, windows)
    dispatcher = DispatcherMembership(members, rng, messages)
    systems: list[tuple[str, Membership]] = [
        ("MultiRangePolicy", multi),
        ("ContiguousPolicy", PolicyMembership(ContiguousPolicy(), members, windows)),
        ("Dispatcher add/remove_consumer", dispatcher),
        ("Pulsar 4.x consistent hashing (peer)", PulsarMembership(members)),
        ("uhashring add/remove_node (peer)", RingMembership(members)),
    ]
    timings: list[tuple[str, list[float]]] = []
    state_before = dispatcher.state()
    for name, system in systems:
        joins, leaves, shifts = churn(system, members, rounds)
        timings += [(f"{name} join", joins), (f"{name} leave", leaves)]
        if shifts:
            timings.append((f"{name} shift chance", shifts))
    peer_join = statistics.median(dict(timings)["uhashring add/remove_node (peer) join"])
    peer_leave = statistics.median(dict(timings)["uhashring add/remove_node (peer) leave"])
    rows = []
    for name, samples in timings:
        median = statistics.median(samples)
        peer = peer_leave if name.endswith("leave") else peer_join
        rows.append([name, str(consumers), f"{median * 1e3:.3f}", f"{max(samples) * 1e3:.3f}", f"{peer / median:.2f}x"])
    print(f"{consumers:,} consumers: MultiRangePolicy ends with {multi.state()}")
    print(f"{consumers:,} consumers: Dispatcher before the changes: {state_before}; after: {dispatcher.state()}")
    return rows


def main() -> None:
    quick = parse_quick(__doc__ or "")
    sizes = (64, 200) if quick else (64, 1000)
    rounds = 20 if quick else 100
    messages = 10_000 if quick else 50_000
    rows: list[list[str]] = []
    for consumers in sizes:
        rows += measure(consumers, rounds, messages)
    print()
    print_table(
        f"Rebalance: one join, one leave, one shift chance; {rounds} of each per group size",
        ["operation", "consumers", "median ms", "max ms", "median vs uhashring"],
        rows,
    )
    print()


if __name__ == "__main__":
    main()
