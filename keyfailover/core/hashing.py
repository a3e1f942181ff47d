"""The one hash that decides where every key belongs, and Apache Pulsar's hashes beside it.

``key_hash(key) = (murmur3_x86_32(utf8(key), seed=0) & 0x7FFFFFFF) % 65536``: Apache
Pulsar's sticky-key hash (``Murmur3_32Hash`` with a range size of 65536), so a keyfailover
range map means the same thing to a Pulsar Key_Shared STICKY subscription. As 65536
divides 2^31, the slot is the low 16 bits of the unsigned Murmur3 value.

Pulsar's own hashes, for the peers the evaluation compares with, all start from
``m31 = murmur3_x86_32(key bytes, seed 0) & 0x7FFFFFFF`` (:func:`murmur3_31`, Pulsar's
``Murmur3_32Hash.makeHash``):

- Pulsar 3.x hashes a sticky key to ``m31`` itself (:func:`pulsar3_hash`); its auto-split
  selector takes ``m31 % 65536``, which is :func:`key_hash`, and its consistent-hashing ring
  spans ``0 .. 2^31 - 1``.
- Pulsar 4.x hashes a key into its selector's range, ``m31 % size + start``, and turns a
  result of 0 (``STICKY_KEY_HASH_NOT_SET``) into 1. The auto-split selector spans
  ``[0, 65535]``, so :func:`pulsar4_key_hash` is :func:`key_hash` except that slot 0 becomes 1;
  slots 0 and 1 always share an auto-split owner, so no key changes owner. Consistent hashing
  spans ``[1, 65535]`` (size 65535), so :func:`pulsar4_consistent_hash` is ``m31 % 65535 + 1``,
  a slot unrelated to :func:`key_hash`, used for keys and ring points alike.

Keyless messages differ on purpose: Pulsar hashes a message without a key as if its key
were the bytes ``b"NONE_KEY"``, so all of them go to one consumer in order; keyfailover
treats keyless messages as unordered and hands them out round robin instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import mmh3
import numpy as np
import numpy.typing as npt

from keyfailover.core.errors import InvalidKeyError

__all__ = [
    "HASH_RANGE_SIZE",
    "key_bytes",
    "key_hash",
    "key_hashes",
    "murmur3_31",
    "murmur3_32",
    "pulsar3_hash",
    "pulsar3_hashes",
    "pulsar4_consistent_hash",
    "pulsar4_consistent_hashes",
    "pulsar4_key_hash",
    "pulsar4_key_hashes",
]

HASH_RANGE_SIZE = 65536
"""Number of hash slots; ranges tile ``[0, HASH_RANGE_SIZE - 1]``."""

_SLOT_MASK = HASH_RANGE_SIZE - 1
_M31_MASK = 0x7FFFFFFF
_CONSISTENT_RANGE_SIZE = HASH_RANGE_SIZE - 1
"""Pulsar 4.x consistent hashing's range ``[1, 65535]`` holds 65535 slots."""


def key_bytes(key: object) -> bytes:
    """Return the UTF-8 bytes that identify ``key`` (a ``str`` and its UTF-8 ``bytes`` are one key).

    Raises :class:`InvalidKeyError` for any other type, and for a ``str`` holding lone
    surrogates, which have no UTF-8 form.
    """
    if type(key) is bytes:
        return key
    if isinstance(key, str):
        try:
            return key.encode()
        except UnicodeEncodeError as exc:
            raise InvalidKeyError(
                f"key {key!r} is not valid Unicode ({exc.reason} at index {exc.start}); "
                "expected a str that encodes to UTF-8"
            ) from None
    if isinstance(key, bytes):
        return bytes(key)
    raise InvalidKeyError(f"key must be str or bytes, not {type(key).__name__}")


def murmur3_32(data: bytes) -> int:
    """Standard Murmur3 x86_32 of ``data`` with seed 0, as an unsigned 32-bit int."""
    return mmh3.hash(data, 0, False)


def murmur3_31(data: bytes) -> int:
    """Murmur3 x86_32 of ``data`` with seed 0 and the sign bit cleared: Pulsar's ``Murmur3_32Hash.makeHash``."""
    return mmh3.hash(data, 0, False) & _M31_MASK


def key_hash(key: str | bytes) -> int:
    """The hash slot of ``key`` in ``[0, 65535]``; linear in the length of ``key``."""
    return mmh3.hash(key_bytes(key), 0, False) & _SLOT_MASK


def pulsar3_hash(key: str | bytes) -> int:
    """Pulsar 3.x's sticky-key hash of ``key``: ``murmur3_31`` of its bytes, in ``[0, 2^31 - 1]``."""
    return murmur3_31(key_bytes(key))


def pulsar4_key_hash(key: str | bytes) -> int:
    """Pulsar 4.x's auto-split slot of ``key`` in ``[1, 65535]``: :func:`key_hash`, with 0 made 1."""
    return key_hash(key) or 1


def pulsar4_consistent_hash(key: str | bytes) -> int:
    """Pulsar 4.x's consistent-hashing slot of ``key`` (or of a ring point's name): ``m31 % 65535 + 1``."""
    return pulsar3_hash(key) % _CONSISTENT_RANGE_SIZE + 1


def key_hashes(keys: Iterable[str | bytes]) -> npt.NDArray[np.int32]:
    """The hash slots of many keys at once, as an ``int32`` numpy array in input order.

    ``keys`` is a batch (a list, tuple or other iterable of keys); a single ``str`` or ``bytes`` is
    refused, since iterating it would hash its characters or byte values one by one.
    """
    # The low 16 bits of a signed and of an unsigned 32-bit value are the same bits.
    return _signed_murmur3(keys, "key_hashes", "key_hash") & np.int32(_SLOT_MASK)


def pulsar3_hashes(keys: Iterable[str | bytes]) -> npt.NDArray[np.int32]:
    """:func:`pulsar3_hash` of many keys at once, as an ``int32`` numpy array in input order."""
    return _signed_murmur3(keys, "pulsar3_hashes", "pulsar3_hash") & np.int32(_M31_MASK)


def pulsar4_key_hashes(keys: Iterable[str | bytes]) -> npt.NDArray[np.int32]:
    """:func:`pulsar4_key_hash` of many keys at once, as an ``int32`` numpy array in input order."""
    slots = _signed_murmur3(keys, "pulsar4_key_hashes", "pulsar4_key_hash") & np.int32(_SLOT_MASK)
    slots[slots == 0] = 1
    return slots


def pulsar4_consistent_hashes(keys: Iterable[str | bytes]) -> npt.NDArray[np.int32]:
    """:func:`pulsar4_consistent_hash` of many keys at once, as an ``int32`` numpy array in input order."""
    m31 = _signed_murmur3(keys, "pulsar4_consistent_hashes", "pulsar4_consistent_hash") & np.int32(_M31_MASK)
    return m31 % np.int32(_CONSISTENT_RANGE_SIZE) + np.int32(1)


def _signed_murmur3(keys: Iterable[str | bytes], batch_name: str, single_name: str) -> npt.NDArray[np.int32]:
    """Murmur3 x86_32 (seed 0) of every key's UTF-8 bytes, as the bits of an ``int32`` array."""
    if isinstance(keys, str | bytes | bytearray | memoryview):
        raise InvalidKeyError(
            f"{batch_name} takes a batch of keys, not one {type(keys).__name__} key; "
            f"pass a list of keys, or use {single_name}(key) for one"
        )
    try:
        batch = keys if isinstance(keys, Sequence) else list(keys)
    except TypeError:
        raise InvalidKeyError(f"{batch_name} takes an iterable of keys, not {type(keys).__name__}") from None
    try:  # fast path: all str, encoded at C speed
        return _murmur3_of(map(str.encode, batch), len(batch))
    except (TypeError, UnicodeEncodeError):  # bytes keys, other types or invalid Unicode
        return _murmur3_of(map(key_bytes, batch), len(batch))


def _murmur3_of(encoded: Iterator[bytes], count: int) -> npt.NDArray[np.int32]:
    """The signed Murmur3 of each of ``count`` encoded keys, as one int32 array."""
    return np.fromiter(map(mmh3.hash, encoded), dtype=np.int32, count=count)
