"""Account events through real servers: what the producer was told was stored, consumers on
threads and what they received, and the checks the demos with real processes end with.

An event is identified by its partition and position (positions count per partition); its
payload carries its number in the order produced, so each account's events can be checked
against the order they were produced in, not only the order they were stored in.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from itertools import pairwise
from typing import TextIO

from keyfailover.client import Client, ClientClosed, Consumer, Message, Producer, Timeout
from keyfailover.core.partitions import partition_of_key
from keyfailover.tools.demo._report import DemoReport, final_table, verdict

__all__ = [
    "SUBSCRIPTION",
    "TOPIC",
    "Arrivals",
    "Observed",
    "Produced",
    "Worker",
    "check_events",
    "conclude",
    "wait_for",
]

TOPIC = "accounts"
"""The topic of the account events."""
SUBSCRIPTION = "ledger"
"""The subscription the demos' consumers share."""

EventId = tuple[int, int]
"""(partition, position) of a stored event."""


class Arrivals:
    """When something happened in each partition (wall-clock seconds, in order); the owner's lock guards it."""

    def __init__(self) -> None:
        self._times: dict[int, list[float]] = defaultdict(list)

    def add(self, partition: int, at: float) -> None:
        """Note that something happened in ``partition`` at ``at``."""
        self._times[partition].append(at)

    def first_after(self, partition: int, at: float) -> float | None:
        """The first time in ``partition`` after ``at``; None when nothing happened there since."""
        times = self._times.get(partition, [])
        index = bisect.bisect_right(times, at)
        return times[index] if index < len(times) else None


class Produced:
    """What the producer was told: each stored event's account and number, by (partition, position)."""

    def __init__(self, partitions: int) -> None:
        self.lock = threading.Lock()
        self.stored: dict[EventId, tuple[str, int]] = {}
        self.stored_at = Arrivals()
        self.failed: list[str] = []
        self._acked: list[tuple[float, int]] = []  # (when, event number) of each event stored, in that order
        self._partitions = partitions

    def send(self, producer: Producer, key: str, number: int) -> None:
        """Send event ``number`` of account ``key``; it is remembered once the server confirms it stored it."""
        partition = partition_of_key(key, self._partitions)

        def done(position: int | None, error: BaseException | None) -> None:
            with self.lock:
                if error is None and position is not None:
                    self.stored[(partition, position)] = (key, number)
                    now = time.time()
                    self.stored_at.add(partition, now)
                    self._acked.append((now, number))
                else:
                    self.failed.append(f"event {number} of {key} was not stored: {error}")

        producer.send_async(f"{key}:{number}:{(number * 37) % 1000 - 500}".encode(), key, done)

    def first_stored_from(self, number: int, since: float) -> float | None:
        """When the server first confirmed, after ``since``, an event numbered ``number`` or higher; None: none yet."""
        with self.lock:
            start = bisect.bisect_right(self._acked, (since, number))
            return next((at for at, acked in self._acked[start:] if acked >= number), None)


class Observed:
    """What all consumers received, shared between their threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.first: dict[EventId, str] = {}
        """The consumer each event was first delivered to."""
        self.numbers_by_key: dict[str, list[int]] = defaultdict(list)
        """Each account's event numbers, in the order they were first delivered."""
        self.deliveries: dict[str, int] = defaultdict(int)
        self.redeliveries = 0
        self.received_at = Arrivals()

    def record(self, consumer: str, message: Message) -> None:
        """Record a delivery to ``consumer``: the counts, and which consumer had each event first."""
        key = message.key.decode() if isinstance(message.key, bytes) else str(message.key)
        number = int(message.payload.split(b":")[1])
        event = (message.partition, message.position)
        with self.lock:
            self.deliveries[consumer] += 1
            # A redelivery; or, after a failover, the new broker delivering again what the old one had
            # delivered and not seen acked: its redelivery_count starts at 0.
            self.redeliveries += message.redelivery_count > 0 or event in self.first
            self.received_at.add(message.partition, time.time())
            if event not in self.first:
                self.first[event] = consumer
                self.numbers_by_key[key].append(number)


def check_events(report: DemoReport, produced: Produced, observed: Observed) -> None:
    """Fill ``report`` with what was stored and consumed, and a problem for each guarantee broken:
    an event stored (confirmed to the producer) but never consumed, an event stored twice, an
    account whose events were first delivered out of the order they were produced in."""
    with produced.lock, observed.lock:
        report.published = len(produced.stored)
        report.acked = len(observed.first)
        report.deliveries = dict(observed.deliveries)
        report.redeliveries = observed.redeliveries
        report.problems.extend(produced.failed)
        missing = sorted(produced.stored.keys() - observed.first.keys())
        if missing:
            key, number = produced.stored[missing[0]]
            partition, position = missing[0]
            report.problems.append(
                f"{len(missing)} stored events were never consumed, the first: event {number} of {key} "
                f"(partition {partition}, position {position})"
            )
        for key, numbers in sorted(observed.numbers_by_key.items()):
            twice = [number for number, count in Counter(numbers).items() if count > 1]
            if twice:
                report.problems.append(f"event {twice[0]} of {key} was stored twice (at two positions)")
                continue
            late = next(((earlier, later) for earlier, later in pairwise(numbers) if later < earlier), None)
            if late is not None:
                report.problems.append(
                    f"{key}: event {late[1]} was first delivered after event {late[0]}, which was produced after it"
                )


def conclude(out: TextIO, report: DemoReport, produced: Produced, observed: Observed) -> None:
    """Check the events (:func:`check_events`) and print the final table, the counts and the verdict."""
    check_events(report, produced, observed)
    final_table(out, report)
    out.write(f"\nstored {report.published}, consumed {report.acked}, redelivered {report.redeliveries}\n")
    held = "every event stored was consumed, none twice; each account's events first delivered in produced order"
    verdict(out, report, held)


class Worker:
    """One consumer of :data:`TOPIC` on its own thread; ``stall`` stops it acking (it keeps what it holds)."""

    def __init__(self, client: Client, name: str, observed: Observed, queue: int, *, stalled: bool = False) -> None:
        self.name = name
        self.consumer: Consumer = client.subscribe(TOPIC, SUBSCRIPTION, consumer_name=name, receiver_queue_size=queue)
        self.stalled = threading.Event()
        if stalled:
            self.stalled.set()
        self.stop = threading.Event()
        self._observed = observed
        self._thread = threading.Thread(target=self._run, name=f"demo-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.stalled.is_set():
                self.stop.wait(0.05)
                continue
            try:
                message = self.consumer.receive(timeout=0.2)
            except Timeout:
                continue
            except ClientClosed:
                return
            self._observed.record(self.name, message)
            if not self.stalled.is_set():
                self.consumer.acknowledge(message)

    def leave(self) -> None:
        """Stop receiving and close the consumer: its keys go to the others."""
        self.stop.set()
        self._thread.join(timeout=10)
        self.consumer.close()


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    """Poll ``condition`` until it holds (True) or ``seconds`` passed (False)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False
