"""Hostile byte streams against a server's Pulsar endpoint: it answers what it can, drops the connection, lives on.

Each example opens a connection, sends its bytes, half-closes, and reads what the server
answers until it closes the connection (or a short bounded wait passes). The decoder's own
cases are in tests/test_pulsar_codec.py; these are about the server around it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pulsar
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyfailover.broker.pulsar import encode_command
from keyfailover.broker.pulsar.PulsarApi_pb2 import BaseCommand, CommandAck
from tests.pulsar_wire import RawPulsar, command, connect_command, producer_command, send_frame, subscribe_command
from tests.server_process import ServerProcess
from tests.strategies import mutated, random_streams

pytestmark = pytest.mark.integration  # a server in a process of its own, whose log is read

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONNECT = encode_command(connect_command())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data: Path = tmp_path_factory.mktemp("pulsar-fuzz") / "data"
    with ServerProcess(data, "--pulsar-port", "0", "--max-frame", "65536") as server:
        yield server


def exchange(server: ServerProcess, data: bytes) -> None:
    """Send ``data`` on a new connection, then EOF; every answer must decode and the server must live on."""
    with RawPulsar(server.pulsar_url or "", timeout=2.0) as raw:
        try:
            raw.send(data)
            raw.half_close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed the connection before reading everything
        with contextlib.suppress(TimeoutError):  # still open after a short wait: the stream was valid so far
            raw.until_closed()
    assert server.process is not None and server.process.poll() is None, "the server died"


topics = st.sampled_from(["persistent://public/default/fuzz", "persistent://public/default/t", "x://bad"])
ids = st.integers(0, 3)


def ack(entries: list[int]) -> bytes:
    built = command(BaseCommand.ACK, consumer_id=1, ack_type=CommandAck.Individual)
    for entry in entries:
        built.ack.message_id.add(ledgerId=0, entryId=entry)
    return encode_command(built)


def seek(request_id: int, entry: int | None, publish_time: int | None) -> bytes:
    built = command(BaseCommand.SEEK, consumer_id=1, request_id=request_id)
    if entry is not None:
        built.seek.message_id.ledgerId, built.seek.message_id.entryId = 0, entry
    if publish_time is not None:
        built.seek.message_publish_time = publish_time
    return encode_command(built)


valid_commands = st.one_of(
    st.builds(lambda t, p: encode_command(producer_command(t, producer_id=p)), topics, ids),
    st.builds(send_frame, st.integers(0, 20), st.binary(max_size=16), st.none() | st.text(max_size=4)),
    st.builds(lambda t: encode_command(subscribe_command(t)), topics),
    st.builds(lambda n: encode_command(command(BaseCommand.FLOW, consumer_id=1, messagePermits=n)), st.integers(0, 9)),
    st.builds(ack, st.lists(st.integers(0, 9), max_size=3)),
    st.just(encode_command(command(BaseCommand.REDELIVER_UNACKNOWLEDGED_MESSAGES, consumer_id=1))),
    st.builds(lambda r: encode_command(command(BaseCommand.CLOSE_CONSUMER, consumer_id=1, request_id=r)), ids),
    st.builds(lambda r: encode_command(command(BaseCommand.CLOSE_PRODUCER, producer_id=1, request_id=r)), ids),
    st.builds(seek, ids, st.none() | st.integers(0, 12), st.none() | st.integers(0, 2**64 - 1)),
    st.just(encode_command(command(BaseCommand.PING))),
    st.just(CONNECT),
)


@st.composite
def mutated_streams(draw: st.DrawFn) -> bytes:
    """A CONNECT and valid commands, with a few bytes flipped, set, inserted or deleted."""
    return draw(mutated(CONNECT + b"".join(draw(st.lists(valid_commands, min_size=1, max_size=6)))))


@FUZZ
@given(data=random_streams, connect=st.booleans())
def test_random_bytes(server: ServerProcess, data: bytes, connect: bool) -> None:
    exchange(server, (CONNECT if connect else b"") + data)


@FUZZ
@given(stream=mutated_streams())
def test_mutated_command_streams(server: ServerProcess, stream: bytes) -> None:
    exchange(server, stream)


@FUZZ
@given(commands=st.lists(valid_commands, max_size=8))
def test_valid_command_streams(server: ServerProcess, commands: list[bytes]) -> None:
    exchange(server, CONNECT + b"".join(commands))


def test_the_server_still_serves_a_pulsar_client_after_the_fuzzing(server: ServerProcess) -> None:
    assert server.pulsar_url is not None
    pc = pulsar.Client(
        server.pulsar_url, operation_timeout_seconds=10, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)
    )
    try:
        consumer = pc.subscribe("after-fuzzing", "check", consumer_type=pulsar.ConsumerType.KeyShared)
        pc.create_producer("after-fuzzing").send(b"still here", partition_key="k")
        message = consumer.receive(timeout_millis=10_000)
        assert (message.data(), message.partition_key()) == (b"still here", "k")
        consumer.acknowledge(message)
    finally:
        pc.close()
    assert server.process is not None and server.process.poll() is None
    assert "Traceback" not in server.errors(), server.errors()
