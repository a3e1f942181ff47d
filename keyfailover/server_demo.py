"""The main job: a real server, producers and consumers that join, leave and stall.

Starts ``keyfailover serve`` on a free loopback port with a temporary data directory,
produces keyed account events, and runs consumers on threads: two at first, a third that
joins, a fourth that joins and stalls (keeps its deliveries unacked), the first leaving,
and the stalled one removed at last, whose unacked messages then go to the new owner.
It prints range ownership after each step and the delivery counts, and checks that every
event was consumed and each key's events were first delivered in the order they were stored.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import TextIO

import numpy as np

from keyfailover.client import Client, ClientClosed, Consumer, Timeout
from keyfailover.demo import DemoReport
from keyfailover.errors import KeyFailoverError
from keyfailover.hashing import key_hash

__all__ = ["run_server_demo"]


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


def _print_ranges(out: TextIO, title: str, workers: dict[str, _Worker]) -> None:
    def tiled() -> bool:  # the consumers heard of their new ranges (ranges_changed frames)
        widths = [
            end - start + 1
            for start, end in (w.consumer.range for w in workers.values())
            if start is not None and end is not None
        ]
        return sum(widths) == 65536

    _wait_for(tiled, 10.0)
    out.write(f"\n{title}\n")
    owned = sorted(
        ((w.consumer.range, name) for name, w in workers.items() if w.consumer.range[0] is not None),
        key=lambda item: item[0][0] or 0,
    )
    for (start, end), name in owned:
        assert start is not None and end is not None
        stalled = "  (stalled)" if workers[name].stalled.is_set() else ""
        out.write(f"  {name:<4}[{start:>5}, {end:>5}]  {(end - start + 1) / 65536:6.1%}{stalled}\n")


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
    rng = np.random.default_rng(seed)
    drawn = rng.zipf(1.1, events * 4)
    account_ids = drawn[drawn <= accounts][:events].tolist()
    report = DemoReport()
    observed = _Observed()
    stored: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="keyfailover-demo-") as data_dir:
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
            out.write(f"keyfailover demo: server at {url}, data in {data_dir}\n")
            out.write(f"{events} events over {accounts} Zipf(1.1) accounts\n")
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
    out.write(f"\n  {'consumer':<10}{'deliveries':>12}\n")
    for name, count in sorted(report.deliveries.items()):
        out.write(f"  {name:<10}{count:>12}\n")
    out.write(f"\nstored {report.published}, consumed {report.acked}, redelivered {report.redeliveries}\n")
    if report.problems:
        out.write("GUARANTEE VIOLATED:\n" + "".join(f"  {p}\n" for p in report.problems[:20]))
    else:
        out.write("every event consumed; each account's events first delivered in stored order\n")
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

        _print_ranges(out, "c1 and c2 share the hash space", workers)
        steps = {
            events // 4: "c3 joins: it splits the busier of c1 and c2",
            events // 2: "c4 joins, then stalls: its keys wait, nobody else's do",
            3 * events // 4: "c1 leaves: its range merges into its less busy neighbour",
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
                _print_ranges(out, steps[i], workers)
            key = f"account-{account}"
            producer.send_async(f"{key}:{i}:{(i * 37) % 1000 - 500}".encode(), key, remember(key))  # type: ignore[arg-type]
        producer.flush()
        start, end = workers["c4"].consumer.range

        def others_done() -> bool:  # every event outside the stalled consumer's range was consumed
            with lock, observed.lock:
                return all(
                    position in observed.first
                    for position, key in stored.items()
                    if start is None or end is None or not start <= key_hash(key) <= end
                )

        _wait_for(others_done, 60.0)
        out.write(f"\nwhile c4 stalled, every event outside its range was consumed: {others_done()}\n")
        workers.pop("c4").leave()
        _print_ranges(out, "stalled c4 is removed: its unacked events go to the new owners", workers)
        _wait_for(lambda: len(observed.first) >= len(stored), 60.0)
        for worker in workers.values():
            worker.leave()
