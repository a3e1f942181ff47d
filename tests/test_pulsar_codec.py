"""keyfailover.broker.pulsar: Pulsar frames, CRC32C, batched entries and topic names, without a server."""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Callable

import cramjam
import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyfailover.broker.pulsar import (
    EVENT_TIME_PROPERTY,
    NULL_VALUE_PROPERTY,
    PARTITION_KEY_B64_PROPERTY,
    PARTITION_KEY_PROPERTY,
    PULSAR_METADATA_PROPERTY,
    MessageFields,
    PulsarDecoder,
    PulsarFrame,
    PulsarFrameError,
    PulsarMetadata,
    SendFrame,
    SingleFields,
    TopicNameError,
    crc32c,
    decompress,
    encode_command,
    encode_delivery,
    encode_message,
    encode_receipt,
    from_pulsar,
    keyfailover_topic,
    parse_message,
    split_batch,
    to_pulsar,
)
from keyfailover.broker.pulsar._codec import metadata_fields, single_fields
from keyfailover.broker.pulsar._wire import decode_metadata, decode_send, decode_single
from keyfailover.broker.pulsar.PulsarApi_pb2 import (
    LZ4,
    NONE,
    SNAPPY,
    ZLIB,
    ZSTD,
    BaseCommand,
    MessageMetadata,
    SingleMessageMetadata,
)
from keyfailover.broker.server._pulsar_send import sent_messages
from keyfailover.wire.properties import DELIVER_AT_PROPERTY, decode_properties, delivery_time, encode_properties
from tests.pulsar_wire import command, connect_command, send_frame


def test_crc32c_is_castagnoli() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C (iSCSI)


def test_a_send_frame_round_trips_with_its_checksum() -> None:
    frames, error = PulsarDecoder(1 << 20).feed(send_frame(7, b"payload", "key"))
    assert error is None
    [frame] = frames
    assert frame == SendFrame(1, 7, None, False, False, frame.rest)
    sent = parse_message(frame.rest)
    assert (sent.payload, sent.metadata.partition_key, sent.checksum_ok) == (b"payload", "key", True)


def test_a_flipped_payload_bit_fails_the_checksum_only() -> None:
    frame = bytearray(send_frame(7, b"payload"))
    frame[-1] ^= 1
    [decoded], error = PulsarDecoder(1 << 20).feed(bytes(frame))
    assert error is None
    assert parse_message(decoded.rest).checksum_ok is False


@given(cut=st.lists(st.integers(0, 200), max_size=5))
def test_any_split_of_the_stream_gives_the_same_frames(cut: list[int]) -> None:
    stream = (
        encode_command(connect_command("t")) + send_frame(1, b"a" * 50, "k") + encode_command(command(BaseCommand.PING))
    )
    decoder = PulsarDecoder(1 << 20)
    frames = []
    start = 0
    for at in [*sorted({min(c, len(stream)) for c in cut}), len(stream)]:
        got, error = decoder.feed(stream[start:at])
        assert error is None
        frames += got
        start = at
    assert [BaseCommand.SEND if isinstance(f, SendFrame) else f.command.type for f in frames] == [
        BaseCommand.CONNECT,
        BaseCommand.SEND,
        BaseCommand.PING,
    ]
    assert decoder.buffered == 0


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (struct.pack(">I", 1 << 20), "over the limit of 65536 bytes"),
        (struct.pack(">I", 2) + b"xx", "too small"),
        (struct.pack(">II", 8, 9) + b"1234", "does not fit its frame"),
        (struct.pack(">II", 8, 4) + b"\xff\xff\xff\xff", "not a valid BaseCommand"),
        (struct.pack(">II", 6, 2) + b"\x08\x7f", "lacks required fields"),  # an unknown command type
        (struct.pack(">II", 6, 2) + b"\x08\x06", "SEND command has no body"),
        (struct.pack(">II", 8, 4) + b"\x08\x06\x32\x00", "lacks required fields"),  # SEND without its ids
    ],
)
def test_malformed_frames_are_refused_and_the_decoder_stays_dead(data: bytes, expected: str) -> None:
    decoder = PulsarDecoder(65536)
    frames, error = decoder.feed(data)
    assert frames == []
    assert error is not None and expected in str(error)
    assert decoder.feed(encode_command(command(BaseCommand.PING))) == ([], error)
    assert decoder.buffered == 0


def test_an_oversized_frame_is_refused_before_its_body_arrives() -> None:
    decoder = PulsarDecoder(1024)
    _, error = decoder.feed(struct.pack(">I", 1025))
    assert error is not None and error.too_large
    assert decoder.buffered == 0


def batch(*messages: tuple[str | None, bytes]) -> bytes:
    out = b""
    for key, payload in messages:
        single = SingleMessageMetadata(payload_size=len(payload))
        if key is not None:
            single.partition_key = key
        body = single.SerializeToString()
        out += struct.pack(">I", len(body)) + body + payload
    return out


def test_a_batched_entry_splits_into_its_messages_with_their_own_keys() -> None:
    entry = batch(("a", b"1"), (None, b"22"), ("b", b""))
    split = split_batch(entry, 3)
    assert [(single.partition_key, payload) for single, payload in split] == [
        ("a", b"1"),
        (None, b"22"),
        ("b", b""),
    ]


@pytest.mark.parametrize(
    ("entry", "count", "expected"),
    [
        (batch(("a", b"1")), 2, "is missing"),
        (batch(("a", b"1")) + b"x", 1, "bytes after its 1 messages"),
        (struct.pack(">I", 99) + b"\x00", 1, "runs past the end"),
        (struct.pack(">I", 2) + b"\x18\x09", 1, "payload size 9 runs past the end"),
    ],
)
def test_a_malformed_batch_is_refused(entry: bytes, count: int, expected: str) -> None:
    with pytest.raises(PulsarFrameError, match=expected):
        split_batch(entry, count)


def test_a_message_part_without_metadata_is_refused() -> None:
    with pytest.raises(PulsarFrameError, match="metadata size 99"):
        parse_message(struct.pack(">I", 99))
    with pytest.raises(PulsarFrameError, match="no metadata size"):
        parse_message(b"")


def test_encode_message_is_what_parse_message_reads() -> None:
    metadata = MessageMetadata(producer_name="p", sequence_id=1, publish_time=2, ordering_key=b"\x00k")
    frame = encode_message(command(BaseCommand.SEND, producer_id=1, sequence_id=1), metadata.SerializeToString(), b"x")
    [decoded], _ = PulsarDecoder(1 << 20).feed(frame)
    sent = parse_message(decoded.rest)
    assert (sent.metadata.ordering_key, sent.payload, sent.checksum_ok) == (b"\x00k", b"x", True)


def test_event_time_is_read_by_hand_and_properties_left_to_protobuf() -> None:
    """A plain message with an event time stays on the fast path; one with properties is parsed by protobuf."""
    metadata = MessageMetadata(producer_name="p", sequence_id=1, publish_time=2, partition_key="k", event_time=1234)
    body = metadata.SerializeToString()
    assert decode_metadata(body, 0, len(body)) == ("k", None, 1234, 0, 0, None)
    metadata.schema_version = b"\x00" * 7 + b"\x01"  # a producer with a schema: still by hand
    body = metadata.SerializeToString()
    assert decode_metadata(body, 0, len(body)) == ("k", None, 1234, 0, 0, b"\x00" * 7 + b"\x01")
    metadata.schema_version = b"\x01"  # no version this server gives out: left to protobuf
    body = metadata.SerializeToString()
    assert decode_metadata(body, 0, len(body)) is None
    metadata.ClearField("schema_version")
    metadata.properties.add(key="trace", value="t-1")
    metadata.properties.add(key="", value="")
    body = metadata.SerializeToString()
    assert decode_metadata(body, 0, len(body)) is None
    sent = parse_message(struct.pack(">I", len(body)) + body)
    assert (sent.metadata.properties, sent.metadata.event_time) == ((("trace", "t-1"), ("", "")), 1234)


def test_a_batched_messages_properties_and_event_time_are_its_own() -> None:
    singles = [
        SingleMessageMetadata(payload_size=1, partition_key="a", event_time=5),
        SingleMessageMetadata(payload_size=1, partition_key="b"),
        SingleMessageMetadata(payload_size=1, partition_key="c", event_time=7),
    ]
    singles[2].properties.add(key="REAL_TOPIC", value="persistent://public/default/t")
    entry = b"".join(
        struct.pack(">I", len(body)) + body + b"x" for body in (single.SerializeToString() for single in singles)
    )
    split = split_batch(entry, 3)
    assert [(single.properties, single.event_time) for single, _ in split] == [
        ((), 5),
        ((), 0),
        ((("REAL_TOPIC", "persistent://public/default/t"),), 7),
    ]


def delivered_metadata(frame: bytes) -> MessageMetadata:
    """The MessageMetadata of a MESSAGE frame, as a client reads it."""
    [decoded], error = PulsarDecoder(1 << 20).feed(frame)
    assert error is None and isinstance(decoded, PulsarFrame) and decoded.command.type == BaseCommand.MESSAGE
    rest = decoded.rest
    (size,) = struct.unpack_from(">I", rest, 6)
    return MessageMetadata.FromString(rest[10 : 10 + size])


@pytest.mark.parametrize(
    ("stored", "properties", "event_time"),
    [
        ({"trace": "t-1", EVENT_TIME_PROPERTY: "1718000000123"}, [("trace", "t-1")], 1718000000123),
        ({EVENT_TIME_PROPERTY: "18446744073709551615"}, [], 2**64 - 1),
        # a value that is no event time (a native producer may set anything) stays a property
        ({EVENT_TIME_PROPERTY: "soon"}, [(EVENT_TIME_PROPERTY, "soon")], 0),
        ({EVENT_TIME_PROPERTY: "0"}, [(EVENT_TIME_PROPERTY, "0")], 0),
        ({EVENT_TIME_PROPERTY: "18446744073709551616"}, [(EVENT_TIME_PROPERTY, "18446744073709551616")], 0),
        ({EVENT_TIME_PROPERTY: "1" * 5000}, [(EVENT_TIME_PROPERTY, "1" * 5000)], 0),
        ({EVENT_TIME_PROPERTY: "١٢٣"}, [(EVENT_TIME_PROPERTY, "١٢٣")], 0),  # digits, but not ASCII
        ({}, [], 0),
    ],
)
def test_a_delivery_carries_the_stored_properties_and_event_time(
    stored: dict[str, str], properties: list[tuple[str, str]], event_time: int
) -> None:
    metadata = delivered_metadata(encode_delivery(1, -1, 5, "k", b"v", properties=encode_properties(stored)))
    assert [(pair.key, pair.value) for pair in metadata.properties] == properties
    assert metadata.event_time == event_time and metadata.HasField("event_time") == (event_time > 0)


def test_a_delivery_is_named_after_its_stored_producer_or_the_server() -> None:
    """A message stored by a named producer goes out under its name; one stored without (an unnamed native
    producer's, a dead letter) under the server's, as Pulsar's metadata needs one."""
    assert delivered_metadata(encode_delivery(1, -1, 5, "k", b"v", producer="billing")).producer_name == "billing"
    assert delivered_metadata(encode_delivery(1, -1, 5, "k", b"v")).producer_name == "keyfailover"


names = st.text(max_size=10).filter(lambda name: name not in {EVENT_TIME_PROPERTY, PULSAR_METADATA_PROPERTY})


@given(st.lists(st.tuples(names, st.text(max_size=10)), max_size=5), st.integers(0, 2**64 - 1))
def test_a_pulsar_messages_properties_and_event_time_come_back_as_sent(
    pairs: list[tuple[str, str]], event_time: int
) -> None:
    stored = from_pulsar(pairs, event_time)
    assert to_pulsar(stored) == PulsarMetadata(dict(pairs), event_time)

    if event_time:  # kept as a property a native consumer reads
        assert decode_properties(stored)[EVENT_TIME_PROPERTY] == str(event_time)


def encrypted_metadata() -> MessageMetadata:
    """An encrypted, compressed batch's MessageMetadata as a producer writes it."""
    metadata = MessageMetadata(
        producer_name="p",
        sequence_id=3,
        publish_time=1,
        partition_key="k",
        encryption_algo="RSA",
        encryption_param=b"iv-bytes",
        compression=LZ4,
        uncompressed_size=99,
        num_messages_in_batch=4,
    )
    metadata.encryption_keys.add(key="app-key", value=b"encrypted data key").metadata.add(key="m", value="v")
    metadata.properties.add(key="plain", value="yes")
    return metadata


def test_an_encrypted_messages_context_is_stored_and_delivered_unchanged() -> None:
    """What a consumer needs to decrypt (keys, algorithm, parameter, and the compression and batch inside the
    ciphertext) travels as a reserved property and comes back in the MESSAGE's metadata, nothing else of it."""
    fields = metadata_fields(encrypted_metadata())
    assert fields.encrypted and fields.passed is not None
    stored = from_pulsar(fields.properties, fields.event_time, fields.passed)
    assert set(decode_properties(stored)) == {"plain", PULSAR_METADATA_PROPERTY}
    delivered = delivered_metadata(encode_delivery(1, -1, 5, "k", b"ciphertext", properties=stored))
    expected = encrypted_metadata()
    for name in ("encryption_keys", "encryption_algo", "encryption_param", "compression", "uncompressed_size"):
        assert getattr(delivered, name) == getattr(expected, name), name
    assert delivered.num_messages_in_batch == 4
    assert [(pair.key, pair.value) for pair in delivered.properties] == [("plain", "yes")]
    assert (delivered.producer_name, delivered.sequence_id) == ("keyfailover", 5)


@pytest.mark.parametrize(
    "value",
    [
        "not base64!",
        base64.b64encode(b"\xff\xff").decode(),  # not a MessageMetadata
        base64.b64encode(MessageMetadata(encryption_algo="RSA").SerializePartialToString()).decode(),  # no keys
    ],
)
def test_a_reserved_metadata_property_that_the_server_did_not_write_stays_a_property(value: str) -> None:
    kept = to_pulsar(encode_properties({PULSAR_METADATA_PROPERTY: value}))
    assert (kept.properties, kept.passed) == ({PULSAR_METADATA_PROPERTY: value}, None)


@pytest.mark.parametrize(("key", "delivered"), [("k", "k"), ("p-7", None), (b"p-7", b"p-7")])
def test_a_chunk_keeps_its_place_and_one_stored_under_its_uuid_goes_without_a_key(
    key: str | bytes, delivered: str | bytes | None
) -> None:
    """A keyless message's chunks are stored under its uuid (so they go to one consumer): delivered keyless."""
    metadata = MessageMetadata(
        producer_name="p", sequence_id=7, publish_time=1, uuid="p-7", chunk_id=1, num_chunks_from_msg=3
    )
    metadata.total_chunk_msg_size = 300
    fields = metadata_fields(metadata)
    assert (fields.chunk, fields.encrypted) == (("p-7", 1, 3), False)
    stored = from_pulsar(fields.properties, fields.event_time, fields.passed)
    message = delivered_metadata(encode_delivery(1, -1, 5, key, b"slice", properties=stored))
    assert (message.uuid, message.chunk_id, message.num_chunks_from_msg, message.total_chunk_msg_size) == (
        "p-7",
        1,
        3,
        300,
    )
    got = message.partition_key if message.HasField("partition_key") else None
    assert (message.ordering_key if message.HasField("ordering_key") else got) == delivered


COMPRESSORS: dict[int, Callable[[bytes], bytes]] = {
    LZ4: lambda data: bytes(cramjam.lz4.compress_block(data, store_size=False)),
    ZLIB: zlib.compress,
    ZSTD: lambda data: bytes(cramjam.zstd.compress(data)),
    SNAPPY: lambda data: bytes(cramjam.snappy.compress_raw(data)),
}
"""Each codec as Pulsar's clients write it: an LZ4 block, a zlib stream, a ZSTD frame, raw snappy."""


@pytest.mark.parametrize("codec", list(COMPRESSORS))
@given(data=st.binary(max_size=3000))
def test_each_codec_decompresses_what_a_client_compressed(codec: int, data: bytes) -> None:
    assert decompress(codec, COMPRESSORS[codec](data), len(data), 3000) == data


@pytest.mark.parametrize("codec", list(COMPRESSORS))
def test_a_payload_that_is_not_what_it_claims_is_refused(codec: int) -> None:
    data = b"abc" * 100
    compressed = COMPRESSORS[codec](data)
    with pytest.raises(PulsarFrameError, match="uncompressed size 301 is over the limit of 300 bytes"):
        decompress(codec, compressed, 301, 300)
    with pytest.raises(PulsarFrameError):  # a size that is not the data's
        decompress(codec, compressed, len(data) - 1, 1000)
    with pytest.raises(PulsarFrameError):
        decompress(codec, compressed, len(data) + 1, 1000)
    with pytest.raises(PulsarFrameError):
        decompress(codec, b"\xff" * 20, len(data), 1000)
    with pytest.raises(PulsarFrameError, match="compression 9 is not one of Pulsar's codecs"):
        decompress(9, compressed, len(data), 1000)
    with pytest.raises(PulsarFrameError):
        decompress(NONE, compressed, len(data), 1000)


@given(
    st.lists(st.tuples(names, st.text(max_size=10)), max_size=3),
    st.booleans(),
    st.none() | st.text(max_size=10),
    st.booleans(),
)
def test_a_null_value_and_a_partition_key_beside_an_ordering_key_come_back_as_sent(
    pairs: list[tuple[str, str]], null_value: bool, partition_key: str | None, b64: bool
) -> None:
    stored = from_pulsar(pairs, 0, null_value=null_value, partition_key=partition_key, partition_key_b64=b64)
    expected = PulsarMetadata(dict(pairs), 0, null_value, partition_key, b64 and partition_key is not None)
    assert to_pulsar(stored, ordering_key=True) == expected


def test_a_delivery_with_an_ordering_key_carries_the_partition_key_and_the_null_value() -> None:
    stored = from_pulsar([("a", "1")], 0, null_value=True, partition_key="account-9")
    metadata = delivered_metadata(encode_delivery(1, -1, 5, b"order-1", b"", properties=stored))
    assert (metadata.ordering_key, metadata.partition_key, metadata.null_value) == (b"order-1", "account-9", True)
    assert [(pair.key, pair.value) for pair in metadata.properties] == [("a", "1")]
    # Beside a str key (the partition key itself), the reserved property stays a property.
    other = encode_properties({PARTITION_KEY_PROPERTY: "x", NULL_VALUE_PROPERTY: "yes"})
    plain = delivered_metadata(encode_delivery(1, -1, 5, "k", b"v", properties=other))
    assert (plain.partition_key, plain.HasField("ordering_key"), plain.null_value) == ("k", False, False)
    assert {pair.key: pair.value for pair in plain.properties} == {
        PARTITION_KEY_PROPERTY: "x",
        NULL_VALUE_PROPERTY: "yes",
    }
    flagged = from_pulsar([], 0, partition_key="YWI=", partition_key_b64=True)
    assert decode_properties(flagged) == {PARTITION_KEY_B64_PROPERTY: "YWI="}
    b64 = delivered_metadata(encode_delivery(1, -1, 5, b"o", b"v", properties=flagged))
    assert (b64.partition_key, b64.partition_key_b64_encoded) == ("YWI=", True)


def test_a_send_with_null_value_or_both_keys_is_read_by_protobuf() -> None:
    """The hand-written reader knows neither field: such metadata goes to protobuf, which reads both."""
    metadata = MessageMetadata(producer_name="p", sequence_id=1, publish_time=1, partition_key="pk", null_value=True)
    metadata.ordering_key = b"ok"
    send = command(BaseCommand.SEND, producer_id=1, sequence_id=1)
    [frame], _ = PulsarDecoder(1 << 20).feed(encode_message(send, metadata.SerializeToString(), b""))
    fields = parse_message(frame.rest).metadata
    assert (fields.partition_key, fields.ordering_key, fields.null_value) == ("pk", b"ok", True)


def test_a_chunk_with_both_keys_and_a_null_value_comes_back_with_all_of_them() -> None:
    """The passed metadata and the producer's reserved fields travel side by side in one message's properties."""
    metadata = MessageMetadata(
        producer_name="p", sequence_id=7, publish_time=1, uuid="p-7", chunk_id=2, num_chunks_from_msg=3
    )
    metadata.partition_key, metadata.ordering_key, metadata.null_value = "pk", b"ok", True
    fields = metadata_fields(metadata)
    stored = from_pulsar(fields.properties, 0, fields.passed, null_value=True, partition_key=fields.partition_key)
    message = delivered_metadata(encode_delivery(1, -1, 5, b"ok", b"slice", properties=stored))
    assert (message.uuid, message.chunk_id, message.num_chunks_from_msg) == ("p-7", 2, 3)
    assert (message.ordering_key, message.partition_key, message.null_value) == (b"ok", "pk", True)
    assert list(message.properties) == []


def test_the_event_time_replaces_a_property_of_its_name() -> None:
    stored = from_pulsar([(EVENT_TIME_PROPERTY, "mine"), ("a", "1"), ("a", "2")], 42)
    assert decode_properties(stored) == {EVENT_TIME_PROPERTY: "42", "a": "2"}  # and a later pair of a key wins
    assert from_pulsar([], 0) is None


def test_a_delivery_time_is_kept_as_its_property_and_left_out_of_a_message() -> None:
    stored = from_pulsar([("a", "1")], 0, deliver_at=1_718_000_000_123)
    assert decode_properties(stored) == {"a": "1", DELIVER_AT_PROPERTY: "1718000000123"}
    assert delivery_time(stored) == 1_718_000_000_123
    assert to_pulsar(stored) == PulsarMetadata({"a": "1"})
    assert from_pulsar([], 0, deliver_at=-5) is None  # a time at or before the epoch is none
    assert delivery_time(None) == 0 and delivery_time(encode_properties({"a": "1"})) == 0
    for text in ("soon", "", "-1", "1.5", "9" * 19, "\uff11\uff12"):  # none is a delivery time: a property
        mine = encode_properties({DELIVER_AT_PROPERTY: text})
        assert delivery_time(mine) == 0
        assert to_pulsar(mine) == PulsarMetadata({DELIVER_AT_PROPERTY: text})


def test_a_sends_delivery_time_is_stored_with_each_of_its_messages() -> None:
    """deliver_at_time is an entry's: a batched entry's messages each keep it (Pulsar's clients send a delayed
    message alone, but a batch with one is stored as it says)."""
    for count in (None, 2):
        metadata = MessageMetadata(producer_name="p", sequence_id=1, publish_time=2, partition_key="k")
        metadata.deliver_at_time = 1_718_000_000_123
        payload = b"x"
        if count is not None:
            metadata.num_messages_in_batch = count
            payload = batch(("a", b"1"), ("b", b"2"))
        frame = encode_message(
            command(BaseCommand.SEND, producer_id=1, sequence_id=1), metadata.SerializeToString(), payload
        )
        [decoded], _ = PulsarDecoder(1 << 20).feed(frame)
        assert isinstance(decoded, SendFrame)
        messages, properties = sent_messages(decoded, 1 << 20)
        assert properties is not None and len(properties) == len(messages) == (count or 1)
        assert {delivery_time(encoded) for encoded in properties} == {1_718_000_000_123}


@pytest.mark.parametrize(
    ("pulsar", "keyfailover"),
    [
        ("persistent://public/default/orders", "orders"),
        ("persistent://public/default/orders-partition-2", "orders-partition-2"),
        ("persistent://acme/billing/orders", "acme/billing/orders"),
        ("persistent://public/other/orders", "public/other/orders"),
    ],
)
def test_topic_names_map_one_to_one(pulsar: str, keyfailover: str) -> None:
    assert keyfailover_topic(pulsar) == keyfailover


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("non-persistent://public/default/t", "is non-persistent"),
        ("orders", "has no scheme"),
        ("persistent://public/default/a/b", "three non-empty parts"),
        ("persistent://public//t", "three non-empty parts"),
        ("persistent://public/default/" + "x" * 300, "not 1 to 256 characters"),
    ],
)
def test_other_topic_names_are_refused(name: str, expected: str) -> None:
    with pytest.raises(TopicNameError, match=expected):
        keyfailover_topic(name)


def test_a_topic_name_that_is_not_utf8_is_refused() -> None:
    with pytest.raises(TopicNameError, match="not valid UTF-8"):
        keyfailover_topic(b"persistent://public/default/\xff")  # type: ignore[arg-type]


# -- the SEND and SEND_RECEIPT commands by hand (keyfailover.broker.pulsar._wire) ---------------------

uint64 = st.integers(0, 2**64 - 1)


@st.composite
def send_commands(draw: st.DrawFn) -> BaseCommand:
    """A valid SEND command with any of CommandSend's fields set."""
    built = command(BaseCommand.SEND, producer_id=draw(uint64), sequence_id=draw(uint64))
    send = built.send
    if draw(st.booleans()):
        send.num_messages = draw(st.integers(-(2**31), 2**31 - 1))
    if draw(st.booleans()):
        send.highest_sequence_id = draw(uint64)
    for name in ("txnid_least_bits", "txnid_most_bits"):
        if draw(st.integers(0, 4)) == 0:
            setattr(send, name, draw(uint64))
    for name in ("is_chunk", "marker"):
        if draw(st.integers(0, 4)) == 0:
            setattr(send, name, draw(st.booleans()))
    if draw(st.integers(0, 4)) == 0:
        send.message_id.ledgerId, send.message_id.entryId = draw(uint64), draw(uint64)
    return built


def protobuf_send(body: bytes) -> tuple[int, int, int | None, bool, bool]:
    """What the server reads of a SEND, read by protobuf."""
    send = BaseCommand.FromString(body).send
    highest = send.highest_sequence_id if send.HasField("highest_sequence_id") else None
    transactional = bool(send.txnid_least_bits or send.txnid_most_bits or send.marker)
    return send.producer_id, send.sequence_id, highest, send.is_chunk, transactional


def by_hand(body: bytes | bytearray) -> tuple[int, int, int | None, bool, bool] | None:
    """What the server reads of a SEND read by hand (a SEND read by hand has no chunk or transaction fields)."""
    ids = decode_send(body, 0, len(body))
    return None if ids is None else (*ids, False, False)


@given(sent=send_commands())
def test_a_send_read_by_hand_is_what_protobuf_reads(sent: BaseCommand) -> None:
    body = sent.SerializeToString()
    read = by_hand(body)
    fields = dict((field.name, value) for field, value in sent.send.ListFields())
    # As Pulsar's clients write a SEND: these fields only, each varint at most 9 bytes (below 2**63).
    if fields.keys() <= {"producer_id", "sequence_id", "num_messages", "highest_sequence_id"} and all(
        0 <= value < 2**63 for value in fields.values()
    ):
        assert read is not None, "a SEND as clients write it is read by hand"
    if read is not None:
        assert read == protobuf_send(body)
    [frame], error = PulsarDecoder(1 << 20).feed(encode_message(sent, b"", b""))
    assert error is None and isinstance(frame, SendFrame)
    assert frame[:-1] == protobuf_send(body)


@given(sent=send_commands(), data=st.data())
def test_a_mutated_send_read_by_hand_is_what_protobuf_reads(sent: BaseCommand, data: st.DataObject) -> None:
    body = bytearray(sent.SerializeToString())
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(body) - 1))
        body[at] = data.draw(st.integers(0, 255))
    read = by_hand(body)
    if read is not None:  # anything it reads, protobuf reads the same
        assert read == protobuf_send(bytes(body))


@pytest.mark.parametrize(
    "body",
    [
        b"\x08\x06\x32\x04\x08\x01\x10\x02\x00",  # a byte after the body
        b"\x08\x06\x32\x0d\x08\x01\x10" + b"\xff" * 9 + b"\x01",  # a sequence id of 10 bytes
        b"\x08\x06\x32\x04\x10\x02\x08\x01",  # fields out of order
        b"\x08\x06\x32\x02\x08\x01",  # no sequence id
        b"\x08\x07\x3a\x04\x08\x01\x10\x02",  # a SEND_RECEIPT
    ],
)
def test_a_send_not_as_clients_write_it_is_left_to_protobuf(body: bytes) -> None:
    assert decode_send(body, 0, len(body)) is None


def test_a_send_with_a_ten_byte_sequence_id_is_read_by_protobuf() -> None:
    sent = command(BaseCommand.SEND, producer_id=3, sequence_id=2**64 - 1)
    [frame], error = PulsarDecoder(1 << 20).feed(encode_message(sent, b"", b""))
    assert error is None
    assert frame == SendFrame(3, 2**64 - 1, None, False, False, frame.rest)


@given(
    producer_id=uint64,
    sequence_id=uint64,
    highest=st.none() | uint64,
    entry=uint64,
    partition=st.integers(-1, 2**31 - 1),
)
def test_a_receipt_by_hand_is_what_protobuf_writes(
    producer_id: int, sequence_id: int, highest: int | None, entry: int, partition: int
) -> None:
    expected = command(BaseCommand.SEND_RECEIPT, producer_id=producer_id, sequence_id=sequence_id)
    receipt = expected.send_receipt
    receipt.message_id.ledgerId = 0
    receipt.message_id.entryId = entry
    if partition >= 0:
        receipt.message_id.partition = partition
    if highest is not None:
        receipt.highest_sequence_id = highest
    encoded = encode_receipt(producer_id, sequence_id, highest, entry, partition)
    assert encoded == encode_command(expected)
    [frame], error = PulsarDecoder(1 << 20).feed(encoded)
    assert error is None and isinstance(frame, PulsarFrame)
    assert frame.command == expected


short_text = st.text(max_size=20)


@st.composite
def metadatas(draw: st.DrawFn) -> MessageMetadata:
    """A valid MessageMetadata with some of the fields the server reads or skips, and now and then others."""
    metadata = MessageMetadata(producer_name=draw(short_text), sequence_id=draw(uint64), publish_time=draw(uint64))
    if draw(st.booleans()):
        metadata.partition_key = draw(st.text(max_size=200))
    for name, number in (
        ("uncompressed_size", st.integers(0, 2**32 - 1)),
        ("num_messages_in_batch", st.integers(-(2**31), 2**31 - 1)),
        ("event_time", uint64),
    ):
        if draw(st.booleans()):
            setattr(metadata, name, draw(number))
    rare: list[tuple[str, st.SearchStrategy[object]]] = [
        ("partition_key_b64_encoded", st.booleans()),
        ("ordering_key", st.binary(max_size=8)),
        ("compression", st.sampled_from([0, 1, 2])),
        ("num_chunks_from_msg", st.integers(0, 3)),
        ("replicated_from", short_text),
        ("uuid", short_text),
        ("schema_version", st.binary(min_size=7, max_size=9)),
    ]
    for name, values in rare:
        if draw(st.integers(0, 5)) == 0:
            setattr(metadata, name, draw(values))
    for _ in range(draw(st.integers(0, 2)) if draw(st.integers(0, 3)) == 0 else 0):
        metadata.properties.add(key=draw(short_text), value=draw(short_text))
    if draw(st.integers(0, 8)) == 0:
        metadata.encryption_keys.add(key=draw(short_text), value=draw(st.binary(max_size=4)))
    return metadata


@st.composite
def singles(draw: st.DrawFn) -> SingleMessageMetadata:
    """A valid SingleMessageMetadata with some of the fields the server reads or skips, and now and then others."""
    single = SingleMessageMetadata(payload_size=draw(st.integers(-(2**31), 2**31 - 1)))
    if draw(st.booleans()):
        single.partition_key = draw(st.text(max_size=200))
    if draw(st.booleans()):
        single.event_time = draw(uint64)
    if draw(st.booleans()):
        single.sequence_id = draw(uint64)
    for _ in range(draw(st.integers(0, 2)) if draw(st.integers(0, 3)) == 0 else 0):
        single.properties.add(key=draw(short_text), value=draw(short_text))
    rare: list[tuple[str, st.SearchStrategy[object]]] = [
        ("partition_key_b64_encoded", st.booleans()),
        ("ordering_key", st.binary(max_size=8)),
        ("compacted_out", st.booleans()),
        ("null_value", st.booleans()),
    ]
    for name, values in rare:
        if draw(st.integers(0, 5)) == 0:
            setattr(single, name, draw(values))
    return single


def metadata_by_hand(body: bytes | bytearray) -> MessageFields | None:
    read = decode_metadata(bytes(body), 0, len(body))
    if read is None:
        return None
    key, batch, event_time, compression, size, version = read
    return MessageFields(
        key, False, None, compression, size, False, None, None, batch, (), event_time, False, 0, version
    )


def single_by_hand(body: bytes | bytearray) -> SingleFields | None:
    read = decode_single(bytes(body), 0, len(body))
    return None if read is None else SingleFields(read[0], False, None, read[2], read[1], (), read[3])


def plain(message: MessageMetadata | SingleMessageMetadata, names: set[str]) -> bool:
    """Whether ``message`` is written as clients write it: only fields in ``names``, strings of at most 127
    bytes, varints of at most 9 bytes (no negative ints, nothing from 2**63)."""
    for field, value in message.ListFields():
        if field.name not in names:
            return False
        if isinstance(value, str) and len(value.encode()) > 127:
            return False
        if field.name == "schema_version" and len(value) != 8:
            return False
        limit = 2**31 if field.name in {"payload_size", "num_messages_in_batch"} else 2**63
        if isinstance(value, int) and not 0 <= value < limit:
            return False
    return True


@given(metadata=metadatas())
def test_metadata_read_by_hand_is_what_protobuf_reads(metadata: MessageMetadata) -> None:
    body = metadata.SerializeToString()
    read = metadata_by_hand(body)
    names = {"producer_name", "sequence_id", "publish_time", "partition_key", "compression", "uncompressed_size"}
    if plain(metadata, names | {"num_messages_in_batch", "event_time", "schema_version"}):
        assert read is not None, "metadata as clients write it is read by hand"
    if read is not None:
        assert read == metadata_fields(metadata)
    message = parse_message(struct.pack(">I", len(body)) + body + b"payload")
    assert (message.metadata, message.payload) == (metadata_fields(metadata), b"payload")


@given(single=singles())
def test_a_batched_messages_metadata_read_by_hand_is_what_protobuf_reads(single: SingleMessageMetadata) -> None:
    body = single.SerializeToString()
    read = single_by_hand(body)
    if plain(single, {"partition_key", "payload_size", "event_time", "sequence_id"}):
        assert read is not None, "a batched message's metadata as clients write it is read by hand"
    if read is not None:
        assert read == single_fields(single)


def mutated(data: st.DataObject, message: MessageMetadata | SingleMessageMetadata) -> bytearray:
    """``message`` serialized, with one to three bytes set to anything."""
    body = bytearray(message.SerializeToString())
    for _ in range(data.draw(st.integers(1, 3)) if body else 0):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    return body


@given(metadata=metadatas(), data=st.data())
def test_mutated_metadata_read_by_hand_is_what_protobuf_reads(metadata: MessageMetadata, data: st.DataObject) -> None:
    body = mutated(data, metadata)
    read = metadata_by_hand(body)
    if read is not None:  # anything read by hand, protobuf reads the same, and finds complete
        parsed = MessageMetadata.FromString(bytes(body))
        assert parsed.IsInitialized()
        assert read == metadata_fields(parsed)


@given(single=singles(), data=st.data())
def test_a_mutated_batched_messages_metadata_read_by_hand_is_what_protobuf_reads(
    single: SingleMessageMetadata, data: st.DataObject
) -> None:
    body = mutated(data, single)
    read = single_by_hand(body)
    if read is not None:
        parsed = SingleMessageMetadata.FromString(bytes(body))
        assert parsed.IsInitialized()
        assert read == single_fields(parsed)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"\x0a\x01p\x10\x01\x18\x02\x32\x02\xff\xfe", "a partition key that is not UTF-8"),
        (b"\x0a\x01p\x10\x01\x18\x02\x32\x09k", "a partition key past the end"),
        (b"\x0a\x01p\x10\x01", "no publish time"),
        (b"\x0a\x01p\x10\x01\x18\x02\x58\xff\xff\xff\xff\x0f", "a batch of -1 messages (10-byte varint)"),
        (b"\x0a\x01p\x10\x01\x18\x02\x40\x09", "a compression this protobuf does not know"),
        (b"\x0a\x01p\x10\x01\x18\x02\x40\x01\x48\x80\x80\x80\x80\x10", "an uncompressed size of 2**32"),
        (b"\x10\x01\x18\x02\x0a\x01p", "fields out of order"),
    ],
)
def test_metadata_not_as_clients_write_it_is_left_to_protobuf(body: bytes, expected: str) -> None:
    assert decode_metadata(body, 0, len(body)) is None, expected
