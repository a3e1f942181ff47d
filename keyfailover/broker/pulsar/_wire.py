"""The two commands of the produce path by hand: SEND in, SEND_RECEIPT out.

Every unbatched message a Pulsar client produces is one SEND answered with one SEND_RECEIPT;
a protobuf BaseCommand parsed, checked and read for each costs more than the rest of the
command. :func:`decode_send` reads a SEND as clients write it (type, then a body of plain
varint fields) with one regular expression, and returns None for anything else (another
command, a field it does not know, a varint of 10 bytes, bytes after the body), which the
decoder then parses with protobuf: a value it returns is the one protobuf would give.
:func:`encode_receipt` writes what ``SerializeToString`` writes, byte for byte.
"""

from __future__ import annotations

import re
import struct
from typing import Final, NamedTuple

from keyfailover.broker.pulsar.PulsarApi_pb2 import BaseCommand, CommandSend

__all__ = ["SendCommand", "decode_send", "encode_receipt", "send_fields"]


class SendCommand(NamedTuple):
    """What the server reads of a CommandSend."""

    producer_id: int
    sequence_id: int
    highest_sequence_id: int | None
    is_chunk: bool
    transactional: bool
    """A transaction id or the marker flag is set (neither is served)."""


def send_fields(send: CommandSend) -> SendCommand:
    """The fields of a SEND parsed by protobuf."""
    return SendCommand(
        send.producer_id,
        send.sequence_id,
        send.highest_sequence_id if send.HasField("highest_sequence_id") else None,
        send.is_chunk,
        bool(send.txnid_least_bits or send.txnid_most_bits or send.marker),
    )


_VARINT: Final = rb"([\x80-\xff]{0,8}[\x00-\x7f])"
"""A varint below 2**63 (at most 9 bytes)."""
_SEND: Final = re.compile(
    rb"\x08\x06\x32[\x00-\x7f]"  # type SEND, then the send body (its length checked apart)
    rb"(?:\x08" + _VARINT + rb")"  # producer_id
    rb"(?:\x10" + _VARINT + rb")"  # sequence_id
    rb"(?:\x18" + _VARINT + rb")?"  # num_messages (not read)
    rb"(?:\x30" + _VARINT + rb")?",  # highest_sequence_id
    re.DOTALL,
)
"""A SEND command as protobuf (and Pulsar's clients) write it, in field order; the other fields of
CommandSend (transactions, chunks, markers, message_id) are left to protobuf."""


def decode_send(data: bytes | bytearray, start: int, end: int) -> SendCommand | None:
    """The SEND command that is the BaseCommand ``data[start:end]``, or None when it is another command or
    a SEND this does not read (then protobuf parses it)."""
    match = _SEND.fullmatch(data, start, end)
    if match is None or data[start + 3] != end - start - 4:
        return None  # the body's length byte must span the rest of the command
    producer, sequence, _, highest = match.groups()
    return SendCommand(_int(producer), _int(sequence), None if highest is None else _int(highest), False, False)


def _int(varint: bytes) -> int:
    """The value of a varint of at most 9 bytes."""
    if len(varint) == 1:
        return varint[0]
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
    if value < 0x80:
        return _SMALL[value]
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
    message_id = b"\x08\x00\x10" + _varint(entry)  # ledgerId 0, entryId
    if partition >= 0:
        message_id += b"\x18" + _varint(partition)
    body = b"\x08" + _varint(producer_id) + b"\x10" + _varint(sequence_id) + b"\x1a" + _SMALL[len(message_id)]
    body += message_id
    if highest_sequence_id is not None:
        body += b"\x20" + _varint(highest_sequence_id)
    command = _RECEIPT_TYPE + _varint(len(body)) + body
    return _U32_PAIR.pack(len(command) + 4, len(command)) + command
