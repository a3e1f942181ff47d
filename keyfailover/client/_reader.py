"""Reading a partition's log by position: what a read returns, and the checks of its arguments.

A read is not a consumer: it takes no permits, holds no leases and moves no cursor. It returns
the stored messages above a position, at most a limit of them, optionally only those whose key's
slot lies in a range, with ``through``, the position to read on after, and ``last``, the position
where the partition's log ends now. :meth:`AsyncClient.read` sends it to the partition's broker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from keyfailover.client._errors import ServerTooOldError
from keyfailover.core.errors import ErrorCode, KeyFailoverError
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hash
from keyfailover.wire.properties import NO_PROPERTIES, Properties
from keyfailover.wire.protocol import MAX_READ, READ_VERSION, Entries, Key

__all__ = ["LogEntries", "LogEntry", "check_read", "check_version", "log_entries"]


class LogEntry(NamedTuple):
    """One stored message, read by position: a named tuple, as :class:`Message` is.

    ``position`` counts within its ``partition``; ``slot`` is its key's hash slot
    (:func:`keyfailover.core.hashing.key_hash`), None for a keyless message. ``publish_time``,
    ``properties`` and ``producer`` are as a consumer's :class:`Message` has them.
    """

    key: Key
    payload: bytes
    position: int
    partition: int
    publish_time: int | None
    properties: Mapping[str, str]
    slot: int | None
    producer: str | None = None


class LogEntries(NamedTuple):
    """What one read of a partition returned.

    ``messages`` in position order; ``through`` is the last position the read examined: read on with
    ``after=through``, also when the slot filter kept nothing. ``last`` is the last position the
    partition's log holds now, its end: the reader has read everything once ``through >= last``.
    """

    partition: int
    messages: list[LogEntry]
    through: int
    last: int


def check_read(partition: int, after: int, limit: int, slots: tuple[int, int] | None) -> tuple[int, int] | None:
    """The slot filter of a read as the wire carries it, once every argument is checked; else a KeyFailoverError
    saying which is wrong and what was expected. Nothing is sent for a call refused here."""
    if type(partition) is not int or partition < 0:
        raise KeyFailoverError(f"partition must be a non-negative int, not {partition!r}")
    if type(after) is not int or not 0 <= after < 2**63:
        raise KeyFailoverError(f"after must be a position: an int from 0 to 2^63 - 1, not {after!r}")
    if type(limit) is not int or not 0 <= limit <= MAX_READ:
        raise KeyFailoverError(f"limit must be an int from 0 to {MAX_READ}, not {limit!r}")
    if slots is None:
        return None
    if (
        not isinstance(slots, tuple | list)
        or len(slots) != 2
        or not all(type(slot) is int for slot in slots)
        or not 0 <= slots[0] <= slots[1] < HASH_RANGE_SIZE
    ):
        raise KeyFailoverError(
            f"slots must be None or a pair (first, last) of hash slots with 0 <= first <= last <= "
            f"{HASH_RANGE_SIZE - 1}, not {slots!r}"
        )
    return (slots[0], slots[1])


def check_version(version: int, address: str) -> None:
    """Raise :class:`ServerTooOldError` when a connection of protocol ``version`` to ``address`` has no reads."""
    if version < READ_VERSION:
        raise ServerTooOldError(
            ErrorCode.VERSION_MISMATCH,
            f"the broker at {address} speaks protocol version {version}; reading by position needs version "
            f"{READ_VERSION} or newer: upgrade the broker (nothing was sent)",
        )


def log_entries(reply: Entries, partition: int) -> LogEntries:
    """The :class:`LogEntries` of partition ``partition`` an ``entries`` frame holds."""
    return LogEntries(
        partition,
        [
            LogEntry(
                key,
                payload,
                position,
                partition,
                publish_time,
                NO_PROPERTIES if properties is None else Properties.decoded(properties),
                None if key is None else key_hash(key),
                producer,
            )
            for position, key, payload, publish_time, properties, producer in reply.messages
        ],
        reply.through,
        reply.last,
    )
