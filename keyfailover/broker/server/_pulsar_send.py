"""What a Pulsar producer's SEND carries, as keyfailover stores it: its messages, their keys and properties.

A SEND holds one message, or a batched entry of several, each with its own key: Pulsar's sticky key,
the ordering key, else the partition key. A partition key beside an ordering key is kept among the
properties, as are a null value, the event time, the entry's delivery time and schema version
(``keyfailover.broker.pulsar._properties``). A compressed payload is decompressed first, so a batch
splits into its keys and consumers get plain messages. An encrypted one cannot be read, nor can a
chunk (a slice of a message too large for one frame): it is stored as it came, one message under the
entry's key, with what its consumers need to read it. What keyfailover does not store (transactions, a
payload it cannot read) is refused with ``ChecksumError``, the one SEND_ERROR a Pulsar client fails the
send on instead of resending it.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from keyfailover.broker.pulsar import (
    MessageFields,
    PulsarFrameError,
    SendFrame,
    SingleFields,
    decompress,
    from_pulsar,
    parse_message,
    split_batch,
)
from keyfailover.broker.pulsar.PulsarApi_pb2 import NONE, ChecksumError
from keyfailover.broker.server._pulsar_errors import RefusedError
from keyfailover.broker.storage.records import PropertiesColumn
from keyfailover.core.errors import PropertiesError
from keyfailover.wire.protocol import Key

__all__ = ["Producer", "Send", "SentMessages", "joined", "sent_messages"]


@dataclass
class Producer:
    """A producer open on a Pulsar connection: its topic, its name, and the partition its message ids carry."""

    topic: str
    name: str
    partition: int


SentMessages = list[tuple[int | None, Key, bytes]]
Send = tuple[SendFrame, Producer, SentMessages, int, int, PropertiesColumn]
"""A SEND read and waiting for its connection's next store request: the SEND, its producer, its messages,
the first and last of their sequence ids (-1: none, a chunk but the last, stored without its producer's name),
and their encoded properties (None: none has any)."""


def _refused(message: str) -> RefusedError:
    """A SEND refused for good: ``ChecksumError`` fails the client's send, which raises, where any other SEND_ERROR
    makes the client reconnect and send the same bytes again, for ever."""
    return RefusedError(ChecksumError, f"{message}; nothing was stored")


def sent_messages(frame: SendFrame, max_size: int) -> tuple[SentMessages, PropertiesColumn]:
    """The keyfailover messages a SEND carries: one, or each message of a batched entry with its own key;
    and their encoded properties (each message's properties, event time, passed metadata and delivery time;
    None when none has any). A compressed payload is decompressed, to at most ``max_size`` bytes."""
    try:
        sent = parse_message(frame.rest)
    except PulsarFrameError as exc:
        raise _refused(str(exc)) from None
    if sent.checksum_ok is False:
        raise _refused("the CRC32C of the message does not match its checksum field")
    metadata = sent.metadata
    if frame.transactional:
        raise _refused("transactions and markers are not supported; expected a SEND outside any transaction")
    count = metadata.num_messages_in_batch
    if count is not None and count < 1:
        raise _refused(f"a batched entry of {count} messages; expected at least 1")
    if metadata.chunk is not None or frame.is_chunk:
        return _chunk(frame, metadata, sent.payload)
    if metadata.encrypted:
        return _encrypted(frame, metadata, sent.payload)
    deliver_at = metadata.deliver_at_time  # of the entry: each message of a batch has it
    version = metadata.schema_version  # likewise
    payload = sent.payload
    if metadata.compression != NONE:
        try:
            payload = decompress(metadata.compression, payload, metadata.uncompressed_size, max_size)
        except PulsarFrameError as exc:
            raise _refused(str(exc)) from None
    if count is None:
        message = (frame.sequence_id, _message_key(metadata), payload)
        if not (_has_more(metadata) or deliver_at > 0 or version):
            return [message], None  # the usual message: nothing more to store
        return [message], [_message_properties(metadata, deliver_at, version)]
    try:
        singles = split_batch(payload, count)
    except PulsarFrameError as exc:
        raise _refused(str(exc)) from None
    messages: SentMessages = [
        (
            frame.sequence_id + index if single.sequence_id is None else single.sequence_id,
            _message_key(single),
            payload,
        )
        for index, (single, payload) in enumerate(singles)
    ]
    if deliver_at <= 0 and not version and not any(_has_more(single) for single, _ in singles):
        return messages, None
    return messages, [_message_properties(single, deliver_at, version) for single, _ in singles]


def _chunk(frame: SendFrame, metadata: MessageFields, payload: bytes) -> tuple[SentMessages, PropertiesColumn]:
    """A chunk as one message: its payload as it came (a slice of the message, compressed or encrypted as a
    whole or per chunk), under the message's key, or its uuid when it has none, so that every chunk of a
    message goes to one consumer in order (G1, G2) and the consumer reassembles them. The last chunk is
    stored under the message's sequence id (a resend of it is a duplicate, a producer created again goes on
    after it); the others, which carry the same id, are stored without one."""
    if metadata.chunk is None:
        raise _refused("SEND is flagged as a chunk but its metadata has no num_chunks_from_msg above 1")
    uuid, chunk_id, chunks = metadata.chunk
    if not uuid or not 0 <= chunk_id < chunks:
        raise _refused(
            f"chunk {chunk_id} of {chunks} of message uuid {uuid!r:.80}; expected a uuid and a chunk id from 0 to "
            f"{chunks - 1}"
        )
    if metadata.num_messages_in_batch is not None:
        raise _refused("a chunk of a batched entry; expected chunks of one message (a client chunks only unbatched)")
    key = _message_key(metadata)
    sequence_id = frame.sequence_id if chunk_id == chunks - 1 else None
    properties = _message_properties(metadata, metadata.deliver_at_time, metadata.schema_version)
    return [(sequence_id, uuid if key is None else key, payload)], [properties]


def _encrypted(frame: SendFrame, metadata: MessageFields, payload: bytes) -> tuple[SentMessages, PropertiesColumn]:
    """An encrypted SEND as one message: its payload as it came, under the entry's key (a batch's is its first
    message's, as Pulsar's clients write it), with what its consumers need to read it. A batch is stored under
    its last sequence id, which a resend repeats and a producer created again goes on after."""
    count = metadata.num_messages_in_batch
    sequence_id = frame.sequence_id
    if count is not None:
        sequence_id = frame.sequence_id + count - 1 if frame.highest_sequence_id is None else frame.highest_sequence_id
    properties = _message_properties(metadata, metadata.deliver_at_time, metadata.schema_version)
    return [(sequence_id, _message_key(metadata), payload)], [properties]


def _has_more(metadata: MessageFields | SingleFields) -> bool:
    """Whether a message has more to store than its key and payload: properties, an event time, a null value, or
    a partition key beside its ordering key."""
    return bool(
        metadata.properties
        or metadata.event_time
        or metadata.null_value
        or (metadata.ordering_key is not None and metadata.partition_key is not None)
    )


def _message_properties(
    metadata: MessageFields | SingleFields, deliver_at: int, schema_version: bytes | None
) -> bytes | None:
    """The encoded properties to store for a message: its properties, event time, passed metadata, null value, a
    partition key beside its ordering key (the stored key), as sent, and its entry's delivery time and schema
    version (None: it has none of them)."""
    passed = metadata.passed if isinstance(metadata, MessageFields) else None
    beside = metadata.partition_key if metadata.ordering_key is not None else None
    try:
        return from_pulsar(
            metadata.properties,
            metadata.event_time,
            passed,
            null_value=metadata.null_value,
            partition_key=beside,
            partition_key_b64=metadata.partition_key_b64_encoded,
            deliver_at=deliver_at,
            schema_version=schema_version,
        )
    except PropertiesError as exc:
        raise _refused(str(exc)) from None


def joined(sends: list[Send]) -> tuple[SentMessages, PropertiesColumn]:
    """The messages of ``sends`` in one list, with their properties (None when none of them has any)."""
    if len(sends) == 1:
        return sends[0][2], sends[0][5]
    messages = [message for send in sends for message in send[2]]
    if all(send[5] is None for send in sends):
        return messages, None
    properties = [encoded for send in sends for encoded in (send[5] or [None] * len(send[2]))]
    return messages, properties


def _message_key(metadata: MessageFields | SingleFields) -> Key:
    """Pulsar's sticky key: the ordering key if set, else the partition key (decoded when base64); None: keyless."""
    if metadata.ordering_key is not None:
        return metadata.ordering_key
    key = metadata.partition_key
    if key is not None and metadata.partition_key_b64_encoded:
        try:
            return base64.b64decode(key, validate=True)
        except binascii.Error:
            raise _refused("partition key is flagged base64 but is not valid base64") from None
    return key
