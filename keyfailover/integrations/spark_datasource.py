"""The ``keyfailover`` format of Spark's Python Data Source API, registered by :func:`register`.

One :class:`KeyFailoverDataSource` answers for the format; each of its methods hands over to the
module of its role: the source's readers in :mod:`keyfailover.integrations.spark_source`, the sink's
writers in :mod:`keyfailover.integrations.spark_sink`.
"""

from __future__ import annotations

from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource
from pyspark.sql.types import StructType

from keyfailover.integrations.spark_sink import KeyFailoverStreamWriter, KeyFailoverWriter, batch_writer, stream_writer
from keyfailover.integrations.spark_source import (
    KeyFailoverReader,
    KeyFailoverStreamReader,
    batch_reader,
    read_schema,
    stream_reader,
)

__all__ = ["KeyFailoverDataSource", "register"]


class KeyFailoverDataSource(DataSource):
    """``format("keyfailover")``: reads a keyfailover topic's log, bounded or as a stream, and writes to a topic,
    exactly once."""

    @classmethod
    def name(cls) -> str:
        """The format's name."""
        return "keyfailover"

    def schema(self) -> StructType:
        """The columns of ``spark.read`` and ``spark.readStream``; checks the read options and the server."""
        return read_schema(self.options)

    def reader(self, schema: StructType) -> KeyFailoverReader:
        """The reader of ``spark.read.format("keyfailover")``."""
        return batch_reader(self.options, schema)

    def streamReader(self, schema: StructType) -> KeyFailoverStreamReader:  # noqa: N802  (Spark's name)
        """The reader of ``spark.readStream.format("keyfailover")``."""
        return stream_reader(self.options, schema)

    def writer(self, schema: StructType, overwrite: bool) -> KeyFailoverWriter:
        """The writer of ``df.write.format("keyfailover")``."""
        return batch_writer(self.options, schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> KeyFailoverStreamWriter:  # noqa: N802  (Spark's name)
        """The writer of ``df.writeStream.format("keyfailover")``."""
        return stream_writer(self.options, schema, overwrite)


def register(spark: SparkSession) -> None:
    """Make ``format("keyfailover")`` known to ``spark``'s readers and writers."""
    spark.dataSource.register(KeyFailoverDataSource)
