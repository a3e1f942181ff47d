"""What a Pulsar producer's SEND carries, as keyfailover stores it: its messages, their keys and properties.

A SEND holds one message, or a batched entry of several, each with its own key: Pulsar's sticky key,
the ordering key, else the partition key. What keyfailover does not store is refused with the
ServerError a Pulsar client expects: compressed, encrypted, chunked or transactional messages.
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
    from_pulsar,
    parse_message,
    split_batch,
)
from keyfailover.broker.pulsar.PulsarApi_pb2 import NONE, ChecksumError, NotAllowedError, UnknownError
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
the first and last of their sequence ids (-1: none), and their encoded properties (None: none has any)."""


def sent_messages(frame: SendFrame) -> tuple[SentMessages, PropertiesColumn]:
    """The keyfailover messages a SEND carries: one, or each message of a batched entry with its own key;
    and their encoded properties (each message's properties and event time; None when none has any)."""
    try:
        sent = parse_message(frame.rest)
    except PulsarFrameError as exc:
        raise RefusedError(UnknownError, f"{exc}; nothing was stored") from None
    if sent.checksum_ok is False:
        raise RefusedError(
            ChecksumError, "the CRC32C of the message does not match its checksum field; nothing was stored"
        )
    metadata = sent.metadata
    if metadata.compression != NONE:
        raise RefusedError(NotAllowedError, "compressed messages are not supported; expected compression NONE")
    if metadata.encrypted or frame.is_chunk or metadata.num_chunks_from_msg > 1:
        raise RefusedError(NotAllowedError, "encrypted and chunked messages are not supported")
    if frame.transactional:
        raise RefusedError(NotAllowedError, "transactions and markers are not supported")
    count = metadata.num_messages_in_batch
    deliver_at = metadata.deliver_at_time  # of the entry: each message of a batch has it
    if count is None:
        message = (frame.sequence_id, _message_key(metadata), sent.payload)
        if not (metadata.properties or metadata.event_time or deliver_at > 0):
            return [message], None  # the usual message: nothing more to store
        return [message], [_message_properties(metadata, deliver_at)]
    if count < 1:
        raise RefusedError(UnknownError, f"a batched entry of {count} messages; expected at least 1")
    try:
        singles = split_batch(sent.payload, count)
    except PulsarFrameError as exc:
        raise RefusedError(UnknownError, f"{exc}; nothing was stored") from None
    messages: SentMessages = [
        (
            frame.sequence_id + index if single.sequence_id is None else single.sequence_id,
            _message_key(single),
            payload,
        )
        for index, (single, payload) in enumerate(singles)
    ]
    if deliver_at <= 0 and not any(single.properties or single.event_time for single, _ in singles):
        return messages, None
    return messages, [_message_properties(single, deliver_at) for single, _ in singles]


def _message_properties(metadata: MessageFields | SingleFields, deliver_at: int) -> bytes | None:
    """The encoded properties to store for a message: its properties, event time and delivery time (None: it has
    none of them)."""
    try:
        return from_pulsar(metadata.properties, metadata.event_time, deliver_at)
    except PropertiesError as exc:
        raise RefusedError(NotAllowedError, f"{exc}; nothing was stored") from None


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
            raise RefusedError(UnknownError, "partition key is flagged base64 but is not valid base64") from None
    return key
