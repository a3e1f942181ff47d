"""``keyfailover produce``, ``consume``, ``ranges`` and ``stats`` against a real server, and the progress bar.

The commands and the server run in this process: the CLI's ``main`` talks to the server over loopback
as it would from a shell."""

from __future__ import annotations

import io
import json
import re
from collections import defaultdict
from functools import partial
from pathlib import Path
from urllib.request import urlopen

from keyfailover.broker.server import ServerConfig
from keyfailover.broker.storage.records import publish_clock
from keyfailover.client import Client, Timeout
from keyfailover.core.clock import ManualClock
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hash
from keyfailover.tools._progress import Progress
from tests.server_process import ServerThread, run_main, wait_until

KEYS = 50
MESSAGES = 2_000


def test_produce_a_file_then_consume_every_line_in_key_order(tmp_path: Path) -> None:
    lines = [f"acct-{i % KEYS},{i}" for i in range(MESSAGES)]
    source = tmp_path / "events.csv"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    started = publish_clock()
    with ServerThread(ServerConfig(data_dir=tmp_path / "data")) as server:
        url = ["--url", server.url, "--topic", "orders"]
        produced = run_main("produce", *url, "--file", str(source), "--key-field", ",", "--progress")
        assert produced.returncode == 0, produced.stderr
        final = produced.stderr.splitlines()[-1]  # text mode reads each "\r" redraw as a line
        assert final.startswith(f"[{'#' * 30}] 100% {MESSAGES:,} sent, {MESSAGES:,} stored"), final

        piped = run_main(
            "produce", *url, "--json", "--key-field", "id", "--allow-keyless", stdin='{"id": 7, "n": 1}\n\n{"n": 2}\n'
        )
        assert piped.returncode == 0, piped.stderr

        consumed = run_main("consume", *url, "--subscription", "audit", "--json", "--idle-timeout", "2")
        assert consumed.returncode == 0, consumed.stderr
        ended = publish_clock()
    records = [json.loads(line) for line in consumed.stdout.splitlines()]
    assert all(started <= r["publish_time"] <= ended for r in records)
    assert [r["position"] for r in records] == sorted(r["position"] for r in records)
    assert len(records) == MESSAGES + 2
    by_key: dict[str | None, list[str]] = defaultdict(list)
    for record in records:
        by_key[record["key"]].append(record["payload"])
    for i in range(KEYS):
        assert by_key[f"acct-{i}"] == [str(n) for n in range(i, MESSAGES, KEYS)]
    assert by_key["7"] == ['{"id": 7, "n": 1}'] and by_key[None] == ['{"n": 2}']


def test_produce_rejects_bad_input_with_the_line_number(tmp_path: Path) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data")) as server:
        url = ["--url", server.url, "--topic", "orders"]
        no_separator = run_main("produce", *url, "--key-field", ",", stdin="a,1\nno separator here\n")
        assert no_separator.returncode != 0
        assert "line 2: no ',' separator between key and payload" in no_separator.stderr
        not_json = run_main("produce", *url, "--json", stdin='{"a": 1}\n[1, 2]\n')
        assert "line 2: expected a JSON object, got list" in not_json.stderr
        missing = run_main("produce", *url, "--file", str(tmp_path / "absent.txt"))
        assert missing.returncode != 0 and "cannot read" in missing.stderr and "absent.txt" in missing.stderr


def test_ranges_pulsar_sticky_is_the_servers_map_and_routes_every_key_to_its_consumer(tmp_path: Path) -> None:
    """Consumers joined and left, so some own several ranges: ``ranges --pulsar-sticky`` lists, per consumer,
    exactly the ranges /ranges has, and every key was delivered to the consumer whose sticky ranges hold its slot."""
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0)) as server, Client(server.url) as client:
        assert server.admin_url is not None
        consumers = {name: client.subscribe("orders", "billing", consumer_name=name) for name in "abcde"}
        for name in "bd":
            consumers.pop(name).close()
        where = ["--admin-url", server.admin_url, "--topic", "orders", "--subscription", "billing"]
        done = run_main("ranges", *where, "--pulsar-sticky")
        assert done.returncode == 0, done.stderr
        sticky = json.loads(done.stdout)
        assert len(done.stdout.splitlines()) == len(sticky) + 2  # "{", a consumer a line, "}"
        snapshot = json.loads(urlopen(f"{server.admin_url}/ranges?topic=orders&subscription=billing").read())

        # Range by range: each of the map's ranges is in its consumer's list, in hash order, and nothing else is.
        expected: dict[str, list[list[int]]] = defaultdict(list)
        for entry in snapshot["ranges"]:
            expected[entry["consumer"]].append([entry["start"], entry["end"]])
        assert sticky == expected
        assert sorted(sticky) == ["a", "c", "e"] and any(len(pairs) > 1 for pairs in sticky.values())
        tiling = sorted(pair for pairs in sticky.values() for pair in pairs)
        assert [start for start, _ in tiling] == [0] + [end + 1 for _, end in tiling[:-1]]
        assert tiling[-1][1] == HASH_RANGE_SIZE - 1

        def told(name: str) -> bool:
            return consumers[name].ranges == [(start, end) for start, end in sticky[name]]

        for name in consumers:
            wait_until(partial(told, name), f"{name} told its ranges")

        # Every key reaches the consumer whose sticky ranges hold key_hash(key): what Pulsar would do with them.
        producer = client.create_producer("orders")
        for i in range(300):
            producer.send_async(b"", key=f"k{i}")
        producer.flush()
        received = 0
        while received < 300:
            for name, consumer in consumers.items():
                try:
                    message = consumer.receive(timeout=0.05)
                except Timeout:
                    continue
                assert isinstance(message.key, str)
                slot = key_hash(message.key)
                assert any(start <= slot <= end for start, end in sticky[name]), (message.key, slot, name)
                consumer.acknowledge(message)
                received += 1

        # The table: one line per range, so a consumer owning several ranges is on several lines.
        table = run_main("ranges", *where)
        assert table.returncode == 0, table.stderr
        lines = re.findall(r"^  (\w) +\[ *(\d+), +(\d+)\] +[\d.]+%$", table.stdout, re.MULTILINE)
        assert [(name, int(start), int(end)) for name, start, end in lines] == [
            (entry["consumer"], entry["start"], entry["end"]) for entry in snapshot["ranges"]
        ]
        stats = run_main("stats", "--admin-url", server.admin_url)
        assert stats.returncode == 0, stats.stderr
        assert "policy multi (max 16 ranges per consumer)" in stats.stdout
        for name, pairs in sticky.items():
            share = sum(end - start + 1 for start, end in pairs) / HASH_RANGE_SIZE
            count = f"{len(pairs)} range{'' if len(pairs) == 1 else 's'}"
            assert re.search(rf"^  {name} +{count}, {share:.1%} ", stats.stdout, re.MULTILINE), stats.stdout

        for consumer in consumers.values():
            consumer.close()
        emptied = run_main("ranges", *where, "--pulsar-sticky")
        assert (emptied.returncode, emptied.stdout) == (0, "{}\n")


def test_progress_bar_lines() -> None:
    clock = ManualClock(100.0)
    out = io.StringIO()
    bar = Progress(out, 1000, clock=clock, interval=0.5)
    bar.update(10, 0, 250)
    clock.now += 0.1
    bar.update(20, 5, 300)  # within the interval: not drawn
    clock.now += 1.9
    bar.finish(40, 40, 1000)
    assert out.getvalue().split("\r")[1:] == [
        f"[{'#' * 7}{'.' * 23}]  25% 10 sent, 0 stored, - msg/s",
        f"[{'#' * 30}] 100% 40 sent, 40 stored, 20 msg/s\n",
    ]


def test_progress_without_a_known_size_has_counts_only() -> None:
    clock = ManualClock(100.0)
    out = io.StringIO()
    bar = Progress(out, None, clock=clock)
    clock.now += 2.0
    bar.finish(3_000, 2_000, 123)
    assert out.getvalue() == "\r3,000 sent, 2,000 stored, 1,000 msg/s\n"
