"""How the Pulsar endpoint refuses a request: keyfailover's refusals as the ServerErrors Pulsar clients know."""

from __future__ import annotations

from typing import Final

from keyfailover.broker.pulsar import TopicNameError
from keyfailover.broker.pulsar.PulsarApi_pb2 import (
    ConsumerAssignError,
    ConsumerBusy,
    NotAllowedError,
    ServiceNotReady,
    TopicNotFound,
    UnknownError,
)
from keyfailover.broker.storage._store import NotServedError, StoreUnavailableError
from keyfailover.core.errors import ConsumerError, ErrorCode, ProtocolError

__all__ = ["RefusedError", "server_error"]

_SERVER_ERRORS: Final = {
    ErrorCode.NOT_OWNER: ServiceNotReady,
    ErrorCode.STORE_UNAVAILABLE: ServiceNotReady,
    ErrorCode.SHUTTING_DOWN: ServiceNotReady,
    ErrorCode.CONSUMER_BUSY: ConsumerBusy,
    ErrorCode.UNKNOWN_TOPIC: TopicNotFound,
    ErrorCode.WRONG_PARTITION: NotAllowedError,
}
"""The Pulsar ServerError for each keyfailover error code that has a close one (else UnknownError)."""


class RefusedError(Exception):
    """A request refused with a Pulsar ServerError and a message saying why."""

    def __init__(self, error: int, message: str) -> None:
        super().__init__(message)
        self.error = error
        self.message = message


def server_error(exc: Exception) -> tuple[int, str]:
    """The Pulsar ServerError and message that refuse a request, for the error that refused it."""
    if isinstance(exc, RefusedError):
        return exc.error, exc.message
    if isinstance(exc, TopicNameError):
        # Not InvalidTopicName, which the client retries for its whole operation timeout: NotAllowedError
        # is final (the client checks a name's form itself, so this is a name keyfailover does not serve).
        return NotAllowedError, str(exc)
    if isinstance(exc, ProtocolError):
        return _SERVER_ERRORS.get(exc.code, UnknownError), exc.message
    if isinstance(exc, ConsumerError):  # a STICKY consumer's ranges: none, malformed, or another's
        return ConsumerAssignError, str(exc)
    if isinstance(exc, NotServedError | StoreUnavailableError):  # moved away, or the store fails over: retried
        return ServiceNotReady, str(exc)
    return UnknownError, str(exc)
