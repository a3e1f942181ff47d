"""The main job: the scripted demo runs clean and reports what it saw."""

from __future__ import annotations

import io
import re

from keyfailover.client import Message
from keyfailover.tools.demo import DemoReport, run_core_demo, run_server_demo
from keyfailover.tools.demo._traffic import Observed, Produced, check_events
from tests.server_process import run_cli


def test_demo_keeps_every_guarantee() -> None:
    out = io.StringIO()
    report = run_core_demo(messages=12_000, keys=800, seed=3, out=out)
    assert report.problems == []
    assert report.published == 12_000
    assert report.acked == report.published
    assert set(report.deliveries) == {"c1", "c2", "c3", "c4"}
    # The stalled consumer's unacked deliveries were redelivered elsewhere after its removal.
    assert report.deliveries["c4"] == 200
    assert report.redeliveries >= 200
    text = out.getvalue()
    assert "final range map" in text
    assert report.status == {"c1": "left", "c4": "stalled, then removed"}
    assert "consumer  hash ranges                    rate/s  unacked  draining  status   first ranges" in text
    assert "nothing lost" in text
    # Each consumer is one line saying how many ranges it owns and its share: the shares of a map add up.
    final = text[text.index("final range map") : text.index("deliveries  status")]
    shares = re.findall(r"^  (c\d) +(\d+) ranges?, +([\d.]+)% of slots", final, re.MULTILINE)
    assert sorted(name for name, _, _ in shares) == ["c2", "c3"]
    assert abs(sum(float(share) for _, _, share in shares) - 100.0) < 0.2


def test_core_demo_command_line_exits_zero() -> None:
    done = run_cli("demo", "--core", "--messages", "5000", "--keys", "300")
    assert done.returncode == 0, done.stderr
    assert "c1 starts alone" in done.stdout
    assert "per-key order held" in done.stdout


def test_server_demo_consumes_everything_in_key_order() -> None:
    out = io.StringIO()
    report = run_server_demo(events=6_000, accounts=400, seed=5, out=out)
    assert report.problems == []
    assert report.published == report.acked == 6_000
    assert set(report.deliveries) <= {"c1", "c2", "c3", "c4"}
    assert {"c1", "c2", "c3"} <= set(report.deliveries)
    # c1 left and the stalled c4 was removed with deliveries unacked: those were redelivered.
    assert report.redeliveries > 0
    text = out.getvalue()
    assert "every event outside its ranges was consumed: True" in text
    # Five tables, one line per live consumer (it may own several ranges): the shares of each add up.
    tables = re.findall(r"^  consumer  hash ranges +received  status   first ranges\n((?:  c\d .*\n)+)", text, re.M)
    assert [len(table.splitlines()) for table in tables] == [2, 3, 4, 3, 2]
    for table in tables:
        shares = re.findall(r"^  c\d +\d+ ranges?, +([\d.]+)% of slots +\d+  (?:active|stalled) +\[", table, re.M)
        assert len(shares) == len(table.splitlines()) and abs(sum(map(float, shares)) - 100.0) < 0.3, table
    assert report.status == {"c1": "left", "c4": "stalled, then removed"}
    final = text[text.rindex("deliveries  status") :]
    assert "c4" in final and "stalled, then removed" in final


def test_server_demo_command_line_exits_zero() -> None:
    done = run_cli("demo", "--messages", "3000", "--keys", "200", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every event consumed" in done.stdout


def test_the_event_checks_name_each_broken_guarantee() -> None:
    """An event confirmed but never consumed, one stored twice, and an account out of produced order."""
    produced, observed = Produced(partitions=2), Observed()
    received = [  # (account, event number, partition, position)
        ("account-1", 0, 0, 0),
        ("account-1", 1, 0, 1),
        ("account-2", 2, 1, 0),
        ("account-2", 2, 1, 1),  # the same event again at the next position: stored twice
        ("account-3", 5, 0, 2),
        ("account-3", 4, 0, 3),  # event 4 was produced before event 5
    ]
    with produced.lock:
        produced.stored = {(partition, position): (key, n) for key, n, partition, position in received}
        produced.stored[(1, 2)] = ("account-4", 6)  # confirmed, never received
    for key, number, partition, position in received:
        observed.record("c1", Message(key, f"{key}:{number}:0".encode(), position, 0, 1, partition))
    observed.record("c2", Message("account-1", b"account-1:1:0", 1, 1, 2, 0))  # a redelivery is no problem
    report = DemoReport()
    check_events(report, produced, observed)
    assert report.problems == [
        "1 stored events were never consumed, the first: event 6 of account-4 (partition 1, position 2)",
        "event 2 of account-2 was stored twice (at two positions)",
        "account-3: event 4 was first delivered after event 5, which was produced after it",
    ]
    assert (report.published, report.acked, report.redeliveries) == (7, 6, 1)
    assert report.deliveries == {"c1": 6, "c2": 1}
