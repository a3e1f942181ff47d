"""keyfailover: a key-hash-range dispatcher (Apache Pulsar PIP-34 Key_Failover).

Many consumers share one stream; every message with the same key goes, in order, to one
consumer at a time. Each consumer owns one contiguous range of the 65536-slot hash space.
"""

from keyfailover.clock import ManualClock
from keyfailover.dispatcher import Delivery, Dispatcher, RebalanceEvent
from keyfailover.errors import (
    BufferFullError,
    ConsumerError,
    DuplicateConsumerError,
    InvalidKeyError,
    KeyFailoverError,
    NotInFlightError,
    PermitsError,
    PositionError,
    RangeMapError,
    SnapshotError,
    UnknownConsumerError,
)
from keyfailover.hashing import HASH_RANGE_SIZE, key_hash, key_hashes
from keyfailover.ranges import RangeMap
from keyfailover.rebalance import Load, plan_join, plan_leave, plan_shift

__all__ = [
    "HASH_RANGE_SIZE",
    "BufferFullError",
    "ConsumerError",
    "Delivery",
    "Dispatcher",
    "DuplicateConsumerError",
    "InvalidKeyError",
    "KeyFailoverError",
    "Load",
    "ManualClock",
    "NotInFlightError",
    "PermitsError",
    "PositionError",
    "RangeMap",
    "RangeMapError",
    "RebalanceEvent",
    "SnapshotError",
    "UnknownConsumerError",
    "key_hash",
    "key_hashes",
    "plan_join",
    "plan_leave",
    "plan_shift",
]

__version__ = "0.1.0"
