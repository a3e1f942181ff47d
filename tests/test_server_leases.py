"""Leases and dead letters through a real server (issue 13): a stuck consumer, a poison message, extend.

Each test starts ``keyfailover serve`` on loopback with a short ``--ack-timeout``; the
clients are the project's own. Times are measured and recorded (``record_property``), never
asserted: what is asserted is who received what, in which order, and that nothing was lost.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest

from keyfailover.broker.server import ServerConfig, SubscriptionConfig
from keyfailover.client import Client, Consumer, LeaseExpiredError, Message, Timeout
from keyfailover.core.dispatcher import DeliverySettings
from tests.server_process import ServerThread, run_main, wait_until

ACK_TIMEOUT = 2.0


def produce(client: Client, topic: str, messages: list[tuple[str, bytes]]) -> list[int]:
    """Send ``(key, payload)`` messages and wait for every receipt; their positions."""
    producer = client.create_producer(topic)
    positions = [producer.send(payload, key) for key, payload in messages]
    producer.close()
    return positions


def test_a_stuck_consumer_loses_its_keys_to_the_others_in_order_and_its_late_ack_is_refused(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """A consumer that heartbeats but never acks: after ack_timeout its keys go to the healthy
    consumer, which gets every message of them, each key in order; the stuck one's ack is refused."""
    keys = [f"account-{i}" for i in range(40)]
    messages = [(keys[i % len(keys)], f"{i}".encode()) for i in range(400)]
    with (
        ServerThread(
            ServerConfig(
                data_dir=tmp_path / "data",
                metrics_port=0,
                subscription=SubscriptionConfig(delivery=DeliverySettings(ack_timeout=ACK_TIMEOUT)),
            )
        ) as server,
        Client(server.url) as client,
    ):
        stuck = client.subscribe("orders", "billing", consumer_name="stuck", receiver_queue_size=1000)
        healthy = client.subscribe("orders", "billing", consumer_name="healthy", receiver_queue_size=1000)
        wait_until(lambda: bool(stuck.ranges) and bool(healthy.ranges), "both consumers own ranges")
        producer = client.create_producer("orders")
        stored_at: dict[int, float] = {}  # a message is delivered right after it is stored
        for key, payload in messages:
            stored_at[producer.send(payload, key)] = time.monotonic()
        producer.close()
        # The stuck consumer's application takes its first message and never acks anything.
        first = stuck.receive(timeout=10)
        got: dict[str, list[int]] = {}
        arrival: dict[int, float] = {}
        done = threading.Event()

        def consume() -> None:
            while not done.is_set():
                try:
                    message = healthy.receive(timeout=0.2)
                except Timeout:
                    continue
                assert isinstance(message.key, str)
                got.setdefault(message.key, []).append(message.position)
                arrival.setdefault(message.position, time.monotonic())
                healthy.acknowledge(message)

        worker = threading.Thread(target=consume)
        worker.start()
        try:
            wait_until(lambda: len(arrival) == len(messages), "the healthy consumer received every message", 30)
        finally:
            done.set()
            worker.join()
        assert first.position in got.get(str(first.key), []), "the stuck consumer's message reached the healthy one"
        for key, positions in got.items():
            assert positions == sorted(positions), f"{key}: out of order {positions}"
        expected: dict[str, list[int]] = {key: [] for key in keys}
        for position, (key, _) in enumerate(messages, start=1):
            expected[key].append(position)
        assert {key: sorted(set(positions)) for key, positions in got.items()} == expected, "nothing lost"
        stats = json.loads(run_main("stats", "--admin-url", str(server.admin_url), "--json").stdout)
        (subscription,) = stats["subscriptions"]
        consumers = subscription["dispatcher"]["consumers"]
        assert consumers["stuck"]["stuck"] is True and consumers["stuck"]["ranges"] == []
        assert stuck.ranges == [], "the stuck consumer was told it lost its ranges"
        assert subscription["dispatcher"]["expired_leases"] >= 1
        handed_over = min(arrival[p] for p in got[str(first.key)] if p >= first.position)
        record_property("ack_timeout_s", ACK_TIMEOUT)
        record_property("messages_taken_back", subscription["dispatcher"]["expired_leases"])
        record_property("handover_after_delivery_s", round(handed_over - stored_at[first.position], 3))
        # Its application wakes up: the late ack is refused, and the activity gives it ranges again.
        with pytest.raises(LeaseExpiredError, match="lease expired"):
            stuck.acknowledge_confirmed(first)
        wait_until(lambda: bool(stuck.ranges), "the stuck consumer rejoined after showing progress")
    assert "Traceback" not in server.errors(), server.errors()


def test_a_poison_message_goes_to_the_dead_letter_topic_and_its_key_goes_on(tmp_path: Path) -> None:
    """With --max-redeliveries 2 a message nacked every time is delivered exactly 3 times, then
    stored in orders-billing-DLQ (listed, consumable, replayable) while its key's next message goes out.
    Its properties go with it everywhere."""
    trace = {"trace-id": "4bf92f35", "content-type": "text/plain"}
    with (
        ServerThread(
            ServerConfig(
                data_dir=tmp_path / "data",
                metrics_port=0,
                subscription=SubscriptionConfig(delivery=DeliverySettings(max_redeliveries=2)),
            )
        ) as server,
        Client(server.url) as client,
    ):
        consumer = client.subscribe("orders", "billing", consumer_name="worker", receiver_queue_size=10)
        producer = client.create_producer("orders")
        poison = producer.send(b"poison", "acct-7", properties=trace)
        after = producer.send(b"fine", "acct-7")
        producer.close()
        deliveries: list[Message] = []
        while True:
            message = consumer.receive(timeout=10)
            if message.payload == b"poison":
                deliveries.append(message)
                consumer.negative_acknowledge(message)
            elif len(deliveries) == 3:  # the key goes on once the poison message is gone
                assert message.position == after and message.properties == {}
                consumer.acknowledge_confirmed(message)
                break
            # else: a copy of "fine" sent before its key was nacked (the nack took it back too)
        assert [m.redelivery_count for m in deliveries] == [0, 1, 2], "max_redeliveries + 1 deliveries"
        assert all(m.properties == trace for m in deliveries)
        published = deliveries[0].publish_time
        assert published is not None and {m.publish_time for m in deliveries} == {published}
        admin = ("--admin-url", str(server.admin_url))
        listed = json.loads(run_main("dlq", "list", *admin, "--topic", "orders", "--subscription", "billing",
                                    "--json").stdout)  # fmt: skip
        (letter,) = listed["dead_letters"]
        assert (letter["position"], letter["key"], letter["redelivery_count"], letter["reason"]) == (
            poison,
            "acct-7",
            2,
            "nack",
        )
        assert listed["dlq_topic"] == "orders-billing-DLQ"
        assert letter["publish_time"] == published
        assert letter["properties"] == trace
        reader = client.subscribe("orders-billing-DLQ", "triage", consumer_name="reader", receiver_queue_size=10)
        stored = reader.receive(timeout=10)
        assert (stored.key, stored.payload, stored.publish_time, stored.properties) == (
            "acct-7",
            b"poison",
            published,
            trace,
        )
        reader.acknowledge(stored)
        replay = run_main("dlq", "replay", *admin, "--topic", "orders", "--subscription", "billing")
        assert replay.returncode == 0 and "replayed 1 dead letter" in replay.stdout, replay
        again = consumer.receive(timeout=10)
        assert (again.key, again.payload, again.redelivery_count, again.properties) == ("acct-7", b"poison", 0, trace)
        assert again.publish_time == published  # replayed, it keeps the time it was first published
        assert again.position > after
        consumer.acknowledge_confirmed(again)
        replay = run_main("dlq", "replay", *admin, "--topic", "orders", "--subscription", "billing")
        assert "replayed 0 dead letter" in replay.stdout, "a dead letter is replayed once"
        listed_text = run_main("dlq", "list", *admin, "--topic", "orders", "--subscription", "billing").stdout
        assert "orders-billing-DLQ: 1 dead letter(s)" in listed_text and "3 deliveries, nack" in listed_text
        # Reads take GET, the replay POST; anything else is refused without a change.
        for method, path, status in [
            ("GET", "/dlq/replay?topic=orders&subscription=billing", 405),
            ("POST", "/stats", 405),
            ("DELETE", "/dlq?topic=orders&subscription=billing", 405),
            ("GET", "/dlq?topic=orders", 400),
            ("POST", "/nowhere", 404),
        ]:
            with pytest.raises(HTTPError) as refused:
                urlopen(Request(f"{server.admin_url}{path}", method=method), timeout=10)
            assert refused.value.code == status, (method, path)
        assert len(json.loads(run_main("dlq", "list", *admin, "--topic", "orders", "--subscription", "billing",
                                      "--json").stdout)["dead_letters"]) == 1  # fmt: skip
    assert "Traceback" not in server.errors(), server.errors()


def test_extend_keeps_a_lease_past_the_ack_timeout(tmp_path: Path) -> None:
    """A consumer working longer than ack_timeout keeps its message by extending the lease."""
    timeout = 1.0
    with (
        ServerThread(
            ServerConfig(
                data_dir=tmp_path / "data",
                subscription=SubscriptionConfig(delivery=DeliverySettings(ack_timeout=timeout)),
            )
        ) as server,
        Client(server.url) as client,
    ):
        consumer: Consumer = client.subscribe("jobs", "workers", consumer_name="slow", receiver_queue_size=5)
        other = client.subscribe("jobs", "workers", consumer_name="idle", receiver_queue_size=5)
        produce(client, "jobs", [("job-1", b"work")])
        owner, bystander = (consumer, other) if _owns(consumer, "job-1") else (other, consumer)
        message = owner.receive(timeout=10)
        pause = threading.Event()
        for _ in range(4):  # 2 s of work in all: twice the ack timeout
            pause.wait(timeout / 2)
            owner.extend(message)
        owner.acknowledge_confirmed(message)
        with pytest.raises(Timeout):
            bystander.receive(timeout=0.5)
    assert "Traceback" not in server.errors(), server.errors()


def _owns(consumer: Consumer, key: str) -> bool:
    from keyfailover import key_hash

    slot = key_hash(key)
    return any(start <= slot <= end for start, end in consumer.ranges)


@pytest.mark.slow
def test_a_consumer_that_never_acks_does_not_stop_the_others(tmp_path: Path) -> None:
    """The never-acking bar at small scale: with a buffer of 200 and an unacked limit of 20, the healthy
    consumer gets every message of its keys while the other holds its 20 (its keys' messages stay in the
    log, parked, not in memory); once the stuck one leaves, the rest comes from the log, in order."""
    keys = [f"account-{i}" for i in range(100)]
    count = 5000
    options = SubscriptionConfig(
        delivery=DeliverySettings(max_replay=200, max_unacked_per_consumer=20, ack_timeout=3600)
    )
    with (
        ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0, subscription=options)) as server,
        Client(server.url) as client,
    ):
        stuck = client.subscribe("orders", "billing", consumer_name="stuck", receiver_queue_size=1000)
        healthy = client.subscribe("orders", "billing", consumer_name="healthy", receiver_queue_size=1000)
        wait_until(lambda: bool(stuck.ranges) and bool(healthy.ranges), "both consumers own ranges")
        mine = [key for key in keys if _owns(healthy, key)]
        positions = produce(client, "orders", [(keys[i % len(keys)], b"x") for i in range(count)])
        key_at = {position: keys[i % len(keys)] for i, position in enumerate(positions)}
        expected = {position for position, key in key_at.items() if key in mine}
        got: list[Message] = []

        def take_healthy(until: set[int]) -> None:
            seen = {m.position for m in got}
            while not until <= seen:
                message = healthy.receive(timeout=30)
                got.append(message)
                seen.add(message.position)
                healthy.acknowledge(message)

        take_healthy(expected)  # the stuck consumer never takes a message: its application is blocked
        stats = json.loads(run_main("stats", "--admin-url", str(server.admin_url), "--json").stdout)
        dispatcher = stats["subscriptions"][0]["dispatcher"]
        assert dispatcher["consumers"]["stuck"]["unacked"] == 20
        assert dispatcher["held"] <= 200 and dispatcher["parked_slots"] > 0
        stuck.close()  # its messages and keys go to the healthy consumer, the parked ones re-read from the log
        take_healthy(set(positions))
        order: dict[str, list[int]] = {}
        for message in got:
            order.setdefault(str(message.key), []).append(message.position)
        for key, seen in order.items():
            first = [p for i, p in enumerate(seen) if p not in seen[:i]]
            assert first == sorted(first), f"{key}: first deliveries out of order"
    assert "Traceback" not in server.errors(), server.errors()


def test_a_backlog_is_read_only_as_far_as_its_consumers_can_take(tmp_path: Path) -> None:
    """10,000 stored messages and a consumer with a receiver queue of 100 that takes none yet: the server
    reads what its permits take (within a read batch), not up to max_replay (100,000): the rest waits in
    the log, not in memory, where the payload cache would have lost it. Then every message comes, each
    key in order."""
    keys = [f"account-{i}" for i in range(100)]
    count = 10_000
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0)) as server, Client(server.url) as client:
        producer = client.create_producer("orders")
        for i in range(count):
            producer.send_async(b"x", keys[i % len(keys)])
        producer.flush()
        producer.close()
        consumer = client.subscribe("orders", "billing", consumer_name="slow", receiver_queue_size=100)

        def dispatcher() -> dict[str, Any]:
            stats = json.loads(run_main("stats", "--admin-url", str(server.admin_url), "--json").stdout)
            found: dict[str, Any] = stats["subscriptions"][0]["dispatcher"]
            return found

        wait_until(lambda: dispatcher()["consumers"]["slow"]["unacked"] == 100, "the consumer's permits taken")
        held = dispatcher()["held"]
        assert 100 <= held <= count // 4, f"read {held} of {count} for a consumer that asked for 100"
        order: dict[str, list[int]] = {}
        for _ in range(count):
            message = consumer.receive(timeout=30)
            order.setdefault(str(message.key), []).append(message.position)
            consumer.acknowledge(message)
        assert sum(map(len, order.values())) == count
        assert all(seen == sorted(seen) for seen in order.values()), "a key out of order"
    assert "Traceback" not in server.errors(), server.errors()


@pytest.mark.slow
def test_a_consumer_whose_leases_all_expired_rejoins_once_its_application_waits_for_more(tmp_path: Path) -> None:
    """The only consumer takes every message and acks none in time (its acks late, on a lossy link, say):
    its leases expire, it owns no range and has nothing left to take or ack. Its application waiting for
    more is progress: it rejoins and gets the messages again, both when it was waiting as its ranges went
    and when it asks only after they went. Without that, no consumer of the subscription would own any key."""
    count = 20
    with (
        ServerThread(
            ServerConfig(
                data_dir=tmp_path / "data",
                subscription=SubscriptionConfig(delivery=DeliverySettings(ack_timeout=ACK_TIMEOUT)),
            )
        ) as server,
        Client(server.url) as client,
    ):
        consumer = client.subscribe("orders", "billing", consumer_name="late", receiver_queue_size=1000)
        wait_until(lambda: bool(consumer.ranges), "the consumer owns the ranges")
        positions = produce(client, "orders", [(f"k{i % 5}", b"x") for i in range(count)])
        first = [consumer.receive(timeout=30) for _ in positions]
        assert sorted(m.position for m in first) == positions
        # Waiting as the leases expire: the ranges go, then come back, with every message again.
        again = [consumer.receive(timeout=30) for _ in positions]
        assert sorted(m.position for m in again) == positions
        assert all(m.redelivery_count == 1 for m in again)
        # Asking only after they went: the leases expire again first, with nothing being waited for.
        wait_until(lambda: not consumer.ranges, "the consumer's leases expired and its ranges went")
        third = [consumer.receive(timeout=30) for _ in positions]
        assert sorted(m.position for m in third) == positions
        for message in third:
            consumer.acknowledge(message)
        wait_until(lambda: bool(consumer.ranges), "the consumer owns the ranges again")
    assert "Traceback" not in server.errors(), server.errors()


def test_delivery_settings_are_per_subscription_live_and_saved(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """`keyfailover admin configure` gives one subscription its own ack timeout, redelivery limit, nack
    backoff and buffer bound while another subscription of the topic keeps the server's; the settings
    apply at once, survive a restart, and a bad one is refused without a change."""
    data = tmp_path / "data"
    with (
        ServerThread(ServerConfig(data_dir=data, metrics_port=0)) as server,  # the server's ack timeout: 30 s
        Client(server.url) as client,
    ):
        admin = ("--admin-url", str(server.admin_url))
        stuck = client.subscribe("orders", "fast", consumer_name="stuck", receiver_queue_size=100)
        healthy = client.subscribe("orders", "fast", consumer_name="healthy", receiver_queue_size=100)
        reader = client.subscribe("orders", "audit", consumer_name="reader", receiver_queue_size=100)
        wait_until(lambda: bool(stuck.ranges) and bool(healthy.ranges), "both consumers own ranges")
        fast = ("--topic", "orders", "--subscription", "fast")
        options = ("--ack-timeout", "1", "--max-redeliveries", "2", "--nack-backoff", "0.5", "--max-replay", "500")
        shown = run_main("admin", "configure", *admin, *fast, *options)
        assert shown.returncode == 0, shown
        assert "ack timeout       1 s (own)" in shown.stdout and "nack backoff max  60 s (server)" in shown.stdout
        assert "max replay        500 messages (own)" in shown.stdout
        too_small = run_main("admin", "configure", *admin, *fast, "--max-replay", "5")
        assert too_small.returncode == 2 and "a number of messages" in too_small.stderr
        refused = run_main("admin", "configure", *admin, *fast, "--nack-backoff", "90")
        assert refused.returncode == 1 and "nack_backoff_max must be a finite number >= 90" in refused.stderr
        assert run_main("admin", "configure", *admin, *fast, "--ack-timeout", "-1").returncode == 2
        keys = [key for key in (f"acct-{i}" for i in range(200)) if _owns(stuck, key)][:5]
        positions = produce(client, "orders", [(key, b"x") for key in keys])
        first = stuck.receive(timeout=10)  # its application takes one and never acks: 1 s later it is stuck
        got: list[int] = []
        while len(got) < len(positions):
            message = healthy.receive(timeout=20)  # the server's 30 s would time out here
            got.append(message.position)
            if message.position == first.position and message.redelivery_count == 1:
                nacked_at = time.monotonic()
                # Its second failure (the first was the expiry): 0.5 s doubled once, then its last try.
                healthy.negative_acknowledge(message)
                got.pop()
                continue
            if message.position == first.position:
                record_property("nack_backoff_redelivery_s", round(time.monotonic() - nacked_at, 3))
            healthy.acknowledge(message)
        assert sorted(got) == positions
        audit = [reader.receive(timeout=10) for _ in positions]
        assert [m.redelivery_count for m in audit] == [0] * len(positions), "the other subscription kept 30 s"
        for message in audit:
            reader.acknowledge(message)
        settings = json.loads(run_main("admin", "configure", *admin, *fast, "--json").stdout)
        assert settings["settings"] == {
            "ack_timeout": 1.0,
            "max_redeliveries": 2,
            "nack_backoff": 0.5,
            "nack_backoff_max": 60.0,
            "max_replay": 500,
        }
        other = json.loads(run_main("admin", "configure", *admin, "--topic", "orders", "--subscription", "audit",
                                   "--json").stdout)  # fmt: skip
        assert other["settings"]["ack_timeout"] == 30.0 and other["own"] == []
        stats = json.loads(run_main("stats", *admin, "--json").stdout)
        by_name = {item["subscription"]: item for item in stats["subscriptions"]}
        assert by_name["fast"]["dispatcher"]["nack_backoff"] == 0.5 and by_name["fast"]["ack_timeout"] == 1.0
        assert by_name["fast"]["dispatcher"]["max_replay"] == 500
        assert by_name["audit"]["dispatcher"]["max_replay"] == 100_000
    assert "Traceback" not in server.errors(), server.errors()
    with ServerThread(ServerConfig(data_dir=data, metrics_port=0)) as server:
        admin = ("--admin-url", str(server.admin_url))
        saved = json.loads(run_main("admin", "configure", *admin, *fast, "--json").stdout)
        assert saved["own"] == ["ack_timeout", "max_redeliveries", "max_replay", "nack_backoff"]
        assert saved["settings"]["max_replay"] == 500
        back = json.loads(run_main("admin", "configure", *admin, *fast, "--ack-timeout", "default", "--json").stdout)
        assert back["settings"]["ack_timeout"] == 30.0
        assert back["own"] == ["max_redeliveries", "max_replay", "nack_backoff"]
        reset = json.loads(run_main("admin", "configure", *admin, *fast, "--reset", "--json").stdout)
        assert reset["own"] == [] and reset["settings"]["max_redeliveries"] is None
        missing = run_main("admin", "configure", *admin, "--topic", "orders", "--subscription", "nobody")
        assert missing.returncode == 1 and "no subscription 'nobody' of topic 'orders'" in missing.stderr
    assert "Traceback" not in server.errors(), server.errors()


def test_parked_messages_come_back_after_a_restart_that_finds_the_log_end_acked(tmp_path: Path) -> None:
    """After a restart, the first read (a buffer's worth, 100) passes the messages acked before it (the
    last 40 of the log), so the read position ends beyond the last message the dispatcher was given.
    The messages parked on the way (one unacked at a time) are re-read from the log as the consumer
    acks, every one of them, in order, with no new message needed to move things on."""
    count, unacked = 100, 60
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0)) as server, Client(server.url) as client:
        positions = produce(client, "orders", [("account-1", b"x")] * count)
        consumer = client.subscribe("orders", "billing", consumer_name="c", receiver_queue_size=count)
        for _ in range(count):
            message = consumer.receive(timeout=30)
            if message.position > positions[unacked - 1]:
                consumer.acknowledge_confirmed(message)
        consumer.close()
    options = SubscriptionConfig(delivery=DeliverySettings(max_replay=100, max_unacked_per_consumer=1))
    with (
        ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0, subscription=options)) as server,
        Client(server.url) as client,
    ):
        consumer = client.subscribe("orders", "billing", consumer_name="c", receiver_queue_size=1)
        got = []
        for _ in range(unacked):
            message = consumer.receive(timeout=30)
            got.append(message.position)
            consumer.acknowledge(message)
        assert got == positions[:unacked]
    assert "Traceback" not in server.errors(), server.errors()
