"""Short import path for the sans-IO dispatcher core (it lives in :mod:`keyfailover.core.dispatcher`)."""

from keyfailover.core.dispatcher import DeadLetter, Delivery, Dispatcher, RebalanceEvent

__all__ = ["DeadLetter", "Delivery", "Dispatcher", "RebalanceEvent"]
