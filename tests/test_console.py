"""The console on the admin endpoint: its static files without the token, its JSON with it, and what the JSON says."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest

from keyfailover.broker.server import ServerConfig, SubscriptionConfig
from keyfailover.client import Client
from keyfailover.core.dispatcher import DeliverySettings
from keyfailover.core.hashing import HASH_RANGE_SIZE
from keyfailover.integrations.console import Sampler
from keyfailover.integrations.console._cluster import ClusterProbe, _answers
from tests.server_process import ServerThread, run_main, wait_until

TOKEN = "s3cret-console"


def fetch(server: ServerThread, path: str, method: str = "GET", token: str | None = None) -> tuple[int, str, bytes]:
    """``(status, content type, body)`` of one admin request, errors included."""
    assert server.admin_url is not None
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    try:
        with urlopen(Request(server.admin_url + path, method=method, headers=headers), timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


def get_json(server: ServerThread, path: str, method: str = "GET", token: str | None = None) -> Any:
    status, content_type, body = fetch(server, path, method, token)
    assert (status, content_type) == (200, "application/json"), (path, status, body)
    return json.loads(body)


def config(tmp_path: Path, token: str | None = None, max_redeliveries: int | None = None) -> ServerConfig:
    delivery = DeliverySettings(max_redeliveries=max_redeliveries)
    return ServerConfig(
        data_dir=tmp_path, metrics_port=0, token=token, subscription=SubscriptionConfig(delivery=delivery)
    )


def test_static_files_are_open_and_json_keeps_the_token(tmp_path: Path) -> None:
    with ServerThread(config(tmp_path, TOKEN)) as server:
        for path, content_type, marker in [
            ("/ui", "text/html; charset=utf-8", b'id="status"'),
            ("/ui/console.js", "text/javascript; charset=utf-8", b"sessionStorage"),
            ("/ui/console.css", "text/css; charset=utf-8", b"repeating-linear-gradient"),
        ]:
            status, found_type, body = fetch(server, path)
            assert (status, found_type) == (200, content_type) and marker in body, path
        assert b"http://" not in fetch(server, "/ui")[2] and b"https://" not in fetch(server, "/ui")[2], "no CDN"
        for path in ["/console/overview", "/console/subscription?topic=t&subscription=s", "/ranges", "/metrics"]:
            assert fetch(server, path)[0] == 401, path
            assert fetch(server, path, token="wrong")[0] == 401, path
        assert get_json(server, "/console/overview", token=TOKEN)["subscriptions"] == []
        # An open path is open for GET only: a POST to it still needs the token.
        assert fetch(server, "/ui", "POST")[0] == 401


def test_subscription_view_follows_joins_and_leaves(tmp_path: Path) -> None:
    with ServerThread(config(tmp_path)) as server, Client(server.url) as client:
        path = "/console/subscription?topic=orders&subscription=billing"
        assert fetch(server, path)[0] == 404
        assert fetch(server, "/console/subscription?topic=orders")[0] == 400
        first = client.subscribe("orders", "billing", consumer_name="a")
        producer = client.create_producer("orders")
        for index in range(50):
            producer.send(b"x", f"key-{index}")
        second = client.subscribe("orders", "billing", consumer_name="b")
        wait_until(lambda: len(get_json(server, path)["consumers"]) == 2, "b joins")
        view = get_json(server, path)
        ranges = get_json(server, "/ranges?topic=orders&subscription=billing")["ranges"]
        assert [(r["start"], r["end"], r["consumer"]) for r in view["ranges"]] == [
            (r["start"], r["end"], r["consumer"]) for r in ranges
        ]
        assert sum(r["slot_share"] for r in view["ranges"]) == pytest.approx(1.0)
        assert {c["consumer"] for c in view["consumers"]} == {"a", "b"}
        for row in view["consumers"]:
            owned = sum(end - start + 1 for start, end in row["ranges"])
            assert row["slot_share"] == pytest.approx(owned / HASH_RANGE_SIZE)
            assert {"rate", "permits", "unacked", "draining_keys", "stuck", "stalled", "expired_leases",
                    "redeliveries"} <= set(row)  # fmt: skip
        assert [c["reason"] for c in view["changes"]] == ["join", "join"]
        assert [c["consumer"] for c in view["changes"]] == ["a", "b"]
        assert view["changes"][-1]["epoch"] == view["epoch"]
        second.close()
        wait_until(lambda: [c["reason"] for c in get_json(server, path)["changes"]][-1] == "leave", "b leaves")
        history = get_json(server, "/history?topic=orders&subscription=billing")["history"]
        assert [entry["reason"] for entry in history] == ["join", "join", "leave"]
        assert [entry["consumer"] for entry in history] == ["a", "b", "b"]
        overview = get_json(server, "/console/overview")
        (row,) = overview["subscriptions"]
        assert (row["topic"], row["subscription"], row["consumers"], overview["cluster"]) == (
            "orders",
            "billing",
            1,
            False,
        )
        first.close()


def test_dead_letter_view_and_purge(tmp_path: Path) -> None:
    with ServerThread(config(tmp_path, TOKEN, max_redeliveries=0)) as server, Client(server.url, token=TOKEN) as client:
        consumer = client.subscribe("orders", "billing", consumer_name="worker", receiver_queue_size=10)
        producer = client.create_producer("orders")
        for payload in (b"poison-1", b"poison-2"):
            producer.send(payload, payload.decode())
        for _ in range(2):
            consumer.negative_acknowledge(consumer.receive(timeout=10))

        def rows() -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = get_json(server, "/console/dlq", token=TOKEN)["subscriptions"]
            return found

        wait_until(lambda: [r["count"] for r in rows()] == [2], "two dead letters")
        (row,) = rows()
        assert (row["topic"], row["subscription"], row["waiting"], row["reasons"], row["served_here"]) == (
            "orders",
            "billing",
            2,
            {"nack": 2},
            True,
        )
        purge = "/dlq/purge?topic=orders&subscription=billing"
        # Refused calls change nothing.
        assert fetch(server, purge, "POST")[0] == 401
        assert fetch(server, purge, "POST", token="wrong")[0] == 401
        assert fetch(server, purge, "GET", token=TOKEN)[0] == 405
        assert fetch(server, "/dlq/purge?topic=orders", "POST", token=TOKEN)[0] == 400
        status, _, body = fetch(server, "/dlq/purge?topic=orders&subscription=nobody", "POST", token=TOKEN)
        assert status == 404 and b"no subscription 'nobody'" in body
        assert [r["count"] for r in rows()] == [2]
        answer = get_json(server, purge, "POST", token=TOKEN)
        assert (answer["purged"], answer["by_partition"], answer["not_served_here"]) == (2, {"orders": 2}, [])
        assert rows() == []
        assert get_json(server, "/dlq?topic=orders&subscription=billing", token=TOKEN)["dead_letters"] == []
        admin = ("--admin-url", str(server.admin_url), "--token", TOKEN)
        done = run_main("dlq", "purge", *admin, "--topic", "orders", "--subscription", "billing")
        assert done.returncode == 0 and "purged 0 dead letter(s) of orders/billing" in done.stdout, done
        reader = client.subscribe("orders-billing-DLQ", "triage", consumer_name="reader", receiver_queue_size=10)
        assert reader.receive(timeout=10).payload == b"poison-1", "the dead-letter topic keeps its messages"
    assert "Traceback" not in server.errors(), server.errors()


def test_a_single_server_is_not_a_cluster_and_probes_answer_by_connecting(tmp_path: Path) -> None:
    with ServerThread(config(tmp_path)) as server:
        assert get_json(server, "/console/cluster")["cluster"] is False
        address = f"127.0.0.1:{server.port}"
        assert server.call(lambda _: _answers(address)) is True
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: a connect is refused
        try:
            refused = f"127.0.0.1:{closed.getsockname()[1]}"
            assert server.call(lambda _: _answers(refused)) is False
        finally:
            closed.close()
        assert server.call(lambda s: ClusterProbe(s).view())["cluster"] is False


def test_the_sampler_keeps_a_bounded_series_per_live_subscription(tmp_path: Path) -> None:
    with ServerThread(config(tmp_path)) as server, Client(server.url) as client:
        path = "/console/subscription?topic=orders&subscription=billing"
        consumer = client.subscribe("orders", "billing", consumer_name="a", receiver_queue_size=10)
        producer = client.create_producer("orders")
        # The server's own sampler has sampled the subscription since it opened (the first sample at once).
        wait_until(lambda: len(get_json(server, path)["series"]) >= 1, "a first sample")
        sampler = server.call(lambda s: Sampler(s, keep=3))
        server.call(lambda _: sampler.sample())
        assert sampler.series("orders", "billing")[0]["delivery_seconds"] is None, "nothing delivered yet"
        for index in range(4):
            producer.send(b"x", f"k{index}")
        for _ in range(4):
            consumer.acknowledge_confirmed(consumer.receive(timeout=10))
        server.call(lambda _: sampler.sample())
        latest = sampler.series("orders", "billing")[-1]
        assert (latest["delivered"], latest["backlog"]) == (4, 0)
        assert latest["delivery_seconds"] is not None
        for _ in range(3):
            server.call(lambda _: sampler.sample())
        series = sampler.series("orders", "billing")
        assert len(series) == 3, "at most keep samples"
        assert [s["delivery_seconds"] for s in series] == [None, None, None], "the oldest went"
        consumer.close()
        server.call(lambda s: s.unsubscribe(s.live("orders", "billing")[0]))
        wait_until(lambda: not server.call(lambda s: s.live("orders", "billing")), "the subscription is gone")
        server.call(lambda _: sampler.sample())
        assert sampler.series("orders", "billing") == [], "a subscription no longer live loses its samples"
    assert "Traceback" not in server.errors(), "the sampler stops with the server"
