"""Consume modes through a real server (issue 13): ordered -> unordered -> ordered under traffic.

Two consumers receive and ack in threads while a producer sends three phases of keyed
messages, the subscription switched with ``keyfailover admin set-consume-mode`` between them.
Asserted: nothing is lost, unordered mode really spreads a key over both consumers, and after
the switch back every message of a key is received only once each earlier message of that
key was acked (per-key order, across consumers). The mode is saved: it survives a restart.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from urllib.request import urlopen

import pytest

from keyfailover.broker.server import ServerConfig, SubscriptionConfig
from keyfailover.client import Client, Consumer, Timeout
from keyfailover.core.dispatcher import DeliverySettings
from tests.server_process import ServerProcess, ServerThread, run_main, wait_until

KEYS = [f"order-{i}" for i in range(21)]  # odd: round robin over two consumers does not follow the key
PER_PHASE = 300


class Log:
    """What every consumer received and acked, with monotonic times (the consumers share a process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.received: list[tuple[float, str, int, str]] = []  # (time, consumer, position, key)
        self.acked: dict[int, float] = {}

    def consume(self, name: str, consumer: Consumer, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                message = consumer.receive(timeout=0.2)
            except Timeout:
                continue
            assert isinstance(message.key, str)
            with self.lock:
                self.received.append((time.monotonic(), name, message.position, message.key))
            consumer.acknowledge_confirmed(message)
            with self.lock:
                self.acked.setdefault(message.position, time.monotonic())


def switch(server: ServerProcess | ServerThread, mode: str) -> None:
    done = run_main(
        "admin", "set-consume-mode", mode, "--admin-url", str(server.admin_url), "--topic", "orders",
        "--subscription", "billing",
    )  # fmt: skip
    assert done.returncode == 0 and f"-> {mode}" in done.stdout, done


def test_ordered_unordered_ordered_under_traffic_loses_nothing_and_keeps_key_order_after(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with (
        ServerThread(
            ServerConfig(
                data_dir=data,
                metrics_port=0,
                subscription=SubscriptionConfig(delivery=DeliverySettings(ack_timeout=10)),
            )
        ) as server,
        Client(server.url) as client,
    ):
        consumers = {
            name: client.subscribe("orders", "billing", consumer_name=name, receiver_queue_size=50)
            for name in ("c1", "c2")
        }
        wait_until(lambda: all(c.ranges for c in consumers.values()), "both consumers own ranges")
        log = Log()
        stop = threading.Event()
        workers = [threading.Thread(target=log.consume, args=(n, c, stop)) for n, c in consumers.items()]
        for worker in workers:
            worker.start()
        producer = client.create_producer("orders")
        phases: dict[int, str] = {}
        try:
            for phase, mode in (("A", None), ("B", "unordered"), ("C", "ordered")):
                if mode is not None:
                    switch(server, mode)
                for i in range(PER_PHASE):
                    position = producer.send(f"{phase}{i}".encode(), KEYS[i % len(KEYS)])
                    phases[position] = phase
            wait_until(lambda: len(log.acked) == len(phases), "every message acked", 60)
        finally:
            stop.set()
            for worker in workers:
                worker.join()
            producer.close()
        assert set(log.acked) == set(phases), "nothing lost"
        key_of = {position: key for _, _, position, key in log.received}
        spread = {
            key: {name for _, name, position, k in log.received if k == key and phases[position] == "B"} for key in KEYS
        }
        assert any(len(names) == 2 for names in spread.values()), f"unordered mode spread no key: {spread}"
        for at, _, position, key in log.received:
            if phases[position] != "C":
                continue
            earlier = [q for q in log.acked if q < position and key_of[q] == key]
            late = [q for q in earlier if log.acked[q] > at]
            assert not late, f"{key}: {position} received before earlier {late} were acked"
        stats = json.load(urlopen(f"{server.admin_url}/stats", timeout=10))
        assert stats["subscriptions"][0]["consume_mode"] == "ordered"
        switch(server, "unordered")
        metrics = urlopen(f"{server.admin_url}/metrics", timeout=10).read().decode()
        info = 'keyfailover_consume_mode_info{mode="unordered",partition="",subscription="billing",topic="orders"} 1.0'
        assert info in metrics
        listed = run_main("ranges", "--admin-url", str(server.admin_url)).stdout
        assert "orders/billing (epoch" in listed and ", unordered)" in listed
    assert "Traceback" not in server.errors(), server.errors()
    with ServerThread(ServerConfig(data_dir=data, metrics_port=0)) as server, Client(server.url) as client:
        client.subscribe("orders", "billing", consumer_name="c1")
        stats = json.load(urlopen(f"{server.admin_url}/stats", timeout=10))
        assert stats["subscriptions"][0]["consume_mode"] == "unordered", "the mode is saved with the subscription"
        refused = run_main(
            "admin", "set-consume-mode", "ordered", "--admin-url", str(server.admin_url), "--topic", "orders",
            "--subscription", "nobody",
        )  # fmt: skip
        assert refused.returncode == 1 and "no subscription 'nobody'" in refused.stderr, refused


@pytest.mark.integration
def test_serve_consume_mode_is_the_mode_of_subscriptions_without_their_own(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with ServerProcess(data, "--metrics-port", "0") as server, Client(server.url) as client:
        client.subscribe("orders", "billing", consumer_name="c1")
        switch(server, "unordered")
        switch(server, "ordered")  # saved: billing keeps ordered whatever the server's default
    with ServerProcess(data, "--metrics-port", "0", "--consume-mode", "unordered") as server, Client(server.url) as c:
        c.subscribe("orders", "billing", consumer_name="c1")
        c.subscribe("orders", "audit", consumer_name="c1")
        stats = json.load(urlopen(f"{server.admin_url}/stats", timeout=10))
        modes = {item["subscription"]: item["consume_mode"] for item in stats["subscriptions"]}
        assert modes == {"billing": "ordered", "audit": "unordered"}
