"""The keyfailover hash and range map in PySpark, so a batch job partitions data as the live consumers own it.

The hash and the ranges run in Spark SQL itself, with no Python UDF: :func:`with_key_hash` computes
exactly :func:`keyfailover.key_hash`, :func:`with_range_id` finds each slot's range by
integer comparisons against the range ends (by a slot table for maps of over 256 ranges),
and :func:`partition_by_ranges` puts range i in partition i with
``repartitionById`` (Spark >= 4.1), sorted by key. :func:`process_in_key_order` then calls
a Python function once per key, with that key's rows in order, inside those partitions.

Ranges are numbered in hash order over the whole map, from 0, as
:meth:`RangeMap.ranges` lists them and :meth:`RangeMap.index_of` numbers them. A consumer
may own several ranges (the multi-range policy), so it may have several range ids and
several partitions; :func:`owner_column` names the consumer of each row, and
:func:`partition_by_consumer` puts all of a consumer's keys in one partition instead.

Null keys form their own group: their ``key_hash``, range id and owner are null, and
:func:`partition_by_ranges` puts them all in one extra partition, number n for a map of n
ranges (empty when there are none), where :func:`process_in_key_order` calls the function
once with the key ``None``.

:func:`read_log` reads a topic of a cluster's log (PostgreSQL) through Spark's JDBC source,
one Spark partition per topic partition, with PostgreSQL's JDBC driver at
:data:`POSTGRESQL_JDBC_JAR` (which :func:`local_session` puts on the session). Its one Python
UDF decodes message properties, stored as msgpack (:mod:`keyfailover.wire.properties`),
which neither PostgreSQL nor Spark reads.

Needs the ``[spark]`` extra (pyspark >= 4.1, pyarrow) and Java. Every expression is
correct with ANSI mode on (the default in Spark 4): the 32-bit arithmetic runs in bigint
with masking, and no product can overflow.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeAlias
from urllib.error import HTTPError, URLError
from urllib.parse import parse_qs, quote, urlsplit
from urllib.request import urlopen

from py4j.protocol import Py4JJavaError  # type: ignore[import-untyped]
from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as sf
from pyspark.sql.types import BinaryType, IntegralType, MapType, StringType, StructType

from keyfailover.core.errors import InvalidKeyError, LogError, RangeMapError, SnapshotError
from keyfailover.core.hashing import HASH_RANGE_SIZE
from keyfailover.core.ranges import RangeMap
from keyfailover.integrations._store import (
    StoreURL,
    check_topic,
    no_log_error,
    unknown_topic_error,
    unreadable_error,
)
from keyfailover.wire.properties import decode_properties

__all__ = [
    "POSTGRESQL_JDBC_JAR",
    "KeyFunction",
    "RangeMapSource",
    "load_range_map",
    "local_session",
    "owner_column",
    "partition_by_consumer",
    "partition_by_ranges",
    "process_in_key_order",
    "read_log",
    "with_key_hash",
    "with_range_id",
]

RangeMapSource: TypeAlias = RangeMap | Mapping[str, Any] | str | os.PathLike[str]
"""A :class:`RangeMap`, its snapshot dict, a snapshot JSON file, or a server's ``/ranges`` URL for one subscription."""

KeyFunction: TypeAlias = Callable[[Any, list[dict[str, Any]]], Iterable[Mapping[str, Any]]]
"""``fn(key, rows)`` of :func:`process_in_key_order`: one key's rows in order in, output rows out."""

# -- Murmur3 x86_32 in bigint arithmetic ---------------------------------------------------
#
# Spark's hash() is Murmur3 x86_32 with seed 42, and it mixes the 1-3 bytes after the last
# whole 4-byte block as separate blocks (SPARK-23381), so it matches the standard hash only
# when the length is a multiple of 4. with_key_hash therefore lets Spark hash the key
# zero-padded to whole blocks with seed 0, then in bigint arithmetic undoes Spark's final
# mix, its length step and the block step of the padded last block (which leaves exactly the
# standard tail mix applied), and finishes with the true length. A key of whole blocks is
# hashed as it is, with no copy: Spark's value is already the standard one.
#
# The steps are written as Spark SQL text, one parse per step: built operator by operator
# from Column objects they cost a py4j round trip each, and building the plan took the
# driver longer than hashing millions of rows took the executors (benchmarks/bench_spark.py).

_U32 = 0xFFFFFFFF
_C1, _C2 = 0xCC9E2D51, 0x1B873593  # block mixing constants
_C4 = 0xE6546B64  # added in every block step: h = rotl(h ^ k, 13) * 5 + _C4
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35  # final mix multipliers


def _inverse(c: int) -> int:
    return pow(c, -1, 1 << 32)


def _rotr(x: int, r: int) -> int:
    return ((x >> r) | (x << (32 - r))) & _U32


def _signed(c: int) -> int:
    """``c`` in [0, 2^32) as the signed 32-bit value with the same bits."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _int_hashing_to_zero(seed: int = 42) -> int:
    """The int ``v`` whose Spark ``hash(v)`` is 0, so ``hash(v, x)`` hashes ``x`` with seed 0.

    Spark's ``hashInt(v, seed) = fmix(rotl(seed ^ mixK1(v), 13) * 5 + _C4, 4)`` and fmix(0)
    is 0, so the step before fmix must give 4; every step is invertible mod 2^32.
    """
    h = (((4 - _C4) & _U32) * _inverse(5)) & _U32
    k = _rotr(h, 13) ^ seed
    k = _rotr((k * _inverse(_C2)) & _U32, 15)
    return _signed((k * _inverse(_C1)) & _U32)


_SEED_ZERO = _int_hashing_to_zero()


def _sql_name(name: str) -> str:
    """``name`` as a Spark SQL identifier of a top-level column: backquoted, its backquotes doubled."""
    return "`" + name.replace("`", "``") + "`"


def _sql_string(text: str) -> str:
    """``text`` as a Spark SQL string constant: its UTF-8 bytes in hex, so no parser setting changes it."""
    return f"CAST(X'{text.encode().hex()}' AS STRING)"


def _mul(x: str, c: int) -> str:
    """SQL for ``x * c mod 2^32``, ``x`` in [0, 2^32): ``c`` as a signed 32-bit value keeps |x * c| below 2^63."""
    return f"(({x} * ({_signed(c)})) & {_U32})"


def _xorshift(x: str, *shifts: int) -> str:
    """SQL for ``x ^ (x >> s1) ^ (x >> s2) ...``, ``x`` a non-negative bigint."""
    return "(" + " ^ ".join([x, *(f"shiftright({x}, {shift})" for shift in shifts)]) + ")"


def _rotr13(x: str) -> str:
    """SQL for ``x`` in [0, 2^32) rotated right by 13 bits."""
    return f"(shiftright({x}, 13) | (shiftleft({x}, 19) & {_U32}))"


def _fmix(x: str) -> str:
    """SQL for Murmur3's final mix of ``x`` in [0, 2^32)."""
    return _xorshift(_mul(_xorshift(_mul(_xorshift(x, 16), _F1), 13), _F2), 16)


def _fmix_undone(x: str) -> str:
    """SQL for the ``y`` whose final mix is ``x``: each step of :func:`_fmix` inverted, the last first."""
    return _xorshift(_mul(_xorshift(_mul(_xorshift(x, 16), _inverse(_F2)), 13, 26), _inverse(_F1)), 16)


def _zero_padded(key: str, binary: bool) -> str:
    """SQL for ``key`` followed by as many zero bytes as make whole 4-byte blocks; a key of whole blocks as it is."""
    zeros = [f"X'{'00' * count}'" if binary else f"CAST(X'{'00' * count}' AS STRING)" for count in (3, 2, 1)]
    return (
        f"CASE octet_length({key}) & 3 WHEN 0 THEN {key} WHEN 1 THEN concat({key}, {zeros[0]}) "
        f"WHEN 2 THEN concat({key}, {zeros[1]}) ELSE concat({key}, {zeros[2]}) END"
    )


def with_key_hash(df: DataFrame, key_col: str, out: str = "key_hash") -> DataFrame:
    """Add ``out``: the :func:`keyfailover.key_hash` slot of ``key_col``, an int in [0, 65535] or null.

    ``key_col`` is a string column (hashed as its UTF-8 bytes, whatever its collation) or a
    binary column, so a string and its UTF-8 bytes get the same slot. A null key gets a null
    slot. Built as four staged ``withColumn`` steps over bigint columns: the expensive values
    are columns of their own, so the plan never nests copies of them, and each step is one
    SQL expression, parsed in one call.
    """
    key_type = _column_type(df, key_col)
    if not isinstance(key_type, StringType | BinaryType):
        raise InvalidKeyError(f"key column {key_col!r} has type {key_type.simpleString()}; expected string or binary")
    key = _sql_name(key_col)
    length = f"octet_length({key})"
    binary = isinstance(key_type, BinaryType) or key_type.collation != "UTF8_BINARY"
    if not isinstance(key_type, BinaryType) and binary:
        key = f"CAST({key} AS BINARY)"  # Spark hashes a collated string by its collation's key, not its bytes
    names = [f"__kf_{out}_{step}" for step in ("v", "h", "d")]
    v, h, d = (_sql_name(name) for name in names)
    steps = [
        # Spark's Murmur3 of the zero-padded key with seed 0: v = fmix(H ^ padded length)
        (names[0], f"(CAST(hash({_SEED_ZERO}, {_zero_padded(key, binary)}) AS BIGINT) & {_U32})"),
        # H: the block loop's state, the padded last block's step included
        (names[1], f"({_fmix_undone(v)} ^ shiftleft(shiftright({length} + 3, 2), 2))"),
        # The standard tail and length: undo that last block step rotl(h ^ k, 13) * 5 + _C4 to
        # h ^ k, unless the key is whole blocks (its H is already the standard one), then ^ length.
        (
            names[2],
            f"(CASE WHEN ({length} & 3) = 0 THEN {h} ELSE "
            f"{_rotr13(_mul(f'(({h} + {(1 << 32) - _C4}) & {_U32})', _inverse(5)))} END ^ {length})",
        ),
        (out, f"CAST(({_fmix(d)} & 65535) AS INT)"),  # a null key has a null length, so a null slot
    ]
    for name, sql in steps:
        df = df.withColumn(name, sf.expr(sql))
    return df.drop(*names)


# -- range maps --------------------------------------------------------------------------


def load_range_map(source: RangeMapSource) -> RangeMap:
    """The :class:`RangeMap` of ``source``, checked to have ranges over the 65536 key-hash slots.

    ``source`` is a :class:`RangeMap`, a snapshot dict as ``RangeMap.snapshot()`` gives, the path
    of a snapshot JSON file, or the URL of a server's ``/ranges`` endpoint for one
    subscription (``http://HOST:PORT/ranges?topic=T&subscription=S``). Snapshots of version
    1 (one range per consumer) and 2 (several) are read.
    """
    if isinstance(source, RangeMap):
        found = source
    elif isinstance(source, Mapping):
        found = RangeMap.from_snapshot(source)
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        found = RangeMap.from_snapshot(_fetch_snapshot(source))
    elif isinstance(source, str | os.PathLike):
        found = RangeMap.from_snapshot(_read_snapshot(Path(source)))
    else:
        raise RangeMapError(
            f"range_map is a {type(source).__name__}; expected a RangeMap, a snapshot dict, "
            "the path of a snapshot JSON file or a /ranges URL"
        )
    if found.range_size != HASH_RANGE_SIZE:
        raise RangeMapError(
            f"the range map covers {found.range_size} slots; expected {HASH_RANGE_SIZE}, the slots key_hash gives"
        )
    if not len(found):
        raise RangeMapError("the range map is empty: no consumer owns a range; expected at least one")
    return found


def _read_snapshot(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SnapshotError(f"cannot read the range map snapshot {str(path)!r}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SnapshotError(f"the range map snapshot {str(path)!r} is not JSON: {exc}") from None


def _fetch_snapshot(url: str) -> Any:
    query = parse_qs(urlsplit(url).query)
    if "topic" not in query or "subscription" not in query:
        raise SnapshotError(
            f"the URL {url!r} names no subscription; expected a /ranges URL with ?topic=T&subscription=S"
        )
    try:
        with urlopen(url, timeout=10) as response:
            body = response.read()
    except HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace").strip()
        raise SnapshotError(f"{url}: HTTP {exc.code} {detail}") from None
    except (URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, URLError) else exc
        raise SnapshotError(f"cannot fetch the range map from {url}: {reason}") from None
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise SnapshotError(f"{url} did not answer JSON: {exc}") from None


_MAX_SEARCH_RANGES = 256
"""Up to this many ranges a binary search of comparisons finds a slot's range; above, a slot table does.

The comparisons compile to small generated code and cost log2(n) per row; with about 2000
ranges the code passes the JVM's 64 KB method limit and Spark falls back to interpreting it.
"""


def _range_index(hash_col: str, range_map: RangeMap, *, checked: bool) -> Column:
    """The index of the range holding ``hash_col``'s slot, null for a null slot; an int column.

    A binary search over the range ends (about log2 n integer comparisons per row), or for
    more than ``_MAX_SEARCH_RANGES`` ranges a lookup in a 65536-entry slot table literal; one
    SQL expression, parsed in one call. ``checked``: a slot outside [0, 65535] fails the query
    rather than landing in an edge range. Slots that :func:`with_key_hash` computed need no
    check, and leaving it out keeps an error branch out of every plan and generated stage.
    """
    slot = _sql_name(hash_col)
    if range_map.range_count() > _MAX_SEARCH_RANGES:
        found = f"element_at(from_json('{json.dumps(range_map.slot_owners().tolist())}', 'array<int>'), {slot} + 1)"
    else:
        ends, _ = range_map.lookup_table()

        def search(low: int, high: int) -> str:
            """A CASE expression finding the range among ``low`` to ``high`` that holds the slot, by halves."""
            if low == high:
                return str(low)
            middle = (low + high) // 2
            return f"CASE WHEN {slot} <= {ends[middle]} THEN {search(low, middle)} ELSE {search(middle + 1, high)} END"

        found = search(0, len(ends) - 1)
    if not checked:
        return sf.expr(f"CASE WHEN {slot} IS NULL THEN NULL ELSE {found} END")
    outside = (
        f"raise_error(concat({_sql_string(hash_col + ' ')}, CAST({slot} AS STRING), "
        f"{_sql_string(f' is not a key-hash slot; expected an int in [0, {HASH_RANGE_SIZE - 1}]')}))"
    )
    return sf.expr(
        f"CAST(CASE WHEN {slot} IS NULL THEN NULL WHEN {slot} BETWEEN 0 AND {HASH_RANGE_SIZE - 1} THEN {found} "
        f"ELSE {outside} END AS INT)"
    )


def _per_range(values: Sequence[Any], sql_type: str, range_index: Column) -> Column:
    """``values[range_index]`` (one value per range, in hash order), null for a null index."""
    return sf.element_at(sf.from_json(sf.lit(json.dumps(list(values))), f"array<{sql_type}>"), range_index + 1)


def _owner(hash_col: str, range_map: RangeMap, *, checked: bool) -> Column:
    """The consumer owning ``hash_col``'s slot, null for a null slot: the owner of its range."""
    _, owners = range_map.lookup_table()
    return _per_range(owners, "string", _range_index(hash_col, range_map, checked=checked))


def with_range_id(
    df: DataFrame, range_map: RangeMapSource, hash_col: str = "key_hash", out: str = "range_id"
) -> DataFrame:
    """Add ``out``: the index (in hash order, from 0) of the range holding ``hash_col``'s slot, or null.

    Ranges are numbered over the whole map, as :meth:`RangeMap.index_of` numbers them, so a
    consumer owning several ranges has several range ids. ``range_map`` is read once, now
    (see :func:`load_range_map` for its forms).
    """
    found = load_range_map(range_map)
    _check_slot_column(df, hash_col)
    return df.withColumn(out, _range_index(hash_col, found, checked=True))


def owner_column(
    df: DataFrame,
    range_map: RangeMapSource,
    key_col: str | None = None,
    *,
    hash_col: str = "key_hash",
    out: str = "owner",
) -> DataFrame:
    """Add ``out``: the consumer id owning each row's key, null for a null key.

    Every range of a consumer maps to it, however many it owns. With ``key_col`` the slot
    is computed from the key; without it ``hash_col`` must already hold the slots (as
    :func:`with_key_hash` adds them).
    """
    found = load_range_map(range_map)
    if key_col is None:
        _check_slot_column(df, hash_col)
        return df.withColumn(out, _owner(hash_col, found, checked=True))
    slot = f"__kf_{out}_slot"
    return with_key_hash(df, key_col, slot).withColumn(out, _owner(slot, found, checked=False)).drop(slot)


def partition_by_ranges(
    df: DataFrame,
    key_col: str,
    range_map: RangeMapSource,
    order_by: str | Sequence[str] | None = None,
    *,
    hash_col: str = "key_hash",
    range_col: str = "range_id",
) -> DataFrame:
    """Repartition so that partition i holds exactly the keys of range i, sorted by key, then ``order_by``.

    Range i is the i-th range in hash order over the whole map (:func:`with_range_id`), so a
    consumer owning several ranges has several partitions (:func:`partition_by_consumer`
    gives it one). One shuffle (``repartitionById``) and a sort within each partition,
    nothing else. The result has ``hash_col`` and ``range_col`` added and n + 1 partitions
    for a map of n ranges: the last holds the rows whose key is null (and is empty when
    there are none).
    """
    found = load_range_map(range_map)
    order = _order_columns(df, order_by)
    ranged = with_key_hash(df, key_col, hash_col).withColumn(range_col, _range_index(hash_col, found, checked=False))
    count = found.range_count()
    target = sf.expr(f"coalesce({_sql_name(range_col)}, {count})")
    return ranged.repartitionById(count + 1, target).sortWithinPartitions(key_col, *order)


def partition_by_consumer(
    df: DataFrame,
    key_col: str,
    range_map: RangeMapSource,
    order_by: str | Sequence[str] | None = None,
    *,
    hash_col: str = "key_hash",
    owner_col: str = "owner",
) -> DataFrame:
    """Repartition so that partition i holds exactly the keys of consumer i, sorted by key, then ``order_by``.

    Consumers are numbered as :meth:`RangeMap.consumers` lists them (in hash order of each
    one's first range), so each consumer's keys, from all its ranges, are in one partition,
    as one live consumer receives them. One shuffle and a sort within each partition, as
    :func:`partition_by_ranges`. The result has ``hash_col`` and ``owner_col`` (the consumer
    id) added and c + 1 partitions for c consumers: the last holds the rows whose key is null.
    """
    found = load_range_map(range_map)
    order = _order_columns(df, order_by)
    arrays = found.arrays()
    count = len(arrays.consumers)
    index_col = f"__kf_{owner_col}_index"
    index = sf.col(index_col)
    owned = with_key_hash(df, key_col, hash_col).withColumn(
        index_col, _per_range(arrays.owner.tolist(), "int", _range_index(hash_col, found, checked=False))
    )
    owned = owned.withColumn(owner_col, _per_range(arrays.consumers, "string", index))
    parted = owned.repartitionById(count + 1, sf.coalesce(index, sf.lit(count)))
    return parted.sortWithinPartitions(key_col, *order).drop(index_col)


def process_in_key_order(  # noqa: PLR0917  (the issue's positional signature)
    df: DataFrame,
    key_col: str,
    order_col: str | Sequence[str],
    fn: KeyFunction,
    range_map: RangeMapSource,
    schema: StructType | str,
    *,
    batch_rows: int = 10_000,
) -> DataFrame:
    """Call ``fn(key, rows)`` once per key, with that key's rows sorted by ``order_col``; return what it yields.

    ``rows`` is a list of dicts (column name to value) of ``df``'s columns; ``fn`` returns an
    iterable of mappings whose keys are exactly ``schema``'s field names. It runs inside the
    partitions of :func:`partition_by_ranges` (partition i holds range i) through
    ``mapInArrow``, grouping consecutive rows of a key: no second shuffle, so the result
    keeps that partitioning. Null keys are one group, called with the key ``None``.
    """
    import pyarrow as pa  # type: ignore[import-untyped]
    from pyspark.sql.pandas.types import to_arrow_schema

    if not callable(fn):
        raise TypeError(f"fn must be callable as fn(key, rows), not {type(fn).__name__}")
    if type(batch_rows) is not int or batch_rows < 1:
        raise ValueError(f"batch_rows must be an int >= 1, not {batch_rows!r}")
    out_schema = schema if isinstance(schema, StructType) else StructType.fromDDL(schema)
    if not isinstance(out_schema, StructType):
        raise ValueError(f"schema {schema!r} is not a struct of fields; expected e.g. 'key string, total long'")
    large = df.sparkSession.conf.get("spark.sql.execution.arrow.useLargeVarTypes", "false") == "true"
    arrow_schema = to_arrow_schema(out_schema, timezone="UTC", prefers_large_types=large)
    field_names = set(out_schema.names)
    columns = df.columns
    parted = partition_by_ranges(df, key_col, range_map, order_col, hash_col="__kf_hash", range_col="__kf_range")

    def output(rows: list[Mapping[str, Any]]) -> Any:
        """One Arrow batch of the output rows ``rows``."""
        return pa.RecordBatch.from_pylist(rows, schema=arrow_schema)

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        """One partition's batches in, ``fn``'s rows out: ``fn`` is called once per run of equal keys."""
        pending: list[Mapping[str, Any]] = []
        group: list[dict[str, Any]] = []
        group_key: Any = None

        def finish() -> None:
            """Call ``fn`` on the group just ended and queue its rows, each checked against the output schema."""
            results = fn(group_key, group)
            if not isinstance(results, Iterable):
                raise TypeError(
                    f"fn returned a {type(results).__name__} for key {group_key!r}; expected an iterable of mappings"
                )
            for row in results:
                if not isinstance(row, Mapping) or row.keys() != field_names:
                    shown = sorted(row) if isinstance(row, Mapping) else type(row).__name__
                    raise ValueError(
                        f"fn yielded {shown} for key {group_key!r}; expected a mapping with exactly the "
                        f"fields {sorted(field_names)}"
                    )
                pending.append(row)

        for batch in batches:
            records = batch.to_pylist()
            for record in records:
                key = record[key_col]
                if group and key != group_key:
                    finish()
                    group = []
                    if len(pending) >= batch_rows:
                        yield output(pending)
                        pending = []
                group_key = key
                group.append(record)
        if group:
            finish()
        if pending:
            yield output(pending)

    return parted.select(*columns).mapInArrow(run, out_schema)


def local_session(
    app_name: str, *, cores: int = 2, task_attempts: int = 1, config: Mapping[str, str] | None = None
) -> SparkSession:
    """A ``local[cores]`` SparkSession on loopback, without the web UI and progress bars (or the one running).

    Python workers run this interpreter unless ``PYSPARK_PYTHON`` names another (it is set
    when missing). ``task_attempts``: how often a failing task runs before its job fails; local
    mode runs it once unless told in the master URL, ``local[cores,attempts]``, where Spark reads it
    (``spark.task.maxFailures`` is not read in local mode). ``config`` adds or overrides Spark
    settings. When :data:`POSTGRESQL_JDBC_JAR` exists it goes first in ``spark.jars`` (before any jar
    ``config`` names), so :func:`read_log` can use it: a JVM takes its jars when it starts, not later.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    master = f"local[{cores}]" if task_attempts == 1 else f"local[{cores},{task_attempts}]"
    builder = SparkSession.builder.master(master).appName(app_name)
    settings = {
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        **(config or {}),
    }
    if POSTGRESQL_JDBC_JAR.exists():
        settings["spark.jars"] = ",".join(filter(None, [str(POSTGRESQL_JDBC_JAR), settings.get("spark.jars")]))
    for name, value in settings.items():
        builder = builder.config(name, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


# -- a cluster's log, through JDBC -------------------------------------------------------

POSTGRESQL_JDBC_JAR = Path("/usr/share/java/postgresql.jar")
"""PostgreSQL's JDBC driver where Debian's ``libpostgresql-jdbc-java`` installs it (``scripts/setup-system``)."""

_JDBC_DRIVER = "org.postgresql.Driver"
_UNDEFINED_TABLE = "42P01"  # PostgreSQL's SQLSTATE for a table that does not exist
_FETCH_ROWS = 10_000  # rows per round trip: the driver streams a partition instead of holding it whole


def read_log(spark: SparkSession, store_url: str, topic: str, *, binary_keys: bool = False) -> DataFrame:
    """The messages of ``topic`` in a cluster's log, read through Spark's JDBC source.

    ``store_url`` is the cluster's PostgreSQL, ``postgresql://user[:password]@host[:port]/database``.
    The columns are ``keyfailover export``'s with the partition first: ``partition`` (int),
    ``position`` (long), ``key`` (string, or binary with ``binary_keys``; null when keyless),
    ``payload`` (binary), ``producer`` (string, null without a name), ``seq`` (long, null),
    ``publish_time`` (timestamp, to the microsecond: when the broker stored the message, by its
    wall clock; null when unknown, stored before logs had publish times) and ``properties``
    (``map<string, string>``, empty for a message without them; decoded by a Python UDF, the
    only one here: Spark reads no msgpack).
    Spark partition i holds the topic's i-th partition (partition i of a topic created with
    P partitions), sorted by position, each read by its own query when the DataFrame is computed.

    The store, the topic and the JDBC driver are checked now: :class:`LogError` says which is
    wrong. Without ``binary_keys``, a key that is not UTF-8 text fails the computation,
    naming its partition and position.
    """
    store = StoreURL.parse(store_url)
    name = _sql_text(check_topic(topic))
    url = f"jdbc:postgresql://{store.address}/{quote(store.database, safe='')}"
    properties = {"driver": _JDBC_DRIVER, "user": store.user, "connectTimeout": "10", "fetchsize": str(_FETCH_ROWS)}
    if store.password is not None:
        properties["password"] = store.password

    def query(sql: str) -> list[Any]:
        return spark.read.format("jdbc").options(url=url, query=sql, **properties).load().collect()

    with _jdbc_errors(store):
        partitions = sorted(int(row[0]) for row in query(f"SELECT partition FROM kf_partitions WHERE topic = {name}"))
        if not partitions:
            topics = sorted(str(row[0]) for row in query("SELECT DISTINCT topic FROM kf_partitions"))
            raise unknown_topic_error(store, topic, topics)
        predicates = [f"topic = {name} AND partition = {partition}" for partition in partitions]
        messages = spark.read.jdbc(url, "kf_messages", predicates=predicates, properties=properties)
    key = sf.col("key")
    if not binary_keys:
        text = key.cast("string")
        not_text = sf.concat(
            sf.lit("the key 0x"),
            sf.hex(key),
            sf.lit(" at position "),
            sf.col("position").cast("string"),
            sf.lit(" of partition "),
            sf.col("partition").cast("string"),
            sf.lit(" is not UTF-8 text; read_log with binary_keys=True keeps keys as bytes"),
        )
        key = sf.when(key.isNull() | sf.is_valid_utf8(text), text).otherwise(sf.raise_error(not_text))
    publish_time = sf.timestamp_micros("publish_time").alias("publish_time")  # the log's µs since the epoch
    columns: list[Column | str] = [
        "partition",
        "position",
        key.alias("key"),
        "payload",
        "producer",
        "seq",
        publish_time,
        _decoded_properties(sf.col("properties")).alias("properties"),
    ]
    return messages.select(*columns).sortWithinPartitions("position")


def _decoded_properties(encoded: Column) -> Column:
    """The map of each row's encoded properties (:mod:`keyfailover.wire.properties`), empty for null: a Python
    UDF that exchanges its rows with the JVM as Arrow batches."""
    decode = sf.udf(_row_properties, MapType(StringType(), StringType(), valueContainsNull=False), useArrow=True)
    return decode(encoded)


def _row_properties(data: bytes | None) -> dict[str, str]:
    return decode_properties(None if data is None else bytes(data))


def _sql_text(text: str) -> str:
    """``text`` as a PostgreSQL escape-string literal, which reads the same whatever the server's settings."""
    return "E'" + text.replace("\\", "\\\\").replace("'", "''") + "'"


@contextmanager
def _jdbc_errors(store: StoreURL) -> Iterator[None]:
    """Turn a failed JDBC read into a :class:`LogError` saying what was missing, without a Java stack trace."""
    try:
        yield
    except (PySparkException, Py4JJavaError) as exc:
        cause = _java_cause(exc)
        if cause is None:
            raise unreadable_error(store, str(exc).partition("\n")[0]) from None
        kind, reason = str(cause.getClass().getName()), str(cause.getMessage())
        if kind == "java.lang.ClassNotFoundException" and _JDBC_DRIVER in reason:
            raise LogError(
                f"this SparkSession cannot load PostgreSQL's JDBC driver ({_JDBC_DRIVER}); expected "
                f"{POSTGRESQL_JDBC_JAR} in its spark.jars from its start (local_session puts it there when the "
                "file exists; scripts/setup-system installs it from Debian's libpostgresql-jdbc-java)"
            ) from None
        if kind == "org.postgresql.util.PSQLException" and cause.getSQLState() == _UNDEFINED_TABLE:
            raise no_log_error(store) from None
        raise unreadable_error(store, reason) from None


def _java_cause(exc: Exception) -> Any:
    """The innermost Java exception behind ``exc``, None when it carries none (as under Spark Connect)."""
    # py4j keeps it as java_exception; PySpark's captured exceptions (AnalysisException...) as _origin.
    throwable = getattr(exc, "java_exception", None)
    if throwable is None:
        throwable = getattr(exc, "_origin", None)
    while throwable is not None and throwable.getCause() is not None:
        throwable = throwable.getCause()
    return throwable


# -- checks ------------------------------------------------------------------------------


def _order_columns(df: DataFrame, order_by: str | Sequence[str] | None) -> list[str]:
    """``order_by`` as a list of column names, each checked to be in ``df``."""
    order = [order_by] if isinstance(order_by, str) else list(order_by or [])
    for name in order:
        _column_type(df, name)
    return order


def _column_type(df: DataFrame, name: str) -> Any:
    if not isinstance(name, str):
        raise InvalidKeyError(f"a column is named by a str, not {type(name).__name__}")
    for field in df.schema.fields:
        if field.name == name:
            return field.dataType
    raise InvalidKeyError(f"column {name!r} is not in the DataFrame; its columns are {df.columns}")


def _check_slot_column(df: DataFrame, hash_col: str) -> None:
    """An InvalidKeyError unless ``hash_col`` of ``df`` is an integer column, as slots are."""
    found = _column_type(df, hash_col)
    if not isinstance(found, IntegralType):
        raise InvalidKeyError(
            f"hash column {hash_col!r} has type {found.simpleString()}; expected an integer column "
            "of key-hash slots (see with_key_hash)"
        )
