"""The exactly-once Spark sink: ``df.write.format("keyfailover")`` and ``df.writeStream.format("keyfailover")``.

Theory of operation: each Spark task sends its rows as a *named producer* with *sequence ids of
its own*, so the broker, which stores a producer's message of a given sequence id once per topic
partition, stores a task's rows once however often Spark runs the task again: a retried task, or
a micro-batch replayed after a restart from its checkpoint, sends the same rows under the same
name with the same sequence ids, and what was stored before comes back as a duplicate.

- A stream's producer for Spark partition p is ``{producerName}-{query id}-{p}``: the query id is
  kept in the checkpoint, so a restarted query has the same names; the row of index i of batch b
  has the sequence id ``b * 2**32 + i``. One name per query and Spark partition, not per batch: the
  broker keeps a row per producer name and topic partition, which would otherwise grow by one
  every batch; the ids skip between batches, which the broker's deduplication accepts.
- A batch write's producer for partition p is ``{producerName}-{writeId}-{p}``, and row i has the
  sequence id i. ``writeId`` is a random UUID drawn once per write, the same for every attempt of
  its tasks; given as an option, a job run again writes under the same names and stores nothing new.

The names and ids hold a row to its place only when a task sees the same rows in the same order
each time it runs: a deterministic source and plan, as for any idempotent Spark sink. Every row
goes to its key's topic partition (keyless rows round robin, counted from the task's first row),
and a task commits only when the broker confirmed every one of its rows. Rows stored by a task
that failed are visible before its batch commits: the sink is idempotent, not transactional.

Options and columns are checked when Spark plans the write, on the driver, before any row is
sent; a task fails on a row it cannot send (a null payload) with the row's index.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceStreamWriter,
    DataSourceWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import BinaryType, DataType, MapType, StringType, StructType

from keyfailover.client import Client, ServerError
from keyfailover.client.aio import parse_url
from keyfailover.core.errors import ConfigError, ErrorCode, KeyFailoverError
from keyfailover.wire.protocol import MAX_NAME_LENGTH, check_name

__all__ = [
    "ROW_BITS",
    "SINK_OPTIONS",
    "KeyFailoverStreamWriter",
    "KeyFailoverWriter",
    "SinkCommit",
    "SinkSettings",
    "batch_writer",
    "producer_name",
    "sequence_id",
    "sink_settings",
    "stream_writer",
]

SINK_OPTIONS = ("url", "topic", "token", "tlsCa", "producerName", "writeId", "sendTimeout")
"""The options the sink takes (Spark hands them over lower-cased; they are matched so)."""

_SPARK_OPTIONS = ("checkpointLocation",)
"""Options of Spark's own that it hands to a stream's sink with the user's: the sink leaves them alone."""

ROW_BITS = 32
"""A stream's sequence id is ``batch id << ROW_BITS | row index``: up to 2**32 rows a task, 2**31 batches."""

_MAX_BATCH_ID = (2**63 - 1) >> ROW_BITS
_MAX_ROWS = 1 << ROW_BITS
_MAX_PARTITION = 2**31 - 1  # a Spark partition id is an int
_DEFAULT_PRODUCER_NAME = "spark"
_DEFAULT_SEND_TIMEOUT = 60.0
_MAX_PENDING = 20_000  # rows a task has sent and the broker not yet confirmed, before it waits
_QUERY_ID = "sql.streaming.queryId"  # local properties Spark sets on a micro-batch's jobs
_BATCH_ID = "streaming.sql.batchId"
_URL_FORM = "kf://HOST:PORT[,HOST:PORT...] or kf+ssl://HOST:PORT[,...]"
_KEY_TYPES = "string or binary"
_PAYLOAD_TYPES = "binary or string"
_PROPERTIES_TYPE = "map<string,string>"


@dataclass(frozen=True)
class SinkSettings:
    """A write's checked options and where its columns are in each row."""

    url: str
    topic: str
    token: str | None
    tls_ca: str | None
    producer_name: str
    send_timeout: float
    key: int | None
    """The index of the ``key`` column; None: there is none, every row is keyless."""
    payload: int
    payload_is_text: bool
    properties: int | None
    """The index of the ``properties`` column; None: there is none."""


@dataclass(frozen=True)
class SinkCommit(WriterCommitMessage):
    """What a task sent, once the broker confirmed all of it: its producer and how many rows."""

    producer: str
    rows: int


def producer_name(base: str, run: str, partition: int) -> str:
    """The name a task of Spark partition ``partition`` produces as: ``{base}-{run}-{partition}``, where
    ``run`` is a stream's query id or a batch write's ``writeId``."""
    return f"{base}-{run}-{partition}"


def sequence_id(batch: int, row: int) -> int:
    """The sequence id of the row of index ``row`` in micro-batch ``batch`` (0 for a batch write)."""
    if not 0 <= batch <= _MAX_BATCH_ID:
        raise KeyFailoverError(
            f"batch id {batch} is beyond the sink's sequence ids; expected at most {_MAX_BATCH_ID} batches"
        )
    if not 0 <= row < _MAX_ROWS:
        raise KeyFailoverError(f"a task has over {_MAX_ROWS} rows; expected at most 2**{ROW_BITS} rows a Spark task")
    return batch << ROW_BITS | row


def _option(options: Mapping[str, str], name: str) -> str | None:
    """The value of option ``name``, None when not given."""
    value = options.get(name.lower())
    return None if value is None else str(value)


def _column_error(name: str, found: DataType, expected: str) -> ConfigError:
    """The error for column ``name`` of type ``found``."""
    return ConfigError(f"column {name!r} has type {found.simpleString()}; expected {expected}")


def _columns(schema: StructType) -> tuple[int | None, int, bool, int | None]:
    """``(key index, payload index, payload is text, properties index)`` of ``schema``, checked."""
    names = [field.name.lower() for field in schema.fields]
    unknown = [field.name for field in schema.fields if field.name.lower() not in ("key", "payload", "properties")]
    if unknown:
        raise ConfigError(
            f"the keyfailover sink takes the columns key ({_KEY_TYPES}, optional), payload ({_PAYLOAD_TYPES}) and "
            f"properties ({_PROPERTIES_TYPE}, optional); the DataFrame also has {unknown}: select or drop them"
        )
    if len(set(names)) != len(names):
        raise ConfigError(f"the DataFrame has a column twice: {schema.fieldNames()}; expected each once")
    if "payload" not in names:
        raise ConfigError(
            f"the DataFrame has no column 'payload'; expected payload ({_PAYLOAD_TYPES}), with key ({_KEY_TYPES}) "
            f"and properties ({_PROPERTIES_TYPE}) optional; its columns are {schema.fieldNames()}"
        )
    fields = {field.name.lower(): (index, field) for index, field in enumerate(schema.fields)}
    key = fields.get("key")
    if key is not None and not isinstance(key[1].dataType, StringType | BinaryType):
        raise _column_error(key[1].name, key[1].dataType, _KEY_TYPES)
    payload_index, payload = fields["payload"]
    if not isinstance(payload.dataType, BinaryType | StringType):
        raise _column_error(payload.name, payload.dataType, _PAYLOAD_TYPES)
    properties = fields.get("properties")
    if properties is not None:
        kind = properties[1].dataType
        if not (
            isinstance(kind, MapType)
            and isinstance(kind.keyType, StringType)
            and isinstance(kind.valueType, StringType)
        ):
            raise _column_error(properties[1].name, kind, _PROPERTIES_TYPE)
    return (
        None if key is None else key[0],
        payload_index,
        isinstance(payload.dataType, StringType),
        None if properties is None else properties[0],
    )


def _send_timeout(options: Mapping[str, str]) -> float:
    """The ``sendTimeout`` option in seconds, checked; its default when not given."""
    text = _option(options, "sendTimeout")
    if text is None:
        return _DEFAULT_SEND_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"option 'sendTimeout' is {text!r}; expected a number of seconds above 0")
    return seconds


def sink_settings(options: Mapping[str, str], schema: StructType, *, streaming: bool) -> SinkSettings:
    """The settings of a write with ``options`` (as Spark gives them, keys lower-cased) of rows of ``schema``.

    :class:`ConfigError` names the option or the column that is wrong and says what was expected.
    """
    known = {name.lower() for name in (*SINK_OPTIONS, *_SPARK_OPTIONS)}
    unknown = sorted(name for name in options if name.lower() not in known)
    if unknown:
        raise ConfigError(
            f"the keyfailover sink has no option {unknown[0]!r}; expected options from {list(SINK_OPTIONS)}"
        )
    url = _option(options, "url")
    if url is None:
        raise ConfigError(f"option 'url' is missing; expected the keyfailover server's URL, {_URL_FORM}")
    try:
        _, tls = parse_url(url)
    except KeyFailoverError as exc:
        raise ConfigError(f"option 'url': {exc}") from None
    topic = _option(options, "topic")
    if topic is None:
        raise ConfigError("option 'topic' is missing; expected the name of the topic to write to")
    try:
        check_name("option 'topic'", topic)
    except KeyFailoverError as exc:
        raise ConfigError(str(exc)) from None
    tls_ca = _option(options, "tlsCa")
    if tls_ca is not None and not tls:
        raise ConfigError(f"option 'tlsCa' is given but option 'url' {url!r} is plain TCP; expected a kf+ssl:// URL")
    if streaming and _option(options, "writeId") is not None:
        raise ConfigError(
            "option 'writeId' is for batch writes; a stream's producers are named after its query id, kept in its "
            "checkpoint"
        )
    base = _option(options, "producerName") or _DEFAULT_PRODUCER_NAME
    run = _option(options, "writeId") or str(uuid.UUID(int=0))  # a query id, or a writeId drawn, as long as a UUID
    longest = producer_name(base, run, _MAX_PARTITION)
    if not 0 < len(longest) <= MAX_NAME_LENGTH or "\0" in longest:
        raise ConfigError(
            f"options 'producerName' and 'writeId' make producer names such as {longest!r}; expected names of 1 to "
            f"{MAX_NAME_LENGTH} characters without NUL"
        )
    key, payload, payload_is_text, properties = _columns(schema)
    return SinkSettings(
        url=url,
        topic=topic,
        token=_option(options, "token"),
        tls_ca=tls_ca,
        producer_name=base,
        send_timeout=_send_timeout(options),
        key=key,
        payload=payload,
        payload_is_text=payload_is_text,
        properties=properties,
    )


def _check_reachable(settings: SinkSettings) -> None:
    """Connect to the server of ``settings`` once, so that an unreachable one fails the write before any batch."""
    try:
        client = Client(settings.url, settings.token, tls_ca=settings.tls_ca)
    except ServerError as exc:
        if exc.code != ErrorCode.UNAUTHORIZED:
            raise
        given = "was not given" if settings.token is None else "was refused"
        raise ConfigError(
            f"option 'token' {given}: the server at {settings.url} answered {exc}; expected the server's token"
        ) from None
    except (OSError, KeyFailoverError) as exc:
        raise ConfigError(
            f"option 'url': cannot connect to {settings.url}: {_reason(exc)}; expected a keyfailover server there, "
            "reachable with options 'token' and 'tlsCa'"
        ) from None
    client.close()


def batch_writer(options: Mapping[str, str], schema: StructType, overwrite: bool) -> KeyFailoverWriter:
    """The writer of ``df.write.format("keyfailover")``: options and columns checked, the server reached."""
    if overwrite:
        raise ConfigError("the keyfailover sink appends to a topic; expected mode 'append', not 'overwrite'")
    settings = sink_settings(options, schema, streaming=False)
    _check_reachable(settings)
    write_id = _option(options, "writeId") or str(uuid.uuid4())
    return KeyFailoverWriter(settings, write_id)


def stream_writer(options: Mapping[str, str], schema: StructType, overwrite: bool) -> KeyFailoverStreamWriter:
    """The writer of ``df.writeStream.format("keyfailover")``: options and columns checked, the server reached.

    Every output mode appends: in complete mode each batch sends the whole result again."""
    settings = sink_settings(options, schema, streaming=True)
    _check_reachable(settings)
    return KeyFailoverStreamWriter(settings)


class _Receipts:
    """The broker's answers to a task's messages: how many came, and the first error."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._answered = 0
        self.error: str | None = None

    def answered(self, row: int, position: int | None, error: BaseException | None) -> None:
        """The answer to the message of row ``row``: a send callback, on the client's thread."""
        with self._changed:
            self._answered += 1
            if error is not None and self.error is None:
                self.error = f"the broker did not store row {row}: {error}"
            self._changed.notify_all()

    def wait(self, count: int, timeout: float) -> int | None:
        """Wait until ``count`` answers came or one was an error; None then, else how many came within ``timeout``
        seconds."""
        with self._changed:
            if self._changed.wait_for(lambda: self._answered >= count or self.error is not None, timeout):
                return None
            return self._answered


def _message(settings: SinkSettings, row: Any, index: int) -> tuple[str | bytes | None, bytes, dict[str, str] | None]:
    """``(key, payload, properties)`` of ``row``, the row of index ``index`` of its task."""
    payload = row[settings.payload]
    if payload is None:
        raise KeyFailoverError(
            f"row {index} has a null payload; expected {_PAYLOAD_TYPES} in column 'payload' (an empty payload is "
            "b'' or '')"
        )
    data = payload.encode() if settings.payload_is_text else bytes(payload)
    key = None if settings.key is None else row[settings.key]
    if isinstance(key, bytearray):
        key = bytes(key)
    properties = None if settings.properties is None else row[settings.properties]
    if properties is not None:
        nulls = sorted(name for name, value in properties.items() if value is None)
        if nulls:
            raise KeyFailoverError(
                f"row {index} has a null value for the properties {nulls}; expected a string for each property"
            )
    return key, data, properties


def _send(settings: SinkSettings, name: str, batch: int, rows: Iterator[Any]) -> SinkCommit:
    """Send ``rows`` as the producer ``name``, sequence ids from ``batch`` and each row's index; return once the
    broker confirmed every one, or raise what went wrong."""
    first = next(rows, None)
    if first is None:
        return SinkCommit(producer=name, rows=0)  # nothing to send: no connection
    receipts = _Receipts()
    count = 0
    with Client(settings.url, settings.token, tls_ca=settings.tls_ca) as client:
        producer = client.create_producer(settings.topic, name)
        for index, row in enumerate(itertools.chain([first], rows)):
            key, payload, properties = _message(settings, row, index)
            producer.send_async(
                payload,
                key,
                functools.partial(receipts.answered, index),
                properties=properties,
                sequence_id=sequence_id(batch, index),
            )
            count = index + 1
            if count % _MAX_PENDING == 0:
                _wait(receipts, count - _MAX_PENDING, settings.send_timeout)
        _wait(receipts, count, settings.send_timeout)
    return SinkCommit(producer=name, rows=count)


def _wait(receipts: _Receipts, count: int, timeout: float) -> None:
    """Wait until the broker answered the first ``count`` rows; raise when one answer was an error, or when they did
    not come within ``timeout`` seconds."""
    came = receipts.wait(count, timeout)
    if came is not None:
        raise KeyFailoverError(
            f"the broker confirmed {came} of {count} rows within {timeout:g} s; expected every receipt within option "
            "'sendTimeout'"
        )
    if receipts.error is not None:
        raise KeyFailoverError(receipts.error)


def _reason(exc: BaseException) -> str:
    """What ``exc`` says, with its kind when it says nothing of it: an OS error's message alone may not tell."""
    return str(exc) if isinstance(exc, KeyFailoverError) else f"{type(exc).__name__}: {exc}"


def _task_error(settings: SinkSettings, name: str, exc: BaseException) -> KeyFailoverError:
    """``exc`` with the task it happened in, for the message Spark shows."""
    return KeyFailoverError(f"keyfailover sink, topic {settings.topic!r}, producer {name!r}: {_reason(exc)}")


class KeyFailoverWriter(DataSourceWriter):
    """The writer of a batch write: every task sends its rows as ``{producerName}-{writeId}-{partition}``."""

    def __init__(self, settings: SinkSettings, write_id: str) -> None:
        self.settings = settings
        self.write_id = write_id

    def write(self, iterator: Iterator[Any]) -> SinkCommit:
        """Send this task's rows and wait until they are stored."""
        context = TaskContext.get()
        assert context is not None  # write runs in a Spark task
        name = producer_name(self.settings.producer_name, self.write_id, context.partitionId())
        try:
            return _send(self.settings, name, 0, iterator)
        except (OSError, KeyFailoverError) as exc:
            raise _task_error(self.settings, name, exc) from None


class KeyFailoverStreamWriter(DataSourceStreamWriter):
    """The writer of a stream: every task sends its rows as ``{producerName}-{query id}-{partition}``, with sequence
    ids from its micro-batch's id."""

    def __init__(self, settings: SinkSettings) -> None:
        self.settings = settings

    def write(self, iterator: Iterator[Any]) -> SinkCommit:
        """Send this task's rows of the micro-batch and wait until they are stored."""
        context = TaskContext.get()
        assert context is not None  # write runs in a Spark task
        query, batch = context.getLocalProperty(_QUERY_ID), context.getLocalProperty(_BATCH_ID)
        if query is None or batch is None:
            raise KeyFailoverError(
                f"a streaming write task has no query id or batch id (Spark's local properties {_QUERY_ID!r} and "
                f"{_BATCH_ID!r}); expected a micro-batch query"
            )
        name = producer_name(self.settings.producer_name, query, context.partitionId())
        try:
            return _send(self.settings, name, int(batch), iterator)
        except (OSError, KeyFailoverError) as exc:
            raise _task_error(self.settings, name, exc) from None

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803  (Spark's name)
        """Nothing to do: the broker stored every row before its task ended."""

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803  (Spark's name)
        """Nothing to undo: what the failed batch stored is stored once again when the batch is replayed."""
