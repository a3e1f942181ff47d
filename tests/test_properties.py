"""Message properties: their one encoding, its round trip, and the limits every way in checks."""

from __future__ import annotations

from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyfailover.core.errors import KeyFailoverError, PropertiesError
from keyfailover.wire.properties import (
    MAX_PROPERTIES,
    MAX_PROPERTIES_SIZE,
    MAX_PROPERTY_KEY,
    NO_PROPERTIES,
    Properties,
    check_encoded,
    decode_properties,
    encode_properties,
)

KEYS = st.text(max_size=MAX_PROPERTY_KEY)
PROPERTIES = st.dictionaries(KEYS, st.text(max_size=200), max_size=20)


@given(PROPERTIES)
def test_encoding_round_trips_and_is_what_the_wire_takes(properties: dict[str, str]) -> None:
    data = encode_properties(properties)
    if not properties:
        assert data is None
        assert decode_properties(data) == {}
        return
    assert data is not None
    assert check_encoded(data) is data
    assert decode_properties(data) == properties


@given(PROPERTIES.filter(bool))
def test_the_encoding_is_a_plain_msgpack_map(properties: dict[str, str]) -> None:
    """What other implementations read and write: msgpack's own map of str to str."""
    data = encode_properties(properties)
    assert data == msgpack.packb(properties, use_bin_type=True)
    assert msgpack.unpackb(data, raw=False) == properties


def test_a_small_map_costs_a_byte_of_header_per_string() -> None:
    assert encode_properties({"trace": "ab12"}) == b"\x81\xa5trace\xa4ab12"


def test_limits_are_inclusive() -> None:
    at_count = {str(i): "" for i in range(MAX_PROPERTIES)}
    assert decode_properties(encode_properties(at_count)) == at_count
    long_key = {"k" * MAX_PROPERTY_KEY: "v"}
    assert decode_properties(encode_properties(long_key)) == long_key
    # one key whose value fills the encoded size exactly: map header 1, key 2, str16 header 3
    exact = {"k": "v" * (MAX_PROPERTIES_SIZE - 1 - 2 - 3)}
    data = encode_properties(exact)
    assert data is not None and len(data) == MAX_PROPERTIES_SIZE
    assert check_encoded(data) == data


@pytest.mark.parametrize(
    ("properties", "match"),
    [
        ({1: "v"}, r"property key 1 is int; expected a str"),
        ({"k": 1}, r"the value of property 'k' is int 1; expected a str"),
        ({"k": None}, r"the value of property 'k' is NoneType"),
        ({"k": b"v"}, r"the value of property 'k' is bytes"),
        ({"k" * (MAX_PROPERTY_KEY + 1): "v"}, rf"has {MAX_PROPERTY_KEY + 1} characters; expected at most"),
        ({str(i): "" for i in range(MAX_PROPERTIES + 1)}, rf"{MAX_PROPERTIES + 1} properties are over the limit"),
        ({"k": "v" * MAX_PROPERTIES_SIZE}, rf"over the limit of {MAX_PROPERTIES_SIZE} per message"),
        ({"k": "\udc80"}, r"not valid Unicode \(surrogates not allowed at index 0\)"),
        ([("k", "v")], r"properties must be a mapping .*, not list"),
    ],
)
def test_what_is_refused_is_named(properties: Any, match: str) -> None:
    with pytest.raises(PropertiesError, match=match) as caught:
        encode_properties(properties)
    assert isinstance(caught.value, KeyFailoverError)
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ("text", r"must be bytes, not str"),
        (b"", r"not one msgpack map"),
        (b"\xc1", r"not one msgpack map"),
        (msgpack.packb({"k": "v"}) + b"\x00", r"not one msgpack map"),
        (msgpack.packb({}), r"an empty map \(send none instead\)"),
        (msgpack.packb(["k", "v"]), r"not one msgpack map"),
        (msgpack.packb("k"), r"got str"),
        (msgpack.packb({"k": 1}), r"the value of property 'k' is int"),
        (msgpack.packb({"k": {"a": "b"}}), r"the value of property 'k' is dict"),
        (msgpack.packb({"k": b"v"}, use_bin_type=True), r"not one msgpack map"),
        (msgpack.packb({b"k": "v"}, use_bin_type=True), r"not one msgpack map"),
        (msgpack.packb({"k" * (MAX_PROPERTY_KEY + 1): "v"}), r"is not a str of at most"),
        (msgpack.packb({str(i): "" for i in range(MAX_PROPERTIES + 1)}), r"not one msgpack map"),
        (b"\x81\xa1k\xa1\xff", r"not one msgpack map"),  # a str that is not UTF-8
        (msgpack.packb({"k": "v" * MAX_PROPERTIES_SIZE}), rf"over the limit of {MAX_PROPERTIES_SIZE}"),
    ],
)
def test_encodings_from_outside_are_checked(data: object, match: str) -> None:
    with pytest.raises(PropertiesError, match=match):
        check_encoded(data)


@given(st.binary(max_size=64))
def test_any_bytes_are_taken_or_refused_with_properties_error(data: bytes) -> None:
    try:
        checked = check_encoded(data)
    except PropertiesError:
        return
    properties = decode_properties(checked)
    assert properties and all(type(k) is str and type(v) is str for k, v in properties.items())


@given(PROPERTIES)
def test_received_properties_are_a_read_only_hashable_mapping(properties: dict[str, str]) -> None:
    """What a consumer's Message holds: equal to the dict sent, hashable like the rest of the message."""
    received = Properties.decoded(encode_properties(properties))
    assert received == properties and dict(received) == properties and len(received) == len(properties)
    assert received == Properties.decoded(encode_properties(dict(reversed(properties.items()))))
    assert hash(received) == hash(Properties(dict(properties)))
    assert (received is NO_PROPERTIES) == (not properties)
    with pytest.raises(TypeError):
        received["new"] = "value"  # type: ignore[index]
