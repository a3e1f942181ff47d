"""The rebalance policy: join, leave and shift plans, moved slots and rate estimates."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyfailover.core.errors import RangeMapError
from keyfailover.core.ranges import Range, RangeMap
from keyfailover.core.rebalance import (
    SPLIT_MODES,
    Load,
    SplitMode,
    balanced_cut,
    moved_slots,
    plan_join,
    plan_leave,
    plan_shift,
    range_traffic,
    reassign_rates,
)

Traffic = npt.NDArray[np.float64]


def _map(ranges: list[Range], range_size: int = 16, epoch: int = 0) -> RangeMap:
    return RangeMap.from_ranges(ranges, range_size, epoch)


def _traffic(size: int, slots: Mapping[int, float]) -> Traffic:
    """Traffic of ``size`` slots: zero except at the given slots."""
    traffic = np.zeros(size, dtype=np.float64)
    for slot, value in slots.items():
        traffic[slot] = value
    return traffic


def _span_traffic(size: int, first: int, last: int, per_slot: float) -> Traffic:
    traffic = np.zeros(size, dtype=np.float64)
    traffic[first : last + 1] = per_slot
    return traffic


def assert_tiles(ranges: RangeMap) -> None:
    items = ranges.ranges()
    if not items:
        return
    assert items[0][0] == 0
    assert items[-1][1] == ranges.range_size - 1
    for (_, end, _), (start, _, _) in itertools.pairwise(items):
        assert start == end + 1
    assert len({consumer for _, _, consumer in items}) == len(items)


# -- balanced_cut -----------------------------------------------------------------------


@pytest.mark.parametrize(("start", "end", "expected"), [(0, 15, 8), (0, 6, 3), (4, 5, 5), (3, 9, 6), (10, 10 + 8, 14)])
def test_balanced_cut_without_traffic_is_the_midpoint(start: int, end: int, expected: int) -> None:
    assert balanced_cut(None, start, end) == expected
    assert balanced_cut(np.zeros(32), start, end) == expected


@pytest.mark.parametrize(
    ("traffic", "start", "end", "expected"),
    [
        (_span_traffic(16, 0, 3, 10.0), 0, 15, 2),  # all traffic in [0, 3]: cut at 2 leaves 20 | 20
        (_span_traffic(16, 12, 15, 1.0), 8, 15, 14),  # offset range: 2 | 2
        (np.arange(16, dtype=np.float64), 0, 15, 11),  # 0+..+10 = 55 | 65 beats 66 | 54
        (_traffic(10, {1: 5.0, 8: 5.0}), 0, 9, 5),  # every cut in [2, 8] halves it: the central one wins
        (_traffic(16, {15: 1.0, 0: 1.0}), 0, 15, 8),
    ],
)
def test_balanced_cut_halves_the_traffic(traffic: Traffic, start: int, end: int, expected: int) -> None:
    assert balanced_cut(traffic, start, end) == expected


def test_balanced_cut_of_a_width_one_range_is_rejected() -> None:
    with pytest.raises(RangeMapError, match="width 1"):
        balanced_cut(None, 5, 5)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 20), min_size=2, max_size=24),
    st.data(),
)
def test_balanced_cut_is_as_even_as_any_cut(values: list[int], data: st.DataObject) -> None:
    traffic = np.array(values, dtype=np.float64)
    start = data.draw(st.integers(0, len(values) - 2))
    end = data.draw(st.integers(start + 1, len(values) - 1))
    at = balanced_cut(traffic, start, end)
    assert start < at <= end

    def imbalance(cut: int) -> float:
        return abs(float(traffic[start:cut].sum() - traffic[cut : end + 1].sum()))

    assert imbalance(at) == min(imbalance(cut) for cut in range(start + 1, end + 1))


# -- plan_join --------------------------------------------------------------------------


def test_join_on_an_empty_map_assigns_everything() -> None:
    empty = RangeMap(16)
    planned = plan_join(empty, "a", Load())
    assert planned.ranges() == [(0, 15, "a")]
    assert planned.epoch == 1
    assert empty.ranges() == []
    assert empty.epoch == 0


def test_join_splits_the_busiest_consumer_and_the_newcomer_takes_the_upper_part() -> None:
    ranges = _map([(0, 3, "a"), (4, 11, "b"), (12, 15, "c")], epoch=5)
    planned = plan_join(ranges, "n", Load(rates={"a": 1.0, "b": 2.0, "c": 9.0}))
    assert planned.ranges() == [(0, 3, "a"), (4, 11, "b"), (12, 13, "c"), (14, 15, "n")]
    assert planned.epoch == 6


def test_join_ties_on_rate_go_to_the_widest() -> None:
    ranges = _map([(0, 3, "a"), (4, 11, "b"), (12, 15, "c")])
    planned = plan_join(ranges, "n", Load(rates={"a": 5.0, "b": 5.0, "c": 5.0}))
    assert planned.ranges() == [(0, 3, "a"), (4, 7, "b"), (8, 11, "n"), (12, 15, "c")]


def test_join_ties_on_rate_and_width_go_to_the_smallest_id() -> None:
    ranges = _map([(0, 7, "y"), (8, 15, "x")])
    planned = plan_join(ranges, "n", Load(rates={"x": 3.0, "y": 3.0}))
    assert planned.ranges() == [(0, 7, "y"), (8, 11, "x"), (12, 15, "n")]


def test_join_treats_a_missing_rate_as_zero() -> None:
    ranges = _map([(0, 11, "a"), (12, 15, "b")])
    planned = plan_join(ranges, "n", Load(rates={"b": 0.5}))
    assert planned.range_of("n") == (14, 15)


def test_join_without_rates_splits_the_widest() -> None:
    ranges = _map([(0, 3, "a"), (4, 15, "b")])
    assert plan_join(ranges, "n", Load()).ranges() == [(0, 3, "a"), (4, 9, "b"), (10, 15, "n")]


@pytest.mark.parametrize("width", [2, 3, 4, 7, 8, 15, 16])
def test_midpoint_join_cuts_at_half_the_width(width: int) -> None:
    ranges = _map([(0, 15 - width, "a"), (16 - width, 15, "b")] if width < 16 else [(0, 15, "b")])
    traffic = _traffic(16, {15: 100.0})  # ignored in midpoint mode
    planned = plan_join(ranges, "n", Load(rates={"b": 10.0}, traffic=traffic), split="midpoint")
    start = 16 - width
    assert planned.range_of("b") == (start, start + width // 2 - 1)
    assert planned.range_of("n") == (start + width // 2, 15)


def test_traffic_join_cuts_where_traffic_halves() -> None:
    ranges = _map([(0, 7, "a"), (8, 15, "b")])
    load = Load(rates={"a": 1.0, "b": 4.0}, traffic=_span_traffic(16, 12, 15, 1.0))
    planned = plan_join(ranges, "n", load)
    assert planned.ranges() == [(0, 7, "a"), (8, 13, "b"), (14, 15, "n")]
    assert range_traffic(planned, load.traffic) == {"a": 0.0, "b": 2.0, "n": 2.0}


def test_traffic_join_with_skewed_traffic_inside_the_range() -> None:
    ranges = _map([(0, 15, "a")])
    load = Load(rates={"a": 1.0}, traffic=_span_traffic(16, 0, 3, 10.0))
    assert plan_join(ranges, "n", load).ranges() == [(0, 1, "a"), (2, 15, "n")]


def test_traffic_join_with_zero_traffic_cuts_at_the_midpoint() -> None:
    ranges = _map([(0, 5, "a"), (6, 15, "b")])
    traffic = _span_traffic(16, 0, 5, 7.0)  # all of it on a, none on the busiest b
    planned = plan_join(ranges, "n", Load(rates={"b": 9.0}, traffic=traffic))
    assert planned.ranges() == [(0, 5, "a"), (6, 10, "b"), (11, 15, "n")]
    silent = plan_join(ranges, "n", Load(rates={"b": 9.0}, traffic=np.zeros(16)))
    assert silent == planned


@pytest.mark.parametrize("hot", [8, 12, 15])
def test_traffic_join_with_one_hot_slot_in_the_upper_half_cuts_at_the_midpoint(hot: int) -> None:
    # Every cut leaves the hot slot on one side, so all cuts are equally (un)balanced: the
    # documented tie-break picks the one nearest the middle of the width.
    planned = plan_join(_map([(0, 15, "a")]), "n", Load(traffic=_traffic(16, {hot: 1000.0})))
    assert planned.ranges() == [(0, 7, "a"), (8, 15, "n")]


@pytest.mark.parametrize("hot", [1, 3, 7])
def test_traffic_join_with_one_hot_slot_in_the_lower_half_cuts_at_the_midpoint(hot: int) -> None:
    planned = plan_join(_map([(0, 15, "a")]), "n", Load(traffic=_traffic(16, {hot: 1000.0})))
    assert planned.ranges() == [(0, 7, "a"), (8, 15, "n")]


def test_balanced_cut_prefers_the_central_cut_among_equally_good_ones() -> None:
    # Left sums: 1 for cuts 1-2, 3 for cuts 3-9; total 4. Both sums are 1 away from half,
    # so every cut is equally good and the midpoint 5 must win.
    assert balanced_cut(_traffic(10, {0: 1.0, 2: 2.0, 9: 1.0}), 0, 9) == 5


def test_join_never_splits_a_width_one_range() -> None:
    ranges = _map([(0, 0, "a"), (1, 1, "b"), (2, 3, "c")], range_size=4)
    planned = plan_join(ranges, "n", Load(rates={"a": 100.0, "b": 50.0, "c": 0.0}))
    assert planned.ranges() == [(0, 0, "a"), (1, 1, "b"), (2, 2, "c"), (3, 3, "n")]


def test_join_when_every_range_has_width_one_leaves_the_newcomer_out() -> None:
    ranges = _map([(0, 0, "a"), (1, 1, "b"), (2, 2, "c")], range_size=3, epoch=4)
    planned = plan_join(ranges, "n", Load(rates={"a": 100.0}))
    assert "n" not in planned
    assert planned == ranges
    assert planned.epoch == 4
    assert planned is not ranges


def test_join_rejects_a_present_consumer_and_an_unknown_split_mode() -> None:
    ranges = _map([(0, 15, "a")])
    with pytest.raises(RangeMapError, match="already owns"):
        plan_join(ranges, "a", Load())
    with pytest.raises(RangeMapError, match="split mode"):
        plan_join(ranges, "n", Load(), split="widest")  # type: ignore[arg-type]


def test_join_rejects_traffic_of_the_wrong_shape() -> None:
    with pytest.raises(RangeMapError, match=r"expected \(16,\)"):
        plan_join(_map([(0, 15, "a")]), "n", Load(traffic=np.zeros(15)))


# -- plan_leave -------------------------------------------------------------------------


def _four() -> RangeMap:
    """a [0, 3], b [4, 7], c [8, 11], d [12, 15]."""
    return _map([(0, 3, "a"), (4, 7, "b"), (8, 11, "c"), (12, 15, "d")], epoch=2)


def test_leave_merges_into_the_neighbour_with_the_lower_rate() -> None:
    rates = {"a": 1.0, "b": 5.0, "c": 2.0, "d": 0.0}
    assert plan_leave(_four(), "b", Load(rates=rates)).ranges() == [(0, 7, "a"), (8, 11, "c"), (12, 15, "d")]
    rates["a"] = 3.0
    planned = plan_leave(_four(), "b", Load(rates=rates))
    assert planned.ranges() == [(0, 3, "a"), (4, 11, "c"), (12, 15, "d")]
    assert planned.epoch == 3


@pytest.mark.parametrize(("leaver", "into"), [("a", "b"), ("d", "c")])
def test_leave_at_an_edge_merges_into_the_only_neighbour(leaver: str, into: str) -> None:
    rates = {"a": 99.0, "b": 99.0, "c": 99.0, "d": 99.0}
    planned = plan_leave(_four(), leaver, Load(rates=rates))
    assert leaver not in planned
    assert planned.width(into) == 8
    assert_tiles(planned)


def test_leave_ties_on_rate_go_to_the_narrower_then_the_smaller_id() -> None:
    ranges = _map([(0, 1, "a"), (2, 7, "b"), (8, 15, "c")])
    assert plan_leave(ranges, "b", Load()).ranges() == [(0, 7, "a"), (8, 15, "c")]
    same_width = _map([(0, 3, "z"), (4, 7, "m"), (8, 11, "y")], range_size=12)
    assert plan_leave(same_width, "m", Load()).ranges() == [(0, 3, "z"), (4, 11, "y")]


def test_leave_hands_the_range_to_the_first_standby() -> None:
    planned = plan_leave(_four(), "c", Load(rates={"b": 0.0}), standby=["s1", "s2"])
    assert planned.ranges() == [(0, 3, "a"), (4, 7, "b"), (8, 11, "s1"), (12, 15, "d")]
    assert planned.epoch == 3


def test_leave_of_the_last_consumer_empties_the_map() -> None:
    planned = plan_leave(_map([(0, 15, "a")]), "a", Load(rates={"a": 5.0}))
    assert planned.ranges() == []
    assert len(planned) == 0


def test_leave_of_the_last_consumer_with_a_standby_hands_it_everything() -> None:
    assert plan_leave(_map([(0, 15, "a")]), "a", Load(), standby=["s"]).ranges() == [(0, 15, "s")]


def test_leave_of_a_consumer_without_a_range_changes_nothing() -> None:
    ranges = _four()
    planned = plan_leave(ranges, "standby-1", Load(), standby=["s"])
    assert planned == ranges
    assert planned.epoch == ranges.epoch
    assert planned is not ranges


def test_leave_rejects_a_standby_that_already_owns_a_range() -> None:
    ranges = _four()
    with pytest.raises(RangeMapError, match="already owns"):
        plan_leave(ranges, "a", Load(), standby=["b"])
    assert ranges == _four()


# -- plan_shift -------------------------------------------------------------------------


def test_shift_moves_the_boundary_between_the_heaviest_and_its_neighbour() -> None:
    ranges = _map([(0, 7, "a"), (8, 15, "b")], epoch=1)
    traffic = _span_traffic(16, 0, 7, 10.0)
    planned = plan_shift(ranges, Load(traffic=traffic), min_traffic=0.0)
    assert planned is not None
    assert planned.ranges() == [(0, 3, "a"), (4, 15, "b")]
    assert planned.epoch == 2
    assert range_traffic(planned, traffic) == {"a": 40.0, "b": 40.0}


def test_shift_moves_toward_the_lighter_neighbour_and_leaves_the_rest() -> None:
    ranges = _map([(0, 3, "a"), (4, 11, "b"), (12, 15, "c")])
    traffic = np.concatenate([np.full(4, 5.0), np.full(8, 10.0), np.zeros(4)])
    planned = plan_shift(ranges, Load(traffic=traffic), min_traffic=0.0)
    assert planned is not None
    assert planned.ranges() == [(0, 3, "a"), (4, 7, "b"), (8, 15, "c")]
    before, after = range_traffic(ranges, traffic), range_traffic(planned, traffic)
    assert after["b"] < before["b"]
    assert max(after.values()) < max(before.values())


def test_shift_can_move_the_boundary_below_the_heaviest() -> None:
    ranges = _map([(0, 7, "a"), (8, 15, "b")])
    traffic = _span_traffic(16, 8, 15, 3.0)
    planned = plan_shift(ranges, Load(traffic=traffic), min_traffic=0.0)
    assert planned is not None
    assert planned.ranges() == [(0, 11, "a"), (12, 15, "b")]


def test_shift_returns_none_at_or_below_the_threshold() -> None:
    ranges = _map([(0, 7, "a"), (8, 15, "b")])
    # a carries 60 and b 40: max/mean = 60 / 50 = 1.2.
    traffic = np.concatenate([np.full(8, 7.5), np.full(8, 5.0)])
    assert plan_shift(ranges, Load(traffic=traffic), threshold=1.25, min_traffic=0.0) is None
    assert plan_shift(ranges, Load(traffic=traffic), threshold=1.2, min_traffic=0.0) is None
    assert plan_shift(ranges, Load(traffic=traffic), threshold=1.19, min_traffic=0.0) is not None


def test_shift_returns_none_below_min_traffic() -> None:
    ranges = _map([(0, 7, "a"), (8, 15, "b")])
    traffic = _span_traffic(16, 0, 7, 10.0)  # total 80, maximally skewed
    assert plan_shift(ranges, Load(traffic=traffic), min_traffic=80.5) is None
    assert plan_shift(ranges, Load(traffic=traffic)) is None  # default min_traffic is 1000
    assert plan_shift(ranges, Load(traffic=traffic), min_traffic=80.0) is not None


def test_shift_returns_none_without_traffic_or_a_second_consumer() -> None:
    assert plan_shift(_map([(0, 7, "a"), (8, 15, "b")]), Load(rates={"a": 1e6}), min_traffic=0.0) is None
    assert plan_shift(_map([(0, 15, "a")]), Load(traffic=np.full(16, 100.0)), min_traffic=0.0) is None
    assert plan_shift(RangeMap(16), Load(traffic=np.full(16, 100.0)), min_traffic=0.0) is None
    zero = plan_shift(_map([(0, 7, "a"), (8, 15, "b")]), Load(traffic=np.zeros(16)), min_traffic=0.0)
    assert zero is None


def test_shift_rejects_a_threshold_below_one_and_traffic_of_the_wrong_shape() -> None:
    ranges = _map([(0, 7, "a"), (8, 15, "b")])
    with pytest.raises(RangeMapError, match="below 1"):
        plan_shift(ranges, Load(traffic=np.ones(16)), threshold=0.9)
    with pytest.raises(RangeMapError, match="shape"):
        plan_shift(ranges, Load(traffic=np.ones(32)))


@pytest.mark.parametrize("hot", [0, 8, 12, 15])
def test_shift_returns_none_when_one_hot_slot_carries_the_load(hot: int) -> None:
    ranges = _map([(0, 7, "a"), (8, 15, "b")])
    assert plan_shift(ranges, Load(traffic=_traffic(16, {hot: 5000.0}))) is None


@pytest.mark.parametrize(
    ("ranges", "hot"),
    [
        ([(0, 7, "a"), (8, 15, "b")], 3),
        ([(0, 7, "a"), (8, 15, "b")], 7),
        ([(0, 11, "a"), (12, 15, "b")], 10),
    ],
)
def test_shift_never_just_moves_a_lone_hot_slot_to_the_neighbour(ranges: list[Range], hot: int) -> None:
    assert plan_shift(_map(ranges), Load(traffic=_traffic(16, {hot: 5000.0}))) is None


def test_shift_passes_the_excess_down_the_chain_in_one_plan() -> None:
    # All 40 messages in a's 4 slots: the mean is 10 and each cap 10.5 (1.05 times the mean at
    # threshold 1.1), so a keeps one slot, b and c take one each through every boundary on the
    # way, and d keeps the rest: three boundaries move at once.
    ranges = _map([(0, 3, "a"), (4, 7, "b"), (8, 11, "c"), (12, 15, "d")])
    traffic = _span_traffic(16, 0, 3, 10.0)
    planned = plan_shift(ranges, Load(traffic=traffic), min_traffic=0.0)
    assert planned is not None
    assert planned.ranges() == [(0, 0, "a"), (1, 1, "b"), (2, 2, "c"), (3, 15, "d")]
    assert range_traffic(planned, traffic) == {"a": 10.0, "b": 10.0, "c": 10.0, "d": 10.0}


def test_shift_leaves_a_hot_key_alone_on_its_consumer_and_balances_the_rest() -> None:
    # Slot 0 carries 60 of 88: more than a fair share (88 / 3), so a keeps it with nothing else
    # of weight (slot 1 carries nothing), and b and c share the other 28 (14 each, under their
    # cap of 1.05 * 14).
    ranges = _map([(0, 5, "a"), (6, 10, "b"), (11, 15, "c")])
    traffic = np.full(16, 2.0)
    traffic[0], traffic[1] = 60.0, 0.0
    planned = plan_shift(ranges, Load(traffic=traffic), min_traffic=0.0)
    assert planned is not None
    assert planned.ranges() == [(0, 1, "a"), (2, 8, "b"), (9, 15, "c")]
    assert range_traffic(planned, traffic) == {"a": 60.0, "b": 14.0, "c": 14.0}


def test_shift_with_every_load_on_its_hottest_slot_is_none_without_warnings() -> None:
    # Each loaded consumer carries one slot and d none: nothing can get lighter. The pinned
    # slots carry the whole total, which rounding may make a hair larger than the sum.
    ranges = _map([(0, 3, "a"), (4, 8, "d"), (9, 12, "b"), (13, 15, "c")])
    traffic = _traffic(16, {3: 0.1, 10: 0.2, 14: 123.456})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan_shift(ranges, Load(traffic=traffic), min_traffic=0.0) is None


# -- moved_slots and reassign_rates -----------------------------------------------------


def test_moved_slots_on_hand_made_cases() -> None:
    two = _map([(0, 7, "a"), (8, 15, "b")])
    assert moved_slots(two, two.copy()) == []
    assert moved_slots(RangeMap(16), _map([(0, 15, "a")])) == [(0, 15, None, "a")]
    assert moved_slots(_map([(0, 15, "a")]), RangeMap(16)) == [(0, 15, "a", None)]
    assert moved_slots(RangeMap(16), RangeMap(16)) == []
    assert moved_slots(two, _map([(0, 7, "a"), (8, 11, "b"), (12, 15, "n")])) == [(12, 15, "b", "n")]
    assert moved_slots(two, _map([(0, 15, "b")])) == [(0, 7, "a", "b")]
    assert moved_slots(two, _map([(0, 7, "a"), (8, 15, "s")])) == [(8, 15, "b", "s")]
    assert moved_slots(two, _map([(0, 4, "a"), (5, 15, "b")])) == [(5, 7, "a", "b")]
    assert moved_slots(two, _map([(0, 9, "b"), (10, 15, "a")])) == [(0, 7, "a", "b"), (10, 15, "b", "a")]


def test_moved_slots_rejects_maps_of_different_sizes() -> None:
    with pytest.raises(RangeMapError, match="range sizes differ"):
        moved_slots(RangeMap(16), RangeMap(32))


def _random_map(data: st.DataObject, size: int, names: list[str]) -> RangeMap:
    count = data.draw(st.integers(0, min(size, len(names))))
    if count <= 1:
        return _map([(0, size - 1, data.draw(st.sampled_from(names)))], size) if count else RangeMap(size)
    cuts = sorted(data.draw(st.sets(st.integers(1, size - 1), min_size=count - 1, max_size=count - 1)))
    owners = data.draw(st.permutations(names))[:count]
    bounds = [0, *cuts, size]
    return _map([(bounds[i], bounds[i + 1] - 1, owners[i]) for i in range(count)], size)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 24))
def test_moved_slots_agrees_with_a_slot_by_slot_comparison(data: st.DataObject, size: int) -> None:
    old = _random_map(data, size, ["a", "b", "c", "d", "e"])
    new = _random_map(data, size, ["a", "b", "c", "f", "g"])
    expected: list[tuple[int, int, str | None, str | None]] = []
    for slot in range(size):
        pair = (old.owner_of(slot), new.owner_of(slot))
        if pair[0] == pair[1]:
            continue
        if expected and expected[-1][1] == slot - 1 and expected[-1][2:] == pair:
            expected[-1] = (expected[-1][0], slot, *pair)
        else:
            expected.append((slot, slot, *pair))
    assert moved_slots(old, new) == expected


def test_reassign_rates_after_a_split_without_traffic_goes_by_width() -> None:
    old = _map([(0, 15, "a")])
    new = _map([(0, 11, "a"), (12, 15, "n")])
    assert reassign_rates(old, new, {"a": 100.0}, None) == pytest.approx({"a": 75.0, "n": 25.0})


def test_reassign_rates_after_a_split_with_traffic_goes_by_traffic() -> None:
    old = _map([(0, 15, "a")])
    new = _map([(0, 7, "a"), (8, 15, "n")])
    traffic = np.concatenate([np.full(8, 3.0), np.full(8, 1.0)])
    assert reassign_rates(old, new, {"a": 100.0}, traffic) == pytest.approx({"a": 75.0, "n": 25.0})


def test_reassign_rates_falls_back_to_width_where_the_old_range_had_no_traffic() -> None:
    old = _map([(0, 7, "a"), (8, 15, "b")])
    new = _map([(0, 7, "a"), (8, 9, "b"), (10, 15, "n")])
    traffic = _span_traffic(16, 0, 7, 1.0)
    assert reassign_rates(old, new, {"a": 10.0, "b": 40.0}, traffic) == pytest.approx({"a": 10.0, "b": 10.0, "n": 30.0})


def test_reassign_rates_after_a_merge_adds_the_leavers_rate() -> None:
    old = _map([(0, 3, "a"), (4, 7, "b"), (8, 15, "c")])
    new = _map([(0, 7, "a"), (8, 15, "c")])
    assert reassign_rates(old, new, {"a": 10.0, "b": 30.0, "c": 5.0}, None) == pytest.approx({"a": 40.0, "c": 5.0})


def test_reassign_rates_after_a_standby_takes_over() -> None:
    old = _map([(0, 7, "a"), (8, 15, "b")])
    new = _map([(0, 7, "a"), (8, 15, "s")])
    assert reassign_rates(old, new, {"a": 1.0, "b": 7.0}, np.ones(16)) == pytest.approx({"a": 1.0, "s": 7.0})


def test_reassign_rates_after_a_shift_moves_the_traffic_share() -> None:
    old = _map([(0, 7, "a"), (8, 15, "b")])
    new = _map([(0, 3, "a"), (4, 15, "b")])
    traffic = _span_traffic(16, 0, 7, 10.0)
    assert reassign_rates(old, new, {"a": 80.0, "b": 4.0}, traffic) == pytest.approx({"a": 40.0, "b": 44.0})


def test_reassign_rates_after_the_last_leaves_and_the_first_joins() -> None:
    assert reassign_rates(_map([(0, 15, "a")]), RangeMap(16), {"a": 9.0}, None) == {}
    assert reassign_rates(RangeMap(16), _map([(0, 15, "a")]), {}, None) == {"a": 0.0}


# -- inputs are not mutated -------------------------------------------------------------


def test_no_plan_mutates_its_inputs() -> None:
    ranges = _map([(0, 3, "a"), (4, 11, "b"), (12, 15, "c")], epoch=9)
    snapshot = ranges.snapshot()
    rates = {"a": 1.0, "b": 50.0, "c": 2.0}
    traffic = np.concatenate([np.full(4, 1.0), np.full(8, 100.0), np.full(4, 1.0)])
    traffic_before = traffic.copy()
    standby = ["s1", "s2"]
    load = Load(rates=rates, traffic=traffic)
    results = [
        plan_join(ranges, "n", load),
        plan_join(ranges, "n", load, split="midpoint"),
        plan_leave(ranges, "b", load),
        plan_leave(ranges, "b", load, standby=standby),
        plan_shift(ranges, load, min_traffic=0.0),
    ]
    assert all(result is not None and result != ranges for result in results)
    planned = results[0]
    assert planned is not None
    reassign_rates(ranges, planned, rates, traffic)
    moved_slots(ranges, planned)
    assert ranges.snapshot() == snapshot
    assert rates == {"a": 1.0, "b": 50.0, "c": 2.0}
    assert np.array_equal(traffic, traffic_before)
    assert standby == ["s1", "s2"]


# -- property: any sequence of joins and leaves ----------------------------------------


def _load(data: st.DataObject, members: list[str], size: int) -> Load:
    rates = {member: data.draw(st.floats(0.0, 100.0), label=f"rate {member}") for member in members}
    kind = data.draw(st.sampled_from(["none", "dense", "sparse", "zero"]), label="traffic")
    if kind == "none":
        return Load(rates=rates)
    if kind == "zero":
        return Load(rates=rates, traffic=np.zeros(size))
    if kind == "dense":
        values = data.draw(st.lists(st.integers(0, 50), min_size=size, max_size=size))
        return Load(rates=rates, traffic=np.array(values, dtype=np.float64))
    traffic = np.zeros(size)
    for slot in data.draw(st.lists(st.integers(0, size - 1), max_size=3)):
        traffic[slot] += 1000.0
    return Load(rates=rates, traffic=traffic)


def _assert_rates_conserved(old: RangeMap, new: RangeMap, rates: Mapping[str, float], traffic: Traffic | None) -> None:
    estimated = reassign_rates(old, new, rates, traffic)
    assert set(estimated) == set(new.consumers())
    assert all(rate >= 0.0 for rate in estimated.values())
    expected = sum(rates.get(c, 0.0) for c in new.consumers())
    if len(new):
        expected += sum(rates.get(c, 0.0) for c in old.consumers() if c not in new)
    assert sum(estimated.values()) == pytest.approx(expected, rel=1e-9, abs=1e-9)


@settings(max_examples=120, deadline=None)
@given(st.data(), st.one_of(st.integers(1, 6), st.integers(7, 48)))
def test_joins_and_leaves_keep_the_tiling_and_place_every_consumer(data: st.DataObject, size: int) -> None:
    ranges = RangeMap(size)
    standby: list[str] = []
    members: list[str] = []
    next_id = 0
    for _ in range(data.draw(st.integers(1, 25), label="steps")):
        load = _load(data, members, size)
        joining = not members or data.draw(st.integers(0, 2), label="join?") > 0
        if joining:
            newcomer = f"c{next_id}"
            next_id += 1
            split: SplitMode = data.draw(st.sampled_from(SPLIT_MODES), label="split")
            planned = plan_join(ranges, newcomer, load, split)
            members.append(newcomer)
            if newcomer in planned:
                moves = moved_slots(ranges, planned)
                assert len(moves) == 1
                first, last, old_owner, new_owner = moves[0]
                assert new_owner == newcomer
                if old_owner is None:
                    assert (first, last) == (0, size - 1)
                else:  # the newcomer took the upper part and the old owner kept a non-empty rest
                    start, end = ranges.range_of(old_owner) or (-1, -1)
                    assert start < first <= last == end
            else:
                assert all(ranges.width(c) == 1 for c in ranges.consumers())
                assert planned == ranges
                standby.append(newcomer)
        else:
            leaver = data.draw(st.sampled_from(members), label="leaver")
            members.remove(leaver)
            waiting = [s for s in standby if s != leaver]
            planned = plan_leave(ranges, leaver, load, standby=waiting)
            if leaver in standby:
                assert planned == ranges
                standby.remove(leaver)
            elif waiting:
                assert planned.range_of(waiting[0]) == ranges.range_of(leaver)
                standby.remove(waiting[0])
        assert_tiles(planned)
        assert set(planned.consumers()).isdisjoint(standby)
        assert set(planned.consumers()) | set(standby) == set(members)
        assert not standby or all(planned.width(c) == 1 for c in planned.consumers())
        assert planned.epoch == ranges.epoch + (0 if planned == ranges else 1)
        _assert_rates_conserved(ranges, planned, load.rates, load.traffic)
        shifted = plan_shift(planned, load, min_traffic=0.0)
        if shifted is not None:
            # A shift acts only past the threshold (1.1 by default), moves boundaries only (the
            # consumers keep their order, each one range), and lowers the heaviest load.
            before, after = range_traffic(planned, load.traffic), range_traffic(shifted, load.traffic)
            assert max(before.values()) * len(before) > 1.1 * sum(before.values())
            assert max(after.values()) < max(before.values())
            assert shifted.consumers() == planned.consumers()
            assert_tiles(shifted)
            _assert_rates_conserved(planned, shifted, load.rates, load.traffic)
        ranges = planned
