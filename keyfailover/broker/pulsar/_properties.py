"""A Pulsar message's properties and event time, kept as keyfailover's message properties.

Pulsar's MessageMetadata (and a batched message's SingleMessageMetadata) carries ``properties``,
a list of str key/value pairs, and ``event_time``, milliseconds since the Unix epoch that the
application set (0: none). keyfailover stores the properties as its own (a later pair of a key
wins, as Pulsar's clients build their map) and the event time as one more property,
:data:`EVENT_TIME_PROPERTY`, holding its decimal digits: one column in both logs, and a native
consumer reads the event time of a message a Pulsar producer sent. A MESSAGE gives it back as
``event_time``, and the rest as ``properties``; a value of the reserved key that is not an event
time (a native producer may set anything) is left as a property. A message's ``deliver_at_time``
is kept the same way, as :data:`~keyfailover.wire.properties.DELIVER_AT_PROPERTY`, which the
subscriptions read (a MESSAGE leaves it out: its time has come when it goes out).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from keyfailover.wire.properties import (
    DELIVER_AT_PROPERTY,
    decode_properties,
    encode_properties,
    parse_delivery_time,
)

__all__ = ["EVENT_TIME_PROPERTY", "from_pulsar", "to_pulsar"]

EVENT_TIME_PROPERTY: Final = "keyfailover.event_time"
"""The property a Pulsar message's event time is kept in: its milliseconds since the Unix epoch, in decimal."""

_MAX_EVENT_TIME: Final = 2**64 - 1  # event_time is a uint64: at most 20 digits


def from_pulsar(properties: Iterable[tuple[str, str]], event_time: int, deliver_at: int = 0) -> bytes | None:
    """The encoded properties to store for a Pulsar message's ``properties`` pairs, ``event_time`` and
    ``deliver_at`` (its ``deliver_at_time``; 0: none, as a time at or before the epoch is); None when it has
    none of them. Each time replaces a property of its reserved name. Raises
    :class:`~keyfailover.core.errors.PropertiesError` beyond the limits of :mod:`keyfailover.wire.properties`."""
    kept = dict(properties)
    if event_time:
        kept[EVENT_TIME_PROPERTY] = str(event_time)
    if deliver_at > 0:
        kept[DELIVER_AT_PROPERTY] = str(deliver_at)
    return encode_properties(kept)


def to_pulsar(data: bytes | None) -> tuple[dict[str, str], int]:
    """A stored message's properties as a MESSAGE carries them: the properties without the event time and the
    delivery time, and the event time (0: none)."""
    properties = decode_properties(data)
    if parse_delivery_time(properties.get(DELIVER_AT_PROPERTY)):
        del properties[DELIVER_AT_PROPERTY]
    text = properties.get(EVENT_TIME_PROPERTY)
    if (
        text is None
        or not (len(text) <= 20 and text.isascii() and text.isdigit())
        or not 0 < int(text) <= _MAX_EVENT_TIME
    ):
        return properties, 0
    del properties[EVENT_TIME_PROPERTY]
    return properties, int(text)
