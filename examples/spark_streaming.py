"""Running account balances from a keyfailover stream, in order per account, written back exactly once.

A Structured Streaming query reads account events (each payload JSON with an ``amount``) with
``spark.readStream.format("keyfailover")``, keeps a running balance per account with
``applyInPandasWithState`` and writes one balance per event to another topic with
``writeStream.format("keyfailover")``. Each account's events reach the state function in position
order: the source gives a key's messages in order, and the function sorts a group by position,
so the order holds whatever order the shuffle delivered them in. The output is in the same order
on every run of a batch: groups are sorted by account before the state function and each group's
balances come out in position order. That keeps the sink's sequence ids on the same rows when a
batch runs again after a restart, and the broker stores it once.

    .venv/bin/python examples/spark_streaming.py --url kf://HOST:PORT --checkpoint DIR
    .venv/bin/python examples/spark_streaming.py --demo

``--demo`` (what ``./scripts/demo --spark`` runs) starts ``keyfailover serve`` on a free loopback
port in a temporary folder, produces half the events, starts the query and stops it after its
first micro-batch, in the middle of the stream; it removes that batch's commit from the
checkpoint, as a driver that died after the sink stored the batch and before Spark recorded it
would leave it, so that the batch runs again; it produces the other half while the query is
down, restarts it on its checkpoint, and then
checks every stored balance against a sequential computation over the events' log. Exit code 1
if a balance is missing, stored twice, out of order or wrong. Needs the ``[spark]`` extra and Java.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.request import Request, urlopen

import pandas as pd  # type: ignore[import-untyped]
from _local_server import LocalServer
from pyspark.sql import SparkSession
from pyspark.sql import functions as sf
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout

from keyfailover.client import Client
from keyfailover.integrations.spark import local_session
from keyfailover.spark import register

EVENTS = "account-events"
BALANCES = "balances"
PARTITIONS = 2
"""Partitions of both topics."""

OUTPUT_SCHEMA = "account string, partition int, position long, amount long, balance long"
STATE_SCHEMA = "balance long, position long"
"""An account's balance and the position of the last event applied to it."""

Balance = tuple[int, int, int]
"""One stored balance: the event's partition and position, and the balance after it."""


def update_balance(key: tuple[Any, ...], frames: Iterator[pd.DataFrame], state: GroupState) -> Iterator[pd.DataFrame]:
    """The balance after each of an account's events of this batch, in position order, carried on in ``state``."""
    (account,) = key
    events = pd.concat(list(frames)).sort_values("position")
    balance, last = state.get if state.exists else (0, 0)
    first = int(events["position"].iloc[0])
    if first <= last:
        raise RuntimeError(f"account {account!r}: position {first} came after {last}, already applied")
    balances = balance + events["amount"].cumsum()
    state.update((int(balances.iloc[-1]), int(events["position"].iloc[-1])))
    yield pd.DataFrame(
        {
            "account": account,
            "partition": events["partition"],
            "position": events["position"],
            "amount": events["amount"],
            "balance": balances,
        }
    )


def start_query(
    spark: SparkSession,
    url: str,
    checkpoint: Path,
    max_per_trigger: int,
    token: str | None = None,
    *,
    one_batch: bool = False,
) -> StreamingQuery:
    """The balances query from the events topic to the balances topic of ``url``, trigger ``availableNow``:
    every event there when it starts, at most ``max_per_trigger`` a micro-batch; it ends by itself. With
    ``one_batch`` its trigger comes every hour instead: it runs one micro-batch at once, then waits."""
    secret = {"token": token} if token else {}
    events = (
        spark.readStream.format("keyfailover")
        .options(url=url, topic=EVENTS, maxMessagesPerTrigger=str(max_per_trigger), **secret)
        .load()
        .where(sf.col("key").isNotNull())
        .select(
            sf.col("key").alias("account"),
            "partition",
            "position",
            sf.get_json_object(sf.col("payload").cast("string"), "$.amount").cast("long").alias("amount"),
        )
    )
    balances = events.groupBy("account").applyInPandasWithState(
        update_balance, OUTPUT_SCHEMA, STATE_SCHEMA, "append", GroupStateTimeout.NoTimeout
    )
    rows = balances.select(
        sf.col("account").alias("key"),
        sf.to_json(sf.struct("partition", "position", "amount", "balance")).alias("payload"),
    )
    return (
        rows.writeStream.format("keyfailover")
        .options(url=url, topic=BALANCES, producerName="balances", **secret)
        .option("checkpointLocation", str(checkpoint))
        .outputMode("append")
        .trigger(**({"processingTime": "1 hour"} if one_batch else {"availableNow": True}))
        .start()
    )


@dataclass(frozen=True)
class Run:
    """One run of the query: the micro-batches it completed and the events they read; whether it was stopped."""

    batches: list[int]
    events: int
    stopped: bool

    def describe(self) -> str:
        span = "no batch" if not self.batches else f"batches {self.batches[0]}-{self.batches[-1]}"
        if len(self.batches) == 1:
            span = f"batch {self.batches[0]}"
        ending = "then stopped, in the middle of the stream" if self.stopped else "then ended: nothing left"
        return f"{span}, {self.events:,} events, {ending}"


def run(query: StreamingQuery, stop_after: int | None = None, timeout: float = 600.0) -> Run:
    """Wait for ``query`` to end, or stop it once it completed ``stop_after`` micro-batches; raise if it failed."""
    waited = 0
    stopped = False
    while not query.awaitTermination(1):
        waited += 1
        if stop_after is not None and len(query.recentProgress) >= stop_after:
            query.stop()
            stopped = True
            break
        if waited > timeout:
            query.stop()
            raise SystemExit(f"the query did not end within {timeout:.0f} s")
    error = query.exception()
    if error is not None:
        raise SystemExit(f"the query failed: {error}")
    progress = query.recentProgress
    return Run([p.batchId for p in progress], sum(p.numInputRows for p in progress), stopped)


def forget_last_commit(checkpoint: Path) -> int:
    """Remove the checkpoint's record that its last micro-batch completed, as if the driver had died after the
    sink stored the batch and before Spark recorded it: the restarted query runs that batch again. The batch's
    id."""
    last = max(int(path.name) for path in (checkpoint / "offsets").iterdir() if path.name.isdigit())
    commit = checkpoint / "commits" / str(last)
    if not commit.exists():
        raise SystemExit(f"batch {last} of {checkpoint} has no commit: expected a query stopped between batches")
    commit.unlink()
    (checkpoint / "commits" / f".{last}.crc").unlink(missing_ok=True)
    return last


def create_topics(admin_url: str) -> None:
    """Create the events and balances topics, as ``keyfailover topics create --admin-url`` does."""
    for topic in (EVENTS, BALANCES):
        request = Request(f"{admin_url}/topics?topic={topic}&partitions={PARTITIONS}", method="POST")
        with urlopen(request, timeout=30) as response:
            if response.status != 200:
                raise SystemExit(f"creating {topic} answered HTTP {response.status}")


def produce(url: str, count: int, accounts: int, rng: random.Random) -> None:
    """Send ``count`` events of ``accounts`` accounts, each an amount of -499 to 499, never 0."""
    with Client(url) as client:
        producer = client.create_producer(EVENTS)
        for _ in range(count):
            amount = rng.choice((1, -1)) * rng.randrange(1, 500)
            producer.send_async(json.dumps({"amount": amount}).encode(), key=f"acct-{rng.randrange(accounts)}")
        producer.flush()


def read_topic(client: Client, topic: str) -> Iterator[tuple[str, int, int, bytes]]:
    """Every keyed message of ``topic``: key, partition, position and payload, each partition in position order."""
    for partition, last in enumerate(client.log_ends(topic)):
        after = 0
        while after < last:
            entries = client.read(topic, partition, after, 5_000)
            for entry in entries.messages:
                if entry.key is not None:
                    key = entry.key if isinstance(entry.key, str) else entry.key.decode()
                    yield key, partition, entry.position, entry.payload
            after = entries.through


def sequential_balances(client: Client) -> dict[str, list[Balance]]:
    """Each account's balances computed one event after the other, in the log's order: the expected output."""
    balances: dict[str, list[Balance]] = defaultdict(list)
    for account, partition, position, payload in read_topic(client, EVENTS):
        before = balances[account][-1][2] if balances[account] else 0
        balances[account].append((partition, position, before + json.loads(payload)["amount"]))
    return balances


def stored_balances(client: Client) -> dict[str, list[Balance]]:
    """Each account's balances as the query stored them, in the order the balances topic holds them."""
    stored: dict[str, list[Balance]] = defaultdict(list)
    for account, _, _, payload in read_topic(client, BALANCES):
        row = json.loads(payload)
        stored[account].append((row["partition"], row["position"], row["balance"]))
    return stored


@dataclass(frozen=True)
class Check:
    """The stored balances against the sequential ones."""

    accounts: int
    expected: int
    stored: int
    missing: int
    duplicated: int
    out_of_order: int
    wrong: int

    @property
    def passed(self) -> bool:
        return self.stored == self.expected and not (self.missing or self.duplicated or self.out_of_order or self.wrong)

    def describe(self) -> str:
        return (
            f"balances: {self.stored:,} stored for {self.accounts:,} accounts; {self.expected:,} expected from a "
            f"sequential computation over the events' log\ncheck: missing {self.missing}, stored twice "
            f"{self.duplicated}, accounts out of order {self.out_of_order}, wrong balance {self.wrong}"
        )


def check(expected: dict[str, list[Balance]], stored: dict[str, list[Balance]]) -> Check:
    """Compare, per account, the stored balances with the expected ones: each once, in order, equal."""
    missing = duplicated = out_of_order = wrong = 0
    for account in expected.keys() | stored.keys():
        want, got = expected.get(account, []), stored.get(account, [])
        want_at = {(partition, position): balance for partition, position, balance in want}
        counts = Counter((partition, position) for partition, position, _ in got)
        missing += len(want_at.keys() - counts.keys())
        duplicated += sum(count - 1 for count in counts.values())
        wrong += sum(1 for partition, position, balance in got if want_at.get((partition, position)) != balance)
        events = [(partition, position) for partition, position, _ in got]
        out_of_order += events != sorted(events)
    return Check(
        accounts=len(expected),
        expected=sum(map(len, expected.values())),
        stored=sum(map(len, stored.values())),
        missing=missing,
        duplicated=duplicated,
        out_of_order=out_of_order,
        wrong=wrong,
    )


@dataclass(frozen=True)
class Demo:
    """What the demo did and found: its two runs, the batch the first left to run again, and the check."""

    first: Run
    second: Run
    replayed: int | None
    """The batch whose commit was removed after run 1."""
    check: Check


def demo_run(spark: SparkSession, url: str, admin_url: str, checkpoint: Path, args: argparse.Namespace) -> Demo:
    """The demo on a running server: half the events, a run of one micro-batch whose commit is then lost, the other
    half, a restarted run, the check. ``spark`` has the keyfailover format registered."""
    rng = random.Random(args.seed)
    create_topics(admin_url)
    half = args.count // 2
    produce(url, half, args.accounts, rng)
    print(f"produced {half:,} events of {args.accounts:,} accounts to {EVENTS} ({PARTITIONS} partitions)")
    first = run(start_query(spark, url, checkpoint, args.per_trigger, one_batch=True), stop_after=1)
    print(f"run 1: {first.describe()}")
    replayed = forget_last_commit(checkpoint)
    print(f"  batch {replayed}'s commit removed from the checkpoint, as if the driver had died after the sink")
    print("  stored the batch and before Spark recorded it: run 2 runs it again, its rows all stored already")
    produce(url, args.count - half, args.accounts, rng)
    print(f"produced {args.count - half:,} more events while the query was down")
    second = run(start_query(spark, url, checkpoint, args.per_trigger))
    print(f"run 2, restarted on its checkpoint {checkpoint}: {second.describe()}")
    with Client(url) as client:
        result = check(sequential_balances(client), stored_balances(client))
    print(result.describe())
    return Demo(first, second, replayed, result)


def spark_session() -> SparkSession:
    spark = local_session("keyfailover-spark-streaming", config={"spark.sql.shuffle.partitions": "4"})
    spark.sparkContext.setLogLevel("FATAL")  # a stopped query's aborted write is logged as an error: it is expected
    register(spark)
    return spark


def demo(args: argparse.Namespace) -> int:
    with (
        tempfile.TemporaryDirectory(prefix="kf-spark-streaming-") as folder,
        LocalServer(Path(folder) / "data") as server,
    ):
        print(f"server {server.url}, admin {server.admin_url}")
        result = demo_run(spark_session(), server.url, server.admin_url, Path(folder) / "checkpoint", args)
    return 0 if result.check.passed else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", action="store_true", help="start a server, stream with a restart, check")
    parser.add_argument("--url", help="the server: run the query once on its account-events topic")
    parser.add_argument("--token", help="the server's token, if it requires one")
    parser.add_argument("--checkpoint", type=Path, help="the query's checkpoint folder (with --url)")
    parser.add_argument("--per-trigger", type=int, default=2_000, help="events a micro-batch at most (default 2000)")
    parser.add_argument("--count", type=int, default=20_000, help="--demo: events to produce (default 20000)")
    parser.add_argument("--accounts", type=int, default=500, help="--demo: distinct accounts (default 500)")
    parser.add_argument("--seed", type=int, default=7, help="--demo: random seed (default 7)")
    args = parser.parse_args()
    if args.demo:
        return demo(args)
    if args.url is None or args.checkpoint is None:
        parser.error("give --url and --checkpoint, or --demo")
    print(run(start_query(spark_session(), args.url, args.checkpoint, args.per_trigger, args.token)).describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
