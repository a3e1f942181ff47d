"""A Pulsar message's properties and event time, kept as keyfailover's message properties.

Pulsar's MessageMetadata (and a batched message's SingleMessageMetadata) carries ``properties``,
a list of str key/value pairs, and ``event_time``, milliseconds since the Unix epoch that the
application set (0: none). keyfailover stores the properties as its own (a later pair of a key
wins, as Pulsar's clients build their map) and the event time as one more property,
:data:`EVENT_TIME_PROPERTY`, holding its decimal digits: one column in both logs, and a native
consumer reads the event time of a message a Pulsar producer sent. A MESSAGE gives it back as
``event_time``, and the rest as ``properties``; a value of the reserved key that is not an event
time (a native producer may set anything) is left as a property.

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
from typing import Final

from google.protobuf.message import DecodeError

from keyfailover.broker.pulsar.PulsarApi_pb2 import MessageMetadata
from keyfailover.wire.properties import decode_properties, encode_properties

__all__ = [
    "EVENT_TIME_PROPERTY",
    "PASSED_FIELDS",
    "PULSAR_METADATA_PROPERTY",
    "from_pulsar",
    "passed_metadata",
    "to_pulsar",
]

EVENT_TIME_PROPERTY: Final = "keyfailover.event_time"
"""The property a Pulsar message's event time is kept in: its milliseconds since the Unix epoch, in decimal."""

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


def from_pulsar(properties: Iterable[tuple[str, str]], event_time: int, passed: bytes | None = None) -> bytes | None:
    """The encoded properties to store for a Pulsar message's ``properties`` pairs, ``event_time`` (0: none) and
    ``passed`` metadata (a serialized MessageMetadata of :data:`PASSED_FIELDS`, None: none); None when it has
    none of them. The event time and the passed metadata replace properties of their reserved names. Raises
    :class:`~keyfailover.core.errors.PropertiesError` beyond the limits of :mod:`keyfailover.wire.properties`."""
    kept = dict(properties)
    if event_time:
        kept[EVENT_TIME_PROPERTY] = str(event_time)
    if passed is not None:
        kept[PULSAR_METADATA_PROPERTY] = base64.b64encode(passed).decode("ascii")
    return encode_properties(kept)


def to_pulsar(data: bytes | None) -> tuple[dict[str, str], int, MessageMetadata | None]:
    """A stored message's properties as a MESSAGE carries them: the properties without the event time and the
    passed metadata, the event time (0: none), and the passed metadata (its :data:`PASSED_FIELDS` only; None:
    none). A reserved property whose value is not what the server writes stays a property."""
    properties = decode_properties(data)
    event_time = 0
    text = properties.get(EVENT_TIME_PROPERTY)
    if text is not None and len(text) <= 20 and text.isascii() and text.isdigit() and 0 < int(text) <= _MAX_EVENT_TIME:
        del properties[EVENT_TIME_PROPERTY]
        event_time = int(text)
    passed = None
    text = properties.get(PULSAR_METADATA_PROPERTY)
    if text is not None:
        passed = _passed(text)
        if passed is not None:
            del properties[PULSAR_METADATA_PROPERTY]
    return properties, event_time, passed


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
