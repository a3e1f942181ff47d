"""The records both storage backends, the entry cache and the server share: a stored message, the
dead-letter records, a topic's schema, what a message and a key are, and the log's statistics.

They belong to no backend: the embedded SQLite log (:mod:`keyfailover.broker.storage.sqlite`) and
the cluster's PostgreSQL log (:mod:`keyfailover.broker.storage.postgresql`) store and return the
same records, and every message of a group commit gets its publish time from :func:`publish_clock`.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from typing import NamedTuple, TypedDict

from keyfailover.core.dispatcher import DeliverySettings
from keyfailover.core.errors import LogError

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
    "SchemaRecord",
    "StoredMessage",
    "TopicStats",
    "check_schema",
    "dead_letter_topic",
    "publish_clock",
    "schema_properties",
    "schema_properties_text",
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


class SchemaRecord(NamedTuple):
    """One version of a topic's schema (a Pulsar schema: the log keeps it for the Pulsar endpoint)."""

    version: int
    """0 for the first schema of the topic, then 1, 2, ..."""
    kind: int
    """Pulsar's ``Schema.Type``: 4 AVRO, 2 JSON, 1 STRING..."""
    name: str
    data: bytes
    """The schema definition (an Avro schema in JSON for AVRO and JSON schemas; empty for primitives)."""
    properties: tuple[tuple[str, str], ...] = ()
    """Its ``(key, value)`` pairs, sorted by key."""


def check_schema(schema: object) -> SchemaRecord:
    """``schema`` if it is a :class:`SchemaRecord` of a version of 0 or more, an int type, a str name without NUL,
    bytes of data and str properties; else :class:`~keyfailover.core.errors.LogError` saying what is wrong."""
    if not isinstance(schema, SchemaRecord):
        raise LogError(f"a schema must be a SchemaRecord, not {type(schema).__name__}")
    version, kind, name, data, properties = schema
    if type(version) is not int or version < 0 or type(kind) is not int:
        raise LogError(f"a schema's version must be an int of 0 or more and its type an int, not {version!r}, {kind!r}")
    if not isinstance(name, str) or not isinstance(data, bytes):
        raise LogError(
            f"a schema's name must be a str and its data bytes, not {type(name).__name__}, {type(data).__name__}"
        )
    if "\x00" in name:
        raise LogError(f"a schema's name must hold no NUL (PostgreSQL's text cannot), not {name!r:.80}")
    if not all(
        isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(s, str) for s in pair) for pair in properties
    ):
        raise LogError("a schema's properties must be (str, str) pairs")
    return schema


def schema_properties_text(properties: Sequence[tuple[str, str]]) -> str:
    """A schema's properties as the logs store them: a JSON object, its keys sorted (a later pair of a key wins)."""
    return json.dumps(dict(properties), sort_keys=True)


def schema_properties(text: str) -> tuple[tuple[str, str], ...]:
    """A schema's properties as stored (:func:`schema_properties_text`) as sorted ``(key, value)`` pairs."""
    return tuple(sorted(json.loads(text).items()))


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
