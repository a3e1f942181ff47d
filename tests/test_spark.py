"""keyfailover.spark on a local SparkSession: the same hash, the same ranges, per-key order, one shuffle."""

from __future__ import annotations

import argparse
import json
import random
import re
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pyarrow as pa  # type: ignore[import-untyped]
import pytest
from pyspark import TaskContext
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf

from keyfailover import RangeMap, key_hash
from keyfailover.core.errors import InvalidKeyError, RangeMapError, SnapshotError
from keyfailover.integrations.spark import (
    load_range_map,
    owner_column,
    partition_by_consumer,
    partition_by_ranges,
    process_in_key_order,
    with_key_hash,
    with_range_id,
)
from tests.examples import example_module

VECTORS = Path(__file__).resolve().parent / "vectors" / "key_hash.json"

UNEVEN = RangeMap.from_ranges(
    [
        (0, 99, "a"),
        (100, 9_999, "b"),
        (10_000, 10_001, "c"),
        (10_002, 30_000, "d"),
        (30_001, 30_500, "e"),
        (30_501, 60_000, "f"),
        (60_001, 65_535, "g"),
    ],
    epoch=12,
)
"""Seven uneven ranges, one of them two slots wide."""

MULTI = RangeMap.from_ranges(
    [
        (0, 999, "a"),
        (1_000, 20_000, "b"),
        (20_001, 20_002, "a"),
        (20_003, 40_000, "c"),
        (40_001, 50_000, "b"),
        (50_001, 65_535, "a"),
    ],
    epoch=5,
)
"""Six ranges of three consumers (the multi-range policy): a owns three, none adjacent, one two slots wide; b two."""


def oracle(df: DataFrame, key_col: str) -> DataFrame:
    """``with_key_hash``'s result next to the test oracle: ``keyfailover.key_hash`` in a Python UDF."""
    python_key_hash = sf.udf(lambda key: None if key is None else key_hash(key), "int")
    return with_key_hash(df, key_col).withColumn("expected", python_key_hash(key_col))


def mismatches(df: DataFrame) -> int:
    return df.where(~sf.col("key_hash").eqNullSafe(sf.col("expected"))).count()


def random_text(rng: random.Random) -> str:
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_:/. ",
        "éèêëàâäîïôöùûüçñßøåÉÀÇ",
        "中文字符日本語한국어漢字鍵値",
        "😀🚀🎉👍🏽🧪\U0010fffd",
        "\x00",
    ]
    chosen = rng.sample(pools, rng.randrange(1, len(pools) + 1))
    return "".join(rng.choice(rng.choice(chosen)) for _ in range(rng.randrange(0, 41)))


# -- the hash ------------------------------------------------------------------------------


def test_with_key_hash_reproduces_the_shared_vectors(spark: SparkSession) -> None:
    vectors = json.loads(VECTORS.read_text(encoding="utf-8"))["vectors"]
    as_bytes = spark.createDataFrame([(bytes.fromhex(v["key_utf8_hex"]),) for v in vectors], "key binary")
    got = {bytes(row["key"]): row["key_hash"] for row in with_key_hash(as_bytes, "key").collect()}
    assert got == {bytes.fromhex(v["key_utf8_hex"]): v["slot"] for v in vectors}
    texts = [v for v in vectors if "key" in v]
    as_text = spark.createDataFrame([(v["key"],) for v in texts], "key string")
    got_text = {row["key"]: row["slot_col"] for row in with_key_hash(as_text, "key", out="slot_col").collect()}
    assert got_text == {v["key"]: v["slot"] for v in texts}
    assert len(texts) > 100 and len(vectors) > len(texts)


def test_with_key_hash_matches_key_hash_on_random_text_and_binary_keys_with_ansi_on(spark: SparkSession) -> None:
    assert spark.conf.get("spark.sql.ansi.enabled") == "true"
    rng = random.Random(20240605)
    texts = [random_text(rng) for _ in range(20_000)]
    binaries = [rng.randbytes(rng.randrange(0, 41)) for _ in range(4_000)]
    assert any(len(t.encode()) % 4 == r for t in texts for r in range(4))
    checked = oracle(spark.createDataFrame([(t,) for t in texts], "key string"), "key")
    assert (checked.count(), mismatches(checked)) == (20_000, 0)
    checked = oracle(spark.createDataFrame([(b,) for b in binaries], "key binary"), "key")
    assert (checked.count(), mismatches(checked)) == (4_000, 0)
    spread = checked.select(sf.count_distinct("key_hash")).first()
    assert spread is not None and spread[0] > 3_500


def test_a_text_key_and_its_utf8_bytes_share_the_slot(spark: SparkSession) -> None:
    keys = ["", "a", "ab", "abc", "abcd", "ünï", "键", "🚀x"]
    df = spark.createDataFrame([(k, k.encode()) for k in keys], "text string, raw binary")
    rows = with_key_hash(with_key_hash(df, "text", "from_text"), "raw", "from_bytes").collect()
    assert [(row["from_text"], row["from_bytes"]) for row in rows] == [(key_hash(k), key_hash(k)) for k in keys]


def test_whole_block_keys_are_hashed_as_they_are_and_the_others_padded(spark: SparkSession) -> None:
    keys = [
        *("", "a", "ab", "abc", "abcd", "abcde", "abcdefgh", "abcdefghijkl"),
        *("é", "éa", "éé", "中", "中a", "中ab", "😀", "😀a", "é中", "中中中中"),  # fewer characters than bytes
        *("ab\x00", "ab\x00\x00", "\x00", "\x00" * 4),  # a key and the same key zero-padded to whole blocks
    ]
    assert {len(k.encode()) % 4 for k in keys} == {0, 1, 2, 3}
    df = spark.createDataFrame([(k, k.encode()) for k in keys], "text string, raw binary")
    rows = with_key_hash(with_key_hash(df, "text", "from_text"), "raw", "from_bytes").collect()
    expected = [key_hash(k) for k in keys]
    assert [row["from_text"] for row in rows] == expected
    assert [row["from_bytes"] for row in rows] == expected
    assert len(set(expected)) == len(keys)  # "ab\0" and its padding "ab\0\0" are two keys with two slots


def test_a_collated_text_key_is_hashed_by_its_utf8_bytes(spark: SparkSession) -> None:
    keys = ["abc", "ABC", "Straße", "STRASSE", "ÉtÉ", "été"]
    df = spark.createDataFrame([(k,) for k in keys], "key string").select(sf.collate("key", "UTF8_LCASE").alias("key"))
    spark.conf.set("spark.sql.legacy.collationAwareHashFunctions", "true")
    try:
        spark_hashes = [row[0] for row in df.select(sf.hash("key")).collect()]
        assert spark_hashes[0] == spark_hashes[1]  # here Spark's hash() follows the collation: "abc" = "ABC"
        rows = with_key_hash(df, "key").collect()
    finally:
        spark.conf.unset("spark.sql.legacy.collationAwareHashFunctions")
    assert [row["key_hash"] for row in rows] == [key_hash(k) for k in keys]


def test_columns_are_found_whatever_their_names(spark: SparkSession) -> None:
    key_col, slot_col, range_col = "the key.`x`", "it's the slot", "range `id`"
    df = spark.createDataFrame([("acct-1",), (None,)], "k string").withColumnRenamed("k", key_col)
    rows = with_range_id(with_key_hash(df, key_col, slot_col), UNEVEN, slot_col, range_col).collect()
    slot = key_hash("acct-1")
    assert [(row[slot_col], row[range_col]) for row in rows] == [(slot, int(UNEVEN.index_of([slot])[0])), (None, None)]
    outside = spark.createDataFrame([(70_000,)], "s int").withColumnRenamed("s", slot_col)
    with pytest.raises(PySparkException, match=r"it's the slot 70000 is not a key-hash slot; expected an int"):
        with_range_id(outside, UNEVEN, slot_col).collect()


# -- ranges --------------------------------------------------------------------------------


class SnapshotServer:
    """A tiny HTTP server on loopback answering ``/ranges?topic=t&subscription=s`` with a snapshot."""

    def __init__(self, snapshot: dict[str, Any]) -> None:
        body = json.dumps(snapshot).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlsplit(self.path)
                known = url.path == "/ranges" and parse_qs(url.query) == {"topic": ["t"], "subscription": ["s"]}
                self.send_response(200 if known else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body if known else b'{"error": "no live subscription"}')

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet."""

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> SnapshotServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


def test_with_range_id_accepts_every_form_of_range_map(spark: SparkSession, tmp_path: Path) -> None:
    slots = [0, 99, 100, 9_999, 10_000, 10_001, 10_002, 30_500, 30_501, 60_000, 60_001, 65_535, None]
    df = spark.createDataFrame([(s,) for s in slots], "key_hash int")
    expected = [None if s is None else int(UNEVEN.index_of([s])[0]) for s in slots]
    assert expected == [0, 0, 1, 1, 2, 2, 3, 4, 5, 5, 6, 6, None]
    snapshot_file = tmp_path / "ranges.json"
    snapshot_file.write_text(json.dumps(UNEVEN.snapshot()), encoding="utf-8")
    version_1_file = tmp_path / "ranges-v1.json"
    version_1_file.write_text(json.dumps(UNEVEN.snapshot() | {"version": 1}), encoding="utf-8")
    with SnapshotServer(UNEVEN.snapshot()) as server:
        forms: list[Any] = [
            UNEVEN,
            UNEVEN.snapshot(),
            snapshot_file,
            str(snapshot_file),
            version_1_file,
            f"{server.url}/ranges?topic=t&subscription=s",
        ]
        for form in forms:
            assert [row["range_id"] for row in with_range_id(df, form).collect()] == expected, form
        with pytest.raises(SnapshotError, match="HTTP 404"):
            with_range_id(df, f"{server.url}/ranges?topic=t&subscription=other")
    with pytest.raises(SnapshotError, match=r"names no subscription; expected a /ranges URL with \?topic=T"):
        with_range_id(df, f"{server.url}/ranges")


@pytest.mark.parametrize(
    ("ranges", "version"), [(UNEVEN, 1), (UNEVEN, 2), (MULTI, 2)], ids=["v1", "v2", "v2 several ranges each"]
)
def test_load_range_map_reads_version_1_and_2_snapshot_files_and_urls(
    tmp_path: Path, ranges: RangeMap, version: int
) -> None:
    snapshot = ranges.snapshot() | {"version": version}
    snapshot_file = tmp_path / "ranges.json"
    snapshot_file.write_text(json.dumps(snapshot), encoding="utf-8")
    with SnapshotServer(snapshot) as server:
        from_url = load_range_map(f"{server.url}/ranges?topic=t&subscription=s")
    for found in (from_url, load_range_map(snapshot_file), load_range_map(str(snapshot_file))):
        assert found == ranges and found.epoch == ranges.epoch
        assert found.ranges_by_consumer() == ranges.ranges_by_consumer()


def test_a_version_1_snapshot_giving_a_consumer_two_ranges_is_refused(tmp_path: Path) -> None:
    snapshot = MULTI.snapshot() | {"version": 1}
    snapshot_file = tmp_path / "ranges.json"
    snapshot_file.write_text(json.dumps(snapshot), encoding="utf-8")
    expected = r"a version 1 snapshot has one range per consumer, but \['a', 'b'\] appear more than once"
    with SnapshotServer(snapshot) as server, pytest.raises(SnapshotError, match=expected):
        load_range_map(f"{server.url}/ranges?topic=t&subscription=s")
    with pytest.raises(SnapshotError, match=expected):
        load_range_map(snapshot_file)


def test_bad_input_raises_errors_that_say_what_was_expected(spark: SparkSession, tmp_path: Path) -> None:
    df = spark.createDataFrame([(1, "k", 70_000)], "number int, key string, key_hash int")
    with pytest.raises(InvalidKeyError, match="key column 'number' has type int; expected string or binary"):
        with_key_hash(df, "number")
    with pytest.raises(InvalidKeyError, match=r"column 'nope' is not in the DataFrame; its columns are \['number'"):
        with_key_hash(df, "nope")
    with pytest.raises(InvalidKeyError, match="hash column 'key' has type string; expected an integer column"):
        with_range_id(df, UNEVEN, hash_col="key")
    with pytest.raises(RangeMapError, match="the range map is empty"):
        with_range_id(df, RangeMap())
    small = RangeMap(range_size=1024)
    small.assign_all("c")
    with pytest.raises(RangeMapError, match="covers 1024 slots; expected 65536"):
        with_range_id(df, small)
    with pytest.raises(RangeMapError, match="range_map is a int; expected a RangeMap"):
        with_range_id(df, 5)  # type: ignore[arg-type]
    with pytest.raises(SnapshotError, match="cannot read the range map snapshot"):
        with_range_id(df, tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(SnapshotError, match="is not JSON"):
        with_range_id(df, tmp_path / "broken.json")
    with pytest.raises(SnapshotError, match="snapshot keys are"):
        with_range_id(df, {"ranges": []})
    with pytest.raises(
        PySparkException, match=r"key_hash 70000 is not a key-hash slot; expected an int in \[0, 65535\]"
    ):
        with_range_id(df, UNEVEN).collect()


def many_ranges(count: int, seed: int) -> RangeMap:
    """``count`` ranges of random widths."""
    cuts = sorted(random.Random(seed).sample(range(1, 65_536), count - 1))
    bounds = [0, *cuts, 65_536]
    return RangeMap.from_ranges([(bounds[i], bounds[i + 1] - 1, f"consumer-{i}") for i in range(count)])


def shared_ranges(count: int, consumers: int, seed: int) -> RangeMap:
    """About ``count`` ranges of random widths over ``consumers`` consumers, each owning several."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, 65_536), count - 1))
    bounds = [0, *cuts, 65_536]
    owners = [f"consumer-{rng.randrange(consumers)}" for _ in range(count)]
    return RangeMap.from_ranges([(bounds[i], bounds[i + 1] - 1, owners[i]) for i in range(count)])


SHARED = shared_ranges(1_000, 40, seed=5)
assert SHARED.range_count() > 900 and len(SHARED) == 40


@pytest.mark.parametrize(
    "ranges",
    [UNEVEN, MULTI, many_ranges(1_000, seed=4), SHARED],
    ids=["7 ranges", "3 consumers with 6 ranges", "1000 ranges", "40 consumers with 1000 ranges"],
)
def test_range_id_and_owner_column_match_the_range_map(spark: SparkSession, ranges: RangeMap) -> None:
    rng = random.Random(3)
    keys = [random_text(rng) for _ in range(3_000)]
    df = spark.createDataFrame([(k,) for k in keys], "key string")
    from_key = owner_column(with_range_id(with_key_hash(df, "key"), ranges), ranges, "key").collect()
    assert {row["key"]: row["owner"] for row in from_key} == {k: ranges.owner_of(key_hash(k)) for k in keys}
    assert {row["key"]: row["range_id"] for row in from_key} == {
        k: int(ranges.index_of([key_hash(k)])[0]) for k in keys
    }
    from_hash = owner_column(with_key_hash(df, "key"), ranges.snapshot(), out="consumer").collect()
    assert {row["key"]: row["consumer"] for row in from_hash} == {row["key"]: row["owner"] for row in from_key}


def test_null_keys_have_no_slot_no_range_and_no_owner(spark: SparkSession) -> None:
    df = spark.createDataFrame([(None,), ("acct-1",), (None,)], "key string")
    rows = owner_column(with_range_id(with_key_hash(df, "key"), UNEVEN), UNEVEN).collect()
    slot = key_hash("acct-1")
    assert [(r["key_hash"], r["range_id"], r["owner"]) for r in rows] == [
        (None, None, None),
        (slot, int(UNEVEN.index_of([slot])[0]), UNEVEN.owner_of(slot)),
        (None, None, None),
    ]


# -- partitioning and per-key order --------------------------------------------------------


def events(spark: SparkSession, keys: int, null_rows: int, seed: int) -> tuple[DataFrame, dict[str | None, list[int]]]:
    """Shuffled ``(key, seq, value)`` rows, 1 to 6 per key, and ``null_rows`` keyless ones; and each key's seqs."""
    rng = random.Random(seed)
    by_key: dict[str | None, list[int]] = {}
    for index in range(keys):
        key = f"acct-{index}" if index % 10 else random_text(rng)
        by_key.setdefault(key, []).extend(rng.sample(range(1_000), rng.randrange(1, 7)))
    by_key[None] = rng.sample(range(1_000), null_rows)
    rows = [(key, seq, seq * 10) for key, seqs in by_key.items() for seq in seqs]
    rng.shuffle(rows)
    df = spark.createDataFrame(rows, "key string, seq long, value long").repartition(3)
    return df, {key: sorted(seqs) for key, seqs in by_key.items()}


def shuffles(df: DataFrame) -> int:
    """How many exchanges (shuffles) the physical plan of ``df`` holds (planned afresh, not as run)."""
    plan: str = df.select("*")._jdf.queryExecution().executedPlan().toString()
    return plan.count("Exchange ")


def where_rows_are(placed: str) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """A ``mapInArrow`` function giving per row its partition, its index there, key, seq, key_hash and ``placed``."""

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        partition = TaskContext.get().partitionId()  # type: ignore[union-attr]
        index = 0
        for batch in batches:
            columns = batch.select(["key", "seq", "key_hash", placed])
            count = batch.num_rows
            yield pa.RecordBatch.from_arrays(
                [
                    pa.array([partition] * count, pa.int32()),
                    pa.array(range(index, index + count), pa.int64()),
                    *columns.columns,
                ],
                names=["partition", "index", "key", "seq", "key_hash", placed],
            )
            index += count

    return run


def check_sorted(partitions: dict[int, list[Any]]) -> None:
    """Each partition's rows come sorted by key (as UTF-8 bytes, null first), then seq."""
    for partition, found in partitions.items():
        found.sort(key=lambda row: row["index"])
        order = [(b"" if row["key"] is None else row["key"].encode(), row["seq"]) for row in found]
        assert order == sorted(order), f"partition {partition} is not sorted by key, then seq"


@pytest.mark.parametrize("ranges", [UNEVEN, MULTI], ids=["one range each", "several ranges each"])
def test_partition_by_ranges_puts_range_i_in_partition_i_sorted_by_key_then_order(
    spark: SparkSession, ranges: RangeMap
) -> None:
    df, by_key = events(spark, keys=3_000, null_rows=5, seed=11)
    parted = partition_by_ranges(df, "key", ranges, order_by="seq")
    count = ranges.range_count()
    assert parted.rdd.getNumPartitions() == count + 1  # the ranges and the null keys
    assert shuffles(parted) == shuffles(df) + 1
    schema = "partition int, index long, key string, seq long, key_hash int, range_id int"
    rows = parted.mapInArrow(where_rows_are("range_id"), schema).collect()
    assert len(rows) == sum(len(seqs) for seqs in by_key.values())
    triples = ranges.ranges()
    partitions: dict[int, list[Any]] = defaultdict(list)
    for row in rows:
        partitions[row["partition"]].append(row)
        if row["key"] is None:
            assert (row["partition"], row["key_hash"], row["range_id"]) == (count, None, None)
        else:
            start, end, consumer = triples[row["partition"]]
            assert row["key_hash"] == key_hash(row["key"]) and start <= row["key_hash"] <= end
            assert ranges.owner_of(row["key_hash"]) == consumer
            assert row["range_id"] == row["partition"]
    check_sorted(partitions)
    holding = {int(ranges.index_of([key_hash(key)])[0]) for key in by_key if key is not None}
    assert set(partitions) == holding | {count}
    if ranges is MULTI:  # a's three ranges are partitions 0, 2 and 5: one consumer, several partitions
        owned_by_a = {p for p in partitions if p < count and triples[p][2] == "a"}
        assert owned_by_a <= {0, 2, 5} and len(owned_by_a) >= 2


def test_partition_by_consumer_puts_all_of_consumer_i_in_partition_i(spark: SparkSession) -> None:
    df, by_key = events(spark, keys=3_000, null_rows=5, seed=13)
    parted = partition_by_consumer(df, "key", MULTI, order_by=["seq"])
    assert parted.columns == ["key", "seq", "value", "key_hash", "owner"]
    assert parted.rdd.getNumPartitions() == 4  # a, b, c and the null keys
    assert shuffles(parted) == shuffles(df) + 1
    schema = "partition int, index long, key string, seq long, key_hash int, owner string"
    rows = parted.mapInArrow(where_rows_are("owner"), schema).collect()
    assert len(rows) == sum(len(seqs) for seqs in by_key.values())
    assert MULTI.consumers() == ["a", "b", "c"]
    partitions: dict[int, list[Any]] = defaultdict(list)
    for row in rows:
        partitions[row["partition"]].append(row)
        if row["key"] is None:
            assert (row["partition"], row["key_hash"], row["owner"]) == (3, None, None)
        else:
            owner = MULTI.owner_of(key_hash(row["key"]))
            assert owner is not None and (row["key_hash"], row["owner"]) == (key_hash(row["key"]), owner)
            assert row["partition"] == MULTI.consumers().index(owner)
    check_sorted(partitions)
    assert set(partitions) == {0, 1, 2, 3}
    # Consumer a's partition holds keys of more than one of its ranges.
    assert len({int(MULTI.index_of([row["key_hash"]])[0]) for row in partitions[0]}) == 2


def seqs_of_each_key(key: str | None, rows: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """One output row per call: the key, its seqs as seen, and where the call ran."""
    partition = TaskContext.get().partitionId()  # type: ignore[union-attr]
    assert all(set(row) == {"key", "seq", "value"} and row["key"] == key for row in rows)
    yield {"key": key, "seqs": [row["seq"] for row in rows], "partition": partition}


@pytest.mark.parametrize("ranges", [UNEVEN, MULTI], ids=["one range each", "several ranges each"])
def test_process_in_key_order_calls_fn_once_per_key_with_its_rows_in_order(
    spark: SparkSession, ranges: RangeMap
) -> None:
    df, by_key = events(spark, keys=1_500, null_rows=4, seed=12)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "7")  # keys straddle batches
    try:
        result = process_in_key_order(
            df, "key", "seq", seqs_of_each_key, ranges, "key string, seqs array<bigint>, partition int", batch_rows=5
        )
        assert shuffles(result) == shuffles(df) + 1
        rows = result.collect()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    calls = Counter(row["key"] for row in rows)
    assert set(calls) == set(by_key) and set(calls.values()) == {1}
    assert {row["key"]: row["seqs"] for row in rows} == by_key
    for row in rows:
        expected = ranges.range_count() if row["key"] is None else int(ranges.index_of([key_hash(row["key"])])[0])
        assert row["partition"] == expected


def test_process_in_key_order_rejects_rows_that_do_not_fit_the_schema(spark: SparkSession) -> None:
    df = spark.createDataFrame([("k", 1)], "key string, seq long")

    def wrong(key: str | None, rows: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        yield {"key": key, "extra": 1}

    result = process_in_key_order(df, "key", "seq", wrong, UNEVEN, "key string")
    with pytest.raises(PySparkException, match=r"fn yielded \['extra', 'key'\] for key 'k'; expected a mapping"):
        result.collect()


# -- the example ---------------------------------------------------------------------------


def test_example_pipeline_runs_end_to_end(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arguments = argparse.Namespace(count=3_000, accounts=120, consumers=5, seed=7, out=tmp_path / "o")
    with example_module("spark_pipeline") as example:
        status = example.demo(arguments)
    printed = capsys.readouterr().out
    assert status == 0, printed
    # Five joins under the server's default multi-range policy leave some consumer with several ranges.
    counts = {int(n) for n in re.findall(r"^  consumer-\d\s+(\d+) range\(s\)", printed, re.MULTILINE)}
    assert len(counts) > 1 and max(counts) > 1, printed
    assert "owner check: 120 accounts, Spark owner == RangeMap.owner_of for 120, mismatches 0" in printed
    assert "balance check: 120 accounts, final balance == sum of amounts, mismatches 0" in printed
    written = sorted(path.name for path in (tmp_path / "o").iterdir() if path.is_dir())
    assert written == [f"owner=consumer-{i}" for i in range(1, 6)]
