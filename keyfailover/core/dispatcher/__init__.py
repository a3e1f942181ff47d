"""The sans-IO Key_Failover dispatcher core: events in, deliveries out."""

from keyfailover.core.dispatcher._core import Delivery, Dispatcher, RebalanceEvent

__all__ = ["Delivery", "Dispatcher", "RebalanceEvent"]
