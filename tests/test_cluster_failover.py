"""Brokers of a cluster failing: real ``keyfailover serve --cluster`` processes over the test
session's ZooKeeper and PostgreSQL, killed (SIGKILL) and suspended (SIGSTOP) under traffic.

Every test checks the invariants: no acknowledged produce lost, each key's produced order a
subsequence of its consumed order, and never two brokers serving one partition: each owner
epoch belongs to one broker (from the brokers' own ownership events), and a partition's
messages were written under non-decreasing epochs (from the ``epoch`` PostgreSQL records with
every row), so a broker that lost a partition never wrote after its successor.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, Literal, Protocol

import asyncpg
import pytest

from keyfailover.client import Client, Message, NoBrokerError
from keyfailover.core.errors import KeyFailoverError
from keyfailover.core.partitions import partition_of_key, partition_topic
from keyfailover.tools._ownership import lease_events, ownership_events
from keyfailover.tools.chaos import Acked, Delivered, Record, held_twice
from keyfailover.tools.services import PostgreSQL, ZooKeeper, free_port
from tests.aio import run_async
from tests.server_process import ServerProcess, run_cli, wait_until

SESSION = 1.0  # the brokers' ZooKeeper session timeout in these tests
WAIT = 60.0


class LogStore(Protocol):
    """The brokers' store: a PostgreSQL server, or a replicated group of them."""

    @property
    def dsn(self) -> str:
        """The URL the brokers take as ``--store``."""
        ...


_SERVES = re.compile(r"broker (\S+) serves '([^']+)' at owner epoch (\d+)")


@pytest.fixture
def cluster(zookeeper: ZooKeeper) -> Iterator[str]:
    """A fresh cluster root in the shared ZooKeeper."""
    yield f"zk://{zookeeper.hosts}/kf-failover-{uuid.uuid4().hex[:8]}"


def broker(cluster: str, postgres: LogStore, *extra: str) -> ServerProcess:
    port = free_port()
    return ServerProcess(
        None,
        "--cluster",
        cluster,
        "--store",
        postgres.dsn,
        "--cluster-session-timeout",
        str(SESSION),
        "--advertise",
        f"127.0.0.1:{port}",
        *extra,
        port=port,
    ).start()


@contextlib.contextmanager
def running(
    cluster: str, postgres: LogStore, count: int, partitions: int, *extra: str
) -> Iterator[tuple[str, list[ServerProcess]]]:
    """``count`` brokers (``extra`` their options) serving a new topic of ``partitions`` partitions, each
    broker some: the topic and the brokers (a test may add restarted ones); every one still running is
    stopped afterwards."""
    topic = f"orders-{uuid.uuid4().hex[:6]}"
    brokers: list[ServerProcess] = []
    try:
        brokers += [broker(cluster, postgres, *extra) for _ in range(count)]
        assert run_cli("topics", "create", topic, "--partitions", str(partitions), "--cluster", cluster).returncode == 0
        wait_until(lambda: len(set(served_by(cluster).values())) == count, f"all {count} brokers serving partitions")
        yield topic, brokers
    finally:
        for process in brokers:
            if process.process is not None and process.process.poll() is None:
                process.stop()


def url_of(brokers: list[ServerProcess]) -> str:
    """The client URL naming every broker."""
    return "kf://" + ",".join(f"127.0.0.1:{b.port}" for b in brokers)


def status(cluster: str) -> dict[str, Any]:
    done = run_cli("cluster", "status", "--cluster", cluster, "--json")
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def served_by(cluster: str) -> dict[tuple[str, int], str]:
    return {(p["topic"], p["partition"]): p["broker"] for p in status(cluster)["assignment"]["partitions"]}


def epochs_of_events(brokers: list[ServerProcess]) -> dict[tuple[str, int], str]:
    """(served topic, owner epoch) -> the broker that opened the partition at that epoch, from its stderr;
    fails when two brokers claim one epoch."""
    owners: dict[tuple[str, int], str] = {}
    for process in brokers:
        for broker_id, served, epoch in _SERVES.findall(process.errors()):
            key = (served, int(epoch))
            assert owners.setdefault(key, broker_id) == broker_id, f"two brokers opened {served} at epoch {epoch}"
    return owners


def stored_column(
    postgres: LogStore, topic: str, column: Literal["epoch", "seq"], producer: str | None = None
) -> dict[int, list[int]]:
    """Partition -> ``column`` (the owner epoch or the sequence id) of each of its messages, in position order;
    with ``producer``, of that producer's messages only."""
    only = "" if producer is None else " AND producer = $2"

    async def fetch() -> list[Any]:
        connection = await asyncpg.connect(postgres.dsn)
        try:
            return list(
                await connection.fetch(
                    f"SELECT partition, {column} FROM kf_messages WHERE topic = $1{only} ORDER BY partition, position",
                    *([topic] if producer is None else [topic, producer]),
                )
            )
        finally:
            await connection.close()

    found: dict[int, list[int]] = defaultdict(list)
    for row in run_async(fetch()):
        found[int(row["partition"])].append(int(row[column]))
    return found


def check_one_writer(postgres: LogStore, topic: str, partitions: int, brokers: list[ServerProcess]) -> None:
    owners = epochs_of_events(brokers)
    for partition, epochs in stored_column(postgres, topic, "epoch").items():
        assert epochs == sorted(epochs), f"partition {partition}: a fenced broker wrote after its successor"
        served = partition_topic(topic, partition, partitions)
        assert {(served, e) for e in epochs} <= owners.keys(), f"partition {partition}: an epoch no broker opened"


class Traffic:
    """A producer thread sending numbered messages per key until stopped, recording what was acknowledged."""

    def __init__(self, client: Client, topic: str, keys: list[str]) -> None:
        self._producer = client.create_producer(topic, "traffic")
        self._keys = keys
        self.acked: dict[str, list[int]] = defaultdict(list)
        self.failed: list[BaseException] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Traffic:
        self._thread.start()
        return self

    def _run(self) -> None:
        number = 0
        while not self._stop.is_set():
            for key in self._keys:
                payload = f"{key}:{number}".encode()

                def done(position: int | None, error: BaseException | None, key: str = key, n: int = number) -> None:
                    with self._lock:
                        if error is None:
                            self.acked[key].append(n)
                        else:
                            self.failed.append(error)

                self._producer.send_async(payload, key, done)
            number += 1
            self._stop.wait(0.01)

    def sent(self) -> int:
        with self._lock:
            return sum(map(len, self.acked.values()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=WAIT)
        self._producer.flush(timeout=WAIT)


def consume_all(client: Client, topic: str, acked: dict[str, list[int]]) -> dict[str, list[int]]:
    """Receive until every acknowledged message arrived; each key's consumed numbers in order (with duplicates)."""
    consumer = client.subscribe(topic, "audit", "auditor", receiver_queue_size=500)
    wanted = {(key, n) for key, numbers in acked.items() for n in numbers}
    seen: dict[str, list[int]] = defaultdict(list)
    deadline = time.monotonic() + WAIT
    while wanted and time.monotonic() < deadline:
        message = consumer.receive(timeout=WAIT)
        consumer.acknowledge(message)
        key, number = message.payload.decode().rsplit(":", 1)
        seen[key].append(int(number))
        wanted.discard((key, int(number)))
    assert not wanted, f"{len(wanted)} acknowledged messages never consumed, e.g. {sorted(wanted)[:5]}"
    consumer.close()
    return seen


def check_order(acked: dict[str, list[int]], consumed: dict[str, list[int]]) -> None:
    """Per key, the acknowledged numbers are a subsequence of the consumed order (OrderChecker)."""
    for key, numbers in acked.items():
        stream = iter(consumed[key])
        assert all(any(n == got for got in stream) for n in sorted(numbers)), f"key {key}: order broken"


def flows_again_and_holds(
    client: Client, traffic: Traffic, postgres: LogStore, topic: str, *, partitions: int, brokers: list[ServerProcess]
) -> None:
    """Traffic flows again after a fault, then stops: no send failed, every acknowledged message is consumed,
    in each key's order, and each partition had one writer at a time."""
    before = traffic.sent()
    wait_until(lambda: traffic.sent() > before + 300, "traffic flowing again", timeout=WAIT)
    traffic.stop()
    assert traffic.failed == []
    consumed = consume_all(client, topic, traffic.acked)
    check_order(traffic.acked, consumed)
    check_one_writer(postgres, topic, partitions, brokers)


def test_a_killed_broker_s_partitions_are_served_again_and_nothing_acknowledged_is_lost(
    cluster: str, postgres: PostgreSQL
) -> None:
    with running(cluster, postgres, 3, 6) as (topic, brokers):
        url = url_of(brokers)
        keys = [f"key-{i}" for i in range(24)]
        assert {partition_of_key(k, 6) for k in keys} == set(range(6))
        with Client(url) as client:
            traffic = Traffic(client, topic, keys).start()
            wait_until(lambda: traffic.sent() > 500, "traffic through every partition")
            victim_id = served_by(cluster)[(topic, 0)]
            victim = next(b for b in brokers if f"127.0.0.1:{b.port}" == victim_id)
            before = traffic.sent()
            victim.kill()
            killed = time.monotonic()
            wait_until(lambda: victim_id not in served_by(cluster).values(), "its partitions reassigned", timeout=WAIT)
            wait_until(lambda: traffic.sent() > before + 500, "traffic flowing again", timeout=WAIT)
            print(f"partitions served again and traffic flowing {time.monotonic() - killed:.2f} s after the kill")
            traffic.stop()
            assert traffic.failed == []
            consumed = consume_all(client, topic, traffic.acked)
        check_order(traffic.acked, consumed)
        check_one_writer(postgres, topic, 6, brokers)
        survivors = {b["id"] for b in status(cluster)["brokers"]}
        assert victim_id not in survivors and len(survivors) == 2


def kill_and_restart(cluster: str, brokers: list[ServerProcess], traffic: Traffic) -> None:
    """SIGKILL the last broker, wait until the first serves everything, restart it on its address (appended
    to ``brokers``: every incarnation's events stay readable) and wait until it serves again under traffic."""
    victim = brokers[-1]
    victim_id = f"127.0.0.1:{victim.port}"
    before = traffic.sent()
    victim.kill()
    wait_until(lambda: set(served_by(cluster).values()) == {f"127.0.0.1:{brokers[0].port}"}, "its partitions moved")
    brokers.append(ServerProcess(None, *victim.extra, port=victim.port).start())
    wait_until(lambda: victim_id in served_by(cluster).values(), "some partitions back on it")
    wait_until(lambda: traffic.sent() > before + 200, "traffic flowing again", timeout=WAIT)


def test_partitions_that_move_away_and_back_keep_every_batch_in_order(cluster: str, postgres: PostgreSQL) -> None:
    """A broker killed and restarted on its address, twice: its partitions move to the other broker and
    back. The producer's batches follow them over three connections; each partition must hold its
    sequence ids without a gap (a gap is a batch stored ahead of an earlier one, which is then
    refused as a duplicate of ids never stored)."""
    with running(cluster, postgres, 2, 4) as (topic, brokers):
        url = url_of(brokers)
        with Client(url) as client:
            traffic = Traffic(client, topic, [f"key-{i}" for i in range(16)]).start()
            for _ in range(2):
                kill_and_restart(cluster, brokers, traffic)
            traffic.stop()
            assert traffic.failed == []
            consumed = consume_all(client, topic, traffic.acked)
        check_order(traffic.acked, consumed)
        for partition, seqs in stored_column(postgres, topic, "seq", "traffic").items():
            gaps = [(a, b) for a, b in itertools.pairwise(seqs) if b != a + 1]
            assert gaps == [], f"partition {partition}: sequence ids skipped, e.g. {gaps[:3]}"
        check_one_writer(postgres, topic, 4, brokers)


class Holder:
    """A consumer on its own thread that acks each message with ``acknowledge_confirmed`` and records
    every holding the broker confirmed: (key, received, ack sent). A message received after a key's
    range moved is delivered only once its former holder's ack was processed (G1), so the holding of
    another consumer starts after the ack was sent; an ack the broker did not confirm (its session
    ended with a killed broker) holds nothing any more and is not recorded."""

    def __init__(self, client: Client, topic: str, name: str) -> None:
        self.name = name
        self._consumer = client.subscribe(topic, "holders", name, receiver_queue_size=20)
        self.held: list[tuple[str, float, float]] = []
        self._values: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            batch: list[tuple[Message, float]] = []
            try:  # up to 10 held at once: one waited for, the others already prefetched
                while len(batch) < 10:
                    batch.append((self._consumer.receive(timeout=0.2 if not batch else 0), time.monotonic()))
            except TimeoutError:
                pass
            for message, received in batch:
                sent = time.monotonic()
                try:
                    self._consumer.acknowledge_confirmed(message, timeout=WAIT)
                except (KeyFailoverError, TimeoutError):
                    continue  # its session ended (a broker died): the broker took it back
                assert isinstance(message.key, str)
                self.held.append((message.key, received, sent))
                key, number = message.payload.decode().rsplit(":", 1)
                with self._lock:
                    self._values.add((key, int(number)))

    def values(self) -> set[tuple[str, int]]:
        """``(key, number)`` of every message received and acked with the broker's confirmation."""
        with self._lock:
            return set(self._values)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=WAIT)
        self._consumer.close()


def test_no_two_consumers_hold_one_keys_messages_at_once_across_a_broker_kill(
    cluster: str, postgres: PostgreSQL
) -> None:
    with running(cluster, postgres, 2, 4) as (topic, brokers):
        url = url_of(brokers)
        with Client(url) as producing, Client(url) as first, Client(url) as second:
            traffic = Traffic(producing, topic, [f"key-{i}" for i in range(16)]).start()
            holders = [Holder(first, topic, "h1")]
            wait_until(lambda: len(holders[0].held) > 100, "the first consumer holding and acking")
            holders.append(Holder(second, topic, "h2"))  # ranges move to it while keys are held
            wait_until(lambda: len(holders[1].held) > 100, "the second consumer holding and acking")
            before = [len(h.held) for h in holders]
            brokers[1].kill()
            wait_until(
                lambda: all(len(h.held) > n + 100 for h, n in zip(holders, before, strict=True)),
                "both consumers holding and acking after the kill",
                timeout=WAIT,
            )
            traffic.stop()
            for holder in holders:
                holder.stop()
        records: list[Record] = []
        for holder in holders:
            for value, (key, received, sent) in enumerate(holder.held):
                records += [
                    Delivered(received, holder.name, key, value, 0, value),
                    Acked(sent, holder.name, key, value, 0, value, True),
                ]
        assert all(holder.held for holder in holders)
        verdict = held_twice(records)
        assert verdict.passed, verdict.examples


def test_a_suspended_broker_cannot_write_after_its_session_and_rejoins_as_a_follower(
    cluster: str, postgres: PostgreSQL
) -> None:
    with running(cluster, postgres, 2, 4) as (topic, brokers):
        coordinator = status(cluster)["coordinator"]
        frozen = next(b for b in brokers if f"127.0.0.1:{b.port}" == coordinator)
        frozen_id = coordinator
        url = url_of(brokers)
        keys = [f"key-{i}" for i in range(16)]
        with Client(url) as client:
            traffic = Traffic(client, topic, keys).start()
            wait_until(lambda: traffic.sent() > 300, "traffic through every partition")
            frozen.suspend()  # its clients' produce requests wait in its socket buffers
            wait_until(lambda: frozen_id not in served_by(cluster).values(), "its partitions given to the other")
            frozen.resume()
            # It comes back with a new session, as a follower: the other broker coordinates now.
            wait_until(
                lambda: (
                    (found := status(cluster))["coordinator"] != frozen_id
                    and frozen_id in {b["id"] for b in found["brokers"]}
                ),
                "the suspended broker back as a follower",
            )
            flows_again_and_holds(client, traffic, postgres, topic, partitions=4, brokers=brokers)
        # Whatever it still had to write after the takeover was refused: by its stale lease
        # (fenced) or because it had stopped serving (not_owner); never stored under its old epoch.
        events = frozen.errors()
        assert "stops serving" in events
        # It paused every partition when it woke, its lease lapsed before the other broker took them over:
        # from the lapse on it delivered nothing and settled no ack (two owners never acted at once).
        lapses = [change for change in lease_events(events) if change.lapsed]
        assert lapses, events
        takeovers = [
            event.at
            for other in brokers
            if other is not frozen
            for event in ownership_events(other.errors(), topic)
            if event.serves and event.epoch > 1  # epoch 1: the first owner; later ones took over
        ]
        assert takeovers
        assert lapses[0].at < min(takeovers)


def test_killing_the_coordinator_elects_another_under_a_new_epoch_and_status_shows_consumers(
    cluster: str, postgres: PostgreSQL
) -> None:
    with running(cluster, postgres, 2, 2, "--metrics-port", "0") as (topic, brokers), Client(url_of(brokers)) as client:
        consumer = client.subscribe(topic, "s", "c1")
        shown = status(cluster)
        ranges = {(e["topic"], e["partition"]): e["consumers"] for e in shown["subscriptions"]}
        assert ranges == {(topic, 0): {"c1": [[0, 32767]]}, (topic, 1): {"c1": [[32768, 65535]]}}
        assert shown["unreachable"] == {}
        text = run_cli("cluster", "status", "--cluster", cluster)
        assert "s: c1 [0, 32767]" in text.stdout and "s: c1 [32768, 65535]" in text.stdout
        first, epoch = shown["coordinator"], shown["epoch"]
        old = next(b for b in brokers if f"127.0.0.1:{b.port}" == first)
        old.kill()
        wait_until(lambda: status(cluster)["coordinator"] not in (None, first), "another coordinator")
        after = status(cluster)
        assert after["epoch"] == epoch + 1
        assert after["assignment"]["epoch"] == epoch + 1  # the new coordinator's assignment
        wait_until(lambda: set(served_by(cluster).values()) == {after["coordinator"]}, "both partitions moved")
        consumer.close()


def test_a_broker_says_which_service_it_cannot_reach_and_exits(zookeeper: ZooKeeper, postgres: PostgreSQL) -> None:
    closed = free_port()
    no_zk = run_cli(
        "serve",
        "--cluster",
        f"zk://127.0.0.1:{closed}/x",
        "--store",
        postgres.dsn,
        "--port",
        "0",
        "--cluster-session-timeout",
        "1",
    )
    assert no_zk.returncode == 1 and "Traceback" not in no_zk.stderr
    assert f"cannot reach ZooKeeper at 127.0.0.1:{closed}" in no_zk.stderr
    no_pg = run_cli(
        "serve",
        "--cluster",
        f"zk://{zookeeper.hosts}/x",
        "--store",
        f"postgresql://kf@127.0.0.1:{closed}/kf",
        "--port",
        "0",
    )
    assert no_pg.returncode == 1 and "Traceback" not in no_pg.stderr
    assert f"cannot reach PostgreSQL at postgresql://kf@127.0.0.1:{closed}/kf" in no_pg.stderr
    half = run_cli("serve", "--cluster", f"zk://{zookeeper.hosts}/x", "--port", "0")
    assert half.returncode == 2 and "needs both --cluster" in half.stderr


def test_a_client_given_no_live_broker_says_so() -> None:
    first, second = free_port(), free_port()
    with pytest.raises(NoBrokerError, match=rf"no broker of kf://127.0.0.1:{first},127.0.0.1:{second} could be"):
        Client(f"kf://127.0.0.1:{first},127.0.0.1:{second}", connect_timeout=2)


def test_a_consumer_subscribed_while_partitions_move_away_and_back_gets_every_message(
    cluster: str, postgres: PostgreSQL
) -> None:
    """The consumer stays subscribed while a broker is killed (its partitions move to the other) and
    restarted (some come back): each partition's part of the consumer follows, and every message the
    producer had confirmed reaches it, also those stored after the partitions came back."""
    with running(cluster, postgres, 2, 4) as (topic, brokers):
        url = url_of(brokers)
        with Client(url) as producing, Client(url) as consuming:
            traffic = Traffic(producing, topic, [f"key-{i}" for i in range(16)]).start()
            holder = Holder(consuming, topic, "stays")
            wait_until(lambda: len(holder.held) > 100, "the consumer receiving")
            kill_and_restart(cluster, brokers, traffic)
            after = traffic.sent()
            wait_until(lambda: traffic.sent() > after + 500, "traffic stored after the partitions came back")
            traffic.stop()
            wanted = {(key, n) for key, numbers in traffic.acked.items() for n in numbers}
            wait_until(lambda: wanted <= holder.values(), "every confirmed message received", timeout=WAIT)
            holder.stop()


def test_a_suspended_broker_s_partitions_are_all_served_again_while_it_sleeps(
    cluster: str, postgres: PostgreSQL
) -> None:
    """A broker serving several partitions, each under traffic, is SIGSTOPped and kept stopped until
    every one of its partitions is served by another broker: none may wait for it to wake, whatever
    its PostgreSQL connections were doing (a write stopped between its statements holds the
    partition's row lock) or its ZooKeeper session and lease."""
    with running(cluster, postgres, 3, 6) as (topic, brokers):
        url = url_of(brokers)
        keys = [f"key-{i}" for i in range(24)]
        with Client(url) as client:
            traffic = Traffic(client, topic, keys).start()
            wait_until(lambda: traffic.sent() > 600, "traffic through every partition")
            owners = served_by(cluster)
            frozen = max(brokers, key=lambda b: sum(o == f"127.0.0.1:{b.port}" for o in owners.values()))
            frozen_id = f"127.0.0.1:{frozen.port}"
            held = {partition for (_, partition), owner in owners.items() if owner == frozen_id}
            assert len(held) >= 2
            others = [b for b in brokers if b is not frozen]
            stopped = time.time()
            frozen.suspend()
            try:

                def taken_over() -> set[int]:
                    return {
                        event.partition
                        for other in others
                        for event in ownership_events(other.errors(), topic)
                        if event.serves and event.at >= stopped
                    }

                wait_until(lambda: held <= taken_over(), "every partition of the stopped broker served again")
                latest = max(
                    event.at
                    for other in others
                    for event in ownership_events(other.errors(), topic)
                    if event.serves and event.at >= stopped and event.partition in held
                )
                print(f"{len(held)} partitions served again {latest - stopped:.2f} s after the stop")
            finally:
                frozen.resume()
            flows_again_and_holds(client, traffic, postgres, topic, partitions=6, brokers=brokers)
