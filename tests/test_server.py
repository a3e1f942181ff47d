"""The server end to end: real ``keyfailover serve`` processes on loopback, real clients."""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.error import HTTPError
from urllib.request import urlopen

import msgpack  # type: ignore[import-untyped]
import pytest
from prometheus_client.parser import text_string_to_metric_families

from keyfailover import RangeMap
from keyfailover.broker.server import ServerConfig
from keyfailover.broker.storage.records import publish_clock
from keyfailover.client import Client, ClientClosed, Consumer, Message, Timeout
from keyfailover.client.aio import AsyncClient
from keyfailover.core.hashing import HASH_RANGE_SIZE
from keyfailover.wire.protocol import (
    Ack,
    CloseConsumer,
    Connect,
    ConsumerClosed,
    Frame,
    Ping,
    Pong,
    Produce,
    RangesChanged,
    Subscribe,
    Subscribed,
    encode,
)
from tests.aio import run_async
from tests.server_process import RawConnection, ServerProcess, ServerThread, run_cli, run_main, wait_until

WHOLE = [(0, HASH_RANGE_SIZE - 1)]


class Recorder:
    """What the consumers saw, with per-key order checks."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.first: dict[int, str] = {}
        self.by_key: dict[str | bytes | None, list[int]] = defaultdict(list)
        self.deliveries = 0

    def saw(self, consumer: str, message: Message) -> None:
        with self.lock:
            self.deliveries += 1
            if message.position not in self.first:
                self.first[message.position] = consumer
                self.by_key[message.key].append(message.position)


def drain(consumer: Consumer, recorder: Recorder, name: str, stop: threading.Event, idle: float = 0.5) -> None:
    while not stop.is_set():
        try:
            message = consumer.receive(timeout=idle)
        except Timeout:
            continue
        except ClientClosed:
            return
        recorder.saw(name, message)
        consumer.acknowledge(message)


@pytest.mark.integration
def test_end_to_end_ordered_with_joins_and_leaves(tmp_path: Path) -> None:
    keys = [f"key-{i}" for i in range(1000)]
    rng = random.Random(5)
    with ServerProcess(tmp_path / "data") as server:
        stored: dict[int, str] = {}
        with Client(server.url) as client:
            recorder = Recorder()
            stop = threading.Event()
            consumers: dict[str, tuple[Consumer, threading.Thread]] = {}

            def join(name: str) -> None:
                consumer = client.subscribe("orders", "billing", consumer_name=name, receiver_queue_size=200)
                thread = threading.Thread(target=drain, args=(consumer, recorder, name, stop), daemon=True)
                thread.start()
                consumers[name] = (consumer, thread)

            join("c1")
            join("c2")
            producers = [client.create_producer("orders", f"p{i}") for i in range(3)]
            lock = threading.Lock()

            def remember(key: str) -> object:
                def callback(position: int | None, error: BaseException | None) -> None:
                    assert error is None, error
                    assert position is not None
                    with lock:
                        stored[position] = key

                return callback

            total = 50_000
            for i in range(total):
                key = rng.choice(keys)
                producers[i % 3].send_async(f"{key}:{i}".encode(), key, remember(key))  # type: ignore[arg-type]
                if i == 10_000:
                    join("c3")
                elif i == 20_000:
                    join("c4")
                elif i == 30_000:
                    consumers.pop("c1")[0].close()
                elif i == 40_000:
                    consumers.pop("c3")[0].close()
            for producer in producers:
                producer.flush()
            assert len(stored) == total
            deadline_rounds = 600
            while len(recorder.first) < total and deadline_rounds:
                deadline_rounds -= 1
                stop.wait(0.1)
            stop.set()
            for _, thread in consumers.values():
                thread.join(timeout=5)
        assert server.stop() == 0
    assert set(recorder.first) == set(stored), "every stored message was consumed"
    by_key_stored: dict[str, list[int]] = defaultdict(list)
    for position in sorted(stored):
        by_key_stored[stored[position]].append(position)
    for key, positions in by_key_stored.items():
        assert recorder.by_key[key] == positions, f"{key}: first deliveries out of order"


@pytest.mark.integration
def test_crash_restart_loses_nothing_confirmed(tmp_path: Path, record_property: Callable[[str, object], None]) -> None:
    """SIGKILL the server at random moments while a producer sends and a consumer consumes; restart each time.

    No message whose send returned is lost, each is stored once, and the live consumer's first
    deliveries of every key come in position order; the redeliveries a crash causes (delivered,
    ack not yet stored) are counted and reported as the ``duplicates`` property.
    """
    data = tmp_path / "data"
    confirmed: dict[int, bytes] = {}
    server = ServerProcess(data).start()
    port = server.port
    rng = random.Random(11)
    stop = threading.Event()
    produced = threading.Event()  # the producer stopped: ``confirmed`` changes no more
    failures: list[BaseException] = []
    deliveries: list[tuple[int, str | bytes | None]] = []

    def produce(client: Client) -> None:
        producer = client.create_producer("events", "crashy")
        i = 0
        while not stop.is_set():
            payload = f"m{i}".encode()
            try:
                position = producer.send(payload, key=f"k{i % 37}", timeout=60.0)
            except BaseException as exc:  # recorded and asserted below
                failures.append(exc)
                produced.set()
                return
            confirmed[position] = payload
            i += 1
        produced.set()

    def consume(consumer: Consumer) -> None:
        """Until every confirmed message arrived, once the producer is done (60 s at most after that)."""
        delivered: set[int] = set()
        deadline = float("inf")
        while True:
            try:
                message = consumer.receive(timeout=0.5)
            except Timeout:
                if produced.is_set():
                    deadline = min(deadline, time.monotonic() + 60.0)
                    if delivered.issuperset(confirmed) or time.monotonic() > deadline:
                        return
                continue
            except BaseException as exc:  # recorded and asserted below
                failures.append(exc)
                return
            deliveries.append((message.position, message.key))
            delivered.add(message.position)
            consumer.acknowledge(message)

    try:
        with Client(server.url) as client, Client(server.url) as reader:
            live = reader.subscribe("events", "live", consumer_name="live", receiver_queue_size=100)
            threads = [
                threading.Thread(target=produce, args=(client,), daemon=True),
                threading.Thread(target=consume, args=(live,), daemon=True),
            ]
            for thread in threads:
                thread.start()
            for _ in range(5):
                target = len(confirmed) + rng.randint(50, 400)
                while len(confirmed) < target and not failures:
                    stop.wait(0.01)
                server.kill()
                server = ServerProcess(data, port=port).start()
            target = len(confirmed) + 100
            while len(confirmed) < target and not failures:
                stop.wait(0.01)
            stop.set()
            for thread in threads:
                thread.join(timeout=60)
                assert not thread.is_alive()
        assert not failures, failures
        with Client(server.url) as client:
            consumer = client.subscribe("events", "audit", consumer_name="a", receiver_queue_size=500)
            seen: dict[int, bytes] = {}
            while True:  # every confirmed message, then whatever else was stored
                try:
                    message = consumer.receive(timeout=30.0 if not seen.keys() >= confirmed.keys() else 2.0)
                except Timeout:
                    break
                seen[message.position] = message.payload
                consumer.acknowledge(message)
    finally:
        server.stop()
    missing = set(confirmed) - set(seen)
    assert not missing, f"{len(missing)} confirmed messages lost"
    assert all(seen[p] == payload for p, payload in confirmed.items())
    # Retries after a crash are deduplicated by (producer, seq): each payload is stored once.
    payloads = list(seen.values())
    assert len(payloads) == len(set(payloads)), "a retried message was stored twice"

    # The live consumer, crashed under five times: everything confirmed arrived, each key's
    # first deliveries in position order; what came twice is reported.
    first: dict[str | bytes | None, list[int]] = defaultdict(list)
    delivered: set[int] = set()
    for position, key in deliveries:
        if position not in delivered:
            delivered.add(position)
            first[key].append(position)
    assert set(confirmed) <= delivered, f"{len(set(confirmed) - delivered)} confirmed messages never delivered"
    for key, positions in first.items():
        assert positions == sorted(positions), f"{key!r}: first deliveries out of order"
    duplicates = len(deliveries) - len(delivered)
    record_property("duplicates", duplicates)
    print(f"crash test: {len(delivered)} messages, {duplicates} delivered again after a crash")


@pytest.mark.parametrize("token", ["s3cret"])
def test_wrong_token_is_refused(tmp_path: Path, token: str) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", token=token)) as server:
        with pytest.raises(Exception, match=r"unauthorized"):
            Client(server.url, token="wrong", connect_timeout=3.0)
        with Client(server.url, token=token) as client:
            assert client.create_producer("t").send(b"x", key="k") == 1


def test_admin_endpoint_and_ranges_stats_commands(tmp_path: Path) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0)) as server:
        assert server.admin_url is not None
        with Client(server.url) as client:
            producer = client.create_producer("orders")
            for i in range(50):
                producer.send_async(b"x", key=f"k{i}")
            producer.flush()
            a = client.subscribe("orders", "billing", consumer_name="a")
            b = client.subscribe("orders", "billing", consumer_name="b")
            a.receive(timeout=5.0)
            snapshot = json.loads(urlopen(f"{server.admin_url}/ranges?topic=orders&subscription=billing").read())
            assert snapshot["version"] == 2
            restored = RangeMap.from_snapshot(snapshot)
            assert sorted(restored.consumers()) == ["a", "b"]
            # b's subscribe came after a's ranges_changed on the same connection: both are up to date.
            assert (a.ranges, b.ranges) == (restored.ranges_of("a"), restored.ranges_of("b"))
            listing = json.loads(urlopen(f"{server.admin_url}/ranges").read())
            assert [(s["topic"], s["subscription"]) for s in listing["subscriptions"]] == [("orders", "billing")]
            assert listing["subscriptions"][0]["ranges"] == snapshot
            stats = json.loads(urlopen(f"{server.admin_url}/stats").read())
            (sub,) = stats["subscriptions"]
            assert sub["last_position"] == 50
            assert (sub["policy"], sub["max_ranges"]) == ("multi", 16)
            assert {name: info["ranges"] for name, info in sub["dispatcher"]["consumers"].items()} == {
                "a": [list(pair) for pair in a.ranges],
                "b": [list(pair) for pair in b.ranges],
            }
            assert json.loads(urlopen(f"{server.admin_url}/healthz").read()) == {"status": "ok"}
            with pytest.raises(HTTPError) as missing:
                urlopen(f"{server.admin_url}/ranges?topic=orders&subscription=nope")
            assert missing.value.code == 404
            for command in ("ranges", "stats"):
                done = run_main(command, "--admin-url", server.admin_url)
                assert done.returncode == 0, done.stderr
                assert "orders/billing" in done.stdout


def subscription_ranges(server: ServerThread, topic: str, subscription: str) -> dict[str, list[tuple[int, int]]]:
    """Every consumer's ranges, as the admin endpoint's ``/ranges`` has them now."""
    snapshot = json.loads(urlopen(f"{server.admin_url}/ranges?topic={topic}&subscription={subscription}").read())
    return RangeMap.from_snapshot(snapshot).ranges_by_consumer()


def test_a_session_hears_of_its_ranges_exactly_when_they_change(tmp_path: Path) -> None:
    """Joins and leaves, frame by frame: each ranges_changed brings a session a list it did not have, and
    after every step the last list each live session was told is its part of the map that /ranges serves."""
    with (
        ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0)) as server,
        RawConnection(server.port) as raw,
    ):
        raw.connect()
        told: dict[int, list[list[tuple[int, int]]]] = {}  # session -> every ranges list it got, in order
        epochs: dict[int, int] = {}
        live: dict[str, int] = {}  # consumer -> session
        changes = 0

        def record(frames: list[Frame]) -> None:
            nonlocal changes
            for frame in frames:
                if isinstance(frame, Subscribed):
                    told[frame.session] = [frame.ranges]
                    live[frame.consumer] = frame.session
                elif isinstance(frame, RangesChanged):
                    assert frame.session in live.values(), f"ranges_changed for a dead session {frame.session}"
                    assert frame.ranges != told[frame.session][-1], "told ranges that did not change"
                    assert frame.epoch > epochs.get(frame.session, -1)
                    told[frame.session].append(frame.ranges)
                    epochs[frame.session] = frame.epoch
                    changes += 1
            owned = subscription_ranges(server, "t", "s")
            assert {name: told[session][-1] for name, session in live.items()} == {
                name: owned.get(name, []) for name in live
            }
            assert sum(end - start + 1 for ranges in owned.values() for start, end in ranges) == HASH_RANGE_SIZE

        for req, name in enumerate(["a", "b", "c", "d", "e"], 1):
            raw.send(Subscribe(req=req, topic="t", subscription="s", consumer=name, receiver_queue=10))
            record(raw.receive_until(Subscribed))
            assert told[live[name]][0], f"{name} joined as a standby"
        assert told[live["a"]][0] == WHOLE and len(told[live["a"]]) >= 2  # a owned everything until b came
        joined = changes
        assert joined >= 4  # every join after the first took slots from someone
        for req, name in enumerate(["b", "d"], 10):
            session = live[name]
            raw.send(CloseConsumer(req=req, topic="t", subscription="s", session=session), Ping(nonce=req))
            frames = raw.receive_until(Pong)  # ranges_changed follow consumer_closed; the pong follows them
            assert ConsumerClosed(session=session, reason="closed", req=req) in frames
            del live[name]
            record(frames)
        assert changes > joined  # each leaver's slots went to someone


def test_on_ranges_changed_tells_a_consumer_its_new_ranges_at_each_join_and_leave(tmp_path: Path) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0)) as server, Client(server.url) as client:
        seen: list[list[tuple[int, int]]] = []
        a = client.subscribe("t", "s", consumer_name="a", on_ranges_changed=seen.append)
        assert seen == [WHOLE] == [a.ranges]  # told before subscribe returned
        expected = [WHOLE]
        others: dict[str, Consumer] = {}

        def step(change: Callable[[], None]) -> None:
            change()
            now = subscription_ranges(server, "t", "s")["a"]
            if now != expected[-1]:
                expected.append(now)
            wait_until(lambda: seen == expected, f"a told {expected[-1]}")
            assert a.ranges == expected[-1]

        def join(name: str) -> Callable[[], None]:
            return lambda: others.__setitem__(name, client.subscribe("t", "s", consumer_name=name))

        for name in ("b", "c"):
            step(join(name))
        for name in ("b", "c"):
            step(others.pop(name).close)
        assert seen[-1] == WHOLE and len(seen) >= 3  # b's join took slots from a; the last leave gave all back


@pytest.mark.integration
@pytest.mark.parametrize(
    ("options", "policy", "most"),
    [(("--policy", "contiguous"), "contiguous", 1), (("--max-ranges", "2"), "multi", 2)],
    ids=["contiguous", "multi-max-2"],
)
def test_serve_policy_and_max_ranges_reach_every_subscription(
    tmp_path: Path, options: tuple[str, ...], policy: str, most: int
) -> None:
    with ServerProcess(tmp_path / "data", "--metrics-port", "0", *options) as server, Client(server.url) as client:
        producer = client.create_producer("t")
        for i in range(2000):
            producer.send_async(b"x", key=f"k{i}")
        producer.flush()
        for subscription in ("s1", "s2"):
            consumers = {name: client.subscribe("t", subscription, consumer_name=name) for name in "abcdef"}
            for name in "bdf":
                consumers.pop(name).close()
        stats = json.loads(urlopen(f"{server.admin_url}/stats").read())
        assert [(sub["subscription"], sub["policy"], sub["max_ranges"]) for sub in stats["subscriptions"]] == [
            ("s1", policy, most),
            ("s2", policy, most),
        ]
        for sub in stats["subscriptions"]:
            owned = {name: info["ranges"] for name, info in sub["dispatcher"]["consumers"].items()}
            assert sorted(owned) == ["a", "c", "e"]
            assert all(1 <= len(ranges) <= most for ranges in owned.values()), owned


@pytest.mark.integration
def test_second_server_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "data"):
        done = run_cli("serve", "--data-dir", str(tmp_path / "data"), "--port", "0", timeout=60)
        assert done.returncode == 1
        assert "in use by another keyfailover server" in done.stderr


def test_negative_acknowledge_restarts_the_key_in_order(tmp_path: Path) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data")) as server, Client(server.url) as client:
        producer = client.create_producer("jobs")
        for i in range(6):
            producer.send_async(f"a{i}".encode(), key="a")
            producer.send_async(f"b{i}".encode(), key="b")
        producer.flush()
        consumer = client.subscribe("jobs", "workers", consumer_name="w", receiver_queue_size=100)
        first = [consumer.receive(timeout=5.0) for _ in range(12)]  # all prefetched
        a_messages = [m for m in first if m.key == "a"]
        for message in first:
            if message.key == "b" or message.position < a_messages[2].position:
                consumer.acknowledge(message)
        consumer.negative_acknowledge(a_messages[2])
        # The rest of key "a" comes again from the nacked position, in order, marked redelivered;
        # the prefetched later "a" messages were dropped, so nothing of "a" arrives out of order.
        again = [consumer.receive(timeout=5.0) for _ in range(4)]
        assert [m.payload for m in again] == [b"a2", b"a3", b"a4", b"a5"]
        assert all(m.redelivery_count == 1 for m in again)
        for message in again:
            consumer.acknowledge(message)
        with pytest.raises(Timeout):
            consumer.receive(timeout=0.5)


def test_asyncio_client_round_trip(tmp_path: Path) -> None:
    async def run(url: str) -> list[tuple[str | bytes | None, bytes]]:
        async with AsyncClient(url) as client:
            started = publish_clock()
            producer = await client.create_producer("async")
            positions = [await producer.send(f"m{i}".encode(), key=f"k{i % 3}") for i in range(9)]
            assert positions == list(range(1, 10))
            consumer = await client.subscribe("async", "s", consumer_name="c")
            assert consumer.ranges == WHOLE
            received = []
            for _ in range(9):
                message = await consumer.receive(timeout=5.0)
                assert message.publish_time is not None and started <= message.publish_time <= publish_clock()
                consumer.acknowledge(message)
                received.append((message.key, message.payload))
            with pytest.raises(Timeout):
                await consumer.receive(timeout=0.3)
            return received

    with ServerThread(ServerConfig(data_dir=tmp_path / "data")) as server:
        received = run_async(run(server.url))
    assert sorted(received, key=lambda item: int(item[1][1:])) == [(f"k{i % 3}", f"m{i}".encode()) for i in range(9)]


def test_publish_time_is_the_broker_clock_between_send_and_receive_and_survives_a_restart(tmp_path: Path) -> None:
    """Each message carries the broker's wall clock at its commit: after its producer began to send it and
    before its consumer got it (one machine, one clock), the same on every delivery and after a restart;
    the delivery-latency histogram counts each first delivery."""
    data = tmp_path / "data"
    sent: dict[int, int] = {}  # position -> the clock just before its send
    received: dict[int, tuple[int, int]] = {}  # position -> (publish time, the clock just after receive)
    with ServerThread(ServerConfig(data_dir=data, metrics_port=0)) as server, Client(server.url) as client:
        consumer = client.subscribe("orders", "billing", consumer_name="c")
        producer = client.create_producer("orders", "p")
        for i in range(20):
            before = publish_clock()
            sent[producer.send(f"{i}".encode(), key=f"k{i % 3}")] = before
        while len(received) < len(sent):
            message = consumer.receive(timeout=10.0)
            now = publish_clock()
            assert message.publish_time is not None
            received[message.position] = (message.publish_time, now)
            consumer.acknowledge_confirmed(message)
        assert server.admin_url is not None
        metrics = urlopen(f"{server.admin_url}/metrics").read().decode()
    assert all(sent[p] <= at <= got for p, (at, got) in received.items()), (sent, received)
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    latency = families["keyfailover_delivery_latency_seconds"]
    counts = {(s.labels["topic"], s.labels["subscription"]): s.value for s in latency.samples if "_count" in s.name}
    assert counts == {("orders", "billing"): len(sent)}
    longest = max(got - sent[p] for p, (_, got) in received.items()) / 1e6
    total = next(s.value for s in latency.samples if s.name.endswith("_sum"))
    assert 0 <= total <= longest * len(sent)  # each observation lies within its message's send -> receive
    with ServerThread(ServerConfig(data_dir=data)) as server, Client(server.url) as client:
        audit = client.subscribe("orders", "audit", consumer_name="a", receiver_queue_size=100)
        again: dict[int, int | None] = {}
        while len(again) < len(sent):
            message = audit.receive(timeout=10.0)
            again[message.position] = message.publish_time
            audit.acknowledge(message)
    assert again == {p: at for p, (at, _) in received.items()}


def frames_of(sock: socket.socket, buffer: bytearray) -> list[dict[str, object]]:
    """The next whole frames a server sent on ``sock``, as plain msgpack maps (no decoder's rules)."""
    while True:
        frames = []
        while len(buffer) >= 4 and len(buffer) >= 4 + struct.unpack(">I", buffer[:4])[0]:
            length = struct.unpack(">I", buffer[:4])[0]
            frames.append(msgpack.unpackb(bytes(buffer[4 : 4 + length]), raw=False))
            del buffer[: 4 + length]
        if frames:
            return frames
        data = sock.recv(65536)
        assert data, "the server closed the connection"
        buffer += data


@pytest.mark.integration
@pytest.mark.parametrize("version", [5, 6])
def test_an_older_client_is_served_deliveries_without_what_its_version_lacks(tmp_path: Path, version: int) -> None:
    """A client of an older protocol version connects, produces in its version's frames, and gets deliveries it
    can read (version 6: without properties; 5: without publish times either) and ack, while a current client
    beside it produces and receives properties."""
    trace = {"trace": "t-1"}
    with ServerProcess(tmp_path / "data") as server, Client(server.url) as client:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        buffer = bytearray()
        with sock:
            sock.sendall(encode(Connect(version=version, token=None, client=f"a version {version} client"), version))
            (connected,) = frames_of(sock, buffer)
            assert (connected["type"], connected["version"]) == ("connected", version)
            old_subscribe = Subscribe(req=1, topic="t", subscription="s", consumer="old", receiver_queue=10)
            sock.sendall(encode(old_subscribe, version))  # no subscription type or priority level before version 9
            subscribed = frames_of(sock, buffer)[0]
            assert subscribed["type"] == "subscribed"
            audit = client.subscribe("t", "audit", consumer_name="new")
            client.create_producer("t").send(b"new", "k", properties=trace)
            old_produce = Produce(req=2, topic="t", producer=None, messages=[(None, "k", b"v")])
            sock.sendall(encode(old_produce, version))
            frames: list[dict[str, Any]] = []

            def deliveries() -> list[list[Any]]:
                return [each for frame in frames if frame["type"] == "messages" for each in frame["messages"]]

            while len(deliveries()) < 2:
                frames += frames_of(sock, buffer)
            assert [len(each) for each in deliveries()] == [version - 1, version - 1]
            assert [each[:4] for each in deliveries()] == [[1, "k", b"new", 0], [2, "k", b"v", 0]]
            session = subscribed["session"]
            assert isinstance(session, int)
            sock.sendall(encode(Ack(topic="t", subscription="s", session=session, positions=[1, 2], req=3)))
            while not any(f["type"] == "settled" for f in frames):
                frames += frames_of(sock, buffer)
        received = [audit.receive(timeout=10) for _ in range(2)]
        assert [(m.payload, m.properties) for m in received] == [(b"new", trace), (b"v", {})]
    assert "Traceback" not in server.errors(), server.errors()


@pytest.mark.integration
def test_consumer_resumes_after_a_server_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = ServerProcess(data).start()
    port = server.port
    try:
        with Client(server.url) as client:
            producer = client.create_producer("orders", "p")
            for i in range(300):
                producer.send_async(f"{i}".encode(), key=f"k{i % 7}")
            producer.flush()
            consumer = client.subscribe("orders", "billing", consumer_name="c", receiver_queue_size=50)
            acked: set[int] = set()
            sessions_before: set[int] = set()
            for _ in range(120):
                message = consumer.receive(timeout=5.0)
                consumer.acknowledge(message)
                acked.add(message.position)
                sessions_before.add(message.session)
            assert server.stop() == 0  # clean shutdown: the cursor is persisted
            server = ServerProcess(data, port=port).start()
            for i in range(300, 400):
                producer.send_async(f"{i}".encode(), key=f"k{i % 7}")
            producer.flush()
            seen: dict[int, bytes] = {}
            sessions_after: set[int] = set()
            while len(acked | set(seen)) < 400:
                message = consumer.receive(timeout=10.0)
                seen[message.position] = message.payload
                sessions_after.add(message.session)
                consumer.acknowledge(message)
    finally:
        server.stop()
    # Session ids are never reused across restarts: a late ack of the old session cannot land on the new one.
    assert sessions_before.isdisjoint(sessions_after), (sessions_before, sessions_after)
    # At least once: every message arrives; an ack still in flight at the shutdown may repeat one.
    assert acked | set(seen) == set(range(1, 401))


def test_stored_subscriptions_are_live_after_a_restart_before_anyone_subscribes(tmp_path: Path) -> None:
    """A subscription whose consumers never come back still shows its backlog and its 0 consumers."""
    data = tmp_path / "data"
    with ServerThread(ServerConfig(data_dir=data)) as server, Client(server.url) as client:
        producer = client.create_producer("orders")
        for i in range(30):
            producer.send_async(b"x", key=f"k{i}")
        producer.flush()
        consumer = client.subscribe("orders", "billing", consumer_name="c")
        consumer.acknowledge(consumer.receive(timeout=5.0))
        consumer.close()
    with ServerThread(ServerConfig(data_dir=data, metrics_port=0)) as server:
        assert server.admin_url is not None
        listing = json.loads(urlopen(f"{server.admin_url}/ranges").read())
        assert [(s["topic"], s["subscription"], s["ranges"]["ranges"]) for s in listing["subscriptions"]] == [
            ("orders", "billing", [])
        ]
        (sub,) = json.loads(urlopen(f"{server.admin_url}/stats").read())["subscriptions"]
        assert sub["last_position"] == 30 and sub["dispatcher"]["consumers"] == {}
        metrics = urlopen(f"{server.admin_url}/metrics").read().decode()
        assert 'keyfailover_consumers{partition="",subscription="billing",topic="orders"} 0.0' in metrics


@pytest.mark.integration
def test_log_level_info_logs_each_consumer_sessions_start_and_end(tmp_path: Path) -> None:
    """``--log-level info``: a line when a consumer joins and when it leaves, with why; the default
    (warning) logs neither."""
    with ServerProcess(tmp_path / "info", "--log-level", "info") as server, Client(server.url) as client:
        client.subscribe("orders", "billing", consumer_name="c1").close()
        wait_until(lambda: "leaves" in server.errors(), "the leave logged")
        log = server.errors()
    assert "INFO keyfailover.server: consumer 'c1' joins orders/billing" in log
    assert "; consumers now 1)" in log
    assert "INFO keyfailover.server: consumer 'c1' leaves orders/billing" in log
    assert ", closed; consumers now 0)" in log
    with ServerProcess(tmp_path / "quiet") as server, Client(server.url) as client:
        client.subscribe("orders", "billing", consumer_name="c1").close()
        quiet = server.errors()
    assert "joins" not in quiet and "leaves" not in quiet
