"""Smoke-run every benchmark script with ``--quick``: it must finish and print its table.

Timing is never asserted; only that each script runs to the end (its own correctness
checks included) and prints the header of its table, and the lines ALSO_PRINTS names.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from keyfailover.core.dispatcher import COMPILED

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

HEADERS = {
    "bench_lookup.py": ("path", "consumers", "keys/s", "µs/key", "vs uhashring"),
    "bench_dispatch.py": ("dispatcher", "messages", "redelivered", "seconds", "messages/s", "µs/message"),
    "bench_rebalance.py": ("operation", "consumers", "median ms", "max ms", "median vs uhashring"),
    "bench_held.py": ("Dispatcher", "held", "keys", "keys moved", "join ms", "leave ms", "uhashring add ms", "vs ring"),
    "bench_log.py": ("writer", "synchronous", "batch", "messages", "messages/s", "vs peer"),
    "bench_spark.py": ("job", "rows", "partitions", "seconds", "median s", "rows/s", "vs native"),
    "bench_stuck.py": ("Dispatcher", "messages", "healthy got", "never read", "parked slots", "dispatcher MiB"),
    "bench_stuck_server.py": ("consumers", "healthy got / their keys'", "longest gap s", "server peak MiB half-way"),
    "bench_e2e.py": ("system", "mode", "messages", "msgs/s", "p50 ms", "p99 ms", "vs redis same durability"),
    "bench_cluster.py": ("setup", "durability", "msgs/s produce+consume", "vs single-node SQLite", "order violations"),
    "bench_pulsar.py": ("client", "messages", "produce msgs/s", "consume msgs/s", "server CPU us/msg", "client CPU"),
    "bench_console.py": (
        "console pages",
        "live at the end",
        "msgs/s",
        "server CPU s/s",
        "server CPU µs/msg",
        "vs pages on the decoy",
    ),
}
ALSO_PRINTS = {
    "bench_console.py": ("server CPU per message with 2 console pages open <= 1.05x with them on a decoy",),
    "bench_e2e.py": ("Publish → receive latency from the broker's publish time",),
    "bench_held.py": ("bytes/message", "dict + list (baseline)"),
    "bench_pulsar.py": ("per-key order held in every run", "within 2x of the native client"),
    "bench_spark.py": ("rows/s  vs Parquet  vs read_log", "rows/s  vs produce"),  # the source's and the sink's tables
    "bench_cluster.py": (
        "brokers  PostgreSQL  ZooKeeper",  # the CPU table
        "every partition served s",  # the failover table
        "first write acknowledged s",  # the store failover table
        "acknowledged but lost: 0",
        "per-key order held in every keyfailover run",
    ),
}


def test_every_benchmark_script_is_smoke_tested() -> None:
    assert sorted(path.name for path in BENCHMARKS.glob("bench_*.py")) == sorted(HEADERS)


def quick_run(script: str, *options: str) -> str:
    """Run ``script --quick [options]``; what it printed (its exit status checked)."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", *options],
        capture_output=True,
        cwd=BENCHMARKS.parent,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"{script} --quick exited {done.returncode}:\n{done.stderr.decode('utf-8')}"
    return done.stdout.decode("utf-8")


@pytest.mark.integration
@pytest.mark.parametrize("script", sorted(HEADERS))
def test_benchmark_quick_run_prints_its_table(script: str) -> None:
    stdout = quick_run(script)
    columns = HEADERS[script]
    assert any(all(column in line for column in columns) for line in stdout.splitlines()), (
        f"{script} printed no table header with columns {columns}:\n{stdout}"
    )
    for expected in ALSO_PRINTS.get(script, ()):
        assert expected in stdout, f"{script} did not print {expected!r}:\n{stdout}"


@pytest.mark.integration
def test_the_consume_path_run_of_bench_e2e_prints_its_table_with_a_row_per_event_loop() -> None:
    stdout = quick_run("bench_e2e.py", "--backlog", "--loops", "asyncio,uvloop")
    assert "Consume path: a stored backlog of 10,000 messages" in stdout, stdout
    assert f"best of 1; {'compiled' if COMPILED else 'plain'} build" in stdout, stdout
    columns = ("system", "mode", "msgs/s", "order violations", "server CPU µs/msg", "consumers CPU µs/msg")
    assert any(all(column in line for column in columns) for line in stdout.splitlines()), stdout
    for loop in ("asyncio", "uvloop"):
        assert f"synchronous=full (durable), {loop}" in stdout, stdout
        assert f"keyfailover ordered consume path ({loop}) >= 1.2x Redis without persistence" in stdout, stdout


@pytest.mark.integration
def test_bench_e2e_refuses_an_unknown_event_loop() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_e2e.py"), "--loops", "asyncio,libev"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "'asyncio,libev' is not a comma-separated list of asyncio and uvloop" in done.stderr
