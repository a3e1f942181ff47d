"""Write ``key_hash.json`` and ``pulsar_hash.json``: shared test vectors that pin the key hashes.

``key_hash.json`` pins keyfailover's key hash: every implementation of it (the Python core,
the Spark side, any other client) must reproduce these values. ``pulsar_hash.json`` pins
Apache Pulsar's hashes of the same keys (3.x's ``m31``, 4.x's auto-split and consistent-hashing
slots), plus keys where Pulsar 4.x departs from keyfailover's slot and the ring points of
Pulsar's own selector tests. They are computed here with a pure-Python Murmur3 x86_32,
written from the reference algorithm and checked against published vectors, so the files
are an oracle independent of the ``mmh3`` package the library uses.

Run ``python tests/vectors/generate_key_hash.py`` to rewrite the files, or add ``--check``
to fail when a file on disk differs from what this script produces.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).with_name("key_hash.json")
PULSAR_OUTPUT = Path(__file__).with_name("pulsar_hash.json")

RANGE_SIZE = 65536
"""Number of hash slots: ``slot = (murmur3_32(key) & 0x7FFFFFFF) % RANGE_SIZE``."""

_MASK32 = 0xFFFFFFFF
_C1 = 0xCC9E2D51
_C2 = 0x1B873593

PUBLISHED_VECTORS: tuple[tuple[bytes, int, int], ...] = (
    # (data, seed, Murmur3 x86_32): widely published vectors for Appleby's reference code,
    # covering every tail length (0-3 bytes after the last full block) and several seeds.
    (b"", 0, 0x00000000),
    (b"", 1, 0x514E28B7),
    (b"", 0xFFFFFFFF, 0x81F16F39),
    (b"\x00", 0, 0x514E28B7),
    (b"\x00\x00", 0, 0x30F4C306),
    (b"\x00\x00\x00", 0, 0x85F0B427),
    (b"\x00\x00\x00\x00", 0, 0x2362F9DE),
    (b"\xff\xff\xff\xff", 0, 0x76293B50),
    (b"\x21", 0, 0x72661CF4),
    (b"\x21\x43", 0, 0xA0F7B07A),
    (b"\x21\x43\x65", 0, 0x7E4A8634),
    (b"\x21\x43\x65\x87", 0, 0xF55B516B),
    (b"\x21\x43\x65\x87", 0x5082EDEE, 0x2362F9DE),
    (b"hello", 0, 0x248BFA47),
    (b"a", 0x9747B28C, 0x7FA09EA6),
    (b"aa", 0x9747B28C, 0x5D211726),
    (b"aaa", 0x9747B28C, 0x283E0130),
    (b"aaaa", 0x9747B28C, 0x5A97808A),
    (b"abc", 0x9747B28C, 0xC84A62DD),
    (b"abcd", 0x9747B28C, 0xF0478627),
    (b"Hello, world!", 0x9747B28C, 0x24884CBA),
    ("ππππππππ".encode(), 0x9747B28C, 0xD58063C1),
    (b"The quick brown fox jumps over the lazy dog", 0, 0x2E4FF723),
)


def _rotl32(value: int, shift: int) -> int:
    return ((value << shift) | (value >> (32 - shift))) & _MASK32


def _scramble(k: int) -> int:
    k = (k * _C1) & _MASK32
    k = _rotl32(k, 15)
    return (k * _C2) & _MASK32


def murmur3_32(data: bytes, seed: int = 0) -> int:
    """Standard Murmur3 x86_32 of ``data``, as an unsigned 32-bit int (Appleby's reference)."""
    h = seed & _MASK32
    full = len(data) - len(data) % 4
    for i in range(0, full, 4):
        h ^= _scramble(int.from_bytes(data[i : i + 4], "little"))
        h = _rotl32(h, 13)
        h = (h * 5 + 0xE6546B64) & _MASK32
    tail = data[full:]
    if tail:
        h ^= _scramble(int.from_bytes(tail, "little"))
    h ^= len(data) & _MASK32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    h ^= h >> 16
    return h


def check_reference() -> None:
    """Raise AssertionError unless :func:`murmur3_32` reproduces every published vector."""
    for data, seed, expected in PUBLISHED_VECTORS:
        got = murmur3_32(data, seed)
        if got != expected:
            raise AssertionError(f"murmur3_32({data!r}, {seed:#x}) = {got:#010x}; expected {expected:#010x}")


def slot_of(data: bytes) -> int:
    """The hash slot of the key whose UTF-8 bytes are ``data``."""
    return (murmur3_32(data) & 0x7FFFFFFF) % RANGE_SIZE


def murmur3_31(data: bytes) -> int:
    """Pulsar's ``Murmur3_32Hash.makeHash``: Murmur3 x86_32 with seed 0, sign bit cleared."""
    return murmur3_32(data) & 0x7FFFFFFF


def pulsar4_slot(data: bytes, start: int, size: int) -> int:
    """Pulsar 4.x's ``makeStickyKeyHash`` in the range ``[start, start + size - 1]``: 0 becomes 1."""
    return (murmur3_31(data) % size + start) or 1


def _pseudo_random_bytes(label: str, length: int) -> bytes:
    """Deterministic bytes (SHA-256 in counter mode), stable across Python versions."""
    out = bytearray()
    counter = 0
    while len(out) < length:
        out += hashlib.sha256(f"{label}/{counter}".encode()).digest()
        counter += 1
    return bytes(out[:length])


def _keys_of_each_length() -> Iterator[tuple[str, bytes]]:
    """Several ASCII and multibyte keys of every UTF-8 byte length 0..12 (every Murmur3 tail)."""
    one, two, three, four = "a", "é", "中", "😀"
    for length in range(13):
        yield "length-ascii", ("x" * length).encode()
        yield "length-ascii", "".join(chr(ord("0") + (i * 7 + length) % 75) for i in range(length)).encode()
        yield "length-ascii", "".join(chr(0x7F - (i * 13 + length) % 64) for i in range(length)).encode()
        # Multibyte keys of exactly `length` bytes: the widest characters first, ASCII padding last.
        for widest in (two, three, four):
            width = len(widest.encode())
            if length >= width:
                text = widest * (length // width) + one * (length % width)
                yield "length-multibyte", text.encode()
        if length >= 3:
            yield "length-multibyte", (one + two + one * (length - 3)).encode()
        if length >= 7:
            yield "length-multibyte", (four + three + one * (length - 7)).encode()
        if length >= 4:
            yield "length-nul", b"\x00" * length
            yield "length-binary", _pseudo_random_bytes("length", length)


_TEXT_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ascii", ("a", "b", "key", "user-1", "user-2", "order:12345", "consumer1", "consumer11", "consumer111")),
    ("ascii", ("Hello, world!", "The quick brown fox jumps over the lazy dog", " ", "\t\n", "~!@#$%^&*()_+")),
    ("ascii", ("persistent://public/default/orders", "tenant/namespace/topic-partition-0", "KEY", "Key")),
    ("accented-latin", ("é", "café", "naïve", "Ångström", "Zürich", "résumé", "São Paulo", "Łódź", "ñ")),
    ("accented-latin", ("crème brûlée", "Øresund", "façade", "Straße", "ÀÉÎÕÜ", "e\u0301", "Ω≈ç√∫")),
    ("cjk", ("中", "中文", "日本語", "漢字キー", "한국어", "东京都", "キー", "鍵", "訂單-42", "用户:7")),
    ("emoji", ("😀", "🚀", "🚀launch", "key-🔑", "👍🏽", "👨\u200d👩\u200d👧", "🇺🇸", "🇯🇵🇰🇷", "𝄞", "😀😀😀")),
    ("nul", ("\x00", "\x00a", "a\x00", "a\x00b", "\x00\x00", "key\x00", "\x00key", "\x00\x00\x00\x00\x00")),
    ("nul", ("k\x00e\x00y", "\x00é", "中\x00", "😀\x00", "\x00😀\x00")),
    ("control", ("\x01", "\x1f", "\x7f", "\x80", "\u00ff", "\u0100", "\u07ff", "\u0800", "\uffff", "\U0010ffff")),
)

_BINARY_KEYS: tuple[bytes, ...] = (
    b"\xff",
    b"\x80",
    b"\xfe\xff",
    b"\xc3\x28",
    b"\xc0\xaf",
    b"\xe2\x82",
    b"\xed\xa0\x80",
    b"\xf0\x9f\x98",
    b"\xf4\x90\x80\x80",
    b"\xf5\x80\x80\x80",
    b"abc\xff",
    b"\xffabc",
    b"\x00\xff\x00",
    b"key\x80\x00",
    bytes(range(128, 256)),
    bytes(range(256)),
)


def _all_keys() -> Iterator[tuple[str, bytes]]:
    yield "empty", b""
    yield from _keys_of_each_length()
    for category, texts in _TEXT_KEYS:
        for text in texts:
            yield category, text.encode()
    for number in range(100):
        yield "ascii-number", str(number).encode()
    for number in range(40):
        yield "uuid", str(uuid.uuid5(uuid.NAMESPACE_URL, f"keyfailover/{number}")).encode()
    for data in _BINARY_KEYS:
        yield "binary", data
    for index in range(24):
        yield "binary", _pseudo_random_bytes("binary", 1 + index % 12) + b"\xff"
    for length in (100, 1000, 10000):
        yield "long-ascii", "".join(chr(ord("a") + i % 26) for i in range(length)).encode()
        yield "long-multibyte", ("é" * (length // 2)).encode()
        yield "long-multibyte", ("中😀" * (length // 7) + "a" * (length % 7)).encode()
        yield "long-binary", _pseudo_random_bytes("long", length - 1) + b"\xff"
        yield "long-nul", b"\x00" * length


def _as_text(data: bytes) -> str | None:
    """``data`` decoded as UTF-8, or None for a binary key (its bytes are its only identity)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _entries(keys: Iterable[tuple[str, bytes]], hashes: Callable[[bytes], dict[str, int]]) -> list[dict[str, Any]]:
    """One vector per distinct key, in order: its category, bytes, text when it has one, then ``hashes(bytes)``."""
    vectors: list[dict[str, Any]] = []
    seen: set[bytes] = set()
    for category, data in keys:
        if data in seen:
            continue
        seen.add(data)
        entry: dict[str, Any] = {"category": category, "key_utf8_hex": data.hex()}
        text = _as_text(data)
        if text is not None:
            entry["key"] = text
        entry.update(hashes(data))
        vectors.append(entry)
    return vectors


def build_vectors() -> list[dict[str, Any]]:
    """Every vector, in a fixed order, without duplicate keys."""
    return _entries(_all_keys(), lambda data: {"murmur3_32": murmur3_32(data), "slot": slot_of(data)})


_PULSAR_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Found by searching "key-<n>" for the property the category names.
    ("key-hash-zero", ("key-30884", "key-78688", "key-274341", "key-289230", "key-308750", "key-410712")),
    ("key-hash-one", ("key-30098", "key-64020", "key-109871")),
    ("consistent-lowest", ("key-4415", "key-37297", "key-109500")),
    ("consistent-highest", ("key-6364", "key-79201", "key-120102")),
    # What Pulsar hashes for a message without a key.
    ("none-key", ("NONE_KEY",)),
    # Ring points of Pulsar 4.x ConsistentHashingStickyKeyConsumerSelectorTest.testGetConsumerKeyHashRanges:
    # consumer name, NUL, name index (0 for distinct names), NUL, point index.
    ("pulsar4-test-ring-point", tuple("\0".join((f"consumer{c}", "0", str(i))) for c in (1, 2, 3) for i in range(3))),
    # Ring points of the Pulsar 3.x ConsistentHashingStickyKeyConsumerSelectorTest revision that pins exact
    # ranges: consumer name, NUL, point index (that selector revision had no name index).
    ("pulsar3-test-ring-point", tuple(f"consumer{c}\0{i}" for c in (1, 2, 3) for i in range(3))),
    ("pulsar3-test-ring-point", tuple(f"consumer\0{i}" for i in range(5))),
)


def build_pulsar_vectors() -> list[dict[str, Any]]:
    """Pulsar's hashes of the special keys and of every key of ``key_hash.json``, without duplicates."""
    special = [(category, text.encode()) for category, texts in _PULSAR_KEYS for text in texts]
    return _entries(
        [*special, *_all_keys()],
        lambda data: {
            "murmur3_31": murmur3_31(data),
            "key_hash": slot_of(data),
            "pulsar4_key_hash": pulsar4_slot(data, 0, RANGE_SIZE),
            "pulsar4_consistent_hash": pulsar4_slot(data, 1, RANGE_SIZE - 1),
        },
    )


def build_pulsar_document() -> dict[str, Any]:
    """The whole JSON document written to ``pulsar_hash.json``."""
    check_reference()
    return {
        "description": (
            "Apache Pulsar hash vectors. key_utf8_hex and key are as in key_hash.json. murmur3_31 = "
            "murmur3_32 & 0x7FFFFFFF (Pulsar's Murmur3_32Hash.makeHash, and Pulsar 3.x's sticky-key hash); "
            "key_hash = murmur3_31 % 65536 (keyfailover's slot, Pulsar 3.x auto-split); pulsar4_key_hash = "
            "murmur3_31 % 65536, with 0 made 1 (Pulsar 4.x auto-split, range [0, 65535]); "
            "pulsar4_consistent_hash = murmur3_31 % 65535 + 1 (Pulsar 4.x consistent hashing, range [1, 65535], "
            "for keys and ring points). Generated by tests/vectors/generate_key_hash.py with a pure-Python "
            "reference Murmur3."
        ),
        "vectors": build_pulsar_vectors(),
    }


def build_document() -> dict[str, Any]:
    """The whole JSON document written to ``key_hash.json``."""
    check_reference()
    return {
        "description": (
            "keyfailover key hash vectors. key_utf8_hex is the key's UTF-8 bytes in hex (the only identity "
            "of a binary key); key is the same key as text when those bytes are valid UTF-8. murmur3_32 is "
            "standard Murmur3 x86_32 with seed 0 of those bytes, unsigned; slot = (murmur3_32 & 0x7FFFFFFF) "
            "% 65536. Generated by tests/vectors/generate_key_hash.py with a pure-Python reference Murmur3."
        ),
        "range_size": RANGE_SIZE,
        "vectors": build_vectors(),
    }


def render() -> str:
    """The exact text of ``key_hash.json``."""
    return json.dumps(build_document(), ensure_ascii=False, indent=1) + "\n"


def render_pulsar() -> str:
    """The exact text of ``pulsar_hash.json``."""
    return json.dumps(build_pulsar_document(), ensure_ascii=False, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="fail if a file on disk is not up to date")
    args = parser.parse_args(argv)
    outdated = 0
    for output, text in ((OUTPUT, render()), (PULSAR_OUTPUT, render_pulsar())):
        if args.check:
            current = output.read_text(encoding="utf-8") if output.exists() else ""
            if current != text:
                print(f"{output} is out of date; run {Path(__file__).name} to regenerate it", file=sys.stderr)
                outdated += 1
            continue
        output.write_text(text, encoding="utf-8", newline="\n")
        print(f"wrote {len(json.loads(text)['vectors'])} vectors to {output}")
    return 1 if outdated else 0


if __name__ == "__main__":
    sys.exit(main())
