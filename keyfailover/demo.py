"""The main job for now: the dispatcher through joins, leaves and a stalled consumer.

Runs on a simulated clock over generated Zipf keys, prints the range map after every
change and the delivery counts per consumer, and checks the guarantees on the way: each
key's messages are delivered in order to one consumer at a time and nothing is lost.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np

from keyfailover.clock import ManualClock
from keyfailover.dispatcher import Delivery, Dispatcher
from keyfailover.errors import KeyFailoverError

__all__ = ["DemoReport", "run_demo"]


@dataclass
class DemoReport:
    """What the demo observed; ``problems`` is empty when every guarantee held."""

    published: int = 0
    acked: int = 0
    deliveries: dict[str, int] = field(default_factory=dict)
    redeliveries: int = 0
    problems: list[str] = field(default_factory=list)


def _print_ranges(out: TextIO, title: str, dispatcher: Dispatcher) -> None:
    stats = dispatcher.stats()
    out.write(f"\n{title} (epoch {stats['epoch']})\n")
    out.write(f"  {'consumer':<10}{'range':>17}{'share':>8}{'rate/s':>9}{'unacked':>9}{'draining':>10}\n")
    for start, end, consumer in dispatcher.ranges():
        info = stats["consumers"][consumer]
        share = (end - start + 1) / 65536
        out.write(
            f"  {consumer:<10}{f'[{start}, {end}]':>17}{share:>8.1%}{info['rate']:>9.0f}"
            f"{info['unacked']:>9}{info['draining_hashes']:>10}\n"
        )


def run_demo(messages: int = 60_000, keys: int = 5_000, seed: int = 7, out: TextIO = sys.stdout) -> DemoReport:
    """Run the scripted scenario and return what was observed."""
    if messages < 1000 or keys < 1:
        raise KeyFailoverError(f"demo needs messages >= 1000 and keys >= 1, got {messages} and {keys}")
    clock = ManualClock()
    dispatcher = Dispatcher(clock=clock, max_replay=20_000, shift_interval=5.0)
    rng = np.random.default_rng(seed)
    drawn = rng.zipf(1.1, messages * 4)
    key_ids = drawn[drawn <= keys][:messages]
    report = DemoReport()
    expected_next: dict[str, int] = {}  # per key: the next position it must be delivered at
    published_by_key: dict[str, list[int]] = {}
    acked: set[int] = set()
    stalled: set[str] = set()
    holder: dict[str, tuple[str, int]] = {}  # key -> (consumer, unacked count)

    def check(delivery: Delivery) -> None:
        key = str(delivery.key)
        order = published_by_key[key]
        nxt = expected_next.get(key, 0)
        while nxt < len(order) and order[nxt] in acked:
            nxt += 1
        if delivery.position != order[nxt]:
            report.problems.append(f"key {key}: delivered {delivery.position}, expected {order[nxt]}")
        expected_next[key] = nxt + 1
        owner, count = holder.get(key, (delivery.consumer, 0))
        if count and owner != delivery.consumer:
            report.problems.append(f"key {key}: in flight on {owner} and {delivery.consumer} at once")
        holder[key] = (delivery.consumer, count + 1)

    def settle(deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            check(delivery)
            report.deliveries[delivery.consumer] = report.deliveries.get(delivery.consumer, 0) + 1
            report.redeliveries += delivery.redelivery_count > 0
            if delivery.consumer in stalled:
                continue
            dispatcher.ack(delivery.consumer, delivery.position)
            acked.add(delivery.position)
            owner, count = holder[str(delivery.key)]
            holder[str(delivery.key)] = (owner, count - 1)
            dispatcher.flow(delivery.consumer, 1)

    def join(cid: str, permits: int = 500) -> None:
        dispatcher.add_consumer(cid)
        dispatcher.flow(cid, permits)

    def forget_inflight(cid: str) -> None:
        for key, (owner, _) in list(holder.items()):
            if owner == cid:
                del holder[key]
                expected_next.pop(key, None)

    def _leave(cid: str) -> None:
        dispatcher.remove_consumer(cid)
        stalled.discard(cid)
        forget_inflight(cid)

    script: dict[int, tuple[str, Callable[[], None]]] = {
        0: ("c1 starts alone and owns the whole hash space", lambda: join("c1")),
        messages // 6: ("c2 joins: it splits c1, the only (so busiest) consumer", lambda: join("c2")),
        2 * messages // 6: ("c3 joins: it splits whichever of c1, c2 dispatches more", lambda: join("c3")),
        3 * messages // 6: ("c4 joins with 200 permits, then stalls (never acks)", lambda: _stall(join, stalled)),
        4 * messages // 6: ("c1 leaves: its range merges into its less busy neighbour", lambda: _leave("c1")),
        5 * messages // 6: ("stalled c4 is removed: its unacked messages go to the new owner", lambda: _leave("c4")),
    }

    out.write(f"keyfailover demo: {messages} messages over {keys} Zipf(1.1) keys, simulated clock\n")
    for position, key_id in enumerate(key_ids.tolist()):
        if position in script:
            title, action = script[position]
            action()
            _print_ranges(out, f"after message {position}: {title}", dispatcher)
        for _ in range(1000):
            if dispatcher.wants():
                break
            clock.now += 0.01
            settle(dispatcher.poll())
        else:
            report.problems.append(f"the buffer stayed full at message {position}: nothing could be delivered")
            break
        key = f"account-{key_id}"
        published_by_key.setdefault(key, []).append(position)
        dispatcher.publish(position, key, b"")
        report.published += 1
        if position % 100 == 99:
            clock.now += 0.01
            settle(dispatcher.poll())
    for _ in range(10_000):
        clock.now += 0.01
        settle(dispatcher.poll())
        if dispatcher.stats()["held"] == 0:
            break
    report.acked = len(acked)
    if report.acked != report.published:
        report.problems.append(f"{report.published - report.acked} messages were never acked")
    _print_ranges(out, "final range map", dispatcher)
    out.write(f"\n  {'consumer':<10}{'deliveries':>12}\n")
    for consumer, count in sorted(report.deliveries.items()):
        out.write(f"  {consumer:<10}{count:>12}\n")
    out.write(
        f"\npublished {report.published}, acked {report.acked}, redelivered {report.redeliveries}; "
        f"rebalances {dispatcher.stats()['rebalances']}\n"
    )
    if report.problems:
        out.write("GUARANTEE VIOLATED:\n" + "".join(f"  {p}\n" for p in report.problems[:20]))
    else:
        out.write("per-key order held, one consumer per key at a time, nothing lost\n")
    return report


def _stall(join: Callable[[str, int], None], stalled: set[str]) -> None:
    join("c4", 200)
    stalled.add("c4")
