"""Pulsar's Key_Shared selectors against the expectations of Pulsar's own unit tests, and properties.

Each ``test_pulsar_*`` test ports one test of Apache Pulsar's
``ConsistentHashingStickyKeyConsumerSelectorTest`` (4.x or 3.x) or
``HashRangeAutoSplitStickyKeyConsumerSelectorTest`` and names it; where a port departs from
Pulsar's text (random UUIDs, a copy-paste slip in an assertion), a comment says how and why.
"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from collections.abc import Callable
from itertools import pairwise
from operator import itemgetter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyfailover.core.errors import ConfigError, ConsumerError, DuplicateConsumerError, KeyFailoverError
from keyfailover.core.hashing import pulsar3_hash, pulsar4_consistent_hash, pulsar4_key_hash
from keyfailover.tools.evaluate._pulsar import (
    AutoSplitSelector,
    ConsistentHashingSelector,
    ConsumerAssignError,
    HashOutOfRangeError,
)

Ranges = dict[str, list[tuple[int, int]]]
Assignment = tuple[int, int, str]
Selector = ConsistentHashingSelector | AutoSplitSelector

INT_MAX = 2**31 - 1


# -- ports of Pulsar's ConsumerHashAssignmentsSnapshot, used by Pulsar's tests -------------------


def assignments(ranges: Ranges) -> list[Assignment]:
    """The snapshot's sorted list of (start, end, consumer)."""
    return sorted(
        ((start, end, consumer) for consumer, spans in ranges.items() for start, end in spans), key=itemgetter(0)
    )


def diff_ranges(
    before: list[Assignment], after: list[Assignment]
) -> dict[tuple[int, int], tuple[str | None, str | None]]:
    """``ConsumerHashAssignmentsSnapshot.diffRanges``: the ranges whose consumer changed, (before, after)."""
    impacted: dict[tuple[int, int], tuple[str | None, str | None]] = {}
    b, a = 0, 0
    while b < len(before) and a < len(after):
        b_start, b_end, b_consumer = before[b]
        a_start, a_end, a_consumer = after[a]
        if (b_start, b_end) == (a_start, a_end):
            if b_consumer != a_consumer:
                impacted[a_start, a_end] = (b_consumer, a_consumer)
            b, a = b + 1, a + 1
        elif b_end < a_start:
            impacted[b_start, b_end] = (b_consumer, a_consumer)
            b += 1
        elif a_end < b_start:
            impacted[a_start, a_end] = (b_consumer, a_consumer)
            a += 1
        else:
            overlap = (max(b_start, a_start), min(b_end, a_end))
            if b_consumer != a_consumer:
                impacted[overlap] = (b_consumer, a_consumer)
            if b_end <= overlap[1]:
                b += 1
            if a_end <= overlap[1]:
                a += 1
    for start, end, consumer in before[b:]:
        impacted[start, end] = (consumer, None)
    for start, end, consumer in after[a:]:
        impacted[start, end] = (None, consumer)
    return impacted


def merge_overlapping(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ConsumerHashAssignmentsSnapshot.mergeOverlappingRanges`` (adjacent ranges merge too)."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(set(ranges)):
        if merged and merged[-1][1] >= start - 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def removed_hash_ranges(before: list[Assignment], after: list[Assignment]) -> Ranges:
    """``resolveImpactedConsumers(...).getRemovedHashRanges()``: per consumer, the merged ranges it lost."""
    lost: dict[str, list[tuple[int, int]]] = {}
    for span, (consumer_before, _) in diff_ranges(before, after).items():
        if consumer_before is not None:
            lost.setdefault(consumer_before, []).append(span)
    return {consumer: merge_overlapping(spans) for consumer, spans in lost.items()}


def fully_contained(ranges: list[tuple[int, int]], within: list[tuple[int, int]]) -> bool:
    """``RemovedHashRanges.isFullyContainedInRanges``."""
    return all(any(start <= s and e <= end for start, end in within) for s, e in ranges)


def owner_in_ranges(ranges: Ranges, hash_: int) -> str | None:
    """The consumer whose reported ranges contain ``hash_`` (Pulsar's ``assertSelectionMatchesRanges``)."""
    for consumer, spans in ranges.items():
        if any(start <= hash_ <= end for start, end in spans):
            return consumer
    return None


def seeded_uuid_keys(rng: random.Random, count: int) -> list[str]:
    """Random version-4 UUID strings from a seeded generator, where Pulsar's tests call UUID.randomUUID()."""
    return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(count)]


def same_name(selector: ConsistentHashingSelector, count: int, first: int = 0) -> list[str]:
    """Pulsar's ``createMockConsumer("consumer", "index " + i, i)``: ids "index i", all named "consumer"."""
    ids = [f"index {i}" for i in range(first, first + count)]
    for consumer in ids:
        selector.add_consumer(consumer, "consumer")
    return ids


# -- Pulsar 4.x ConsistentHashingStickyKeyConsumerSelectorTest ----------------------------------


def test_pulsar_consumer_select() -> None:
    """testConsumerSelect (4.x: 200 points, within 20%); seeded random UUIDs instead of UUID.randomUUID()."""
    selector = ConsistentHashingSelector(200, "4.x")
    assert selector.select(selector.key_hash("anyKey")) is None
    selector.add_consumer("c1")
    assert selector.select(selector.key_hash("anyKey")) == "c1"
    rng = random.Random(20240611)

    def counts() -> Counter[str | None]:
        return Counter(selector.select(selector.key_hash(key)) for key in seeded_uuid_keys(rng, 1000))

    def assert_even(selected: Counter[str | None], consumers: list[str]) -> None:
        share = 1000 / len(consumers)
        assert set(selected) == set(consumers)
        for consumer in consumers:
            assert abs(selected[consumer] - share) <= share * 0.20, (consumer, selected)

    selector.add_consumer("c2")
    assert_even(counts(), ["c1", "c2"])
    selector.add_consumer("c3")
    assert_even(counts(), ["c1", "c2", "c3"])
    selector.add_consumer("c4")
    assert_even(counts(), ["c1", "c2", "c3", "c4"])
    selector.remove_consumer("c1")
    assert_even(counts(), ["c2", "c3", "c4"])
    selector.remove_consumer("c2")
    assert_even(counts(), ["c3", "c4"])
    selector.remove_consumer("c3")
    assert counts() == Counter({"c4": 1000})


PULSAR_4_RANGES: Ranges = {
    "consumer1": [(14359, 18366), (29991, 39817), (52980, 60442)],
    "consumer2": [(1, 6668), (39818, 52979), (60443, 63679), (65184, 65535)],
    "consumer3": [(6669, 14358), (18367, 29990), (63680, 65183)],
}


def test_pulsar_get_consumer_key_hash_ranges() -> None:
    """testGetConsumerKeyHashRanges (4.x, 3 points): Pulsar's exact ranges, tiling [1, 65535]."""
    selector = ConsistentHashingSelector(3, "4.x")
    for name in ("consumer1", "consumer2", "consumer3"):
        selector.add_consumer(name)
    ranges = selector.consumer_key_hash_ranges()
    assert ranges == selector.consumer_key_hash_ranges()
    assert ranges == PULSAR_4_RANGES
    spans = sorted(span for spans in ranges.values() for span in spans)
    assert all(later[0] == earlier[1] + 1 for earlier, later in pairwise(spans))
    first, last = selector.key_hash_range()
    assert sum(end - start + 1 for start, end in spans) == last - first + 1 == 65535


def test_pulsar_consumers_get_sufficiently_accurately_evenly_mapped() -> None:
    """testConsumersGetSufficientlyAccuratelyEvenlyMapped: 20 consumers all named "consumer", 200 points."""
    selector = ConsistentHashingSelector(200, "4.x")
    consumers = same_name(selector, 20)
    owners = selector.owners_of(selector.key_hashes([f"key {i}" for i in range(10000)]))
    selected = np.bincount(owners.index, minlength=len(owners.consumers))
    average = 10000 // 20
    allowed = int(0.2 * average)
    assert owners.consumers == tuple(consumers)
    assert all(abs(int(count) - average) <= allowed for count in selected), selected
    for consumer in consumers:
        selector.remove_consumer(consumer)
    assert selector.consumer_key_hash_ranges() == {}


@pytest.mark.parametrize("version", ["4.x", "3.x"])
def test_pulsar_should_not_collide_with_consumer_name_ends_with_number(version: str) -> None:
    """shouldNotCollideWithConsumerNameEndsWithNumber (apache/pulsar #22050), 4.x and 3.x."""
    selector = ConsistentHashingSelector(12, "4.x" if version == "4.x" else "3.x")
    selector.add_consumer("consumer1")
    selector.add_consumer("consumer11")
    owner_of_range: dict[tuple[int, int], str] = {}
    for consumer, spans in selector.consumer_key_hash_ranges().items():
        for span in spans:
            assert owner_of_range.setdefault(span, consumer) == consumer, span


@pytest.mark.parametrize("version", ["4.x", "3.x"])
def test_pulsar_should_remove_consumers_from_consumer_key_hash_ranges(version: str) -> None:
    """shouldRemoveConsumersFromConsumerKeyHashRanges, 4.x and 3.x."""
    selector = ConsistentHashingSelector(12, "4.x" if version == "4.x" else "3.x")
    consumers = [f"consumer{i}" for i in range(1, 100)]
    for consumer in consumers:
        selector.add_consumer(consumer)
    assert len(selector.consumer_key_hash_ranges()) == len(consumers)
    for consumer in consumers:
        selector.remove_consumer(consumer)
    assert selector.consumer_key_hash_ranges() == {}
    for consumer in consumers:
        selector.remove_consumer(consumer)


@pytest.mark.parametrize("version", ["4.x", "3.x"])
def test_pulsar_should_not_change_selected_consumer_when_consumer_is_removed(version: str) -> None:
    """testShouldNotChangeSelectedConsumerWhenConsumerIsRemoved: 100 consumers named "consumer", 100 points.

    4.x validates at ``i * (65535 // 201)``; 3.x at ``i * (Integer.MAX_VALUE // 201)``.
    """
    selector = ConsistentHashingSelector(100, "4.x" if version == "4.x" else "3.x")
    consumers = same_name(selector, 100)
    size = 65535 if version == "4.x" else INT_MAX
    points = [i * (size // 201) for i in range(200)]
    before = [selector.select(point) for point in points]
    removed: set[str] = set()
    for consumer in consumers:
        selector.remove_consumer(consumer)
        removed.add(consumer)
        for point, expected in zip(points, before, strict=True):
            if expected not in removed:
                assert selector.select(point) == expected, (consumer, point)


def test_pulsar_should_not_change_selected_consumer_when_consumer_is_removed_check_hash_ranges() -> None:
    """testShouldNotChangeSelectedConsumerWhenConsumerIsRemovedCheckHashRanges: 25 consumers, 100 points."""
    selector = ConsistentHashingSelector(100, "4.x")
    consumers = same_name(selector, 25)
    expected = selector.consumer_key_hash_ranges()
    for removed in consumers:
        selector.remove_consumer(removed)
        for consumer, spans in expected.items():
            if consumer == removed:
                continue
            for start, end in spans:
                assert selector.select(start) == consumer, (removed, start)
                assert selector.select(end) == consumer, (removed, end)
        expected = selector.consumer_key_hash_ranges()


def test_pulsar_should_not_change_selected_consumer_unnecessarily_when_consumer_is_added_check_hash_ranges() -> None:
    """testShouldNotChangeSelectedConsumerUnnecessarilyWhenConsumerIsAddedCheckHashRanges: 25 + 25 consumers.

    Pulsar's text selects ``range.getStart()`` twice (its "range end" check repeats the start);
    this port checks the start and the end.
    """
    selector = ConsistentHashingSelector(100, "4.x")
    same_name(selector, 25)
    expected = selector.consumer_key_hash_ranges()
    for i in range(25, 50):
        added = same_name(selector, 1, first=i)[0]
        for consumer, spans in expected.items():
            for start, end in spans:
                assert selector.select(start) in (consumer, added), (added, start)
                assert selector.select(end) in (consumer, added), (added, end)
        expected = selector.consumer_key_hash_ranges()


def test_pulsar_should_not_change_selected_consumer_when_consumer_is_added() -> None:
    """testShouldNotChangeSelectedConsumerWhenConsumerIsAdded (50 + 50 consumers), as it means to check.

    Pulsar's assertion sits behind ``if (!addedConsumers.contains(addedConsumer))``, which is never
    true, so it checks nothing; here each validation point keeps its consumer or goes to a newcomer.
    """
    selector = ConsistentHashingSelector(100, "4.x")
    same_name(selector, 50)
    points = [i * (65535 // 201) for i in range(200)]
    before = [selector.select(point) for point in points]
    added: set[str] = set()
    for i in range(50, 100):
        added.update(same_name(selector, 1, first=i))
        for point, expected in zip(points, before, strict=True):
            assert selector.select(point) == expected or selector.select(point) in added, point


def test_pulsar_should_contain_minimal_mapping_changes_when_consumer_leaves_and_rejoins() -> None:
    """testShouldContainMinimalMappingChangesWhenConsumerLeavesAndRejoins: under 1% of the range changes."""
    selector = ConsistentHashingSelector(100, "4.x")
    consumers = same_name(selector, 10)
    before = assignments(selector.consumer_key_hash_ranges())
    selector.remove_consumer(consumers[0])
    selector.remove_consumer(consumers[5])
    selector.add_consumer(consumers[0], "consumer")
    selector.add_consumer(consumers[5], "consumer")
    after = assignments(selector.consumer_key_hash_ranges())
    changed = sum(end - start + 1 for start, end in diff_ranges(before, after))
    assert changed < int(65535 * (1 / 100.0))


@pytest.mark.slow
def test_pulsar_should_not_swap_existing_consumers() -> None:
    """testShouldNotSwapExistingConsumers: 100 consumers "consumer<i>", 200 points, each leaves and rejoins."""
    selector = ConsistentHashingSelector(200, "4.x")
    consumers = [f"consumer{i}" for i in range(100)]
    for consumer in consumers:
        selector.add_consumer(consumer)
    before_ranges = selector.consumer_key_hash_ranges()
    before = assignments(before_ranges)
    for consumer in consumers:
        selector.remove_consumer(consumer)
        before_ranges = selector.consumer_key_hash_ranges()
        after = assignments(before_ranges)
        assert set(removed_hash_ranges(before, after)) == {consumer}
        before = after

        selector.add_consumer(consumer)
        after_ranges = selector.consumer_key_hash_ranges()
        after = assignments(after_ranges)
        removed = removed_hash_ranges(before, after)
        for owner, spans in removed.items():
            assert fully_contained(spans, before_ranges[owner])
            assert fully_contained(spans, after_ranges[consumer])
        assert merge_overlapping([span for spans in removed.values() for span in spans]) == after_ranges[consumer]
        before, before_ranges = after, after_ranges


def test_pulsar_consumers_reconnect() -> None:
    """testConsumersReconnect: 50 consumers named "consumer" leave in a random order and rejoin in order.

    Pulsar's ``pointsToTest`` takes ``Math.max(i * increment, hashRangeSize - 1)``, so every
    validation point is 65534; this port checks those and the ``i * increment`` points meant.
    """
    selector = ConsistentHashingSelector(100, "4.x")
    consumers = same_name(selector, 50)
    size = 65535
    points = [max(i * (size // 201), size - 1) for i in range(200)] + [i * (size // 201) for i in range(200)]
    before = [selector.select(point) for point in points]
    for consumer in random.Random(7).sample(consumers, len(consumers)):
        selector.remove_consumer(consumer)
    for consumer in consumers:
        selector.add_consumer(consumer, "consumer")
    assert [selector.select(point) for point in points] == before


# -- Pulsar 3.x ConsistentHashingStickyKeyConsumerSelectorTest ----------------------------------


def test_pulsar_3_get_consumer_key_hash_ranges_reports_like_pulsar_3() -> None:
    """testGetConsumerKeyHashRanges (3.x): Pulsar's exact ranges from that revision's ring points.

    The 3.x test revision that pins exact ranges puts point i at ``makeHash(name + "\\0" + i)``,
    without the name index of the 3.x selector ported here, so its ring is planted directly;
    what is checked is 3.x's report: from 0, one range per point, never joined, and the
    wrap-around range ``[last + 1, Integer.MAX_VALUE - 1]`` appended to the first point's consumer.
    """
    selector = ConsistentHashingSelector(3, "3.x")
    for name in ("consumer1", "consumer2", "consumer3"):
        selector.add_consumer(name)
    selector._ring.clear()  # white box: plant the ring of Pulsar's test revision
    for name in ("consumer1", "consumer2", "consumer3"):
        for i in range(3):
            selector._ring[pulsar3_hash(f"{name}\0{i}")] = name
    assert selector.consumer_key_hash_ranges() == {
        "consumer1": [(119056335, 242013991), (722195657, 1656011842), (1707482098, 1914695766)],
        "consumer2": [(0, 90164503), (90164504, 119056334), (382436668, 722195656), (1914695767, 2147483646)],
        "consumer3": [(242013992, 242377547), (242377548, 382436667), (1656011843, 1707482097)],
    }
    assert selector.select(INT_MAX) == selector.select(0) == "consumer2"


def test_3x_report_overflows_like_java_after_a_point_at_integer_max_value() -> None:
    selector = ConsistentHashingSelector(1, "3.x")
    selector.add_consumer("a")
    selector.add_consumer("b")
    selector._ring.clear()  # white box: no name is known to hash to 2^31 - 1, so plant such a point
    selector._ring.update({5: "b", INT_MAX: "a"})
    # Pulsar appends Range.of(lastKey + 1, Integer.MAX_VALUE - 1), and lastKey + 1 overflows to MIN_VALUE.
    assert selector.consumer_key_hash_ranges() == {"b": [(0, 5), (-(2**31), INT_MAX - 1)], "a": [(6, INT_MAX)]}


def test_3x_ring_points_carry_the_name_index_and_ranges_are_never_joined() -> None:
    selector = ConsistentHashingSelector(3, "3.x")
    for name in ("consumer1", "consumer2", "consumer3"):
        selector.add_consumer(name)
    ranges = selector.consumer_key_hash_ranges()
    points = sorted((pulsar3_hash(f"{name}\0{0}\0{i}"), name) for name in ranges for i in range(3))
    ends = sorted((end, consumer) for consumer, spans in ranges.items() for _, end in spans)
    assert ends == [*points, (INT_MAX - 1, points[0][1])]
    assert assignments(ranges)[0][0] == 0
    assert selector.key_hash_range() == (0, INT_MAX)


# -- collisions and name indexes -----------------------------------------------------------------

# Found by search: one ring point ("<name>\0" "0\0" "0") of each name lands on the same slot or hash.
COLLIDING_4X = ("consumer-1728", "consumer-2580", "consumer-3628")  # Pulsar 4.x slot 3981
COLLIDING_3X = ("consumer-2411", "consumer-24023")  # m31 719897460
SELF_COLLIDING_4X = "consumer-1329"  # its points 0 and 3 share Pulsar 4.x slot 17247


def test_colliding_names_are_what_the_tests_say() -> None:
    assert {pulsar4_consistent_hash(f"{name}\0{0}\0{0}") for name in COLLIDING_4X} == {3981}
    assert {pulsar3_hash(f"{name}\0{0}\0{0}") for name in COLLIDING_3X} == {719897460}
    own = [pulsar4_consistent_hash(f"{SELF_COLLIDING_4X}\0{0}\0{i}") for i in range(4)]
    assert own[0] == own[3] == 17247
    assert len(set(own)) == 3


def test_4x_first_consumer_keeps_a_colliding_point_and_the_first_in_line_takes_over() -> None:
    selector = ConsistentHashingSelector(1, "4.x")
    first, second, third = COLLIDING_4X
    for consumer in COLLIDING_4X:
        selector.add_consumer(consumer)
    assert selector.consumer_key_hash_ranges() == {first: [(1, 65535)]}
    selector.remove_consumer(second)  # a waiting consumer leaves the line
    assert selector.select(3981) == first
    selector.remove_consumer(first)
    assert selector.consumer_key_hash_ranges() == {third: [(1, 65535)]}
    selector.add_consumer(first)
    assert selector.select(3981) == third
    selector.remove_consumer(third)
    assert selector.select(3981) == first
    selector.remove_consumer(first)
    assert selector.consumer_key_hash_ranges() == {}


def test_4x_a_consumer_colliding_with_itself_leaves_cleanly() -> None:
    selector = ConsistentHashingSelector(4, "4.x")
    selector.add_consumer(SELF_COLLIDING_4X)
    selector.add_consumer("other")
    assert sum(len(spans) for spans in selector.consumer_key_hash_ranges().values()) >= 2
    selector.remove_consumer(SELF_COLLIDING_4X)
    assert set(selector.consumer_key_hash_ranges()) == {"other"}
    selector.remove_consumer("other")
    assert selector.consumer_key_hash_ranges() == {}


def test_3x_later_consumer_takes_a_colliding_point_and_the_loser_is_forgotten() -> None:
    selector = ConsistentHashingSelector(1, "3.x")
    earlier, later = COLLIDING_3X
    selector.add_consumer(earlier)
    selector.add_consumer(later)
    assert selector.consumer_key_hash_ranges() == {later: [(0, 719897460), (719897461, INT_MAX - 1)]}
    selector.remove_consumer(earlier)  # it holds no point: Pulsar forgot it, and nothing changes
    assert set(selector.consumer_key_hash_ranges()) == {later}
    selector.add_consumer("again", earlier)  # same name: the freed name index 0, the same point
    assert set(selector.consumer_key_hash_ranges()) == {"again"}
    selector.remove_consumer(later)
    assert set(selector.consumer_key_hash_ranges()) == {"again"}
    selector.remove_consumer("again")
    assert selector.consumer_key_hash_ranges() == {}


@pytest.mark.parametrize("version", ["4.x", "3.x"])
def test_same_name_consumers_get_the_lowest_free_name_index(version: str) -> None:
    selector = ConsistentHashingSelector(5, "4.x" if version == "4.x" else "3.x")
    hash_of = pulsar4_consistent_hash if version == "4.x" else pulsar3_hash
    same_name(selector, 3)
    ranges = selector.consumer_key_hash_ranges()
    for index in range(3):
        for point in range(5):
            assert selector.select(hash_of(f"consumer\0{index}\0{point}")) == f"index {index}"
    selector.remove_consumer("index 1")
    selector.add_consumer("newcomer", "consumer")
    assert selector.consumer_key_hash_ranges()["newcomer"] == ranges["index 1"]


# -- Pulsar HashRangeAutoSplitStickyKeyConsumerSelectorTest --------------------------------------


def test_pulsar_auto_split_get_consumer_key_hash_ranges() -> None:
    """testGetConsumerKeyHashRanges (auto-split, range size 2 << 5): Pulsar's exact ranges."""
    selector = AutoSplitSelector(2 << 5)
    for name in ("consumer1", "consumer2", "consumer3", "consumer4"):
        selector.add_consumer(name)
    assert selector.consumer_key_hash_ranges() == {
        "consumer1": [(49, 64)],
        "consumer4": [(33, 48)],
        "consumer2": [(17, 32)],
        "consumer3": [(0, 16)],
    }


def test_pulsar_auto_split_get_consumer_key_hash_ranges_with_same_consumer_name() -> None:
    """testGetConsumerKeyHashRangesWithSameConsumerName: three "My-consumer"s, one distinct range each."""
    selector = AutoSplitSelector(2 << 5)
    for i in range(3):
        selector.add_consumer(f"consumer {i}", "My-consumer")
    ranges = selector.consumer_key_hash_ranges()
    each = [ranges[f"consumer {i}"] for i in range(3)]
    assert all(len(spans) == 1 for spans in each)
    assert each[0] != each[1] != each[2]


def test_pulsar_auto_split_selection_matches_published_ranges_across_membership_changes() -> None:
    """testSelectionMatchesPublishedRangesAcrossMembershipChanges: 8 joins then 8 leaves, hashes 0..63."""
    selector = AutoSplitSelector(2 << 5)

    def assert_selection_matches_ranges() -> None:
        ranges = selector.consumer_key_hash_ranges()
        for hash_ in range(64):
            assert selector.select(hash_) == owner_in_ranges(ranges, hash_), hash_

    consumers = [f"consumer{i}" for i in range(8)]
    for consumer in consumers:
        selector.add_consumer(consumer)
        assert_selection_matches_ranges()
    for consumer in consumers:
        selector.remove_consumer(consumer)
        assert_selection_matches_ranges()
    assert selector.select(0) is None


def test_pulsar_auto_split_selection_during_membership_changes() -> None:
    """testConcurrentSelectionDuringMembershipChanges, sequentially: range size 2 << 10, 100 rounds."""
    selector = AutoSplitSelector(2 << 10)
    selector.add_consumer("stable")
    first, last = selector.key_hash_range()
    hashes = np.arange(first, last + 1)
    for _ in range(100):
        selector.add_consumer("transient")
        owners = selector.owners_of(hashes)
        assert set(owners.index.tolist()) == {0, 1}
        selector.remove_consumer("transient")
    owners = selector.owners_of(hashes)
    assert owners.consumers == ("stable",)
    assert not owners.index.any()
    selector.remove_consumer("stable")
    assert (selector.owners_of(hashes).index == -1).all()


def test_auto_split_refuses_a_consumer_when_every_range_is_one_slot() -> None:
    selector = AutoSplitSelector(64)
    for i in range(64):
        selector.add_consumer(f"c{i}")
    before = selector.consumer_key_hash_ranges()
    assert sorted(end for spans in before.values() for _, end in spans) == list(range(1, 65))
    with pytest.raises(ConsumerAssignError, match="64 consumers") as info:
        selector.add_consumer("one too many")
    assert isinstance(info.value, KeyFailoverError)
    assert selector.consumer_key_hash_ranges() == before
    assert "one too many" not in selector.owners_of(np.arange(64)).consumers
    selector.remove_consumer("one too many")
    selector.remove_consumer("c5")
    selector.add_consumer("one too many")
    assert selector.consumer_key_hash_ranges()["one too many"] != []


def test_auto_split_top_range_goes_to_the_consumer_below() -> None:
    selector = AutoSplitSelector(64)
    for name in ("top", "middle", "low"):
        selector.add_consumer(name)
    assert selector.consumer_key_hash_ranges() == {"low": [(0, 16)], "middle": [(17, 32)], "top": [(33, 64)]}
    selector.remove_consumer("top")
    assert selector.consumer_key_hash_ranges() == {"low": [(0, 16)], "middle": [(17, 64)]}
    selector.remove_consumer("low")
    assert selector.consumer_key_hash_ranges() == {"middle": [(0, 64)]}


# -- key hashes, arguments and errors ------------------------------------------------------------


KEYS: list[str | bytes] = ["", "a", "key 42", "key-30884", b"\xff\x00", "NONE_KEY", "中文"]


def test_each_selector_hashes_keys_as_its_pulsar_version_does() -> None:
    four, three, auto = ConsistentHashingSelector(), ConsistentHashingSelector(version="3.x"), AutoSplitSelector()
    for key in KEYS:
        assert four.key_hash(key) == pulsar4_consistent_hash(key)
        assert three.key_hash(key) == pulsar3_hash(key)
        assert auto.key_hash(key) == pulsar4_key_hash(key)
    assert auto.key_hash("key-30884") == 1  # its key_hash is 0
    for selector in (four, three, auto, AutoSplitSelector(8)):
        assert selector.key_hashes(KEYS).tolist() == [selector.key_hash(key) for key in KEYS]
        first, last = selector.key_hash_range()
        assert all(first <= selector.key_hash(key) <= last for key in KEYS)
    assert four.key_hash_range() == (1, 65535)
    assert auto.key_hash_range() == (0, 65535)
    assert AutoSplitSelector(8).key_hash("key-30884") == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: ConsistentHashingSelector(0),
        lambda: ConsistentHashingSelector(True),
        lambda: ConsistentHashingSelector(10, "5.x"),  # type: ignore[arg-type]
        lambda: AutoSplitSelector(1),
        lambda: AutoSplitSelector(48),
        lambda: AutoSplitSelector(2**31),
    ],
)
def test_bad_constructor_arguments_are_refused(make: Callable[[], Selector]) -> None:
    with pytest.raises(ConfigError):
        make()


@pytest.mark.parametrize(
    "make", [ConsistentHashingSelector, lambda: ConsistentHashingSelector(5, "3.x"), AutoSplitSelector]
)
def test_bad_consumers_and_hashes_are_refused_and_change_nothing(make: Callable[[], Selector]) -> None:
    selector = make()
    selector.add_consumer("a")
    before = selector.consumer_key_hash_ranges()
    with pytest.raises(DuplicateConsumerError, match="'a' is already added"):
        selector.add_consumer("a")
    with pytest.raises(ConsumerError, match="non-empty str"):
        selector.add_consumer("")
    with pytest.raises(ConsumerError, match="must be a str, not int"):
        selector.add_consumer("b", 7)  # type: ignore[arg-type]
    with pytest.raises(ConsumerError, match="not valid Unicode"):
        selector.add_consumer("b", "\ud800")
    last = selector.key_hash_range()[1]
    for wrong in (-1, last + 1):
        with pytest.raises(HashOutOfRangeError, match=rf"hash {wrong} is outside \[0, {last}\]"):
            selector.select(wrong)
        with pytest.raises(HashOutOfRangeError, match=f"hash {wrong} is outside"):
            selector.owners_of(np.array([0, wrong]))
    with pytest.raises(HashOutOfRangeError, match="integer array"):
        selector.owners_of(np.array([0.5]))
    assert selector.consumer_key_hash_ranges() == before
    selector.remove_consumer("never added")
    assert selector.consumer_key_hash_ranges() == before


def test_owners_of_an_empty_selector_and_of_no_hashes() -> None:
    selector = ConsistentHashingSelector()
    owners = selector.owners_of(np.array([0, 5, 65535]))
    assert owners.consumers == ()
    assert owners.index.tolist() == [-1, -1, -1]
    selector.add_consumer("a")
    assert selector.owners_of(np.array([], dtype=np.int64)).index.shape == (0,)


def test_many_consumers_with_many_points_are_fast_enough() -> None:
    selector = ConsistentHashingSelector(100, "4.x")
    for i in range(1000):
        selector.add_consumer(f"consumer{i}")
    owners = selector.owners_of(np.arange(1, 65536))
    assert len(owners.consumers) == 1000
    assert len(set(owners.index.tolist())) > 990
    for i in range(1000):
        selector.remove_consumer(f"consumer{i}")
    assert selector.consumer_key_hash_ranges() == {}


# -- properties ----------------------------------------------------------------------------------


def span_reported(selector: Selector) -> tuple[int, int]:
    """The hashes Pulsar's report tiles: [1, 65535] (4.x), [0, 2^31 - 2] (3.x), [0, range size] (auto-split)."""
    first, last = selector.key_hash_range()
    if isinstance(selector, AutoSplitSelector):
        return first, last + 1
    return (first, last - 1) if last == INT_MAX else (first, last)


def check_reports_agree(selector: Selector, extra: list[int]) -> None:
    """Ranges tile the reported span; select, owners_of and the ranges agree on a sample of hashes."""
    ranges = selector.consumer_key_hash_ranges()
    if not ranges:
        assert selector.owners_of(np.arange(2)).index.tolist() == [-1, -1]
        return
    first, last = span_reported(selector)
    spans = assignments(ranges)
    assert spans[0][0] == first
    assert spans[-1][1] == last
    assert all(later[0] == earlier[1] + 1 for earlier, later in pairwise(spans))
    assert all(spans_of == sorted(spans_of) for spans_of in ranges.values())
    low, high = selector.key_hash_range()
    sample = {min(max(h, low), high) for start, end, _ in spans for h in (start, end)}
    sample.update(low + value % (high - low + 1) for value in extra)
    sample.update(range(low, min(high, 127) + 1))
    ordered = sorted(h for h in sample if first <= h <= last)
    owned = selector.owners_of(np.array(ordered))
    assert set(ranges) <= set(owned.consumers)
    for hash_, index in zip(ordered, owned.index.tolist(), strict=True):
        selected = selector.select(hash_)
        assert selected == owner_in_ranges(ranges, hash_) == owned.consumers[index], hash_


selectors = st.one_of(
    st.builds(ConsistentHashingSelector, st.sampled_from([1, 3, 10]), st.just("4.x")),
    st.builds(ConsistentHashingSelector, st.sampled_from([1, 3, 10]), st.just("3.x")),
    st.builds(AutoSplitSelector, st.sampled_from([2, 8, 64, 65536])),
)
operations = st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.sampled_from(["x", "y", "z"])), max_size=20)
hashes = st.lists(st.integers(0, 2**40), max_size=20)


@settings(max_examples=150, deadline=None)
@given(selectors, operations, hashes)
def test_select_owners_and_ranges_agree_through_joins_and_leaves(
    selector: Selector, ops: list[tuple[bool, int, str]], extra: list[int]
) -> None:
    present: set[str] = set()
    for joins, number, name in ops:
        consumer = f"c{number}"
        if joins and consumer not in present:
            try:
                selector.add_consumer(consumer, name)
            except ConsumerAssignError:
                continue
            present.add(consumer)
        elif not joins:
            selector.remove_consumer(consumer)
            present.discard(consumer)
        check_reports_agree(selector, extra)
    for consumer in sorted(present):
        selector.remove_consumer(consumer)
    assert selector.consumer_key_hash_ranges() == {}
    assert selector.select(0) is None
    owners = selector.owners_of(np.array([0, 1]))
    assert owners.consumers == ()
    assert owners.index.tolist() == [-1, -1]


@settings(max_examples=60, deadline=None)
@given(selectors, st.lists(st.sampled_from(["x", "y", "z", "w"]), max_size=12), st.randoms(use_true_random=False))
def test_reconnecting_in_the_same_order_restores_the_assignment(
    selector: Selector, names: list[str], rng: random.Random
) -> None:
    joined: list[tuple[str, str]] = []
    for number, name in enumerate(names):
        try:
            selector.add_consumer(f"c{number}", name)
        except ConsumerAssignError:
            continue
        joined.append((f"c{number}", name))
    before = selector.consumer_key_hash_ranges()
    for consumer, _ in rng.sample(joined, len(joined)):
        selector.remove_consumer(consumer)
    assert selector.consumer_key_hash_ranges() == {}
    for consumer, name in joined:
        selector.add_consumer(consumer, name)
    assert selector.consumer_key_hash_ranges() == before
