"""The main job: consumers that join, leave and stall, with every guarantee checked.

:func:`run_server_demo` (``keyfailover demo``) starts a real ``keyfailover serve`` on a free
loopback port with a temporary data directory, produces keyed account events and runs
consumers on threads: two at first, a third that joins, a fourth that joins and stalls
(keeps its deliveries unacked), the first leaving, and the stalled one removed at last,
whose unacked events then go to the new owners. It checks that every event was consumed
and each account's events were first delivered in the order they were stored.

:func:`run_core_demo` (``keyfailover demo --core``) runs the same story on the dispatcher
core alone, on a simulated clock, and checks each delivery as it happens: in per-key
order, one consumer per key at a time, nothing lost.

Both print who owns what after every change, one line per consumer (it may own several
ranges of the hash space: how many, its share of the slots, the first few), and a final table.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from keyfailover.client import Client, ClientClosed, Consumer, Timeout
from keyfailover.core.clock import ManualClock
from keyfailover.core.dispatcher import Delivery, Dispatcher
from keyfailover.core.errors import KeyFailoverError
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hash

__all__ = ["DemoReport", "run_core_demo", "run_server_demo"]


@dataclass
class DemoReport:
    """What the demo observed; ``problems`` is empty when every guarantee held."""

    published: int = 0
    acked: int = 0
    deliveries: dict[str, int] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)
    """Each consumer's state at the end: active, left, or stalled then removed."""
    redeliveries: int = 0
    problems: list[str] = field(default_factory=list)


def _zipf_ids(count: int, distinct: int, seed: int) -> list[int]:
    """``count`` Zipf(1.1) draws in ``[1, distinct]``."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while len(ids) < count:
        drawn = rng.zipf(1.1, count * 4)
        ids.extend(drawn[drawn <= distinct][: count - len(ids)].tolist())
    return ids


def _final_table(out: TextIO, report: DemoReport) -> None:
    out.write(f"\n  {'consumer':<10}{'deliveries':>12}  {'status'}\n")
    for consumer in sorted(report.deliveries.keys() | report.status.keys()):
        count = report.deliveries.get(consumer, 0)
        out.write(f"  {consumer:<10}{count:>12}  {report.status.get(consumer, 'active')}\n")


def _verdict(out: TextIO, report: DemoReport, held: str) -> None:
    if report.problems:
        out.write("GUARANTEE VIOLATED:\n" + "".join(f"  {p}\n" for p in report.problems[:20]))
    else:
        out.write(held + "\n")


# -- the core alone, on a simulated clock ----------------------------------------------------


_SHOWN_RANGES = 3
"""Ranges listed per consumer in the tables; the rest are counted."""


def _owned(ranges: list[tuple[int, int]]) -> tuple[str, str]:
    """A consumer's ranges for the tables: ``("3 ranges, 12.5% of slots", "[0, 99] [500, 899] ...")``."""
    if not ranges:
        return "no range (standby)", ""
    share = sum(end - start + 1 for start, end in ranges) / HASH_RANGE_SIZE
    summary = f"{len(ranges)} range{'' if len(ranges) == 1 else 's'}, {share:.1%} of slots"
    listed = " ".join(f"[{start}, {end}]" for start, end in ranges[:_SHOWN_RANGES])
    more = len(ranges) - _SHOWN_RANGES
    return summary, listed + (f" and {more} more" if more > 0 else "")


_RANGES_HEADER = f"{'hash ranges':<28}"
_TAIL_HEADER = f"  {'status':<9}first ranges"


def _in_hash_order(owned: dict[str, list[tuple[int, int]]]) -> list[tuple[str, list[tuple[int, int]]]]:
    """``(consumer, ranges)`` by each consumer's first range; standbys, owning none, last."""
    return sorted(owned.items(), key=lambda item: (not item[1], item[1][:1]))


def _print_core_ranges(out: TextIO, title: str, dispatcher: Dispatcher, stalled: set[str]) -> None:
    stats = dispatcher.stats()
    out.write(f"\n{title} (epoch {stats['epoch']})\n")
    out.write(f"  {'consumer':<10}{_RANGES_HEADER}{'rate/s':>9}{'unacked':>9}{'draining':>10}{_TAIL_HEADER}\n")
    for consumer, ranges in _in_hash_order({cid: info["ranges"] for cid, info in stats["consumers"].items()}):
        info = stats["consumers"][consumer]
        summary, listed = _owned(ranges)
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
    key_ids = _zipf_ids(messages, keys, seed)
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
        4 * messages // 6: ("c1 leaves: its ranges go to the least busy, its neighbours first", lambda: _leave("c1")),
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
    _final_table(out, report)
    out.write(
        f"\npublished {report.published}, acked {report.acked}, redelivered {report.redeliveries}; "
        f"rebalances {dispatcher.stats()['rebalances']}\n"
    )
    _verdict(out, report, "per-key order held, one consumer per key at a time, nothing lost")
    return report


# -- a real server, producers and consumers --------------------------------------------------


class _Observed:
    """What all consumers saw, shared between their threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.first: dict[int, str] = {}
        self.first_by_key: dict[str, list[int]] = defaultdict(list)
        self.deliveries: dict[str, int] = defaultdict(int)
        self.redeliveries = 0

    def record(self, consumer: str, position: int, key: str, redelivery_count: int) -> None:
        with self.lock:
            self.deliveries[consumer] += 1
            self.redeliveries += redelivery_count > 0
            if position not in self.first:
                self.first[position] = consumer
                self.first_by_key[key].append(position)


class _Worker:
    """One consumer on its own thread; ``stall`` stops it acking (it keeps what it holds)."""

    def __init__(self, client: Client, name: str, observed: _Observed, queue: int, *, stalled: bool = False) -> None:
        self.name = name
        self.consumer: Consumer = client.subscribe("accounts", "ledger", consumer_name=name, receiver_queue_size=queue)
        self.stalled = threading.Event()
        if stalled:
            self.stalled.set()
        self.stop = threading.Event()
        self._observed = observed
        self._thread = threading.Thread(target=self._run, name=f"demo-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.stalled.is_set():
                self.stop.wait(0.05)
                continue
            try:
                message = self.consumer.receive(timeout=0.2)
            except Timeout:
                continue
            except ClientClosed:
                return
            key = message.key.decode() if isinstance(message.key, bytes) else str(message.key)
            self._observed.record(self.name, message.position, key, message.redelivery_count)
            if not self.stalled.is_set():
                self.consumer.acknowledge(message)

    def leave(self) -> None:
        self.stop.set()
        self._thread.join(timeout=10)
        self.consumer.close()


def _print_server_ranges(out: TextIO, title: str, workers: dict[str, _Worker], observed: _Observed) -> None:
    owned = {name: worker.consumer.ranges for name, worker in workers.items()}

    def tiled() -> bool:  # the consumers heard of their new ranges (ranges_changed frames)
        owned.update((name, worker.consumer.ranges) for name, worker in workers.items())
        return sum(end - start + 1 for ranges in owned.values() for start, end in ranges) == HASH_RANGE_SIZE

    _wait_for(tiled, 10.0)
    out.write(f"\n{title}\n")
    out.write(f"  {'consumer':<10}{_RANGES_HEADER}{'received':>10}{_TAIL_HEADER}\n")
    with observed.lock:
        received = dict(observed.deliveries)
    for name, ranges in _in_hash_order(owned):
        status = "stalled" if workers[name].stalled.is_set() else "active"
        summary, listed = _owned(ranges)
        out.write(f"  {name:<10}{summary:<28}{received.get(name, 0):>10}  {status:<9}{listed}\n")


def _wait_for(condition: object, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return True
        time.sleep(0.05)
    return False


def run_server_demo(events: int = 30_000, accounts: int = 2_000, seed: int = 7, out: TextIO = sys.stdout) -> DemoReport:
    """Run the scripted scenario against a real server process; returns what was observed."""
    if events < 1000 or accounts < 1:
        raise KeyFailoverError(f"demo needs events >= 1000 and accounts >= 1, got {events} and {accounts}")
    account_ids = _zipf_ids(events, accounts, seed)
    report = DemoReport()
    observed = _Observed()
    stored: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="keyfailover-demo-") as data_dir:
        out.write(f"keyfailover demo: starting keyfailover serve with data in {data_dir} ...\n")
        out.flush()
        server = subprocess.Popen(
            [sys.executable, "-m", "keyfailover", "serve", "--data-dir", str(Path(data_dir)), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            line = server.stdout.readline()
            if not line.startswith("listening on "):
                raise KeyFailoverError(f"the demo server did not start: {line!r}")
            url = "kf://" + line.split("listening on ", 1)[1].strip()
            out.write(f"server listening at {url}; producing {events} events over {accounts} Zipf(1.1) accounts\n")
            _scenario(url, account_ids, observed=observed, stored=stored, report=report, out=out)
        finally:
            server.terminate()
            _, errors = server.communicate(timeout=30)
            if server.returncode != 0:
                report.problems.append(f"the server exited with {server.returncode}: {errors.strip()[-2000:]}")
    report.published = len(stored)
    report.acked = len(observed.first)
    report.deliveries = dict(observed.deliveries)
    report.redeliveries = observed.redeliveries
    missing = set(stored) - set(observed.first)
    if missing:
        report.problems.append(f"{len(missing)} stored events were never consumed")
    for key, positions in observed.first_by_key.items():
        if positions != sorted(positions):
            report.problems.append(f"account {key}: first deliveries out of order")
    _final_table(out, report)
    out.write(f"\nstored {report.published}, consumed {report.acked}, redelivered {report.redeliveries}\n")
    _verdict(out, report, "every event consumed; each account's events first delivered in stored order")
    return report


def _scenario(
    url: str, account_ids: list[int], *, observed: _Observed, stored: dict[int, str], report: DemoReport, out: TextIO
) -> None:
    events = len(account_ids)
    with Client(url) as client:
        workers = {name: _Worker(client, name, observed, 200) for name in ("c1", "c2")}
        producer = client.create_producer("accounts", "demo-producer")
        lock = threading.Lock()

        def remember(key: str) -> object:
            def done(position: int | None, error: BaseException | None) -> None:
                if error is None and position is not None:
                    with lock:
                        stored[position] = key
                else:
                    report.problems.append(f"an event was not stored: {error}")

            return done

        _print_server_ranges(out, "c1 and c2 share the hash space", workers, observed)
        steps = {
            events // 4: "c3 joins: it takes a third of the traffic, from the busiest first",
            events // 2: "c4 joins, then stalls: its keys wait, nobody else's do",
            3 * events // 4: "c1 leaves: its ranges go to the least busy, its neighbours first",
        }
        for i, account in enumerate(account_ids):
            if i in steps:
                producer.flush()
                if i == events // 4:
                    workers["c3"] = _Worker(client, "c3", observed, 200)
                elif i == events // 2:
                    workers["c4"] = _Worker(client, "c4", observed, 100, stalled=True)
                else:
                    workers.pop("c1").leave()
                    report.status["c1"] = "left"
                _print_server_ranges(out, steps[i], workers, observed)
            key = f"account-{account}"
            producer.send_async(f"{key}:{i}:{(i * 37) % 1000 - 500}".encode(), key, remember(key))  # type: ignore[arg-type]
        producer.flush()
        stalled = workers["c4"].consumer.ranges

        def others_done() -> bool:  # every event outside the stalled consumer's ranges was consumed
            with lock, observed.lock:
                return all(
                    position in observed.first
                    for position, key in stored.items()
                    if not any(start <= key_hash(key) <= end for start, end in stalled)
                )

        _wait_for(others_done, 60.0)
        out.write(f"\nwhile c4 stalled, every event outside its ranges was consumed: {others_done()}\n")
        workers.pop("c4").leave()
        report.status["c4"] = "stalled, then removed"
        _print_server_ranges(out, "stalled c4 is removed: its unacked events go to the new owners", workers, observed)
        _wait_for(lambda: len(observed.first) >= len(stored), 60.0)
        for worker in workers.values():
            worker.leave()
