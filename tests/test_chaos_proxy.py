"""The chaos harness's fault-injecting TCP proxy, against a real echo server on loopback.

Timing is checked one way only: a fault holds bytes at least as long as it should (never an
upper bound, the machine is shared). Where a test must show that bytes do *not* get through,
it waits a short grace period; a proxy that works can never fail such a check, one that leaks
would be caught on most runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from keyfailover.client import Client
from keyfailover.core.errors import KeyFailoverError
from keyfailover.core.loops import new_loop, set_loop_factory
from keyfailover.tools.chaos._netns import Namespace, NamespaceError, support
from keyfailover.tools.chaos._proxy import FaultEvent, FaultProxy, LinkFaults, Stall, _open_socket
from keyfailover.tools.chaos._worker import _LossyLinks, _through_proxies
from tests.aio import run_async
from tests.server_process import ServerProcess, until, wait_until
from tests.tiers import starts_processes

GRACE = 0.3  # seconds a test waits to see that nothing gets through


class EchoServer:
    """A threaded TCP server on loopback that sends back what it reads, and half-closes at EOF.

    ``received`` gets each chunk it reads (to see what crossed the proxy upstream);
    ``connections`` counts the connections it accepted.
    """

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.listener.getsockname()
        self.received: queue.Queue[bytes] = queue.Queue()
        self.connections = 0
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:  # closed
                return
            self.connections += 1
            thread = threading.Thread(target=self._echo, args=(connection,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _echo(self, connection: socket.socket) -> None:
        with connection, contextlib.suppress(OSError):
            while data := connection.recv(65536):
                self.received.put(data)
                connection.sendall(data)
            connection.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # shutdown wakes the accepting thread (a close alone does not)
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for thread in self._threads:
            thread.join(10)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


def connect(proxy: FaultProxy) -> socket.socket:
    return socket.create_connection(proxy.address, timeout=30)


def round_trip(sock: socket.socket, data: bytes) -> bytes:
    """Send ``data`` and read until as many bytes came back."""
    sock.sendall(data)
    back = b""
    while len(back) < len(data):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed"
        back += chunk
    return back


def assert_reset(sock: socket.socket) -> None:
    """The connection is gone: the next read fails with a reset (or, at worst, sees the end)."""
    with contextlib.suppress(ConnectionResetError):
        assert sock.recv(1) == b""


def assert_refused(proxy: FaultProxy) -> None:
    """A new connection is reset at once: in ``connect`` itself when the reset comes first, else at the first read."""
    try:
        sock = connect(proxy)
    except ConnectionResetError:
        return
    with sock:
        assert_reset(sock)


def nothing_arrives(sock: socket.socket) -> bool:
    """True when ``sock`` gets nothing for the grace period."""
    sock.settimeout(GRACE)
    try:
        sock.recv(1)
    except TimeoutError:
        return True
    finally:
        sock.settimeout(30)
    return False


def through(proxy: FaultProxy, data: bytes) -> bytes:
    """Stream ``data`` through ``proxy`` to the echo server in random pieces (while reading the echo
    back), half-close, and return everything read up to the server's end of stream."""
    with connect(proxy) as sock:
        pieces = random.Random(len(data))

        def send() -> None:
            at = 0
            while at < len(data):
                size = pieces.randint(1, 8192)
                sock.sendall(data[at : at + size])
                at += size
            sock.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        back = bytearray()
        while chunk := sock.recv(65536):
            back += chunk
        sender.join()
    return bytes(back)


PAYLOAD = random.Random(15).randbytes(200_000)

FAULTS: dict[str, list[Callable[[FaultProxy], None]]] = {
    "pass": [],
    "delay": [lambda proxy: proxy.delay(0.01, jitter=0.01)],
    "slow": [lambda proxy: proxy.slow(2_000_000)],
    "drop": [lambda proxy: proxy.drop(0.3, rto=0.002)],
    "all at once": [
        lambda proxy: proxy.delay(0.005, 0.005),
        lambda proxy: proxy.slow(4_000_000),
        lambda proxy: proxy.drop(0.2, rto=0.002),
    ],
    "one way each": [
        lambda proxy: proxy.drop(0.3, rto=0.002, direction="up"),
        lambda proxy: proxy.delay(0.01, direction="down"),
    ],
}


@pytest.mark.parametrize("fault", FAULTS)
def test_bytes_pass_unchanged_and_in_order_both_ways(echo: EchoServer, fault: str) -> None:
    with FaultProxy(echo.address, seed=1) as proxy:
        for switch in FAULTS[fault]:
            switch(proxy)
        assert through(proxy, PAYLOAD) == PAYLOAD
        wait_until(lambda: proxy.stats().active == 0, "the connection to end")
        stats = proxy.stats()
    assert (stats.connections, stats.bytes_up, stats.bytes_down) == (1, len(PAYLOAD), len(PAYLOAD))
    assert (stats.chunks_delayed > 0) == (fault in ("delay", "all at once", "one way each"))
    assert stats.chunks_stalled == 0 or fault in ("drop", "all at once", "one way each")
    assert stats.retransmissions >= stats.chunks_stalled
    assert stats.resets == stats.refused == stats.upstream_failures == 0


def test_on_the_callers_event_loop_bytes_pass_and_nothing_is_left_after(echo: EchoServer) -> None:
    async def main() -> None:
        async with FaultProxy(echo.address) as proxy:
            proxy.delay(0.01, jitter=0.01)
            proxy.drop(0.3, rto=0.002)
            reader, writer = await asyncio.open_connection(*proxy.address)
            writer.write(PAYLOAD)
            writer.write_eof()
            assert await reader.read() == PAYLOAD
            writer.close()
            await writer.wait_closed()
            with pytest.raises(RuntimeError, match="close it with aclose"):
                proxy.close()
        assert asyncio.all_tasks() == {asyncio.current_task()}
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection(*proxy.address)

    run_async(main())


def test_a_delay_holds_each_chunk_at_least_that_long_each_way(echo: EchoServer) -> None:
    with FaultProxy(echo.address) as proxy, connect(proxy) as sock:
        assert round_trip(sock, b"warm") == b"warm"
        for direction, at_least in (("up", 0.3), ("down", 0.3), ("both", 0.6)):
            proxy.clear()
            proxy.delay(0.3, direction=direction)
            start = time.monotonic()
            assert round_trip(sock, direction.encode()) == direction.encode()
            assert time.monotonic() - start >= at_least
        proxy.delay(0.3, jitter=0.1)
        start = time.monotonic()
        assert round_trip(sock, b"jitter") == b"jitter"
        assert time.monotonic() - start >= 0.4
        assert proxy.stats().chunks_delayed == 6


def test_no_delayed_round_trip_is_shorter_than_the_delay_whatever_the_loop_s_clock_grain(
    echo: EchoServer,
) -> None:
    # uvloop's timers run on a millisecond clock read at the top of each turn: a proxy that trusted
    # them let about one round trip in a hundred through early, by up to a millisecond.
    with FaultProxy(echo.address) as proxy, connect(proxy) as sock:
        proxy.delay(0.005, direction="up")
        shortest = min(timed_round_trip(sock, b"%03d" % number) for number in range(300))
        assert shortest >= 0.005


def timed_round_trip(sock: socket.socket, data: bytes) -> float:
    start = time.monotonic()
    assert round_trip(sock, data) == data
    return time.monotonic() - start


def test_a_jittered_delay_keeps_the_order_of_many_small_messages(echo: EchoServer) -> None:
    with FaultProxy(echo.address, seed=2) as proxy, connect(proxy) as sock:
        proxy.delay(0.01, jitter=0.01)
        messages = b"".join(b"%04d" % number for number in range(300))
        for number in range(300):  # one small write each: many chunks, each its own jitter
            sock.sendall(b"%04d" % number)
        back = b""
        while len(back) < len(messages):
            back += sock.recv(65536)
        assert back == messages


def test_slow_limits_the_rate(echo: EchoServer) -> None:
    with FaultProxy(echo.address) as proxy, connect(proxy) as sock:
        proxy.slow(50_000, direction="up")
        start = time.monotonic()
        assert round_trip(sock, PAYLOAD[:20_000]) == PAYLOAD[:20_000]
        # 20 000 bytes at 50 000 per second, paced in pieces of 1 000: at least 19 pieces wait.
        assert time.monotonic() - start >= 19_000 / 50_000


def test_a_blackhole_holds_everything_until_cleared_and_the_connection_carries_on(echo: EchoServer) -> None:
    with FaultProxy(echo.address) as proxy, connect(proxy) as sock:
        assert round_trip(sock, b"before") == b"before"
        assert echo.received.get(timeout=30) == b"before"
        proxy.blackhole()
        sock.sendall(b"during")
        with connect(proxy) as late:  # accepted, but held: the upstream does not see it yet
            late.sendall(b"late")
            with pytest.raises(queue.Empty):
                echo.received.get(timeout=GRACE)
            assert nothing_arrives(sock)
            assert echo.connections == 1
            assert proxy.stats().active == 2
            proxy.clear("blackhole")
            assert sock.recv(65536) == b"during"
            assert late.recv(65536) == b"late"
            assert echo.connections == 2
        assert round_trip(sock, b"after") == b"after"


def test_a_blackhole_one_way_lets_the_other_way_through(echo: EchoServer) -> None:
    with FaultProxy(echo.address) as proxy, connect(proxy) as sock:
        assert round_trip(sock, b"before") == b"before"
        echo.received.get(timeout=30)
        proxy.blackhole(direction="down")
        sock.sendall(b"one way")
        assert echo.received.get(timeout=30) == b"one way"  # the server got it ...
        assert nothing_arrives(sock)  # ... its answer is held
        proxy.clear()
        assert sock.recv(65536) == b"one way"


def test_a_blackhole_holds_a_close_too(echo: EchoServer) -> None:
    with FaultProxy(echo.address) as proxy, connect(proxy) as sock:
        assert round_trip(sock, b"x") == b"x"
        proxy.blackhole(direction="up")
        sock.shutdown(socket.SHUT_WR)
        assert nothing_arrives(sock)  # the server did not see the end, so it has not closed
        proxy.clear()
        assert sock.recv(1) == b""


def test_reset_closes_every_connection_and_refuses_new_ones_until_cleared(echo: EchoServer) -> None:
    with FaultProxy(echo.address) as proxy, connect(proxy) as first, connect(proxy) as second:
        assert round_trip(first, b"1") == b"1"
        assert round_trip(second, b"2") == b"2"
        proxy.reset()
        assert proxy.refusing
        assert proxy.stats().active == 0
        assert_reset(first)
        assert_reset(second)
        assert_refused(proxy)
        assert proxy.stats().refused == 1
        proxy.clear()
        assert not proxy.refusing
        with connect(proxy) as again:
            assert round_trip(again, b"3") == b"3"
        stats = proxy.stats()
    assert (stats.connections, stats.resets, stats.refused, echo.connections) == (3, 2, 1, 3)


def test_an_upstream_that_refuses_resets_the_client(echo: EchoServer) -> None:
    echo.close()
    with FaultProxy(echo.address) as proxy:
        assert_refused(proxy)
        wait_until(lambda: proxy.stats().upstream_failures == 1, "the upstream failure to be counted")


def stall_decisions(echo: EchoServer, seed: int) -> list[Stall]:
    """The stalls of 40 one-byte round trips (each a chunk of its own) under a loss of one half."""
    with FaultProxy(echo.address, seed=seed) as proxy, connect(proxy) as sock:
        proxy.drop(0.5, rto=0.001)
        for number in range(40):
            assert round_trip(sock, bytes([number])) == bytes([number])
        stats = proxy.stats()
        stalls = proxy.stalls()
    assert stats.chunks_stalled == len(stalls)
    assert stats.retransmissions == sum(stall.losses for stall in stalls)
    return stalls


def test_the_same_seed_makes_the_same_stall_decisions(echo: EchoServer) -> None:
    first = stall_decisions(echo, seed=3)
    assert first, "a loss of one half stalled nothing in 80 chunks"
    assert {stall.direction for stall in first} == {"up", "down"}
    assert stall_decisions(echo, seed=3) == first
    assert stall_decisions(echo, seed=4) != first


def test_a_chunk_lost_too_often_resets_the_connection_as_tcp_gives_up(echo: EchoServer) -> None:
    with FaultProxy(echo.address) as proxy, connect(proxy) as sock:
        proxy.drop(1.0, rto=0.00001, direction="up")
        sock.sendall(b"lost")
        assert_reset(sock)
        stats = proxy.stats()
    assert (stats.chunks_stalled, stats.retransmissions, stats.resets) == (1, 16, 1)
    assert echo.received.empty()


def test_a_connection_reset_again_after_its_socket_closed_is_left_alone(echo: EchoServer) -> None:
    # A fault resets a connection, then close() resets it again before its task has ended: on
    # uvloop the closed socket is still handed out, with descriptor -1 (a CI run's close failed so).
    async def main() -> None:
        async with FaultProxy(echo.address) as proxy:
            reader, writer = await asyncio.open_connection(*proxy.address)
            await until(lambda: len(proxy._connections) == 1, "the connection to be accepted")
            (connection,) = proxy._connections
            connection.reset()
            await until(lambda: _open_socket(connection.client) is None, "its socket to be closed")
            connection.reset()
            with pytest.raises(ConnectionResetError):
                await reader.read()
            writer.close()
        assert proxy.stats().active == 0

    run_async(main())


def open_descriptors() -> set[str]:
    """The process's open descriptors (not the one the listing itself used, closed by now)."""
    return {fd for fd in os.listdir("/proc/self/fd") if os.path.lexists(f"/proc/self/fd/{fd}")}


def describe(descriptors: set[str]) -> dict[str, str]:
    """What each of ``descriptors`` is (a socket, a pipe, a file), for a failure's message."""
    found = {}
    for fd in descriptors:
        with contextlib.suppress(OSError):
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return found


def test_close_ends_every_connection_and_the_thread_and_leaves_nothing_listening(echo: EchoServer) -> None:
    # What this test opens must be closed at the end: compared as sets of descriptors, not counts (a CI
    # run failed on the count, which a descriptor of an earlier test closed meanwhile changes too). Earlier
    # tests' garbage is collected first, and a loop made first: libuv opens a pipe, once a process, for its first.
    gc.collect()
    new_loop().close()
    before = open_descriptors()
    proxy = FaultProxy(echo.address).start()
    with connect(proxy) as idle, connect(proxy) as held:
        assert round_trip(idle, b"idle") == b"idle"
        proxy.blackhole(direction="down")
        held.sendall(b"held")
        wait_until(lambda: proxy.stats().active == 2, "both connections to be accepted")
        proxy.close()
        assert_reset(idle)
        assert_reset(held)
    proxy.close()  # twice: nothing more to do
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(proxy.address, timeout=30)
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("fault proxy")]
    try:
        wait_until(lambda: open_descriptors() <= before, "every descriptor opened since the start to be closed")
    except TimeoutError:
        raise AssertionError(f"still open: {describe(open_descriptors() - before)}") from None
    with FaultProxy(echo.address, port=proxy.port) as again, connect(again) as sock:  # the port is free again
        assert round_trip(sock, b"again") == b"again"
    with pytest.raises(RuntimeError, match="is closed"):
        proxy.start()


def test_a_port_in_use_fails_the_start_and_leaves_no_thread_and_a_proxy_starts_once(echo: EchoServer) -> None:
    with pytest.raises(OSError, match="address already in use"):
        FaultProxy(echo.address, port=echo.address[1]).start()
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("fault proxy")]
    with FaultProxy(echo.address) as proxy, pytest.raises(RuntimeError, match="is already started"):
        proxy.start()


BAD_CALLS: list[tuple[Callable[[FaultProxy], object], str]] = [
    (lambda proxy: proxy.delay(-0.1), r"delay seconds must be at least 0, got -0\.1"),
    (lambda proxy: proxy.delay(0.1, jitter=-1), "delay jitter must be at least 0, got -1"),
    (lambda proxy: proxy.delay(float("nan")), "delay seconds must be a finite number at least 0, got nan"),
    (lambda proxy: proxy.delay(True), "delay seconds must be a finite number at least 0, got True"),
    (lambda proxy: proxy.slow(0), "slow bytes_per_second must be above 0, got 0"),
    (lambda proxy: proxy.drop(1.5), "drop probability must be at least 0 and at most 1, got 1.5"),
    (lambda proxy: proxy.drop(-0.01), "drop probability must be at least 0 and at most 1, got -0.01"),
    (lambda proxy: proxy.drop(0.5, rto=0), "drop rto must be above 0, got 0"),
    (lambda proxy: proxy.blackhole(direction="sideways"), "direction must be 'up', 'down' or 'both', got 'sideways'"),
    (lambda proxy: proxy.delay(0.2, direction="UP"), "direction must be 'up', 'down' or 'both', got 'UP'"),
    (lambda proxy: proxy.clear("netem"), "fault kind must be one of delay, slow, drop, blackhole, reset"),
    (lambda proxy: proxy.clear(direction="left"), "direction must be 'up', 'down' or 'both', got 'left'"),
    (lambda proxy: proxy.faults("both"), "direction must be 'up' or 'down', got 'both'"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("call", "message"), BAD_CALLS)
def test_bad_arguments_are_refused_with_what_was_expected_and_change_nothing(
    echo: EchoServer, call: Callable[[FaultProxy], object], message: str
) -> None:
    with FaultProxy(echo.address) as proxy:
        proxy.delay(0.1, direction="up")
        proxy.drop(0.2, direction="down")
        faults, events = (proxy.faults("up"), proxy.faults("down")), proxy.events
        with pytest.raises(ValueError, match=message) as raised:
            call(proxy)
        assert isinstance(raised.value, KeyFailoverError)
        assert (proxy.faults("up"), proxy.faults("down")) == faults
        assert proxy.events == events
    assert faults == (LinkFaults(delay=(0.1, 0.0)), LinkFaults(loss=(0.2, 0.2)))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"upstream": ("127.0.0.1", 0)}, "upstream port must be an int from 1 to 65535, got 0"),
        ({"upstream": ("127.0.0.1", 70000)}, "upstream port must be an int from 1 to 65535, got 70000"),
        ({"upstream": ("127.0.0.1", 1), "port": -1}, "port must be an int from 0 to 65535, got -1"),
    ],
)
def test_bad_ports_are_refused(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FaultProxy(**arguments)  # type: ignore[arg-type]


def test_every_switch_is_an_event_in_order_for_the_record(echo: EchoServer) -> None:
    seen: list[FaultEvent] = []
    proxy = FaultProxy(echo.address, name="broker-1", on_event=seen.append)
    proxy.delay(0.05, jitter=0.01)  # before the start: in force from the first connection
    with proxy:
        proxy.blackhole(direction="down")
        proxy.clear("blackhole")
        proxy.clear("blackhole")  # nothing on: no event
        proxy.reset()
        proxy.reset()  # already on: no event
        proxy.drop(0.1, direction="up")
        proxy.clear()
    assert seen == proxy.events
    assert [(event.kind, event.action, event.detail) for event in seen] == [
        ("delay", "start", "direction=both seconds=0.05 jitter=0.01"),
        ("blackhole", "start", "direction=down"),
        ("blackhole", "end", "direction=down"),
        ("reset", "start", ""),
        ("drop", "start", "direction=up probability=0.1 rto=0.2"),
        ("reset", "end", ""),
        ("delay", "end", "direction=both"),
        ("drop", "end", "direction=up"),
    ]
    assert {event.target for event in seen} == {"broker-1"}
    times = [event.t for event in seen]
    assert times == sorted(times)
    assert seen[0].to_json() == {
        "t": seen[0].t,
        "kind": "delay",
        "target": "broker-1",
        "action": "start",
        "detail": "direction=both seconds=0.05 jitter=0.01",
    }


def test_faults_switch_from_many_threads_at_once(echo: EchoServer) -> None:
    with FaultProxy(echo.address) as proxy, connect(proxy) as sock:

        def toggle(number: int) -> None:
            for _ in range(50):
                proxy.delay(0.001 * number)
                proxy.blackhole(direction="up")
                proxy.clear()

        threads = [threading.Thread(target=toggle, args=(number,)) for number in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert (proxy.faults("up"), proxy.faults("down")) == (LinkFaults(), LinkFaults())
        assert round_trip(sock, b"still there") == b"still there"
        assert len(proxy.events) >= 4 * 50 * 2


def test_a_lossy_consumer_s_loops_reach_brokers_through_its_own_proxies_and_other_hosts_directly(
    echo: EchoServer,
) -> None:
    """``consume --lossy``: each loop the worker makes afterwards connects to a broker through that broker's
    proxy (its faults hit only this process's links); any other address it reaches directly."""
    other = EchoServer()
    links = _LossyLinks([echo.address], seed=1)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        _through_proxies(links)
        loop = new_loop()
        try:

            async def peer(address: tuple[str, int]) -> tuple[str, int]:
                transport, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, *address)
                try:
                    found: tuple[str, int] = transport.get_extra_info("peername")[:2]
                    return found
                finally:
                    transport.close()

            proxy = links.through(*echo.address)
            assert proxy != echo.address
            assert loop.run_until_complete(peer(echo.address)) == proxy
            assert loop.run_until_complete(peer(other.address)) == other.address
        finally:
            loop.close()
    finally:
        set_loop_factory(None)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        links.close()
        other.close()


@pytest.mark.integration
def test_a_keyfailover_client_works_through_a_delay_and_gives_up_on_a_blackholed_server(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Through a delay, produce and consume as usual. Under a blackhole the connection stays open
    and silent: the client misses its pongs after twice the session timeout, drops the connection
    and keeps reconnecting; once the blackhole is cleared, it is back."""
    with (
        caplog.at_level(logging.WARNING, logger="keyfailover.client"),
        ServerProcess(tmp_path / "data", "--session-timeout", "0.5") as server,
        FaultProxy(("127.0.0.1", server.port), seed=5) as proxy,
        Client(f"kf://127.0.0.1:{proxy.port}") as client,
    ):
        producer = client.create_producer("t")
        consumer = client.subscribe("t", "s", consumer_name="c")
        proxy.delay(0.05, jitter=0.02)
        for number in range(5):
            assert producer.send(b"%d" % number, key="k") == number + 1
        for number in range(5):
            message = consumer.receive(timeout=30)
            assert message.payload == b"%d" % number
            consumer.acknowledge_confirmed(message)  # settled before the blackhole, not redelivered after
        assert proxy.stats().chunks_delayed > 0
        proxy.clear()
        proxy.blackhole()
        wait_until(
            lambda: f"no answer from 127.0.0.1:{proxy.port}" in caplog.text, "the client to give up on the server"
        )
        proxy.clear()
        assert producer.send(b"after", key="k", timeout=60) == 6
        message = consumer.receive(timeout=60)
        assert message.payload == b"after"
        consumer.acknowledge(message)
        assert proxy.stats().connections >= 2


ECHO_INSIDE = """
import socket, sys
with socket.create_server((sys.argv[1], 0)) as listener:
    print(listener.getsockname()[1], flush=True)
    while True:
        connection, _ = listener.accept()
        with connection:
            while data := connection.recv(65536):
                connection.sendall(data)
"""


@pytest.fixture
@starts_processes
def namespace() -> Iterator[Namespace]:
    found = support()
    if not found.available:
        pytest.skip(f"no network namespaces here: {found.reason}")
    with Namespace() as made:
        yield made
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert made.name not in listed.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert f" {made.host_interface}@" not in links


def echo_inside(namespace: Namespace) -> tuple[subprocess.Popen[str], int]:
    """An echo server run inside ``namespace`` on its address, and its port."""
    server = namespace.popen([sys.executable, "-c", ECHO_INSIDE, namespace.address], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    return server, int(server.stdout.readline())


def test_a_namespace_drops_everything_until_healed_and_tcp_carries_on(namespace: Namespace) -> None:
    server, port = echo_inside(namespace)
    with socket.create_connection((namespace.address, port), timeout=30) as sock:
        assert round_trip(sock, b"before") == b"before"
        namespace.drop_all(direction="in")
        sock.sendall(b"lost, then sent again")
        assert nothing_arrives(sock)
        namespace.heal()
        back = b""
        while len(back) < len(b"lost, then sent again"):
            back += sock.recv(65536)
        assert back == b"lost, then sent again"
        namespace.slow(20_000, direction="out")
        start = time.monotonic()
        assert round_trip(sock, PAYLOAD[:40_000]) == PAYLOAD[:40_000]
        assert time.monotonic() - start >= (40_000 - 20_000) / 20_000  # all but a burst's worth at the rate
    namespace.close()
    assert server.wait(timeout=30) == -signal.SIGKILL  # killed with the namespace
    assert server.stdout is not None
    server.stdout.close()


def test_netem_works_where_the_kernel_has_it(namespace: Namespace) -> None:
    if support().netem:
        namespace.netem(0.01, 0.1)
        namespace.heal()
    else:
        with pytest.raises(NamespaceError, match="netem"):
            namespace.netem(0.01, 0.1)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ns: ns.slow(0), "bytes_per_second must be an int of at least 1, got 0"),
        (lambda ns: ns.netem(-1), "delay must be a number of seconds from 0 to 3600, got -1"),
        (lambda ns: ns.netem(0.1, 2), "loss must be a probability from 0 to 1, got 2"),
        (lambda ns: ns.drop_all(direction="up"), "direction must be 'in', 'out' or 'both', got 'up'"),
    ],
)
def test_bad_namespace_arguments_are_refused(call: Callable[[Namespace], None], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(Namespace(index=0))  # checked before any command runs: nothing is made
