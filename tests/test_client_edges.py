"""Client edge cases around reconnects, ended sessions and frame limits, against real servers.

Each test pins one interleaving or input that once lost or held back messages; some reach
into the client's internals to make the interleaving happen every time.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from keyfailover.broker.server import ServerConfig
from keyfailover.broker.storage.sqlite import LOG_FILE_NAME, Log
from keyfailover.client import Client, PropertiesError
from keyfailover.client._link import Link as _Link
from keyfailover.client.aio import AsyncClient
from keyfailover.core.errors import KeyFailoverError
from keyfailover.tools.chaos._proxy import FaultProxy
from keyfailover.wire.protocol import Connected, Frame
from tests.aio import run_async
from tests.server_process import ServerProcess, ServerThread, wait_until

WAIT = 30.0


async def async_wait_until(condition: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(WAIT):
        while not condition():
            await asyncio.sleep(0.01)
    assert condition(), what


def stored_payloads(data: Path, topic: str) -> list[bytes]:
    with Log(data / LOG_FILE_NAME) as log:
        return [message.payload for message in log.read(topic, 0, 10_000)]


@pytest.mark.integration
def test_a_reconnect_resends_unconfirmed_batches_before_newer_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch A waits unconfirmed while the server is down; batch B is sent by another thread just as
    the link comes back. A must go out first: sent after B, the server would take its sequence id
    for a duplicate of one never stored, and A would be lost."""
    data = tmp_path / "data"
    results: dict[str, tuple[int | None, BaseException | None]] = {}

    def record(name: str) -> Callable[[int | None, BaseException | None], None]:
        return lambda position, error: results.__setitem__(name, (position, error))

    async def scenario(server: ServerProcess) -> ServerProcess:
        port = server.port
        async with AsyncClient(server.url) as client:
            producer = await client.create_producer("t", "p")
            await producer.send(b"warm-up", "k")
            assert server.stop() == 0
            await async_wait_until(
                lambda: not next(iter(client._links.values())).ready.is_set(), "the client saw the server go"
            )
            producer.send_async(b"A", "k", record("A"))
            await async_wait_until(lambda: bool(producer._parts[0]._unconfirmed), "batch A flushed while disconnected")
            original = _Link._dispatch

            def dispatch(link: _Link, frame: Frame) -> None:
                if isinstance(frame, Connected):  # a user thread sends B as the connection comes back
                    sender = threading.Thread(target=producer.send_async, args=(b"B", "k", record("B")))
                    sender.start()
                    sender.join()
                original(link, frame)

            monkeypatch.setattr(_Link, "_dispatch", dispatch)
            server = ServerProcess(data, port=port).start()
            async with asyncio.timeout(WAIT):
                await producer.flush()
        return server

    server = ServerProcess(data).start()
    try:
        server = run_async(scenario(server))
    finally:
        server.stop()
    (a, a_error), (b, b_error) = results["A"], results["B"]
    assert a_error is None and b_error is None and a is not None and b is not None
    assert 1 < a < b
    assert stored_payloads(data, "t") == [b"warm-up", b"A", b"B"]


@pytest.mark.integration
def test_a_nack_of_a_message_from_an_ended_session_drops_nothing_of_the_new_one(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = ServerProcess(data).start()
    try:
        with Client(server.url) as client:
            consumer = client.subscribe("t", "s", "c", receiver_queue_size=10)
            producer = client.create_producer("t", "p")
            stored = [producer.send(f"m{i}".encode(), key="k") for i in range(3)]
            old = consumer.receive(timeout=WAIT)
            port = server.port
            assert server.stop() == 0
            server = ServerProcess(data, port=port).start()
            inbox = consumer._consumer.inbox.messages
            wait_until(lambda: len(inbox) == 3 and inbox[0].session != old.session, "the new session's messages")
            consumer.negative_acknowledge(old)  # its session ended with the server: nothing to restart
            again = [consumer.receive(timeout=WAIT) for _ in range(3)]
            assert [m.position for m in again] == stored
            assert {m.session for m in again} != {old.session}
    finally:
        server.stop()


def test_long_keys_count_toward_the_batch_limit(tmp_path: Path) -> None:
    """Small payloads with long keys: batches stay under the server's frame limit."""
    with (
        ServerThread(ServerConfig(data_dir=tmp_path / "data", max_frame=65536)) as server,
        Client(server.url) as client,
    ):
        producer = client.create_producer("t", "p")
        keys = ["k" * 300 + str(i) for i in range(400)]
        for key in keys:
            producer.send_async(b"", key)
        producer.flush(timeout=WAIT)
        assert client.server_errors() == {}
        with pytest.raises(KeyFailoverError, match=r"over the 31744 bytes a message may have"):
            producer.send_async(b"x", "k" * 40_000)
        with pytest.raises(KeyFailoverError, match=r"is not valid Unicode"):
            producer.send_async(b"x", "bad \udc80 key")
        consumer = client.subscribe("t", "s", "c")
        got = [consumer.receive(timeout=WAIT) for _ in keys]
    assert [m.key for m in got] == keys


def test_properties_count_toward_the_batch_limit(tmp_path: Path) -> None:
    """Small payloads with a kilobyte of properties each: batches stay under the server's frame limit, and
    every message arrives with its own."""
    with (
        ServerThread(ServerConfig(data_dir=tmp_path / "data", max_frame=65536)) as server,
        Client(server.url) as client,
    ):
        producer = client.create_producer("t", "p")
        sent = [{"i": str(i), "pad": "p" * 1000} if i % 2 else {} for i in range(200)]
        for properties in sent:
            producer.send_async(b"", "k", properties=properties)
        producer.flush(timeout=WAIT)
        assert client.server_errors() == {}
        with pytest.raises(KeyFailoverError, match=r"payload, key, properties and framing\) is over the 31744 bytes"):
            producer.send_async(b"", "k", properties={"big": "b" * 32_000})
        consumer = client.subscribe("t", "s", "c")
        got = [consumer.receive(timeout=WAIT) for _ in sent]
    assert [dict(m.properties) for m in got] == sent


@pytest.mark.parametrize(
    ("properties", "match"),
    [
        ({"k": 1}, r"the value of property 'k' is int 1; expected a str"),
        ({7: "v"}, r"property key 7 is int; expected a str"),
        ({"k" * 257: "v"}, r"has 257 characters; expected at most 256"),
        ({str(i): "" for i in range(129)}, r"129 properties are over the limit of 128"),
        ({"k": "v" * 70_000}, r"over the limit of 65536 per message"),
        ([("k", "v")], r"properties must be a mapping"),
    ],
)
def test_refused_properties_raise_at_the_call_and_send_nothing(tmp_path: Path, properties: object, match: str) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data")) as server, Client(server.url) as client:
        producer = client.create_producer("t", "p")
        producer.send_async(b"before", "k", properties={"ok": "yes"})
        with pytest.raises(PropertiesError, match=match):
            producer.send_async(b"refused", "k", properties=properties)  # type: ignore[arg-type]
        with pytest.raises(PropertiesError, match=match):
            producer.send(b"refused", "k", properties=properties)  # type: ignore[arg-type]
        after = producer.send(b"after", "k")
        consumer = client.subscribe("t", "s", "c")
        got = [consumer.receive(timeout=WAIT) for _ in range(2)]
        assert [(m.payload, dict(m.properties)) for m in got] == [(b"before", {"ok": "yes"}), (b"after", {})]
        assert len(set(got)) == 2  # messages stay hashable, with properties or without
        assert got[-1].position == after == 2
        assert client.server_errors() == {}


def test_the_asyncio_client_sends_and_receives_properties(tmp_path: Path) -> None:
    async def run(url: str) -> list[tuple[bytes, dict[str, str]]]:
        async with AsyncClient(url) as client:
            producer = await client.create_producer("t", "p")
            await producer.send(b"a", "k", properties={"trace": "t-1"})
            producer.send_async(b"b", "k", properties={"": ""})
            await producer.send(b"c", "k")
            with pytest.raises(PropertiesError):
                await producer.send(b"d", "k", properties={"k": None})  # type: ignore[dict-item]
            consumer = await client.subscribe("t", "s", "c")
            return [((m := await consumer.receive(timeout=WAIT)).payload, dict(m.properties)) for _ in range(3)]

    with ServerThread(ServerConfig(data_dir=tmp_path / "data")) as server:
        got = run_async(run(server.url))
    assert got == [(b"a", {"trace": "t-1"}), (b"b", {"": ""}), (b"c", {})]


def test_a_resubscribe_after_a_reconnect_presents_the_sessions_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from keyfailover.wire.protocol import Subscribe

    with ServerThread(ServerConfig(data_dir=tmp_path / "data")) as server, Client(server.url) as client:
        consumer = client.subscribe("t", "s", consumer_name="c1")
        link = next(iter(client._async._links.values()))
        secret = consumer._consumer.parts[0]._secret
        assert secret is not None
        sent: list[Subscribe] = []
        original = link.send

        def recording(frame: Frame) -> bool:
            if isinstance(frame, Subscribe):
                sent.append(frame)
            return original(frame)

        monkeypatch.setattr(link, "send", recording)
        transport = link._transport
        assert transport is not None
        client._loop.call_soon_threadsafe(transport.abort)
        wait_until(lambda: consumer._consumer.parts[0]._secret not in (None, secret), "subscribed again")
        assert [frame.secret for frame in sent] == [secret]
        producer = client.create_producer("t")
        producer.send(b"x", key="k")
        assert consumer.receive(timeout=10).payload == b"x"


def test_request_ids_are_unique_across_a_clients_links(tmp_path: Path) -> None:
    """A producer keeps its unconfirmed batches by request id and moves them to another broker's link
    in a failover; ids handed out by two links of one client must never collide, or a new batch
    would take an old one's place (and the old one be lost)."""

    async def scenario(first: ServerThread, second: ServerThread) -> list[int]:
        async with AsyncClient(f"kf://127.0.0.1:{first.port},127.0.0.1:{second.port}") as client:
            a = await client._link(f"127.0.0.1:{first.port}")
            b = await client._link(f"127.0.0.1:{second.port}")
            return [a.next_req(), b.next_req(), a.next_req(), b.next_req()]

    with (
        ServerThread(ServerConfig(data_dir=tmp_path / "a")) as first,
        ServerThread(ServerConfig(data_dir=tmp_path / "b")) as second,
    ):
        ids = run_async(scenario(first, second))
    assert len(set(ids)) == len(ids)


@pytest.mark.slow
def test_a_lookup_skips_a_link_a_lossy_network_stalled(tmp_path: Path) -> None:
    """The first broker's link stalls (nothing passes, as behind a segment TCP keeps resending), but stays up
    until its pings have gone unanswered for twice the session timeout. A lookup meanwhile (a consumer
    relocating after a failover) must not wait on it once it missed two pings: it goes over the other
    broker's link, still answering. (Two single servers: each answers a lookup with itself.)"""

    async def scenario(first: ServerThread, second: ServerThread, proxy: FaultProxy) -> list[str | None]:
        async with AsyncClient(f"kf://127.0.0.1:{proxy.port},127.0.0.1:{second.port}") as client:
            stalled = await client._link(f"127.0.0.1:{proxy.port}")
            other = await client._link(f"127.0.0.1:{second.port}")
            proxy.blackhole()
            cut = time.monotonic()
            overdue = max(stalled.session_timeout / 2, 1.0)  # two ping intervals
            await async_wait_until(
                lambda: other.heard > cut and time.monotonic() - stalled.heard > overdue,
                "the other link answered a ping after the cut, the stalled one missed two",
            )
            assert stalled.ready.is_set(), "the stalled link is still up: its pings are not overdue yet"
            async with asyncio.timeout(WAIT):
                return await client._lookup("orders")

    with (
        ServerThread(ServerConfig(data_dir=tmp_path / "a")) as first,
        ServerThread(ServerConfig(data_dir=tmp_path / "b")) as second,
        FaultProxy(("127.0.0.1", first.port)) as proxy,
    ):
        brokers = run_async(scenario(first, second, proxy))
    assert brokers == [f"127.0.0.1:{second.port}"]


def test_a_lookup_for_a_lost_partition_asks_another_broker_than_the_one_it_was_lost_from(tmp_path: Path) -> None:
    """A part that lost its broker looks its partition up again, through a link other than the one it was lost
    from while another is up, however recently that one answered: its broker may be the trouble (a lossy link
    answers pings now and then, and a lookup through it waits as long as its stalls). (Two single servers:
    each answers a lookup with itself.)"""

    async def scenario(first: ServerThread, second: ServerThread) -> list[list[str | None]]:
        async with AsyncClient(f"kf://127.0.0.1:{first.port},127.0.0.1:{second.port}") as client:
            a = await client._link(f"127.0.0.1:{first.port}")
            b = await client._link(f"127.0.0.1:{second.port}")
            return [
                await client._lookup("orders"),
                await client._lookup("orders", avoid=a),
                await client._lookup("orders", avoid=b),
            ]

    with (
        ServerThread(ServerConfig(data_dir=tmp_path / "a")) as first,
        ServerThread(ServerConfig(data_dir=tmp_path / "b")) as second,
    ):
        plain, avoiding_first, avoiding_second = run_async(scenario(first, second))
    assert plain == avoiding_second == [f"127.0.0.1:{first.port}"]
    assert avoiding_first == [f"127.0.0.1:{second.port}"]


def test_a_client_interrupted_while_it_connects_cancels_its_tasks_and_closes_its_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C while ``Client()`` waits: nothing is left running on the loop to be destroyed pending at exit."""
    running: list[asyncio.Task[None]] = []
    loops: list[asyncio.AbstractEventLoop] = []
    connecting = threading.Event()

    async def connect_forever(*args: object) -> AsyncClient:
        loops.append(asyncio.get_running_loop())
        running.append(asyncio.get_running_loop().create_task(asyncio.sleep(3600)))  # e.g. a link's task
        connecting.set()
        await asyncio.sleep(3600)
        raise AssertionError("not reached")

    monkeypatch.setattr(Client, "_make", staticmethod(connect_forever))

    def ctrl_c() -> None:
        main = threading.main_thread().ident
        if connecting.wait(10) and main is not None:
            signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=ctrl_c, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        Client("kf://127.0.0.1:1")
    assert loops[0].is_closed()
    assert running[0].cancelled()


def test_a_client_interrupted_while_its_thread_starts_lets_the_thread_stop_and_close_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C inside ``Thread.start``: the thread may begin to run only after ``Client()`` gave up.
    It stops at once and closes the loop itself, with no 'Event loop is closed' error in the thread."""
    threads: list[threading.Thread] = []
    failures: list[BaseException | None] = []
    start = threading.Thread.start
    interrupted = threading.Event()

    def start_after_the_interrupt() -> None:
        if interrupted.wait(10):
            time.sleep(0.2)
            start(threads[0])

    threading.Thread(target=start_after_the_interrupt, daemon=True).start()

    def start_late_and_interrupt(thread: threading.Thread) -> None:
        threads.append(thread)
        interrupted.set()
        raise KeyboardInterrupt

    monkeypatch.setattr(threading, "excepthook", lambda hook: failures.append(hook.exc_value))
    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(threading.Thread, "start", start_late_and_interrupt)
        Client("kf://127.0.0.1:1")
    wait_until(lambda: threads[0].ident is not None and not threads[0].is_alive(), "the late thread ran and ended")
    assert failures == []


def test_the_loops_thread_holds_off_ctrl_c_and_sigterm_so_they_reach_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel gives a process's Ctrl-C to any thread not holding it off; Python acts on it only in
    the main thread, so one given to the loop's thread would leave ``receive()`` with no timeout asleep
    until a message came. The loop's thread holds both off; the caller's mask is left as it was."""
    masks: list[set[int | signal.Signals]] = []

    async def observe_and_refuse(*args: object) -> AsyncClient:
        masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        raise ConnectionRefusedError("refused after looking")

    monkeypatch.setattr(Client, "_make", staticmethod(observe_and_refuse))
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with pytest.raises(ConnectionRefusedError, match="refused after looking"):
        Client("kf://127.0.0.1:1")
    assert {signal.SIGINT, signal.SIGTERM} <= masks[0]
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
    assert signal.SIGINT not in before


def test_a_lookup_naming_a_broker_that_just_died_is_asked_again(tmp_path: Path) -> None:
    """Right after a failover a broker's view of the cluster may still name the dead broker as a partition's
    owner: the client's connection to it is refused. create_producer and subscribe look the topic up again
    (within the connect timeout) instead of failing. The first lookup here answers a port nothing listens on."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{closed.getsockname()[1]}"

    async def scenario(server: ServerThread) -> tuple[int, list[bytes]]:
        async with AsyncClient(server.url) as client:
            lookup = client._lookup
            asked = 0

            async def stale_first(topic: str, avoid: _Link | None = None) -> list[str | None]:
                nonlocal asked
                asked += 1
                return [dead] if asked == 1 else await lookup(topic, avoid)

            client._lookup = stale_first  # type: ignore[method-assign]
            producer = await client.create_producer("orders", "p")
            await producer.send(b"after the failover", "k")
            asked_by_producer = asked
            asked = 0
            consumer = await client.subscribe("orders", "s")
            message = await consumer.receive()
            return asked_by_producer + asked, [message.payload]

    with ServerThread(ServerConfig(data_dir=tmp_path / "data")) as server:
        lookups, received = run_async(scenario(server))
    assert lookups == 4  # each of the two asked twice: the stale answer, then the live one
    assert received == [b"after the failover"]


def test_explicit_sequence_ids_store_a_message_sent_again_once(tmp_path: Path) -> None:
    """A producer that numbers its messages itself: sent again under the same name with the same ids, by a new
    client, they are answered with the positions they were stored at; ids may skip, and new ones are stored."""
    with ServerThread(ServerConfig(data_dir=tmp_path / "data")) as server:
        with Client(server.url) as client:
            producer = client.create_producer("t", "numbered")
            first = [producer.send(f"m{seq}".encode(), "k", sequence_id=seq) for seq in (5, 10, 1 << 40)]
        with Client(server.url) as client:
            producer = client.create_producer("t", "numbered")
            again = [producer.send(f"m{seq}".encode(), "k", sequence_id=seq) for seq in (5, 10, 1 << 40)]
            later = producer.send(b"later", "k", sequence_id=(1 << 40) + 7)
            counted = producer.send(b"counted", "k")  # the counter goes on above the ids given
    assert first == again == [1, 2, 3]
    assert (later, counted) == (4, 5)
    with Log(tmp_path / "data" / LOG_FILE_NAME) as log:
        assert log.last_sequence("t", "numbered") > (1 << 40) + 7
    assert stored_payloads(tmp_path / "data", "t") == [b"m5", b"m10", f"m{1 << 40}".encode(), b"later", b"counted"]


def test_sequence_ids_that_do_not_increase_are_refused_and_queue_nothing(tmp_path: Path) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data")) as server, Client(server.url) as client:
        producer = client.create_producer("t", "numbered")
        producer.send(b"a", "k", sequence_id=10)
        for wrong in (10, 3):
            with pytest.raises(KeyFailoverError, match=rf"sequence id {wrong} of producer 'numbered' is not above 10"):
                producer.send_async(b"x", "k", sequence_id=wrong)
        refused: tuple[object, ...] = (-1, 2**63, True, 1.5)
        for value in refused:
            with pytest.raises(KeyFailoverError, match=r"sequence_id must be an int in \[0, 2\*\*63 - 1\] or None"):
                producer.send_async(b"x", "k", sequence_id=value)  # type: ignore[arg-type]
        producer.send(b"b", "k", sequence_id=11)
    assert stored_payloads(tmp_path / "data", "t") == [b"a", b"b"]
