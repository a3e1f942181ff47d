"""Pulsar's own client against keyfailover's, on one server in the same run (issue 17's bar: within 2x).

Run: ``python benchmarks/bench_pulsar.py [--quick]``. One ``keyfailover serve --pulsar-port``
process (SQLite, ``--sync normal``) on loopback; for each client a fresh topic: produce N
keyed messages (1,000 keys, 100-byte payloads) as fast as the client pipelines them, then one
Key_Shared consumer receives and acks all N. Rates are printed, never asserted; each key's
order is checked. ``send_async calls/s`` is how fast the Python client took the messages into
its queue (10,000 pending at most): when it is close to the produce rate, the queue was full and
the broker's receipts set the pace. ``server CPU us/msg`` is the CPU time (user and system, all
its threads, from /proc) the server spent per message while they were produced: steadier than
the rates when other work shares the machine ("-" where /proc is not there). ``client CPU
us/msg`` is the same for this process (the client: the calling thread and the client's own I/O
threads): what a produced message costs on each side. The LZ4 rows compress on the producer
(``compression_type=LZ4``; the server decompresses each SEND, consumers get plain messages) and are
compared with the same batching uncompressed, measured in the same run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypeVar

import pulsar
from _common import format_count, parse_quick, print_goals, print_table, run_setting, timed

from keyfailover.client import Client

T = TypeVar("T")

KEYS = 1000
PAYLOAD = b"x" * 92


def start_server(data_dir: str) -> tuple[subprocess.Popen[str], str, str]:
    """``keyfailover serve`` with a Pulsar port; the process, its native URL and its Pulsar URL."""
    command = [sys.executable, "-P", "-m", "keyfailover", "serve", "--data-dir", data_dir, "--sync", "normal"]
    process = subprocess.Popen([*command, "--port", "0", "--pulsar-port", "0"], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    native = process.stdout.readline().rsplit(" ", 1)[1].strip()
    foreign = process.stdout.readline().rsplit(" ", 1)[1].strip()
    return process, f"kf://{native}", foreign


def cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds process ``pid`` used so far (all its threads); None without /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Run(NamedTuple):
    """One client's figures: produce and consume rates, the rate of ``send_async`` calls (None: not the
    Python client), and the CPU microseconds per produced message of the server and of this process."""

    produce: float
    consume: float
    queueing: float | None
    server_cpu: float | None
    client_cpu: float | None


def produced(server: int, count: int, produce: Callable[[], T]) -> tuple[float, T, float | None, float | None]:
    """Seconds ``produce()`` took, what it returned, and the CPU microseconds per message meanwhile of the
    server and of this process (the client)."""
    before, mine = cpu_seconds(server), cpu_seconds(os.getpid())
    seconds, result = timed(produce)
    after, mine_after = cpu_seconds(server), cpu_seconds(os.getpid())
    used = None if before is None or after is None else (after - before) / count * 1e6
    own = None if mine is None or mine_after is None else (mine_after - mine) / count * 1e6
    return seconds, result, used, own


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

        seconds, _, used, own = produced(server, count, produce)
        consumed, received = timed(consume)
    check_order(received, count)
    return Run(count / seconds, count / consumed, None, used, own)


def pulsar_run(url: str, server: int, count: int, topic: str, **producer_options: object) -> Run:
    """The figures of the Pulsar client with ``producer_options``, on a topic of its own."""
    client = pulsar.Client(url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    try:
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
            received = []
            for _ in range(count):
                message = consumer.receive(timeout_millis=30_000)
                received.append((message.partition_key(), int.from_bytes(message.data()[:8], "big")))
                consumer.acknowledge(message)
            return received

        seconds, queueing, used, own = produced(server, count, produce)
        consumed, received = timed(consume)
    finally:
        client.close()
    check_order(received, count)
    return Run(count / seconds, count / consumed, count / queueing, used, own)


LZ4 = {"compression_type": pulsar.CompressionType.LZ4}
SETTINGS: list[tuple[str, dict[str, object]]] = [
    ("batching off (the Python wrapper's default)", {}),
    ("default batching", {"batching_enabled": True}),
    ("key-based batching", {"batching_enabled": True, "batching_type": pulsar.BatchingType.KeyBased}),
    ("batching off, LZ4", LZ4),
    ("default batching, LZ4", {"batching_enabled": True, **LZ4}),
]
"""The Pulsar producer's settings measured: the Python wrapper's default (off), its batcher, key-based; the
first two again with LZ4 compression."""
COMPRESSED = [
    ("batching off, LZ4", "batching off (the Python wrapper's default)"),
    ("default batching, LZ4", "default batching"),
]
"""Each compressed setting and the uncompressed one it is compared with."""


def main() -> None:
    quick = parse_quick(__doc__ or "")
    print(f"keyfailover: {run_setting()}\n")
    count = 2000 if quick else 50_000
    with tempfile.TemporaryDirectory(prefix="bench-pulsar-") as data_dir:
        process, native_url, pulsar_url = start_server(data_dir)
        try:
            server = process.pid
            native = native_run(native_url, server, count)
            measured = [
                (f"pulsar-client, {setting}", pulsar_run(pulsar_url, server, count, f"bench-{index}", **options))
                for index, (setting, options) in enumerate(SETTINGS)
            ]
        finally:
            process.terminate()
            process.wait(timeout=30)

    def cpu(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    print_table(
        f"Produce then consume {count:,} keyed messages ({KEYS:,} keys) on one server, SQLite --sync normal",
        [
            "client",
            "messages",
            "produce msgs/s",
            "consume msgs/s",
            "produce vs native",
            "consume vs native",
            "send_async calls/s",
            "server CPU us/msg",
            "client CPU us/msg",
        ],
        [
            [
                name,
                format_count(count),
                format_count(run.produce),
                format_count(run.consume),
                f"{run.produce / native.produce:.2f}x",
                f"{run.consume / native.consume:.2f}x",
                "-" if run.queueing is None else format_count(run.queueing),
                cpu(run.server_cpu),
                cpu(run.client_cpu),
            ]
            for name, run in [("keyfailover client", native), *measured]
        ],
    )
    print("per-key order held in every run")
    by_setting = dict(zip([setting for setting, _ in SETTINGS], [run for _, run in measured], strict=True))
    for compressed, plain in COMPRESSED:
        run, base = by_setting[compressed], by_setting[plain]
        print(
            f"{compressed} against {plain}: produce {run.produce / base.produce:.2f}x, consume "
            f"{run.consume / base.consume:.2f}x"
        )
    print()
    print_goals(
        [
            (
                f"{name}: produce and consume within 2x of the native client (issue 17)",
                f"{run.produce / native.produce:.2f}x / {run.consume / native.consume:.2f}x",
                run.produce * 2 >= native.produce and run.consume * 2 >= native.consume,
            )
            for name, run in measured
        ]
    )


if __name__ == "__main__":
    main()
