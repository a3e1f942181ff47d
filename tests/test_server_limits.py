"""Connection limits: what a client that misbehaves before or after login can cost the server.

Each test starts a real server with small limits and measures the server process's resident
memory (VmRSS) around the attack; the bounds asserted are far below what the same attack
cost before the limits (hundreds of MiB).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from keyfailover.core.errors import ErrorCode
from keyfailover.wire.protocol import Error, Ping, encode
from tests.server_process import RawConnection, ServerProcess, wait_until

pytestmark = pytest.mark.integration  # servers in processes of their own

MiB = 1024 * 1024


def rss(server: ServerProcess) -> int:
    """The server process's resident memory in bytes."""
    assert server.process is not None
    with open(f"/proc/{server.process.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def connections(server: ServerProcess) -> int:
    """Open connections, from the server's admin endpoint."""
    import json
    from urllib.request import urlopen

    assert server.admin_url is not None
    with urlopen(f"{server.admin_url}/stats", timeout=10) as response:
        return int(json.load(response)["connections"])


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[ServerProcess]:
    with ServerProcess(
        tmp_path / "data",
        "--metrics-port",
        "0",
        "--login-timeout",
        "1",
        "--frame-timeout",
        "1",
        "--max-connections",
        "120",
        "--max-output",
        str(2 * MiB),
    ) as server:
        yield server


def closed_with(raw: RawConnection, code: ErrorCode) -> None:
    frames = raw.until_closed()
    errors = [frame for frame in frames if isinstance(frame, Error)]
    assert [error.code for error in errors] == [code], frames


def test_partial_frames_before_login_cost_no_memory(limited: ServerProcess) -> None:
    """100 connections each announcing a 5 MiB frame and sending 1 MiB of it: refused at the prefix."""
    before = rss(limited)
    sockets = [socket.create_connection(("127.0.0.1", limited.port), timeout=10) for _ in range(100)]
    try:
        for sock in sockets:
            with contextlib.suppress(OSError):  # the server may close it before all is sent
                sock.sendall(struct.pack(">I", 5 * MiB) + b"\x00" * MiB)
        grown = rss(limited) - before
        wait_until(lambda: connections(limited) == 0, "every such connection closed")
    finally:
        for sock in sockets:
            sock.close()
    assert grown < 30 * MiB, f"the server grew by {grown / MiB:.1f} MiB"


def test_a_frame_before_login_is_refused_once_and_closes(limited: ServerProcess) -> None:
    with RawConnection(limited.port) as raw:
        raw.send(*[Ping(nonce=i) for i in range(2000)])
        closed_with(raw, ErrorCode.NOT_CONNECTED)


def test_a_connection_that_never_logs_in_is_closed(limited: ServerProcess) -> None:
    with RawConnection(limited.port) as raw:
        closed_with(raw, ErrorCode.NOT_CONNECTED)  # after the 1 s login timeout


def test_a_sender_trickling_one_frame_is_closed(limited: ServerProcess) -> None:
    """A byte every 0.2 s keeps the connection busy, but the frame never completes: closed."""
    with RawConnection(limited.port) as raw:
        raw.connect()
        stop = threading.Event()

        def trickle() -> None:
            for byte in struct.pack(">I", 1000) + b"\x00" * 1000:
                if stop.wait(0.2):
                    return
                with contextlib.suppress(OSError):
                    raw.sock.sendall(bytes([byte]))

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        try:
            closed_with(raw, ErrorCode.SLOW_CONNECTION)
        finally:
            stop.set()
            sender.join(timeout=10)


def test_a_client_that_never_reads_its_replies_is_paused_not_buffered(limited: ServerProcess) -> None:
    """Pings without reading the pongs: the server stops reading at 1 MiB of pongs instead of growing."""
    before = rss(limited)
    ping = encode(Ping(nonce=2**40))
    chunk = ping * 50_000
    sent = 0
    with RawConnection(limited.port) as raw:
        raw.connect()
        raw.sock.settimeout(3.0)
        with contextlib.suppress(TimeoutError):
            while sent < 200 * MiB:
                raw.sock.sendall(chunk)
                sent += len(chunk)
        grown = rss(limited) - before
        assert sent < 200 * MiB, "the server read every ping: nothing stopped it"
        raw.sock.settimeout(10.0)
    assert grown < 40 * MiB, f"the server grew by {grown / MiB:.1f} MiB"


def test_connections_over_the_limit_are_refused(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "data", "--max-connections", "3", "--metrics-port", "0") as server:
        held = [RawConnection(server.port) for _ in range(3)]
        try:
            for raw in held:
                raw.connect()
            with RawConnection(server.port) as extra:
                closed_with(extra, ErrorCode.TOO_MANY_CONNECTIONS)
            held.pop().close()
            wait_until(lambda: connections(server) == 2, "a slot freed")
            with RawConnection(server.port) as again:
                again.connect()
        finally:
            for raw in held:
                raw.close()


def test_deliveries_over_the_output_limit_to_a_reading_consumer_are_not_cut(limited: ServerProcess) -> None:
    """The output limit is for answers a client asked for; deliveries are bounded by permits instead.

    20 MB of deliveries against the 2 MiB limit, to a consumer with 1000 permits of 10 kB.
    """
    from keyfailover.client import Client

    with Client(limited.url) as client:
        producer = client.create_producer("big")
        for i in range(2000):
            producer.send_async(b"p" * 10_000, key=f"k{i % 50}")
        producer.flush()
        consumer = client.subscribe("big", "s", receiver_queue_size=1000)
        received = [consumer.receive(timeout=30) for _ in range(2000)]
    assert sorted(message.position for message in received) == list(range(1, 2001))
    assert {message.redelivery_count for message in received} == {0}
