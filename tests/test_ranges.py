"""RangeMap: unit tests of every operation, and a model-based property test of the invariants."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyfailover.core.errors import KeyFailoverError, RangeMapError, SnapshotError, UnknownConsumerError
from keyfailover.core.hashing import HASH_RANGE_SIZE
from keyfailover.core.ranges import SNAPSHOT_VERSION, Range, RangeMap, validate_consumer_id

FULL = HASH_RANGE_SIZE - 1


def _map(ranges: list[Range], range_size: int = 16) -> RangeMap:
    return RangeMap.from_ranges(ranges, range_size)


def _three() -> RangeMap:
    """a [0, 3], b [4, 9], c [10, 15]."""
    return _map([(0, 3, "a"), (4, 9, "b"), (10, 15, "c")])


def _state(ranges: RangeMap) -> tuple[list[Range], int]:
    return ranges.ranges(), ranges.epoch


def _call(ranges: RangeMap, operation: str) -> Callable[..., None]:
    method: Callable[..., None] = getattr(ranges, operation)
    return method


def assert_invariants(ranges: RangeMap) -> None:
    """The documented invariants, checked from every public view of the map."""
    items = ranges.ranges()
    size = ranges.range_size
    consumers = [consumer for _, _, consumer in items]
    assert len(ranges) == len(items) == len(set(consumers))
    assert ranges.consumers() == consumers
    assert list(ranges) == items
    if items:
        assert items[0][0] == 0
        assert items[-1][1] == size - 1
        for (_, end, _), (start, _, _) in itertools.pairwise(items):
            assert start == end + 1
    for start, end, consumer in items:
        assert start <= end
        assert consumer in ranges
        assert ranges.range_of(consumer) == (start, end)
        assert ranges.width(consumer) == end - start + 1
    assert sum(ranges.width(c) for c in consumers) == (size if items else 0)
    ends, owners = ranges.lookup_table()
    assert ends == [end for _, end, _ in items]
    assert owners == consumers


# -- construction and reading -----------------------------------------------------------


def test_a_new_map_is_empty() -> None:
    ranges = RangeMap()
    assert ranges.range_size == HASH_RANGE_SIZE
    assert ranges.epoch == 0
    assert len(ranges) == 0
    assert ranges.ranges() == []
    assert ranges.consumers() == []
    assert ranges.owner_of(0) is None
    assert ranges.owner_of(FULL) is None
    assert ranges.range_of("a") is None
    assert ranges.width("a") == 0
    assert "a" not in ranges
    assert_invariants(ranges)


@pytest.mark.parametrize("range_size", [0, -1, 1.5, "16", None, True])
def test_constructor_rejects_a_bad_range_size(range_size: Any) -> None:
    with pytest.raises(RangeMapError, match="range_size"):
        RangeMap(range_size)


@pytest.mark.parametrize("epoch", [-1, 1.0, "0", None, True])
def test_constructor_rejects_a_bad_epoch(epoch: Any) -> None:
    with pytest.raises(RangeMapError, match="epoch"):
        RangeMap(16, epoch)


def test_constructor_keeps_a_given_epoch() -> None:
    assert RangeMap(16, 7).epoch == 7


@pytest.mark.parametrize("consumer", ["", 0, None, b"a", ["a"]])
def test_validate_consumer_id_rejects_non_strings_and_empty(consumer: Any) -> None:
    with pytest.raises(RangeMapError, match="non-empty str"):
        validate_consumer_id(consumer)


def test_validate_consumer_id_returns_a_valid_id() -> None:
    assert validate_consumer_id("consumer-1") == "consumer-1"


def test_owner_of_looks_up_every_boundary() -> None:
    ranges = _three()
    expected = ["a"] * 4 + ["b"] * 6 + ["c"] * 6
    assert [ranges.owner_of(slot) for slot in range(16)] == expected


@pytest.mark.parametrize("slot", [-1, 16, 1000])
def test_owner_of_rejects_a_slot_outside_the_space(slot: int) -> None:
    with pytest.raises(RangeMapError, match=r"outside \[0, 15\]"):
        _three().owner_of(slot)
    with pytest.raises(RangeMapError):
        RangeMap(16).owner_of(slot)


def test_neighbours() -> None:
    ranges = _three()
    assert ranges.neighbours("a") == (None, "b")
    assert ranges.neighbours("b") == ("a", "c")
    assert ranges.neighbours("c") == ("b", None)
    single = RangeMap(16)
    single.assign_all("x")
    assert single.neighbours("x") == (None, None)


def test_neighbours_of_an_unknown_consumer_is_a_lookup_error() -> None:
    with pytest.raises(UnknownConsumerError, match="'zz'") as info:
        _three().neighbours("zz")
    assert isinstance(info.value, LookupError)
    assert str(info.value) == "consumer 'zz' owns no range in this map"


def test_equality_compares_range_size_and_ranges() -> None:
    assert _three() == _three()
    assert _three() != _map([(0, 4, "a"), (5, 9, "b"), (10, 15, "c")])
    assert _map([(0, 15, "a")], 16) != _map([(0, 16, "a")], 17)
    assert RangeMap(16) == RangeMap(16)
    assert RangeMap(16) != RangeMap(32)
    assert _three() != "not a map"
    with pytest.raises(TypeError):
        hash(_three())


def test_repr_shows_epoch_and_ranges() -> None:
    assert repr(_map([(0, 15, "a")], 16)) == "RangeMap(epoch=0, ranges=[(0, 15, 'a')])"


# -- vectorised lookups -----------------------------------------------------------------


def test_index_of_and_owners_of_match_owner_of_on_every_slot() -> None:
    ranges = _three()
    slots = np.arange(16)
    indexes = ranges.index_of(slots)
    owners = ranges.owners_of(slots)
    assert indexes.tolist() == [0] * 4 + [1] * 6 + [2] * 6
    assert owners.tolist() == [ranges.owner_of(slot) for slot in range(16)]
    assert ranges.owners_of([15, 0, 4]).tolist() == ["c", "a", "b"]
    assert ranges.index_of(np.array([[3, 4], [9, 10]])).tolist() == [[0, 1], [1, 2]]


def test_index_of_rejects_slots_outside_the_space_and_an_empty_map() -> None:
    ranges = _three()
    with pytest.raises(RangeMapError, match=r"\[0, 15\]"):
        ranges.index_of([0, 16])
    with pytest.raises(RangeMapError, match=r"\[0, 15\]"):
        ranges.owners_of(np.array([-1, 3]))
    with pytest.raises(RangeMapError, match="empty"):
        RangeMap(16).index_of([0])
    with pytest.raises(RangeMapError, match="empty"):
        RangeMap(16).owners_of([0])


def test_slot_owners_gives_the_range_index_of_every_slot() -> None:
    ranges = _three()
    table = ranges.slot_owners()
    assert table.shape == (16,)
    assert table.tolist() == ranges.index_of(np.arange(16)).tolist()


def test_lookups_at_full_size_agree_on_random_slots() -> None:
    ranges = RangeMap()
    ranges.assign_all("a")
    ranges.split("a", "b", 20000)
    ranges.split("b", "c", 40000)
    ranges.split("a", "d", 1)
    ranges.split("c", "e", FULL)
    assert ranges.ranges() == [
        (0, 0, "a"),
        (1, 19999, "d"),
        (20000, 39999, "b"),
        (40000, FULL - 1, "c"),
        (FULL, FULL, "e"),
    ]
    slots = np.random.default_rng(7).integers(0, HASH_RANGE_SIZE, size=5000)
    slots = np.concatenate([slots, [0, 1, 19999, 20000, 39999, 40000, FULL - 1, FULL]])
    expected = [ranges.owner_of(int(slot)) for slot in slots]
    assert ranges.owners_of(slots).tolist() == expected
    consumers = ranges.consumers()
    assert [consumers[i] for i in ranges.index_of(slots)] == expected
    table = ranges.slot_owners()
    assert table.shape == (HASH_RANGE_SIZE,)
    assert [consumers[i] for i in table[slots]] == expected


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


def test_split_gives_the_newcomer_the_upper_part_by_default() -> None:
    ranges = _three()
    ranges.split("b", "n", 7)
    assert ranges.ranges() == [(0, 3, "a"), (4, 6, "b"), (7, 9, "n"), (10, 15, "c")]
    assert ranges.epoch == 1
    assert_invariants(ranges)


def test_split_can_give_the_newcomer_the_lower_part() -> None:
    ranges = _three()
    ranges.split("b", "n", 7, newcomer_takes="lower")
    assert ranges.ranges() == [(0, 3, "a"), (4, 6, "n"), (7, 9, "b"), (10, 15, "c")]
    assert_invariants(ranges)


@pytest.mark.parametrize("at", [5, 9])
def test_split_at_the_extremes_leaves_both_parts_non_empty(at: int) -> None:
    ranges = _three()
    ranges.split("b", "n", at)
    assert ranges.range_of("b") == (4, at - 1)
    assert ranges.range_of("n") == (at, 9)


def test_split_of_a_width_one_range_is_rejected() -> None:
    ranges = _map([(0, 0, "a"), (1, 15, "b")])
    with pytest.raises(RangeMapError, match=r"\[0, 0\]"):
        ranges.split("a", "n", 0)
    with pytest.raises(RangeMapError, match=r"\[0, 0\]"):
        ranges.split("a", "n", 1)


@pytest.mark.parametrize(
    ("leaver", "into", "expected"),
    [
        ("b", "a", [(0, 9, "a"), (10, 15, "c")]),
        ("b", "c", [(0, 3, "a"), (4, 15, "c")]),
        ("a", "b", [(0, 9, "b"), (10, 15, "c")]),
        ("c", "b", [(0, 3, "a"), (4, 15, "b")]),
    ],
)
def test_merge_extends_the_neighbour_over_the_leaver(leaver: str, into: str, expected: list[Range]) -> None:
    ranges = _three()
    ranges.merge(leaver, into)
    assert ranges.ranges() == expected
    assert leaver not in ranges
    assert ranges.epoch == 1
    assert_invariants(ranges)


def test_remove_last_empties_the_map() -> None:
    ranges = _map([(0, 15, "a")])
    ranges.remove_last("a")
    assert ranges.ranges() == []
    assert ranges.epoch == 1
    assert ranges.owner_of(3) is None
    ranges.assign_all("b")
    assert ranges.ranges() == [(0, 15, "b")]
    assert ranges.epoch == 2


def test_replace_hands_the_range_unchanged() -> None:
    ranges = _three()
    ranges.replace("b", "n")
    assert ranges.ranges() == [(0, 3, "a"), (4, 9, "n"), (10, 15, "c")]
    assert "b" not in ranges
    assert ranges.range_of("b") is None
    assert ranges.epoch == 1
    assert_invariants(ranges)


@pytest.mark.parametrize(
    ("boundary", "expected"),
    [
        (1, [(0, 0, "a"), (1, 9, "b"), (10, 15, "c")]),
        (8, [(0, 7, "a"), (8, 9, "b"), (10, 15, "c")]),
        (9, [(0, 8, "a"), (9, 9, "b"), (10, 15, "c")]),
    ],
)
def test_move_boundary(boundary: int, expected: list[Range]) -> None:
    ranges = _three()
    ranges.move_boundary("a", "b", boundary)
    assert ranges.ranges() == expected
    assert ranges.epoch == 1
    assert_invariants(ranges)


def test_move_boundary_to_where_it_is_changes_nothing() -> None:
    ranges = _three()
    ranges.move_boundary("a", "b", 4)
    assert _state(ranges) == (_three().ranges(), 0)


REJECTED_CHANGES: list[Any] = [
    pytest.param("split", ("b", "n", 4), RangeMapError, r"expected an int in \[5, 9\]", id="split-at-start"),
    pytest.param("split", ("b", "n", 10), RangeMapError, r"expected an int in \[5, 9\]", id="split-past-end"),
    pytest.param("split", ("b", "n", 6.0), RangeMapError, "expected an int", id="split-at-float"),
    pytest.param("split", ("b", "n", True), RangeMapError, "expected an int", id="split-at-bool"),
    pytest.param("split", ("b", "n", "6"), RangeMapError, "expected an int", id="split-at-str"),
    pytest.param("split", ("b", "c", 6), RangeMapError, "already owns", id="split-for-an-owner"),
    pytest.param("split", ("b", "b", 6), RangeMapError, "already owns", id="split-for-itself"),
    pytest.param("split", ("b", "", 6), RangeMapError, "non-empty str", id="split-for-empty-id"),
    pytest.param("split", ("b", 5, 6), RangeMapError, "non-empty str", id="split-for-int-id"),
    pytest.param("split", ("b", "n", 6, "middle"), RangeMapError, "newcomer_takes", id="split-bad-side"),
    pytest.param("split", ("zz", "n", 6), UnknownConsumerError, "'zz'", id="split-unknown"),
    pytest.param("merge", ("a", "c"), RangeMapError, "expected adjacent", id="merge-not-adjacent"),
    pytest.param("merge", ("c", "a"), RangeMapError, "expected adjacent", id="merge-not-adjacent-reversed"),
    pytest.param("merge", ("b", "b"), RangeMapError, "expected adjacent", id="merge-into-itself"),
    pytest.param("merge", ("zz", "a"), UnknownConsumerError, "'zz'", id="merge-unknown-leaver"),
    pytest.param("merge", ("a", "zz"), UnknownConsumerError, "'zz'", id="merge-into-unknown"),
    pytest.param("replace", ("b", "c"), RangeMapError, "already owns", id="replace-by-an-owner"),
    pytest.param("replace", ("b", "b"), RangeMapError, "already owns", id="replace-by-itself"),
    pytest.param("replace", ("b", ""), RangeMapError, "non-empty str", id="replace-by-empty-id"),
    pytest.param("replace", ("zz", "n"), UnknownConsumerError, "'zz'", id="replace-unknown"),
    pytest.param("move_boundary", ("a", "b", 0), RangeMapError, r"\[1, 9\]", id="move-to-lower-start"),
    pytest.param("move_boundary", ("a", "b", 10), RangeMapError, r"\[1, 9\]", id="move-past-upper-end"),
    pytest.param("move_boundary", ("a", "b", 5.0), RangeMapError, "expected an int", id="move-to-float"),
    pytest.param("move_boundary", ("b", "a", 4), RangeMapError, "not just below", id="move-reversed"),
    pytest.param("move_boundary", ("a", "c", 5), RangeMapError, "not just below", id="move-not-adjacent"),
    pytest.param("move_boundary", ("a", "a", 2), RangeMapError, "not just below", id="move-with-itself"),
    pytest.param("move_boundary", ("zz", "b", 5), UnknownConsumerError, "'zz'", id="move-unknown-lower"),
    pytest.param("move_boundary", ("a", "zz", 5), UnknownConsumerError, "'zz'", id="move-unknown-upper"),
    pytest.param("remove_last", ("a",), RangeMapError, "3 consumers", id="remove-last-of-three"),
    pytest.param("remove_last", ("zz",), UnknownConsumerError, "'zz'", id="remove-last-unknown"),
    pytest.param("assign_all", ("n",), RangeMapError, "expected an empty map", id="assign-all-when-owned"),
]


@pytest.mark.parametrize(("operation", "args", "error", "message"), REJECTED_CHANGES)
def test_rejected_changes_raise_and_change_nothing(
    operation: str, args: tuple[Any, ...], error: type[Exception], message: str
) -> None:
    ranges = _three()
    with pytest.raises(error, match=message):
        _call(ranges, operation)(*args)
    assert _state(ranges) == (_three().ranges(), 0)
    assert_invariants(ranges)


def test_copy_is_independent() -> None:
    original = _three()
    original.split("c", "d", 12)
    clone = original.copy()
    assert clone == original
    assert clone.epoch == original.epoch == 1
    clone.split("a", "n", 2)
    clone.merge("c", "b")
    assert original.ranges() == [(0, 3, "a"), (4, 9, "b"), (10, 11, "c"), (12, 15, "d")]
    assert original.epoch == 1
    assert original.owner_of(2) == "a"
    assert original.owners_of([2, 10]).tolist() == ["a", "c"]
    assert original.lookup_table() == ([3, 9, 11, 15], ["a", "b", "c", "d"])
    original.replace("d", "z")
    assert clone.ranges() == [(0, 1, "a"), (2, 3, "n"), (4, 11, "b"), (12, 15, "d")]
    assert clone.owners_of([2, 10, 15]).tolist() == ["n", "b", "d"]
    assert clone.epoch == 3


def test_lookup_table_lists_are_replaced_not_mutated() -> None:
    ranges = _three()
    ends, owners = ranges.lookup_table()
    ranges.split("a", "n", 2)
    assert (ends, owners) == ([3, 9, 15], ["a", "b", "c"])
    assert ranges.lookup_table() == ([1, 3, 9, 15], ["a", "n", "b", "c"])


# -- snapshots --------------------------------------------------------------------------


def test_snapshot_shape() -> None:
    ranges = _three()
    ranges.split("c", "d", 12)
    assert ranges.snapshot() == {
        "version": SNAPSHOT_VERSION,
        "range_size": 16,
        "epoch": 1,
        "ranges": [
            {"start": 0, "end": 3, "consumer": "a"},
            {"start": 4, "end": 9, "consumer": "b"},
            {"start": 10, "end": 11, "consumer": "c"},
            {"start": 12, "end": 15, "consumer": "d"},
        ],
    }


@pytest.mark.parametrize("build", ["empty", "one", "many"])
def test_snapshot_round_trips_through_json_at_full_size(build: str) -> None:
    ranges = RangeMap()
    if build != "empty":
        ranges.assign_all("ключ-é")
    if build == "many":
        for index, at in enumerate([30000, 1, FULL, 50000]):
            ranges.split(ranges.owner_of(at) or "", f"c{index}", at)
    restored = RangeMap.from_snapshot(json.loads(json.dumps(ranges.snapshot())))
    assert restored == ranges
    assert restored.epoch == ranges.epoch
    assert restored.snapshot() == ranges.snapshot()
    assert_invariants(restored)


def _snapshot(triples: list[tuple[Any, Any, Any]], **fields: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "version": SNAPSHOT_VERSION,
        "range_size": 8,
        "epoch": 3,
        "ranges": [{"start": s, "end": e, "consumer": c} for s, e, c in triples],
    }
    document.update(fields)
    return document


def _without(key: str) -> dict[str, Any]:
    document = _snapshot([(0, 7, "a")])
    del document[key]
    return document


TWO = [(0, 3, "a"), (4, 7, "b")]

BAD_SNAPSHOTS: list[Any] = [
    pytest.param(_snapshot(TWO, version=2), id="version-2"),
    pytest.param(_snapshot(TWO, version=0), id="version-0"),
    pytest.param(_snapshot(TWO, version="1"), id="version-str"),
    pytest.param(_snapshot(TWO, version=None), id="version-none"),
    pytest.param(_without("version"), id="missing-version"),
    pytest.param(_without("range_size"), id="missing-range-size"),
    pytest.param(_without("epoch"), id="missing-epoch"),
    pytest.param(_without("ranges"), id="missing-ranges"),
    pytest.param(_snapshot(TWO, extra=1), id="extra-key"),
    pytest.param(_snapshot(TWO, ranges={"start": 0}), id="ranges-not-a-list"),
    pytest.param(_snapshot(TWO, ranges=[[0, 7, "a"]]), id="entry-not-a-mapping"),
    pytest.param(_snapshot(TWO, ranges=[{"start": 0, "end": 7}]), id="entry-missing-consumer"),
    pytest.param(_snapshot(TWO, ranges=[{"start": 0, "end": 7, "consumer": "a", "x": 1}]), id="entry-extra-key"),
    pytest.param(_snapshot([(0, 2, "a"), (4, 7, "b")]), id="gap"),
    pytest.param(_snapshot([(1, 7, "a")]), id="gap-at-start"),
    pytest.param(_snapshot([(0, 4, "a"), (4, 7, "b")]), id="overlap"),
    pytest.param(_snapshot([(0, 7, "a"), (0, 7, "b")]), id="same-range-twice"),
    pytest.param(_snapshot([(0, 3, "a"), (4, 7, "a")]), id="duplicate-consumer"),
    pytest.param(_snapshot([(0, 6, "a")]), id="ends-short"),
    pytest.param(_snapshot([(0, 3, "a"), (4, 8, "b")]), id="ends-past-range-size"),
    pytest.param(_snapshot([(0, 3, "a"), (4, 7, "b")], range_size=16), id="wrong-range-size"),
    pytest.param(_snapshot([(0, 3, "a"), (4, 3, "b"), (4, 7, "c")]), id="end-before-start"),
    pytest.param(_snapshot([(0, 7.0, "a")]), id="float-end"),
    pytest.param(_snapshot([(0.0, 7, "a")]), id="float-start"),
    pytest.param(_snapshot([(0, "7", "a")]), id="str-end"),
    pytest.param(_snapshot([(None, 7, "a")]), id="none-start"),
    pytest.param(_snapshot([(False, 7, "a")]), id="bool-start"),
    pytest.param(_snapshot([(0, 3.0, "a"), (4, 7, "b")]), id="float-end-of-two"),
    pytest.param(_snapshot([(0, 3, "a"), (4, "7", "b")]), id="str-end-of-two"),
    pytest.param(_snapshot([(0, 3, "a"), ("4", 7, "b")]), id="str-start-of-two"),
    pytest.param(_snapshot([(None, 3, "a"), (4, 7, "b")]), id="none-start-of-two"),
    pytest.param(_snapshot([(0, 7, "")]), id="empty-consumer"),
    pytest.param(_snapshot([(0, 7, 5)]), id="int-consumer"),
    pytest.param(_snapshot([], range_size=0), id="range-size-zero"),
    pytest.param(_snapshot([(0, 7, "a")], range_size="8"), id="range-size-str"),
    pytest.param(_snapshot([(0, 7, "a")], epoch=-1), id="negative-epoch"),
    pytest.param(_snapshot([(0, 7, "a")], epoch=1.5), id="float-epoch"),
    pytest.param([], id="not-a-mapping"),
]


@pytest.mark.parametrize("snapshot", BAD_SNAPSHOTS)
def test_from_snapshot_rejects_malformed_snapshots(snapshot: Any) -> None:
    with pytest.raises(SnapshotError):
        RangeMap.from_snapshot(snapshot)


def test_from_snapshot_accepts_the_valid_twin_of_the_bad_ones() -> None:
    restored = RangeMap.from_snapshot(_snapshot(TWO))
    assert restored.ranges() == TWO
    assert restored.epoch == 3
    assert restored.range_size == 8
    empty = RangeMap.from_snapshot(_snapshot([]))
    assert empty == RangeMap(8)
    assert empty.epoch == 3


def test_snapshot_error_is_a_range_map_error_and_a_value_error() -> None:
    with pytest.raises(RangeMapError) as info:
        RangeMap.from_snapshot(_snapshot([(0, 2, "a"), (4, 7, "b")]))
    assert isinstance(info.value, SnapshotError)
    assert isinstance(info.value, ValueError)
    assert "expected start 3" in str(info.value)


def test_from_ranges_accepts_unsorted_input() -> None:
    assert _map([(10, 15, "c"), (0, 3, "a"), (4, 9, "b")]) == _three()


# -- model-based property test ----------------------------------------------------------

NAMES = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]
BAD_IDS: list[Any] = ["", 7, None]
ID_POOL: list[Any] = NAMES + BAD_IDS
OPERATIONS = [
    "assign_all",
    "split",
    "split",
    "split",
    "merge",
    "move_boundary",
    "move_boundary",
    "replace",
    "remove_last",
]

Model = list[str | None]
"""The owner of every slot: the obvious representation the RangeMap must agree with."""


def _runs(model: Model) -> list[tuple[int, int, str]]:
    runs: list[tuple[int, int, str]] = []
    for slot, owner in enumerate(model):
        if owner is None:
            continue
        if runs and runs[-1][2] == owner and runs[-1][1] == slot - 1:
            runs[-1] = (runs[-1][0], slot, owner)
        else:
            runs.append((slot, slot, owner))
    return runs


def _span(model: Model, consumer: Any) -> tuple[int, int] | None:
    if not isinstance(consumer, str):
        return None
    slots = [slot for slot, owner in enumerate(model) if owner == consumer]
    return (slots[0], slots[-1]) if slots else None


def _is_new_id(model: Model, consumer: Any) -> bool:
    return isinstance(consumer, str) and consumer != "" and consumer not in model


def _expected(model: Model, operation: str, args: tuple[Any, ...]) -> Model | None:
    """What the map must hold after ``operation(*args)``, or None when it must be rejected."""
    after = list(model)
    if operation == "assign_all":
        (consumer,) = args
        if not _is_new_id(model, consumer) or any(model):
            return None
        return [consumer] * len(model)
    if operation == "split":
        owner, newcomer, at, takes = args
        span = _span(model, owner)
        if span is None or not _is_new_id(model, newcomer) or takes not in ("upper", "lower"):
            return None
        if type(at) is not int or not span[0] < at <= span[1]:
            return None
        part = range(at, span[1] + 1) if takes == "upper" else range(span[0], at)
        for slot in part:
            after[slot] = newcomer
        return after
    if operation == "merge":
        leaver, into = args
        leaver_span, into_span = _span(model, leaver), _span(model, into)
        if leaver_span is None or into_span is None:
            return None
        if into_span[1] + 1 != leaver_span[0] and leaver_span[1] + 1 != into_span[0]:
            return None
        return [into if owner == leaver else owner for owner in model]
    if operation == "move_boundary":
        lower, upper, boundary = args
        lower_span, upper_span = _span(model, lower), _span(model, upper)
        if lower_span is None or upper_span is None or lower_span[1] + 1 != upper_span[0]:
            return None
        if type(boundary) is not int or not lower_span[0] < boundary <= upper_span[1]:
            return None
        for slot in range(lower_span[0], upper_span[1] + 1):
            after[slot] = lower if slot < boundary else upper
        return after
    if operation == "replace":
        old, new = args
        if _span(model, old) is None or not _is_new_id(model, new):
            return None
        return [new if owner == old else owner for owner in model]
    (consumer,) = args  # remove_last
    if _span(model, consumer) is None or len({owner for owner in model}) != 1:
        return None
    return [None] * len(model)


def _draw_arguments(data: st.DataObject, ranges: RangeMap, operation: str) -> tuple[Any, ...]:
    """Arguments for ``operation``: mostly valid ones, with bad ones mixed in, so both outcomes are common."""
    size = ranges.range_size
    present = ranges.consumers()
    absent = [name for name in NAMES if name not in present]

    def likely(good: list[Any]) -> Any:
        """Mostly one of ``good``; sometimes anything, including bad ids and unknown consumers."""
        if good and data.draw(st.integers(0, 4)) > 0:
            return data.draw(st.sampled_from(good))
        return data.draw(st.sampled_from(present + ID_POOL))

    def slot_between(low: int, high: int) -> Any:
        if data.draw(st.integers(0, 6)) == 0:
            return data.draw(st.sampled_from([1.0, True, "2", None]))
        return data.draw(st.integers(low, high))

    def slot_near(consumer: Any) -> Any:
        found = ranges.range_of(consumer) if consumer in present else None
        return slot_between(found[0], found[1] + 1) if found else slot_between(-1, size)

    if operation == "assign_all":
        return (likely(absent),)
    if operation == "remove_last":
        return (likely(present),)
    if operation == "split":
        owner = likely(present)
        takes = data.draw(st.sampled_from(["upper", "upper", "lower", "lower", "bad"]))
        return owner, likely(absent), slot_near(owner), takes
    if operation == "replace":
        return likely(present), likely(absent)
    lower = likely(present)
    neighbours = [n for n in ranges.neighbours(lower) if n is not None] if lower in present else []
    other = likely(neighbours)
    if operation == "merge":
        return lower, other
    lower_range = ranges.range_of(lower) if lower in present else None
    upper_range = ranges.range_of(other) if other in present else None
    if lower_range and upper_range:
        return lower, other, slot_between(min(lower_range[0], upper_range[0]), max(lower_range[1], upper_range[1]) + 1)
    return lower, other, slot_near(lower)


def _must_exist(operation: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arguments of ``operation`` that name consumers which must already own a range."""
    return {"assign_all": (), "split": args[:1], "move_boundary": args[:2], "replace": args[:1]}.get(operation, args)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.one_of(st.integers(1, 8), st.integers(9, 40)))
def test_any_sequence_of_changes_keeps_the_invariants(data: st.DataObject, range_size: int) -> None:
    ranges = RangeMap(range_size)
    model: Model = [None] * range_size
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        empty_map_grows = not len(ranges) and data.draw(st.integers(0, 4)) > 0
        operation = "assign_all" if empty_map_grows else data.draw(st.sampled_from(OPERATIONS), label="operation")
        args = _draw_arguments(data, ranges, operation)
        expected = _expected(model, operation, args)
        before = _state(ranges)
        if expected is None:
            with pytest.raises(KeyFailoverError) as info:
                _call(ranges, operation)(*args)
            # Arguments are checked in order: the first bad one decides. A str that owns no
            # range is unknown; any other type is a malformed argument.
            bad = [consumer for consumer in _must_exist(operation, args) if _span(model, consumer) is None]
            unknown = bool(bad) and isinstance(bad[0], str)
            assert isinstance(info.value, UnknownConsumerError if unknown else RangeMapError)
            assert _state(ranges) == before
        else:
            _call(ranges, operation)(*args)
            assert ranges.ranges() == _runs(expected)
            assert ranges.epoch == before[1] + (1 if expected != model else 0)
            model = expected
        assert_invariants(ranges)
        _check_lookups(data, ranges, model)


def _check_lookups(data: st.DataObject, ranges: RangeMap, model: Model) -> None:
    size = ranges.range_size
    assert [ranges.owner_of(slot) for slot in range(size)] == model
    if not len(ranges):
        with pytest.raises(RangeMapError):
            ranges.index_of([0])
        return
    slots = np.array(data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=20)))
    assert ranges.owners_of(slots).tolist() == [model[slot] for slot in slots]
    consumers = ranges.consumers()
    assert [consumers[i] for i in ranges.index_of(slots)] == [model[slot] for slot in slots]
    assert [consumers[i] for i in ranges.slot_owners()] == model
    for consumer in consumers:
        start, end = ranges.range_of(consumer) or (0, 0)
        below, above = ranges.neighbours(consumer)
        assert below == (model[start - 1] if start > 0 else None)
        assert above == (model[end + 1] if end + 1 < size else None)
    document = ranges.snapshot()
    restored = RangeMap.from_snapshot(json.loads(json.dumps(document)))
    assert restored == ranges
    assert restored.epoch == ranges.epoch
    clone = ranges.copy()
    assert clone == ranges
    assert clone.epoch == ranges.epoch
