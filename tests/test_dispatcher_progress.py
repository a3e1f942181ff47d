"""Joins and leaves give no slots to a consumer that is not making progress.

A consumer that is stuck, at its unacked limit, or that answered nothing (ack, nack,
extension) for ``half_life`` seconds while without permits or while holding deliveries is
``stalled``: keys moved to it would only wait, while its dispatch rate makes it look the
least busy. Each criterion is pinned here with both policies, with the exceptions (the
joiner, a stuck consumer rejoining) and the fallback (nobody else may take a leaver's
slots). Time comes only from a manual clock.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keyfailover import Dispatcher
from keyfailover.core.clock import ManualClock
from keyfailover.core.rebalance import Load, moved_slots
from tests.test_dispatcher import ack_all, keys_of

HALF_LIFE = 10.0

# Three consumers a, b, c joined in that order: the consumer to stall and the one to leave, its
# neighbour (multi: b | c | a; contiguous: a | c | b, where a's only other neighbour is b).
LAYOUTS = {"multi": ("c", "a", "b"), "contiguous": ("a", "c", "b")}


def three(policy: str, unflowed: str = "", **options: Any) -> tuple[Dispatcher, ManualClock]:
    """A dispatcher with a, b and c, each with 10 permits but ``unflowed``; nothing published."""
    clock = ManualClock(100.0)
    d = Dispatcher(clock=clock, policy=policy, half_life=HALF_LIFE, **options)
    for name in "abc":
        d.add_consumer(name)
        if name != unflowed:
            d.flow(name, 10)
    return d, clock


def hold(d: Dispatcher, consumer: str, count: int) -> list[int]:
    """Publish ``count`` messages of distinct keys ``consumer`` owns and poll: the positions it now holds."""
    first = d.last_position + 1 if d.last_position is not None else 0
    for offset, key in enumerate(keys_of(d, consumer, count, prefix=f"held-{first}")):
        d.publish(first + offset, key)
    out = d.poll()
    assert {x.consumer for x in out} == {consumer}
    return [x.position for x in out]


def served(d: Dispatcher, consumer: str, count: int) -> None:
    """``consumer`` takes ``count`` messages of its keys and acks them."""
    d.flow(consumer, count)
    for position in hold(d, consumer, count):
        d.ack(consumer, position)


def stalled(d: Dispatcher) -> set[str]:
    return {cid for cid, entry in d.stats()["consumers"].items() if entry["stalled"]}


def leave(d: Dispatcher, leaver: str) -> set[str]:
    """Remove ``leaver``; who took its slots."""
    before = d.range_map()
    d.remove_consumer(leaver)
    return {new for _, _, old, new in moved_slots(before, d.range_map()) if old == leaver and new is not None}


def slots(ranges: list[tuple[int, int]]) -> set[int]:
    return {slot for start, end in ranges for slot in range(start, end + 1)}


def assert_passed_over(d: Dispatcher, consumer: str, leaver: str, other: str) -> None:
    """``leaver`` leaves: ``other`` alone takes its slots, and ``consumer`` gains none (it may give some)."""
    before = d.ranges_of(consumer)
    assert leave(d, leaver) == {other}
    gained = slots(d.ranges_of(consumer)) - slots(before)
    assert not gained, f"{consumer} gained {len(gained)} slots: {d.ranges()}"


@pytest.mark.parametrize("policy", sorted(LAYOUTS))
def test_an_idle_consumer_with_permits_takes_part_of_a_leavers_slots(policy: str) -> None:
    d, _ = three(policy)
    idle, leaver, _ = LAYOUTS[policy]
    assert stalled(d) == set()
    assert idle in leave(d, leaver), "nothing held, permits to spare: it may take"


@pytest.mark.parametrize("holding", [0, 10])
@pytest.mark.parametrize("policy", sorted(LAYOUTS))
def test_a_leave_passes_over_a_consumer_without_permits(policy: str, holding: int) -> None:
    blocked, leaver, other = LAYOUTS[policy]
    d, clock = three(policy, unflowed="" if holding else blocked)
    if holding:
        hold(d, blocked, holding)  # its 10 permits used: it holds 10, answers none, and may take no more
    clock.advance(HALF_LIFE - 0.5)
    assert stalled(d) == set(), "a newcomer is judged from its join on: silent less than half_life"
    clock.advance(0.5)
    assert stalled(d) == {blocked}
    assert_passed_over(d, blocked, leaver, other)


@pytest.mark.parametrize("policy", sorted(LAYOUTS))
def test_a_consumer_without_permits_that_answered_within_half_life_makes_progress(policy: str) -> None:
    d, clock = three(policy)
    busy, leaver, other = LAYOUTS[policy]
    served(d, other, 10)  # the other takes as much, and acks: the busy one does not look the busiest
    first, *_ = hold(d, busy, 10)  # a full receiver queue: it takes no more until it flows again
    d.ack(busy, first)
    assert stalled(d) == set(), "it acks: busy, not stalled"
    clock.advance(1.0)
    d.poll()  # a sample sees the ack (no earlier than it came)
    clock.advance(HALF_LIFE - 0.5)
    assert stalled(d) == set()
    clock.advance(0.5)
    assert stalled(d) == {busy}, "no permits, and no answer for half_life since the sample that saw the last"
    d.ack(busy, first + 1)
    assert busy in leave(d, leaver)


@pytest.mark.parametrize("policy", sorted(LAYOUTS))
def test_a_leave_passes_over_a_consumer_at_its_unacked_limit(policy: str) -> None:
    d, _ = three(policy, max_unacked_per_consumer=2)
    blocked, leaver, other = LAYOUTS[policy]
    hold(d, blocked, 2)
    entry = d.stats()["consumers"][blocked]
    assert (entry["unacked_limit_reached"], entry["permits"], entry["stalled"]) == (True, 8, True)
    assert_passed_over(d, blocked, leaver, other)


@pytest.mark.parametrize("policy", sorted(LAYOUTS))
def test_a_consumer_holding_deliveries_it_answered_none_of_for_half_life_is_passed_over(policy: str) -> None:
    d, clock = three(policy)
    slow, leaver, other = LAYOUTS[policy]
    served(d, other, 5)  # the other takes more, and acks: the slow one looks the less busy
    hold(d, slow, 2)  # it has permits left, and answers nothing
    clock.advance(1.0)
    d.poll()  # a sample sees it holding since
    clock.advance(HALF_LIFE - 1.0)
    assert stalled(d) == set(), "it began holding less than half_life ago"
    clock.advance(1.0)
    assert stalled(d) == {slow}
    assert_passed_over(d, slow, leaver, other)


@pytest.mark.parametrize("answer", ["ack", "nack", "extend"])
def test_an_answer_within_half_life_is_progress(answer: str) -> None:
    d, clock = three("multi")
    slow, leaver, _ = LAYOUTS["multi"]
    first, second = hold(d, slow, 2)
    clock.advance(1.0)
    d.poll()
    clock.advance(HALF_LIFE)
    assert stalled(d) == {slow}
    if answer == "ack":
        d.ack(slow, first)
    elif answer == "nack":
        d.nack(slow, first)
    else:
        assert d.extend(slow, [first]) == ([first], [])
    assert stalled(d) == set(), f"an {answer} is progress"
    clock.advance(HALF_LIFE - 1.0)
    assert slow in leave(d, leaver), f"still holding {second}, but it answered within half_life"


@pytest.mark.parametrize("policy", sorted(LAYOUTS))
def test_a_joiner_takes_slots_before_its_first_flow(policy: str) -> None:
    d, clock = three(policy)
    clock.advance(HALF_LIFE)  # the others are silent long since, but have permits and hold nothing
    d.add_consumer("n")  # a joiner has had no chance to flow permits yet
    assert d.ranges_of("n")
    assert stalled(d) == set(), "judged from its join on"
    clock.advance(HALF_LIFE)
    assert stalled(d) == {"n"}, "without permits and silent for half_life: stalled (its own join gave it slots)"


def test_a_join_takes_from_a_stalled_consumer_whose_in_flight_messages_count_as_its_load() -> None:
    # c took 100 messages long ago and acks none: its measured traffic has decayed to almost
    # nothing, but what it holds is load, and a joiner takes part of it rather than give it more.
    clock = ManualClock(100.0)
    d = Dispatcher(clock=clock, half_life=HALF_LIFE, shift_threshold=None)
    d.add_consumer("a")
    d.add_consumer("c")
    d.flow("c", 100)
    hold(d, "c", 100)
    d.flow("a", 10_000)
    position = d.last_position or 0
    for tick in range(120):  # a acks 4 messages of its own keys every half second for a minute
        for key in keys_of(d, "a", 4, prefix=f"tick-{tick}"):
            position += 1
            d.publish(position, key)
        ack_all(d, d.poll())
        clock.advance(0.5)
    assert stalled(d) == {"c"}
    before = d.range_map()
    d.add_consumer("n")
    moves = moved_slots(before, d.range_map())
    assert {new for _, _, _, new in moves} == {"n"}, f"c gains nothing: {moves}"
    assert {old for _, _, old, _ in moves} == {"a", "c"}, f"both give to the joiner: {moves}"


@pytest.mark.parametrize("policy", sorted(LAYOUTS))
def test_a_stuck_consumer_takes_slots_in_its_own_rejoin(policy: str) -> None:
    d, clock = three(policy, ack_timeout=5.0)
    stuck, _, _ = LAYOUTS[policy]
    first = hold(d, stuck, 1)[0]
    clock.advance(3.0)
    later = hold(d, stuck, 1)[0]
    d.flow(stuck, 0)
    clock.advance(2.0)
    d.poll()  # the first lease expires: stuck, it loses its ranges
    assert d.ranges_of(stuck) == [] and d.lease_expired(stuck, first)
    assert d.stats()["consumers"][stuck]["stalled"]
    d.ack(stuck, later)  # progress: it rejoins, holding nothing, with 8 permits
    assert d.ranges_of(stuck)
    assert stalled(d) == set()


@pytest.mark.parametrize("policy", sorted(LAYOUTS))
def test_a_leave_with_every_other_consumer_stalled_goes_as_before(policy: str) -> None:
    d, clock = three(policy)
    blocked, leaver, _ = LAYOUTS[policy]
    for name in "abc":
        if name != leaver:
            hold(d, name, 10)
    clock.advance(HALF_LIFE)
    d.poll()  # a sample: the leave's own, at this clock reading, measures the same load
    assert stalled(d) == {"a", "b", "c"} - {leaver}
    rates = {cid: entry["rate"] for cid, entry in d.stats()["consumers"].items()}
    expected = d.policy.leave(d.range_map(), leaver, Load(rates, np.array(d.traffic())))
    assert blocked in leave(d, leaver)
    assert d.range_map().ranges() == expected.ranges()


@pytest.mark.parametrize("policy", sorted(LAYOUTS))
def test_a_standby_without_permits_does_not_inherit(policy: str) -> None:
    # Two slots, two owners: the others wait as standbys, oldest first.
    clock = ManualClock(100.0)
    d = Dispatcher(clock=clock, policy=policy, slots=(0, 1), half_life=HALF_LIFE)
    for name in ("a", "b", "s1", "s2"):
        d.add_consumer(name)
    for name in ("a", "b", "s2"):
        d.flow(name, 5)
    assert sorted(c for _, _, c in d.ranges()) == ["a", "b"]
    clock.advance(HALF_LIFE)
    assert stalled(d) == {"s1"}
    assert leave(d, "a") == {"s2"}
    standby = {cid for cid, entry in d.stats()["consumers"].items() if entry["standby"]}
    assert standby == {"s1"}
