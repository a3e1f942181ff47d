"""keyfailover: a key-hash-range dispatcher (Apache Pulsar PIP-34 Key_Failover).

Many consumers share one stream; every message with the same key goes, in order, to one
consumer at a time. Each consumer owns ranges of the 65536-slot hash space.

The package is built in layers, inside out, each a folder that imports only the ones
before it: ``core`` (hash, ranges, rebalance policy, the sans-IO dispatcher), ``wire``
(the native protocol and message properties), ``broker`` (storage, cluster, server) and,
beside it, ``client`` (sync and asyncio), ``integrations`` (metrics,
Spark, export, plot) and ``tools`` (command line, demo, evaluation). This module
re-exports the core's public names; ``keyfailover.dispatcher``, ``keyfailover.metrics``
and ``keyfailover.spark`` are kept as short import paths.
"""

from keyfailover.core import (
    HASH_RANGE_SIZE,
    BufferFullError,
    ConfigError,
    ConsumerError,
    ContiguousPolicy,
    DeadLetter,
    Delivery,
    DeliverySettings,
    Dispatcher,
    DuplicateConsumerError,
    InvalidKeyError,
    KeyFailoverError,
    LeaseExpiredError,
    Load,
    ManualClock,
    MultiRangePolicy,
    NotInFlightError,
    PermitsError,
    Policy,
    PositionError,
    RangeMap,
    RangeMapError,
    RebalanceEvent,
    SnapshotError,
    UnknownConsumerError,
    WrongPartitionError,
    key_hash,
    key_hashes,
)

__all__ = [
    "HASH_RANGE_SIZE",
    "BufferFullError",
    "ConfigError",
    "ConsumerError",
    "ContiguousPolicy",
    "DeadLetter",
    "Delivery",
    "DeliverySettings",
    "Dispatcher",
    "DuplicateConsumerError",
    "InvalidKeyError",
    "KeyFailoverError",
    "LeaseExpiredError",
    "Load",
    "ManualClock",
    "MultiRangePolicy",
    "NotInFlightError",
    "PermitsError",
    "Policy",
    "PositionError",
    "RangeMap",
    "RangeMapError",
    "RebalanceEvent",
    "SnapshotError",
    "UnknownConsumerError",
    "WrongPartitionError",
    "key_hash",
    "key_hashes",
]

__version__ = "0.1.0"
