"""Spark: partitioning by keyfailover ranges against Spark's own hash repartition, and the shared hash alone.

Run: ``python benchmarks/bench_spark.py [--quick]`` (needs the ``[spark]`` extra and Java).
One local[2] session; the input, cached before any timing, is 5,000,000 rows of
``(key, seq, value)`` over 100,000 keys, each key equally often (200,000 rows over 10,000
keys with ``--quick``).

The job: ``partition_by_ranges`` (the shared hash in Spark SQL, the range index, one
``repartitionById`` shuffle so partition i holds range i, a sort by key then seq) and a
per-partition count; its peer is Spark's native ``repartition(n, key)`` +
``sortWithinPartitions(key, seq)`` + the same count. The hash alone: ``with_key_hash``
against Spark's built-in ``hash()`` (a different hash, as a floor) and against a pandas UDF
calling mmh3 through ``keyfailover.key_hashes``, each summed over all rows. Every job runs
once to warm up, then the jobs take turns, best of 3 (1 with ``--quick``). The counts and
the sums of the shared hash are checked against each other.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import pandas as pd  # type: ignore[import-untyped]
from _common import SEED, consumer_ids, format_count, joined_range_map, parse_quick, print_goals, print_table
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf
from pyspark.sql.pandas.functions import pandas_udf

from keyfailover import key_hashes
from keyfailover.integrations.spark import local_session, partition_by_ranges, with_key_hash

CONSUMERS = 8
GOAL = 1.3
"""The shared-hash job may take at most this many times the native job's time (issue 16's bar)."""


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


def main() -> None:
    quick = parse_quick(__doc__ or "")
    rows, keys, repeats = (200_000, 10_000, 1) if quick else (5_000_000, 100_000, 3)
    spark = local_session(
        "keyfailover-bench-spark",
        config={"spark.driver.memory": "3g", "spark.sql.shuffle.partitions": str(CONSUMERS)},
    )
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
    spark.stop()


if __name__ == "__main__":
    main()
