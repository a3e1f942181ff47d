"""The cost of one join and one leave with 1000 consumers, against uhashring as the peer.

Run: ``python benchmarks/bench_rebalance.py [--quick]``. Three systems start with the same
1000 consumers (200 with ``--quick``), each built by joins, then go through 200 (20)
rounds of one newcomer joining and one random member leaving; every join and every leave
is timed on its own, and the table shows the median and the slowest.

- the pure policy, ``plan_join`` / ``plan_leave`` on a ``RangeMap``, with a random
  per-slot traffic array and random consumer rates (re-estimated after each change by
  ``reassign_rates``, as the dispatcher does, untimed);
- ``Dispatcher.add_consumer`` / ``remove_consumer`` on a dispatcher holding 50,000
  messages (10,000) with keys drawn Zipf(1.1), most of them in flight and unacked, so a
  change re-routes keys, marks draining keys and hands a leaver's messages back;
- uhashring's ``HashRing.add_node`` / ``remove_node`` (160 vnodes per node).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from functools import partial
from typing import Protocol

import numpy as np
import uhashring
from _common import (
    SEED,
    consumer_ids,
    format_count,
    joined_range_map,
    parse_quick,
    print_table,
    timed,
    zipf_keys,
)

from keyfailover import HASH_RANGE_SIZE, Dispatcher, Load, plan_join, plan_leave
from keyfailover.core.clock import ManualClock
from keyfailover.core.rebalance import reassign_rates

WINDOW = 50
TICK = 0.01


class Membership(Protocol):
    """A system whose members join and leave; ``settle`` is the untimed work between changes."""

    def join(self, cid: str) -> None: ...
    def leave(self, cid: str) -> None: ...
    def settle(self) -> None: ...


class PolicyMembership:
    """The pure rebalance policy on a ``RangeMap``, with random rates and per-slot traffic."""

    def __init__(self, members: Sequence[str], rng: np.random.Generator) -> None:
        self._ranges = joined_range_map(members)
        self._before = self._ranges
        self._traffic = rng.random(HASH_RANGE_SIZE)
        self._rates = dict(zip(members, (1000.0 * rng.random(len(members))).tolist(), strict=True))
        self._load = Load(self._rates, self._traffic)

    def join(self, cid: str) -> None:
        self._ranges = plan_join(self._ranges, cid, self._load)

    def leave(self, cid: str) -> None:
        self._ranges = plan_leave(self._ranges, cid, self._load)

    def settle(self) -> None:
        self._rates = reassign_rates(self._before, self._ranges, self._rates, self._traffic)
        self._before = self._ranges
        self._load = Load(self._rates, self._traffic)


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


class RingMembership:
    """uhashring's consistent-hash ring: the peer."""

    def __init__(self, members: Sequence[str]) -> None:
        self._ring = uhashring.HashRing(nodes=list(members))

    def join(self, cid: str) -> None:
        self._ring.add_node(cid)

    def leave(self, cid: str) -> None:
        self._ring.remove_node(cid)

    def settle(self) -> None:
        """Nothing to do between changes."""


def churn(system: Membership, members: Sequence[str], rounds: int) -> tuple[list[float], list[float]]:
    """Seconds of each join and each leave over ``rounds`` of one join then one random leave."""
    rng = random.Random(SEED)
    live = list(members)
    joins: list[float] = []
    leaves: list[float] = []
    for i in range(rounds):
        newcomer = f"n{i}"
        joins.append(timed(partial(system.join, newcomer))[0])
        live.append(newcomer)
        system.settle()
        leaver = live.pop(rng.randrange(len(live)))
        leaves.append(timed(partial(system.leave, leaver))[0])
        system.settle()
    return joins, leaves


def main() -> None:
    quick = parse_quick(__doc__ or "")
    consumers = 200 if quick else 1000
    rounds = 20 if quick else 200
    messages = 10_000 if quick else 50_000
    members = consumer_ids(consumers)
    rng = np.random.default_rng(SEED)

    dispatcher = DispatcherMembership(members, rng, messages)
    state_before = dispatcher.state()
    systems: list[tuple[str, str, Membership]] = [
        ("RangeMap plan_join", "RangeMap plan_leave", PolicyMembership(members, rng)),
        ("Dispatcher.add_consumer", "Dispatcher.remove_consumer", dispatcher),
        ("uhashring HashRing.add_node (peer)", "uhashring HashRing.remove_node (peer)", RingMembership(members)),
    ]
    timings: list[tuple[str, list[float]]] = []
    for join_name, leave_name, system in systems:
        joins, leaves = churn(system, members, rounds)
        timings += [(join_name, joins), (leave_name, leaves)]

    peer_join, peer_leave = statistics.median(timings[-2][1]), statistics.median(timings[-1][1])
    rows = []
    for index, (name, samples) in enumerate(timings):
        median = statistics.median(samples)
        peer = peer_join if index % 2 == 0 else peer_leave
        rows.append([name, str(consumers), f"{median * 1e3:.3f}", f"{max(samples) * 1e3:.3f}", f"{peer / median:.1f}x"])
    print_table(
        f"Rebalance: one join and one leave with {consumers:,} consumers, {rounds} of each",
        ["operation", "consumers", "median ms", "max ms", "median vs uhashring"],
        rows,
    )
    print(f"Dispatcher before the changes: {state_before}")
    print(f"Dispatcher after the changes:  {dispatcher.state()}")
    print()


if __name__ == "__main__":
    main()
