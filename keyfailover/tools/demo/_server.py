"""``keyfailover demo``: a real server, with consumers that join, leave and stall."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from keyfailover.client import Client
from keyfailover.core.errors import KeyFailoverError
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hash
from keyfailover.tools.demo._report import (
    RANGES_HEADER,
    TAIL_HEADER,
    DemoReport,
    describe_ranges,
    in_hash_order,
    zipf_ids,
)
from keyfailover.tools.demo._traffic import SUBSCRIPTION, TOPIC, Observed, Produced, Worker, conclude, wait_for

__all__ = ["console_url", "run_server_demo", "started"]


def started(server: subprocess.Popen[str]) -> tuple[str, str]:
    """The client URL ``kf://HOST:PORT`` and the admin URL that a ``keyfailover serve --metrics-port`` process
    prints once it serves; :class:`KeyFailoverError` with what it printed instead when it did not start."""
    assert server.stdout is not None
    line, admin = server.stdout.readline(), server.stdout.readline()
    if not line.startswith("listening on ") or not admin.startswith("metrics on "):
        raise KeyFailoverError(f"keyfailover serve did not start: it printed {line!r} and {admin!r}")
    return "kf://" + line.split("listening on ", 1)[1].strip(), admin.split("metrics on ", 1)[1].strip()


def console_url(admin: str, topic: str = TOPIC, subscription: str = SUBSCRIPTION) -> str:
    """The console's page of ``subscription`` of ``topic`` on the admin endpoint ``admin`` (``http://HOST:PORT``)."""
    quoted = "/".join(urllib.parse.quote(name, safe="") for name in (topic, subscription))
    return f"{admin.rstrip('/')}/ui#/subscription/{quoted}"


def _print_server_ranges(
    out: TextIO, title: str, workers: dict[str, Worker], observed: Observed, report: DemoReport
) -> None:
    owned = {name: worker.consumer.ranges for name, worker in workers.items()}

    def tiled() -> bool:  # the consumers heard of their new ranges (ranges_changed frames)
        owned.update((name, worker.consumer.ranges) for name, worker in workers.items())
        return sum(end - start + 1 for ranges in owned.values() for start, end in ranges) == HASH_RANGE_SIZE

    wait_for(tiled, 10.0)
    report.steps.append((title, {name: list(ranges) for name, ranges in owned.items()}))
    out.write(f"\n{title}\n")
    out.write(f"  {'consumer':<10}{RANGES_HEADER}{'received':>10}{TAIL_HEADER}\n")
    with observed.lock:
        received = dict(observed.deliveries)
    for name, ranges in in_hash_order(owned):
        status = "stalled" if workers[name].stalled.is_set() else "active"
        summary, listed = describe_ranges(ranges)
        out.write(f"  {name:<10}{summary:<28}{received.get(name, 0):>10}  {status:<9}{listed}\n")


def run_server_demo(
    events: int = 30_000,
    accounts: int = 2_000,
    seed: int = 7,
    out: TextIO = sys.stdout,
    *,
    linger: float = 0.0,
    stop: threading.Event | None = None,
) -> DemoReport:
    """Run the scripted scenario against a real server process; returns what was observed.

    The console's URL is printed once the server is up. After the run the server and the consumers still
    there stay up ``linger`` seconds, or until ``stop`` is set, so that the console can be watched.
    """
    if events < 1000 or accounts < 1:
        raise KeyFailoverError(f"demo needs events >= 1000 and accounts >= 1, got {events} and {accounts}")
    if linger < 0:
        raise KeyFailoverError(f"demo needs linger >= 0 seconds, got {linger}")
    account_ids = zipf_ids(events, accounts, seed)
    report = DemoReport()
    observed = Observed()
    produced = Produced(partitions=1)
    with tempfile.TemporaryDirectory(prefix="keyfailover-demo-") as data_dir:
        out.write(f"keyfailover demo: starting keyfailover serve with data in {data_dir} ...\n")
        out.flush()
        server = subprocess.Popen(
            [
                *(sys.executable, "-m", "keyfailover", "serve", "--data-dir", str(Path(data_dir))),
                *("--port", "0", "--metrics-port", "0"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            url, admin_url = started(server)
            out.write(f"server listening at {url}; producing {events} events over {accounts} Zipf(1.1) accounts\n")
            out.write(f"console: {console_url(admin_url)}\n")
            out.flush()

            def linger_after_the_run() -> None:
                if linger > 0:
                    out.write(
                        f"\nkeeping the server up for {linger:g} s (Ctrl-C to stop) so that you can watch the "
                        f"console: {console_url(admin_url)}\n"
                    )
                    out.flush()
                    (stop or threading.Event()).wait(linger)

            stats = _ConsumerStats(admin_url)
            _scenario(
                url,
                account_ids,
                stats,
                observed=observed,
                produced=produced,
                report=report,
                out=out,
                linger=linger_after_the_run,
            )
        finally:
            server.terminate()
            _, errors = server.communicate(timeout=30)
            if server.returncode != 0:
                report.problems.append(f"the server exited with {server.returncode}: {errors.strip()[-2000:]}")
    conclude(out, report, produced, observed)
    return report


class _ConsumerStats:
    """The server's per-consumer stats of the demo's subscription, read from its admin endpoint's ``/stats``."""

    def __init__(self, admin: str) -> None:
        self._url = f"{admin}/stats"

    def __call__(self) -> dict[str, dict[str, Any]]:
        with urllib.request.urlopen(self._url, timeout=10) as response:
            found = json.load(response)
        consumers: dict[str, dict[str, Any]] = {}
        for subscription in found["subscriptions"]:
            consumers.update(subscription["dispatcher"]["consumers"])
        return consumers


def _scenario(
    url: str,
    account_ids: list[int],
    stats: _ConsumerStats,
    *,
    observed: Observed,
    produced: Produced,
    report: DemoReport,
    out: TextIO,
    linger: Callable[[], None],
) -> None:
    """The story of the module's docstring; ``linger`` is called at the end, before the last consumers leave."""
    events = len(account_ids)
    with Client(url) as client:
        workers = {name: Worker(client, name, observed, 200) for name in ("c1", "c2")}
        producer = client.create_producer(TOPIC, "demo-producer")

        _print_server_ranges(out, "c1 and c2 share the hash space", workers, observed, report)
        steps = {
            events // 4: "c3 joins: it takes a third of the traffic, from the busiest first",
            events // 2: "c4 joins with 100 permits, then stalls: it holds what it takes and acks none; "
            "its keys wait, nobody else's do",
            3 * events // 4: "c1 leaves: its ranges go to the consumers making progress; the stalled c4 gets none",
        }
        for i, account in enumerate(account_ids):
            if i in steps:
                producer.flush()
                if i == events // 4:
                    workers["c3"] = Worker(client, "c3", observed, 200)
                elif i == events // 2:
                    workers["c4"] = Worker(client, "c4", observed, 100, stalled=True)
                else:
                    _wait_until_stalled(out, stats, "c4")
                    workers.pop("c1").leave()
                    report.status["c1"] = "left"
                _print_server_ranges(out, steps[i], workers, observed, report)
            produced.send(producer, f"account-{account}", i)
        producer.flush()
        stalled = workers["c4"].consumer.ranges

        def others_done() -> bool:  # every event outside the stalled consumer's ranges was consumed
            with produced.lock, observed.lock:
                return all(
                    event in observed.first
                    for event, (key, _) in produced.stored.items()
                    if not any(start <= key_hash(key) <= end for start, end in stalled)
                )

        wait_for(others_done, 60.0)
        out.write(f"\nwhile c4 stalled, every event outside its ranges was consumed: {others_done()}\n")
        workers.pop("c4").leave()
        report.status["c4"] = "stalled, then removed"
        title = "stalled c4 is removed: its unacked events go to the new owners"
        _print_server_ranges(out, title, workers, observed, report)
        wait_for(lambda: len(observed.first) >= len(produced.stored), 60.0)
        linger()
        for worker in workers.values():
            worker.leave()


def _wait_until_stalled(out: TextIO, stats: _ConsumerStats, name: str) -> None:
    """Wait (up to a minute) until the server counts ``name`` stalled, and say what it sees."""
    seen: dict[str, Any] = {}

    def stalled() -> bool:
        seen.update(stats()[name])
        return bool(seen["stalled"])

    out.write(f"\nwaiting for the server to count {name} stalled (no ack for its rate half-life, 10 s) ...\n")
    out.flush()
    began = time.monotonic()
    if wait_for(stalled, 60.0):
        out.write(
            f"the server counts {name} stalled after {time.monotonic() - began:.1f} s ({seen['unacked']} unacked, "
            f"{seen['permits']} permits left, no ack): a join or a leave gives it no slots\n"
        )
    else:
        out.write(f"\nthe server does not count {name} stalled ({seen}): a change may give it slots\n")
