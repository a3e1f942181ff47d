"""The one exception hierarchy of keyfailover.

Every error raised for bad input derives from :class:`KeyFailoverError` and also from
the built-in class a caller would expect (``ValueError``, ``TypeError``, ``LookupError``),
so both ``except KeyFailoverError`` and ``except ValueError`` work. A call that raises
leaves the object it was called on unchanged.
"""

from __future__ import annotations

__all__ = [
    "BufferFullError",
    "ConsumerError",
    "DuplicateConsumerError",
    "InvalidKeyError",
    "KeyFailoverError",
    "NotInFlightError",
    "PermitsError",
    "PositionError",
    "RangeMapError",
    "SnapshotError",
    "UnknownConsumerError",
]


class KeyFailoverError(Exception):
    """Root of every error keyfailover raises on purpose."""


class InvalidKeyError(KeyFailoverError, TypeError):
    """A message key is not ``str``, ``bytes`` or ``None``, or a ``str`` is not valid UTF-8."""


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


class BufferFullError(KeyFailoverError, RuntimeError):
    """A publish came while ``wants()`` was 0: the bounded replay buffer is full."""


class RangeMapError(KeyFailoverError, ValueError):
    """A range-map operation would break the tiling invariant, or its arguments are invalid."""


class SnapshotError(RangeMapError):
    """A range-map snapshot is not of the documented shape."""
