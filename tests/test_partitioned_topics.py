"""Partitioned topics on one server: P partitions fixed at creation, each a dispatcher over its
block of slots, one map and one receive/ack API for the user."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from urllib.request import Request, urlopen

import pytest

from keyfailover.broker.server import ServerConfig, SubscriptionConfig
from keyfailover.client import Client, Message
from keyfailover.core.dispatcher import DeliverySettings
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hash
from keyfailover.core.partitions import partition_of_key, partition_slots, partition_topic, split_partition_topic
from keyfailover.wire.protocol import Error, ErrorCode, Lookup, Produce, Receipt, Route, Subscribe, Subscribed
from tests.server_process import RawConnection, ServerThread, run_main, wait_until

WAIT = 30.0


def admin(server: ServerThread, path: str, method: str = "GET") -> dict[str, object]:
    assert server.admin_url is not None
    with urlopen(Request(server.admin_url + path, method=method), timeout=10) as response:
        found: dict[str, object] = json.load(response)
        return found


def test_partition_names_round_trip() -> None:
    assert (partition_of_key("a", 4), partition_of_key("k", 4)) == (1, 2)  # the wrong-partition case below
    assert partition_topic("orders", 3, 8) == "orders-partition-3"
    assert partition_topic("orders", 0, 1) == "orders"
    assert split_partition_topic("orders-partition-3") == ("orders", 3)
    assert split_partition_topic("a-partition-b-partition-12") == ("a-partition-b", 12)
    for plain in ("orders", "orders-partition-", "-partition-3", "orders-partition-03", "orders-partition-x"):
        assert split_partition_topic(plain) is None, plain


def test_keys_go_to_their_partitions_and_every_key_keeps_its_order(tmp_path: Path) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0)) as server:
        created = run_main("topics", "create", "orders", "--partitions", "4", "--admin-url", str(server.admin_url))
        assert created.returncode == 0, created.stderr
        assert "created with 4 partition(s)" in created.stdout
        with Client(server.url) as client:
            first = client.subscribe("orders", "s", "c1", receiver_queue_size=50)
            second = client.subscribe("orders", "s", "c2", receiver_queue_size=50)
            producer = client.create_producer("orders", "p")
            sent: dict[str | None, list[bytes]] = defaultdict(list)
            for i in range(2000):
                key = None if i % 10 == 0 else f"key-{i % 97}"
                payload = f"{key}:{i}".encode()
                producer.send_async(payload, key)
                sent[key].append(payload)
            producer.flush(timeout=WAIT)
            got: dict[str | None, list[Message]] = defaultdict(list)
            holder: dict[str, str] = {}
            consumers = [first, second]
            while sum(map(len, got.values())) < 2000:
                for consumer in consumers:
                    for _ in range(50):
                        try:
                            message = consumer.receive(timeout=0.05 if sum(map(len, got.values())) else WAIT)
                        except TimeoutError:
                            break
                        consumer.acknowledge(message)
                        assert isinstance(message.key, str | None)
                        got[message.key].append(message)
                        if message.key is not None:
                            # One consumer per key over the run (no rebalance happens once both joined).
                            assert holder.setdefault(message.key, consumer.consumer_name) == consumer.consumer_name
            ranges = admin(server, "/ranges?topic=orders&subscription=s")
            held = sorted(first.ranges + second.ranges)  # per partition: one merged map joins neighbours
            mine = first.ranges
        for key, payloads in sent.items():
            assert (
                [m.payload for m in got[key]] == payloads
                if key is not None
                else sorted(m.payload for m in got[key]) == sorted(payloads)
            )
            if key is not None:
                assert {m.partition for m in got[key]} == {partition_of_key(key, 4)}
        keyless_partitions = {m.partition for m in got[None]}
        assert keyless_partitions == {0, 1, 2, 3}  # round robin
        # One map over the four partitions: it tiles the slot space, each consumer in every block.
        entries = ranges["ranges"]
        assert isinstance(entries, list)
        assert entries[0]["start"] == 0 and entries[-1]["end"] == HASH_RANGE_SIZE - 1
        assert all(a["end"] + 1 == b["start"] for a, b in itertools.pairwise(entries))
        for partition in range(4):
            start, end = partition_slots(partition, 4)
            owners = {e["consumer"] for e in entries if e["start"] <= end and e["end"] >= start}
            assert owners == {"c1", "c2"}, (partition, owners)
        slots = {
            e["consumer"]: {
                s for x in entries if x["consumer"] == e["consumer"] for s in range(x["start"], x["end"] + 1)
            }
            for e in entries
        }
        assert {s for start, end in held for s in range(start, end + 1)} == slots["c1"] | slots["c2"]
        assert {s for start, end in mine for s in range(start, end + 1)} == slots["c1"]


def test_a_partition_count_is_fixed_and_survives_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with ServerThread(ServerConfig(data_dir=data, metrics_port=0)) as server:
        url = str(server.admin_url)
        assert run_main("topics", "create", "orders", "--partitions", "8", "--admin-url", url).returncode == 0
        again = run_main("topics", "create", "orders", "--partitions", "8", "--admin-url", url)
        assert again.returncode == 0 and "exists already" in again.stdout
        other = run_main("topics", "create", "orders", "--partitions", "3", "--admin-url", url)
        assert other.returncode == 1
        assert "exists with 8 partitions" in other.stderr and "Traceback" not in other.stderr
        with Client(server.url) as client:
            client.create_producer("plain").send(b"x", "k")
        held = run_main("topics", "create", "plain", "--partitions", "2", "--admin-url", url)
        assert held.returncode == 1 and "already holds messages" in held.stderr
    with ServerThread(ServerConfig(data_dir=data, metrics_port=0)) as server:
        assert admin(server, "/topics")["partitioned"] == {"orders": 8}
        connection = RawConnection(server.port)
        connection.connect()
        connection.send(Lookup(req=1, topic="orders"), Lookup(req=2, topic="new"))
        assert connection.receive() == Route(req=1, topic="orders", brokers=[""] * 8)
        assert connection.receive() == Route(req=2, topic="new", brokers=[""])
        connection.close()


@pytest.mark.parametrize(
    ("frame", "says"),
    [
        (Produce(req=1, topic="orders", producer=None, messages=[(None, "k", b"x")]), "has 4 partitions; produce to"),
        (
            Subscribe(req=1, topic="orders", subscription="s", consumer="c", receiver_queue=10),
            "has 4 partitions; subscribe to",
        ),
        (
            Subscribe(req=1, topic="orders-partition-4", subscription="s", consumer="c", receiver_queue=10),
            "has no partition 4",
        ),
        (  # "a" is in partition 1 and "k" in partition 2 (slots 27058 and 42449)
            Produce(req=1, topic="orders-partition-1", producer=None, messages=[(None, "a", b"x"), (None, "k", b"x")]),
            f"message 1's key 'k' hashes to slot {key_hash('k')}, outside 'orders-partition-1''s slots 16384 to 32767",
        ),
    ],
    ids=["produce-to-the-topic", "subscribe-to-the-topic", "no-such-partition", "key-of-another-partition"],
)
def test_requests_to_the_wrong_partition_are_refused_and_store_nothing(
    tmp_path: Path, frame: Produce | Subscribe, says: str
) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0)) as server:
        assert admin(server, "/topics?topic=orders&partitions=4", "POST")["created"] is True
        connection = RawConnection(server.port)
        connection.connect()
        connection.send(frame)
        error = connection.receive()
        assert isinstance(error, Error) and error.code == ErrorCode.WRONG_PARTITION and error.req == 1, error
        assert says in error.message
        # The connection goes on, and nothing was stored.
        home = partition_topic("orders", partition_of_key("k", 4), 4)
        connection.send(Produce(req=2, topic=home, producer=None, messages=[(None, "k", b"y")]))
        assert connection.receive() == Receipt(req=2, positions=[1], duplicates=[False])
        connection.send(Subscribe(req=3, topic=home, subscription="s", consumer="c", receiver_queue=10))
        assert isinstance(connection.receive(), Subscribed)
        connection.close()
        assert admin(server, "/topics")["served"] == [home]


def test_settings_of_a_partitioned_subscription_apply_to_every_partition(tmp_path: Path) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0)) as server, Client(server.url) as client:
        admin(server, "/topics?topic=orders&partitions=3", "POST")
        consumer = client.subscribe("orders", "s", "c")
        changed = admin(server, "/consume-mode?topic=orders&subscription=s&mode=unordered", "POST")
        assert changed == {"topic": "orders", "subscription": "s", "consume_mode": "unordered", "was": "ordered"}
        configured = admin(server, "/subscription-settings?topic=orders&subscription=s&ack_timeout=7", "POST")
        assert configured["own"] == ["ack_timeout"] and configured["live"] is True
        stats = admin(server, "/stats")["subscriptions"]
        assert isinstance(stats, list)
        assert sorted(s["topic"] for s in stats) == [partition_topic("orders", p, 3) for p in range(3)]
        assert {(s["consume_mode"], s["ack_timeout"]) for s in stats} == {("unordered", 7.0)}
        consumer.close()


def test_dead_letters_of_a_partitioned_subscription_are_listed_and_replayed_per_partition(tmp_path: Path) -> None:
    with (
        ServerThread(
            ServerConfig(
                data_dir=tmp_path / "data",
                metrics_port=0,
                subscription=SubscriptionConfig(delivery=DeliverySettings(max_redeliveries=0)),
            )
        ) as server,
        Client(server.url) as client,
    ):
        admin(server, "/topics?topic=orders&partitions=4", "POST")
        consumer = client.subscribe("orders", "s", "c")
        producer = client.create_producer("orders", "p")
        for key in ("a", "k"):  # partitions 1 and 2
            producer.send(key.encode(), key)
        for _ in range(2):
            consumer.negative_acknowledge(consumer.receive(timeout=WAIT))
        # A nack is sent without waiting, and each partition's subscription stores its letter on its own.
        dlq = "/dlq?topic=orders&subscription=s"

        def both_stored() -> bool:
            letters = admin(server, dlq)["dead_letters"]
            return isinstance(letters, list) and len(letters) == 2

        wait_until(both_stored, "both dead letters stored")
        listed = admin(server, dlq)
        letters = listed["dead_letters"]
        assert isinstance(letters, list) and listed["dlq_topic"] is None
        assert sorted((e["partition"], e["key"], e["position"]) for e in letters) == [(1, "a", 1), (2, "k", 1)]
        replayed = admin(server, "/dlq/replay?topic=orders&subscription=s", "POST")
        assert replayed["replayed"] == 2 and replayed["not_served_here"] == []
        assert replayed["by_partition"] == {f"orders-partition-{p}": [2] if p in (1, 2) else [] for p in range(4)}
        again = sorted((m.key, m.partition, m.position) for m in [consumer.receive(timeout=WAIT) for _ in range(2)])
        assert again == [("a", 1, 2), ("k", 2, 2)]


def test_the_command_line_produces_and_consumes_a_partitioned_topic(tmp_path: Path) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0)) as server:
        admin(server, "/topics?topic=orders&partitions=4", "POST")
        url = ("--url", server.url)
        produced = run_main("produce", "--topic", "orders", "--key-field", ",", *url, stdin="a,1\nk,2\na,3\n")
        assert produced.returncode == 0, produced.stderr
        assert "stored 3 messages in 'orders' over 4 partitions (positions count within each)" in produced.stderr + (
            produced.stdout
        )
        text = run_main("consume", "--topic", "orders", "--subscription", "t", "--idle-timeout", "1", *url).stdout
        assert sorted(text.splitlines()) == ["1:1\ta\t1", "1:2\ta\t3", "2:1\tk\t2"]
        lines = run_main(
            "consume", "--topic", "orders", "--subscription", "j", "--idle-timeout", "1", "--json", *url
        ).stdout.splitlines()
        assert sorted((r["partition"], r["position"], r["key"]) for r in map(json.loads, lines)) == [
            (1, 1, "a"),
            (1, 2, "a"),
            (2, 1, "k"),
        ]


def test_the_history_of_a_partitioned_subscription_is_one_map_and_plots(tmp_path: Path) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0)) as server, Client(server.url) as client:
        admin(server, "/topics?topic=orders&partitions=2", "POST")
        first = client.subscribe("orders", "s", "c1")
        client.subscribe("orders", "s", "c2")
        history = admin(server, "/history?topic=orders&subscription=s")["history"]
        assert isinstance(history, list)
        maps = [entry["snapshot"]["ranges"] for entry in history]
        # Each map tiles the whole space; the first is c1 alone (its two partitions merged), the last
        # has c2 in both blocks; one map per change of a partition once both had consumers.
        assert maps[0] == [{"start": 0, "end": 65535, "consumer": "c1"}]
        assert {e["consumer"] for e in maps[-1] if e["end"] <= 32767} == {"c1", "c2"}
        assert {e["consumer"] for e in maps[-1] if e["start"] >= 32768} == {"c1", "c2"}
        assert len(maps) == 3
        shown = {slot for e in maps[-1] if e["consumer"] == "c1" for slot in range(e["start"], e["end"] + 1)}
        assert shown == {slot for start, end in first.ranges for slot in range(start, end + 1)}
        out = tmp_path / "ownership.png"
        plotted = run_main(
            "plot", "--admin-url", str(server.admin_url), "--topic", "orders", "--subscription", "s", "--out", str(out)
        )
        assert plotted.returncode == 0, plotted.stderr
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
