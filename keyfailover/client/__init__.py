"""Clients: :class:`Client` (blocking, any thread) and, in :mod:`keyfailover.client.aio`, the asyncio one.

Both have the same names as the Apache Pulsar Python client.
"""

from keyfailover.client._sync import (
    Client,
    ClientClosed,
    Consumer,
    ConsumerBusyError,
    ConsumerClosedError,
    LeaseExpiredError,
    LogEntries,
    LogEntry,
    Message,
    NoBrokerError,
    NotInFlight,
    Producer,
    PropertiesError,
    ServerError,
    ServerTooOldError,
    Timeout,
)

__all__ = [
    "Client",
    "ClientClosed",
    "Consumer",
    "ConsumerBusyError",
    "ConsumerClosedError",
    "LeaseExpiredError",
    "LogEntries",
    "LogEntry",
    "Message",
    "NoBrokerError",
    "NotInFlight",
    "Producer",
    "PropertiesError",
    "ServerError",
    "ServerTooOldError",
    "Timeout",
]
