"""The hash layer against the shared vectors and an independent pure-Python Murmur3."""

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
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_bytes, key_hash, key_hashes, murmur3_32

VECTORS_DIR = Path(__file__).parent / "vectors"
GENERATOR_PATH = VECTORS_DIR / "generate_key_hash.py"
VECTORS_PATH = VECTORS_DIR / "key_hash.json"


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


@pytest.mark.parametrize(("key", "type_name"), [(42, "int"), (None, "NoneType"), (["a"], "list"), (1.5, "float")])
def test_invalid_key_types_are_rejected_naming_the_type(key: Any, type_name: str) -> None:
    calls: list[Callable[[Any], object]] = [key_hash, key_bytes, lambda k: key_hashes(["ok", k])]
    for call in calls:
        with pytest.raises(InvalidKeyError, match=rf"\b{type_name}\b") as info:
            call(key)
        assert isinstance(info.value, KeyFailoverError)
        assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("key", ["\ud800", "a\udfffb", "ok\ud83d"])
def test_lone_surrogates_are_rejected_before_hashing(key: str) -> None:
    # mmh3 crashes the interpreter on such strings, so reaching this assertion at all
    # shows the key is encoded (and rejected) before mmh3 sees it.
    with pytest.raises(InvalidKeyError, match="UTF-8"):
        key_hash(key)
    with pytest.raises(InvalidKeyError, match="UTF-8"):
        key_hashes(["fine", key])
