"""The account events the server demos run: consumers on threads and what they observed."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from keyfailover.client import Client, ClientClosed, Consumer, Timeout

__all__ = ["Observed", "Worker", "wait_for"]


class Observed:
    """What all consumers saw, shared between their threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.first: dict[int, str] = {}
        self.first_by_key: dict[str, list[int]] = defaultdict(list)
        self.deliveries: dict[str, int] = defaultdict(int)
        self.redeliveries = 0

    def record(self, consumer: str, position: int, key: str, redelivery_count: int) -> None:
        with self.lock:
            self.deliveries[consumer] += 1
            self.redeliveries += redelivery_count > 0
            if position not in self.first:
                self.first[position] = consumer
                self.first_by_key[key].append(position)


class Worker:
    """One consumer on its own thread; ``stall`` stops it acking (it keeps what it holds)."""

    def __init__(self, client: Client, name: str, observed: Observed, queue: int, *, stalled: bool = False) -> None:
        self.name = name
        self.consumer: Consumer = client.subscribe("accounts", "ledger", consumer_name=name, receiver_queue_size=queue)
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
            key = message.key.decode() if isinstance(message.key, bytes) else str(message.key)
            self._observed.record(self.name, message.position, key, message.redelivery_count)
            if not self.stalled.is_set():
                self.consumer.acknowledge(message)

    def leave(self) -> None:
        self.stop.set()
        self._thread.join(timeout=10)
        self.consumer.close()


def wait_for(condition: object, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return True
        time.sleep(0.05)
    return False
