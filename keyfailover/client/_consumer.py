"""Consumers: a session per partition, one inbox for the application, acks batched per session.

:class:`AsyncConsumer` is what the application receives from and acknowledges on; a
:class:`PartConsumer` is its session on one partition: it subscribes on its broker's link
(again after a reconnect or a moved partition), puts what arrives in the consumer's shared
inbox, returns permits with flows and sends acks, nacks and lease extensions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import NamedTuple

from keyfailover.client._errors import (
    LOOK_AGAIN,
    ClientClosed,
    ConsumerBusyError,
    ConsumerClosedError,
    NotInFlight,
    ServerError,
    ServerTooOldError,
    Timeout,
    settle_error,
)
from keyfailover.client._link import MAX_BATCH, Link, LostCallback, Part, call_soon
from keyfailover.core.errors import ErrorCode, KeyFailoverError
from keyfailover.core.subtypes import SubscriptionType
from keyfailover.wire.properties import NO_PROPERTIES, Properties
from keyfailover.wire.protocol import (
    SUBSCRIPTION_TYPES_VERSION,
    Ack,
    CloseConsumer,
    ConsumerClosed,
    Error,
    Extend,
    Flow,
    Frame,
    Key,
    Messages,
    Nack,
    RangesChanged,
    Settled,
    Subscribe,
    Subscribed,
)

_log = logging.getLogger("keyfailover.client")


RangesCallback = Callable[[list[tuple[int, int]]], None]
"""``on_ranges_changed(ranges)``: the consumer's new inclusive ``(start, end)`` hash ranges, sorted; empty: standby."""


class Message(NamedTuple):
    """A received message; acknowledge or negatively acknowledge it on its consumer.

    ``position`` counts within its ``partition`` (0 for a topic of one partition).
    ``publish_time`` is when the broker stored it, by the broker's wall clock, in integer
    microseconds since the Unix epoch: ``time.time_ns() // 1000`` on the broker; None when
    unknown (stored before logs had publish times). ``properties`` are the str keys and values
    its producer sent with it, a read-only mapping (empty when it has none). A dead letter, and
    a dead letter replayed, keeps the publish time and the properties of the message it was.
    ``producer`` is the name of the producer that stored it; None for an unnamed producer's message,
    a dead letter or a replayed one (stored without a name), or from a broker older than protocol
    version 9.
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
    producer: str | None = None

    def __repr__(self) -> str:
        shown = f", properties={dict(self.properties)!r}" if self.properties else ""
        if self.producer is not None:
            shown += f", producer={self.producer!r}"
        return (
            f"Message(key={self.key!r}, payload={self.payload!r}, position={self.position}, "
            f"redelivery_count={self.redelivery_count}, publish_time={self.publish_time}{shown})"
        )


class _Inbox:
    """What a consumer's partitions received, for the application to take (from any thread)."""

    __slots__ = ("arrived", "cond", "lock", "messages")

    def __init__(self) -> None:
        self.messages: deque[Message] = deque()
        # lock guards messages; threads wait on cond (over lock), coroutines on arrived. Blocks take the lock
        # itself: a `with` on the condition is two Python calls more, for each message taken and acked.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.arrived = asyncio.Event()

    def drop(self, keep: Callable[[Message], bool]) -> int:
        """Keep only the messages ``keep`` accepts (holding ``lock``); how many were dropped."""
        kept = [message for message in self.messages if keep(message)]
        dropped = len(self.messages) - len(kept)
        if dropped:
            self.messages.clear()
            self.messages.extend(kept)
        return dropped


MAX_PRIORITY_LEVEL = 2**31 - 1
"""The highest priority level a consumer may have (Pulsar's are int32s): the lowest priority."""


def check_subscription_version(version: int, address: str) -> None:
    """Raise :class:`ServerTooOldError` when a connection of protocol ``version`` to ``address`` cannot ask for a
    subscription type or priority level."""
    if version < SUBSCRIPTION_TYPES_VERSION:
        raise ServerTooOldError(
            ErrorCode.VERSION_MISMATCH,
            f"the broker at {address} speaks protocol version {version}; a subscription type or priority level "
            f"needs version {SUBSCRIPTION_TYPES_VERSION} or newer: upgrade the broker (nothing was sent)",
        )


class PartConsumer(Part):
    """One consumer's session on one partition: what it receives goes to the consumer's shared inbox."""

    def __init__(
        self,
        link: Link,
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
        subscription_type: SubscriptionType | None = None,
        priority_level: int = 0,
    ) -> None:
        super().__init__(link, base_topic, partition, partitions, on_lost)
        self.subscription = subscription
        self.consumer_name = name
        self._queue_size = receiver_queue_size
        self._subscription_type = subscription_type
        self._priority_level = priority_level
        self._on_ranges = on_ranges
        self._loop = asyncio.get_running_loop()
        self._inbox = inbox
        self._lock, self._cond = inbox.lock, inbox.cond
        self._session = 0
        self._subscribing = False
        self._secret: str | None = None  # from the last subscribed: proves a resubscribe is this consumer
        self._consumed = 0  # received since the last flow (guarded by _lock)
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
        """Send a subscribe for this partition, with the last session's secret; reconnected() retries one not sent."""
        req = self.link.next_req()
        frame = Subscribe(
            req=req,
            topic=self.topic,
            subscription=self.subscription,
            consumer=self.consumer_name,
            receiver_queue=self._queue_size,
            secret=self._secret,
            subscription_type=self._subscription_type,
            priority_level=self._priority_level,
        )
        self.link.pending[req] = self._on_subscribe_reply
        self._subscribing = True
        if not self.link.send(frame):
            self._subscribing = False
            self.link.pending.pop(req, None)  # retried by reconnected()

    def _on_subscribe_reply(self, reply: Frame | None) -> None:
        """A subscribe's answer: a session to receive on, a moved partition to follow, or a refusal ending the part."""
        self._subscribing = False
        if reply is None:
            return  # connection lost: reconnected() subscribes again
        if isinstance(reply, Subscribed):
            self._session = reply.session
            self._secret = reply.secret
            with self._lock:
                self._consumed = 0
            self.link.sessions[reply.session] = self.on_frame
            self._set_ranges(reply.ranges)
            if not self._subscribed.done():
                self._subscribed.set_result(None)
        elif isinstance(reply, Error):
            if reply.code in LOOK_AGAIN:
                self._on_lost(self)  # the partition moved, or the store fails over: subscribe again, with backoff
                return
            error_class = ConsumerBusyError if reply.code == ErrorCode.CONSUMER_BUSY else ServerError
            self._end(error_class(reply.code, reply.message))

    async def subscribed(self) -> None:
        """Wait until the server confirmed this partition's subscription."""
        await self._subscribed

    def disconnected(self) -> None:
        """The link dropped: forget the session, whose messages went back to pending, and look for the partition."""
        self._drop_session()
        self._on_lost(self)

    def failed(self, error: ServerError) -> None:
        """The link was refused for good: the part ends with ``error``."""
        self._drop_session()
        self._end(error)

    def reconnected(self) -> None:
        """The link is back: subscribe again, unless closed."""
        if not self._closed:
            self._subscribe()

    def move(self, link: Link) -> None:
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
        """A frame for this part's session: messages go to the inbox, new ranges are remembered; a closed session is
        subscribed again, followed or ended, by its reason."""
        if isinstance(frame, Messages):
            if frame.session != self._session:
                return
            session, partition = frame.session, self.partition
            made = tuple.__new__  # a Message of its fields, without the call of Message's __new__: half the cost
            with self._lock:
                self._inbox.messages.extend(
                    made(
                        Message,
                        (
                            key,
                            payload,
                            position,
                            redelivery,
                            session,
                            partition,
                            published,
                            NO_PROPERTIES if data is None else Properties.decoded(data),
                            producer,
                        ),
                    )
                    for position, key, payload, redelivery, published, data, producer in frame.messages
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
        with self._lock:
            self._inbox.drop(lambda message: message.partition != partition)
            self._acks.clear()

    def _end(self, error: BaseException) -> None:
        """End this part for good with ``error``: a waiting subscribe or receive raises it."""
        self.ended = error
        if not self._subscribed.done():
            self._subscribed.set_exception(error)
        with self._lock:
            self._cond.notify_all()
        self._inbox.arrived.set()

    def _set_ranges(self, ranges: list[tuple[int, int]]) -> None:
        """Remember the ranges the server announced; tell the consumer when they differ."""
        if not ranges:
            with self._lock:
                self._show_progress = True
                self._cond.notify_all()  # an application waiting for a message shows progress now
            self._inbox.arrived.set()
        if ranges != self.ranges:
            self.ranges = ranges
            self._on_ranges()

    # -- receiving -------------------------------------------------------------------

    def waiting(self) -> bool:
        """The application waits for a message and none is here (holding ``_lock``): that is progress
        too; whether to send a flow now to show it (a part left with no range, whose deliveries were all
        taken back, would else never send another: it gets nothing to take)."""
        return not self._flow_scheduled and self._progress()

    def _progress(self) -> bool:
        """Whether to send a flow now to show the server progress (holding ``_lock``)."""
        if not self._show_progress:
            return False
        self._show_progress = False
        self._flow_scheduled = True
        return True

    def consumed_one(self, count: int = 1) -> bool:
        """Count messages taken (holding ``_lock``); whether a flow is now to be scheduled.

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
        with self._lock:
            permits, self._consumed = self._consumed, 0
            self._flow_scheduled = False
        if self._session:
            self.link.send(
                Flow(topic=self.topic, subscription=self.subscription, session=self._session, permits=permits)
            )

    # -- acknowledging ---------------------------------------------------------------

    def acknowledge(self, message: Message) -> None:
        """Acknowledge ``message`` (batched; sent within a loop iteration)."""
        with self._lock:
            if message.session != self._ack_session and self._acks:
                # The batch so far belongs to another session: it goes out as it is, alone.
                positions, self._acks = self._acks, []
                session = self._ack_session
                self._call(lambda: self._send_acks(session, positions))
            self._ack_session = message.session
            self._acks.append(message.position)
            schedule = not self._ack_scheduled or len(self._acks) >= MAX_BATCH
            self._ack_scheduled = True
            flow = self._progress()
        if schedule:
            self._call(self._flush_acks)
        if flow:
            self._call(self.send_flow)

    def _flush_acks(self) -> None:
        """Send the acks batched so far, as one ack frame of their session."""
        with self._lock:
            positions, self._acks = self._acks, []
            session = self._ack_session
            self._ack_scheduled = False
        self._send_acks(session, positions)

    def _send_acks(self, session: int, positions: list[int]) -> None:
        """Send one ack frame for ``positions`` of ``session``: none when either is empty."""
        if positions and session:
            self.link.send(Ack(topic=self.topic, subscription=self.subscription, session=session, positions=positions))

    async def settle(self, kind: type[Ack | Extend], message: Message, timeout: float | None) -> None:
        """Send one ``kind`` frame for ``message`` with a request id and wait for its answer."""
        self._flush_acks()
        with self._lock:
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
            """Hold the request's answer: None when the connection was lost."""
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
            raise settle_error(reply)
        if not isinstance(reply, Settled):
            raise ClientClosed(
                f"the connection was lost before the {frame.type} of position {message.position} was answered"
            )

    def negative_acknowledge(self, message: Message) -> None:
        """Redeliver ``message``; prefetched later messages of its key are dropped, so the key restarts in order."""
        kb = message.key.encode() if isinstance(message.key, str) else message.key

        def keep(queued: Message) -> bool:
            """Whether ``queued`` stays: all but the later messages of the nacked key, of its session."""
            # Only the nacked message's session restarts the key; a nack of a message from an
            # ended session changes nothing (the server already took that session's messages back).
            if kb is None or queued.session != message.session or queued.position <= message.position:
                return True
            return (queued.key.encode() if isinstance(queued.key, str) else queued.key) != kb

        with self._lock:
            dropped = self._inbox.drop(keep)
        self._call(lambda: self._send_nack(message, dropped))

    def _send_nack(self, message: Message, dropped: int) -> None:
        """Send the nack of ``message`` after the acks batched before it, if its session is still live, and give back
        the permits of the ``dropped`` prefetched messages."""
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
            with self._lock:
                flow = self.consumed_one(dropped)
            if flow:
                self.send_flow()

    def _call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the consumer's loop soon, from any thread."""
        call_soon(self._loop, fn)

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
                """The server confirmed the close, or the connection dropped: stop waiting."""
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
        with self._lock:
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
        self.parts: list[PartConsumer] = []
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

    def _part(self, message: Message) -> PartConsumer:
        """The partition's part that delivered ``message``; raises for a message this consumer did not receive."""
        if not 0 <= message.partition < len(self.parts):
            raise KeyFailoverError(f"{message!r} was not received by this consumer (no partition {message.partition})")
        return self.parts[message.partition]

    def _taken(self) -> tuple[Message, PartConsumer | None]:
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
        with self.inbox.lock:
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
        with self.inbox.lock:
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
        """Raise why nothing can be received: a partition ended for good, or the consumer was closed."""
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
        """Run ``fn`` on the consumer's loop soon, from any thread."""
        call_soon(self._loop, fn)

    async def close(self) -> None:
        """Send pending acks and leave the subscription on every partition; unacked messages go to others."""
        self._closed = True
        for part in self.parts:
            await part.close()
