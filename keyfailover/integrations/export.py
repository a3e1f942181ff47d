"""Export one topic of a server's embedded log to Parquet or JSON lines, for batch jobs (Spark).

The export reads the data directory's log through a :class:`~keyfailover.broker.storage.LogSnapshot`:
a consistent snapshot of the topic as of the last commit before it started, safe while
``keyfailover serve`` runs on the same directory (the server's LOCK file is left alone).

Every message becomes one row: ``position`` (int64), ``key`` (UTF-8 text, or binary with
``binary_keys=True``; null for a keyless message), ``payload`` (binary), ``producer`` (the
producer name, null when it had none) and ``seq`` (its sequence id). The log stores no
publish time. Parquet files hold those types; a JSON line holds the payload, and a binary
key, in base64.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from keyfailover.broker.storage.sqlite import LOG_FILE_NAME, ExportRow, Key, LogSnapshot
from keyfailover.core.errors import InvalidKeyError, LogError, LogFileError

__all__ = ["ExportResult", "export_topic"]

Format = Literal["parquet", "jsonl"]

_CHUNK_ROWS = 65_536
_ROWS_PER_FILE = 1_000_000


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What :func:`export_topic` wrote."""

    topic: str
    messages: int
    first_position: int | None
    """None when the topic held no message."""
    last_position: int | None
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
    if format not in ("parquet", "jsonl"):
        raise LogError(f"format must be 'parquet' or 'jsonl', not {format!r}")
    if type(rows_per_file) is not int or rows_per_file < 1:
        raise LogError(f"rows_per_file must be an int >= 1, not {rows_per_file!r}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LogFileError(f"the output folder {str(out)!r} is not empty; expected a new or empty folder")
    snapshot = LogSnapshot(Path(data_dir) / LOG_FILE_NAME)
    files: list[Path] = []
    parts = _Parts(out, format, rows_per_file, files)
    created = not out.exists()
    try:
        chunks = _chunks(snapshot.messages(topic, _CHUNK_ROWS), binary_keys)
        out.mkdir(parents=True, exist_ok=True)
        if format == "parquet":
            _write_parquet(chunks, parts, binary_keys)
        else:
            _write_jsonl(chunks, parts)
    except BaseException:
        for path in files:
            path.unlink(missing_ok=True)
        if created and out.is_dir():
            out.rmdir()
        raise
    finally:
        snapshot.close()
    return ExportResult(topic, parts.messages, parts.first, parts.last, files)


def _chunks(rows: Iterator[ExportRow], binary_keys: bool) -> Iterator[list[ExportRow]]:
    """Rows in lists of up to ``_CHUNK_ROWS``, keys converted to text or to bytes."""
    chunk: list[ExportRow] = []
    for position, key, payload, producer, seq in rows:
        chunk.append((position, _key(key, position, binary_keys), payload, producer, seq))
        if len(chunk) == _CHUNK_ROWS:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _key(key: Key, position: int, binary_keys: bool) -> Key:
    if key is None:
        return None
    if binary_keys:
        return key.encode() if isinstance(key, str) else key
    if isinstance(key, str):
        return key
    try:
        return key.decode()
    except UnicodeDecodeError:
        raise InvalidKeyError(
            f"the key {key!r} at position {position} is not UTF-8 text; export with binary keys "
            "(--binary-keys) to keep keys as bytes"
        ) from None


class _Parts:
    """Numbered part files in ``out``, each of up to ``rows_per_file`` rows; counts what goes into them."""

    def __init__(self, out: Path, suffix: str, rows_per_file: int, files: list[Path]) -> None:
        self.out, self.suffix, self.rows_per_file, self.files = out, suffix, rows_per_file, files
        self.room = 0  # rows the current file still takes; the first row opens the first file
        self.messages = 0
        self.first: int | None = None
        self.last: int | None = None

    def write(
        self,
        chunks: Iterable[list[ExportRow]],
        open_file: Callable[[Path], Any],
        write: Callable[[Any, list[ExportRow]], None],
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

    def _split(self, chunk: list[ExportRow]) -> Iterator[tuple[Path | None, list[ExportRow]]]:
        """Pieces of ``chunk`` for one file each, with the path of the file to open first (None: keep writing)."""
        self.first = chunk[0][0] if self.first is None else self.first
        self.last = chunk[-1][0]
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


def _write_parquet(chunks: Iterable[list[ExportRow]], parts: _Parts, binary_keys: bool) -> None:
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    schema = pa.schema(
        [
            pa.field("position", pa.int64(), nullable=False),
            pa.field("key", pa.binary() if binary_keys else pa.string()),
            pa.field("payload", pa.binary(), nullable=False),
            pa.field("producer", pa.string()),
            pa.field("seq", pa.int64()),
        ]
    )

    def write(writer: Any, piece: list[ExportRow]) -> None:
        columns = zip(*piece, strict=True)
        arrays = [pa.array(column, type=field.type) for column, field in zip(columns, schema, strict=True)]
        writer.write_table(pa.Table.from_arrays(arrays, schema=schema))

    parts.write(chunks, lambda path: pq.ParquetWriter(path, schema), write)


def _write_jsonl(chunks: Iterable[list[ExportRow]], parts: _Parts) -> None:
    parts.write(
        chunks,
        lambda path: path.open("w", encoding="utf-8"),
        lambda sink, piece: sink.writelines(_json_line(*row) for row in piece),
    )


def _json_line(position: int, key: Key, payload: bytes, producer: str | None, seq: int | None) -> str:
    record = {
        "position": position,
        "key": base64.b64encode(key).decode() if isinstance(key, bytes) else key,
        "payload": base64.b64encode(payload).decode(),
        "producer": producer,
        "seq": seq,
    }
    return json.dumps(record, ensure_ascii=False) + "\n"
