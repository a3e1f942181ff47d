"""The checks of the embedded log's arguments: each returns the value it checked, or raises
:class:`~keyfailover.core.errors.LogError` (:class:`InvalidKeyError`, :class:`PropertiesError` for a key
or properties) naming what is wrong and what was expected."""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Sequence
from typing import TypeVar

from keyfailover.broker.cursor import Cursor
from keyfailover.broker.storage.records import DeadLetterEntry, Key, Message
from keyfailover.core.errors import InvalidKeyError, LogError, PropertiesError
from keyfailover.wire.properties import check_encoded

__all__ = [
    "check_count",
    "check_cursor_row",
    "check_iterable",
    "check_key",
    "check_letter",
    "check_message",
    "check_name",
    "check_payload",
    "check_position",
    "check_properties",
    "check_publish_time",
    "check_subscription",
]

_T = TypeVar("_T")


def check_properties(properties: Sequence[bytes | None], count: int) -> Sequence[bytes | None]:
    """``properties``, one encoding or None per message of a batch of ``count``, each checked."""
    if not isinstance(properties, Sequence) or len(properties) != count:
        shown = len(properties) if isinstance(properties, Sequence) else type(properties).__name__
        raise PropertiesError(
            f"a batch of {count} messages has properties for {shown}; expected one encoding or None per message"
        )
    for index, data in enumerate(properties):
        if data is not None:
            try:
                check_encoded(data)
            except PropertiesError as exc:
                raise PropertiesError(f"message {index}: {exc}") from None
    return properties


def check_message(message: Message, index: int) -> Message:
    """Message ``index`` of a batch as ``(seq, key, payload)``; its items are checked where it is stored."""
    try:
        seq, key, payload = message
    except (TypeError, ValueError):
        raise LogError(f"message {index} must be a (seq, key, payload) tuple, not {reprlib.repr(message)}") from None
    return seq, key, payload


def check_payload(payload: object, index: int) -> bytes:
    """The payload of message ``index`` as bytes: bytes, a bytearray or a memoryview."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    raise LogError(f"the payload of message {index} must be bytes, not {type(payload).__name__}")


def check_key(key: object) -> Key:
    """A message key: a str that encodes to UTF-8, or bytes; :class:`InvalidKeyError` for anything else."""
    if isinstance(key, str):
        try:
            key.encode()
        except UnicodeEncodeError as exc:
            raise InvalidKeyError(
                f"key {reprlib.repr(key)} is not valid Unicode ({exc.reason} at index {exc.start}); "
                "expected a str that encodes to UTF-8"
            ) from None
        return str(key)
    if isinstance(key, bytes):
        return bytes(key)
    raise InvalidKeyError(f"a message key must be str, bytes or None, not {type(key).__name__}")


def check_subscription(topic: object, subscription: object) -> tuple[str, str]:
    """``(topic, subscription)``, each checked as :func:`check_name` does."""
    return check_name(topic, "topic"), check_name(subscription, "subscription")


def check_name(value: object, what: str) -> str:
    """A name, of a topic, subscription, producer or reason: a non-empty str that encodes to UTF-8."""
    if not isinstance(value, str) or not value:
        raise LogError(f"{what} must be a non-empty str, not {reprlib.repr(value)}")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise LogError(
            f"{what} {reprlib.repr(value)} is not valid Unicode; expected a str that encodes to UTF-8"
        ) from None
    return str(value)


def check_count(value: object, what: str) -> int:
    """A count, a limit or a position to read after: an int of at least 0."""
    if type(value) is not int or value < 0:
        raise LogError(f"{what} must be a non-negative int, not {reprlib.repr(value)}")
    return value


def check_position(value: object) -> int:
    """A position: an int. One outside a topic finds nothing."""
    if type(value) is not int:
        raise LogError(f"a position must be an int, not {reprlib.repr(value)}")
    return value


def check_iterable(value: Iterable[_T], what: str) -> Iterable[_T]:
    """``value``, refused unless it is iterable."""
    if not isinstance(value, Iterable):
        raise LogError(f"{what} must be iterable, not {type(value).__name__}")
    return value


def check_publish_time(value: object) -> int:
    """A publish time: an int of microseconds since the Unix epoch, at least 0."""
    if type(value) is not int or value < 0:
        raise LogError(f"a publish time must be an int of microseconds since the Unix epoch, not {value!r}")
    return value


def check_letter(value: object, index: int) -> DeadLetterEntry:
    """Dead letter ``index`` as a :data:`~keyfailover.broker.storage.records.DeadLetterEntry`, each item checked."""
    if not isinstance(value, tuple) or len(value) != 7:
        raise LogError(
            f"dead letter {index} must be a (position, key, payload, redelivery_count, reason, publish_time, "
            f"properties) tuple, not {reprlib.repr(value)}"
        )
    position, key, payload, count, reason, publish_time, properties = value
    if key is not None and type(key) is not str and type(key) is not bytes:
        key = check_key(key)
    return (
        check_position(position),
        key,
        check_payload(payload, index),
        check_count(count, "redelivery_count"),
        check_name(reason, "reason"),
        None if publish_time is None else check_publish_time(publish_time),
        None if properties is None else check_encoded(properties),
    )


def check_cursor_row(entry: tuple[str, str, Cursor]) -> tuple[str, str, bytes]:
    """The row a ``(topic, subscription, cursor)`` triple is saved as: the names checked, the cursor encoded."""
    try:
        topic, subscription, cursor = entry
    except (TypeError, ValueError):
        raise LogError(
            f"a cursor entry must be a (topic, subscription, Cursor) tuple, not {reprlib.repr(entry)}"
        ) from None
    if not isinstance(cursor, Cursor):
        raise LogError(
            f"the cursor of {reprlib.repr(subscription)} on topic {reprlib.repr(topic)} must be a Cursor, "
            f"not {type(cursor).__name__}"
        )
    return *check_subscription(topic, subscription), cursor.to_bytes()
