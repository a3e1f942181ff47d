"""Pulsar's own client against keyfailover's, on one server in the same run (issue 17's bar: within 2x).

Run: ``python benchmarks/bench_pulsar.py [--quick]``. One ``keyfailover serve --pulsar-port``
process (SQLite, ``--sync normal``) on loopback; for each client a fresh topic: produce N
keyed messages (1,000 keys, 100-byte payloads) as fast as the client pipelines them, then one
Key_Shared consumer receives and acks all N. Rates are printed, never asserted; each key's
order is checked. ``send_async calls/s`` is how fast the Python client took the messages into
its queue (10,000 pending at most): when it is close to the produce rate, the queue was full and
the broker's receipts set the pace. ``server CPU us/msg`` is the CPU time (user and system, all
its threads, from /proc) the server spent per message while they were produced: steadier than
the rates when other work shares the machine ("-" where /proc is not there).

The rows "against an endpoint that stores nothing" produce with the same client settings to
``_null_pulsar.py`` (another process answering each SEND at once, storing nothing): the most
that client can produce on this machine whatever the broker does, its ceiling. "vs ceiling" is
the rate through keyfailover over that ceiling.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pulsar
from _common import format_count, parse_quick, print_goals, print_table, timed

from keyfailover.client import Client

T = TypeVar("T")

KEYS = 1000
PAYLOAD = b"x" * 92


HERE = Path(__file__).resolve().parent


def start_server(data_dir: str) -> tuple[subprocess.Popen[str], str, str]:
    """``keyfailover serve`` with a Pulsar port; the process, its native URL and its Pulsar URL."""
    command = [sys.executable, "-m", "keyfailover", "serve", "--data-dir", data_dir, "--sync", "normal"]
    process = subprocess.Popen([*command, "--port", "0", "--pulsar-port", "0"], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    native = process.stdout.readline().rsplit(" ", 1)[1].strip()
    foreign = process.stdout.readline().rsplit(" ", 1)[1].strip()
    return process, f"kf://{native}", foreign


def start_null_endpoint() -> tuple[subprocess.Popen[str], str]:
    """``_null_pulsar.py`` in its own process; the process and its Pulsar URL."""
    process = subprocess.Popen([sys.executable, str(HERE / "_null_pulsar.py")], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, process.stdout.readline().rsplit(" ", 1)[1].strip()


def cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds process ``pid`` used so far (all its threads); None without /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Run = tuple[float, float | None, float | None, float | None]
"""Produce and consume rates (None: nothing consumed), the rate of ``send_async`` calls (None: not the
Python client), and the server's CPU microseconds per produced message (None: not measured)."""


def produced(server: int, count: int, produce: Callable[[], T]) -> tuple[float, T, float | None]:
    """Seconds ``produce()`` took, what it returned, and the server's CPU microseconds per message meanwhile."""
    before = cpu_seconds(server)
    seconds, result = timed(produce)
    after = cpu_seconds(server)
    used = None if before is None or after is None else (after - before) / count * 1e6
    return seconds, result, used


def payload(index: int) -> bytes:
    return index.to_bytes(8, "big") + PAYLOAD


def check_order(received: list[tuple[str, int]], count: int) -> None:
    last: dict[str, int] = {}
    for key, index in received:
        assert index > last.get(key, -1), f"{key}: {index} after {last[key]}"
        last[key] = index
    assert len(received) == count, f"received {len(received)} of {count}"


def native_run(url: str, server: int, count: int) -> Run:
    with Client(url) as client:
        consumer = client.subscribe("bench-native", "bench", "c")
        producer = client.create_producer("bench-native", "p")

        def produce() -> None:
            for index in range(count):
                producer.send_async(payload(index), f"k{index % KEYS}")
            producer.flush()

        def consume() -> list[tuple[str, int]]:
            received = []
            for _ in range(count):
                message = consumer.receive(timeout=30)
                received.append((str(message.key), int.from_bytes(message.payload[:8], "big")))
                consumer.acknowledge(message)
            return received

        seconds, _, used = produced(server, count, produce)
        consumed, received = timed(consume)
    check_order(received, count)
    return count / seconds, count / consumed, None, used


def pulsar_run(url: str, server: int | None, count: int, topic: str, **producer_options: object) -> Run:
    """Produce and consume rates, and the rate of the client's ``send_async`` calls alone (its own bound).

    ``server`` None: the null endpoint, which is only produced to (nothing comes back to consume).
    """
    client = pulsar.Client(url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    try:
        consumer = None
        if server is not None:
            consumer = client.subscribe(topic, "bench", consumer_type=pulsar.ConsumerType.KeyShared)
        producer = client.create_producer(
            topic,
            producer_name="p",
            block_if_queue_full=True,
            send_timeout_millis=0,
            max_pending_messages=10_000,
            **producer_options,
        )

        def produce() -> float:
            queued = timed(
                lambda: [producer.send_async(payload(i), None, partition_key=f"k{i % KEYS}") for i in range(count)]
            )
            producer.flush()
            return queued[0]

        def consume() -> list[tuple[str, int]]:
            assert consumer is not None
            received = []
            for _ in range(count):
                message = consumer.receive(timeout_millis=30_000)
                received.append((message.partition_key(), int.from_bytes(message.data()[:8], "big")))
                consumer.acknowledge(message)
            return received

        if server is None:
            seconds, queueing = timed(produce)
            return count / seconds, None, count / queueing, None
        seconds, queueing, used = produced(server, count, produce)
        consumed, received = timed(consume)
    finally:
        client.close()
    check_order(received, count)
    return count / seconds, count / consumed, count / queueing, used


SETTINGS: list[tuple[str, dict[str, object]]] = [
    ("batching off", {}),
    ("default batching", {"batching_enabled": True}),
    ("key-based batching", {"batching_enabled": True, "batching_type": pulsar.BatchingType.KeyBased}),
]
"""The Pulsar producer's settings measured: the Python wrapper's default (off), its batcher, key-based."""


def main() -> None:
    quick = parse_quick(__doc__ or "")
    count = 2000 if quick else 50_000
    with tempfile.TemporaryDirectory(prefix="bench-pulsar-") as data_dir:
        process, native_url, pulsar_url = start_server(data_dir)
        null, null_url = start_null_endpoint()
        try:
            server = process.pid
            native = native_run(native_url, server, count)
            measured = [
                (
                    setting,
                    pulsar_run(pulsar_url, server, count, f"bench-{index}", **options),
                    pulsar_run(null_url, None, count, f"bench-{index}", **options),
                )
                for index, (setting, options) in enumerate(SETTINGS)
            ]
        finally:
            for started in (process, null):
                started.terminate()
                started.wait(timeout=30)
    base_produce, base_consume, _, _ = native
    base_consume = base_consume or 1.0

    def row(name: str, run: Run, ceiling: float | None) -> list[str]:
        produce, consume, queueing, used = run
        return [
            name,
            format_count(produce),
            "-" if consume is None else format_count(consume),
            f"{produce / base_produce:.2f}x",
            "-" if consume is None else f"{consume / base_consume:.2f}x",
            "-" if ceiling is None else f"{produce / ceiling:.2f}x",
            "-" if queueing is None else format_count(queueing),
            "-" if used is None else f"{used:.1f}",
        ]

    rows = [row("keyfailover client", native, None)]
    for setting, through, ceiling in measured:
        rows.append(row(f"pulsar-client, {setting}", through, ceiling[0]))
        rows.append(row(f"pulsar-client, {setting}, against an endpoint that stores nothing", ceiling, None))
    print_table(
        f"Produce then consume {count:,} keyed messages ({KEYS:,} keys) on one server, SQLite --sync normal",
        [
            "client",
            "produce msgs/s",
            "consume msgs/s",
            "produce vs native",
            "consume vs native",
            "vs ceiling",
            "send_async calls/s",
            "server CPU us/msg",
        ],
        rows,
    )
    print("per-key order held in every run")
    print()
    goals = []
    for setting, (produce, consume, _, _), _ in measured:
        assert consume is not None
        goals.append(
            (
                f"pulsar-client, {setting}: produce and consume within 2x of the native client (issue 17)",
                f"{produce / base_produce:.2f}x / {consume / base_consume:.2f}x",
                produce * 2 >= base_produce and consume * 2 >= base_consume,
            )
        )
    print_goals(goals)


if __name__ == "__main__":
    main()
