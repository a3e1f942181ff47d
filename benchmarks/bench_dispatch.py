"""The core dispatch loop, publish → poll → ack, on one core with consumers joining and leaving.

Run: ``python benchmarks/bench_dispatch.py [--quick]``. Messages carry keys drawn Zipf(1.1)
from 100,000 distinct keys and go to 8 consumers; every 50,000 messages (5,000 with
``--quick``, so both runs see 19 changes) a new consumer joins or, alternately, a random
one leaves. Each consumer gets a window of permits at the
start and one permit back per ack. One round of the loop publishes up to 256 messages,
fewer when ``wants()`` says so, polls, and acks, in delivery order, every delivery of the
previous poll: acks trail one poll behind, so joins and leaves meet messages in flight
(draining keys, redelivery of a leaver's messages), as they do in a live system. After
the last publish the loop drains until nothing is left. The clock is manual: +1 ms a round.

The same loop also drives the Dispatcher with leases on (``ack_timeout`` 30 s, which no
delivery reaches: the row shows what the deadline bookkeeping costs; issue 13's bar, from
RocketMQ RIP-19, is under 10% of throughput). In the same run the same loop drives two
peers: ``NaiveKeyShared`` (routes each message at once by the same range-map lookup; no
permits, draining or replay order) and ``NullDispatcher`` (no routing at all), which shows
what the loop itself costs. Every run checks that each published message was acked exactly
once.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from _common import (
    DISTINCT_KEYS,
    SEED,
    ZIPF_EXPONENT,
    best_of,
    consumer_ids,
    format_count,
    parse_quick,
    print_goals,
    print_table,
    zipf_keys,
)

from keyfailover import Delivery, Dispatcher, Load, MultiRangePolicy, RangeMap, key_hash
from keyfailover.core.clock import ManualClock

CONSUMERS = 8
CHANGES = 20
BATCH = 256
WINDOW = 1000
TICK = 0.001

GOAL = 300_000.0
LEASE_COST_GOAL = 0.10
ACK_TIMEOUT = 30.0


class DispatchCore(Protocol):
    """The part of the dispatcher API the loop drives."""

    def add_consumer(self, cid: str) -> None: ...
    def remove_consumer(self, cid: str) -> None: ...
    def flow(self, cid: str, permits: int) -> None: ...
    def wants(self) -> int: ...
    def publish(self, position: int, key: str | bytes | None, payload: Any = None) -> None: ...
    def poll(self) -> list[Delivery]: ...
    def ack(self, cid: str, position: int) -> None: ...


class NaiveKeyShared:
    """Publish → route → ack and nothing else: the baseline a real dispatcher must stay near.

    Each message goes out at once to its key's owner (a key → consumer dict in front of the
    same ``RangeMap`` lookup, cleared on every change). There are no permits, no bound, no
    draining keys and no replay order; a leaver's unacked messages are simply routed again.
    """

    def __init__(self) -> None:
        self._policy = MultiRangePolicy()
        self._ranges = RangeMap()
        self._owner: dict[str | bytes | None, str] = {}
        self._inflight: dict[str, dict[int, Delivery]] = {}  # consumer -> position -> delivery
        self._outbox: list[Delivery] = []

    def add_consumer(self, cid: str) -> None:
        self._ranges = self._policy.join(self._ranges, cid, Load())
        self._inflight[cid] = {}
        self._owner.clear()

    def remove_consumer(self, cid: str) -> None:
        self._ranges = self._policy.leave(self._ranges, cid, Load())
        returned = self._inflight.pop(cid)
        self._owner.clear()
        for delivery in returned.values():
            self._send(delivery.position, delivery.key, delivery.payload, delivery.redelivery_count + 1)

    def flow(self, cid: str, permits: int) -> None:
        """Ignored: without flow control every message goes out at once."""

    def wants(self) -> int:
        return sys.maxsize

    def publish(self, position: int, key: str | bytes | None, payload: Any = None) -> None:
        self._send(position, key, payload, 0)

    def poll(self) -> list[Delivery]:
        out, self._outbox = self._outbox, []
        return out

    def ack(self, cid: str, position: int) -> None:
        del self._inflight[cid][position]

    def _send(self, position: int, key: str | bytes | None, payload: Any, redeliveries: int) -> None:
        cid = self._route(key)
        delivery = Delivery(cid, position, key, payload, redeliveries)
        self._inflight[cid][position] = delivery
        self._outbox.append(delivery)

    def _route(self, key: str | bytes | None) -> str:
        cid = self._owner.get(key)
        if cid is None:
            found = self._ranges.owner_of(0 if key is None else key_hash(key))
            if found is None:
                raise RuntimeError("no consumer to route to; the loop adds consumers before publishing")
            cid = self._owner[key] = found
        return cid


class NullDispatcher(NaiveKeyShared):
    """No routing: every message goes to the oldest consumer. Only the loop and its acks cost."""

    def _route(self, key: str | bytes | None) -> str:
        return next(iter(self._inflight))


def drive(core: DispatchCore, keys: list[str], clock: ManualClock, churn_every: int) -> int:
    """Run the loop over ``keys`` (message ``i`` has key ``keys[i]``), a join or leave every ``churn_every``.

    Returns the number of deliveries made.

    Raises SystemExit unless every message was acked exactly once.
    """
    total = len(keys)
    acked = bytearray(total)
    live = consumer_ids(CONSUMERS)
    for cid in live:
        core.add_consumer(cid)
        core.flow(cid, WINDOW)
    joined = len(live)
    churn_rng = random.Random(SEED)
    churns = 0
    next_churn = churn_every
    publish, poll, ack, flow, wants = core.publish, core.poll, core.ack, core.flow, core.wants
    outstanding: list[Delivery] = []
    deliveries = 0
    position = 0
    while True:
        if position == next_churn and position < total:
            if churns % 2 == 0:
                cid = f"c{joined}"
                joined += 1
                core.add_consumer(cid)
                flow(cid, WINDOW)
                live.append(cid)
            else:
                cid = live.pop(churn_rng.randrange(len(live)))
                core.remove_consumer(cid)
                outstanding = [d for d in outstanding if d.consumer != cid]
            churns += 1
            next_churn += churn_every
        stop = min(position + min(BATCH, wants()), next_churn, total)
        for p in range(position, stop):
            publish(p, keys[p])
        position = stop
        delivered = poll()
        credits: dict[str, int] = {}
        for delivery in outstanding:
            cid = delivery.consumer
            ack(cid, delivery.position)
            acked[delivery.position] += 1
            credits[cid] = credits.get(cid, 0) + 1
        for cid, permits in credits.items():
            flow(cid, permits)
        clock.advance(TICK)
        deliveries += len(delivered)
        if position == total and not delivered and not outstanding:
            break
        outstanding = delivered
    once = acked.count(1)
    if once != total:
        never = acked.count(0)
        raise SystemExit(
            f"{type(core).__name__}: {never} of {total} messages were never acked and "
            f"{total - once - never} were acked more than once; expected each acked exactly once"
        )
    return deliveries


def main() -> None:
    quick = parse_quick(__doc__ or "")
    total = 100_000 if quick else 1_000_000
    repeats = 1 if quick else 3
    churn_every = total // CHANGES
    keys = zipf_keys(np.random.default_rng(SEED), total)

    cores: list[tuple[str, Callable[[ManualClock], DispatchCore]]] = [
        ("keyfailover Dispatcher", lambda clock: Dispatcher(clock=clock)),
        (
            f"keyfailover Dispatcher, ack_timeout {ACK_TIMEOUT:g} s",
            lambda clock: Dispatcher(clock=clock, ack_timeout=ACK_TIMEOUT),
        ),
        ("NaiveKeyShared (baseline)", lambda clock: NaiveKeyShared()),
        ("NullDispatcher (loop only)", lambda clock: NullDispatcher()),
    ]
    rows: list[list[str]] = []
    per_message: dict[str, float] = {}
    rates: dict[str, float] = {}
    for name, make in cores:

        def run(make: Callable[[ManualClock], DispatchCore] = make) -> int:
            clock = ManualClock()
            return drive(make(clock), keys, clock, churn_every)

        seconds, deliveries = best_of(run, repeats)
        rates[name] = total / seconds
        per_message[name] = seconds / total * 1e6
        rows.append(
            [
                name,
                format_count(total),
                format_count(deliveries - total),
                f"{seconds:.3f}",
                format_count(rates[name]),
                f"{per_message[name]:.2f}",
            ]
        )

    changes = (total - 1) // churn_every
    print_table(
        f"Dispatch loop: {total:,} messages, keys Zipf({ZIPF_EXPONENT}) over {DISTINCT_KEYS:,}, "
        f"{CONSUMERS} consumers, a join or leave every {churn_every:,} ({changes} in all), "
        f"batches of {BATCH}, best of {repeats}",
        ["dispatcher", "messages", "redelivered", "seconds", "messages/s", "µs/message"],
        rows,
    )
    dispatcher, leased, null_name = cores[0][0], cores[1][0], cores[3][0]
    print(
        f"Dispatcher cost without the loop: {per_message[dispatcher] - per_message[null_name]:.2f} µs/message "
        f"({dispatcher} minus {null_name})"
    )
    print()
    lease_cost = 1.0 - rates[leased] / rates[dispatcher]
    print_goals(
        [
            (
                f"dispatch loop with churn >= {format_count(GOAL)} messages/s",
                format_count(rates[dispatcher]),
                rates[dispatcher] >= GOAL,
            ),
            (
                f"lease bookkeeping costs <= {LEASE_COST_GOAL:.0%} of throughput",
                f"{lease_cost:.1%}",
                lease_cost <= LEASE_COST_GOAL,
            ),
        ]
    )


if __name__ == "__main__":
    main()
