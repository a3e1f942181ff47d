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

This module is the facade: :class:`AsyncClient` looks partitions up, opens the links and
moves a part to its partition's new broker. The pieces beside it, each importing only those
listed before it: ``_errors``, the exceptions; ``_urls``, broker URLs and TLS; ``_link``, one
connection to one broker and the part a producer or consumer has on it; ``_producer``, the
batching and the resending; ``_consumer``, the inbox, the flows and the acks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable

from keyfailover.client._consumer import (
    MAX_PRIORITY_LEVEL,
    AsyncConsumer,
    Message,
    PartConsumer,
    RangesCallback,
    check_subscription_version,
)
from keyfailover.client._errors import (
    LOOK_AGAIN,
    PERMANENT,
    ClientClosed,
    ConsumerBusyError,
    ConsumerClosedError,
    LeaseExpiredError,
    NoBrokerError,
    NotInFlight,
    ServerError,
    ServerTooOldError,
    Timeout,
)
from keyfailover.client._link import MAX_BACKOFF, MIN_BACKOFF, Link, Part
from keyfailover.client._producer import AsyncProducer, PartProducer, SendCallback
from keyfailover.client._reader import LogEntries, LogEntry, check_read, check_version, log_entries
from keyfailover.client._urls import Address, client_tls, parse_url
from keyfailover.core.errors import KeyFailoverError, PropertiesError
from keyfailover.core.partitions import partition_topic
from keyfailover.core.subtypes import SubscriptionType, check_subscription_type
from keyfailover.wire.protocol import Entries, Error, Frame, Key, Lookup, Read, Route, check_name

__all__ = [
    "Address",
    "AsyncClient",
    "AsyncConsumer",
    "AsyncProducer",
    "ClientClosed",
    "ConsumerBusyError",
    "ConsumerClosedError",
    "Key",
    "LeaseExpiredError",
    "LogEntries",
    "LogEntry",
    "Message",
    "NoBrokerError",
    "NotInFlight",
    "PropertiesError",
    "RangesCallback",
    "SendCallback",
    "ServerError",
    "ServerTooOldError",
    "Timeout",
    "client_tls",
    "parse_url",
]


def _reason(exc: BaseException) -> str:
    """Why a connection failed, in words."""
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno).lower()
    return str(exc)


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
        self._links: dict[Address, Link] = {}
        self._reqs = itertools.count(1)
        self._connecting: dict[Address, asyncio.Task[Link]] = {}
        self._connect_timeout = connect_timeout
        self._started = False
        self._closed = False
        self._failure: ServerError | None = None
        self._relocating: dict[Part, asyncio.Task[None]] = {}
        self._again: set[Part] = set()
        self._routes: dict[str, list[Address | None]] = {}  # topic -> its partitions' brokers, for reads

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
        links = await self._partition_links(topic)
        name = producer_name or f"producer-{uuid.uuid4().hex}"
        parts = []
        for index, link in enumerate(links):
            part = PartProducer(link, topic, index, len(links), name=name, on_lost=self._lost)
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
        *,
        subscription_type: SubscriptionType | None = None,
        priority_level: int = 0,
    ) -> AsyncConsumer:
        """Join ``subscription_name`` of ``topic`` (every partition of it); returns once the brokers confirmed it.

        ``on_ranges_changed(ranges)`` runs on the event loop with the consumer's new hash
        ranges, each time a rebalance changes them and after a resubscribe that gets different ones:
        inclusive ``(start, end)`` pairs, sorted, over all partitions; empty for a standby.

        ``subscription_type``: ``"exclusive"``, ``"failover"``, ``"shared"`` or ``"key_shared"``, as Pulsar's
        (docs/protocol.md, "Subscription types"); None joins as the subscription is. ``priority_level``: the
        consumer's priority in a failover subscription, the lower the first. Either needs brokers of protocol
        version 9: an older one raises :class:`ServerTooOldError`, sending nothing.
        """
        if type(receiver_queue_size) is not int or receiver_queue_size < 1:
            raise KeyFailoverError(f"receiver_queue_size must be a positive int, not {receiver_queue_size!r}")
        check_name("topic", topic)
        check_name("subscription_name", subscription_name)
        if consumer_name is not None:
            check_name("consumer_name", consumer_name)
        if subscription_type is not None:
            check_subscription_type(subscription_type)
        if type(priority_level) is not int or not 0 <= priority_level <= MAX_PRIORITY_LEVEL:
            raise KeyFailoverError(
                f"priority_level must be an int from 0 to {MAX_PRIORITY_LEVEL}, not {priority_level!r}"
            )
        links = await self._partition_links(topic)
        if (subscription_type, priority_level) != (None, 0):
            for link in links:
                check_subscription_version(link.version, link.address)
        name = consumer_name or f"consumer-{uuid.uuid4().hex[:12]}"
        consumer = AsyncConsumer(topic, subscription_name, name, on_ranges_changed)
        for index, link in enumerate(links):
            part = PartConsumer(
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
                subscription_type=subscription_type,
                priority_level=priority_level,
            )
            link.parties.append(part)
            consumer.parts.append(part)
        try:
            await consumer.subscribed()
        except BaseException:
            await consumer.close()
            raise
        return consumer

    async def read(
        self,
        topic: str,
        partition: int = 0,
        after: int = 0,
        limit: int = 1000,
        *,
        slots: tuple[int, int] | None = None,
        timeout: float | None = None,
    ) -> LogEntries:
        """The stored messages of partition ``partition`` of ``topic`` above position ``after``, in position order.

        At most ``limit`` of them (0 to :data:`~keyfailover.wire.protocol.MAX_READ`; 0 asks only where the log
        ends), fewer when the answer would pass the frame limit or the read examined its most; with ``slots``,
        an inclusive ``(first, last)`` pair of hash slots, only those whose key's slot lies in it (keyless ones
        left out). Read on with ``after=entries.through`` until ``through`` reaches ``last``. A topic nothing
        was produced to reads as an empty log. The read goes to the partition's broker: it follows a moved
        partition and waits out a store failover, with backoff, for up to ``timeout`` seconds (default: the
        connect timeout), then raises :class:`Timeout`. Positions start at 1.
        """
        check_name("topic", topic)
        wire_slots = check_read(partition, after, limit, slots)
        await self.connect()
        self._check_usable()
        entries, _ = await self._read_partition(topic, partition, after, limit, slots=wire_slots, timeout=timeout)
        return entries

    async def log_ends(self, topic: str, timeout: float | None = None) -> list[int]:
        """The last position of every partition of ``topic``, in partition order (0: an empty partition); each
        asked of its partition's broker as :meth:`read` does."""
        check_name("topic", topic)
        await self.connect()
        self._check_usable()
        first, partitions = await self._read_partition(topic, 0, 0, 0, slots=None, timeout=timeout)
        rest = await asyncio.gather(
            *(self._read_partition(topic, index, 0, 0, slots=None, timeout=timeout) for index in range(1, partitions))
        )
        return [first.last, *(entries.last for entries, _ in rest)]

    async def _read_partition(
        self,
        topic: str,
        partition: int,
        after: int,
        limit: int,
        *,
        slots: tuple[int, int] | None,
        timeout: float | None,
    ) -> tuple[LogEntries, int]:
        """:meth:`read`, arguments checked, and how many partitions the topic has: asked of the broker the last
        lookup named for the partition, looked up again (with backoff, until ``timeout``) when it is not known,
        cannot be reached, dropped the connection, or refused the lookup or the read with ``not_owner`` or
        ``store_unavailable``."""
        within = self._connect_timeout if timeout is None else timeout
        deadline = time.monotonic() + within
        delay = MIN_BACKOFF
        why = "no lookup answered"
        while True:
            routes = self._routes.get(topic)
            try:
                if routes is None:
                    routes = self._routes[topic] = await self._lookup(topic)
                if partition >= len(routes):
                    raise KeyFailoverError(
                        f"topic {topic!r} has {len(routes)} partition(s), numbered from 0; it has no partition "
                        f"{partition}"
                    )
                address = routes[partition]
                if address is None:
                    why = f"partition {partition} of {topic!r} had no broker"
                else:
                    link = await self._link(address)
                    check_version(link.version, address)
                    served = partition_topic(topic, partition, len(routes))
                    make = functools.partial(Read, topic=served, after=after, limit=limit, slots=slots)
                    reply = await self._request(link, make, f"the read of {served!r}")
                    if isinstance(reply, Entries):
                        return log_entries(reply, partition), len(routes)
                    if not isinstance(reply, Error):
                        raise ClientClosed(f"unexpected {reply.type!r} frame answering the read of {served!r}")
                    if reply.code not in LOOK_AGAIN:
                        raise ServerError(reply.code, reply.message)
                    why = f"{address} answered {reply.code}: {reply.message}"
            except Timeout:
                raise
            except ServerError as exc:
                if exc.code not in LOOK_AGAIN:
                    raise
                why = str(exc)
            except (OSError, ClientClosed) as exc:
                why = _reason(exc)
            self._routes.pop(topic, None)
            if time.monotonic() + delay > deadline:
                raise Timeout(f"partition {partition} of {topic!r} could not be read within {within} s: {why}")
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, MAX_BACKOFF)

    def server_errors(self) -> dict[str, int]:
        """Errors the servers sent that answered no request (e.g. rejected acks), by code."""
        total: Counter[str] = Counter()
        for link in self._links.values():
            total.update(link.errors)
        return dict(total)

    async def _partition_links(self, topic: str) -> list[Link]:
        """Connect if not yet; the link to the broker of each partition of ``topic``, for a new producer or consumer."""
        await self.connect()
        self._check_usable()
        return await self._served(topic)

    def _check_usable(self) -> None:
        """Raise when no producer or consumer can be made: the client was refused for good, or closed."""
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

    async def _link(self, address: Address) -> Link:
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

    async def _open_link(self, address: Address) -> Link:
        """Connect a new link to ``address``; a refusal no retry cures fails the whole client."""
        link = Link(address, self._token, self._tls, self._reqs)
        try:
            await link.start(self._connect_timeout)
        except ServerError as exc:
            if exc.code in PERMANENT:
                self._failure = exc
            raise
        self._links[address] = link
        return link

    async def _any_link(self, avoid: Link | None = None) -> Link:
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

    async def _lookup(self, topic: str, avoid: Link | None = None) -> list[Address | None]:
        """The broker address of each partition of ``topic`` (None: not served right now), asked of a link
        other than ``avoid`` if another is up."""
        link = await self._any_link(avoid)
        reply = await self._request(link, lambda req: Lookup(req=req, topic=topic), f"the lookup of {topic!r}")
        if isinstance(reply, Error):
            raise ServerError(reply.code, reply.message)
        if not isinstance(reply, Route):
            raise ClientClosed(f"unexpected {reply.type!r} frame answering the lookup of {topic!r}")
        return [link.address if broker == "" else broker for broker in reply.brokers]

    async def _request(self, link: Link, make: Callable[[int], Frame], what: str) -> Frame:
        """The frame answering the request ``make`` builds with a new request id, sent on ``link``: raises
        :class:`ClientClosed` when the connection dropped first, :class:`Timeout` when no answer came within the
        connect timeout. ``what`` names the request in those errors."""
        answer: asyncio.Future[Frame | None] = asyncio.get_running_loop().create_future()
        req = link.next_req()

        def answered(reply: Frame | None) -> None:
            """Hold the request's answer: None when the connection was lost."""
            if not answer.done():
                answer.set_result(reply)

        link.pending[req] = answered
        if not link.send(make(req)):
            link.pending.pop(req, None)
            raise ClientClosed(f"the connection to {link.address} dropped before {what}")
        try:
            async with asyncio.timeout(self._connect_timeout):
                reply = await answer
        except TimeoutError:
            link.pending.pop(req, None)
            raise Timeout(f"no answer to {what} from {link.address} within {self._connect_timeout} s") from None
        if reply is None:
            raise ClientClosed(f"the connection to {link.address} dropped before {what} was answered")
        return reply

    async def _served(self, topic: str) -> list[Link]:
        """The connection to the broker of every partition of ``topic``, waiting (up to the connect
        timeout) while a failover leaves some partition without one, or a lookup names a broker that
        has just died (its connection refused: the brokers' view had not caught up yet)."""
        deadline = time.monotonic() + self._connect_timeout
        delay = MIN_BACKOFF
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
            delay = min(delay * 2, MAX_BACKOFF)

    def _lost(self, part: Part) -> None:
        """``part`` lost its broker (a dropped connection, ``not_owner``, a moved partition): find it again."""
        if self._closed:
            return
        if part in self._relocating:
            self._again.add(part)  # the search under way looks once more before it ends
            return
        task = asyncio.get_running_loop().create_task(self._relocate(part), name=f"keyfailover-relocate {part.topic}")
        self._relocating[part] = task

    async def _relocate(self, part: Part) -> None:
        """Look ``part``'s topic up until its partition's broker takes it, and move it there.

        After each move or retry the search waits (backoff with jitter, doubling): when the
        part is lost again meanwhile (the new broker has not opened the partition yet: it
        answers ``not_owner``), it looks again; else it is done. Its own broker coming back
        (the connection re-established) ends the search too: the link resubscribes and resends.
        """
        delay = MIN_BACKOFF
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
                delay = min(delay * 2, MAX_BACKOFF)
                if link is not None and link.ready.is_set() and part not in self._again:
                    return
        finally:
            self._relocating.pop(part, None)
            self._again.discard(part)
