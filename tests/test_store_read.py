"""Reading a cluster's log (issue 14): ``keyfailover.spark.read_log`` through Spark's JDBC source and
``keyfailover export --store`` through asyncpg, against a real PostgreSQL written by PostgresLog."""

from __future__ import annotations

import base64
import datetime as dt
import json
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf

from keyfailover.broker.storage.postgresql import PostgresLog
from keyfailover.broker.storage.records import Key, Message
from keyfailover.core.errors import LogError
from keyfailover.integrations import export
from keyfailover.integrations._store import StoreURL
from keyfailover.spark import read_log
from keyfailover.tools.services import PostgreSQL, free_port
from keyfailover.wire.properties import encode_properties
from tests.aio import run_async
from tests.server_process import run_cli
from tests.test_cli_errors import assert_clean_failure

Row = tuple[int, int, Key, bytes, str | None, int | None, int | None, dict[str, str]]
"""``(partition, position, key as written, payload, producer, seq, publish time in µs, properties)``: one stored
message."""

COLUMNS = ["partition", "position", "key", "payload", "producer", "seq", "publish_time", "properties"]
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
PUBLISHED = 1_750_000_000_123_456
"""The publish time (µs since the epoch) of the first batch written; each later one a millisecond on."""
PARTITIONS = 4
"""Partitions of a written topic; the last is opened by a broker but holds no message."""
KEYS: list[Key] = ["acct-7", "ünïcode-键", None, b"raw-bytes", "", "acct-7"]
"""Text keys, a keyless message, and a binary key that is UTF-8 text (read as text, as export does)."""


def write_topic(postgres: PostgreSQL, keys: Sequence[Key] = KEYS) -> tuple[str, list[Row]]:
    """A new topic of PARTITIONS partitions, each but the last with messages of a named producer (with sequence
    ids, and a resent duplicate that is not stored again) and of an unnamed one, every third with properties;
    what was stored, in (partition, position) order. The first message has no publish time, as in a log from
    before them."""
    topic = f"o'rders\\{uuid.uuid4().hex[:8]}"  # a quote and a backslash: the topic is quoted right in SQL
    written: list[Row] = []

    def messages(partition: int, seqs: range, named: bool) -> list[Message]:
        return [
            (seq if named else None, keys[seq % len(keys)], f"p{partition} m{seq}".encode() + bytes([seq, 0, 255]))
            for seq in seqs
        ]

    async def main() -> None:
        log = await PostgresLog.connect(postgres.dsn)
        try:
            for partition in range(PARTITIONS):
                lease = await log.open_partition(topic, partition, "broker-1")
                if partition == PARTITIONS - 1:
                    continue
                batches = [
                    ("p-1", messages(partition, range(7), True)),
                    (None, messages(partition, range(10, 13), False)),
                    ("p-1", messages(partition, range(6, 10 + partition), True)),  # seq 6 again: a resend
                ]
                for producer, batch in batches:
                    at = PUBLISHED + 1000 * len(written)
                    properties = [{"n": f"{i}", "ü": "\x00"} if i % 3 == 0 else {} for i in range(len(batch))]
                    encoded = [encode_properties(each) for each in properties]
                    stored = await log.append(lease, producer, batch, publish_time=at, properties=encoded)
                    for (position, duplicate), (seq, key, payload), kept in zip(stored, batch, properties, strict=True):
                        if not duplicate:
                            written.append((partition, position, key, payload, producer, seq, at, kept))
            await log.pool.execute(
                "UPDATE kf_messages SET publish_time = NULL WHERE topic = $1 AND partition = 0 AND position = 1", topic
            )
            written[0] = (*written[0][:6], None, written[0][7])
        finally:
            await log.close()

    run_async(main())
    return topic, written


def as_text(row: Row) -> Row:
    """``row`` as read with text keys: a binary key decoded from UTF-8."""
    key = row[2]
    return (*row[:2], key.decode() if isinstance(key, bytes) else key, *row[3:])


def as_binary(row: Row) -> Row:
    """``row`` as read with binary keys: a text key as its UTF-8 bytes."""
    key = row[2]
    return (*row[:2], key.encode() if isinstance(key, str) else key, *row[3:])


def plain(values: Sequence[Any]) -> tuple[Any, ...]:
    """A row read by Spark or from Parquet, its binary values (bytearray) as bytes, its timestamps as µs
    since the epoch and its maps (Parquet's lists of pairs) as dicts."""
    return tuple(
        bytes(value)
        if isinstance(value, bytearray)
        else (value - EPOCH) // dt.timedelta(microseconds=1)
        if isinstance(value, dt.datetime)
        else dict(value)
        if isinstance(value, list)
        else value
        for value in values
    )


def in_micros(df: DataFrame) -> DataFrame:
    """``df`` with its publish times as µs since the epoch (Spark collects a timestamp in its session's zone)."""
    return df.withColumn("publish_time", sf.unix_micros("publish_time"))


def by_partition(rows: list[Row]) -> list[list[Row]]:
    return [[row for row in rows if row[0] == partition] for partition in range(PARTITIONS)]


# -- store URLs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "parsed", "shown"),
    [
        ("postgresql://kf@127.0.0.1:5433/keyfailover", ("kf", None, "127.0.0.1", 5433, "keyfailover"), None),
        ("postgres://kf:p%40ss@db.example/log", ("kf", "p@ss", "db.example", 5432, "log"), "kf@db.example:5432/log"),
        ("postgresql://k%20f:pw@[::1]:7/a%2Bb", ("k f", "pw", "::1", 7, "a+b"), "k f@[::1]:7/a+b"),
    ],
)
def test_a_store_url_gives_its_parts_and_is_shown_without_its_password(
    url: str, parsed: tuple[Any, ...], shown: str | None
) -> None:
    store = StoreURL.parse(url)
    assert (store.user, store.password, store.host, store.port, store.database) == parsed
    assert str(store) == (url if shown is None else f"postgresql://{shown}")


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("mysql://kf@h/db", "'mysql://kf@h/db' is not a PostgreSQL URL"),
        ("postgresql://kf:pw@h/db?sslmode=require", "'postgresql://kf:***@h/db?sslmode=require' has ?options"),
        ("postgresql://h:5432/db", "names no user"),
        ("postgresql://kf@:5432/db", "names no host"),
        ("postgresql://kf:pw@h:99999/db", "'postgresql://kf:***@h:99999/db' is malformed or has a port that is not"),
        ("postgresql://kf@h:0/db", "has port 0"),
        ("postgresql://kf@h:5432/", "does not name one database"),
        ("postgresql://kf@h/db/more", "does not name one database"),
    ],
)
def test_a_store_url_not_of_the_form_says_what_is_wrong(url: str, problem: str) -> None:
    with pytest.raises(LogError) as info:
        StoreURL.parse(url)
    assert problem in str(info.value)
    assert str(info.value).endswith("; expected postgresql://user[:password]@host[:port]/database")


# -- read_log -------------------------------------------------------------------------------------


def test_read_log_gives_each_partition_in_position_order_in_its_own_spark_partition(
    spark: SparkSession, postgres: PostgreSQL, capsys: pytest.CaptureFixture[str]
) -> None:
    topic, written = write_topic(postgres)
    df = read_log(spark, postgres.dsn, topic)
    assert df.columns == COLUMNS
    assert [field.dataType.simpleString() for field in df.schema] == [
        "int",
        "bigint",
        "string",
        "binary",
        "string",
        "bigint",
        "timestamp",
        "map<string,string>",
    ]
    df.explain()
    assert f"Scan JDBCRelation(kf_messages) [numPartitions={PARTITIONS}]" in capsys.readouterr().out
    read = [[plain(row) for row in rows] for rows in in_micros(df).rdd.glom().collect()]
    assert read == [[as_text(row) for row in rows] for rows in by_partition(written)]
    assert read[-1] == []  # the partition without messages is an empty Spark partition


def test_read_log_with_binary_keys(spark: SparkSession, postgres: PostgreSQL) -> None:
    topic, written = write_topic(postgres)
    df = read_log(spark, postgres.dsn.replace("kf@", "kf:any-password@"), topic, binary_keys=True)
    assert df.schema["key"].dataType.simpleString() == "binary"
    read = [[plain(row) for row in rows] for rows in in_micros(df).rdd.glom().collect()]
    assert read == [[as_binary(row) for row in rows] for rows in by_partition(written)]


def test_a_key_that_is_not_utf8_text_stops_both_readers_unless_keys_are_binary(
    spark: SparkSession, postgres: PostgreSQL, tmp_path: Path
) -> None:
    topic, written = write_topic(postgres, [*KEYS, b"\xff\xfe"])
    with pytest.raises(
        PySparkException,
        match=r"the key 0xFFFE at position \d+ of partition \d+ is not UTF-8 text; read_log with binary_keys=True",
    ):
        read_log(spark, postgres.dsn, topic).collect()
    read = in_micros(read_log(spark, postgres.dsn, topic, binary_keys=True)).collect()
    assert [plain(row) for row in read] == [as_binary(row) for row in written]

    first = next(row for row in written if row[2] == b"\xff\xfe")
    out = tmp_path / "out"
    done = run_cli("export", "--store", postgres.dsn, "--topic", topic, str(out))
    assert_clean_failure(
        done, 1, f"at position {first[1]} of partition {first[0]} is not UTF-8 text; export with binary keys"
    )
    assert not out.exists()  # nothing half-written is left


def test_read_log_errors_say_what_was_wrong_and_what_was_expected(spark: SparkSession, postgres: PostgreSQL) -> None:
    topic, _ = write_topic(postgres)
    where = f"127.0.0.1:{postgres.port}"
    closed = free_port()
    with pytest.raises(LogError) as info:
        read_log(spark, f"postgresql://kf:s3cret@127.0.0.1:{closed}/keyfailover", topic)
    assert str(info.value) == (
        f"cannot read the log at postgresql://kf@127.0.0.1:{closed}/keyfailover: Connection refused; expected the "
        "cluster's PostgreSQL running there, letting user 'kf' read database 'keyfailover'"
    )
    with pytest.raises(LogError, match=r'database "nowhere" does not exist; expected .* read database \'nowhere\''):
        read_log(spark, f"postgresql://kf@{where}/nowhere", topic)
    with pytest.raises(LogError, match=rf"the database at postgresql://kf@{where}/postgres holds no keyfailover log"):
        read_log(spark, f"postgresql://kf@{where}/postgres", topic)
    with pytest.raises(LogError, match=r"topic 'no-such-topic' is not in the log at .*; expected one of \[") as info:
        read_log(spark, postgres.dsn, "no-such-topic")
    assert repr(topic) in str(info.value)
    with pytest.raises(LogError, match=r"is not a PostgreSQL URL; expected postgresql://user\[:password\]@host"):
        read_log(spark, f"mysql://kf@{where}/keyfailover", topic)
    with pytest.raises(LogError, match="topic must be a non-empty str"):
        read_log(spark, postgres.dsn, "")


def test_read_log_on_a_session_without_the_jdbc_driver_says_how_to_get_it(postgres: PostgreSQL, java: str) -> None:
    """The session shared by the tests has the driver; one without it is started in a child process."""
    topic, _ = write_topic(postgres)
    script = """
import sys
from pathlib import Path

from keyfailover.core.errors import LogError
from keyfailover.integrations import spark

spark.POSTGRESQL_JDBC_JAR = Path("/nowhere/postgresql.jar")  # as on a machine without the Debian package
session = spark.local_session("without-driver", cores=1)
try:
    spark.read_log(session, sys.argv[1], sys.argv[2])
except LogError as exc:
    print(exc)
finally:
    session.stop()
"""
    done = subprocess.run(
        [sys.executable, "-c", script, postgres.dsn, topic], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "this SparkSession cannot load PostgreSQL's JDBC driver (org.postgresql.Driver)" in done.stdout
    assert "expected /nowhere/postgresql.jar in its spark.jars from its start" in done.stdout


# -- export --store -------------------------------------------------------------------------------


def test_cli_export_from_the_store_to_parquet(postgres: PostgreSQL, tmp_path: Path) -> None:
    topic, written = write_topic(postgres)
    out = tmp_path / "out"
    done = run_cli("export", "--store", postgres.dsn, "--topic", topic, str(out))
    assert done.returncode == 0, done.stderr
    assert f"exported {len(written)} messages of {topic!r} ({PARTITIONS} partitions): 1 file(s) in {out}" in done.stdout
    table = pq.read_table(out / "part-00000.parquet")
    assert table.schema.names == COLUMNS
    assert [str(field.type) for field in table.schema] == [
        "int32",
        "int64",
        "string",
        "binary",
        "string",
        "int64",
        "timestamp[us, tz=UTC]",
        "map<string, string ('properties')>",
    ]
    assert [plain(tuple(row.values())) for row in table.to_pylist()] == [as_text(row) for row in written]


def test_cli_export_from_the_store_to_json_lines_with_binary_keys(postgres: PostgreSQL, tmp_path: Path) -> None:
    topic, written = write_topic(postgres)
    out = tmp_path / "out"
    done = run_cli("export", "--store", postgres.dsn, "--topic", topic, "--format", "jsonl", "--binary-keys", str(out))
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in (out / "part-00000.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [list(line) for line in lines] == [COLUMNS] * len(written)
    assert [
        (
            line["partition"],
            line["position"],
            None if line["key"] is None else base64.b64decode(line["key"]),
            base64.b64decode(line["payload"]),
            line["producer"],
            line["seq"],
            None if line["publish_time"] is None else plain([dt.datetime.fromisoformat(line["publish_time"])])[0],
            line["properties"],
        )
        for line in lines
    ] == [as_binary(row) for row in written]


def test_export_store_topic_reads_a_chunk_at_a_time_into_files_of_a_given_size(
    postgres: PostgreSQL, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic, written = write_topic(postgres)
    monkeypatch.setattr(export, "_CHUNK_ROWS", 4)  # cursor fetches that end inside partitions and files
    result = export.export_store_topic(postgres.dsn, topic, tmp_path / "out", "jsonl", rows_per_file=10)
    assert (result.topic, result.messages, result.partitions) == (topic, len(written), PARTITIONS)
    sizes = [len(path.read_text(encoding="utf-8").splitlines()) for path in result.files]
    assert sizes == [10] * (len(written) // 10) + [len(written) % 10]
    lines = [json.loads(line) for path in result.files for line in path.read_text(encoding="utf-8").splitlines()]
    assert [(line["partition"], line["position"], line["key"]) for line in lines] == [
        as_text(row)[:3] for row in written
    ]


def test_cli_export_store_errors(postgres: PostgreSQL, tmp_path: Path) -> None:
    topic, _ = write_topic(postgres)
    out = tmp_path / "out"
    where = f"127.0.0.1:{postgres.port}"
    closed = free_port()
    done = run_cli(
        "export", "--store", f"postgresql://kf:s3cret@127.0.0.1:{closed}/keyfailover", "--topic", topic, str(out)
    )
    assert_clean_failure(done, 1, f"cannot read the log at postgresql://kf@127.0.0.1:{closed}/keyfailover: ")
    assert "s3cret" not in done.stderr
    done = run_cli("export", "--store", f"postgresql://kf@{where}/postgres", "--topic", topic, str(out))
    assert_clean_failure(done, 1, "holds no keyfailover log (no kf_partitions table)")
    done = run_cli("export", "--store", postgres.dsn, "--topic", "no-such-topic", str(out))
    assert_clean_failure(done, 1, "topic 'no-such-topic' is not in the log at", repr(topic))
    done = run_cli("export", "--store", f"postgresql://{where}/keyfailover", "--topic", topic, str(out))
    assert_clean_failure(done, 1, "names no user; expected postgresql://user[:password]@host[:port]/database")
    assert not out.exists()
    done = run_cli("export", "--store", postgres.dsn, "--data-dir", str(tmp_path), "--topic", topic, str(out))
    assert_clean_failure(done, 2, "not allowed with argument")
    done = run_cli("export", "--topic", topic, str(out))
    assert_clean_failure(done, 2, "one of the arguments --data-dir --store is required")
