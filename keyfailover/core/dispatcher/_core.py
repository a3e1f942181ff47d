"""The Key_Failover dispatcher: a sans-IO state machine (events in, deliveries out).

Per key the dispatcher keeps a :class:`_KeyState`: the consumer holding the key's
unacknowledged deliveries (``holder``, at most one: G1), how many there are, and the
key's pending messages in position order. Every in-flight position of a key is below
every pending one, so the next valid delivery of a key is always the head of its
pending queue (G2).

A key with pending messages and nothing blocking it sits in its owner's ready heap,
ordered by head position, so replays go out before newer messages and a consumer
without permits is never scanned (G5). A key whose owner changed while it had
messages in flight on the old owner is *draining*: it is in no heap, and only the
old owner's last ack (or its removal) releases it to the new owner (G1, PIP-379).
Heap entries are invalidated lazily: an entry counts only while its key is still
queued on that consumer and its position is still the key's head.

A range change costs what moves, not what is held: the key states are also linked per slot,
and a change re-routes only the keys of the slots ``moved_slots`` names. It reads and sets
those keys' states only: a waiting key that goes to a new owner is *adopted* by it (listed,
``queued_on`` set at once), and its heap entry, which needs its head message, is made when
that owner is next served. So a change never reads the moved keys' queues, messages or
heaps, memory scattered over everything held. A held message
keeps its key as bytes shared with its key state (no str, no copy per message), and a key
has a pending queue only while something of it waits.

With an ``ack_timeout`` every delivery is a lease (G7). A consumer's in-flight dict is in
deadline order (a delivery or an extension puts a message last, with the latest
deadline), so its earliest deadline is its first entry; a heap holds at most one entry per
consumer, never later than that first deadline. ``poll`` takes back what expired (with
every later delivery of the same key on that consumer, G2), and the first expiry on a
consumer marks it *stuck*: its ranges go to the others as if it had left, and it rejoins
as a joiner at its next accepted ack, nack, extension or flow. With ``max_redeliveries``,
a message that failed more often than that is not delivered again: when it reaches the
head of its key it is handed to the IO layer as a :class:`DeadLetter` (the key goes on),
and it counts against ``max_replay`` until the IO layer confirms it stored it. A delivery
*fails* when it comes back as the oldest of its key's returned deliveries (the one nacked,
the first of the key whose lease expired, the first of the key on a removed consumer) or
keyless; the later ones of the key, returned only to keep the key's order, do not fail.

A join or a leave gives no slots to a consumer that is not making progress (``stalled`` in
:meth:`Dispatcher.stats`): one that is stuck, at its unacked limit, or that answered nothing
(no ack, nack or extension) for ``half_life`` seconds while it has no permits, or while it
has held deliveries for that long. Keys moved to it would only wait, as a stalled consumer
looks idle by its dispatch rate. In a join its in-flight messages count as traffic of their
slots, so the joiner takes from it; a joiner itself (it has not flowed permits yet) and a
stuck consumer rejoining are exempt in their own join. When every other member is stalled,
a leave goes as it did before, to whoever the policy picks. Progress is noted at the
samples the dispatcher takes anyway (a poll at most once a second, every change): acks
only count.

With ``spill`` (for an IO layer that keeps a log), a bounded buffer never stops reading for
everyone because of the keys some consumers cannot take: once half of ``max_replay`` is
held, a fresh message whose owner has no permits (or whose key is blocked) is not held; its
slot is *parked* from that position, and every later message of the slot too. A slot left with
no owner while consumers are present (a sticky subscription's undeclared slots, every consumer
stuck) has its waiting messages parked at the next poll, whatever is held. The dispatcher
then keeps one position per parked slot, not the messages. When an owner can take again,
:meth:`rereads` names the slots and where to re-read them from; the IO layer re-reads its log
and hands the messages back with :meth:`restore`, then :meth:`restored` says how far it got.

The consume mode is ``ordered`` (all of the above) or ``unordered`` (pop, as RocketMQ's
RIP-19): every waiting message, keyed or not, is in one queue in position order and goes to
the next consumer with permits, round robin, under a lease; ranges are kept up to date but
route nothing, and there is no per-key order. A keyed message delivered in unordered mode is
*loose*: it counts in its key's ``loose``, not in ``inflight``/``holder``. Back in ordered
mode a key with loose deliveries is blocked until every one of them is acked, nacked or
expired (then it restarts in position order); a returned loose message is put back in its
key's queue by position.

A message published with a ``deliver_at`` clock reading later than the poll that routes it is
*delayed* (Pulsar's ``deliver_at_time``, as Pulsar's Shared and Key_Shared dispatchers track it):
it waits alone in a heap by that reading, held and counted as any other, and does not block its
key: the key's later messages go out meanwhile. When its time comes it joins its key's queue at
its position (the shared queue when keyless or unordered) and goes out as a waiting message does,
to the consumer holding the key if the key is in flight there (G1 holds; a draining key makes it
wait), ahead of the key's later messages still waiting. So G2 holds for the other messages of its
key and not for it: it may go out after later messages of its key, and while they are in flight.
Once delivered it is an ordinary message (a nack returns it with the key's later deliveries).
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
import time
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple

import mmh3
import numpy as np
import numpy.typing as npt
from mypy_extensions import mypyc_attr
from sortedcontainers import SortedDict

from keyfailover.core.dispatcher._load import LoadMeter
from keyfailover.core.dispatcher._settings import (
    DEFAULT_ACK_TIMEOUT,
    DEFAULT_MAX_REPLAY,
    DEFAULT_NACK_BACKOFF_MAX,
    DeliverySettings,
    check_delivery_settings,
    check_int,
    check_number,
)
from keyfailover.core.errors import (
    BufferFullError,
    ConfigError,
    ConsumerError,
    DuplicateConsumerError,
    KeyFailoverError,
    LeaseExpiredError,
    NotInFlightError,
    PermitsError,
    PositionError,
    UnknownConsumerError,
    WrongPartitionError,
)
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_bytes
from keyfailover.core.histogram import Histogram
from keyfailover.core.ranges import Range, RangeMap
from keyfailover.core.rebalance import (
    DEFAULT_MAX_RANGES,
    MAX_STICKY_RANGES,
    SPLIT_MODES,
    UNASSIGNED,
    ContiguousPolicy,
    Load,
    MultiRangePolicy,
    Policy,
    SplitMode,
    StickyPolicy,
    check_policy_choice,
    moved_slots,
    reassign_rates,
)

__all__ = [
    "CONSUME_MODES",
    "DEFAULT_ACK_TIMEOUT",
    "DEFAULT_NACK_BACKOFF_MAX",
    "ConsumeMode",
    "DeadLetter",
    "Delivery",
    "Dispatcher",
    "RebalanceEvent",
    "check_consume_mode",
    "check_delivery_settings",
]


ConsumeMode = Literal["ordered", "unordered"]
CONSUME_MODES: tuple[ConsumeMode, ...] = ("ordered", "unordered")


def check_consume_mode(mode: object) -> ConsumeMode:
    """A consume mode: ``"ordered"`` (key ranges, per-key order) or ``"unordered"`` (pop: any consumer, no order)."""
    if isinstance(mode, str):
        if mode == "ordered":
            return "ordered"
        if mode == "unordered":
            return "unordered"
    raise ConfigError(f"consume mode must be one of {CONSUME_MODES}, not {mode!r}")


_KEYWORD_DEFAULTS = (DEFAULT_MAX_REPLAY, 0.0, None, 0, 0.0, DEFAULT_NACK_BACKOFF_MAX)
"""The defaults of the keyword arguments that build a dispatcher's :class:`DeliverySettings`, in the order
``max_replay``, ``ack_timeout``, ``max_redeliveries``, ``max_unacked_per_consumer``, ``nack_backoff``,
``nack_backoff_max``: any other value of them given with ``settings`` is refused."""

_MAX_DOUBLINGS = 60  # 2**60 times any backoff is past any max

Key = str | bytes | None

_SLOT_MASK = HASH_RANGE_SIZE - 1

_BACKLOG_MIN = 100
"""Waiting messages below which a consumer's backlog is not worth a range change."""

_EXPIRED_REMEMBERED = 10_000
"""Positions taken back from one consumer that are remembered, so that a late ack of one is
refused as late (:class:`LeaseExpiredError`) rather than as unknown; the oldest go first."""


class Delivery(NamedTuple):
    """One message handed to one consumer; ack or nack it by ``position``."""

    consumer: str
    position: int
    key: Key
    payload: Any
    redelivery_count: int


_delivery = functools.partial(tuple.__new__, Delivery)
"""``Delivery`` from a tuple of its fields, without the call of its generated ``__new__`` (the hot path)."""


class DeadLetter(NamedTuple):
    """A message whose deliveries failed more than ``max_redeliveries`` times: store it, then confirm it.

    ``redelivery_count`` is that of its last delivery (``max_redeliveries`` when every
    delivery failed); ``reason`` is why that delivery came back: ``"nack"``, ``"ack
    timeout"`` or ``"consumer removed"``.
    """

    position: int
    key: Key
    payload: Any
    redelivery_count: int
    reason: str


@dataclass(frozen=True)
class RebalanceEvent:
    """One change of the range map, kept for the metrics and the ownership plots."""

    epoch: int
    time: float
    reason: str
    consumer: str | None
    moved_slots: int
    stickiness: float
    """Fraction of recent traffic (or, with none, of the hash space) that kept its consumer."""
    draining_keys: int
    """Keys blocked right after the change because they were in flight on a former owner."""
    drain_seconds: float | None
    """Time from the change until the last of those keys was released; None while any is blocked."""


class _Change:
    __slots__ = ("drained_at", "event", "seq")

    def __init__(self, seq: int, event: RebalanceEvent) -> None:
        self.seq = seq
        self.event = event
        self.drained_at: float | None = None

    def public(self) -> RebalanceEvent:
        """The event as the public history shows it, with the seconds its moved keys took to drain: None while some
        still drain."""
        seconds = None if self.drained_at is None else max(self.drained_at - self.event.time, 0.0)
        return replace(self.event, drain_seconds=seconds)


class _Returns:
    """How often a message came back, and why: made at its first return, as most messages never come back."""

    __slots__ = ("count", "failures", "reason")

    def __init__(self) -> None:
        self.count = 0  # its redeliveries
        self.failures = 0  # returns as the oldest of its key (see the module docstring)
        self.reason = ""  # why its last delivery came back


_TEXT = 1
"""A message's flag: its key came as a str (it is kept as bytes)."""
_LOOSE = 2
"""A message's flag: in flight from a delivery made in unordered mode."""
_DELAYED = 4
"""A message's flag: it waited for its ``deliver_at``, so it may be below its key's deliveries in flight."""


class _Message:
    """One held message, in 7 slots (88 bytes with its GC header).

    Its key is kept as bytes only (the ``_TEXT`` flag says whether it came as a str, so a
    delivery hands back the same type), and once routed its ``kb`` and ``slot`` are its key
    state's own objects: a message costs its object and its position, not copies of its key.
    """

    __slots__ = ("back", "deadline", "flags", "kb", "payload", "position", "slot")

    def __init__(self, position: int, text: bool, kb: bytes | None, slot: int, payload: Any) -> None:
        self.position = position
        self.flags = _TEXT if text else 0  # _TEXT, _LOOSE while in flight from an unordered delivery, _DELAYED
        self.kb = kb
        self.slot = slot
        self.payload = payload
        self.back: _Returns | None = None  # None until it first comes back
        self.deadline = 0.0  # of its lease while in flight (with an ack_timeout)

    def returns(self) -> _Returns:
        """Its return record, made on first use."""
        back = self.back
        if back is None:
            back = self.back = _Returns()
        return back

    def failures(self) -> int:
        """Its failed deliveries so far."""
        back = self.back
        return 0 if back is None else back.failures


class _Consumer:
    __slots__ = (
        "acked",
        "adopted",
        "answered",
        "answered_at",
        "answers_seen",
        "cid",
        "delivered",
        "expired",
        "expired_count",
        "holding_since",
        "inflight",
        "lease_due",
        "permits",
        "ready",
        "redelivered",
        "stuck",
        "unacked_blocked",
        "withheld",
    )

    def __init__(self, cid: str) -> None:
        self.cid = cid
        self.permits = 0
        self.inflight: dict[int, _Message] = {}  # in delivery (so deadline) order
        self.ready: list[tuple[int, bytes]] = []  # heap of (head position, key bytes)
        # Keys queued on it by a range change whose ready entries are not made yet (see _adopt).
        self.adopted: list[_KeyState] = []
        self.delivered = 0
        self.acked = 0
        self.answered = 0  # accepted nacks and extensions: answers, as acks are
        # Progress as the samples see it (see Dispatcher._progressing): acked + answered at the last
        # sample, the sample that saw it change last, and the first that saw it holding what it holds.
        self.answers_seen = 0
        self.answered_at = -math.inf
        self.holding_since: float | None = None  # None: it held nothing at the last sample
        self.redelivered = 0
        self.stuck = False  # a lease expired: it owns no range until it shows progress
        self.lease_due = False  # it has an entry in the dispatcher's lease heap
        self.expired: OrderedDict[int, float] = OrderedDict()  # taken-back position -> when
        self.expired_count = 0
        self.unacked_blocked = False  # at max_unacked_per_consumer: its permits are withheld
        self.withheld = 0


def _check_position(position: object, last: int | None) -> None:
    """A position to publish: an int after ``last``, the last published one (None before the first)."""
    if type(position) is not int:
        raise PositionError(f"position must be an int, not {type(position).__name__}")
    if last is not None and position <= last:
        raise PositionError(f"position {position} is not after the last published position {last}")


def _check_deliver_at(deliver_at: object) -> None:
    """A message's ``deliver_at``: a finite clock reading, 0 for none."""
    if type(deliver_at) not in (int, float) or not math.isfinite(deliver_at):  # type: ignore[arg-type]
        raise PositionError(
            f"deliver_at must be a finite int or float clock reading (0: at once), not {deliver_at!r:.80}"
        )


def _make_message(position: int, key: object, payload: Any, first: int = 0, size: int = HASH_RANGE_SIZE) -> _Message:
    """A message with its key's bytes and slot, counted from ``first`` (raises :class:`InvalidKeyError`
    for a key of any other type than str, bytes or None, :class:`WrongPartitionError` for a key whose
    slot is not in ``[first, first + size)``)."""
    if key is None:
        return _Message(position, False, None, -1, payload)
    text = isinstance(key, str)
    if type(key) is str:
        try:
            kb = key.encode()
        except UnicodeEncodeError:
            kb = key_bytes(key)  # raises the descriptive InvalidKeyError
    else:
        kb = key if type(key) is bytes else key_bytes(key)
    slot = (mmh3.hash(kb, 0, False) & _SLOT_MASK) - first
    if not 0 <= slot < size:
        raise _wrong_partition(key, slot + first, first, size)
    return _Message(position, text, kb, slot, payload)


def _key_of(message: _Message) -> Key:
    """The key ``message`` was published with (a str decoded again from its bytes)."""
    kb = message.kb
    return kb.decode() if message.flags & _TEXT and kb is not None else kb


def _wrong_partition(key: object, slot: int, first: int, size: int) -> WrongPartitionError:
    """The error for ``key``, whose ``slot`` is outside this dispatcher's block of ``size`` slots from ``first``."""
    return WrongPartitionError(
        f"key {key!r} hashes to slot {slot}, outside this dispatcher's slots [{first}, {first + size - 1}]; "
        "expected a key of its partition"
    )


def _put_back(queue: deque[_Message], returned: list[_Message]) -> None:
    """Put ``returned`` (sorted by position) into ``queue`` (sorted by position) where each belongs.

    O(k) for the k queued messages below the last returned one: ahead of everything, the usual
    case, costs one ``extendleft``.
    """
    if not returned:
        return
    top = returned[-1].position
    if not queue or top < queue[0].position:
        queue.extendleft(reversed(returned))
        return
    below = []
    while queue and queue[0].position < top:
        below.append(queue.popleft())
    queue.extendleft(reversed(list(heapq.merge(below, returned, key=_position_of))))


def _position_of(message: _Message) -> int:
    """The sort key of held messages: their position."""
    return message.position


_NO_PENDING: deque[_Message] = deque(maxlen=0)
"""The pending queue of every key with none of its own: read it, never add to it (see ``_KeyState.queue``)."""


class _KeyState:
    """One key's holder, in-flight count and pending queue; also a link in its slot's list (``prev``/``next``).

    The dispatcher keeps, per slot, a doubly linked list of the states of that slot's keys
    (see :meth:`Dispatcher._add_key`), so a range change visits the keys of the moved slots
    only: O(1) to link and unlink, 16 bytes per key, and no container per slot.
    """

    __slots__ = (
        "backoff",
        "drain_seq",
        "draining",
        "holder",
        "inflight",
        "kb",
        "loose",
        "next",
        "pending",
        "prev",
        "queued_on",
        "slot",
    )

    def __init__(
        self, kb: bytes, slot: int, holder: _Consumer | None, inflight: int, heads: list[_KeyState | None]
    ) -> None:
        """A key's state, linked first into its slot's list (``heads[slot]``, the dispatcher's slot heads)."""
        self.kb = kb
        self.slot = slot
        self.holder = holder
        self.inflight = inflight
        self.pending = _NO_PENDING  # replaced by a deque of its own by queue()
        self.queued_on: _Consumer | None = None
        self.draining = False
        self.drain_seq = 0  # the change that started the current draining
        self.loose = 0  # deliveries in flight made in unordered mode (on any consumers): the key is blocked
        self.backoff = 0.0  # the clock reading at which a nack's backoff ends (0: none): the key is blocked
        self.prev: _KeyState | None = None  # the neighbours in its slot's list
        head = self.next = heads[slot]
        if head is not None:
            head.prev = self
        heads[slot] = self

    def queue(self) -> deque[_Message]:
        """The pending queue, to add to: made on first use, as most keys never wait (an empty deque is 760 bytes)."""
        pending = self.pending
        if pending is _NO_PENDING:
            pending = self.pending = deque()
        return pending


@mypyc_attr(allow_interpreted_subclasses=True)  # the compiled build's checked front subclasses it
class Dispatcher:
    """Key_Failover dispatcher core: ordered per-key delivery to elastic consumers.

    Parameters:
        clock: seconds, monotonic; read at add/remove/poll/stats only.
        max_replay: bound on messages held unacknowledged (pending plus in flight);
            ``wants()`` is 0 at the bound (G4).
        split: for the contiguous policy, ``"traffic"`` (cut where recent traffic halves)
            or ``"midpoint"``.
        policy: ``"multi"`` (several ranges per consumer, the default: see
            :class:`~keyfailover.core.rebalance.MultiRangePolicy`), ``"contiguous"`` (one
            range each, PIP-34 literally) or ``"sticky"`` (each consumer owns the ranges it
            declares to :meth:`add_consumer`: Pulsar's Key_Shared STICKY; see :meth:`set_policy`).
        max_ranges: for the multi-range policy, the most ranges one consumer may own.
        half_life: seconds over which measured rates and traffic lose half their weight; also
            how long a consumer without permits, or holding deliveries, may go without an
            answer (ack, nack, extension) before a join or a leave counts it stalled and gives
            it no slots.
        shift_threshold: traffic max/mean above which a boundary shift is considered;
            None disables shifting.
        shift_interval: minimum seconds between two shifts (and between shift checks).
        shift_min_traffic: recent traffic below which no shift is made (too little signal).
        history: how many :class:`RebalanceEvent` records to keep.
        ack_timeout: seconds a consumer has to ack a delivery before it is taken back and
            the consumer loses its ranges until it shows progress (G7); 0 disables leases.
        max_redeliveries: failed deliveries after the first that a message may have; one
            that fails once more is handed out by :meth:`dead_letters` instead of being
            delivered again. None (the default) redelivers for ever.
        max_unacked_per_consumer: a consumer holding this many unacked deliveries gets no
            more until it is down to half of them (Pulsar's maxUnackedMessagesPerConsumer);
            0 (the default) is no limit.
        consume_mode: ``"ordered"`` (the default) or ``"unordered"``; see :meth:`set_consume_mode`.
        backlog_interval: seconds between backlog checks: a consumer whose waiting messages
            grew since the last check (to at least 100, or a tenth of ``max_replay`` if less)
            while another has idle permits sheds
            range to the others, as a shift would with its backlog counted as traffic; None
            disables (so does ``shift_threshold=None``).
        spill: park the slots of keys that cannot go out once half of ``max_replay`` is held,
            for the IO layer to re-read from its log (see :meth:`rereads`); off by default, as
            an IO layer without a log would lose what is parked.
        nack_backoff: seconds a nacked message waits before it is delivered again, doubling
            with each failure of it (its first nack waits ``nack_backoff``, its second twice
            that, ...) up to ``nack_backoff_max``. In ordered mode the whole key waits (its
            later messages stay behind it, G2) and no other key does (G5); a keyless message,
            or any message in unordered mode, waits alone. Only nacks back off: an expired
            lease or a removed consumer returns its messages at once. 0 (the default) is off.
        nack_backoff_max: the longest backoff, in seconds (default 60).
        settings: the delivery settings as one :class:`DeliverySettings`, instead of the keyword
            arguments ``max_replay``, ``ack_timeout``, ``max_redeliveries``,
            ``max_unacked_per_consumer``, ``nack_backoff`` and ``nack_backoff_max``, which build
            one; giving both is a :class:`ConfigError`.
        slots: ``(first, last)``, the inclusive block of hash slots this dispatcher serves (a
            partition's, see :mod:`keyfailover.core.partitions`); its ranges tile that block.
            Every slot argument and result (:meth:`ranges`, :meth:`owner_of`, :meth:`rereads`)
            is a slot of the whole space; :meth:`snapshot`, :meth:`range_map` and
            :meth:`traffic` are the block's own, counted from ``first``. Default: all 65536.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        max_replay: int = DEFAULT_MAX_REPLAY,
        split: SplitMode = "traffic",
        *,
        half_life: float = 10.0,
        shift_threshold: float | None = 1.1,
        shift_interval: float = 30.0,
        shift_min_traffic: float = 1000.0,
        history: int = 1000,
        policy: str = "multi",
        max_ranges: int = DEFAULT_MAX_RANGES,
        ack_timeout: float = 0.0,
        max_redeliveries: int | None = None,
        consume_mode: ConsumeMode = "ordered",
        max_unacked_per_consumer: int = 0,
        spill: bool = False,
        backlog_interval: float | None = 5.0,
        nack_backoff: float = 0.0,
        nack_backoff_max: float = DEFAULT_NACK_BACKOFF_MAX,
        slots: tuple[int, int] = (0, HASH_RANGE_SIZE - 1),
        settings: DeliverySettings | None = None,
    ) -> None:
        if not callable(clock):
            raise ConfigError(f"clock must be a callable returning seconds, not {clock!r}")
        if not isinstance(split, str) or split not in SPLIT_MODES:
            raise ConfigError(f"split must be one of {SPLIT_MODES}, not {split!r}")
        check_number("half_life", half_life, 0.0, inclusive=False)
        if shift_threshold is not None:
            check_number("shift_threshold", shift_threshold, 1.0, extra=" or None")
        check_number("shift_interval", shift_interval, 0.0)
        check_number("shift_min_traffic", shift_min_traffic, 0.0)
        check_int("history", history, 0)
        check_policy_choice(policy, max_ranges, sticky=True)
        given = (max_replay, ack_timeout, max_redeliveries, max_unacked_per_consumer, nack_backoff, nack_backoff_max)
        if settings is None:
            settings = DeliverySettings(
                ack_timeout=ack_timeout,
                max_redeliveries=max_redeliveries,
                max_replay=max_replay,
                max_unacked_per_consumer=max_unacked_per_consumer,
                nack_backoff=nack_backoff,
                nack_backoff_max=nack_backoff_max,
            )
        elif not isinstance(settings, DeliverySettings):
            raise ConfigError(f"settings must be a DeliverySettings or None, not {settings!r}")
        elif given != _KEYWORD_DEFAULTS:
            raise ConfigError(
                "the delivery settings were given twice, as settings and as keyword arguments; expected one of them"
            )
        check_consume_mode(consume_mode)
        if type(spill) is not bool:
            raise ConfigError(f"spill must be a bool, not {spill!r}")
        if backlog_interval is not None:
            check_number("backlog_interval", backlog_interval, 0.0, inclusive=False, extra=" or None")
        if (
            type(slots) is not tuple
            or len(slots) != 2
            or not all(type(bound) is int for bound in slots)
            or not 0 <= slots[0] <= slots[1] < HASH_RANGE_SIZE
        ):
            raise ConfigError(
                f"slots must be a (first, last) tuple of ints with 0 <= first <= last <= 65535, not {slots!r}"
            )
        now = clock()
        if type(now) not in (int, float) or not math.isfinite(now):
            raise ConfigError(f"clock() must return a finite number of seconds, returned {now!r}")
        self._clock = clock
        self._settings = settings
        max_replay = settings.max_replay
        self._max_replay = max_replay
        self._held_bound = max_replay  # what held may be: max_replay, or more when it was lowered under held
        self._split = split
        self._max_ranges = max_ranges
        self._shift_min_traffic = shift_min_traffic
        # The ranges each consumer of a sticky subscription declared, in slots of the whole space.
        self._declared: dict[str, list[tuple[int, int]]] = {}
        self._declared_index = SortedDict()  # every declared range's first slot -> (last slot, consumer)
        self._declared_here: dict[str, list[tuple[int, int]]] = {}  # the same, of the block, counted from first
        self._shift_threshold = shift_threshold
        self._shift_interval = shift_interval
        self._first = slots[0]
        self._size = slots[1] - slots[0] + 1
        self._policy = self._make_policy(policy)
        self._meter = LoadMeter(self._size, half_life)
        self._half_life = float(half_life)  # also the window of progress a consumer must show (see _progressing)

        self._map = RangeMap(self._size)
        self._ends: list[int] = []
        self._owners: list[_Consumer | None] = []  # None: unassigned (a sticky subscription's undeclared slots)
        self._consumers: dict[str, _Consumer] = {}
        self._round_robin: list[_Consumer] = []  # join order, for keyless messages
        self._standby: list[str] = []
        self._keys: dict[bytes, _KeyState] = {}
        # Per slot, the first state of its keys' linked list (None: no key of the slot is held),
        # so a range change walks the moved slots' keys only, not every held key.
        self._slot_keys: list[_KeyState | None] = [None] * self._size
        self._fresh: deque[_Message] = deque()  # published, not yet routed
        self._keyless: deque[_Message] = deque()  # keyless messages waiting for permits
        self._wake: dict[_Consumer, None] = {}  # consumers whose ready heap may be servable
        self._rr = 0
        self._held = 0
        self._last_position: int | None = None
        self._last_sample = now
        self._last_shift = now
        self._rebalances: Counter[str] = Counter()
        self._history: deque[_Change] = deque(maxlen=history)
        self._changes = 0
        # Draining keys by the change that blocked them, and the changes still waiting for
        # any key blocked at or before them: change j is drained once no key blocked by a
        # change <= j is still draining.
        self._draining_since: dict[int, int] = {}
        self._undrained: deque[_Change] = deque()  # not bounded by history: each change is observed once
        self._drain_seconds = Histogram()
        self._ack_timeout = float(settings.ack_timeout)
        self._max_redeliveries = settings.max_redeliveries
        self._deadline = now + self._ack_timeout  # of a delivery made now (set at every poll)
        # (no earlier than the consumer's first deadline, seq, consumer): one entry per consumer with leases
        self._leases: list[tuple[float, int, _Consumer]] = []
        self._lease_seq = 0
        self._expired_total = 0
        self._dead_out: list[DeadLetter] = []  # decided, not yet handed out
        self._dead_unconfirmed: dict[int, DeadLetter] = {}  # handed out, not yet confirmed stored
        self._dead_total = 0
        # Unordered mode: every waiting message is in ``_keyless`` (keyed ones too), in position order.
        self._unordered = consume_mode == "unordered"
        self._unacked_limit = settings.max_unacked_per_consumer
        self._unacked_resume = settings.max_unacked_per_consumer // 2
        self._spill = spill
        self._park_at = max(max_replay // 2, 1)
        self._parked: dict[int, int] = {}  # slot -> the first position of it not held (re-read from the log)
        self._parked_total = 0  # messages not held because their slot was parked
        self._unowned: set[int] = set()  # slots whose waiting keys lost their owner since the last poll: to spill
        self._spilled_returns: dict[int, _Returns] = {}  # spilled messages that had come back: restored with them
        self._reread_due = False  # something changed that may let a parked slot go out
        self._backlog_interval = None if shift_threshold is None else backlog_interval
        self._last_backlog = now
        self._backlog_seen: dict[str, int] = {}  # waiting messages per consumer at the last check
        self._backlog_acked: dict[str, int] = {}  # acks per consumer at the last check
        self._backlog_min = min(_BACKLOG_MIN, max(max_replay // 10, 1))
        self._backoff = float(settings.nack_backoff)
        self._backoff_max = float(settings.nack_backoff_max)
        self._key_backoffs: list[tuple[float, bytes]] = []  # (end, key): stale once the key's backoff differs
        self._delayed: list[tuple[float, int, _Message]] = []  # (end, position, message): shared-queue messages
        self._due_at: dict[int, float] = {}  # fresh (unrouted) messages published with a deliver_at: position -> it
        self._timed: list[tuple[float, int, _Message]] = []  # (deliver_at, position, message): delayed messages
        self._timed_slots: Counter[int] = Counter()  # delayed keyed messages per slot: such a slot is never spilled
        self._honours_delays = True
        # Routed while delivery times were not honoured, before their time: position -> deliver_at (see honour_delays)
        self._waived: dict[int, float] = {}

    # -- consumers -------------------------------------------------------------------

    def add_consumer(self, cid: str, ranges: Sequence[tuple[int, int]] | None = None) -> None:
        """Add a consumer; it takes its share of the hash space from the busiest consumers (G1 applies).

        No other consumer gains slots unless it is making progress (see the module docstring); the
        joiner always may, as it cannot have flowed permits yet.

        Under the sticky policy it declares ``ranges`` instead: inclusive ``(first, last)`` hash
        slots of the whole space (not only of :attr:`slots`), disjoint from each other and from
        every other consumer's; it owns their part of :attr:`slots` and nothing else, and keys
        there move to it from nobody (a sticky subscription's undeclared slots have no owner and
        their messages wait). Ranges under another policy, none under sticky, or an overlap are
        refused (:class:`ConsumerError`, naming the consumer whose range it overlaps) and change
        nothing.
        """
        if not isinstance(cid, str) or not cid:
            raise ConsumerError(f"consumer id must be a non-empty str, not {cid!r}")
        if cid == UNASSIGNED:
            raise ConsumerError(f"consumer id {cid!r} is reserved for the slots no sticky consumer declared")
        if cid in self._consumers:
            raise DuplicateConsumerError(f"consumer {cid!r} is already present; expected a new id")
        declared = self._check_declared(cid, ranges)
        now = self._sample()
        if declared is not None:
            self._declare(cid, declared)
        planned = self._policy.join(self._map, cid, self._change_load(now, cid, leave=False))
        consumer = _Consumer(cid)
        consumer.answered_at = now  # a newcomer is judged on what it does from its join on, not stalled at once
        self._consumers[cid] = consumer
        self._round_robin.append(consumer)
        self._meter.track(cid, 0)
        if cid not in planned:
            self._standby.append(cid)
        self._apply(planned, now, "join", cid, [])

    def remove_consumer(self, cid: str, *, reason: str = "leave") -> None:
        """Remove a consumer; its unacked messages go back to pending, first in line (G3).

        Its slots go to the consumers (or the first standby) making progress; to the others only
        when none is, or when the policy's shape leaves no other choice (see the policies).

        ``reason`` labels the resulting range change: ``"leave"`` or ``"timeout"`` (a session
        the service declared dead).
        """
        consumer = self._consumer(cid)
        if reason not in ("leave", "timeout"):
            raise KeyFailoverError(f"removal reason must be 'leave' or 'timeout', not {reason!r}")
        now = self._sample()
        for start, _ in self._declared.pop(cid, ()):
            del self._declared_index[start]
        self._declared_here.pop(cid, None)  # before the plan: a sticky leave keeps the slots of who remains
        planned = self._leave_plan(cid, now)
        returned = self._return_inflight(consumer, list(consumer.inflight.values()), "consumer removed")
        del self._consumers[cid]
        self._round_robin.remove(consumer)
        self._rr = 0
        self._wake.pop(consumer, None)
        self._apply(planned, now, reason, cid, returned)
        self._meter.forget(cid)

    def flow(self, cid: str, permits: int) -> None:
        """Give ``cid`` ``permits`` more deliveries (0 is allowed); a stuck consumer rejoins (progress)."""
        consumer = self._consumer(cid)
        if type(permits) is not int or permits < 0:
            raise PermitsError(f"permits must be a non-negative int, not {permits!r}")
        self._give_permits(consumer, permits)
        if consumer.stuck:
            self._recover(consumer)

    def permits(self, cid: str) -> int:
        """The deliveries ``cid`` may still take: its permits, those withheld at its unacked limit included."""
        consumer = self._consumer(cid)
        return consumer.permits + consumer.withheld

    def withdraw_permits(self, cid: str) -> int:
        """Take away every delivery ``cid`` may still take, those withheld at its unacked limit included, and
        return how many: it gets nothing more until a :meth:`flow`, and keeps what it holds (a Failover consumer
        that stood down drains so, holding its keys until it acks them: G1)."""
        consumer = self._consumer(cid)
        taken = consumer.permits + consumer.withheld
        consumer.permits = consumer.withheld = 0
        self._wake.pop(consumer, None)
        return taken

    def inflight_count(self, cid: str) -> int:
        """How many deliveries are in flight on ``cid``: made and not acked, nacked, taken back or unsent."""
        return len(self._consumer(cid).inflight)

    def _give_permits(self, consumer: _Consumer, permits: int) -> None:
        """``permits`` more deliveries for ``consumer``: withheld while it is at its unacked limit; it is woken
        when keys wait on it."""
        self._reread_due = True
        if consumer.unacked_blocked:
            consumer.withheld += permits
        elif permits:
            consumer.permits += permits
            if consumer.ready or consumer.adopted:
                self._wake[consumer] = None

    # -- messages --------------------------------------------------------------------

    def wants(self) -> int:
        """How many more messages ``publish`` accepts now; 0 means stop reading (G4)."""
        return max(self._max_replay - self._held, 0)

    def hungry(self) -> bool:
        """Whether a consumer that may take messages (not stuck) has permits left: after :meth:`poll`, its
        permits are more than anything waiting could use, so reading on may find it some.

        False means every consumer has all it asked for: what a reader hands in now only waits in
        memory. A server reads on only while this holds (and :meth:`wants` allows).
        """
        return any(consumer.permits and not consumer.stuck for consumer in self._consumers.values())

    def publish(self, position: int, key: Key, payload: Any = None, *, deliver_at: float = 0.0) -> None:
        """Hand in the message at ``position``; positions strictly increase.

        ``deliver_at``: a clock reading before which it is not delivered. Later than the poll that
        routes it, the message is delayed, and it does not block its key meanwhile (see the module
        docstring); 0, or a reading already past, delivers it as any other.
        """
        _check_position(position, self._last_position)
        _check_deliver_at(deliver_at)
        self._check_room()
        message = _make_message(position, key, payload, self._first, self._size)
        if message.kb is not None:
            self._meter.slot_log.append(message.slot)
        self._last_position = position
        self._held += 1
        self._fresh.append(message)
        if deliver_at:
            self._due_at[position] = deliver_at

    def publish_many(self, messages: Iterable[Sequence[Any]]) -> int:
        """Hand in several messages, as :meth:`publish` does each with no payload; returns how many.

        Each item starts with its position and key: a ``(position, key)`` pair, or a longer
        tuple such as a stored message. All or none: a bad item (or more than :meth:`wants`
        allows) raises, and nothing is published.
        """
        last = self._last_position
        first, size = self._first, self._size
        made: list[_Message] = []
        slots = array("H")
        hash32 = mmh3.hash
        for item in messages:
            position, key = item[0], item[1]
            if type(position) is not int or (last is not None and position <= last):
                _check_position(position, last)  # raises
            if type(key) is str:  # the usual key, made here as _make_message does, without its call
                try:
                    kb = key.encode()
                except UnicodeEncodeError:
                    kb = key_bytes(key)  # raises the descriptive InvalidKeyError
                slot = (hash32(kb, 0, False) & _SLOT_MASK) - first
                if not 0 <= slot < size:
                    raise _wrong_partition(key, slot + first, first, size)
                message = _Message(position, True, kb, slot, None)
                slots.append(slot)
            else:
                message = _make_message(position, key, None, first, size)
                if message.kb is not None:
                    slots.append(message.slot)
            made.append(message)
            last = position
        if self._held + len(made) > self._max_replay:
            raise BufferFullError(
                f"{len(made)} messages would take the dispatcher to {self._held + len(made)} unacked, over its "
                f"max_replay bound of {self._max_replay}; expected at most wants() = {self.wants()} of them"
            )
        self._meter.slot_log.extend(slots)
        self._last_position = last
        self._held += len(made)
        self._fresh.extend(made)
        return len(made)

    def _check_room(self) -> None:
        """Refuse a publish or restore while the dispatcher holds ``max_replay`` messages: G4's bound on what it
        holds."""
        if self._held >= self._max_replay:
            raise BufferFullError(
                f"the dispatcher holds {self._held} unacked messages, its max_replay bound; "
                "expected publish and restore only while wants() > 0"
            )

    # -- spilling to the log -----------------------------------------------------------

    def rereads(self) -> dict[int, int]:
        """Parked slots whose messages may go out now: ``{slot: first position to re-read}``.

        Call it after :meth:`poll`; re-read the log from each position on (up to the last
        published one), :meth:`restore` each message of those slots in position order, but those
        acknowledged or stored as dead letters already, while :meth:`wants` allows, then call
        :meth:`restored`. Empty unless something changed since
        the last call that lets a parked slot's owner take messages.
        """
        # Re-read while there is room, whatever is held: a consumer at its unacked limit may hold half the
        # buffer (the server's default bounds) for as long as it does not ack, and the others go on (G5).
        if not self._parked or not self._reread_due or self._fresh or self._held >= self._max_replay:
            return {}
        self._reread_due = False
        offset = self._first
        if self._unordered:
            return {slot + offset: first for slot, first in self._parked.items()}
        owner_of = self._owner_of_slot
        return {
            slot + offset: first
            for slot, first in self._parked.items()
            if (owner := owner_of(slot)) is not None and owner.permits
        }

    def restore(self, position: int, key: Key, payload: Any = None, *, deliver_at: float = 0.0) -> None:
        """Hand back a parked message re-read from the log (its slot parked at or before ``position``).

        Restored messages of a slot come in position order and count against ``max_replay``
        as published ones do. ``deliver_at`` is the message's own, as given to :meth:`publish`:
        a delayed message waits for it again, if it is still ahead, and goes out from the next poll.
        """
        if self._fresh:
            raise PositionError("restore only right after poll(): published messages are waiting to be routed")
        _check_deliver_at(deliver_at)
        message = _make_message(position, key, payload, self._first, self._size) if type(position) is int else None
        if message is None or message.kb is None:
            raise PositionError(f"restore takes a keyed message at an int position, not {position!r}, {key!r}")
        first = self._parked.get(message.slot)
        last = self._last_position
        if first is None or position < first or last is None or position > last:
            raise PositionError(
                f"position {position} (slot {message.slot + self._first}) is not parked: expected a position from "
                f"{first} to {last} of a slot rereads() named"
            )
        self._check_room()
        self._held += 1
        self._parked[message.slot] = position + 1
        if self._spilled_returns:
            message.back = self._spilled_returns.pop(position, None)  # its redeliveries and failures
        if deliver_at and self._honours_delays:
            self._hold_until(message, deliver_at)  # released at the next poll, in position order, if due by then
            return
        if deliver_at and deliver_at > self._clock():
            self._waive(position, deliver_at)
        if self._unordered:
            self._keyless.append(message)
            return
        state = self._keys.get(message.kb)
        if state is None:
            state = self._add_key(message.kb, message.slot, None, 0)
        else:
            message.kb, message.slot = state.kb, state.slot
        pending = state.queue()
        pending.append(message)
        if len(pending) == 1:
            self._reroute(state)

    def restored(self, slots: Iterable[int], through: int) -> None:
        """Every message of ``slots`` up to ``through`` was re-read; a slot re-read to the end is unparked."""
        last = self._last_position
        if type(through) is not int or last is None or through > last:
            raise PositionError(f"through must be an int position up to the last published {last}, not {through!r}")
        parked = self._parked
        offset = self._first
        for named in slots:  # slots of the whole space, as rereads() named them
            local = named - offset if type(named) is int else -1
            first = parked.get(local)
            if first is None:
                continue
            if through >= last:
                del parked[local]
            elif through >= first:
                parked[local] = through + 1
        self._reread_due = True  # the budget may have run out: ask again after the next poll

    def _stalled(self, state: _KeyState | None, slot: int) -> bool:
        """Whether a fresh message of ``slot`` (its key's ``state``) would wait for a while: park it."""
        owner = self._owner_of_slot(slot)
        if owner is None:
            # No owner while consumers are present (a sticky subscription's undeclared slot, or every
            # consumer stuck): park, so others go on (G5). Without consumers nobody could go on anyway.
            return bool(self._consumers)
        return not owner.permits or (state is not None and bool(state.draining or state.loose or state.backoff))

    def _park(self, message: _Message) -> None:
        """Let ``message`` go: its slot is parked, and the message is read again from the log when the slot is re-
        read."""
        self._held -= 1
        self._parked.setdefault(message.slot, message.position)
        self._parked_total += 1
        if self._due_at:
            self._due_at.pop(message.position, None)  # re-read with its deliver_at from the log

    def _spill_unowned(self) -> None:
        """Park the waiting messages of slots left with no owner while consumers are present (a sticky
        subscription's undeclared slots, every consumer stuck): they leave the buffer for the log, so
        that the owned keys go on (G4, G5), and come back through :meth:`rereads` once a consumer owns
        them, with their redelivery counts. A slot with a key in flight, loose or backing off, with a
        delayed message, or with a dead letter not yet confirmed, stays held: re-reading it could bring
        one of those back twice. Its key is queued again, and the slot looked at again, when that ends."""
        slots = sorted(self._unowned)
        self._unowned.clear()
        if self._unordered or not self._consumers:
            return  # nothing goes by owner, or nobody could go on: nothing is parked (as for fresh messages)
        letters = [*self._dead_out, *self._dead_unconfirmed.values()]
        dead = {_make_message(0, letter.key, None, self._first, self._size).slot for letter in letters}
        returns = self._spilled_returns
        timed = self._timed_slots
        for slot in slots:
            if slot in dead or timed[slot] or self._owner_of_slot(slot) is not None:
                continue  # (a delayed message of the slot is held: a re-read would bring it back twice)
            states = self._keys_in(slot, slot)
            if any(state.inflight or state.loose or state.backoff for state in states):
                continue
            first: int | None = None
            for state in states:
                pending = state.pending
                if not pending:
                    continue
                for message in pending:
                    if message.back is not None:
                        returns[message.position] = message.back
                head = pending[0].position
                first = head if first is None else min(first, head)
                self._held -= len(pending)
                self._parked_total += len(pending)
                state.pending = _NO_PENDING
                state.queued_on = None
                self._drop_key(state)
            if first is not None:
                parked = self._parked.get(slot)
                self._parked[slot] = first if parked is None else min(parked, first)

    def poll(self) -> list[Delivery]:
        """Route everything that can go out now and return the deliveries.

        The list comes in three parts, each for consumers with permits only:

        1. keys waiting on a consumer (replays, returned and held-back messages, keys whose
           drain just ended), consumer by consumer in the order they became servable, each
           consumer's keys by ascending head position;
        2. keyless messages that were waiting (nacked or returned ones first, in position
           order, then those that found no permits), round robin over the consumers in join
           order, starting after the consumer served last;
        3. messages published since the last poll, in publish order: a keyed one goes to
           its owner when the owner has permits and no waiting keys (otherwise it waits,
           see 1), a keyless one round robin as in 2.

        So the list is not sorted by position overall, nor per consumer; per key it always is
        (G2), and a key's messages never pass each other, but a delayed one (see the module
        docstring). In unordered mode every waiting message, keyed or not, goes as keyless ones
        do (2 and 3), with no order at all. A delayed message whose time came by this poll
        waits as a returned one does (1, 2).
        """
        now = self._clock()
        if self._leases and self._leases[0][0] <= now:
            self._expire(now)
        if (self._key_backoffs and self._key_backoffs[0][0] <= now) or (self._delayed and self._delayed[0][0] <= now):
            self._end_backoffs(now)
        if self._timed and self._timed[0][0] <= now:
            self._release_timed(now)
        self._deadline = now + self._ack_timeout
        interval = self._backlog_interval
        if interval is not None and now - self._last_backlog >= interval and not self._unordered:
            self._check_backlog(now)
        if self._shift_threshold is not None and now - self._last_shift >= self._shift_interval:
            self._maybe_shift(now)
        elif now - self._last_sample >= 1.0 or self._meter.needs_fold():
            self._sample(now)
        out: list[Delivery] = []
        if self._unordered:
            if self._fresh or self._keyless:
                self._serve_unordered(out, now)
            return out
        if self._wake:
            self._serve_ready(out)
        if self._keyless:
            self._serve_keyless(out)
        if self._fresh:
            self._route_fresh(out, now)
        if self._unowned:
            self._spill_unowned()
        return out

    def ack(self, cid: str, position: int) -> None:
        """Acknowledge ``position``, in flight on ``cid``; a drained key moves on (G1).

        Refused (:class:`LeaseExpiredError`) when the delivery was taken back at its deadline.
        """
        consumer = self._consumer(cid)
        if not self._ack(consumer, position):
            raise self._refusal(consumer, position, "ack")
        if consumer.stuck:
            self._recover(consumer)

    def ack_many(self, cid: str, positions: Iterable[int]) -> tuple[list[int], list[int]]:
        """Acknowledge each of ``positions`` as :meth:`ack` does; returns ``(acked, rejected)``.

        A rejected position (not in flight on ``cid``, a repeat or a late one included)
        changes nothing; the others are acknowledged all the same.
        """
        consumer = self._consumer(cid)
        inflight = consumer.inflight
        keys = self._keys
        acked: list[int] = []
        rejected: list[int] = []
        unordered = self._unordered
        quick = 0  # acks settled here, as _acked settles them, without its call: counted at the end
        for position in positions:
            message = inflight.pop(position, None) if type(position) is int else None
            if message is None:
                rejected.append(position)
                continue
            acked.append(position)
            kb = message.kb
            if kb is None or consumer.unacked_blocked:
                self._acked(consumer, message)
                continue
            state = keys[kb]
            if message.flags & _LOOSE:
                if not unordered:  # loose from before a switch to ordered mode: the key may go on (_unblock)
                    self._acked(consumer, message)
                    continue
                message.flags ^= _LOOSE
                state.loose -= 1
                if not (state.loose or state.inflight or state.pending):  # as _unblock does in unordered mode
                    self._drop_key(state)
                quick += 1
                continue
            if state.inflight > 1:
                state.inflight -= 1
            elif state.draining or state.pending or state.loose:
                self._acked(consumer, message)
                continue
            else:  # the key's last delivery in flight, and nothing of it waits: it is done
                state.inflight = 0
                state.holder = None
                self._drop_key(state)
            quick += 1
        consumer.acked += quick
        self._held -= quick
        if acked and consumer.stuck:
            self._recover(consumer)
        return acked, rejected

    def extend(self, cid: str, positions: Iterable[int]) -> tuple[list[int], list[int]]:
        """Renew the leases of ``positions``, in flight on ``cid``: each deadline becomes now + ``ack_timeout``.

        For a consumer still working on a delivery (SQS ChangeMessageVisibility, RocketMQ
        changeInvisibleTime). Returns ``(extended, rejected)``; a rejected position (not in
        flight on ``cid``, a late one included) changes nothing. Without leases every
        position in flight is accepted and nothing changes. An accepted extension is
        progress: a stuck consumer rejoins.
        """
        consumer = self._consumer(cid)
        timeout = self._ack_timeout
        deadline = self._clock() + timeout if timeout else 0.0
        inflight = consumer.inflight
        extended: list[int] = []
        rejected: list[int] = []
        for position in positions:
            message = inflight.pop(position, None) if type(position) is int else None
            if message is None:
                rejected.append(position)
                continue
            inflight[position] = message  # last: the latest deadline
            if timeout:
                message.deadline = deadline
            extended.append(position)
        if extended:
            consumer.answered += 1
            if consumer.stuck:
                self._recover(consumer)
        return extended, rejected

    def lease_expired(self, cid: str, position: int) -> bool:
        """Whether ``position`` was taken back from ``cid`` at a lease deadline (so an ack of it is late).

        The last 10,000 positions taken back from each consumer are remembered.
        """
        return position in self._consumer(cid).expired

    def failures(self, cid: str, position: int) -> int | None:
        """How many earlier deliveries of the message in flight at ``position`` on ``cid`` failed (came
        back as the oldest of its key, or keyless: what ``max_redeliveries`` counts), where its
        ``redelivery_count`` counts every earlier delivery; None when it is not in flight there. O(1)."""
        message = self._consumer(cid).inflight.get(position)
        return None if message is None else message.failures()

    def next_deadline(self) -> float | None:
        """The clock reading at which :meth:`poll` may next have work of its own: a lease to take
        back, a nack backoff that ends or a delayed message due; None when there is none.

        Never later than the earliest deadline or backoff end (it may be earlier: polling
        early is harmless).
        """
        heaps: tuple[list[Any], ...] = (self._leases, self._key_backoffs, self._delayed, self._timed)
        ends = [heap[0][0] for heap in heaps if heap]
        return min(ends) if ends else None

    def dead_letters(self) -> list[DeadLetter]:
        """The messages given up on since the last call, in the order decided.

        Each still counts against ``max_replay`` until :meth:`dead_lettered` confirms it was
        stored in the dead-letter topic (G3: stored before it leaves the subscription).
        """
        out = self._dead_out
        if not out:
            return []
        self._dead_out = []
        for letter in out:
            self._dead_unconfirmed[letter.position] = letter
        return out

    def dead_lettered(self, positions: Iterable[int]) -> tuple[list[int], list[int]]:
        """Confirm that these dead letters are stored; returns ``(confirmed, rejected)``.

        A rejected position (not handed out by :meth:`dead_letters`, or confirmed already)
        changes nothing.
        """
        unconfirmed = self._dead_unconfirmed
        confirmed: list[int] = []
        rejected: list[int] = []
        for position in positions:
            if type(position) is int and unconfirmed.pop(position, None) is not None:
                confirmed.append(position)
                self._held -= 1
            else:
                rejected.append(position)
        return confirmed, rejected

    def _ack(self, consumer: _Consumer, position: object) -> bool:
        """Acknowledge ``consumer``'s delivery at ``position``; False when it is not in flight there, a wrong type
        included."""
        message = consumer.inflight.pop(position, None) if type(position) is int else None
        if message is None:
            return False
        self._acked(consumer, message)
        return True

    def _acked(self, consumer: _Consumer, message: _Message) -> None:
        """``message``, just taken out of ``consumer``'s in-flight map, is acknowledged: its key moves on (G1).

        :meth:`ack_many` settles the usual cases inline, as this does (a quiet key's delivery, a loose one in
        unordered mode): change it with this.
        """
        consumer.acked += 1
        self._held -= 1
        if consumer.unacked_blocked and len(consumer.inflight) <= self._unacked_resume:
            self._resume(consumer)
        kb = message.kb
        if kb is None:
            return
        state = self._keys[kb]
        if message.flags & _LOOSE:
            message.flags ^= _LOOSE
            state.loose -= 1
            if not state.loose:
                self._unblock(state)
            return
        was_draining = state.draining
        if not self._settle_inflight(state, 1):
            return
        if was_draining and state.pending and not (state.loose or state.backoff):
            self._queue(state, self._owner_of_slot(state.slot))
        if not state.pending and not state.loose:
            self._drop_key(state)

    def nack(self, cid: str, position: int) -> None:
        """Return ``position`` and every later unacked delivery of its key on ``cid`` to pending (G2).

        With a ``nack_backoff`` the message waits for its backoff before it goes out again: in
        ordered mode with its whole key, else alone.
        """
        consumer = self._consumer(cid)
        message = consumer.inflight.get(position) if type(position) is int else None
        if message is None:
            raise self._refusal(consumer, position, "nack")
        kb = message.kb
        # In unordered mode too: a client drops what it prefetched of the key after a nack.
        later = [message]
        if kb is not None:
            later = [m for m in consumer.inflight.values() if m.kb == kb and m.position >= position]
        consumer.answered += 1
        until = self._backoff_end(message) if self._backoff else 0.0
        for state in self._return_inflight(consumer, later, "nack", message, until):
            if until:
                self._hold(state, until)
            elif not (state.draining or state.loose or state.backoff):  # (a backoff from an earlier nack)
                self._queue(state, self._owner_of_slot(state.slot))
        if consumer.stuck:
            self._recover(consumer)

    def unsent(self, cid: str, positions: Iterable[int]) -> tuple[list[int], list[int]]:
        """Take back deliveries to ``cid`` that the IO layer could not send: returns ``(taken, rejected)``.

        As if :meth:`poll` had never made them: each goes back to pending ahead of its key (G2),
        with its permit; no redelivery or failure is counted, and ``cid`` is not stuck. Every
        later delivery of their keys on ``cid`` comes back with them, in either consume mode, as
        for a nack (G2: an IO layer sends a consumer's deliveries in the order ``poll`` made them,
        so what did not go out includes those; and a key's ordered deliveries made before a switch
        to unordered mode must not be left in flight behind a returned one). A rejected position
        (not in flight on ``cid``, a repeat included) changes nothing. Without this, a delivery
        lost before it was sent would hold its key until its lease ended (forever without
        leases), and its permit would be gone for good: the consumer would wait for it.
        """
        consumer = self._consumer(cid)
        inflight = consumer.inflight
        firsts: dict[bytes, int] = {}
        taken: list[int] = []
        rejected: list[int] = []
        messages: dict[int, _Message] = {}
        for position in positions:
            message = inflight.get(position) if type(position) is int else None
            if message is None or position in messages:
                rejected.append(position)
                continue
            taken.append(position)
            messages[position] = message
            kb = message.kb
            if kb is not None and position < firsts.get(kb, position + 1):
                firsts[kb] = position
        if not messages:
            return taken, rejected
        for message in inflight.values():
            kb = message.kb
            if kb is not None and message.position >= firsts.get(kb, message.position + 1):
                messages[message.position] = message
        self._give_permits(consumer, len(messages))
        for state in self._return_inflight(consumer, list(messages.values()), "", counted=False):
            if not (state.draining or state.loose or state.backoff):
                self._queue(state, self._owner_of_slot(state.slot))
        return taken, rejected

    # -- reading ---------------------------------------------------------------------

    def ranges(self) -> list[Range]:
        """Every ``(start, end, consumer)``, sorted by start; they tile :attr:`slots`."""
        offset = self._first
        if not offset:
            return self._map.ranges()
        return [(start + offset, end + offset, cid) for start, end, cid in self._map.ranges()]

    def ranges_of(self, cid: str) -> list[tuple[int, int]]:
        """``cid``'s inclusive ranges, sorted; empty for a standby (raises for an unknown consumer)."""
        self._consumer(cid)
        return self._ranges_of(cid)

    def _ranges_of(self, cid: str) -> list[tuple[int, int]]:
        """The inclusive slot ranges consumer ``cid`` owns, in this dispatcher's slot numbers: its block's offset
        added."""
        offset = self._first
        if not offset:
            return self._map.ranges_of(cid)
        return [(start + offset, end + offset) for start, end in self._map.ranges_of(cid)]

    @property
    def last_position(self) -> int | None:
        """The last position published, None before the first: a re-read of parked slots ends there."""
        return self._last_position

    @property
    def slots(self) -> tuple[int, int]:
        """The inclusive ``(first, last)`` hash slots this dispatcher serves."""
        return self._first, self._first + self._size - 1

    @property
    def policy(self) -> Policy:
        """The rebalance policy deciding every range change."""
        return self._policy

    def set_policy(self, policy: str) -> None:
        """Switch to another rebalance policy (a name as the constructor takes); only without consumers.

        A Pulsar Key_Shared subscription is AUTO_SPLIT (a load-aware policy) or STICKY (each
        consumer declares its ranges) as its first consumer says; the server switches an
        empty subscription to what a joiner asks. Measured load, held messages and history
        carry over. Refused (:class:`ConfigError`, nothing changed) while a consumer is present.
        """
        check_policy_choice(policy, self._max_ranges, sticky=True)
        if policy == self._policy.name:
            return
        if self._consumers:
            raise ConfigError(
                f"cannot switch to policy {policy!r} while {len(self._consumers)} consumer(s) are present; "
                "expected a subscription without consumers"
            )
        self._policy = self._make_policy(policy)

    def _make_policy(self, name: str) -> Policy:
        """The rebalance policy called ``name``, built from this dispatcher's settings: multi, contiguous or sticky."""
        threshold = 1.1 if self._shift_threshold is None else float(self._shift_threshold)
        if name == MultiRangePolicy.name:
            return MultiRangePolicy(self._max_ranges, threshold, self._shift_min_traffic)
        if name == ContiguousPolicy.name:
            return ContiguousPolicy(self._split, threshold, self._shift_min_traffic)
        return StickyPolicy(self._declared_here)

    def declared_ranges(self, cid: str) -> list[tuple[int, int]] | None:
        """The ranges sticky consumer ``cid`` declared (whole-space slots), None for a consumer of another policy."""
        self._consumer(cid)
        found = self._declared.get(cid)
        return None if found is None else list(found)

    def _check_declared(self, cid: str, ranges: object) -> list[tuple[int, int]] | None:
        """``ranges`` checked as :meth:`add_consumer` documents, sorted; None when the policy takes none."""
        if self._policy.name != StickyPolicy.name:
            if ranges is not None:
                raise ConsumerError(
                    f"consumer {cid!r} declared hash ranges, but policy {self._policy.name!r} assigns them; "
                    "expected ranges only under the sticky policy"
                )
            return None
        if ranges is None or isinstance(ranges, (str, bytes)) or not isinstance(ranges, Sequence) or not ranges:
            raise ConsumerError(
                f"consumer {cid!r} of a sticky subscription must declare its hash ranges: expected a non-empty "
                f"sequence of (first, last) slots, not {ranges!r:.200}"
            )
        if len(ranges) > MAX_STICKY_RANGES:
            raise ConsumerError(
                f"consumer {cid!r} declared {len(ranges)} hash ranges; expected at most {MAX_STICKY_RANGES}"
            )
        checked = []
        for item in ranges:
            if (
                not isinstance(item, (tuple, list))
                or len(item) != 2
                or not all(type(bound) is int for bound in item)
                or not 0 <= item[0] <= item[1] < HASH_RANGE_SIZE
            ):
                raise ConsumerError(
                    f"consumer {cid!r} declared range {item!r:.80}; expected (first, last) ints with "
                    f"0 <= first <= last <= {HASH_RANGE_SIZE - 1}"
                )
            checked.append((item[0], item[1]))
        checked.sort()
        for low, high in itertools.pairwise(checked):
            if high[0] <= low[1]:
                raise ConsumerError(
                    f"consumer {cid!r} declared overlapping ranges {list(low)} and {list(high)}; expected disjoint ones"
                )
        index = self._declared_index
        for first, last in checked:
            # Declared ranges are disjoint: the only one that may reach [first, last] is the last to start by `last`.
            below = index.bisect_right(last) - 1
            if below >= 0:
                their_first, (their_last, other) = index.peekitem(below)
                if their_last >= first:
                    raise ConsumerError(
                        f"consumer {cid!r}'s range [{first}, {last}] overlaps [{their_first}, {their_last}] "
                        f"of consumer {other!r}; expected ranges no other consumer declared"
                    )
        return checked

    def _declare(self, cid: str, ranges: list[tuple[int, int]]) -> None:
        """Record sticky ``ranges`` of ``cid``, and their parts in this dispatcher's block."""
        first, size = self._first, self._size
        self._declared[cid] = ranges
        self._declared_index.update((start, (end, cid)) for start, end in ranges)
        self._declared_here[cid] = [
            (max(start - first, 0), min(end - first, size - 1))
            for start, end in ranges
            if end >= first and start < first + size
        ]

    @property
    def consume_mode(self) -> ConsumeMode:
        """``"ordered"`` (key ranges, per-key order) or ``"unordered"`` (pop: any consumer with permits)."""
        return "unordered" if self._unordered else "ordered"

    def set_consume_mode(self, mode: ConsumeMode) -> None:
        """Switch between ordered and unordered consumption; nothing waiting or in flight is lost.

        To unordered: every waiting message joins one queue in position order. To ordered:
        waiting messages go back to their keys, and a key with deliveries still in flight
        from unordered mode waits until each is acked, nacked or expired (G1, G2 again from
        then on). Leases, dead letters and ranges carry on across the switch; nack backoffs end
        (what waited goes out with the rest).
        """
        check_consume_mode(mode)
        if mode == self.consume_mode:
            return
        self._reread_due = True
        keys = self._keys
        delayed = [message for _, _, message in self._delayed]
        self._delayed = []
        self._key_backoffs = []
        if mode == "unordered":
            waiting = [*self._keyless, *delayed, *(m for state in keys.values() for m in state.pending)]
            waiting.sort(key=lambda m: m.position)
            self._keyless = deque(waiting)
            for state in list(keys.values()):
                state.pending = _NO_PENDING
                state.queued_on = None
                state.backoff = 0.0
                if not (state.inflight or state.loose):
                    self._drop_key(state)
            for consumer in self._consumers.values():
                consumer.ready = []
                consumer.adopted = []
            self._wake.clear()
            self._unordered = True
            return
        self._unordered = False
        waiting = sorted([*self._keyless, *delayed], key=lambda m: m.position)
        self._keyless = deque()
        for message in waiting:
            if message.kb is None:
                self._keyless.append(message)
                continue
            found = keys.get(message.kb)
            if found is None:
                found = self._add_key(message.kb, message.slot, None, 0)
            found.queue().append(message)
        for key_state in keys.values():
            self._reroute(key_state)

    def set_delivery_settings(
        self,
        *,
        ack_timeout: float,
        max_redeliveries: int | None,
        nack_backoff: float = 0.0,
        nack_backoff_max: float = DEFAULT_NACK_BACKOFF_MAX,
        max_replay: int | None = None,
    ) -> None:
        """Change the lease, dead-letter, backoff and buffer settings live: :meth:`set_settings` with these
        over the settings in force; ``max_replay`` None keeps its bound. A bad value changes nothing."""
        self.set_settings(
            replace(
                self._settings,
                ack_timeout=ack_timeout,
                max_redeliveries=max_redeliveries,
                nack_backoff=nack_backoff,
                nack_backoff_max=nack_backoff_max,
                max_replay=self._settings.max_replay if max_replay is None else max_replay,
            )
        )

    def set_settings(self, settings: DeliverySettings) -> None:
        """Change the delivery settings live to ``settings``; its ``max_unacked_per_consumer`` must be the one in
        force. Raises :class:`ConfigError`, changing nothing, when it is not.

        A new ``ack_timeout`` applies to every delivery made from now on; a lease already out
        ends no later than the new timeout from now: a longer timeout does not lengthen it, and a
        consumer that needs longer extends. Turning leases on leases what is in flight from
        now; turning them off ends every lease. A new ``max_redeliveries`` applies to every
        message when it is next due to go out; backoffs already running keep their ends. A new
        ``max_replay`` bounds what is held from now on: lowered under what is held, nothing is
        dropped and nothing more is taken, :meth:`wants` being 0, until acks bring the held count
        under it; it parks slots from half of it, as at the start.
        """
        if not isinstance(settings, DeliverySettings):
            raise ConfigError(f"settings must be a DeliverySettings, not {settings!r}")
        if settings.max_unacked_per_consumer != self._unacked_limit:
            raise ConfigError(
                f"max_unacked_per_consumer is {self._unacked_limit} for the life of a dispatcher, not "
                f"{settings.max_unacked_per_consumer!r}; expected settings with the one in force"
            )
        max_replay = settings.max_replay
        if max_replay != self._max_replay:
            self._max_replay = max_replay
            self._held_bound = max(max_replay, self._held)
            self._park_at = max(max_replay // 2, 1)
            self._backlog_min = min(_BACKLOG_MIN, max(max_replay // 10, 1))
            self._reread_due = True
        timeout = float(settings.ack_timeout)
        if timeout != self._ack_timeout:
            now = self._clock()
            self._leases = []
            cap = now + timeout
            was_leased = self._ack_timeout > 0.0
            for consumer in self._consumers.values():
                consumer.lease_due = False
                if not timeout or not consumer.inflight:
                    continue
                for message in consumer.inflight.values():  # deadline order stays: min() keeps it
                    message.deadline = min(message.deadline, cap) if was_leased else cap
                self._schedule(consumer, next(iter(consumer.inflight.values())).deadline)
            self._ack_timeout = timeout
            self._deadline = cap
        self._max_redeliveries = settings.max_redeliveries
        self._backoff = float(settings.nack_backoff)
        self._backoff_max = float(settings.nack_backoff_max)
        self._settings = settings

    @property
    def settings(self) -> DeliverySettings:
        """The delivery settings in force."""
        return self._settings

    @property
    def max_replay(self) -> int:
        """The bound on messages held (pending and in flight)."""
        return self._max_replay

    @property
    def nack_backoff(self) -> tuple[float, float]:
        """``(nack_backoff, nack_backoff_max)`` in seconds; a first value of 0 is off."""
        return self._backoff, self._backoff_max

    @property
    def ack_timeout(self) -> float:
        """Seconds a delivery's lease lasts; 0 when leases are off."""
        return self._ack_timeout

    @property
    def max_redeliveries(self) -> int | None:
        """Redeliveries after which a message is dead-lettered; None: never."""
        return self._max_redeliveries

    @property
    def epoch(self) -> int:
        """The range map's epoch: +1 at every change."""
        return self._map.epoch

    def range_map(self) -> RangeMap:
        """A copy of the current range map."""
        return self._map.copy()

    def owner_of(self, key: str | bytes) -> str | None:
        """The consumer whose range holds ``key``'s hash, or None when none does (no consumers, or a
        sticky subscription's undeclared slot).

        Raises :class:`WrongPartitionError` for a key whose slot is outside :attr:`slots`.
        """
        kb = key if type(key) is bytes else key_bytes(key)
        slot = (mmh3.hash(kb, 0, False) & _SLOT_MASK) - self._first
        if not 0 <= slot < self._size:
            raise _wrong_partition(key, slot + self._first, self._first, self._size)
        owners = self._owners
        owner = owners[bisect.bisect_left(self._ends, slot)] if owners else None
        return None if owner is None else owner.cid

    def snapshot(self) -> dict[str, Any]:
        """The range map snapshot (``RangeMap.snapshot`` format; of a block, counted from its first slot)."""
        return self._map.snapshot()

    def consumers(self) -> list[str]:
        """Every consumer id, in join order (standbys included)."""
        return list(self._consumers)

    def rebalances(self) -> list[RebalanceEvent]:
        """The most recent range changes, oldest first."""
        return [change.public() for change in self._history]

    def stats(self) -> dict[str, Any]:
        """Per-consumer and dispatcher-wide state, for operators (read at scrape time).

        Rates are as of the last measurement (taken by ``poll`` about once a second and at
        every change); reading stats never changes what the dispatcher decides. A consumer's
        ``stalled`` says it is not making progress (stuck, at its unacked limit, or no answer
        for ``half_life`` while without permits or holding deliveries): a join or a leave now
        would give it no slots.
        """
        rates = self._meter.rates
        draining: dict[str, tuple[set[int], int]] = {cid: (set(), 0) for cid in self._consumers}
        waiting: Counter[str] = Counter()
        replay = len(self._keyless)
        backoff_keys = 0
        backoff_messages = len(self._delayed)
        for state in self._keys.values():
            replay += len(state.pending)
            if state.backoff:
                backoff_keys += 1
                backoff_messages += len(state.pending)
            if state.pending:
                owner = self._owner_of_slot(state.slot)
                if owner is not None:
                    waiting[owner.cid] += len(state.pending)
            if state.draining and state.holder is not None:
                slots, unacked = draining[state.holder.cid]
                slots.add(state.slot)
                draining[state.holder.cid] = (slots, unacked + state.inflight)
        consumers = {}
        now = self._clock()
        for cid, consumer in self._consumers.items():
            slots, unacked = draining[cid]
            first = next(iter(consumer.inflight.values()), None)  # in deadline order: the first ends first
            consumers[cid] = {
                "ranges": self._ranges_of(cid),
                "standby": cid in self._standby,
                "stuck": consumer.stuck,
                "stalled": not self._progressing(consumer, now),
                "expired": consumer.expired_count,
                "lease_ends_in": max(first.deadline - now, 0.0) if first is not None and self._ack_timeout else None,
                "permits": consumer.permits + consumer.withheld,
                "unacked_limit_reached": consumer.unacked_blocked,
                "unacked": len(consumer.inflight),
                "rate": rates.get(cid, 0.0),
                "draining_hashes": len(slots),
                "draining_unacked": unacked,
                "replay": waiting[cid],
                "delivered": consumer.delivered,
                "acked": consumer.acked,
                "redelivered": consumer.redelivered,
            }
        return {
            "consumers": consumers,
            "replay": replay + len(self._delayed) + len(self._timed),
            "unrouted": len(self._fresh),
            "held": self._held,
            "max_replay": self._max_replay,
            "wants": self.wants(),
            "epoch": self._map.epoch,
            "rebalances": dict(self._rebalances),
            "ack_timeout": self._ack_timeout,
            "max_redeliveries": self._max_redeliveries,
            "expired_leases": self._expired_total,
            "dead_lettered": self._dead_total,
            "dead_letters_unconfirmed": len(self._dead_out) + len(self._dead_unconfirmed),
            "consume_mode": self.consume_mode,
            "parked_slots": len(self._parked),
            "parked_messages": self._parked_total,
            "nack_backoff": self._backoff,
            "nack_backoff_max": self._backoff_max,
            "backoff_keys": backoff_keys,
            "backoff_messages": backoff_messages,
            "delayed_messages": len(self._timed),
        }

    def draining_slots(self) -> list[tuple[int, int]]:
        """The inclusive slot ranges holding a draining key (one still in flight on a former owner after its
        range moved), merged and sorted, in this dispatcher's slot numbers. O(keys) per call: read it for a
        page or a scrape, not per message."""
        offset = self._first
        slots = sorted({state.slot + offset for state in self._keys.values() if state.draining})
        merged: list[tuple[int, int]] = []
        for slot in slots:
            if merged and merged[-1][1] == slot - 1:
                merged[-1] = (merged[-1][0], slot)
            else:
                merged.append((slot, slot))
        return merged

    def drain_histogram(self) -> Histogram:
        """Seconds from each range change until its last blocked key was released (read-only use)."""
        return self._drain_seconds

    def traffic(self) -> Any:
        """Recent per-slot traffic (decayed message counts, as of the last measurement), read-only;
        entry i is slot ``slots[0] + i``."""
        return self._meter.traffic

    # -- internals: routing ----------------------------------------------------------

    def _deliver(self, consumer: _Consumer, message: _Message, out: list[Delivery]) -> None:
        """Give ``message`` to ``consumer``: one permit spent, in flight on it with a lease when leases are on, and
        out."""
        consumer.permits -= 1
        consumer.delivered += 1
        consumer.inflight[message.position] = message
        back = message.back
        if back is not None:
            consumer.redelivered += 1
            if consumer.expired:
                consumer.expired.pop(message.position, None)
        if self._ack_timeout:
            message.deadline = self._deadline
            if not consumer.lease_due:
                self._schedule(consumer, self._deadline)
        if self._unacked_limit and len(consumer.inflight) >= self._unacked_limit:
            self._withhold(consumer)
        count = 0 if back is None else back.count
        out.append(_delivery((consumer.cid, message.position, _key_of(message), message.payload, count)))

    @staticmethod
    def _withhold(consumer: _Consumer) -> None:
        """``consumer`` is at ``max_unacked_per_consumer``: its permits are withheld until it acks."""
        consumer.unacked_blocked = True
        consumer.withheld += consumer.permits
        consumer.permits = 0

    def _serve_ready(self, out: list[Delivery]) -> None:
        """Deliver the heads of the keys waiting on each woken consumer, oldest position first, while it has permits."""
        keys = self._keys
        deliver = self._deliver
        heappop, heappush = heapq.heappop, heapq.heappush
        limit = self._max_redeliveries
        for consumer in self._wake:
            if consumer.adopted:
                self._adopt(consumer)
            ready = consumer.ready
            while consumer.permits and ready:
                position, kb = heappop(ready)
                state = keys.get(kb)
                if state is None or state.queued_on is not consumer:
                    continue
                pending = state.pending
                if not pending or pending[0].position != position:
                    continue
                if limit is not None and pending[0].failures() > limit:
                    self._dead_letter(pending.popleft())
                    if pending:
                        heappush(ready, (pending[0].position, kb))
                    else:
                        state.queued_on = None
                        state.pending = _NO_PENDING
                        if not state.inflight:
                            self._drop_key(state)
                    continue
                deliver(consumer, pending.popleft(), out)
                state.holder = consumer
                state.inflight += 1
                if pending:
                    heappush(ready, (pending[0].position, kb))
                else:
                    state.queued_on = None
                    state.pending = _NO_PENDING
        self._wake.clear()

    def _serve_keyless(self, out: list[Delivery]) -> None:
        """The shared queue, round robin to consumers with permits: keyless messages, and in unordered
        mode every waiting message (a keyed one goes out loose)."""
        waiting = self._keyless
        keys, heads = self._keys, self._slot_keys
        limit = self._max_redeliveries
        deliver = self._deliver
        consumers = self._round_robin
        count = len(consumers)
        turn = self._rr  # the next consumer's turn, kept here and stored back before it is read elsewhere
        while waiting:
            if limit is not None and waiting[0].failures() > limit:
                self._dead_letter(waiting.popleft())
                continue
            consumer = consumers[turn] if turn < count else None
            if consumer is not None and consumer.permits and not consumer.stuck:
                turn = turn + 1 if turn + 1 < count else 0  # as _next_with_permits turns, without its call
            else:
                self._rr = turn
                consumer = self._next_with_permits()
                if consumer is None:
                    return
                turn = self._rr
            message = waiting.popleft()
            kb = message.kb
            if kb is not None:
                state = keys.get(kb)
                if state is None:  # as _add_key does, without its call
                    state = keys[kb] = _KeyState(kb, message.slot, None, 0, heads)
                state.loose += 1
                message.flags |= _LOOSE
            deliver(consumer, message, out)
        self._rr = turn

    def _serve_unordered(self, out: list[Delivery], now: float) -> None:
        """Unordered mode: waiting messages, then fresh ones, round robin to consumers with permits (pop);
        a fresh one delayed past ``now`` waits for its time."""
        waiting = self._keyless
        parked = self._parked
        due_at = self._due_at
        if parked or due_at:  # a parked slot's later messages are re-read from the log, in unordered mode too
            for message in self._fresh:
                if parked and message.kb is not None and message.slot in parked:
                    self._park(message)
                elif not (due_at and self._delays(message, now)):
                    waiting.append(message)
        else:
            waiting.extend(self._fresh)
        self._fresh.clear()
        self._serve_keyless(out)

    def _next_with_permits(self) -> _Consumer | None:
        """The next consumer in round-robin order that has permits and is not stuck, its turn taken; None if none."""
        consumers = self._round_robin
        count = len(consumers)
        for step in range(count):
            consumer = consumers[(self._rr + step) % count]
            if consumer.permits and not consumer.stuck:
                self._rr = (self._rr + step + 1) % count
                return consumer
        return None

    def _route_fresh(self, out: list[Delivery], now: float) -> None:
        """Route messages published since the last poll: to their key's owner at once when nothing of the key waits;
        one delayed past ``now`` waits for its time (a parked slot's is parked all the same)."""
        keys = self._keys
        due_at = self._due_at
        heads = self._slot_keys
        ends, owners = self._ends, self._owners
        deliver = self._deliver
        fresh = self._fresh
        keyless = self._keyless
        keyless_blocked = False
        parked = self._parked if self._spill else None
        park_at = self._park_at
        # A delivery of a fresh message (never returned) is made here as _deliver makes it, without its
        # call: most messages go out this way.
        leased, deadline, limit = bool(self._ack_timeout), self._deadline, self._unacked_limit
        append = out.append
        while fresh:
            message = fresh.popleft()
            kb = message.kb
            if kb is None:
                if due_at and self._delays(message, now):
                    continue
                consumer = None if keyless or keyless_blocked else self._next_with_permits()
                if consumer is None:
                    keyless_blocked = True
                    keyless.append(message)
                else:
                    deliver(consumer, message, out)
                continue
            state = keys.get(kb)
            if parked is not None and (
                message.slot in parked or (self._held >= park_at and self._stalled(state, message.slot))
            ):
                self._park(message)
                continue
            if due_at and self._delays(message, now):
                continue
            if state is not None:
                message.kb, message.slot = state.kb, state.slot  # the key's objects, not copies per message
                if state.pending:
                    state.queue().append(message)
                    continue
            owner = owners[bisect.bisect_left(ends, message.slot)] if owners else None
            # An owner with permits has no adopted keys by now (_serve_ready made their entries): an
            # empty heap means nothing of it waits.
            if state is None:
                if owner is None or not owner.permits or owner.ready:
                    state = self._add_key(kb, message.slot, None, 0)
                    state.queue().append(message)
                    self._queue(state, owner)
                    continue
                state = keys[kb] = _KeyState(kb, message.slot, owner, 1, heads)  # as _add_key does, without its call
            elif state.holder is not owner or state.loose:  # draining: in flight on a consumer that no longer owns it
                state.queue().append(message)
                continue
            elif owner is None or not owner.permits or owner.ready:
                state.queue().append(message)
                self._queue(state, owner)
                continue
            else:
                state.inflight += 1
            owner.permits -= 1
            owner.delivered += 1
            position = message.position
            inflight = owner.inflight
            inflight[position] = message
            if leased:
                message.deadline = deadline
                if not owner.lease_due:
                    self._schedule(owner, deadline)
            if limit and len(inflight) >= limit:
                self._withhold(owner)
            append(_delivery((owner.cid, position, kb.decode() if message.flags & _TEXT else kb, message.payload, 0)))

    def _queue(self, state: _KeyState, owner: _Consumer | None) -> None:
        """Put ``state``'s head on ``owner``'s ready heap (None: no consumer, wait for one)."""
        state.queued_on = owner
        if owner is not None:
            heapq.heappush(owner.ready, (state.pending[0].position, state.kb))
            self._pushed(owner)
        elif self._spill:
            self._unowned.add(state.slot)

    def _compact(self, consumer: _Consumer) -> None:
        """Drop ``consumer``'s ready entries that no longer point at a key's head queued on it."""
        keys = self._keys
        live = []
        for position, kb in consumer.ready:
            state = keys.get(kb)
            if (
                state is not None
                and state.queued_on is consumer
                and state.pending
                and state.pending[0].position == position
            ):
                live.append((position, kb))
        heapq.heapify(live)
        consumer.ready = live

    def _add_key(self, kb: bytes, slot: int, holder: _Consumer | None, inflight: int) -> _KeyState:
        """A new key state, in ``_keys`` and first in its slot's list (``_route_fresh`` and ``_serve_keyless``
        make theirs as this does, without the call)."""
        state = self._keys[kb] = _KeyState(kb, slot, holder, inflight, self._slot_keys)
        return state

    def _drop_key(self, state: _KeyState) -> None:
        """Forget ``state`` (nothing pending, in flight or loose): out of ``_keys`` and its slot's list."""
        del self._keys[state.kb]
        before, after = state.prev, state.next
        if before is None:
            self._slot_keys[state.slot] = after
        else:
            before.next = after
        if after is not None:
            after.prev = before

    def _keys_in(self, first: int, last: int) -> list[_KeyState]:
        """The states of the keys in slots ``first..last``: O(slots) in C plus O(keys found) in Python."""
        found = []
        for head in filter(None, self._slot_keys[first : last + 1]):
            state: _KeyState | None = head
            while state is not None:
                found.append(state)
                state = state.next
        return found

    def _owner_of_slot(self, slot: int) -> _Consumer | None:
        """The consumer owning ``slot`` in the current map; None while there are no consumers."""
        owners = self._owners
        return owners[bisect.bisect_left(self._ends, slot)] if owners else None

    def _return_inflight(
        self,
        consumer: _Consumer,
        messages: list[_Message],
        reason: str,
        failed: _Message | None = None,
        delay_until: float = 0.0,
        *,
        counted: bool = True,
    ) -> list[_KeyState]:
        """Move ``messages`` (in flight on ``consumer``) back to pending, each key ahead of its queue.

        Each counts a redelivery, and ``failed`` (a nack's message) alone a failure when given; else
        each key's oldest returned message, every keyless or loose one, and in unordered mode every
        one. Not ``counted``: none of that (deliveries that were never sent), ``reason`` unused. A
        loose message goes back into its key's queue by position (ahead of everything in unordered
        mode). With ``delay_until``, ``failed`` waits until then if it goes back
        to the shared queue (keyless, or unordered mode). Returns the ordered-mode key states
        that got messages back, for the caller to queue.
        """
        unordered = self._unordered
        each = failed is None
        by_key: dict[bytes, list[_Message]] = {}
        front = []  # back to the shared queue, ahead of what waits there
        loose: list[tuple[bytes, _Message]] = []
        for message in messages:
            del consumer.inflight[message.position]
            if counted:
                back = message.returns()
                back.count += 1
                back.reason = reason
                if message is failed or (each and (message.kb is None or unordered or message.flags & _LOOSE)):
                    back.failures += 1
            if message.flags & _LOOSE and message.kb is not None:  # only keyed deliveries go out loose
                loose.append((message.kb, message))
            elif message.kb is None or unordered:
                front.append(message)
            else:
                by_key.setdefault(message.kb, []).append(message)
        keys = self._keys
        states: dict[bytes, _KeyState] = {}
        for message in front:
            if message.kb is not None:  # unordered mode: an ordered delivery made before the switch
                state = states[message.kb] = keys[message.kb]
                self._settle_inflight(state, 1)
        for kb, returned in by_key.items():
            state = states[kb] = keys[kb]
            returned.sort(key=_position_of)
            if each and counted:
                returned[0].returns().failures += 1
            _put_back(state.queue(), returned)  # a delayed message may wait there below them
            self._settle_inflight(state, len(returned))
        for kb, message in loose:
            message.flags ^= _LOOSE
            state = states[kb] = keys[kb]
            state.loose -= 1
            if unordered:
                front.append(message)
            else:
                _put_back(state.queue(), [message])
        if delay_until and failed is not None and failed in front:
            front.remove(failed)
            heapq.heappush(self._delayed, (delay_until, failed.position, failed))
        front.sort(key=_position_of)
        _put_back(self._keyless, front)  # in position order with what waits there (as Pulsar replays)
        if not consumer.inflight:
            consumer.holding_since = None  # it holds nothing: whatever it holds next, it holds from now on
        if consumer.unacked_blocked and len(consumer.inflight) <= self._unacked_resume:
            self._resume(consumer)
        if unordered:
            for state in states.values():
                if not (state.inflight or state.loose or state.pending):
                    self._drop_key(state)
            return []
        return list(states.values())

    def _settle_inflight(self, state: _KeyState, count: int) -> bool:
        """``count`` of ``state``'s ordered deliveries were acked or taken back; True when none is left
        in flight (the key has no holder then, and stops draining)."""
        state.inflight -= count
        if state.inflight:
            return False
        state.holder = None
        if state.draining:
            self._release(state)
        return True

    def _resume(self, consumer: _Consumer) -> None:
        """``consumer`` acked down to half its unacked limit: its withheld permits count again."""
        consumer.unacked_blocked = False
        self._reread_due = True
        consumer.permits += consumer.withheld
        consumer.withheld = 0
        if consumer.permits and (consumer.ready or consumer.adopted):
            self._wake[consumer] = None

    def _unblock(self, state: _KeyState) -> None:
        """``state``'s last loose delivery is settled: in ordered mode the key may go on, in order."""
        if not (state.inflight or state.pending):
            self._drop_key(state)
        elif not self._unordered:
            self._reroute(state)

    def _dead_letter(self, message: _Message) -> None:
        """Give up on ``message``: it waits in the dead-letter queue until the IO layer confirms it stored it."""
        back = message.returns()
        self._dead_out.append(
            DeadLetter(message.position, _key_of(message), message.payload, back.count - 1, back.reason)
        )
        self._dead_total += 1

    # -- internals: nack backoff -----------------------------------------------------

    def _backoff_end(self, message: _Message) -> float:
        """When the backoff of ``message``, being nacked, ends: ``nack_backoff`` doubled per earlier failure."""
        doublings = min(message.failures(), _MAX_DOUBLINGS)
        return self._clock() + min(self._backoff * 2.0**doublings, self._backoff_max)

    def _hold(self, state: _KeyState, until: float) -> None:
        """Keep ``state`` (ordered mode) off every ready heap until ``until``; a later end wins."""
        state.queued_on = None  # its heap entries, if any, are stale from now on
        if until > state.backoff:
            state.backoff = until
            heapq.heappush(self._key_backoffs, (until, state.kb))

    def _end_backoffs(self, now: float) -> None:
        """Release the keys and messages whose backoff ended at or before ``now``."""
        keys = self._keys
        backoffs = self._key_backoffs
        while backoffs and backoffs[0][0] <= now:
            until, kb = heapq.heappop(backoffs)
            state = keys.get(kb)
            if state is not None and state.backoff == until:
                state.backoff = 0.0
                self._reroute(state)
        delayed = self._delayed
        due = []
        while delayed and delayed[0][0] <= now:
            due.append(heapq.heappop(delayed)[2])
        if due:
            due.sort(key=_position_of)
            _put_back(self._keyless, due)

    # -- internals: delayed delivery -------------------------------------------------

    def _delays(self, message: _Message, now: float) -> bool:
        """Whether fresh ``message`` was published with a ``deliver_at`` after ``now``: then it waits for it."""
        deliver_at = self._due_at.pop(message.position, 0.0)
        if deliver_at <= now:
            return False
        if not self._honours_delays:
            self._waive(message.position, deliver_at)
            return False
        self._hold_until(message, deliver_at)
        return True

    def _waive(self, position: int, deliver_at: float) -> None:
        """Remember the delivery time of the message at ``position``, routed without waiting for it, for when delivery
        times are honoured again; entries of messages no longer waiting are dropped as the map outgrows
        ``max_replay``."""
        waived = self._waived
        waived[position] = deliver_at
        if len(waived) > 2 * self._max_replay + 16:
            waiting = self._waiting_positions()
            self._waived = {p: at for p, at in waived.items() if p in waiting}

    def _waiting_positions(self) -> set[int]:
        """The positions of the messages routed and waiting to go out (not delayed, not in flight). O(held)."""
        waiting = {message.position for message in self._keyless}
        for state in self._keys.values():
            waiting.update(message.position for message in state.pending)
        return waiting

    def honour_delays(self, honour: bool) -> None:
        """Honour delivery times (the default) or not, live: a subscription whose type has none (Pulsar honours
        them on Shared and Key_Shared subscriptions only).

        Not honoured, every delayed message goes out now, as :meth:`release_delayed` lets it, and so does a message
        handed in with a ``deliver_at`` ahead; each one's delivery time is kept while it waits. Honoured again, those
        still waiting (not delivered since) wait for their time again, if it is still ahead.
        """
        if type(honour) is not bool:
            raise ConfigError(f"honour must be a bool, not {honour!r}")
        if honour == self._honours_delays:
            return
        self._honours_delays = honour
        if not honour:
            for deliver_at, position, _ in self._timed:
                self._waived[position] = deliver_at
            if self._timed:
                self._release_timed(math.inf)
                self._reread_due = True
            return
        waived, self._waived = self._waived, {}
        now = self._clock()
        ahead = {position: at for position, at in waived.items() if at > now}
        if ahead:
            self._delay_again(ahead)

    def _delay_again(self, ahead: dict[int, float]) -> None:
        """Take the waiting messages at the positions of ``ahead`` out of their queues and delay each to its
        ``deliver_at`` there (the others were delivered since, or are no longer held)."""
        keep = [message for message in self._keyless if message.position not in ahead]
        if len(keep) < len(self._keyless):
            for message in self._keyless:
                if message.position in ahead:
                    self._hold_until(message, ahead[message.position])
            self._keyless = deque(keep)
        for state in list(self._keys.values()):
            pending = state.pending
            if not pending or not any(message.position in ahead for message in pending):
                continue
            head = pending[0]
            for message in pending:
                if message.position in ahead:
                    self._hold_until(message, ahead[message.position])
            left = deque(message for message in pending if message.position not in ahead)
            if left:
                state.pending = left
                if state.queued_on is not None and left[0] is not head:
                    self._queue(state, state.queued_on)  # a new head: an entry for it (the old goes stale)
                continue
            state.pending = _NO_PENDING
            state.queued_on = None
            state.backoff = 0.0  # (its entry in the backoff heap goes stale)
            if not state.inflight and not state.loose:
                self._drop_key(state)

    def _hold_until(self, message: _Message, deliver_at: float) -> None:
        """Keep ``message`` (held, routed nowhere) until the first poll at or after ``deliver_at``."""
        message.flags |= _DELAYED
        heapq.heappush(self._timed, (deliver_at, message.position, message))
        if message.kb is not None:
            self._timed_slots[message.slot] += 1

    def release_delayed(self) -> None:
        """Let every delayed message go out now, as if its time had come, and deliver those handed in with a
        ``deliver_at`` and not routed yet at once: a subscription that stops honouring delivery times (Pulsar
        honours them on Shared and Key_Shared subscriptions only)."""
        self._due_at.clear()
        if self._timed:
            self._release_timed(math.inf)
            self._reread_due = True

    def _release_timed(self, now: float) -> None:
        """The delayed messages whose time came by ``now`` wait as returned ones do: each keyed one in its key's
        queue at its position, behind a draining or blocked key as its other messages are (G1), the others in
        the shared queue in position order."""
        timed, slots = self._timed, self._timed_slots
        shared: list[_Message] = []
        keyed: list[tuple[bytes, _Message]] = []
        while timed and timed[0][0] <= now:
            message = heapq.heappop(timed)[2]
            kb = message.kb
            if kb is None:
                shared.append(message)
                continue
            slots[message.slot] -= 1
            if not slots[message.slot]:
                del slots[message.slot]
            if self._unordered:
                shared.append(message)
            else:
                keyed.append((kb, message))
        shared.sort(key=_position_of)
        _put_back(self._keyless, shared)
        keys = self._keys
        for kb, message in keyed:
            state = keys.get(kb)
            if state is None:
                state = self._add_key(kb, message.slot, None, 0)
            else:
                message.kb, message.slot = state.kb, state.slot
            pending = state.queue()
            head = pending[0] if pending else None
            _put_back(pending, [message])
            if state.queued_on is not None and pending[0] is not head:
                self._queue(state, state.queued_on)  # queued, with a new head: an entry for it (the old goes stale)
            else:
                self._reroute(state)

    # -- internals: leases -----------------------------------------------------------

    def _schedule(self, consumer: _Consumer, deadline: float) -> None:
        """Put ``consumer``'s lease check due at ``deadline`` on the lease heap."""
        self._lease_seq += 1
        heapq.heappush(self._leases, (deadline, self._lease_seq, consumer))
        consumer.lease_due = True

    def _expire(self, now: float) -> None:
        """Take back every delivery whose deadline is at or before ``now`` (G7)."""
        leases = self._leases
        while leases and leases[0][0] <= now:
            consumer = heapq.heappop(leases)[2]
            consumer.lease_due = False
            if self._consumers.get(consumer.cid) is not consumer:
                continue  # removed since
            expired = []
            for message in consumer.inflight.values():
                if message.deadline > now:
                    break
                expired.append(message)
            if expired:
                self._take_back(consumer, expired, now)
            first = next(iter(consumer.inflight.values()), None)
            if first is not None and not consumer.lease_due:
                self._schedule(consumer, first.deadline)

    def _take_back(self, consumer: _Consumer, expired: list[_Message], now: float) -> None:
        """Return ``expired`` and every later delivery of their keys on ``consumer`` (G2); it is now stuck.

        In unordered mode there is no key order to keep: only ``expired`` come back.
        """
        firsts: dict[bytes, int] = {}
        messages = []
        for message in expired:
            if message.kb is None or self._unordered:
                messages.append(message)
            elif message.position < firsts.get(message.kb, message.position + 1):
                firsts[message.kb] = message.position  # the oldest: an extension puts deadlines out of position order
        messages += [
            m for m in consumer.inflight.values() if m.kb is not None and m.kb in firsts and m.position >= firsts[m.kb]
        ]
        remembered = consumer.expired
        for message in messages:
            remembered[message.position] = now
        while len(remembered) > _EXPIRED_REMEMBERED:
            remembered.popitem(last=False)
        consumer.expired_count += len(expired)
        self._expired_total += len(expired)
        returned = self._return_inflight(consumer, messages, "ack timeout")
        if consumer.stuck:
            for state in returned:
                self._reroute(state)
            return
        # Stuck: its ranges go to the others as if it had left (its other keys drain as usual).
        consumer.stuck = True
        self._sample(now)
        self._apply(self._leave_plan(consumer.cid, now), now, "stuck", consumer.cid, returned)

    def _recover(self, consumer: _Consumer) -> None:
        """A stuck consumer showed progress: it rejoins as a joiner."""
        consumer.stuck = False
        now = self._sample()
        planned = self._policy.join(self._map, consumer.cid, self._change_load(now, consumer.cid, leave=False))
        if consumer.cid not in planned:
            self._standby.append(consumer.cid)
        self._apply(planned, now, "recovered", consumer.cid, [])

    def _refusal(self, consumer: _Consumer, position: object, verb: str) -> NotInFlightError:
        """The error for an ack or nack of ``position``, which is not in flight on ``consumer``."""
        taken_back = consumer.expired.get(position) if type(position) is int else None
        if taken_back is None:
            return NotInFlightError(self._not_in_flight(consumer.cid, position, verb))
        return LeaseExpiredError(
            f"cannot {verb} position {position} on {consumer.cid!r}: its lease expired and it was taken back "
            f"at clock {taken_back:.3f} (ack_timeout {self._ack_timeout:g} s), so it is delivered again; "
            "expected an ack within ack_timeout of the delivery, or extend() while still working on it"
        )

    # -- internals: range changes ----------------------------------------------------

    def _leave_plan(self, cid: str, now: float) -> RangeMap:
        """The map without ``cid`` (its ranges to a standby or the others, those making progress if any may
        take them); a standby that inherits leaves the list."""
        standby = self._standby
        planned = self._policy.leave(self._map, cid, self._change_load(now, cid, leave=True), standby)
        if cid in standby:
            standby.remove(cid)
        else:
            heir = next((member for member in standby if member in planned), None)
            if heir is not None:
                standby.remove(heir)
        return planned

    def _apply(
        self, planned: RangeMap, now: float, reason: str, consumer: str | None, returned: list[_KeyState]
    ) -> None:
        """Install ``planned`` and re-route every key whose owner changed (G1).

        Only the keys of the moved slots are visited (through the per-slot lists), so a change
        costs in proportion to the keys that move, not to everything held.
        """
        self._reread_due = True
        old = self._map
        moved = moved_slots(old, planned)
        traffic = self._meter.traffic
        self._meter.set_rates(reassign_rates(old, planned, self._meter.rates, traffic, moved))
        self._map = planned
        ends, owner_ids = planned.lookup_table()
        self._ends = ends
        consumers = self._consumers
        self._owners = [None if cid == UNASSIGNED else consumers[cid] for cid in owner_ids]
        for first, last, _, to in moved:
            self._reroute_slots(first, last, None if to is None or to == UNASSIGNED else consumers[to])
        for state in returned:
            self._reroute(state)
        if planned.epoch != old.epoch:
            self._record(old, planned, moved, now=now, reason=reason, consumer=consumer)

    def _reroute_slots(self, first: int, last: int, owner: _Consumer | None) -> None:
        """Re-route the keys of slots ``first..last``, which all belong to ``owner`` now (G1): the hot loop
        of a change, walking the slots' key lists.

        It reads and sets each key's state only (one object a key): a waiting key is adopted by
        ``owner`` (see :meth:`_hand_over`), so the loop never reads a key's queue, head message or
        bytes, which lie scattered over everything held.
        """
        adopted: list[_KeyState] = []
        append = adopted.append
        for head in filter(None, self._slot_keys[first : last + 1]):
            state: _KeyState | None = head
            while state is not None:
                if state.inflight:
                    if state.holder is not owner:
                        self._drain(state)
                        state = state.next
                        continue
                    if state.draining:
                        self._release(state)
                if (
                    state.pending is not _NO_PENDING
                    and not (state.loose or state.backoff)
                    and (owner is None or state.queued_on is not owner)
                ):
                    state.queued_on = owner
                    append(state)
                state = state.next
        if adopted:
            if owner is not None:
                self._hand_over(owner, adopted)
            elif self._spill:
                self._unowned.update(state.slot for state in adopted)

    def _hand_over(self, owner: _Consumer, states: list[_KeyState]) -> None:
        """``owner`` adopts ``states`` (queued on it now): they wait in its list until it is next served,
        and it is woken when it has permits. The list is pruned when stale entries dominate."""
        adopted = owner.adopted
        adopted += states
        if self._too_stale(len(adopted)):
            owner.adopted = list(dict.fromkeys(state for state in adopted if state.queued_on is owner))
        if owner.permits:
            self._wake[owner] = None

    def _adopt(self, consumer: _Consumer) -> None:
        """Make the ready entries of the keys ``consumer`` adopted since it was last served (those still
        queued on it, at their heads now), before it is served: O(k log n) for k keys and a heap of n.

        A key adopted twice (its slots moved away and back) gets two equal entries; the second is
        stale once the first is served, as any entry whose position is no longer its key's head.
        """
        adopted = consumer.adopted
        consumer.adopted = []
        self._push_ready(
            consumer, [(state.pending[0].position, state.kb) for state in adopted if state.queued_on is consumer]
        )

    def _drain(self, state: _KeyState) -> None:
        """``state``'s key is in flight on a consumer that no longer owns it: it waits for those acks (G1)."""
        if not state.draining:
            state.draining = True
            state.drain_seq = self._changes + 1
            self._draining_since[state.drain_seq] = self._draining_since.get(state.drain_seq, 0) + 1
        state.queued_on = None

    def _push_ready(self, owner: _Consumer, heads: list[tuple[int, bytes]]) -> None:
        """Put keys' ``(head position, key)`` on ``owner``'s ready heap (their ``queued_on`` is set): one
        heapify when they outnumber the heap; compact it when stale entries dominate."""
        ready = owner.ready
        if len(heads) > len(ready):
            ready += heads
            heapq.heapify(ready)
        else:
            for entry in heads:
                heapq.heappush(ready, entry)
        if self._too_stale(len(owner.ready)):
            self._compact(owner)

    def _pushed(self, owner: _Consumer) -> None:
        """A key went on ``owner``'s ready heap: compact it when stale entries dominate, and wake it."""
        if self._too_stale(len(owner.ready)):
            self._compact(owner)
        if owner.permits:
            self._wake[owner] = None

    def _too_stale(self, entries: int) -> bool:
        """Whether a ready heap or adopted list of ``entries`` is mostly stale (more than 4 per held key)."""
        return entries > 64 and entries > 4 * len(self._keys)

    def _reroute(self, state: _KeyState) -> None:
        """After the map changed, move ``state``'s key to its slot's owner: drain it off its old holder, or queue it
        anew."""
        owner = self._owner_of_slot(state.slot)
        if state.inflight:
            if state.holder is not owner:
                self._drain(state)
                return
            if state.draining:
                self._release(state)
        if state.pending and (owner is None or state.queued_on is not owner) and not (state.loose or state.backoff):
            self._queue(state, owner)

    def _record(
        self,
        old: RangeMap,
        new: RangeMap,
        moved: list[tuple[int, int, str | None, str | None]],
        *,
        now: float,
        reason: str,
        consumer: str | None,
    ) -> None:
        """Record a change of the range map from ``old`` to ``new`` in the history and the counters."""
        traffic = self._meter.traffic
        moved_count = sum(last - first + 1 for first, last, _, _ in moved)
        total = float(traffic.sum())
        if total > 0.0:
            moved_traffic = sum(float(traffic[first : last + 1].sum()) for first, last, _, _ in moved)
            stickiness = 1.0 - moved_traffic / total
        else:
            stickiness = 1.0 - moved_count / self._size
        if not len(old):
            stickiness = 1.0
        draining = sum(self._draining_since.values())
        self._changes += 1
        self._rebalances[reason] += 1
        event = RebalanceEvent(new.epoch, now, reason, consumer, moved_count, stickiness, draining, None)
        change = _Change(self._changes, event)
        self._history.append(change)
        if draining:
            self._undrained.append(change)
        else:
            change.drained_at = now
            self._drain_seconds.observe(0.0)

    def _release(self, state: _KeyState) -> None:
        """``state`` stops draining; mark the changes that no longer wait for any key drained."""
        state.draining = False
        self._reread_due = True
        since = self._draining_since
        left = since[state.drain_seq] - 1
        if left:
            since[state.drain_seq] = left
            return
        del since[state.drain_seq]
        oldest_blocking = next(iter(since), self._changes + 1)
        undrained = self._undrained
        if undrained and undrained[0].seq < oldest_blocking:
            now = self._clock()
            while undrained and undrained[0].seq < oldest_blocking:
                change = undrained.popleft()
                change.drained_at = now
                self._drain_seconds.observe(max(now - change.event.time, 0.0))

    def _check_backlog(self, now: float) -> None:
        """A consumer whose waiting messages keep growing while another has idle permits sheds range.

        The policy's shift decides, on the measured traffic plus each slot's waiting messages
        (ready to go, not blocked by draining): what a slow consumer cannot take counts as
        load on it, so the shift moves as little range as makes the loads even again. Only a
        consumer making progress counts as idle: one with nothing in flight, or that acked
        since the last check. One that takes messages and acks none (its application may be
        blocked) has its in-flight messages counted as load too, so no range goes to it.
        """
        self._last_backlog = now
        owner_of = self._owner_of_slot
        waiting: Counter[str] = Counter()
        per_slot: Counter[int] = Counter()
        for state in self._keys.values():
            if state.pending and not (state.draining or state.loose or state.backoff):
                owner = owner_of(state.slot)
                if owner is not None:
                    waiting[owner.cid] += len(state.pending)
                    per_slot[state.slot] += len(state.pending)
        seen, self._backlog_seen = self._backlog_seen, dict(waiting)
        acked_seen = self._backlog_acked
        self._backlog_acked = {cid: c.acked for cid, c in self._consumers.items()}
        least = self._backlog_min
        growing = [c for c, count in waiting.items() if count >= least and count > seen.get(c, count)]
        idle = False
        busy: list[_Consumer] = []  # not acking: what they hold is load the policy must not add to
        for cid, consumer in self._consumers.items():
            if not consumer.inflight or consumer.acked > acked_seen.get(cid, consumer.acked):
                idle = idle or bool(consumer.permits and not waiting[cid] and not consumer.stuck)
            else:
                busy.append(consumer)
        if not growing or not idle:
            return
        self._sample(now)
        traffic = self._with_inflight(self._meter.traffic, busy)
        slots = np.fromiter(per_slot.keys(), np.intp, len(per_slot))
        traffic[slots] += np.fromiter(per_slot.values(), np.float64, len(per_slot))
        planned = self._policy.shift(self._map, Load(self._meter.rates, traffic))
        if planned is not None:
            self._apply(planned, now, "backlog", None, [])
            self._backlog_seen = {}

    def _maybe_shift(self, now: float) -> None:
        """Sample the load and let the policy move ranges off an overloaded consumer, when its plan moves any."""
        self._sample(now)
        self._last_shift = now
        planned = self._policy.shift(self._map, self._load())
        if planned is not None:
            self._apply(planned, now, "shift", None, [])

    # -- internals: measurement and checks -------------------------------------------

    def _sample(self, now: float | None = None) -> float:
        """Fold the deliveries into the rates and traffic, and note which consumers showed progress."""
        if now is None:
            now = self._clock()
        consumers = self._consumers
        self._meter.sample(now, {cid: c.delivered for cid, c in consumers.items()})
        for consumer in consumers.values():
            answers = consumer.acked + consumer.answered
            if answers != consumer.answers_seen:
                consumer.answers_seen = answers
                consumer.answered_at = now
            if not consumer.inflight:
                consumer.holding_since = None
            elif consumer.holding_since is None:
                consumer.holding_since = now
        self._last_sample = now
        return now

    def _load(self) -> Load:
        """The load the policies weigh: each consumer's dispatch rate and each slot's traffic."""
        return Load(self._meter.rates, self._meter.traffic)

    def _progressing(self, consumer: _Consumer, now: float) -> bool:
        """Whether ``consumer`` makes progress, so that a join or a leave may give it slots.

        Not when stuck or at its unacked limit. Otherwise yes when it answered (ack, nack,
        extension) within ``half_life`` seconds; failing that, not without permits, and not
        when it has held deliveries for ``half_life`` seconds. Samples (a poll at most once a
        second, and every change) see an answer and the start of holding no earlier than they
        came, so a consumer is never called stalled sooner than ``half_life`` after either.
        O(1): acks only count, as they did.
        """
        if consumer.stuck or consumer.unacked_blocked:
            return False
        if consumer.acked + consumer.answered != consumer.answers_seen or now - consumer.answered_at < self._half_life:
            return True  # it answered since the last sample, or within half_life
        if not consumer.permits:
            return False
        since = consumer.holding_since
        return not consumer.inflight or since is None or now - since < self._half_life

    def _change_load(self, now: float, cid: str, *, leave: bool) -> Load:
        """The load a join of (``leave``: a leave by) ``cid`` is planned on.

        The members that are not making progress, ``cid`` aside, are ``closed``: they gain no
        slots. In a join what they hold in flight counts as traffic of its slots, load the
        joiner may take from them; a leave leaves their load alone, so it is not counted. With
        every other member closed a leave is planned on the measured load alone, as the
        policies would plan it anyway; so is every change of a sticky subscription, whose
        ranges are declared.
        """
        if isinstance(self._policy, StickyPolicy):
            return self._load()
        progressing = self._progressing
        closed = [c for member, c in self._consumers.items() if member != cid and not progressing(c, now)]
        if not closed or (leave and len(closed) == len(self._consumers) - 1):
            return self._load()
        traffic = self._meter.traffic
        holding = [] if leave else [c for c in closed if c.inflight]
        if holding:
            traffic = self._with_inflight(traffic, holding)
        return Load(self._meter.rates, traffic, frozenset(c.cid for c in closed))

    def _with_inflight(self, traffic: npt.NDArray[np.float64], consumers: list[_Consumer]) -> npt.NDArray[np.float64]:
        """A copy of ``traffic`` with every keyed message in flight on ``consumers`` added to its slot."""
        slots = np.array([message.slot for consumer in consumers for message in consumer.inflight.values()], np.intp)
        added = np.array(traffic, dtype=np.float64)
        np.add.at(added, slots[slots >= 0], 1.0)  # keyless ones are at slot -1
        return added

    def _audit(self) -> None:
        """Check every internal invariant; raises AssertionError naming the first broken one.

        O(state); for tests, which call it after every step of a random run.
        """
        inflight_by_key: Counter[bytes] = Counter()
        loose_by_key: Counter[bytes] = Counter()
        held = len(self._fresh) + len(self._keyless) + len(self._dead_out) + len(self._dead_unconfirmed)
        held += len(self._delayed) + len(self._timed)
        assert self._unordered or all(m.kb is None for _, _, m in self._delayed), "a keyed message delayed alone"
        assert all(m.flags & _DELAYED for _, _, m in self._timed), "a delayed message not flagged"
        timed_slots = Counter(m.slot for _, _, m in self._timed if m.kb is not None)
        assert timed_slots == self._timed_slots, f"delayed messages per slot {self._timed_slots} != {timed_slots}"
        assert set(self._due_at) <= {m.position for m in self._fresh}, "a deliver_at kept for a routed message"
        assert self._honours_delays or not self._timed, "a message delayed while delivery times are not honoured"
        if not self._unordered:
            shared = [m.position for m in self._keyless]
            assert shared == sorted(shared), "the shared queue is not in position order"
        backoffs = set(self._key_backoffs)
        timeout = self._ack_timeout
        scheduled = {id(entry[2]): entry[0] for entry in self._leases}
        for consumer in self._consumers.values():
            held += len(consumer.inflight)
            if timeout and consumer.inflight:
                first = next(iter(consumer.inflight.values())).deadline
                assert consumer.lease_due and scheduled.get(id(consumer), first + 1) <= first, f"{consumer.cid}: lease"
                deadlines = [m.deadline for m in consumer.inflight.values()]
                assert deadlines == sorted(deadlines), f"{consumer.cid}: in-flight not in deadline order"
            assert not (consumer.stuck and consumer.cid in self._map), f"{consumer.cid}: stuck with ranges"
            if consumer.unacked_blocked:
                assert not consumer.permits and len(consumer.inflight) > self._unacked_resume, f"{consumer.cid}: limit"
            else:
                assert not consumer.withheld, f"{consumer.cid}: withheld permits while not blocked"
                assert not self._unacked_limit or len(consumer.inflight) < self._unacked_limit, consumer.cid
            assert not (consumer.stuck and consumer.cid in self._standby), f"{consumer.cid}: stuck standby"
            waking = consumer in self._wake or not (consumer.permits and consumer.adopted)
            assert waking, f"{consumer.cid}: adopted keys and permits, not woken"
            for message in consumer.inflight.values():
                if message.flags & _LOOSE:
                    assert message.kb is not None, "a keyless loose delivery"
                    loose_by_key[message.kb] += 1
                elif message.kb is not None:
                    inflight_by_key[message.kb] += 1
                    found = self._keys.get(message.kb)
                    assert found is not None and found.holder is consumer, f"{message.kb!r}: holder mismatch"
        adopted = {(id(consumer), id(state)) for consumer in self._consumers.values() for state in consumer.adopted}
        for kb, state in self._keys.items():
            held += len(state.pending)
            assert state.inflight == inflight_by_key[kb], f"{kb!r}: inflight count {state.inflight}"
            assert state.loose == loose_by_key[kb], f"{kb!r}: loose count {state.loose}"
            assert (state.holder is None) == (state.inflight == 0), f"{kb!r}: holder without inflight"
            assert state.pending or state.inflight or state.loose, f"{kb!r}: empty state kept"
            assert not (self._unordered and state.pending), f"{kb!r}: keyed queue in unordered mode"
            positions = [m.position for m in state.pending]
            assert positions == sorted(positions), f"{kb!r}: pending out of order"
            in_order = [m.position for m in state.pending if not m.flags & _DELAYED]
            if state.holder is not None and in_order:
                top = max(p for p, m in state.holder.inflight.items() if m.kb == kb and not m.flags & _LOOSE)
                assert top < in_order[0], f"{kb!r}: pending {in_order[0]} not after in-flight {top}"
            if state.backoff:
                assert state.pending and not self._unordered, f"{kb!r}: backoff without pending messages"
                assert (state.backoff, kb) in backoffs, f"{kb!r}: backoff {state.backoff} not scheduled"
            owner = self._owner_of_slot(state.slot)
            assert state.draining == (state.inflight > 0 and state.holder is not owner), f"{kb!r}: draining flag"
            queued = bool(state.pending) and not state.draining and owner is not None
            queued = queued and not (state.loose or state.backoff)
            assert state.queued_on is owner if queued else state.queued_on is None, f"{kb!r}: queued_on"
            if queued and owner is not None:
                listed = (positions[0], kb) in owner.ready or (id(owner), id(state)) in adopted
                assert listed, f"{kb!r}: neither in {owner.cid}'s ready heap nor adopted by it"
            assert (state.pending is _NO_PENDING) == (not state.pending), f"{kb!r}: an empty queue of its own"
        linked = 0
        for head in filter(None, self._slot_keys):
            assert head.prev is None and self._slot_keys[head.slot] is head, f"{head.kb!r}: not first in its slot"
            for linked_state in self._keys_in(head.slot, head.slot):
                kb = linked_state.kb
                assert linked_state.slot == head.slot and self._keys.get(kb) is linked_state, f"{kb!r}: stale link"
                assert linked_state.next is None or linked_state.next.prev is linked_state, f"{kb!r}: broken link"
                linked += 1
        assert linked == len(self._keys), f"{linked} keys in the slot lists, {len(self._keys)} held"
        since = Counter(state.drain_seq for state in self._keys.values() if state.draining)
        assert since == Counter(self._draining_since), f"draining by change {since} != {self._draining_since}"
        assert held == self._held, f"held {self._held}, counted {held}"
        assert self._spill or not self._parked, "parked without spill"
        last = self._last_position
        assert all(last is not None and first <= last + 1 for first in self._parked.values()), "parked past the end"
        assert self._held <= self._held_bound, f"held {self._held} above max_replay {self._max_replay}"
        stuck = {cid for cid, consumer in self._consumers.items() if consumer.stuck}
        owning = set(self._map.consumers()) - {UNASSIGNED}
        assert set(self._consumers) == owning | set(self._standby) | stuck, "membership"
        assert set(self._declared) == set(self._declared_here), "declared in the block"
        indexed = sorted((start, (end, cid)) for cid, ranges in self._declared.items() for start, end in ranges)
        assert list(self._declared_index.items()) == indexed, "the declared ranges' index"
        assert set(self._declared) <= set(self._consumers), "declared by a consumer that left"
        for cid in owning if self._policy.name == StickyPolicy.name else ():
            joined: list[tuple[int, int]] = []
            for start, end in self._declared_here[cid]:
                joined.append((joined.pop()[0], end) if joined and joined[-1][1] + 1 == start else (start, end))
            assert self._map.ranges_of(cid) == joined, f"{cid}: owns {self._map.ranges_of(cid)}, declared {joined}"

    def _consumer(self, cid: object) -> _Consumer:
        """The connected consumer ``cid``; raises :class:`UnknownConsumerError` naming the known ones when it is not."""
        consumer = self._consumers.get(cid) if isinstance(cid, str) else None
        if consumer is None:
            if not isinstance(cid, str) or not cid:
                raise ConsumerError(f"consumer id must be a non-empty str, not {cid!r}")
            known = ", ".join(repr(c) for c in list(self._consumers)[:10]) or "none"
            raise UnknownConsumerError(f"consumer {cid!r} is not connected; known consumers: {known}")
        return consumer

    def _not_in_flight(self, cid: str, position: object, verb: str) -> str:
        """Why ``cid`` cannot ``verb`` ``position``: not an int, or not in flight on it."""
        if type(position) is not int:
            return f"cannot {verb} position {position!r} on {cid!r}: expected an int position in flight"
        return f"cannot {verb} position {position} on {cid!r}: it is not in flight on that consumer"
