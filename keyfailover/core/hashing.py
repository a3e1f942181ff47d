"""The one hash that decides where every key belongs.

``key_hash(key) = (murmur3_x86_32(utf8(key), seed=0) & 0x7FFFFFFF) % 65536``: Apache
Pulsar's sticky-key hash (``Murmur3_32Hash`` with a range size of 65536), so a keyfailover
range map means the same thing to a Pulsar Key_Shared STICKY subscription. As 65536
divides 2^31, the slot is the low 16 bits of the unsigned Murmur3 value.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import mmh3
import numpy as np
import numpy.typing as npt

from keyfailover.core.errors import InvalidKeyError

__all__ = ["HASH_RANGE_SIZE", "key_bytes", "key_hash", "key_hashes", "murmur3_32"]

HASH_RANGE_SIZE = 65536
"""Number of hash slots; ranges tile ``[0, HASH_RANGE_SIZE - 1]``."""

_SLOT_MASK = HASH_RANGE_SIZE - 1


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


def key_hash(key: str | bytes) -> int:
    """The hash slot of ``key`` in ``[0, 65535]``; O(len(key))."""
    return mmh3.hash(key_bytes(key), 0, False) & _SLOT_MASK


def key_hashes(keys: Iterable[str | bytes]) -> npt.NDArray[np.int32]:
    """The hash slots of many keys at once, as an ``int32`` numpy array in input order.

    ``keys`` is a batch (a list, tuple or other iterable of keys); a single ``str`` or ``bytes`` is
    refused, since iterating it would hash its characters or byte values one by one.
    """
    if isinstance(keys, str | bytes | bytearray | memoryview):
        raise InvalidKeyError(
            f"key_hashes takes a batch of keys, not one {type(keys).__name__} key; "
            "pass a list of keys, or use key_hash(key) for one"
        )
    try:
        batch = keys if isinstance(keys, Sequence) else list(keys)
    except TypeError:
        raise InvalidKeyError(f"key_hashes takes an iterable of keys, not {type(keys).__name__}") from None
    try:  # fast path: all str, encoded at C speed
        return _slots_of(map(str.encode, batch), len(batch))
    except (TypeError, UnicodeEncodeError):  # bytes keys, other types or invalid Unicode
        return _slots_of(map(key_bytes, batch), len(batch))


def _slots_of(encoded: Iterator[bytes], count: int) -> npt.NDArray[np.int32]:
    raw = np.fromiter(map(mmh3.hash, encoded), dtype=np.int32, count=count)
    # The low 16 bits of a signed and of an unsigned 32-bit value are the same bits.
    return raw & np.int32(_SLOT_MASK)
