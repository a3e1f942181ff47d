"""The wire protocol: frames, their encoding and a validating incremental decoder (sans-IO).

A frame on the wire is a 4-byte unsigned big-endian body length ``N`` followed by ``N``
bytes holding one msgpack map: ``"type"`` (a str) plus the frame's fields. ``str`` travels
as msgpack str and ``bytes`` as msgpack bin, so a key comes back exactly as it was sent.
docs/protocol.md is the specification for other implementations; this module is the
reference. :func:`encode` trusts its input (mypy checks it); :class:`Decoder` trusts
nothing: every frame it returns has exactly the documented fields, types and bounds. The frame
types are declared in :mod:`keyfailover.wire._frames` and re-exported here.
Message properties travel as their one encoding (:mod:`keyfailover.wire.properties`), a
bin holding a msgpack map, which the decoder checks but does not decode for the frame: a frame
body holds one map, so a nested map costs no memory before it is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import reprlib
import socket
import struct
from collections.abc import Callable
from dataclasses import fields
from typing import Any, Final, Literal, NamedTuple, TypeGuard, get_args

import msgpack  # type: ignore[import-untyped]

from keyfailover.core.errors import (
    FATAL_CODES,
    ErrorCode,
    FrameEncodeError,
    KeyFailoverError,
    PropertiesError,
    ProtocolError,
)
from keyfailover.core.hashing import HASH_RANGE_SIZE
from keyfailover.core.subtypes import SUBSCRIPTION_TYPES, SubscriptionType
from keyfailover.wire._frames import (
    Ack,
    ClientFrame,
    Close,
    CloseConsumer,
    Connect,
    Connected,
    ConsumerClosed,
    Delivered,
    Entries,
    Entry,
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
)
from keyfailover.wire._ints import is_within_int_range
from keyfailover.wire.properties import check_encoded

__all__ = [
    "DEFAULT_MAX_FRAME",
    "FATAL_CODES",
    "MAX_NAME_LENGTH",
    "MAX_READ",
    "OLDEST_PROTOCOL_VERSION",
    "PRODUCER_VERSION",
    "PROTOCOL_VERSION",
    "READ_VERSION",
    "SUBSCRIPTION_TYPES_VERSION",
    "Ack",
    "ClientFrame",
    "Close",
    "CloseConsumer",
    "Connect",
    "Connected",
    "ConsumerClosed",
    "Decoder",
    "Delivered",
    "Entries",
    "Entry",
    "Error",
    "ErrorCode",
    "Extend",
    "Flow",
    "Frame",
    "Key",
    "Lookup",
    "Messages",
    "Nack",
    "Ping",
    "Pong",
    "Produce",
    "ProtocolError",
    "RangesChanged",
    "Read",
    "Receipt",
    "Route",
    "ServerFrame",
    "Settled",
    "Subscribe",
    "Subscribed",
    "check_name",
    "encode",
    "is_valid_name",
    "stream_transport",
]

PROTOCOL_VERSION: Final = 9
"""The version this client sends in ``connect``, and the newest a server speaks."""

SUBSCRIPTION_TYPES_VERSION: Final = 9
"""The first version whose ``subscribe`` has ``subscription_type`` and ``priority_level``."""

READ_VERSION: Final = 8
"""The first version with ``read`` and ``entries``: a connection of an older version has neither frame."""

_PROPERTIES_VERSION: Final = 7
"""The first version with message properties: an older connection's produce and deliveries lack them."""

PRODUCER_VERSION: Final = 9
"""The first version whose deliveries and entries name their producer: an older connection's lack the name."""

OLDEST_PROTOCOL_VERSION: Final = 5
"""The oldest version a server still speaks; it answers ``version_mismatch`` to versions outside
``OLDEST_PROTOCOL_VERSION`` .. ``PROTOCOL_VERSION``. Version 8 deliveries and entries do not name their
producer, and its ``subscribe`` has no subscription type or priority level; version 7 frames have no ``read``
and ``entries`` either;
version 6 frames carry no properties (a
``produce`` has no ``properties`` field, a delivery no properties item), version 5 deliveries no
publish time either."""

DEFAULT_MAX_FRAME: Final = 5 * 1024 * 1024
"""Largest frame body (the ``N`` of the length prefix, in bytes) a decoder accepts by default."""

MAX_NAME_LENGTH: Final = 256
"""Topic, subscription and consumer names are 1 to this many characters, without NUL."""

MAX_READ: Final = 10_000
"""The most messages one ``read`` may ask for (its ``limit``), and the most an ``entries`` frame holds."""

_INT64_MIN: Final = -(2**63)
_PRIORITY_MAX: Final = 2**31 - 1
_INT64_MAX: Final = 2**63 - 1
_MAX_LENGTH: Final = 2**32 - 1  # what the 4-byte length prefix can say
_HEADER: Final = struct.Struct(">I")

_FIELDS: Final[dict[type[Frame], tuple[str, ...]]] = {
    cls: tuple(f.name for f in fields(cls)) for cls in (*get_args(ClientFrame), *get_args(ServerFrame))
}


# -- encoding -----------------------------------------------------------------------------


def stream_transport(transport: asyncio.BaseTransport) -> asyncio.Transport:
    """The TCP transport of a new connection, with Nagle off: frames are batched already."""
    if not isinstance(transport, asyncio.Transport):
        raise TypeError(f"expected a stream transport, got {type(transport).__name__}")
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return transport


def encode(frame: Frame, version: int = PROTOCOL_VERSION) -> bytes:
    """Return ``frame`` as it goes on the wire: the 4-byte body length, then the msgpack body.

    ``version`` is the protocol version of the connection: before version 9, deliveries and entries leave
    out their producer name and a subscribe has no ``subscription_type`` or ``priority_level`` field (one
    that names a type or a priority raises :class:`FrameEncodeError`); before version 8 there is no ``read`` or
    ``entries`` (either raises :class:`FrameEncodeError`); for version 6, deliveries leave out
    their properties and a produce has no ``properties`` field (a produce with properties raises
    :class:`FrameEncodeError`: that version cannot carry them); for version 5, deliveries leave out
    their publish time too. Nothing is validated beyond what msgpack needs; a value it cannot carry
    raises :class:`FrameEncodeError`. Cost is one ``msgpack.packb`` call: batches of tuples are
    packed by msgpack's C code.
    """
    names = _FIELDS.get(type(frame))
    if names is None:
        raise FrameEncodeError(f"cannot encode {frame!r}: expected a protocol frame")
    if version < READ_VERSION and type(frame) in (Read, Entries):
        raise FrameEncodeError(
            f"protocol version {version} has no {frame.type!r} frame; expected version {READ_VERSION} or newer"
        )
    body: dict[str, Any] = {"type": frame.type}
    for name in names:
        body[name] = getattr(frame, name)
    if (
        version < SUBSCRIPTION_TYPES_VERSION
        and type(frame) is Subscribe
        and (body.pop("subscription_type"), body.pop("priority_level")) != (None, 0)  # the fields go either way
    ):
        raise FrameEncodeError(
            f"protocol version {version} cannot carry a subscription type or priority level; expected version "
            f"{SUBSCRIPTION_TYPES_VERSION} or newer"
        )
    if version < PRODUCER_VERSION:
        if type(frame) is Messages:
            items = 4 if version < 6 else 5 if version < _PROPERTIES_VERSION else 6  # each version one item less
            body["messages"] = [delivered[:items] for delivered in frame.messages]
        elif type(frame) is Entries:
            body["messages"] = [entry[:5] for entry in frame.messages]
        elif version < _PROPERTIES_VERSION and type(frame) is Produce and body.pop("properties") is not None:
            raise FrameEncodeError(f"protocol version {version} cannot carry message properties")
    try:
        packed: bytes = msgpack.packb(body, use_bin_type=True)
        return _HEADER.pack(len(packed)) + packed
    except (TypeError, ValueError, OverflowError, struct.error) as exc:
        raise FrameEncodeError(f"cannot encode {frame.type!r} frame: {exc}") from None


# -- field checks ---------------------------------------------------------------------------
# Each check returns the value it was given, or raises a _FieldError saying what was expected.


class _FieldError(Exception):
    """A field value is invalid; the text completes "field 'x' ..." with expected and received."""


class _ShortRepr(reprlib.Repr):
    """reprlib, with bytes cut before ``repr`` (reprlib would render all of a 5 MiB payload)."""

    def repr_bytes(self, x: bytes, level: int) -> str:
        """The repr of at most ``maxstring`` bytes of ``x``, and "..." when it is longer."""
        return repr(x[: self.maxstring]) + ("..." if len(x) > self.maxstring else "")


_REPR = _ShortRepr()
_REPR.maxstring = 40
_REPR.maxother = 40
_REPR.maxtuple = 4


def _show(value: object) -> str:
    """A short description of a received value, for error messages."""
    return f"{_REPR.repr(value)} ({type(value).__name__})"


def _wrong(expected: str, value: object) -> _FieldError:
    """The error for a field whose ``value`` is not ``expected``."""
    return _FieldError(f"must be {expected}, got {_show(value)}")


_UINT: Final = "a non-negative int64"


def _uint(value: object) -> int:
    """``value`` if it is a non-negative int64."""
    if type(value) is int and 0 <= value <= _INT64_MAX:
        return value
    raise _wrong(_UINT, value)


def _opt_uint(value: object) -> int | None:
    """``value`` if it is a non-negative int64 or None."""
    if value is None or (type(value) is int and 0 <= value <= _INT64_MAX):
        return value
    raise _wrong(f"{_UINT} or nil", value)


def _int64(value: object) -> int:
    """``value`` if it is an int64."""
    if type(value) is int and _INT64_MIN <= value <= _INT64_MAX:
        return value
    raise _wrong("an int64", value)


def _max_frame(value: object) -> int:
    """``value`` if it can be a frame limit: an int the length prefix can say, at least 1."""
    if type(value) is int and 0 < value <= _MAX_LENGTH:
        return value
    raise _wrong(f"an int in [1, {_MAX_LENGTH}]", value)


def _timeout(value: object) -> float:
    """``value`` as a float, if it is a positive finite number."""
    # An int is accepted too: some msgpack libraries send integral floats as ints.
    if (type(value) is float or type(value) is int) and 0 < value < math.inf:
        return float(value)
    raise _wrong("a positive finite number", value)


_NAME_RULE: Final = f"a str of 1 to {MAX_NAME_LENGTH} characters without NUL"


def is_valid_name(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a topic, subscription, consumer or producer name the protocol accepts."""
    return type(value) is str and 0 < len(value) <= MAX_NAME_LENGTH and "\0" not in value


def check_name(what: str, value: object) -> str:
    """``value`` if it is a valid name; else a KeyFailoverError naming ``what``, the value and the rule.

    Clients call it before sending, so a name the server would refuse never reaches it.
    """
    if is_valid_name(value):
        return value
    raise KeyFailoverError(f"{what} must be {_NAME_RULE}, got {_show(value)}")


def _name(value: object) -> str:
    """``value`` if it is a valid topic, subscription, consumer or producer name."""
    if is_valid_name(value):
        return value
    raise _wrong(_NAME_RULE, value)


def _label(value: object) -> str:
    """``value`` if it is a non-empty str."""
    if type(value) is str and value:
        return value
    raise _wrong("a non-empty str", value)


def _opt_subscription_type(value: object) -> SubscriptionType | None:
    """``value`` if it is one of the subscription types or None."""
    for known in SUBSCRIPTION_TYPES:
        if value == known and type(value) is str:
            return known
    if value is None:
        return None
    raise _wrong(f"one of {', '.join(SUBSCRIPTION_TYPES)} or nil", value)


def _priority(value: object) -> int:
    """``value`` if it is an int from 0 to 2**31 - 1 (Pulsar's priority levels are int32s)."""
    if type(value) is int and 0 <= value <= _PRIORITY_MAX:
        return value
    raise _wrong(f"an int from 0 to {_PRIORITY_MAX}", value)


def _opt_label(value: object) -> str | None:
    """``value`` if it is a non-empty str or None."""
    if value is None or (type(value) is str and value):
        return value
    raise _wrong("a non-empty str or nil", value)


def _text(value: object) -> str:
    """``value`` if it is a str."""
    if type(value) is str:
        return value
    raise _wrong("a str", value)


def _opt_text(value: object) -> str | None:
    """``value`` if it is a str or None."""
    if value is None or type(value) is str:
        return value
    raise _wrong("a str or nil", value)


# Arrays are checked by plain loops over the tuples msgpack built: on CPython 3.11 a loop
# with a specialized unpack and chained type tests beats set(map(type, ...)), min and max,
# and it stops at the first bad item. Batches hold up to ~10,000 items, so this is the hot path.

_KEY_TYPES: Final = frozenset({str, bytes, type(None)})


def _array(value: object, expected: str) -> tuple[Any, ...]:
    """``value`` if it is an array, as msgpack decodes one: a tuple."""
    if type(value) is tuple:
        return value
    raise _wrong(f"an array of {expected}", value)


def _bad_item(items: tuple[Any, ...], item: object, expected: str) -> _FieldError:
    """The error for ``item``, the first bad one of ``items`` (so the first one that *is* it)."""
    index = next(i for i, each in enumerate(items) if each is item)
    return _FieldError(f"item {index} must be {expected}, got {_show(item)}")


def _uints(value: object) -> list[int]:
    """``value`` as a list, if it is an array of non-negative int64s; the error names the first bad item."""
    items = _array(value, _UINT)
    # Checked in C as a whole (an ack frame holds many); the loop finds the bad item to name.
    if not is_within_int_range(items, 0, _INT64_MAX):
        for item in items:
            if not (type(item) is int and 0 <= item <= _INT64_MAX):
                raise _bad_item(items, item, _UINT)
    return list(items)


_MAX_ROUTE: Final = HASH_RANGE_SIZE  # the most partitions a topic may have


def _brokers(value: object) -> list[str | None]:
    """A route's brokers: 1 to ``_MAX_ROUTE`` items, each a ``HOST:PORT`` str or None."""
    items = _array(value, "broker addresses")
    if not 0 < len(items) <= _MAX_ROUTE:
        raise _FieldError(f"must hold 1 to {_MAX_ROUTE} broker addresses (one per partition), got {len(items)}")
    for item in items:
        if not (item is None or type(item) is str):
            raise _bad_item(items, item, "a str (HOST:PORT, or empty for this broker) or nil")
    return list(items)


def _bools(value: object) -> list[bool]:
    """``value`` as a list, if it is an array of bools."""
    items = _array(value, "bool")
    for item in items:
        if type(item) is not bool:
            raise _bad_item(items, item, "a bool")
    return list(items)


_PRODUCED: Final = f"an array [seq: {_UINT} or nil, key: str, bin or nil, payload: bin]"


def _produced(value: object) -> list[tuple[int | None, Key, bytes]]:
    """A produce's messages: ``[seq, key, payload]`` arrays, each checked in one pass."""
    items = _array(value, "messages")
    try:
        for item in items:
            seq, key, payload = item
            if not (
                (seq is None or (type(seq) is int and 0 <= seq <= _INT64_MAX))
                and type(key) in _KEY_TYPES
                and type(payload) is bytes
            ):
                break
        else:
            return list(items)
    except (TypeError, ValueError):  # the item is not an array of 3
        pass
    raise _bad_item(items, item, _PRODUCED)


def _check_properties(items: tuple[Any, ...], item: object, data: bytes) -> None:
    """``data``, the properties of ``item`` of ``items``, checked: a :class:`_FieldError` naming the item."""
    try:
        check_encoded(data)
    except PropertiesError as exc:
        index = next(i for i, each in enumerate(items) if each is item)
        raise _FieldError(f"item {index}: {exc}") from None


def _opt_properties(value: object) -> list[bytes | None] | None:
    """A produce's ``properties``: nil, or one bin (encoded properties, checked) or nil per message."""
    if value is None:
        return None
    items = _array(value, "encoded properties or nil")
    for item in items:
        if item is not None:
            if type(item) is not bytes:
                raise _bad_item(items, item, "a bin (encoded properties) or nil")
            _check_properties(items, item, item)
    return list(items)


def _properties_match(values: dict[str, Any]) -> None:
    """A produce's ``properties``, when given, hold one item per message."""
    if values["properties"] is not None and len(values["properties"]) != len(values["messages"]):
        raise _FieldError(
            f"'properties' has {len(values['properties'])} items and 'messages' {len(values['messages'])}; "
            "expected one item (encoded properties or nil) per message, or nil"
        )


_DELIVERED: Final = (
    f"an array [position: {_UINT}, key: str, bin or nil, payload: bin, redelivery_count: {_UINT}, "
    f"publish_time: {_UINT} or nil, properties: bin or nil, producer: str or nil]"
)


def _delivered(value: object) -> list[Delivered]:
    """A ``messages`` frame's deliveries, each item checked in one pass and its properties after."""
    items = _array(value, "messages")
    with_properties = []
    try:
        for item in items:
            position, key, payload, count, at, properties, producer = item
            if not (
                type(position) is int
                and type(payload) is bytes
                and type(count) is int
                and type(key) in _KEY_TYPES
                and 0 <= position <= _INT64_MAX
                and 0 <= count <= _INT64_MAX
                and (at is None or (type(at) is int and 0 <= at <= _INT64_MAX))
                and (producer is None or type(producer) is str)
            ):
                break
            if properties is not None:
                if type(properties) is not bytes:
                    break
                with_properties.append(item)
        else:
            for item in with_properties:
                _check_properties(items, item, item[5])
            return list(items)
    except (TypeError, ValueError):  # the item is not an array of 7
        pass
    raise _bad_item(items, item, _DELIVERED)


def _older_delivered(items: int, version: int) -> Callable[[object], list[Delivered]]:
    """The check of a delivery array of protocol ``version``: ``items`` 6 (versions 7 and 8: no producer name), 5
    (version 6: no properties either) or 4 (version 5: no publish time either), giving deliveries of this version
    (None for what the older one lacks)."""
    missing = (None,) * (7 - items)

    def check(value: object) -> list[Delivered]:
        """``value`` if it is an array of deliveries of the older version, filled up to this version's."""
        found = _array(value, "messages")
        if any(type(item) is not tuple or len(item) != items for item in found):
            raise _FieldError(f"must be an array of {items}-item deliveries (protocol version {version})")
        return _delivered(tuple((*item, *missing) for item in found))

    return check


def _older_entries(value: object) -> list[Entry]:
    """The messages of a version 8 ``entries`` frame: 5-item entries without a producer name, filled up to this
    version's."""
    found = _array(value, "messages")
    if any(type(item) is not tuple or len(item) != 5 for item in found):
        raise _FieldError("must be an array of 5-item entries (protocol version 8)")
    return _entries(tuple((*item, None) for item in found))


_ENTRY: Final = (
    f"an array [position: an int in [1, 2^63 - 1], key: str, bin or nil, payload: bin, publish_time: {_UINT} or nil, "
    "properties: bin or nil, producer: str or nil]"
)


def _entries(value: object) -> list[Entry]:
    """An ``entries`` frame's messages: at most :data:`MAX_READ`, each item checked in one pass, in strictly
    ascending position order, and their properties after."""
    items = _array(value, "messages")
    if len(items) > MAX_READ:
        raise _FieldError(f"must hold at most {MAX_READ} messages, got {len(items)}")
    with_properties = []
    before = 0  # the previous item's position
    try:
        for item in items:
            position, key, payload, at, properties, producer = item
            if not (
                type(position) is int
                and type(payload) is bytes
                and type(key) in _KEY_TYPES
                and 0 < position <= _INT64_MAX
                and (at is None or (type(at) is int and 0 <= at <= _INT64_MAX))
                and (producer is None or type(producer) is str)
            ):
                break
            if position <= before:
                raise _FieldError(
                    f"item at position {position} follows position {before}; expected strictly ascending positions"
                )
            before = position
            if properties is not None:
                if type(properties) is not bytes:
                    break
                with_properties.append(item)
        else:
            for item in with_properties:
                _check_properties(items, item, item[4])
            return list(items)
    except (TypeError, ValueError):  # the item is not an array of 6
        pass
    raise _bad_item(items, item, _ENTRY)


def _through_covers(values: dict[str, Any]) -> None:
    """An ``entries`` frame's ``through`` is at or after the position of every message it holds."""
    messages = values["messages"]
    if messages and messages[-1][0] > values["through"]:
        raise _FieldError(
            f"'through' {values['through']} is before the last message's position {messages[-1][0]}; "
            "expected the last position examined, at or after every message returned"
        )


def _read_limit(value: object) -> int:
    """``value`` if it is an int from 0 to :data:`MAX_READ`."""
    if type(value) is int and 0 <= value <= MAX_READ:
        return value
    raise _wrong(f"an int in [0, {MAX_READ}]", value)


_SLOTS: Final = f"nil or an array [first, last] of hash slots in [0, {HASH_RANGE_SIZE - 1}] with first <= last"


def _opt_slots(value: object) -> tuple[int, int] | None:
    """A ``read``'s ``slots``: nil, or one inclusive ``[first, last]`` pair of hash slots."""
    if value is None:
        return None
    if (
        type(value) is tuple
        and len(value) == 2
        and type(value[0]) is int
        and type(value[1]) is int
        and 0 <= value[0] <= value[1] < HASH_RANGE_SIZE
    ):
        return (value[0], value[1])
    raise _wrong(_SLOTS, value)


def _same_length(values: dict[str, Any]) -> None:
    """A receipt holds one duplicate flag per position."""
    if len(values["positions"]) != len(values["duplicates"]):
        raise _FieldError(
            f"'duplicates' has {len(values['duplicates'])} items and 'positions' {len(values['positions'])}; "
            "expected one duplicate flag per position"
        )


_RANGE: Final = f"an array [start, end] of hash slots in [0, {HASH_RANGE_SIZE - 1}] with start <= end"
_MAX_RANGES: Final = HASH_RANGE_SIZE
"""The most pairs a ``ranges`` field may hold: one per slot, as many as non-overlapping ranges can be."""


def _slot_ranges(value: object) -> list[tuple[int, int]]:
    """Inclusive ``(start, end)`` slot pairs, each starting after the previous one ended."""
    items = _array(value, "[start, end] pairs")
    if len(items) > _MAX_RANGES:
        raise _FieldError(f"must hold at most {_MAX_RANGES} [start, end] pairs, got {len(items)}")
    after = -1  # the previous pair's end
    for index, item in enumerate(items):
        if not (
            type(item) is tuple
            and len(item) == 2
            and type(item[0]) is int
            and type(item[1]) is int
            and 0 <= item[0] <= item[1] < HASH_RANGE_SIZE
        ):
            raise _FieldError(f"item {index} must be {_RANGE}, got {_show(item)}")
        if item[0] <= after:
            raise _FieldError(
                f"item {index} [{item[0]}, {item[1]}] starts at or before the end {after} of item {index - 1}; "
                "expected sorted, non-overlapping ranges"
            )
        after = item[1]
    return list(items)


class _Spec(NamedTuple):
    """How to check and build one frame type from its decoded map."""

    cls: type[Frame]
    checks: tuple[tuple[str, Callable[[Any], Any]], ...]
    keys: frozenset[str]
    across: Callable[[dict[str, Any]], None] | None


def _spec(
    cls: type[Frame], across: Callable[[dict[str, Any]], None] | None = None, **checks: Callable[[Any], Any]
) -> _Spec:
    """The spec of ``cls``: one check per field, in field order, and ``across`` for checks over several fields."""
    assert tuple(checks) == _FIELDS[cls], cls  # one check per field, in field order
    return _Spec(cls, tuple(checks.items()), frozenset({"type", *checks}), across)


_CLIENT_SPECS: Final = {
    spec.cls.type: spec
    for spec in (
        _spec(Connect, version=_uint, token=_opt_text, client=_label),
        _spec(
            Produce,
            _properties_match,
            req=_uint,
            topic=_name,
            producer=_opt_label,
            messages=_produced,
            properties=_opt_properties,
        ),
        _spec(
            Subscribe,
            req=_uint,
            topic=_name,
            subscription=_name,
            consumer=_name,
            receiver_queue=_uint,
            secret=_opt_label,
            subscription_type=_opt_subscription_type,
            priority_level=_priority,
        ),
        _spec(Flow, topic=_name, subscription=_name, session=_uint, permits=_uint),
        *(
            _spec(cls, topic=_name, subscription=_name, session=_uint, positions=_uints, req=_opt_uint)
            for cls in (Ack, Nack, Extend)
        ),
        _spec(CloseConsumer, req=_uint, topic=_name, subscription=_name, session=_uint),
        _spec(Lookup, req=_uint, topic=_name),
        _spec(Read, req=_uint, topic=_name, after=_uint, limit=_read_limit, slots=_opt_slots),
        _spec(Ping, nonce=_int64),
        _spec(Close),
    )
}
_SERVER_SPECS: Final = {
    spec.cls.type: spec
    for spec in (
        _spec(Connected, version=_uint, server=_label, max_frame=_max_frame, session_timeout=_timeout),
        _spec(Receipt, _same_length, req=_uint, positions=_uints, duplicates=_bools),
        _spec(Subscribed, req=_uint, session=_uint, consumer=_name, ranges=_slot_ranges, secret=_label),
        _spec(Route, req=_uint, topic=_name, brokers=_brokers),
        _spec(Messages, session=_uint, messages=_delivered),
        _spec(Entries, _through_covers, req=_uint, through=_uint, last=_uint, messages=_entries),
        _spec(RangesChanged, session=_uint, epoch=_uint, ranges=_slot_ranges),
        _spec(ConsumerClosed, session=_uint, reason=_label, req=_opt_uint),
        _spec(Settled, req=_uint),
        _spec(Pong, nonce=_int64),
        _spec(Error, code=_label, message=_text, req=_opt_uint),
    )
}
_SPECS: Final = {"server": _CLIENT_SPECS, "client": _SERVER_SPECS, "any": _CLIENT_SPECS | _SERVER_SPECS}


def _without(spec: _Spec, name: str) -> _Spec:
    """``spec`` for an older version whose frame lacks the field ``name`` (it comes out as the field's default)."""
    return spec._replace(
        checks=tuple(check for check in spec.checks if check[0] != name), keys=spec.keys - {name}, across=None
    )


_INTRODUCED: Final = {"read": READ_VERSION, "entries": READ_VERSION}
"""The frame types newer than the oldest version spoken, and the version each came with: a connection of an
older version refuses them as unknown."""

_OLDER: Final = {
    version: {
        "subscribe": _without(_without(_CLIENT_SPECS["subscribe"], "subscription_type"), "priority_level"),
        "messages": _SERVER_SPECS["messages"]._replace(
            checks=(("session", _uint), ("messages", _older_delivered(min(version - 1, 6), version)))
        ),
        **(
            {
                "entries": _SERVER_SPECS["entries"]._replace(
                    checks=tuple(
                        (name, _older_entries if name == "messages" else check)
                        for name, check in _SERVER_SPECS["entries"].checks
                    )
                )
            }
            if version >= READ_VERSION
            else {"produce": _without(_CLIENT_SPECS["produce"], "properties")}
            if version < _PROPERTIES_VERSION
            else {}
        ),
    }
    for version in range(OLDEST_PROTOCOL_VERSION, SUBSCRIPTION_TYPES_VERSION)
}
"""The frames older versions still spoken send differently (before version 9: deliveries and entries without their
producer name, a subscribe without type and priority; version 6: no properties either; 5: no publish times
either)."""
_MAX_MAP_LEN: Final = 64
"""Far more fields than any frame has, so extras are reported as ``bad_field``; a bigger map is refused unbuilt."""


def _build(spec: _Spec, body: dict[Any, Any]) -> Frame:
    """The frame of ``spec`` from a decoded ``body``, every field checked; a ``bad_field`` error names what is wrong."""
    frame_type = spec.cls.type
    if body.keys() != spec.keys:
        missing = ", ".join(sorted(spec.keys - body.keys())) or "none"
        extra = ", ".join(sorted(map(repr, body.keys() - spec.keys))) or "none"
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"{frame_type} frame must have exactly the fields {sorted(spec.keys)}; missing: {missing}; extra: {extra}",
        )
    values: dict[str, Any] = {}
    try:
        for name, check in spec.checks:
            values[name] = check(body[name])
    except _FieldError as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{frame_type} frame: field {name!r} {exc}") from None
    if spec.across is not None:
        try:
            spec.across(values)
        except _FieldError as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{frame_type} frame: {exc}") from None
    return spec.cls(**values)


# -- decoding -------------------------------------------------------------------------------


class Decoder:
    """Bytes in, validated frames out; incremental, so any split of the stream gives the same frames.

    ``accept`` is the side this decoder serves: ``"server"`` accepts only the frames a client
    sends, ``"client"`` only the frames a server sends. ``version`` is the protocol version of the
    connection, whose frames it expects (a server sets it to the version ``connect`` named; an
    older version's frames lack what it lacks, which decodes as None). Every error it raises is a fatal
    :class:`ProtocolError`; after one, the decoder is dead and :meth:`feed` raises it again.
    It never holds more than ``4 + max_frame`` bytes between calls: a length prefix above
    ``max_frame`` is rejected as soon as its 4 bytes arrive, before the body. Decoding one
    body briefly takes up to ~32 times its size in Python objects (an array of 1-item
    arrays); maps, which would cost ~80 times, are refused at the second one.
    """

    __slots__ = ("_accept", "_buffer", "_error", "_maps", "_max_frame", "_specs", "_version")

    def __init__(
        self,
        max_frame: int = DEFAULT_MAX_FRAME,
        *,
        accept: Literal["client", "server", "any"] = "any",
        version: int = PROTOCOL_VERSION,
    ) -> None:
        self.max_frame = max_frame  # checked by the setter
        if accept not in _SPECS:
            raise KeyFailoverError(f"accept must be one of {sorted(_SPECS)}, not {accept!r}")
        self._accept = accept
        self.version = version  # sets the frame specs of this side and version
        self._buffer = bytearray()
        self._error: ProtocolError | None = None
        self._maps = 0

    @property
    def version(self) -> int:
        """The protocol version whose frames this decoder expects."""
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        if type(value) is not int or not OLDEST_PROTOCOL_VERSION <= value <= PROTOCOL_VERSION:
            raise KeyFailoverError(
                f"version must be an int from {OLDEST_PROTOCOL_VERSION} to {PROTOCOL_VERSION}, not {value!r}"
            )
        specs = {name: spec for name, spec in _SPECS[self._accept].items() if _INTRODUCED.get(name, 0) <= value}
        self._specs = {**specs, **{name: spec for name, spec in _OLDER.get(value, {}).items() if name in specs}}
        self._version = value

    @property
    def max_frame(self) -> int:
        """The largest body length this decoder accepts (a server raises it after login)."""
        return self._max_frame

    @max_frame.setter
    def max_frame(self, value: int) -> None:
        if type(value) is not int or not 0 < value <= _MAX_LENGTH:
            raise KeyFailoverError(f"max_frame must be an int in [1, {_MAX_LENGTH}], not {value!r}")
        self._max_frame = value

    @property
    def buffered(self) -> int:
        """Bytes received but not yet decoded (part of one frame: at most ``4 + max_frame``)."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Take the next bytes of the stream; return the frames they complete, in order.

        Raises a fatal :class:`ProtocolError` at the first bad frame; frames decoded earlier
        in the same call are dropped with it. A server, which must act on the frames that came
        before the bad one, uses :meth:`feed_partial`.
        """
        frames, error = self.feed_partial(data)
        if error is not None:
            raise error.with_traceback(None)
        return frames

    def feed_partial(self, data: bytes | bytearray | memoryview) -> tuple[list[Frame], ProtocolError | None]:
        """Like :meth:`feed`, but return the frames before the first bad one with its error.

        The error is None when every complete frame was good. After an error the decoder is
        dead: every later call returns no frames and the same error.
        """
        frames: list[Frame] = []
        if self._error is not None:
            return frames, self._error
        try:
            self._feed(data, frames)
        except ProtocolError as exc:
            self._error = exc
            self._buffer = bytearray()
        return frames, self._error

    def _feed(self, data: bytes | bytearray | memoryview, frames: list[Frame]) -> None:
        """Append to ``frames`` the frames ``data`` completes; keep the bytes of an incomplete one."""
        if self._buffer:
            self._buffer += data
            data = self._buffer
        offset = 0
        size = len(data)
        with memoryview(data) as view:
            while size - offset >= 4:
                (length,) = _HEADER.unpack_from(view, offset)
                if length > self._max_frame:
                    raise ProtocolError(
                        ErrorCode.FRAME_TOO_LARGE,
                        f"frame body of {length} bytes is over the limit of {self._max_frame} bytes",
                    )
                end = offset + 4 + length
                if end > size:
                    break
                frames.append(self._decode(view[offset + 4 : end]))
                offset = end
        if data is self._buffer:
            del self._buffer[:offset]
        elif offset < size:
            self._buffer += data[offset:]

    def _decode(self, body: memoryview) -> Frame:
        """The frame of one frame ``body``; a fatal ProtocolError when it is not a valid frame of this side."""
        self._maps = 0
        try:
            value = msgpack.unpackb(
                body,
                raw=False,
                use_list=False,
                strict_map_key=True,
                object_hook=self._one_map,
                max_map_len=_MAX_MAP_LEN,
                max_ext_len=0,
            )
        except ProtocolError:
            raise
        except (ValueError, msgpack.UnpackException) as exc:
            raise ProtocolError(ErrorCode.MALFORMED_FRAME, f"frame body is not one msgpack value: {exc}") from None
        if type(value) is not dict:
            raise ProtocolError(ErrorCode.MALFORMED_FRAME, f"frame body must be a msgpack map, got {_show(value)}")
        frame_type = value.get("type")
        if type(frame_type) is not str:
            raise ProtocolError(ErrorCode.MALFORMED_FRAME, f"frame map must have a str 'type', got {_show(frame_type)}")
        spec = self._specs.get(frame_type)
        if spec is None:
            raise ProtocolError(ErrorCode.UNKNOWN_TYPE, self._unknown(frame_type))
        return _build(spec, value)

    def _one_map(self, mapping: dict[str, Any]) -> dict[str, Any]:
        """Count a map msgpack built: a valid frame holds exactly one, so decoding stops at the second.

        msgpack calls this for every map it builds, innermost first; an array of empty maps
        would otherwise cost ~80 bytes of memory per byte received.
        """
        self._maps += 1
        if self._maps > 1:
            raise ProtocolError(ErrorCode.MALFORMED_FRAME, "a frame holds one map, its body: nested maps are invalid")
        return mapping

    def _unknown(self, frame_type: str) -> str:
        """Why ``frame_type`` is refused: a frame of a newer version, of the other side, or no frame at all."""
        introduced = _INTRODUCED.get(frame_type, 0)
        if introduced > self._version and frame_type in _SPECS[self._accept]:
            return (
                f"frame type {frame_type!r} came with protocol version {introduced}; this connection speaks "
                f"version {self._version}"
            )
        if frame_type in _CLIENT_SPECS:
            return f"frame type {frame_type!r} is sent by clients, not accepted from a server"
        if frame_type in _SERVER_SPECS:
            return f"frame type {frame_type!r} is sent by servers, not accepted from a client"
        return f"unknown frame type {_show(frame_type)}; expected one of {sorted(self._specs)}"
