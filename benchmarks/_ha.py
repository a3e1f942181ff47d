"""bench_cluster's replicated store: a Patroni group, the probe that times its failovers, and the counts of what
its kills lost or stored twice.

The group is :class:`keyfailover.tools.services.PatroniGroup`: two PostgreSQL members under Patroni in
synchronous mode, its state in the benchmark's ZooKeeper. :class:`HAStore` gives each cluster of the benchmark
a database of its own in it. :class:`FailoverProbe` sends one message at a time through the brokers and retries on
errors by itself, so the time from a primary's kill to the first write acknowledged again is measured to a
few milliseconds. :class:`SteadyTraffic` sends through the client's normal path only; what it was told is
stored is compared with what the store holds at the end by :func:`lost_and_duplicated`.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import struct
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import asyncpg

from keyfailover.client import Client
from keyfailover.tools.services import PatroniGroup, ServiceError

__all__ = [
    "HA_TTL",
    "FailoverProbe",
    "FailoverSummary",
    "HAStore",
    "Losses",
    "SteadyTraffic",
    "database_url",
    "lost_and_duplicated",
    "summarise_failovers",
]

HA_TTL = 10
"""Patroni's ``ttl`` of the group: a primary that stops renewing its leader key is replaced within about this."""
HA_MARGIN = 5.0
"""The issue's bar: the median store failover within ``ttl`` plus this many seconds."""
STEADY_PERIOD = 0.02
PROBE_PATIENCE = 1.0
"""Seconds the probe waits for a receipt before it sends its next message (the unanswered one stays queued)."""
INDEX = struct.Struct("<q")


def database_url(dsn: str, name: str) -> str:
    """``dsn`` with its database replaced by ``name``, its hosts and query kept."""
    parts = urllib.parse.urlsplit(dsn)
    if not parts.path.strip("/"):
        raise ValueError(f"the PostgreSQL URL {dsn!r} names no database; expected postgresql://user@hosts/database")
    return urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))


@dataclass(frozen=True)
class FailoverSummary:
    """The seconds of each store failover, in kill order, and their least, median and largest."""

    seconds: tuple[float, ...]
    least: float
    median: float
    largest: float

    def meets(self, ttl: float, margin: float = HA_MARGIN) -> bool:
        """Whether the median is within ``ttl`` plus ``margin`` seconds: the issue's bar."""
        return self.median <= ttl + margin


def summarise_failovers(seconds: Sequence[float]) -> FailoverSummary:
    """The least, median and largest of the failover times ``seconds``; ValueError when there are none."""
    if not seconds:
        raise ValueError("no store failover was measured; expected at least one kill")
    return FailoverSummary(tuple(seconds), min(seconds), statistics.median(seconds), max(seconds))


@dataclass(frozen=True)
class Losses:
    """What the store holds of one producer against what it was told is stored."""

    acknowledged: int
    stored: int
    lost: int  # acknowledged, not stored
    twice_by_sequence: int  # extra rows of a (partition, producer, sequence id) stored more than once
    twice_by_payload: int  # extra rows of a message index stored more than once


def lost_and_duplicated(acknowledged: Iterable[int], stored: Sequence[tuple[int, str, int, int]]) -> Losses:
    """Compare the message indices ``acknowledged`` with the rows ``stored``: partition, producer, sequence id and
    the message index its payload carries. A producer's sequence ids count within each partition."""
    acked = set(acknowledged)
    indices = Counter(row[3] for row in stored)
    sequences = Counter(row[:3] for row in stored)
    return Losses(
        acknowledged=len(acked),
        stored=len(stored),
        lost=len(acked - indices.keys()),
        twice_by_sequence=sum(n - 1 for n in sequences.values()),
        twice_by_payload=sum(n - 1 for n in indices.values()),
    )


class HAStore:
    """A :class:`PatroniGroup` of two members in ``hosts``'s ZooKeeper for the whole benchmark, a database of it per
    cluster; the group is stopped and its folder removed at exit."""

    def __init__(self, hosts: str) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="bench_cluster-patroni-"))  # under /tmp: open to postgres
        self.group = PatroniGroup(self._folder, hosts, namespace="/bench-cluster-store", ttl=HA_TTL)

    def __enter__(self) -> HAStore:
        try:
            self.group.start()
        except ServiceError as error:
            shutil.rmtree(self._folder, ignore_errors=True)
            raise SystemExit(f"cannot start the Patroni group of the replicated store: {error}") from None
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.group.stop()
        shutil.rmtree(self._folder, ignore_errors=True)

    def fetch(self, database: str, statement: str, *args: object) -> list[Any]:
        """The rows ``statement`` returns in ``database``, on whichever member is the primary."""

        async def run() -> list[Any]:
            connection = await asyncpg.connect(database_url(self.group.dsn, database), timeout=10.0)
            try:
                return list(await connection.fetch(statement, *args))
            finally:
                await connection.close()

        return asyncio.run(run())

    def create_database(self, name: str) -> str:
        """A new, empty database ``name`` on the group: its URL naming every member."""
        self.fetch(self.group.database, f'CREATE DATABASE "{name}"')
        return database_url(self.group.dsn, name)

    def settings(self) -> str:
        """The primary's settings that decide what a commit survives, as it runs them."""
        names = ("synchronous_commit", "synchronous_standby_names", "fsync")
        return ", ".join(f"{name}={self.fetch(self.group.database, f'SHOW {name}')[0][0]}" for name in names)

    def postmasters(self) -> list[int]:
        """The process ids of the members' running postmasters."""
        found = []
        for name in self.group.names:
            try:
                found.append(int((self._folder / name / "data" / "postmaster.pid").read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                continue
        return found


class FailoverProbe:
    """A thread sending one message at a time to ``keys`` in turn through a client of its own: the next once the
    last is acknowledged, refused, or unanswered for PROBE_PATIENCE seconds; it records when each send
    began and when its receipt came."""

    def __init__(self, address: str, topic: str, keys: Sequence[str], poll: float) -> None:
        self._client = Client(address)
        self._producer = self._client.create_producer(topic, "failover-probe")
        self._keys = keys
        self._poll = poll
        self._lock = threading.Lock()
        self._acked: list[tuple[float, float]] = []  # (send began, receipt came), monotonic seconds
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="failover-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sent = 0
        while not self._stop.is_set():
            self._send(self._keys[sent % len(self._keys)]).wait(PROBE_PATIENCE)
            sent += 1
            self._stop.wait(self._poll)

    def _send(self, key: str) -> threading.Event:
        """Send one message to ``key``; an event set once it is acknowledged or refused, as recorded."""
        answered = threading.Event()
        began = time.monotonic()

        def done(_position: int | None, error: BaseException | None) -> None:
            """Record the receipt of the send, or count its refusal."""
            with self._lock:
                if error is None:
                    self._acked.append((began, time.monotonic()))
                else:
                    self.refused += 1
            answered.set()

        self._producer.send_async(b"probe", key, done)
        return answered

    def first_ack_after(self, since: float) -> float | None:
        """When the first receipt of a send begun at or after ``since`` came; None before one did."""
        with self._lock:
            times = [acked for began, acked in self._acked if began >= since]
        return min(times) if times else None

    def stop(self) -> None:
        """Stop sending and close the client, whose close waits for the queued messages."""
        self._stop.set()
        self._thread.join(timeout=60.0)
        self._client.close()


class SteadyTraffic:
    """A thread sending, through the client's normal path only, one message to each of ``keys`` every STEADY_PERIOD
    seconds, each carrying its index; it records the indices acknowledged and counts those refused."""

    def __init__(self, client: Client, topic: str, keys: Sequence[str], name: str) -> None:
        self._producer = client.create_producer(topic, name)
        self.name = name
        self._keys = keys
        self._lock = threading.Lock()
        self.acknowledged: list[int] = []
        self.refused = 0
        self.first_refusal: str | None = None
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steady-traffic", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(STEADY_PERIOD):
            for key in self._keys:
                self._producer.send_async(INDEX.pack(self.sent), key, self._recorder(self.sent))
                self.sent += 1

    def _recorder(self, index: int) -> Callable[[int | None, BaseException | None], None]:
        """The send callback of message ``index``."""

        def done(_position: int | None, error: BaseException | None) -> None:
            """Record ``index`` acknowledged, or count its refusal and keep the first one's message."""
            with self._lock:
                if error is None:
                    self.acknowledged.append(index)
                else:
                    self.refused += 1
                    self.first_refusal = self.first_refusal or f"{type(error).__name__}: {error}"

        return done

    def stop(self, timeout: float) -> None:
        """Stop sending and wait up to ``timeout`` seconds for every receipt or refusal."""
        self._stop.set()
        self._thread.join(timeout=timeout)
        self._producer.flush(timeout=timeout)
