"""The keyfailover Spark source: its planning without Spark, then bounded reads and streaming queries on a local
SparkSession against a real ``keyfailover serve`` process, and every bad option as the user sees it."""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trustme
from hypothesis import given
from hypothesis import strategies as st
from pyspark import TaskContext
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf

from keyfailover.broker.server import ServerConfig
from keyfailover.broker.storage.postgresql import PostgresLog
from keyfailover.broker.storage.records import Message
from keyfailover.client import Client, LogEntry
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hash
from keyfailover.core.partitions import partition_of_key, partition_slots
from keyfailover.integrations._source_plan import (
    SourceOptionError,
    SourceOptions,
    admit,
    check_starting,
    connect,
    cut_by_traffic,
    plan_by_partition,
    plan_by_ranges,
    starting_offsets,
)
from keyfailover.spark import register
from keyfailover.tools.services import PostgreSQL, ZooKeeper, free_port
from keyfailover.wire.protocol import Key
from tests.aio import run_async
from tests.server_process import ServerProcess, ServerThread, wait_until
from tests.test_cluster_failover import running
from tests.test_store_read import as_text, write_topic
from tests.tiers import starts_processes

Row = tuple[Any, ...]
"""A row as the tests collect it: :data:`COLUMNS`, then the Spark partition it was read in."""

COLUMNS = ("key", "payload", "topic", "partition", "position", "slot", "publish_us", "properties")

# -- planning, no Spark ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"url": "kf://127.0.0.1:1"}, "option topic is required"),
        ({"topic": "t"}, "option url is required"),
        ({"url": "kf://h:1", "topic": "t", "startingOffsets": "earliest"}, "unknown option 'startingOffsets'"),
        ({"url": "kf://h:1", "topic": ""}, "option topic must be"),
        ({"url": "kf://h:1", "topic": "t", "startingPositions": "first"}, "option startingPositions is 'first': not"),
        ({"url": "kf://h:1", "topic": "t", "startingPositions": "[1, 2]"}, "expected earliest, latest or a JSON"),
        ({"url": "kf://h:1", "topic": "t", "startingPositions": '{"x": 1}'}, "names the partition 'x'"),
        ({"url": "kf://h:1", "topic": "t", "startingPositions": '{"0": -1}'}, "the position -1; expected a"),
        ({"url": "kf://h:1", "topic": "t", "startingPositions": '{"0": "5"}'}, "the position '5'; expected"),
        ({"url": "kf://h:1", "topic": "t", "maxMessagesPerTrigger": "0"}, "option maxMessagesPerTrigger is '0'"),
        ({"url": "kf://h:1", "topic": "t", "maxMessagesPerTrigger": "1e3"}, "expected a whole number from 1"),
        ({"url": "kf://h:1", "topic": "t", "ranges": "0"}, "option ranges is '0'; expected partitions"),
        ({"url": "kf://h:1", "topic": "t", "ranges": "65537"}, "a number of slot ranges from 1 to 65536"),
        ({"url": "kf://h:1", "topic": "t", "ranges": "some"}, "option ranges is 'some'"),
        ({"url": "kf://h:1", "topic": "t", "binaryKeys": "yes"}, "option binaryKeys is 'yes'; expected true or"),
        ({"url": "kf://h:1", "store": "postgresql://kf@h/kf", "topic": "t"}, "options url and store are both given"),
        ({"store": "postgresql://kf@h/kf", "topic": "t", "token": "x"}, "option token is for a server's url"),
    ],
)
def test_a_bad_option_is_refused_naming_it(options: dict[str, str], expected: str) -> None:
    with pytest.raises(SourceOptionError, match=re.escape(expected)):
        SourceOptions.parse(options)


def test_options_are_read_in_any_case_with_their_defaults() -> None:
    parsed = SourceOptions.parse({"URL": "kf://h:1", "topic": "t", "maxmessagespertrigger": "7", "Ranges": "5"})
    assert parsed == SourceOptions("kf://h:1", None, "t", "earliest", 7, 5, None, None, False)
    assert SourceOptions.parse({"url": "kf://h:1", "topic": "t", "startingPositions": '{"1": 4}'}).starting == {1: 4}


def test_starting_positions_resolve_against_the_log_ends() -> None:
    ends = [5, 0, 9]
    assert starting_offsets("earliest", ends) == {"0": 1, "1": 1, "2": 1}
    assert starting_offsets("latest", ends) == {"0": 6, "1": 1, "2": 10}
    assert starting_offsets({2: 10, 0: 3}, ends) == {"0": 3, "1": 1, "2": 10}
    with pytest.raises(SourceOptionError, match="names partition 3, but the topic has 3 partitions"):
        check_starting({3: 1}, ends)
    with pytest.raises(SourceOptionError, match="partition 1 at position 2, beyond the end of its log: expected at"):
        check_starting({1: 2}, ends)


@given(
    st.lists(st.tuples(st.integers(1, 50), st.integers(0, 60)), min_size=1, max_size=6),
    st.none() | st.integers(1, 100),
)
def test_admission_takes_at_most_the_limit_split_by_backlog(logs: list[tuple[int, int]], most: int | None) -> None:
    start = {str(p): min(first, last + 1) for p, (first, last) in enumerate(logs)}
    ends = [last for _, last in logs]
    end = admit(start, ends, most)
    taken = [end[str(p)] - start[str(p)] for p in range(len(ends))]
    backlogs = [last + 1 - start[str(p)] for p, last in enumerate(ends)]
    assert all(0 <= t <= b for t, b in zip(taken, backlogs, strict=True))
    assert sum(taken) == (sum(backlogs) if most is None else min(most, sum(backlogs)))
    if most is not None and sum(backlogs) > most:  # each share is within one of its proportion
        assert all(abs(t - most * b / sum(backlogs)) < 1 for t, b in zip(taken, backlogs, strict=True))


def test_partitions_that_appear_later_are_read_from_their_first_position() -> None:
    end = admit({"0": 1}, [0, 5, 2], 4)
    assert end == {"0": 1, "1": 4, "2": 2}
    assert [tasks[0][1:3] for tasks in plan_by_partition({"0": 1}, end)] == [(0, 0), (0, 3), (0, 1)]


def test_admission_refuses_an_offset_beyond_the_log() -> None:
    with pytest.raises(Exception, match="starts partition 1 at position 9, but its log ends at 3"):
        admit({"0": 1, "1": 9}, [4, 3], None)


@given(st.dictionaries(st.integers(0, HASH_RANGE_SIZE - 1), st.integers(1, 1000), max_size=30), st.integers(1, 64))
def test_a_cut_by_traffic_tiles_the_slots_in_shares(weights: dict[int, int], count: int) -> None:
    traffic = np.zeros(HASH_RANGE_SIZE, dtype=np.float64)
    for slot, weight in weights.items():
        traffic[slot] = weight
    ranges = cut_by_traffic(traffic, count)
    assert len(ranges) == count and ranges[0][0] == 0 and ranges[-1][1] == HASH_RANGE_SIZE - 1
    assert all(first <= last for first, last in ranges)
    assert all(ranges[i][1] + 1 == ranges[i + 1][0] for i in range(count - 1))
    total = traffic.sum()
    for first, last in ranges:  # a range carries more than its share only by the slot that crossed it
        carried = traffic[first : last + 1].sum()
        assert carried <= total / count + traffic[first : last + 1].max(initial=0) + 1e-9


def test_a_plan_by_ranges_reads_each_slot_once_and_each_partitions_keyless_messages_once() -> None:
    start, end = {"0": 1, "1": 4, "2": 1}, {"0": 11, "1": 4, "2": 3}
    ranges = [(0, 100), (101, 30000), (30001, 65535)]
    plan = plan_by_ranges(start, end, ranges)
    assert len(plan) == 3
    covered: dict[int, list[tuple[int, int]]] = defaultdict(list)
    keyless: dict[int, int] = defaultdict(int)
    for (first, last), tasks in zip(ranges, plan, strict=True):
        for task in tasks:
            lo, hi = task.slots or partition_slots(task.partition, 3)
            assert first <= lo <= hi <= last
            covered[task.partition].append((lo, hi))
            keyless[task.partition] += task.keyless
            assert (task.after, task.last) == (start[str(task.partition)] - 1, end[str(task.partition)] - 1)
    assert 1 not in covered  # nothing to read in partition 1
    for partition in (0, 2):
        low, high = partition_slots(partition, 3)
        pieces = sorted(covered[partition])
        assert pieces[0][0] == low and pieces[-1][1] == high
        assert all(pieces[i][1] + 1 == pieces[i + 1][0] for i in range(len(pieces) - 1))
        assert keyless[partition] == 1
    assert plan_by_partition(start, end)[1][0].after == plan_by_partition(start, end)[1][0].last == 3


class Secured:
    """A server over TLS that requires a token, with its CA file and a CA that did not sign it."""

    def __init__(self, folder: Path, server: ServerThread) -> None:
        self.folder = folder
        self.server = server
        self.url = server.url.replace("kf://", "kf+ssl://")
        self.ca = folder / "ca.pem"
        self.other_ca = folder / "other-ca.pem"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """A TLS server in this process, its certificate from a throwaway CA, requiring the token ``s3cret``."""
    folder = tmp_path_factory.mktemp("secured")
    authority = trustme.CA()
    authority.cert_pem.write_to_path(str(folder / "ca.pem"))
    trustme.CA().cert_pem.write_to_path(str(folder / "other-ca.pem"))
    certificate = authority.issue_cert("127.0.0.1")
    certificate.cert_chain_pems[0].write_to_path(str(folder / "server.pem"))
    certificate.private_key_pem.write_to_path(str(folder / "server.key"))
    config = ServerConfig(
        data_dir=folder / "data", token="s3cret", tls_cert=folder / "server.pem", tls_key=folder / "server.key"
    )
    with ServerThread(config) as server:
        yield Secured(folder, server)


def test_connecting_names_the_url_the_token_or_the_ca_file_at_fault(secured: Secured) -> None:
    given = {"url": secured.url, "topic": "t", "tlsCa": str(secured.ca)}
    with pytest.raises(SourceOptionError, match=r"option token: the server at .* refused the connection"):
        connect(SourceOptions.parse({**given, "token": "wrong"}))
    with connect(SourceOptions.parse({**given, "token": "s3cret"})) as client:
        assert client.log_ends("t") == [0]
    plain = {"url": secured.server.url, "topic": "t"}
    with pytest.raises(SourceOptionError, match=r"option tlsCa is given but url .* is plain TCP"):
        connect(SourceOptions.parse({**plain, "tlsCa": str(secured.ca)}))
    with pytest.raises(SourceOptionError, match=r"option tlsCa is .*, which is not a file"):
        connect(SourceOptions.parse({**given, "tlsCa": str(secured.folder)}))
    (secured.folder / "not-a-ca.pem").write_text("not a certificate")
    with pytest.raises(SourceOptionError, match="option tlsCa: cannot load the CA file"):
        connect(SourceOptions.parse({**given, "tlsCa": str(secured.folder / "not-a-ca.pem")}))
    with pytest.raises(SourceOptionError, match=r"option tlsCa: cannot connect to .* over TLS: .*CERTIFICATE_VERIFY"):
        connect(SourceOptions.parse({**given, "tlsCa": str(secured.other_ca), "token": "s3cret"}))


# -- on Spark, against a server ----------------------------------------------------------------------------------

PARTITIONS = 4


def _message(i: int) -> tuple[Key, bytes, dict[str, str] | None]:
    """The i-th message of a topic: str keys, UTF-8 bytes keys and keyless ones; properties on every third."""
    key: Key = None if i % 23 == 0 else (f"user-{i % 31}" if i % 4 else f"acct-{i % 7}".encode())
    if i % 50 == 7:
        key = "ключ-é"
    return key, f"payload-{i}".encode(), {"n": str(i), "kind": "test"} if i % 3 == 0 else None


class Server:
    """A server or a cluster at ``url``, to produce to and read back from; ``process`` a single server's."""

    def __init__(self, url: str, process: ServerProcess | None = None) -> None:
        self.process = process
        self.url = url

    def create(self, topic: str, partitions: int = PARTITIONS) -> None:
        """Create ``topic`` with ``partitions`` through the single server's admin endpoint."""
        assert self.process is not None and self.process.admin_url is not None
        request = urllib.request.Request(
            f"{self.process.admin_url}/topics?topic={topic}&partitions={partitions}", method="POST"
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert json.load(answer)["created"] is True

    def produce(self, topic: str, numbers: range, message: Callable[[int], tuple[Key, bytes, Any]] = _message) -> None:
        """Store the messages ``numbers`` of ``topic``."""
        with Client(self.url) as client:
            producer = client.create_producer(topic)
            for i in numbers:
                key, payload, properties = message(i)
                producer.send_async(payload, key, properties=properties)
            producer.flush()

    def log(self, topic: str) -> list[LogEntry]:
        """Every message of ``topic``, read by the client."""
        found = []
        with Client(self.url) as client:
            for partition, last in enumerate(client.log_ends(topic)):
                after = 0
                while after < last:
                    entries = client.read(topic, partition, after, 1000)
                    found += entries.messages
                    after = entries.through
        return found


@pytest.fixture(scope="module")
@starts_processes
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One ``keyfailover serve --data-dir`` process for the module's Spark tests, stopped at the end."""
    with ServerProcess(tmp_path_factory.mktemp("source") / "data", "--metrics-port", "0") as process:
        yield Server(process.url, process)


@pytest.fixture(scope="module")
def source(spark: SparkSession) -> SparkSession:
    """The session, with the keyfailover format registered."""
    register(spark)
    return spark


def _expected(entry: LogEntry, binary_keys: bool = False) -> Row:
    """The row the source gives for ``entry``: its key as text, or bytes with ``binary_keys``."""
    key = entry.key
    if isinstance(key, bytes) and not binary_keys:
        key = key.decode()
    elif isinstance(key, str) and binary_keys:
        key = key.encode()
    properties = dict(entry.properties)
    return (key, entry.payload, None, entry.partition, entry.position, entry.slot, entry.publish_time, properties)


def _rows(df: DataFrame) -> list[Row]:
    """The rows of ``df`` in the order each Spark partition gave them, with their Spark partition last."""
    selected = df.select(
        *COLUMNS[:6], sf.unix_micros("publish_time").alias("publish_us"), "properties", sf.spark_partition_id()
    )
    return [(*row[:7], dict(row[7]), row[8]) for row in selected.collect()]


def _check_order_and_whole_keys(rows: list[Row]) -> None:
    """Within each Spark partition every key's messages in position order; no key in two Spark partitions."""
    seen: dict[Any, int] = {}
    last: dict[tuple[int, Any], int] = {}
    for row in rows:
        key, partition, position, spark_partition = row[0], row[3], row[4], row[8]
        if key is None:
            continue
        assert seen.setdefault(key, spark_partition) == spark_partition, f"key {key!r} in two Spark partitions"
        assert last.get((partition, key), 0) < position, f"key {key!r} out of position order"
        last[(partition, key)] = position


def _same(rows: list[Row], log: list[LogEntry], binary_keys: bool = False) -> None:
    """``rows`` hold each message of ``log`` once, as it was stored."""
    got = sorted((row[3], row[4], row[:2], row[5:8]) for row in rows)
    wanted = sorted(
        (e.partition, e.position, _expected(e, binary_keys)[:2], _expected(e, binary_keys)[5:8]) for e in log
    )
    assert got == wanted


def test_a_bounded_read_holds_every_message_as_produced(source: SparkSession, server: Server) -> None:
    server.create("bounded")
    server.produce("bounded", range(300))
    log = server.log("bounded")
    assert len(log) == 300
    df = source.read.format("keyfailover").option("url", server.url).option("topic", "bounded").load()
    assert df.schema.simpleString() == (
        "struct<key:string,payload:binary,topic:string,partition:int,position:bigint,slot:int,"
        "publish_time:timestamp,properties:map<string,string>>"
    )
    rows = _rows(df)
    _same(rows, log)
    assert {row[2] for row in rows} == {"bounded"}
    assert all(row[8] == row[3] for row in rows)  # Spark partition i reads topic partition i
    assert all(row[5] == (None if row[0] is None else key_hash(row[0])) for row in rows)
    produced = {payload: (key, properties or {}) for key, payload, properties in map(_message, range(300))}
    for row in rows:  # a str key keeps its text; a UTF-8 bytes key reads as its text
        key, properties = produced[row[1]]
        assert row[0] == (key.decode() if isinstance(key, bytes) else key) and row[7] == properties
    _check_order_and_whole_keys(rows)

    binary = source.read.format("keyfailover").options(url=server.url, topic="bounded", binaryKeys="true").load()
    assert binary.schema["key"].dataType.simpleString() == "binary"
    _same(_rows(binary), log, binary_keys=True)

    from_middle = source.read.format("keyfailover").options(
        url=server.url, topic="bounded", startingPositions=json.dumps({"2": 10}), ranges="3"
    )
    rows = _rows(from_middle.load())
    _same(rows, [e for e in log if e.partition != 2 or e.position >= 10])
    assert len({row[8] for row in rows}) <= 3 and from_middle.load().rdd.getNumPartitions() == 3
    _check_order_and_whole_keys(rows)


def _hot_message(i: int) -> tuple[Key, bytes, None]:
    """Half the messages on three hot keys, the others each on a key of its own."""
    return f"hot-{i % 3}" if i % 2 else f"k-{i}", f"m-{i}".encode(), None


def test_ranges_cut_a_read_into_that_many_spark_partitions_of_whole_keys(source: SparkSession, server: Server) -> None:
    server.create("ranged", 2)
    server.produce("ranged", range(400), _hot_message)
    df = source.read.format("keyfailover").options(url=server.url, topic="ranged", ranges="5").load()
    assert df.rdd.getNumPartitions() == 5
    rows = _rows(df)
    _same(rows, server.log("ranged"))
    _check_order_and_whole_keys(rows)
    assert len({row[8] for row in rows}) >= 3  # the traffic is spread, not all in one Spark partition


def test_a_key_that_is_not_utf8_fails_a_text_read_naming_binary_keys(source: SparkSession, server: Server) -> None:
    server.produce("raw", range(5), lambda i: (b"\xff\xfe-%d" % i, b"x", None))
    df = source.read.format("keyfailover").options(url=server.url, topic="raw").load()
    with pytest.raises(Exception, match="not UTF-8 text: read binary keys with option binaryKeys true"):
        df.collect()
    binary = source.read.format("keyfailover").options(url=server.url, topic="raw", binaryKeys="true").load()
    assert sorted(row.key for row in binary.collect()) == [b"\xff\xfe-%d" % i for i in range(5)]


class Batches:
    """What a streaming query's ``foreachBatch`` saw: each batch's rows by batch id, a replayed batch's last."""

    def __init__(self) -> None:
        self.rows: dict[int, list[Row]] = {}

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        self.rows[batch_id] = _rows(df)

    def all(self) -> list[Row]:
        """Every row of every batch."""
        return [row for rows in self.rows.values() for row in rows]


def _stream(spark: SparkSession, batches: Batches, checkpoint: Path, trigger: dict[str, Any], **options: str) -> Any:
    """Start a streaming query of the source with ``options`` into ``batches``."""
    df = spark.readStream.format("keyfailover").options(**options).load()
    writer = df.writeStream.foreachBatch(batches).option("checkpointLocation", str(checkpoint))
    return writer.trigger(**trigger).start()


def _check_batches(batches: Batches, log: list[LogEntry]) -> None:
    """The batches hold each message of ``log`` once, each batch per key in order and with whole keys."""
    _same(batches.all(), log)
    for rows in batches.rows.values():
        _check_order_and_whole_keys(rows)


def test_available_now_reads_everything_once_in_limited_batches(
    source: SparkSession, server: Server, tmp_path: Path
) -> None:
    server.create("stream")
    server.produce("stream", range(240))
    batches = Batches()
    query = _stream(
        source,
        batches,
        tmp_path / "checkpoint",
        {"availableNow": True},
        url=server.url,
        topic="stream",
        maxMessagesPerTrigger="70",
        ranges="3",
    )
    assert query.awaitTermination(120)
    assert query.exception() is None
    _check_batches(batches, server.log("stream"))
    assert sorted(len(rows) for rows in batches.rows.values()) == [30, 70, 70, 70]
    assert all(len({row[8] for row in rows}) <= 3 for rows in batches.rows.values())


def test_a_restarted_query_resumes_exactly_where_it_stopped(
    source: SparkSession, server: Server, tmp_path: Path
) -> None:
    server.create("restart", 2)
    server.produce("restart", range(120))
    checkpoint = tmp_path / "checkpoint"
    options = {"url": server.url, "topic": "restart", "maxMessagesPerTrigger": "25"}
    batches = Batches()
    # The first trigger runs one micro-batch at once, the next would come in an hour: stopped after one batch.
    query = _stream(source, batches, checkpoint, {"processingTime": "1 hour"}, **options)
    try:
        wait_until(lambda: len(query.recentProgress) >= 1 or query.exception() is not None, "one micro-batch", 120)
    finally:
        query.stop()
    assert query.exception() is None
    assert [len(rows) for rows in batches.rows.values()] == [25]  # 95 of the 120 left for the restarted query
    server.produce("restart", range(120, 180))  # while the query is down
    query = _stream(source, batches, checkpoint, {"availableNow": True}, **options)
    assert query.awaitTermination(120)
    assert query.exception() is None
    assert sorted(batches.rows) == list(range(len(batches.rows)))  # numbered on from the checkpoint
    assert len(batches.rows) == 8  # then the other 155: six batches of 25, one of 5
    _check_batches(batches, server.log("restart"))


def test_a_read_task_that_fails_once_is_read_again_whole_and_in_order(
    source: SparkSession, server: Server, tmp_path: Path
) -> None:
    server.create("retried", 2)
    server.produce("retried", range(200))
    failed = tmp_path / "failed-once"

    @sf.udf(returnType="long", useArrow=False)
    def fail_once(position: int) -> int:
        context = TaskContext.get()
        if position == 40 and context is not None and context.attemptNumber() == 0:
            failed.touch()
            raise RuntimeError("a planted failure of the task's first attempt, at position 40")
        return position

    batches = Batches()
    df = source.readStream.format("keyfailover").options(url=server.url, topic="retried", ranges="3").load()
    writer = df.where(fail_once("position") > 0).writeStream.foreachBatch(batches)
    query = writer.option("checkpointLocation", str(tmp_path / "checkpoint")).trigger(availableNow=True).start()
    assert query.awaitTermination(120)
    assert query.exception() is None
    assert failed.exists()  # the tasks that read a position 40 failed mid-read and ran again
    _check_batches(batches, server.log("retried"))


def test_a_once_trigger_reads_everything_available_in_one_batch(
    source: SparkSession, server: Server, tmp_path: Path
) -> None:
    server.produce("once", range(50))
    batches = Batches()
    query = _stream(source, batches, tmp_path / "checkpoint", {"once": True}, url=server.url, topic="once")
    assert query.awaitTermination(120)
    assert query.exception() is None
    assert len(batches.rows) == 1
    _check_batches(batches, server.log("once"))


def test_latest_starts_after_what_the_log_held_when_the_query_started(
    source: SparkSession, server: Server, tmp_path: Path
) -> None:
    server.produce("late", range(10))
    batches = Batches()
    query = _stream(
        source,
        batches,
        tmp_path / "checkpoint",
        {"processingTime": "0 seconds"},
        url=server.url,
        topic="late",
        startingPositions="latest",
    )
    sent = iter(range(10, 100_000))
    with Client(server.url) as client:
        producer = client.create_producer("late")

        def one_more_and_read() -> bool:
            """Produce one message; whether the query has read any yet."""
            i = next(sent)
            producer.send(f"payload-{i}".encode(), "k")
            return bool(batches.all()) or query.exception() is not None

        try:
            wait_until(one_more_and_read, "a micro-batch of messages produced after the start", 120)
        finally:
            query.stop()
    assert query.exception() is None
    read = sorted(row[4] for row in batches.all())
    assert read[0] > 10  # none of the ten before the start
    assert read == list(range(read[0], read[-1] + 1))  # from the first one read on, every message once


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"url": "URL"}, "option topic is required"),
        ({"url": "URL", "topic": "t", "startAt": "1"}, "unknown option 'startat' of the keyfailover source"),
        ({"url": "URL", "topic": "t", "startingPositions": "{0: 1}"}, "option startingPositions is '{0: 1}': not"),
        ({"url": "URL", "topic": "bounded", "startingPositions": '{"7": 1}'}, "names partition 7, but the topic"),
        ({"url": "URL", "topic": "bounded", "startingPositions": '{"0": 9999}'}, "beyond the end of its log"),
        ({"url": "URL", "topic": "t", "startingPositions": '{"0": -2}'}, "the position -2; expected a position"),
        ({"url": "kf://127.0.0.1:1", "topic": "t"}, "option url: cannot connect to kf://127.0.0.1:1"),
        ({"url": "pulsar://127.0.0.1:6650", "topic": "t"}, "option url: server URL 'pulsar://127.0.0.1:6650' is"),
        ({"url": "URL", "topic": "t", "ranges": "-1"}, "option ranges is '-1'; expected partitions"),
        ({"url": "URL", "topic": "t", "maxMessagesPerTrigger": "lots"}, "option maxMessagesPerTrigger is 'lots'"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["read", "readStream"])
def test_a_bad_option_fails_load_with_a_message_naming_it(
    source: SparkSession, server: Server, options: dict[str, str], expected: str, stream: bool
) -> None:
    given = {name: server.url if value == "URL" else value for name, value in options.items()}
    reader = source.readStream if stream else source.read
    with pytest.raises(PySparkException) as caught:
        reader.format("keyfailover").options(**given).load()
    shown = str(caught.value)
    assert expected in shown, shown
    assert "SourceOptionError" in shown


def test_a_store_is_read_as_its_brokers_would_serve_it(source: SparkSession, postgres: PostgreSQL) -> None:
    topic, written = write_topic(postgres)  # the same keys in every partition: a log no broker would write
    df = source.read.format("keyfailover").options(store=postgres.dsn, topic=topic).load()
    rows = _rows(df)
    assert [(row[8], row[4]) for row in rows] == sorted((row[3], row[4]) for row in rows)  # in position order
    wanted = [as_text(row) for row in written]
    assert sorted((r[3], r[4], r[0], r[1], r[6], r[7]) for r in rows) == sorted(
        (partition, position, key, payload, at, properties)
        for partition, position, key, payload, _, _, at, properties in wanted
    )
    assert all(row[5] == (None if row[0] is None else key_hash(row[0])) for row in rows)
    with pytest.raises(PySparkException, match="option store: cannot read the log at"):
        source.read.format("keyfailover").options(store=f"postgresql://kf@127.0.0.1:{free_port()}/kf", topic="t").load()


def test_a_store_cut_into_ranges_reads_whole_keys_in_order(source: SparkSession, postgres: PostgreSQL) -> None:
    topic = f"ranged-{uuid.uuid4().hex[:8]}"
    stored: list[tuple[int, int, Key, bytes]] = []

    async def write() -> None:
        """Each message to its key's partition, as brokers store them, in batches of ten."""
        log = await PostgresLog.connect(postgres.dsn)
        try:
            leases = [await log.open_partition(topic, partition, "broker-1") for partition in range(PARTITIONS)]
            for first in range(0, 200, 10):
                by_partition: dict[int, list[Message]] = defaultdict(list)
                for i in range(first, first + 10):
                    key, payload, _ = _hot_message(i)
                    assert key is not None
                    by_partition[partition_of_key(key, PARTITIONS)].append((None, key, payload))
                for partition, mine in sorted(by_partition.items()):
                    appended = await log.append(leases[partition], None, mine, publish_time=1_750_000_000_000_000)
                    for (position, _), (_, key, payload) in zip(appended, mine, strict=True):
                        stored.append((partition, position, key, payload))
        finally:
            await log.close()

    run_async(write())
    df = source.read.format("keyfailover").options(store=postgres.dsn, topic=topic, ranges="3").load()
    assert df.rdd.getNumPartitions() == 3
    rows = _rows(df)
    _check_order_and_whole_keys(rows)
    assert sorted((row[3], row[4], row[0], row[1]) for row in rows) == sorted(stored)
    assert len({row[8] for row in rows}) >= 2


def test_a_stream_of_a_cluster_follows_its_partitions_across_a_broker_loss(
    source: SparkSession, zookeeper: ZooKeeper, postgres: PostgreSQL, tmp_path: Path
) -> None:
    cluster = f"zk://{zookeeper.hosts}/kf-source-{uuid.uuid4().hex[:8]}"
    with running(cluster, postgres, 2, PARTITIONS) as (topic, (first, second)):
        brokers = Server(f"kf://127.0.0.1:{second.port},127.0.0.1:{first.port}")
        brokers.produce(topic, range(120))
        batches = Batches()
        options = {"url": brokers.url, "topic": topic, "maxMessagesPerTrigger": "50", "ranges": "3"}
        checkpoint = tmp_path / "checkpoint"
        query = _stream(source, batches, checkpoint, {"availableNow": True}, **options)
        assert query.awaitTermination(120) and query.exception() is None
        second.kill()  # the first broker named in url: the source and the producer go to the other
        brokers.produce(topic, range(120, 200))
        query = _stream(source, batches, checkpoint, {"availableNow": True}, **options)
        assert query.awaitTermination(120) and query.exception() is None
        _check_batches(batches, brokers.log(topic))
        assert len(batches.all()) == 200


def test_a_read_over_tls_with_a_token(source: SparkSession, secured: Secured) -> None:
    with Client(secured.url, "s3cret", tls_ca=secured.ca) as client:
        producer = client.create_producer("secure")
        positions = [producer.send(f"m{i}".encode(), f"k{i % 3}") for i in range(6)]
    options = {"url": secured.url, "topic": "secure", "token": "s3cret", "tlsCa": str(secured.ca), "ranges": "2"}
    df = source.read.format("keyfailover").options(**options).load()
    assert sorted(row.position for row in df.collect()) == positions


def test_latest_reads_nothing_in_a_bounded_read(source: SparkSession, server: Server) -> None:
    loaded = source.read.format("keyfailover").options(url=server.url, topic="t", startingPositions="latest")
    with pytest.raises(PySparkException, match="option startingPositions is latest, which reads nothing"):
        loaded.load().collect()
