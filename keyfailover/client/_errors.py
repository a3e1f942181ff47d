"""The client's exceptions, and the server's refusals that no reconnect can cure."""

from __future__ import annotations

from keyfailover.core.errors import FATAL_CODES, ErrorCode, KeyFailoverError, NotInFlightError
from keyfailover.core.errors import LeaseExpiredError as CoreLeaseExpiredError
from keyfailover.wire.protocol import Error

# Refusals no retry can cure. The other fatal codes close one connection for a limit it hit
# (too many connections, too slow): the client reconnects, with backoff.
PERMANENT: frozenset[str] = FATAL_CODES - {
    ErrorCode.TOO_MANY_CONNECTIONS,
    ErrorCode.SLOW_CONNECTION,
    ErrorCode.NOT_CONNECTED,
}


LOOK_AGAIN: frozenset[str] = frozenset({ErrorCode.NOT_OWNER, ErrorCode.STORE_UNAVAILABLE})
"""Refusals after which a part looks its partition up again, with backoff, and resends or subscribes again:
the partition moved (``not_owner``), or the broker's store fails over (``store_unavailable``: the retry waits
until a new primary writes)."""


class Timeout(KeyFailoverError, TimeoutError):  # noqa: N818  (the name the Pulsar client uses)
    """Nothing arrived (or nothing was confirmed) within the timeout."""


class ClientClosed(KeyFailoverError, RuntimeError):  # noqa: N818  (reads as a state, like Timeout)
    """The client, producer or consumer was closed."""


class ConsumerClosedError(ClientClosed):
    """The server ended the consumer for good (another consumer of the same name superseded it)."""


class NoBrokerError(ClientClosed, ConnectionError):
    """None of the brokers the client was given answers."""


class ServerError(KeyFailoverError, RuntimeError):
    """The server rejected a request; ``code`` is the protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class ServerTooOldError(ServerError):
    """The broker speaks a protocol version without the request asked for (reads came with version 8); nothing
    was sent. Its ``code`` is ``version_mismatch``, what the broker would have answered."""


class ConsumerBusyError(ServerError):
    """The consumer name is in use by a live session of another client; pick another name."""


class NotInFlight(ServerError, NotInFlightError):  # noqa: N818  (the server's code: not_in_flight)
    """A confirmed ack, nack or extension named a message that is not in flight on this consumer."""


class LeaseExpiredError(NotInFlight, CoreLeaseExpiredError):
    """A confirmed ack, nack or extension came after the message's ack deadline: it was taken back.

    The message is (or will be) delivered again, maybe to another consumer; the late call
    changed nothing. Extend a lease (:meth:`AsyncConsumer.extend`) while still working on it.
    """


def settle_error(reply: Error) -> ServerError:
    """The exception for an error answering an ack, nack or extension."""
    if reply.code == ErrorCode.LEASE_EXPIRED:
        return LeaseExpiredError(reply.code, reply.message)
    if reply.code == ErrorCode.NOT_IN_FLIGHT:
        return NotInFlight(reply.code, reply.message)
    return ServerError(reply.code, reply.message)
