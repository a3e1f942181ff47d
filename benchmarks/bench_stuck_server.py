"""A consumer that receives every message and never acks, beside three healthy ones, through a real server.

Run: ``python benchmarks/bench_stuck_server.py [--quick] [--profile-server FILE]``. Each row is a fresh ``keyfailover
serve`` with its default bounds (``--max-replay`` 100,000, ``--max-unacked-per-consumer``
50,000; ``--quick``: a tenth of each) and an ack timeout of an hour, so that no lease
expires during the run: what keeps the healthy consumers going here is the unacked limit
and the log spill, not the deadline. One producer process sends 1,000,000 100-byte messages
over 10,000 keys (uniform, seeded; ``--quick``: 100,000) in confirmed batches of 1000, and
four consumer processes with receiver queues of 1000 take them. In the first row one
consumer's application takes every message and never acks; the other three take and ack
each one. The peer row, in the same run, has four healthy consumers.

A row ends once the producer is done and the healthy consumers received nothing new for
``QUIET`` seconds. It reports what the healthy consumers received (first deliveries), the
longest time they received nothing while the producer was still sending, what the
never-acking consumer holds and what is left in the log (unacked, its keys), the server's
peak resident memory (``VmHWM``), and checks that nothing was lost: every message was acked
or is still in the subscription's backlog, and the healthy consumers got every message
of every key the never-acking consumer neither owns at the end nor ever received a message of
(a key it holds a message of waits for its ack, as per-key order demands).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import tempfile
import time
import traceback
from array import array
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import numpy as np
from _common import format_count, print_goals, print_table, run_setting
from _e2e_traffic import (
    BATCH,
    HEADER,
    KEYS,
    POLL_SECONDS,
    RECEIVER_QUEUE,
    TOPIC,
    end_processes,
    key_names,
    keyfailover_server,
    produce_keyfailover,
)

from keyfailover import key_hash

SUBSCRIPTION = "bench"
QUIET = 3.0
START_TIMEOUT = 60.0


def peak_rss_mib(pid: int) -> float:
    """The peak resident memory of process ``pid`` so far (Linux ``VmHWM``), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no VmHWM in /proc/{pid}/status")


def stats(admin: str) -> dict[str, Any]:
    """The one subscription's entry of the admin endpoint's ``/stats``."""
    with urlopen(f"{admin}/stats", timeout=10) as response:
        found = json.load(response)
    subscription: dict[str, Any] = found["subscriptions"][0]
    return subscription


def consumer_main(
    address: str, name: str, *, acks: bool, stop: Event, progress: Any, slot: int, results: Queue[Any]
) -> None:
    """Receive until ``stop`` and idle; ack each message when ``acks``. Reports first-delivery indices and times."""
    try:
        from keyfailover.client import Client, Timeout

        indices, times = array("q"), array("q")
        seen: set[int] = set()
        now = time.monotonic_ns
        with Client(address) as client:
            consumer = client.subscribe(TOPIC, SUBSCRIPTION, consumer_name=name, receiver_queue_size=RECEIVER_QUEUE)
            results.put(("ready", name))
            while True:
                try:
                    message = consumer.receive(POLL_SECONDS)
                except Timeout:
                    progress[slot] = len(indices)
                    if stop.is_set():
                        break
                    continue
                index = HEADER.unpack_from(message.payload)[0]
                if index not in seen:
                    seen.add(index)
                    indices.append(index)
                    times.append(now())
                    if not len(indices) & 255:
                        progress[slot] = len(indices)
                if acks:
                    consumer.acknowledge(message)
        results.put(("consumer", name, indices.tobytes(), times.tobytes()))
    except BaseException:
        results.put(("error", name, traceback.format_exc()))
        raise


def producer_main(address: str, count: int, results: Queue[Any]) -> None:
    try:
        first, last = produce_keyfailover(address, count, 1)
        results.put(("producer", first, last))
    except BaseException:
        results.put(("error", "producer", traceback.format_exc()))
        raise


@dataclass(frozen=True)
class Row:
    label: str
    healthy_received: int
    healthy_expected: int
    longest_gap: float
    stuck_holds: int
    backlog: int
    acked_or_backlog: int
    peak_half_mib: float
    held: int
    parked_slots: int
    parked_messages: int
    changes: str
    seconds: float
    peak_mib: float


def run_row(label: str, stuck: bool, count: int, profile: Path | None = None) -> Row:
    names = ["stuck" if stuck else "h0", "h1", "h2", "h3"]
    context = multiprocessing.get_context("spawn")
    results: Queue[Any] = context.Queue()
    stop = context.Event()
    progress = context.Array("q", len(names), lock=False)
    bounds = ["--max-replay", str(count // 10), "--max-unacked-per-consumer", str(count // 20)]
    args = ["--ack-timeout", "3600", "--metrics-port", "0", *bounds]
    with (
        tempfile.TemporaryDirectory(prefix="bench-stuck-") as folder,
        keyfailover_server(Path(folder), args, profile) as srv,
    ):
        assert srv.admin is not None
        consumers = [
            context.Process(
                target=consumer_main,
                args=(srv.address, name),
                kwargs={"acks": name != "stuck", "stop": stop, "progress": progress, "slot": slot, "results": results},
                daemon=True,
            )
            for slot, name in enumerate(names)
        ]
        producer = context.Process(target=producer_main, args=(srv.address, count, results), daemon=True)
        processes = [*consumers, producer]
        reports: dict[str, tuple[Any, ...]] = {}
        produced: tuple[int, int] | None = None
        final: dict[str, Any] | None = None
        peak = 0.0
        peaks: list[tuple[int, float]] = []  # (monotonic ns, the server's peak memory so far)
        try:
            for process in consumers:
                process.start()
            ready = 0
            deadline = time.monotonic() + START_TIMEOUT
            healthy_seen, quiet_since = -1, time.monotonic()
            while len(reports) < len(names):
                try:
                    kind, *message = results.get(timeout=0.2)
                except queue.Empty:
                    peaks.append((time.monotonic_ns(), peak_rss_mib(srv.pid)))
                    if ready < len(names) and time.monotonic() > deadline:
                        raise SystemExit(f"{label}: only {ready} consumers subscribed") from None
                    for process in processes:
                        if process.exitcode not in (None, 0):
                            raise SystemExit(f"{label}: a benchmark process exited with {process.exitcode}") from None
                    if produced is not None and not stop.is_set():
                        healthy = sum(progress[slot] for slot, name in enumerate(names) if name != "stuck")
                        if healthy != healthy_seen:
                            healthy_seen, quiet_since = healthy, time.monotonic()
                        elif time.monotonic() - quiet_since > QUIET:
                            final = stats(srv.admin)
                            peak = peak_rss_mib(srv.pid)
                            stop.set()
                    continue
                if kind == "error":
                    raise SystemExit(f"{label}: {message[0]} failed:\n{message[1]}")
                if kind == "ready":
                    ready += 1
                    if ready == len(names):
                        producer.start()
                elif kind == "producer":
                    produced = (message[0], message[1])
                else:
                    reports[message[0]] = tuple(message[1:])
            for process in processes:
                process.join(timeout=30)
        finally:
            stop.set()
            end_processes(processes)
    assert produced is not None and final is not None
    first_send, last_send = produced
    half_way = first_send + (last_send - first_send) // 2
    peak_half = max((mib for at, mib in peaks if at <= half_way), default=0.0)
    healthy_indices = np.concatenate(
        [np.frombuffer(reports[n][0], np.int64) for n in names if n != "stuck"] or [np.zeros(0, np.int64)]
    )
    healthy_times = np.sort(np.concatenate([np.frombuffer(reports[n][1], np.int64) for n in names if n != "stuck"]))
    during = healthy_times[(healthy_times >= first_send) & (healthy_times <= last_send)]
    edges = np.concatenate([[first_send], during, [last_send]])
    longest_gap = float(np.diff(edges).max()) / 1e9
    keys = key_names(count)
    slots = np.fromiter((key_hash(k) for k in keys), np.int64, count)
    of_stuck = np.zeros(count, bool)
    if stuck:
        for start, end in final["dispatcher"]["consumers"]["stuck"]["ranges"]:  # before anyone left
            of_stuck |= (slots >= start) & (slots <= end)
        touched = {keys[i] for i in np.frombuffer(reports["stuck"][0], np.int64).tolist()}
        of_stuck |= np.fromiter((k in touched for k in keys), bool, count)
    expected = set(np.flatnonzero(~of_stuck).tolist())
    got = set(healthy_indices.tolist())
    consumers = final["dispatcher"]["consumers"]
    stuck_holds = consumers["stuck"]["unacked"] if stuck else 0
    acked = sum(c["acked"] for c in consumers.values())
    return Row(
        label,
        len(got & expected) if stuck else len(got),
        len(expected),
        longest_gap,
        stuck_holds,
        final["backlog"],
        acked + final["backlog"],
        peak_half,
        final["dispatcher"]["held"],
        final["dispatcher"]["parked_slots"],
        final["dispatcher"]["parked_messages"],
        " ".join(f"{reason} {n}" for reason, n in sorted(final["dispatcher"]["rebalances"].items())),
        (int(healthy_times[-1]) - first_send) / 1e9 if len(healthy_times) else 0.0,
        peak,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a small run that finishes in a few seconds")
    parser.add_argument(
        "--profile-server", type=Path, default=None, help="run the stuck row only, its server under cProfile, to FILE"
    )
    options = parser.parse_args()
    count = 100_000 if options.quick else 1_000_000
    print(f"keyfailover: {run_setting()}\n")
    rows = [run_row("1 never acks, 3 healthy", True, count, options.profile_server)]
    if options.profile_server is not None:
        print(f"server profile written to {options.profile_server}")
        return
    rows.append(run_row("peer: 4 healthy", False, count))
    print_table(
        f"keyfailover serve, {format_count(count)} messages over {KEYS:,} keys in batches of {BATCH}: "
        "a consumer that receives and never acks",
        [
            "consumers",
            "healthy got / their keys'",
            "longest gap s",
            "healthy msg/s",
            "stuck holds",
            "left in log",
            "held / parked slots",
            "parked msgs",
            "range changes",
            "server peak MiB half-way / end",
        ],
        [
            [
                row.label,
                f"{format_count(row.healthy_received)} / {format_count(row.healthy_expected)}",
                f"{row.longest_gap:.2f}",
                format_count(row.healthy_received / row.seconds) if row.seconds else "-",
                format_count(row.stuck_holds),
                format_count(row.backlog - row.stuck_holds),
                f"{format_count(row.held)} / {row.parked_slots:,}",
                format_count(row.parked_messages),
                row.changes,
                f"{row.peak_half_mib:.0f} / {row.peak_mib:.0f}",
            ]
            for row in rows
        ],
    )
    stuck = rows[0]
    print_goals(
        [
            (
                "healthy consumers keep receiving while messages are sent (longest gap under 1 s)",
                f"{stuck.longest_gap:.2f} s",
                stuck.longest_gap < 1.0,
            ),
            (
                "healthy consumers receive every message of their keys",
                f"{stuck.healthy_received:,} of {stuck.healthy_expected:,}",
                stuck.healthy_received == stuck.healthy_expected,
            ),
            (
                "nothing lost: acked + backlog = sent",
                f"{stuck.acked_or_backlog:,} of {count:,}",
                stuck.acked_or_backlog == count,
            ),
            (
                "server peak memory flat in the second half of sending (within 10%)",
                f"{stuck.peak_half_mib:.0f} MiB half-way through sending, {stuck.peak_mib:.0f} MiB at the end",
                stuck.peak_mib <= 1.1 * stuck.peak_half_mib,
            ),
        ]
    )


if __name__ == "__main__":
    main()
