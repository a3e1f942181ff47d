"""Short import path for the Spark integration (it lives in :mod:`keyfailover.integrations.spark`)."""

from keyfailover.integrations.spark import (
    POSTGRESQL_JDBC_JAR,
    KeyFunction,
    RangeMapSource,
    load_range_map,
    local_session,
    owner_column,
    partition_by_consumer,
    partition_by_ranges,
    process_in_key_order,
    read_log,
    with_key_hash,
    with_range_id,
)
from keyfailover.integrations.spark_datasource import register

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
    "register",
    "with_key_hash",
    "with_range_id",
]
