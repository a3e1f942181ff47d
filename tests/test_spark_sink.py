"""The exactly-once Spark sink against a real ``keyfailover serve`` process: batch writes, a stream, a task that
fails once and is retried, a query that fails mid-batch and is restarted on its checkpoint, and bad input.

What was stored is read back from the server's log (:class:`LogSnapshot`), never through the sink.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.request import Request, urlopen

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf
from pyspark.sql.types import StringType

from keyfailover.broker.storage.sqlite import LOG_FILE_NAME, LogSnapshot
from keyfailover.core.errors import KeyFailoverError
from keyfailover.core.partitions import partition_topic
from keyfailover.integrations.spark_sink import ROW_BITS, producer_name, sequence_id
from keyfailover.spark import register
from keyfailover.tools.services import free_port
from keyfailover.wire.properties import decode_properties
from tests.server_process import ServerProcess
from tests.tiers import starts_processes

pytestmark = pytest.mark.spark

PARTITIONS = 2
"""Topic partitions of every topic the tests write: the deduplication holds per topic partition."""


class Stored:
    """One message as the log holds it."""

    def __init__(self, partition: int, row: tuple[Any, ...]) -> None:
        position, key, payload, producer, seq, _, properties = row
        self.partition = partition
        self.position: int = position
        self.key: str | bytes | None = key
        self.payload: bytes = payload
        self.producer: str = producer
        self.seq: int = seq
        self.properties = decode_properties(properties) if properties else {}


@pytest.fixture(scope="module")
@starts_processes
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One ``keyfailover serve`` process for the module, with its admin endpoint."""
    with ServerProcess(tmp_path_factory.mktemp("sink-data"), "--metrics-port", "0") as process:
        yield process


@pytest.fixture(scope="module")
def kf(spark: SparkSession) -> SparkSession:
    """The session with ``format("keyfailover")`` registered."""
    register(spark)
    return spark


def create_topic(server: ServerProcess, topic: str) -> None:
    """Create ``topic`` with :data:`PARTITIONS` partitions."""
    assert server.admin_url is not None
    request = Request(f"{server.admin_url}/topics?topic={topic}&partitions={PARTITIONS}", method="POST")
    with urlopen(request, timeout=10) as response:
        assert response.status == 200


def stored(server: ServerProcess, topic: str, partitions: int = PARTITIONS) -> list[Stored]:
    """Every message of ``topic`` of ``partitions`` partitions in the server's log, partition by partition, in
    position order."""
    assert server.data_dir is not None
    found = []
    with LogSnapshot(server.data_dir / LOG_FILE_NAME) as snapshot:
        for partition in range(partitions):
            name = partition_topic(topic, partition, partitions)
            if name in snapshot.topics():
                found += [Stored(partition, row) for row in snapshot.messages(name)]
    return found


def options(server: ServerProcess, topic: str, **more: str) -> dict[str, str]:
    """The sink's options for ``topic`` on ``server``."""
    return {"url": server.url, "topic": topic, **more}


def seqs_by_producer(messages: list[Stored]) -> dict[str, list[int]]:
    """The sequence ids each producer stored, sorted."""
    found: dict[str, list[int]] = defaultdict(list)
    for message in messages:
        found[message.producer].append(message.seq)
    return {name: sorted(seqs) for name, seqs in found.items()}


def test_names_and_sequence_ids_of_the_sink() -> None:
    assert producer_name("spark", "q", 3) == "spark-q-3"
    assert [sequence_id(0, 0), sequence_id(0, 7), sequence_id(2, 5)] == [0, 7, (2 << ROW_BITS) + 5]
    assert sequence_id((1 << 31) - 1, (1 << ROW_BITS) - 1) == 2**63 - 1
    with pytest.raises(KeyFailoverError, match=r"batch id 2147483648 is beyond the sink's sequence ids"):
        sequence_id(1 << 31, 0)
    with pytest.raises(KeyFailoverError, match=r"a task has over 4294967296 rows; expected at most 2\*\*32 rows"):
        sequence_id(0, 1 << ROW_BITS)


def test_a_batch_write_stores_every_row_once_with_its_key_payload_and_properties(
    kf: SparkSession, server: ServerProcess
) -> None:
    create_topic(server, "batch")
    rows = [
        (None if i % 7 == 0 else f"key-{i % 13}", f"p{i}".encode(), None if i % 3 else {"i": str(i), "t": "x"})
        for i in range(300)
    ]
    text_keys = kf.createDataFrame(
        kf.sparkContext.parallelize(rows, 3), "key string, payload binary, properties map<string,string>"
    )
    text_keys.write.format("keyfailover").options(**options(server, "batch")).mode("append").save()
    binary = [(None if i % 5 == 0 else f"bin-{i % 11}".encode(), f"s{i}") for i in range(200)]
    binary_keys = kf.createDataFrame(kf.sparkContext.parallelize(binary, 2), "key binary, payload string")
    fixed = options(server, "batch", writeId="nightly-1", producerName="job")
    binary_keys.write.format("keyfailover").options(**fixed).mode("append").save()
    binary_keys.write.format("keyfailover").options(**fixed).mode("append").save()  # again: nothing new

    messages = stored(server, "batch")
    got = Counter((m.key, m.payload, tuple(sorted(m.properties.items()))) for m in messages)
    expected: Counter[tuple[str | bytes | None, bytes, tuple[tuple[str, str], ...]]] = Counter(
        (key, payload, tuple(sorted((properties or {}).items()))) for key, payload, properties in rows
    )
    expected.update((key, payload.encode(), ()) for key, payload in binary)
    assert got == expected
    assert max(got.values()) == 1
    by_producer = seqs_by_producer(messages)
    # A batch write: a producer per Spark partition, named after the write, its rows numbered from 0.
    assert sorted(name for name in by_producer if name.startswith("job-")) == ["job-nightly-1-0", "job-nightly-1-1"]
    assert all(name.startswith("spark-") for name in by_producer if not name.startswith("job-"))
    assert sorted(name.rsplit("-", 1)[1] for name in by_producer if name.startswith("spark-")) == ["0", "1", "2"]
    for seqs in by_producer.values():
        assert seqs == list(range(len(seqs)))
    assert sum(map(len, by_producer.values())) == 500
    for message in messages:
        if message.key is not None:
            assert {m.partition for m in messages if m.key == message.key} == {message.partition}


def test_a_task_that_fails_once_is_retried_and_stores_every_row_once(
    kf: SparkSession, server: ServerProcess, tmp_path: Path
) -> None:
    """The first attempt of the task of rows 0-149 fails at row 100, after sending rows 0-99, which its client's
    close waits to be stored; the retry sends rows 0-149 again, the first 100 of them duplicates."""
    create_topic(server, "retried")
    failed = tmp_path / "failed"

    @sf.udf(returnType=StringType(), useArrow=False)
    def payload(i: int) -> str | None:
        from pyspark import TaskContext

        context = TaskContext.get()
        if i == 100 and context is not None and context.attemptNumber() == 0:
            failed.touch()
            return None  # the sink refuses a null payload: the task fails at this row
        return f"r{i}"

    numbers = kf.createDataFrame(kf.sparkContext.parallelize([(i,) for i in range(300)], 2), "i int")
    frame = numbers.select(
        sf.concat(sf.lit("k"), (sf.col("i") % 10).cast("string")).alias("key"), payload("i").alias("payload")
    )
    frame.write.format("keyfailover").options(**options(server, "retried")).mode("append").save()

    assert failed.exists()
    messages = stored(server, "retried")
    assert sorted(m.payload for m in messages) == sorted(f"r{i}".encode() for i in range(300))
    for seqs in seqs_by_producer(messages).values():
        assert seqs == list(range(150))


def write_files(folder: Path, start: int, count: int, rows: int) -> None:
    """``count`` JSON files of ``rows`` rows each, file n holding the keys of group n % 2 and numbers from
    ``start``: one file per Spark partition."""
    for file in range(start, start + count):
        lines = [
            json.dumps({"key": f"g{file % 2}-{n % 5}", "n": n, "file": file})
            for n in range(file * rows, (file + 1) * rows)
        ]
        (folder / f"part-{file:04d}.json").write_text("\n".join(lines) + "\n")


def run_stream(kf: SparkSession, server: ServerProcess, source: Path, checkpoint: Path, marks: Path) -> None:
    """Write the files of ``source`` to the topic ``stream``, two files a batch, until none is left.

    The row numbered 1_030 gets a null payload in the first attempt of its task, which fails it once and
    leaves the file ``failed-once`` in ``marks``; while ``marks`` holds a file ``broken``, the row numbered
    2_050 gets one every time."""
    broken, failed = marks / "broken", marks / "failed-once"

    @sf.udf(returnType=StringType(), useArrow=False)
    def payload(n: int, key: str) -> str | None:
        from pyspark import TaskContext

        context = TaskContext.get()
        if n == 1_030 and context is not None and context.attemptNumber() == 0:  # file 2's row 30
            failed.touch()
            return None
        if n == 2_050 and broken.exists():  # file 4's row 50
            return None
        return f"{key}:{n}"

    frame = (
        kf.readStream.schema("key string, n long, file int")
        .option("maxFilesPerTrigger", 2)
        .json(str(source))
        .select("key", payload("n", "key").alias("payload"))
    )
    query = (
        frame.writeStream.format("keyfailover")
        .options(**options(server, "stream"))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)


def test_a_stream_stores_every_row_once_in_key_order_across_a_retried_task_a_failed_batch_and_replays(
    kf: SparkSession, server: ServerProcess, tmp_path: Path
) -> None:
    create_topic(server, "stream")
    source, checkpoint, broken = tmp_path / "in", tmp_path / "checkpoint", tmp_path / "broken"
    source.mkdir()
    rows = 500
    write_files(source, 0, 4, rows)  # batches 0 and 1; a task of batch 1 fails once and is retried
    run_stream(kf, server, source, checkpoint, tmp_path)
    assert (tmp_path / "failed-once").exists()
    write_files(source, 4, 2, rows)  # batch 2: a task fails at row 50 twice, the query stops mid-batch
    broken.touch()
    with pytest.raises(PySparkException, match=r"row 50 has a null payload; expected binary or string"):
        run_stream(kf, server, source, checkpoint, tmp_path)
    partial = len(stored(server, "stream"))
    assert 4 * rows + 50 <= partial < 6 * rows
    broken.unlink()
    run_stream(kf, server, source, checkpoint, tmp_path)  # restarted: batch 2 again, whole
    assert len(stored(server, "stream")) == 6 * rows
    (checkpoint / "commits" / "2").unlink()  # as if the query died after the sink's commit, before Spark's
    (checkpoint / "commits" / ".2.crc").unlink(missing_ok=True)
    run_stream(kf, server, source, checkpoint, tmp_path)  # batch 2 replayed: nothing new

    messages = stored(server, "stream")
    assert sorted(m.payload for m in messages) == sorted(
        f"g{n // rows % 2}-{n % 5}:{n}".encode() for n in range(6 * rows)
    )
    by_key: dict[str | bytes | None, list[int]] = defaultdict(list)
    for message in sorted(messages, key=lambda m: (m.partition, m.position)):
        by_key[message.key].append(int(message.payload.split(b":")[1]))
    for numbers in by_key.values():
        assert numbers == sorted(numbers)  # each key in the order of its rows
    names = {m.producer for m in messages}
    query_ids = {name[len("spark-") : name.rindex("-")] for name in names}
    assert len(query_ids) == 1  # one query, restarted on its checkpoint: the same names
    assert {name.rsplit("-", 1)[1] for name in names} <= {"0", "1"}
    batches = Counter(m.seq >> ROW_BITS for m in messages)
    assert batches == {0: 2 * rows, 1: 2 * rows, 2: 2 * rows}
    for seqs in seqs_by_producer(messages).values():  # each batch's rows numbered from 0 in each task
        for batch in range(3):
            indexes = [seq & ((1 << ROW_BITS) - 1) for seq in seqs if seq >> ROW_BITS == batch]
            assert indexes == list(range(len(indexes)))


GOOD = "key string, payload binary"
BAD_OPTIONS = [
    ({"url": "{url}"}, GOOD, r"option 'topic' is missing; expected the name of the topic to write to"),
    ({"topic": "bad"}, GOOD, r"option 'url' is missing; expected the keyfailover server's URL, kf://HOST:PORT"),
    (
        {"url": "{url}", "topic": "bad", "startingPositions": "earliest"},
        GOOD,
        r"the keyfailover sink has no option 'startingpositions'; expected options from \['url', 'topic'",
    ),
    ({"url": "http://x:1", "topic": "bad"}, GOOD, r"option 'url': server URL 'http://x:1' is not of the form kf://"),
    ({"url": "{url}", "topic": "bad", "tlsCa": "/ca.pem"}, GOOD, r"option 'tlsCa' is given but option 'url' 'kf://"),
    ({"url": "{url}", "topic": "bad", "sendTimeout": "soon"}, GOOD, r"option 'sendTimeout' is 'soon'; expected a"),
    ({"url": "{url}", "topic": "bad", "sendTimeout": "0"}, GOOD, r"option 'sendTimeout' is '0'; expected a number"),
    ({"url": "{url}", "topic": "bad", "producerName": "p" * 250}, GOOD, r"make producer names such as 'ppp"),
    (
        {"url": "kf://127.0.0.1:{closed}", "topic": "bad"},
        GOOD,
        r"option 'url': cannot connect to kf://127\.0\.0\.1:\d+: .*; expected a keyfailover server there",
    ),
    ({"url": "{url}", "topic": "bad"}, "payload binary, extra int", r"the DataFrame also has \['extra'\]: select"),
    ({"url": "{url}", "topic": "bad"}, "key string", r"the DataFrame has no column 'payload'; expected payload"),
    ({"url": "{url}", "topic": "bad"}, "key int, payload binary", r"column 'key' has type int; expected string or"),
    ({"url": "{url}", "topic": "bad"}, "payload array<int>", r"column 'payload' has type array<int>; expected binary"),
    (
        {"url": "{url}", "topic": "bad"},
        "payload binary, properties map<string,int>",
        r"column 'properties' has type map<string,int>; expected map<string,string>",
    ),
]


@pytest.mark.parametrize(("given", "schema", "expected"), BAD_OPTIONS)
def test_bad_options_and_columns_fail_the_write_before_any_row(
    kf: SparkSession, server: ServerProcess, given: dict[str, str], schema: str, expected: str
) -> None:
    filled = {
        name: value.format(url=server.url, closed=free_port()) if name == "url" else value
        for name, value in given.items()
    }
    frame: DataFrame = kf.createDataFrame([], schema)
    with pytest.raises(PySparkException, match=expected):
        frame.write.format("keyfailover").options(**filled).mode("append").save()
    assert stored(server, "bad") == []


def test_a_stream_refuses_a_write_id_and_a_batch_write_refuses_overwrite(
    kf: SparkSession, server: ServerProcess, tmp_path: Path
) -> None:
    frame = kf.readStream.format("rate").load().select(sf.col("value").cast("string").cast("binary").alias("payload"))
    with pytest.raises(PySparkException, match=r"option 'writeId' is for batch writes; a stream's producers are"):
        frame.writeStream.format("keyfailover").options(**options(server, "bad", writeId="w")).option(
            "checkpointLocation", str(tmp_path / "checkpoint")
        ).start().awaitTermination(60)
    with pytest.raises(PySparkException, match=r"the keyfailover sink appends to a topic; expected mode 'append'"):
        kf.createDataFrame([], GOOD).write.format("keyfailover").options(**options(server, "bad")).mode(
            "overwrite"
        ).save()
    assert stored(server, "bad") == []


def test_a_server_with_a_token_takes_the_write_with_it_and_refuses_it_without(kf: SparkSession, tmp_path: Path) -> None:
    frame = kf.createDataFrame([("k", b"with the token")], GOOD)
    with ServerProcess(tmp_path / "data", "--token", "secret") as guarded:
        for given, expected in ((None, "was not given"), ("wrong", "was refused")):
            refused = options(guarded, "guarded") | ({} if given is None else {"token": given})
            with pytest.raises(PySparkException, match=rf"option 'token' {expected}: the server at kf://.* answered "):
                frame.write.format("keyfailover").options(**refused).mode("append").save()
        frame.write.format("keyfailover").options(**options(guarded, "guarded", token="secret")).mode("append").save()
        assert [(m.key, m.payload) for m in stored(guarded, "guarded", partitions=1)] == [("k", b"with the token")]


def test_a_row_the_sink_cannot_send_fails_its_task_naming_the_row(kf: SparkSession, server: ServerProcess) -> None:
    rows = [("k", b"fine", {"a": "1"}), ("k", b"null value", {"a": "1", "b": None})]
    frame = kf.createDataFrame(
        kf.sparkContext.parallelize(rows, 1), "key string, payload binary, properties map<string,string>"
    )
    with pytest.raises(
        PySparkException,
        match=r"keyfailover sink, topic 'bad-rows', producer 'spark-[-0-9a-f]+-0': row 1 has a null value for the "
        r"properties \['b'\]; expected a string for each property",
    ):
        frame.write.format("keyfailover").options(**options(server, "bad-rows")).mode("append").save()
    big = kf.createDataFrame(
        [("k", b"big", {"p": "x" * 70_000})], "key string, payload binary, properties map<string,string>"
    )
    with pytest.raises(
        PySparkException,
        match=r"keyfailover sink, topic 'bad-rows', producer '[^']+': .*over the limit of 65536 per message",
    ):
        big.write.format("keyfailover").options(**options(server, "bad-rows")).mode("append").save()
    # the row before the bad one, stored by the first attempt and sent again by the second: once
    assert [m.payload for m in stored(server, "bad-rows", partitions=1)] == [b"fine"]
