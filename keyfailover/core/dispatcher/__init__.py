"""The sans-IO Key_Failover dispatcher core: events in, deliveries out."""

from keyfailover.core.dispatcher._core import (
    DEFAULT_ACK_TIMEOUT,
    DeadLetter,
    Delivery,
    Dispatcher,
    RebalanceEvent,
    check_leases,
)

__all__ = ["DEFAULT_ACK_TIMEOUT", "DeadLetter", "Delivery", "Dispatcher", "RebalanceEvent", "check_leases"]
