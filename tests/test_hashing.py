"""The hash layer against the shared vectors and an independent pure-Python Murmur3, Pulsar's hashes included."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyfailover.core.errors import InvalidKeyError, KeyFailoverError
from keyfailover.core.hashing import (
    HASH_RANGE_SIZE,
    key_bytes,
    key_hash,
    key_hashes,
    murmur3_31,
    murmur3_32,
    pulsar3_hash,
    pulsar3_hashes,
    pulsar4_consistent_hash,
    pulsar4_consistent_hashes,
    pulsar4_key_hash,
    pulsar4_key_hashes,
)

VECTORS_DIR = Path(__file__).parent / "vectors"
GENERATOR_PATH = VECTORS_DIR / "generate_key_hash.py"
VECTORS_PATH = VECTORS_DIR / "key_hash.json"
PULSAR_VECTORS_PATH = VECTORS_DIR / "pulsar_hash.json"


@cache
def _generator() -> ModuleType:
    """The vector generator script, which holds the reference Murmur3, loaded as a module."""
    spec = importlib.util.spec_from_file_location("generate_key_hash", GENERATOR_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference_murmur3() -> Callable[[bytes, int], int]:
    function: Callable[[bytes, int], int] = _generator().murmur3_32
    return function


@cache
def _document() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))
    return loaded


def _vectors() -> list[dict[str, Any]]:
    vectors: list[dict[str, Any]] = _document()["vectors"]
    return vectors


@cache
def _pulsar_vectors() -> list[dict[str, Any]]:
    vectors: list[dict[str, Any]] = json.loads(PULSAR_VECTORS_PATH.read_text(encoding="utf-8"))["vectors"]
    return vectors


def _pulsar_category(category: str) -> list[dict[str, Any]]:
    return [v for v in _pulsar_vectors() if v["category"] == category]


def _key_forms(vector: dict[str, Any]) -> list[str | bytes]:
    """Every form of the vector's key that must hash to its slot: bytes, and str when valid text."""
    forms: list[str | bytes] = [bytes.fromhex(vector["key_utf8_hex"])]
    if "key" in vector:
        forms.append(vector["key"])
    return forms


texts = st.text(max_size=40)
binaries = st.binary(max_size=40)
keys = st.one_of(texts, binaries)


# -- the reference implementation and the vector file -----------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", 0),
        (b"hello", 0x248BFA47),
        (b"The quick brown fox jumps over the lazy dog", 0x2E4FF723),
    ],
)
def test_reference_murmur3_reproduces_published_vectors(data: bytes, expected: int) -> None:
    assert _reference_murmur3()(data, 0) == expected


def test_reference_murmur3_reproduces_every_vector_of_the_generator() -> None:
    reference = _reference_murmur3()
    published: tuple[tuple[bytes, int, int], ...] = _generator().PUBLISHED_VECTORS
    assert len(published) >= 3
    for data, seed, expected in published:
        assert reference(data, seed) == expected, (data, seed)


def test_vector_file_is_what_the_generator_writes() -> None:
    assert VECTORS_PATH.read_text(encoding="utf-8") == _generator().render()


def test_vector_file_covers_the_required_cases() -> None:
    vectors = _vectors()
    assert len(vectors) >= 300
    assert _document()["range_size"] == HASH_RANGE_SIZE
    by_bytes = [bytes.fromhex(v["key_utf8_hex"]) for v in vectors]
    assert len(set(by_bytes)) == len(by_bytes), "duplicate keys"
    assert b"" in by_bytes
    for length in range(13):
        of_length = [v for v, data in zip(vectors, by_bytes, strict=True) if len(data) == length]
        assert len(of_length) >= (1 if length == 0 else 3), length
        if length >= 2:
            assert any(not data.isascii() for data in by_bytes if len(data) == length), length
    assert {100, 1000, 10000} <= {len(data) for data in by_bytes}
    texts_present = [v["key"] for v in vectors if "key" in v]
    assert any(any(0x80 <= ord(c) <= 0x24F for c in t) for t in texts_present), "accented Latin"
    assert any(any(0x4E00 <= ord(c) <= 0x9FFF for c in t) for t in texts_present), "CJK"
    assert any(any(ord(c) > 0xFFFF for c in t) for t in texts_present), "4-byte UTF-8"
    assert any(t.startswith("\x00") for t in texts_present)
    assert any(t.endswith("\x00") for t in texts_present)
    assert any("\x00" in t[1:-1] for t in texts_present)
    assert sum("key" not in v for v in vectors) >= 10, "binary keys that are not UTF-8"


def test_vector_entries_are_self_consistent() -> None:
    reference = _reference_murmur3()
    for vector in _vectors():
        data = bytes.fromhex(vector["key_utf8_hex"])
        if "key" in vector:
            assert vector["key"].encode() == data
        else:
            with pytest.raises(UnicodeDecodeError):
                data.decode("utf-8")
        assert reference(data, 0) == vector["murmur3_32"]
        assert 0 <= vector["murmur3_32"] <= 0xFFFFFFFF
        assert vector["slot"] == (vector["murmur3_32"] & 0x7FFFFFFF) % 65536


# -- key_hash against the vectors -------------------------------------------------------


def test_key_hash_reproduces_every_vector() -> None:
    checked = 0
    for vector in _vectors():
        for key in _key_forms(vector):
            assert key_hash(key) == vector["slot"], vector["key_utf8_hex"][:40]
            checked += 1
    assert checked > len(_vectors())


def test_murmur3_32_reproduces_every_vector() -> None:
    for vector in _vectors():
        assert murmur3_32(bytes.fromhex(vector["key_utf8_hex"])) == vector["murmur3_32"]


def test_key_hashes_reproduces_every_vector_in_one_batch() -> None:
    vectors = _vectors()
    batch = [key for vector in vectors for key in _key_forms(vector)]
    expected = [vector["slot"] for vector in vectors for _ in _key_forms(vector)]
    result = key_hashes(batch)
    assert result.dtype == np.int32
    assert result.shape == (len(batch),)
    assert result.tolist() == expected


# -- properties -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(keys)
def test_key_hash_matches_the_reference(key: str | bytes) -> None:
    data = key.encode() if isinstance(key, str) else key
    full = _reference_murmur3()(data, 0)
    assert murmur3_32(data) == full
    assert key_hash(key) == (full & 0x7FFFFFFF) % HASH_RANGE_SIZE == full & 0xFFFF


@settings(max_examples=100, deadline=None)
@given(texts)
def test_a_str_and_its_utf8_bytes_are_one_key(text: str) -> None:
    assert key_hash(text) == key_hash(text.encode("utf-8"))
    assert key_bytes(text) == text.encode("utf-8")


@settings(max_examples=100, deadline=None)
@given(st.lists(keys, max_size=30))
def test_key_hashes_equals_key_hash_per_key(batch: list[str | bytes]) -> None:
    result = key_hashes(batch)
    assert result.dtype == np.int32
    assert result.shape == (len(batch),)
    assert result.tolist() == [key_hash(key) for key in batch]


def test_key_hashes_takes_any_iterable_and_an_empty_one() -> None:
    batch: list[str | bytes] = ["a", b"b", "c"]
    assert key_hashes(key for key in batch).tolist() == [key_hash("a"), key_hash(b"b"), key_hash("c")]
    empty = key_hashes([])
    assert empty.dtype == np.int32
    assert empty.shape == (0,)


def test_slot_is_low_16_bits_of_the_unsigned_hash() -> None:
    assert HASH_RANGE_SIZE == 65536
    # Keys whose hash has the sign bit set exercise the signed/unsigned handling of the batch path.
    high = [v for v in _vectors() if v["murmur3_32"] >= 0x80000000]
    low = [v for v in _vectors() if v["murmur3_32"] < 0x80000000]
    assert high and low
    for vector in high + low:
        data = bytes.fromhex(vector["key_utf8_hex"])
        assert key_hash(data) == murmur3_32(data) & 0xFFFF
    assert key_hashes([bytes.fromhex(v["key_utf8_hex"]) for v in high]).tolist() == [
        v["murmur3_32"] & 0xFFFF for v in high
    ]


def test_a_bytes_subclass_hashes_like_its_bytes() -> None:
    class Tagged(bytes):
        pass

    assert key_bytes(Tagged(b"abc")) == b"abc"
    assert type(key_bytes(Tagged(b"abc"))) is bytes
    assert key_hash(Tagged(b"abc")) == key_hash(b"abc")


# -- invalid keys -----------------------------------------------------------------------


SINGLE_HASHES: list[Callable[[Any], int]] = [key_hash, pulsar3_hash, pulsar4_key_hash, pulsar4_consistent_hash]
BATCH_HASHES: list[Callable[[Any], Any]] = [key_hashes, pulsar3_hashes, pulsar4_key_hashes, pulsar4_consistent_hashes]


def _after_a_valid_key(batch: Callable[[Any], Any]) -> Callable[[Any], object]:
    """``batch`` called on a valid key followed by ``key``."""
    return lambda key: batch(["ok", key])


@pytest.mark.parametrize(("key", "type_name"), [(42, "int"), (None, "NoneType"), (["a"], "list"), (1.5, "float")])
def test_invalid_key_types_are_rejected_naming_the_type(key: Any, type_name: str) -> None:
    calls: list[Callable[[Any], object]] = [key_bytes, *SINGLE_HASHES]
    calls += [_after_a_valid_key(batch) for batch in BATCH_HASHES]
    for call in calls:
        with pytest.raises(InvalidKeyError, match=rf"\b{type_name}\b") as info:
            call(key)
        assert isinstance(info.value, KeyFailoverError)
        assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("key", ["\ud800", "a\udfffb", "ok\ud83d"])
def test_lone_surrogates_are_rejected_before_hashing(key: str) -> None:
    # mmh3 crashes the interpreter on such strings, so reaching this assertion at all
    # shows the key is encoded (and rejected) before mmh3 sees it.
    for single in SINGLE_HASHES:
        with pytest.raises(InvalidKeyError, match="UTF-8"):
            single(key)
    for batch in BATCH_HASHES:
        with pytest.raises(InvalidKeyError, match="UTF-8"):
            batch(["fine", key])


@pytest.mark.parametrize(("batch", "single"), list(zip(BATCH_HASHES, SINGLE_HASHES, strict=True)))
def test_a_batch_form_refuses_one_key_naming_the_single_form(batch: Callable[[Any], Any], single: Any) -> None:
    for key in ("abc", b"abc"):
        with pytest.raises(InvalidKeyError, match=rf"{batch.__name__} takes a batch .* {single.__name__}\(key\)"):
            batch(key)
    with pytest.raises(InvalidKeyError, match=rf"{batch.__name__} takes an iterable of keys, not int"):
        batch(42)


# -- Pulsar's hashes against pulsar_hash.json ----------------------------------------------


def test_pulsar_vector_file_is_what_the_generator_writes() -> None:
    assert PULSAR_VECTORS_PATH.read_text(encoding="utf-8") == _generator().render_pulsar()


def test_pulsar_vector_entries_follow_pulsars_formulas_from_the_reference_murmur3() -> None:
    reference = _reference_murmur3()
    for vector in _pulsar_vectors():
        data = bytes.fromhex(vector["key_utf8_hex"])
        if "key" in vector:
            assert vector["key"].encode() == data
        m31 = reference(data, 0) & 0x7FFFFFFF
        assert vector["murmur3_31"] == m31
        assert vector["key_hash"] == m31 % 65536
        # StickyKeyConsumerSelectorUtils.makeStickyKeyHash: makeHash % range.size() + range.getStart(), 0 -> 1.
        assert vector["pulsar4_key_hash"] == (m31 % 65536 + 0 or 1)
        assert vector["pulsar4_consistent_hash"] == m31 % 65535 + 1


def test_pulsar_vector_file_covers_every_key_hash_vector_and_the_keys_where_pulsar_4_departs() -> None:
    by_bytes = {v["key_utf8_hex"]: v for v in _pulsar_vectors()}
    assert len(by_bytes) == len(_pulsar_vectors()), "duplicate keys"
    for vector in _vectors():
        assert by_bytes[vector["key_utf8_hex"]]["key_hash"] == vector["slot"]
    zero = _pulsar_category("key-hash-zero")
    assert len(zero) >= 3
    assert all(v["key_hash"] == 0 and v["pulsar4_key_hash"] == 1 for v in zero)
    one = _pulsar_category("key-hash-one")
    assert len(one) >= 3
    assert all(v["key_hash"] == 1 and v["pulsar4_key_hash"] == 1 for v in one)
    assert [v["pulsar4_consistent_hash"] for v in _pulsar_category("consistent-lowest")] == [1, 1, 1]
    assert [v["pulsar4_consistent_hash"] for v in _pulsar_category("consistent-highest")] == [65535] * 3
    assert [v["key"] for v in _pulsar_category("none-key")] == ["NONE_KEY"]
    sign_bit_set = [v for v in _pulsar_vectors() if murmur3_32(bytes.fromhex(v["key_utf8_hex"])) >= 0x80000000]
    assert sign_bit_set, "keys whose Murmur3 has the bit that murmur3_31 clears"


def test_pulsar_hashes_reproduce_every_vector_one_by_one() -> None:
    for vector in _pulsar_vectors():
        data = bytes.fromhex(vector["key_utf8_hex"])
        assert murmur3_31(data) == vector["murmur3_31"]
        for key in _key_forms(vector):
            assert pulsar3_hash(key) == vector["murmur3_31"]
            assert key_hash(key) == vector["key_hash"]
            assert pulsar4_key_hash(key) == vector["pulsar4_key_hash"]
            assert pulsar4_consistent_hash(key) == vector["pulsar4_consistent_hash"]


def test_pulsar_hashes_reproduce_every_vector_in_one_batch() -> None:
    vectors = _pulsar_vectors()
    batch = [key for vector in vectors for key in _key_forms(vector)]
    for function, field in [
        (pulsar3_hashes, "murmur3_31"),
        (pulsar4_key_hashes, "pulsar4_key_hash"),
        (pulsar4_consistent_hashes, "pulsar4_consistent_hash"),
    ]:
        result = function(batch)
        assert result.dtype == np.int32
        assert result.tolist() == [vector[field] for vector in vectors for _ in _key_forms(vector)], field


# Pulsar's selector tests pin exact ranges; every range but the wrap-around one ends at a ring point.
# 4.x ConsistentHashingStickyKeyConsumerSelectorTest.testGetConsumerKeyHashRanges (3 points each), points at
# makeStickyKeyHash(name + "\0" + nameIndex + "\0" + i): consumer1 [14359,18366] [29991,39817] [52980,60442];
# consumer2 [1,6668] [39818,52979] [60443,63679] [65184,65535]; consumer3 [6669,14358] [18367,29990] [63680,65183].
PULSAR_4_TEST_RING = {
    "consumer1": [18366, 39817, 60442],
    "consumer2": [6668, 52979, 63679],
    "consumer3": [14358, 29990, 65183],
}
# The 3.x revision of that test that pins exact ranges puts point i at makeHash(name + "\0" + i):
# consumer1 [119056335,242013991] [722195657,1656011842] [1707482098,1914695766]; consumer2 [0,90164503]
# [90164504,119056334] [382436668,722195656] [1914695767,2147483646]; consumer3 [242013992,242377547]
# [242377548,382436667] [1656011843,1707482097]. Its testConsumersGetEvenlyMappedWhenThereAreCollisions has
# five consumers all named "consumer" with 5 points, ranges ending at the five points of "consumer".
PULSAR_3_TEST_RING = {
    "consumer1": [242013991, 1656011842, 1914695766],
    "consumer2": [90164503, 119056334, 722195656],
    "consumer3": [242377547, 382436667, 1707482097],
    "consumer": [216056713, 306176208, 365902830, 1240826377, 1862045174],
}


@pytest.mark.parametrize(
    ("ring", "point_hash", "category", "field"),
    [
        (
            PULSAR_4_TEST_RING,
            lambda name, i: pulsar4_consistent_hash(f"{name}\0{0}\0{i}"),
            "pulsar4",
            "pulsar4_consistent_hash",
        ),
        (PULSAR_3_TEST_RING, lambda name, i: pulsar3_hash(f"{name}\0{i}"), "pulsar3", "murmur3_31"),
    ],
)
def test_ring_points_are_the_range_ends_pulsar_expects(
    ring: dict[str, list[int]], point_hash: Callable[[str, int], int], category: str, field: str
) -> None:
    for name, ends in ring.items():
        assert sorted(point_hash(name, i) for i in range(len(ends))) == ends
    in_vector_file = {v[field] for v in _pulsar_category(f"{category}-test-ring-point")}
    assert in_vector_file == {end for ends in ring.values() for end in ends}


@settings(max_examples=200, deadline=None)
@given(keys)
def test_pulsar_hashes_match_the_reference_and_key_hash(key: str | bytes) -> None:
    data = key.encode() if isinstance(key, str) else key
    m31 = _reference_murmur3()(data, 0) & 0x7FFFFFFF
    assert murmur3_31(data) == pulsar3_hash(key) == m31
    assert pulsar4_key_hash(key) == (key_hash(key) or 1)
    assert pulsar4_consistent_hash(key) == m31 % 65535 + 1
    assert 1 <= pulsar4_consistent_hash(key) <= 65535


@settings(max_examples=100, deadline=None)
@given(st.lists(keys, max_size=30))
def test_pulsar_batch_forms_equal_the_single_forms(batch: list[str | bytes]) -> None:
    for batch_form, single in zip(BATCH_HASHES, SINGLE_HASHES, strict=True):
        result = batch_form(batch)
        assert result.dtype == np.int32
        assert result.shape == (len(batch),)
        assert result.tolist() == [single(key) for key in batch]
