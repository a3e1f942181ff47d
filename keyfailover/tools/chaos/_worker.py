"""The producer and consumer processes of a chaos run: each records what it saw as JSON lines.

Run by the harness as ``python -m keyfailover.tools.chaos produce|consume ...``, one
OS process each, so a fault can kill or suspend it. Every record is written through to the
kernel at once (a killed worker's records up to its last instant survive it), with times
from ``time.monotonic()``, the clock every process of the machine shares.

- ``produce``: sends keyed messages at a steady rate until SIGTERM; each key's sends are
  numbered 0, 1, 2, ... (the payload is ``key:value``); each receipt is a ``produced`` record,
  with the time of its send.
- ``consume``: receives until SIGTERM; each message is a ``delivered`` record, then it is
  acknowledged with the broker's confirmation, recorded as ``acked`` with the time the ack was
  sent: first with ``confirmed`` None (sent, outcome not known yet), then with the answer: True
  (settled) or False (refused: the lease had ended). An ack without an answer (a timeout, the
  session or the worker gone) stays on record as sent, its outcome unknown, as Jepsen records an
  indeterminate operation: the broker may have settled it, or it comes again.

``consume --lossy SEED`` makes the consumer reach every broker through a :class:`FaultProxy` of its
own (its event loops connect through it: a loop factory, :func:`keyfailover.core.loops.set_loop_factory`);
SIGUSR1 starts a loss fault on those links, SIGUSR2 ends it. That is how ``keyfailover chaos`` loses a consumer's
packets: brokers advertise one address to every client, so a consumer's own links can only be
told apart inside it.

``consume --mutate`` breaks a guarantee on purpose, so tests can show the checkers catch it:
``drop`` acknowledges the 20th message without handing it to the application (a loss),
``reorder`` holds back the first message after the 20th delivery whose key it has received five
times (a hot key) and hands it only after the next message of that key (out of order).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from keyfailover.client import Client, Message, NotInFlight
from keyfailover.client.aio import Key, parse_url
from keyfailover.core.errors import KeyFailoverError
from keyfailover.core.loops import loop_class, set_loop_factory
from keyfailover.core.partitions import partition_of_key
from keyfailover.tools.chaos._proxy import FaultProxy
from keyfailover.tools.chaos._records import UNANSWERED, Acked, Delivered, Produced, RecordWriter
from keyfailover.tools.chaos._schedule import heal, lose

__all__ = ["MUTATIONS", "consume", "key_draws", "main", "produce"]

TICK = 0.01
"""Seconds between the producer's bursts: a rate of R sends R * TICK messages per burst."""


def key_draws(keys: int, distribution: str, seed: int, count: int) -> list[int]:
    """``count`` key numbers in ``[0, keys)``: Zipf(1.1) (key 0 the hottest) or uniform."""
    rng = np.random.default_rng(seed)
    if distribution == "uniform":
        uniform: list[int] = rng.integers(0, keys, count).tolist()
        return uniform
    drawn: list[int] = []
    while len(drawn) < count:
        batch = rng.zipf(1.1, count * 2)
        drawn += (batch[batch <= keys] - 1)[: count - len(drawn)].tolist()
    return drawn


class _LossyLinks:
    """A proxy of this process's own for each broker address, and whether they lose packets now."""

    def __init__(self, addresses: list[tuple[str, int]], seed: int) -> None:
        self._lock = threading.Lock()
        self._proxies = {
            address: FaultProxy(address, seed=seed + index).start() for index, address in enumerate(addresses)
        }

    def through(self, host: str, port: int) -> tuple[str, int]:
        """The proxy to connect to instead of ``host:port`` (itself when it is no broker's address)."""
        proxy = self._proxies.get((host, port))
        return (host, port) if proxy is None else proxy.address

    def switch(self, losing: bool) -> None:
        with self._lock:
            (lose if losing else heal)(self._proxies.values())

    def close(self) -> None:
        for proxy in self._proxies.values():
            proxy.close()


def _through_proxies(links: _LossyLinks) -> None:
    """Make every event loop this process creates from now on connect to brokers through ``links`` (the
    proxies' own loops were made before, so they connect to the brokers themselves)."""

    class Loop(loop_class()):  # type: ignore[misc]
        async def create_connection(
            self, protocol_factory: Any, host: str | None = None, port: int | None = None, **kwargs: Any
        ) -> Any:
            if host is None or port is None:
                raise ValueError("a chaos worker connects to a host and port, not a socket or path")
            proxy_host, proxy_port = links.through(host, port)
            return await super().create_connection(protocol_factory, proxy_host, proxy_port, **kwargs)

    set_loop_factory(Loop)
    signal.signal(signal.SIGUSR1, lambda signum, frame: links.switch(True))
    signal.signal(signal.SIGUSR2, lambda signum, frame: links.switch(False))


def _stop_on_sigterm() -> threading.Event:
    stop = threading.Event()

    def handle(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    return stop


def produce(
    url: str, topic: str, name: str, records: Path, *, rate: float, keys: int, distribution: str, seed: int
) -> None:
    """Send at ``rate`` messages a second until SIGTERM, then wait for the receipts of what was sent.

    A send still unanswered after that wait is recorded as failed with :data:`UNANSWERED`: the
    producer got no receipt and no error for it (a producer stalled on a partition).
    """
    stop = _stop_on_sigterm()
    waiting: dict[tuple[str, int], float] = {}  # sends not answered yet and when they were made
    guard = threading.Lock()
    with RecordWriter(records) as writer, Client(url) as client:
        producer = client.create_producer(topic, name)
        partitions = producer.partitions
        values: dict[str, int] = {}
        draws: Iterator[int] = iter(())
        per_tick = max(rate * TICK, 1e-9)
        owed = 0.0
        start = time.monotonic()
        ticks = 0
        while not stop.is_set():
            owed += per_tick
            while owed >= 1.0:
                owed -= 1.0
                number = next(draws, None)
                if number is None:
                    draws = iter(key_draws(keys, distribution, seed + ticks, 10_000))
                    number = next(draws)
                key = f"key-{number}"
                value = values.get(key, 0)
                values[key] = value + 1
                sent = time.monotonic()

                def done(
                    position: int | None,
                    error: BaseException | None,
                    key: str = key,
                    value: int = value,
                    sent: float = sent,
                ) -> None:
                    with guard:
                        waiting.pop((key, value), None)
                    if error is None:
                        partition = partition_of_key(key, partitions)
                        writer.write(Produced(time.monotonic(), name, key, value, True, partition, position, sent=sent))
                    else:
                        writer.write(Produced(time.monotonic(), name, key, value, False, error=_said(error), sent=sent))

                with guard:
                    waiting[(key, value)] = sent
                producer.send_async(f"{key}:{value}".encode(), key, done)
            ticks += 1
            stop.wait(max(start + ticks * TICK - time.monotonic(), 0.0))  # pacing, not synchronisation
        try:
            producer.flush(timeout=60.0)
        except (KeyFailoverError, TimeoutError) as error:
            print(f"producer {name}: not every send was answered: {_said(error)}", file=sys.stderr)
        with guard:
            unanswered = sorted(waiting.items())
        for (key, value), sent in unanswered:
            writer.write(Produced(time.monotonic(), name, key, value, False, error=UNANSWERED, sent=sent))


def _said(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:300]


MUTATIONS = ("drop", "reorder")
_MUTATE_AFTER = 20
_HOT = 5


def consume(
    url: str,
    topic: str,
    name: str,
    records: Path,
    *,
    subscription: str,
    ack_timeout: float,
    mutate: str | None = None,
    lossy: int | None = None,
) -> None:
    """Receive and acknowledge (with the broker's confirmation) every message until SIGTERM."""
    stop = _stop_on_sigterm()
    brokers = [(host, int(port)) for host, _, port in (address.rpartition(":") for address in parse_url(url)[0])]
    links = _LossyLinks(brokers, lossy) if lossy is not None else None
    if links is not None:
        _through_proxies(links)
    with contextlib.ExitStack() as stack:
        if links is not None:
            stack.callback(links.close)
        writer = stack.enter_context(RecordWriter(records))
        client = stack.enter_context(Client(url))
        consumer = client.subscribe(topic, subscription, name, receiver_queue_size=50)

        def handle(message: Message, handed: bool = True) -> None:
            key = message.key if isinstance(message.key, str) else str(message.key)
            value = int(message.payload.rsplit(b":", 1)[1])
            partition, position = message.partition, message.position
            if handed:
                writer.write(
                    Delivered(time.monotonic(), name, key, value, partition, position, message.redelivery_count)
                )
            sent = time.monotonic()
            writer.write(Acked(sent, name, key, value, partition, position, None))
            try:
                consumer.acknowledge_confirmed(message, timeout=ack_timeout)
            except NotInFlight:  # refused: its lease had ended, the broker took the message back
                writer.write(Acked(sent, name, key, value, partition, position, False))
            except (KeyFailoverError, TimeoutError):
                pass  # no answer (a timeout, the session gone): settled or not, nobody can tell; it stays unknown
            else:
                writer.write(Acked(sent, name, key, value, partition, position, True))

        received = 0
        seen: Counter[Key] = Counter()
        held: Message | None = None
        while not stop.is_set():
            try:
                message = consumer.receive(timeout=0.2)
            except TimeoutError:
                continue
            except KeyFailoverError as error:
                print(f"consumer {name}: receive failed: {_said(error)}", file=sys.stderr)
                continue
            received += 1
            seen[message.key] += 1
            if mutate == "drop" and received == _MUTATE_AFTER:
                handle(message, handed=False)
            elif mutate == "reorder" and received >= _MUTATE_AFTER and seen[message.key] >= _HOT:
                held, mutate = message, None  # handed after the next message of its key
            else:
                handle(message)
                if held is not None and message.key == held.key:
                    handle(held)
                    held = None
        consumer.close()


def main(argv: Sequence[str] | None = None) -> None:
    """Run a producer or a consumer worker of a chaos run, as the harness starts it.

    ``argv`` is ``produce`` or ``consume`` and its flags.
    """
    parser = argparse.ArgumentParser(prog="python -m keyfailover.tools.chaos")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in ("produce", "consume"):
        sub = commands.add_parser(command)
        sub.add_argument("--url", required=True)
        sub.add_argument("--topic", required=True)
        sub.add_argument("--name", required=True)
        sub.add_argument("--records", type=Path, required=True)
    producing = commands.choices["produce"]
    producing.add_argument("--rate", type=float, required=True)
    producing.add_argument("--keys", type=int, required=True)
    producing.add_argument("--distribution", choices=("zipf", "uniform"), required=True)
    producing.add_argument("--seed", type=int, required=True)
    consuming = commands.choices["consume"]
    consuming.add_argument("--subscription", required=True)
    consuming.add_argument("--ack-timeout", type=float, required=True)
    consuming.add_argument("--mutate", choices=MUTATIONS, default=None)
    consuming.add_argument("--lossy", type=int, default=None, metavar="SEED")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    where = (args.url, args.topic, args.name, args.records)  # what both commands take first
    if args.command == "produce":
        produce(
            *where,
            rate=args.rate,
            keys=args.keys,
            distribution=args.distribution,
            seed=args.seed,
        )
    else:
        consume(
            *where,
            subscription=args.subscription,
            ack_timeout=args.ack_timeout,
            mutate=args.mutate,
            lossy=args.lossy,
        )
