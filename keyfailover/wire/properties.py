"""Message properties: string keys and values a message carries beside its key and payload.

Apache Pulsar's message properties (Kafka's headers): tracing ids, content types, where a
dead letter came from. They have one encoding wherever they leave Python: a msgpack map of
str keys to str values, stored as it is in both logs (a nullable column: NULL for a message
without properties), carried as a bin in the native protocol's frames, and kept as those
bytes by the server in between, so a delivery passes them on without decoding them. Only the
edges decode: a client's :class:`~keyfailover.client.Message`, the Pulsar endpoint, export.

msgpack because it is the native protocol's own encoding and a dependency already; its C
coder packs or unpacks a few properties in well under a microsecond (JSON takes three to four
times longer), a short string or a small map costs one byte of header (JSON two quotes per
string, a colon and a comma per pair), and it holds any str (PostgreSQL's ``jsonb`` refuses
U+0000). The price: SQL cannot read inside the bytes.

Limits (:class:`~keyfailover.core.errors.PropertiesError` beyond them, and nothing is stored):
at most :data:`MAX_PROPERTIES` properties, keys of at most :data:`MAX_PROPERTY_KEY` characters
(empty allowed, as in Pulsar), and at most :data:`MAX_PROPERTIES_SIZE` bytes encoded.

One property is read by the server: :data:`DELIVER_AT_PROPERTY`, a message's delivery time.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterator, Mapping
from typing import Final

import msgpack  # type: ignore[import-untyped]

from keyfailover.core.errors import PropertiesError

__all__ = [
    "DELIVER_AT_PROPERTY",
    "MAX_PROPERTIES",
    "MAX_PROPERTIES_SIZE",
    "MAX_PROPERTY_KEY",
    "NO_PROPERTIES",
    "Properties",
    "check_encoded",
    "decode_properties",
    "delivery_time",
    "encode_properties",
    "parse_delivery_time",
]

MAX_PROPERTIES: Final = 128
"""The most properties one message may carry."""

MAX_PROPERTY_KEY: Final = 256
"""The longest property key, in characters (Unicode code points), as long as a topic name may be."""

MAX_PROPERTIES_SIZE: Final = 64 * 1024
"""The most bytes one message's properties may take encoded: their keys' and values' UTF-8 bytes
and one to five bytes of msgpack header for each, and for the map."""

DELIVER_AT_PROPERTY: Final = "keyfailover.deliver_at"
"""The property holding a message's delivery time, Pulsar's ``deliver_at_time``: milliseconds since the Unix epoch
in decimal digits. A durable subscription delivers the message no earlier (a reader reads it at once); a Pulsar
producer's ``deliver_at`` and ``deliver_after`` are kept in it, and a native producer may set it."""

_DELIVER_AT_BYTES: Final = DELIVER_AT_PROPERTY.encode()
_MAX_DELIVER_AT: Final = 2**63 - 1  # deliver_at_time is an int64: at most 19 digits

_RULE: Final = (
    f"a mapping of at most {MAX_PROPERTIES} str keys of at most {MAX_PROPERTY_KEY} characters to str values, "
    f"at most {MAX_PROPERTIES_SIZE} bytes encoded"
)

_REPR = reprlib.Repr()
_REPR.maxstring = 40
_REPR.maxother = 40


def encode_properties(properties: Mapping[str, str] | None) -> bytes | None:
    """``properties`` checked and encoded; None for None or an empty mapping (a message without properties).

    Raises :class:`PropertiesError`, saying which key or value is wrong and what was expected.
    """
    if properties is None:
        return None
    if not isinstance(properties, Mapping):
        raise PropertiesError(f"properties must be {_RULE}, not {type(properties).__name__}")
    if not properties:
        return None
    if len(properties) > MAX_PROPERTIES:
        raise PropertiesError(f"{len(properties)} properties are over the limit of {MAX_PROPERTIES} per message")
    for key, value in properties.items():
        if not isinstance(key, str):
            raise PropertiesError(f"property key {_REPR.repr(key)} is {type(key).__name__}; expected a str")
        if len(key) > MAX_PROPERTY_KEY:
            raise PropertiesError(
                f"property key {_REPR.repr(key)} has {len(key)} characters; expected at most {MAX_PROPERTY_KEY}"
            )
        if not isinstance(value, str):
            raise PropertiesError(
                f"the value of property {_REPR.repr(key)} is {type(value).__name__} {_REPR.repr(value)}; expected a str"
            )
        for text in (key, value):
            try:
                text.encode()
            except UnicodeEncodeError as exc:
                raise PropertiesError(
                    f"property {_REPR.repr(key)} holds {_REPR.repr(text)}, not valid Unicode ({exc.reason} at index "
                    f"{exc.start}); expected a str that encodes to UTF-8"
                ) from None
    data: bytes = msgpack.packb(dict(properties), use_bin_type=True)
    if len(data) > MAX_PROPERTIES_SIZE:
        raise PropertiesError(
            f"the properties take {len(data)} bytes encoded, over the limit of {MAX_PROPERTIES_SIZE} per message"
        )
    return data


def check_encoded(data: object) -> bytes:
    """``data`` if it is the encoding of properties within the limits (one non-empty msgpack map of str to str,
    nothing after it); else :class:`PropertiesError` saying what is wrong. For bytes from outside: a frame, a
    log call."""
    if type(data) is not bytes:
        raise PropertiesError(f"encoded properties must be bytes, not {type(data).__name__}")
    if len(data) > MAX_PROPERTIES_SIZE:
        raise PropertiesError(
            f"encoded properties of {len(data)} bytes are over the limit of {MAX_PROPERTIES_SIZE} per message"
        )
    try:
        value = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_map_len=MAX_PROPERTIES,
            max_array_len=0,
            max_bin_len=0,
            max_ext_len=0,
        )
    except (ValueError, msgpack.UnpackException) as exc:
        raise PropertiesError(f"encoded properties are not one msgpack map of str to str: {exc}") from None
    if type(value) is not dict or not value:
        shown = "an empty map (send none instead)" if value == {} else type(value).__name__
        raise PropertiesError(f"encoded properties must be a non-empty msgpack map of str to str, got {shown}")
    for key, text in value.items():
        if type(key) is not str or len(key) > MAX_PROPERTY_KEY:
            raise PropertiesError(
                f"property key {_REPR.repr(key)} is not a str of at most {MAX_PROPERTY_KEY} characters"
            )
        if type(text) is not str:
            raise PropertiesError(
                f"the value of property {_REPR.repr(key)} is {type(text).__name__} {_REPR.repr(text)}; expected a str"
            )
    return data


def decode_properties(data: bytes | None) -> dict[str, str]:
    """The properties ``data`` encodes, {} for None. It trusts ``data``: bytes a log stored or a decoder took
    were checked (:func:`check_encoded`) on their way in."""
    if data is None:
        return {}
    properties: dict[str, str] = msgpack.unpackb(data, raw=False)
    return properties


def delivery_time(data: bytes | None) -> int:
    """The delivery time that encoded properties ``data`` hold (:data:`DELIVER_AT_PROPERTY`), in milliseconds since
    the Unix epoch; 0 for none, or for a value that is not one: decimal digits of 1 to 2**63 - 1. Properties that
    do not name it are not decoded, only scanned."""
    if data is None or _DELIVER_AT_BYTES not in data:
        return 0
    return parse_delivery_time(decode_properties(data).get(DELIVER_AT_PROPERTY))


def parse_delivery_time(text: str | None) -> int:
    """The delivery time ``text`` holds, as :func:`delivery_time` reads it: 0 when it holds none."""
    if text is None or not (len(text) <= 19 and text.isascii() and text.isdigit()):
        return 0
    value = int(text)
    return value if value <= _MAX_DELIVER_AT else 0


class Properties(Mapping[str, str]):
    """A received message's properties: a read-only mapping of str to str, hashable (so is the message holding it)."""

    __slots__ = ("_items",)

    def __init__(self, items: dict[str, str]) -> None:
        """Wrap ``items`` (a dict nobody else holds: it is not copied)."""
        self._items = items

    @classmethod
    def decoded(cls, data: bytes | None) -> Properties:
        """The properties ``data`` encodes (trusted, as :func:`decode_properties`); :data:`NO_PROPERTIES` for None."""
        return NO_PROPERTIES if data is None else cls(decode_properties(data))

    def __getitem__(self, key: str) -> str:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Properties):
            return self._items == other._items
        return isinstance(other, Mapping) and self._items == dict(other.items())

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return f"Properties({self._items!r})"


NO_PROPERTIES: Final = Properties({})
"""The properties of a message without any: one empty instance for them all."""
