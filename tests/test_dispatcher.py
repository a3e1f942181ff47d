"""Example-based tests of the dispatcher core, written from its specification.

The PIP-34 timeline with the contiguous policy (join splits the busiest range, leave
merges into the less busy neighbour) and its counterpart with the multi-range policy
(a join takes a fair share from the busiest, a leave moves only the leaver's slots),
draining on join (G1, PIP-379), redelivery on removal and nack (G2, G3), keyless round
robin, permits, the bound (G4), every rejected call, and the stats. Time comes only from
a manual clock; nothing sleeps.
"""

from __future__ import annotations

import functools
import gc
import time
import tracemalloc
from collections import Counter, deque
from collections.abc import Callable
from itertools import pairwise
from typing import Any, cast

import pytest

import keyfailover
from keyfailover import Delivery, Dispatcher
from keyfailover.core.clock import ManualClock
from keyfailover.core.dispatcher import COMPILED
from keyfailover.core.errors import (
    BufferFullError,
    DuplicateConsumerError,
    InvalidKeyError,
    KeyFailoverError,
    NotInFlightError,
    PermitsError,
    PositionError,
    UnknownConsumerError,
)
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hash
from keyfailover.core.ranges import RangeMap
from keyfailover.core.rebalance import ContiguousPolicy, MultiRangePolicy, moved_slots, range_traffic

FULL = (0, HASH_RANGE_SIZE - 1)


class Stream:
    """Publishes into a dispatcher at increasing positions."""

    def __init__(self, d: Dispatcher, first: int = 0) -> None:
        self.d = d
        self.next_position = first

    def publish(self, key: str | bytes | None, payload: object = None) -> int:
        position = self.next_position
        self.d.publish(position, key, payload)
        self.next_position += 1
        return position


def keys_where(wanted: Callable[[int], bool], count: int, prefix: str = "key") -> list[str]:
    """The first ``count`` keys ``f"{prefix}-{i}"`` whose hash slot satisfies ``wanted``."""
    found: list[str] = []
    i = 0
    while len(found) < count:
        key = f"{prefix}-{i}"
        if wanted(key_hash(key)):
            found.append(key)
        i += 1
    return found


def keys_of(d: Dispatcher, consumer: str, count: int, prefix: str = "key") -> list[str]:
    """The first ``count`` keys that ``consumer`` owns right now."""
    found: list[str] = []
    i = 0
    while len(found) < count:
        key = f"{prefix}-{i}"
        if d.owner_of(key) == consumer:
            found.append(key)
        i += 1
    return found


def range_of(d: Dispatcher, consumer: str) -> tuple[int, int]:
    """The one range of ``consumer`` (the contiguous policy gives one range each)."""
    found = d.ranges_of(consumer)
    assert len(found) == 1, f"{consumer} should own exactly one range in {d.ranges()}"
    return found[0]


def assert_tiles(d: Dispatcher) -> None:
    ranges = d.ranges()
    assert ranges[0][0] == 0
    assert ranges[-1][1] == HASH_RANGE_SIZE - 1
    for (_, end, owner), (start, _, other) in pairwise(ranges):
        assert start == end + 1, ranges
        assert owner != other, f"two adjacent ranges of {owner}"
    assert {c for _, _, c in ranges} == set(d.consumers())


def ack_all(d: Dispatcher, deliveries: list[Delivery]) -> None:
    for delivery in deliveries:
        d.ack(delivery.consumer, delivery.position)


def drive(d: Dispatcher, clock: ManualClock, stream: Stream, per_tick: dict[str, int], ticks: int) -> None:
    """Deliver and ack ``per_tick[c]`` messages of c's own keys every half second; then each has a permit
    to spare, as a consumer waiting for more has (one without permits gains no slots in a change)."""
    for _ in range(ticks):
        for consumer, count in per_tick.items():
            d.flow(consumer, count)
            for key in keys_of(d, consumer, count, prefix=f"load-{consumer}"):
                stream.publish(key)
        out = d.poll()
        assert Counter(x.consumer for x in out) == Counter({c: n for c, n in per_tick.items() if n})
        ack_all(d, out)
        clock.advance(0.5)
    for consumer in per_tick:
        d.flow(consumer, 1)


def wrong(value: object) -> Any:
    """A value of the wrong type, typed Any so that the type checker lets a test pass it."""
    return value


def fingerprint(d: Dispatcher) -> tuple[Any, ...]:
    return d.ranges(), d.snapshot(), d.wants(), d.stats(), d.consumers()


# -- the API surface ------------------------------------------------------------------


def test_public_names_are_re_exported() -> None:
    from keyfailover import dispatcher

    assert keyfailover.Dispatcher is dispatcher.Dispatcher
    assert keyfailover.Delivery is dispatcher.Delivery
    assert Delivery._fields == ("consumer", "position", "key", "payload", "redelivery_count")


def test_no_consumer_no_ranges() -> None:
    d = Dispatcher(clock=ManualClock(100.0), max_replay=5)
    assert d.ranges() == []
    assert d.owner_of("anything") is None
    snapshot = d.snapshot()
    assert snapshot["version"] == 2
    assert snapshot["range_size"] == HASH_RANGE_SIZE
    assert snapshot["ranges"] == []
    assert d.wants() == 5
    d.publish(0, "k", "kept")  # held until someone can take it
    d.publish(1, None, "kept too")
    assert d.poll() == []
    assert d.wants() == 3
    d.add_consumer("late")
    d.flow("late", 5)
    out = d.poll()
    assert [(x.consumer, x.position, x.payload, x.redelivery_count) for x in out] == [
        ("late", 0, "kept", 0),
        ("late", 1, "kept too", 0),
    ]


def test_time_only_from_the_injected_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sans-IO: with a clock injected, the dispatcher never reads the system clock."""

    def forbidden() -> float:
        raise AssertionError("the dispatcher read the system clock")

    clock = ManualClock(100.0)
    d = Dispatcher(clock=clock, max_replay=50)
    for name in ("monotonic", "time", "perf_counter", "monotonic_ns", "time_ns", "perf_counter_ns"):
        monkeypatch.setattr(time, name, forbidden)
    stream = Stream(d)
    d.add_consumer("c1")
    d.add_consumer("c2")
    drive(d, clock, stream, {"c1": 3, "c2": 1}, ticks=6)
    d.add_consumer("c3")
    d.remove_consumer("c1")
    d.stats()
    d.snapshot()


def test_the_default_policy_is_multi_range() -> None:
    d = Dispatcher(clock=ManualClock(100.0), max_ranges=4)
    assert d.policy == MultiRangePolicy(max_ranges=4)
    assert Dispatcher(clock=ManualClock(100.0), policy="contiguous").policy == ContiguousPolicy()


def test_ranges_of_an_unknown_consumer_is_refused() -> None:
    d = Dispatcher(clock=ManualClock(100.0))
    d.add_consumer("a")
    assert d.ranges_of("a") == [FULL]
    with pytest.raises(UnknownConsumerError, match="consumer 'b' is not connected; known consumers: 'a'"):
        d.ranges_of("b")


# -- the PIP-34 timeline ----------------------------------------------------------------


@pytest.mark.parametrize("busy", ["C1", "C2"])
def test_pip34_timeline(busy: str) -> None:
    clock = ManualClock(100.0)
    d = Dispatcher(clock=clock, policy="contiguous")
    stream = Stream(d)

    d.add_consumer("C1")
    assert d.ranges() == [(0, HASH_RANGE_SIZE - 1, "C1")]
    assert d.owner_of("any key") == "C1"
    epoch = d.snapshot()["epoch"]

    d.add_consumer("C2")
    halves = [(0, HASH_RANGE_SIZE // 2 - 1), (HASH_RANGE_SIZE // 2, HASH_RANGE_SIZE - 1)]
    assert sorted([range_of(d, "C1"), range_of(d, "C2")]) == halves
    assert d.snapshot()["epoch"] > epoch
    before = {c: range_of(d, c) for c in ("C1", "C2")}

    # Measured load: `busy` delivers ten times as much as the other one, for a few seconds.
    idle = "C2" if busy == "C1" else "C1"
    drive(d, clock, stream, {busy: 20, idle: 2}, ticks=10)
    assert {c: range_of(d, c) for c in ("C1", "C2")} == before, "light traffic must not move a boundary"
    rates = {c: d.stats()["consumers"][c]["rate"] for c in ("C1", "C2")}
    assert rates[busy] > 2 * rates[idle] > 0, rates

    d.add_consumer("C3")
    assert_tiles(d)
    assert range_of(d, idle) == before[idle], f"C3 must split the busier {busy}, not {idle}"
    busy_start, busy_end = before[busy]
    c3_start, c3_end = range_of(d, "C3")
    kept_start, kept_end = range_of(d, busy)
    assert busy_start <= c3_start <= c3_end <= busy_end
    assert sorted([(kept_start, kept_end), (c3_start, c3_end)])[0][0] == busy_start
    assert (kept_end - kept_start + 1) + (c3_end - c3_start + 1) == busy_end - busy_start + 1

    # C1 leaves: its range merges into an adjacent neighbour; nobody else changes.
    old = {c: range_of(d, c) for c in ("C1", "C2", "C3")}
    c1_start, c1_end = old["C1"]
    d.remove_consumer("C1")
    assert_tiles(d)
    grown = [c for c in ("C2", "C3") if range_of(d, c) != old[c]]
    assert len(grown) == 1, d.ranges()
    heir = grown[0]
    heir_start, heir_end = old[heir]
    assert heir_end + 1 == c1_start or c1_end + 1 == heir_start, f"{heir} is not adjacent to C1"
    assert range_of(d, heir) == (min(heir_start, c1_start), max(heir_end, c1_end))

    d.remove_consumer("C2")
    assert d.ranges() == [(0, HASH_RANGE_SIZE - 1, "C3")]
    assert d.owner_of("any key") == "C3"


def test_join_ties_go_to_the_widest_range() -> None:
    """Without any traffic (all rates 0) a joining consumer splits the widest range."""
    d = Dispatcher(clock=ManualClock(100.0), split="midpoint", policy="contiguous")
    for name in ("a", "b", "c"):
        d.add_consumer(name)
    widths = {c: end - start + 1 for start, end, c in d.ranges()}
    assert sorted(widths.values()) == [HASH_RANGE_SIZE // 4, HASH_RANGE_SIZE // 4, HASH_RANGE_SIZE // 2]
    widest = max(widths, key=lambda c: widths[c])
    widest_start, widest_end = range_of(d, widest)
    others = {c: range_of(d, c) for c in widths if c != widest}
    d.add_consumer("d")
    assert {c: range_of(d, c) for c in others} == others
    assert sorted([range_of(d, widest), range_of(d, "d")]) == [
        (widest_start, widest_start + HASH_RANGE_SIZE // 4 - 1),
        (widest_start + HASH_RANGE_SIZE // 4, widest_end),
    ]


@pytest.mark.parametrize("busier_side", ["below", "above"])
def test_leaver_merges_into_the_less_busy_neighbour(busier_side: str) -> None:
    clock = ManualClock(100.0)
    d = Dispatcher(clock=clock, split="midpoint", policy="contiguous")
    for name in ("a", "b", "c"):
        d.add_consumer(name)
    middle = next(c for start, end, c in d.ranges() if start > 0 and end < HASH_RANGE_SIZE - 1)
    start, end = range_of(d, middle)
    below, above = d.ranges()[0][2], d.ranges()[-1][2]
    assert range_of(d, below)[1] + 1 == start and range_of(d, above)[0] == end + 1
    busier, calmer = (below, above) if busier_side == "below" else (above, below)

    drive(d, clock, Stream(d), {busier: 20, calmer: 2, middle: 5}, ticks=10)
    rates = d.stats()["consumers"]
    assert rates[busier]["rate"] > rates[calmer]["rate"] > 0
    busier_range, calmer_range = range_of(d, busier), range_of(d, calmer)

    d.remove_consumer(middle)
    assert range_of(d, busier) == busier_range
    assert range_of(d, calmer) == (min(calmer_range[0], start), max(calmer_range[1], end))
    assert_tiles(d)


@pytest.mark.parametrize("busy", ["C1", "C2"])
def test_multi_range_timeline(busy: str) -> None:
    """The same timeline with the default multi-range policy: a join takes a fair share from
    the busiest, a leave moves only the leaver's slots."""
    clock = ManualClock(100.0)
    d = Dispatcher(clock=clock)
    stream = Stream(d)
    d.add_consumer("C1")
    assert d.ranges() == [(0, HASH_RANGE_SIZE - 1, "C1")]

    d.add_consumer("C2")  # nothing measured yet: slots weigh alike, the joiner takes the low end of its band
    assert_tiles(d)
    band = 1.0 - cast(MultiRangePolicy, d.policy).tolerance
    assert abs(d.range_map().width("C2") - band * HASH_RANGE_SIZE / 2) <= 1
    assert d.range_map().width("C1") == HASH_RANGE_SIZE - d.range_map().width("C2")
    idle = "C2" if busy == "C1" else "C1"
    drive(d, clock, stream, {busy: 20, idle: 2}, ticks=10)
    rates = {c: d.stats()["consumers"][c]["rate"] for c in ("C1", "C2")}
    assert rates[busy] > 2 * rates[idle] > 0, rates

    before = d.range_map()
    d.add_consumer("C3")
    after = d.range_map()
    assert_tiles(d)
    moves = moved_slots(before, after)
    assert {old for _, _, old, _ in moves} == {busy}, f"only the busiest gives: {moves}"
    traffic = d.traffic()
    total = float(traffic.sum())
    shares = {c: load / total for c, load in range_traffic(after, traffic).items()}
    assert range_traffic(before, traffic)[busy] / total > 0.9
    assert 0.25 <= shares["C3"] <= 0.4, shares
    assert max(shares.values()) <= 0.4, f"nobody is left with much more than a third: {shares}"

    d.remove_consumer("C1")  # only C1's slots move; the others keep every slot they had
    assert_tiles(d)
    assert {old for _, _, old, _ in moved_slots(after, d.range_map())} == {"C1"}

    d.remove_consumer("C2")
    assert d.ranges() == [(0, HASH_RANGE_SIZE - 1, "C3")]


def test_a_consumer_joining_on_little_traffic_gets_a_range() -> None:
    d = Dispatcher(clock=ManualClock(1000.0))
    d.add_consumer("c1")
    d.add_consumer("c2")
    d.publish(1, "hot")  # both keys hash into c1's half, at either end of what c1 keeps
    d.publish(2, "k3")
    d.add_consumer("c3")
    d.add_consumer("c4")
    assert d.ranges_of("c4"), d.ranges()


def test_every_change_bumps_the_epoch() -> None:
    d = Dispatcher(clock=ManualClock(100.0))
    epochs = [d.snapshot()["epoch"]]
    changes: list[Callable[[], None]] = [
        lambda: d.add_consumer("a"),
        lambda: d.add_consumer("b"),
        lambda: d.add_consumer("c"),
        lambda: d.remove_consumer("b"),
        lambda: d.remove_consumer("a"),
    ]
    for change in changes:
        change()
        epochs.append(d.snapshot()["epoch"])
    assert epochs == sorted(set(epochs)), f"epochs must strictly increase: {epochs}"
    snapshot = d.snapshot()
    assert snapshot["ranges"] == [{"start": 0, "end": HASH_RANGE_SIZE - 1, "consumer": "c"}]
    assert set(snapshot) == {"version", "range_size", "epoch", "ranges"}


# -- G1: draining on join ---------------------------------------------------------------


def test_key_in_flight_on_old_owner_drains_before_moving() -> None:
    clock = ManualClock(100.0)
    d = Dispatcher(clock=clock)
    stream = Stream(d)
    d.add_consumer("c1")
    d.flow("c1", 1000)
    held = [f"held-{i}" for i in range(60)]
    first_of = {key: stream.publish(key) for key in held}
    second_of = {key: stream.publish(key) for key in held}
    out = d.poll()
    assert {x.position for x in out} == set(first_of.values()) | set(second_of.values())
    assert {x.consumer for x in out} == {"c1"}

    d.add_consumer("c2")
    moved = [k for k in held if d.owner_of(k) == "c2"]
    stayed = [k for k in held if d.owner_of(k) == "c1"]
    fresh = [k for k in (f"fresh-{i}" for i in range(60)) if d.owner_of(k) == "c2"]
    assert moved and stayed and fresh, "the split should move some keys of each kind"

    stats = d.stats()["consumers"]
    assert stats["c1"]["draining_hashes"] == len(moved)
    assert stats["c1"]["draining_unacked"] == 2 * len(moved)
    assert stats["c2"]["draining_hashes"] == 0

    d.flow("c2", 1000)
    third_of = {key: stream.publish(key) for key in moved + stayed}
    fresh_at = {key: stream.publish(key) for key in fresh}
    out = d.poll()
    by_position = {x.position: x.consumer for x in out}
    # Keys that moved with nothing in flight go to the new owner at once (G5 as well).
    assert all(by_position.get(fresh_at[k]) == "c2" for k in fresh)
    # Keys that stayed go on to their owner.
    assert all(by_position.get(third_of[k]) == "c1" for k in stayed)
    # Keys still unacked on c1 go to nobody, not even c1, which still has permits.
    assert not any(third_of[k] in by_position for k in moved)
    assert d.poll() == []

    key = moved[0]
    d.ack("c1", first_of[key])
    assert d.poll() == [], "one of two unacked messages acked: still draining"
    assert d.stats()["consumers"]["c1"]["draining_hashes"] == len(moved)
    d.ack("c1", second_of[key])
    assert d.stats()["consumers"]["c1"]["draining_hashes"] == len(moved) - 1
    out = d.poll()
    assert [(x.consumer, x.position, x.key, x.redelivery_count) for x in out] == [("c2", third_of[key], key, 0)]

    # The old owner acks everything: every moved key goes on, in order, to c2.
    for k in moved[1:] + stayed:
        d.ack("c1", first_of[k])
        d.ack("c1", second_of[k])
    out = d.poll()
    assert sorted((x.consumer, x.position) for x in out) == sorted(("c2", third_of[k]) for k in moved[1:])
    assert d.stats()["consumers"]["c1"]["draining_hashes"] == 0


@pytest.mark.parametrize("policy", ["multi", "contiguous"])
def test_old_owner_leaving_releases_its_draining_keys_in_order(policy: str) -> None:
    d = Dispatcher(clock=ManualClock(100.0), split="midpoint", policy=policy)
    stream = Stream(d)
    d.add_consumer("c1")
    d.flow("c1", 100)
    keys = [f"drain-{i}" for i in range(40)]
    first = {key: stream.publish(key, "first") for key in keys}
    second = {key: stream.publish(key, "second") for key in keys}
    assert len(d.poll()) == 80
    d.add_consumer("c2")
    moved = [key for key in keys if d.owner_of(key) == "c2"]
    assert moved, "the join moves some of the keys in flight"
    d.flow("c2", 200)
    third = {key: stream.publish(key, "third") for key in moved}
    assert d.poll() == [], "keys in flight on c1 are blocked"

    d.remove_consumer("c1")
    out = d.poll()
    assert {x.consumer for x in out} == {"c2"}
    for key in keys:
        mine = [(x.position, x.payload, x.redelivery_count) for x in out if x.key == key]
        expected = [(first[key], "first", 1), (second[key], "second", 1)]
        assert mine == expected + ([(third[key], "third", 0)] if key in moved else [])


def slot_twins(wanted: Callable[[int], bool]) -> tuple[str, str]:
    """Two different keys with the same hash slot, in a slot that satisfies ``wanted``."""
    seen: dict[int, str] = {}
    i = 0
    while True:
        key = f"twin-{i}"
        slot = key_hash(key)
        if wanted(slot):
            if slot in seen:
                return seen[slot], key
            seen[slot] = key
        i += 1


def in_eighth(low: int, eighth: int, slot: int) -> bool:
    return low <= slot < low + eighth


def test_keys_sharing_a_slot_move_independently() -> None:
    """Draining is per key: a key with nothing in flight moves at once even if another key
    of its slot is still unacked on the old owner."""
    d = Dispatcher(clock=ManualClock(100.0))
    stream = Stream(d)
    d.add_consumer("c1")
    d.flow("c1", 20)
    eighth = HASH_RANGE_SIZE // 8  # a pair in each eighth of the slots: the joiner's share holds some
    pairs = [slot_twins(functools.partial(in_eighth, low, eighth)) for low in range(0, HASH_RANGE_SIZE, eighth)]
    first = {held: stream.publish(held) for held, _ in pairs}
    assert len(d.poll()) == len(pairs)
    d.add_consumer("c2")
    d.flow("c2", 10)
    held, free = next((a, b) for a, b in pairs if d.owner_of(a) == "c2")
    assert key_hash(held) == key_hash(free) and d.owner_of(free) == "c2"
    blocked, moved = stream.publish(held), stream.publish(free)
    out = d.poll()
    assert [(x.consumer, x.position) for x in out] == [("c2", moved)]
    d.ack("c1", first[held])
    assert [(x.consumer, x.position) for x in d.poll()] == [("c2", blocked)]


# -- a range change costs what moves -------------------------------------------------------


class UnwalkableKeys(dict[bytes, Any]):
    """The dispatcher's key table, made to fail the test if anything walks every held key."""

    def __iter__(self) -> Any:
        raise AssertionError("a range change walked every held key")

    def values(self) -> Any:
        raise AssertionError("a range change walked every held key")

    def items(self) -> Any:
        raise AssertionError("a range change walked every held key")


def held_in_moved_slots(before: RangeMap, after: RangeMap, keys: list[str]) -> set[bytes]:
    moved = moved_slots(before, after)
    return {key.encode() for key in keys if any(first <= key_hash(key) <= last for first, last, _, _ in moved)}


def holding(policy: str, permits: int, keys: list[str], again: list[str]) -> tuple[Dispatcher, list[Delivery]]:
    """A dispatcher of ``policy`` whose consumers c1, c2 and c3 have ``permits`` each, given a message of
    each of ``keys`` and then one of each of ``again``; returns it and what its first poll delivered."""
    d = Dispatcher(clock=ManualClock(100.0), policy=policy, max_replay=10_000)
    stream = Stream(d)
    for name in ("c1", "c2", "c3"):
        d.add_consumer(name)
        d.flow(name, permits)
    for key in keys + again:
        stream.publish(key)
    return d, d.poll()


@pytest.mark.parametrize("policy", ["multi", "contiguous"])
def test_a_range_change_visits_only_the_keys_of_the_moved_slots(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A join or a leave re-routes the keys of the moved slots, each once (a leaver's returned keys
    once more), and never walks the other held keys."""
    keys = [f"held-{i}" for i in range(1500)]
    d, out = holding(policy, 500, keys, keys[:700])  # in flight, and some pending behind them
    visited: Counter[bytes] = Counter()
    reroute, reroute_slots = d._reroute, d._reroute_slots

    def counting(state: Any) -> None:
        visited[state.kb] += 1
        reroute(state)

    def counting_slots(first: int, last: int, owner: Any) -> None:
        visited.update(state.kb for state in d._keys_in(first, last))
        reroute_slots(first, last, owner)

    monkeypatch.setattr(d, "_reroute", counting)
    monkeypatch.setattr(d, "_reroute_slots", counting_slots)
    monkeypatch.setattr(d, "_keys", UnwalkableKeys(d._keys))

    before = d.range_map()
    d.add_consumer("c4")
    expected = held_in_moved_slots(before, d.range_map(), keys)
    assert 0 < len(expected) < len(keys)
    assert visited == Counter(expected)

    visited.clear()
    before = d.range_map()
    d.remove_consumer("c2")
    expected = held_in_moved_slots(before, d.range_map(), keys)
    returned = {str(x.key).encode() for x in out if x.consumer == "c2"}
    assert returned and 0 < len(expected) < len(keys)
    assert visited == Counter(expected) + Counter(returned)
    monkeypatch.undo()
    d._audit()


def test_keys_of_moved_slots_follow_their_new_owner_whatever_their_state() -> None:
    """Keys of the moved slots, pending or in flight, end where G1 says; acked keys leave no trace."""
    d = Dispatcher(clock=ManualClock(100.0), max_replay=10_000)
    stream = Stream(d)
    d.add_consumer("c1")
    d.flow("c1", 300)
    keys = [f"state-{i}" for i in range(400)]
    for key in keys:
        stream.publish(key)
    out = d.poll()
    assert [x.key for x in out] == keys[:300]
    ack_all(d, out[:100])  # keys 0-99 acked to nothing, 100-299 in flight, 300-399 pending
    d.add_consumer("c2")
    d.flow("c2", 1000)
    d._audit()
    moved = [key for key in keys if d.owner_of(key) == "c2"]
    draining = [key for key in moved if 100 <= keys.index(key) < 300]
    assert draining and len(moved) < len(keys)
    out = d.poll()
    assert {x.consumer for x in out} == {"c2"}
    assert sorted(str(x.key) for x in out) == sorted(key for key in moved if keys.index(key) >= 300)
    assert d.stats()["consumers"]["c1"]["draining_hashes"] == len({key_hash(key) for key in draining})
    ack_all(d, out)
    d.remove_consumer("c1")
    d._audit()
    out = d.poll()
    assert sorted(str(x.key) for x in out) == sorted(keys[100:300] + [key for key in keys[300:] if key not in moved])
    ack_all(d, out)
    assert d.stats()["held"] == 0
    assert not d._keys and not any(d._slot_keys), "acked keys stay linked in their slots"


class GuardedQueue(deque[Any]):
    """A key's pending queue that raises on every read while ``armed``: what a range change must not read."""

    armed = False

    def _check(self) -> None:
        if GuardedQueue.armed:
            raise AssertionError("a range change read a moved key's pending queue")

    def __len__(self) -> int:
        self._check()
        return super().__len__()

    def __getitem__(self, index: Any) -> Any:
        self._check()
        return super().__getitem__(index)

    def __iter__(self) -> Any:
        self._check()
        return super().__iter__()


def guard_queues(d: Dispatcher, spared: set[bytes]) -> None:
    """Make every key's pending queue a :class:`GuardedQueue` of the same messages, but a plain deque for
    the ``spared`` keys (read while disarmed)."""
    armed, GuardedQueue.armed = GuardedQueue.armed, False
    for kb, state in d._keys.items():
        if state.pending:
            state.pending = (deque if kb in spared else GuardedQueue)(state.pending)
    GuardedQueue.armed = armed


def waiting_positions(d: Dispatcher, consumer: str) -> list[int]:
    """Every pending position of the keys ``consumer`` owns that are free to go (not draining), sorted."""
    return sorted(
        message.position
        for state in d._keys.values()
        if not state.draining and d._owner_of_slot(state.slot) is d._consumers[consumer]
        for message in state.pending
    )


@pytest.mark.parametrize("policy", ["multi", "contiguous"])
def test_a_range_change_reads_the_moved_keys_states_only(policy: str) -> None:
    """A join or a leave sets each moved key's state and never reads its queue or head message (scattered
    over what is held); the new owner's next poll serves the moved keys as if they had been queued at the
    change: its smallest pending positions, in order."""
    keys = [f"moved-{i}" for i in range(600)]
    d, out = holding(policy, 100, keys, keys[::2])  # in flight, waiting behind what is in flight, and only waiting
    GuardedQueue.armed = True
    try:
        guard_queues(d, set())
        d.add_consumer("c4")
        returned = {str(x.key).encode() for x in out if x.consumer == "c2"}
        guard_queues(d, returned)  # a leaver's in-flight messages go back to their keys' queues (G3)
        d.remove_consumer("c2")
    finally:
        GuardedQueue.armed = False
    d._audit()
    assert any(d._consumers[name].adopted for name in ("c1", "c3", "c4")), "no key was adopted"
    expected = {name: waiting_positions(d, name)[:40] for name in ("c1", "c3", "c4")}
    for name in expected:
        d.flow(name, 40)
    served: dict[str, list[int]] = {name: [] for name in expected}
    for delivery in d.poll():
        served[delivery.consumer].append(delivery.position)
    assert served == expected
    assert not any(d._consumers[name].adopted for name in expected)
    d._audit()


def test_keys_adopted_by_a_consumer_without_permits_wait_listed_within_a_bound() -> None:
    """A consumer with no permits adopts the keys of every change back to it and makes their ready entries
    only when it gets permits; its list is pruned when stale entries dominate, and then every waiting
    message goes out once, in order per key."""
    d = Dispatcher(clock=ManualClock(100.0), max_replay=10_000)
    stream = Stream(d)
    d.add_consumer("slow")
    keys = [f"adopted-{i}" for i in range(40)]
    published: dict[str, list[int]] = {key: [] for key in keys}
    for _ in range(3):
        for key in keys:
            published[key].append(stream.publish(key))
    assert d.poll() == []
    slow = d._consumers["slow"]
    entries = list(slow.ready)
    longest = 0
    for i in range(60):
        d.add_consumer(f"visitor-{i}")
        d.remove_consumer(f"visitor-{i}")
        longest = max(longest, len(slow.adopted))
    assert 0 < longest <= max(64, 4 * len(d._keys)), f"{longest} adopted entries for {len(d._keys)} keys"
    assert slow.ready == entries, "ready entries made without permits"
    d.flow("slow", 1000)
    got: dict[str, list[int]] = {key: [] for key in keys}
    for delivery in d.poll():
        got[str(delivery.key)].append(delivery.position)
    assert got == published
    d._audit()


# -- G3: removal ------------------------------------------------------------------------


def test_removed_consumers_messages_go_to_the_new_owner_first() -> None:
    d = Dispatcher(clock=ManualClock(100.0), split="midpoint")
    stream = Stream(d, first=10)
    d.add_consumer("c1")
    d.add_consumer("c2")
    (k,) = keys_of(d, "c1", 1)
    (j,) = keys_of(d, "c2", 1)
    d.flow("c1", 2)
    p1, p2 = stream.publish(k, "k1"), stream.publish(k, "k2")
    assert [(x.consumer, x.position) for x in d.poll()] == [("c1", p1), ("c1", p2)]
    p3 = stream.publish(k, "k3")  # c1 has no permits left: pending
    newer = [stream.publish(j, "j1"), stream.publish(j, "j2")]  # c2 has no permits: pending
    assert d.poll() == []

    d.remove_consumer("c1")
    assert d.ranges() == [(0, HASH_RANGE_SIZE - 1, "c2")]
    d.flow("c2", 2)
    out = d.poll()
    assert [(x.consumer, x.position, x.payload, x.redelivery_count) for x in out] == [
        ("c2", p1, "k1", 1),
        ("c2", p2, "k2", 1),
    ]
    d.flow("c2", 10)
    out += d.poll()
    assert sorted(x.position for x in out) == [p1, p2, p3, *newer]
    assert [x.position for x in out if x.key == k] == [p1, p2, p3]
    ack_all(d, out)
    assert d.wants() == 100_000
    with pytest.raises(UnknownConsumerError):
        d.flow("c1", 1)


def test_re_added_consumer_starts_afresh() -> None:
    d = Dispatcher(clock=ManualClock(100.0))
    stream = Stream(d)
    d.add_consumer("c1")
    d.flow("c1", 3)
    position = stream.publish("k")
    assert [x.position for x in d.poll()] == [position]
    d.remove_consumer("c1")
    d.add_consumer("c1")
    entry = d.stats()["consumers"]["c1"]
    assert (entry["permits"], entry["unacked"]) == (0, 0)
    with pytest.raises(NotInFlightError):
        d.ack("c1", position)
    d.flow("c1", 1)
    out = d.poll()
    assert [(x.consumer, x.position, x.redelivery_count) for x in out] == [("c1", position, 1)]
    d.ack("c1", position)
    assert d.wants() == 100_000
    assert d.poll() == []


# -- G2: nack ---------------------------------------------------------------------------


def test_nack_returns_the_position_and_every_later_delivery_of_the_key() -> None:
    d = Dispatcher(clock=ManualClock(100.0))
    d.add_consumer("c1")
    d.flow("c1", 7)
    d.publish(1, "k", "a")
    d.publish(2, "k", "b")
    d.publish(3, b"k", "c")  # the same key as "k"
    d.publish(4, "j", "d")
    d.publish(5, b"k", "e")
    out = d.poll()
    assert [x.position for x in out] == [1, 2, 3, 4, 5]
    assert [x.key for x in out] == ["k", "k", b"k", "j", b"k"]

    d.nack("c1", 2)
    assert d.stats()["consumers"]["c1"]["unacked"] == 2  # 1 and 4 stay in flight
    for position in (2, 3, 5):
        with pytest.raises(NotInFlightError):
            d.ack("c1", position)
    out = d.poll()
    assert [(x.position, x.payload, x.redelivery_count) for x in out] == [(2, "b", 1), (3, "c", 1)]
    assert d.stats()["consumers"]["c1"]["permits"] == 0  # 7 permits: 5, then 2 of 3 redeliveries

    d.nack("c1", 1)  # returns 1, 2 and 3 (5 is still pending)
    d.flow("c1", 3)
    out = d.poll()
    assert [(x.position, x.redelivery_count) for x in out] == [(1, 1), (2, 2), (3, 2)]
    d.flow("c1", 5)
    out = d.poll()
    assert [(x.position, x.redelivery_count) for x in out] == [(5, 1)]
    for position in (1, 2, 3, 4, 5):
        d.ack("c1", position)
    assert d.stats()["consumers"]["c1"]["unacked"] == 0
    assert d.poll() == []


def test_failures_count_only_the_deliveries_that_came_back_as_the_oldest_of_their_key() -> None:
    d = Dispatcher(clock=ManualClock(100.0))
    d.add_consumer("c1")
    d.flow("c1", 10)
    for position in (1, 2, 3):
        d.publish(position, "k", position)
    d.poll()
    assert [d.failures("c1", p) for p in (1, 2, 3)] == [0, 0, 0]
    d.nack("c1", 2)  # 2 failed; 3 comes back only to keep the key's order
    out = d.poll()
    assert [(x.position, x.redelivery_count, d.failures("c1", x.position)) for x in out] == [(2, 1, 1), (3, 1, 0)]
    d.nack("c1", 3)
    assert d.failures("c1", 3) is None  # not in flight
    assert [(x.position, x.redelivery_count, d.failures("c1", x.position)) for x in d.poll()] == [(3, 2, 1)]
    with pytest.raises(UnknownConsumerError):
        d.failures("nobody", 1)


def test_nack_of_a_keyless_message_returns_only_that_message() -> None:
    d = Dispatcher(clock=ManualClock(100.0))
    d.add_consumer("c1")
    d.flow("c1", 3)
    for position in (1, 2, 3):
        d.publish(position, None, position)
    assert len(d.poll()) == 3
    d.nack("c1", 1)
    assert d.stats()["consumers"]["c1"]["unacked"] == 2
    d.ack("c1", 2)
    d.ack("c1", 3)
    d.flow("c1", 1)
    assert [(x.position, x.redelivery_count) for x in d.poll()] == [(1, 1)]


def test_nacked_keyless_messages_come_back_in_position_order() -> None:
    """Nacked one by one, oldest first, keyless messages go out again oldest first (as Pulsar replays them),
    ahead of one that waited for permits, not last-nacked first."""
    d = Dispatcher(clock=ManualClock(100.0))
    d.add_consumer("c1")
    d.flow("c1", 3)
    for position in (1, 2, 3, 4):
        d.publish(position, None, position)
    assert [x.position for x in d.poll()] == [1, 2, 3]  # 4 waits for a permit
    for position in (1, 2, 3):
        d.nack("c1", position)
    d.flow("c1", 4)
    assert [(x.position, x.redelivery_count) for x in d.poll()] == [(1, 1), (2, 1), (3, 1), (4, 0)]
    d._audit()


def test_str_and_bytes_forms_are_one_key() -> None:
    d = Dispatcher(clock=ManualClock(100.0))
    for name in ("a", "b", "c", "d"):
        d.add_consumer(name)
        d.flow(name, 10)
    keys = [f"k\u00e9y-{i}" for i in range(8)]
    for key in keys:
        assert d.owner_of(key) == d.owner_of(key.encode())
    key = keys[0]
    owner = d.owner_of(key)
    assert owner is not None
    d.publish(1, key, "s1")
    d.publish(2, key.encode(), "b2")
    d.publish(3, key, "s3")
    out = d.poll()
    assert [(x.consumer, x.position, x.key) for x in out] == [
        (owner, 1, key),
        (owner, 2, key.encode()),
        (owner, 3, key),
    ]
    d.nack(owner, 1)  # returns every later delivery of the key, in either form
    assert d.stats()["consumers"][owner]["unacked"] == 0
    out = d.poll()
    assert [(x.position, x.key, x.payload, x.redelivery_count) for x in out] == [
        (1, key, "s1", 1),
        (2, key.encode(), "b2", 1),
        (3, key, "s3", 1),
    ]


# -- keyless messages -------------------------------------------------------------------


def test_keyless_messages_go_round_robin() -> None:
    d = Dispatcher(clock=ManualClock(100.0))
    for name in ("a", "b", "c"):
        d.add_consumer(name)
        d.flow(name, 100)
    stream = Stream(d)
    one_by_one = []
    for _ in range(6):
        stream.publish(None)
        out = d.poll()
        assert len(out) == 1
        one_by_one.append(out[0].consumer)
    assert Counter(one_by_one) == Counter({"a": 2, "b": 2, "c": 2})
    assert all(x != y for x, y in pairwise(one_by_one)), one_by_one

    batch = [stream.publish(None) for _ in range(9)]
    out = d.poll()
    assert sorted(x.position for x in out) == batch
    assert Counter(x.consumer for x in out) == Counter({"a": 3, "b": 3, "c": 3})


def test_unordered_mode_hands_messages_round_robin_whatever_their_keys() -> None:
    """In unordered mode every message goes to the next consumer in turn that has permits, one each; once all
    are acked (in batches), no state of their keys is left."""
    d = Dispatcher(clock=ManualClock(100.0), consume_mode="unordered")
    for name in ("a", "b", "c"):
        d.add_consumer(name)
        d.flow(name, 100)
    stream = Stream(d)
    batch = [stream.publish(key) for key in ["k1"] * 4 + [None, "k2", "k3", "k1", "k4"]]
    out = d.poll()
    assert [x.position for x in out] == batch
    assert [x.consumer for x in out] == ["a", "b", "c"] * 3
    d.ack_many("b", [x.position for x in out if x.consumer == "b"])
    d.remove_consumer("c")  # its loose deliveries come back, and go round robin over a and b
    again = d.poll()
    assert [x.consumer for x in again] == ["a", "b", "a"]
    assert sorted(x.position for x in again) == sorted(x.position for x in out if x.consumer == "c")
    assert d.ack_many("a", [x.position for x in [*out, *again] if x.consumer == "a"])[1] == []
    assert d.ack_many("b", [x.position for x in again if x.consumer == "b"])[1] == []
    assert d.stats()["held"] == 0
    assert not d._keys and not any(d._slot_keys), "acked keys stay linked in their slots"


def test_keyless_messages_skip_consumers_without_permits_and_are_never_lost() -> None:
    d = Dispatcher(clock=ManualClock(100.0))
    for name in ("a", "b", "c"):
        d.add_consumer(name)
    stream = Stream(d)
    positions = [stream.publish(None, i) for i in range(6)]
    assert d.poll() == []
    d.flow("b", 4)
    out = d.poll()
    assert [x.consumer for x in out] == ["b"] * 4
    d.remove_consumer("b")  # its four come back
    d.flow("c", 10)
    out = d.poll()
    assert {x.consumer for x in out} == {"c"}
    assert sorted(x.position for x in out) == positions
    assert sorted(x.redelivery_count for x in out) == [0, 0, 1, 1, 1, 1]


# -- permits and the bound (G4) ---------------------------------------------------------


def test_a_consumer_never_gets_more_deliveries_than_permits() -> None:
    d = Dispatcher(clock=ManualClock(100.0))
    d.add_consumer("c1")
    stream = Stream(d)
    for i in range(10):
        stream.publish(f"k{i}")
    d.flow("c1", 0)
    assert d.poll() == []
    d.flow("c1", 2)
    d.flow("c1", 1)
    assert len(d.poll()) == 3
    assert d.poll() == []
    assert d.stats()["consumers"]["c1"]["permits"] == 0
    d.flow("c1", 100)
    assert len(d.poll()) == 7
    assert d.stats()["consumers"]["c1"]["permits"] == 93


def test_bound_counts_pending_and_in_flight() -> None:
    d = Dispatcher(clock=ManualClock(100.0), max_replay=3)
    d.add_consumer("c1")
    d.flow("c1", 1)
    assert d.wants() == 3
    d.publish(1, "a", None)
    d.publish(2, "b", None)
    assert d.wants() == 1
    out = d.poll()
    assert len(out) == 1
    assert d.wants() == 1, "a delivery in flight is still held"
    d.publish(3, None, None)
    assert d.wants() == 0
    before = fingerprint(d)
    with pytest.raises(BufferFullError) as info:
        d.publish(4, "c", None)
    assert str(info.value)
    assert fingerprint(d) == before
    ack_all(d, out)
    assert d.wants() == 1
    d.publish(4, "c", None)  # the rejected position is still free
    assert d.wants() == 0


# -- memory per held message ----------------------------------------------------------------


def test_a_held_message_keeps_no_copy_of_its_key() -> None:
    """Messages of one key share their key state's bytes and slot, hand back the type they came
    with, and a key with nothing waiting has no pending queue of its own."""
    d = Dispatcher(clock=ManualClock(100.0))
    d.add_consumer("c1")
    d.flow("c1", 3)
    key = "shared-key"
    for position in range(4):
        d.publish(position, "".join(key) if position % 2 else key.encode())  # a new str or bytes object each time
    out = d.poll()
    assert [x.key for x in out] == [key.encode(), key, key.encode()]
    state = d._keys[key.encode()]
    inflight = list(d._consumers["c1"].inflight.values())
    assert all(m.kb is state.kb for m in inflight)
    # The compiled core keeps a slot as a machine int in the object, no object of its own to share.
    assert all(m.slot is state.slot if not COMPILED else m.slot == state.slot for m in inflight)
    (waiting,) = state.pending
    assert waiting.kb is state.kb
    d.ack("c1", 0)
    d.flow("c1", 1)
    assert [(x.position, x.key) for x in d.poll()] == [(3, key)]
    assert not state.pending and state.pending.maxlen == 0, "an emptied queue is let go for the shared empty one"


@pytest.mark.slow
def test_core_memory_per_held_message_is_under_200_bytes() -> None:
    """20,000 messages over 200 keys, in flight or waiting: what the core keeps per message beyond
    its fixed tables, keys decoded afresh per message as a reader makes them (was about 350 bytes)."""
    for permits in (20_000, 0):
        d = Dispatcher(clock=ManualClock(100.0), max_replay=20_000)
        for name in ("c1", "c2", "c3", "c4"):
            d.add_consumer(name)
            d.flow(name, permits)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for position in range(20_000):
                d.publish(position, f"key-{position % 200}")
            assert len(d.poll()) == (20_000 if permits else 0)
            gc.collect()
            per_message = (tracemalloc.get_traced_memory()[0] - before) / 20_000
        finally:
            tracemalloc.stop()
        assert per_message <= 200, f"{per_message:.0f} bytes per held message with {permits} permits"
        assert d.stats()["held"] == 20_000


# -- rejected calls change nothing ------------------------------------------------------


def prepared() -> tuple[Dispatcher, ManualClock]:
    """Two consumers, deliveries in flight, pending messages and a draining key."""
    clock = ManualClock(100.0)
    d = Dispatcher(clock=clock, max_replay=50, split="midpoint", policy="contiguous")
    d.add_consumer("c1")
    d.flow("c1", 4)
    (moving,) = keys_where(lambda slot: slot >= HASH_RANGE_SIZE // 2, 1, prefix="mv")
    (staying,) = keys_where(lambda slot: slot < HASH_RANGE_SIZE // 2, 1, prefix="st")
    d.publish(10, moving, "m1")
    d.publish(11, staying, "s1")
    d.publish(12, None, "n1")
    d.publish(13, staying, "s2")
    d.publish(14, staying, "s3")
    assert len(d.poll()) == 4
    clock.advance(1.5)
    d.add_consumer("c2")
    d.publish(20, moving, "m2")  # blocked: draining on c1
    d.flow("c2", 1)
    d.poll()
    assert d.stats()["consumers"]["c1"]["draining_hashes"] == 1
    return d, clock


def follow_up(d: Dispatcher, clock: ManualClock) -> list[Any]:
    """The same calls on a twin: a rejected call must not change what comes after."""
    seen: list[Any] = []
    d.flow("c1", 10)
    d.flow("c2", 10)
    d.publish(21, "after", "x")  # right after the last accepted position
    seen.append(d.poll())
    for position in (10, 11, 12, 13):
        d.ack("c1", position)
    clock.advance(2.0)
    seen.append(d.poll())
    d.add_consumer("c3")
    d.publish(22, None, "y")
    seen.append(d.poll())
    d.remove_consumer("c1")
    seen.append(d.poll())
    seen.append((d.ranges(), d.wants(), d.stats()))
    return seen


BAD_CALLS: list[tuple[str, Callable[[Dispatcher], object], type[KeyFailoverError], tuple[str, ...]]] = [
    ("position repeated", lambda d: d.publish(20, "k", None), PositionError, ("20",)),
    ("position going back", lambda d: d.publish(5, "k", None), PositionError, ("5", "20")),
    ("position a float", lambda d: d.publish(wrong(30.0), "k", None), PositionError, ("int", "float")),
    ("position a str", lambda d: d.publish(wrong("31"), "k", None), PositionError, ("int", "str")),
    ("position None", lambda d: d.publish(wrong(None), "k", None), PositionError, ("int",)),
    ("negative permits", lambda d: d.flow("c1", -1), PermitsError, ("-1",)),
    ("float permits", lambda d: d.flow("c1", wrong(1.5)), PermitsError, ("int",)),
    ("str permits", lambda d: d.flow("c1", wrong("3")), PermitsError, ("int",)),
    ("flow unknown", lambda d: d.flow("nobody", 1), UnknownConsumerError, ("nobody",)),
    ("ack unknown", lambda d: d.ack("nobody", 11), UnknownConsumerError, ("nobody",)),
    ("nack unknown", lambda d: d.nack("nobody", 11), UnknownConsumerError, ("nobody",)),
    ("remove unknown", lambda d: d.remove_consumer("nobody"), UnknownConsumerError, ("nobody",)),
    ("add duplicate", lambda d: d.add_consumer("c1"), DuplicateConsumerError, ("c1",)),
    ("ack never published", lambda d: d.ack("c1", 15), NotInFlightError, ("15",)),
    ("ack pending", lambda d: d.ack("c1", 20), NotInFlightError, ("20",)),
    ("ack on the wrong consumer", lambda d: d.ack("c2", 11), NotInFlightError, ("11",)),
    ("nack on the wrong consumer", lambda d: d.nack("c2", 10), NotInFlightError, ("10",)),
    ("nack pending", lambda d: d.nack("c1", 14), NotInFlightError, ("14",)),
    ("key an int", lambda d: d.publish(30, wrong(123), None), InvalidKeyError, ("int",)),
    ("key a float", lambda d: d.publish(30, wrong(1.5), None), InvalidKeyError, ("float",)),
    ("key a list", lambda d: d.publish(30, wrong(["k"]), None), InvalidKeyError, ("list",)),
    ("key a bytearray", lambda d: d.publish(30, wrong(bytearray(b"k")), None), InvalidKeyError, ("bytearray",)),
    ("key a lone surrogate", lambda d: d.publish(30, "\ud800", None), InvalidKeyError, ()),
    ("owner_of an int", lambda d: d.owner_of(wrong(7)), InvalidKeyError, ("int",)),
    ("consumer id empty", lambda d: d.add_consumer(""), KeyFailoverError, ()),
    ("consumer id not a str", lambda d: d.add_consumer(wrong(7)), KeyFailoverError, ("7",)),
]


@pytest.mark.parametrize(("bad", "error", "mentions"), [case[1:] for case in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_rejected_call_raises_and_changes_nothing(
    bad: Callable[[Dispatcher], object], error: type[KeyFailoverError], mentions: tuple[str, ...]
) -> None:
    d, clock = prepared()
    twin, twin_clock = prepared()
    before = fingerprint(d)
    assert before == fingerprint(twin)
    with pytest.raises(error) as info:
        bad(d)
    message = str(info.value)
    assert message, "the error must say what was wrong"
    for word in mentions:
        assert word in message, f"{message!r} should mention {word!r}"
    assert fingerprint(d) == before
    assert follow_up(d, clock) == follow_up(twin, twin_clock)


def test_acking_twice_is_rejected() -> None:
    d, _ = prepared()
    d.ack("c1", 11)
    before = fingerprint(d)
    with pytest.raises(NotInFlightError, match="11"):
        d.ack("c1", 11)
    with pytest.raises(NotInFlightError, match="11"):
        d.nack("c1", 11)
    assert fingerprint(d) == before


def test_errors_are_also_builtin_exceptions() -> None:
    d, _ = prepared()
    with pytest.raises(ValueError):
        d.publish(1, "k", None)
    with pytest.raises(ValueError):
        d.flow("c1", -5)
    with pytest.raises(LookupError):
        d.flow("nobody", 1)
    with pytest.raises(LookupError):
        d.ack("c2", 11)
    with pytest.raises(TypeError):
        d.publish(99, wrong(42), None)


# -- stats ------------------------------------------------------------------------------


def test_stats_on_a_known_state() -> None:
    clock = ManualClock(100.0)
    d = Dispatcher(clock=clock, max_replay=10, split="midpoint", policy="contiguous")
    d.add_consumer("c1")
    d.add_consumer("c2")
    c1_range, c2_range = range_of(d, "c1"), range_of(d, "c2")
    assert sorted([c1_range, c2_range]) == [(0, 32767), (32768, 65535)]
    # k1 lies in the half of c1's range that a midpoint split hands to a newcomer.
    lower, upper = c1_range
    middle = lower + (upper - lower + 1) // 2
    (k1,) = keys_where(lambda slot: middle <= slot <= upper, 1, prefix="one")
    (k2,) = keys_where(lambda slot: c2_range[0] <= slot <= c2_range[1], 1, prefix="two")
    d.flow("c1", 5)
    for position, key in ((1, k1), (2, k1), (3, k1), (4, k2), (5, k2), (6, None)):
        d.publish(position, key, None)
    out = d.poll()
    assert sorted((x.consumer, x.position) for x in out) == [("c1", 1), ("c1", 2), ("c1", 3), ("c1", 6)]
    clock.advance(1.5)
    assert d.poll() == []  # a poll a second later measures the rates

    stats = d.stats()
    c1, c2 = stats["consumers"]["c1"], stats["consumers"]["c2"]
    assert c1["ranges"] == [c1_range]
    assert c2["ranges"] == [c2_range]
    assert (c1["permits"], c1["unacked"]) == (1, 4)
    assert (c2["permits"], c2["unacked"]) == (0, 0)
    assert c1["rate"] > 0.0
    assert c2["rate"] == 0.0
    assert (c1["draining_hashes"], c2["draining_hashes"]) == (0, 0)
    assert stats["replay"] == 2
    assert d.wants() == 4

    d.add_consumer("c3")  # c1 is the busiest: c3 takes the half of c1's range holding k1
    assert range_of(d, "c3") == (middle, upper)
    assert d.owner_of(k1) == "c3"
    stats = d.stats()
    c1, c3 = stats["consumers"]["c1"], stats["consumers"]["c3"]
    assert (c1["draining_hashes"], c1["draining_unacked"]) == (1, 3)
    assert (c3["draining_hashes"], c3["ranges"], c3["permits"], c3["unacked"]) == (0, [(middle, upper)], 0, 0)
    assert stats["replay"] == 2
    assert stats == d.stats(), "reading stats changes nothing"

    for position in (1, 2, 3):
        d.ack("c1", position)
    assert d.stats()["consumers"]["c1"]["draining_hashes"] == 0
    assert d.stats()["consumers"]["c1"]["unacked"] == 1
    assert d.wants() == 7


def test_stats_list_every_range_of_a_consumer_with_several() -> None:
    clock = ManualClock(100.0)
    d = Dispatcher(clock=clock)
    d.add_consumer("C1")
    d.add_consumer("C2")
    drive(d, clock, Stream(d), {"C1": 20, "C2": 2}, ticks=10)
    # Newcomers take pieces of the busiest consumers' ranges: soon someone owns two.
    for newcomer in ("C3", "C4", "C5", "C6"):
        d.add_consumer(newcomer)
        if max(len(d.ranges_of(c)) for c in d.consumers()) >= 2:
            break
    stats = d.stats()["consumers"]
    ranges = d.range_map()
    for consumer in d.consumers():
        assert stats[consumer]["ranges"] == d.ranges_of(consumer) == ranges.ranges_of(consumer)
    assert max(len(stats[c]["ranges"]) for c in stats) >= 2, stats
    owned = sorted(r for c in stats for r in stats[c]["ranges"])
    assert owned == [(start, end) for start, end, _ in d.ranges()]
    assert all(len(stats[c]["ranges"]) <= 16 for c in stats)
