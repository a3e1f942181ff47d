"""Spark: partitioning by keyfailover ranges against Spark's own hash repartition, the shared hash alone, and the
keyfailover source and sink against their peers.

Run: ``python benchmarks/bench_spark.py [--quick] [--only partitioning|read|write]`` (needs the ``[spark]`` and
``[cluster]`` extras and Java; the read part also ZooKeeper, PostgreSQL and its JDBC driver, from
``scripts/setup-system``). One local[2] session runs every part.

Partitioning. The input, cached before any timing, is 5,000,000 rows of ``(key, seq, value)`` over 100,000
keys, each key equally often (200,000 rows over 10,000 keys with ``--quick``).

The job: ``partition_by_ranges`` (the shared hash in Spark SQL, the range index, one
``repartitionById`` shuffle so partition i holds range i, a sort by key then seq) and a
per-partition count; its peer is Spark's native ``repartition(n, key)`` +
``sortWithinPartitions(key, seq)`` + the same count. The hash alone: ``with_key_hash``
against Spark's built-in ``hash()`` (a different hash, as a floor) and against a pandas UDF
calling mmh3 through ``keyfailover.key_hashes``, each summed over all rows. Every job runs
once to warm up, then the jobs take turns, best of 3 (1 with ``--quick``). The counts and
the sums of the shared hash are checked against each other.

Read. 1,000,000 messages (10,000 with ``--quick``) over 10,000 keys, each key equally often, each payload a
JSON line of 100 bytes, no properties, are produced once, before any timing, through one broker of a cluster
(ZooKeeper and PostgreSQL started on loopback in temporary folders, as ``bench_cluster`` starts them) to a
topic of 4 partitions: they are stored in the cluster's PostgreSQL log. Each job then reads every message
and, in one aggregation, counts them and XORs a hash of each one's partition, position, key, payload and
publish time; a stream does it in ``foreachBatch``, with trigger ``availableNow`` and a new checkpoint:

- ``spark.readStream.format("keyfailover")`` with ``store``, the PostgreSQL log read directly;
- the same with ``ranges`` 8: 8 Spark partitions of slot ranges cut by the traffic, each filtering the
  partitions its range touches after reading them;
- the same with ``url``, the broker, which reads the log for it over the wire;
- the peer, ``keyfailover.spark.read_log`` (Spark's JDBC source);
- the floor, the same rows from Parquet, written from ``read_log`` once before timing.

Every job runs once to warm up, then the jobs take turns, best of 2 (1 with ``--quick``). Each run's count must
be the number of messages, and every job's hash the same.

Write. The same messages, each a key and its JSON line, go to a ``keyfailover serve`` (SQLite) on loopback,
each writer into a topic of its own, once each, timed from start to end:

- ``df.write.format("keyfailover")`` of the rows in Parquet (2 files, each key's rows in one file, in order);
- ``df.writeStream.format("keyfailover")`` from those files as a file stream source, trigger ``availableNow``;
- the peer, ``keyfailover produce --json --key-field key --file F`` of the JSON lines, a process of its own.

Each topic's stored count, read back from the server's log, must be the number of messages.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd  # type: ignore[import-untyped]
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
from _common import SEED, consumer_ids, format_count, joined_range_map, print_goals, print_table, timed
from _e2e_traffic import keyfailover_server
from bench_cluster import Cluster, Services
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf
from pyspark.sql.pandas.functions import pandas_udf
from pyspark.sql.streaming.query import StreamingQuery

from keyfailover import key_hashes
from keyfailover.client import Client
from keyfailover.integrations.spark import local_session, partition_by_ranges, with_key_hash
from keyfailover.spark import read_log, register

CONSUMERS = 8
GOAL = 1.3
"""The shared-hash job may take at most this many times the native job's time (issue 16's bar)."""

TOPIC = "bench-spark"
TOPIC_PARTITIONS = 4
"""Partitions of the read part's topic: the source's Spark partitions without ``ranges``."""
RANGES = 8
"""The ``ranges`` option of the read part's cut stream."""
STREAM_KEYS = 10_000
PAYLOAD_BYTES = 100
WRITE_FILES = 2
"""Parquet files of the write part's rows: one Spark task each for the sink."""
WARM_UP = 1_000
"""Messages each Spark writer writes once, to a topic of its own, before it is timed."""
FLUSH_EVERY = 50_000
"""Messages the filling producer sends before it waits for their receipts, to bound its memory."""
CHECKED = ("partition", "position", "key", "payload", "publish_time")
"""The columns each read job hashes: those the source, read_log and the Parquet copy share."""
TIMEOUT = 900
"""Seconds any one step of the read and write parts may take before the benchmark gives up."""

Tally = tuple[int, int]
"""What a read job saw: how many rows, and the XOR of a hash of each row's CHECKED columns."""


def events(spark: SparkSession, rows: int, keys: int) -> DataFrame:
    """``rows`` rows ``(key, seq, value)``; row i has key ``key-<i * 7919 mod keys>``, so each key equally often."""
    df = spark.range(rows, numPartitions=4).select(
        sf.concat(sf.lit("key-"), ((sf.col("id") * 7919) % keys).cast("string")).alias("key"),
        sf.col("id").alias("seq"),
        (sf.rand(SEED) * 1000).cast("long").alias("value"),
    )
    df.cache()
    df.count()
    return df


def partition_counts(df: DataFrame, partitions: int) -> list[int]:
    """Rows in each of the ``partitions`` partitions of ``df`` (the sort within partitions runs: a count keeps it)."""
    found = df.groupBy(sf.spark_partition_id().alias("partition")).count().collect()
    counts = {row["partition"]: row["count"] for row in found}
    if not set(counts) <= set(range(partitions)):
        raise SystemExit(f"rows in partitions {sorted(counts)}; expected partitions 0 to {partitions - 1}")
    return [counts.get(partition, 0) for partition in range(partitions)]


def hash_sum(df: DataFrame, column: Any) -> int:
    """The sum of ``column`` over ``df`` (every row's hash is computed)."""
    found = df.select(column.alias("slot")).agg(sf.sum("slot")).first()
    assert found is not None
    return int(found[0])


def mmh3_slots(keys: pd.Series) -> pd.Series:
    """The peer of the shared hash: ``keyfailover.key_hashes`` (mmh3) over a batch of keys, in Python."""
    return pd.Series(key_hashes(keys.tolist()))


def measure(jobs: dict[str, Callable[[], Any]], repeats: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Warm every job up once, then run them in turns ``repeats`` times: seconds per run, and each one's result."""
    results = {name: job() for name, job in jobs.items()}
    seconds: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(repeats):
        for name, job in jobs.items():
            start = time.perf_counter()
            results[name] = job()
            seconds[name].append(time.perf_counter() - start)
    return seconds, results


def partitioning(spark: SparkSession, quick: bool) -> None:
    """The partitioning job against Spark's native one, and the shared hash alone against two peers."""
    rows, keys, repeats = (200_000, 10_000, 1) if quick else (5_000_000, 100_000, 3)
    df = events(spark, rows, keys)
    range_map = joined_range_map(consumer_ids(CONSUMERS))
    ranges = range_map.range_count()  # one partition per range (a consumer may own several)

    shared_job = "partition_by_ranges + count"
    native_job = "repartition(n, key) + sortWithinPartitions + count (peer)"
    job_seconds, counts = measure(
        {
            shared_job: lambda: partition_counts(partition_by_ranges(df, "key", range_map, "seq"), ranges + 1),
            native_job: lambda: partition_counts(
                df.repartition(ranges, "key").sortWithinPartitions("key", "seq"), ranges
            ),
        },
        repeats,
    )
    if sum(counts[shared_job]) != rows or sum(counts[native_job]) != rows or counts[shared_job][-1] != 0:
        raise SystemExit(f"partition counts do not add up to {rows} rows: {counts}")
    native = min(job_seconds[native_job])
    print_table(
        f"Partitioning: {rows:,} rows, {keys:,} keys, {CONSUMERS} consumers in {ranges} ranges, local[2], "
        f"best of {repeats} after a warm-up",
        ["job", "rows", "partitions", "seconds", "median s", "rows/s", "vs native"],
        [
            [
                name,
                format_count(rows),
                str(len(counts[name])),
                f"{min(runs):.2f}",
                f"{statistics.median(runs):.2f}",
                format_count(rows / min(runs)),
                f"{min(runs) / native:.2f}x",
            ]
            for name, runs in job_seconds.items()
        ],
    )
    job_ratio = min(job_seconds[shared_job]) / native

    python_slots = pandas_udf(mmh3_slots, "int")  # type: ignore[call-overload]  # pandas is untyped here
    shared_hash = "with_key_hash (Spark SQL, no UDF)"
    native_hash = "hash() built in (peer; not the shared hash)"
    pandas_hash = "pandas UDF: mmh3 via key_hashes (peer)"
    hash_seconds, sums = measure(
        {
            shared_hash: lambda: hash_sum(with_key_hash(df, "key"), sf.col("key_hash")),
            native_hash: lambda: hash_sum(df, sf.pmod(sf.hash("key"), sf.lit(65536))),
            pandas_hash: lambda: hash_sum(df, python_slots("key")),
        },
        repeats,
    )
    if sums[shared_hash] != sums[pandas_hash]:
        raise SystemExit(f"with_key_hash summed to {sums[shared_hash]}, the mmh3 UDF to {sums[pandas_hash]}")
    native = min(hash_seconds[native_hash])
    print_table(
        f"Hash alone: {rows:,} rows, the slot of every key summed, best of {repeats} after a warm-up",
        ["hash", "rows", "seconds", "median s", "rows/s", "vs native hash()"],
        [
            [
                name,
                format_count(rows),
                f"{min(runs):.2f}",
                f"{statistics.median(runs):.2f}",
                format_count(rows / min(runs)),
                f"{min(runs) / native:.2f}x",
            ]
            for name, runs in hash_seconds.items()
        ],
    )
    print_goals([(f"partition_by_ranges job within {GOAL}x of the native job", f"{job_ratio:.2f}x", job_ratio <= GOAL)])
    df.unpersist()


# -- the keyfailover source and sink -------------------------------------------------------------


def message(index: int) -> tuple[str, str]:
    """Message ``index``: its key, ``key-<index * 7919 mod STREAM_KEYS>``, and its payload, a JSON line of
    PAYLOAD_BYTES characters holding the key and the index."""
    key = f"key-{index * 7919 % STREAM_KEYS}"
    head = f'{{"key": "{key}", "seq": {index}, "pad": "'
    return key, head + "." * (PAYLOAD_BYTES - len(head) - 2) + '"}'


def produce(address: str, topic: str, count: int) -> None:
    """Store messages ``0 .. count - 1`` in ``topic`` through the server at ``address``, with one producer."""
    errors: list[BaseException] = []

    def done(_position: int | None, error: BaseException | None) -> None:
        if error is not None:
            errors.append(error)

    with Client(address) as client:
        producer = client.create_producer(topic)
        for index in range(count):
            key, payload = message(index)
            producer.send_async(payload.encode(), key, done)
            if (index + 1) % FLUSH_EVERY == 0:
                producer.flush(TIMEOUT)
        producer.flush(TIMEOUT)
    if errors:
        raise SystemExit(f"{len(errors):,} of {count:,} messages were not stored in {topic}; the first: {errors[0]}")


def tally(df: DataFrame) -> Tally:
    """The rows of ``df`` and the XOR of a hash of each one's CHECKED columns, in one aggregation."""
    found = df.agg(sf.count(sf.lit(1)), sf.bit_xor(sf.xxhash64(*CHECKED))).first()
    assert found is not None
    return int(found[0]), int(found[1] or 0)


def run_to_end(query: StreamingQuery, what: str) -> None:
    """Wait until ``query``, triggered availableNow, has read everything and stopped; SystemExit naming ``what``
    when it failed or took longer than TIMEOUT."""
    try:
        if not query.awaitTermination(TIMEOUT):
            query.stop()
            raise SystemExit(f"{what} did not end within {TIMEOUT} s")
    except StreamingQueryException as exc:
        raise SystemExit(f"{what} failed: {exc}") from None


def stream_tally(spark: SparkSession, options: Mapping[str, str], checkpoints: Path) -> Tally:
    """Read the keyfailover source with ``options`` as a stream, trigger availableNow, from a new checkpoint
    under ``checkpoints``: the tally of every micro-batch, taken in ``foreachBatch``."""
    seen: list[Tally] = []

    def batch(df: DataFrame, _batch_id: int) -> None:
        seen.append(tally(df))

    stream = spark.readStream.format("keyfailover").options(**options).load()
    checkpoint = tempfile.mkdtemp(prefix="checkpoint-", dir=checkpoints)
    query = (
        stream.writeStream.foreachBatch(batch)
        .trigger(availableNow=True)
        .option("checkpointLocation", checkpoint)
        .start()
    )
    run_to_end(query, f"the stream reading with {dict(options)}")
    return sum(rows for rows, _ in seen), functools.reduce(lambda a, b: a ^ b, (xor for _, xor in seen), 0)


def ratio(seconds: float, of: float) -> str:
    """``seconds`` as a multiple of ``of``."""
    return f"{seconds / of:.2f}x"


def read_jobs(spark: SparkSession, cluster: Cluster, folder: Path) -> dict[str, Callable[[], Tally]]:
    """The read part's jobs, by the name its table gives them; the Parquet copy is written now."""
    parquet = str(folder / "log.parquet")
    read_log(spark, cluster.store, TOPIC).write.parquet(parquet)
    store = {"store": cluster.store, "topic": TOPIC}
    return {
        "readStream keyfailover, store (PostgreSQL)": lambda: stream_tally(spark, store, folder),
        f"readStream keyfailover, store, ranges {RANGES}": lambda: stream_tally(
            spark, {**store, "ranges": str(RANGES)}, folder
        ),
        "readStream keyfailover, url (the broker)": lambda: stream_tally(
            spark, {"url": cluster.address, "topic": TOPIC}, folder
        ),
        "read_log, JDBC (peer)": lambda: tally(read_log(spark, cluster.store, TOPIC)),
        "Parquet copy (floor)": lambda: tally(spark.read.parquet(parquet)),
    }


def read_part(spark: SparkSession, folder: Path, count: int, repeats: int) -> None:
    """Store ``count`` messages in a cluster's PostgreSQL log, then time each job reading them all."""
    with Services() as services, Cluster(services, folder / "cluster", "bench_spark", 1) as cluster:
        cluster.create_topic(TOPIC, TOPIC_PARTITIONS)
        fill_seconds, _ = timed(lambda: produce(cluster.address, TOPIC, count))
        jobs = read_jobs(spark, cluster, folder)
        job_seconds, tallies = measure(jobs, repeats)
    first = next(iter(jobs))
    wrong = {name: found for name, found in tallies.items() if found != tallies[first] or found[0] != count}
    if wrong:
        raise SystemExit(f"read jobs saw other rows than the {count:,} stored: {tallies}")
    best = {name: min(runs) for name, runs in job_seconds.items()}
    parquet, jdbc = best["Parquet copy (floor)"], best["read_log, JDBC (peer)"]
    print_table(
        f"Reading a topic's log: {count:,} messages of {PAYLOAD_BYTES} bytes, {STREAM_KEYS:,} keys, "
        f"{TOPIC_PARTITIONS} partitions in PostgreSQL (produced through 1 broker in {fill_seconds:.1f} s), "
        f"local[2], each row counted and hashed, best of {repeats} after a warm-up",
        ["job", "rows", "seconds", "median s", "rows/s", "vs Parquet", "vs read_log"],
        [
            [
                name,
                format_count(count),
                f"{best[name]:.2f}",
                f"{statistics.median(runs):.2f}",
                format_count(count / best[name]),
                ratio(best[name], parquet),
                ratio(best[name], jdbc),
            ]
            for name, runs in job_seconds.items()
        ],
    )


def write_inputs(folder: Path, count: int) -> tuple[Path, Path]:
    """Messages ``0 .. count - 1`` in ``folder``: as JSON lines, the peer's file, and as ``(key, payload)`` rows in
    WRITE_FILES Parquet files, each key's rows in one file in order; the file and the Parquet folder."""
    lines, parquet = folder / "messages.jsonl", folder / "messages.parquet"
    parquet.mkdir(parents=True)
    rows = [message(index) for index in range(count)]
    lines.write_text("".join(f"{payload}\n" for _, payload in rows))
    for part in range(WRITE_FILES):
        mine = [row for row in rows if int(row[0].removeprefix("key-")) % WRITE_FILES == part]
        table = pa.table({"key": [key for key, _ in mine], "payload": [payload for _, payload in mine]})
        pq.write_table(table, parquet / f"part-{part}.parquet")
    return lines, parquet


def write_part(spark: SparkSession, folder: Path, count: int) -> None:
    """Time each writer storing ``count`` messages in a topic of its own on a ``keyfailover serve``, after each
    Spark writer wrote WARM_UP of them once."""
    lines, parquet = write_inputs(folder / "all", count)
    _, warm_parquet = write_inputs(folder / "warm", WARM_UP)
    (folder / "server").mkdir()
    with keyfailover_server(folder / "server", (), None) as server, Client(server.address) as client:

        def batch(topic: str, files: Path) -> None:
            rows = spark.read.parquet(str(files))
            rows.write.format("keyfailover").options(url=server.address, topic=topic).mode("append").save()

        def stream(topic: str, files: Path) -> None:
            source = spark.readStream.schema("key string, payload string").parquet(str(files))
            query = (
                source.writeStream.format("keyfailover")
                .options(url=server.address, topic=topic)
                .option("checkpointLocation", tempfile.mkdtemp(prefix="checkpoint-", dir=folder))
                .trigger(availableNow=True)
                .start()
            )
            run_to_end(query, f"the stream writing {topic}")

        def cli(topic: str, _files: Path) -> None:
            command = ["produce", "--url", server.address, "--topic", topic, "--json", "--key-field", "key"]
            done = subprocess.run(
                [sys.executable, "-m", "keyfailover", *command, "--file", str(lines)],
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
                check=False,
            )
            if done.returncode:
                raise SystemExit(f"keyfailover {' '.join(command)} exited {done.returncode}: {done.stderr.strip()}")

        peer = "keyfailover produce --json --key-field key (peer)"
        writers = {
            'df.write.format("keyfailover"), batch': batch,
            'df.writeStream.format("keyfailover"), availableNow': stream,
            peer: cli,
        }
        seconds: dict[str, float] = {}
        for number, (name, writer) in enumerate(writers.items()):
            if name != peer:
                writer(f"{TOPIC}-warm-up-{number}", warm_parquet)
            topic = f"{TOPIC}-write-{number}"
            seconds[name], _ = timed(functools.partial(writer, topic, parquet))
            stored = sum(client.log_ends(topic, TIMEOUT))
            if stored != count:
                raise SystemExit(f"{name} stored {stored:,} messages in {topic}; expected {count:,}")
    print_table(
        f"Writing to a topic: {count:,} messages of {PAYLOAD_BYTES} bytes, {STREAM_KEYS:,} keys, to keyfailover "
        f"serve (SQLite) on loopback, a new topic each, local[2], one run each after a warm-up, stored counts checked",
        ["writer", "rows", "seconds", "rows/s", "vs produce"],
        [
            [name, format_count(count), f"{took:.2f}", format_count(count / took), ratio(took, seconds[peer])]
            for name, took in seconds.items()
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small run that finishes in a couple of minutes")
    parser.add_argument("--only", choices=("partitioning", "read", "write"), default=None, help="run only this part")
    options = parser.parse_args()
    count, repeats = (10_000, 1) if options.quick else (1_000_000, 2)
    spark = local_session(
        "keyfailover-bench-spark",
        config={"spark.driver.memory": "3g", "spark.sql.shuffle.partitions": str(CONSUMERS)},
    )
    register(spark)
    folder = Path(tempfile.mkdtemp(prefix="bench_spark-"))
    try:
        if options.only in (None, "partitioning"):
            partitioning(spark, options.quick)
        if options.only in (None, "read"):
            (folder / "read").mkdir()
            read_part(spark, folder / "read", count, repeats)
        if options.only in (None, "write"):
            (folder / "write").mkdir()
            write_part(spark, folder / "write", count)
    finally:
        spark.stop()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
