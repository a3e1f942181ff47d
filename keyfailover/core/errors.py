"""The one exception hierarchy of keyfailover.

Every error raised for bad input derives from :class:`KeyFailoverError` and also from
the built-in class a caller would expect (``ValueError``, ``TypeError``, ``LookupError``),
so both ``except KeyFailoverError`` and ``except ValueError`` work. A call that raises
leaves the object it was called on unchanged.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

__all__ = [
    "FATAL_CODES",
    "BufferFullError",
    "ConfigError",
    "ConsumerError",
    "CursorError",
    "DuplicateConsumerError",
    "ErrorCode",
    "FrameEncodeError",
    "InvalidKeyError",
    "KeyFailoverError",
    "LeaseExpiredError",
    "LogError",
    "LogFileError",
    "NotInFlightError",
    "PermitsError",
    "PositionError",
    "PropertiesError",
    "ProtocolError",
    "RangeMapError",
    "SequenceError",
    "SnapshotError",
    "UnknownConsumerError",
    "WrongPartitionError",
]


class KeyFailoverError(Exception):
    """Root of every error keyfailover raises on purpose."""


class InvalidKeyError(KeyFailoverError, TypeError):
    """A message key is not ``str``, ``bytes`` or ``None``, or a ``str`` is not valid UTF-8."""


class PropertiesError(KeyFailoverError, TypeError, ValueError):
    """A message's properties are not a mapping of str to str within the limits, or bytes that do not encode one.

    A ``TypeError`` for a key or value that is not a str, a ``ValueError`` for a size over a limit:
    it is both, so either ``except`` catches it.
    """


class WrongPartitionError(KeyFailoverError, ValueError):
    """A key whose hash slot lies outside the slots of the dispatcher (the partition) it was given to."""


class ConfigError(KeyFailoverError, ValueError):
    """A constructor argument has the wrong type or lies outside its documented range."""


class PositionError(KeyFailoverError, ValueError):
    """A published position is not an int strictly after the last published one."""


class PermitsError(KeyFailoverError, ValueError):
    """A flow call gave a permit count that is not a non-negative int."""


class ConsumerError(KeyFailoverError, ValueError):
    """A consumer id is malformed (ids are non-empty strings)."""


class UnknownConsumerError(KeyFailoverError, LookupError):
    """A call named a consumer the dispatcher or range map does not have."""

    def __str__(self) -> str:  # LookupError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class DuplicateConsumerError(KeyFailoverError, ValueError):
    """A consumer id was added while a consumer of that id is still present."""


class NotInFlightError(KeyFailoverError, LookupError):
    """An ack or nack named a position that is not in flight on that consumer."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class LeaseExpiredError(NotInFlightError):
    """An ack, nack or extension named a delivery whose lease (ack deadline) had expired.

    The delivery was taken back when its deadline passed and is (or will be) delivered
    again; the late call changed nothing. Processing is at least once: a consumer that
    works past its deadline should extend the lease while it works.
    """


class BufferFullError(KeyFailoverError, RuntimeError):
    """A publish came while ``wants()`` was 0: the bounded replay buffer is full."""


class RangeMapError(KeyFailoverError, ValueError):
    """A range-map operation would break the tiling invariant, or its arguments are invalid."""


class SnapshotError(RangeMapError):
    """A range-map snapshot is not of the documented shape."""


class ErrorCode(StrEnum):
    """The ``code`` of a wire ``error`` frame (docs/protocol.md says when each is sent)."""

    MALFORMED_FRAME = "malformed_frame"
    UNKNOWN_TYPE = "unknown_type"
    FRAME_TOO_LARGE = "frame_too_large"
    BAD_FIELD = "bad_field"
    UNAUTHORIZED = "unauthorized"
    VERSION_MISMATCH = "version_mismatch"
    NOT_CONNECTED = "not_connected"
    UNKNOWN_TOPIC = "unknown_topic"
    UNKNOWN_SUBSCRIPTION = "unknown_subscription"
    UNKNOWN_SESSION = "unknown_session"
    NOT_IN_FLIGHT = "not_in_flight"
    LEASE_EXPIRED = "lease_expired"
    CONSUMER_BUSY = "consumer_busy"
    NOT_OWNER = "not_owner"
    STORE_UNAVAILABLE = "store_unavailable"
    WRONG_PARTITION = "wrong_partition"
    INVALID_MESSAGE = "invalid_message"
    SHUTTING_DOWN = "shutting_down"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    SLOW_CONNECTION = "slow_connection"
    INTERNAL = "internal"


FATAL_CODES: Final[frozenset[ErrorCode]] = frozenset(
    {
        ErrorCode.MALFORMED_FRAME,
        ErrorCode.UNKNOWN_TYPE,
        ErrorCode.FRAME_TOO_LARGE,
        ErrorCode.BAD_FIELD,
        ErrorCode.UNAUTHORIZED,
        ErrorCode.VERSION_MISMATCH,
        ErrorCode.NOT_CONNECTED,
        ErrorCode.TOO_MANY_CONNECTIONS,
        ErrorCode.SLOW_CONNECTION,
    }
)
"""Codes after which the connection must be closed: the peer broke the protocol or may not talk."""


class ProtocolError(KeyFailoverError, ValueError):
    """A frame broke the wire protocol, or a request cannot be served; ``code`` says which.

    ``fatal`` (``code in FATAL_CODES``) means the connection must be closed; other codes
    reject one request and the connection goes on.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.fatal = code in FATAL_CODES

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class FrameEncodeError(KeyFailoverError, ValueError):
    """A frame holds a value the wire cannot carry (wrong type, int beyond 64 bits, lone surrogate)."""


class LogError(KeyFailoverError, ValueError):
    """A log call got an invalid argument: a topic, producer or subscription name, a payload, a limit."""


class SequenceError(LogError):
    """A named producer's message has no valid sequence id, or its ids do not increase within a batch."""


class LogFileError(KeyFailoverError, OSError):
    """The log file cannot be used: its folder is missing, it is closed, or it is no log this version reads."""


class CursorError(KeyFailoverError, ValueError):
    """A cursor was given a position that is not a positive int, or cursor bytes are malformed."""
