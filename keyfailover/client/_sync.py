"""The blocking client, named after the Apache Pulsar Python client.

A :class:`Client` runs the asyncio client (:mod:`keyfailover.client.aio`) on a background thread.
Hot calls cross threads cheaply: ``send_async`` and ``acknowledge`` append to batches
that the loop flushes, and ``receive`` takes from a thread-safe inbox.

    client = Client("kf://127.0.0.1:6650")
    producer = client.create_producer("orders")
    position = producer.send(b"payload", key="customer-7")
    entries = client.read("orders", after=0, limit=100)  # the log by position: entries.messages, .through, .last
    consumer = client.subscribe("orders", "billing", consumer_name="c1")
    print(consumer.ranges)  # e.g. [(0, 16383), (40960, 49151)]: the hash ranges it owns
    msg = consumer.receive(timeout=1.0)
    consumer.acknowledge(msg)
    client.close()
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from keyfailover.client.aio import (
    AsyncClient,
    AsyncConsumer,
    AsyncProducer,
    ClientClosed,
    ConsumerBusyError,
    ConsumerClosedError,
    Key,
    LeaseExpiredError,
    LogEntries,
    LogEntry,
    Message,
    NoBrokerError,
    NotInFlight,
    PropertiesError,
    RangesCallback,
    SendCallback,
    ServerError,
    ServerTooOldError,
    Timeout,
)
from keyfailover.core.signals import interrupts_held, whole_loop
from keyfailover.core.subtypes import SubscriptionType

__all__ = [
    "Client",
    "ClientClosed",
    "Consumer",
    "ConsumerBusyError",
    "ConsumerClosedError",
    "LeaseExpiredError",
    "LogEntries",
    "LogEntry",
    "Message",
    "NoBrokerError",
    "NotInFlight",
    "Producer",
    "PropertiesError",
    "ServerError",
    "ServerTooOldError",
    "Timeout",
]

_T = TypeVar("_T")


class Client:
    """A connection to a keyfailover server, usable from any thread."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        connect_timeout: float = 10.0,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> None:
        """Connect to ``url`` (``kf://HOST:PORT[,HOST:PORT...]`` or, with TLS, ``kf+ssl://...``: any broker of a
        cluster; ``tls_ca``: the CA file to trust)."""
        self._closed = False
        self._loop = whole_loop()
        self._thread = threading.Thread(target=self._serve, name="keyfailover-client", daemon=True)
        try:  # Ctrl-C may come as the thread's start ends, or while connecting
            with interrupts_held():  # the loop's thread keeps them held: they always reach this thread
                self._thread.start()
            self._async = self._run(self._make(url, token, connect_timeout, tls_ca))
        except BaseException:
            self._stop_loop()
            raise

    def _serve(self) -> None:
        """The loop's thread: run the loop until it is stopped, then cancel what still runs on it (a connect
        or close that was interrupted) and close it, so that no task is left to be destroyed pending at exit.
        The thread closes the loop itself: after a Ctrl-C during ``Thread.start`` it may start only then."""
        try:
            self._loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            if pending:
                self._loop.run_until_complete(asyncio.wait(pending, timeout=5.0))
            self._loop.close()

    @staticmethod
    async def _make(
        url: str, token: str | None, connect_timeout: float, tls_ca: str | os.PathLike[str] | None
    ) -> AsyncClient:
        """Create the asyncio client and connect it, on the loop's thread."""
        return await AsyncClient(url, token, connect_timeout=connect_timeout, tls_ca=tls_ca).connect()

    def _run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        """Run ``coro`` on the loop and wait for its result; raises ClientClosed once the client is closed."""
        if self._closed:
            coro.close()
            raise ClientClosed("the client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def create_producer(self, topic: str, producer_name: str | None = None) -> Producer:
        """A producer for ``topic``."""
        return Producer(self, self._run(self._async.create_producer(topic, producer_name)))

    def subscribe(
        self,
        topic: str,
        subscription_name: str,
        consumer_name: str | None = None,
        receiver_queue_size: int = 1000,
        on_ranges_changed: RangesCallback | None = None,
        *,
        subscription_type: SubscriptionType | None = None,
        priority_level: int = 0,
    ) -> Consumer:
        """Join a subscription; returns once the server confirmed it.

        ``on_ranges_changed(ranges)`` runs on the client's thread with the consumer's new hash
        ranges each time they change: inclusive ``(start, end)`` pairs, sorted; empty for a standby.
        ``subscription_type`` and ``priority_level``: as :meth:`AsyncClient.subscribe
        <keyfailover.client.aio.AsyncClient.subscribe>`.
        """
        consumer = self._run(
            self._async.subscribe(
                topic,
                subscription_name,
                consumer_name,
                receiver_queue_size,
                on_ranges_changed,
                subscription_type=subscription_type,
                priority_level=priority_level,
            )
        )
        return Consumer(self, consumer)

    def read(
        self,
        topic: str,
        partition: int = 0,
        after: int = 0,
        limit: int = 1000,
        *,
        slots: tuple[int, int] | None = None,
        timeout: float | None = None,
    ) -> LogEntries:
        """The stored messages of a partition above position ``after``, at most ``limit``, optionally only those
        whose key's slot lies in ``slots``; as :meth:`AsyncClient.read <keyfailover.client.aio.AsyncClient.read>`."""
        return self._run(self._async.read(topic, partition, after, limit, slots=slots, timeout=timeout))

    def log_ends(self, topic: str, timeout: float | None = None) -> list[int]:
        """The last position of every partition of ``topic``, in partition order (0: an empty partition)."""
        return self._run(self._async.log_ends(topic, timeout))

    def server_errors(self) -> dict[str, int]:
        """Errors the server sent that answered no request (e.g. rejected acks), by code."""
        return self._async.server_errors()

    def close(self) -> None:
        """Flush producers, close consumers and the connection, stop the thread."""
        if self._closed:
            return
        try:
            self._run(self._async.close(), timeout=30.0)
        finally:
            self._closed = True
            self._stop_loop()

    def _stop_loop(self) -> None:
        """Stop the loop (also one whose thread is only starting: it stops at once) and wait for its thread."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Producer:
    """Sends keyed messages to one topic."""

    def __init__(self, client: Client, producer: AsyncProducer) -> None:
        self._client = client
        self._producer = producer

    @property
    def topic(self) -> str:
        """The topic it sends to."""
        return self._producer.topic

    @property
    def producer_name(self) -> str:
        """Its name: with its sequence ids, retries store each message once."""
        return self._producer.producer_name

    @property
    def partitions(self) -> int:
        """How many partitions the topic has (positions count within each)."""
        return self._producer.partitions

    def send(
        self,
        payload: bytes,
        key: Key = None,
        timeout: float | None = 30.0,
        *,
        properties: Mapping[str, str] | None = None,
        sequence_id: int | None = None,
    ) -> int:
        """Send and block until stored; returns the message's position.

        ``properties``: str keys and values sent with the message (at most 128, keys of at most 256
        characters, 64 KiB encoded); :class:`PropertiesError` refuses others and sends nothing.
        ``sequence_id``: the message's own sequence id, above the ones this producer sent before to its
        partition: a message sent again with the same id is stored once, and answered with the position
        it was stored at (:meth:`AsyncProducer.send_async <keyfailover.client.aio.AsyncProducer.send_async>`).
        """
        done = threading.Event()
        outcome: list[int | BaseException | None] = [None]

        def callback(position: int | None, error: BaseException | None) -> None:
            """Record the outcome and wake the sender."""
            outcome[0] = error if error is not None else position
            done.set()

        self._producer.send_async(payload, key, callback, properties=properties, sequence_id=sequence_id)
        if not done.wait(timeout):
            raise Timeout(f"message not confirmed within {timeout} s (it may still be stored)")
        result = outcome[0]
        if isinstance(result, BaseException):
            raise result
        assert result is not None
        return result

    def send_async(
        self,
        payload: bytes,
        key: Key = None,
        callback: SendCallback | None = None,
        *,
        properties: Mapping[str, str] | None = None,
        sequence_id: int | None = None,
    ) -> None:
        """Queue a message; ``callback(position, error)`` runs on the client's thread when stored.

        ``properties`` and ``sequence_id`` as for :meth:`send`; refused ones raise here, queuing nothing.
        """
        self._producer.send_async(payload, key, callback, properties=properties, sequence_id=sequence_id)

    def flush(self, timeout: float | None = 60.0) -> None:
        """Block until every message sent so far is stored."""
        self._client._run(self._producer.flush(), timeout)

    def close(self) -> None:
        """Flush, then refuse further sends."""
        self._client._run(self._producer.close())


class Consumer:
    """Receives messages; per key, in order, from one consumer at a time."""

    def __init__(self, client: Client, consumer: AsyncConsumer) -> None:
        self._client = client
        self._consumer = consumer

    @property
    def consumer_name(self) -> str:
        """Its name in the subscription."""
        return self._consumer.consumer_name

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The hash ranges this consumer owns now: inclusive ``(start, end)`` pairs, sorted; empty for a standby."""
        return self._consumer.ranges

    @property
    def partitions(self) -> int:
        """How many partitions the topic has (a message's position counts within its partition)."""
        return self._consumer.partitions

    def receive(self, timeout: float | None = None) -> Message:
        """The next message; raises :class:`Timeout` when none arrives within ``timeout`` seconds."""
        return self._consumer.wait_take(timeout)

    def acknowledge(self, message: Message) -> None:
        """Acknowledge ``message``: batched, sent from the client's thread soon after."""
        self._consumer.acknowledge(message)

    def acknowledge_confirmed(self, message: Message, timeout: float | None = 10.0) -> None:
        """Acknowledge ``message`` and wait for the server; :class:`LeaseExpiredError` when it came too late."""
        self._client._run(self._consumer.acknowledge_confirmed(message, timeout))

    def extend(self, message: Message, timeout: float | None = 10.0) -> None:
        """Renew ``message``'s lease (ack deadline) while still working on it; raises as acknowledge_confirmed."""
        self._client._run(self._consumer.extend(message, timeout))

    def negative_acknowledge(self, message: Message) -> None:
        """Redeliver ``message``; later prefetched messages of its key are dropped to keep order."""
        self._consumer.negative_acknowledge(message)

    def close(self) -> None:
        """Send pending acks and leave the subscription; its unacked messages go to others."""
        self._client._run(self._consumer.close())
