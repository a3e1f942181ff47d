"""The records both storage backends, the entry cache and the server share: a stored message, the
dead-letter records, what a message and a key are, and the log's statistics.

They belong to no backend: the embedded SQLite log (:mod:`keyfailover.broker.storage.sqlite`) and
the cluster's PostgreSQL log (:mod:`keyfailover.broker.storage.postgresql`) store and return the
same records, and every message of a group commit gets its publish time from :func:`publish_clock`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import NamedTuple, TypedDict

from keyfailover.core.dispatcher import DeliverySettings

__all__ = [
    "DEAD_LETTER_SUFFIX",
    "DELIVERY_SETTINGS",
    "DeadLetterEntry",
    "DeadLetterGroup",
    "DeadLetterRecord",
    "ExportRow",
    "Key",
    "LogStats",
    "Message",
    "PropertiesColumn",
    "StoredMessage",
    "TopicStats",
    "dead_letter_topic",
    "publish_clock",
    "stored_message",
]

Key = str | bytes | None
"""A message key: a str, bytes, or None for a keyless message."""
Message = tuple[int | None, Key, bytes]
"""``(sequence id or None, key, payload)``: one message to append."""
PropertiesColumn = Sequence[bytes | None] | None
"""The encoded properties (:func:`~keyfailover.wire.properties.encode_properties`) of each message of a
batch, None for a message without them; None for a batch none of whose messages has any (so a batch
without properties costs nothing per message)."""
DeadLetterEntry = tuple[int, Key, bytes, int, str, int | None, bytes | None]
"""``(position, key, payload, redelivery_count, reason, publish_time or None, properties or None)``: a message
going to a dead-letter topic."""

ExportRow = tuple[int, Key, bytes, str | None, int | None, int | None, bytes | None]
"""``(position, key, payload, producer name or None, sequence id or None, publish time or None, encoded
properties or None)``: one stored message."""

DELIVERY_SETTINGS = DeliverySettings.own_names()
"""The settings a subscription may have of its own, the log stores and checks: the rest are the server's."""

DEAD_LETTER_SUFFIX = "-DLQ"
"""The suffix of a subscription's dead-letter topic: :func:`dead_letter_topic`."""


def publish_clock() -> int:
    """The broker's wall clock as a publish time: integer microseconds since the Unix epoch."""
    return time.time_ns() // 1000


def dead_letter_topic(topic: str, subscription: str) -> str:
    """The dead-letter topic of a subscription: ``<topic>-<subscription>-DLQ`` (Apache Pulsar's naming)."""
    return f"{topic}-{subscription}{DEAD_LETTER_SUFFIX}"


class StoredMessage(NamedTuple):
    """One message as the log holds it (a named tuple: the server makes one per message).

    ``publish_time`` is the broker's wall clock when it was stored, in microseconds since the
    Unix epoch (:func:`publish_clock`); None when unknown (stored before the log had them).
    ``properties`` are the message's properties as stored, encoded (a msgpack map of str to str:
    :func:`~keyfailover.wire.properties.decode_properties` gives the mapping); None when it has
    none. They stay encoded because the server only passes them on: a native delivery carries the
    same bytes. ``producer`` is the name of the producer that stored it, None for an unnamed producer's
    message or one stored without a name (a dead letter, a replay). The messages a log reads share one
    name object per producer: a name costs a reference per message, not a string.
    """

    position: int
    key: Key
    payload: bytes
    publish_time: int | None
    properties: bytes | None = None
    producer: str | None = None


stored_message = functools.partial(tuple.__new__, StoredMessage)
"""A ``StoredMessage`` from a tuple ``(position, key, payload, publish_time, properties, producer)``, in C (one per
message read or stored: the named tuple's own constructor is a Python function). The tuple must hold all six: this
constructor fills in no default."""


class DeadLetterRecord(NamedTuple):
    """A dead-lettered message: where it is in the dead-letter topic, where it came from, and why."""

    dlq_position: int
    position: int
    key: Key
    payload: bytes
    redelivery_count: int
    reason: str
    time: float
    replayed_at: int | None
    publish_time: int | None
    """The publish time of the message it was (µs since the Unix epoch), None when unknown."""
    properties: bytes | None = None
    """The encoded properties of the message it was, None when it had none."""


class DeadLetterGroup(NamedTuple):
    """The dead letters of one subscription (of one served topic or partition) with one reason, counted."""

    topic: str
    """The topic they came from (a partitioned topic's own name, not its partition's)."""
    partition: int
    """Its partition they came from, 0 for a topic of one partition."""
    subscription: str
    reason: str
    letters: int
    waiting: int
    """How many of them were not replayed yet."""
    oldest: float
    """Unix seconds the oldest of them was dead-lettered."""


class TopicStats(TypedDict):
    """One topic of :class:`LogStats`: how many messages it holds, and its first and last position."""

    messages: int
    first_position: int
    last_position: int


class LogStats(TypedDict):
    """What a log holds: its file, the file's size, and each topic's :class:`TopicStats`."""

    path: str
    file_bytes: int
    """Size of the database file plus its write-ahead log."""
    topics: dict[str, TopicStats]
