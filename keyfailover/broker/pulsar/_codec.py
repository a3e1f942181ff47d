"""Pulsar frames on the wire: length prefixes, the protobuf command, and the checksummed message part.

A frame is ``[total size: 4][command size: 4][BaseCommand]``, and for SEND and MESSAGE then
``[0x0e01: 2][CRC32C: 4][metadata size: 4][MessageMetadata][payload]`` with the CRC32C over
everything after it (all integers big-endian). :class:`PulsarDecoder` trusts nothing and
holds at most ``4 + max_frame`` bytes; a malformed frame is a fatal :class:`PulsarFrameError`
(the stream cannot be resynchronised), a malformed message part only fails its SEND. A SEND
comes out as a :class:`SendFrame` (read by hand when it can be, see ``_wire``), every other
command as a :class:`PulsarFrame`.
"""

from __future__ import annotations

import functools
import struct
from typing import Final, NamedTuple

import google_crc32c
from google.protobuf.message import DecodeError

from keyfailover.broker.pulsar._properties import passed_metadata, to_pulsar
from keyfailover.broker.pulsar._wire import decode_metadata, decode_send, decode_single
from keyfailover.broker.pulsar.PulsarApi_pb2 import (
    NONE,
    BaseCommand,
    CommandSend,
    MessageMetadata,
    SingleMessageMetadata,
)
from keyfailover.core.errors import KeyFailoverError

__all__ = [
    "MAX_FRAME_PADDING",
    "PROTOCOL_VERSION",
    "SERVER_NAME",
    "MessageFields",
    "PulsarDecoder",
    "PulsarFrame",
    "PulsarFrameError",
    "SendFrame",
    "SentMessage",
    "SingleFields",
    "crc32c",
    "encode_command",
    "encode_delivery",
    "encode_message",
    "parse_message",
    "split_batch",
]

PROTOCOL_VERSION: Final = 21
"""The newest Pulsar protocol version this server speaks (the newest in the vendored PulsarApi.proto);
a client is answered ``min(its version, this)``."""

MAX_FRAME_PADDING: Final = 10 * 1024
"""Bytes of a frame kept for its command and metadata: the largest payload a client may send is the
frame limit less this (Apache Pulsar keeps the same 10 KiB)."""

SERVER_NAME: Final = "keyfailover"
"""The server version CONNECTED announces, and the producer name of a message delivered that was stored without one
(an unnamed native producer's, a dead letter, a replay)."""

_MAGIC: Final = b"\x0e\x01"
_U32: Final = struct.Struct(">I")
_U32_PAIR: Final = struct.Struct(">II")


class PulsarFrameError(KeyFailoverError, ValueError):
    """Bytes that are not a valid Pulsar frame (or message part); the text says what was wrong.

    ``too_large``: the frame's size was over the limit (refused before its body arrived).
    """

    def __init__(self, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


def crc32c(data: bytes | memoryview) -> int:
    """CRC32C (Castagnoli) of ``data``: Pulsar's frame checksum."""
    return int(google_crc32c.value(data if type(data) is bytes else bytes(data)))


class PulsarFrame(NamedTuple):
    """One decoded frame but a SEND: its command, and the bytes after the command (none but for MESSAGE)."""

    command: BaseCommand
    rest: bytes


class SendFrame(NamedTuple):
    """One decoded SEND: what the server reads of its command, and the bytes after the command (magic,
    checksum, message)."""

    producer_id: int
    sequence_id: int
    highest_sequence_id: int | None
    is_chunk: bool
    transactional: bool
    """A transaction id or the marker flag is set (neither is served)."""
    rest: bytes


def _send_frame(send: CommandSend, rest: bytes) -> SendFrame:
    """The SendFrame of a SEND parsed by protobuf."""
    return SendFrame(
        send.producer_id,
        send.sequence_id,
        send.highest_sequence_id if send.HasField("highest_sequence_id") else None,
        send.is_chunk,
        bool(send.txnid_least_bits or send.txnid_most_bits or send.marker),
        rest,
    )


_NO_PROPERTIES: Final[tuple[tuple[str, str], ...]] = ()


class MessageFields(NamedTuple):
    """What the server reads of a SEND's MessageMetadata (None: the field is not set)."""

    partition_key: str | None
    partition_key_b64_encoded: bool
    ordering_key: bytes | None
    compression: int
    uncompressed_size: int
    """The payload's size before compression; 0 when it is not compressed."""
    encrypted: bool
    """It has encryption keys."""
    chunk: tuple[str, int, int] | None
    """A chunk's message uuid, chunk id and number of chunks; None: not a chunk (one chunk or none)."""
    passed: bytes | None
    """What a consumer needs to read an encrypted message or a chunk: a MessageMetadata of its ``PASSED_FIELDS``,
    serialized; None: neither."""
    num_messages_in_batch: int | None
    properties: tuple[tuple[str, str], ...] = _NO_PROPERTIES
    """Its ``(key, value)`` pairs, in order."""
    event_time: int = 0
    """Milliseconds since the Unix epoch; 0: not set."""
    null_value: bool = False
    """It is a tombstone: its payload is empty and stands for none."""
    deliver_at_time: int = 0
    """Milliseconds since the Unix epoch before which the message is not delivered; 0: not set."""
    schema_version: bytes | None = None
    """The version of the topic's schema the message was written with; None: not set."""


class SingleFields(NamedTuple):
    """What the server reads of a batched message's SingleMessageMetadata (None: the field is not set)."""

    partition_key: str | None
    partition_key_b64_encoded: bool
    ordering_key: bytes | None
    sequence_id: int | None
    payload_size: int
    properties: tuple[tuple[str, str], ...] = _NO_PROPERTIES
    """Its ``(key, value)`` pairs, in order."""
    event_time: int = 0
    """Milliseconds since the Unix epoch; 0: not set."""
    null_value: bool = False
    """It is a tombstone: its payload is empty and stands for none."""


_message_fields = functools.partial(tuple.__new__, MessageFields)
"""A ``MessageFields`` from a tuple of all its fields, in C: the hand-read path makes one per SEND."""
_single_fields = functools.partial(tuple.__new__, SingleFields)
"""A ``SingleFields`` from a tuple of all its fields, in C: the hand-read path makes one per batched message."""


class SentMessage(NamedTuple):
    """The message part of a SEND: its metadata and payload, and whether its checksum matched
    (None: the client sent none, as Pulsar clients before protocol version 6 did)."""

    metadata: MessageFields
    payload: bytes
    checksum_ok: bool | None


def metadata_fields(metadata: MessageMetadata) -> MessageFields:
    """What the server reads of a MessageMetadata parsed by protobuf."""
    chunks = metadata.num_chunks_from_msg
    chunk = (metadata.uuid, metadata.chunk_id, chunks) if chunks > 1 else None
    return MessageFields(
        metadata.partition_key if metadata.HasField("partition_key") else None,
        metadata.partition_key_b64_encoded,
        metadata.ordering_key if metadata.HasField("ordering_key") else None,
        metadata.compression,
        0 if metadata.compression == NONE else metadata.uncompressed_size,
        len(metadata.encryption_keys) > 0,
        chunk,
        passed_metadata(metadata).SerializePartialToString() if metadata.encryption_keys or chunk else None,
        metadata.num_messages_in_batch if metadata.HasField("num_messages_in_batch") else None,
        tuple((pair.key, pair.value) for pair in metadata.properties),
        metadata.event_time,
        metadata.null_value,
        metadata.deliver_at_time,
        metadata.schema_version if metadata.HasField("schema_version") else None,
    )


def single_fields(single: SingleMessageMetadata) -> SingleFields:
    """What the server reads of a SingleMessageMetadata parsed by protobuf."""
    return SingleFields(
        single.partition_key if single.HasField("partition_key") else None,
        single.partition_key_b64_encoded,
        single.ordering_key if single.HasField("ordering_key") else None,
        single.sequence_id if single.HasField("sequence_id") else None,
        single.payload_size,
        tuple((pair.key, pair.value) for pair in single.properties),
        single.event_time,
        single.null_value,
    )


class PulsarDecoder:
    """Bytes in, commands out; incremental, so any split of the stream gives the same frames.

    After an error the decoder is dead: every later call raises the same error. It never holds
    more than ``4 + max_frame`` bytes: a size above ``max_frame`` is refused as soon as its 4
    bytes arrive.
    """

    __slots__ = ("_buffer", "_error", "max_frame")

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        """The largest total size (the first 4 bytes of a frame) accepted; a server raises it after CONNECT."""
        self._buffer = bytearray()
        self._error: PulsarFrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not decoded yet (part of one frame)."""
        return len(self._buffer)

    def feed(self, data: bytes) -> tuple[list[PulsarFrame | SendFrame], PulsarFrameError | None]:
        """Take the next bytes; return the frames they complete and the error that stopped decoding, if any."""
        frames: list[PulsarFrame | SendFrame] = []
        if self._error is None:
            try:
                self._feed(data, frames)
            except PulsarFrameError as exc:
                self._error = exc
                self._buffer = bytearray()
        return frames, self._error

    def _feed(self, data: bytes, frames: list[PulsarFrame | SendFrame]) -> None:
        """Append ``data`` to the buffer and decode every whole frame in it into ``frames``; a partial frame stays
        buffered."""
        buffer = self._buffer
        buffer += data
        offset = 0
        size = len(buffer)
        with memoryview(buffer) as view:  # slices of a view copy once, where bytes(bytearray[...]) copies twice
            while size - offset >= 4:
                (total,) = _U32.unpack_from(view, offset)
                if total > self.max_frame:
                    raise PulsarFrameError(
                        f"frame of {total} bytes is over the limit of {self.max_frame} bytes", too_large=True
                    )
                if total < 4:
                    raise PulsarFrameError(f"frame size {total} is too small; expected at least 4 (the command size)")
                end = offset + 4 + total
                if end > size:
                    break
                (command_size,) = _U32.unpack_from(view, offset + 4)
                if not 0 < command_size <= total - 4:
                    raise PulsarFrameError(
                        f"command size {command_size} does not fit its frame of {total} bytes; expected 1 to "
                        f"{total - 4}"
                    )
                start = offset + 8
                rest = view[start + command_size : end].tobytes()
                ids = decode_send(buffer, start, start + command_size)
                if ids is None:
                    command = BaseCommand()
                    try:
                        command.ParseFromString(view[start : start + command_size].tobytes())
                    except DecodeError as exc:
                        raise PulsarFrameError(f"command is not a valid BaseCommand ({exc})") from None
                    _check_command(command)
                    if command.type == BaseCommand.SEND:
                        frames.append(_send_frame(command.send, rest))
                    else:
                        frames.append(PulsarFrame(command, rest))
                else:
                    frames.append(SendFrame(*ids, False, False, rest))
                offset = end
        del buffer[:offset]


_EMPTY_BODIES: Final = frozenset({BaseCommand.PING, BaseCommand.PONG})
"""Commands whose body has no fields: accepted without it."""


def _check_command(command: BaseCommand) -> None:
    """Refuse a command without its required fields (an unknown type leaves ``type`` unset) or its body.

    In BaseCommand each command's body is the field numbered as its type.
    """
    if not command.IsInitialized():
        raise PulsarFrameError("command lacks required fields (an unknown command type leaves its type unset)")
    body = BaseCommand.DESCRIPTOR.fields_by_number.get(command.type)
    if command.type not in _EMPTY_BODIES and (body is None or not command.HasField(body.name)):  # type: ignore[arg-type]
        raise PulsarFrameError(f"{BaseCommand.Type.Name(command.type)} command has no body")


def _check_metadata(metadata: MessageMetadata | SingleMessageMetadata, what: str) -> None:
    if not metadata.IsInitialized():
        raise PulsarFrameError(f"{what} lacks required fields")


def encode_command(command: BaseCommand) -> bytes:
    """``command`` as a frame without a message part."""
    body = command.SerializeToString()
    return _U32_PAIR.pack(len(body) + 4, len(body)) + body


def encode_message(command: BaseCommand, metadata: bytes, payload: bytes) -> bytes:
    """``command`` with a message part (serialized ``MessageMetadata`` and payload) and its CRC32C."""
    body = command.SerializeToString()
    checked = _U32.pack(len(metadata)) + metadata + payload
    total = 4 + len(body) + 6 + len(checked)
    return _U32_PAIR.pack(total, len(body)) + body + _MAGIC + _U32.pack(crc32c(checked)) + checked


def encode_delivery(
    consumer_id: int,
    partition: int,
    position: int,
    key: str | bytes | None,
    payload: bytes,
    *,
    redeliveries: int = 0,
    published: int | None = None,
    properties: bytes | None = None,
    producer: str | None = None,
) -> bytes:
    """A MESSAGE frame for ``consumer_id``: message id ledger 0, entry ``position`` (and ``partition`` unless
    it is -1); a str key as the partition key, a bytes key as the ordering key; ``published`` in µs; the
    stored (encoded) ``properties`` as the message's properties, event time, null value, passed metadata, schema
    version and the partition key beside an ordering key (see :func:`to_pulsar`). A chunk stored under its uuid
    as key came without one, and goes without one. ``producer`` is the name of the producer that stored the
    message, its ``producer_name``; a message stored without one goes out under :data:`SERVER_NAME` (Pulsar's
    metadata requires a name)."""
    command = BaseCommand(type=BaseCommand.MESSAGE)
    message = command.message
    message.consumer_id = consumer_id
    message.message_id.ledgerId = 0
    message.message_id.entryId = position
    if partition >= 0:
        message.message_id.partition = partition
    if redeliveries:
        message.redelivery_count = redeliveries
    metadata = MessageMetadata(
        producer_name=producer or SERVER_NAME,
        sequence_id=position,
        publish_time=0 if published is None else published // 1000,
    )
    if properties is not None:
        kept = to_pulsar(properties, ordering_key=isinstance(key, bytes))
        for name, value in kept.properties.items():
            metadata.properties.add(key=name, value=value)
        if kept.event_time:
            metadata.event_time = kept.event_time
        if kept.null_value:
            metadata.null_value = True
        if kept.partition_key is not None:
            metadata.partition_key = kept.partition_key
            metadata.partition_key_b64_encoded = kept.partition_key_b64
        if kept.schema_version is not None:
            metadata.schema_version = kept.schema_version
        if kept.passed is not None:
            metadata.MergeFrom(kept.passed)
            if kept.passed.num_chunks_from_msg > 1 and key == kept.passed.uuid:
                key = None
    if isinstance(key, str):
        metadata.partition_key = key
    elif key is not None:
        metadata.ordering_key = key
    return encode_message(command, metadata.SerializeToString(), payload)


def parse_message(rest: bytes) -> SentMessage:
    """The message part of a SEND frame; :class:`PulsarFrameError` when it is malformed."""
    checksum_ok: bool | None = None
    if rest.startswith(_MAGIC):
        if len(rest) < 6:
            raise PulsarFrameError(f"message part of {len(rest)} bytes ends inside its checksum")
        (expected,) = _U32.unpack_from(rest, 2)
        rest = rest[6:]
        checksum_ok = crc32c(rest) == expected
    if len(rest) < 4:
        raise PulsarFrameError(f"message part of {len(rest)} bytes has no metadata size; expected at least 4 bytes")
    (size,) = _U32.unpack_from(rest, 0)
    if size > len(rest) - 4:
        raise PulsarFrameError(f"metadata size {size} is over the {len(rest) - 4} bytes that follow it")
    plain = decode_metadata(rest, 4, 4 + size)
    if plain is None:
        metadata = MessageMetadata()
        try:
            metadata.ParseFromString(rest[4 : 4 + size])
        except DecodeError as exc:
            raise PulsarFrameError(f"message metadata is not a valid MessageMetadata ({exc})") from None
        _check_metadata(metadata, "message metadata")
        fields = metadata_fields(metadata)
    else:
        key, batch, event_time, compression, uncompressed, version = plain
        fields = _message_fields(
            (
                key,
                False,
                None,
                compression,
                uncompressed,
                False,
                None,
                None,
                batch,
                _NO_PROPERTIES,
                event_time,
                False,
                0,
                version,
            )
        )
    return SentMessage(fields, rest[4 + size :], checksum_ok)


def split_batch(payload: bytes, count: int) -> list[tuple[SingleFields, bytes]]:
    """The ``count`` messages of a batched entry: ``[size: 4][SingleMessageMetadata][payload]`` each."""
    messages = []
    offset = 0
    for index in range(count):
        if len(payload) - offset < 4:
            raise PulsarFrameError(f"batch message {index} of {count} is missing: the entry ends at byte {offset}")
        (size,) = _U32.unpack_from(payload, offset)
        offset += 4
        if size > len(payload) - offset:
            raise PulsarFrameError(f"batch message {index}'s metadata size {size} runs past the end of the entry")
        plain = decode_single(payload, offset, offset + size)
        if plain is None:
            single = SingleMessageMetadata()
            try:
                single.ParseFromString(payload[offset : offset + size])
            except DecodeError as exc:
                raise PulsarFrameError(
                    f"batch message {index}'s metadata is not a SingleMessageMetadata ({exc})"
                ) from None
            _check_metadata(single, f"batch message {index}'s metadata")
            fields = single_fields(single)
        else:
            key, length, sequence_id, event_time = plain
            fields = _single_fields((key, False, None, sequence_id, length, _NO_PROPERTIES, event_time, False))
        offset += size
        length = fields.payload_size
        if not 0 <= length <= len(payload) - offset:
            raise PulsarFrameError(
                f"batch message {index}'s payload size {length} runs past the end of the entry "
                f"({len(payload) - offset} bytes left)"
            )
        messages.append((fields, payload[offset : offset + length]))
        offset += length
    if offset != len(payload):
        raise PulsarFrameError(f"batched entry has {len(payload) - offset} bytes after its {count} messages")
    return messages
