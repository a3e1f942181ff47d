"""RangeMap: unit tests of every operation, snapshots, and a model-based property test of the invariants.

A consumer may own several ranges, never two adjacent ones; the model the map must agree
with is the obvious one, the owner of every slot.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyfailover.core.errors import KeyFailoverError, RangeMapError, SnapshotError
from keyfailover.core.hashing import HASH_RANGE_SIZE
from keyfailover.core.ranges import SNAPSHOT_VERSION, Range, RangeMap, check_consumer_id

FULL = HASH_RANGE_SIZE - 1


def _map(ranges: list[Range], range_size: int = 16, epoch: int = 0) -> RangeMap:
    return RangeMap.from_ranges(ranges, range_size, epoch)


def _three() -> RangeMap:
    """a [0, 3], b [4, 9], c [10, 15]."""
    return _map([(0, 3, "a"), (4, 9, "b"), (10, 15, "c")])


SCATTERED: list[Range] = [(0, 1, "a"), (2, 4, "b"), (5, 7, "a"), (8, 11, "c"), (12, 15, "a")]
"""a owns three ranges that are not adjacent to one another."""


def _scattered() -> RangeMap:
    return _map(SCATTERED)


def _state(ranges: RangeMap) -> tuple[list[Range], int]:
    return ranges.ranges(), ranges.epoch


def _first_seen(owners: list[str]) -> list[str]:
    return list(dict.fromkeys(owners))


def assert_invariants(ranges: RangeMap) -> None:
    """The documented invariants, checked from every public view of the map."""
    items = ranges.ranges()
    size = ranges.range_size
    owners = [consumer for _, _, consumer in items]
    consumers = _first_seen(owners)
    if items:
        assert items[0][0] == 0, f"the first range starts at {items[0][0]}"
        assert items[-1][1] == size - 1, f"the last range ends at {items[-1][1]}"
    for (_, end, owner), (start, _, next_owner) in itertools.pairwise(items):
        assert start == end + 1, f"gap or overlap at {end} / {start}"
        assert owner != next_owner, f"two adjacent ranges of {owner!r} at {end} / {start}"
    assert all(start <= end for start, end, _ in items)
    assert ranges.range_count() == len(items)
    assert len(ranges) == len(consumers)
    assert ranges.consumers() == consumers
    grouped = {c: [(s, e) for s, e, o in items if o == c] for c in consumers}
    assert ranges.ranges_by_consumer() == grouped
    assert list(ranges.ranges_by_consumer()) == consumers, "ranges_by_consumer is in hash order"
    for consumer in consumers:
        assert consumer in ranges
        assert ranges.ranges_of(consumer) == grouped[consumer]
        assert ranges.width(consumer) == sum(e - s + 1 for s, e in grouped[consumer])
    assert sum(ranges.width(c) for c in consumers) == (size if items else 0)
    ends, lookup_owners = ranges.lookup_table()
    assert ends == [end for _, end, _ in items]
    assert lookup_owners == owners
    arrays = ranges.arrays()
    assert arrays.starts.tolist() == [start for start, _, _ in items]
    assert arrays.ends.tolist() == ends
    assert arrays.consumers == tuple(consumers)
    assert [arrays.consumers[code] for code in arrays.owner.tolist()] == owners


def _corrupt_gap(ranges: RangeMap) -> None:
    ranges._starts[1] += 1  # white box: a slot nobody owns


def _corrupt_adjacent(ranges: RangeMap) -> None:
    ranges._owners[1] = ranges._owners[0]  # white box: two adjacent ranges of one owner


def _corrupt_count(ranges: RangeMap) -> None:
    ranges._counts["ghost"] = 1  # white box: a consumer counted without a range


@pytest.mark.parametrize("corrupt", [_corrupt_gap, _corrupt_adjacent, _corrupt_count])
def test_the_invariant_checker_catches_a_planted_violation(corrupt: Callable[[RangeMap], None]) -> None:
    ranges = _three()
    assert_invariants(ranges)
    corrupt(ranges)
    with pytest.raises(AssertionError):
        assert_invariants(ranges)


# -- construction and reading -----------------------------------------------------------


def test_a_new_map_is_empty() -> None:
    ranges = RangeMap()
    assert ranges.range_size == HASH_RANGE_SIZE
    assert ranges.epoch == 0
    assert len(ranges) == 0
    assert ranges.ranges() == []
    assert ranges.range_count() == 0
    assert ranges.consumers() == []
    assert ranges.ranges_of("a") == []
    assert ranges.ranges_by_consumer() == {}
    assert ranges.owner_of(0) is None
    assert ranges.owner_of(FULL) is None
    assert ranges.width("a") == 0
    assert "a" not in ranges
    assert ranges.lookup_table() == ([], [])
    assert ranges.slot_owners().tolist() == []
    assert ranges.arrays().consumers == ()
    assert_invariants(ranges)


@pytest.mark.parametrize("range_size", [0, -1, 1.5, "16", None, True])
def test_constructor_rejects_a_bad_range_size(range_size: Any) -> None:
    with pytest.raises(RangeMapError, match=f"range_size must be a positive int, not {range_size!r}"):
        RangeMap(range_size)


@pytest.mark.parametrize("epoch", [-1, 1.0, "0", None, True])
def test_constructor_rejects_a_bad_epoch(epoch: Any) -> None:
    with pytest.raises(RangeMapError, match="epoch must be a non-negative int"):
        RangeMap(16, epoch)


def test_constructor_keeps_a_given_epoch() -> None:
    assert RangeMap(16, 7).epoch == 7


@pytest.mark.parametrize("consumer", ["", 0, None, b"a", ["a"]])
def test_validate_consumer_id_rejects_non_strings_and_empty(consumer: Any) -> None:
    with pytest.raises(RangeMapError, match="non-empty str"):
        check_consumer_id(consumer)


def test_validate_consumer_id_returns_a_valid_id() -> None:
    assert check_consumer_id("consumer-1") == "consumer-1"


def test_a_consumer_with_three_ranges_is_read_from_every_view() -> None:
    ranges = _scattered()
    assert ranges.ranges() == SCATTERED
    assert len(ranges) == 3
    assert ranges.range_count() == 5
    assert ranges.consumers() == ["a", "b", "c"]
    assert ranges.ranges_of("a") == [(0, 1), (5, 7), (12, 15)]
    assert ranges.ranges_of("b") == [(2, 4)]
    assert ranges.ranges_by_consumer() == {"a": [(0, 1), (5, 7), (12, 15)], "b": [(2, 4)], "c": [(8, 11)]}
    assert (ranges.width("a"), ranges.width("b"), ranges.width("c")) == (9, 3, 4)
    assert ranges.lookup_table() == ([1, 4, 7, 11, 15], ["a", "b", "a", "c", "a"])
    assert_invariants(ranges)


def test_consumers_are_in_hash_order_of_their_first_range() -> None:
    ranges = _map([(0, 1, "z"), (2, 3, "m"), (4, 5, "z"), (6, 15, "a")])
    assert ranges.consumers() == ["z", "m", "a"]
    assert list(ranges.ranges_by_consumer()) == ["z", "m", "a"]
    assert ranges.arrays().consumers == ("z", "m", "a")


def test_ranges_of_returns_a_copy() -> None:
    ranges = _scattered()
    ranges.ranges_of("a").append((99, 99))
    assert ranges.ranges_of("a") == [(0, 1), (5, 7), (12, 15)]


def test_owner_of_looks_up_every_boundary() -> None:
    ranges = _scattered()
    expected = ["a"] * 2 + ["b"] * 3 + ["a"] * 3 + ["c"] * 4 + ["a"] * 4
    assert [ranges.owner_of(slot) for slot in range(16)] == expected
    numpy_slot: Any = np.int64(9)  # any integer type that supports __index__
    assert ranges.owner_of(numpy_slot) == "c"


@pytest.mark.parametrize("slot", [-1, 16, 1000])
def test_owner_of_rejects_a_slot_outside_the_space(slot: int) -> None:
    with pytest.raises(RangeMapError, match=rf"slot {slot} is outside \[0, 15\]"):
        _three().owner_of(slot)
    with pytest.raises(RangeMapError, match="outside"):
        RangeMap(16).owner_of(slot)


@pytest.mark.parametrize(("slot", "kind"), [(1.0, "float"), ("3", "str"), (None, "NoneType")])
def test_owner_of_rejects_a_slot_that_is_not_an_int(slot: Any, kind: str) -> None:
    with pytest.raises(RangeMapError, match=f"slot must be an int, not {kind}"):
        _three().owner_of(slot)


def test_contains_is_false_for_anything_that_owns_no_range() -> None:
    ranges = _three()
    assert "a" in ranges
    assert "zz" not in ranges
    assert ["a"] not in ranges  # unhashable: no TypeError
    assert 3 not in ranges


def test_equality_compares_range_size_and_ranges_not_epoch() -> None:
    assert _three() == _three()
    assert _map(SCATTERED, epoch=4) == _scattered()
    assert _three() != _map([(0, 4, "a"), (5, 9, "b"), (10, 15, "c")])
    assert _map([(0, 15, "a")], 16) != _map([(0, 16, "a")], 17)
    assert RangeMap(16) == RangeMap(16)
    assert RangeMap(16) != RangeMap(32)
    assert _three() != "not a map"
    with pytest.raises(TypeError):
        hash(_three())


def test_repr_shows_epoch_and_ranges() -> None:
    assert repr(_map([(0, 7, "a"), (8, 15, "b")], 16, 2)) == "RangeMap(epoch=2, ranges=[(0, 7, 'a'), (8, 15, 'b')])"


# -- vectorised lookups -----------------------------------------------------------------


def test_index_of_gives_the_range_index_and_owners_of_the_owner() -> None:
    ranges = _scattered()
    slots = np.arange(16)
    assert ranges.index_of(slots).tolist() == [0] * 2 + [1] * 3 + [2] * 3 + [3] * 4 + [4] * 4
    assert ranges.owners_of(slots).tolist() == [ranges.owner_of(slot) for slot in range(16)]
    assert ranges.owners_of([15, 0, 4]).tolist() == ["a", "a", "b"]
    assert ranges.index_of(np.array([[3, 4], [9, 12]])).tolist() == [[1, 1], [3, 4]]
    assert ranges.index_of(np.array([], dtype=np.int64)).tolist() == []
    assert ranges.slot_owners().tolist() == ranges.index_of(slots).tolist()


def test_index_of_rejects_bad_slots_and_an_empty_map() -> None:
    ranges = _three()
    with pytest.raises(RangeMapError, match=r"slots must lie in \[0, 15\]"):
        ranges.index_of([0, 16])
    with pytest.raises(RangeMapError, match=r"\[0, 15\]"):
        ranges.owners_of(np.array([-1, 3]))
    with pytest.raises(RangeMapError, match="slots must be integers, not float64"):
        ranges.index_of([1.0])
    with pytest.raises(RangeMapError, match="the range map is empty"):
        RangeMap(16).index_of([0])
    with pytest.raises(RangeMapError, match="empty"):
        RangeMap(16).owners_of([0])


def test_lookups_at_full_size_agree_on_random_slots() -> None:
    ranges = RangeMap()
    ranges.assign_all("a")
    ranges.reassign([(20000, 39999, "b"), (1, 1000, "d"), (50000, FULL, "b"), (FULL, FULL, "e"), (30000, 30000, "a")])
    assert ranges.ranges() == [
        (0, 0, "a"),
        (1, 1000, "d"),
        (1001, 19999, "a"),
        (20000, 29999, "b"),
        (30000, 30000, "a"),
        (30001, 39999, "b"),
        (40000, 49999, "a"),
        (50000, FULL - 1, "b"),
        (FULL, FULL, "e"),
    ]
    assert_invariants(ranges)
    slots = np.random.default_rng(7).integers(0, HASH_RANGE_SIZE, size=5000)
    slots = np.concatenate([slots, [0, 1, 1000, 1001, 19999, 20000, 30000, 30001, FULL - 1, FULL]])
    expected = [ranges.owner_of(int(slot)) for slot in slots]
    assert ranges.owners_of(slots).tolist() == expected
    owners = ranges.lookup_table()[1]
    assert [owners[i] for i in ranges.index_of(slots)] == expected
    table = ranges.slot_owners()
    assert table.shape == (HASH_RANGE_SIZE,)
    assert [owners[i] for i in table[slots]] == expected


# -- changes ----------------------------------------------------------------------------


def test_assign_all_gives_the_whole_space() -> None:
    ranges = RangeMap(16)
    ranges.assign_all("a")
    assert ranges.ranges() == [(0, 15, "a")]
    assert ranges.epoch == 1
    assert_invariants(ranges)


def test_assign_all_at_full_size() -> None:
    ranges = RangeMap()
    ranges.assign_all("a")
    assert ranges.ranges() == [(0, FULL, "a")]
    assert ranges.owner_of(FULL) == "a"


def test_assign_inside_a_range_keeps_both_remainders() -> None:
    ranges = _three()
    ranges.assign(5, 7, "n")
    assert ranges.ranges() == [(0, 3, "a"), (4, 4, "b"), (5, 7, "n"), (8, 9, "b"), (10, 15, "c")]
    assert ranges.ranges_of("b") == [(4, 4), (8, 9)]
    assert ranges.epoch == 1
    assert_invariants(ranges)


def test_assign_across_ranges_takes_every_slot_in_between() -> None:
    ranges = _three()
    ranges.assign(2, 12, "n")
    assert ranges.ranges() == [(0, 1, "a"), (2, 12, "n"), (13, 15, "c")]
    assert "b" not in ranges, "b lost its only range"
    assert len(ranges) == 3
    assert_invariants(ranges)


def test_assign_merges_with_adjacent_ranges_of_the_same_owner() -> None:
    ranges = _scattered()
    ranges.assign(2, 4, "a")  # b's range lies between two of a's
    assert ranges.ranges() == [(0, 7, "a"), (8, 11, "c"), (12, 15, "a")]
    assert "b" not in ranges
    ranges.assign(8, 11, "a")
    assert ranges.ranges() == [(0, 15, "a")]
    assert ranges.epoch == 2
    assert_invariants(ranges)


def test_assign_extends_a_range_into_its_neighbour() -> None:
    ranges = _three()
    ranges.assign(4, 6, "a")
    assert ranges.ranges() == [(0, 6, "a"), (7, 9, "b"), (10, 15, "c")]
    ranges.assign(7, 9, "c")
    assert ranges.ranges() == [(0, 6, "a"), (7, 15, "c")]
    assert_invariants(ranges)


def test_a_consumer_gets_three_non_adjacent_ranges_one_assign_at_a_time() -> None:
    ranges = RangeMap(16)
    ranges.assign_all("b")
    ranges.assign(0, 1, "a")
    ranges.assign(5, 7, "a")
    ranges.assign(12, 15, "a")
    ranges.assign(8, 11, "c")
    assert ranges == _scattered()
    assert ranges.epoch == 5
    assert_invariants(ranges)


@pytest.mark.parametrize(("start", "end"), [(0, 1), (0, 0), (13, 14), (5, 7)])
def test_assigning_a_consumer_what_it_owns_changes_nothing(start: int, end: int) -> None:
    ranges = _scattered()
    ranges.assign(start, end, "a")
    assert _state(ranges) == (SCATTERED, 0)


def test_reassign_applies_every_move_in_order_as_one_change() -> None:
    ranges = _three()
    ranges.reassign([(0, 7, "n"), (6, 12, "m"), (15, 15, "n")])
    assert ranges.ranges() == [(0, 5, "n"), (6, 12, "m"), (13, 14, "c"), (15, 15, "n")]
    assert ranges.epoch == 1
    assert_invariants(ranges)


def test_reassign_accepts_any_iterable_of_moves() -> None:
    ranges = _three()
    ranges.reassign(move for move in [(4, 9, "a")])
    assert ranges.ranges() == [(0, 9, "a"), (10, 15, "c")]


@pytest.mark.parametrize("moves", [[], [(0, 3, "a")], [(4, 9, "b"), (0, 1, "a")]])
def test_reassign_that_moves_nothing_keeps_the_epoch(moves: list[Range]) -> None:
    ranges = _three()
    ranges.reassign(moves)
    assert _state(ranges) == (_three().ranges(), 0)


def test_reassign_whose_moves_cancel_out_keeps_the_epoch() -> None:
    """Regression: slots given away and back within one call are no change; the epoch used to grow."""
    ranges = _three()
    ranges.reassign([(0, 3, "b"), (0, 3, "a")])
    assert _state(ranges) == (_three().ranges(), 0)
    ranges.reassign([(2, 6, "n"), (2, 3, "a"), (4, 6, "b"), (15, 15, "n")])
    assert _state(ranges) == ([(0, 3, "a"), (4, 9, "b"), (10, 14, "c"), (15, 15, "n")], 1)


REJECTED_MOVES: list[Any] = [
    pytest.param([(0, 3, "n"), (4, 16, "n")], r"end must be an int in \[4, 15\], not 16", id="end-past-the-space"),
    pytest.param([(0, 3, "n"), (5, 4, "n")], r"end must be an int in \[5, 15\], not 4", id="end-before-start"),
    pytest.param([(-1, 3, "n")], r"start must be an int in \[0, 15\], not -1", id="negative-start"),
    pytest.param([(16, 16, "n")], r"start must be an int in \[0, 15\], not 16", id="start-past-the-space"),
    pytest.param([(1.0, 3, "n")], r"start must be an int in \[0, 15\], not 1.0", id="float-start"),
    pytest.param([(True, 3, "n")], r"start must be an int in \[0, 15\], not True", id="bool-start"),
    pytest.param([(0, "3", "n")], r"end must be an int in \[0, 15\], not '3'", id="str-end"),
    pytest.param([(0, 3, "n"), (0, 3, "")], "consumer id must be a non-empty str, not ''", id="empty-id"),
    pytest.param([(0, 3, 7)], "consumer id must be a non-empty str, not 7", id="int-id"),
    pytest.param([(0, 3, "n"), [0, 3, "n"]], r"move \[0, 3, 'n'\] must be a \(start, end, consumer\) tuple", id="list"),
    pytest.param([(0, 3)], r"move \(0, 3\) must be a \(start, end, consumer\) tuple", id="pair"),
]


@pytest.mark.parametrize(("moves", "message"), REJECTED_MOVES)
def test_rejected_moves_raise_and_change_nothing(moves: list[Any], message: str) -> None:
    ranges = _three()
    with pytest.raises(RangeMapError, match=message):
        ranges.reassign(moves)
    assert _state(ranges) == (_three().ranges(), 0)
    assert_invariants(ranges)


@pytest.mark.parametrize(
    ("move", "message"),
    [
        (p.values[0][-1], p.values[1])
        for p in REJECTED_MOVES
        if isinstance(p.values[0][-1], tuple) and len(p.values[0][-1]) == 3
    ],
)
def test_rejected_assign_raises_and_changes_nothing(move: tuple[Any, ...], message: str) -> None:
    ranges = _three()
    with pytest.raises(RangeMapError, match=message):
        ranges.assign(*move)
    assert _state(ranges) == (_three().ranges(), 0)


def test_changing_an_empty_map_is_refused() -> None:
    ranges = RangeMap(16)
    message = "cannot reassign slots of an empty map; expected assign_all first"
    with pytest.raises(RangeMapError, match=message):
        ranges.assign(0, 3, "a")
    with pytest.raises(RangeMapError, match=message):
        ranges.reassign([])
    assert _state(ranges) == ([], 0)


def test_assign_all_is_refused_on_a_map_with_consumers() -> None:
    ranges = _three()
    message = "cannot give the whole space to 'n': the map already has 3 consumer"
    with pytest.raises(RangeMapError, match=message):
        ranges.assign_all("n")
    with pytest.raises(RangeMapError, match="non-empty str"):
        RangeMap(16).assign_all("")
    assert _state(ranges) == (_three().ranges(), 0)


def test_clear_empties_the_map_once() -> None:
    ranges = _scattered()
    ranges.clear()
    assert _state(ranges) == ([], 1)
    assert ranges.owner_of(3) is None
    assert len(ranges) == 0
    ranges.clear()
    assert ranges.epoch == 1, "clearing an empty map is no change"
    ranges.assign_all("b")
    assert _state(ranges) == ([(0, 15, "b")], 2)
    assert_invariants(ranges)


def test_copy_is_independent_both_ways() -> None:
    original = _scattered()
    # Fill every cache first: a copy shares them until either side changes.
    original.ranges_by_consumer()
    original.owners_of([0])
    original.arrays()
    clone = original.copy()
    assert clone == original
    assert clone.epoch == original.epoch == 0
    clone.assign(2, 4, "a")
    clone.assign(8, 8, "n")
    assert original.ranges() == SCATTERED
    assert original.ranges_by_consumer() == {"a": [(0, 1), (5, 7), (12, 15)], "b": [(2, 4)], "c": [(8, 11)]}
    assert original.owners_of([2, 8]).tolist() == ["b", "c"]
    assert original.arrays().consumers == ("a", "b", "c")
    assert original.epoch == 0
    original.assign(0, 15, "z")
    assert clone.ranges() == [(0, 7, "a"), (8, 8, "n"), (9, 11, "c"), (12, 15, "a")]
    assert clone.owners_of([2, 8, 9]).tolist() == ["a", "n", "c"]
    assert clone.epoch == 2
    assert_invariants(original)
    assert_invariants(clone)


# -- snapshots --------------------------------------------------------------------------


def test_snapshot_shape_lists_a_consumer_once_per_range() -> None:
    assert SNAPSHOT_VERSION == 2
    assert _map(SCATTERED, epoch=5).snapshot() == {
        "version": 2,
        "range_size": 16,
        "epoch": 5,
        "ranges": [{"start": s, "end": e, "consumer": c} for s, e, c in SCATTERED],
    }


def _full_size(build: str) -> RangeMap:
    ranges = RangeMap()
    if build == "empty":
        return ranges
    ranges.assign_all("ключ-é")
    if build == "many":
        ranges.reassign([(at, at + 999, f"c{at % 7}") for at in range(1, FULL - 1000, 3001)])
    elif build == "every-slot":  # 65536 one-slot ranges, three consumers taking turns
        ranges.reassign([(slot, slot, f"c{slot % 3}") for slot in range(HASH_RANGE_SIZE)])
    return ranges


@pytest.mark.parametrize("build", ["empty", "one", "many", "every-slot"])
def test_snapshot_round_trips_through_json_at_full_size(build: str) -> None:
    ranges = _full_size(build)
    restored = RangeMap.from_snapshot(json.loads(json.dumps(ranges.snapshot())))
    assert restored == ranges
    assert restored.epoch == ranges.epoch
    assert restored.snapshot() == ranges.snapshot()
    assert restored.ranges_by_consumer() == ranges.ranges_by_consumer()
    if build == "every-slot":
        assert restored.range_count() == HASH_RANGE_SIZE
        assert restored.ranges_of("c1")[:2] == [(1, 1), (4, 4)]


def _document(triples: list[tuple[Any, Any, Any]], **fields: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "version": SNAPSHOT_VERSION,
        "range_size": 8,
        "epoch": 3,
        "ranges": [{"start": s, "end": e, "consumer": c} for s, e, c in triples],
    }
    document.update(fields)
    return document


def _without(key: str) -> dict[str, Any]:
    document = _document([(0, 7, "a")])
    del document[key]
    return document


TWO = [(0, 3, "a"), (4, 7, "b")]

BAD_SNAPSHOTS: list[Any] = [
    pytest.param(_document(TWO, version=3), "version 3 is not supported", id="version-3"),
    pytest.param(_document(TWO, version=0), "version 0 is not supported", id="version-0"),
    pytest.param(_document(TWO, version="2"), "version '2' is not supported", id="version-str"),
    pytest.param(_document(TWO, version=True), "version True is not supported", id="version-bool"),
    pytest.param(_document(TWO, version=None), "version None is not supported", id="version-none"),
    pytest.param(_without("version"), "snapshot keys are", id="missing-version"),
    pytest.param(_without("range_size"), "snapshot keys are", id="missing-range-size"),
    pytest.param(_without("epoch"), "snapshot keys are", id="missing-epoch"),
    pytest.param(_without("ranges"), "snapshot keys are", id="missing-ranges"),
    pytest.param(_document(TWO, extra=1), "snapshot keys are", id="extra-key"),
    pytest.param(_document(TWO, ranges={"start": 0}), "'ranges' must be a list, not dict", id="ranges-not-a-list"),
    pytest.param(_document(TWO, ranges=[[0, 7, "a"]]), "must have exactly start, end and consumer", id="entry-list"),
    pytest.param(_document(TWO, ranges=[{"start": 0, "end": 7}]), "exactly start, end", id="entry-missing-key"),
    pytest.param(
        _document(TWO, ranges=[{"start": 0, "end": 7, "consumer": "a", "x": 1}]), "exactly start", id="entry-extra-key"
    ),
    pytest.param(_document([(0, 2, "a"), (4, 7, "b")]), "expected start 3", id="gap"),
    pytest.param(_document([(1, 7, "a")]), "expected start 0", id="gap-at-start"),
    pytest.param(_document([(0, 4, "a"), (4, 7, "b")]), "expected start 5", id="overlap"),
    pytest.param(_document([(0, 7, "a"), (0, 7, "b")]), "expected start 8", id="same-range-twice"),
    pytest.param(_document([(0, 6, "a")]), "ranges end at 6, expected them to reach 7", id="ends-short"),
    pytest.param(_document([(0, 3, "a"), (4, 8, "b")]), "ranges end at 8", id="ends-past-range-size"),
    pytest.param(_document(TWO, range_size=16), "expected them to reach 15", id="wrong-range-size"),
    pytest.param(_document([(0, 3, "a"), (4, 3, "b"), (4, 7, "c")]), "end >= start", id="end-before-start"),
    pytest.param(_document([(0, 7.0, "a")]), "with int start and end", id="float-end"),
    pytest.param(_document([(0.0, 7, "a")]), "with int start and end", id="float-start"),
    pytest.param(_document([(0, "7", "a")]), "with int start and end", id="str-end"),
    pytest.param(_document([(None, 7, "a")]), "with int start and end", id="none-start"),
    pytest.param(_document([(False, 7, "a")]), "with int start and end", id="bool-start"),
    pytest.param(_document([(0, 3, "a"), ("4", 7, "b")]), "with int start and end", id="str-start-of-two"),
    pytest.param(_document([(0, 7, "")]), "non-empty str", id="empty-consumer"),
    pytest.param(_document([(0, 7, 5)]), "non-empty str", id="int-consumer"),
    pytest.param(_document([(0, 7, ["a"])]), "non-empty str", id="list-consumer"),
    pytest.param(_document([], range_size=0), "range_size", id="range-size-zero"),
    pytest.param(_document([(0, 7, "a")], range_size="8"), "range_size", id="range-size-str"),
    pytest.param(_document([(0, 7, "a")], epoch=-1), "epoch", id="negative-epoch"),
    pytest.param(_document([(0, 7, "a")], epoch=1.5), "epoch", id="float-epoch"),
    pytest.param([], "a snapshot must be a mapping, not list", id="not-a-mapping"),
    pytest.param(_document([(0, 3, "a"), (4, 5, "b"), (6, 7, "a")], version=1), "more than once", id="v1-repeat"),
    pytest.param(_document([(0, 3, "a"), (4, 7, "a")], version=1), "more than once", id="v1-adjacent-repeat"),
]


@pytest.mark.parametrize(("snapshot", "message"), BAD_SNAPSHOTS)
def test_from_snapshot_rejects_malformed_snapshots(snapshot: Any, message: str) -> None:
    with pytest.raises(SnapshotError, match=message):
        RangeMap.from_snapshot(snapshot)


def test_from_snapshot_reads_the_valid_twin_of_the_bad_ones() -> None:
    restored = RangeMap.from_snapshot(_document(TWO))
    assert restored.ranges() == TWO
    assert (restored.epoch, restored.range_size) == (3, 8)
    empty = RangeMap.from_snapshot(_document([]))
    assert empty == RangeMap(8)
    assert empty.epoch == 3


def test_a_version_2_snapshot_may_repeat_a_consumer_and_adjacent_repeats_merge() -> None:
    restored = RangeMap.from_snapshot(_document([(0, 1, "a"), (2, 3, "b"), (4, 5, "a"), (6, 7, "a")]))
    assert restored.ranges() == [(0, 1, "a"), (2, 3, "b"), (4, 7, "a")]
    assert restored.ranges_of("a") == [(0, 1), (4, 7)]


def test_a_version_1_snapshot_is_still_read() -> None:
    document = {
        "version": 1,
        "range_size": 16,
        "epoch": 9,
        "ranges": [
            {"start": 8, "end": 15, "consumer": "b"},
            {"start": 0, "end": 3, "consumer": "a"},
            {"start": 4, "end": 7, "consumer": "c"},
        ],
    }
    restored = RangeMap.from_snapshot(json.loads(json.dumps(document)))
    assert restored.ranges() == [(0, 3, "a"), (4, 7, "c"), (8, 15, "b")]
    assert restored.epoch == 9
    assert restored.snapshot()["version"] == 2


def test_a_version_1_snapshot_with_a_repeated_consumer_names_it() -> None:
    document = _document([(0, 1, "b"), (2, 3, "a"), (4, 5, "b"), (6, 6, "a"), (7, 7, "c")], version=1)
    with pytest.raises(SnapshotError) as info:
        RangeMap.from_snapshot(document)
    assert str(info.value) == (
        "a version 1 snapshot has one range per consumer, but ['a', 'b'] appear more than once; "
        "expected version 2 for consumers with several ranges"
    )


class _CountingId(str):
    """A consumer id that counts how often it is compared."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        _CountingId.comparisons += 1
        return str.__eq__(self, other)

    def __hash__(self) -> int:
        return str.__hash__(self)


def test_reading_a_version_1_snapshot_takes_linear_work() -> None:
    """Regression: checking a version 1 snapshot for repeated consumers compared every id with every other."""
    count = 4096
    document = _document([(i * 16, i * 16 + 15, _CountingId(f"c{i}")) for i in range(count)], version=1)
    document["range_size"] = HASH_RANGE_SIZE
    _CountingId.comparisons = 0
    restored = RangeMap.from_snapshot(document)
    assert len(restored) == count
    assert _CountingId.comparisons < 10 * count, f"{_CountingId.comparisons} comparisons of {count} ids"


def test_snapshot_errors_are_range_map_errors_and_value_errors() -> None:
    with pytest.raises(RangeMapError) as info:
        RangeMap.from_snapshot(_document([(0, 2, "a"), (4, 7, "b")]))
    assert isinstance(info.value, SnapshotError)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith("invalid snapshot: range (4, 7, 'b') does not continue the tiling")


# -- from_ranges ------------------------------------------------------------------------


def test_from_ranges_accepts_unsorted_input_and_merges_adjacent_ranges_of_one_owner() -> None:
    assert _map([(10, 15, "c"), (0, 3, "a"), (4, 9, "b")]) == _three()
    merged = _map([(0, 1, "a"), (8, 15, "a"), (2, 3, "a"), (4, 7, "b")])
    assert merged.ranges() == [(0, 3, "a"), (4, 7, "b"), (8, 15, "a")]
    assert merged.range_count() == 3
    assert_invariants(merged)


def test_from_ranges_keeps_range_size_and_epoch() -> None:
    built = _map([(0, 99, "a")], 100, 12)
    assert (built.range_size, built.epoch) == (100, 12)
    empty = RangeMap.from_ranges([], 8, 2)
    assert (empty.ranges(), empty.range_size, empty.epoch) == ([], 8, 2)


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        ([(0, 7, "a"), (8, 15)], r"range \(8, 15\) must be \(start, end, consumer\) with int start and end"),
        ([[0, 15, "a"]], r"range \[0, 15, 'a'\] must be"),
        ([(0, 15.0, "a")], "with int start and end"),
        ([(True, 15, "a")], "with int start and end"),
        ([(0, 15, "")], "non-empty str"),
        ([(0, 15, None)], "non-empty str"),
        ([(0, 6, "a"), (8, 15, "b")], r"range \(8, 15, 'b'\) does not continue the tiling: expected start 7"),
        ([(0, 8, "a"), (8, 15, "b")], "expected start 9"),
        ([(0, 3, "a"), (4, 2, "b"), (4, 15, "c")], "and an int end >= start"),
        ([(0, 14, "a")], "ranges end at 14, expected them to reach 15"),
        ([(0, 16, "a")], "ranges end at 16, expected them to reach 15"),
    ],
)
def test_from_ranges_rejects_anything_that_does_not_tile(ranges: list[Any], message: str) -> None:
    with pytest.raises(RangeMapError, match=message):
        RangeMap.from_ranges(ranges, 16)


@pytest.mark.parametrize(("range_size", "epoch"), [(0, 0), (16, -1), (16, 0.5)])
def test_from_ranges_rejects_a_bad_range_size_or_epoch(range_size: int, epoch: int) -> None:
    with pytest.raises(RangeMapError, match=r"range_size|epoch"):
        RangeMap.from_ranges([(0, 15, "a")], range_size, epoch)


# -- model-based property test ----------------------------------------------------------

NAMES = ["a", "b", "c", "d", "e"]
BAD_IDS: list[Any] = ["", 7, None]
OPERATIONS = ["assign_all", "assign", "assign", "assign", "reassign", "reassign", "clear"]

Model = list[str | None]
"""The owner of every slot: the obvious representation the RangeMap must agree with."""


def _runs(model: Model) -> list[Range]:
    runs: list[Range] = []
    for slot, owner in enumerate(model):
        if owner is None:
            continue
        if runs and runs[-1][2] == owner:
            runs[-1] = (runs[-1][0], slot, owner)
        else:
            runs.append((slot, slot, owner))
    return runs


def _valid_move(move: Any, size: int) -> bool:
    if not isinstance(move, tuple) or len(move) != 3:
        return False
    start, end, consumer = move
    return (
        type(start) is int
        and type(end) is int
        and 0 <= start <= end < size
        and isinstance(consumer, str)
        and consumer != ""
    )


def _expected(model: Model, operation: str, args: tuple[Any, ...]) -> Model | None:
    """What the map must hold after ``operation(*args)``, or None when it must be rejected."""
    if operation == "clear":
        return [None] * len(model)
    if operation == "assign_all":
        (consumer,) = args
        if not isinstance(consumer, str) or not consumer or any(model):
            return None
        return [consumer] * len(model)
    moves = [args] if operation == "assign" else list(args[0])
    if not any(model) or not all(_valid_move(move, len(model)) for move in moves):
        return None
    after = list(model)
    for start, end, consumer in moves:
        after[start : end + 1] = [consumer] * (end - start + 1)
    return after


def _draw_arguments(data: st.DataObject, size: int, operation: str) -> tuple[Any, ...]:
    """Arguments for ``operation``: mostly valid ones, with bad ones mixed in, so both outcomes are common."""

    def consumer() -> Any:
        return data.draw(
            st.sampled_from(NAMES + BAD_IDS) if data.draw(st.integers(0, 9)) == 0 else st.sampled_from(NAMES)
        )

    def slot(low: int) -> Any:
        if data.draw(st.integers(0, 14)) == 0:
            return data.draw(st.sampled_from([-1, size, 1.0, True, "2", None]))
        return data.draw(st.integers(min(low, size - 1), size - 1))

    def move() -> Any:
        start = slot(0)
        found = (start, slot(start if type(start) is int else 0), consumer())
        return found if data.draw(st.integers(0, 19)) else list(found)

    if operation == "assign_all":
        return (consumer(),)
    if operation == "clear":
        return ()
    if operation == "assign":
        found = move()
        return tuple(found)
    return ([move() for _ in range(data.draw(st.integers(0, 4)))],)


def _check_against(ranges: RangeMap, model: Model, slots: list[int]) -> None:
    """Every reader of ``ranges`` agrees with ``model``."""
    size = ranges.range_size
    runs = _runs(model)
    assert ranges.ranges() == runs
    assert_invariants(ranges)
    assert [ranges.owner_of(slot) for slot in range(size)] == model
    owners = [owner for _, _, owner in runs]
    for name in NAMES:
        mine = [(s, e) for s, e, o in runs if o == name]
        assert (name in ranges) == bool(mine)
        assert ranges.ranges_of(name) == mine
        assert ranges.width(name) == model.count(name)
    if not runs:
        with pytest.raises(RangeMapError):
            ranges.index_of([0])
        return
    assert ranges.owners_of(slots).tolist() == [model[slot] for slot in slots]
    assert [owners[i] for i in ranges.index_of(slots)] == [model[slot] for slot in slots]
    assert [owners[i] for i in ranges.slot_owners()] == model


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.data(), st.one_of(st.integers(1, 8), st.integers(9, 40)))
def test_any_sequence_of_changes_agrees_with_a_slot_model(data: st.DataObject, range_size: int) -> None:
    ranges = RangeMap(range_size)
    model: Model = [None] * range_size
    epoch = 0
    earlier: tuple[RangeMap, Model, int] | None = None
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        empty_map_grows = not len(ranges) and data.draw(st.integers(0, 4)) > 0
        operation = "assign_all" if empty_map_grows else data.draw(st.sampled_from(OPERATIONS), label="operation")
        args = _draw_arguments(data, range_size, operation)
        expected = _expected(model, operation, args)
        method: Callable[..., None] = getattr(ranges, operation)
        if expected is None:
            with pytest.raises(RangeMapError):
                method(*args)
            assert _state(ranges) == (_runs(model), epoch), "a rejected call changed the map"
        else:
            method(*args)
            epoch += expected != model
            model = expected
        assert ranges.epoch == epoch, "the epoch grows by one exactly when a slot changed owner"
        slots = data.draw(st.lists(st.integers(0, range_size - 1), min_size=1, max_size=20), label="slots")
        _check_against(ranges, model, slots)
        document = json.loads(json.dumps(ranges.snapshot()))
        restored = RangeMap.from_snapshot(document)
        assert (restored, restored.epoch) == (ranges, ranges.epoch)
        if earlier is not None:  # a copy taken one step ago has not followed the change
            clone, clone_model, clone_epoch = earlier
            assert clone.epoch == clone_epoch
            _check_against(clone, clone_model, slots)
        earlier = (ranges.copy(), model, epoch)


def test_every_error_of_the_map_is_a_keyfailover_error() -> None:
    assert issubclass(RangeMapError, KeyFailoverError) and issubclass(RangeMapError, ValueError)
    assert issubclass(SnapshotError, RangeMapError)
