"""The wire protocol: round trips, incremental decoding, every validation rule, and fuzzing.

The fuzz properties hold the decoder to its contract on hostile input: ``feed`` returns
valid frames or raises a fatal :class:`ProtocolError`, never anything else, and never keeps
more than ``4 + max_frame`` bytes.
"""

from __future__ import annotations

import math
import re
import struct
import tracemalloc
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Literal, get_args

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyfailover.core.errors import FATAL_CODES, ErrorCode, FrameEncodeError, KeyFailoverError, ProtocolError
from keyfailover.core.hashing import HASH_RANGE_SIZE
from keyfailover.core.subtypes import SUBSCRIPTION_TYPES
from keyfailover.wire.properties import MAX_PROPERTIES, encode_properties
from keyfailover.wire.protocol import (
    DEFAULT_MAX_FRAME,
    MAX_NAME_LENGTH,
    MAX_READ,
    OLDEST_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    READ_VERSION,
    Ack,
    ClientFrame,
    Close,
    CloseConsumer,
    Connect,
    Connected,
    ConsumerClosed,
    Decoder,
    Delivered,
    Entries,
    Error,
    Extend,
    Flow,
    Frame,
    Key,
    Lookup,
    Messages,
    Nack,
    Ping,
    Pong,
    Produce,
    RangesChanged,
    Read,
    Receipt,
    Route,
    ServerFrame,
    Settled,
    Subscribe,
    Subscribed,
    encode,
)
from tests.strategies import mutated

DOC_PATH = Path(__file__).parent.parent / "docs" / "protocol.md"
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

Accept = Literal["client", "server", "any"]

CLIENT_TYPES: tuple[type[Frame], ...] = get_args(ClientFrame)
SERVER_TYPES: tuple[type[Frame], ...] = get_args(ServerFrame)


# -- strategies -----------------------------------------------------------------------------

uints = st.integers(0, 300) | st.integers(0, INT64_MAX)
int64s = st.integers(-300, 300) | st.integers(INT64_MIN, INT64_MAX)
names = st.text(st.characters(codec="utf-8", exclude_characters="\0"), min_size=1, max_size=MAX_NAME_LENGTH)
labels = st.text(min_size=1, max_size=40)
texts = st.text(max_size=40)
keys = st.none() | st.text(max_size=20) | st.binary(max_size=20)
payloads = st.binary(max_size=64)
positions = st.lists(uints, max_size=40)


@st.composite
def slot_range_lists(draw: st.DrawFn) -> list[tuple[int, int]]:
    """Sorted, non-overlapping inclusive ranges (possibly adjacent, possibly none): what a consumer may own."""
    ranges: list[tuple[int, int]] = []
    after = -1
    for gap, width in draw(st.lists(st.tuples(st.integers(0, 9000), st.integers(0, 9000)), max_size=8)):
        start = after + 1 + gap
        if start + width >= HASH_RANGE_SIZE:
            break
        ranges.append((start, start + width))
        after = start + width
    return ranges


LAST_SLOT = HASH_RANGE_SIZE - 1
slot_ranges = st.sampled_from([[], [(0, LAST_SLOT)], [(0, 0)], [(LAST_SLOT, LAST_SLOT)]]) | slot_range_lists()
produced = st.lists(st.tuples(st.none() | uints, keys, payloads), max_size=30)
encoded_properties = st.none() | st.dictionaries(texts, texts, min_size=1, max_size=4).map(encode_properties)
producer_names = st.none() | labels
delivered = st.lists(
    st.tuples(uints, keys, payloads, uints, st.none() | uints, encoded_properties, producer_names), max_size=30
)


@st.composite
def produces(draw: st.DrawFn) -> Produce:
    """A produce, its messages' properties nil or one item (nil or encoded) per message."""
    messages = draw(produced)
    properties = draw(st.none() | st.lists(encoded_properties, min_size=len(messages), max_size=len(messages)))
    return Produce(
        req=draw(uints), topic=draw(names), producer=draw(st.none() | labels), messages=messages, properties=properties
    )


@st.composite
def entries(draw: st.DrawFn) -> Entries:
    """An answer to a read: messages at strictly ascending positions, ``through`` at or after the last of them."""
    gaps = draw(st.lists(st.integers(1, 1000) | st.integers(1, 2**40), max_size=30))
    position = 0
    messages = []
    for gap in gaps:
        position += gap
        message = (
            position,
            draw(keys),
            draw(payloads),
            draw(st.none() | uints),
            draw(encoded_properties),
            draw(producer_names),
        )
        messages.append(message)
    through = draw(st.integers(position, INT64_MAX))
    return Entries(req=draw(uints), through=through, last=draw(uints), messages=messages)


slot_pairs = st.integers(0, LAST_SLOT).flatmap(lambda first: st.tuples(st.just(first), st.integers(first, LAST_SLOT)))


@st.composite
def receipts(draw: st.DrawFn) -> Receipt:
    stored = draw(st.lists(st.tuples(uints, st.booleans()), max_size=40))
    return Receipt(req=draw(uints), positions=[p for p, _ in stored], duplicates=[d for _, d in stored])


@st.composite
def subscribeds(draw: st.DrawFn) -> Subscribed:
    return Subscribed(
        req=draw(uints), session=draw(uints), consumer=draw(names), ranges=draw(slot_ranges), secret=draw(labels)
    )


@st.composite
def ranges_changeds(draw: st.DrawFn) -> RangesChanged:
    return RangesChanged(session=draw(uints), epoch=draw(uints), ranges=draw(slot_ranges))


client_frames: st.SearchStrategy[Frame] = st.one_of(
    st.builds(Connect, version=uints, token=st.none() | texts, client=labels),
    produces(),
    st.builds(
        Subscribe,
        req=uints,
        topic=names,
        subscription=names,
        consumer=names,
        receiver_queue=uints,
        secret=st.none() | labels,
        subscription_type=st.none() | st.sampled_from(SUBSCRIPTION_TYPES),
        priority_level=st.integers(0, 2**31 - 1),
    ),
    st.builds(Flow, topic=names, subscription=names, session=uints, permits=uints),
    st.builds(Ack, topic=names, subscription=names, session=uints, positions=positions, req=st.none() | uints),
    st.builds(Nack, topic=names, subscription=names, session=uints, positions=positions, req=st.none() | uints),
    st.builds(Extend, topic=names, subscription=names, session=uints, positions=positions, req=st.none() | uints),
    st.builds(CloseConsumer, req=uints, topic=names, subscription=names, session=uints),
    st.builds(Lookup, req=uints, topic=names),
    st.builds(Read, req=uints, topic=names, after=uints, limit=st.integers(0, MAX_READ), slots=st.none() | slot_pairs),
    st.builds(Ping, nonce=int64s),
    st.just(Close()),
)
server_frames: st.SearchStrategy[Frame] = st.one_of(
    st.builds(
        Connected,
        version=uints,
        server=labels,
        max_frame=st.integers(1, 2**32 - 1),
        session_timeout=st.floats(min_value=0, exclude_min=True, allow_infinity=False),
    ),
    receipts(),
    subscribeds(),
    st.builds(Route, req=uints, topic=names, brokers=st.lists(st.none() | texts, min_size=1, max_size=20)),
    st.builds(Messages, session=uints, messages=delivered),
    entries(),
    ranges_changeds(),
    st.builds(ConsumerClosed, session=uints, reason=labels, req=st.none() | uints),
    st.builds(Settled, req=uints),
    st.builds(Pong, nonce=int64s),
    st.builds(Error, code=labels, message=texts, req=st.none() | uints),
)
frames = client_frames | server_frames

# Any msgpack value (ext types included) to put where a field, item or body belongs.
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=10)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


def same(decoded: list[Frame], expected: list[Frame]) -> bool:
    """Equal down to the types: 1 is not True, 1.0 is not 1, "k" is not b"k", a list is not a tuple."""
    return repr(decoded) == repr(expected)


def raw(body: object) -> bytes:
    """Any msgpack value framed as a body, bypassing :func:`encode`."""
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return struct.pack(">I", len(packed)) + packed


def body_of(frame: Frame) -> dict[str, Any]:
    """The map :func:`encode` sends for ``frame``, as a mutable dict."""
    body: dict[str, Any] = msgpack.unpackb(encode(frame)[4:], raw=False)
    return body


def rejection(data: bytes, accept: Accept = "any", max_frame: int = DEFAULT_MAX_FRAME) -> ProtocolError:
    return rejection_by(Decoder(max_frame, accept=accept), data)


def rejection_by(decoder: Decoder, data: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decoder.feed(data)
    assert info.value.fatal
    return info.value


# -- round trips ----------------------------------------------------------------------------


@given(frames)
def test_every_frame_round_trips_exactly(frame: Frame) -> None:
    data = encode(frame)
    assert struct.unpack(">I", data[:4])[0] == len(data) - 4
    accept: Accept = "server" if isinstance(frame, CLIENT_TYPES) else "client"
    assert same(Decoder(accept=accept).feed(data), [frame])
    assert same(Decoder().feed(data), [frame])


def test_keys_keep_their_type_on_the_wire() -> None:
    messages: list[Delivered] = [
        (1, "k", b"a", 0, 1_750_000_000_000_000, None, "billing"),
        (2, b"k", b"b", 0, None, None, None),
        (3, None, b"c", 0, 0, None, ""),
        (4, "", b"", 1, 1, TRACE, "billing"),
        (5, b"", b"", 2, INT64_MAX, None, None),
    ]
    frame = Messages(session=1, messages=messages)
    body = encode(frame)[4:]
    assert b"\xa1k" in body  # str travels as msgpack str
    assert b"\xc4\x01k" in body  # bytes travel as msgpack bin
    assert same(Decoder().feed(encode(frame)), [frame])


TRACE: bytes = msgpack.packb({"trace": "ab12"}, use_bin_type=True)  # what encode_properties gives


def test_older_connections_get_deliveries_without_what_their_version_lacks() -> None:
    """Version 8 and 7 deliveries have no producer name, version 6 ones no properties either, version 5 ones no
    publish time either."""
    at = 1_750_000_000_000_000
    frame = Messages(
        session=1, messages=[(1, "k", b"v", 0, at, TRACE, "billing"), (2, None, b"w", 1, None, None, None)]
    )
    assert msgpack.unpackb(encode(frame)[4:])["messages"] == [
        [1, "k", b"v", 0, at, TRACE, "billing"],
        [2, None, b"w", 1, None, None, None],
    ]
    for version in (8, 7):
        assert msgpack.unpackb(encode(frame, version)[4:])["messages"] == [
            [1, "k", b"v", 0, at, TRACE],
            [2, None, b"w", 1, None, None],
        ]
    assert msgpack.unpackb(encode(frame, 6)[4:])["messages"] == [[1, "k", b"v", 0, at], [2, None, b"w", 1, None]]
    assert msgpack.unpackb(encode(frame, 5)[4:]) == {
        "type": "messages",
        "session": 1,
        "messages": [[1, "k", b"v", 0], [2, None, b"w", 1]],
    }
    assert encode(frame, PROTOCOL_VERSION) == encode(frame)
    assert encode(frame, 8) == encode(frame, 7)  # version 8 changed no delivery
    for other in (Pong(nonce=3), Receipt(req=1, positions=[1], duplicates=[False])):
        assert encode(other, 5) == encode(other) == encode(other, 6)  # only deliveries and produce changed


def test_a_subscribe_before_version_9_has_no_type_or_priority_and_reads_as_one_without() -> None:
    """Version 9 added ``subscription_type`` and ``priority_level`` to ``subscribe``: an older connection's
    subscribe lacks them (decoded as nil and 0, joining as the subscription is) and cannot ask for either."""
    plain = Subscribe(req=1, topic="t", subscription="s", consumer="c", receiver_queue=10)
    for version in (5, 8):
        old = msgpack.unpackb(encode(plain, version)[4:])
        assert "subscription_type" not in old and "priority_level" not in old
        assert same(Decoder(accept="server", version=version).feed(encode(plain, version)), [plain])
        error = rejection_by(Decoder(accept="server", version=version), raw(body_of(plain)))
        assert "extra: 'priority_level', 'subscription_type'" in error.message
    typed = replace(plain, subscription_type="failover", priority_level=2)
    assert same(Decoder(accept="server").feed(encode(typed)), [typed])
    for asked in (typed, replace(plain, priority_level=1)):
        with pytest.raises(FrameEncodeError, match="protocol version 8 cannot carry a subscription type or priority"):
            encode(asked, 8)


@pytest.mark.parametrize(
    ("field", "bad", "expected"),
    [
        ("subscription_type", "Exclusive", "one of exclusive, failover, shared, key_shared or nil"),
        ("subscription_type", 1, "one of exclusive, failover, shared, key_shared or nil"),
        ("priority_level", -1, "an int from 0 to 2147483647"),
        ("priority_level", 2**31, "an int from 0 to 2147483647"),
    ],
)
def test_a_subscribe_with_an_unknown_type_or_priority_is_refused(field: str, bad: Any, expected: str) -> None:
    body = body_of(Subscribe(req=1, topic="t", subscription="s", consumer="c", receiver_queue=10))
    body[field] = bad
    error = rejection_by(Decoder(accept="server"), raw(body))
    assert error.code is ErrorCode.BAD_FIELD and expected in error.message


def test_a_produce_for_an_older_connection_has_no_properties_field() -> None:
    plain = Produce(req=1, topic="t", producer=None, messages=[(None, "k", b"v")])
    assert "properties" not in msgpack.unpackb(encode(plain, 6)[4:])
    assert msgpack.unpackb(encode(plain)[4:])["properties"] is None
    with_properties = replace(plain, properties=[TRACE])
    assert encode(with_properties, 7) == encode(with_properties)  # versions 8 and 9 changed no produce
    with pytest.raises(FrameEncodeError, match="protocol version 6 cannot carry message properties"):
        encode(replace(plain, properties=[TRACE]), 6)


@pytest.mark.parametrize("version", [5, 6])
def test_a_decoder_of_an_older_version_reads_its_frames(version: int) -> None:
    """What a server reads from a version 5 or 6 client, and what such a client reads (as the current frames
    with None for what the version lacks)."""
    server = Decoder(accept="server", version=version)
    old_produce = Produce(req=1, topic="t", producer="p", messages=[(1, "k", b"v")])
    assert same(server.feed(encode(old_produce, version)), [old_produce])
    new_body = body_of(replace(old_produce, properties=[None]))  # a version 7 produce on that connection
    assert "extra: 'properties'" in rejection_by(server, raw(new_body)).message
    at = 1_750_000_000_000_000 if version == 6 else None
    delivered = Messages(session=1, messages=[(1, "k", b"v", 0, at, None, None), (2, b"k", b"w", 3, at, None, None)])
    assert same(Decoder(accept="client", version=version).feed(encode(delivered, version)), [delivered])
    body = body_of(delivered)  # version 9 deliveries on that connection
    error = rejection_by(Decoder(accept="client", version=version), raw(body))
    assert f"{version - 1}-item deliveries (protocol version {version})" in error.message


@pytest.mark.parametrize("version", [7, 8])
def test_a_decoder_of_version_7_or_8_reads_deliveries_without_their_producer(version: int) -> None:
    """What a version 7 or 8 client reads: deliveries of six items, as the current ones with no producer name."""
    named = Messages(session=1, messages=[(1, "k", b"v", 0, 5, TRACE, "billing"), (2, None, b"w", 3, None, None, None)])
    unnamed = Messages(session=1, messages=[(*item[:6], None) for item in named.messages])
    assert same(Decoder(accept="client", version=version).feed(encode(named, version)), [unnamed])
    error = rejection_by(Decoder(accept="client", version=version), raw(body_of(named)))
    assert f"6-item deliveries (protocol version {version})" in error.message


@pytest.mark.parametrize("bad", [4, 10, "9", True, None])
def test_a_decoder_version_must_be_one_spoken(bad: Any) -> None:
    with pytest.raises(KeyFailoverError, match=f"version must be an int from {OLDEST_PROTOCOL_VERSION} to 9"):
        Decoder(version=bad)
    decoder = Decoder()
    with pytest.raises(KeyFailoverError, match="version must be an int"):
        decoder.version = bad
    assert decoder.version == PROTOCOL_VERSION


@pytest.mark.parametrize("version", [5, 6, 7])
def test_connections_older_than_reads_have_no_read_or_entries(version: int) -> None:
    """``read`` and ``entries`` came with version 8: a decoder of an older connection refuses them, naming the
    version they need, and encode will not write them for one."""
    assert READ_VERSION == PROTOCOL_VERSION - 1 == 8
    read = Read(req=1, topic="t", after=0, limit=10)
    answer = Entries(req=1, through=0, last=0, messages=[])
    cases: list[tuple[Frame, Accept]] = [(read, "server"), (answer, "client")]
    for frame, side in cases:
        error = rejection_by(Decoder(accept=side, version=version), raw(body_of(frame)))
        assert error.code is ErrorCode.UNKNOWN_TYPE
        assert f"frame type {frame.type!r} came with protocol version 8; this connection speaks version {version}" in (
            error.message
        )
        with pytest.raises(FrameEncodeError, match=f"protocol version {version} has no {frame.type!r} frame"):
            encode(frame, version)
        assert same(Decoder(accept=side, version=8).feed(encode(frame, 8)), [frame])


def test_an_entries_frame_keeps_keys_positions_and_properties() -> None:
    frame = Entries(
        req=3,
        through=9,
        last=12,
        messages=[
            (1, "k", b"a", 1_750_000_000_000_000, TRACE, "billing"),
            (4, b"k", b"", None, None, None),
            (9, None, b"c", 0, None, "billing"),
        ],
    )
    body = msgpack.unpackb(encode(frame)[4:])
    assert body == {
        "type": "entries",
        "req": 3,
        "through": 9,
        "last": 12,
        "messages": [
            [1, "k", b"a", 1_750_000_000_000_000, TRACE, "billing"],
            [4, b"k", b"", None, None, None],
            [9, None, b"c", 0, None, "billing"],
        ],
    }
    assert same(Decoder(accept="client").feed(encode(frame)), [frame])
    old = msgpack.unpackb(encode(frame, 8)[4:])["messages"]  # a version 8 reader gets entries without the name
    assert old == [item[:5] for item in body["messages"]]
    without = replace(frame, messages=[(*item[:5], None) for item in frame.messages])
    assert same(Decoder(accept="client", version=8).feed(encode(frame, 8)), [without])
    error = rejection_by(Decoder(accept="client", version=8), raw(body_of(frame)))
    assert "5-item entries (protocol version 8)" in error.message


def test_a_read_round_trips_with_and_without_its_slot_filter() -> None:
    for slots in (None, (0, 0), (0, LAST_SLOT), (100, 200)):
        frame = Read(req=1, topic="t-partition-1", after=INT64_MAX, limit=MAX_READ, slots=slots)
        assert same(Decoder(accept="server").feed(encode(frame)), [frame])


def test_properties_travel_as_a_bin_holding_a_msgpack_map() -> None:
    """The example in docs/protocol.md: one message with the properties {"trace": "ab12"}."""
    frame = Produce(req=1, topic="t", producer=None, messages=[(None, "k", b"v")], properties=[TRACE])
    data = encode(frame)
    # "properties", an array of one bin of 12 bytes: the map {"trace": "ab12"}
    pinned = "aa 70 72 6f 70 65 72 74 69 65 73 91 c4 0c 81 a5 74 72 61 63 65 a4 61 62 31 32"
    assert data.hex(" ").endswith(pinned)
    assert pinned in DOC_PATH.read_text(encoding="utf-8")
    assert same(Decoder(accept="server").feed(data), [frame])


def test_wire_bytes_are_pinned() -> None:
    """The example in docs/protocol.md: ping with nonce 1."""
    expected = bytes.fromhex("00000012" + "82" + "a474797065" + "a470696e67" + "a56e6f6e6365" + "01")
    assert encode(Ping(nonce=1)) == expected
    assert expected.hex(" ") in DOC_PATH.read_text(encoding="utf-8")


def test_ranges_changed_example_is_pinned() -> None:
    """The example in docs/protocol.md: ranges travel as an array of [start, end] int arrays."""
    frame = RangesChanged(session=7, epoch=12, ranges=[(0, 99), (40000, 65535)])
    data = encode(frame)
    # "ranges", an array of 2 pairs: [0, 99] as 92 00 63, [40000, 65535] as 92 cd 9c40 cd ffff
    assert data.endswith(bytes.fromhex("a6 72 61 6e 67 65 73 92 92 00 63 92 cd 9c 40 cd ff ff"))
    assert msgpack.unpackb(data[4:]) == {
        "type": "ranges_changed",
        "session": 7,
        "epoch": 12,
        "ranges": [[0, 99], [40000, 65535]],
    }
    assert data.hex(" ") in DOC_PATH.read_text(encoding="utf-8")


@pytest.mark.parametrize("count", [0, 1, 10_000])
def test_batches_round_trip_empty_to_large(count: int) -> None:
    key_cycle: list[Key] = ["k", b"k", None]
    batch: list[Frame] = [
        Produce(req=1, topic="t", producer="p", messages=[(i, key_cycle[i % 3], b"%d" % i) for i in range(count)]),
        Produce(req=2, topic="t", producer=None, messages=[(None, f"k{i}", b"") for i in range(count)]),
        Produce(
            req=3,
            topic="t",
            producer=None,
            messages=[(None, "k", b"") for _ in range(count)],
            properties=[TRACE if i % 2 else None for i in range(count)],
        ),
        Messages(
            session=3,
            messages=[
                (INT64_MAX - i, key_cycle[i % 3], b"x" * (i % 7), i, i or None, TRACE if i % 5 else None, "p" * (i % 3))
                for i in range(count)
            ],
        ),
        Ack(topic="t", subscription="s", session=3, positions=list(range(count))),
        Nack(topic="t", subscription="s", session=3, positions=list(range(count))),
        Receipt(req=1, positions=list(range(count)), duplicates=[i % 2 == 0 for i in range(count)]),
    ]
    decoded = Decoder().feed(b"".join(encode(frame) for frame in batch))
    assert same(decoded, batch)


def test_error_codes_encode_as_their_strings() -> None:
    frame = Error(code=ErrorCode.UNKNOWN_SESSION, message="gone", req=4)
    [decoded] = Decoder(accept="client").feed(encode(frame))
    assert isinstance(decoded, Error)
    assert type(decoded.code) is str
    assert decoded.code == ErrorCode.UNKNOWN_SESSION.value == "unknown_session"


def test_session_timeout_accepts_an_integral_number() -> None:
    body = body_of(Connected(version=1, server="s", max_frame=10, session_timeout=1.5))
    body["session_timeout"] = 10
    [decoded] = Decoder(accept="client").feed(raw(body))
    assert isinstance(decoded, Connected)
    assert type(decoded.session_timeout) is float
    assert decoded.session_timeout == 10.0


# -- incremental decoding -------------------------------------------------------------------


@given(st.lists(frames, max_size=6), st.lists(st.integers(0, 10**6), max_size=12))
def test_any_split_of_the_stream_gives_the_same_frames(sent: list[Frame], cuts: list[int]) -> None:
    stream = b"".join(encode(frame) for frame in sent)
    points = sorted({cut % (len(stream) + 1) for cut in cuts})
    decoder = Decoder()
    decoded: list[Frame] = []
    for start, end in zip([0, *points], [*points, len(stream)], strict=True):
        decoded += decoder.feed(stream[start:end])
        assert decoder.buffered <= 4 + DEFAULT_MAX_FRAME
    assert same(decoded, sent)
    assert decoder.buffered == 0


@given(st.lists(frames, min_size=1, max_size=3))
def test_byte_by_byte_and_other_buffer_types(sent: list[Frame]) -> None:
    stream = b"".join(encode(frame) for frame in sent)
    decoder = Decoder()
    decoded: list[Frame] = []
    for i in range(len(stream)):
        chunk = stream[i : i + 1]
        decoded += decoder.feed(bytearray(chunk) if i % 2 else memoryview(chunk))
    assert same(decoded, sent)


def test_partial_frame_waits_for_the_rest() -> None:
    data = encode(Ping(nonce=9))
    decoder = Decoder()
    assert decoder.feed(data[:3]) == []
    assert decoder.feed(data[3:-1]) == []
    assert decoder.buffered == len(data) - 1
    assert decoder.feed(data[-1:] + data[:5]) == [Ping(nonce=9)]
    assert decoder.buffered == 5
    assert decoder.feed(data[5:]) == [Ping(nonce=9)]


# -- frame size -----------------------------------------------------------------------------


def test_oversized_length_is_rejected_on_its_header_alone() -> None:
    decoder = Decoder(100)
    assert decoder.feed(struct.pack(">I", 101)[:2]) == []
    with pytest.raises(ProtocolError) as info:
        decoder.feed(struct.pack(">I", 101)[2:])  # no body byte has come
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE
    assert "101" in info.value.message and "100" in info.value.message
    assert decoder.buffered == 0


def test_oversized_frame_is_never_buffered() -> None:
    decoder = Decoder(1000)
    with pytest.raises(ProtocolError):
        decoder.feed(encode(Ping(nonce=1)) + struct.pack(">I", 2**32 - 1) + bytes(100_000))
    assert decoder.buffered == 0


def test_frame_of_exactly_max_frame_is_accepted() -> None:
    frame = Error(code="x", message="", req=None)
    size = len(encode(frame)) - 4
    frame = replace(frame, message="m" * (200 - size - 1))  # 1 more byte of str header (str8)
    data = encode(frame)
    assert len(data) - 4 == 200
    assert Decoder(200).feed(data) == [frame]
    assert rejection(data, max_frame=199).code is ErrorCode.FRAME_TOO_LARGE


def test_default_limit() -> None:
    assert DEFAULT_MAX_FRAME == 5 * 1024 * 1024 == Decoder().max_frame
    assert (OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION) == (5, 9)


@pytest.mark.parametrize("bad", [0, -1, 2**32, True, 1.5, "5"])
def test_decoder_limit_must_be_a_positive_32_bit_int(bad: Any) -> None:
    with pytest.raises(KeyFailoverError, match="max_frame"):
        Decoder(bad)


def test_decoder_accept_is_checked() -> None:
    with pytest.raises(KeyFailoverError, match="accept"):
        Decoder(accept="both")  # type: ignore[arg-type]


# -- validation -----------------------------------------------------------------------------

SAMPLES: dict[str, Frame] = {
    frame.type: frame
    for frame in (
        Connect(version=1, token="secret", client="c"),
        Produce(req=1, topic="t", producer="p", messages=[(1, "k", b"v")], properties=[TRACE]),
        Subscribe(req=1, topic="t", subscription="s", consumer="c", receiver_queue=10, subscription_type="shared"),
        Flow(topic="t", subscription="s", session=1, permits=5),
        Ack(topic="t", subscription="s", session=1, positions=[1, 2]),
        Nack(topic="t", subscription="s", session=1, positions=[1, 2]),
        Extend(topic="t", subscription="s", session=1, positions=[1, 2], req=4),
        CloseConsumer(req=1, topic="t", subscription="s", session=1),
        Read(req=1, topic="t", after=5, limit=100, slots=(10, 20)),
        Ping(nonce=1),
        Close(),
        Connected(version=1, server="keyfailover", max_frame=1024, session_timeout=10.0),
        Receipt(req=1, positions=[1, 2], duplicates=[False, True]),
        Subscribed(req=1, session=1, consumer="c", ranges=[(0, 99), (200, HASH_RANGE_SIZE - 1)], secret="f00d"),
        Messages(session=1, messages=[(1, "k", b"v", 0, 7, None, "p"), (2, None, b"w", 1, None, TRACE, None)]),
        Entries(req=1, through=7, last=9, messages=[(1, "k", b"v", 7, None, None), (3, None, b"w", None, TRACE, "p")]),
        RangesChanged(session=1, epoch=2, ranges=[(0, 99)]),
        ConsumerClosed(session=1, reason="timeout", req=None),
        Settled(req=4),
        Pong(nonce=1),
        Error(code="unknown_session", message="no such session", req=3),
    )
}

# (frame type, field, bad value): each must be refused with bad_field naming the field.
BAD_FIELDS: list[tuple[str, str, object]] = [
    # ints: bool is not an int, floats are not ints, int64 bounds, non-negative counts
    ("ping", "nonce", True),
    ("ping", "nonce", 1.0),
    ("ping", "nonce", INT64_MAX + 1),
    ("pong", "nonce", "1"),
    ("connect", "version", -1),
    ("connect", "version", None),
    ("produce", "req", -1),
    ("subscribe", "receiver_queue", -1),
    ("subscribe", "receiver_queue", False),
    ("flow", "permits", -1),
    ("flow", "session", 2**64 - 1),
    ("ack", "positions", [1, -1]),
    ("ack", "positions", [1, True]),
    ("ack", "positions", [INT64_MAX + 1]),
    ("ack", "positions", 5),
    ("ack", "positions", [[1]]),
    ("nack", "positions", [None]),
    ("consumer_closed", "req", -1),
    ("error", "req", 1.5),
    # names: non-empty, at most 256 chars, no NUL; str only
    ("produce", "topic", ""),
    ("produce", "topic", "t" * (MAX_NAME_LENGTH + 1)),
    ("produce", "topic", "a\0b"),
    ("produce", "topic", b"t"),
    ("subscribe", "subscription", ""),
    ("subscribe", "consumer", ""),
    ("subscribe", "consumer", None),
    ("flow", "subscription", "x" * 1000),
    ("produce", "producer", ""),
    ("connect", "client", ""),
    ("connect", "client", None),
    ("connect", "token", 7),
    ("subscribed", "consumer", ""),
    ("connected", "server", ""),
    ("consumer_closed", "reason", ""),
    ("error", "code", ""),
    ("error", "message", None),
    # produce batches: [seq, key, payload]
    ("produce", "messages", [[-1, "k", b"v"]]),
    ("produce", "messages", [[True, "k", b"v"]]),
    ("produce", "messages", [[1, 5, b"v"]]),
    ("produce", "messages", [[1, 1.5, b"v"]]),
    ("produce", "messages", [[1, ["k"], b"v"]]),
    ("produce", "messages", [[1, "k", "v"]]),
    ("produce", "messages", [[1, "k", None]]),
    ("produce", "messages", [[1, "k"]]),
    ("produce", "messages", [[1, "k", b"v", 0]]),
    ("produce", "messages", [b"abc"]),
    ("produce", "messages", ["abc"]),
    ("produce", "messages", [None]),
    ("produce", "messages", [[1, "k", b"v"], 7]),
    ("produce", "messages", b"messages"),
    # produce properties: nil, or one bin (a msgpack map of str to str) or nil per message
    ("produce", "properties", []),
    ("produce", "properties", [None, None]),
    ("produce", "properties", [["k", "v"]]),
    ("produce", "properties", ["k=v"]),
    ("produce", "properties", [7]),
    ("produce", "properties", TRACE),
    ("produce", "properties", [b"\x80"]),
    ("produce", "properties", [b"\x81\xa1k\x01"]),
    ("produce", "properties", [msgpack.packb({"k": b"v"}, use_bin_type=True)]),
    ("produce", "properties", [msgpack.packb({str(i): "" for i in range(MAX_PROPERTIES + 1)})]),
    ("produce", "properties", [TRACE + b"\x00"]),
    # deliveries: [position, key, payload, redelivery_count, publish_time, properties, producer]
    ("messages", "messages", [[-1, "k", b"v", 0, 1, None, None]]),
    ("messages", "messages", [[None, "k", b"v", 0, 1, None, None]]),
    ("messages", "messages", [[1, "k", b"v", -1, 1, None, None]]),
    ("messages", "messages", [[1, "k", b"v", True, 1, None, None]]),
    ("messages", "messages", [[1, 2, b"v", 0, 1, None, None]]),
    ("messages", "messages", [[1, "k", "v", 0, 1, None, None]]),
    ("messages", "messages", [[1, "k", b"v", 0, -1, None, None]]),
    ("messages", "messages", [[1, "k", b"v", 0, 1.5, None, None]]),
    ("messages", "messages", [[1, "k", b"v", 0, True, None, None]]),
    ("messages", "messages", [[1, "k", b"v", 0, "now", None, None]]),
    ("messages", "messages", [[1, "k", b"v", 0, 1, "trace", None]]),
    ("messages", "messages", [[1, "k", b"v", 0, 1, b"\x80", None]]),
    ("messages", "messages", [[1, "k", b"v", 0, 1, b"\xc1", None]]),
    ("messages", "messages", [[1, "k", b"v", 0, 1, None, b"p"]]),
    ("messages", "messages", [[1, "k", b"v", 0, 1, None, 7]]),
    ("messages", "messages", [[1, "k", b"v", 0, 1, None]]),  # a version 8 delivery, without its producer
    ("messages", "messages", [[1, "k", b"v", 0, 1]]),  # a version 6 delivery, without its properties
    ("messages", "messages", [[1, "k", b"v", 0]]),  # a version 5 delivery, without its publish time
    ("messages", "messages", ["abcdef"]),
    ("messages", "messages", [b"abcdef"]),
    ("messages", "messages", [[1, "k", b"v", 0, None, None, None], [2, "k", b"v", 0, 0, None, None, 0]]),
    ("messages", "messages", None),
    # read: a position, a limit up to MAX_READ, an optional [first, last] pair of slots
    ("read", "req", None),
    ("read", "topic", ""),
    ("read", "after", -1),
    ("read", "after", INT64_MAX + 1),
    ("read", "after", None),
    ("read", "limit", MAX_READ + 1),
    ("read", "limit", -1),
    ("read", "limit", True),
    ("read", "limit", None),
    ("read", "slots", [5, 4]),
    ("read", "slots", [0, HASH_RANGE_SIZE]),
    ("read", "slots", [-1, 3]),
    ("read", "slots", [1]),
    ("read", "slots", [1, 2, 3]),
    ("read", "slots", [[1, 2]]),
    ("read", "slots", [1, 2.0]),
    ("read", "slots", [True, 2]),
    ("read", "slots", 5),
    # entries: [position, key, payload, publish_time, properties, producer], ascending, through covering them
    ("entries", "through", -1),
    ("entries", "through", 2),
    ("entries", "last", None),
    ("entries", "last", -1),
    ("entries", "messages", [[0, "k", b"v", None, None, None]]),
    ("entries", "messages", [[-1, "k", b"v", None, None, None]]),
    ("entries", "messages", [[1, "k", b"v", None, None, None], [1, "k", b"w", None, None, None]]),
    ("entries", "messages", [[2, "k", b"v", None, None, None], [1, "k", b"w", None, None, None]]),
    ("entries", "messages", [[1, 2, b"v", None, None, None]]),
    ("entries", "messages", [[1, "k", "v", None, None, None]]),
    ("entries", "messages", [[1, "k", b"v", -1, None, None]]),
    ("entries", "messages", [[1, "k", b"v", True, None, None]]),
    ("entries", "messages", [[1, "k", b"v", None, "trace", None]]),
    ("entries", "messages", [[1, "k", b"v", None, b"\x80", None]]),
    ("entries", "messages", [[1, "k", b"v", None, None, b"p"]]),
    ("entries", "messages", [[1, "k", b"v", None, None]]),  # a version 8 entry, without its producer
    ("entries", "messages", [[1, "k", b"v", 0, None, None, None]]),  # a delivery, with a redelivery count
    ("entries", "messages", [[1, "k", b"v", None]]),
    ("entries", "messages", [[i, "k", b"", None, None, None] for i in range(1, MAX_READ + 2)]),
    ("entries", "messages", None),
    # receipts, ranges, limits
    ("receipt", "duplicates", [0, 1]),
    ("receipt", "duplicates", [False]),
    ("receipt", "positions", [1]),
    ("ranges_changed", "epoch", -1),
    ("connected", "max_frame", 0),
    ("connected", "max_frame", 2**32),
    ("connected", "session_timeout", 0.0),
    ("connected", "session_timeout", -1.0),
    ("connected", "session_timeout", math.inf),
    ("connected", "session_timeout", math.nan),
    ("connected", "session_timeout", True),
    ("connected", "session_timeout", "10"),
    ("connected", "version", 1.0),
]


@pytest.mark.parametrize(("frame_type", "field", "value"), BAD_FIELDS)
def test_bad_field_values_are_rejected(frame_type: str, field: str, value: object) -> None:
    body = body_of(SAMPLES[frame_type])
    body[field] = value
    error = rejection(raw(body))
    assert error.code is ErrorCode.BAD_FIELD
    assert frame_type in error.message and field in error.message


def test_bad_item_is_named_by_index() -> None:
    body = body_of(Ack(topic="t", subscription="s", session=1, positions=[1, 1, 2, 3]))
    body["positions"] = [1, 1, 2, True, -5]
    assert "item 3 must be a non-negative int64, got True (bool)" in rejection(raw(body)).message
    body = body_of(SAMPLES["messages"])
    body["messages"] = [[1, "k", b"v", 0, None, None, None]] * 3 + [[2, "k", b"x" * 10_000, -1, None, None, None]]
    message = rejection(raw(body)).message
    assert "item 3 must be an array [position" in message
    assert len(message) < 400  # a 10 kB payload is cut short in the message


# (bad ranges value, what the message must say): refused in subscribed and ranges_changed alike.
BAD_RANGES: list[tuple[object, str]] = [
    (None, "must be an array of [start, end] pairs, got None"),
    ((0, 99), "item 0 must be an array [start, end]"),  # a bare pair, not a list of pairs
    ("0-99", "must be an array of [start, end] pairs"),
    (b"\x00", "must be an array of [start, end] pairs"),
    ([[0]], "item 0 must be an array [start, end]"),
    ([[0, 1, 2]], "item 0 must be an array [start, end]"),
    ([[]], "item 0 must be an array [start, end]"),
    ([7], "item 0 must be an array [start, end]"),
    ([[0, 9], "10-20"], "item 1 must be an array [start, end]"),
    ([[0, None]], "item 0 must be an array [start, end]"),
    ([[None, None]], "item 0 must be an array [start, end]"),
    ([[0, 9.0]], "item 0 must be an array [start, end]"),
    ([[False, True]], "got (False, True) (tuple)"),
    ([[-1, 5]], "hash slots in [0, 65535]"),
    ([[0, HASH_RANGE_SIZE]], "hash slots in [0, 65535]"),
    ([[0, 2**64 - 1]], "hash slots in [0, 65535]"),
    ([[10, 9]], "with start <= end, got (10, 9)"),
    ([[0, 9], [20, 29], [25, 40]], "item 2 [25, 40] starts at or before the end 29 of item 1"),
    ([[0, 9], [9, 12]], "item 1 [9, 12] starts at or before the end 9 of item 0"),
    ([[20, 29], [0, 9]], "item 1 [0, 9] starts at or before the end 29 of item 0; expected sorted, non-overlapping"),
    ([[5, 5], [5, 5]], "item 1 [5, 5] starts at or before the end 5 of item 0"),
    ([[slot, slot] for slot in range(HASH_RANGE_SIZE)] + [[0, 0]], "at most 65536 [start, end] pairs, got 65537"),
]


@pytest.mark.parametrize("frame_type", ["subscribed", "ranges_changed"])
@pytest.mark.parametrize(("value", "expected"), BAD_RANGES, ids=[f"bad{i}" for i in range(len(BAD_RANGES))])
def test_bad_ranges_are_rejected_with_what_was_expected(frame_type: str, value: object, expected: str) -> None:
    body = body_of(SAMPLES[frame_type])
    body["ranges"] = value
    error = rejection(raw(body), accept="client")
    assert error.code is ErrorCode.BAD_FIELD
    assert error.message.startswith(f"{frame_type} frame: field 'ranges' ")
    assert expected in error.message
    assert len(error.message) < 400  # a huge list is not echoed back


def valid_ranges(pairs: list[tuple[int, int]]) -> bool:
    """The rule of docs/protocol.md, stated plainly: slots, start <= end, each start after the previous end."""
    ends = [-1] + [end for _, end in pairs]
    return all(
        0 <= start <= end <= LAST_SLOT and start > previous for (start, end), previous in zip(pairs, ends, strict=False)
    )


edge_slots = st.sampled_from([-1, 0, 1, LAST_SLOT - 1, LAST_SLOT, HASH_RANGE_SIZE]) | st.integers(
    -3, HASH_RANGE_SIZE + 3
)


@settings(max_examples=400)
@given(st.lists(st.tuples(edge_slots, edge_slots), max_size=6) | slot_range_lists(), st.booleans())
def test_ranges_are_accepted_exactly_when_valid(pairs: list[tuple[int, int]], subscribed: bool) -> None:
    frame: Frame = (
        Subscribed(req=1, session=2, consumer="c", ranges=pairs, secret="s")
        if subscribed
        else RangesChanged(session=2, epoch=3, ranges=pairs)
    )
    data = encode(frame)
    if valid_ranges(pairs):
        assert same(Decoder(accept="client").feed(data), [frame])
    else:
        error = rejection(data, accept="client")
        assert error.code is ErrorCode.BAD_FIELD and "field 'ranges' item " in error.message


@pytest.mark.parametrize(
    "ranges",
    [
        [],  # a standby
        [(0, HASH_RANGE_SIZE - 1)],
        [(0, 0), (1, 1)],  # adjacent ranges are valid (a server merges them, but need not)
        [(slot, slot) for slot in range(HASH_RANGE_SIZE)],  # the most there can be: every slot alone
    ],
    ids=["standby", "everything", "adjacent", "every-slot"],
)
def test_valid_ranges_round_trip(ranges: list[tuple[int, int]]) -> None:
    for frame in (
        Subscribed(req=1, session=2, consumer="c", ranges=ranges, secret="s"),
        RangesChanged(session=2, epoch=3, ranges=ranges),
    ):
        assert same(Decoder(accept="client").feed(encode(frame)), [frame])


@pytest.mark.parametrize("frame_type", sorted(SAMPLES))
def test_missing_and_extra_fields_are_rejected(frame_type: str) -> None:
    body = body_of(SAMPLES[frame_type])
    body["extra"] = 1
    error = rejection(raw(body))
    assert error.code is ErrorCode.BAD_FIELD and "extra: 'extra'" in error.message
    for field in fields(SAMPLES[frame_type]):
        body = body_of(SAMPLES[frame_type])
        del body[field.name]
        error = rejection(raw(body))
        assert error.code is ErrorCode.BAD_FIELD and f"missing: {field.name}" in error.message


def test_field_names_must_be_str() -> None:
    assert rejection(raw({"type": "ping", b"nonce": 1})).code is ErrorCode.BAD_FIELD


def truncated(body: object) -> bytes:
    """A body one byte short of the value it starts, with a length prefix that says so."""
    packed: bytes = msgpack.packb(body)
    return struct.pack(">I", len(packed) - 1) + packed[:-1]


MALFORMED: list[bytes] = [
    b"\x00\x00\x00\x00",  # empty body
    b"\x00\x00\x00\x01\xc1",  # the never-used msgpack byte
    truncated({"type": "ping", "nonce": 1}),
    struct.pack(">I", 2) + b"\x01\x02",  # two values in one body
    raw([{"type": "ping", "nonce": 1}]),  # not a map
    raw("ping"),
    raw({"nonce": 1}),  # no type
    raw({"type": 1, "nonce": 1}),
    raw({"type": b"ping", "nonce": 1}),  # type must be str
    raw({b"type": "ping", "nonce": 1}),
    struct.pack(">I", 3) + b"\x81\x01\x01",  # int map key
    raw({"type": "ping", "nonce": {}}),  # nested map
    raw({"type": "produce", "req": 1, "topic": "t", "producer": None, "messages": [{}, {}]}),
    raw({str(i): i for i in range(65)}),  # more fields than any frame by far
]


@pytest.mark.parametrize("data", MALFORMED)
def test_malformed_bodies_are_rejected(data: bytes) -> None:
    assert rejection(data).code is ErrorCode.MALFORMED_FRAME


def test_invalid_utf8_is_malformed() -> None:
    packed = msgpack.packb({"type": "pong", "nonce": 1})
    packed = packed.replace(b"\xa4pong", b"\xa4p\xffng")
    assert rejection(struct.pack(">I", len(packed)) + packed).code is ErrorCode.MALFORMED_FRAME


def test_unknown_type_is_rejected() -> None:
    error = rejection(raw({"type": "bogus"}))
    assert error.code is ErrorCode.UNKNOWN_TYPE and "bogus" in error.message


@pytest.mark.parametrize("frame_type", sorted(SAMPLES))
def test_frames_of_the_wrong_direction_are_rejected(frame_type: str) -> None:
    frame = SAMPLES[frame_type]
    own: Accept = "server" if isinstance(frame, CLIENT_TYPES) else "client"
    other: Accept = "client" if own == "server" else "server"
    assert Decoder(accept=own).feed(encode(frame)) == [frame]
    error = rejection(encode(frame), accept=other)
    assert error.code is ErrorCode.UNKNOWN_TYPE and frame_type in error.message


def test_decoder_stays_dead_after_a_fatal_error() -> None:
    decoder = Decoder(accept="server")
    good = encode(Ping(nonce=1))
    with pytest.raises(ProtocolError) as first:
        decoder.feed(good + raw({"type": "ping", "nonce": 2**64 - 1}) + good)
    for _ in range(3):
        with pytest.raises(ProtocolError) as again:
            decoder.feed(good)
        assert again.value is first.value
    assert decoder.buffered == 0


# -- errors ---------------------------------------------------------------------------------


def test_fatal_codes() -> None:
    assert {code.value for code in FATAL_CODES} == {
        "malformed_frame",
        "unknown_type",
        "frame_too_large",
        "bad_field",
        "unauthorized",
        "version_mismatch",
        "not_connected",
        "too_many_connections",
        "slow_connection",
    }
    for code in ErrorCode:
        error = ProtocolError(code, "why")
        assert error.fatal is (code in FATAL_CODES)
        assert isinstance(error, KeyFailoverError) and isinstance(error, ValueError)
        assert str(error) == f"{code.value}: why"
        assert (error.code, error.message) == (code, "why")


def test_encode_refuses_what_the_wire_cannot_carry() -> None:
    with pytest.raises(FrameEncodeError, match="expected a protocol frame"):
        encode("ping")  # type: ignore[arg-type]
    with pytest.raises(FrameEncodeError, match="'ping' frame"):
        encode(Ping(nonce=2**64))
    with pytest.raises(FrameEncodeError, match="'produce' frame"):
        encode(Produce(req=1, topic="t", producer=None, messages=[(None, "\ud800", b"")]))
    with pytest.raises(FrameEncodeError):
        encode(Produce(req=1, topic="t", producer=None, messages=[(None, object(), b"")]))  # type: ignore[list-item]


# -- fuzzing --------------------------------------------------------------------------------

FUZZ = settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])


def feed_hostile(
    chunks: list[bytes], max_frame: int = 4096, accept: Accept = "any"
) -> tuple[list[Frame], ProtocolError | None]:
    """Feed ``chunks``; only frames or a fatal ProtocolError may come out, and the buffer stays bounded."""
    decoder = Decoder(max_frame, accept=accept)
    decoded: list[Frame] = []
    error: ProtocolError | None = None
    for chunk in chunks:
        try:
            decoded += decoder.feed(chunk)
        except ProtocolError as exc:
            assert exc.fatal
            assert decoder.buffered == 0
            with pytest.raises(ProtocolError):
                decoder.feed(encode(Ping(nonce=1)))
            error = exc
            break
        assert decoder.buffered <= 4 + max_frame
    for frame in decoded:  # whatever was accepted is a valid frame that survives a round trip
        assert same(Decoder(accept=accept).feed(encode(frame)), [frame])
    return decoded, error


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=5), st.sampled_from(get_args(Accept)))
def test_fuzz_random_bytes(chunks: list[bytes], accept: Accept) -> None:
    feed_hostile(chunks, accept=accept)


@FUZZ
@given(st.binary(max_size=600))
def test_fuzz_random_bodies(body: bytes) -> None:
    feed_hostile([struct.pack(">I", len(body)) + body])


@pytest.mark.slow
@FUZZ
@given(msgpack_values)
def test_fuzz_random_msgpack_values(value: object) -> None:
    feed_hostile([raw(value)])


@pytest.mark.slow
@FUZZ
@given(st.sampled_from(sorted(SAMPLES)), st.data())
def test_fuzz_random_fields(frame_type: str, data: st.DataObject) -> None:
    """Valid frame maps with fields replaced, added or removed, and items replaced."""
    body = body_of(SAMPLES[frame_type])
    for _ in range(data.draw(st.integers(1, 3))):
        field = data.draw(st.sampled_from([*body, "extra"]))
        action = data.draw(st.sampled_from(["replace", "delete", "item"]))
        if action == "delete":
            body.pop(field, None)
        elif action == "item" and isinstance(body.get(field), list) and body[field]:
            items = body[field]
            items[data.draw(st.integers(0, len(items) - 1))] = data.draw(msgpack_values)
        else:
            body[field] = data.draw(msgpack_values)
    feed_hostile([raw(body)])


@st.composite
def mutated_streams(draw: st.DrawFn) -> bytes:
    return draw(mutated(b"".join(encode(frame) for frame in draw(st.lists(frames, min_size=1, max_size=3)))))


@pytest.mark.slow
@FUZZ
@given(mutated_streams(), st.lists(st.integers(0, 10**6), max_size=4))
def test_fuzz_mutated_frames(stream: bytes, cuts: list[int]) -> None:
    points = sorted({cut % (len(stream) + 1) for cut in cuts})
    chunks = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    split_frames, split_error = feed_hostile(chunks, max_frame=1 << 16)
    whole_frames, whole_error = feed_hostile([stream], max_frame=1 << 16)
    if whole_error is None:
        assert split_error is None and same(split_frames, whole_frames)
    else:  # the same first bad frame, however the stream was cut
        assert split_error is not None and str(split_error) == str(whole_error)


@given(frames)
def test_every_proper_prefix_of_a_frame_waits(frame: Frame) -> None:
    data = encode(frame)
    for cut in range(0, len(data), max(1, len(data) // 100)):
        assert Decoder().feed(data[:cut]) == []


def test_memory_stays_bounded_on_an_array_of_maps() -> None:
    """An array of empty maps would be ~80 bytes of memory per byte received; the second map stops it."""
    max_frame = 1 << 20
    body = b"\xdd" + struct.pack(">I", max_frame - 5) + b"\x80" * (max_frame - 5)
    data = struct.pack(">I", len(body)) + body
    tracemalloc.start()
    try:
        error = rejection(data, max_frame=max_frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert error.code is ErrorCode.MALFORMED_FRAME
    assert peak < 4 * max_frame


# -- documentation --------------------------------------------------------------------------


def test_docs_describe_every_frame_field_and_code() -> None:
    doc = DOC_PATH.read_text(encoding="utf-8")
    for cls in (*CLIENT_TYPES, *SERVER_TYPES):
        section = re.search(rf"^### `{cls.type}`.*?(?=^##)", doc, re.MULTILINE | re.DOTALL)
        assert section is not None, cls.type
        for field in fields(cls):
            assert f"`{field.name}`" in section.group(), (cls.type, field.name)
    for code in ErrorCode:
        assert f"`{code.value}`" in doc, code
