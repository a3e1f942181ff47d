"""The sans-IO Key_Failover dispatcher core: events in, deliveries out."""

# ruff: noqa: I001  (the front is imported first: it picks the core, compiled or plain, that the rest imports)
from keyfailover.core.dispatcher._front import COMPILED, Dispatcher
from keyfailover.core.dispatcher._core import (
    CONSUME_MODES,
    DEFAULT_ACK_TIMEOUT,
    DEFAULT_NACK_BACKOFF_MAX,
    ConsumeMode,
    DeadLetter,
    Delivery,
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
    "COMPILED",
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
