"""The sans-IO Key_Failover dispatcher core: events in, deliveries out."""

from keyfailover.core.dispatcher._core import (
    CONSUME_MODES,
    DEFAULT_ACK_TIMEOUT,
    DEFAULT_NACK_BACKOFF_MAX,
    ConsumeMode,
    DeadLetter,
    Delivery,
    Dispatcher,
    RebalanceEvent,
    check_consume_mode,
)
from keyfailover.core.dispatcher._settings import (
    DEFAULT_MAX_REPLAY,
    DEFAULT_MAX_UNACKED,
    DeliverySettings,
    check_delivery_settings,
)

__all__ = [
    "CONSUME_MODES",
    "DEFAULT_ACK_TIMEOUT",
    "DEFAULT_MAX_REPLAY",
    "DEFAULT_MAX_UNACKED",
    "DEFAULT_NACK_BACKOFF_MAX",
    "ConsumeMode",
    "DeadLetter",
    "Delivery",
    "DeliverySettings",
    "Dispatcher",
    "RebalanceEvent",
    "check_consume_mode",
    "check_delivery_settings",
]
