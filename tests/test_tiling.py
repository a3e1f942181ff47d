"""``splice``: the one routine that gives slots to a consumer in parallel sorted lists.

Hand-made cases pin each way a new range meets the old ones (cut, swallowed, merged with
a same-owner neighbour on either side or both); a property test checks every call against
the obvious model, one owner per slot.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyfailover.core._tiling import splice

Triple = tuple[int, int, str]
Lists = tuple[list[int], list[int], list[str]]


def _lists(ranges: list[Triple]) -> Lists:
    return [s for s, _, _ in ranges], [e for _, e, _ in ranges], [o for _, _, o in ranges]


def _ranges(lists: Lists) -> list[Triple]:
    return list(zip(*lists, strict=True))


def _slots(ranges: list[Triple]) -> list[str]:
    """The model: the owner of every slot."""
    return [owner for start, end, owner in ranges for _ in range(start, end + 1)]


def _runs(slots: list[str], offset: int = 0) -> list[Triple]:
    """Maximal runs of one owner: the only tiling of ``slots`` without two adjacent ranges of one owner."""
    runs: list[Triple] = []
    for slot, owner in enumerate(slots, offset):
        if runs and runs[-1][2] == owner:
            runs[-1] = (runs[-1][0], slot, owner)
        else:
            runs.append((slot, slot, owner))
    return runs


def _splice(ranges: list[Triple], start: int, end: int, owner: str) -> tuple[list[Triple], object]:
    lists = _lists(ranges)
    result = splice(*lists, (start, end, owner))
    return _ranges(lists), result


# a [0, 3], b [4, 9], c [10, 15]
THREE: list[Triple] = [(0, 3, "a"), (4, 9, "b"), (10, 15, "c")]


@pytest.mark.parametrize(
    ("start", "end", "owner", "expected", "removed", "added"),
    [
        pytest.param(
            5, 7, "n", [(0, 3, "a"), (4, 4, "b"), (5, 7, "n"), (8, 9, "b"), (10, 15, "c")],
            [(4, 9, "b")], [(4, 4, "b"), (5, 7, "n"), (8, 9, "b")], id="inside-one-range",
        ),
        pytest.param(
            4, 9, "n", [(0, 3, "a"), (4, 9, "n"), (10, 15, "c")],
            [(4, 9, "b")], [(4, 9, "n")], id="exactly-one-range",
        ),
        pytest.param(
            2, 12, "n", [(0, 1, "a"), (2, 12, "n"), (13, 15, "c")],
            [(0, 3, "a"), (4, 9, "b"), (10, 15, "c")], [(0, 1, "a"), (2, 12, "n"), (13, 15, "c")], id="across-three",
        ),
        pytest.param(
            4, 6, "a", [(0, 6, "a"), (7, 9, "b"), (10, 15, "c")],
            [(0, 3, "a"), (4, 9, "b")], [(0, 6, "a"), (7, 9, "b")], id="merges-with-the-owner-below",
        ),
        pytest.param(
            7, 9, "c", [(0, 3, "a"), (4, 6, "b"), (7, 15, "c")],
            [(4, 9, "b"), (10, 15, "c")], [(4, 6, "b"), (7, 15, "c")], id="merges-with-the-owner-above",
        ),
        pytest.param(
            2, 5, "a", [(0, 5, "a"), (6, 9, "b"), (10, 15, "c")],
            [(0, 3, "a"), (4, 9, "b")], [(0, 5, "a"), (6, 9, "b")], id="extends-its-own-range",
        ),
        pytest.param(
            0, 15, "b", [(0, 15, "b")],
            [(0, 3, "a"), (4, 9, "b"), (10, 15, "c")], [(0, 15, "b")], id="everything",
        ),
        pytest.param(
            0, 0, "z", [(0, 0, "z"), (1, 3, "a"), (4, 9, "b"), (10, 15, "c")],
            [(0, 3, "a")], [(0, 0, "z"), (1, 3, "a")], id="first-slot",
        ),
        pytest.param(
            15, 15, "z", [(0, 3, "a"), (4, 9, "b"), (10, 14, "c"), (15, 15, "z")],
            [(10, 15, "c")], [(10, 14, "c"), (15, 15, "z")], id="last-slot",
        ),
    ],
)  # fmt: skip
def test_splice_on_hand_made_cases(
    start: int, end: int, owner: str, expected: list[Triple], *, removed: list[Triple], added: list[Triple]
) -> None:
    after, result = _splice(THREE, start, end, owner)
    assert after == expected
    assert result == (removed, added)


def test_splice_merges_with_same_owner_ranges_on_both_sides() -> None:
    ranges = [(0, 3, "a"), (4, 9, "b"), (10, 15, "a")]
    after, result = _splice(ranges, 4, 9, "a")
    assert after == [(0, 15, "a")]
    assert result == (ranges, [(0, 15, "a")])
    after, _ = _splice(ranges, 5, 8, "a")
    assert after == [(0, 3, "a"), (4, 4, "b"), (5, 8, "a"), (9, 9, "b"), (10, 15, "a")]


@pytest.mark.parametrize(("start", "end"), [(0, 3), (1, 2), (3, 3), (11, 15)])
def test_splice_of_slots_the_owner_has_already_changes_nothing(start: int, end: int) -> None:
    ranges = [(0, 3, "a"), (4, 9, "b"), (10, 15, "a")]
    lists = _lists(ranges)
    assert splice(*lists, (start, end, "a")) is None
    assert _ranges(lists) == ranges


def test_splice_works_in_a_sub_space() -> None:
    """The lists need only cover the spliced slots: they may tile [100, 131]."""
    ranges = [(100, 115, "a"), (116, 131, "b")]
    after, _ = _splice(ranges, 110, 120, "c")
    assert after == [(100, 109, "a"), (110, 120, "c"), (121, 131, "b")]


# -- property: against one owner per slot ---------------------------------------------

OWNERS = ["a", "b", "c", "d"]


@st.composite
def tilings(draw: st.DrawFn) -> tuple[int, list[Triple]]:
    """An offset and a tiling of ``[offset, offset + size - 1]`` without two adjacent ranges of one owner."""
    offset = draw(st.sampled_from([0, 0, 7, 1000]))
    slots = draw(st.lists(st.sampled_from(OWNERS), min_size=1, max_size=40))
    return offset, _runs(slots, offset)


Splice = Callable[[Lists, int, int, str], object]
"""A splice taking the three lists as one tuple (so that planted variants stay short)."""


def _real(lists: Lists, start: int, end: int, owner: str) -> object:
    return splice(*lists, (start, end, owner))


def check_splice(function: Splice, ranges: list[Triple], start: int, end: int, owner: str) -> None:
    """``function`` gives ``[start, end]`` of ``ranges`` to ``owner`` exactly as the slot model says."""
    offset = ranges[0][0]
    slots = _slots(ranges)
    expected_slots = list(slots)
    expected_slots[start - offset : end - offset + 1] = [owner] * (end - start + 1)
    lists = _lists(ranges)
    result = function(lists, start, end, owner)
    after = _ranges(lists)
    if expected_slots == slots:
        assert result is None, f"nothing changed, yet {result} was returned"
        assert after == ranges
        return
    assert after == _runs(expected_slots, offset), f"{after} is not the tiling of {expected_slots}"
    assert isinstance(result, tuple), f"{result} returned although slots changed owner"
    removed, added = result
    # Exactly the ranges that left and the ones that came, each in hash order.
    assert removed == [r for r in ranges if r not in after], f"removed {removed}"
    assert added == [r for r in after if r not in ranges], f"added {added}"


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(tilings(), st.data())
def test_splice_agrees_with_a_slot_model(tiling: tuple[int, list[Triple]], data: st.DataObject) -> None:
    offset, ranges = tiling
    last = ranges[-1][1]
    start = data.draw(st.integers(offset, last), label="start")
    end = data.draw(st.integers(start, last), label="end")
    owner = data.draw(st.sampled_from([*OWNERS, "new"]), label="owner")
    check_splice(_real, ranges, start, end, owner)


def _no_merge(lists: Lists, start: int, end: int, owner: str) -> object:
    """Planted bug: cuts the new range in but never merges it with a neighbour of the same owner."""
    starts, ends, owners = lists
    removed = [r for r in zip(starts, ends, owners, strict=True) if r[0] <= end and r[1] >= start]
    pieces = [(s, min(e, start - 1), o) for s, e, o in removed if s < start]
    pieces += [(start, end, owner)] + [(max(s, end + 1), e, o) for s, e, o in removed if e > end]
    at, count = starts.index(removed[0][0]), len(removed)
    starts[at : at + count] = [piece[0] for piece in pieces]
    ends[at : at + count] = [piece[1] for piece in pieces]
    owners[at : at + count] = [piece[2] for piece in pieces]
    return removed, pieces


def _always_changes(lists: Lists, start: int, end: int, owner: str) -> object:
    """Planted bug: reports a change even when the owner had every slot already."""
    return splice(*lists, (start, end, owner)) or ([], [])


def _loses_a_removed_range(lists: Lists, start: int, end: int, owner: str) -> object:
    """Planted bug: forgets the last range it removed."""
    result = splice(*lists, (start, end, owner))
    return result if result is None else (result[0][:-1], result[1])


@pytest.mark.parametrize(
    ("planted", "ranges", "start", "end", "owner"),
    [
        (_no_merge, [(0, 3, "a"), (4, 9, "b")], 4, 5, "a"),
        (_always_changes, [(0, 3, "a"), (4, 9, "b")], 1, 2, "a"),
        (_loses_a_removed_range, [(0, 3, "a"), (4, 9, "b")], 2, 5, "c"),
    ],
)
def test_the_splice_checker_catches_a_planted_bug(
    planted: Splice, ranges: list[Triple], start: int, end: int, owner: str
) -> None:
    check_splice(_real, ranges, start, end, owner)
    with pytest.raises(AssertionError):
        check_splice(planted, ranges, start, end, owner)
