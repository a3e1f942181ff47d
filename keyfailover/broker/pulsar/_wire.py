"""The produce path's protobuf by hand: a SEND and its message metadata in, a SEND_RECEIPT out.

Every unbatched message a Pulsar client produces is one SEND with its own MessageMetadata,
answered with one SEND_RECEIPT; protobuf objects built, checked and read for each cost more
than the rest of the produce path. The decoders here read these messages as Pulsar's clients
write them (the fields the server reads or skips, in field order, short strings, varints of at
most 9 bytes) with regular expressions, and return None for anything else (another command, a
field they do not know, a string that is not UTF-8, ...), which the caller then parses with
protobuf: a value they return is the one protobuf would give. :func:`encode_receipt` writes
what ``SerializeToString`` writes, byte for byte.
"""

from __future__ import annotations

import re
import struct
from typing import Final

from keyfailover.broker.pulsar.PulsarApi_pb2 import BaseCommand

__all__ = ["decode_metadata", "decode_send", "decode_single", "encode_receipt"]


_SKIPPED: Final = rb"[\x80-\xff]{0,8}[\x00-\x7f]"
"""A varint below 2**63 (at most 9 bytes), not read."""
_VARINT: Final = b"(" + _SKIPPED + b")"
"""A varint below 2**63, read."""


def _optional(tag: bytes, value: bytes) -> bytes:
    """A pattern for an optional field: its ``tag`` and ``value``."""
    return b"(?:" + tag + value + b")?"


_SEND: Final = re.compile(
    b"".join(
        [
            rb"\x08\x06\x32[\x00-\x7f]",  # type SEND, then the send body (its length checked apart)
            rb"\x08" + _VARINT,  # producer_id (1)
            rb"\x10" + _VARINT,  # sequence_id (2)
            _optional(rb"\x18", _SKIPPED),  # num_messages (3)
            _optional(rb"\x30", _VARINT),  # highest_sequence_id (6)
        ]
    )
)
"""A SEND command as protobuf (and Pulsar's clients) write it, in field order; the other fields of
CommandSend (transactions, chunks, markers, message_id) are left to protobuf."""


def decode_send(data: bytes | bytearray, start: int, end: int) -> tuple[int, int, int | None] | None:
    """``(producer_id, sequence_id, highest_sequence_id or None)`` of the SEND that is the BaseCommand
    ``data[start:end]`` (it has no other fields), or None when it is another command or a SEND this does
    not read (then protobuf parses it)."""
    match = _SEND.fullmatch(data, start, end)
    if match is None or data[start + 3] != end - start - 4:
        return None  # the body's length byte must span the rest of the command
    producer, sequence, highest = match.groups()
    return _int(producer), _int(sequence), None if highest is None else _int(highest)


_METADATA_IDS: Final = re.compile(rb"\x10" + _SKIPPED + rb"\x18" + _SKIPPED)
"""MessageMetadata's sequence_id (2) and publish_time (3), after its producer_name (1)."""
_METADATA_TAIL: Final = re.compile(
    b"".join(
        [
            _optional(rb"\x40", rb"([\x00-\x04])"),  # compression (8): one of the codecs this protobuf knows
            _optional(rb"\x48", _VARINT),  # uncompressed_size (9)
            _optional(rb"\x58", _VARINT),  # num_messages_in_batch (11)
            _optional(rb"\x60", _VARINT),  # event_time (12)
            _optional(rb"\x82\x01\x08", rb"([\x00-\xff]{8})"),  # schema_version (16): 8 bytes, as the server gives
        ]
    )
)
"""MessageMetadata's fields after its partition_key (6) that a client writes for a plain message (a producer with a
schema writes its schema version too). Its properties (4) come before the partition key: a message with properties
is left to protobuf."""
_SINGLE: Final = re.compile(
    b"".join(
        [
            rb"\x18" + _VARINT,  # payload_size (3)
            _optional(rb"\x28", _VARINT),  # event_time (5)
            _optional(rb"\x40", _VARINT),  # sequence_id (8)
        ]
    )
)
"""SingleMessageMetadata's fields after its partition_key (2) that a client writes for a plain message. Its
properties (1) come first: a message with properties is left to protobuf."""
_INT32: Final = 1 << 31
_UINT32: Final = 1 << 32


def decode_metadata(
    data: bytes, start: int, end: int
) -> tuple[str | None, int | None, int, int, int, bytes | None] | None:
    """``(partition_key, num_messages_in_batch, event_time, compression, uncompressed_size, schema_version)`` (None
    for the first two and the last when not set, 0 for the others when not set; the size 0 too when not compressed)
    of the MessageMetadata in ``data[start:end]`` when it holds no other fields than those, a schema version of 8
    bytes, and producer_name, sequence_id and publish_time; else None (then protobuf parses it)."""
    if end - start < 2 or data[start] != 0x0A or data[start + 1] >= 0x80:  # producer_name
        return None
    ids = _METADATA_IDS.match(data, start + 2 + data[start + 1], end)
    if ids is None:
        return None
    read = _key_then(data, ids.end(), end, 0x32, _METADATA_TAIL)
    if read is None:
        return None
    key, tail = read
    codec, size_varint, batch, event, version = tail.groups()
    event_time = 0 if event is None else _int(event)
    compression = 0 if codec is None else codec[0]
    size = 0 if size_varint is None else _int(size_varint)
    if size >= _UINT32:
        return None
    size = size if compression else 0
    if batch is None:
        return key, None, event_time, compression, size, version
    count = _int(batch)
    return None if count >= _INT32 else (key, count, event_time, compression, size, version)


def decode_single(data: bytes, start: int, end: int) -> tuple[str | None, int, int | None, int] | None:
    """``(partition_key, payload_size, sequence_id, event_time)`` (None for the key and the sequence id when
    not set, 0 for an event time not set) of the SingleMessageMetadata in ``data[start:end]`` when it holds
    no other fields than those; else None."""
    read = _key_then(data, start, end, 0x12, _SINGLE)
    if read is None:
        return None
    key, fields = read
    size_varint, event, sequence = fields.groups()
    size = _int(size_varint)
    if size >= _INT32:
        return None
    return key, size, None if sequence is None else _int(sequence), 0 if event is None else _int(event)


def _key_then(
    data: bytes, offset: int, end: int, tag: int, rest: re.Pattern[bytes]
) -> tuple[str | None, re.Match[bytes]] | None:
    """The partition key (string field ``tag``) at ``offset`` if it is there (None if not), and ``rest``
    matched on the fields after it up to ``end``; None when they do not match or the key is longer than
    127 bytes, runs past ``end`` or is not UTF-8 (protobuf gives such a value as bytes)."""
    key = None
    if offset < end and data[offset] == tag:
        if offset + 1 >= end or data[offset + 1] >= 0x80:
            return None
        after = offset + 2 + data[offset + 1]
        if after > end:
            return None
        try:
            key = data[offset + 2 : after].decode()
        except UnicodeDecodeError:
            return None
        offset = after
    match = rest.fullmatch(data, offset, end)
    return None if match is None else (key, match)


def _int(varint: bytes) -> int:
    """The value of a varint of at most 9 bytes (every byte but the last has its high bit set)."""
    size = len(varint)
    if size == 1:
        return varint[0]
    if size == 2:
        return varint[0] - 0x80 | varint[1] << 7
    if size == 3:
        return varint[0] - 0x80 | (varint[1] - 0x80) << 7 | varint[2] << 14
    value = 0
    for index, byte in enumerate(varint):
        value |= (byte & 0x7F) << 7 * index
    return value


_SMALL: Final = [bytes([value]) for value in range(0x80)]
_U32_PAIR: Final = struct.Struct(">II")
_RECEIPT_TYPE: Final = bytes([1 << 3, BaseCommand.SEND_RECEIPT, BaseCommand.SEND_RECEIPT << 3 | 2])
"""A BaseCommand's type SEND_RECEIPT (field 1, a varint) and the tag of its send_receipt body (field 7,
length-delimited)."""


def _varint(value: int) -> bytes:
    """``value`` (0 to 2**64 - 1) as a varint."""
    if value < 0x80:
        return _SMALL[value]
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    if value < 0x200000:
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14))
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_receipt(
    producer_id: int, sequence_id: int, highest_sequence_id: int | None, entry: int, partition: int
) -> bytes:
    """The SEND_RECEIPT frame for a message stored at ledger 0, ``entry`` (of ``partition`` unless it is -1):
    what :func:`~keyfailover.broker.pulsar.encode_command` makes of the same BaseCommand."""
    if partition < 0:
        message_id = b"\x08\x00\x10" + _varint(entry)  # ledgerId 0, entryId
    else:
        message_id = b"\x08\x00\x10%b\x18%b" % (_varint(entry), _varint(partition))
    body = b"\x08%b\x10%b\x1a%b%b" % (_varint(producer_id), _varint(sequence_id), _SMALL[len(message_id)], message_id)
    if highest_sequence_id is not None:
        body += b"\x20" + _varint(highest_sequence_id)
    size = len(body)  # at most 54 bytes (three varints of 10 bytes, the message id of 19): a one-byte length
    return _U32_PAIR.pack(size + 8, size + 4) + _RECEIPT_TYPE + _SMALL[size] + body
