"""``keyfailover demo --core``: the dispatcher core alone, on a simulated clock."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

from keyfailover.core.clock import ManualClock
from keyfailover.core.dispatcher import Delivery, Dispatcher
from keyfailover.core.errors import KeyFailoverError
from keyfailover.tools.demo._report import (
    RANGES_HEADER,
    TAIL_HEADER,
    DemoReport,
    describe_ranges,
    final_table,
    in_hash_order,
    verdict,
    zipf_ids,
)

__all__ = ["run_core_demo"]


def _print_core_ranges(out: TextIO, title: str, dispatcher: Dispatcher, stalled: set[str]) -> None:
    stats = dispatcher.stats()
    out.write(f"\n{title} (epoch {stats['epoch']})\n")
    out.write(f"  {'consumer':<10}{RANGES_HEADER}{'rate/s':>9}{'unacked':>9}{'draining':>10}{TAIL_HEADER}\n")
    for consumer, ranges in in_hash_order({cid: info["ranges"] for cid, info in stats["consumers"].items()}):
        info = stats["consumers"][consumer]
        summary, listed = describe_ranges(ranges)
        status = "stalled" if consumer in stalled else "active"
        out.write(
            f"  {consumer:<10}{summary:<28}{info['rate']:>9.0f}{info['unacked']:>9}"
            f"{info['draining_hashes']:>10}  {status:<9}{listed}\n"
        )


def run_core_demo(messages: int = 60_000, keys: int = 5_000, seed: int = 7, out: TextIO = sys.stdout) -> DemoReport:
    """Run the scripted scenario and return what was observed."""
    if messages < 1000 or keys < 1:
        raise KeyFailoverError(f"demo needs messages >= 1000 and keys >= 1, got {messages} and {keys}")
    clock = ManualClock()
    dispatcher = Dispatcher(clock=clock, max_replay=20_000, shift_interval=5.0)
    key_ids = zipf_ids(messages, keys, seed)
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
        report.status[cid] = "stalled, then removed" if cid in stalled else "left"
        stalled.discard(cid)
        forget_inflight(cid)

    def stall(cid: str) -> None:
        join(cid, 200)
        stalled.add(cid)

    script: dict[int, tuple[str, Callable[[], None]]] = {
        0: ("c1 starts alone and owns the whole hash space", lambda: join("c1")),
        messages // 6: ("c2 joins: it takes half of the traffic from c1, the only consumer", lambda: join("c2")),
        2 * messages // 6: ("c3 joins: it takes a third of the traffic, from the busiest first", lambda: join("c3")),
        3 * messages // 6: ("c4 joins with 200 permits, then stalls (never acks)", lambda: stall("c4")),
        4 * messages // 6: (
            "c1 leaves: its ranges go to the consumers making progress; the stalled c4 gets none",
            lambda: _leave("c1"),
        ),
        5 * messages // 6: ("stalled c4 is removed: its unacked messages go to the new owners", lambda: _leave("c4")),
    }

    out.write(f"keyfailover demo: {messages} messages over {keys} Zipf(1.1) keys, simulated clock\n")
    for position, key_id in enumerate(key_ids):
        if position in script:
            title, action = script[position]
            action()
            _print_core_ranges(out, f"after message {position}: {title}", dispatcher, stalled)
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
    _print_core_ranges(out, "final range map", dispatcher, stalled)
    final_table(out, report)
    out.write(
        f"\npublished {report.published}, acked {report.acked}, redelivered {report.redeliveries}; "
        f"rebalances {dispatcher.stats()['rebalances']}\n"
    )
    verdict(out, report, "per-key order held, one consumer per key at a time, nothing lost")
    return report
