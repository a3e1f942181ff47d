"""Cursor: ack patterns, mark-delete advancement, redelivery ranges, the stored form, and a model property."""

from __future__ import annotations

import random
import struct
import zlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyfailover.broker.cursor import FORMAT_VERSION, Cursor
from keyfailover.core.errors import CursorError, KeyFailoverError


def _state(cursor: Cursor) -> tuple[int, list[tuple[int, int]]]:
    return cursor.mark_delete, cursor.acked_ranges


def _mark_delete_of(acked: set[int]) -> int:
    """The largest m with 1..m all in ``acked``."""
    m = 0
    while m + 1 in acked:
        m += 1
    return m


def assert_matches(cursor: Cursor, model: set[int], up_to: int) -> None:
    """The cursor says exactly what the set of acked positions says, for positions 1..up_to."""
    mark_delete = _mark_delete_of(model)
    assert cursor.mark_delete == mark_delete
    assert cursor.acked == {p for p in model if p > mark_delete}
    assert cursor.last_acked == max(model, default=0)
    for position in range(1, up_to + 1):
        assert cursor.is_acked(position) == (position in model), position
    ranges = cursor.acked_ranges
    previous_end = mark_delete
    for start, end in ranges:
        assert previous_end + 1 < start <= end  # sorted, disjoint, never touching
        previous_end = end


# -- construction ----------------------------------------------------------------------


def test_a_new_cursor_has_consumed_nothing() -> None:
    cursor = Cursor()
    assert _state(cursor) == (0, [])
    assert cursor.acked == frozenset()
    assert not cursor.is_acked(1)
    assert list(cursor.unacked_after(0, 3)) == [1, 2, 3]


def test_init_absorbs_acked_positions_contiguous_to_mark_delete() -> None:
    cursor = Cursor(3, [9, 5, 4, 2, 9, 11, 12])
    assert _state(cursor) == (5, [(9, 9), (11, 12)])
    assert cursor.acked == {9, 11, 12}


def test_init_accepts_any_iterable_of_positions() -> None:
    assert _state(Cursor(0, range(1, 6))) == (5, [])
    assert _state(Cursor(0, iter([7, 8]))) == (0, [(7, 8)])
    assert _state(Cursor(0, frozenset({3}))) == (0, [(3, 3)])


@pytest.mark.parametrize(
    ("mark_delete", "acked"),
    [(-1, ()), (True, ()), (1.0, ()), (2**63, ()), (0, [0]), (0, [-3]), (0, ["4"]), (0, [2**63]), (0, 5)],
)
def test_init_rejects_bad_positions(mark_delete: Any, acked: Any) -> None:
    with pytest.raises(CursorError, match="must be"):
        Cursor(mark_delete, acked)


# -- acks ------------------------------------------------------------------------------


def test_in_order_acks_advance_mark_delete() -> None:
    cursor = Cursor()
    for position in range(1, 101):
        cursor.ack(position)
        assert _state(cursor) == (position, [])


def test_an_ack_above_a_hole_waits_until_the_hole_is_acked() -> None:
    cursor = Cursor()
    for position in (2, 3, 5):
        cursor.ack(position)
    assert _state(cursor) == (0, [(2, 3), (5, 5)])
    assert [cursor.is_acked(p) for p in range(1, 7)] == [False, True, True, False, True, False]
    cursor.ack(1)
    assert _state(cursor) == (3, [(5, 5)])
    cursor.ack(4)
    assert _state(cursor) == (5, [])


def test_ack_joins_the_range_before_after_or_both() -> None:
    cursor = Cursor(0, [10, 20, 30])
    cursor.ack(11)  # joins the range before
    cursor.ack(19)  # joins the range after
    assert _state(cursor) == (0, [(10, 11), (19, 20), (30, 30)])
    for position in range(12, 19):
        cursor.ack(position)  # the last one joins both
    assert _state(cursor) == (0, [(10, 20), (30, 30)])
    cursor.ack(25)  # alone between two ranges
    cursor.ack(5)  # alone before every range
    cursor.ack(31)  # extends the newest range
    cursor.ack(40)  # alone after every range
    assert _state(cursor) == (0, [(5, 5), (10, 20), (25, 25), (30, 31), (40, 40)])


def test_ack_is_idempotent() -> None:
    cursor = Cursor(4, [7, 8, 9])
    before = _state(cursor)
    for position in (1, 4, 7, 8, 9):
        cursor.ack(position)
    assert _state(cursor) == before


def test_filling_many_holes_in_order_absorbs_every_range() -> None:
    cursor = Cursor()
    model: set[int] = set()
    for position in range(2, 401, 2):
        cursor.ack(position)
        model.add(position)
    for position in range(1, 400, 2):  # each absorbs one range: exercises dropping dead ranges
        cursor.ack(position)
        model.add(position)
        assert cursor.mark_delete == position + 1
        assert cursor.acked_ranges == [(p, p) for p in range(position + 3, 401, 2)]
    assert_matches(cursor, model, 402)
    cursor.ack(402)
    cursor.ack(401)
    assert _state(cursor) == (402, [])


def test_acks_between_absorptions_keep_the_ranges_right() -> None:
    rng = random.Random(7)
    cursor = Cursor()
    model: set[int] = set()
    order = list(range(1, 2001))
    for start in range(0, len(order), 50):  # nearly in order: shuffled within windows of 50
        window = order[start : start + 50]
        rng.shuffle(window)
        order[start : start + 50] = window
    for position in order:
        cursor.ack(position)
        model.add(position)
        if position % 97 == 0:
            assert_matches(cursor, model, 2002)
    assert _state(cursor) == (2000, [])


@pytest.mark.parametrize("position", [0, -1, True, 1.5, "3", None, 2**63])
def test_ack_and_is_acked_reject_bad_positions_and_change_nothing(position: Any) -> None:
    cursor = Cursor(2, [5])
    with pytest.raises(CursorError, match="must be an int"):
        cursor.ack(position)
    with pytest.raises(CursorError, match="must be an int"):
        cursor.is_acked(position)
    assert _state(cursor) == (2, [(5, 5)])


@pytest.mark.parametrize("position", [0, -1, True, 1.5, "3", None, 2**63])
def test_ack_many_rejects_a_batch_with_a_bad_position_and_acks_none_of_it(position: Any) -> None:
    cursor = Cursor(2, [5])
    with pytest.raises(CursorError, match="must be an int"):
        cursor.ack_many([3, 7, position, 8])
    assert _state(cursor) == (2, [(5, 5)])
    cursor.ack_many([])
    assert _state(cursor) == (2, [(5, 5)])


# -- what a restarted subscription redelivers ------------------------------------------


def test_unacked_after_skips_acked_positions() -> None:
    cursor = Cursor(3, [5, 6, 9, 12, 13, 14])
    assert list(cursor.unacked_after(0, 15)) == [4, 7, 8, 10, 11, 15]
    assert list(cursor.unacked_after(5, 11)) == [7, 8, 10, 11]
    assert list(cursor.unacked_after(6, 8)) == [7, 8]
    assert list(cursor.unacked_after(12, 14)) == []
    assert list(cursor.unacked_after(14, 20)) == [15, 16, 17, 18, 19, 20]
    assert list(cursor.unacked_after(9, 9)) == []
    assert list(cursor.unacked_after(10, 2)) == []


def test_unacked_after_is_a_snapshot_and_checks_arguments_when_called() -> None:
    cursor = Cursor(0, [3])
    pending = cursor.unacked_after(0, 5)
    for position in range(1, 6):
        cursor.ack(position)
    assert list(pending) == [1, 2, 4, 5]
    with pytest.raises(CursorError, match="after must be"):
        cursor.unacked_after(-1, 5)
    with pytest.raises(CursorError, match="up_to must be"):
        cursor.unacked_after(0, "5")  # type: ignore[arg-type]


# -- equality, copies ------------------------------------------------------------------


def test_cursors_with_the_same_state_are_equal_whatever_their_history() -> None:
    by_acks = Cursor()
    for position in (3, 1, 2, 7, 6):
        by_acks.ack(position)
    assert by_acks == Cursor(3, [6, 7]) == Cursor(0, [1, 2, 3, 6, 7])
    assert by_acks != Cursor(3, [6])
    assert by_acks != Cursor(2, [6, 7])
    assert by_acks != "Cursor(3, [6, 7])"
    with pytest.raises(TypeError):
        hash(by_acks)


def test_copy_is_independent() -> None:
    cursor = Cursor(1, [4])
    copy = cursor.copy()
    cursor.ack(2)
    copy.ack(9)
    assert _state(cursor) == (2, [(4, 4)])
    assert _state(copy) == (1, [(4, 4), (9, 9)])


def test_repr_shows_mark_delete_and_the_first_ranges() -> None:
    assert repr(Cursor(2, [4, 5])) == "Cursor(mark_delete=2, acked_ranges=[(4, 5)])"
    many = repr(Cursor(0, range(2, 20, 2)))
    assert many.startswith("Cursor(mark_delete=0, acked_ranges=[(2, 2), (4, 4), (6, 6), (8, 8), ...")
    assert "9 ranges" in many


# -- the stored form -------------------------------------------------------------------


def test_to_bytes_round_trips_and_starts_with_the_format_version() -> None:
    for cursor in (Cursor(), Cursor(5), Cursor(0, [2]), Cursor(10**12, [10**12 + 2, 2**63 - 1])):
        data = cursor.to_bytes()
        assert data[0] == FORMAT_VERSION
        assert Cursor.from_bytes(data) == cursor
        assert Cursor.from_bytes(bytearray(data)) == cursor
        assert Cursor.from_bytes(memoryview(data)) == cursor


def test_an_in_order_cursor_is_a_few_bytes() -> None:
    assert len(Cursor(123_456_789).to_bytes()) <= 24


def test_a_million_scattered_acks_stay_small() -> None:
    rng = random.Random(1)
    acked = [p for p in range(2, 2_000_000) if rng.random() < 0.5]
    cursor = Cursor(0, acked)
    assert len(cursor.acked_ranges) > 400_000
    data = cursor.to_bytes()
    assert len(data) < 2 * len(cursor.acked_ranges)  # under 2 bytes a range; 8 bytes a position raw
    assert Cursor.from_bytes(data) == cursor


def _encoded(mark_delete: int, deltas: list[int], count: int | None = None, version: int = FORMAT_VERSION) -> bytes:
    header = struct.pack("<BQI", version, mark_delete, len(deltas) // 2 if count is None else count)
    return header + zlib.compress(struct.pack(f"<{len(deltas)}Q", *deltas))


def test_the_encoding_is_the_documented_one() -> None:
    # mark_delete 5, ranges [8, 9] and [12, 12]: gaps from the previous end, then lengths - 1
    assert Cursor.from_bytes(_encoded(5, [3, 1, 3, 0])) == Cursor(5, [8, 9, 12])


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "shorter than the 13-byte header"),
        (_encoded(0, [])[:12], "shorter than the 13-byte header"),
        (_encoded(0, [], version=2), "format version 2; expected 1"),
        (_encoded(2**63, []), "beyond 2\\*\\*63 - 1"),
        (_encoded(0, [])[:13] + b"not zlib", "do not decompress"),
        (_encoded(0, [2, 0], count=2), "16 bytes of ranges for 2 ranges"),
        (_encoded(0, [1, 0]), "touches mark_delete"),
        (_encoded(0, [2, 3, 1, 0]), "touches mark_delete or the range before"),
        (_encoded(5, [2**63, 0]), "ends beyond"),
        (_encoded(0, [2**63, 2**63, 2**63, 0]), "ends beyond"),
        (_encoded(0, [2, 2**64 - 1]), "ends beyond"),
    ],
)
def test_from_bytes_rejects_malformed_data(data: bytes, match: str) -> None:
    with pytest.raises(CursorError, match=match):
        Cursor.from_bytes(data)


def test_from_bytes_rejects_what_is_not_bytes() -> None:
    with pytest.raises(CursorError, match="must be bytes, not str"):
        Cursor.from_bytes("\x01")  # type: ignore[arg-type]


def test_cursor_errors_are_value_errors_of_the_hierarchy() -> None:
    with pytest.raises(KeyFailoverError):
        Cursor().ack(0)
    with pytest.raises(ValueError):
        Cursor().ack(0)


# -- the model property ----------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    start=st.integers(0, 5),
    initial=st.lists(st.integers(1, 80), max_size=20),
    acks=st.lists(st.integers(1, 80), max_size=120),
    window=st.tuples(st.integers(0, 85), st.integers(0, 85)),
)
def test_cursor_matches_the_set_of_acked_positions(
    start: int, initial: list[int], acks: list[int], window: tuple[int, int]
) -> None:
    cursor = Cursor(start, initial)
    model = set(range(1, start + 1)) | set(initial)
    assert_matches(cursor, model, 85)
    for position in acks:
        cursor.ack(position)
        model.add(position)
        assert cursor.mark_delete == _mark_delete_of(model)
    assert_matches(cursor, model, 85)
    batched = Cursor(start, initial)
    for first in range(0, len(acks), 7):  # the same acks in batches, as a subscription takes an ack frame
        batched.ack_many(acks[first : first + 7])
    assert batched == cursor
    after, up_to = window
    assert list(cursor.unacked_after(after, up_to)) == [p for p in range(after + 1, up_to + 1) if p not in model]
    assert Cursor.from_bytes(cursor.to_bytes()) == cursor
    assert Cursor(cursor.mark_delete, cursor.acked) == cursor == cursor.copy()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 2**62), max_size=50), st.integers(0, 2**62))
def test_the_stored_form_round_trips_for_far_apart_positions(acked: list[int], mark_delete: int) -> None:
    cursor = Cursor(mark_delete, acked)
    again = Cursor.from_bytes(cursor.to_bytes())
    assert again == cursor
    assert again.acked == cursor.acked


@settings(max_examples=300, deadline=None)
@given(
    start=st.integers(0, 5),
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("many"), st.lists(st.integers(1, 80), max_size=12)),
            st.tuples(st.just("one"), st.integers(1, 80)),
            st.tuples(st.just("read"), st.integers(0, 2)),
        ),
        max_size=40,
    ),
)
def test_noted_acks_read_the_same_as_merged_ones_whatever_comes_between(
    start: int, steps: list[tuple[str, Any]]
) -> None:
    """Batches are noted and merged later: a single ack, a copy or the stored form in between sees them all."""
    cursor = Cursor(start)
    model = set(range(1, start + 1))
    for kind, value in steps:
        if kind == "many":
            cursor.ack_many(value)
            model.update(value)
        elif kind == "one":
            cursor.ack(value)
            model.add(value)
        elif value == 0:
            assert_matches(cursor, model, 85)
        elif value == 1:
            assert_matches(cursor.copy(), model, 85)
        else:
            assert_matches(Cursor.from_bytes(cursor.to_bytes()), model, 85)
        assert cursor.last_acked == max(model, default=0)  # read without merging
    assert_matches(cursor, model, 85)


def test_batches_over_more_ranges_than_the_merge_threshold_stay_exact() -> None:
    """Tens of thousands of ranges (every other position acked), then the holes filled in shuffled batches."""
    cursor = Cursor()
    evens = list(range(2, 60_001, 2))
    for first in range(0, len(evens), 250):
        cursor.ack_many(evens[first : first + 250])
        assert cursor.last_acked == evens[min(first + 249, len(evens) - 1)]
    assert cursor.mark_delete == 0
    assert len(cursor.acked_ranges) == 30_000
    odds = list(range(1, 60_000, 2))
    random.Random(7).shuffle(odds)
    for first in range(0, len(odds) - 250, 250):
        cursor.ack_many(odds[first : first + 250])
    assert not cursor.is_acked(min(odds[-250:]))
    cursor.ack_many(odds[-250:])
    assert cursor.mark_delete == 60_000
    assert cursor.acked_ranges == []
