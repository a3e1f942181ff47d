"""A Pulsar message's properties and the metadata fields keyfailover keeps beside them, as message properties.

Pulsar's MessageMetadata (and a batched message's SingleMessageMetadata) carries ``properties``,
a list of str key/value pairs, and some fields keyfailover has no column for: ``event_time``,
milliseconds since the Unix epoch that the application set (0: none); ``null_value``, a tombstone
(its payload is empty, and a consumer is told it has none); and the ``partition_key`` of a message
whose sticky key is its ``ordering_key``. keyfailover stores the properties as its own (a later pair
of a key wins, as Pulsar's clients build their map) and each of those fields, when set, as one more
property of a reserved name: one column in both logs, and a native consumer reads them too. A
MESSAGE gives each back as its field, and the rest as ``properties``; a value of a reserved name that
is no such field (a native producer may set anything) is left as a property. A message's
``deliver_at_time`` is kept the same way, as :data:`~keyfailover.wire.properties.DELIVER_AT_PROPERTY`,
which the subscriptions read; a MESSAGE leaves it out: its time has come when it goes out. A message's
``schema_version`` (the version of its topic's schema it was written with: 8 bytes, a big-endian long) is
kept as :data:`SCHEMA_VERSION_PROPERTY`, in decimal, and a MESSAGE gives it back; bytes of another length
are no version keyfailover's registry gives out, and are not kept.

Some payloads the server passes on without reading them: an encrypted message's ciphertext, which
only its consumers can decrypt, and a chunk, a slice of a message that its consumer reassembles.
What the consumer needs to read them (:data:`PASSED_FIELDS` of the MessageMetadata: the encryption
keys, the chunk's place, and the compression and batch size inside) is kept the same way, as
:data:`PULSAR_METADATA_PROPERTY` holding those fields serialized, in base64, and given back to a
MESSAGE unchanged.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from typing import Final, NamedTuple

from google.protobuf.message import DecodeError

from keyfailover.broker.pulsar.PulsarApi_pb2 import MessageMetadata
from keyfailover.wire.properties import (
    DELIVER_AT_PROPERTY,
    decode_properties,
    encode_properties,
    parse_delivery_time,
)

__all__ = [
    "EVENT_TIME_PROPERTY",
    "NULL_VALUE_PROPERTY",
    "PARTITION_KEY_B64_PROPERTY",
    "PARTITION_KEY_PROPERTY",
    "PASSED_FIELDS",
    "PULSAR_METADATA_PROPERTY",
    "SCHEMA_VERSION_PROPERTY",
    "PulsarMetadata",
    "from_pulsar",
    "passed_metadata",
    "to_pulsar",
]

EVENT_TIME_PROPERTY: Final = "keyfailover.event_time"
"""The property a Pulsar message's event time is kept in: its milliseconds since the Unix epoch, in decimal."""
NULL_VALUE_PROPERTY: Final = "keyfailover.null_value"
"""The property that marks a Pulsar message with ``null_value`` (a tombstone): ``"true"``."""
PARTITION_KEY_PROPERTY: Final = "keyfailover.partition_key"
"""The property a Pulsar message's partition key is kept in when its ordering key is its stored key."""
PARTITION_KEY_B64_PROPERTY: Final = "keyfailover.partition_key_b64"
"""As :data:`PARTITION_KEY_PROPERTY`, for a partition key flagged ``partition_key_b64_encoded`` (kept as sent)."""

SCHEMA_VERSION_PROPERTY: Final = "keyfailover.schema_version"
"""The property a Pulsar message's schema version is kept in: the version number, in decimal."""

PULSAR_METADATA_PROPERTY: Final = "keyfailover.pulsar_metadata"
"""The property that keeps what a consumer needs to read an encrypted message or a chunk: :data:`PASSED_FIELDS`
of its MessageMetadata, serialized, in base64."""

PASSED_FIELDS: Final = (
    "encryption_keys",  # first: the one repeated field
    "encryption_algo",
    "encryption_param",
    "compression",
    "uncompressed_size",
    "num_messages_in_batch",
    "uuid",
    "chunk_id",
    "num_chunks_from_msg",
    "total_chunk_msg_size",
)
"""The MessageMetadata fields a consumer needs to read a payload the server cannot: the encryption keys, a
chunk's message and place in it, and the compression and batch that are inside the ciphertext or spread over
the chunks."""

_MAX_EVENT_TIME: Final = 2**64 - 1  # event_time is a uint64: at most 20 digits
_MAX_SCHEMA_VERSION: Final = 2**63 - 1  # a long
_TRUE: Final = "true"


class PulsarMetadata(NamedTuple):
    """A stored message's properties as a MESSAGE carries them: the properties without the reserved ones, and
    the fields they kept."""

    properties: dict[str, str]
    event_time: int = 0
    """Milliseconds since the Unix epoch; 0: none."""
    null_value: bool = False
    partition_key: str | None = None
    """The partition key sent beside an ordering key; None: none was."""
    partition_key_b64: bool = False
    """Whether that partition key is flagged base64."""
    passed: MessageMetadata | None = None
    """What a consumer needs to read an encrypted message or a chunk: its :data:`PASSED_FIELDS` only; None: none."""
    schema_version: bytes | None = None
    """The version of its topic's schema it was written with, 8 bytes; None: none."""


def from_pulsar(
    properties: Iterable[tuple[str, str]],
    event_time: int,
    passed: bytes | None = None,
    *,
    null_value: bool = False,
    partition_key: str | None = None,
    partition_key_b64: bool = False,
    deliver_at: int = 0,
    schema_version: bytes | None = None,
) -> bytes | None:
    """The encoded properties to store for a Pulsar message's ``properties`` pairs, ``event_time`` (0: none),
    ``passed`` metadata (a serialized MessageMetadata of :data:`PASSED_FIELDS`, None: none), ``null_value``,
    ``partition_key`` (one beside an ordering key, None: none; ``partition_key_b64``: it is flagged base64),
    ``deliver_at`` (its ``deliver_at_time``; 0: none, as a time at or before the epoch is) and ``schema_version``
    (None: none; kept when it is 8 bytes); None when it has none of them. A field set replaces a property of its
    reserved name. Raises
    :class:`~keyfailover.core.errors.PropertiesError` beyond the limits of :mod:`keyfailover.wire.properties`."""
    kept = dict(properties)
    if event_time:
        kept[EVENT_TIME_PROPERTY] = str(event_time)
    if passed is not None:
        kept[PULSAR_METADATA_PROPERTY] = base64.b64encode(passed).decode("ascii")
    if null_value:
        kept[NULL_VALUE_PROPERTY] = _TRUE
    if partition_key is not None:
        kept.pop(PARTITION_KEY_PROPERTY, None)
        kept.pop(PARTITION_KEY_B64_PROPERTY, None)
        kept[PARTITION_KEY_B64_PROPERTY if partition_key_b64 else PARTITION_KEY_PROPERTY] = partition_key
    if deliver_at > 0:
        kept[DELIVER_AT_PROPERTY] = str(deliver_at)
    if schema_version is not None and len(schema_version) == 8:
        kept[SCHEMA_VERSION_PROPERTY] = str(int.from_bytes(schema_version, "big", signed=True))
    return encode_properties(kept)


def to_pulsar(data: bytes | None, *, ordering_key: bool = False) -> PulsarMetadata:
    """A stored message's encoded properties as a MESSAGE carries them: see :class:`PulsarMetadata`. A partition
    key is taken out of them only for a message delivered with an ``ordering_key`` (its key is bytes); beside a
    str key, which is the partition key, the reserved property stays a property. The delivery time is left out:
    the message is going out. A reserved property whose value is not what the server writes stays a property."""
    properties = decode_properties(data)
    if not properties:
        return PulsarMetadata(properties)
    if parse_delivery_time(properties.get(DELIVER_AT_PROPERTY)):
        del properties[DELIVER_AT_PROPERTY]
    event_time = _event_time(properties.get(EVENT_TIME_PROPERTY))
    if event_time:
        del properties[EVENT_TIME_PROPERTY]
    null_value = properties.get(NULL_VALUE_PROPERTY) == _TRUE
    if null_value:
        del properties[NULL_VALUE_PROPERTY]
    partition_key: str | None = None
    partition_key_b64 = False
    if ordering_key:
        partition_key_b64 = PARTITION_KEY_B64_PROPERTY in properties
        partition_key = properties.pop(
            PARTITION_KEY_B64_PROPERTY if partition_key_b64 else PARTITION_KEY_PROPERTY, None
        )
    passed = None
    text = properties.get(PULSAR_METADATA_PROPERTY)
    if text is not None:
        passed = _passed(text)
        if passed is not None:
            del properties[PULSAR_METADATA_PROPERTY]
    schema_version = _schema_version(properties.get(SCHEMA_VERSION_PROPERTY))
    if schema_version is not None:
        del properties[SCHEMA_VERSION_PROPERTY]
    return PulsarMetadata(properties, event_time, null_value, partition_key, partition_key_b64, passed, schema_version)


def _schema_version(text: str | None) -> bytes | None:
    """The 8 bytes of the schema version a property holds: 0 to 2^63 - 1 in ASCII decimal digits; None for anything
    else."""
    if text is None or not (len(text) <= 19 and text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value.to_bytes(8, "big") if value <= _MAX_SCHEMA_VERSION else None


def _event_time(text: str | None) -> int:
    """The event time a property holds: 1 to 2^64 - 1 in ASCII decimal digits; 0 for anything else."""
    if text is None or not (len(text) <= 20 and text.isascii() and text.isdigit()):
        return 0
    value = int(text)
    return value if 0 < value <= _MAX_EVENT_TIME else 0


def _passed(text: str) -> MessageMetadata | None:
    """The :data:`PASSED_FIELDS` of the MessageMetadata ``text`` holds in base64; None when it is none, or not of an
    encrypted message or a chunk."""
    try:
        stored = MessageMetadata.FromString(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError, DecodeError):
        return None
    return passed_metadata(stored) if stored.encryption_keys or stored.num_chunks_from_msg > 1 else None


def passed_metadata(metadata: MessageMetadata) -> MessageMetadata:
    """A MessageMetadata holding only the :data:`PASSED_FIELDS` of ``metadata``."""
    passed = MessageMetadata()
    passed.encryption_keys.extend(metadata.encryption_keys)
    for name in PASSED_FIELDS[1:]:
        if metadata.HasField(name):
            setattr(passed, name, getattr(metadata, name))
    return passed
