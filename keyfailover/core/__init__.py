"""The core: the hash, the range map, the rebalance policy and the sans-IO dispatcher.

Nothing here does I/O, reads a wall clock on its own or imports anything outside
``keyfailover.core``; every ordering rule (G1-G7) is decided and tested here.
"""

from keyfailover.core.clock import ManualClock
from keyfailover.core.dispatcher import DeadLetter, Delivery, DeliverySettings, Dispatcher, RebalanceEvent
from keyfailover.core.errors import (
    BufferFullError,
    ConfigError,
    ConsumerError,
    DuplicateConsumerError,
    InvalidKeyError,
    KeyFailoverError,
    LeaseExpiredError,
    NotInFlightError,
    PermitsError,
    PositionError,
    RangeMapError,
    SnapshotError,
    UnknownConsumerError,
    WrongPartitionError,
)
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hash, key_hashes
from keyfailover.core.ranges import RangeMap
from keyfailover.core.rebalance import ContiguousPolicy, Load, MultiRangePolicy, Policy

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
