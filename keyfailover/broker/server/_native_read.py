"""Reads by position over the native protocol: a ``read`` answered from the store with one ``entries`` frame.

A read examines the stored messages above ``after`` in position order, keeps those its slot filter
takes, and stops at the first of: ``limit`` messages kept, :data:`MAX_SCAN` messages examined, the
next kept message not fitting the frame, the end of the log. ``through`` is the last position it
examined, so the reader goes on after it whatever the filter kept. The store reads in chunks of at
most :data:`_CHUNK` messages, awaited off the event loop, and never above the last position this
broker knows committed (:meth:`Store.read`).
"""

from __future__ import annotations

from typing import Final

from keyfailover.broker.server._connection import ConnectionHost
from keyfailover.broker.storage.records import StoredMessage
from keyfailover.core.hashing import key_hash
from keyfailover.wire.protocol import DEFAULT_MAX_FRAME, MAX_READ, Entries, Entry, ErrorCode, ProtocolError, Read

__all__ = ["MAX_SCAN", "read_entries"]

MAX_SCAN: Final = MAX_READ
"""The most stored messages one read examines: a narrow slot filter ends its read here, ``through`` saying where."""

_CHUNK: Final = 1000
"""The most messages asked of the store at once (the memory a read holds beyond its answer)."""

_FRAME_OVERHEAD: Final = 96
"""An upper bound on the bytes of an ``entries`` frame besides its messages: the map and its five fields."""

_ENTRY_OVERHEAD: Final = 40
"""An upper bound on the bytes of one message besides its key, payload, properties and producer name: the array
header, the position, the publish time and the headers of the key, payload, properties and producer name."""


def _entry_size(message: StoredMessage) -> int:
    """An upper bound on the encoded size of ``message`` as an item of ``entries``."""
    key, properties, producer = message.key, message.properties, message.producer
    key_size = 0 if key is None else len(key.encode()) if isinstance(key, str) else len(key)
    return (
        _ENTRY_OVERHEAD
        + key_size
        + len(message.payload)
        + (0 if properties is None else len(properties))
        + (0 if producer is None else len(producer.encode()))
    )


def _kept(message: StoredMessage, slots: tuple[int, int] | None) -> bool:
    """Whether the slot filter ``slots`` (None: no filter) takes ``message``: its key hashes into them."""
    if slots is None:
        return True
    return message.key is not None and slots[0] <= key_hash(message.key) <= slots[1]


async def read_entries(server: ConnectionHost, frame: Read, max_frame: int) -> Entries:
    """The ``entries`` answering ``frame``, in a frame of at most ``max_frame`` bytes (and 5 MiB, the most a server
    sends); a :class:`ProtocolError` refusing it: the server is closing (``shutting_down``), the topic is a
    partitioned topic itself (``wrong_partition``), not served here (``not_owner``), or a message to return is
    larger than the frame (``invalid_message``). A topic with no messages is an empty log: ``last`` 0.
    The store out of reach raises :class:`StoreUnavailableError`."""
    if server.closing:
        raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the server is shutting down; nothing was read")
    server.check_served(frame.topic, "read")
    store = server.storage
    budget = min(max_frame, DEFAULT_MAX_FRAME) - _FRAME_OVERHEAD
    found: list[Entry] = []
    through = frame.after
    examined = 0
    full = False
    while not full and len(found) < frame.limit and examined < MAX_SCAN:
        last = store.last_position(frame.topic)
        if through >= last:
            break
        count = min(_CHUNK, MAX_SCAN - examined)
        if frame.slots is None:
            count = min(count, frame.limit - len(found))
        chunk = await store.read(frame.topic, through, count)
        server.check_served(frame.topic, "read")  # the partition may have moved while the store read
        if not chunk:  # nothing stored in (through, last]: the store reads up to the last position it knows
            through = last
            break
        for message in chunk:
            if len(found) == frame.limit:
                full = True
                break
            if _kept(message, frame.slots):
                size = _entry_size(message)
                if size > budget:
                    if not found:
                        raise ProtocolError(
                            ErrorCode.INVALID_MESSAGE,
                            f"the message at position {message.position} of {frame.topic!r} takes up to {size} "
                            f"bytes, over the {budget} a frame of this connection holds for it; it cannot be read "
                            "over this connection (a server with a larger --max-frame can send it)",
                        )
                    full = True
                    break
                budget -= size
                found.append(
                    (
                        message.position,
                        message.key,
                        message.payload,
                        message.publish_time,
                        message.properties,
                        message.producer,
                    )
                )
            through = message.position
            examined += 1
    last = store.last_position(frame.topic)
    return Entries(req=frame.req, through=through, last=max(last, through) if examined else last, messages=found)
