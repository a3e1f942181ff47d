"""One (topic, subscription): the dispatcher core, its durable cursor and the read loop.

The dispatcher holds positions only; payloads come from a bounded cache of what was just
read, or are re-read from the log for replays. The log is read only as far as
``Dispatcher.wants()`` allows (G4), and a single pump task per subscription does all reads
and sends, so the core is touched by the event loop thread alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import operator
import secrets
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np

from keyfailover.broker.cursor import Cursor
from keyfailover.broker.storage._store import NotServedError, Store, StoreUnavailableError
from keyfailover.broker.storage.records import StoredMessage, dead_letter_topic, publish_clock
from keyfailover.core.dispatcher import (
    ConsumeMode,
    DeadLetter,
    Delivery,
    DeliverySettings,
    Dispatcher,
    check_consume_mode,
)
from keyfailover.core.errors import (
    ConfigError,
    ConsumerError,
    ErrorCode,
    KeyFailoverError,
    NotInFlightError,
    ProtocolError,
)
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hash
from keyfailover.core.histogram import DEFAULT_BUCKETS, Histogram
from keyfailover.core.ranges import Range
from keyfailover.core.rebalance import DEFAULT_MAX_RANGES, UNASSIGNED, StickyPolicy, check_policy_choice
from keyfailover.core.subtypes import SINGLE_ACTIVE, SubscriptionType, active_consumer
from keyfailover.wire.properties import delivery_time
from keyfailover.wire.protocol import ConsumerClosed, Delivered, Frame, Messages, RangesChanged

__all__ = ["DeliverySettings", "OwnSettings", "Session", "Subscription", "SubscriptionConfig"]

_log = logging.getLogger("keyfailover.server")

_FLUSH_SHARE = 0.1
"""The most of the log worker's time one subscription's cursor flushes may take."""
_READ_BATCH = 2000
"""The most messages one read of the log brings."""
_READ_PER_CONSUMER = 250
"""How many messages a read brings per consumer of the subscription (at most ``_READ_BATCH``).

A read's messages go out in the next poll, spread over the consumers: about this many to each,
a quarter of the default receiver queue (1000), which the client refills after a quarter too.
Frames of half of it (2000 messages a read among four consumers) let a consumer's permits run out
before its next flow comes, and what a read brought for it then waits in the dispatcher, which
costs the server about 2 µs a message more (``benchmarks/bench_e2e.py --backlog``, alternating
runs: 0.82-0.94x Redis's fastest row at 2000 a read, 0.96-1.19x at 1000)."""
_SEND_BATCH = 1000
_SEND_BYTES = 2 * 1024 * 1024  # well under the protocol's default 5 MiB frame limit
_HISTORY_RANGES = 200_000
"""The most ranges the recent range maps kept for plots hold in all (besides ``history`` maps at most)."""
_DELIVERY_BUCKETS = (0.0005, *DEFAULT_BUCKETS, 600.0, 1800.0, 3600.0)
"""Publish to first delivery: from a consumer keeping up (below a millisecond) to one catching up on an hour."""


OwnSettings: TypeAlias = dict[str, float | int | None]
"""The delivery settings a subscription has of its own, by name (``keyfailover admin configure``): some of
:meth:`DeliverySettings.own_names`, as the log stores them."""


@dataclass(frozen=True)
class SubscriptionConfig:
    """What every subscription of a server shares: buffer bounds, the rebalance policy and the delivery settings."""

    payload_cache: int = 20_000
    """Payloads read from the log and not yet delivered kept in memory, the oldest dropped past this many (read
    again when their messages go out); a payload leaves as its message goes out (a redelivery reads it again)."""
    cursor_flush_seconds: float = 0.05
    history: int = 1000  # range maps kept for `keyfailover plot`
    policy: str = "multi"
    """The dispatcher's rebalance policy: ``"multi"`` (several ranges per consumer) or ``"contiguous"``."""
    max_ranges: int = DEFAULT_MAX_RANGES
    """With the multi policy, the most ranges one consumer may own."""
    consume_mode: ConsumeMode = "ordered"
    """The consume mode of a subscription that has none saved (``keyfailover admin set-consume-mode`` saves one)."""
    delivery: DeliverySettings = field(default_factory=DeliverySettings)
    """The delivery settings of a subscription without settings of its own; each subscription may
    override those :meth:`DeliverySettings.own_names` lists."""

    def __post_init__(self) -> None:
        """Refuse a policy, consume mode or delivery settings that are not valid, with :class:`ConfigError`."""
        # Checked here, so a bad setting stops the server at start, not at its first subscribe.
        check_policy_choice(self.policy, self.max_ranges)
        if not isinstance(self.delivery, DeliverySettings):
            raise ConfigError(f"delivery must be a DeliverySettings, not {self.delivery!r}")
        check_consume_mode(self.consume_mode)


class Session:
    """One consumer's attachment to a subscription through one connection.

    ``ranges`` is what the session was last told it owns: inclusive, sorted ``(start, end)``
    pairs, empty for a standby. ``counts_failures``: each delivery's redelivery count is the
    number of its earlier deliveries that *failed* (:meth:`Dispatcher.failures`), not of all of
    them: what a Pulsar client's dead-letter policy expects, so that a message taken back only to
    keep its key's order behind a nacked one is not dead-lettered with it. ``sub_type``: the
    subscription type the consumer asks for, None to join as the subscription is; ``priority``: its
    priority level in a Failover subscription, the lower the first. ``on_active``: called with
    whether the consumer is its Exclusive or Failover subscription's active one, when it joins and
    whenever that changes; ``on_drained``: called when the consumer, having stood down as a Failover
    subscription's active one, has nothing in flight any more and left the dispatcher.
    """

    __slots__ = (
        "consumer",
        "counts_failures",
        "held",
        "id",
        "on_active",
        "on_drained",
        "priority",
        "ranges",
        "secret",
        "send",
        "sub_type",
        "subscription",
    )

    def __init__(
        self,
        session_id: int,
        consumer: str,
        subscription: Subscription,
        send: Callable[[Frame], None],
        *,
        counts_failures: bool = False,
        sub_type: SubscriptionType | None = None,
        priority: int = 0,
        on_active: Callable[[bool], None] | None = None,
        on_drained: Callable[[], None] | None = None,
    ) -> None:
        """A session of ``consumer``, whose frames go out through ``send``; it owns no ranges yet."""
        self.id = session_id
        self.consumer = consumer
        self.secret = secrets.token_hex(16)  # proves a later subscribe is this consumer resuming
        self.subscription = subscription
        self.send = send
        self.counts_failures = counts_failures
        self.sub_type = sub_type
        self.priority = priority
        self.on_active = on_active
        self.on_drained = on_drained
        self.held = 0
        """The permits of a Failover standby, or of one that stood down and drains, kept for when it becomes the
        active consumer."""
        self.ranges: list[tuple[int, int]] = []


class Subscription:
    """The live state of one subscription of one topic."""

    def __init__(
        self,
        topic: str,
        name: str,
        cursor: Cursor,
        storage: Store,
        config: SubscriptionConfig,
        *,
        consume_mode: ConsumeMode = "ordered",
        own_settings: Mapping[str, float | int | None] | None = None,
        slots: tuple[int, int] = (0, HASH_RANGE_SIZE - 1),
        settings_topic: str | None = None,
        may_act: Callable[[], bool] | None = None,
        partition: int = -1,
    ) -> None:
        """The subscription ``name`` of ``topic``, from ``cursor``: its dispatcher has the server's delivery
        settings of ``config`` with ``own_settings`` over them, and serves the hash ``slots``; ``partition`` is the
        topic's partition index, -1 unless it is a partition of a partitioned topic. Not started."""
        self.topic = topic
        self.partition = partition
        self.saved_mode: ConsumeMode = consume_mode
        """The consume mode saved for the subscription (or the server's default): its mode unless a typed
        consumer's type decides it while the subscription has consumers."""
        self.sub_type: SubscriptionType | None = None
        """The type the present consumers asked for (the first to ask set it); None without consumers, or while
        none of them named one (native consumers joining as the subscription is)."""
        self._active: str | None = None  # a Failover subscription's active consumer
        self._draining: set[str] = set()
        """Failover consumers that stood down and are still in the dispatcher, without permits, until nothing is in
        flight on them (G1 across a switch: see :meth:`_elect`)."""
        self._keyless_key = _keyless_key(slots)
        self._keyed_runs: list[tuple[int, int]] = []
        """The runs of positions, first and last, handed to the dispatcher with :attr:`_keyless_key` for the keyless
        ones (:meth:`_keyed`): a re-read restores a keyless message under it only if it was parked under it."""
        self._may_act = may_act
        """A cluster broker's lease: while it returns False nothing is delivered and no ack, nack or
        extension is taken (None: always may)."""
        self.name = name
        self.settings_topic = topic if settings_topic is None else settings_topic
        """The topic its consume mode and delivery settings are saved under: a partition's are its topic's."""
        self.cursor = cursor
        self.own_settings: OwnSettings = {} if own_settings is None else dict(own_settings)
        self.dispatcher = Dispatcher(
            clock=time.monotonic,
            policy=config.policy,
            max_ranges=config.max_ranges,
            consume_mode=consume_mode,
            settings=config.delivery.with_overrides(self.own_settings),
            spill=True,  # the log is here: what a blocked consumer cannot take is re-read from it, not held
            slots=slots,
        )
        self.sessions: dict[str, Session] = {}
        self._storage = storage
        self._config = config
        self._read_position = cursor.mark_delete
        # Payloads by position, oldest first (a dict keeps insertion order; its pop, once per delivery, costs
        # less than an OrderedDict's, which unlinks a node besides).
        self._cache: dict[int, StoredMessage] = {}
        self._wake = asyncio.Event()
        self._cursor_dirty = False
        self._history: deque[tuple[float, int, list[Range]]] = deque()
        self._history_ranges = 0  # ranges in all of _history's maps
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._unburied: list[DeadLetter] = []  # given up on by the dispatcher, not stored in the DLQ yet
        self.dead_lettered = 0  # messages stored in the dead-letter topic by this subscription
        self.delivery_seconds = Histogram(_DELIVERY_BUCKETS)
        """Seconds from each message's publish time to its first delivery (messages without one left out)."""

    def start(self) -> None:
        """Start the pump, which reads and delivers, and the flusher, which saves the cursor."""
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._pump_loop(), name=f"pump {self.topic}/{self.name}")
        self._flusher = loop.create_task(self._flush_loop(), name=f"cursor {self.topic}/{self.name}")

    def wake(self) -> None:
        """Something changed that the pump may act on: permits, acks, members or settings."""
        self._wake.set()

    def committed(self) -> None:
        """Messages were just committed: the pump reads them (from the store's entry cache, while they are in it)."""
        self._wake.set()

    # -- membership ------------------------------------------------------------------

    def attach(
        self,
        session: Session,
        permits: int,
        secret: str | None = None,
        sticky: list[tuple[int, int]] | None = None,
    ) -> Session | None:
        """Add ``session``; returns the session it superseded, if any (already detached).

        A consumer name with a live session is taken over only by a subscribe that presents
        that session's secret (the same consumer, resuming over a new connection); any other
        is refused with ``consumer_busy`` and changes nothing. ``sticky``: the hash ranges a
        Key_Shared STICKY consumer declares (whole-space slots); a subscription without
        consumers becomes sticky for it, or back to the configured policy for a consumer
        without; a joiner of the other kind than the present consumers is refused with
        ``consumer_busy``; ranges that overlap a present consumer's are the dispatcher's
        :class:`ConsumerError`, and nothing changes.

        The session's ``sub_type`` must be the subscription's (:meth:`_check_type`); the first
        consumer of a subscription without consumers sets it, once it is in. A Failover standby
        waits outside the dispatcher with its permits (:meth:`_elect`). A refused subscribe changes
        nothing: all is checked before anything changes, and the type is set only once the
        dispatcher took the consumer.
        """
        old = self.sessions.get(session.consumer)
        if old is not None and (secret is None or not hmac.compare_digest(secret, old.secret)):
            raise ProtocolError(
                ErrorCode.CONSUMER_BUSY,
                f"consumer {session.consumer!r} of {self.topic!r}/{self.name!r} has a live session; "
                "expected another consumer name, or the secret of that session's subscribe to resume it",
            )
        if session.consumer == UNASSIGNED:
            raise ConsumerError(
                f"consumer name {UNASSIGNED!r} is reserved for the hash slots no consumer declared; expected "
                "another consumer name"
            )
        self._check_kind(session.consumer, sticky, old)
        self._check_type(session, old)
        if old is not None:
            self.detach(old, "superseded")
        first = not self.sessions
        sub_type = session.sub_type if first or self.sub_type is None else self.sub_type
        if sub_type == "failover":
            self._attach_failover(session, permits, first)
            return old
        dispatcher = self.dispatcher
        policy = dispatcher.policy.name
        dispatcher.set_policy(self._config.policy if sticky is None else StickyPolicy.name)
        try:
            dispatcher.add_consumer(session.consumer, sticky)
        except KeyFailoverError:
            dispatcher.set_policy(policy)
            raise
        if first:
            self._set_type(sub_type)
        else:
            self.sub_type = sub_type  # the untyped consumers' mode serves it: the mode holds
        self.dispatcher.flow(session.consumer, permits)
        self.sessions[session.consumer] = session
        self._joined(session)
        session.ranges = self.dispatcher.ranges_of(session.consumer)
        self.announce_ranges(skip=session)
        if session.on_active is not None and self.sub_type == "exclusive":
            session.on_active(True)
        self.wake()
        return old

    def _attach_failover(self, session: Session, permits: int, first: bool) -> None:
        """Add ``session`` to a Failover subscription (the first consumer makes it one) and choose the active
        consumer again; a refusal of the dispatcher leaves everything as it was."""
        session.held = permits
        self.sessions[session.consumer] = session
        self.sub_type = "failover"
        try:
            self._elect(session)
        except KeyFailoverError:
            del self.sessions[session.consumer]
            if first:
                self.sub_type = None
            raise
        if first:
            self._set_type("failover")
        self._joined(session)

    def _joined(self, session: Session) -> None:
        """Log that ``session`` joined."""
        _log.info(
            "consumer %r joins %s/%s (session %d; consumers now %d)",
            session.consumer,
            self.topic,
            self.name,
            session.id,
            len(self.sessions),
        )

    def effective_type(self) -> SubscriptionType:
        """The subscription's type now: the one its consumers asked for, else what its consume mode serves
        (``shared`` for unordered, ``key_shared`` for ordered)."""
        if self.sub_type is not None:
            return self.sub_type
        return "shared" if self.dispatcher.consume_mode == "unordered" else "key_shared"

    def _check_type(self, session: Session, old: Session | None) -> None:
        """Refuse a joiner of another type than the present consumers' with ``consumer_busy``, as Pulsar does
        ("Subscription is of different type"), and a second consumer of an Exclusive subscription ("Exclusive
        consumer is already connected"); a joiner that names no type joins any but an Exclusive or Failover one."""
        if not any(other is not old for other in self.sessions.values()):
            return
        present = self.effective_type()
        wanted = session.sub_type
        where = f"{self.topic!r}/{self.name!r}"
        if wanted is None and present in SINGLE_ACTIVE:
            raise ProtocolError(
                ErrorCode.CONSUMER_BUSY,
                f"Subscription is of different type: {where} is {present} and consumer {session.consumer!r} "
                f"names no type; expected a consumer asking for {present}, or a subscribe after its consumers "
                "have left",
            )
        if wanted is not None and wanted != present:
            raise ProtocolError(
                ErrorCode.CONSUMER_BUSY,
                f"Subscription is of different type: {where} is {present}, consumer {session.consumer!r} asks for "
                f"{wanted}; expected {present}, or a subscribe after its consumers have left",
            )
        if present == "exclusive":
            raise ProtocolError(
                ErrorCode.CONSUMER_BUSY,
                f"Exclusive consumer is already connected to {where}; expected no other consumer, or a subscribe "
                "after it has left",
            )

    def _set_type(self, sub_type: SubscriptionType | None) -> None:
        """Give the subscription the type of its first joiner, or None when no consumer left names one: Shared
        serves the unordered consume mode, the others the ordered one, and no type the saved mode, switched to
        live. Exclusive and Failover deliver at once what waits for its delivery time (Pulsar delays only on
        Shared and Key_Shared); the dispatcher keeps each one's time, for a later type that honours it."""
        self.sub_type = sub_type
        mode: ConsumeMode = "unordered" if sub_type == "shared" else "ordered"
        if sub_type is None:
            mode = self.saved_mode
        dispatcher = self.dispatcher
        if dispatcher.consume_mode != mode:
            dispatcher.set_consume_mode(mode)
        dispatcher.honour_delays(sub_type not in SINGLE_ACTIVE)

    def _elect(self, joiner: Session | None = None) -> None:
        """Make the Failover consumer Pulsar would pick (:func:`active_consumer`) the active one: the only one of
        the dispatcher with permits.

        When it changes, the new one joins the dispatcher with its own permits (or gets them back, if it was
        still draining), and the old one, if still connected, stays in it draining: its permits are withdrawn and
        kept for later, and the keys it holds move to the new one only as it acks them, nacks them or its leases
        on them expire, as for any range change (G1); once nothing is in flight on it, it leaves the dispatcher
        (:meth:`_settle_drains`). Every session is told; else only ``joiner`` is, of the one in place. A refusal
        of the dispatcher to add the chosen one raises before anything changed.
        """
        sessions = self.sessions
        chosen = active_consumer(((s.priority, name) for name, s in sessions.items()), self.partition)
        dispatcher = self.dispatcher
        current = self._active
        if chosen == current:
            told = [] if joiner is None else [joiner]
        else:
            if chosen is not None:
                active = sessions[chosen]
                if chosen in self._draining:
                    self._draining.discard(chosen)
                else:
                    if not dispatcher.consumers():
                        dispatcher.set_policy(self._config.policy)
                    dispatcher.add_consumer(chosen)
                dispatcher.flow(chosen, active.held)
                active.held = 0
                _log.info("consumer %r is the active consumer of %s/%s", chosen, self.topic, self.name)
            self._active = chosen
            if current is not None:
                sessions[current].held += dispatcher.withdraw_permits(current)
                self._draining.add(current)
                self._settle_drains()
            told = list(sessions.values())
        for session in told:
            if session.on_active is not None:
                session.on_active(session.consumer == chosen)
        self.announce_ranges(skip=joiner)
        self.wake()

    def lease_expired(self, session: Session, position: int) -> bool:
        """Whether ``position`` was taken back from ``session``'s consumer at a lease deadline (never for a
        Failover standby: nothing is in flight on it once it has drained)."""
        return self._in_dispatcher(session) and self.dispatcher.lease_expired(session.consumer, position)

    def _in_dispatcher(self, session: Session) -> bool:
        """Whether ``session``'s consumer is one of the dispatcher's: all but a Failover standby (the active
        consumer, and one that stood down and still drains, are)."""
        return self.sub_type != "failover" or session.consumer == self._active or session.consumer in self._draining

    def _settle_drains(self) -> None:
        """Let every Failover consumer that stood down and has nothing in flight any more leave the dispatcher
        (its slots go to the active consumer), its permits kept for when it is active again."""
        if not self._draining:
            return
        dispatcher = self.dispatcher
        for name in sorted(self._draining):
            if dispatcher.inflight_count(name):
                continue
            self._draining.discard(name)
            session = self.sessions[name]
            session.held += dispatcher.withdraw_permits(name)  # (an unsent delivery's permit)
            dispatcher.remove_consumer(name)
            _log.info("consumer %r of %s/%s drained: it stands by", name, self.topic, self.name)
            if session.on_drained is not None:
                session.on_drained()
            self.announce_ranges()
            self.wake()

    def _ranges_of(self, session: Session) -> list[tuple[int, int]]:
        """The ranges ``session``'s consumer owns: none for a Failover standby."""
        return self.dispatcher.ranges_of(session.consumer) if self._in_dispatcher(session) else []

    def _check_kind(self, consumer: str, sticky: list[tuple[int, int]] | None, old: Session | None) -> None:
        """Refuse a STICKY joiner of an AUTO subscription with consumers (and the other way round)."""
        dispatcher = self.dispatcher
        others = [cid for cid in dispatcher.consumers() if old is None or cid != old.consumer]
        if not others:
            return
        is_sticky = dispatcher.policy.name == StickyPolicy.name
        if is_sticky != (sticky is not None):
            own, auto = "declaring their own hash ranges (Key_Shared STICKY)", "taking ranges from the policy"
            kind, theirs = (own, auto) if sticky is not None else (auto, own)
            raise ProtocolError(
                ErrorCode.CONSUMER_BUSY,
                f"consumer {consumer!r} joins {kind}, but {self.topic!r}/{self.name!r} has {len(others)} "
                f"consumer(s) {theirs}; expected a consumer of their kind, or a subscribe after they have left",
            )

    def detach(self, session: Session, reason: str, req: int | None = None, notify: bool = True) -> None:
        """Remove ``session``: its unacked messages go back to pending and to the new owner."""
        if self.sessions.get(session.consumer) is not session:
            return
        del self.sessions[session.consumer]
        _log.info(
            "consumer %r leaves %s/%s (session %d, %s; consumers now %d)",
            session.consumer,
            self.topic,
            self.name,
            session.id,
            reason,
            len(self.sessions),
        )
        failover = self.sub_type == "failover"
        if self._in_dispatcher(session):
            self.dispatcher.remove_consumer(session.consumer, reason="timeout" if reason == "timeout" else "leave")
            self._draining.discard(session.consumer)
            if session.consumer == self._active:
                self._active = None
        if notify:
            session.send(ConsumerClosed(session=session.id, reason=reason, req=req))
        if self.sub_type is not None and all(other.sub_type is None for other in self.sessions.values()):
            self._set_type(None)  # no consumer left names a type (or none is left): the saved mode again
        elif failover:
            self._elect()
            return
        self.announce_ranges()
        self.wake()

    def current(self, consumer: str, session_id: int) -> Session | None:
        """The session ``session_id`` if it is still ``consumer``'s live one, else None."""
        session = self.sessions.get(consumer)
        return session if session is not None and session.id == session_id else None

    def session_by_id(self, session_id: int) -> Session | None:
        """The live session with this id, or None."""
        for session in self.sessions.values():
            if session.id == session_id:
                return session
        return None

    def announce_ranges(self, skip: Session | None = None) -> None:
        """Tell every session whose ranges changed its new ranges; remember the map for plots.

        ``ranges_of`` reads the map's per-consumer index, built once per change in O(r), so
        telling n sessions costs O(r + n), not O(n * r).
        """
        epoch = self.dispatcher.epoch
        history = self._history
        if not history or history[-1][1] != epoch:
            ranges = self.dispatcher.ranges()
            history.append((time.time(), epoch, ranges))
            self._history_ranges += len(ranges)
            while len(history) > 1 and (len(history) > self._config.history or self._history_ranges > _HISTORY_RANGES):
                self._history_ranges -= len(history.popleft()[2])
        for session in self.sessions.values():
            now = self._ranges_of(session)
            if now != session.ranges:
                session.ranges = now
                if session is not skip:
                    session.send(RangesChanged(session=session.id, epoch=epoch, ranges=now))

    # -- flow, acks ------------------------------------------------------------------

    async def set_consume_mode(self, mode: str) -> None:
        """Save the consume mode and switch to it live (nothing waiting or in flight is lost); while the
        consumers present asked for a type, theirs holds, and the saved mode applies once they have left."""
        checked = check_consume_mode(mode)
        await self._storage.save_consume_mode(self.settings_topic, self.name, checked)
        self.saved_mode = checked
        if self.sub_type is None:
            self.dispatcher.set_consume_mode(checked)
        self.wake()

    def configure(self, own: Mapping[str, float | int | None]) -> DeliverySettings:
        """Give the subscription ``own`` delivery settings over the server's, saved already by the
        caller; returns the settings in force. Invalid ones raise :class:`ConfigError` and change nothing."""
        settings = self._config.delivery.with_overrides(own)
        self.dispatcher.set_settings(settings)
        self.own_settings = dict(own)
        self.wake()
        return settings

    def flow(self, session: Session, permits: int) -> None:
        """Give the session's consumer ``permits`` more messages to receive, and wake the pump to send them; a
        Failover standby, or one that stood down and still drains, keeps them for when it becomes active."""
        if self.sub_type == "failover" and session.consumer != self._active:
            session.held += permits
            return
        epoch = self.dispatcher.epoch
        self.dispatcher.flow(session.consumer, permits)
        self._announce_since(epoch)
        self.wake()

    def _announce_since(self, epoch: int) -> None:
        """Announce the ranges now if a consumer's frame changed them (a stuck consumer rejoined): the pump
        may mark it stuck again before its next announcement, and a consumer told nothing in between would
        not know it has to show progress again."""
        if self.dispatcher.epoch != epoch:
            self.announce_ranges()

    def paused(self) -> bool:
        """Whether the broker may not act on this subscription now (its lease lapsed)."""
        return self._may_act is not None and not self._may_act()

    def ack(self, session: Session, positions: list[int]) -> list[int]:
        """Ack each position; returns those that were not in flight on the session (all while paused, and all
        of a Failover standby)."""
        if self.paused() or not self._in_dispatcher(session):
            return list(positions)
        epoch = self.dispatcher.epoch
        acked, rejected = self.dispatcher.ack_many(session.consumer, positions)
        self._announce_since(epoch)
        if acked:
            self.cursor.ack_many(acked)
            self._cursor_dirty = True
            self._settle_drains()
            self.wake()
        return rejected

    def extend(self, session: Session, positions: list[int]) -> list[int]:
        """Renew the leases of ``positions``; returns those that were not in flight on the session."""
        if self.paused() or not self._in_dispatcher(session):
            return list(positions)
        epoch = self.dispatcher.epoch
        rejected = self.dispatcher.extend(session.consumer, positions)[1]
        self._announce_since(epoch)
        self._settle_drains()  # an extension is progress: a stuck draining consumer rejoined, it may own slots
        return rejected

    def nack(self, session: Session, positions: list[int]) -> list[int]:
        """Nack each position: it is delivered again, after its backoff if there is one. Returns those that were
        not in flight on the session, all of them while paused or for a Failover standby."""
        if self.paused() or not self._in_dispatcher(session):
            return list(positions)
        rejected = []
        epoch = self.dispatcher.epoch
        for position in positions:
            try:
                self.dispatcher.nack(session.consumer, position)
            except NotInFlightError:
                rejected.append(position)
        self._announce_since(epoch)
        self._settle_drains()
        self.wake()
        return rejected

    # -- the pump --------------------------------------------------------------------

    async def _pump_loop(self) -> None:
        """Run :meth:`_pump` each time the subscription is woken, or at the next lease deadline or backoff end;
        announce the ranges after a pump that changed them. A failed pump is logged, and the next one tries again."""
        epoch = -1
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._next_wake())
            self._wake.clear()
            if self._closed:
                return
            try:
                await self._pump()
            except StoreUnavailableError as exc:  # the store fails over: consumers keep what they hold
                _log.warning("dispatch of %s/%s waits for the store: %s", self.topic, self.name, exc)
            except Exception:
                _log.exception("dispatch of %s/%s failed", self.topic, self.name)
            now_epoch = self.dispatcher.epoch
            if now_epoch != epoch:
                epoch = now_epoch
                self.announce_ranges()

    def _next_wake(self) -> float:
        """Seconds until the pump must poll without being woken: the next lease deadline or backoff end,
        at most 1 s away."""
        deadline = self.dispatcher.next_deadline()
        if deadline is None:
            return 1.0
        return min(max(deadline - time.monotonic(), 0.0) + 0.001, 1.0)

    async def _pump(self) -> None:
        """Deliver what the dispatcher hands out, then read on from the log while it wants more, until nothing moves.

        Each round sends the dispatcher's deliveries, stores its dead letters, re-reads parked slots
        first when there are any, and reads the next batch only for a consumer with permits to spare:
        at most what :meth:`Dispatcher.wants` allows, G4. Messages acked before a restart are skipped,
        never published again. Nothing is done while the broker may not act, its lease having lapsed.
        """
        dispatcher = self.dispatcher
        while not self.paused():
            deliveries = dispatcher.poll()
            self._settle_drains()  # leases may have expired on a Failover consumer that stood down
            await self._send(deliveries)
            letters = dispatcher.dead_letters()
            if letters or self._unburied:
                await self._bury(letters)
            slots = dispatcher.rereads()
            if slots:
                await self._reread(slots)
                continue  # deliver what came back before reading on
            wanted = dispatcher.wants()
            last = self._storage.last_position(self.topic)
            # Read on only for a consumer with permits to spare: read further, messages would wait in
            # memory and their payloads leave the cache (smaller than max_replay) before they went out.
            if not wanted or self._read_position >= last or not self.sessions or not dispatcher.hungry():
                return
            size = min(wanted, _READ_BATCH, _READ_PER_CONSUMER * len(self.sessions))
            batch = await self._storage.read(self.topic, self._read_position, size)
            if not batch:
                return
            cursor = self.cursor
            if batch[0].position <= cursor.last_acked:  # some were acked before (a restart): never again
                is_acked = cursor.is_acked
                unacked = [message for message in batch if not is_acked(message.position)]
            else:
                unacked = batch  # the usual case
            self._publish(unacked)
            self._cache.update(zip(map(_position, unacked), unacked, strict=True))
            self._read_position = batch[-1].position
            self._trim_cache()

    def _publish(self, messages: list[StoredMessage]) -> None:
        """Hand ``messages`` to the dispatcher, a message whose delivery time is ahead with it (Pulsar's
        ``deliver_at_time``, kept in its properties: so a restart keeps it too), the others in runs. An
        Exclusive or Failover subscription's dispatcher does not honour the delivery times, and keeps them."""
        dispatcher = self.dispatcher
        if self.sub_type in SINGLE_ACTIVE and messages:
            messages = self._keyed(messages)
        # The usual batch: no properties, so no delivery times.
        if not any(map(_properties, messages)):
            dispatcher.publish_many(messages)
            return
        now = time.monotonic()
        start = 0
        for index, message in enumerate(messages):
            deliver_at = _deliver_at(message.properties, now)
            if deliver_at:
                if start < index:
                    dispatcher.publish_many(messages[start:index])
                dispatcher.publish(message.position, message.key, None, deliver_at=deliver_at)
                start = index + 1
        if start < len(messages):
            dispatcher.publish_many(messages[start:])

    def _keyed(self, messages: list[StoredMessage]) -> list[StoredMessage]:
        """``messages`` with :attr:`_keyless_key` for each keyless one's key: an Exclusive or Failover subscription
        hands its dispatcher keyless messages under that one key, so that they wait in one queue with the keyed
        ones, by position, and go out in log order. A delivery's key is the stored message's own."""
        first, last = messages[0].position, messages[-1].position
        runs = self._keyed_runs
        if runs and runs[-1][1] == self._read_position:  # the run goes on
            runs[-1] = (runs[-1][0], last)
        else:
            mark = self.cursor.mark_delete  # runs wholly acked are of no use any more
            runs[:] = [run for run in runs if run[1] > mark]
            runs.append((first, last))
        if all(message.key is not None for message in messages):
            return messages
        keyless = self._keyless_key
        return [message if message.key is not None else message._replace(key=keyless) for message in messages]

    def _was_keyed(self, position: int) -> bool:
        """Whether a keyless message at ``position`` went to the dispatcher under :attr:`_keyless_key`."""
        return any(first <= position <= last for first, last in self._keyed_runs)

    async def _bury(self, letters: list[DeadLetter]) -> None:
        """Store the dispatcher's dead letters in the dead-letter topic, then ack them here (G3).

        Stored first, acked after: a crash in between redelivers them (at least once). A
        failed store is retried at the next pump; the dispatcher holds them till then.
        """
        self._unburied.extend(letters)
        unburied = self._unburied
        cache = self._cache
        missing = [letter.position for letter in unburied if letter.position not in cache]
        if missing:
            await self._read_into_cache(missing)
        entries = []
        for letter in unburied:
            stored = cache.get(letter.position)
            if stored is None:
                _log.error("dead letter at position %d of %s is not in the log", letter.position, self.topic)
                continue
            entries.append(
                (
                    letter.position,
                    stored.key,
                    stored.payload,
                    letter.redelivery_count,
                    letter.reason,
                    stored.publish_time,
                    stored.properties,
                )
            )
        try:
            await self._storage.dead_letter(self.topic, self.name, entries)
        except StoreUnavailableError as exc:  # stored or not: the retry may store them twice, at least once
            _log.warning("storing %d dead letters of %s/%s waits for the store: %s", len(entries), self.topic,
                         self.name, exc)  # fmt: skip
            return
        except Exception:
            _log.exception("storing %d dead letters of %s/%s failed; retrying", len(entries), self.topic, self.name)
            return
        self._unburied = []
        positions = [letter.position for letter in unburied]
        for position in positions:
            self.cursor.ack(position)
            cache.pop(position, None)
        self.dispatcher.dead_lettered(positions)
        self.dead_lettered += len(entries)
        self._cursor_dirty = True
        _log.warning(
            "%d message(s) of %s/%s moved to %s after %s deliveries",
            len(entries),
            self.topic,
            self.name,
            dead_letter_topic(self.topic, self.name),
            "/".join(sorted({str(letter.redelivery_count + 1) for letter in unburied})),
        )

    async def _read_into_cache(self, positions: list[int]) -> None:
        """Read the messages at ``positions`` (not cached) from the log into the payload cache."""
        found = await self._storage.read_positions(self.topic, positions)
        self._cache.update(found)

    async def _reread(self, slots: dict[int, int]) -> None:
        """Re-read parked slots from the log (from each one's first parked position) and restore them in order.

        Stops where the dispatcher's bound does, and tells it how far every slot was re-read.
        """
        dispatcher = self.dispatcher
        after = min(slots.values()) - 1
        # The last published message, where parking ends. Not the read position: past it the pump may
        # have read messages acked before a restart, which it never published.
        end = dispatcher.last_position
        if end is None:
            return
        through = end  # lowered where the bound stops the re-read
        cache = self._cache
        now = time.monotonic()
        keyless = self._keyless_key
        while after < end and through == end:
            # Positions have no gaps: the batch ends at or before ``end``.
            batch = await self._storage.read(self.topic, after, min(_READ_BATCH, end - after))
            if not batch:
                break
            for message in batch:
                position, key = message.position, message.key
                if key is None and self._was_keyed(position):
                    key = keyless  # parked under it, handed in by an Exclusive or Failover subscription
                if key is None or position < slots.get(key_hash(key), position + 1) or self.cursor.is_acked(position):
                    continue  # not parked, or acked before a restart (never published again)
                if not dispatcher.wants():
                    through = position - 1
                    break
                deliver_at = _deliver_at(message.properties, now)
                dispatcher.restore(position, key, None, deliver_at=deliver_at)
                cache[position] = message
            after = batch[-1].position
        dispatcher.restored(slots, through)
        self._trim_cache()

    def _trim_cache(self) -> None:
        """Drop the oldest payloads past ``payload_cache``, all in one pass from the front."""
        cache = self._cache
        excess = len(cache) - self._config.payload_cache
        if excess > 0:
            for position in list(itertools.islice(cache, excess)):
                del cache[position]

    async def _send(self, deliveries: list[Delivery]) -> None:
        """Send ``deliveries`` to their sessions in frames, payloads from the cache or re-read from the log.

        A consumer removed while payloads were read is skipped: its deliveries went back to pending.
        A redelivery's count is its failures for a session that counts those. Deliveries that cannot
        go out (reading their payloads failed, or the lease lapsed meanwhile) go back to the dispatcher
        with their permits (:meth:`Dispatcher.unsent`): else their keys would wait for their leases, and
        their consumers for them, having asked for them.
        """
        if not deliveries:
            return
        cache = self._cache
        sessions = self.sessions
        missing = [d.position for d in deliveries if d.position not in cache]
        if missing:
            before = {d.consumer: sessions.get(d.consumer) for d in deliveries}
            try:
                await self._read_into_cache(missing)
            except BaseException:
                self._unsent(deliveries)
                raise
            # A consumer removed while payloads were read had its deliveries sent back to pending. (A Failover
            # consumer that stood down meanwhile still holds them, draining: they go out to it.)
            gone = {name for name, session in before.items() if session is None or sessions.get(name) is not session}
            if gone:
                deliveries = [d for d in deliveries if d.consumer not in gone]
        by_consumer: dict[str, list[Delivered]] = {}
        properties_bytes: dict[str, int] = {}  # per consumer: its deliveries' properties count toward frame sizes
        first_published: list[int] = []  # of first deliveries: their latency is observed
        # A payload leaves the cache as it goes out, while its objects are fresh in memory: an ack frees
        # nothing of it then, and the rare redelivery reads it from the log again.
        take = cache.pop
        for consumer, position, _, _, redeliveries in deliveries:
            cached = take(position, None)
            if cached is None:
                _log.error("position %d of %s is not in the log", position, self.topic)
                continue
            items = by_consumer.get(consumer)
            if items is None:
                items = by_consumer[consumer] = []
            _, key, payload, published, properties, producer = cached  # unpacked at once: cheaper than field reads
            count = redeliveries
            if not count:
                if published is not None:
                    first_published.append(published)
            elif (session := sessions.get(consumer)) is not None and session.counts_failures:
                failed = self.dispatcher.failures(consumer, position)
                count = count if failed is None else failed  # None: taken back meanwhile, its ack will be refused
            if properties is not None:
                properties_bytes[consumer] = properties_bytes.get(consumer, 0) + len(properties)
            items.append((position, key, payload, count, published, properties, producer))
        if first_published:
            waited = publish_clock() - np.array(first_published, dtype=np.int64)
            self.delivery_seconds.observe_many(np.maximum(waited, 0) / 1e6)
        if missing:
            self._trim_cache()
        if self.paused():
            # The lease lapsed while payloads were read (the broker may have been stopped): nothing goes
            # out; the deliveries go back, and out again once the lease is renewed.
            self._unsent(deliveries)
            return
        for name, items in by_consumer.items():
            session = sessions.get(name)
            if session is not None:
                _send_in_frames(session, items, properties_bytes.get(name, 0))

    def _unsent(self, deliveries: list[Delivery]) -> None:
        """Give ``deliveries`` back to the dispatcher, with their permits: they were not sent (those of a
        consumer removed meanwhile went back already)."""
        by_consumer: dict[str, list[int]] = {}
        for delivery in deliveries:
            by_consumer.setdefault(delivery.consumer, []).append(delivery.position)
        for name, positions in by_consumer.items():
            session = self.sessions.get(name)
            if session is not None and self._in_dispatcher(session):
                self.dispatcher.unsent(name, positions)
                if name in self._draining:  # their permits are kept for when it is active again
                    session.held += self.dispatcher.withdraw_permits(name)
        self._settle_drains()

    # -- reading -----------------------------------------------------------------------

    def backlog(self) -> int:
        """Messages stored and not yet acknowledged by this subscription."""
        acked_above = sum(end - start + 1 for start, end in self.cursor.acked_ranges)
        return max(self._storage.last_position(self.topic) - self.cursor.mark_delete - acked_above, 0)

    def history(self) -> list[tuple[float, int, list[Range]]]:
        """The recent range maps, oldest first: ``(unix seconds, epoch, its ranges)`` (in slots of the whole
        space: a partition's tile its block only)."""
        return list(self._history)

    def describe(self) -> dict[str, Any]:
        """JSON-safe state for the admin endpoint: rebalance policy, dispatcher stats, cursor and backlog.

        ``max_ranges`` is the most ranges one consumer may own: 1 under the contiguous policy.
        """
        last = self._storage.last_position(self.topic)
        acked_above = sum(end - start + 1 for start, end in self.cursor.acked_ranges)
        policy = self.dispatcher.policy
        return {
            "topic": self.topic,
            "subscription": self.name,
            "policy": policy.name,
            "max_ranges": policy.range_limit,
            "consume_mode": self.dispatcher.consume_mode,
            "saved_consume_mode": self.saved_mode,
            "subscription_type": self.effective_type(),
            "active_consumer": self._active if self.sub_type == "failover" else None,
            **self.dispatcher.settings.own_view(),
            "own_settings": sorted(self.own_settings),
            "dead_lettered": self.dead_lettered,
            "dispatcher": self.dispatcher.stats(),
            "mark_delete": self.cursor.mark_delete,
            "acked_above_mark_delete": acked_above,
            "read_position": self._read_position,
            "last_position": last,
            "backlog": self.backlog(),
        }

    # -- cursor ----------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        """Save the cursor every ``cursor_flush_seconds``, or less often when saving it takes long.

        A cursor with many acked ranges (a consumer that never acks leaves a hole per message)
        takes long to save, on the worker thread that also commits produced messages: the
        flushes may use at most ``_FLUSH_SHARE`` of its time. A crash loses at most the acks
        since the last flush (they are redelivered: at least once).
        """
        wait = self._config.cursor_flush_seconds
        while not self._closed:
            await asyncio.sleep(wait)
            started = time.monotonic()
            try:
                await self.flush_cursor()
            except NotServedError:
                return  # another broker took the partition: the server closes this subscription
            except StoreUnavailableError as exc:  # the store fails over: saved at the next flush
                _log.warning("the cursor of %s/%s was not saved now: %s", self.topic, self.name, exc)
            took = time.monotonic() - started
            wait = max(self._config.cursor_flush_seconds, took * (1.0 - _FLUSH_SHARE) / _FLUSH_SHARE)

    async def flush_cursor(self) -> None:
        """Save the cursor if acks changed it since it was last saved."""
        if not self._cursor_dirty:
            return
        self._cursor_dirty = False
        snapshot = self.cursor.copy()
        try:
            await self._storage.save_cursors([(self.topic, self.name, snapshot)])
        except StoreUnavailableError:
            self._cursor_dirty = True  # not saved: the next flush saves it
            raise

    def stop(self, reason: str) -> None:
        """Stop delivering now, without waiting for anything: cancel the pump and the flusher, and tell every
        session (``consumer_closed`` with ``reason``). A server letting a partition go stops all of its
        subscriptions so before it saves their cursors, which may take long while the store fails over."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        for task in (self._task, self._flusher):
            if task is not None:
                task.cancel()
        for session in list(self.sessions.values()):
            session.send(ConsumerClosed(session=session.id, reason=reason, req=None))
        self.sessions.clear()
        self._cache.clear()  # payloads: a closed subscription is not read again (a seek opens a new one)

    async def close(self, reason: str = "shutdown") -> None:
        """:meth:`stop`, wait for the pump and the flusher to end, and persist the cursor."""
        self.stop(reason)
        for task in (self._task, self._flusher):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._cursor_dirty = True
        try:
            await self.flush_cursor()
        except NotServedError:
            pass  # fenced out: acks since the last flush are redelivered
        except StoreUnavailableError as exc:
            _log.warning("the cursor of %s/%s was not saved at close (%s): its acks since the last save are "
                         "redelivered", self.topic, self.name, exc)  # fmt: skip


def _send_in_frames(session: Session, items: list[Delivered], properties_bytes: int) -> None:
    """``items`` to ``session`` in frames of at most ``_SEND_BATCH`` deliveries and about ``_SEND_BYTES``
    (``properties_bytes``: the size of the items' encoded properties, all together)."""
    if (
        len(items) <= _SEND_BATCH
        and 32 * len(items) + sum(map(len, map(_payload, items))) + properties_bytes <= _SEND_BYTES
    ):
        session.send(Messages(session=session.id, messages=items))  # the usual case: one frame
        return
    batch: list[Delivered] = []
    size = 0
    for item in items:
        item_size = len(item[2]) + 32 + (0 if item[5] is None else len(item[5]))
        if batch and (len(batch) >= _SEND_BATCH or size + item_size > _SEND_BYTES):
            session.send(Messages(session=session.id, messages=batch))
            batch, size = [], 0
        batch.append(item)
        size += item_size
    session.send(Messages(session=session.id, messages=batch))


def _keyless_key(slots: tuple[int, int]) -> str:
    """The key an Exclusive or Failover subscription serving the hash ``slots`` gives keyless messages in its
    dispatcher (:meth:`Subscription._keyed`): the first of ``"\\0keyless 0"``, ``"\\0keyless 1"``, ... whose slot is
    one of them. A key of the log that happens to be it changes nothing but the order between the two."""
    first, last = slots
    index = 0
    while True:
        key = f"\0keyless {index}"
        if first <= key_hash(key) <= last:
            return key
        index += 1


def _deliver_at(properties: bytes | None, now: float) -> float:
    """The reading of the dispatcher's clock (``time.monotonic``, read as ``now``) before which a message with
    ``properties`` may not go out, when its delivery time is ahead; else 0."""
    at = delivery_time(properties)
    if not at:
        return 0.0
    reading = now + (at / 1000 - time.time())
    return reading if reading > now else 0.0


_position = operator.itemgetter(0)
_payload = operator.itemgetter(2)
_properties = operator.itemgetter(4)
