"""A refusal that retrying cannot cure surfaces at once; only transient failures are retried.

A name the server would refuse is refused by the client before anything is sent. A server
that refuses the client for good (here: it came back with another token) fails every
producer and consumer with the server's reason, and the client stops reconnecting. A
server frame that breaks the protocol drops that connection only: the client reconnects.
"""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path
from types import TracebackType
from urllib.request import Request, urlopen

import pytest

from keyfailover.broker.server import ServerConfig
from keyfailover.client import Client, ServerError
from keyfailover.core.errors import KeyFailoverError
from keyfailover.wire.protocol import (
    DEFAULT_MAX_FRAME,
    MAX_NAME_LENGTH,
    PROTOCOL_VERSION,
    Close,
    CloseConsumer,
    Connect,
    Connected,
    ConsumerClosed,
    Decoder,
    Frame,
    Lookup,
    Ping,
    Pong,
    Route,
    Subscribe,
    Subscribed,
    encode,
)
from tests.server_process import ServerProcess, ServerThread, run_main, wait_until


def protocol_errors(server: ServerProcess | ServerThread, code: str, token: str | None = None) -> float:
    assert server.admin_url is not None
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    with urlopen(Request(f"{server.admin_url}/metrics", headers=headers), timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(f'keyfailover_protocol_errors_total{{code="{code}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


BAD_NAMES = ["t" * (MAX_NAME_LENGTH + 1), "", "with\0nul"]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_bad_names_are_refused_by_the_client_before_anything_is_sent(tmp_path: Path, bad: str) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0)) as server, Client(server.url) as client:
        rule = f"must be a str of 1 to {MAX_NAME_LENGTH} characters without NUL"
        with pytest.raises(KeyFailoverError, match=f"topic {rule}"):
            client.create_producer(bad)
        with pytest.raises(KeyFailoverError, match=f"subscription_name {rule}"):
            client.subscribe("t", bad)
        with pytest.raises(KeyFailoverError, match=f"consumer_name {rule}"):
            client.subscribe("t", "s", consumer_name=bad)
        with pytest.raises(KeyFailoverError, match=f"producer_name {rule}"):
            client.create_producer("t", bad)
        assert client.create_producer("t").send(b"still fine", key="k") == 1
        assert protocol_errors(server, "bad_field") == 0


@pytest.mark.parametrize(
    "arguments",
    [
        ["produce", "--topic", "t" * 300],
        ["consume", "--topic", "t", "--subscription", "s" * 300],
        ["consume", "--topic", "t", "--subscription", "s", "--consumer-name", ""],
    ],
)
def test_the_cli_refuses_bad_names_at_once(arguments: list[str]) -> None:
    done = run_main(*arguments, "--url", "kf://127.0.0.1:1", stdin="k,v\n")
    assert done.returncode == 2
    assert f"a name must be a str of 1 to {MAX_NAME_LENGTH} characters without NUL" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.integration
def test_a_server_that_refuses_for_good_fails_everything_once_and_is_not_retried(tmp_path: Path) -> None:
    first = ServerProcess(tmp_path / "data", "--token", "old").start()
    client = Client(first.url, token="old")
    try:
        producer = client.create_producer("t")
        consumer = client.subscribe("t", "s", consumer_name="c1")
        assert producer.send(b"before", key="k") == 1
        assert consumer.receive(timeout=10).payload == b"before"
        port = first.port
        first.stop()
        with ServerProcess(tmp_path / "data", "--token", "new", "--metrics-port", "0", port=port) as second:
            with pytest.raises(ServerError, match="unauthorized"):
                consumer.receive(timeout=60)
            link = next(iter(client._async._links.values()))
            wait_until(lambda: link._maintainer is not None and link._maintainer.done(), "the link to stop")
            with pytest.raises(ServerError, match="unauthorized"):
                producer.send(b"after", key="k")
            with pytest.raises(ServerError, match="unauthorized"):
                client.create_producer("t2")
            # One refused attempt, not a loop: the reconnecting stopped with the first refusal.
            assert protocol_errors(second, "unauthorized", token="new") == 1
    finally:
        client.close()


@pytest.mark.integration
def test_a_server_that_drops_every_connection_is_retried_with_backoff(tmp_path: Path) -> None:
    """Transient: the server goes away and comes back; the client gets through once it is back."""
    server = ServerProcess(tmp_path / "data", "--metrics-port", "0").start()
    port = server.port
    with Client(server.url) as client:
        producer = client.create_producer("t")
        assert producer.send(b"one", key="k") == 1
        server.stop()
        with ServerProcess(tmp_path / "data", port=port) as again:
            assert producer.send(b"two", key="k", timeout=60) == 2
            assert again.port == port


@pytest.mark.integration
def test_a_server_that_stops_answering_is_dropped_and_reconnected_to(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stopped (SIGSTOP) server keeps its TCP connections open: the client notices the missing
    pongs after twice the session timeout, drops the connection and reconnects (in a cluster it
    then looks its partitions up again)."""
    with (
        caplog.at_level(logging.WARNING, logger="keyfailover.client"),
        ServerProcess(tmp_path / "data", "--session-timeout", "0.5") as server,
        Client(server.url) as client,
    ):
        producer = client.create_producer("t")
        assert producer.send(b"one", key="k") == 1
        server.suspend()
        try:
            wait_until(lambda: "no answer from 127.0.0.1" in caplog.text, "the client to give up on the server")
        finally:
            server.resume()
        assert producer.send(b"two", key="k", timeout=60) == 2


class BadRangesServer:
    """A stand-in server on loopback whose first ``subscribed`` lists its ranges out of order.

    No keyfailover server sends such a frame, so this one speaks the protocol itself (with
    :func:`encode`, which does not validate): it answers ``connect``, ``subscribe``, ``ping``
    and ``close_consumer``, and counts the connections it was given.
    """

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # closed
                return
            self.connections += 1
            threading.Thread(target=self._talk, args=(connection, self.connections), daemon=True).start()

    def _talk(self, connection: socket.socket, number: int) -> None:
        decoder = Decoder(accept="server")
        with connection:
            while data := connection.recv(65536):
                for frame in decoder.feed(data):
                    if isinstance(frame, Close):
                        return
                    connection.sendall(encode(self._answer(frame, number)))

    @staticmethod
    def _answer(frame: Frame, number: int) -> Frame:
        if isinstance(frame, Connect):
            return Connected(version=PROTOCOL_VERSION, server="fake", max_frame=DEFAULT_MAX_FRAME, session_timeout=10.0)
        if isinstance(frame, Subscribe):
            ranges = [(200, 65535), (0, 99)] if number == 1 else [(0, 99), (200, 65535)]
            return Subscribed(req=frame.req, session=number, consumer=frame.consumer, ranges=ranges, secret="s")
        if isinstance(frame, CloseConsumer):
            return ConsumerClosed(session=frame.session, reason="closed", req=frame.req)
        if isinstance(frame, Lookup):
            return Route(req=frame.req, topic=frame.topic, brokers=[""])
        assert isinstance(frame, Ping), frame
        return Pong(nonce=frame.nonce)

    def __enter__(self) -> BadRangesServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._listener.close()


def test_a_subscribed_with_ranges_out_of_order_drops_the_connection_and_the_client_subscribes_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[list[tuple[int, int]]] = []
    with caplog.at_level(logging.ERROR, logger="keyfailover.client"), BadRangesServer() as server:
        with Client(f"kf://127.0.0.1:{server.port}") as client:
            consumer = client.subscribe("t", "s", consumer_name="c", on_ranges_changed=seen.append)
            assert consumer.ranges == [(0, 99), (200, 65535)]
        assert server.connections == 2
    assert seen == [[(0, 99), (200, 65535)]]  # the bad list never reached the application
    assert "malformed data from the server" in caplog.text
    assert "item 1 [0, 99] starts at or before the end 65535 of item 0" in caplog.text
