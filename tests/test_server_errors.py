"""Bad input over a raw socket: the server's error frames (docs/protocol.md, "Errors").

Fatal codes close that connection only: every other connection goes on and nothing stored
changes. Non-fatal codes reject one frame and the connection keeps working.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.request import urlopen

import msgpack  # type: ignore[import-untyped]
import pytest

from keyfailover.broker.server import ServerConfig
from keyfailover.client import Client, Consumer, Message
from keyfailover.core.errors import FATAL_CODES, ErrorCode
from keyfailover.wire.protocol import (
    PROTOCOL_VERSION,
    Ack,
    CloseConsumer,
    Connect,
    ConsumerClosed,
    Error,
    Flow,
    Frame,
    Messages,
    Nack,
    Ping,
    Pong,
    Produce,
    RangesChanged,
    Receipt,
    Subscribe,
    Subscribed,
    encode,
)
from tests.server_process import RawConnection, ServerThread, wait_until

TOKEN = "s3cret"
MAX_FRAME = 4096

F = TypeVar("F", bound=Frame)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    data: Path = tmp_path_factory.mktemp("errors") / "data"
    with ServerThread(ServerConfig(data_dir=data, max_frame=MAX_FRAME, token=TOKEN)) as server:
        yield server
        assert "Traceback" not in server.errors(), server.errors()


def framed(body: bytes) -> bytes:
    """``body`` behind its 4-byte length prefix."""
    return struct.pack(">I", len(body)) + body


def packed(value: object) -> bytes:
    """A frame whose body is ``value`` packed as msgpack, whatever it is."""
    return framed(msgpack.packb(value, use_bin_type=True))


def reply(raw: RawConnection, kind: type[F]) -> F:
    """The next frame other than ``messages`` and ``ranges_changed`` (pushed at any time); it must be a ``kind``."""
    while True:
        frame = raw.receive()
        if not isinstance(frame, Messages | RangesChanged):
            assert isinstance(frame, kind), f"expected a {kind.type} frame, got {frame!r}"
            return frame


def check_error(frame: Frame, code: ErrorCode, message: str, req: int | None = None) -> None:
    """``frame`` is an error of ``code`` answering ``req``, its message matching the regex ``message``."""
    assert isinstance(frame, Error), f"expected an error frame, got {frame!r}"
    assert (frame.code, frame.req) == (code, req), frame
    assert re.search(message, frame.message), f"{frame.message!r} does not say {message!r}"


def deliveries(raw: RawConnection, count: int) -> list[int]:
    """Positions of the next ``count`` deliveries to the connection's sessions."""
    positions: list[int] = []
    while len(positions) < count:
        frame = raw.receive()
        assert isinstance(frame, Messages | RangesChanged), f"expected deliveries, got {frame!r}"
        if isinstance(frame, Messages):
            positions += [position for position, *_ in frame.messages]
    assert len(positions) == count, f"more than the {count} permits delivered: {positions}"
    return positions


def produce(raw: RawConnection, req: int, topic: str, payloads: list[bytes]) -> list[int]:
    """Store keyed messages through ``raw``; their positions."""
    raw.send(
        Produce(req=req, topic=topic, producer=None, messages=[(None, f"k{i}", p) for i, p in enumerate(payloads)])
    )
    receipt = reply(raw, Receipt)
    assert receipt.req == req and receipt.duplicates == [False] * len(payloads), receipt
    return receipt.positions


def assert_works(raw: RawConnection, topic: str) -> None:
    """The connection still answers a ping and stores a produce."""
    raw.send(Ping(nonce=-7))
    assert reply(raw, Pong) == Pong(nonce=-7)
    assert len(produce(raw, 900, topic, [b"still working"])) == 1


def consume(consumer: Consumer, positions: set[int]) -> dict[int, Message]:
    """Receive (and acknowledge) until every one of ``positions`` came; the first delivery of each."""
    received: dict[int, Message] = {}
    while not positions <= received.keys():
        message = consumer.receive(timeout=10.0)
        received.setdefault(message.position, message)
        consumer.acknowledge(message)
    assert received.keys() == positions, f"unexpected positions {sorted(received.keys() - positions)}"
    return received


def assert_no_tracebacks(server: ServerThread) -> None:
    assert "Traceback" not in server.errors(), server.errors()


# -- fatal ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fatal:
    """One protocol violation: the bytes, the error the server must answer, when it is sent."""

    bad: bytes
    code: ErrorCode
    message: str  # a regex the error's message matches: it says what was wrong
    after_connect: bool = True  # else the bad bytes are the connection's first frame


PING = msgpack.packb({"type": "ping", "nonce": 1}, use_bin_type=True)
SUBSCRIBE = {
    "type": "subscribe",
    "req": 5,
    "topic": "t",
    "subscription": "s",
    "consumer": "c",
    "receiver_queue": 1,
    "secret": None,
    "subscription_type": None,
    "priority_level": 0,
}

FATAL = {
    "malformed_frame/truncated": Fatal(framed(PING[:-1]), ErrorCode.MALFORMED_FRAME, r"not one msgpack value"),
    "malformed_frame/trailing": Fatal(framed(PING + b"\x00"), ErrorCode.MALFORMED_FRAME, r"extra data"),
    "malformed_frame/empty": Fatal(framed(b""), ErrorCode.MALFORMED_FRAME, r"not one msgpack value"),
    "malformed_frame/not_a_map": Fatal(packed([1, 2]), ErrorCode.MALFORMED_FRAME, r"must be a msgpack map"),
    "malformed_frame/nested_map": Fatal(
        packed({"type": "ping", "nonce": {}}), ErrorCode.MALFORMED_FRAME, r"nested maps"
    ),
    "malformed_frame/no_type": Fatal(packed({"nonce": 1}), ErrorCode.MALFORMED_FRAME, r"str 'type'"),
    "malformed_frame/bad_utf8": Fatal(framed(b"\x81\xa4type\xa2\xff\xfe"), ErrorCode.MALFORMED_FRAME, r"utf-8"),
    "unknown_type/made_up": Fatal(packed({"type": "launch"}), ErrorCode.UNKNOWN_TYPE, r"unknown frame type 'launch'"),
    "unknown_type/server_frame": Fatal(encode(Pong(nonce=1)), ErrorCode.UNKNOWN_TYPE, r"'pong' is sent by servers"),
    "unknown_type/ranges_changed": Fatal(
        encode(RangesChanged(session=1, epoch=1, ranges=[(0, 65535)])),
        ErrorCode.UNKNOWN_TYPE,
        r"'ranges_changed' is sent by servers",
    ),
    "frame_too_large": Fatal(
        struct.pack(">I", MAX_FRAME + 1),  # the length alone: refused before any body byte
        ErrorCode.FRAME_TOO_LARGE,
        rf"{MAX_FRAME + 1} bytes is over the limit of {MAX_FRAME}",
    ),
    "bad_field/out_of_range": Fatal(
        packed({**SUBSCRIBE, "receiver_queue": -1}), ErrorCode.BAD_FIELD, r"'receiver_queue' must be a non-negative"
    ),
    "bad_field/missing": Fatal(
        packed({k: v for k, v in SUBSCRIBE.items() if k != "consumer"}), ErrorCode.BAD_FIELD, r"missing: consumer"
    ),
    "bad_field/extra": Fatal(packed({**SUBSCRIBE, "colour": "red"}), ErrorCode.BAD_FIELD, r"extra: 'colour'"),
    "bad_field/empty_name": Fatal(packed({**SUBSCRIBE, "topic": ""}), ErrorCode.BAD_FIELD, r"'topic' must be a str"),
    "bad_field/second_connect": Fatal(
        encode(Connect(version=PROTOCOL_VERSION, token=TOKEN, client="again")), ErrorCode.BAD_FIELD, r"already sent"
    ),
    "unauthorized/wrong_token": Fatal(
        encode(Connect(version=PROTOCOL_VERSION, token="guess", client="x")),
        ErrorCode.UNAUTHORIZED,
        r"token",
        after_connect=False,
    ),
    "unauthorized/no_token": Fatal(
        encode(Connect(version=PROTOCOL_VERSION, token=None, client="x")),
        ErrorCode.UNAUTHORIZED,
        r"token",
        after_connect=False,
    ),
    "version_mismatch": Fatal(
        encode(Connect(version=PROTOCOL_VERSION + 1, token=TOKEN, client="x")),
        ErrorCode.VERSION_MISMATCH,
        rf"version {PROTOCOL_VERSION + 1} is not supported; expected 5 to {PROTOCOL_VERSION}",
        after_connect=False,
    ),
    # A version 4 client cannot route keys to partitions; a version 3 one's ack lacks its req.
    "version_mismatch/v4_client": Fatal(
        encode(Connect(version=4, token=TOKEN, client="x")),
        ErrorCode.VERSION_MISMATCH,
        rf"version 4 is not supported; expected 5 to {PROTOCOL_VERSION}",
        after_connect=False,
    ),
}


def test_every_fatal_code_is_covered() -> None:
    # The codes of the connection limits are covered in tests/test_server_limits.py.
    limits = {ErrorCode.NOT_CONNECTED, ErrorCode.TOO_MANY_CONNECTIONS, ErrorCode.SLOW_CONNECTION}
    assert {case.code for case in FATAL.values()} == FATAL_CODES - limits


@pytest.mark.parametrize("case", FATAL.values(), ids=FATAL.keys())
def test_fatal_error_closes_only_that_connection(
    server: ServerThread, case: Fatal, request: pytest.FixtureRequest
) -> None:
    topic = f"fatal/{request.node.callspec.id}"
    with Client(server.url, token=TOKEN) as witness:
        producer = witness.create_producer(topic, "witness")
        stored = {producer.send(f"before {i}".encode(), key=f"k{i}"): f"before {i}".encode() for i in range(4)}
        held: list[int] = []
        with RawConnection(server.port) as raw:
            if case.after_connect:
                raw.connect(TOKEN)
                (position,) = produce(raw, 1, topic, [b"raw, before"])
                stored[position] = b"raw, before"
                raw.send(Subscribe(req=2, topic=topic, subscription="audit", consumer="raw", receiver_queue=2))
                reply(raw, Subscribed)
                held = deliveries(raw, 2)
            # A produce right behind the bad frame: it must not be processed.
            raw.send(case.bad, Produce(req=3, topic=topic, producer=None, messages=[(None, "k", b"raw, after")]))
            frames = [f for f in raw.until_closed() if not isinstance(f, Messages | RangesChanged)]
        assert len(frames) == 1, f"expected only the error, then the close: {frames}"
        check_error(frames[0], case.code, case.message)

        # The witness, connected all along, still produces and consumes; the frame behind
        # the bad one stored nothing (else "after" would not be next), and the messages
        # the closed connection held are delivered again.
        position = producer.send(b"after", key="k0")
        assert position == max(stored) + 1
        stored[position] = b"after"
        consumer = witness.subscribe(topic, "audit", "witness", receiver_queue_size=100)
        received = consume(consumer, set(stored))
        assert {p: m.payload for p, m in received.items()} == stored
        assert {p: m.redelivery_count for p, m in received.items()} == {p: int(p in held) for p in stored}
    assert_no_tracebacks(server)


def test_frames_before_a_fatal_frame_are_processed(server: ServerThread) -> None:
    """Only frames *after* the bad one are dropped, however TCP cuts the stream into reads.

    Here the produce and the bad frame go out in one write (so, on loopback, usually in one
    read of the server): the produce must be stored all the same.
    """
    topic = "fatal/frames before"
    with Client(server.url, token=TOKEN) as witness, RawConnection(server.port) as raw:
        producer = witness.create_producer(topic, "witness")
        first = producer.send(b"first", key="k")
        raw.connect(TOKEN)
        raw.send(Produce(req=1, topic=topic, producer=None, messages=[(None, "k", b"raw")]), framed(PING[:-1]))
        frames = raw.until_closed()
        check_error(frames[-1], ErrorCode.MALFORMED_FRAME, r"not one msgpack value")
        last = producer.send(b"last", key="k")
        consumer = witness.subscribe(topic, "audit", "witness")
        received = consume(consumer, set(range(first, last + 1)))
        assert [m.payload for _, m in sorted(received.items())] == [b"first", b"raw", b"last"]


# -- non-fatal --------------------------------------------------------------------------------


def test_a_frame_before_connect_closes_the_connection(server: ServerThread) -> None:
    topic = "not connected"
    with RawConnection(server.port) as raw:
        raw.send(Produce(req=7, topic=topic, producer=None, messages=[(None, "k", b"ignored")]), Ping(nonce=1))
        (refused,) = raw.until_closed()
        check_error(refused, ErrorCode.NOT_CONNECTED, r"expected a connect frame first, got 'produce'")
    with RawConnection(server.port) as raw:
        raw.connect(TOKEN)
        assert produce(raw, 8, topic, [b"stored"]) == [1], "the produce before connect stored nothing"
        assert_works(raw, topic)
    assert_no_tracebacks(server)


def test_unknown_topic(server: ServerThread) -> None:
    topic = "no such topic"
    with RawConnection(server.port) as raw:
        raw.connect(TOKEN)
        for frame in (
            Ack(topic=topic, subscription="s", session=1, positions=[1]),
            Nack(topic=topic, subscription="s", session=1, positions=[1]),
            Flow(topic=topic, subscription="s", session=1, permits=5),
        ):
            raw.send(frame)
            check_error(raw.receive(), ErrorCode.UNKNOWN_TOPIC, r"topic 'no such topic' does not exist")
        raw.send(CloseConsumer(req=4, topic=topic, subscription="s", session=1))
        check_error(raw.receive(), ErrorCode.UNKNOWN_TOPIC, r"topic 'no such topic' does not exist", req=4)
        assert_works(raw, "unknown topic, then")
    assert_no_tracebacks(server)


def test_unknown_subscription(server: ServerThread) -> None:
    topic = "unknown subscription"
    with RawConnection(server.port) as raw:
        raw.connect(TOKEN)
        (position,) = produce(raw, 1, topic, [b"x"])
        for frame in (
            Ack(topic=topic, subscription="nobody", session=1, positions=[position]),
            Nack(topic=topic, subscription="nobody", session=1, positions=[position]),
            Flow(topic=topic, subscription="nobody", session=1, permits=5),
        ):
            raw.send(frame)
            check_error(raw.receive(), ErrorCode.UNKNOWN_SUBSCRIPTION, r"subscription 'nobody' .* does not exist")
        raw.send(CloseConsumer(req=2, topic=topic, subscription="nobody", session=1))
        check_error(raw.receive(), ErrorCode.UNKNOWN_SUBSCRIPTION, r"subscription 'nobody'", req=2)
        assert_works(raw, topic)
    assert_no_tracebacks(server)


def test_unknown_and_foreign_sessions_change_nothing(server: ServerThread) -> None:
    topic, sub = "unknown session", "s"
    with RawConnection(server.port) as owner, RawConnection(server.port) as other:
        owner.connect(TOKEN)
        other.connect(TOKEN)
        produce(owner, 1, topic, [b"a", b"b", b"c"])
        owner.send(Subscribe(req=2, topic=topic, subscription=sub, consumer="owner", receiver_queue=3))
        session = reply(owner, Subscribed).session
        held = deliveries(owner, 3)
        other.send(Subscribe(req=3, topic=topic, subscription=sub, consumer="other", receiver_queue=3))
        other_session = reply(other, Subscribed).session
        dead = max(session, other_session) + 1000

        # Another connection's live session, and a session that never existed: rejected.
        for victim in (session, dead):
            for frame in (
                Ack(topic=topic, subscription=sub, session=victim, positions=held),
                Nack(topic=topic, subscription=sub, session=victim, positions=held),
                Flow(topic=topic, subscription=sub, session=victim, permits=1),
            ):
                other.send(frame)
                check_error(reply(other, Error), ErrorCode.UNKNOWN_SESSION, rf"session {victim} is not a live session")
            other.send(CloseConsumer(req=4, topic=topic, subscription=sub, session=victim))
            check_error(
                reply(other, Error), ErrorCode.UNKNOWN_SESSION, rf"session {victim} .*nothing was changed", req=4
            )
        assert_works(other, topic)

        # Nothing changed: the owner's session is live and its messages are still in flight on it.
        owner.send(Ack(topic=topic, subscription=sub, session=session, positions=held), Ping(nonce=1))
        assert reply(owner, Pong) == Pong(nonce=1), "the owner's ack was rejected"

        # A session that ended is dead for good, on its own connection too.
        owner.send(CloseConsumer(req=5, topic=topic, subscription=sub, session=session))
        closed = reply(owner, ConsumerClosed)
        assert (closed.session, closed.reason, closed.req) == (session, "closed", 5)
        owner.send(Flow(topic=topic, subscription=sub, session=session, permits=1))
        check_error(reply(owner, Error), ErrorCode.UNKNOWN_SESSION, rf"session {session} is not a live session")
        assert_works(owner, topic)
    assert_no_tracebacks(server)


def test_ack_of_a_position_not_in_flight(server: ServerThread) -> None:
    topic, sub = "not in flight", "s"
    with RawConnection(server.port) as raw:
        raw.connect(TOKEN)
        produce(raw, 1, topic, [b"a", b"b"])
        raw.send(Subscribe(req=2, topic=topic, subscription=sub, consumer="c", receiver_queue=2))
        session = reply(raw, Subscribed).session
        first, second = sorted(deliveries(raw, 2))
        never = 10_000

        # The positions in flight take effect; the message lists only the others.
        raw.send(Ack(topic=topic, subscription=sub, session=session, positions=[first, never]))
        check_error(reply(raw, Error), ErrorCode.NOT_IN_FLIGHT, rf"ack of position\(s\) {never} rejected")
        raw.send(Ack(topic=topic, subscription=sub, session=session, positions=[first]))
        check_error(reply(raw, Error), ErrorCode.NOT_IN_FLIGHT, rf"ack of position\(s\) {first} rejected")
        raw.send(Nack(topic=topic, subscription=sub, session=session, positions=[never, first]))
        check_error(reply(raw, Error), ErrorCode.NOT_IN_FLIGHT, rf"nack of position\(s\) {never}, {first} rejected")

        # The connection and the session go on: the other message is still in flight.
        raw.send(Ack(topic=topic, subscription=sub, session=session, positions=[second]), Ping(nonce=2))
        assert reply(raw, Pong) == Pong(nonce=2), "the ack of a message in flight was rejected"
        assert_works(raw, topic)
    assert_no_tracebacks(server)


# -- a live consumer's identity is its own --------------------------------------------------------


def subscribe(raw: RawConnection, req: int, topic: str, consumer: str, secret: str | None) -> Frame:
    raw.send(Subscribe(req=req, topic=topic, subscription="s", consumer=consumer, receiver_queue=5, secret=secret))
    frame = raw.receive()
    while isinstance(frame, Messages | RangesChanged):
        frame = raw.receive()
    return frame


def test_a_live_consumer_name_is_taken_only_with_its_secret(server: ServerThread) -> None:
    topic = "identity"
    with RawConnection(server.port) as owner, RawConnection(server.port) as thief:
        owner.connect(TOKEN)
        thief.connect(TOKEN)
        produce(owner, 1, topic, [b"a", b"b", b"c"])
        first = subscribe(owner, 2, topic, "c1", None)
        assert isinstance(first, Subscribed) and len(first.secret) >= 32
        held = deliveries(owner, 3)
        for secret in (None, "guessed", first.secret[:-1]):
            refused = subscribe(thief, 3, topic, "c1", secret)
            check_error(refused, ErrorCode.CONSUMER_BUSY, r"consumer 'c1' of 'identity'/'s' has a live session", req=3)
        # Nothing changed: the thief has no session to ack with, and the owner's acks work.
        thief.send(Ack(topic=topic, subscription="s", session=first.session, positions=held))
        check_error(reply(thief, Error), ErrorCode.UNKNOWN_SESSION, r"is not a live session")
        owner.send(Ack(topic=topic, subscription="s", session=first.session, positions=held[:1]))
        assert_works(owner, topic)

        # The same consumer resuming on a new connection (the old one half-open) presents its secret.
        resumed = subscribe(thief, 4, topic, "c1", first.secret)
        assert isinstance(resumed, Subscribed) and resumed.session != first.session
        assert resumed.secret != first.secret
        closed = reply(owner, ConsumerClosed)
        assert (closed.session, closed.reason) == (first.session, "superseded")
        # What the old session held and did not ack, then the message assert_works stored.
        assert sorted(deliveries(thief, 3)) == [*held[1:], held[-1] + 1]


def test_a_second_client_cannot_take_a_live_consumers_name(tmp_path: Path) -> None:
    from keyfailover.client import ConsumerBusyError

    with (
        ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0)) as started,
        Client(started.url) as owner,
        Client(started.url) as other,
    ):
        producer = owner.create_producer("orders")
        for i in range(20):
            producer.send_async(f"m{i}".encode(), key=f"k{i}")
        producer.flush()
        mine = owner.subscribe("orders", "billing", consumer_name="c1")
        held = [mine.receive(timeout=10) for _ in range(20)]
        with pytest.raises(ConsumerBusyError, match="consumer 'c1' of 'orders'/'billing' has a live session"):
            other.subscribe("orders", "billing", consumer_name="c1")
        for message in held:  # the owner's session is untouched: every ack lands
            mine.acknowledge(message)
        wait_until(lambda: backlog(started, "orders", "billing") == 0, "every message acknowledged")
        assert owner.server_errors() == {}
        other.subscribe("orders", "billing", consumer_name="c2")  # another name is welcome


def backlog(server: ServerThread, topic: str, subscription: str) -> int:
    assert server.admin_url is not None
    with urlopen(f"{server.admin_url}/stats", timeout=10) as response:
        found = json.load(response)
    return next(
        int(item["backlog"])
        for item in found["subscriptions"]
        if (item["topic"], item["subscription"]) == (topic, subscription)
    )
