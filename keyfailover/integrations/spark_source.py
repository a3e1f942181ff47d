"""The keyfailover Spark source: ``spark.readStream.format("keyfailover")`` and ``spark.read.format("keyfailover")``.

A Python data source (PySpark's ``pyspark.sql.datasource``) that reads a topic's log by position with the
native client's :meth:`~keyfailover.client.Client.read`, or a cluster's PostgreSQL log directly with the
``store`` option: it is not a consumer, it takes no permits and moves no cursor. The format's one data
source class, :mod:`keyfailover.integrations.spark_datasource`, hands its reads over to
:func:`read_schema`, :func:`batch_reader` and :func:`stream_reader` here.

Where each part runs: Spark creates the data source on the driver when ``load()`` is called and asks it
for its schema, and :func:`read_schema` checks the options and the server there, so a wrong option fails
``load()`` itself. The stream reader's offsets, admission control and planning run on the
driver, in one Python process for the query's life, with one client; each Spark task reads its part of
a micro-batch in an executor's Python worker, with a client of its own. The planning itself, with no
Spark in it, is :mod:`keyfailover.integrations._source_plan`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from keyfailover.client import LogEntries, LogEntry
from keyfailover.core.errors import KeyFailoverError
from keyfailover.integrations._source_plan import (
    READ_TIMEOUT,
    LogReader,
    Offsets,
    ReadTask,
    SourceOptionError,
    SourceOptions,
    admit,
    check_starting,
    connect,
    cut_by_traffic,
    plan_by_partition,
    plan_by_ranges,
    sample_traffic,
    starting_offsets,
)

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]

__all__ = [
    "KeyFailoverReader",
    "KeyFailoverStreamReader",
    "SourceOptionError",
    "SourcePartition",
    "batch_reader",
    "read_schema",
    "source_schema",
    "stream_reader",
]

_PAGE = 5000
"""Messages a task asks for in one read (the server answers fewer when they would not fit in one frame)."""


def source_schema(binary_keys: bool) -> StructType:
    """The source's columns: ``key`` is a string, or binary with ``binaryKeys``; ``slot`` and ``key`` are null for
    a keyless message, ``publish_time`` for one stored before logs had publish times."""
    return StructType(
        [
            StructField("key", BinaryType() if binary_keys else StringType(), True),
            StructField("payload", BinaryType(), False),
            StructField("topic", StringType(), False),
            StructField("partition", IntegerType(), False),
            StructField("position", LongType(), False),
            StructField("slot", IntegerType(), True),
            StructField("publish_time", TimestampType(), True),
            StructField("properties", MapType(StringType(), StringType(), False), False),
        ]
    )


class SourcePartition(InputPartition):
    """One Spark partition of a batch: the reads its task makes, in order."""

    def __init__(self, tasks: Sequence[ReadTask]) -> None:
        super().__init__(list(tasks))

    @property
    def tasks(self) -> list[ReadTask]:
        """The reads, in the order the task makes them."""
        tasks: list[ReadTask] = self.value
        return tasks


def _options(given: Mapping[str, str], schema: StructType | None = None) -> SourceOptions:
    """The options ``given``, checked; with ``schema``, a schema given with ``.schema(...)`` must have the source's
    columns and types."""
    options = SourceOptions.parse(given)
    if schema is not None and schema.simpleString() != source_schema(options.binary_keys).simpleString():
        raise KeyFailoverError(
            f"the keyfailover source has a fixed schema, {source_schema(options.binary_keys).simpleString()}, "
            f"not {schema.simpleString()}: expected no .schema(...) on the reader, or option binaryKeys for "
            "binary keys"
        )
    return options


def read_schema(given: Mapping[str, str]) -> StructType:
    """The columns of ``spark.read`` and ``spark.readStream``, once the options are checked, the server reached
    and ``startingPositions`` checked against the topic's log: a wrong option fails ``load()``, before any
    batch."""
    options = _options(given)
    with connect(options) as client:
        check_starting(options.starting, client.log_ends(options.topic, READ_TIMEOUT))
    return source_schema(options.binary_keys)


def batch_reader(given: Mapping[str, str], schema: StructType) -> KeyFailoverReader:
    """The reader of ``spark.read.format("keyfailover")``: from ``startingPositions`` to where each partition's
    log ends when it is planned."""
    options = _options(given, schema)
    if options.starting == "latest":
        raise SourceOptionError(
            "option startingPositions is latest, which reads nothing in a bounded read: expected earliest or "
            "a JSON object of partition to position"
        )
    return KeyFailoverReader(options, schema)


def stream_reader(given: Mapping[str, str], schema: StructType) -> KeyFailoverStreamReader:
    """The reader of ``spark.readStream.format("keyfailover")``: micro-batches from ``startingPositions``, or from
    a checkpoint's offset, on."""
    return KeyFailoverStreamReader(_options(given, schema), schema)


def _plan(client: LogReader, options: SourceOptions, start: Offsets, end: Offsets) -> list[SourcePartition]:
    """The Spark partitions of the batch from ``start`` to ``end``: by topic partition, or by ``ranges`` slot
    ranges cut by the batch's traffic, sampled."""
    if options.ranges is None:
        plan = plan_by_partition(start, end)
    else:
        traffic = sample_traffic(client, options.topic, start, end)
        plan = plan_by_ranges(start, end, cut_by_traffic(traffic, options.ranges))
    return [SourcePartition(tasks) for tasks in plan]


class KeyFailoverReader(DataSourceReader):
    """The bounded read of ``spark.read.format("keyfailover")``."""

    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        self.source_options = options
        self.source_schema = schema

    def partitions(self) -> list[SourcePartition]:
        """The whole log from ``startingPositions`` to its end now, cut as ``ranges`` says."""
        with connect(self.source_options) as client:
            ends = client.log_ends(self.source_options.topic, READ_TIMEOUT)
            start = starting_offsets(self.source_options.starting, ends)
            end = {str(partition): last + 1 for partition, last in enumerate(ends)}
            return _plan(client, self.source_options, start, end)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The messages of one Spark partition, as Arrow record batches."""
        assert isinstance(partition, SourcePartition)
        return read_tasks(self.source_options, self.source_schema, partition.tasks)


class KeyFailoverStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """The stream of ``spark.readStream.format("keyfailover")``: offsets are each partition's next position.

    Its driver side keeps one client, connected at first use and closed by :meth:`stop`; Spark pickles the
    reader for its tasks before that, so they carry no client.
    """

    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        self.source_options = options
        self.source_schema = schema
        self._client: LogReader | None = None
        self._target: list[int] | None = None

    def _connected(self) -> LogReader:
        """The driver's client, connected at the first call."""
        if self._client is None:
            self._client = connect(self.source_options)
        return self._client

    def _ends(self) -> list[int]:
        """Where each partition's log ends now."""
        return self._connected().log_ends(self.source_options.topic, READ_TIMEOUT)

    def __getstate__(self) -> dict[str, Any]:
        """What a task needs: the options and the schema, without the driver's client."""
        return {**self.__dict__, "_client": None}

    def initialOffset(self) -> Offsets:  # noqa: N802  (PySpark's name)
        """Where a new query starts: ``startingPositions`` resolved against the log now."""
        return starting_offsets(self.source_options.starting, self._ends())

    def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802  (PySpark's name)
        """``maxMessagesPerTrigger`` as a :class:`ReadMaxRows`, else everything available."""
        most = self.source_options.max_per_trigger
        return ReadAllAvailable() if most is None else ReadMaxRows(most)

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802  (PySpark's name)
        """Fix the ends of the logs now as the query's target: it reads up to them and then stops."""
        self._target = self._ends()

    def latestOffset(self, start: Offsets, limit: ReadLimit) -> Offsets:  # noqa: N802  (PySpark's name)
        """The end of the next micro-batch: to each log's end (or the availableNow target), at most ``limit``
        messages in all, split across partitions by their backlogs."""
        ends = self._target if self._target is not None else self._ends()
        return admit(start, ends, limit.max_rows if isinstance(limit, ReadMaxRows) else None)

    def partitions(self, start: Offsets, end: Offsets) -> list[SourcePartition]:
        """The Spark partitions of the micro-batch from ``start`` to ``end``, cut as ``ranges`` says."""
        return _plan(self._connected(), self.source_options, start, end)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The messages of one Spark partition, as Arrow record batches."""
        assert isinstance(partition, SourcePartition)
        return read_tasks(self.source_options, self.source_schema, partition.tasks)

    def commit(self, end: Offsets) -> None:
        """Nothing to do: the offset lives in Spark's checkpoint, and reading moves nothing on the server."""

    def stop(self) -> None:
        """Close the driver's client."""
        if self._client is not None:
            self._client.close()
            self._client = None


def read_tasks(options: SourceOptions, schema: StructType, tasks: Sequence[ReadTask]) -> Iterator[pa.RecordBatch]:
    """Every message the ``tasks`` read, in task order and in position order within each, as Arrow record
    batches of the source's schema, one per page read.

    The next page is asked for as soon as a page arrives, on a thread of its own, while this one is made
    into its record batch: the server's time and the conversion's overlap."""
    if all(task.last <= task.after for task in tasks):
        return
    arrow_schema = to_arrow_schema(schema, timezone="UTC")
    with connect(options) as client, ThreadPoolExecutor(1, thread_name_prefix="keyfailover-source") as reader:

        def page(task: ReadTask, after: int) -> LogEntries:
            entries = client.read(
                options.topic,
                task.partition,
                after,
                min(_PAGE, task.last - after),
                slots=task.slots if task.filtered else None,
                timeout=READ_TIMEOUT,
            )
            if entries.through <= after:
                raise KeyFailoverError(
                    f"partition {task.partition} of topic {options.topic!r} ends at position {entries.last}, "
                    f"before the batch's last position {task.last}: expected the log the query started on"
                )
            return entries

        for task in tasks:
            if task.last <= task.after:
                continue
            coming: Future[LogEntries] | None = reader.submit(page, task, task.after)
            while coming is not None:
                entries = coming.result()
                coming = reader.submit(page, task, entries.through) if entries.through < task.last else None
                kept = [entry for entry in entries.messages if entry.position <= task.last and _kept(task, entry)]
                if kept:
                    yield _record_batch(kept, options, arrow_schema)


def _kept(task: ReadTask, entry: LogEntry) -> bool:
    """Whether ``task`` keeps ``entry``: the server filtered it already, or its slot is in the task's range, or
    it is keyless and the task takes keyless messages."""
    if task.filtered or task.slots is None:
        return True
    if entry.slot is None:
        return task.keyless
    return task.slots[0] <= entry.slot <= task.slots[1]


def _record_batch(entries: Sequence[LogEntry], options: SourceOptions, arrow_schema: pa.Schema) -> pa.RecordBatch:
    """The Arrow record batch of ``entries``, in the order of ``arrow_schema``'s columns."""
    import pyarrow as pa

    columns = {
        "key": [_key(entry, options) for entry in entries],
        "payload": [entry.payload for entry in entries],
        "topic": [options.topic] * len(entries),
        "partition": [entry.partition for entry in entries],
        "position": [entry.position for entry in entries],
        "slot": [entry.slot for entry in entries],
        "publish_time": [entry.publish_time for entry in entries],  # µs since the epoch, as the log has them
        "properties": [list(entry.properties.items()) if entry.properties else [] for entry in entries],
    }
    arrays = [pa.array(columns[field.name], type=field.type) for field in arrow_schema]
    return pa.RecordBatch.from_arrays(arrays, schema=arrow_schema)


def _key(entry: LogEntry, options: SourceOptions) -> str | bytes | None:
    """The key as the ``key`` column holds it: bytes with ``binaryKeys``, else text, which a bytes key must be in
    UTF-8."""
    key = entry.key
    if isinstance(key, str) and options.binary_keys:
        return key.encode()
    if not isinstance(key, bytes) or options.binary_keys:
        return key
    try:
        return key.decode()
    except UnicodeDecodeError:
        raise SourceOptionError(
            f"the message at position {entry.position} of partition {entry.partition} of topic {options.topic!r} "
            f"has the key {key!r}, which is not UTF-8 text: read binary keys with option binaryKeys true"
        ) from None
