"""The sans-IO Key_Failover dispatcher core: events in, deliveries out."""

from keyfailover.core.dispatcher._core import DeadLetter, Delivery, Dispatcher, RebalanceEvent

__all__ = ["DeadLetter", "Delivery", "Dispatcher", "RebalanceEvent"]
