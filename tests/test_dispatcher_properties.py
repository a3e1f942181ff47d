"""Property tests of the dispatcher core against guarantees G1-G7 (docs: /work/shared/DESIGN.md).

A :class:`hypothesis.stateful.RuleBasedStateMachine` drives one :class:`Dispatcher` with a
manual clock and keeps its own reference model of what was published, what is in flight on
which consumer and what was acked. Every delivery is checked against the model when it
comes out of ``poll`` (G1, G2, permits, redelivery counts); after every poll the model
checks that nothing which could go out was held back (G5); after every step it checks the
bound (G4), the range tiling and the per-consumer stats. The teardown drains everything
and checks that every published position was acked exactly once (G3). The machine runs
once per rebalance policy (several ranges per consumer, and PIP-34's one range each), with
and without boundary shifts, and with leases and a redelivery limit (G7): the model then
also predicts which deliveries expire at each poll, which consumers are stuck, and which
messages must be dead-lettered instead of delivered again; and with consume-mode switches
(unordered mode: any consumer, no order; back in ordered mode a key with deliveries still
out from unordered mode waits for them). Messages published with a ``deliver_at`` (Pulsar's
delayed delivery) never go out before it; until then they block nothing (G2 and G5 are
checked as if they were not there), and from then on they count as waiting messages of their
key. Keyless messages go out in position order, redeliveries included.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from keyfailover import Delivery, Dispatcher
from keyfailover.core.clock import ManualClock
from keyfailover.core.dispatcher import DeadLetter
from keyfailover.core.errors import (
    BufferFullError,
    ConfigError,
    ConsumerError,
    DuplicateConsumerError,
    InvalidKeyError,
    KeyFailoverError,
    LeaseExpiredError,
    NotInFlightError,
    PermitsError,
    PositionError,
    UnknownConsumerError,
)
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_bytes, key_hash
from keyfailover.core.ranges import RangeMap
from keyfailover.core.rebalance import UNASSIGNED, ContiguousPolicy, MultiRangePolicy, StickyPolicy

Key = str | bytes | None

NAMES = ("c1", "c2", "c3", "c4")

# Zipf-like: earlier entries repeat more often. "hot" and b"hot" (and "warm", b"warm")
# are one key each; None is keyless.
KEY_POOL: tuple[Key, ...] = (
    *(["hot"] * 4),
    *([b"hot"] * 2),
    *([None] * 2),
    *(["warm"] * 2),
    b"warm",
    "k3",
    "k4",
    "\u00fc5",
    b"k6",
    "k7",
)
DISTINCT_KEYS: tuple[str | bytes, ...] = ("hot", b"hot", "warm", b"warm", "k3", "k4", "\u00fc5", b"k6", "k7")

CLOCK_STEPS = (0.0, 0.25, 1.0, 2.5, 7.0, 31.0)

MAX_REPLAY = 20


@dataclass(frozen=True)
class Published:
    position: int
    key: Key
    kb: bytes | None
    payload: object


@dataclass
class Model:
    """What the dispatcher must be holding, kept independently of it."""

    max_replay: int
    ack_timeout: float = 0.0
    max_redeliveries: int | None = None
    held_above: int = 0  # held when max_replay was lowered under it: held may stay up to this, never grow
    consumers: list[str] = field(default_factory=list)
    permits: dict[str, int] = field(default_factory=dict)
    messages: dict[int, Published] = field(default_factory=dict)
    by_key: dict[bytes, list[int]] = field(default_factory=dict)
    holder: dict[int, str] = field(default_factory=dict)  # in-flight position -> consumer
    deadline: dict[int, float] = field(default_factory=dict)  # in-flight position -> its lease's end
    acked: Counter[int] = field(default_factory=Counter)
    delivered: Counter[int] = field(default_factory=Counter)
    came_back: dict[int, str] = field(default_factory=dict)  # why its last delivery came back
    failures: Counter[int] = field(default_factory=Counter)  # came back as the oldest of its key, or keyless
    stuck: set[str] = field(default_factory=set)
    dead: set[int] = field(default_factory=set)  # dead-lettered, not confirmed stored
    buried: Counter[int] = field(default_factory=Counter)  # dead-lettered and confirmed
    taken_back: dict[str, set[int]] = field(default_factory=dict)  # consumer -> positions taken at a deadline
    unordered: bool = False
    loose: set[int] = field(default_factory=set)  # in-flight positions delivered in unordered mode
    unacked_limit: int = 0
    blocked: set[str] = field(default_factory=set)  # consumers at their unacked limit
    routed_through: int = -1  # the last position published before the last poll
    last_position: int = -1
    nack_backoff: float = 0.0
    nack_backoff_max: float = 60.0
    backoff: dict[bytes, float] = field(default_factory=dict)  # ordered mode: key -> when its nack backoff ends
    delayed: dict[int, float] = field(default_factory=dict)  # keyless or unordered: position -> its backoff's end
    deliver_at: dict[int, float] = field(default_factory=dict)  # published with a delivery time: position -> it
    polled_at: float = -math.inf  # the clock reading of the last poll
    restored_due: set[int] = field(default_factory=set)  # restored since the last poll with a delivery time past

    # -- derived -----------------------------------------------------------------------

    def held(self) -> int:
        return len(self.messages) - len(self.acked) - len(self.buried)

    def is_pending(self, position: int) -> bool:
        return (
            position not in self.acked
            and position not in self.holder
            and position not in self.dead
            and position not in self.buried
        )

    def pending(self) -> list[int]:
        return [p for p in self.messages if self.is_pending(p)]

    def scheduled(self, position: int) -> bool:
        """Whether ``position`` waits for its delivery time, as of the last poll."""
        return self.deliver_at.get(position, -math.inf) > self.polled_at

    def eligible(self, position: int) -> bool:
        """Pending and not waiting for its delivery time: what G2 and G5 are about."""
        return self.is_pending(position) and not self.scheduled(position)

    def inflight_on(self, consumer: str) -> list[int]:
        return sorted(p for p, c in self.holder.items() if c == consumer)

    def holders_of(self, kb: bytes) -> set[str]:
        return {self.holder[p] for p in self.by_key[kb] if p in self.holder}

    # -- events ------------------------------------------------------------------------

    def publish(self, position: int, key: Key, payload: object, deliver_at: float = 0.0) -> None:
        kb = None if key is None else key_bytes(key)
        self.messages[position] = Published(position, key, kb, payload)
        if deliver_at:
            self.deliver_at[position] = deliver_at
        if kb is not None:
            self.by_key.setdefault(kb, []).append(position)
        self.last_position = position

    def add(self, consumer: str) -> None:
        self.consumers.append(consumer)
        self.permits[consumer] = 0
        self.taken_back[consumer] = set()

    def remove(self, consumer: str) -> None:
        self.consumers.remove(consumer)
        del self.permits[consumer]
        del self.taken_back[consumer]
        self.stuck.discard(consumer)
        self.blocked.discard(consumer)
        self.give_back(self.inflight_on(consumer), "consumer removed")

    def give_back(self, positions: list[int], reason: str, failed: int | None = None) -> None:
        """Return ``positions`` to pending. ``failed`` alone failed when given; else each key's
        oldest of them, every keyless one, every one from unordered mode, and in unordered mode all."""
        oldest: dict[bytes, int] = {}
        consumers = {self.holder[p] for p in positions}
        for p in positions:
            del self.holder[p]
            self.deadline.pop(p, None)
            self.came_back[p] = reason
            kb = self.messages[p].kb
            if failed is not None:
                self.failures[p] += p == failed
            elif kb is None or self.unordered or p in self.loose:
                self.failures[p] += 1
            elif kb not in oldest or p < oldest[kb]:
                oldest[kb] = p
            self.loose.discard(p)
        for p in oldest.values():
            self.failures[p] += 1
        for consumer in consumers:
            if consumer in self.permits:
                self.settle_limit(consumer)

    def can_take(self, consumer: str) -> bool:
        """Whether ``consumer`` may get a delivery: permits, not stuck, not at its unacked limit."""
        return self.permits[consumer] > 0 and consumer not in self.stuck and consumer not in self.blocked

    def settle_limit(self, consumer: str) -> None:
        """A consumer at its unacked limit gets deliveries again once down to half of it."""
        if consumer in self.blocked and len(self.inflight_on(consumer)) <= self.unacked_limit // 2:
            self.blocked.discard(consumer)

    def ack(self, consumer: str, position: int) -> None:
        assert self.holder.pop(position) == consumer
        self.deadline.pop(position, None)
        self.loose.discard(position)
        self.settle_limit(consumer)
        self.acked[position] += 1
        self.stuck.discard(consumer)

    def later_of_key(self, consumer: str, position: int) -> list[int]:
        """``position`` and every later delivery of its key on ``consumer`` (just it, when keyless)."""
        kb = self.messages[position].kb
        if kb is None:
            return [position]
        return [p for p in self.inflight_on(consumer) if p >= position and self.messages[p].kb == kb]

    def nack(self, consumer: str, position: int, now: float) -> list[int]:
        returned = self.later_of_key(consumer, position)
        self.give_back(returned, "nack", position)
        self.stuck.discard(consumer)
        if self.nack_backoff:
            end = now + min(self.nack_backoff * 2.0 ** (self.failures[position] - 1), self.nack_backoff_max)
            kb = self.messages[position].kb
            if kb is None or self.unordered:
                self.delayed[position] = end
            else:
                self.backoff[kb] = max(self.backoff.get(kb, 0.0), end)
            event("a nack backs off")
        return returned

    def end_backoffs(self, now: float) -> None:
        """What a poll at ``now`` releases: every backoff that ended by then."""
        self.backoff = {kb: end for kb, end in self.backoff.items() if end > now}
        self.delayed = {p: end for p, end in self.delayed.items() if end > now}

    def backing_off(self, position: int) -> bool:
        """Whether ``position`` waits for a nack backoff (its own, or in ordered mode its key's)."""
        kb = self.messages[position].kb
        return position in self.delayed or (kb is not None and not self.unordered and kb in self.backoff)

    def expire(self, now: float) -> None:
        """What a poll at ``now`` takes back first: every lease due, with its key's later deliveries
        (G7, G2; in unordered mode, no order to keep: only those due)."""
        due = sorted(p for p, deadline in self.deadline.items() if deadline <= now)
        returned: set[int] = set()
        for p in due:
            consumer = self.holder[p]
            returned.update([p] if self.unordered else self.later_of_key(consumer, p))
            self.stuck.add(consumer)
            event("a lease expired")
        for p in returned:
            self.taken_back[self.holder[p]].add(p)
        self.give_back(sorted(returned), "ack timeout")

    def must_dead_letter(self, position: int) -> bool:
        limit = self.max_redeliveries
        return limit is not None and self.failures[position] > limit


def parked_positions(d: Dispatcher, model: Model) -> set[int]:
    """Pending positions the dispatcher does not hold: those of a parked slot from its first parked position on."""
    parked = d._parked  # white box: slot (counted from the dispatcher's first slot) -> first position not held
    first = d.slots[0]
    return {
        p
        for p in model.pending()
        if (kb := model.messages[p].kb) is not None
        and p <= model.routed_through  # published since the last poll: held until routed
        and p >= parked.get(key_hash(kb) - first, model.last_position + 1)
    }


def owner_lookup(ranges: list[tuple[int, int, str]]) -> Callable[[int], str | None]:
    """Who owns a slot according to ``ranges`` (as returned by ``Dispatcher.ranges``); None for an unassigned one."""
    ends = [end for _, end, _ in ranges]
    owners = [None if consumer == UNASSIGNED else consumer for _, _, consumer in ranges]

    def owner(slot: int) -> str | None:
        return owners[bisect.bisect_left(ends, slot)] if owners else None

    return owner


def poll_and_check(d: Dispatcher, model: Model, now: float) -> list[Delivery]:
    """Poll at clock ``now``: the model takes back the leases due first, then checks the dead letters and
    deliveries; then it plays the IO layer's log, restoring what rereads() asks for."""
    model.expire(now)
    model.end_backoffs(now)
    model.polled_at = now
    model.restored_due.clear()
    out = d.poll()
    model.routed_through = model.last_position
    check_dead_letters(model, d.dead_letters())
    check_poll(d, model, out, now)
    reread(d, model)
    return out


def reread(d: Dispatcher, model: Model) -> None:
    """Re-read the parked slots rereads() names from the model's log, in position order, while the bound allows."""
    slots = d.rereads()
    if not slots:
        return
    event("parked slots re-read")
    through = model.last_position
    for position, message in sorted(model.messages.items()):
        slot = None if message.kb is None else key_hash(message.kb)
        if slot not in slots or position < slots[slot] or position in model.acked or position in model.buried:
            # Not parked, or settled: the server's cursor skips what it acked, stored dead letters included.
            # A dead letter not confirmed yet is not skipped (the server cannot tell it apart): the
            # dispatcher must never park a slot from before one.
            continue
        if not d.wants():
            through = position - 1
            break
        deliver_at = model.deliver_at.get(position, 0.0)
        d.restore(position, message.key, message.payload, deliver_at=deliver_at)
        if deliver_at and not model.scheduled(position):
            model.restored_due.add(position)  # it waits in the dispatcher's heap until the next poll
    d.restored(slots, through)


def check_dead_letters(model: Model, letters: list[DeadLetter]) -> None:
    """Every dead letter came back more than max_redeliveries times and was pending; mark it dead."""
    for letter in letters:
        position = letter.position
        message = model.messages.get(position)
        assert message is not None, f"{letter}: never published"
        assert model.is_pending(position), f"{letter}: was not pending"
        assert model.must_dead_letter(position), f"{letter}: failed {model.failures[position]} time(s) only"
        assert letter.redelivery_count == model.delivered[position] - 1, f"{letter}: {model.delivered[position]}"
        assert letter.key == message.key and letter.payload is message.payload, f"{letter}: {message}"
        assert letter.reason == model.came_back[position], f"{letter}: came back by {model.came_back[position]}"
        model.dead.add(position)
        event("dead-lettered")


def check_poll(d: Dispatcher, model: Model, out: list[Delivery], now: float = 0.0) -> None:
    """Check one poll's deliveries against the model, then update the model with them."""
    assert isinstance(out, list)
    owner = owner_lookup(d.ranges())
    for delivery in out:
        assert isinstance(delivery, Delivery)
        consumer, position = delivery.consumer, delivery.position
        assert consumer in model.permits, f"{delivery} went to a consumer that is not present"
        assert model.permits[consumer] > 0, f"{delivery}: {consumer} had no permits left"
        message = model.messages.get(position)
        assert message is not None, f"{delivery}: position was never published"
        assert position not in model.acked, f"{delivery}: position was already acked"
        assert position not in model.holder, f"{delivery}: position is already in flight on {model.holder[position]}"
        assert delivery.key == message.key, f"{delivery}: published with key {message.key!r}"
        assert type(delivery.key) is type(message.key)
        assert delivery.payload is message.payload
        assert delivery.redelivery_count == model.delivered[position], (
            f"{delivery}: position was delivered {model.delivered[position]} time(s) before"
        )
        assert consumer not in model.stuck, f"{delivery}: {consumer} is stuck"
        assert not model.scheduled(position), (
            f"{delivery}: before its delivery time {model.deliver_at[position]} (polled at {model.polled_at})"
        )
        assert consumer not in model.blocked, f"{delivery}: {consumer} is at its unacked limit"
        if message.kb is not None and not model.unordered:
            holders = model.holders_of(message.kb)
            assert holders <= {consumer}, f"G1: {delivery} while key has unacked deliveries on {sorted(holders)}"
            expected_owner = owner(key_hash(message.kb))
            assert consumer == expected_owner, (
                f"{delivery}: key hash {key_hash(message.kb)} is owned by {expected_owner} in {d.ranges()}"
            )
            smallest = min(p for p in model.by_key[message.kb] if model.eligible(p))
            assert position == smallest, f"G2: {delivery} but position {smallest} of that key is still pending"
        if message.kb is None and not model.unordered:
            older = [
                p
                for p in model.pending()
                if p < position and model.messages[p].kb is None and model.eligible(p) and not model.backing_off(p)
            ]
            assert not older, f"{delivery} while keyless position {older[0]} waits: keyless ones go in position order"
        assert not model.must_dead_letter(position), f"{delivery}: past max_redeliveries, expected a dead letter"
        assert not model.backing_off(position), f"G5: {delivery} before its nack backoff ended"
        if delivery.redelivery_count:
            event("redelivery")
        model.permits[consumer] -= 1
        model.holder[position] = consumer
        model.delivered[position] += 1
        if model.unacked_limit and len(model.inflight_on(consumer)) >= model.unacked_limit:
            model.blocked.add(consumer)
            event("a consumer reached its unacked limit")
        model.taken_back[consumer].discard(position)
        if model.unordered and message.kb is not None:
            model.loose.add(position)
        if model.ack_timeout:
            model.deadline[position] = now + model.ack_timeout
    check_nothing_held_back(d, model)
    parked = parked_positions(d, model)
    assert d.stats()["replay"] == len(model.pending()) - len(parked), "after a poll every held pending message waits"


def check_nothing_held_back(d: Dispatcher, model: Model) -> None:
    """After a poll, no pending message may be deliverable (G5: nothing waits needlessly)."""
    owner = owner_lookup(d.ranges())
    parked = parked_positions(d, model)
    if model.unordered:  # every waiting message goes to any consumer with permits
        waiting = [p for p in model.pending() if p not in parked and model.eligible(p) and not model.backing_off(p)]
        with_permits = sorted(c for c in model.permits if model.can_take(c))
        assert not (waiting and with_permits), f"unordered: {waiting[:3]} pending while {with_permits} have permits"
        return
    for kb, positions in model.by_key.items():
        pending = [p for p in positions if model.eligible(p)]
        if not pending or any(p in model.loose for p in positions):
            continue  # nothing waits, or the key waits for its deliveries from unordered mode
        if pending[0] in parked:
            event("a key waits in the log: its slot is parked")
            continue  # the IO layer re-reads it once rereads() names the slot
        if kb in model.backoff:
            continue  # it goes on when its backoff ends (other keys do not wait for it: checked below)
        key_owner = owner(key_hash(kb))
        holders = model.holders_of(kb)
        if not holders <= {key_owner}:
            event("a pending key is draining: unacked on a former owner")
        if key_owner is None or not model.can_take(key_owner):
            continue
        assert not holders <= {key_owner}, (
            f"G5: key {kb!r} has position {pending[0]} pending, is not blocked (unacked on {sorted(holders)}), "
            f"and its owner {key_owner} has {model.permits[key_owner]} permit(s)"
        )
    keyless = [
        p for p in model.pending() if model.messages[p].kb is None and model.eligible(p) and not model.backing_off(p)
    ]
    with_permits = sorted(c for c in model.permits if model.can_take(c))
    assert not (keyless and with_permits), f"keyless position {keyless[0]} pending while {with_permits} have permits"


def check_ranges(d: Dispatcher, model: Model) -> None:
    """The range map tiles the space; the contiguous policy gives one range per consumer, the
    multi-range policy at most max_ranges, never two adjacent ones of one consumer; under the
    sticky policy every consumer owns exactly what it declared (of the block), the rest is unassigned."""
    ranges = d.ranges()
    first, last = d.slots
    policy = d.policy
    if isinstance(policy, StickyPolicy):
        declared = {c: d.declared_ranges(c) for c in model.consumers}
        for consumer, theirs in declared.items():
            owned = [(start, end) for start, end, c in ranges if c == consumer]
            expected = merged(theirs or []) if consumer not in model.stuck else []
            assert owned == expected, f"{consumer} owns {owned}, declared {theirs}"
    if not (model.consumers if isinstance(policy, StickyPolicy) else set(model.consumers) - model.stuck):
        assert ranges == []  # a sticky map is all unassigned rather than empty while anyone is present
    else:
        assert ranges[0][0] == first
        assert ranges[-1][1] == last
        for (_, end, below), (start, _, above) in pairwise(ranges):
            assert start == end + 1, f"ranges do not tile: {ranges}"
            assert below != above, f"two adjacent ranges of {below}: {ranges}"
        assert all(start <= end for start, end, _ in ranges)
        counts = Counter(consumer for _, _, consumer in ranges if consumer != UNASSIGNED)
        limit = policy.range_limit
        assert max(counts.values(), default=0) <= limit, f"more than {limit} range(s) for one consumer: {ranges}"
        # Every consumer owns a range, is a standby, which owns none, or is stuck (G7), which owns
        # none either. With 65536 slots and at most four consumers the contiguous policy never
        # leaves one a standby.
        standby = {c for c, entry in d.stats()["consumers"].items() if entry["standby"]}
        live = set(model.consumers) - model.stuck
        assert set(counts) | standby == live, f"ranges {ranges} vs consumers {model.consumers}, stuck {model.stuck}"
        assert not set(counts) & standby, f"standby {standby} own ranges: {ranges}"
        if standby:
            event("a join left a consumer a standby")
            assert isinstance(policy, MultiRangePolicy), f"standby {standby} under {policy}"


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ``ranges`` with adjacent ones joined (as a range map holds them)."""
    joined: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        joined.append((joined.pop()[0], end) if joined and joined[-1][1] + 1 == start else (start, end))
    return joined


def check_state(d: Dispatcher, model: Model) -> None:
    """The invariants that hold between any two calls."""
    d._audit()  # the core's own internal invariants (heaps, holders, draining bookkeeping)
    # G4: the bound.
    parked = parked_positions(d, model)
    held = model.held() - len(parked)
    assert held <= max(model.max_replay, model.held_above)
    assert d.wants() == max(model.max_replay - held, 0)
    # G1: every key's unacked deliveries sit on one consumer (but those made in unordered mode).
    owner = owner_lookup(d.ranges())
    for kb, positions in model.by_key.items():
        holders = model.holders_of(kb)
        if any(p in model.loose for p in positions):
            continue
        assert len(holders) <= 1
        if holders and holders != {owner(key_hash(kb))}:
            event("a key is unacked on a consumer that no longer owns it")
    check_ranges(d, model)
    ranges = d.ranges()
    snapshot = d.snapshot()
    first, last = d.slots
    assert snapshot["version"] == 2
    assert snapshot["range_size"] == last - first + 1  # a block's own map, counted from its first slot
    assert [(r["start"] + first, r["end"] + first, r["consumer"]) for r in snapshot["ranges"]] == ranges
    for key in DISTINCT_KEYS:
        assert d.owner_of(key) == owner(key_hash(key))
    # Operator stats agree with the model.
    stats = d.stats()
    waiting_for_time = {p for p in scheduled_positions(model) if p not in parked} | model.restored_due
    assert stats["delayed_messages"] == len(waiting_for_time), f"{stats['delayed_messages']}: {waiting_for_time}"
    # Messages published since the last poll may not have reached the replay buffer yet.
    assert stats["replay"] + stats.get("unrouted", 0) == len(model.pending()) - len(parked)
    backing_off = [
        p
        for p in model.pending()
        if model.backing_off(p) and p <= model.routed_through and p not in parked and p not in waiting_for_time
    ]  # a delayed message of a key in backoff waits for its time: it joins the key's queue then
    assert stats["backoff_messages"] == len(backing_off), f"{stats['backoff_messages']} in backoff: {backing_off}"
    assert stats["backoff_keys"] == len(model.backoff), f"{stats['backoff_keys']} keys in backoff: {model.backoff}"
    assert set(stats["consumers"]) == set(model.consumers)
    for consumer in model.consumers:
        entry = stats["consumers"][consumer]
        assert entry["stuck"] == (consumer in model.stuck), f"{consumer}: {entry}, stuck {model.stuck}"
        assert entry["unacked_limit_reached"] == (consumer in model.blocked), f"{consumer}: {entry}"
        assert entry["permits"] == model.permits[consumer], f"{consumer}: {entry}"
        assert entry["unacked"] == len(model.inflight_on(consumer)), f"{consumer}: {entry}"
        assert entry["ranges"] == [(start, end) for start, end, c in ranges if c == consumer]
        assert d.ranges_of(consumer) == entry["ranges"]


def scheduled_positions(model: Model) -> list[int]:
    """Pending positions routed by a poll that found their delivery time ahead: they wait for it."""
    return [p for p in model.deliver_at if p <= model.routed_through and model.is_pending(p) and model.scheduled(p)]


def fingerprint(d: Dispatcher) -> tuple[Any, ...]:
    """Everything observable without changing the dispatcher."""
    return d.ranges(), d.snapshot(), d.wants(), d.stats(), d.consumers()


class DispatcherMachine(RuleBasedStateMachine):
    """Random calls against one dispatcher (the default multi-range policy), checked against :class:`Model`."""

    def make(self, clock: ManualClock) -> Dispatcher:
        return Dispatcher(clock=clock, max_replay=MAX_REPLAY)

    def make_model(self) -> Model:
        return Model(MAX_REPLAY)

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock(1000.0)
        self.d = self.make(self.clock)
        self.model = self.make_model()
        self.payload_seq = 0

    def rejected(self, error: type[KeyFailoverError], call: Callable[[], object]) -> None:
        before = fingerprint(self.d)
        with pytest.raises(error) as info:
            call()
        assert str(info.value), "an error must say what was wrong"
        assert fingerprint(self.d) == before, f"rejected call changed the state ({info.value})"

    @initialize(
        names=st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True),
        permits=st.integers(0, 5),
        keys=st.lists(st.sampled_from(KEY_POOL), max_size=8),
        data=st.data(),
    )
    def start(self, names: list[str], permits: int, keys: list[Key], data: st.DataObject) -> None:
        """Consumers with a few permits and a few messages, so that every run has work to do."""
        for name in names:
            self.join(name, data)
            self.d.flow(name, permits)
            self.model.permits[name] += permits
        for key in keys:
            self.publish_one(key, 1)

    def join(self, name: str, data: st.DataObject) -> None:
        """``name`` joins the dispatcher and the model."""
        self.d.add_consumer(name)
        self.model.add(name)

    @precondition(lambda self: len(self.model.consumers) < len(NAMES))
    @rule(data=st.data())
    def add_consumer(self, data: st.DataObject) -> None:
        absent = [name for name in NAMES if name not in self.model.consumers]
        self.join(data.draw(st.sampled_from(absent), label="add"), data)

    @precondition(lambda self: bool(self.model.consumers))
    @rule(data=st.data())
    def remove_consumer(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self.model.consumers), label="remove")
        self.d.remove_consumer(name)
        self.model.remove(name)

    @precondition(lambda self: bool(self.model.consumers))
    @rule(data=st.data(), permits=st.integers(0, 5))
    def flow(self, data: st.DataObject, permits: int) -> None:
        name = data.draw(st.sampled_from(self.model.consumers), label="flow")
        self.d.flow(name, permits)
        self.model.permits[name] += permits
        self.model.stuck.discard(name)  # a flow is progress

    def publish_one(self, key: Key, gap: int, deliver_at: float = 0.0) -> None:
        position = self.model.last_position + gap
        self.payload_seq += 1
        payload = ("payload", self.payload_seq)
        if self.model.held() - len(parked_positions(self.d, self.model)) >= self.model.max_replay:
            event("publish at the bound")
            self.rejected(BufferFullError, lambda: self.d.publish(position, key, payload, deliver_at=deliver_at))
        else:
            self.d.publish(position, key, payload, deliver_at=deliver_at)
            self.model.publish(position, key, payload, deliver_at)

    @rule(
        key=st.sampled_from(KEY_POOL),
        gap=st.integers(1, 3),
        delay=st.sampled_from((-1.0, 0.0, 0.25, 2.0, 10.0)),
    )
    def publish_delayed(self, key: Key, gap: int, delay: float) -> None:
        """A message to go out ``delay`` seconds from now at the earliest (Pulsar's deliver_at_time); 0 or
        less: at once, as any other."""
        self.publish_one(key, gap, self.clock() + delay)
        if delay > 0:
            event("a delayed message")

    @rule(bound=st.integers(1, 2 * MAX_REPLAY))
    def set_max_replay(self, bound: int) -> None:
        """The bound changed live (a subscription's own setting): lowered under what is held, nothing is
        dropped and nothing more is taken until acks bring the held count under it (G3, G4)."""
        d, model = self.d, self.model
        held = model.held() - len(parked_positions(d, model))
        d.set_delivery_settings(
            ack_timeout=d.ack_timeout,
            max_redeliveries=d.max_redeliveries,
            nack_backoff=d.nack_backoff[0],
            nack_backoff_max=d.nack_backoff[1],
            max_replay=bound,
        )
        if bound < held:
            event("max_replay lowered under what is held")
        model.held_above = held if bound < held else 0
        model.max_replay = bound
        assert d.max_replay == bound

    @rule(keys=st.lists(st.sampled_from(KEY_POOL), min_size=1, max_size=4), gap=st.integers(1, 3))
    def publish(self, keys: list[Key], gap: int) -> None:
        for key in keys:
            self.publish_one(key, gap)

    @rule(
        keys=st.lists(st.sampled_from(KEY_POOL), min_size=1, max_size=6),
        gap=st.integers(1, 3),
        fault=st.sampled_from((None, None, "stale", "bad key")),
    )
    def publish_many(self, keys: list[Key], gap: int, fault: str | None) -> None:
        """Several at once (as the server hands in what it read): all or none."""
        d, model = self.d, self.model
        items: list[tuple[int, Any]] = [(model.last_position + gap * (i + 1), key) for i, key in enumerate(keys)]
        if fault == "stale" and (len(items) > 1 or model.last_position >= 0):
            items[-1] = (items[0][0] if len(items) > 1 else model.last_position, keys[-1])
            self.rejected(PositionError, lambda: d.publish_many(items))
        elif fault == "bad key":
            items[-1] = (items[-1][0], 7)
            self.rejected(InvalidKeyError, lambda: d.publish_many(items))
        elif model.held() - len(parked_positions(d, model)) + len(items) > model.max_replay:
            event("publish_many over the bound")
            self.rejected(BufferFullError, lambda: d.publish_many(items))
        else:
            assert d.publish_many(items) == len(items)
            for position, key in items:
                model.publish(position, key, None)

    @precondition(lambda self: any(self.model.messages[p].kb is not None for p in self.model.holder))
    @rule(data=st.data(), as_bytes=st.booleans(), delay=st.sampled_from((0.0, 0.0, 0.5, 3.0)))
    def publish_key_in_flight(self, data: st.DataObject, as_bytes: bool, delay: float) -> None:
        """Another message of a key that is in flight: what a range move must then hold back; delayed, one
        that must not wait for the key, and whose key may be in flight or draining when its time comes."""
        in_flight = sorted({kb for p in self.model.holder if (kb := self.model.messages[p].kb) is not None})
        kb = data.draw(st.sampled_from(in_flight), label="key in flight")
        self.publish_one(kb if as_bytes else kb.decode(), 1, self.clock() + delay if delay else 0.0)

    @rule()
    def poll(self) -> None:
        ranges = self.d.ranges()
        poll_and_check(self.d, self.model, self.clock())
        if self.d.ranges() != ranges:
            event("ranges shifted during a poll")

    @precondition(lambda self: bool(self.model.holder))
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        position, consumer = data.draw(st.sampled_from(sorted(self.model.holder.items())), label="ack")
        self.d.ack(consumer, position)
        self.model.ack(consumer, position)

    @precondition(lambda self: bool(self.model.holder))
    @rule(data=st.data())
    def ack_many(self, data: st.DataObject) -> None:
        """A batch of acks as the server sends them: some of one consumer's, repeats and strays mixed in."""
        consumer = data.draw(st.sampled_from(sorted(set(self.model.holder.values()))), label="consumer")
        mine = self.model.inflight_on(consumer)
        strays = [p for p in self.model.holder if p not in mine] + [self.model.last_position + 1]
        positions = data.draw(st.lists(st.sampled_from(mine + strays), max_size=8), label="batch")
        acked, rejected = self.d.ack_many(consumer, positions)
        expected: tuple[list[int], list[int]] = ([], [])
        for position in positions:
            if self.model.holder.get(position) == consumer:
                self.model.ack(consumer, position)
                expected[0].append(position)
            else:
                expected[1].append(position)
        assert (acked, rejected) == expected

    @precondition(lambda self: bool(self.model.holder))
    @rule(data=st.data())
    def nack(self, data: st.DataObject) -> None:
        position, consumer = data.draw(st.sampled_from(sorted(self.model.holder.items())), label="nack")
        self.d.nack(consumer, position)
        self.model.nack(consumer, position, self.clock())

    @precondition(lambda self: bool(self.model.holder))
    @rule(data=st.data())
    def unsent(self, data: st.DataObject) -> None:
        """Deliveries the IO layer could not send come back as if never made, their permits too, with every
        later delivery of their keys on that consumer (G2); strays are rejected."""
        model = self.model
        consumer = data.draw(st.sampled_from(sorted(set(model.holder.values()))), label="consumer")
        mine = model.inflight_on(consumer)
        strays = [p for p in model.holder if p not in mine] + [model.last_position + 1]
        positions = data.draw(st.lists(st.sampled_from(mine + strays), max_size=6), label="unsent")
        taken, rejected = self.d.unsent(consumer, positions)
        expected: tuple[list[int], list[int]] = ([], [])
        for position in positions:
            expected[position not in mine or position in expected[0]].append(position)
        assert (taken, rejected) == expected
        returned = set(taken)
        for position in taken:
            returned.update(model.later_of_key(consumer, position))
        for position in returned:
            del model.holder[position]
            model.deadline.pop(position, None)
            model.loose.discard(position)
            model.delivered[position] -= 1
        model.permits[consumer] += len(returned)
        model.settle_limit(consumer)
        if returned:
            event("deliveries not sent came back")

    @precondition(lambda self: bool(self.model.consumers))
    @rule(data=st.data())
    def withdraw_permits(self, data: st.DataObject) -> None:
        """A consumer's permits, withheld ones included, are taken away and counted: it keeps what it holds and
        gets nothing more until it flows (a Failover consumer that stood down drains so)."""
        model = self.model
        name = data.draw(st.sampled_from(model.consumers), label="withdraw")
        assert self.d.inflight_count(name) == len(model.inflight_on(name))
        assert self.d.withdraw_permits(name) == model.permits[name]
        model.permits[name] = 0
        assert self.d.permits(name) == 0
        if model.inflight_on(name):
            event("permits withdrawn with deliveries in flight")

    @rule(seconds=st.sampled_from(CLOCK_STEPS))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(
        data=st.data(),
        kind=st.sampled_from(
            ("duplicate", "unknown", "not in flight", "stale position", "bad key", "bad permits", "bad deliver_at")
        ),
    )
    def rejected_call(self, data: st.DataObject, kind: str) -> None:
        """Calls the dispatcher must refuse without changing anything."""
        model, d = self.model, self.d
        present = model.consumers
        absent = [name for name in NAMES if name not in present]
        if kind == "duplicate" and present:
            name = data.draw(st.sampled_from(present), label="duplicate")
            self.rejected(DuplicateConsumerError, lambda: d.add_consumer(name))
        elif kind == "unknown" and absent:
            name = data.draw(st.sampled_from(absent), label="unknown")
            position = max(model.last_position, 0)
            calls: list[Callable[[], object]] = [
                lambda: d.flow(name, 1),
                lambda: d.remove_consumer(name),
                lambda: d.ack(name, position),
                lambda: d.nack(name, position),
            ]
            self.rejected(UnknownConsumerError, data.draw(st.sampled_from(calls), label="call"))
        elif kind == "not in flight" and present:
            # Acked, pending, never published, or in flight on another consumer.
            positions = [*model.messages, model.last_position + 1]
            choices = [(c, p) for c in present for p in positions if model.holder.get(p) != c]
            consumer, position = data.draw(st.sampled_from(choices), label="not in flight")
            call = data.draw(st.sampled_from((d.ack, d.nack)), label="call")
            self.rejected(NotInFlightError, lambda: call(consumer, position))
        elif kind == "stale position" and model.last_position >= 0:
            position = model.last_position - data.draw(st.integers(0, 2), label="back")
            self.rejected(PositionError, lambda: d.publish(position, "hot", None))
        elif kind == "bad key" and d.wants():
            # The position stays free: the next publish may use it.
            key: Any = data.draw(st.sampled_from((7, 1.5, bytearray(b"hot"), ("hot",), "\udc80")), label="bad key")
            self.rejected(InvalidKeyError, lambda: d.publish(model.last_position + 1, key, None))
        elif kind == "bad permits" and present:
            name = data.draw(st.sampled_from(present), label="consumer")
            permits: Any = data.draw(st.sampled_from((-1, -5, 1.0, "2", None)), label="bad permits")
            self.rejected(PermitsError, lambda: d.flow(name, permits))
        elif kind == "bad deliver_at":
            at: Any = data.draw(st.sampled_from((math.nan, math.inf, "1", True, None)), label="bad deliver_at")
            self.rejected(PositionError, lambda: d.publish(model.last_position + 1, "hot", None, deliver_at=at))

    @invariant()
    def consistent(self) -> None:
        check_state(self.d, self.model)

    def teardown(self) -> None:
        """G3: with permits for all and every delivery acked, everything published drains."""
        d, model = self.d, self.model
        if not model.consumers:
            d.add_consumer("drainer")
            model.add("drainer")
        for position, consumer in sorted(model.holder.items()):
            d.ack(consumer, position)
            model.ack(consumer, position)
        ends = [at for position, at in model.deliver_at.items() if model.is_pending(position)]
        self.clock.now = max([self.clock.now, *ends])  # every delivery time comes
        # An unacked limit may let one out per poll, and at a bound of 1 a parked message is restored by
        # one poll's re-read and goes out at the next.
        for _ in range(5 + 2 * len(model.messages)):
            if not model.held():
                break
            for consumer in model.consumers:
                d.flow(consumer, model.max_replay)
                model.permits[consumer] += model.max_replay
                model.stuck.discard(consumer)
            poll_and_check(d, model, self.clock())
            for position, consumer in sorted(model.holder.items()):
                d.ack(consumer, position)
                model.ack(consumer, position)
            confirm_dead_letters(d, model, sorted(model.dead))
            self.clock.advance(1.0)
        assert model.held() == 0, f"G3: positions {model.pending()} were never delivered and acked"
        assert set(model.acked) | set(model.buried) == set(model.messages)
        assert not set(model.acked) & set(model.buried), "acked and dead-lettered"
        assert all(count == 1 for count in (model.acked + model.buried).values())
        assert d.wants() == model.max_replay
        assert d.poll() == []
        check_state(d, model)


def confirm_dead_letters(d: Dispatcher, model: Model, positions: list[int]) -> None:
    """Confirm ``positions`` as stored; those not dead-lettered (or confirmed already) must be rejected."""
    confirmed, rejected = d.dead_lettered(positions)
    expected: tuple[list[int], list[int]] = ([], [])
    for position in positions:
        if position in model.dead:
            model.dead.remove(position)
            model.buried[position] += 1
            expected[0].append(position)
        else:
            expected[1].append(position)
    assert (confirmed, rejected) == expected


class LeaseMachine(DispatcherMachine):
    """Leases (ack_timeout 1 s against clock steps of 0 to 31 s) and a redelivery limit of 1 (G7)."""

    TIMEOUT = 1.0
    LIMIT = 1

    def make(self, clock: ManualClock) -> Dispatcher:
        return Dispatcher(clock=clock, max_replay=MAX_REPLAY, ack_timeout=self.TIMEOUT, max_redeliveries=self.LIMIT)

    def make_model(self) -> Model:
        return Model(MAX_REPLAY, ack_timeout=self.TIMEOUT, max_redeliveries=self.LIMIT)

    @precondition(lambda self: bool(self.model.holder))
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        """Renew some of one consumer's leases, with strays and taken-back ones mixed in."""
        model = self.model
        consumer = data.draw(st.sampled_from(sorted(set(model.holder.values()))), label="consumer")
        mine = model.inflight_on(consumer)
        strays = [*sorted(model.taken_back[consumer]), model.last_position + 1]
        positions = data.draw(st.lists(st.sampled_from(mine + strays), max_size=5), label="extend")
        extended, rejected = self.d.extend(consumer, positions)
        assert extended == [p for p in positions if p in mine]
        assert rejected == [p for p in positions if p not in mine]
        if model.ack_timeout:
            for position in extended:
                model.deadline[position] = self.clock() + model.ack_timeout
        if extended:
            model.stuck.discard(consumer)

    @precondition(lambda self: bool(self.model.holder))
    @rule()
    def stall(self) -> None:
        """Nobody acks for a whole ack_timeout: every lease out now is due at the next poll."""
        self.clock.advance(self.model.ack_timeout or self.TIMEOUT)
        poll_and_check(self.d, self.model, self.clock())

    @precondition(lambda self: any(self.model.taken_back.values()))
    @rule(data=st.data())
    def late_ack(self, data: st.DataObject) -> None:
        """An ack or nack of a delivery taken back at its deadline is refused as late and changes nothing."""
        choices = sorted((c, p) for c, taken in self.model.taken_back.items() for p in taken)
        consumer, position = data.draw(st.sampled_from(choices), label="late")
        assert self.d.lease_expired(consumer, position)
        call = data.draw(st.sampled_from((self.d.ack, self.d.nack)), label="call")
        self.rejected(LeaseExpiredError, lambda: call(consumer, position))
        event("a late ack was refused")

    @rule(data=st.data())
    def confirm_dead(self, data: st.DataObject) -> None:
        """The IO layer confirms some dead letters stored (strays and repeats are rejected)."""
        model = self.model
        choices = sorted(model.dead) + sorted(model.buried) + [model.last_position + 1]
        confirm_dead_letters(self.d, model, data.draw(st.lists(st.sampled_from(choices), max_size=4), label="dead"))

    @rule(
        timeout=st.sampled_from((0.0, 0.5, 1.0, 4.0)),
        limit=st.sampled_from((None, 0, 1, 2)),
        backoff=st.sampled_from((0.0, 0.25, 1.0)),
    )
    def reconfigure(self, timeout: float, limit: int | None, backoff: float) -> None:
        """Delivery settings changed live: a lease out ends no later than the new timeout from now."""
        model, now = self.model, self.clock()
        self.d.set_delivery_settings(
            ack_timeout=timeout, max_redeliveries=limit, nack_backoff=backoff, nack_backoff_max=2.0
        )
        if not timeout:
            model.deadline.clear()
        else:
            for position in model.holder:
                end = now + timeout
                model.deadline[position] = min(model.deadline[position], end) if model.ack_timeout else end
        model.ack_timeout, model.max_redeliveries = timeout, limit
        model.nack_backoff, model.nack_backoff_max = backoff, 2.0
        assert self.d.ack_timeout == timeout and self.d.max_redeliveries == limit
        assert self.d.nack_backoff == (backoff, 2.0)

    @invariant()
    def leases_scheduled(self) -> None:
        """A poll at the next deadline is never too late for a lease that is due, nor for a backoff's end."""
        deadline = self.d.next_deadline()
        model = self.model
        parked = parked_positions(self.d, model)
        timed = [model.deliver_at[p] for p in scheduled_positions(model) if p not in parked]
        ends = [*model.deadline.values(), *model.backoff.values(), *model.delayed.values(), *timed]
        if ends:
            assert deadline is not None and deadline <= min(ends)


class ModeMachine(LeaseMachine):
    """Leases and dead letters, with the consume mode switched between ordered and unordered at
    random, an unacked limit of 3 per consumer and nack backoffs (0.5 s doubling to 2 s)."""

    LIMIT_UNACKED = 3
    SPILL = False
    BACKOFF = 0.5
    BACKOFF_MAX = 2.0
    SLOTS = (0, HASH_RANGE_SIZE - 1)

    def make(self, clock: ManualClock) -> Dispatcher:
        return Dispatcher(
            clock=clock,
            max_replay=MAX_REPLAY,
            ack_timeout=self.TIMEOUT,
            max_redeliveries=self.LIMIT,
            max_unacked_per_consumer=self.LIMIT_UNACKED,
            spill=self.SPILL,
            nack_backoff=self.BACKOFF,
            nack_backoff_max=self.BACKOFF_MAX,
            slots=self.SLOTS,
        )

    def make_model(self) -> Model:
        model = super().make_model()
        model.unacked_limit = self.LIMIT_UNACKED
        model.nack_backoff, model.nack_backoff_max = self.BACKOFF, self.BACKOFF_MAX
        return model

    @rule()
    def switch_mode(self) -> None:
        model = self.model
        if model.backoff or model.delayed:
            event("a mode switch ends nack backoffs")
        model.backoff.clear()
        model.delayed.clear()
        model.unordered = not model.unordered
        self.d.set_consume_mode("unordered" if model.unordered else "ordered")
        assert self.d.stats()["consume_mode"] == ("unordered" if model.unordered else "ordered")
        if model.loose and not model.unordered:
            event("back to ordered with deliveries from unordered mode still out")


class SpillMachine(ModeMachine):
    """The mode machine with spilling: at half the bound, the slots of keys that cannot go out are parked
    and re-read from the model's log (the model counts them as pending, not held)."""

    SPILL = True


class BlockMachine(SpillMachine):
    """The spill machine over one block of slots (a partition's): every pool key's slot lies in
    [1094, 58351], so the offset between the block's own slots and the whole space's is exercised
    in routing, ranges, owner_of, snapshots and re-reads."""

    SLOTS = (1094, 58351)


TERRITORY = HASH_RANGE_SIZE // len(NAMES)


def declared_ranges(name: str) -> st.SearchStrategy[list[tuple[int, int]]]:
    """One to three disjoint ranges inside ``name``'s quarter of the space (so that members never
    conflict), at random gaps and widths: some pool keys fall in them, others stay unassigned."""
    low = NAMES.index(name) * TERRITORY

    def ranges(gaps_and_widths: list[tuple[int, int]]) -> list[tuple[int, int]]:
        found, at, high = [], low, low + TERRITORY - 1
        for gap, width in gaps_and_widths:
            if at + gap <= high:
                found.append((at + gap, min(at + gap + width, high)))
            at += gap + width + 2  # two ranges never touch: each stays one range of the map
        return found

    sizes = st.tuples(st.integers(0, 2500), st.integers(0, 8000))
    return st.lists(sizes, min_size=1, max_size=3).map(ranges)


class StickyMachine(SpillMachine):
    """Key_Shared STICKY: each consumer declares its own ranges (leases, modes and spilling as the spill
    machine); keys in undeclared slots wait, and overlapping or missing declarations are refused."""

    def make(self, clock: ManualClock) -> Dispatcher:
        d = super().make(clock)
        d.set_policy("sticky")
        return d

    def join(self, name: str, data: st.DataObject) -> None:
        """``name`` joins declaring ranges of its own quarter of the space."""
        self.d.add_consumer(name, data.draw(declared_ranges(name), label=f"{name} declares"))
        self.model.add(name)

    @rule(data=st.data(), kind=st.sampled_from(("overlap", "none", "malformed", "switch policy")))
    def refused_declaration(self, data: st.DataObject, kind: str) -> None:
        """A join whose ranges overlap a member's, or that declares none or malformed ones, and a policy
        switch while consumers are present: refused, nothing changed."""
        d, model = self.d, self.model
        absent = [name for name in NAMES if name not in model.consumers]
        event(f"refused: {kind}")
        if kind == "switch policy" and model.consumers:
            self.rejected(ConfigError, lambda: d.set_policy("multi"))
        elif absent and kind != "switch policy":
            name = data.draw(st.sampled_from(absent), label="joiner")
            bad: Any
            if kind == "overlap" and model.consumers:
                member = data.draw(st.sampled_from(model.consumers), label="member")
                start, end = data.draw(st.sampled_from(d.declared_ranges(member) or []), label="theirs")
                slot = data.draw(st.integers(start, end), label="slot")
                bad = [(slot, min(slot + data.draw(st.integers(0, 100)), HASH_RANGE_SIZE - 1))]
            elif kind == "none":
                bad = data.draw(st.sampled_from((None, [])), label="none")
            else:
                bad = data.draw(
                    st.sampled_from(([(5, 4)], [(0, HASH_RANGE_SIZE)], [(-1, 3)], [(1.0, 2)], "0-9", [(1, 5), (5, 9)])),
                    label="malformed",
                )
            self.rejected(ConsumerError, lambda: d.add_consumer(name, bad))

    @invariant()
    def unassigned_keys_wait(self) -> None:
        """No delivery of a key whose slot no consumer declared (poll_and_check checks owners); seen happen."""
        owner = owner_lookup(self.d.ranges())
        if self.model.consumers and any(
            owner(key_hash(kb)) is None for p in self.model.pending() if (kb := self.model.messages[p].kb) is not None
        ):
            event("a key waits in a slot no consumer declared")
        if any(self.model.messages[p].kb is not None for p in self.model.holder):
            event("a keyed message is in flight")

    def teardown(self) -> None:
        """G3 as the other machines check it, once the members made way for one consumer declaring the whole space."""
        d, model = self.d, self.model
        for position, consumer in sorted(model.holder.items()):
            d.ack(consumer, position)
            model.ack(consumer, position)
        for consumer in list(model.consumers):
            d.remove_consumer(consumer)
            model.remove(consumer)
        d.add_consumer("drainer", [(0, HASH_RANGE_SIZE - 1)])
        model.add("drainer")
        super().teardown()


class MultiShiftingMachine(DispatcherMachine):
    """The multi-range policy with at most two ranges each and shifts that fire on little traffic."""

    def make(self, clock: ManualClock) -> Dispatcher:
        return Dispatcher(
            clock=clock,
            max_replay=MAX_REPLAY,
            max_ranges=2,
            half_life=2.0,
            shift_threshold=1.05,
            shift_interval=1.0,
            shift_min_traffic=1.0,
            backlog_interval=1.0,
        )


class ContiguousMachine(DispatcherMachine):
    """PIP-34's contiguous policy: one range each, split where traffic halves."""

    def make(self, clock: ManualClock) -> Dispatcher:
        return Dispatcher(clock=clock, max_replay=MAX_REPLAY, policy="contiguous", split="traffic")


class ContiguousMidpointShiftingMachine(DispatcherMachine):
    """The contiguous policy with midpoint splits and boundary shifts that fire on little traffic."""

    def make(self, clock: ManualClock) -> Dispatcher:
        return Dispatcher(
            clock=clock,
            max_replay=MAX_REPLAY,
            policy="contiguous",
            split="midpoint",
            half_life=2.0,
            shift_threshold=1.05,
            shift_interval=1.0,
            shift_min_traffic=1.0,
            backlog_interval=1.0,
        )


def covered(inner: list[tuple[int, int]], outer: list[tuple[int, int]]) -> bool:
    """Whether every slot of the sorted ranges ``inner`` lies in the sorted ranges ``outer``."""
    starts = [start for start, _ in outer]
    for start, end in inner:
        index = bisect.bisect_right(starts, start) - 1
        if index < 0 or outer[index][1] < end:
            return False
    return True


class StallingMachine(LeaseMachine):
    """Consumers that stop answering for good (no ack, nack or extension; they may still flow), with a
    half-life of 2 s and no leases: what such a consumer holds, it holds for ever. Every guarantee the
    other machines check still holds, and a leave never grows a stalled consumer's slots while another
    member may take them (the stats say who is stalled, and never one the model knows is progressing)."""

    TIMEOUT = 0.0
    LIMIT = 1
    HALF_LIFE = 2.0
    POLICY = "multi"

    def make(self, clock: ManualClock) -> Dispatcher:
        return Dispatcher(
            clock=clock,
            max_replay=MAX_REPLAY,
            policy=self.POLICY,
            half_life=self.HALF_LIFE,
            ack_timeout=self.TIMEOUT,
            max_redeliveries=self.LIMIT,
        )

    def __init__(self) -> None:
        super().__init__()
        self.stopped: set[str] = set()
        self.answered_at: dict[str, float] = {}  # the clock at each consumer's join or last accepted ack/nack/extend

    def answering(self) -> list[tuple[int, str]]:
        """The in-flight positions of consumers that still answer, with their consumer."""
        return sorted((p, c) for p, c in self.model.holder.items() if c not in self.stopped)

    def answered(self, consumer: str) -> None:
        self.answered_at[consumer] = self.clock()

    def join(self, name: str, data: st.DataObject) -> None:
        """A newcomer is judged from its join on: its join counts as its first answer."""
        super().join(name, data)
        self.answered(name)

    @precondition(lambda self: bool(set(self.model.consumers) - self.stopped))
    @rule(data=st.data())
    def stop_answering(self, data: st.DataObject) -> None:
        self.stopped.add(data.draw(st.sampled_from(sorted(set(self.model.consumers) - self.stopped)), label="stops"))

    @precondition(lambda self: bool(self.answering()))
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        position, consumer = data.draw(st.sampled_from(self.answering()), label="ack")
        self.d.ack(consumer, position)
        self.model.ack(consumer, position)
        self.answered(consumer)

    @precondition(lambda self: bool(self.answering()))
    @rule(data=st.data())
    def ack_many(self, data: st.DataObject) -> None:
        consumer = data.draw(st.sampled_from(sorted({c for _, c in self.answering()})), label="consumer")
        positions = data.draw(st.lists(st.sampled_from(self.model.inflight_on(consumer)), max_size=4), label="batch")
        acked, rejected = self.d.ack_many(consumer, positions)
        assert acked == list(dict.fromkeys(positions)) and len(rejected) == len(positions) - len(acked)
        for position in acked:
            self.model.ack(consumer, position)
        if acked:
            self.answered(consumer)

    @precondition(lambda self: bool(self.answering()))
    @rule(data=st.data())
    def nack(self, data: st.DataObject) -> None:
        position, consumer = data.draw(st.sampled_from(self.answering()), label="nack")
        self.d.nack(consumer, position)
        self.model.nack(consumer, position, self.clock())
        self.answered(consumer)

    @precondition(lambda self: bool(self.answering()))
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        position, consumer = data.draw(st.sampled_from(self.answering()), label="extend")
        assert self.d.extend(consumer, [position]) == ([position], [])
        if self.model.ack_timeout:
            self.model.deadline[position] = self.clock() + self.model.ack_timeout
        self.model.stuck.discard(consumer)
        self.answered(consumer)

    @precondition(lambda self: bool(self.model.consumers))
    @rule(data=st.data())
    def remove_consumer(self, data: st.DataObject) -> None:
        """A leave gives a stalled consumer no slot, unless nobody else may take it: every other member
        stalled, or (one range each) both of the leaver's neighbours stalled and no standby open."""
        d, model = self.d, self.model
        name = data.draw(st.sampled_from(model.consumers), label="remove")
        entries = d.stats()["consumers"]
        stalled = {c for c, entry in entries.items() if entry["stalled"] and c != name}
        before = {c: d.ranges_of(c) for c in stalled}
        ranges = d.ranges()
        open_standby = any(entry["standby"] and c not in stalled for c, entry in entries.items() if c != name)
        d.remove_consumer(name)
        model.remove(name)
        self.answered_at.pop(name, None)  # a consumer joining under this name is another
        owned = [(start, end) for start, end, c in ranges if c == name]
        if not owned or not stalled:
            return
        if stalled == set(entries) - {name}:
            event("a leave with every other member stalled goes as before")
            return
        if isinstance(d.policy, ContiguousPolicy) and not open_standby:
            ((start, end),) = owned
            neighbours = {c for first, last, c in ranges if last == start - 1 or first == end + 1}
            if neighbours <= stalled:
                event("one range each: both neighbours of the leaver stalled")
                return
        for consumer in stalled:
            assert covered(d.ranges_of(consumer), before[consumer]), (
                f"{name} left and stalled {consumer} gained slots: {before[consumer]} -> {d.ranges_of(consumer)}"
            )
        event("a leave passed over a stalled consumer")

    @invariant()
    def stalled_as_the_model_knows(self) -> None:
        """Stuck or blocked: stalled; else a join or an answer within the half-life is progress (the samples
        never see one before it came); without one, permits with nothing held is not stalled."""
        model, now = self.model, self.clock()
        for consumer, entry in self.d.stats()["consumers"].items():
            answered = self.answered_at[consumer]
            if consumer in model.stuck or consumer in model.blocked:
                assert entry["stalled"], f"{consumer}: {entry}"
            elif now - answered < self.HALF_LIFE:
                assert not entry["stalled"], f"{consumer}: {entry}, joined or answered at {answered}"
            elif model.permits[consumer] and not model.inflight_on(consumer):
                assert not entry["stalled"], f"{consumer}: {entry}"
            elif entry["stalled"]:
                event("a consumer without answers for the half-life is stalled")


class StallingContiguousMachine(StallingMachine):
    """The stalling machine with one range each, and leases of 4 s: a consumer that stops answering is
    first stalled, then stuck."""

    TIMEOUT = 4.0
    POLICY = "contiguous"


# Four machines share the time the two of one policy had (600 and 300 examples).
DispatcherMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=100, deadline=None)
MultiShiftingMachine.TestCase.settings = settings(max_examples=75, stateful_step_count=100, deadline=None)
ContiguousMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=100, deadline=None)
ContiguousMidpointShiftingMachine.TestCase.settings = settings(max_examples=75, stateful_step_count=100, deadline=None)
LeaseMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=100, deadline=None)
ModeMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=100, deadline=None)
SpillMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=100, deadline=None)
BlockMachine.TestCase.settings = settings(max_examples=75, stateful_step_count=100, deadline=None)
StickyMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=100, deadline=None)
StallingMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=100, deadline=None)
StallingContiguousMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=100, deadline=None)
TestStallingMachine = pytest.mark.slow(StallingMachine.TestCase)
TestStallingContiguousMachine = pytest.mark.slow(StallingContiguousMachine.TestCase)
TestStickyMachine = pytest.mark.slow(StickyMachine.TestCase)
TestBlockMachine = pytest.mark.slow(BlockMachine.TestCase)
TestSpillMachine = pytest.mark.slow(SpillMachine.TestCase)
TestModeMachine = pytest.mark.slow(ModeMachine.TestCase)
TestDispatcherMachine = pytest.mark.slow(DispatcherMachine.TestCase)
TestLeaseMachine = pytest.mark.slow(LeaseMachine.TestCase)
TestMultiShiftingMachine = pytest.mark.slow(MultiShiftingMachine.TestCase)
TestContiguousMachine = pytest.mark.slow(ContiguousMachine.TestCase)
TestContiguousMidpointShiftingMachine = pytest.mark.slow(ContiguousMidpointShiftingMachine.TestCase)


# -- the checkers catch planted violations ------------------------------------------------


def _plant(d: Dispatcher, ranges: list[tuple[int, int, str]]) -> None:
    """White box: install ``ranges`` as the dispatcher's map as they are, bypassing policy and checks."""
    planted = RangeMap(HASH_RANGE_SIZE)
    planted._starts = [start for start, _, _ in ranges]
    planted._ends = [end for _, end, _ in ranges]
    planted._owners = [owner for _, _, owner in ranges]
    planted._counts = dict(Counter(planted._owners))
    d._map = planted
    d._ends, owners = planted.lookup_table()
    d._owners = [None if cid == UNASSIGNED else d._consumers[cid] for cid in owners]


END = HASH_RANGE_SIZE - 1

PLANTED_MAPS = [
    pytest.param("multi", [(0, 9, "c1"), (10, 19, "c2"), (20, 29, "c1"), (30, 39, "c2"), (40, END, "c1")],
                 "more than 2 range", id="over-max-ranges"),
    pytest.param("contiguous", [(0, 9, "c1"), (10, 19, "c2"), (20, END, "c1")], "more than 1 range",
                 id="contiguous-two-ranges"),
    pytest.param("multi", [(0, 9, "c1"), (10, END, "c1")], "two adjacent ranges", id="adjacent-ranges-of-one"),
    pytest.param("multi", [(0, 9, "c1"), (11, END, "c2")], "do not tile", id="gap"),
    pytest.param("multi", [(0, END, "c1")], "vs consumers", id="member-without-range"),
]  # fmt: skip


@pytest.mark.parametrize(("policy", "ranges", "message"), PLANTED_MAPS)
def test_the_range_checker_catches_a_planted_violation(
    policy: str, ranges: list[tuple[int, int, str]], message: str
) -> None:
    d = Dispatcher(clock=ManualClock(1000.0), policy=policy, max_ranges=2)
    model = Model(MAX_REPLAY)
    for name in ("c1", "c2"):
        d.add_consumer(name)
        model.add(name)
    check_ranges(d, model)
    _plant(d, ranges)
    with pytest.raises(AssertionError, match=message):
        check_ranges(d, model)


@pytest.mark.parametrize(
    "ranges",
    [
        pytest.param([(0, 149, "c1"), (150, 199, UNASSIGNED), (200, 299, "c2"), (300, END, UNASSIGNED)], id="wider"),
        pytest.param([(0, 99, "c1"), (100, 299, UNASSIGNED), (300, END, "c2")], id="another-range"),
    ],
)
def test_the_range_checker_catches_a_sticky_consumer_owning_what_it_did_not_declare(
    ranges: list[tuple[int, int, str]],
) -> None:
    d = Dispatcher(clock=ManualClock(1000.0), policy="sticky")
    model = Model(MAX_REPLAY)
    for name, declared in (("c1", [(0, 99)]), ("c2", [(200, 299)])):
        d.add_consumer(name, declared)
        model.add(name)
    check_ranges(d, model)
    _plant(d, ranges)
    with pytest.raises(AssertionError, match="owns"):
        check_ranges(d, model)


def _delivery_model() -> tuple[Dispatcher, Model, str]:
    """c1 and c2 with permits, key "k" published at 1 and 2 (pending), owned by ``owner``."""
    d = Dispatcher(clock=ManualClock(1000.0), max_replay=MAX_REPLAY)
    model = Model(MAX_REPLAY)
    for name in ("c1", "c2"):
        d.add_consumer(name)
        model.add(name)
        model.permits[name] = 2
    for position in (1, 2):
        d.publish(position, "k", position)
        model.publish(position, "k", position)
    owner = d.owner_of("k")
    assert owner is not None
    return d, model, owner


def test_the_delivery_checker_catches_a_skipped_position() -> None:
    d, model, owner = _delivery_model()
    with pytest.raises(AssertionError, match="G2"):
        check_poll(d, model, [Delivery(owner, 2, "k", 2, 0)])


def test_the_delivery_checker_catches_a_key_on_two_consumers() -> None:
    d, model, owner = _delivery_model()
    other = "c2" if owner == "c1" else "c1"
    model.holder[1] = owner
    model.delivered[1] = 1
    with pytest.raises(AssertionError, match="G1"):
        check_poll(d, model, [Delivery(other, 2, "k", 2, 0)])


def test_the_delivery_checker_catches_a_delivery_past_the_permits_or_to_the_wrong_owner() -> None:
    d, model, owner = _delivery_model()
    other = "c2" if owner == "c1" else "c1"
    with pytest.raises(AssertionError, match="is owned by"):
        check_poll(d, model, [Delivery(other, 1, "k", 1, 0)])
    model.permits[owner] = 0
    with pytest.raises(AssertionError, match="had no permits left"):
        check_poll(d, model, [Delivery(owner, 1, "k", 1, 0)])


def test_the_held_back_checker_catches_a_message_left_waiting() -> None:
    d, model, _ = _delivery_model()  # "k" is pending and its owner has permits
    with pytest.raises(AssertionError, match="G5"):
        check_nothing_held_back(d, model)


def test_the_delivery_checker_catches_a_delivery_before_its_time() -> None:
    d, model, owner = _delivery_model()
    model.deliver_at[1] = 1001.0
    model.polled_at = 1000.0
    with pytest.raises(AssertionError, match="before its delivery time"):
        check_poll(d, model, [Delivery(owner, 1, "k", 1, 0)])


def test_the_delivery_checker_catches_keyless_messages_out_of_position_order() -> None:
    d, model, _ = _delivery_model()
    for position in (3, 4):
        model.publish(position, None, position)
    with pytest.raises(AssertionError, match="position order"):
        check_poll(d, model, [Delivery("c1", 4, None, 4, 0)])


def test_the_delivery_checker_catches_a_delivery_past_max_redeliveries() -> None:
    d, model, owner = _delivery_model()
    model.max_redeliveries = 1
    model.delivered[1] = 2  # delivered twice, failed twice
    model.failures[1] = 2
    with pytest.raises(AssertionError, match="past max_redeliveries"):
        check_poll(d, model, [Delivery(owner, 1, "k", 1, 2)])


def test_the_dead_letter_checker_catches_a_premature_or_wrong_dead_letter() -> None:
    _, model, _ = _delivery_model()
    model.max_redeliveries = 1
    with pytest.raises(AssertionError, match="failed 0 time"):
        check_dead_letters(model, [DeadLetter(1, "k", 1, 0, "nack")])
    model.delivered[1] = 2
    model.failures[1] = 2
    model.came_back[1] = "ack timeout"
    with pytest.raises(AssertionError, match="came back by ack timeout"):
        check_dead_letters(model, [DeadLetter(1, "k", 1, 1, "nack")])
    model.holder[1] = "c1"
    with pytest.raises(AssertionError, match="was not pending"):
        check_dead_letters(model, [DeadLetter(1, "k", 1, 1, "ack timeout")])


def test_the_state_checker_catches_a_stuck_consumer_that_kept_its_ranges() -> None:
    """The model says c1's lease expired; a dispatcher that did not move its ranges is caught."""
    d = Dispatcher(clock=ManualClock(1000.0), max_replay=MAX_REPLAY)
    model = Model(MAX_REPLAY)
    for name in ("c1", "c2"):
        d.add_consumer(name)
        model.add(name)
    check_state(d, model)
    model.stuck.add("c1")
    with pytest.raises(AssertionError, match="stuck"):
        check_state(d, model)


# -- G6: determinism ---------------------------------------------------------------------

Op = tuple[Any, ...]

PUBLISH = st.tuples(st.just("publish"), st.sampled_from(KEY_POOL), st.integers(1, 3))
POLL = st.tuples(st.just("poll"))
FLOW = st.tuples(st.just("flow"), st.sampled_from(NAMES), st.integers(0, 12))
ACK = st.tuples(st.just("ack"), st.integers(0, 50))
EXTEND = st.tuples(st.just("extend"), st.integers(0, 50))
MODE = st.tuples(st.just("mode"), st.sampled_from(("ordered", "unordered")))
DELAYED = st.tuples(st.just("delayed"), st.sampled_from(KEY_POOL), st.sampled_from((0.5, 3.0)))
OPS: st.SearchStrategy[Op] = st.one_of(
    PUBLISH,
    DELAYED,
    POLL,
    FLOW,
    ACK,
    PUBLISH,
    PUBLISH,
    POLL,
    ACK,
    st.tuples(st.just("add"), st.sampled_from(NAMES)),
    st.tuples(st.just("remove"), st.sampled_from(NAMES)),
    st.tuples(st.just("nack"), st.integers(0, 50)),
    st.tuples(st.just("tick"), st.sampled_from(CLOCK_STEPS)),
    EXTEND,
    MODE,
)


class Run:
    """One dispatcher replaying a list of ops and recording every outcome."""

    def __init__(self, make: Callable[[ManualClock], Dispatcher], observe: bool) -> None:
        self.clock = ManualClock(1000.0)
        self.d = make(self.clock)
        self.observe = observe
        self.position = 0
        self.outstanding: list[tuple[str, int]] = []

    def apply(self, op: Op) -> object:
        d = self.d
        kind = op[0]
        try:
            if kind == "add":
                d.add_consumer(op[1])
            elif kind == "remove":
                d.remove_consumer(op[1])
            elif kind == "flow":
                d.flow(op[1], op[2])
            elif kind == "publish":
                self.position += op[2]
                d.publish(self.position, op[1], self.position)
            elif kind == "delayed":
                self.position += 1
                d.publish(self.position, op[1], self.position, deliver_at=self.clock() + op[2])
            elif kind == "poll":
                out = d.poll()
                self.outstanding.extend((x.consumer, x.position) for x in out)
                letters = d.dead_letters()
                d.dead_lettered([letter.position for letter in letters])
                return out, letters
            elif kind == "mode":
                d.set_consume_mode(op[1])
            elif kind == "extend" and self.outstanding:
                consumer, position = self.outstanding[op[1] % len(self.outstanding)]
                return d.extend(consumer, [position])
            elif kind in ("ack", "nack") and self.outstanding:
                consumer, position = self.outstanding.pop(op[1] % len(self.outstanding))
                (d.ack if kind == "ack" else d.nack)(consumer, position)
            elif kind == "tick":
                self.clock.advance(op[1])
        except KeyFailoverError as exc:
            return type(exc).__name__, str(exc)
        finally:
            if self.observe:  # reading the state must not change any later decision
                d.stats()
                d.snapshot()
                d.traffic()
                d.owner_of("hot")
        return None

    def observable(self) -> tuple[Any, ...]:
        return self.d.ranges(), self.d.snapshot(), self.d.wants(), self.d.consumers()


def make_shifting(clock: ManualClock) -> Dispatcher:
    return Dispatcher(
        clock=clock, max_replay=30, max_ranges=3, half_life=3.0, shift_threshold=1.1, shift_interval=2.0,
        shift_min_traffic=1.0,
    )  # fmt: skip


def make_default(clock: ManualClock) -> Dispatcher:
    return Dispatcher(clock=clock, max_replay=30)


def make_leases(clock: ManualClock) -> Dispatcher:
    return Dispatcher(clock=clock, max_replay=30, ack_timeout=2.0, max_redeliveries=1)


def make_contiguous_shifting(clock: ManualClock) -> Dispatcher:
    return Dispatcher(
        clock=clock, max_replay=30, policy="contiguous", split="traffic", half_life=3.0, shift_threshold=1.1,
        shift_interval=2.0, shift_min_traffic=1.0,
    )  # fmt: skip


PRELUDE: list[Op] = [("add", "c1"), ("add", "c2"), ("flow", "c1", 4), ("flow", "c2", 4)]


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(OPS, min_size=40, max_size=150).map(lambda ops: PRELUDE + ops),
    make=st.sampled_from([make_default, make_shifting, make_contiguous_shifting, make_leases]),
)
def test_same_calls_and_clock_give_same_deliveries_and_ranges(
    ops: list[Op], make: Callable[[ManualClock], Dispatcher]
) -> None:
    """G6: two dispatchers fed the same calls and clock readings agree on every outcome.

    A third one, whose state is read (stats, snapshot, traffic, owner_of) after every
    call, must agree too: observing the dispatcher never changes what it decides.
    """
    runs = [Run(make, observe=False), Run(make, observe=False), Run(make, observe=True)]
    for step, op in enumerate(ops):
        outcomes = [run.apply(op) for run in runs]
        assert outcomes[1] == outcomes[0], f"step {step} {op}: {outcomes[1]} != {outcomes[0]}"
        assert outcomes[2] == outcomes[0], f"step {step} {op}: observed run gave {outcomes[2]} != {outcomes[0]}"
        states = [run.observable() for run in runs]
        assert states[1] == states[0], f"step {step} {op}"
        assert states[2] == states[0], f"step {step} {op}"
    assert runs[0].d.stats() == runs[1].d.stats() == runs[2].d.stats()


# -- G5: a stalled consumer never delays anyone else ------------------------------------

STALL_KEYS = tuple(f"order-{i}" for i in range(40))


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    keys=st.lists(st.sampled_from(STALL_KEYS), min_size=150, max_size=300),
    stalled_index=st.integers(0, 3),
    ticks=st.lists(st.sampled_from((0.0, 0.5, 3.0)), min_size=1, max_size=5),
    policy=st.sampled_from(("multi", "contiguous")),
)
def test_stalled_consumer_never_delays_other_keys(
    keys: list[str], stalled_index: int, ticks: list[float], policy: str
) -> None:
    """G5 (and G4): one consumer never gets a permit; everyone else keeps receiving every
    message of their keys at once, only the stalled consumer's keys fill the buffer, and at
    the bound publishing stops. Removing the stalled consumer then hands its backlog over."""
    clock = ManualClock(1000.0)
    max_replay = 30
    d = Dispatcher(clock=clock, max_replay=max_replay, policy=policy)
    model = Model(max_replay)
    names = ["a", "b", "c", "d"]
    stalled = names[stalled_index]
    for name in names:
        d.add_consumer(name)
        model.add(name)
        if name != stalled:
            d.flow(name, 10_000)
            model.permits[name] += 10_000
    position = 0
    keys_by_position: dict[int, str] = {}
    reached_bound = False
    for i, key in enumerate(keys):
        if d.wants() == 0:
            reached_bound = True
            break
        position += 1
        d.publish(position, key, None)
        model.publish(position, key, None)
        keys_by_position[position] = key
        out = d.poll()
        check_poll(d, model, out)
        assert all(x.consumer != stalled for x in out)
        for x in out:
            d.ack(x.consumer, x.position)
            model.ack(x.consumer, x.position)
        # Everything still held belongs to a key the stalled consumer owns right now.
        held_owners = {d.owner_of(keys_by_position[p]) for p in model.pending()}
        assert held_owners <= {stalled}, f"messages of {held_owners - {stalled}} wait although their owner has permits"
        clock.advance(ticks[i % len(ticks)])
        check_state(d, model)
    if reached_bound:
        event("the stalled consumer's keys filled the buffer")
        assert model.held() == max_replay
        with pytest.raises(BufferFullError):
            d.publish(position + 1, STALL_KEYS[0], None)
    d.remove_consumer(stalled)
    model.remove(stalled)
    for name in model.consumers:
        d.flow(name, max_replay)
        model.permits[name] += max_replay
    out = d.poll()
    check_poll(d, model, out)
    assert model.pending() == []
    assert all(x.redelivery_count == 0 for x in out), "messages never delivered are not redeliveries"
    for x in out:
        d.ack(x.consumer, x.position)
        model.ack(x.consumer, x.position)
    assert model.held() == 0
    assert set(model.acked) == set(model.messages)


def test_the_checkers_catch_a_message_left_waiting_in_unordered_mode_and_a_delivery_to_a_stuck_consumer() -> None:
    d, model, owner = _delivery_model()
    model.unordered = True
    with pytest.raises(AssertionError, match=r"unordered: .* pending while"):
        check_nothing_held_back(d, model)
    model.stuck.add(owner)
    with pytest.raises(AssertionError, match="is stuck"):
        check_poll(d, model, [Delivery(owner, 1, "k", 1, 0)])


delay_ops = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.sampled_from((None, "a", "b", "c")), st.sampled_from((0.0, 0.5, 5.0))),
        st.tuples(st.just("toggle")),
        st.tuples(st.just("flow"), st.sampled_from(("c1", "c2")), st.integers(0, 3)),
        st.tuples(st.just("tick"), st.sampled_from((0.3, 1.0, 3.0))),
        st.tuples(st.just("ack"), st.sampled_from(("c1", "c2"))),
        st.tuples(st.just("nack"), st.sampled_from(("c1", "c2"))),
        st.tuples(st.just("unordered"), st.booleans()),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(delay_ops)
def test_delivery_times_waived_and_honoured_again(ops: list[tuple[Any, ...]]) -> None:
    """``honour_delays(False)`` lets every delayed message go and delays nothing new; ``honour_delays(True)`` makes
    those still waiting wait for their time again: a first delivery made while delivery times are honoured is never
    early. Nothing is lost, and the state stays consistent."""
    clock = ManualClock(1000.0)
    d = Dispatcher(clock=clock, max_replay=1000)
    for name in ("c1", "c2"):
        d.add_consumer(name)
    honour = True
    at: dict[int, float] = {}
    delivered: set[int] = set()
    acked: set[int] = set()
    position = 0

    def poll() -> None:
        for delivery in d.poll():
            if honour and delivery.position not in delivered:
                assert at.get(delivery.position, 0.0) <= clock(), f"{delivery} before its time"
            delivered.add(delivery.position)
        if not honour:
            assert d.stats()["delayed_messages"] == 0

    for op in ops:
        if op[0] == "publish":
            position += 1
            at[position] = clock() + op[2] if op[2] else 0.0
            d.publish(position, op[1], deliver_at=at[position])
        elif op[0] == "toggle":
            honour = not honour
            d.honour_delays(honour)
        elif op[0] == "flow":
            d.flow(op[1], op[2])
        elif op[0] == "tick":
            clock.advance(op[1])
        elif op[0] == "ack":
            acked.update(d.ack_many(op[1], [p for p, c in held_by(d).items() if c == op[1]])[0])
        elif op[0] == "nack":
            mine = sorted(p for p, c in held_by(d).items() if c == op[1])
            if mine:
                d.nack(op[1], mine[0])
        else:
            d.set_consume_mode("unordered" if op[1] else "ordered")
        poll()
        d._audit()
    d.honour_delays(True)
    clock.advance(10.0)
    for _ in range(20):
        for name in ("c1", "c2"):
            d.flow(name, 100)
        poll()
        for name in ("c1", "c2"):
            taken, _ = d.ack_many(name, [p for p, c in held_by(d).items() if c == name])
            acked.update(taken)
        d._audit()
    assert acked == set(range(1, position + 1)) and d.stats()["held"] == 0


def held_by(d: Dispatcher) -> dict[int, str]:
    """Every position in flight, and on which consumer."""
    return {position: cid for cid in d.consumers() for position in d._consumers[cid].inflight}
