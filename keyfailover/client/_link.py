"""One connection to one broker, and the parts of producers and consumers that use it.

A :class:`Link` connects, heartbeats, and reconnects with backoff when the connection drops;
it routes each answer to the callback of its request and each delivery to its session. A
:class:`Part` is a producer's or consumer's share of one partition, on the link of the
broker serving it: the link tells it when it drops, comes back or is refused for good.
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
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator

from keyfailover.client._errors import PERMANENT, ServerError, Timeout
from keyfailover.client._urls import Address, host_port
from keyfailover.core.errors import ErrorCode, KeyFailoverError
from keyfailover.core.partitions import partition_topic
from keyfailover.wire.protocol import (
    PROTOCOL_VERSION,
    Close,
    Connect,
    Connected,
    ConsumerClosed,
    Decoder,
    Entries,
    Error,
    Frame,
    Messages,
    Ping,
    Pong,
    RangesChanged,
    Receipt,
    Route,
    Settled,
    Subscribed,
    encode,
    stream_transport,
)

_log = logging.getLogger("keyfailover.client")

MAX_BATCH = 1000
_MAX_BATCH_BYTES = 1 << 20
MIN_BACKOFF = 0.05  # seconds before the second reconnect attempt; doubles up to MAX_BACKOFF
MAX_BACKOFF = 2.0
_STABLE = 5.0  # a connection up this long resets the backoff
OLDEST_SERVER_VERSION = 7
"""The oldest protocol version the client falls back to when a server refuses its own with ``version_mismatch``:
a server not yet upgraded to reads by position (version 8) still takes produces with properties."""


class Link(asyncio.Protocol):
    """The client's connection to one broker, re-established with backoff whenever it drops."""

    def __init__(self, address: Address, token: str | None, tls: ssl.SSLContext | None, reqs: Iterator[int]) -> None:
        self.address = address
        self._host, self._port = host_port(address)
        self._token = token
        self._tls = tls
        self._transport: asyncio.Transport | None = None
        self._decoder = Decoder(accept="client")
        self.version = PROTOCOL_VERSION
        """The protocol version of the connection: the newest the server speaks, down to
        :data:`OLDEST_SERVER_VERSION`."""
        self._gone: asyncio.Future[None] | None = None  # the current connection's loss
        # Request ids come from the client's one counter, unique across its links: a producer's
        # unconfirmed batches, keyed by request id, move between links in a failover.
        self._req = reqs
        self.pending: dict[int, Callable[[Frame | None], None]] = {}
        self.sessions: dict[int, Callable[[Frame], None]] = {}  # session -> its consumer part's on_frame
        self.parties: list[Part] = []
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
        """Connect, then keep the connection up in the background: heartbeats, and reconnects when it drops."""
        await self._connect_once(timeout)
        self._maintainer = asyncio.get_running_loop().create_task(self._maintain(), name="keyfailover-link")

    async def _connect_once(self, timeout: float) -> None:
        """Connect and wait for the server's connected, within ``timeout`` seconds each try; raises Timeout or the
        refusal. A server refusing the protocol version with ``version_mismatch`` is asked again with each older
        one down to :data:`OLDEST_SERVER_VERSION`, once its refused connection is gone."""
        self.version = PROTOCOL_VERSION
        while True:
            try:
                await self._connect_version(timeout)
                return
            except ServerError as exc:
                if exc.code != ErrorCode.VERSION_MISMATCH or self.version <= OLDEST_SERVER_VERSION:
                    raise
            transport, gone = self._transport, self._gone
            if transport is not None:
                transport.abort()
            if gone is not None:
                await gone
            self.version -= 1
            _log.info("%s refused protocol version %d; trying %d", self.address, self.version + 1, self.version)

    async def _connect_version(self, timeout: float) -> None:
        """One connection speaking :attr:`version`, up once the server answered connected within ``timeout``."""
        loop = asyncio.get_running_loop()
        self._decoder = Decoder(accept="client", version=self.version)
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
                delay = min(max(delay * 2, MIN_BACKOFF), MAX_BACKOFF)
                try:
                    await self._connect_once(5.0)
                except ServerError as exc:
                    if exc.code in PERMANENT:
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
        """Say connect, with the token and the client's name."""
        self._transport = stream = stream_transport(transport)
        self._gone = asyncio.get_running_loop().create_future()
        stream.write(encode(Connect(version=self.version, token=self._token, client=_client_name())))

    def data_received(self, data: bytes) -> None:
        """Decode frames and dispatch them; malformed data drops the connection, which reconnects."""
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
        """Fail the requests waiting on this connection, forget its sessions and tell the parts: lost, or refused."""
        self._transport = None
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(None)
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
        """Route a server frame: deliveries to their session, answers to their request, connected to the parts."""
        if isinstance(frame, Messages | RangesChanged | ConsumerClosed):
            on_frame = self.sessions.get(frame.session)
            if on_frame is not None:
                on_frame(frame)
            if isinstance(frame, ConsumerClosed):
                self.sessions.pop(frame.session, None)
                if frame.req is not None and (callback := self.pending.pop(frame.req, None)) is not None:
                    callback(frame)
            return
        if isinstance(frame, Receipt | Subscribed | Settled | Route | Entries):
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
                if frame.code in PERMANENT:  # the server closes the connection next
                    self.failure = ServerError(frame.code, frame.message)
            return
        if isinstance(frame, Connected):
            self.session_timeout = frame.session_timeout
            self.max_batch_bytes = min(_MAX_BATCH_BYTES, frame.max_frame // 2)
            self._ready_since = time.monotonic()
            self.ready.set()
            self._lost.clear()  # also the loss of a connection refused for its protocol version
            if self._maintainer is not None:
                # A reconnection: what was unconfirmed goes out now, in this same step, before
                # anything queued meanwhile can send newer batches ahead of it.
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
        """A request id, unique across the client's links."""
        return next(self._req)

    def send(self, frame: Frame) -> bool:
        """Write ``frame`` if connected; False when it could not be sent now: not connected, or the connection
        is closing (lost, its loss not handled yet: asyncio would drop the write and warn on stderr)."""
        if self._transport is None or not self.ready.is_set() or self._transport.is_closing():
            return False
        self._transport.write(encode(frame, self.version))
        return True

    async def close(self) -> None:
        """Stop reconnecting and close the connection, saying close to the server first."""
        self.closed = True
        self._lost.set()
        if self._maintainer is not None:
            await self._maintainer
        if self._transport is not None:
            self.send(Close())
            self._transport.close()


def _client_name() -> str:
    """How the client names itself at connect: its host name and process id."""
    return f"{socket.gethostname()}-{os.getpid()}"


LostCallback = Callable[["Part"], None]


class Part(ABC):
    """A producer's or consumer's part for one partition of its topic, on its broker's link."""

    def __init__(self, link: Link, base_topic: str, partition: int, partitions: int, on_lost: LostCallback) -> None:
        self.link = link
        self.base_topic = base_topic
        self.partition = partition
        self.topic = partition_topic(base_topic, partition, partitions)
        self._on_lost = on_lost

    def _relink(self, link: Link) -> None:
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
    def move(self, link: Link) -> None:
        """The partition is served by the broker of ``link`` now."""

    @abstractmethod
    def resume(self) -> None:
        """The partition's broker is this link's again: subscribe or resend what was refused."""

    @abstractmethod
    async def close(self) -> None:
        """Leave: flush or unsubscribe."""


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    """Run ``fn`` on ``loop`` soon, called from the loop or from another thread (the sync client's)."""
    if _on_loop(loop):
        loop.call_soon(fn)
    else:
        loop.call_soon_threadsafe(fn)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the caller runs inside ``loop``, on its thread."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
