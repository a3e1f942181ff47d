"""The sticky policy (Pulsar's Key_Shared STICKY) in the core: each consumer owns the ranges it declared.

The first tests port the expectations of Apache Pulsar's
``HashRangeExclusiveStickyKeyConsumerSelectorTest`` (its hash space of 10 slots is the first 10
of keyfailover's 65536; the rest is unassigned); the others pin what keyfailover adds: keys of
undeclared slots wait and nothing is lost, a partition's block, stuck consumers, switching policy.
The guarantees G1-G7 under this policy are the property machine ``StickyMachine`` in
tests/test_dispatcher_properties.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyfailover.core.clock import ManualClock
from keyfailover.core.dispatcher import Delivery, Dispatcher
from keyfailover.core.errors import ConfigError, ConsumerError
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hash
from keyfailover.core.rebalance import MAX_STICKY_RANGES, UNASSIGNED

END = HASH_RANGE_SIZE - 1


def owner(d: Dispatcher, slot: int) -> str | None:
    """Who owns ``slot`` in ``d``'s ranges (None: unassigned, or no map)."""
    for start, end, consumer in d.ranges():
        if start <= slot <= end:
            return None if consumer == UNASSIGNED else consumer
    return None


def keys_in(first: int, last: int, count: int) -> list[str]:
    """``count`` distinct keys whose slots lie in ``[first, last]``."""
    found = (key for key in (f"key-{i}" for i in itertools.count()) if first <= key_hash(key) <= last)
    return list(itertools.islice(found, count))


def key_in(first: int, last: int) -> str:
    """A key whose slot lies in ``[first, last]``."""
    return keys_in(first, last, 1)[0]


# -- Pulsar's HashRangeExclusiveStickyKeyConsumerSelectorTest ------------------------------------


def test_consumer_select() -> None:
    """testConsumerSelect: consumer1 [0, 2], consumer2 [3, 9]; slots nobody declared have no consumer."""
    d = Dispatcher(policy="sticky")
    d.add_consumer("consumer1", [(0, 2)])
    assert [owner(d, slot) for slot in range(3)] == ["consumer1"] * 3
    assert owner(d, 4) is None
    d.add_consumer("consumer2", [(3, 9)])
    assert [owner(d, slot) for slot in range(3, 10)] == ["consumer2"] * 7
    assert [owner(d, slot) for slot in range(3)] == ["consumer1"] * 3
    d.remove_consumer("consumer1")
    assert owner(d, 1) is None
    d.remove_consumer("consumer2")
    assert owner(d, 5) is None
    assert d.ranges() == []


def test_empty_ranges_are_refused() -> None:
    """testEmptyRanges and testNullKeySharedMeta: a sticky consumer must declare ranges."""
    d = Dispatcher(policy="sticky")
    nothing: tuple[list[tuple[int, int]] | None, ...] = ([], None)
    for declared in nothing:
        with pytest.raises(ConsumerError, match="must declare its hash ranges"):
            d.add_consumer("consumer", declared)
    assert d.consumers() == []


def test_get_consumer_key_hash_ranges() -> None:
    """testGetConsumerKeyHashRanges: each consumer's ranges are what it declared."""
    d = Dispatcher(policy="sticky")
    declared = {"consumer1": (0, 2), "consumer2": (3, 7), "consumer3": (9, 12), "consumer4": (15, 20)}
    for name, declared_range in declared.items():
        d.add_consumer(name, [declared_range])
    assert {name: d.ranges_of(name) for name in declared} == {name: [r] for name, r in declared.items()}
    assert d.ranges() == [
        (0, 2, "consumer1"),
        (3, 7, "consumer2"),
        (8, 8, UNASSIGNED),
        (9, 12, "consumer3"),
        (13, 14, UNASSIGNED),
        (15, 20, "consumer4"),
        (21, END, UNASSIGNED),
    ]


@pytest.mark.parametrize("declared", [(4, 6), (1, 3), (2, 2), (5, 5), (1, 5), (2, 6), (2, 5), (1, 6)])
def test_single_range_conflict(declared: tuple[int, int]) -> None:
    """testSingleRangeConflict: any overlap with consumer1's [2, 5] is refused and changes nothing."""
    d = Dispatcher(policy="sticky")
    d.add_consumer("consumer1", [(2, 5)])
    before = d.ranges()
    with pytest.raises(ConsumerError, match=r"overlaps \[2, 5\] of consumer 'consumer1'"):
        d.add_consumer("consumer", [declared])
    assert d.ranges() == before and d.consumers() == ["consumer1"]


def test_a_range_whose_start_is_after_its_end_is_refused() -> None:
    """testSingleRangeConflict's last case, [8, 6]: malformed."""
    d = Dispatcher(policy="sticky")
    with pytest.raises(ConsumerError, match="expected \\(first, last\\) ints"):
        d.add_consumer("consumer", [(8, 6)])


@pytest.mark.parametrize("declared", [[(2, 2), (3, 3), (4, 5)], [(0, 0), (1, 2)]])
def test_multiple_range_conflict(declared: list[tuple[int, int]]) -> None:
    """testMultipleRangeConflict: one overlapping range of several refuses them all."""
    d = Dispatcher(policy="sticky")
    d.add_consumer("consumer1", [(2, 5)])
    with pytest.raises(ConsumerError, match="overlaps"):
        d.add_consumer("consumer", declared)
    assert d.consumers() == ["consumer1"]


# -- what keyfailover adds ----------------------------------------------------------------------


def test_keys_nobody_declared_wait_and_go_to_the_consumer_that_declares_them() -> None:
    d = Dispatcher(clock=ManualClock(0.0), policy="sticky")
    low, high = key_in(0, 32767), key_in(32768, END)
    d.add_consumer("low", [(0, 32767)])
    d.flow("low", 10)
    d.publish(1, high, "h1")
    d.publish(2, low, "l2")
    d.publish(3, high, "h3")
    assert d.poll() == [Delivery("low", 2, low, "l2", 0)]
    assert d.stats()["replay"] == 2  # held, not lost
    d.add_consumer("high", [(32768, END)])
    d.flow("high", 10)
    assert d.poll() == [Delivery("high", 1, high, "h1", 0), Delivery("high", 3, high, "h3", 0)]


def test_a_partitions_dispatcher_owns_the_part_of_the_declared_ranges_in_its_block() -> None:
    d = Dispatcher(policy="sticky", slots=(1000, 1999))
    d.add_consumer("a", [(0, 1499)])
    d.add_consumer("b", [(1700, 5000)])
    d.add_consumer("elsewhere", [(30000, 40000)])  # nothing in this block: a member without ranges
    assert d.ranges() == [(1000, 1499, "a"), (1500, 1699, UNASSIGNED), (1700, 1999, "b")]
    assert d.declared_ranges("elsewhere") == [(30000, 40000)]
    assert d.stats()["consumers"]["elsewhere"]["ranges"] == []
    with pytest.raises(ConsumerError, match="overlaps"):  # overlaps are across the whole space, as in Pulsar
        d.add_consumer("c", [(35000, 35000)])


def test_a_partition_nobody_declared_is_unassigned_while_consumers_are_present() -> None:
    """A block none of the consumers' ranges reach is all unassigned (not an empty map, which means no
    consumers): its keys wait, and the metrics and alerts see the gap. Empty again once all have left."""
    d = Dispatcher(policy="sticky", slots=(32768, END))
    d.add_consumer("a", [(0, 32767)])
    assert d.ranges() == [(32768, END, UNASSIGNED)]
    assert d.stats()["consumers"]["a"]["standby"]
    d.add_consumer("b", [(40000, 40999)])
    d.remove_consumer("b")
    assert d.ranges() == [(32768, END, UNASSIGNED)]
    d.remove_consumer("a")
    assert d.ranges() == []


def test_a_stuck_sticky_consumer_loses_its_ranges_to_nobody_and_gets_them_back_when_it_recovers() -> None:
    clock = ManualClock(0.0)
    d = Dispatcher(clock=clock, policy="sticky", ack_timeout=1.0)
    key = key_in(0, 100)
    d.add_consumer("only", [(0, 100)])
    d.flow("only", 1)
    d.publish(1, key, "m")
    assert d.poll() == [Delivery("only", 1, key, "m", 0)]
    clock.advance(2.0)
    assert d.poll() == []  # taken back, and nobody else may have the key
    assert owner(d, key_hash(key)) is None and d.stats()["consumers"]["only"]["stuck"]
    assert d.ranges() == [(0, END, UNASSIGNED)]  # a consumer is present: the space is unassigned, not unmapped
    d.flow("only", 1)  # progress: it recovers its declared ranges
    assert d.ranges_of("only") == [(0, 100)]
    assert d.poll() == [Delivery("only", 1, key, "m", 1)]


def test_the_policy_switches_only_without_consumers() -> None:
    d = Dispatcher(policy="multi")
    with pytest.raises(ConsumerError, match="only under the sticky policy"):
        d.add_consumer("a", [(0, 10)])
    d.add_consumer("a")
    with pytest.raises(ConfigError, match="while 1 consumer"):
        d.set_policy("sticky")
    assert d.policy.name == "multi"
    d.remove_consumer("a")
    d.set_policy("sticky")
    d.add_consumer("a", [(0, 10)])
    assert d.ranges()[0] == (0, 10, "a")
    d.remove_consumer("a")
    d.set_policy("contiguous")
    d.add_consumer("b")
    assert d.ranges() == [(0, END, "b")]
    with pytest.raises(ConfigError, match="policy must be one of"):
        d.set_policy("ring")


def test_the_reserved_owner_is_not_a_consumer_id() -> None:
    d = Dispatcher(policy="sticky")
    with pytest.raises(ConsumerError, match="reserved"):
        d.add_consumer(UNASSIGNED, [(0, 10)])


def test_keys_nobody_declared_are_parked_so_they_never_stop_the_declared_ones() -> None:
    """G5 under the sticky policy, with spill as the server runs it: the messages of an undeclared range
    do not fill the buffer (they are parked, left in the log), so the declared consumer gets every message
    of its keys however many wait; a consumer declaring the rest then gets them all, each key in order
    (G2, G3), re-read from the log."""
    d = Dispatcher(clock=ManualClock(0.0), policy="sticky", spill=True, max_replay=10)
    low_keys, high_keys = keys_in(0, 32767, 3), keys_in(32768, END, 3)
    d.add_consumer("low", [(0, 32767)])
    d.flow("low", 1000)
    log: dict[int, str] = {}
    got: dict[str, list[int]] = {"low": [], "high": []}
    for position in range(1, 201):
        key = (low_keys if position % 4 == 0 else high_keys)[position % 3]
        assert d.wants(), f"the buffer filled up at position {position}"
        d.publish(position, key)
        log[position] = key
        for delivery in d.poll():
            got[delivery.consumer].append(delivery.position)
            d.ack(delivery.consumer, delivery.position)
    assert got["low"] == [p for p, k in log.items() if k in low_keys]
    d.add_consumer("high", [(32768, END)])
    d.flow("high", 1000)
    for _ in range(200):
        for delivery in d.poll():
            got[delivery.consumer].append(delivery.position)
            d.ack(delivery.consumer, delivery.position)
        due = d.rereads()
        if not due:
            if len(got["high"]) == sum(k in high_keys for k in log.values()):
                break
            continue
        through = 0
        for position in range(min(due.values()), max(log) + 1):
            if key_hash(log[position]) in due and position >= due[key_hash(log[position])]:
                if not d.wants():
                    break
                d.restore(position, log[position])
            through = position
        d.restored(due, through)
    expected = [p for p, k in log.items() if k in high_keys]
    assert sorted(got["high"]) == expected  # every one, once
    for key in high_keys:
        mine = [p for p in got["high"] if log[p] == key]
        assert mine == sorted(mine), f"{key} out of order: {mine}"
    d._audit()


def test_a_consumer_declaring_more_ranges_than_the_cap_is_refused_and_changes_nothing() -> None:
    d = Dispatcher(policy="sticky")
    d.add_consumer("a", [(0, 9)])
    too_many = [(2 * i + 100, 2 * i + 100) for i in range(MAX_STICKY_RANGES + 1)]
    with pytest.raises(ConsumerError, match=f"declared {MAX_STICKY_RANGES + 1} hash ranges; expected at most"):
        d.add_consumer("b", too_many)
    assert d.consumers() == ["a"]
    d.add_consumer("b", too_many[:MAX_STICKY_RANGES])  # at the cap: accepted
    assert len(d.ranges_of("b")) == MAX_STICKY_RANGES
    d._audit()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 20)), min_size=1, max_size=6), max_size=8))
def test_a_declaration_is_refused_exactly_when_it_overlaps_a_present_consumers(
    joins: list[list[tuple[int, int]]],
) -> None:
    """The overlap check (an index of every declared range) against a check of every pair."""
    d = Dispatcher(policy="sticky", slots=(0, END))
    present: dict[str, list[tuple[int, int]]] = {}
    for index, spans in enumerate(joins):
        ranges = sorted({(start, start + width) for start, width in spans})
        own_overlap = any(b[0] <= a[1] for a, b in itertools.pairwise(ranges))
        other_overlap = any(
            first <= their_last and their_first <= last
            for theirs in present.values()
            for their_first, their_last in theirs
            for first, last in ranges
        )
        cid = f"c{index}"
        if own_overlap or other_overlap:
            with pytest.raises(ConsumerError, match="overlap"):
                d.add_consumer(cid, ranges)
        else:
            d.add_consumer(cid, ranges)
            present[cid] = ranges
        if index % 3 == 2 and present:
            leaver = sorted(present)[0]
            d.remove_consumer(leaver)
            del present[leaver]
        d._audit()
    assert sorted(d.consumers()) == sorted(present)


class Pump:
    """The server's read loop in miniature over a log in memory: poll, re-read parked slots, read on
    one message at a time (live traffic), skipping what was acked as the server's cursor does."""

    def __init__(self, d: Dispatcher) -> None:
        self.d = d
        self.log: list[str] = []  # the key of position i + 1
        self.read = 0
        self.acked: set[int] = set()

    def turn(self) -> list[Delivery]:
        d, out = self.d, []
        for _ in range(10_000):
            out += d.poll()
            due = d.rereads()
            if due:
                last = d.last_position
                assert last is not None
                through = last
                for position in range(min(due.values()), last + 1):
                    key = self.log[position - 1]
                    if position < due.get(key_hash(key), position + 1) or position in self.acked:
                        continue
                    if not d.wants():
                        through = position - 1
                        break
                    d.restore(position, key)
                d.restored(due, through)
                continue
            if not d.wants() or self.read >= len(self.log):
                return out
            self.read += 1
            d.publish(self.read, self.log[self.read - 1])
        raise AssertionError("the pump never settled")

    def ack(self, deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            self.d.ack(delivery.consumer, delivery.position)
            self.acked.add(delivery.position)


def two_with_six_on_b(d: Dispatcher) -> Pump:
    """Sticky consumers "a" (the low half) and "b" (the high half) of ``d``, six of b's keys in flight on b."""
    d.add_consumer("a", [(0, 32767)])
    d.add_consumer("b", [(32768, END)])
    pump = Pump(d)
    pump.log += keys_in(32768, END, 6)
    d.flow("b", 6)
    assert len(pump.turn()) == 6
    return pump


def a_takes_twenty(pump: Pump, between: Callable[[], None]) -> list[int]:
    """Twenty messages of a's keys produced, a taking and acking one at a time; the positions a got."""
    pump.log += keys_in(0, 32767, 20)
    got = []
    for _ in range(100):
        pump.d.flow("a", 1)
        deliveries = pump.turn()
        pump.ack(deliveries)
        got += [delivery.position for delivery in deliveries]
        between()
    return got


def test_a_sticky_consumers_keys_are_parked_when_it_leaves_so_the_others_go_on() -> None:
    """G4/G5: the messages a leaving sticky consumer held (now nobody's) leave the bounded buffer for the
    log, so the one that stays gets every message of its keys; a consumer declaring the leaver's range
    later gets the leaver's messages, each once more, counted as redelivered (G3)."""
    d = Dispatcher(clock=ManualClock(0.0), policy="sticky", spill=True, max_replay=10)
    pump = two_with_six_on_b(d)
    d.remove_consumer("b")  # its six come back, to nobody
    assert a_takes_twenty(pump, lambda: None) == list(range(7, 27))
    d.add_consumer("c", [(32768, END)])
    d.flow("c", 10)
    back = pump.turn()
    assert [(x.consumer, x.position, x.redelivery_count) for x in back] == [("c", p, 1) for p in range(1, 7)]
    d._audit()


def test_a_stuck_sticky_consumers_keys_are_parked_until_it_recovers() -> None:
    clock = ManualClock(0.0)
    d = Dispatcher(clock=clock, policy="sticky", spill=True, max_replay=10, ack_timeout=1.0)
    pump = two_with_six_on_b(d)
    clock.advance(2.0)  # b's leases expire: it is stuck, its range nobody's
    assert a_takes_twenty(pump, lambda: clock.advance(0.1)) == list(range(7, 27))
    assert d.stats()["consumers"]["b"]["stuck"]
    d.flow("b", 10)  # progress: b takes its range back, and its six again
    back = pump.turn()
    assert [(x.consumer, x.position, x.redelivery_count) for x in back] == [("b", p, 1) for p in range(1, 7)]
    d._audit()


def test_a_slot_with_a_dead_letter_not_stored_yet_is_not_parked_from_before_it() -> None:
    """G3: the server's re-read of a parked slot skips what its cursor acked, so a dead letter whose store
    has not succeeded yet must not lie in a parked stretch of the log: it would come back and go out again
    besides being dead-lettered. A leaver's slot holding one keeps its messages until the store is confirmed,
    then parks, and the re-read brings back only the other key's message."""
    clock = ManualClock(0.0)
    d = Dispatcher(clock=clock, policy="sticky", spill=True, max_replay=10, max_redeliveries=1)
    d.add_consumer("a", [(0, 32767)])
    d.add_consumer("b", [(32768, END)])
    slot = key_hash(key_in(32768, END))
    first, second = keys_in(slot, slot, 2)  # two keys of one slot of b's
    pump = Pump(d)
    pump.log += [first, second]
    d.flow("b", 4)
    assert [x.position for x in pump.turn()] == [1, 2]
    d.nack("b", 2)
    assert [x.position for x in pump.turn()] == [2]
    d.nack("b", 2)  # its second failure: given up on
    assert pump.turn() == []
    (letter,) = d.dead_letters()  # handed to the server, whose store fails: not confirmed
    assert letter.position == 2
    d.remove_consumer("b")  # position 1 comes back to pending, its slot nobody's
    pump.turn()
    assert d.stats()["parked_slots"] == 0  # held, not parked from position 1 with the letter behind it
    d.add_consumer("c", [(32768, END)])
    d.flow("c", 4)
    back = pump.turn()
    assert [(x.consumer, x.position) for x in back] == [("c", 1)]
    assert d.dead_lettered([2]) == ([2], [])  # stored at last: the server acks it in its cursor
    pump.acked.add(2)
    pump.ack(back)
    assert pump.turn() == []
    d._audit()
