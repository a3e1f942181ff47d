"""Export one topic of a server's embedded log, or of a cluster's log, to Parquet or JSON lines, for batch jobs (Spark).

:func:`export_topic` reads the data directory's log through a :class:`~keyfailover.broker.storage.LogSnapshot`:
a consistent snapshot of the topic as of the last commit before it started, safe while
``keyfailover serve`` runs on the same directory (the server's LOCK file is left alone).
:func:`export_store_topic` reads a cluster's PostgreSQL log with asyncpg, in one read-only
repeatable-read transaction (a snapshot as of its start), through a cursor, a chunk at a time.

Every message becomes one row: ``position`` (int64), ``key`` (UTF-8 text, or binary with
``binary_keys=True``; null for a keyless message), ``payload`` (binary), ``producer`` (the
producer name, null when it had none), ``seq`` (its sequence id), ``publish_time`` (when
the broker stored it, by its wall clock, to the microsecond; null when unknown: stored before
logs had publish times) and ``properties`` (its str keys and values; empty when it has none);
a cluster's export starts each row with its ``partition`` (int32), in (partition, position)
order. Parquet files hold those types (``publish_time`` a UTC timestamp in microseconds, Spark's
``timestamp``; ``properties`` a ``map<string, string>``); a JSON line holds the payload, and a
binary key, in base64, the publish time in ISO 8601 UTC (``2025-06-01T12:34:56.789012Z``) and the
properties as an object.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

from keyfailover.broker.storage.records import ExportRow, Key
from keyfailover.broker.storage.sqlite import LOG_FILE_NAME, LogSnapshot
from keyfailover.core.errors import InvalidKeyError, LogError, LogFileError
from keyfailover.core.loops import new_loop
from keyfailover.integrations._store import (
    StoreURL,
    check_topic,
    close_store,
    connect_store,
    run_store_step,
    unknown_topic_error,
)
from keyfailover.wire.properties import decode_properties

__all__ = ["ExportResult", "StoreExportResult", "export_store_topic", "export_topic"]

Format = Literal["parquet", "jsonl"]

StoreRow = tuple[int, int, Key, bytes, str | None, int | None, int | None, dict[str, str]]
"""``(partition, position, key, payload, producer name or None, sequence id or None, publish time or None,
properties)``: one row of a cluster's log (the publish time in microseconds since the Unix epoch)."""
LogRow = tuple[int, Key, bytes, str | None, int | None, int | None, dict[str, str]]
"""``(position, key, payload, producer name or None, sequence id or None, publish time or None, properties)``:
one row of a data directory's log."""

_T = TypeVar("_T")
_Row = tuple[Any, ...]

_LOG_COLUMNS = ("position", "key", "payload", "producer", "seq", "publish_time", "properties")
_STORE_COLUMNS = ("partition", *_LOG_COLUMNS)
_CHUNK_ROWS = 65_536
_ROWS_PER_FILE = 1_000_000
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What :func:`export_topic` wrote."""

    topic: str
    messages: int
    first_position: int | None
    """None when the topic held no message."""
    last_position: int | None
    files: list[Path]


@dataclass(frozen=True, slots=True)
class StoreExportResult:
    """What :func:`export_store_topic` wrote."""

    topic: str
    messages: int
    partitions: int
    """The topic's partitions in the log (some may hold no message)."""
    files: list[Path]


def export_topic(
    data_dir: str | Path,
    topic: str,
    out_dir: str | Path,
    format: Format = "parquet",
    *,
    binary_keys: bool = False,
    rows_per_file: int = _ROWS_PER_FILE,
) -> ExportResult:
    """Write every message of ``topic`` in ``data_dir``'s log to ``out_dir``, in position order.

    ``out_dir`` is created and must be new or empty; it receives ``part-00000.parquet``
    (or ``.jsonl``), ``part-00001`` ... with up to ``rows_per_file`` messages each. Keys
    are text unless ``binary_keys``; a key that is not UTF-8 text then raises
    :class:`InvalidKeyError`. On any error the files written so far are removed.
    """
    out = _output_folder(out_dir, format, rows_per_file)
    snapshot = LogSnapshot(Path(data_dir) / LOG_FILE_NAME)
    try:
        chunks = _chunks(snapshot.messages(topic, _CHUNK_ROWS), binary_keys)
        parts = _write(
            out, chunks, format=format, rows_per_file=rows_per_file, columns=_LOG_COLUMNS, binary_keys=binary_keys
        )
    finally:
        snapshot.close()
    first, last = (None, None) if parts.first is None or parts.last is None else (parts.first[0], parts.last[0])
    return ExportResult(topic, parts.messages, first, last, parts.files)


def export_store_topic(
    store_url: str,
    topic: str,
    out_dir: str | Path,
    format: Format = "parquet",
    *,
    binary_keys: bool = False,
    rows_per_file: int = _ROWS_PER_FILE,
) -> StoreExportResult:
    """Write every message of ``topic`` in a cluster's log to ``out_dir``, in (partition, position) order.

    ``store_url`` is the cluster's PostgreSQL, ``postgresql://user[:password]@host[:port]/database``
    (without a password, asyncpg reads ``PGPASSWORD`` or ``~/.pgpass``). The files are
    :func:`export_topic`'s with a ``partition`` column first; :class:`LogError` says when the
    store cannot be read, holds no log or has no such topic.
    """
    store = StoreURL.parse(store_url)
    check_topic(topic)
    out = _output_folder(out_dir, format, rows_per_file)
    with _StoreReader(store) as reader:
        partitions = reader.partitions(topic)
        chunks = reader.chunks(topic, binary_keys)
        parts = _write(
            out, chunks, format=format, rows_per_file=rows_per_file, columns=_STORE_COLUMNS, binary_keys=binary_keys
        )
    return StoreExportResult(topic, parts.messages, partitions, parts.files)


def _output_folder(out_dir: str | Path, format: Format, rows_per_file: int) -> Path:
    """``out_dir``, checked to be new or empty, after the options are checked."""
    if format not in ("parquet", "jsonl"):
        raise LogError(f"format must be 'parquet' or 'jsonl', not {format!r}")
    if type(rows_per_file) is not int or rows_per_file < 1:
        raise LogError(f"rows_per_file must be an int >= 1, not {rows_per_file!r}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LogFileError(f"the output folder {str(out)!r} is not empty; expected a new or empty folder")
    return out


def _write(
    out: Path,
    chunks: Iterable[Sequence[_Row]],
    *,
    format: Format,
    rows_per_file: int,
    columns: tuple[str, ...],
    binary_keys: bool,
) -> _Parts:
    """Write ``chunks`` of rows of ``columns`` as part files in ``out``; on any error remove what was written."""
    parts = _Parts(out, format, rows_per_file)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        if format == "parquet":
            _write_parquet(chunks, parts, columns, binary_keys)
        else:
            _write_jsonl(chunks, parts, columns)
    except BaseException:
        for path in parts.files:
            path.unlink(missing_ok=True)
        if created and out.is_dir():
            out.rmdir()
        raise
    return parts


def _chunks(rows: Iterator[ExportRow], binary_keys: bool) -> Iterator[list[LogRow]]:
    """Rows in lists of up to ``_CHUNK_ROWS``, keys converted to text or to bytes, properties decoded."""
    chunk: list[LogRow] = []
    for position, key, payload, producer, seq, publish_time, properties in rows:
        chunk.append(
            (
                position,
                _key(key, position, binary_keys),
                payload,
                producer,
                seq,
                publish_time,
                decode_properties(properties),
            )
        )
        if len(chunk) == _CHUNK_ROWS:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _key(key: Key, position: int, binary_keys: bool, partition: int | None = None) -> Key:
    if key is None:
        return None
    if binary_keys:
        return key.encode() if isinstance(key, str) else key
    if isinstance(key, str):
        return key
    try:
        return key.decode()
    except UnicodeDecodeError:
        where = f"position {position}" if partition is None else f"position {position} of partition {partition}"
        raise InvalidKeyError(
            f"the key {key!r} at {where} is not UTF-8 text; export with binary keys "
            "(--binary-keys) to keep keys as bytes"
        ) from None


class _StoreReader:
    """One read-only, repeatable-read transaction on a cluster's log, driven from synchronous code on its own loop."""

    def __init__(self, store: StoreURL) -> None:
        self._store = store
        self._runner = asyncio.Runner(loop_factory=new_loop)
        self._connection: Any = None

    def __enter__(self) -> _StoreReader:
        store = self._store
        try:
            self._connection = connect_store(self._runner, store, 10)
            self._run(self._connection.transaction(isolation="repeatable_read", readonly=True).start())
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._close()

    def partitions(self, topic: str) -> int:
        """How many partitions ``topic`` has in the log; :class:`LogError` lists the topics there when none."""
        found = self._run(self._connection.fetch("SELECT partition FROM kf_partitions WHERE topic = $1", topic))
        if not found:
            topics = self._run(self._connection.fetch("SELECT DISTINCT topic FROM kf_partitions ORDER BY topic"))
            raise unknown_topic_error(self._store, topic, [str(row[0]) for row in topics])
        return len(found)

    def chunks(self, topic: str, binary_keys: bool) -> Iterator[list[StoreRow]]:
        """Every message of ``topic`` in (partition, position) order, ``_CHUNK_ROWS`` at a time from a cursor."""
        cursor = self._run(
            self._connection.cursor(
                """SELECT partition, position, key, payload, producer, seq, publish_time, properties FROM kf_messages
                   WHERE topic = $1 ORDER BY partition, position""",
                topic,
            )
        )
        while records := self._run(cursor.fetch(_CHUNK_ROWS)):
            yield [
                (
                    partition,
                    position,
                    _key(key, position, binary_keys, partition),
                    payload,
                    producer,
                    seq,
                    at,
                    decode_properties(properties),
                )
                for partition, position, key, payload, producer, seq, at, properties in records
            ]

    def _run(self, step: Awaitable[_T]) -> _T:
        """Run one step of the conversation; a failure of the store becomes a :class:`LogError` saying so."""
        return run_store_step(self._runner, self._store, step)

    def _close(self) -> None:
        """Close the connection (its transaction read, so ending it any way loses nothing) and the loop."""
        close_store(self._runner, self._connection)


class _Parts:
    """Numbered part files in ``out``, each of up to ``rows_per_file`` rows; counts what goes into them."""

    def __init__(self, out: Path, suffix: str, rows_per_file: int) -> None:
        self.out, self.suffix, self.rows_per_file = out, suffix, rows_per_file
        self.files: list[Path] = []
        self.room = 0  # rows the current file still takes; the first row opens the first file
        self.messages = 0
        self.first: _Row | None = None
        self.last: _Row | None = None

    def write(
        self,
        chunks: Iterable[Sequence[_Row]],
        open_file: Callable[[Path], Any],
        write: Callable[[Any, Sequence[_Row]], None],
    ) -> None:
        """Write every chunk with ``write(file, rows)``, opening each part with ``open_file(path)`` and closing it."""
        current: Any = None
        try:
            for chunk in chunks:
                for opened, piece in self._split(chunk):
                    if opened is not None:
                        if current is not None:
                            current.close()
                        current = open_file(opened)
                    write(current, piece)
        finally:
            if current is not None:
                current.close()

    def _split(self, chunk: Sequence[_Row]) -> Iterator[tuple[Path | None, Sequence[_Row]]]:
        """Pieces of ``chunk`` for one file each, with the path of the file to open first (None: keep writing)."""
        self.first = chunk[0] if self.first is None else self.first
        self.last = chunk[-1]
        self.messages += len(chunk)
        while chunk:
            opened = None
            if not self.room:
                opened = self.out / f"part-{len(self.files):05d}.{self.suffix}"
                self.files.append(opened)
                self.room = self.rows_per_file
            piece, chunk = chunk[: self.room], chunk[self.room :]
            self.room -= len(piece)
            yield opened, piece


def _write_parquet(
    chunks: Iterable[Sequence[_Row]], parts: _Parts, columns: tuple[str, ...], binary_keys: bool
) -> None:
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    types = {
        "partition": (pa.int32(), False),
        "position": (pa.int64(), False),
        "key": (pa.binary() if binary_keys else pa.string(), True),
        "payload": (pa.binary(), False),
        "producer": (pa.string(), True),
        "seq": (pa.int64(), True),
        "publish_time": (pa.timestamp("us", tz="UTC"), True),  # built from the log's microseconds as they are
        "properties": (pa.map_(pa.string(), pa.string()), False),  # empty for a message without
    }
    schema = pa.schema([pa.field(name, *types[name]) for name in columns])

    def write(writer: Any, piece: Sequence[_Row]) -> None:
        values = zip(*piece, strict=True)
        arrays = [pa.array(column, type=field.type) for column, field in zip(values, schema, strict=True)]
        writer.write_table(pa.Table.from_arrays(arrays, schema=schema))

    parts.write(chunks, lambda path: pq.ParquetWriter(path, schema), write)


def _write_jsonl(chunks: Iterable[Sequence[_Row]], parts: _Parts, columns: tuple[str, ...]) -> None:
    parts.write(
        chunks,
        lambda path: path.open("w", encoding="utf-8"),
        lambda sink, piece: sink.writelines(_json_line(columns, row) for row in piece),
    )


def _json_line(columns: tuple[str, ...], row: _Row) -> str:
    """One row as a JSON object of ``columns``, its bytes (payload, a binary key) in base64, its publish
    time in ISO 8601 UTC."""
    record = {name: _json_value(name, value) for name, value in zip(columns, row, strict=True)}
    return json.dumps(record, ensure_ascii=False) + "\n"


def _json_value(column: str, value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if column == "publish_time" and value is not None:  # microseconds since the Unix epoch
        moment = _EPOCH + dt.timedelta(microseconds=value)
        return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")
    return value
