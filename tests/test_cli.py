"""``keyfailover produce`` and ``consume`` against a real server, and the produce progress bar."""

from __future__ import annotations

import io
import json
from collections import defaultdict
from pathlib import Path

from keyfailover.core.clock import ManualClock
from keyfailover.tools._progress import Progress
from tests.server_process import ServerProcess, run_cli

KEYS = 50
MESSAGES = 2_000


def test_produce_a_file_then_consume_every_line_in_key_order(tmp_path: Path) -> None:
    lines = [f"acct-{i % KEYS},{i}" for i in range(MESSAGES)]
    source = tmp_path / "events.csv"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with ServerProcess(tmp_path / "data") as server:
        url = ["--url", server.url, "--topic", "orders"]
        produced = run_cli("produce", *url, "--file", str(source), "--key-field", ",", "--progress")
        assert produced.returncode == 0, produced.stderr
        final = produced.stderr.splitlines()[-1]  # text mode reads each "\r" redraw as a line
        assert final.startswith(f"[{'#' * 30}] 100% {MESSAGES:,} sent, {MESSAGES:,} stored"), final

        piped = run_cli(
            "produce", *url, "--json", "--key-field", "id", "--allow-keyless", stdin='{"id": 7, "n": 1}\n\n{"n": 2}\n'
        )
        assert piped.returncode == 0, piped.stderr

        consumed = run_cli("consume", *url, "--subscription", "audit", "--json", "--idle-timeout", "2")
        assert consumed.returncode == 0, consumed.stderr
    records = [json.loads(line) for line in consumed.stdout.splitlines()]
    assert [r["position"] for r in records] == sorted(r["position"] for r in records)
    assert len(records) == MESSAGES + 2
    by_key: dict[str | None, list[str]] = defaultdict(list)
    for record in records:
        by_key[record["key"]].append(record["payload"])
    for i in range(KEYS):
        assert by_key[f"acct-{i}"] == [str(n) for n in range(i, MESSAGES, KEYS)]
    assert by_key["7"] == ['{"id": 7, "n": 1}'] and by_key[None] == ['{"n": 2}']


def test_produce_rejects_bad_input_with_the_line_number(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "data") as server:
        url = ["--url", server.url, "--topic", "orders"]
        no_separator = run_cli("produce", *url, "--key-field", ",", stdin="a,1\nno separator here\n")
        assert no_separator.returncode != 0
        assert "line 2: no ',' separator between key and payload" in no_separator.stderr
        not_json = run_cli("produce", *url, "--json", stdin='{"a": 1}\n[1, 2]\n')
        assert "line 2: expected a JSON object, got list" in not_json.stderr
        missing = run_cli("produce", *url, "--file", str(tmp_path / "absent.txt"))
        assert missing.returncode != 0 and "cannot read" in missing.stderr and "absent.txt" in missing.stderr


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
