"""The asyncio client: producers and consumers over reconnecting connections to the brokers.

Names mirror the Apache Pulsar Python client. Everything here runs on one event loop;
:mod:`keyfailover.client` wraps it for threads. The client bootstraps from any broker of its
URL (``kf://h1:6651,h2:6652``), looks up each topic's partitions and the broker serving each,
produces each key to the partition of its slot (keyless messages round robin) and subscribes
to every partition of a topic, with one receive and ack API (as Pulsar's partitioned
consumer). When a connection drops, the client reconnects with backoff; when a partition
moves to another broker (a failover, or ``not_owner``), it looks the topic up again and
follows it. Either way it resubscribes its consumers (dropping what they had prefetched: the
server returned it to pending) and resends every produce batch not yet confirmed, with the
same producer name and sequence ids, so each message is stored once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import socket
import ssl
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

from keyfailover.core.errors import FATAL_CODES, ErrorCode, KeyFailoverError, NotInFlightError, PropertiesError
from keyfailover.core.errors import LeaseExpiredError as CoreLeaseExpiredError
from keyfailover.core.partitions import partition_of_key, partition_topic
from keyfailover.wire.properties import NO_PROPERTIES, Properties, encode_properties
from keyfailover.wire.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Close,
    CloseConsumer,
    Connect,
    Connected,
    ConsumerClosed,
    Decoder,
    Error,
    Extend,
    Flow,
    Frame,
    Key,
    Lookup,
    Messages,
    Nack,
    Ping,
    Pong,
    Produce,
    RangesChanged,
    Receipt,
    Route,
    Settled,
    Subscribe,
    Subscribed,
    check_name,
    encode,
    stream_transport,
)

__all__ = [
    "AsyncClient",
    "AsyncConsumer",
    "AsyncProducer",
    "ClientClosed",
    "ConsumerBusyError",
    "ConsumerClosedError",
    "Key",
    "LeaseExpiredError",
    "Message",
    "NoBrokerError",
    "NotInFlight",
    "PropertiesError",
    "ServerError",
    "Timeout",
    "parse_url",
]

Address = str
"""A broker's ``HOST:PORT``."""

RangesCallback = Callable[[list[tuple[int, int]]], None]
"""``on_ranges_changed(ranges)``: the consumer's new inclusive ``(start, end)`` hash ranges, sorted; empty: standby."""
SendCallback = Callable[["int | None", "BaseException | None"], None]

_log = logging.getLogger("keyfailover.client")

_MAX_BATCH = 1000
_MAX_BATCH_BYTES = 1 << 20
_MIN_BACKOFF = 0.05  # seconds before the second reconnect attempt; doubles up to _MAX_BACKOFF
_MAX_BACKOFF = 2.0
_STABLE = 5.0  # a connection up this long resets the backoff
# Refusals no retry can cure. The other fatal codes close one connection for a limit it hit
# (too many connections, too slow): the client reconnects, with backoff.
_PERMANENT: frozenset[str] = FATAL_CODES - {
    ErrorCode.TOO_MANY_CONNECTIONS,
    ErrorCode.SLOW_CONNECTION,
    ErrorCode.NOT_CONNECTED,
}


class Timeout(KeyFailoverError, TimeoutError):  # noqa: N818  (the name the Pulsar client uses)
    """Nothing arrived (or nothing was confirmed) within the timeout."""


class ClientClosed(KeyFailoverError, RuntimeError):  # noqa: N818  (reads as a state, like Timeout)
    """The client, producer or consumer was closed."""


class ConsumerClosedError(ClientClosed):
    """The server ended the consumer for good (another consumer of the same name superseded it)."""


class NoBrokerError(ClientClosed, ConnectionError):
    """None of the brokers the client was given answers."""


def _reason(exc: BaseException) -> str:
    """Why a connection failed, in words."""
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno).lower()
    return str(exc)


class ServerError(KeyFailoverError, RuntimeError):
    """The server rejected a request; ``code`` is the protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class ConsumerBusyError(ServerError):
    """The consumer name is in use by a live session of another client; pick another name."""


class NotInFlight(ServerError, NotInFlightError):  # noqa: N818  (the server's code: not_in_flight)
    """A confirmed ack, nack or extension named a message that is not in flight on this consumer."""


class LeaseExpiredError(NotInFlight, CoreLeaseExpiredError):
    """A confirmed ack, nack or extension came after the message's ack deadline: it was taken back.

    The message is (or will be) delivered again, maybe to another consumer; the late call
    changed nothing. Extend a lease (:meth:`AsyncConsumer.extend`) while still working on it.
    """


def _settle_error(reply: Error) -> ServerError:
    """The exception for an error answering an ack, nack or extension."""
    if reply.code == ErrorCode.LEASE_EXPIRED:
        return LeaseExpiredError(reply.code, reply.message)
    if reply.code == ErrorCode.NOT_IN_FLIGHT:
        return NotInFlight(reply.code, reply.message)
    return ServerError(reply.code, reply.message)


class Message(NamedTuple):
    """A received message; acknowledge or negatively acknowledge it on its consumer.

    ``position`` counts within its ``partition`` (0 for a topic of one partition).
    ``publish_time`` is when the broker stored it, by the broker's wall clock, in integer
    microseconds since the Unix epoch (``time.time_ns() // 1000`` on the broker); None when
    unknown (stored before logs had publish times). ``properties`` are the str keys and values
    its producer sent with it, a read-only mapping (empty when it has none). A dead letter, and
    a dead letter replayed, keeps the publish time and the properties of the message it was.
    Immutable, and a named tuple because a consumer creates one per message: that is a third
    of the cost of a frozen dataclass.
    """

    key: Key
    payload: bytes
    position: int
    redelivery_count: int
    session: int = 0
    partition: int = 0
    publish_time: int | None = None
    properties: Mapping[str, str] = NO_PROPERTIES

    def __repr__(self) -> str:
        shown = f", properties={dict(self.properties)!r}" if self.properties else ""
        return (
            f"Message(key={self.key!r}, payload={self.payload!r}, position={self.position}, "
            f"redelivery_count={self.redelivery_count}, publish_time={self.publish_time}{shown})"
        )


def parse_url(url: str) -> tuple[list[Address], bool]:
    """``kf://h1:p1[,h2:p2...]`` -> (["h1:p1", ...], False); ``kf+ssl://...`` -> (..., True): TLS."""
    expected = f"server URL {url!r} is not of the form kf://HOST:PORT[,HOST:PORT...] or kf+ssl://HOST:PORT[,...]"
    scheme, separator, rest = url.partition("://") if isinstance(url, str) else ("", "", "")
    if not separator or scheme not in ("kf", "kf+ssl") or not rest:
        raise KeyFailoverError(expected)
    addresses = []
    for item in rest.rstrip("/").split(","):
        try:
            parts = urlsplit(f"kf://{item}")
            port = parts.port
        except ValueError as exc:
            raise KeyFailoverError(f"{expected} ({exc})") from None
        if not parts.hostname or port is None or parts.path or parts.query:
            raise KeyFailoverError(expected)
        addresses.append(_address(parts.hostname, port))
    return addresses, scheme == "kf+ssl"


def _address(host: str, port: int) -> Address:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _host_port(address: Address) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise KeyFailoverError(f"broker address {address!r} is not of the form HOST:PORT")
    return host.strip("[]"), int(port)


def client_tls(ca_file: str | os.PathLike[str] | None) -> ssl.SSLContext:
    """A TLS context that verifies the server: against ``ca_file`` when given, else the system's CAs."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise KeyFailoverError(f"cannot load the CA file {ca_file}: {exc}; expected PEM certificates") from None


class _Link(asyncio.Protocol):
    """The client's connection to one broker, re-established with backoff whenever it drops."""

    def __init__(self, address: Address, token: str | None, tls: ssl.SSLContext | None, reqs: Iterator[int]) -> None:
        self.address = address
        self._host, self._port = _host_port(address)
        self._token = token
        self._tls = tls
        self._transport: asyncio.Transport | None = None
        self._decoder = Decoder(accept="client")
        # Request ids come from the client's one counter, unique across its links: a producer's
        # unconfirmed batches, keyed by request id, move between links in a failover.
        self._req = reqs
        self.pending: dict[int, Callable[[Frame | None], None]] = {}
        self.sessions: dict[int, _PartConsumer] = {}
        self.parties: list[_Part] = []
        self.ready = asyncio.Event()
        self.errors: Counter[str] = Counter()  # server errors not tied to a request, by code
        self.session_timeout = 10.0
        self.max_batch_bytes = _MAX_BATCH_BYTES  # lowered to half the server's frame limit at connect
        self.closed = False
        self.failure: ServerError | None = None  # a fatal refusal: the link is done for good
        self._ready_since = 0.0
        self._heard = 0.0  # when the server last sent anything
        self._connected_waiter: asyncio.Future[None] | None = None
        self._maintainer: asyncio.Task[None] | None = None
        self._lost = asyncio.Event()

    # -- connection life cycle -------------------------------------------------------

    async def start(self, timeout: float) -> None:
        await self._connect_once(timeout)
        self._maintainer = asyncio.get_running_loop().create_task(self._maintain(), name="keyfailover-link")

    async def _connect_once(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        self._decoder = Decoder(accept="client")
        self._connected_waiter = loop.create_future()
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(
                    lambda: self,
                    self._host,
                    self._port,
                    ssl=self._tls,
                    server_hostname=self._host if self._tls is not None else None,
                )
                await self._connected_waiter
        except TimeoutError:
            if self._transport is not None:
                self._transport.abort()
            raise Timeout(f"could not connect to kf://{self._host}:{self._port} within {timeout} s") from None

    async def _maintain(self) -> None:
        """Heartbeat while connected; reconnect with backoff and jitter when the connection drops.

        The backoff starts over only after a connection stayed up for ``_STABLE`` seconds, so a
        server that accepts and drops us at once is not hammered. A fatal refusal (a wrong
        token, a protocol violation) is not retried: it fails every producer and consumer.
        """
        nonce = itertools.count()
        delay = 0.0
        while not self.closed:
            interval = max(self.session_timeout / 4, 0.05)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._lost.wait()
            if self.closed:
                return
            if self.ready.is_set():
                silent = time.monotonic() - self._heard
                if silent > max(2 * self.session_timeout, 1.0) and self._transport is not None:
                    # Pings unanswered: the broker is stopped or cut off. Drop the connection, so
                    # its partitions are looked up again (another broker may serve them now).
                    _log.warning("no answer from %s for %.1f s; reconnecting", self.address, silent)
                    self._transport.abort()
                    continue
                self.send(Ping(nonce=next(nonce)))
                continue
            if time.monotonic() - self._ready_since >= _STABLE:
                delay = 0.0
            while not self.closed and not self.ready.is_set():
                if delay:
                    await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(max(delay * 2, _MIN_BACKOFF), _MAX_BACKOFF)
                try:
                    await self._connect_once(5.0)
                except ServerError as exc:
                    if exc.code in _PERMANENT:
                        self.fail(exc)
                        return
                    _log.info("reconnect to %s:%d refused (%s); retrying", self._host, self._port, exc)
                except (OSError, KeyFailoverError) as exc:
                    _log.info("reconnect to %s:%d failed (%s); retrying", self._host, self._port, exc)

    @property
    def heard(self) -> float:
        """When the server last sent anything on this link (monotonic seconds; 0: never)."""
        return self._heard

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = stream = stream_transport(transport)
        stream.write(encode(Connect(version=PROTOCOL_VERSION, token=self._token, client=_client_name())))

    def data_received(self, data: bytes) -> None:
        self._heard = time.monotonic()
        try:
            frames = self._decoder.feed(data)
        except KeyFailoverError as exc:
            _log.error("malformed data from the server (%s); reconnecting", exc)
            if self._transport is not None:
                self._transport.abort()
            return
        for frame in frames:
            self._dispatch(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        was_ready = self.ready.is_set()
        self.ready.clear()
        waiter = self._connected_waiter
        if waiter is not None and not waiter.done():
            hint = "" if self._tls is not None else "; if the server uses TLS, connect with kf+ssl://"
            waiter.set_exception(
                ConnectionError(f"the server closed the connection before answering connect ({exc}){hint}")
            )
        pending, self.pending = self.pending, {}
        for callback in pending.values():
            callback(None)
        self.sessions.clear()
        if self.failure is not None:
            self.fail(self.failure)
        elif was_ready:
            for party in list(self.parties):
                party.disconnected()
        self._lost.set()

    def fail(self, error: ServerError) -> None:
        """The server refused us for good: stop reconnecting; every producer and consumer fails with ``error``."""
        self.failure = error
        self.closed = True
        self._lost.set()
        for party in list(self.parties):
            party.failed(error)
        if self._transport is not None:
            self._transport.abort()

    def _dispatch(self, frame: Frame) -> None:
        if isinstance(frame, Messages | RangesChanged | ConsumerClosed):
            consumer = self.sessions.get(frame.session)
            if consumer is not None:
                consumer.on_frame(frame)
            if isinstance(frame, ConsumerClosed):
                self.sessions.pop(frame.session, None)
                if frame.req is not None and (callback := self.pending.pop(frame.req, None)) is not None:
                    callback(frame)
            return
        if isinstance(frame, Receipt | Subscribed | Settled | Route):
            callback = self.pending.pop(frame.req, None)
            if callback is not None:
                callback(frame)
            return
        if isinstance(frame, Error):
            callback = self.pending.pop(frame.req, None) if frame.req is not None else None
            waiter = self._connected_waiter
            if waiter is not None and not waiter.done():  # refused at connect: e.g. a wrong token
                waiter.set_exception(ServerError(frame.code, frame.message))
            elif callback is not None:
                callback(frame)
            else:
                self.errors[frame.code] += 1
                _log.warning("server error %s: %s", frame.code, frame.message)
                if frame.code in _PERMANENT:  # the server closes the connection next
                    self.failure = ServerError(frame.code, frame.message)
            return
        if isinstance(frame, Connected):
            self.session_timeout = frame.session_timeout
            self.max_batch_bytes = min(_MAX_BATCH_BYTES, frame.max_frame // 2)
            self._ready_since = time.monotonic()
            self.ready.set()
            if self._maintainer is not None:
                # A reconnection: what was unconfirmed goes out now, in this same step, before
                # anything queued meanwhile can send newer batches ahead of it.
                self._lost.clear()
                for party in list(self.parties):
                    party.reconnected()
            waiter = self._connected_waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            return
        if not isinstance(frame, Pong):
            _log.warning("unexpected %s frame from the server", frame.type)

    # -- requests --------------------------------------------------------------------

    def next_req(self) -> int:
        return next(self._req)

    def send(self, frame: Frame) -> bool:
        """Write ``frame`` if connected; False when it could not be sent now."""
        if self._transport is None or not self.ready.is_set():
            return False
        self._transport.write(encode(frame))
        return True

    async def close(self) -> None:
        self.closed = True
        self._lost.set()
        if self._maintainer is not None:
            await self._maintainer
        if self._transport is not None:
            self.send(Close())
            self._transport.close()


def _client_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class AsyncClient:
    """A client of a keyfailover server or cluster: producers and consumers of its topics."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        connect_timeout: float = 10.0,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> None:
        self._bootstrap, tls = parse_url(url)
        if tls_ca is not None and not tls:
            raise KeyFailoverError(f"tls_ca is given but {url!r} is plain TCP; expected a kf+ssl:// URL")
        self._url = url
        self._token = token
        self._tls = client_tls(tls_ca) if tls else None
        self._links: dict[Address, _Link] = {}
        self._reqs = itertools.count(1)
        self._connecting: dict[Address, asyncio.Task[_Link]] = {}
        self._connect_timeout = connect_timeout
        self._started = False
        self._closed = False
        self._failure: ServerError | None = None
        self._relocating: dict[_Part, asyncio.Task[None]] = {}
        self._again: set[_Part] = set()

    async def connect(self) -> AsyncClient:
        """Connect to the first broker of the URL that answers (done by the first create_producer/subscribe)."""
        if not self._started:
            self._started = True
            await self._any_link()
        return self

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def create_producer(self, topic: str, producer_name: str | None = None) -> AsyncProducer:
        """A producer for ``topic``; its name and sequence ids make retries store each message once."""
        check_name("topic", topic)
        if producer_name is not None:
            check_name("producer_name", producer_name)
        await self.connect()
        self._check_usable()
        links = await self._served(topic)
        name = producer_name or f"producer-{uuid.uuid4().hex}"
        parts = []
        for index, link in enumerate(links):
            part = _PartProducer(link, topic, index, len(links), name=name, on_lost=self._lost)
            link.parties.append(part)
            parts.append(part)
        return AsyncProducer(topic, name, parts)

    async def subscribe(
        self,
        topic: str,
        subscription_name: str,
        consumer_name: str | None = None,
        receiver_queue_size: int = 1000,
        on_ranges_changed: RangesCallback | None = None,
    ) -> AsyncConsumer:
        """Join ``subscription_name`` of ``topic`` (every partition of it); returns once the brokers confirmed it.

        ``on_ranges_changed(ranges)`` runs on the event loop with the consumer's new hash
        ranges (inclusive ``(start, end)`` pairs, sorted, over all partitions; empty for a
        standby) each time a rebalance changes them, and after a resubscribe that gets different ones.
        """
        if type(receiver_queue_size) is not int or receiver_queue_size < 1:
            raise KeyFailoverError(f"receiver_queue_size must be a positive int, not {receiver_queue_size!r}")
        check_name("topic", topic)
        check_name("subscription_name", subscription_name)
        if consumer_name is not None:
            check_name("consumer_name", consumer_name)
        await self.connect()
        self._check_usable()
        links = await self._served(topic)
        name = consumer_name or f"consumer-{uuid.uuid4().hex[:12]}"
        consumer = AsyncConsumer(topic, subscription_name, name, on_ranges_changed)
        for index, link in enumerate(links):
            part = _PartConsumer(
                link,
                topic,
                index,
                len(links),
                subscription=subscription_name,
                name=name,
                receiver_queue_size=receiver_queue_size,
                inbox=consumer.inbox,
                on_ranges=consumer.ranges_changed,
                on_lost=self._lost,
            )
            link.parties.append(part)
            consumer.parts.append(part)
        try:
            await consumer.subscribed()
        except BaseException:
            await consumer.close()
            raise
        return consumer

    def server_errors(self) -> dict[str, int]:
        """Errors the servers sent that answered no request (e.g. rejected acks), by code."""
        total: Counter[str] = Counter()
        for link in self._links.values():
            total.update(link.errors)
        return dict(total)

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise self._failure
        for link in self._links.values():
            if link.failure is not None:
                raise link.failure
        if self._closed:
            raise ClientClosed("the client is closed")

    async def close(self) -> None:
        """Flush producers, close consumers and the connections."""
        for link in list(self._links.values()):
            for party in list(link.parties):
                await party.close()
        self._closed = True
        for task in list(self._relocating.values()):
            task.cancel()
        for link in list(self._links.values()):
            await link.close()  # kept: server_errors() still counts what they were sent

    # -- brokers and partitions ------------------------------------------------------

    async def _link(self, address: Address) -> _Link:
        """The connection to the broker at ``address``, connected first if new."""
        link = self._links.get(address)
        if link is not None and link.failure is not None:
            raise link.failure  # refused for good (e.g. a wrong token): no retry cures it
        if link is not None and not link.closed:
            return link
        connecting = self._connecting.get(address)
        if connecting is None:
            connecting = asyncio.get_running_loop().create_task(self._open_link(address))
            self._connecting[address] = connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done():
                self._connecting.pop(address, None)

    async def _open_link(self, address: Address) -> _Link:
        link = _Link(address, self._token, self._tls, self._reqs)
        try:
            await link.start(self._connect_timeout)
        except ServerError as exc:
            if exc.code in _PERMANENT:
                self._failure = exc
            raise
        self._links[address] = link
        return link

    async def _any_link(self, avoid: _Link | None = None) -> _Link:
        """A connected link: the first one up that answered within two ping intervals (a link stalled by a
        lossy network stays up until its pings go unanswered for twice the session timeout), else the
        one up last heard from, else the first bootstrap broker that answers. ``avoid`` is taken only
        when no other link is up (the link a partition was just lost from: its broker may be the
        reason, and a lookup through a stalled link waits for as long as the stall)."""
        up = [link for link in self._links.values() if link.ready.is_set()]
        ready = [link for link in up if link is not avoid] or up
        if ready:
            now = time.monotonic()
            for link in ready:
                if now - link.heard <= max(link.session_timeout / 2, 1.0):
                    return link
            return max(ready, key=lambda link: link.heard)
        errors = []
        for address in self._bootstrap:
            known = self._links.get(address)
            if known is not None and not known.closed:
                errors.append(f"{address}: connection down, reconnecting")
                continue
            try:
                return await self._link(address)
            except ServerError:
                raise
            except (OSError, KeyFailoverError) as exc:
                if len(self._bootstrap) == 1:
                    raise
                errors.append(f"{address}: {_reason(exc)}")
        raise NoBrokerError(f"no broker of {self._url} could be reached ({'; '.join(errors)})")

    async def _lookup(self, topic: str, avoid: _Link | None = None) -> list[Address | None]:
        """The broker address of each partition of ``topic`` (None: not served right now), asked of a link
        other than ``avoid`` if another is up."""
        link = await self._any_link(avoid)
        answer: asyncio.Future[Frame | None] = asyncio.get_running_loop().create_future()
        req = link.next_req()

        def answered(reply: Frame | None) -> None:
            if not answer.done():
                answer.set_result(reply)

        link.pending[req] = answered
        if not link.send(Lookup(req=req, topic=topic)):
            link.pending.pop(req, None)
            raise ClientClosed(f"the connection to {link.address} dropped before the lookup of {topic!r}")
        try:
            async with asyncio.timeout(self._connect_timeout):
                reply = await answer
        except TimeoutError:
            link.pending.pop(req, None)
            raise Timeout(
                f"no answer to the lookup of {topic!r} from {link.address} within {self._connect_timeout} s"
            ) from None
        if isinstance(reply, Error):
            raise ServerError(reply.code, reply.message)
        if not isinstance(reply, Route):
            raise ClientClosed(f"the connection to {link.address} dropped before the lookup of {topic!r} was answered")
        return [link.address if broker == "" else broker for broker in reply.brokers]

    async def _served(self, topic: str) -> list[_Link]:
        """The connection to the broker of every partition of ``topic``, waiting (up to the connect
        timeout) while a failover leaves some partition without one, or a lookup names a broker that
        has just died (its connection refused: the brokers' view had not caught up yet)."""
        deadline = time.monotonic() + self._connect_timeout
        delay = _MIN_BACKOFF
        while True:
            brokers = await self._lookup(topic)
            served = [broker for broker in brokers if broker is not None]
            refused: OSError | None = None
            if len(served) == len(brokers):
                try:
                    return [await self._link(address) for address in served]
                except OSError as exc:
                    refused = exc
            if time.monotonic() + delay > deadline:
                if refused is not None:
                    raise refused
                missing = [index for index, broker in enumerate(brokers) if broker is None]
                raise Timeout(
                    f"partitions {missing[:10]} of {topic!r} had no broker for {self._connect_timeout} s; "
                    "is the cluster short of live brokers?"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_BACKOFF)

    def _lost(self, part: _Part) -> None:
        """``part`` lost its broker (a dropped connection, ``not_owner``, a moved partition): find it again."""
        if self._closed:
            return
        if part in self._relocating:
            self._again.add(part)  # the search under way looks once more before it ends
            return
        task = asyncio.get_running_loop().create_task(self._relocate(part), name=f"keyfailover-relocate {part.topic}")
        self._relocating[part] = task

    async def _relocate(self, part: _Part) -> None:
        """Look ``part``'s topic up until its partition's broker takes it, and move it there.

        After each move or retry the search waits (backoff with jitter, doubling): when the
        part is lost again meanwhile (the new broker has not opened the partition yet: it
        answers ``not_owner``), it looks again; else it is done. Its own broker coming back
        (the connection re-established) ends the search too: the link resubscribes and resends.
        """
        delay = _MIN_BACKOFF
        try:
            while not self._closed and not part.closed:
                self._again.discard(part)
                address = None
                with contextlib.suppress(OSError, KeyFailoverError):
                    brokers = await self._lookup(part.base_topic, avoid=part.link)
                    if part.partition < len(brokers):
                        address = brokers[part.partition]
                link = None
                if address is not None:
                    with contextlib.suppress(OSError, KeyFailoverError):
                        link = await self._link(address)
                if link is not None and link is not part.link:
                    old = part.link
                    part.move(link)
                    if not old.parties and old.address not in self._bootstrap:
                        self._links.pop(old.address, None)
                        await old.close()
                elif link is not None and link.ready.is_set():
                    part.resume()
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, _MAX_BACKOFF)
                if link is not None and link.ready.is_set() and part not in self._again:
                    return
        finally:
            self._relocating.pop(part, None)
            self._again.discard(part)


def _message_size(key: Key, payload: bytes, properties: bytes | None = None) -> int:
    """An upper bound on the encoded size of one message in a ``produce`` frame (with its encoded properties)."""
    if key is None:
        key_size = 0
    elif isinstance(key, str):
        try:
            key_size = len(key.encode())
        except UnicodeEncodeError as exc:
            raise KeyFailoverError(
                f"key {key!r} is not valid Unicode ({exc.reason} at index {exc.start}); expected a str that encodes "
                "to UTF-8"
            ) from None
    else:
        key_size = len(key)
    return len(payload) + key_size + 32 + (0 if properties is None else len(properties) + 8)


class _PendingBatch:
    __slots__ = ("callbacks", "messages", "properties", "size")

    def __init__(self) -> None:
        self.messages: list[tuple[int | None, Key, bytes]] = []
        self.callbacks: list[SendCallback | None] = []
        self.properties: list[bytes | None] | None = None
        """Each message's encoded properties, once one of them has some (None until then)."""
        self.size = 0

    def add(
        self, message: tuple[int | None, Key, bytes], callback: SendCallback | None, properties: bytes | None, size: int
    ) -> None:
        """Append one message of ``size`` bytes (:func:`_message_size`) with its encoded ``properties``."""
        self.messages.append(message)
        self.callbacks.append(callback)
        self.size += size
        if properties is not None or self.properties is not None:
            self.last_properties(properties)

    def last_properties(self, properties: bytes | None) -> None:
        """Record the encoded properties of the message appended last; called when it or an earlier one has some."""
        if self.properties is None:
            self.properties = [None] * (len(self.messages) - 1)
        self.properties.append(properties)

    def split(self, limit: int) -> list[_PendingBatch]:
        """This batch as consecutive batches of at most ``limit`` bytes each (itself when it fits)."""
        if self.size <= limit:
            return [self]
        parts = [_PendingBatch()]
        properties = self.properties or [None] * len(self.messages)
        for message, callback, encoded in zip(self.messages, self.callbacks, properties, strict=True):
            size = _message_size(message[1], message[2], encoded)
            part = parts[-1]
            if part.messages and part.size + size > limit:
                part = _PendingBatch()
                parts.append(part)
            part.add(message, callback, encoded, size)
        return parts


LostCallback = Callable[["_Part"], None]


class _Part(ABC):
    """A producer's or consumer's part for one partition of its topic, on its broker's link."""

    def __init__(self, link: _Link, base_topic: str, partition: int, partitions: int, on_lost: LostCallback) -> None:
        self.link = link
        self.base_topic = base_topic
        self.partition = partition
        self.topic = partition_topic(base_topic, partition, partitions)
        self._on_lost = on_lost

    def _relink(self, link: _Link) -> None:
        """Leave this part's link for ``link`` (the partition's broker now)."""
        with contextlib.suppress(ValueError):
            self.link.parties.remove(self)
        self.link = link
        link.parties.append(self)

    @property
    @abstractmethod
    def closed(self) -> bool:
        """Closed, or failed for good: nothing more to relocate."""

    @abstractmethod
    def disconnected(self) -> None:
        """The link dropped."""

    @abstractmethod
    def reconnected(self) -> None:
        """The link is back: subscribe or resend again."""

    @abstractmethod
    def failed(self, error: ServerError) -> None:
        """The link was refused for good."""

    @abstractmethod
    def move(self, link: _Link) -> None:
        """The partition is served by the broker of ``link`` now."""

    @abstractmethod
    def resume(self) -> None:
        """The partition's broker is this link's again: subscribe or resend what was refused."""

    @abstractmethod
    async def close(self) -> None:
        """Leave: flush or unsubscribe."""


class _Refusal:
    """The first message of a produce a broker refused with ``not_owner`` on one link.

    The broker refuses the producer's later produces on that connection until one starts at
    or before this message (so a resend cannot be overtaken by newer batches). When the
    message is stored through another broker meanwhile (``settled``) and the partition comes
    back, the resend starts after it: the message goes first, as a batch of its own that is
    stored as a duplicate (nothing new), and lifts the broker's refusal.
    """

    __slots__ = ("message", "properties", "settled")

    def __init__(self, message: tuple[int | None, Key, bytes], properties: bytes | None) -> None:
        self.message = message
        self.properties = properties
        self.settled = False

    @property
    def seq(self) -> int:
        """The refused message's sequence id."""
        seq = self.message[0]
        assert seq is not None  # a named producer's messages all have one
        return seq


class _PartProducer(_Part):
    """Sends keyed messages to one partition, in order, batched; retries are deduplicated."""

    def __init__(
        self, link: _Link, base_topic: str, partition: int, partitions: int, *, name: str, on_lost: LostCallback
    ) -> None:
        super().__init__(link, base_topic, partition, partitions, on_lost)
        self.producer_name = name
        # Sequence ids start from the wall clock in microseconds, so a restarted producer of
        # the same name continues above what it stored before (unless it sent over a million
        # messages a second for the whole downtime).
        self._seq = itertools.count(time.time_ns() // 1000)
        self._batch = _PendingBatch()
        self._full: list[_PendingBatch] = []  # batches at their limit, not yet sent
        self._flush_scheduled = False
        self._held = False  # a batch was refused (not_owner): newer ones wait to be resent after it
        self._unconfirmed: dict[int, _PendingBatch] = {}  # req -> batch, in send order
        self._refusals: dict[_Link, _Refusal] = {}  # link -> the first produce it refused (not_owner)
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self._failure: ServerError | None = None
        self._lock = threading.Lock()  # send_async may be called from another thread (sync client)
        self._loop = asyncio.get_running_loop()

    def send_async(
        self,
        payload: bytes,
        key: Key = None,
        callback: SendCallback | None = None,
        properties: Mapping[str, str] | None = None,
    ) -> None:
        """Queue a message; ``callback(position, None)`` or ``callback(None, error)`` follows."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise ClientClosed(f"producer {self.producer_name!r} is closed")
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise KeyFailoverError(f"payload must be bytes, not {type(payload).__name__}")
        if key is not None and not isinstance(key, str | bytes):
            raise KeyFailoverError(f"key must be str, bytes or None, not {type(key).__name__}")
        encoded = None if properties is None else encode_properties(properties)
        data = bytes(payload)
        size = _message_size(key, data, encoded)
        limit = self.link.max_batch_bytes - 1024
        if size > limit:
            raise KeyFailoverError(
                f"a message of {size} bytes (payload, key, properties and framing) is over the {limit} bytes a "
                "message may have on this connection (half the server's frame limit, less 1 KiB)"
            )
        with self._lock:
            batch = self._batch
            if batch.messages and (len(batch.messages) >= _MAX_BATCH or batch.size + size > self.link.max_batch_bytes):
                # Full: it goes out with the next flush as it is; a new batch starts.
                self._full.append(batch)
                batch = self._batch = _PendingBatch()
            # batch.add, inline: this is every message's path
            batch.messages.append((next(self._seq), key, data))
            batch.callbacks.append(callback)
            batch.size += size
            if encoded is not None or batch.properties is not None:
                batch.last_properties(encoded)
            schedule = not self._flush_scheduled
            self._flush_scheduled = True
        if schedule:  # one flush per burst: it sends every full batch and the current one
            _call_soon(self._loop, self._flush_now)

    async def flush(self) -> None:
        """Wait until every message sent so far is stored."""
        self._flush_now()
        while self._unconfirmed:
            self._idle.clear()
            await self._idle.wait()

    def _flush_now(self) -> None:
        with self._lock:
            batches, self._full = self._full, []
            if self._batch.messages:
                batches.append(self._batch)
                self._batch = _PendingBatch()
            self._flush_scheduled = False
        for batch in batches:
            req = self.link.next_req()
            self._unconfirmed[req] = batch
            if not self._held:  # held: sent, in order, with the refused ones
                self._transmit(req, batch)

    def _transmit(self, req: int, batch: _PendingBatch) -> None:
        frame = Produce(
            req=req, topic=self.topic, producer=self.producer_name, messages=batch.messages, properties=batch.properties
        )
        link = self.link
        link.pending[req] = lambda reply: self._answered(req, reply, link)
        if not link.send(frame):
            link.pending.pop(req, None)  # resent by reconnected()

    def _answered(self, req: int, reply: Frame | None, link: _Link) -> None:
        if reply is None:
            return  # connection lost: kept in _unconfirmed and resent after reconnecting
        if isinstance(reply, Error) and reply.code == ErrorCode.NOT_OWNER:
            # Kept in _unconfirmed, with everything after it (the broker refuses those too), and resent
            # in order to the partition's broker once found; newer batches wait for that.
            refused = self._unconfirmed.get(req)
            if refused is not None and refused.messages and link not in self._refusals:
                self._refusals[link] = _Refusal(refused.messages[0], (refused.properties or [None])[0])
            self._held = True
            self._on_lost(self)
            return
        batch = self._unconfirmed.pop(req, None)
        if batch is None:
            return
        if isinstance(reply, Receipt):
            if self._refusals:
                self._settle(batch, reply)
            for callback, position in zip(batch.callbacks, reply.positions, strict=True):
                if callback is None:
                    continue
                if position:
                    callback(position, None)
                else:  # a receipt without a position: the server did not store it
                    callback(None, ServerError("not_stored", "the server's receipt gave this message no position"))
        else:
            error = (
                ServerError(reply.code, reply.message)
                if isinstance(reply, Error)
                else ServerError("internal", "unexpected reply")
            )
            for callback in batch.callbacks:
                if callback is not None:
                    callback(None, error)
        if not self._unconfirmed:
            self._idle.set()

    @property
    def closed(self) -> bool:
        """Closed, or failed for good."""
        return self._closed or self._failure is not None

    def disconnected(self) -> None:
        """Unconfirmed batches stay queued for resending; the partition may have moved: look."""
        self._on_lost(self)

    def move(self, link: _Link) -> None:
        """The partition is served by the broker of ``link`` now: resend there what is unconfirmed."""
        self._relink(link)
        if link.ready.is_set():
            self.reconnected()

    def resume(self) -> None:
        """Resend everything unconfirmed, in order: what was refused, and what was sent after it."""
        self.reconnected()

    def failed(self, error: ServerError) -> None:
        """The link failed for good: every message not yet confirmed fails with ``error``."""
        self._failure = error
        with self._lock:
            batches = [*self._unconfirmed.values(), *self._full, self._batch]
            self._unconfirmed, self._full, self._batch = {}, [], _PendingBatch()
        for batch in batches:
            for callback in batch.callbacks:
                if callback is not None:
                    callback(None, error)
        self._idle.set()

    def _settle(self, batch: _PendingBatch, receipt: Receipt) -> None:
        """Mark the refusals whose message ``batch`` holds and ``receipt`` stored as settled."""
        if not batch.messages:
            return
        first, last = batch.messages[0][0], batch.messages[-1][0]
        if first is None or last is None:
            return
        for refusal in self._refusals.values():
            if refusal.settled or not first <= refusal.seq <= last:
                continue
            for message, position in zip(batch.messages, receipt.positions, strict=True):
                if message[0] == refusal.seq:
                    refusal.settled = bool(position)
                    break

    def _lifting(self, first: int | None) -> _PendingBatch | None:
        """What to send ahead of a resend on this part's link (``first``: the resend's first sequence id) to
        lift the link's refusal of this producer, which the resend would not lift: the refused message
        again, when another broker stored it meanwhile and the resend starts after it. None otherwise."""
        for gone in [link for link in self._refusals if link.closed]:
            del self._refusals[gone]  # its connection and the broker's refusal with it
        refusal = self._refusals.pop(self.link, None)
        if refusal is None or (first is not None and first <= refusal.seq):
            return None  # no refusal here, or the resend starts at the refused message: it lifts the refusal
        if not refusal.settled:
            return None  # never stored (it failed): sending it now would store what was reported lost
        batch = _PendingBatch()  # no callback: its sender was answered when it was stored
        message = refusal.message
        batch.add(message, None, refusal.properties, _message_size(message[1], message[2], refusal.properties))
        return batch

    def reconnected(self) -> None:
        """Resend every unconfirmed batch, in order; split where the new server takes smaller frames."""
        self._held = False
        old, self._unconfirmed = self._unconfirmed, {}
        batches = list(old.values())
        if self._refusals:
            lifting = self._lifting(next((batch.messages[0][0] for batch in batches if batch.messages), None))
            if lifting is not None:
                batches.insert(0, lifting)  # a duplicate: stored as nothing new, and unconfirmed until answered
        for batch in batches:
            for part in batch.split(self.link.max_batch_bytes):
                req = self.link.next_req()
                self._unconfirmed[req] = part
                self._transmit(req, part)

    async def close(self) -> None:
        """Flush, then refuse further sends."""
        if self._closed:
            return
        await self.flush()
        self._closed = True
        with contextlib.suppress(ValueError):
            self.link.parties.remove(self)


class AsyncProducer:
    """Sends keyed messages to one topic, in order per key, batched; retries are deduplicated.

    Each key goes to the partition holding its slot (keyless messages round robin over the
    partitions); positions count within a partition.
    """

    def __init__(self, topic: str, name: str, parts: list[_PartProducer]) -> None:
        self.topic = topic
        self.producer_name = name
        self._parts = parts
        self._next = itertools.count()

    @property
    def partitions(self) -> int:
        """How many partitions the topic has (positions count within each)."""
        return len(self._parts)

    def send_async(
        self,
        payload: bytes,
        key: Key = None,
        callback: SendCallback | None = None,
        *,
        properties: Mapping[str, str] | None = None,
    ) -> None:
        """Queue a message; ``callback(position, None)`` or ``callback(None, error)`` follows.

        ``properties``: str keys and values sent with it (at most 128, keys of at most 256 characters,
        64 KiB encoded: :mod:`keyfailover.wire.properties`); :class:`PropertiesError` refuses others
        and queues nothing.
        """
        parts = self._parts
        if len(parts) == 1:
            part = parts[0]
        elif key is None:
            part = parts[next(self._next) % len(parts)]
        else:
            if not isinstance(key, str | bytes):
                raise KeyFailoverError(f"key must be str, bytes or None, not {type(key).__name__}")
            _message_size(key, b"")  # a str key must encode to UTF-8 before it can be hashed
            part = parts[partition_of_key(key, len(parts))]
        part.send_async(payload, key, callback, properties)

    async def send(self, payload: bytes, key: Key = None, *, properties: Mapping[str, str] | None = None) -> int:
        """Send and wait until the message is stored; returns its position (within its partition)."""
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def done(position: int | None, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(position or 0)

        self.send_async(payload, key, done, properties=properties)
        return await future

    async def flush(self) -> None:
        """Wait until every message sent so far is stored."""
        for part in self._parts:
            await part.flush()

    async def close(self) -> None:
        """Flush, then refuse further sends."""
        for part in self._parts:
            await part.close()


class _Inbox:
    """What a consumer's partitions received, for the application to take (from any thread)."""

    __slots__ = ("arrived", "cond", "messages")

    def __init__(self) -> None:
        self.messages: deque[Message] = deque()
        self.cond = threading.Condition()  # guards messages for threads; arrived wakes coroutines
        self.arrived = asyncio.Event()

    def drop(self, keep: Callable[[Message], bool]) -> int:
        """Keep only the messages ``keep`` accepts (holding ``cond``); how many were dropped."""
        kept = [message for message in self.messages if keep(message)]
        dropped = len(self.messages) - len(kept)
        if dropped:
            self.messages.clear()
            self.messages.extend(kept)
        return dropped


class _PartConsumer(_Part):
    """One consumer's session on one partition: what it receives goes to the consumer's shared inbox."""

    def __init__(
        self,
        link: _Link,
        base_topic: str,
        partition: int,
        partitions: int,
        *,
        subscription: str,
        name: str,
        receiver_queue_size: int,
        inbox: _Inbox,
        on_ranges: Callable[[], None],
        on_lost: LostCallback,
    ) -> None:
        super().__init__(link, base_topic, partition, partitions, on_lost)
        self.subscription = subscription
        self.consumer_name = name
        self._queue_size = receiver_queue_size
        self._on_ranges = on_ranges
        self._loop = asyncio.get_running_loop()
        self._inbox = inbox
        self._cond = inbox.cond
        self._session = 0
        self._subscribing = False
        self._secret: str | None = None  # from the last subscribed: proves a resubscribe is this consumer
        self._consumed = 0  # received since the last flow (guarded by _cond)
        self._flow_scheduled = False
        # Set when the server left this consumer without ranges (a standby, or stuck after an
        # expired lease): the application's next receive or ack sends a flow, which the
        # server counts as progress, so a consumer that was stuck gets ranges again.
        self._show_progress = False
        self._acks: list[int] = []
        self._ack_session = 0
        self._ack_scheduled = False
        self._closed = False
        self.ended: BaseException | None = None
        self._subscribed: asyncio.Future[None] = self._loop.create_future()
        self.ranges: list[tuple[int, int]] = []
        self._subscribe()

    @property
    def closed(self) -> bool:
        """Closed, or ended for good."""
        return self._closed or self.ended is not None

    # -- subscription ----------------------------------------------------------------

    def _subscribe(self) -> None:
        req = self.link.next_req()
        frame = Subscribe(
            req=req,
            topic=self.topic,
            subscription=self.subscription,
            consumer=self.consumer_name,
            receiver_queue=self._queue_size,
            secret=self._secret,
        )
        self.link.pending[req] = self._on_subscribe_reply
        self._subscribing = True
        if not self.link.send(frame):
            self._subscribing = False
            self.link.pending.pop(req, None)  # retried by reconnected()

    def _on_subscribe_reply(self, reply: Frame | None) -> None:
        self._subscribing = False
        if reply is None:
            return  # connection lost: reconnected() subscribes again
        if isinstance(reply, Subscribed):
            self._session = reply.session
            self._secret = reply.secret
            with self._cond:
                self._consumed = 0
            self.link.sessions[reply.session] = self
            self._set_ranges(reply.ranges)
            if not self._subscribed.done():
                self._subscribed.set_result(None)
        elif isinstance(reply, Error):
            if reply.code == ErrorCode.NOT_OWNER:
                self._on_lost(self)  # the partition moved: subscribe where it is now
                return
            error_class = ConsumerBusyError if reply.code == ErrorCode.CONSUMER_BUSY else ServerError
            self._end(error_class(reply.code, reply.message))

    async def subscribed(self) -> None:
        await self._subscribed

    def disconnected(self) -> None:
        self._drop_session()
        self._on_lost(self)

    def failed(self, error: ServerError) -> None:
        self._drop_session()
        self._end(error)

    def reconnected(self) -> None:
        if not self._closed:
            self._subscribe()

    def move(self, link: _Link) -> None:
        """The partition is served by the broker of ``link`` now: subscribe there."""
        self._drop_session()
        self._relink(link)
        if link.ready.is_set() and not self._closed:
            self._subscribe()

    def resume(self) -> None:
        """Subscribe again unless a session is live or a subscribe is on its way."""
        if not self._closed and not self._session and not self._subscribing:
            self._subscribe()

    def on_frame(self, frame: Frame) -> None:
        if isinstance(frame, Messages):
            if frame.session != self._session:
                return
            session, partition = frame.session, self.partition
            with self._cond:
                self._inbox.messages.extend(
                    Message(
                        key,
                        payload,
                        position,
                        redelivery,
                        session,
                        partition,
                        published,
                        NO_PROPERTIES if data is None else Properties.decoded(data),
                    )
                    for position, key, payload, redelivery, published, data in frame.messages
                )
                self._cond.notify_all()
            self._inbox.arrived.set()
        elif isinstance(frame, RangesChanged):
            if frame.session == self._session:
                self._set_ranges(frame.ranges)
        elif isinstance(frame, ConsumerClosed) and frame.session == self._session:
            self._drop_session()
            if frame.reason == "timeout" and not self._closed:
                _log.warning("consumer %r timed out on the server; subscribing again", self.consumer_name)
                self._subscribe()
            elif frame.reason == "seek" and not self._closed:
                _log.info("subscription of consumer %r was reset (a seek); subscribing again", self.consumer_name)
                self._subscribe()
            elif frame.reason == "superseded":
                self._end(ConsumerClosedError(f"consumer {self.consumer_name!r} was superseded by another of its name"))
            elif frame.reason == "moved":
                self._on_lost(self)
            # "shutdown": the server is stopping; reconnected() subscribes again once it is back.

    def _drop_session(self) -> None:
        """Forget the session: the server already returned its messages to pending."""
        self.link.sessions.pop(self._session, None)
        self._session = 0
        partition = self.partition
        with self._cond:
            self._inbox.drop(lambda message: message.partition != partition)
            self._acks.clear()

    def _end(self, error: BaseException) -> None:
        self.ended = error
        if not self._subscribed.done():
            self._subscribed.set_exception(error)
        with self._cond:
            self._cond.notify_all()
        self._inbox.arrived.set()

    def _set_ranges(self, ranges: list[tuple[int, int]]) -> None:
        """Remember the ranges the server announced; tell the consumer when they differ."""
        if not ranges:
            with self._cond:
                self._show_progress = True
                self._cond.notify_all()  # an application waiting for a message shows progress now
            self._inbox.arrived.set()
        if ranges != self.ranges:
            self.ranges = ranges
            self._on_ranges()

    # -- receiving -------------------------------------------------------------------

    def waiting(self) -> bool:
        """The application waits for a message and none is here (holding ``_cond``): that is progress
        too; whether to send a flow now to show it (a part left with no range, whose deliveries were all
        taken back, would else never send another: it gets nothing to take)."""
        return not self._flow_scheduled and self._progress()

    def _progress(self) -> bool:
        """Whether to send a flow now to show the server progress (holding ``_cond``)."""
        if not self._show_progress:
            return False
        self._show_progress = False
        self._flow_scheduled = True
        return True

    def consumed_one(self, count: int = 1) -> bool:
        """Count messages taken (holding ``_cond``); whether a flow is now to be scheduled.

        The permits go back once a quarter of the receiver queue was taken (Pulsar's client waits for
        half): what is left in the queue must last until the server's answer comes, and a server busy
        with a read for all its consumers answers a few milliseconds later. Waiting for half, a consumer
        faster than the others found its queue nearly empty when its flow went out (a median of 23 to 41
        of 1000 messages left in ``benchmarks/bench_e2e.py --backlog``) and waited for the server.
        """
        self._consumed += count
        if self._flow_scheduled:
            return False
        if self._consumed < max(self._queue_size // 4, 1):
            return self._progress()
        self._flow_scheduled = True
        return True

    def send_flow(self) -> None:
        """Send the permits taken since the last flow: none at all when only showing progress."""
        with self._cond:
            permits, self._consumed = self._consumed, 0
            self._flow_scheduled = False
        if self._session:
            self.link.send(
                Flow(topic=self.topic, subscription=self.subscription, session=self._session, permits=permits)
            )

    # -- acknowledging ---------------------------------------------------------------

    def acknowledge(self, message: Message) -> None:
        """Acknowledge ``message`` (batched; sent within a loop iteration)."""
        with self._cond:
            if message.session != self._ack_session and self._acks:
                # The batch so far belongs to another session: it goes out as it is, alone.
                positions, self._acks = self._acks, []
                session = self._ack_session
                self._call(lambda: self._send_acks(session, positions))
            self._ack_session = message.session
            self._acks.append(message.position)
            schedule = not self._ack_scheduled or len(self._acks) >= _MAX_BATCH
            self._ack_scheduled = True
            flow = self._progress()
        if schedule:
            self._call(self._flush_acks)
        if flow:
            self._call(self.send_flow)

    def _flush_acks(self) -> None:
        with self._cond:
            positions, self._acks = self._acks, []
            session = self._ack_session
            self._ack_scheduled = False
        self._send_acks(session, positions)

    def _send_acks(self, session: int, positions: list[int]) -> None:
        if positions and session:
            self.link.send(Ack(topic=self.topic, subscription=self.subscription, session=session, positions=positions))

    async def settle(self, kind: type[Ack | Extend], message: Message, timeout: float | None) -> None:
        """Send one ``kind`` frame for ``message`` with a request id and wait for its answer."""
        self._flush_acks()
        with self._cond:
            flow = self._progress()
        if flow:
            self.send_flow()
        if not message.session or message.session != self._session:
            raise NotInFlight(
                ErrorCode.NOT_IN_FLIGHT,
                f"position {message.position} was delivered to an earlier session of {self.consumer_name!r}, "
                "which ended (its messages were given back)",
            )
        answer: asyncio.Future[Frame | None] = self._loop.create_future()
        req = self.link.next_req()

        def answered(reply: Frame | None) -> None:
            if not answer.done():
                answer.set_result(reply)

        self.link.pending[req] = answered
        frame = kind(
            topic=self.topic,
            subscription=self.subscription,
            session=message.session,
            positions=[message.position],
            req=req,
        )
        if not self.link.send(frame):
            self.link.pending.pop(req, None)
            raise ClientClosed(f"not connected: the {frame.type} of position {message.position} was not sent")
        try:
            async with asyncio.timeout(timeout):
                reply = await answer
        except TimeoutError:
            self.link.pending.pop(req, None)
            raise Timeout(f"no answer to the {frame.type} of position {message.position} within {timeout} s") from None
        if isinstance(reply, Error):
            raise _settle_error(reply)
        if not isinstance(reply, Settled):
            raise ClientClosed(
                f"the connection was lost before the {frame.type} of position {message.position} was answered"
            )

    def negative_acknowledge(self, message: Message) -> None:
        """Redeliver ``message``; prefetched later messages of its key are dropped, so the key restarts in order."""
        kb = message.key.encode() if isinstance(message.key, str) else message.key

        def keep(queued: Message) -> bool:
            # Only the nacked message's session restarts the key; a nack of a message from an
            # ended session changes nothing (the server already took that session's messages back).
            if kb is None or queued.session != message.session or queued.position <= message.position:
                return True
            return (queued.key.encode() if isinstance(queued.key, str) else queued.key) != kb

        with self._cond:
            dropped = self._inbox.drop(keep)
        self._call(lambda: self._send_nack(message, dropped))

    def _send_nack(self, message: Message, dropped: int) -> None:
        self._flush_acks()
        if message.session and message.session == self._session:
            self.link.send(
                Nack(
                    topic=self.topic,
                    subscription=self.subscription,
                    session=message.session,
                    positions=[message.position],
                )
            )
            with self._cond:
                flow = self.consumed_one(dropped)
            if flow:
                self.send_flow()

    def _call(self, fn: Callable[[], None]) -> None:
        _call_soon(self._loop, fn)

    async def close(self) -> None:
        """Send pending acks and leave the subscription; its unacked messages go to others."""
        if self._closed:
            return
        self._flush_acks()
        self._closed = True
        with contextlib.suppress(ValueError):
            self.link.parties.remove(self)
        session = self._session
        if session and self.link.ready.is_set():
            done: asyncio.Future[None] = self._loop.create_future()
            req = self.link.next_req()

            def closed(_reply: Frame | None) -> None:
                if not done.done():
                    done.set_result(None)

            self.link.pending[req] = closed
            self.link.send(CloseConsumer(req=req, topic=self.topic, subscription=self.subscription, session=session))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await done
        self._drop_session()
        if not self._subscribed.done():
            self._subscribed.set_exception(ClientClosed(f"consumer {self.consumer_name!r} is closed"))
            self._subscribed.exception()  # retrieved: nobody need await it
        with self._cond:
            self._cond.notify_all()
        self._inbox.arrived.set()


class AsyncConsumer:
    """Receives the messages of the keys its hash ranges hold, in per-key order, from every
    partition of its topic.

    A consumer may own several ranges of the hash space, or none (a standby, which gets
    keyless messages only until a rebalance gives it some): :attr:`ranges` says which (over
    all partitions), and ``on_ranges_changed(ranges)`` is called with the new list whenever it changes.
    """

    def __init__(self, topic: str, subscription: str, name: str, on_ranges_changed: RangesCallback | None) -> None:
        self.topic = topic
        self.subscription = subscription
        self.consumer_name = name
        self.inbox = _Inbox()
        self.parts: list[_PartConsumer] = []
        self._on_ranges_changed = on_ranges_changed
        self._ranges: list[tuple[int, int]] = []
        self._closed = False
        self._loop = asyncio.get_running_loop()

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The hash ranges this consumer owns now: inclusive ``(start, end)`` pairs, sorted; empty for a standby."""
        return list(self._ranges)

    @property
    def partitions(self) -> int:
        """How many partitions the topic has (a message's position counts within its partition)."""
        return len(self.parts)

    def ranges_changed(self) -> None:
        """A partition's ranges changed: tell ``on_ranges_changed`` when the consumer's differ."""
        ranges = sorted(r for part in self.parts for r in part.ranges)
        if ranges != self._ranges:
            self._ranges = ranges
            if self._on_ranges_changed is not None:
                try:
                    self._on_ranges_changed(list(ranges))
                except Exception:
                    _log.exception("on_ranges_changed callback failed")

    async def subscribed(self) -> None:
        """Wait until every partition confirmed the subscription."""
        for part in self.parts:
            await part.subscribed()

    # -- receiving -------------------------------------------------------------------

    def _part(self, message: Message) -> _PartConsumer:
        if not 0 <= message.partition < len(self.parts):
            raise KeyFailoverError(f"{message!r} was not received by this consumer (no partition {message.partition})")
        return self.parts[message.partition]

    def _taken(self) -> tuple[Message, _PartConsumer | None]:
        """Pop the next message (holding the inbox's lock): it and its partition if a flow is due."""
        message = self.inbox.messages.popleft()
        part = self.parts[message.partition]
        return message, part if part.consumed_one() else None

    def _show_waiting(self) -> None:
        """No message is here for the application (holding the inbox's lock): parts that owe the server a
        sign of progress send it."""
        for part in self.parts:
            if part.waiting():
                self._call(part.send_flow)

    def take(self) -> Message | None:
        """Pop the next message if one is here (thread-safe); accounts permits."""
        with self.inbox.cond:
            if not self.inbox.messages:
                self._check_open()
                self._show_waiting()
                return None
            message, flow = self._taken()
        if flow is not None:
            self._call(flow.send_flow)
        return message

    def wait_take(self, timeout: float | None) -> Message:
        """Blocking take for threads (the sync client)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.inbox.cond:
            while not self.inbox.messages:
                self._check_open()
                self._show_waiting()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise Timeout(f"no message within {timeout} s")
                self.inbox.cond.wait(remaining)
            message, flow = self._taken()
        if flow is not None:
            self._call(flow.send_flow)
        return message

    async def receive(self, timeout: float | None = None) -> Message:
        """The next message; raises :class:`Timeout` when none arrives in time."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    message = self.take()
                    if message is not None:
                        return message
                    self.inbox.arrived.clear()
                    await self.inbox.arrived.wait()
        except TimeoutError:
            raise Timeout(f"no message within {timeout} s") from None

    def _check_open(self) -> None:
        for part in self.parts:
            if part.ended is not None:
                raise part.ended
        if self._closed:
            raise ClientClosed(f"consumer {self.consumer_name!r} is closed")

    # -- acknowledging ---------------------------------------------------------------

    def acknowledge(self, message: Message) -> None:
        """Acknowledge ``message`` (batched; sent within a loop iteration)."""
        self._part(message).acknowledge(message)

    async def acknowledge_confirmed(self, message: Message, timeout: float | None = 10.0) -> None:
        """Acknowledge ``message`` and wait until the server accepted it.

        Raises :class:`LeaseExpiredError` when the ack came after the message's ack deadline
        (it was taken back and is delivered again), :class:`NotInFlight` when the message is
        not in flight on this consumer (acked already, or its session ended), and
        :class:`Timeout` when no answer came within ``timeout`` seconds.
        """
        self._check_open()
        await self._part(message).settle(Ack, message, timeout)

    async def extend(self, message: Message, timeout: float | None = 10.0) -> None:
        """Renew ``message``'s lease: its ack deadline becomes now plus the server's ack timeout.

        For work that takes longer than the ack timeout (as SQS ChangeMessageVisibility):
        call it before the deadline, as often as needed. Raises as :meth:`acknowledge_confirmed`.
        """
        self._check_open()
        await self._part(message).settle(Extend, message, timeout)

    def negative_acknowledge(self, message: Message) -> None:
        """Redeliver ``message``; prefetched later messages of its key are dropped, so the key restarts in order."""
        self._part(message).negative_acknowledge(message)

    def _call(self, fn: Callable[[], None]) -> None:
        _call_soon(self._loop, fn)

    async def close(self) -> None:
        """Send pending acks and leave the subscription on every partition; unacked messages go to others."""
        self._closed = True
        for part in self.parts:
            await part.close()


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    """Run ``fn`` on ``loop`` soon, called from the loop or from another thread (the sync client's)."""
    if _on_loop(loop):
        loop.call_soon(fn)
    else:
        loop.call_soon_threadsafe(fn)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
