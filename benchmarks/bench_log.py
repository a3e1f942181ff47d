"""Append and read throughput of the SQLite log, against plain ``sqlite3`` as the peer.

Run: ``python benchmarks/bench_log.py [--quick]``. Messages have a 100-byte payload and a
str key; each append call is one produce request of 1, 100 or 1000 messages, committed
on its own, with ``synchronous`` full (the write-ahead log synced at every commit) and
normal (synced at checkpoints only: durable across a crash of the process, not of the
machine). ``Log.append`` runs with a named producer (sequence ids indexed for dedup, as
the client always sends them) and without one.

The peer, in the same run, is the least any SQLite log can do: ``executemany`` of
``(position, payload)`` rows into a bare rowid table, one transaction per batch, in the
same WAL mode. Reads page through a topic 1000 messages at a time (``Log.read`` against
the same query on the bare table), and ``Log.read_positions`` fetches sets of 1000 positions
as replays do: every fourth of a stretch of 4000 (what one of four consumers had in flight
when it left), and, the worst case, 1000 drawn at random from the whole topic. The log
stores the messages of a produce request together (entries of up to 256): a position read
alone costs the decoding of its entry. Every run checks the positions it got back.
"""

from __future__ import annotations

import os
import random
import sqlite3
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Literal

from _common import SEED, best_of, format_count, parse_quick, print_goals, print_table

from keyfailover.broker.storage.sqlite import Log

Synchronous = Literal["full", "normal"]

PAYLOAD = b"x" * 100
TOPIC = "bench"
READ_PAGE = 1000
GOAL = 200_000.0

COUNTS: dict[tuple[Synchronous, int], int] = {
    ("full", 1): 1000,
    ("full", 100): 50_000,
    ("full", 1000): 200_000,
    ("normal", 1): 5000,
    ("normal", 100): 50_000,
    ("normal", 1000): 200_000,
}
"""Messages appended per measurement (a tenth with ``--quick``)."""


def _messages(count: int) -> list[tuple[int, str, bytes]]:
    return [(seq, f"key-{seq % 1000}", PAYLOAD) for seq in range(1, count + 1)]


def _in_fresh_folder(action: Callable[[Path], float]) -> float:
    with tempfile.TemporaryDirectory(prefix="bench_log-") as folder:
        return action(Path(folder))


def append_log(synchronous: Synchronous, batch: int, count: int, producer: str | None) -> float:
    """Seconds for ``Log.append`` to store ``count`` messages, ``batch`` per call."""
    messages = _messages(count)
    batches = [
        [(seq if producer else None, key, payload) for seq, key, payload in messages[start : start + batch]]
        for start in range(0, count, batch)
    ]

    def run(folder: Path) -> float:
        with Log(folder / "log.db", synchronous=synchronous) as log:
            start = time.perf_counter()
            for chunk in batches:
                log.append([(TOPIC, producer, chunk)])
            seconds = time.perf_counter() - start
            if log.last_position(TOPIC) != count:
                raise SystemExit(f"Log.append stored {log.last_position(TOPIC)} messages; expected {count}")
        return seconds

    return _in_fresh_folder(run)


def _bare_table(path: Path, synchronous: Synchronous) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute(f"PRAGMA synchronous = {synchronous.upper()}")
    db.execute("CREATE TABLE messages (position INTEGER PRIMARY KEY, payload BLOB NOT NULL)")
    return db


def append_peer(synchronous: Synchronous, batch: int, count: int) -> float:
    """Seconds for plain ``sqlite3`` executemany to store ``count`` (position, payload) rows, ``batch`` a commit."""
    payloads = [[PAYLOAD] * min(batch, count - start) for start in range(0, count, batch)]

    def run(folder: Path) -> float:
        db = _bare_table(folder / "peer.db", synchronous)
        position = 0
        start = time.perf_counter()
        for chunk in payloads:
            rows = [(position + i, payload) for i, payload in enumerate(chunk, 1)]
            position += len(chunk)
            db.execute("BEGIN IMMEDIATE")
            db.executemany("INSERT INTO messages (position, payload) VALUES (?, ?)", rows)
            db.execute("COMMIT")
        seconds = time.perf_counter() - start
        stored = db.execute("SELECT count(*) FROM messages").fetchone()[0]
        db.close()
        if stored != count:
            raise SystemExit(f"the peer stored {stored} rows; expected {count}")
        return seconds

    return _in_fresh_folder(run)


def read_log(log: Log, count: int) -> float:
    """Seconds for ``Log.read`` to page through all ``count`` messages."""
    start = time.perf_counter()
    after = 0
    while page := log.read(TOPIC, after, READ_PAGE):
        after = page[-1].position
    seconds = time.perf_counter() - start
    if after != count:
        raise SystemExit(f"Log.read ended at position {after}; expected {count}")
    return seconds


def read_positions_log(log: Log, sets: list[list[int]]) -> float:
    """Seconds for ``Log.read_positions`` to fetch every set of positions."""
    start = time.perf_counter()
    found = [log.read_positions(TOPIC, positions) for positions in sets]
    seconds = time.perf_counter() - start
    if [sorted(f) for f in found] != [sorted(s) for s in sets]:
        raise SystemExit("Log.read_positions missed positions it stored")
    return seconds


def read_peer(db: sqlite3.Connection, count: int) -> float:
    """Seconds for the same paging query on the bare table."""
    start = time.perf_counter()
    after = 0
    while page := db.execute(
        "SELECT position, payload FROM messages WHERE position > ? ORDER BY position LIMIT ?", (after, READ_PAGE)
    ).fetchall():
        after = page[-1][0]
    seconds = time.perf_counter() - start
    if after != count:
        raise SystemExit(f"the peer's read ended at position {after}; expected {count}")
    return seconds


def main() -> None:
    quick = parse_quick(__doc__ or "")
    repeats = 1 if quick else 3
    scale = 10 if quick else 1

    rows: list[list[str]] = []
    rates: dict[tuple[str, Synchronous, int], float] = {}
    for (synchronous, batch), full_count in COUNTS.items():
        count = full_count // scale
        writers: list[tuple[str, Callable[[], float]]] = [
            ("Log.append, named producer", partial(append_log, synchronous, batch, count, "producer-1")),
            ("Log.append, no producer", partial(append_log, synchronous, batch, count, None)),
            ("sqlite3 executemany (peer)", partial(append_peer, synchronous, batch, count)),
        ]
        measured = [(name, count / best_of(run, repeats)[0]) for name, run in writers]
        peer = measured[-1][1]
        for name, rate in measured:
            rates[name, synchronous, batch] = rate
            rows.append(
                [
                    name,
                    synchronous,
                    str(batch),
                    format_count(count),
                    format_count(rate),
                    f"{1e6 / rate:.2f}",
                    f"{rate / peer:.2f}x",
                ]
            )
    print_table(
        f"Appends: {len(PAYLOAD)}-byte payloads, one commit per batch, WAL mode, best of {repeats}",
        ["writer", "synchronous", "batch", "messages", "messages/s", "µs/message", "vs peer"],
        rows,
    )

    count = 200_000 // scale
    rng = random.Random(SEED)
    sets = [rng.sample(range(1, count + 1), READ_PAGE) for _ in range(max(count // READ_PAGE // 4, 1))]
    stretches = [
        list(range(start, start + 4 * READ_PAGE, 4))
        for start in (rng.randrange(1, count - 4 * READ_PAGE + 2) for _ in range(len(sets)))
    ]
    with tempfile.TemporaryDirectory(prefix="bench_log-") as folder:
        with Log(Path(folder) / "log.db", synchronous="normal") as log:
            messages = _messages(count)
            for start in range(0, count, 1000):
                log.append([(TOPIC, "producer-1", messages[start : start + 1000])])
            sequential = best_of(lambda: read_log(log, count), repeats)[0]
            scattered = best_of(lambda: read_positions_log(log, sets), repeats)[0]
            spread = best_of(lambda: read_positions_log(log, stretches), repeats)[0]
        db = _bare_table(Path(folder) / "peer.db", "normal")
        db.executemany("INSERT INTO messages VALUES (?, ?)", ((p, PAYLOAD) for p in range(1, count + 1)))
        peer = best_of(lambda: read_peer(db, count), repeats)[0]
        db.close()
        file_size = os.path.getsize(Path(folder) / "log.db")
    fetched = len(sets) * READ_PAGE
    readers = [
        ("Log.read, pages of 1000", count, sequential),
        ("Log.read_positions, every 4th of 4000", fetched, spread),
        ("Log.read_positions, random sets of 1000", fetched, scattered),
        ("sqlite3 paging query (peer)", count, peer),
    ]
    peer_rate = count / peer
    print_table(
        f"Reads: {count:,} stored messages ({file_size / count:.0f} bytes each on disk), best of {repeats}",
        ["reader", "messages", "messages/s", "µs/message", "vs peer"],
        [
            [name, format_count(n), format_count(n / s), f"{s / n * 1e6:.2f}", f"{n / s / peer_rate:.2f}x"]
            for name, n, s in readers
        ],
    )
    achieved = rates["Log.append, named producer", "normal", 1000]
    print_goals(
        [
            (
                f"Log.append, named producer, batches of 1000, synchronous=normal >= {format_count(GOAL)} messages/s",
                format_count(achieved),
                achieved >= GOAL,
            )
        ]
    )


if __name__ == "__main__":
    main()
