"""Hostile byte streams against one running server: it answers valid frames, drops the connection, and lives on.

Each example opens a connection, sends its bytes, half-closes, and reads what the server
answers until it closes the connection (or a short bounded wait passes). The decoder's own
fuzz properties are in tests/test_protocol.py; these are about the server around it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyfailover.client import Client
from keyfailover.core.errors import FATAL_CODES, ErrorCode
from keyfailover.wire.protocol import (
    PROTOCOL_VERSION,
    Ack,
    ClientFrame,
    Close,
    CloseConsumer,
    Connect,
    Error,
    Flow,
    Frame,
    Nack,
    Ping,
    Pong,
    Produce,
    Subscribe,
    encode,
)
from tests.server_process import RawConnection, ServerProcess
from tests.strategies import mutated, random_streams

pytestmark = pytest.mark.integration  # a server in a process of its own, whose log is read

CONNECT = encode(Connect(version=PROTOCOL_VERSION, token=None, client="fuzz"))
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data: Path = tmp_path_factory.mktemp("fuzz") / "data"
    with ServerProcess(data, "--max-frame", "65536") as server:
        yield server


def exchange(server: ServerProcess, data: bytes, *, connect: bool = False) -> list[Frame]:
    """Send ``data`` on a new connection (after a valid connect if ``connect``), then EOF.

    Returns the frames the server answered until it closed the connection. Every frame must
    decode (the client-side decoder checks it), none may be ``internal``, a fatal error
    must be the last one, and the server must still be running.
    """
    with RawConnection(server.port, timeout=2.0) as raw:
        if connect:
            raw.connect()
        try:
            raw.send(data)
            raw.half_close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed the connection on a fatal error before reading everything
        try:
            frames = raw.until_closed()
        except TimeoutError:  # still open after a short wait: what came so far
            frames = raw.received()
    errors = [frame for frame in frames if isinstance(frame, Error)]
    assert all(error.code != ErrorCode.INTERNAL for error in errors), errors
    fatal = [i for i, frame in enumerate(frames) if isinstance(frame, Error) and frame.code in FATAL_CODES]
    assert fatal in ([], [len(frames) - 1]), f"frames after a fatal error: {frames}"
    assert server.process is not None and server.process.poll() is None, "the server died"
    return frames


# -- streams ----------------------------------------------------------------------------------

names = st.sampled_from(["t", "fuzz", "orders"])
small = st.integers(0, 5) | st.integers(0, 2**63 - 1)
keys = st.none() | st.text(max_size=8) | st.binary(max_size=8)
payloads = st.binary(max_size=16)
valid_frames: st.SearchStrategy[ClientFrame] = st.one_of(
    st.builds(
        Produce,
        req=small,
        topic=names,
        producer=st.none(),
        messages=st.lists(st.tuples(st.none(), keys, payloads), max_size=4),
    ),
    st.builds(
        Produce,
        req=small,
        topic=names,
        producer=st.just("p"),
        messages=st.lists(st.tuples(st.integers(0, 50), keys, payloads), max_size=4),
    ),
    st.builds(Subscribe, req=small, topic=names, subscription=names, consumer=names, receiver_queue=st.integers(0, 9)),
    st.builds(Flow, topic=names, subscription=names, session=small, permits=st.integers(0, 9)),
    st.builds(Ack, topic=names, subscription=names, session=small, positions=st.lists(small, max_size=4)),
    st.builds(Nack, topic=names, subscription=names, session=small, positions=st.lists(small, max_size=4)),
    st.builds(CloseConsumer, req=small, topic=names, subscription=names, session=small),
    st.builds(Ping, nonce=st.integers(-(2**63), 2**63 - 1)),
    st.just(Close()),
    st.builds(Connect, version=st.integers(0, 2), token=st.none(), client=st.just("again")),
)


def stream_of(frames: list[ClientFrame]) -> bytes:
    return CONNECT + b"".join(encode(frame) for frame in frames)


@st.composite
def mutated_streams(draw: st.DrawFn) -> tuple[bool, bytes]:
    """Valid frames, mutated; half of the time behind a valid connect sent first, else with the connect mutated too."""
    frames = b"".join(encode(frame) for frame in draw(st.lists(valid_frames, min_size=1, max_size=6)))
    connect_first = draw(st.booleans())
    return connect_first, draw(mutated(frames if connect_first else CONNECT + frames))


# -- properties -------------------------------------------------------------------------------


@FUZZ
@given(data=random_streams, connected=st.booleans())
def test_random_bytes(server: ServerProcess, data: bytes, connected: bool) -> None:
    exchange(server, data, connect=connected)


@FUZZ
@given(case=mutated_streams())
def test_mutated_frame_streams(server: ServerProcess, case: tuple[bool, bytes]) -> None:
    connect_first, stream = case
    exchange(server, stream, connect=connect_first)


@FUZZ
@given(frames=st.lists(valid_frames, max_size=6))
def test_valid_frame_streams(server: ServerProcess, frames: list[ClientFrame]) -> None:
    """Valid frames are never fatal except a second connect, and pings are answered in order."""
    answered = exchange(server, stream_of(frames))
    served: list[ClientFrame] = []
    for frame in frames:
        if isinstance(frame, Connect | Close):
            break  # a second connect is fatal (bad_field); close ends the connection
        served.append(frame)
    fatal = [f for f in answered if isinstance(f, Error) and f.code in FATAL_CODES]
    expected_fatal = len(served) < len(frames) and isinstance(frames[len(served)], Connect)
    assert [f.code for f in fatal] == ([ErrorCode.BAD_FIELD] if expected_fatal else []), answered
    pongs = [f.nonce for f in answered if isinstance(f, Pong)]
    assert pongs == [f.nonce for f in served if isinstance(f, Ping)]


def test_server_still_serves_after_the_fuzzing(server: ServerProcess) -> None:
    with Client(server.url, connect_timeout=5.0) as client:
        position = client.create_producer("after fuzzing").send(b"still here", key="k")
        consumer = client.subscribe("after fuzzing", "check", "c")
        message = consumer.receive(timeout=10.0)
        assert (message.position, message.key, message.payload) == (position, "k", b"still here")
        consumer.acknowledge(message)
    assert server.process is not None and server.process.poll() is None
    assert "Traceback" not in server.errors(), server.errors()
