"""The frames of the wire protocol: one frozen dataclass per frame type, and the message key.

Each frame's ``type`` names it on the wire and its fields are the fields of its msgpack map, in
order; :mod:`keyfailover.wire.protocol` encodes and decodes them and re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypeAlias

from keyfailover.core.subtypes import SubscriptionType

Key: TypeAlias = str | bytes | None
"""A message key: str and bytes stay distinct on the wire (both hash by their UTF-8 bytes)."""


# -- frames: client -> server ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Connect:
    """The first frame of every connection: protocol version, optional token, client name."""

    type: ClassVar[str] = "connect"
    version: int
    token: str | None
    client: str


@dataclass(frozen=True, slots=True)
class Produce:
    """Store messages ``(seq, key, payload)`` in ``topic``; ``(producer, seq)`` makes retries idempotent.

    ``properties``: each message's encoded properties (None for one without), or None when no
    message of the batch has any.
    """

    type: ClassVar[str] = "produce"
    req: int
    topic: str
    producer: str | None
    messages: list[tuple[int | None, Key, bytes]]
    properties: list[bytes | None] | None = None


@dataclass(frozen=True, slots=True)
class Subscribe:
    """Attach consumer ``consumer`` to ``subscription`` of ``topic`` with ``receiver_queue`` permits.

    ``secret`` is what the consumer's last ``subscribed`` returned (nil the first time): only
    with it may a subscribe take over a consumer name that still has a live session.
    ``subscription_type`` (version 9): the type the consumer asks for, nil to join as the
    subscription is; ``priority_level`` (version 9): its priority in a failover subscription,
    the lower the first.
    """

    type: ClassVar[str] = "subscribe"
    req: int
    topic: str
    subscription: str
    consumer: str
    receiver_queue: int
    secret: str | None = None
    subscription_type: SubscriptionType | None = None
    priority_level: int = 0


@dataclass(frozen=True, slots=True)
class Flow:
    """Grant ``permits`` more messages to a consumer session."""

    type: ClassVar[str] = "flow"
    topic: str
    subscription: str
    session: int
    permits: int


@dataclass(frozen=True, slots=True)
class _Settle:
    """The fields of ``ack``, ``nack`` and ``extend``: each is a subclass, so two types never compare equal."""

    topic: str
    subscription: str
    session: int
    positions: list[int]
    req: int | None = None


@dataclass(frozen=True, slots=True)
class Ack(_Settle):
    """Acknowledge delivered positions of a consumer session; with ``req``, answered (``settled`` or ``error``)."""

    type: ClassVar[str] = "ack"


@dataclass(frozen=True, slots=True)
class Nack(_Settle):
    """Give delivered positions back: each key restarts from its oldest nacked position."""

    type: ClassVar[str] = "nack"


@dataclass(frozen=True, slots=True)
class Extend(_Settle):
    """Renew the leases (ack deadlines) of delivered positions a consumer is still working on."""

    type: ClassVar[str] = "extend"


@dataclass(frozen=True, slots=True)
class CloseConsumer:
    """Detach a consumer session; its unacked messages go to the new owners of its keys."""

    type: ClassVar[str] = "close_consumer"
    req: int
    topic: str
    subscription: str
    session: int


@dataclass(frozen=True, slots=True)
class Lookup:
    """Ask how many partitions ``topic`` has and which broker serves each (answered by ``route``)."""

    type: ClassVar[str] = "lookup"
    req: int
    topic: str


@dataclass(frozen=True, slots=True)
class Read:
    """Read the stored messages of ``topic`` above position ``after`` (answered by ``entries``; version 8).

    At most ``limit`` messages, 0 asking only where the log ends; with ``slots``, an inclusive
    ``(first, last)`` pair of hash slots, only the messages whose key hashes into it (keyless ones left out).
    """

    type: ClassVar[str] = "read"
    req: int
    topic: str
    after: int
    limit: int
    slots: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Ping:
    """Heartbeat; the server answers ``pong`` with the same nonce."""

    type: ClassVar[str] = "ping"
    nonce: int


@dataclass(frozen=True, slots=True)
class Close:
    """The client says goodbye; the server closes the connection."""

    type: ClassVar[str] = "close"


# -- frames: server -> client ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Connected:
    """The answer to ``connect``: the server's limits for this connection."""

    type: ClassVar[str] = "connected"
    version: int
    server: str
    max_frame: int
    session_timeout: float


@dataclass(frozen=True, slots=True)
class Receipt:
    """The answer to ``produce``: a position per message, and whether it was already stored."""

    type: ClassVar[str] = "receipt"
    req: int
    positions: list[int]
    duplicates: list[bool]


@dataclass(frozen=True, slots=True)
class Subscribed:
    """The answer to ``subscribe``: the new session, its hash ranges (none for a standby) and its secret.

    ``ranges`` holds inclusive ``(start, end)`` slot pairs, sorted and non-overlapping.
    """

    type: ClassVar[str] = "subscribed"
    req: int
    session: int
    consumer: str
    ranges: list[tuple[int, int]]
    secret: str


@dataclass(frozen=True, slots=True)
class Route:
    """The answer to ``lookup``: one broker address (``HOST:PORT``) per partition of ``topic``.

    ``""`` is the broker that answered; nil, a partition no broker serves right now (a
    failover is under way: look up again). Partition p of a topic with P > 1 partitions is
    produced to and subscribed to as the topic ``<topic>-partition-<p>``.
    """

    type: ClassVar[str] = "route"
    req: int
    topic: str
    brokers: list[str | None]


Delivered: TypeAlias = tuple[int, Key, bytes, int, int | None, bytes | None, str | None]
"""``(position, key, payload, redelivery_count, publish_time, properties, producer)``: one delivery. ``publish_time``
is the broker's wall clock when the message was stored, in microseconds since the Unix epoch; None when
unknown (stored before logs had publish times). ``properties`` are the message's encoded properties, None
when it has none. ``producer`` is the name of the producer that stored it, None for an unnamed producer or a
message stored without a name (a dead letter, a replay)."""


@dataclass(frozen=True, slots=True)
class Messages:
    """Deliveries to a session: ``(position, key, payload, redelivery_count, publish_time, properties, producer)``
    each."""

    type: ClassVar[str] = "messages"
    session: int
    messages: list[Delivered]


Entry: TypeAlias = tuple[int, Key, bytes, int | None, bytes | None, str | None]
"""``(position, key, payload, publish_time, properties, producer)``: one stored message read by position, as a
delivery holds it without a redelivery count."""


@dataclass(frozen=True, slots=True)
class Entries:
    """The answer to ``read``: the messages found, in position order; ``through`` is the last position the
    read examined (the next read goes on after it, even when the slot filter kept nothing) and ``last`` the
    last position the log holds now, its end."""

    type: ClassVar[str] = "entries"
    req: int
    through: int
    last: int
    messages: list[Entry]


@dataclass(frozen=True, slots=True)
class RangesChanged:
    """A session's hash ranges changed (rebalance): all of them now; ``epoch`` is the range map's new epoch."""

    type: ClassVar[str] = "ranges_changed"
    session: int
    epoch: int
    ranges: list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class ConsumerClosed:
    """A session ended: "closed", "timeout", "superseded", "shutdown" (others may come)."""

    type: ClassVar[str] = "consumer_closed"
    session: int
    reason: str
    req: int | None


@dataclass(frozen=True, slots=True)
class Settled:
    """The answer to an ``ack``, ``nack`` or ``extend`` that carried a ``req``: every position was accepted."""

    type: ClassVar[str] = "settled"
    req: int


@dataclass(frozen=True, slots=True)
class Pong:
    """The answer to ``ping``."""

    type: ClassVar[str] = "pong"
    nonce: int


@dataclass(frozen=True, slots=True)
class Error:
    """A request failed (``req`` set) or the connection is being closed (``code`` is fatal)."""

    type: ClassVar[str] = "error"
    code: str
    message: str
    req: int | None


ClientFrame: TypeAlias = (
    Connect | Produce | Subscribe | Flow | Ack | Nack | Extend | CloseConsumer | Lookup | Read | Ping | Close
)
"""Frames a client sends."""

ServerFrame: TypeAlias = (
    Connected
    | Receipt
    | Subscribed
    | Route
    | Messages
    | Entries
    | RangesChanged
    | ConsumerClosed
    | Settled
    | Pong
    | Error
)
"""Frames a server sends."""

Frame: TypeAlias = ClientFrame | ServerFrame
