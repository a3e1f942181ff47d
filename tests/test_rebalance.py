"""The rebalance policies: ContiguousPolicy (PIP-34 literally) and MultiRangePolicy (several ranges per consumer).

Hand-made maps and traffic pin each policy's documented behaviour; property tests run
random joins, leaves and shifts through both and check what every plan must keep: the
tiling, membership, ``max_ranges``, the epoch, that ``moved_slots`` lists every moved
slot, and that ``reassign_rates`` neither creates nor loses rate.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from keyfailover.core.errors import RangeMapError
from keyfailover.core.ranges import Range, RangeMap
from keyfailover.core.rebalance import (
    POLICIES,
    SPLIT_MODES,
    ContiguousPolicy,
    Load,
    MultiRangePolicy,
    Policy,
    SplitMode,
    balanced_cut,
    moved_slots,
    range_traffic,
    reassign_rates,
)

Traffic = npt.NDArray[np.float64]
Moves = list[tuple[int, int, str | None, str | None]]


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


def _balanced(traffic: Traffic, count: int) -> RangeMap:
    """``count`` consumers ``c0``.. with one range each, cut where the traffic splits evenly."""
    cumulative = np.cumsum(traffic)
    cuts = [int(np.searchsorted(cumulative, cumulative[-1] * k / count)) + 1 for k in range(1, count)]
    bounds = [0, *cuts, len(traffic)]
    assert len(set(bounds)) == len(bounds), "too few slots for that many consumers"
    return _map([(bounds[i], bounds[i + 1] - 1, f"c{i}") for i in range(count)], len(traffic))


def _moved_traffic(old: RangeMap, new: RangeMap, traffic: Traffic) -> float:
    return sum(float(traffic[first : last + 1].sum()) for first, last, _, _ in moved_slots(old, new))


def _slot_moves(old: RangeMap, new: RangeMap) -> Moves:
    """What ``moved_slots`` must say, found slot by slot."""
    expected: Moves = []
    for slot in range(old.range_size):
        pair = (old.owner_of(slot), new.owner_of(slot))
        if pair[0] == pair[1]:
            continue
        if expected and expected[-1][1] == slot - 1 and expected[-1][2:] == pair:
            expected[-1] = (expected[-1][0], slot, *pair)
        else:
            expected.append((slot, slot, *pair))
    return expected


def assert_tiles(ranges: RangeMap) -> None:
    items = ranges.ranges()
    if not items:
        return
    assert items[0][0] == 0
    assert items[-1][1] == ranges.range_size - 1
    for (_, end, owner), (start, _, other) in itertools.pairwise(items):
        assert start == end + 1, f"gap or overlap at {end} / {start}"
        assert owner != other, f"two adjacent ranges of {owner!r}"


def check_plan(policy: Policy, old: RangeMap, new: RangeMap, members: Sequence[str], standby: Sequence[str]) -> None:
    """What every plan of ``policy`` keeps; ``members`` and ``standby`` are as they are after the change."""
    assert_tiles(new)
    assert new.range_size == old.range_size
    owners = set(new.consumers())
    assert owners.isdisjoint(standby), f"a standby owns a range: {sorted(owners & set(standby))}"
    assert owners | set(standby) == set(members), (
        f"members {sorted(members)} vs owners {sorted(owners)} and standby {sorted(standby)}"
    )
    counts = {consumer: len(found) for consumer, found in new.ranges_by_consumer().items()}
    if isinstance(policy, MultiRangePolicy):
        over = {c: n for c, n in counts.items() if n > policy.max_ranges}
        assert not over, f"more than max_ranges={policy.max_ranges} ranges: {over}"
    else:
        assert all(n == 1 for n in counts.values()), f"the contiguous policy gave several ranges: {counts}"
    assert new.epoch == old.epoch + (0 if new == old else 1), f"epoch {old.epoch} -> {new.epoch}"
    assert moved_slots(old, new) == _slot_moves(old, new)


Estimator = Callable[[RangeMap, RangeMap, Mapping[str, float], Traffic | None], dict[str, float]]


def _assert_rates_conserved(
    old: RangeMap,
    new: RangeMap,
    rates: Mapping[str, float],
    traffic: Traffic | None,
    estimate: Estimator = reassign_rates,
) -> None:
    """The rate estimate after a change neither creates nor loses rate: a leaver's goes to its heirs."""
    estimated = estimate(old, new, rates, traffic)
    assert set(estimated) == set(new.consumers())
    assert all(rate >= 0.0 for rate in estimated.values())
    expected = sum(rates.get(c, 0.0) for c in new.consumers())
    if len(new):
        expected += sum(rates.get(c, 0.0) for c in old.consumers() if c not in new)
    assert sum(estimated.values()) == pytest.approx(expected, rel=1e-9, abs=1e-9)


# The plan checker is trusted only because it catches each kind of broken plan.
PLANTED_PLANS = [
    pytest.param(
        MultiRangePolicy(max_ranges=2),
        _map([(0, 1, "a"), (2, 3, "b"), (4, 5, "a"), (6, 7, "b"), (8, 15, "a")], epoch=1),
        ["a", "b"],
        "max_ranges",
        id="over-max-ranges",
    ),
    pytest.param(ContiguousPolicy(), _map([(0, 3, "a"), (4, 7, "b"), (8, 15, "a")], epoch=1), ["a", "b"], "several",
                 id="contiguous-with-two-ranges"),
    pytest.param(MultiRangePolicy(), _map([(0, 15, "a")], epoch=1), ["a", "b"], "members", id="member-lost"),
    pytest.param(MultiRangePolicy(), _map([(0, 7, "b"), (8, 15, "a")], epoch=0), ["a", "b"], "epoch",
                 id="epoch-not-bumped"),
    pytest.param(MultiRangePolicy(), _map([(0, 7, "a"), (8, 15, "b")], epoch=2), ["a", "b"], "epoch",
                 id="epoch-bumped-twice"),
]  # fmt: skip


@pytest.mark.parametrize(("policy", "planted", "members", "message"), PLANTED_PLANS)
def test_the_plan_checker_catches_a_planted_violation(
    policy: Policy, planted: RangeMap, members: list[str], message: str
) -> None:
    old = _map([(0, 7, "a"), (8, 15, "b")])
    check_plan(policy, old, old.copy(), ["a", "b"], [])
    with pytest.raises(AssertionError, match=message):
        check_plan(policy, old, planted, members, [])


def _keeps_the_donors_rate(
    old: RangeMap, new: RangeMap, rates: Mapping[str, float], traffic: Traffic | None
) -> dict[str, float]:
    """Planted bug: a receiver gains what it took, but the donor keeps its whole rate."""
    estimated = reassign_rates(old, new, rates, traffic)
    return {c: max(rate, float(rates.get(c, 0.0))) for c, rate in estimated.items()}


def test_the_rate_checker_catches_rate_that_appears_from_nowhere() -> None:
    old, new = _map([(0, 15, "a")]), _map([(0, 7, "a"), (8, 15, "n")])
    _assert_rates_conserved(old, new, {"a": 10.0}, None)
    with pytest.raises(AssertionError):
        _assert_rates_conserved(old, new, {"a": 10.0}, None, _keeps_the_donors_rate)


def test_policies_are_found_by_name_the_default_first() -> None:
    assert list(POLICIES) == ["multi", "contiguous"]
    assert POLICIES["multi"] is MultiRangePolicy
    assert POLICIES["contiguous"] is ContiguousPolicy
    assert MultiRangePolicy().name == "multi"
    assert ContiguousPolicy().name == "contiguous"


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


def test_balanced_cut_prefers_the_central_cut_among_equally_good_ones() -> None:
    # Left sums: 1 for cuts 1-2, 3 for cuts 3-9; total 4. Both sums are 1 away from half,
    # so every cut is equally good and the midpoint 5 must win.
    assert balanced_cut(_traffic(10, {0: 1.0, 2: 2.0, 9: 1.0}), 0, 9) == 5


def test_balanced_cut_of_a_width_one_range_is_rejected() -> None:
    with pytest.raises(RangeMapError, match=r"cannot cut \[5, 5\]: a range of width 1 has no cut"):
        balanced_cut(None, 5, 5)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=2, max_size=24), st.data())
def test_balanced_cut_is_as_even_as_any_cut(values: list[int], data: st.DataObject) -> None:
    traffic = np.array(values, dtype=np.float64)
    start = data.draw(st.integers(0, len(values) - 2))
    end = data.draw(st.integers(start + 1, len(values) - 1))
    at = balanced_cut(traffic, start, end)
    assert start < at <= end

    def imbalance(cut: int) -> float:
        return abs(float(traffic[start:cut].sum() - traffic[cut : end + 1].sum()))

    assert imbalance(at) == min(imbalance(cut) for cut in range(start + 1, end + 1))


# -- ContiguousPolicy: join ---------------------------------------------------------------

CONTIGUOUS = ContiguousPolicy()
MIDPOINT = ContiguousPolicy(split="midpoint")


def test_contiguous_join_on_an_empty_map_assigns_everything() -> None:
    empty = RangeMap(16)
    planned = CONTIGUOUS.join(empty, "a", Load())
    assert planned.ranges() == [(0, 15, "a")]
    assert planned.epoch == 1
    assert empty.ranges() == []
    assert empty.epoch == 0


def test_contiguous_join_splits_the_busiest_consumer_and_the_newcomer_takes_the_upper_part() -> None:
    ranges = _map([(0, 3, "a"), (4, 11, "b"), (12, 15, "c")], epoch=5)
    planned = CONTIGUOUS.join(ranges, "n", Load(rates={"a": 1.0, "b": 2.0, "c": 9.0}))
    assert planned.ranges() == [(0, 3, "a"), (4, 11, "b"), (12, 13, "c"), (14, 15, "n")]
    assert planned.epoch == 6


def test_contiguous_join_ties_on_rate_go_to_the_widest() -> None:
    ranges = _map([(0, 3, "a"), (4, 11, "b"), (12, 15, "c")])
    planned = CONTIGUOUS.join(ranges, "n", Load(rates={"a": 5.0, "b": 5.0, "c": 5.0}))
    assert planned.ranges() == [(0, 3, "a"), (4, 7, "b"), (8, 11, "n"), (12, 15, "c")]


def test_contiguous_join_ties_on_rate_and_width_go_to_the_smallest_id() -> None:
    ranges = _map([(0, 7, "y"), (8, 15, "x")])
    planned = CONTIGUOUS.join(ranges, "n", Load(rates={"x": 3.0, "y": 3.0}))
    assert planned.ranges() == [(0, 7, "y"), (8, 11, "x"), (12, 15, "n")]


def test_contiguous_join_treats_a_missing_rate_as_zero() -> None:
    ranges = _map([(0, 11, "a"), (12, 15, "b")])
    planned = CONTIGUOUS.join(ranges, "n", Load(rates={"b": 0.5}))
    assert planned.ranges_of("n") == [(14, 15)]


def test_contiguous_join_without_rates_splits_the_widest() -> None:
    ranges = _map([(0, 3, "a"), (4, 15, "b")])
    assert CONTIGUOUS.join(ranges, "n", Load()).ranges() == [(0, 3, "a"), (4, 9, "b"), (10, 15, "n")]


@pytest.mark.parametrize("width", [2, 3, 4, 7, 8, 15, 16])
def test_contiguous_midpoint_join_cuts_at_half_the_width(width: int) -> None:
    ranges = _map([(0, 15 - width, "a"), (16 - width, 15, "b")] if width < 16 else [(0, 15, "b")])
    traffic = _traffic(16, {15: 100.0})  # ignored in midpoint mode
    planned = MIDPOINT.join(ranges, "n", Load(rates={"b": 10.0}, traffic=traffic))
    start = 16 - width
    assert planned.ranges_of("b") == [(start, start + width // 2 - 1)]
    assert planned.ranges_of("n") == [(start + width // 2, 15)]


def test_contiguous_traffic_join_cuts_where_traffic_halves() -> None:
    ranges = _map([(0, 7, "a"), (8, 15, "b")])
    load = Load(rates={"a": 1.0, "b": 4.0}, traffic=_span_traffic(16, 12, 15, 1.0))
    planned = CONTIGUOUS.join(ranges, "n", load)
    assert planned.ranges() == [(0, 7, "a"), (8, 13, "b"), (14, 15, "n")]
    assert range_traffic(planned, load.traffic) == {"a": 0.0, "b": 2.0, "n": 2.0}


def test_contiguous_traffic_join_with_skewed_traffic_inside_the_range() -> None:
    ranges = _map([(0, 15, "a")])
    load = Load(rates={"a": 1.0}, traffic=_span_traffic(16, 0, 3, 10.0))
    assert CONTIGUOUS.join(ranges, "n", load).ranges() == [(0, 1, "a"), (2, 15, "n")]


def test_contiguous_traffic_join_with_zero_traffic_cuts_at_the_midpoint() -> None:
    ranges = _map([(0, 5, "a"), (6, 15, "b")])
    traffic = _span_traffic(16, 0, 5, 7.0)  # all of it on a, none on the busiest b
    planned = CONTIGUOUS.join(ranges, "n", Load(rates={"b": 9.0}, traffic=traffic))
    assert planned.ranges() == [(0, 5, "a"), (6, 10, "b"), (11, 15, "n")]
    silent = CONTIGUOUS.join(ranges, "n", Load(rates={"b": 9.0}, traffic=np.zeros(16)))
    assert silent == planned


@pytest.mark.parametrize("hot", [1, 3, 7, 8, 12, 15])
def test_contiguous_traffic_join_with_one_hot_slot_cuts_at_the_midpoint(hot: int) -> None:
    # Every cut leaves the hot slot on one side, so all cuts are equally (un)balanced: the
    # documented tie-break picks the one nearest the middle of the width.
    planned = CONTIGUOUS.join(_map([(0, 15, "a")]), "n", Load(traffic=_traffic(16, {hot: 1000.0})))
    assert planned.ranges() == [(0, 7, "a"), (8, 15, "n")]


def test_contiguous_join_never_splits_a_width_one_range() -> None:
    ranges = _map([(0, 0, "a"), (1, 1, "b"), (2, 3, "c")], range_size=4)
    planned = CONTIGUOUS.join(ranges, "n", Load(rates={"a": 100.0, "b": 50.0, "c": 0.0}))
    assert planned.ranges() == [(0, 0, "a"), (1, 1, "b"), (2, 2, "c"), (3, 3, "n")]


def test_contiguous_join_when_every_range_has_width_one_leaves_the_newcomer_out() -> None:
    ranges = _map([(0, 0, "a"), (1, 1, "b"), (2, 2, "c")], range_size=3, epoch=4)
    planned = CONTIGUOUS.join(ranges, "n", Load(rates={"a": 100.0}))
    assert "n" not in planned
    assert planned == ranges
    assert planned.epoch == 4
    assert planned is not ranges


# -- ContiguousPolicy: leave --------------------------------------------------------------


def _four() -> RangeMap:
    """a [0, 3], b [4, 7], c [8, 11], d [12, 15]."""
    return _map([(0, 3, "a"), (4, 7, "b"), (8, 11, "c"), (12, 15, "d")], epoch=2)


def test_contiguous_leave_merges_into_the_neighbour_with_the_lower_rate() -> None:
    rates = {"a": 1.0, "b": 5.0, "c": 2.0, "d": 0.0}
    assert CONTIGUOUS.leave(_four(), "b", Load(rates=rates)).ranges() == [(0, 7, "a"), (8, 11, "c"), (12, 15, "d")]
    rates["a"] = 3.0
    planned = CONTIGUOUS.leave(_four(), "b", Load(rates=rates))
    assert planned.ranges() == [(0, 3, "a"), (4, 11, "c"), (12, 15, "d")]
    assert planned.epoch == 3


@pytest.mark.parametrize(("leaver", "into"), [("a", "b"), ("d", "c")])
def test_contiguous_leave_at_an_edge_merges_into_the_only_neighbour(leaver: str, into: str) -> None:
    rates = {"a": 99.0, "b": 99.0, "c": 99.0, "d": 99.0}
    planned = CONTIGUOUS.leave(_four(), leaver, Load(rates=rates))
    assert leaver not in planned
    assert planned.width(into) == 8
    assert_tiles(planned)


def test_contiguous_leave_ties_on_rate_go_to_the_narrower_then_the_smaller_id() -> None:
    ranges = _map([(0, 1, "a"), (2, 7, "b"), (8, 15, "c")])
    assert CONTIGUOUS.leave(ranges, "b", Load()).ranges() == [(0, 7, "a"), (8, 15, "c")]
    same_width = _map([(0, 3, "z"), (4, 7, "m"), (8, 11, "y")], range_size=12)
    assert CONTIGUOUS.leave(same_width, "m", Load()).ranges() == [(0, 3, "z"), (4, 11, "y")]


@pytest.mark.parametrize("policy", [CONTIGUOUS, MultiRangePolicy()], ids=["contiguous", "multi"])
def test_leave_hands_every_range_to_the_first_standby(policy: Policy) -> None:
    planned = policy.leave(_four(), "c", Load(rates={"b": 0.0}), standby=["s1", "s2"])
    assert planned.ranges() == [(0, 3, "a"), (4, 7, "b"), (8, 11, "s1"), (12, 15, "d")]
    assert planned.epoch == 3


def test_multi_leave_hands_all_of_several_ranges_to_the_first_standby() -> None:
    ranges = _map([(0, 1, "a"), (2, 4, "b"), (5, 7, "a"), (8, 11, "c"), (12, 15, "a")], epoch=1)
    planned = MultiRangePolicy().leave(ranges, "a", Load(traffic=np.ones(16)), standby=["s"])
    assert planned.ranges() == [(0, 1, "s"), (2, 4, "b"), (5, 7, "s"), (8, 11, "c"), (12, 15, "s")]
    assert planned.epoch == 2


@pytest.mark.parametrize("policy", [CONTIGUOUS, MultiRangePolicy()], ids=["contiguous", "multi"])
def test_leave_of_the_last_consumer_empties_the_map_or_hands_it_to_a_standby(policy: Policy) -> None:
    planned = policy.leave(_map([(0, 15, "a")], epoch=3), "a", Load(rates={"a": 5.0}))
    assert (planned.ranges(), len(planned), planned.epoch) == ([], 0, 4)
    assert policy.leave(_map([(0, 15, "a")]), "a", Load(), standby=["s"]).ranges() == [(0, 15, "s")]


@pytest.mark.parametrize("policy", [CONTIGUOUS, MultiRangePolicy()], ids=["contiguous", "multi"])
def test_leave_of_a_consumer_without_a_range_changes_nothing(policy: Policy) -> None:
    ranges = _four()
    planned = policy.leave(ranges, "standby-1", Load(), standby=["s"])
    assert planned == ranges
    assert planned.epoch == ranges.epoch
    assert planned is not ranges


@pytest.mark.parametrize("policy", [CONTIGUOUS, MultiRangePolicy()], ids=["contiguous", "multi"])
def test_leave_rejects_a_standby_that_already_owns_a_range(policy: Policy) -> None:
    ranges = _four()
    with pytest.raises(RangeMapError, match="standby 'b' already owns a range; expected a consumer without one"):
        policy.leave(ranges, "a", Load(), standby=["b"])
    assert ranges == _four()


# -- ContiguousPolicy: shift --------------------------------------------------------------


def _shifting(threshold: float = 1.1, min_traffic: float = 0.0) -> ContiguousPolicy:
    return ContiguousPolicy(threshold=threshold, min_traffic=min_traffic)


def test_contiguous_shift_moves_the_boundary_between_the_heaviest_and_its_neighbour() -> None:
    ranges = _map([(0, 7, "a"), (8, 15, "b")], epoch=1)
    traffic = _span_traffic(16, 0, 7, 10.0)
    planned = _shifting().shift(ranges, Load(traffic=traffic))
    assert planned is not None
    assert planned.ranges() == [(0, 3, "a"), (4, 15, "b")]
    assert planned.epoch == 2
    assert range_traffic(planned, traffic) == {"a": 40.0, "b": 40.0}


def test_contiguous_shift_moves_toward_the_lighter_neighbour_and_leaves_the_rest() -> None:
    ranges = _map([(0, 3, "a"), (4, 11, "b"), (12, 15, "c")])
    traffic = np.concatenate([np.full(4, 5.0), np.full(8, 10.0), np.zeros(4)])
    planned = _shifting().shift(ranges, Load(traffic=traffic))
    assert planned is not None
    assert planned.ranges() == [(0, 3, "a"), (4, 7, "b"), (8, 15, "c")]
    before, after = range_traffic(ranges, traffic), range_traffic(planned, traffic)
    assert after["b"] < before["b"]
    assert max(after.values()) < max(before.values())


def test_contiguous_shift_can_move_the_boundary_below_the_heaviest() -> None:
    ranges = _map([(0, 7, "a"), (8, 15, "b")])
    planned = _shifting().shift(ranges, Load(traffic=_span_traffic(16, 8, 15, 3.0)))
    assert planned is not None
    assert planned.ranges() == [(0, 11, "a"), (12, 15, "b")]


def test_contiguous_shift_returns_none_at_or_below_the_threshold() -> None:
    ranges = _map([(0, 7, "a"), (8, 15, "b")])
    # a carries 60 and b 40: max/mean = 60 / 50 = 1.2.
    load = Load(traffic=np.concatenate([np.full(8, 7.5), np.full(8, 5.0)]))
    assert _shifting(threshold=1.25).shift(ranges, load) is None
    assert _shifting(threshold=1.2).shift(ranges, load) is None
    assert _shifting(threshold=1.19).shift(ranges, load) is not None


def test_contiguous_shift_returns_none_below_min_traffic() -> None:
    ranges = _map([(0, 7, "a"), (8, 15, "b")])
    load = Load(traffic=_span_traffic(16, 0, 7, 10.0))  # total 80, maximally skewed
    assert _shifting(min_traffic=80.5).shift(ranges, load) is None
    assert ContiguousPolicy().shift(ranges, load) is None  # default min_traffic is 1000
    assert _shifting(min_traffic=80.0).shift(ranges, load) is not None


def test_contiguous_shift_returns_none_without_traffic_or_a_second_consumer() -> None:
    policy = _shifting()
    assert policy.shift(_map([(0, 7, "a"), (8, 15, "b")]), Load(rates={"a": 1e6})) is None
    assert policy.shift(_map([(0, 15, "a")]), Load(traffic=np.full(16, 100.0))) is None
    assert policy.shift(RangeMap(16), Load(traffic=np.full(16, 100.0))) is None
    assert policy.shift(_map([(0, 7, "a"), (8, 15, "b")]), Load(traffic=np.zeros(16))) is None


@pytest.mark.parametrize("hot", [0, 8, 12, 15])
def test_contiguous_shift_returns_none_when_one_hot_slot_carries_the_load(hot: int) -> None:
    ranges = _map([(0, 7, "a"), (8, 15, "b")])
    assert ContiguousPolicy().shift(ranges, Load(traffic=_traffic(16, {hot: 5000.0}))) is None


@pytest.mark.parametrize(
    ("ranges", "hot"),
    [
        ([(0, 7, "a"), (8, 15, "b")], 3),
        ([(0, 7, "a"), (8, 15, "b")], 7),
        ([(0, 11, "a"), (12, 15, "b")], 10),
    ],
)
def test_contiguous_shift_never_just_moves_a_lone_hot_slot_to_the_neighbour(ranges: list[Range], hot: int) -> None:
    assert ContiguousPolicy().shift(_map(ranges), Load(traffic=_traffic(16, {hot: 5000.0}))) is None


def test_contiguous_shift_passes_the_excess_down_the_chain_in_one_plan() -> None:
    # All 40 messages in a's 4 slots: the mean is 10 and each cap 10.5 (1.05 times the mean at
    # threshold 1.1), so a keeps one slot, b and c take one each through every boundary on the
    # way, and d keeps the rest: three boundaries move at once.
    ranges = _map([(0, 3, "a"), (4, 7, "b"), (8, 11, "c"), (12, 15, "d")])
    traffic = _span_traffic(16, 0, 3, 10.0)
    planned = _shifting().shift(ranges, Load(traffic=traffic))
    assert planned is not None
    assert planned.ranges() == [(0, 0, "a"), (1, 1, "b"), (2, 2, "c"), (3, 15, "d")]
    assert range_traffic(planned, traffic) == {"a": 10.0, "b": 10.0, "c": 10.0, "d": 10.0}


def test_contiguous_shift_leaves_a_hot_key_alone_on_its_consumer_and_balances_the_rest() -> None:
    # Slot 0 carries 60 of 88: more than a fair share (88 / 3), so a keeps it with nothing else
    # of weight (slot 1 carries nothing), and b and c share the other 28 (14 each, under their
    # cap of 1.05 * 14).
    ranges = _map([(0, 5, "a"), (6, 10, "b"), (11, 15, "c")])
    traffic = np.full(16, 2.0)
    traffic[0], traffic[1] = 60.0, 0.0
    planned = _shifting().shift(ranges, Load(traffic=traffic))
    assert planned is not None
    assert planned.ranges() == [(0, 1, "a"), (2, 8, "b"), (9, 15, "c")]
    assert range_traffic(planned, traffic) == {"a": 60.0, "b": 14.0, "c": 14.0}


def test_contiguous_shift_with_every_load_on_its_hottest_slot_is_none_without_warnings() -> None:
    # Each loaded consumer carries one slot and d none: nothing can get lighter. The pinned
    # slots carry the whole total, which rounding may make a hair larger than the sum.
    ranges = _map([(0, 3, "a"), (4, 8, "d"), (9, 12, "b"), (13, 15, "c")])
    traffic = _traffic(16, {3: 0.1, 10: 0.2, 14: 123.456})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _shifting().shift(ranges, Load(traffic=traffic)) is None


# -- ContiguousPolicy: arguments ----------------------------------------------------------


@pytest.mark.parametrize("split", ["widest", "", None, 3])
def test_contiguous_policy_rejects_an_unknown_split_mode(split: object) -> None:
    with pytest.raises(RangeMapError, match=rf"split mode {split!r} is unknown; expected one of \('traffic', "):
        ContiguousPolicy(split=split)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", [ContiguousPolicy, MultiRangePolicy])
@pytest.mark.parametrize("threshold", [0.9, 0.0, -1.0, float("nan"), float("inf"), True, "1.2", None])
def test_policies_reject_a_bad_threshold(policy: type[Policy], threshold: object) -> None:
    with pytest.raises(RangeMapError, match=r"shift threshold .* is not a finite number >= 1; expected max/mean >= 1"):
        policy(threshold=threshold)  # type: ignore[call-arg]


@pytest.mark.parametrize("min_traffic", [-1.0, float("nan"), float("inf"), "100", None, True])
def test_contiguous_policy_rejects_a_bad_min_traffic(min_traffic: object) -> None:
    """Regression: min_traffic was never checked; a str failed only at the first shift, a negative one never."""
    with pytest.raises(RangeMapError, match=r"min_traffic .* is not a finite number >= 0"):
        ContiguousPolicy(min_traffic=min_traffic)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", [CONTIGUOUS, MultiRangePolicy()], ids=["contiguous", "multi"])
def test_join_rejects_a_present_consumer_and_traffic_of_the_wrong_shape(policy: Policy) -> None:
    ranges = _map([(0, 15, "a")])
    with pytest.raises(RangeMapError, match="'a' already owns a range; expected a consumer without one"):
        policy.join(ranges, "a", Load())
    with pytest.raises(RangeMapError, match=r"traffic has shape \(15,\); expected \(16,\), one entry per slot"):
        policy.join(ranges, "n", Load(traffic=np.zeros(15)))


@pytest.mark.parametrize("policy", [_shifting(), MultiRangePolicy(min_traffic=0.0)], ids=["contiguous", "multi"])
def test_shift_rejects_traffic_of_the_wrong_shape(policy: Policy) -> None:
    with pytest.raises(RangeMapError, match="shape"):
        policy.shift(_map([(0, 7, "a"), (8, 11, "b"), (12, 15, "c")]), Load(traffic=np.ones(32)))


def test_multi_leave_rejects_traffic_of_the_wrong_shape() -> None:
    """(The contiguous leave reads only the rates.)"""
    with pytest.raises(RangeMapError, match="shape"):
        MULTI.leave(_map([(0, 7, "a"), (8, 11, "b"), (12, 15, "c")]), "b", Load(traffic=np.ones(32)))


def test_contiguous_policy_refuses_a_map_with_several_ranges_per_consumer() -> None:
    ranges = _map([(0, 3, "a"), (4, 7, "b"), (8, 15, "a")])
    message = "the contiguous policy needs one range per consumer; this map has 3 ranges for 2 consumers"
    with pytest.raises(RangeMapError, match=message):
        CONTIGUOUS.join(ranges, "n", Load())
    with pytest.raises(RangeMapError, match=message):
        CONTIGUOUS.leave(ranges, "b", Load())
    with pytest.raises(RangeMapError, match=message):
        _shifting().shift(ranges, Load(traffic=np.ones(16)))


# -- MultiRangePolicy: join ---------------------------------------------------------------

MULTI = MultiRangePolicy()


@pytest.mark.parametrize("traffic", [None, _traffic(16, {3: 50.0})], ids=["widths", "traffic"])
def test_multi_join_on_an_empty_map_takes_everything(traffic: Traffic | None) -> None:
    empty = RangeMap(16, 3)
    planned = MULTI.join(empty, "a", Load(traffic=traffic))
    assert planned.ranges() == [(0, 15, "a")]
    assert planned.epoch == 4
    assert empty.ranges() == []


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("traffic", ["uniform", "widths", "noisy"])
def test_multi_join_into_a_balanced_map_moves_a_fair_share_and_little_more(count: int, traffic: str) -> None:
    size = 256
    weights = {
        "uniform": np.full(size, 10.0),
        "widths": np.ones(size),
        "noisy": np.random.default_rng(count).integers(1, 20, size).astype(np.float64),
    }[traffic]
    ranges = _balanced(weights, count)
    planned = MULTI.join(ranges, "n", Load(traffic=None if traffic == "widths" else weights))
    check_plan(MULTI, ranges, planned, [*ranges.consumers(), "n"], [])
    total = float(weights.sum())
    fair = total / (count + 1)
    slot = float(weights.max())  # a slot is never split: the plan is as good as whole slots allow
    moved = _moved_traffic(ranges, planned, weights)
    assert moved <= fair * (1 + MULTI.tolerance) + slot, f"moved {moved / total:.3f} of the traffic"
    loads = range_traffic(planned, weights)
    assert loads["n"] >= fair * (1 - MULTI.tolerance) - slot
    assert max(loads.values()) <= fair * (1 + MULTI.tolerance) + slot, loads
    assert all(new == "n" for _, _, _, new in moved_slots(ranges, planned)), "only the newcomer takes"


def test_multi_join_takes_from_the_consumers_above_the_new_fair_share_only() -> None:
    # a carries 1280, the others 640 each: the new fair share is 640, so a alone gives, the
    # low end of the newcomer's band: 640 * (1 - tolerance) = 608.
    ranges = _map([(0, 63, "a"), (64, 127, "b"), (128, 191, "c"), (192, 255, "d")], 256)
    traffic = np.full(256, 10.0)
    traffic[:64] = 20.0
    planned = MULTI.join(ranges, "n", Load(traffic=traffic))
    assert {(old, new) for _, _, old, new in moved_slots(ranges, planned)} == {("a", "n")}
    band = 640.0 * (1 - MULTI.tolerance)
    assert _moved_traffic(ranges, planned, traffic) == pytest.approx(band, abs=20.0)  # within one of a's slots
    loads = range_traffic(planned, traffic)
    assert loads["n"] == pytest.approx(band, abs=20.0)
    assert (loads["b"], loads["c"], loads["d"]) == (640.0, 640.0, 640.0)
    assert len(planned.ranges_of("n")) == 1


def test_multi_join_cuts_at_range_edges_and_continues_a_piece_across_a_boundary() -> None:
    # Four equal consumers and a newcomer: it takes about 12 slots of each (the low end of its
    # band) at a boundary between two donors, each piece continued into the next donor's
    # range: two ranges, not four.
    ranges = _map([(0, 63, "a"), (64, 127, "b"), (128, 191, "c"), (192, 255, "d")], 256)
    planned = MULTI.join(ranges, "n", Load(traffic=np.full(256, 10.0)))
    taken = planned.ranges_of("n")
    assert len(taken) == 2, taken
    assert all(start <= boundary < end for (start, end), boundary in zip(taken, (63, 191), strict=True)), taken
    assert all(len(planned.ranges_of(c)) == 1 for c in "abcd"), "every donor gave at an edge"
    widths = {c: planned.width(c) for c in "abcd"}
    assert max(widths.values()) - min(widths.values()) <= 1, widths
    assert planned.width("n") == pytest.approx(256 / 5 * (1 - MULTI.tolerance), abs=1.0)


def test_multi_join_leaves_a_hot_slot_whole_on_its_owner_with_little_else() -> None:
    # Slot 100 carries 1000 of 1255: more than any fair share. b keeps it and nothing else;
    # the newcomer takes b's cold slots.
    ranges = _map([(0, 63, "a"), (64, 127, "b"), (128, 191, "c"), (192, 255, "d")], 256)
    traffic = np.ones(256)
    traffic[100] = 1000.0
    planned = MULTI.join(ranges, "n", Load(traffic=traffic))
    check_plan(MULTI, ranges, planned, ["a", "b", "c", "d", "n"], [])
    assert planned.owner_of(100) == "b"
    loads = range_traffic(planned, traffic)
    assert loads["b"] <= 1000.0 * (1 + MULTI.tolerance), "the hot slot's owner carries little else"
    others = [loads[c] for c in "acd"]
    assert max(others) - min(others) <= 2.0, loads
    assert loads["n"] == pytest.approx(sum(others) / 3 * (1 - MULTI.tolerance), abs=2.0), loads


def test_multi_join_when_no_slot_can_be_spared_leaves_the_newcomer_a_standby() -> None:
    ranges = _map([(0, 0, "a")], range_size=1, epoch=2)
    planned = MULTI.join(ranges, "n", Load(traffic=np.ones(1)))
    assert planned == ranges
    assert planned.epoch == 2
    assert planned is not ranges


# -- MultiRangePolicy: leave --------------------------------------------------------------


@pytest.mark.parametrize("count", [2, 3, 4, 6])
@pytest.mark.parametrize("leaver", [0, 1, -1])
def test_multi_leave_moves_only_the_leavers_slots(count: int, leaver: int) -> None:
    traffic = np.random.default_rng(count).integers(5, 15, 512).astype(np.float64)
    ranges = _balanced(traffic, count)
    gone = ranges.consumers()[leaver]
    planned = MULTI.leave(ranges, gone, Load(traffic=traffic))
    members = [c for c in ranges.consumers() if c != gone]
    check_plan(MULTI, ranges, planned, members, [])
    assert all(old == gone for _, _, old, _ in moved_slots(ranges, planned)), "only the leaver's slots move"
    fair = float(traffic.sum()) / len(members)
    loads = range_traffic(planned, traffic)
    assert max(loads.values()) <= fair * (1 + MULTI.tolerance) + float(traffic.max()), loads


def test_multi_leave_gives_the_most_to_the_least_busy() -> None:
    # b leaves with 640; c carries 320 and a, d 640: c, the least busy, takes the most.
    ranges = _map([(0, 63, "a"), (64, 127, "b"), (128, 191, "c"), (192, 255, "d")], 256)
    traffic = np.full(256, 10.0)
    traffic[128:192] = 5.0
    planned = MULTI.leave(ranges, "b", Load(traffic=traffic))
    taken = {c: 0.0 for c in "acd"}
    for first, last, old, new in moved_slots(ranges, planned):
        assert old == "b"
        assert new is not None
        taken[new] += float(traffic[first : last + 1].sum())
    assert taken["c"] > taken["a"] and taken["c"] > taken["d"], taken
    loads = range_traffic(planned, traffic)
    assert max(loads.values()) - min(loads.values()) <= 10.0, loads


def test_multi_leave_moves_boundaries_to_adjacent_neighbours_first() -> None:
    # b's two neighbours need exactly b's share between them: both boundaries move, no new range.
    ranges = _map([(0, 47, "a"), (48, 79, "b"), (80, 127, "c")], 128)
    traffic = np.ones(128)
    planned = MULTI.leave(ranges, "b", Load(traffic=traffic))
    assert planned.ranges() == [(0, 63, "a"), (64, 127, "c")]


def test_multi_leave_with_a_hot_slot_settles_in_the_same_change() -> None:
    # The leaver's hot slot (heavier than a fair share) must go somewhere whole; whoever takes
    # it hands its other traffic on in the same change, keeping the hot slot and little else.
    ranges = _map([(0, 63, "a"), (64, 127, "b"), (128, 191, "c"), (192, 255, "d")], 256, epoch=7)
    traffic = np.full(256, 10.0)
    traffic[70] = 1500.0
    planned = MULTI.leave(ranges, "b", Load(traffic=traffic))
    check_plan(MULTI, ranges, planned, ["a", "c", "d"], [])
    holder = planned.owner_of(70)
    assert holder is not None
    loads = range_traffic(planned, traffic)
    assert loads[holder] <= 1500.0 * (1 + MULTI.tolerance), loads
    others = [load for consumer, load in loads.items() if consumer != holder]
    assert max(others) - min(others) <= 20.0, f"the other two share the rest evenly: {loads}"
    assert planned.epoch == 8


# -- MultiRangePolicy: shift --------------------------------------------------------------


def _drifted() -> tuple[RangeMap, Traffic]:
    """Four equal ranges of 64 slots; a's traffic has doubled."""
    ranges = _map([(0, 63, "a"), (64, 127, "b"), (128, 191, "c"), (192, 255, "d")], 256, epoch=3)
    traffic = np.full(256, 10.0)
    traffic[:64] = 20.0
    return ranges, traffic


def test_multi_shift_moves_what_the_busiest_carries_over_its_share_to_the_others() -> None:
    ranges, traffic = _drifted()
    planned = MULTI.shift(ranges, Load(traffic=traffic))
    assert planned is not None
    check_plan(MULTI, ranges, planned, ["a", "b", "c", "d"], [])
    assert planned.epoch == 4
    assert all(old == "a" for _, _, old, _ in moved_slots(ranges, planned))
    fair = float(traffic.sum()) / 4
    assert _moved_traffic(ranges, planned, traffic) <= (1280.0 - fair) * (1 + MULTI.tolerance)
    loads = range_traffic(planned, traffic)
    assert max(loads.values()) <= fair * (1 + MULTI.tolerance), loads


def test_multi_shift_returns_none_when_balanced_or_within_the_threshold() -> None:
    ranges, traffic = _drifted()
    assert MULTI.shift(ranges, Load(traffic=np.full(256, 10.0))) is None
    # max/mean = 1.6; a hundred times the traffic makes the noise allowance (three standard
    # deviations of a Poisson count, about 1% of a share here) too small to matter.
    heavy = Load(traffic=traffic * 100.0)
    assert MultiRangePolicy(threshold=1.65).shift(ranges, heavy) is None
    assert MultiRangePolicy(threshold=1.55).shift(ranges, heavy) is not None
    # At the measured 3200 messages the allowance is 85 on a share of 800: 1.5 does not act yet.
    assert MultiRangePolicy(threshold=1.5).shift(ranges, Load(traffic=traffic)) is None
    assert MultiRangePolicy(threshold=1.4).shift(ranges, Load(traffic=traffic)) is not None


def test_multi_shift_returns_none_on_too_little_traffic() -> None:
    ranges, traffic = _drifted()  # 3200 in all
    assert MultiRangePolicy(min_traffic=3200.5).shift(ranges, Load(traffic=traffic)) is None
    assert MultiRangePolicy(min_traffic=3200.0).shift(ranges, Load(traffic=traffic)) is not None
    assert MULTI.shift(ranges, Load(traffic=traffic / 4)) is None  # default min_traffic is 1000


def test_multi_shift_returns_none_without_traffic_or_a_second_consumer() -> None:
    policy = MultiRangePolicy(min_traffic=0.0)
    assert policy.shift(_map([(0, 7, "a"), (8, 15, "b")]), Load(rates={"a": 1e6})) is None
    assert policy.shift(_map([(0, 7, "a"), (8, 15, "b")]), Load(traffic=np.zeros(16))) is None
    assert policy.shift(_map([(0, 15, "a")]), Load(traffic=np.full(16, 100.0))) is None
    assert policy.shift(RangeMap(16), Load(traffic=np.full(16, 100.0))) is None


def test_multi_shift_measures_each_consumer_against_its_fair_share_not_the_mean() -> None:
    """max/mean is 1.1, not over the threshold, yet b carries 110/95 of its fair share: a's hot
    key (a share of its own) leaves 95 each to b and c, so the shift acts. (The module
    docstring's "max/mean over the threshold" is the rule only without hot keys.)"""
    ranges = _map([(0, 0, "a"), (1, 110, "b"), (111, 190, "c")], 191)
    traffic = np.full(191, 1000.0)
    traffic[0] = 110_000.0
    assert range_traffic(ranges, traffic) == {"a": 110_000.0, "b": 110_000.0, "c": 80_000.0}
    planned = MULTI.shift(ranges, Load(traffic=traffic))
    assert planned is not None
    loads = range_traffic(planned, traffic)
    assert loads["a"] == 110_000.0
    assert loads["b"] == pytest.approx(95_000.0, abs=1000.0)  # within one slot
    assert loads["c"] == pytest.approx(95_000.0, abs=1000.0)
    assert {(old, new) for _, _, old, new in moved_slots(ranges, planned)} == {("b", "c")}


def test_multi_shift_leaves_a_consumer_alone_with_its_hot_slot() -> None:
    # b's hot slot outweighs any fair share: b keeps it and little else, and nothing moves.
    ranges = _map([(0, 63, "a"), (64, 127, "b"), (128, 191, "c"), (192, 255, "d")], 256)
    traffic = np.ones(256)
    traffic[100] = 5000.0
    assert MULTI.shift(ranges, Load(traffic=traffic)) is None


# -- MultiRangePolicy: max_ranges and arguments -------------------------------------------


@pytest.mark.parametrize("max_ranges", [0, -1, 1.5, "16", None, True])
def test_multi_policy_rejects_a_bad_max_ranges(max_ranges: object) -> None:
    with pytest.raises(RangeMapError, match=f"max_ranges must be an int >= 1, not {max_ranges!r}"):
        MultiRangePolicy(max_ranges=max_ranges)  # type: ignore[arg-type]


@pytest.mark.parametrize("max_ranges", [1, 2, 3])
def test_multi_join_respects_max_ranges(max_ranges: int) -> None:
    # Seven consumers on uniform traffic: a newcomer wants a piece of each, but may own only max_ranges.
    traffic = np.full(448, 10.0)
    ranges = _balanced(traffic, 7)
    policy = MultiRangePolicy(max_ranges=max_ranges)
    planned = policy.join(ranges, "n", Load(traffic=traffic))
    check_plan(policy, ranges, planned, [*ranges.consumers(), "n"], [])
    assert 1 <= len(planned.ranges_of("n")) <= max_ranges


INTERLEAVED = [(2 * i, 2 * i + 1, "abcd"[i % 4]) for i in range(8)]
"""a b c d a b c d, two slots each: every consumer owns two ranges."""

ONE_EACH = [(4 * i, 4 * i + 3, "abcd"[i]) for i in range(4)]


@pytest.mark.parametrize(("layout", "max_ranges"), [(INTERLEAVED, 2), (ONE_EACH, 1)], ids=["two-each", "one-each"])
@pytest.mark.parametrize("leaver", ["a", "b", "c", "d"])
@pytest.mark.parametrize("traffic", [None, np.ones(16)], ids=["widths", "uniform"])
def test_multi_leave_keeps_max_ranges_when_every_receiver_is_full(
    layout: list[Range], max_ranges: int, leaver: str, traffic: Traffic | None
) -> None:
    """Every receiver already owns max_ranges ranges, so the leaver's ranges may only go to
    adjacent neighbours (a boundary move that never adds a range), whatever the need says."""
    ranges = _map(layout)
    policy = MultiRangePolicy(max_ranges=max_ranges)
    planned = policy.leave(ranges, leaver, Load(traffic=traffic))
    assert leaver not in planned
    check_plan(policy, ranges, planned, [c for c in "abcd" if c != leaver], [])


# -- moved_slots, range_traffic and reassign_rates ----------------------------------------


def test_moved_slots_on_hand_made_cases() -> None:
    two = _map([(0, 7, "a"), (8, 15, "b")])
    assert moved_slots(two, two.copy()) == []
    assert moved_slots(RangeMap(16), _map([(0, 15, "a")])) == [(0, 15, None, "a")]
    assert moved_slots(_map([(0, 15, "a")]), RangeMap(16)) == [(0, 15, "a", None)]
    assert moved_slots(RangeMap(16), RangeMap(16)) == []
    assert moved_slots(two, _map([(0, 7, "a"), (8, 11, "b"), (12, 15, "n")])) == [(12, 15, "b", "n")]
    assert moved_slots(two, _map([(0, 15, "b")])) == [(0, 7, "a", "b")]
    assert moved_slots(two, _map([(0, 4, "a"), (5, 15, "b")])) == [(5, 7, "a", "b")]
    assert moved_slots(two, _map([(0, 9, "b"), (10, 15, "a")])) == [(0, 7, "a", "b"), (10, 15, "b", "a")]
    scattered = _map([(0, 1, "a"), (2, 4, "b"), (5, 7, "a"), (8, 15, "b")])
    assert moved_slots(two, scattered) == [(2, 4, "a", "b")]
    assert moved_slots(scattered, two) == [(2, 4, "b", "a")]


def test_moved_slots_rejects_maps_of_different_sizes() -> None:
    with pytest.raises(RangeMapError, match="range sizes differ: 16 and 32"):
        moved_slots(RangeMap(16), RangeMap(32))


def _random_map(data: st.DataObject, size: int, names: list[str]) -> RangeMap:
    """Any tiling of ``size`` slots by ``names``, a consumer possibly owning several ranges."""
    if not data.draw(st.integers(0, 5)):
        return RangeMap(size)
    owners = data.draw(st.lists(st.sampled_from(names), min_size=size, max_size=size))
    return _map([(slot, slot, owner) for slot, owner in enumerate(owners)], size)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 24))
def test_moved_slots_agrees_with_a_slot_by_slot_comparison(data: st.DataObject, size: int) -> None:
    old = _random_map(data, size, ["a", "b", "c", "d", "e"])
    new = _random_map(data, size, ["a", "b", "c", "f", "g"])
    assert moved_slots(old, new) == _slot_moves(old, new)


def test_range_traffic_sums_every_range_of_a_consumer() -> None:
    ranges = _map([(0, 1, "a"), (2, 4, "b"), (5, 7, "a"), (8, 15, "c")])
    traffic = np.arange(16, dtype=np.float64)
    assert range_traffic(ranges, traffic) == {"a": 0 + 1 + 5 + 6 + 7, "b": 2 + 3 + 4, "c": sum(range(8, 16))}
    assert range_traffic(ranges, None) == {"a": 0.0, "b": 0.0, "c": 0.0}
    assert range_traffic(RangeMap(16), traffic) == {}


@given(st.data(), st.integers(1, 24))
def test_range_traffic_agrees_with_a_slot_by_slot_sum(data: st.DataObject, size: int) -> None:
    ranges = _random_map(data, size, ["a", "b", "c", "d"])
    traffic = np.array(data.draw(st.lists(st.integers(0, 1000), min_size=size, max_size=size)), dtype=np.float64)
    expected = dict.fromkeys(ranges.consumers(), 0.0)
    for slot in range(size if len(ranges) else 0):
        owner = ranges.owner_of(slot)
        assert owner is not None
        expected[owner] += float(traffic[slot])
    assert range_traffic(ranges, traffic) == expected


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


def test_reassign_rates_splits_a_leavers_rate_over_its_heirs_by_traffic() -> None:
    old = _map([(0, 3, "a"), (4, 5, "b"), (6, 7, "c"), (8, 11, "b"), (12, 15, "c")])
    new = _map([(0, 5, "a"), (6, 7, "c"), (8, 15, "c")])
    traffic = np.ones(16)
    traffic[4:6] = 3.0  # b's first range carries 6 of b's 10
    assert reassign_rates(old, new, {"a": 1.0, "b": 50.0, "c": 2.0}, traffic) == pytest.approx({"a": 31.0, "c": 22.0})


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


# -- purity: no input mutated, same inputs same map ---------------------------------------

POLICIES_UNDER_TEST: list[Policy] = [
    ContiguousPolicy(min_traffic=0.0),
    ContiguousPolicy(split="midpoint", min_traffic=0.0),
    MultiRangePolicy(min_traffic=0.0),
    MultiRangePolicy(max_ranges=2, threshold=1.3, min_traffic=0.0),
]
POLICY_IDS = ["contiguous", "contiguous-midpoint", "multi", "multi-2-ranges"]


@pytest.mark.parametrize("policy", POLICIES_UNDER_TEST, ids=POLICY_IDS)
def test_no_plan_mutates_its_inputs_and_the_same_inputs_give_the_same_map(policy: Policy) -> None:
    ranges = _map([(0, 3, "a"), (4, 11, "b"), (12, 15, "c")], epoch=9)
    snapshot = ranges.snapshot()
    rates = {"a": 1.0, "b": 50.0, "c": 2.0}
    traffic = np.concatenate([np.full(4, 1.0), np.full(8, 100.0), np.full(4, 1.0)])
    standby = ["s1", "s2"]
    load = Load(rates=rates, traffic=traffic)
    inputs = copy.deepcopy((rates, traffic, standby))

    def plans() -> list[RangeMap | None]:
        return [
            policy.join(ranges, "n", load),
            policy.leave(ranges, "b", load),
            policy.leave(ranges, "b", load, standby=standby),
            policy.shift(ranges, load),
        ]

    first = plans()
    assert all(result is not None and result != ranges for result in first)
    for result in first:
        assert result is not None
        assert result.epoch == 10
        reassign_rates(ranges, result, rates, traffic)
        moved_slots(ranges, result)
    assert ranges.snapshot() == snapshot
    assert (rates, standby) == (inputs[0], inputs[2])
    assert np.array_equal(traffic, inputs[1])
    again = plans()
    assert [None if r is None else r.snapshot() for r in again] == [None if r is None else r.snapshot() for r in first]


# -- property: any sequence of joins, leaves and shifts, for both policies ----------------


def _load(data: st.DataObject, members: list[str], size: int) -> Load:
    rates = {member: data.draw(st.floats(0.0, 100.0), label=f"rate {member}") for member in members}
    kind = data.draw(st.sampled_from(["none", "dense", "sparse", "zero", "skewed"]), label="traffic")
    if kind == "none":
        return Load(rates=rates)
    if kind == "zero":
        return Load(rates=rates, traffic=np.zeros(size))
    if kind == "dense":
        values = data.draw(st.lists(st.integers(0, 50), min_size=size, max_size=size))
        return Load(rates=rates, traffic=np.array(values, dtype=np.float64))
    traffic = np.zeros(size) if kind == "sparse" else np.ones(size)
    for slot in data.draw(st.lists(st.integers(0, size - 1), max_size=3)):
        traffic[slot] += data.draw(st.sampled_from([5.0, 100.0, 1000.0]))
    return Load(rates=rates, traffic=traffic)


def _policy(data: st.DataObject) -> Policy:
    if data.draw(st.booleans(), label="multi?"):
        return MultiRangePolicy(
            max_ranges=data.draw(st.sampled_from([1, 2, 3, 16]), label="max_ranges"),
            threshold=data.draw(st.sampled_from([1.1, 1.25]), label="threshold"),
            min_traffic=0.0,
        )
    split: SplitMode = data.draw(st.sampled_from(SPLIT_MODES), label="split")
    return ContiguousPolicy(split=split, min_traffic=0.0)


def _check_contiguous_join(ranges: RangeMap, planned: RangeMap, newcomer: str) -> None:
    """PIP-34: the newcomer took the upper part of one range, whose owner kept a non-empty rest."""
    ((first, last, old_owner, new_owner),) = moved_slots(ranges, planned)
    assert new_owner == newcomer
    if old_owner is None:
        assert (first, last) == (0, ranges.range_size - 1)
    else:
        ((start, end),) = ranges.ranges_of(old_owner)
        assert start < first <= last == end


def _check_shift(policy: Policy, planned: RangeMap, shifted: RangeMap, traffic: Traffic) -> None:
    before, after = range_traffic(planned, traffic), range_traffic(shifted, traffic)
    mean = sum(before.values()) / len(before)
    # A shift never makes the busiest consumer busier.
    assert max(after.values()) <= max(before.values()) * (1 + 1e-9)
    if isinstance(policy, ContiguousPolicy):
        # It acts only past max/mean > threshold, moves boundaries only (the consumers keep
        # their order) and makes the busiest lighter.
        assert max(before.values()) > policy.threshold * mean
        assert max(after.values()) < max(before.values())
        assert shifted.consumers() == planned.consumers()
    else:
        # It acts when someone carries more than its fair share (see the hot-key test below
        # for why that is not max/mean), and only consumers under the mean take.
        assert max(before.values()) > mean
        receivers = {new for _, _, _, new in moved_slots(planned, shifted)}
        assert all(before[r] < mean for r in receivers if r is not None), (before, receivers)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.data(), st.one_of(st.integers(1, 6), st.integers(7, 64)))
def test_joins_leaves_and_shifts_keep_every_invariant(data: st.DataObject, size: int) -> None:
    policy = _policy(data)
    ranges = RangeMap(size)
    standby: list[str] = []
    members: list[str] = []
    next_id = 0
    for _ in range(data.draw(st.integers(1, 20), label="steps")):
        load = _load(data, members, size)
        if not members or data.draw(st.integers(0, 2), label="join?") > 0:
            newcomer = f"c{next_id}"
            next_id += 1
            planned = policy.join(ranges, newcomer, load)
            members.append(newcomer)
            if newcomer not in planned:
                standby.append(newcomer)
                assert planned == ranges
            elif isinstance(policy, ContiguousPolicy):
                _check_contiguous_join(ranges, planned, newcomer)
        else:
            leaver = data.draw(st.sampled_from(members), label="leaver")
            members.remove(leaver)
            waiting = [s for s in standby if s != leaver]
            planned = policy.leave(ranges, leaver, load, standby=waiting)
            if leaver in standby:
                assert planned == ranges
                standby.remove(leaver)
            elif waiting:
                assert planned.ranges_of(waiting[0]) == ranges.ranges_of(leaver)
                assert all(old == leaver for _, _, old, _ in moved_slots(ranges, planned))
                standby.remove(waiting[0])
        check_plan(policy, ranges, planned, members, standby)
        _assert_rates_conserved(ranges, planned, load.rates, load.traffic)
        if load.traffic is not None:
            shifted = policy.shift(planned, load)
            if shifted is not None:
                check_plan(policy, planned, shifted, members, standby)
                _check_shift(policy, planned, shifted, load.traffic)
                _assert_rates_conserved(planned, shifted, load.rates, load.traffic)
                planned = shifted
        ranges = planned


# -- MultiRangePolicy: what does not hold (yet) -------------------------------------------


def test_multi_policy_with_threshold_one_plans_a_join() -> None:
    ranges = _map([(0, 7, "a"), (8, 15, "b")])
    planned = MultiRangePolicy(threshold=1.0).join(ranges, "c", Load())
    check_plan(MultiRangePolicy(threshold=1.0), ranges, planned, ["a", "b", "c"], [])


@pytest.mark.parametrize("min_traffic", [-1.0, "100"])
def test_multi_policy_rejects_a_bad_min_traffic(min_traffic: object) -> None:
    with pytest.raises(RangeMapError, match="min_traffic"):
        MultiRangePolicy(min_traffic=min_traffic)  # type: ignore[arg-type]


def test_multi_join_never_takes_an_existing_consumers_last_range() -> None:
    ranges = _map([(slot, slot, f"c{slot}") for slot in range(8)], 8)
    policy = MultiRangePolicy(threshold=2.0)
    planned = policy.join(ranges, "n", Load())
    check_plan(policy, ranges, planned, [*ranges.consumers(), "n"], ["n"] if "n" not in planned else [])


@pytest.mark.parametrize("hot", [1.0, 1000.0])
def test_multi_join_gives_the_newcomer_a_range_while_others_hold_idle_slots(hot: float) -> None:
    # a's range has a hot slot at each edge; b holds 54 slots nobody has used yet.
    ranges = _map([(0, 9, "a"), (10, 63, "b")], 64)
    planned = MULTI.join(ranges, "n", Load(traffic=_traffic(64, {0: hot, 9: hot})))
    assert "n" in planned, planned


@pytest.mark.parametrize(
    ("traffic", "best"),
    [
        # b leaves with two hot slots of 50: a, c and d can end at 66, 66 and 30 (1.22x the fair 54),
        # but one of them gets both hot slots (100, 1.85x).
        pytest.param(np.concatenate([np.ones(16), [50.0, 50.0], np.ones(46)]), 66.0, id="two-hot-slots"),
        # Eight uniform slots, b leaves: a, c, d can carry 3, 3, 2; one neighbour gets 4.
        pytest.param(np.ones(8), 3.0, id="coarse-uniform-slots"),
    ],
)
def test_multi_leave_spreads_slots_no_receiver_needs_whole(traffic: Traffic, best: float) -> None:
    size = len(traffic)
    quarter = size // 4
    ranges = _map([(i * quarter, (i + 1) * quarter - 1, name) for i, name in enumerate("abcd")], size)
    planned = MULTI.leave(ranges, "b", Load(traffic=traffic))
    loads = range_traffic(planned, traffic)
    assert max(loads.values()) <= best, loads


# -- members that may not gain (Load.closed: consumers not making progress) ---------------


def _slots(ranges: RangeMap, consumer: str) -> set[int]:
    return {
        slot
        for start, end in (ranges.ranges_of(consumer) if consumer in ranges else [])
        for slot in range(start, end + 1)
    }


def _with_closed(load: Load, *closed: str) -> Load:
    return Load(load.rates, load.traffic, frozenset(closed))


def _busy_a_idle_b() -> tuple[RangeMap, Load]:
    """a carries 90% of the traffic, b 10%: a newcomer takes its band from a, and the settle step
    then moves a's excess over its cap to b, the one under its share."""
    traffic = np.concatenate([np.full(128, 9.0), np.ones(128)])
    return _map([(0, 127, "a"), (128, 255, "b")], 256), Load(traffic=traffic)


def test_multi_join_settles_among_open_members_only() -> None:
    ranges, load = _busy_a_idle_b()
    assert len(_slots(MULTI.join(ranges, "n", load), "b")) > 128, "open, b takes a's excess in the settle step"
    planned = MULTI.join(ranges, "n", _with_closed(load, "b"))
    check_plan(MULTI, ranges, planned, ["a", "b", "n"], [])
    assert planned.ranges_of("b") == [(128, 255)]
    assert {new for _, _, _, new in moved_slots(ranges, planned)} == {"n"}
    assert planned == MULTI.join(ranges, "n", _with_closed(load, "b", "n")), "the newcomer itself always may gain"


@pytest.mark.parametrize("policy", [CONTIGUOUS, MULTI], ids=["contiguous", "multi"])
def test_a_join_may_take_from_a_closed_member(policy: Policy) -> None:
    ranges, load = _busy_a_idle_b()
    planned = policy.join(ranges, "n", _with_closed(load, "a", "b"))
    check_plan(policy, ranges, planned, ["a", "b", "n"], [])
    assert {(old, new) for _, _, old, new in moved_slots(ranges, planned)} == {("a", "n")}
    taken = _moved_traffic(ranges, planned, np.asarray(load.traffic))
    fair = float(np.asarray(load.traffic).sum()) / 3
    assert taken >= fair * 0.9, f"a, closed and the busiest, gives the newcomer about a fair share: {taken}"


def test_multi_leave_passes_a_closed_neighbour_over() -> None:
    load = Load(traffic=np.ones(16))
    assert len(_slots(MULTI.leave(_four(), "b", load), "a")) > 4, "open, a takes part of b's range"
    planned = MULTI.leave(_four(), "b", _with_closed(load, "a"))
    check_plan(MULTI, _four(), planned, ["a", "c", "d"], [])
    assert planned.ranges_of("a") == [(0, 3)]
    assert {(old, new) for _, _, old, new in moved_slots(_four(), planned)} <= {("b", "c"), ("b", "d")}
    loads = range_traffic(planned, np.ones(16))
    assert (loads["c"], loads["d"]) == (6.0, 6.0), "the open members share the leaver's slots evenly"


def test_multi_leave_skips_a_closed_standby_and_carves_when_every_standby_is_closed() -> None:
    load = Load(traffic=np.ones(16))
    planned = MULTI.leave(_four(), "c", _with_closed(load, "s1"), standby=["s1", "s2"])
    assert planned.ranges() == [(0, 3, "a"), (4, 7, "b"), (8, 11, "s2"), (12, 15, "d")]
    carved = MULTI.leave(_four(), "c", _with_closed(load, "s1", "s2"), standby=["s1", "s2"])
    assert "s1" not in carved and "s2" not in carved
    assert carved == MULTI.leave(_four(), "c", load)


@pytest.mark.parametrize("policy", [CONTIGUOUS, MULTI], ids=["contiguous", "multi"])
def test_a_leave_with_nobody_open_goes_as_if_nobody_were_closed(policy: Policy) -> None:
    load = Load(rates={"a": 3.0, "c": 1.0}, traffic=np.ones(16))
    for standby in ([], ["s1"]):
        everyone = _with_closed(load, "a", "c", "d", "s1")
        assert policy.leave(_four(), "b", everyone, standby) == policy.leave(_four(), "b", load, standby)


def test_multi_leave_gives_a_closed_neighbour_a_piece_no_open_member_can_take_within_max_ranges() -> None:
    # One range each: d cannot take b's range (not adjacent), so the less loaded neighbour does.
    policy = MultiRangePolicy(max_ranges=1)
    traffic = np.ones(16)
    traffic[0] = 5.0
    planned = policy.leave(_four(), "b", Load(traffic=traffic, closed=frozenset({"a", "c"})))
    assert planned.ranges() == [(0, 3, "a"), (4, 11, "c"), (12, 15, "d")]


def test_contiguous_leave_passes_a_closed_neighbour_over() -> None:
    rates = {"a": 1.0, "b": 5.0, "c": 2.0, "d": 0.0}
    assert CONTIGUOUS.leave(_four(), "b", Load(rates=rates)).ranges_of("a") == [(0, 7)], "open, a, less busy, takes"
    planned = CONTIGUOUS.leave(_four(), "b", Load(rates=rates, closed=frozenset({"a"})))
    assert planned.ranges() == [(0, 3, "a"), (4, 11, "c"), (12, 15, "d")]


def test_contiguous_leave_with_both_neighbours_closed_goes_to_an_open_standby_else_the_less_busy() -> None:
    rates = {"a": 1.0, "b": 5.0, "c": 2.0, "d": 0.0}
    closed = frozenset({"a", "c", "s1"})
    planned = CONTIGUOUS.leave(_four(), "b", Load(rates=rates, closed=closed), standby=["s1", "s2"])
    assert planned.ranges() == [(0, 3, "a"), (4, 7, "s2"), (8, 11, "c"), (12, 15, "d")]
    # d is open but not adjacent: one range each leaves the range to a closed neighbour, as before.
    planned = CONTIGUOUS.leave(_four(), "b", Load(rates=rates, closed=closed))
    assert planned.ranges() == [(0, 7, "a"), (8, 11, "c"), (12, 15, "d")]


def _grown(policy: Policy, data: st.DataObject, size: int, names: list[str]) -> RangeMap:
    """The map after ``names`` joined one by one on random loads."""
    ranges = RangeMap(size)
    for name in names:
        ranges = policy.join(ranges, name, _load(data, ranges.consumers(), size))
    return ranges


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.data(), st.one_of(st.integers(2, 8), st.integers(9, 64)))
def test_a_closed_member_never_gains_in_a_join_or_a_leave_while_an_open_one_can(data: st.DataObject, size: int) -> None:
    """Whatever the policy: a join grows only the newcomer among the closed; a leave gives the leaver's
    slots to open members (or the first open standby) only, where the policy's shape lets any take
    them, and otherwise goes as if nobody were closed."""
    policy = _policy(data)
    names = [f"c{i}" for i in range(data.draw(st.integers(2, 6), label="members"))]
    ranges = _grown(policy, data, size, names)
    owners = ranges.consumers()
    standby = [n for n in names if n not in ranges] + data.draw(st.sampled_from([[], [], ["s1"], ["s1", "s2"]]))
    closed = frozenset(name for name in [*names, "s1", "s2"] if data.draw(st.booleans(), label=f"{name} closed?"))
    measured = _load(data, names, size)
    load, plain = _with_closed(measured, *closed), _with_closed(measured)

    joined = policy.join(ranges, "n", load)
    assert joined == policy.join(ranges, "n", _with_closed(measured, *closed, "n")), "the newcomer always may gain"
    assert all(_slots(joined, c) <= _slots(ranges, c) for c in closed), "a closed member gained in a join"

    leaver = data.draw(st.sampled_from(owners), label="leaver")
    left = policy.leave(ranges, leaver, load, standby)
    takers = [m for m in owners if m != leaver and m not in closed]
    heirs = [s for s in standby if s not in closed]
    if not (takers or heirs):
        event("nobody open: as if nobody were closed")
        assert left == policy.leave(ranges, leaver, plain, standby), "nobody open: as if nobody were closed"
        return
    gained = {c: _slots(left, c) - _slots(ranges, c) for c in closed if c != leaver}
    if any(gained.values()):
        # Only where the shape leaves no open member to take a piece, and only the leaver's slots.
        event(f"a closed {policy.name} member took what no open one could")
        assert not heirs and all(slots <= _slots(ranges, leaver) for slots in gained.values())
        if isinstance(policy, MultiRangePolicy):
            unbounded = replace(policy, max_ranges=size + 1).leave(ranges, leaver, load, standby)
            assert all(_slots(unbounded, c) <= _slots(ranges, c) for c in closed if c != leaver), "not max_ranges"
        else:
            ((start, end),) = ranges.ranges_of(leaver)
            neighbours = {ranges.owner_of(slot) for slot in (start - 1, end + 1) if 0 <= slot < size}
            assert neighbours <= closed, f"an open neighbour of {neighbours} could have taken it"
        return
    receivers = {new for _, _, old, new in moved_slots(ranges, left) if old == leaver}
    assert receivers and receivers <= set(heirs[:1] or takers), "an open member takes the leaver's slots"
    event("an open standby inherits" if heirs else f"open members take ({len(closed & set(owners))} closed)")
