"""Running account balances in Spark, partitioned exactly as the live keyfailover consumers own the accounts.

Reads payment events exported from a server's log (``keyfailover export --format parquet``;
each payload is JSON with an ``amount``), and the live range map from a server's
``/ranges`` endpoint or a snapshot file (version 1 or 2). Each account's events are
processed in position order inside the partition of its range, giving a running balance per
event; a consumer may own several ranges (the server's default multi-range policy), so its
accounts may be spread over several partitions, and the result goes to one output directory
per consumer (``OUT/owner=<consumer>``), all its ranges together. Then it checks that
for every account the owner Spark computed equals ``RangeMap.owner_of`` of the live map,
and that every final balance is the sum of the account's amounts.

    .venv/bin/python examples/spark_pipeline.py --events EXPORT_DIR --ranges URL_OR_FILE --out OUT_DIR
    .venv/bin/python examples/spark_pipeline.py --demo --out OUT_DIR

``--demo`` does everything on its own: it starts ``keyfailover serve`` on a free loopback
port in a temporary folder, subscribes a few consumers, produces payment events, exports
them while the server runs, and runs the job against the server's live ``/ranges``.
Needs the ``[spark]`` extra and Java.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.request import urlopen

from _local_server import LocalServer
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf

from keyfailover import RangeMap, key_hash
from keyfailover.client import Client
from keyfailover.integrations.export import export_topic
from keyfailover.integrations.spark import load_range_map, local_session, owner_column, process_in_key_order

TOPIC = "payments"
SUBSCRIPTION = "ledger"
OUTPUT_SCHEMA = "account string, position long, amount long, balance long"


def running_balance(account: str | None, events: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """One output row per event of ``account``: the balance after it. Events must come in position order."""
    balance = 0
    last = 0
    for event in events:
        if event["position"] <= last:
            raise RuntimeError(f"account {account!r}: position {event['position']} came after {last}")
        last = event["position"]
        balance += event["amount"]
        yield {"account": account, "position": event["position"], "amount": event["amount"], "balance": balance}


def run_job(spark: SparkSession, events_dir: Path, ranges: str, out_dir: Path) -> int:
    """Run the balances job and its checks; the process exit code (1 when a check failed)."""
    range_map = load_range_map(ranges)  # read once: the job and the checks use the same map
    print(f"range map (epoch {range_map.epoch}) from {ranges}: range = partition")
    for partition, (start, end, consumer) in enumerate(range_map.ranges()):
        share = (end - start + 1) / range_map.range_size
        print(f"  {partition:>3}  {consumer:<14}[{start:>5}, {end:>5}]  {share:6.1%}")
    for consumer, its_ranges in range_map.ranges_by_consumer().items():
        print(f"  {consumer:<14}{len(its_ranges)} range(s), {range_map.width(consumer) / range_map.range_size:6.1%}")
    events = spark.read.parquet(str(events_dir)).select(
        "key",
        "position",
        sf.get_json_object(sf.col("payload").cast("string"), "$.amount").cast("long").alias("amount"),
    )
    balances = process_in_key_order(events, "key", "position", running_balance, range_map, OUTPUT_SCHEMA)
    owned = owner_column(balances, range_map, "account")
    owned.write.partitionBy("owner").parquet(str(out_dir))

    written = spark.read.parquet(str(out_dir))
    print(f"\nwrote {written.count():,} balances to {out_dir}:")
    for row in written.groupBy("owner").count().orderBy("owner").collect():
        print(f"  owner={row['owner']}: {row['count']:,} rows")
    return check(written, events, range_map)


def check(written: DataFrame, events: DataFrame, range_map: RangeMap) -> int:
    """Print the owner and balance checks; 1 if any failed."""
    owners: dict[str, set[str]] = defaultdict(set)
    for row in written.select("account", "owner").distinct().collect():
        owners[row["account"]].add(row["owner"])
    wrong_owner = [account for account, found in owners.items() if found != {range_map.owner_of(key_hash(account))}]
    finals = written.groupBy("account").agg(sf.max_by("balance", "position").alias("final"))
    sums = events.groupBy(sf.col("key").alias("account")).agg(sf.sum("amount").alias("total"))
    wrong_balance = finals.join(sums, "account", "full_outer").where(~sf.col("final").eqNullSafe(sf.col("total")))
    mismatches = wrong_balance.count()
    print(
        f"\nowner check: {len(owners):,} accounts, Spark owner == RangeMap.owner_of for "
        f"{len(owners) - len(wrong_owner):,}, mismatches {len(wrong_owner)}"
    )
    print(f"balance check: {len(owners):,} accounts, final balance == sum of amounts, mismatches {mismatches}")
    return 1 if wrong_owner or mismatches else 0


def spark_session() -> SparkSession:
    return local_session("keyfailover-spark-pipeline", config={"spark.sql.shuffle.partitions": "4"})


def wait_for_consumers(ranges_url: str, count: int, timeout: float = 30.0) -> None:
    """Return once ``count`` consumers own ranges (a consumer may own several)."""
    deadline = time.monotonic() + timeout
    while True:
        with urlopen(ranges_url, timeout=10) as response:
            if len(RangeMap.from_snapshot(json.load(response))) == count:
                return
        if time.monotonic() > deadline:
            raise SystemExit(f"the range map of {ranges_url} did not reach {count} consumers in {timeout} s")
        time.sleep(0.05)


def demo(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kf-spark-demo-") as folder:
        data, events_dir = Path(folder) / "data", Path(folder) / "events"
        with LocalServer(data) as server:
            print(f"server {server.url}, admin {server.admin_url}")
            ranges = f"{server.admin_url}/ranges?topic={TOPIC}&subscription={SUBSCRIPTION}"
            with Client(server.url) as client:
                consumers = [
                    client.subscribe(TOPIC, SUBSCRIPTION, f"consumer-{i}", receiver_queue_size=16)
                    for i in range(1, args.consumers + 1)
                ]
                wait_for_consumers(ranges, args.consumers)
                rng = random.Random(args.seed)
                producer = client.create_producer(TOPIC, "demo-producer")
                for _ in range(args.count):
                    account = f"acct-{rng.randrange(args.accounts)}"
                    amount = rng.choice((1, -1)) * rng.randrange(1, 500)
                    producer.send_async(json.dumps({"amount": amount}).encode(), key=account)
                producer.flush()
                exported = export_topic(data, TOPIC, events_dir, "parquet")
                print(
                    f"produced {args.count:,} events of {args.accounts:,} accounts; exported them while the server "
                    f"runs, as `keyfailover export --data-dir {data} --topic {TOPIC} --format parquet {events_dir}` "
                    f"does ({len(exported.files)} file)\n"
                )
                status = run_job(spark_session(), events_dir, ranges, args.out)
                for consumer in consumers:
                    consumer.close()
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder (must not exist)")
    parser.add_argument("--events", type=Path, help="a folder of exported events (Parquet)")
    parser.add_argument("--ranges", help="a server's /ranges?topic=T&subscription=S URL or a snapshot JSON file")
    parser.add_argument("--demo", action="store_true", help="start a server, produce and export events, then run")
    parser.add_argument("--count", type=int, default=20_000, help="--demo: events to produce (default 20000)")
    parser.add_argument("--accounts", type=int, default=500, help="--demo: distinct accounts (default 500)")
    parser.add_argument("--consumers", type=int, default=3, help="--demo: consumers to subscribe (default 3)")
    parser.add_argument("--seed", type=int, default=7, help="--demo: random seed (default 7)")
    args = parser.parse_args()
    if args.demo:
        return demo(args)
    if args.events is None or args.ranges is None:
        parser.error("give --events and --ranges, or --demo")
    return run_job(spark_session(), args.events, args.ranges, args.out)


if __name__ == "__main__":
    sys.exit(main())
