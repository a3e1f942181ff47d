"""Level 1 of scheduling: partitions as blocks of slots, and their sticky assignment to brokers."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyfailover.core.clock import ManualClock
from keyfailover.core.dispatcher import Dispatcher
from keyfailover.core.errors import ConfigError, WrongPartitionError
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hash
from keyfailover.core.partitions import (
    Assignment,
    PartitionId,
    assign_partitions,
    check_partition_count,
    partition_of_key,
    partition_of_slot,
    partition_slots,
    partitions_of_slots,
)

# -- blocks of slots ---------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 3, 7, 8, 100, 65535, 65536])
def test_partitions_tile_the_slot_space_and_every_slot_finds_its_block(count: int) -> None:
    blocks = [partition_slots(p, count) for p in range(count)]
    assert blocks[0][0] == 0 and blocks[-1][1] == HASH_RANGE_SIZE - 1
    assert all(after[0] == before[1] + 1 for before, after in itertools.pairwise(blocks))
    sizes = {last - first + 1 for first, last in blocks}
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    slots = np.arange(HASH_RANGE_SIZE)
    owners = partitions_of_slots(slots, count)
    expected = np.repeat(np.arange(count), [last - first + 1 for first, last in blocks])
    assert np.array_equal(owners, expected)
    for slot in (0, 1, HASH_RANGE_SIZE // 3, HASH_RANGE_SIZE // 3 + 1, HASH_RANGE_SIZE - 1):
        first, last = partition_slots(partition_of_slot(slot, count), count)
        assert first <= slot <= last


def test_a_key_goes_to_the_partition_of_its_slot() -> None:
    for key in ("orders-1", "ü", b"\x00\xff", ""):
        assert partition_of_key(key, 8) == key_hash(key) * 8 // HASH_RANGE_SIZE


@pytest.mark.parametrize("bad", [0, -1, 65537, 2.0, "8", None, True])
def test_a_bad_partition_count_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="partition count must be an int from 1 to 65536"):
        check_partition_count(bad)


def test_a_bad_partition_or_slot_is_refused() -> None:
    with pytest.raises(ConfigError, match="partition must be an int from 0 to 3"):
        partition_slots(4, 4)
    with pytest.raises(ConfigError, match="slot must be an int from 0 to 65535"):
        partition_of_slot(65536, 4)


# -- sticky assignment ---------------------------------------------------------------------

BROKERS = ("b1", "b2", "b3", "b4", "b5")


def partition_ids(count: int) -> list[PartitionId]:
    return [(f"t{i % 3}", i // 3) for i in range(count)]


@st.composite
def situations(draw: st.DrawFn) -> tuple[list[PartitionId], list[str], dict[PartitionId, str]]:
    """Partitions, live brokers, and a previous assignment over partly other partitions and brokers."""
    partitions = partition_ids(draw(st.integers(0, 12)))
    brokers = draw(st.lists(st.sampled_from(BROKERS), unique=True, max_size=4))
    old_partitions = partition_ids(draw(st.integers(0, 12)))
    previous = {p: draw(st.sampled_from(BROKERS)) for p in old_partitions if draw(st.booleans())}
    return partitions, brokers, previous


def most_kept(partitions: list[PartitionId], brokers: list[str], previous: dict[PartitionId, str]) -> int:
    """By brute force over which brokers may hold one more: the most valid previous assignments any
    balanced assignment keeps."""
    valid = Counter(b for p, b in previous.items() if p in set(partitions) and b in brokers)
    base, extra = divmod(len(partitions), len(brokers))
    return max(
        sum(min(valid[b], base + (b in more)) for b in brokers) for more in itertools.combinations(brokers, extra)
    )


@settings(max_examples=400, deadline=None)
@given(situations())
def test_the_assignment_is_balanced_and_keeps_all_that_balance_allows(
    situation: tuple[list[PartitionId], list[str], dict[PartitionId, str]],
) -> None:
    partitions, brokers, previous = situation
    owners = assign_partitions(partitions, brokers, previous)
    if not brokers:
        assert owners == {}
        return
    assert set(owners) == set(partitions), "every partition is assigned"
    assert set(owners.values()) <= set(brokers), "to a live broker"
    counts = Counter(owners.values())
    loads = [counts[b] for b in brokers]
    assert max(loads) - min(loads) <= 1, f"balanced: {counts}"
    kept = sum(1 for p, b in owners.items() if previous.get(p) == b)
    assert kept == most_kept(partitions, brokers, previous), "sticky: no balanced assignment keeps more"
    shuffled = dict(reversed(list(previous.items())))
    assert assign_partitions(reversed(partitions), reversed(brokers), shuffled) == owners, "deterministic"


def test_a_broker_leaving_moves_only_its_partitions_and_a_joiner_takes_a_fair_share() -> None:
    partitions = partition_ids(12)
    three = assign_partitions(partitions, ["b1", "b2", "b3"], {})
    assert sorted(Counter(three.values()).values()) == [4, 4, 4]
    two = assign_partitions(partitions, ["b1", "b3"], three)
    assert {p for p in partitions if two[p] != three[p]} == {p for p in partitions if three[p] == "b2"}
    four = assign_partitions(partitions, ["b1", "b2", "b3", "b4"], three)
    moved = [p for p in partitions if four[p] != three[p]]
    assert len(moved) == 3 and all(four[p] == "b4" for p in moved), "the joiner takes 3, nothing else moves"


def test_ties_go_to_the_lowest_broker_id() -> None:
    assert assign_partitions([("t", 0)], ["b2", "b1"], {}) == {("t", 0): "b1"}


@pytest.mark.parametrize(
    ("partitions", "brokers", "message"),
    [
        ([("t", 0)], ["b1", "b1"], r"broker ids must be distinct; given more than once: \['b1'\]"),
        ([("t", 0)], [""], "a broker id must be a non-empty str"),
        ([("t", -1)], ["b1"], r"a partition id must be a \(topic, index >= 0\) tuple"),
        (["t-0"], ["b1"], "a partition id must be a"),
        ([("t", 0), ("t", 0)], ["b1"], "partition ids must be distinct"),
    ],
)
def test_bad_ids_are_refused(partitions: list[PartitionId], brokers: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        assign_partitions(partitions, brokers, {})


def test_an_assignment_changes_generation_only_when_owners_change() -> None:
    partitions = partition_ids(6)
    first = Assignment(0).rebalanced(partitions, ["b1", "b2"])
    assert first.generation == 1 and first.supersedes(Assignment(0))
    assert first.rebalanced(partitions, ["b2", "b1"]) is first, "nothing changed: same generation"
    second = first.rebalanced(partitions, ["b1", "b2", "b3"])
    assert second.generation == 2 and second.supersedes(first) and not first.supersedes(second)
    assert second.moved(first) == sorted(second.partitions_of("b3"))
    assert len(second.partitions_of("b3")) == 2
    with pytest.raises(TypeError):
        second.owners[("t0", 0)] = "b9"  # type: ignore[index]
    with pytest.raises(ConfigError, match="generation must be an int >= 0"):
        Assignment(-1)


def test_the_stickiness_check_catches_a_balanced_assignment_that_moves_too_much() -> None:
    """The brute-force bound is not met by round robin (kazoo SetPartitioner-like, ignoring the past)."""
    partitions = partition_ids(9)
    previous = assign_partitions(partitions, ["b1", "b2", "b3"], {})
    brokers = ["b1", "b2", "b3", "b4"]
    round_robin = {p: brokers[i % len(brokers)] for i, p in enumerate(partitions)}
    loads = Counter(round_robin.values())
    assert max(loads.values()) - min(loads.values()) <= 1, "the planted assignment is balanced"
    kept = sum(1 for p, b in round_robin.items() if previous[p] == b)
    assert kept < most_kept(partitions, brokers, previous)
    sticky = assign_partitions(partitions, brokers, previous)
    assert sum(1 for p, b in sticky.items() if previous[p] == b) == most_kept(partitions, brokers, previous)


# -- a dispatcher per partition ------------------------------------------------------------


def block_dispatchers(count: int, consumers: list[str]) -> list[Dispatcher]:
    """One dispatcher per partition of a topic with ``count`` partitions, each with ``consumers``."""
    dispatchers = []
    for partition in range(count):
        d = Dispatcher(clock=ManualClock(), slots=partition_slots(partition, count))
        for consumer in consumers:
            d.add_consumer(consumer)
            d.flow(consumer, 1000)
        dispatchers.append(d)
    return dispatchers


def test_the_partitions_range_maps_together_tile_the_whole_space() -> None:
    dispatchers = block_dispatchers(4, ["c1", "c2", "c3"])
    union = sorted(r for d in dispatchers for r in d.ranges())
    assert union[0][0] == 0 and union[-1][1] == HASH_RANGE_SIZE - 1
    assert all(after[0] == before[1] + 1 for before, after in itertools.pairwise(union))
    for partition, d in enumerate(dispatchers):
        first, last = partition_slots(partition, 4)
        assert d.slots == (first, last)
        assert d.ranges()[0][0] == first and d.ranges()[-1][1] == last
        assert d.snapshot()["range_size"] == last - first + 1
        assert all(d.ranges_of(consumer) for consumer in ("c1", "c2", "c3")), "each consumer has a share of each"


def test_each_key_goes_to_its_partitions_dispatcher_and_to_the_owner_of_its_slot() -> None:
    dispatchers = block_dispatchers(4, ["c1", "c2"])
    keys = [f"acct-{i}" for i in range(400)]
    for position, key in enumerate(keys, start=1):
        dispatchers[partition_of_key(key, 4)].publish(position, key, key)
    delivered = {}
    for d in dispatchers:
        for delivery in d.poll():
            delivered[delivery.key] = delivery.consumer
            assert d.owner_of(str(delivery.key)) == delivery.consumer
        d._audit()
    assert set(delivered) == set(keys)
    for key in keys:  # the owner by the ranges, in slots of the whole space
        slot = key_hash(key)
        d = dispatchers[partition_of_key(key, 4)]
        assert [cid for start, end, cid in d.ranges() if start <= slot <= end] == [delivered[key]]


def test_a_key_of_another_partition_is_refused_and_changes_nothing() -> None:
    d = Dispatcher(clock=ManualClock(), slots=partition_slots(0, 4))
    d.add_consumer("c1")
    outside = next(f"k{i}" for i in range(100) if partition_of_key(f"k{i}", 4) != 0)
    before = (d.stats(), d.wants(), d.ranges())
    with pytest.raises(WrongPartitionError, match=r"hashes to slot \d+, outside this dispatcher's slots \[0, 16383\]"):
        d.publish(1, outside)
    with pytest.raises(WrongPartitionError, match="expected a key of its partition"):
        d.owner_of(outside)
    assert (d.stats(), d.wants(), d.ranges()) == before
    d.publish(1, next(f"k{i}" for i in range(100) if partition_of_key(f"k{i}", 4) == 0))  # position 1 is still free


@pytest.mark.parametrize("slots", [(5, 4), (-1, 10), (0, 65536), (0,), [0, 10], (0.0, 10)])
def test_bad_slots_are_refused(slots: object) -> None:
    with pytest.raises(ConfigError, match=r"slots must be a \(first, last\) tuple of ints"):
        Dispatcher(slots=slots)  # type: ignore[arg-type]
