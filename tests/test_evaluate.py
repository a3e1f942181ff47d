"""keyfailover.evaluate and ``keyfailover evaluate``: strategies, measures, goals and the command line."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import subprocess
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from keyfailover.core.hashing import HASH_RANGE_SIZE
from keyfailover.core.rebalance import MultiRangePolicy
from keyfailover.tools.evaluate import (
    BOUND,
    JSON_KEYS,
    SCENARIOS,
    SEED,
    STRATEGIES,
    FlinkKeyGroups,
    Join,
    KeyFailover,
    KeyFailoverContiguous,
    Leave,
    Measured,
    PulsarAutoSplit,
    PulsarConsistent,
    PulsarConsistent3,
    Result,
    RocketMQAveragely,
    RocketMQSticky,
    Strategy,
    balance,
    build_scenario,
    consumer_loads,
    drain_times,
    fair_level,
    goals,
    hot_key,
    ideal,
    least_moved,
    run_strategy,
    stickiness,
)
from keyfailover.tools.evaluate._drain import PROCESSING, TICK
from tests.server_process import run_cli, run_main

Owners = npt.NDArray[np.intp]

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs keyfailover[plot]")


def _owners(strategy: Strategy) -> list[str | None]:
    """Each slot's owner by name (None: nobody)."""
    owned = strategy.ownership()
    assert owned.index.shape == (HASH_RANGE_SIZE,)
    return [owned.consumers[i] if i >= 0 else None for i in owned.index.tolist()]


def _key_owners(strategy: Strategy, scenario: str = "zipf") -> list[str | None]:
    """Each key's owner by name (None: nobody), each key placed by the strategy's own hash."""
    owned = strategy.owners(build_scenario(scenario, quick=True).population)
    return [owned.consumers[i] if i >= 0 else None for i in owned.index.tolist()]


def _counts(owners: list[str | None]) -> dict[str | None, int]:
    counts: dict[str | None, int] = {}
    for owner in owners:
        counts[owner] = counts.get(owner, 0) + 1
    return counts


# -- every strategy's invariants --------------------------------------------------------


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("scenario", ["random", "scale", "rolling-restart"])
def test_every_key_is_owned_by_a_member_after_every_event(name: str, scenario: str) -> None:
    built = build_scenario(scenario, quick=True)
    strategy = STRATEGIES[name]()
    members: list[str] = []
    windows = iter(built.windows * (len(built.setup) + len(built.events)))
    for event in (*built.setup, *built.events):
        strategy.apply(event)
        if isinstance(event, Join):
            members.append(event.consumer)
        else:
            members.remove(event.consumer)
        strategy.apply(Measured(next(windows)))
        owned = strategy.owners(built.population)
        owners = {owned.consumers[i] if i >= 0 else None for i in np.unique(owned.index).tolist()}
        assert None not in owners, f"{name}: keys without an owner after {event}"
        assert owners <= set(members), f"{name}: owners {sorted(map(str, owners))} are not members {sorted(members)}"
        if name == KeyFailoverContiguous.name:
            assert strategy.ranges() == len(members), "keyfailover-contiguous: one contiguous range per consumer"
        if name == KeyFailover.name:
            assert len(set(members) - owners) <= 0, "keyfailover: every member owns keys"
            assert strategy.ranges() <= 16 * len(members), "keyfailover: at most max_ranges ranges per consumer"


def test_no_member_no_owner() -> None:
    for strategy_type in STRATEGIES.values():
        strategy = strategy_type()
        assert set(_key_owners(strategy)) == {None}
        strategy.join("a")
        strategy.leave("a")
        assert set(_key_owners(strategy)) == {None}, strategy.name


# -- each strategy on small cases with known answers ------------------------------------


def test_pulsar_autosplit_newcomer_takes_the_lower_half_and_the_top_passes_down() -> None:
    strategy = PulsarAutoSplit()
    strategy.join("c0")  # range key 65536: every slot
    strategy.join("c1")  # splits (0, 65536] at 32768 and takes the lower half; slot 0 goes to the first key
    assert _counts(_owners(strategy)) == {"c1": 32769, "c0": 32767}
    strategy.join("c2")  # the first of two equally wide ranges, (0, 32768], splits at 16384
    owners = _owners(strategy)
    assert (owners[16384], owners[16385], owners[32768], owners[32769]) == ("c2", "c1", "c1", "c0")
    strategy.leave("c0")  # the top range's owner left: the consumer just below takes key 65536
    assert _counts(_owners(strategy)) == {"c2": 16385, "c1": 65536 - 16385}
    strategy.leave("c2")  # any other range goes to the next-higher key
    assert _counts(_owners(strategy)) == {"c1": 65536}


def test_flink_key_groups_are_contiguous_even_runs_of_128_groups() -> None:
    strategy = FlinkKeyGroups()
    for consumer in ("a", "b", "c"):
        strategy.join(consumer)
    owners = _owners(strategy)
    # Group g = slot % 128 goes to subtask g * 3 // 128: groups 0-42, 43-85, 86-127; 512 slots a group.
    assert _counts(owners) == {"a": 43 * 512, "b": 43 * 512, "c": 42 * 512}
    assert [owners[g] for g in (42, 43, 85, 86, 127, 128 + 42)] == ["a", "b", "b", "c", "c", "a"]
    strategy.leave("a")  # b and c become subtasks 0 and 1 of 2: 64 groups each
    assert _counts(_owners(strategy)) == {"b": 32768, "c": 32768}


def test_rocketmq_averagely_gives_sorted_consumers_contiguous_blocks_of_queues() -> None:
    strategy = RocketMQAveragely()
    for consumer in ("c2", "c0", "c1"):
        strategy.join(consumer)
    owners = _owners(strategy)
    # 256 queues over 3: 86, 85, 85 in sorted id order; queue q holds slots q, q + 256, ...
    assert _counts(owners) == {"c0": 86 * 256, "c1": 85 * 256, "c2": 85 * 256}
    assert [owners[q] for q in (0, 85, 86, 170, 171, 255, 256 + 85)] == ["c0", "c0", "c1", "c1", "c2", "c2", "c0"]


def test_sticky_moves_only_what_the_change_forces() -> None:
    strategy = RocketMQSticky()
    strategy.join("a")
    strategy.join("b")
    before = _owners(strategy)
    assert _counts(before) == {"a": 128 * 256, "b": 128 * 256}
    strategy.join("c")
    after = _owners(strategy)
    assert _counts(after) == {"a": 86 * 256, "b": 85 * 256, "c": 85 * 256}
    assert all(new in (old, "c") for old, new in zip(before, after, strict=True))
    strategy.leave("a")
    left = _owners(strategy)
    assert _counts(left) == {"b": 128 * 256, "c": 128 * 256}
    assert all(old in (new, "a") for old, new in zip(after, left, strict=True))


@pytest.mark.parametrize("ring", [PulsarConsistent, PulsarConsistent3])
def test_pulsar_consistent_moves_keys_only_to_a_newcomer_or_from_a_leaver(ring: type[PulsarConsistent]) -> None:
    # "consumer1" + "11" and "consumer11" + "1" were the same ring point before #22050.
    strategy = ring()
    for consumer in ("consumer1", "consumer2"):
        strategy.join(consumer)
    before = _key_owners(strategy)
    strategy.join("consumer11")
    after = _key_owners(strategy)
    moved = [new for old, new in zip(before, after, strict=True) if old != new]
    assert moved and set(moved) == {"consumer11"}
    strategy.leave("consumer11")
    assert _key_owners(strategy) == before
    strategy.leave("consumer1")
    assert set(_key_owners(strategy)) == {"consumer2"}


def test_pulsar_4x_places_keys_by_its_own_slot_not_keyfailovers() -> None:
    # m31 % 65535 + 1 is not m31 % 65536: a key's 4.x consistent-hashing slot differs from its
    # keyfailover slot, so the peer must place each key by Pulsar's hash, not by the slot.
    population = build_scenario("uniform", quick=True).population
    assert np.count_nonzero(population.key_pulsar4 != population.key_slots) > 0.9 * len(population.key_slots)
    strategy = PulsarConsistent(points=3)
    for consumer in ("consumer1", "consumer2", "consumer3"):
        strategy.join(consumer)
    by_key = strategy.owners(population)
    by_slot = strategy.ownership()
    own = [by_key.consumers[i] for i in by_key.index.tolist()]
    # Pulsar's own test pins consumer1's ranges at [14359, 18366], [29991, 39817], [52980, 60442].
    pinned = [(14359, 18366), (29991, 39817), (52980, 60442)]
    for owner, slot in zip(own, population.key_pulsar4.tolist(), strict=True):
        assert (owner == "consumer1") == any(low <= slot <= high for low, high in pinned)
    assert by_slot.consumers[by_slot.index[14359]] == "consumer1"


def test_keyfailover_contiguous_join_splits_the_busiest_where_its_traffic_halves() -> None:
    traffic = np.zeros(HASH_RANGE_SIZE)
    traffic[:100] = 10.0  # all traffic in the lowest 100 slots
    strategy = KeyFailoverContiguous()
    strategy.measured(traffic)
    strategy.join("a")
    strategy.join("b")
    owners = _owners(strategy)
    assert (owners[49], owners[50]) == ("a", "b")
    assert _counts(owners) == {"a": 50, "b": HASH_RANGE_SIZE - 50}


def test_keyfailover_join_takes_half_the_traffic_and_stays_put_when_traffic_is_measured_again() -> None:
    traffic = np.zeros(HASH_RANGE_SIZE)
    traffic[:100] = 10.0  # all traffic in the lowest 100 slots
    strategy = KeyFailover()
    strategy.measured(traffic)
    strategy.join("a")
    strategy.join("b")
    owners = _owners(strategy)
    on_b = sum(float(traffic[slot]) for slot, owner in enumerate(owners) if owner == "b")
    # Half of the 1000 at the low end of its band (1 - tolerance), one slot's worth either way.
    assert on_b == pytest.approx(500.0 * (1 - MultiRangePolicy().tolerance), abs=10.0)
    assert not strategy.measured(traffic), "a balanced map is left alone"
    assert _owners(strategy) == owners


# -- the measures on hand-made cases ----------------------------------------------------

# 8 slots, 3 consumers: 0 owns slots 0-2, 1 owns 3-4, 2 owns 5-7.
OWNER: Owners = np.array([0, 0, 0, 1, 1, 2, 2, 2], dtype=np.intp)
WEIGHTS = np.arange(1.0, 9.0)  # slot s carries s + 1: loads 6, 9 and 21 (sum 36, mean 12)
THREE: Owners = np.arange(3, dtype=np.intp)


def test_consumer_loads_sum_each_consumers_slots() -> None:
    assert consumer_loads(OWNER, WEIGHTS, THREE).tolist() == [6.0, 9.0, 21.0]
    assert consumer_loads(OWNER, WEIGHTS, np.array([2, 3], dtype=np.intp)).tolist() == [21.0, 0.0]


def test_balance_is_max_over_mean_and_the_standard_deviation_in_mean_loads() -> None:
    got = balance(OWNER, WEIGHTS, THREE)
    # Loads over the mean: 0.5, 0.75, 1.75; deviations -0.5, -0.25, 0.75.
    assert got.max_mean == pytest.approx(21.0 / 12.0)
    assert got.stddev == pytest.approx(math.sqrt((0.25 + 0.0625 + 0.5625) / 3.0))
    # The same slots counted by width (hash space): loads 3, 2, 3 over a mean of 8/3.
    space = balance(OWNER, np.ones(8), THREE)
    assert space.max_mean == pytest.approx(9.0 / 8.0)
    assert space.stddev == pytest.approx(math.sqrt(((9 / 8 - 1) ** 2 * 2 + (6 / 8 - 1) ** 2) / 3.0))


def test_balance_counts_a_member_without_slots_and_is_perfect_without_load() -> None:
    four = np.arange(4, dtype=np.intp)
    assert balance(OWNER, WEIGHTS, four).max_mean == pytest.approx(21.0 / 9.0)  # mean 36 / 4
    assert balance(OWNER, np.zeros(8), THREE) == (1.0, 0.0)
    even = balance(np.array([0, 0, 1, 1, 2, 2, 0, 1], dtype=np.intp), np.array([1.0] * 6 + [0.0] * 2), THREE)
    assert even == (1.0, 0.0)


def test_stickiness_is_the_weight_that_keeps_its_consumer() -> None:
    after: Owners = np.array([0, 0, 1, 1, 1, 2, 2, 0], dtype=np.intp)  # slot 2 moves to 1, slot 7 to 0
    assert stickiness(OWNER, after, WEIGHTS) == pytest.approx((36.0 - 3.0 - 8.0) / 36.0)
    assert stickiness(OWNER, after, np.ones(8)) == pytest.approx(6.0 / 8.0)
    assert stickiness(OWNER, OWNER, WEIGHTS) == 1.0
    # Slots nobody owned before do not count; with nothing counted the change kept everything.
    half: Owners = np.array([-1, -1, -1, -1, 1, 2, 2, 2], dtype=np.intp)
    assert stickiness(half, after, WEIGHTS) == pytest.approx((5.0 + 6.0 + 7.0) / (5.0 + 6.0 + 7.0 + 8.0))
    assert stickiness(np.full(8, -1, dtype=np.intp), after, WEIGHTS) == 1.0


def test_hot_key_reports_the_floor_and_what_its_owner_carries_besides() -> None:
    # The hottest key is 7 (weight 8) on consumer 2, which also carries 6 + 7.
    assert hot_key(OWNER, WEIGHTS, THREE) == pytest.approx((1.0, 13.0 / 12.0))
    hot = WEIGHTS.copy()
    hot[7] = 60.0  # total 88, mean 88 / 3: the key alone is 60 / (88 / 3) mean loads
    assert hot_key(OWNER, hot, THREE) == pytest.approx((60.0 * 3 / 88.0, 13.0 * 3 / 88.0))


def test_fair_level_sets_keys_heavier_than_it_aside() -> None:
    assert fair_level(36.0, np.array([8.0, 7.0, 6.0]), 3) == pytest.approx(12.0)
    # A key of 60 out of 88 is heavier than a third: its owner carries it alone, the others share 28.
    assert fair_level(88.0, np.array([60.0, 7.0, 6.0]), 3) == pytest.approx(14.0)
    assert fair_level(10.0, np.array([6.0, 4.0]), 2) == pytest.approx(4.0)  # each consumer one key


def test_least_moved_is_the_newcomers_share_from_a_balanced_state() -> None:
    # Two consumers with 12 each; a third joins: 8 each is fair, so 4 + 4 must move.
    owner: Owners = np.array([0, 0, 0, 1, 1, 1], dtype=np.intp)
    weights = np.full(6, 4.0)
    two, three = np.array([0, 1], dtype=np.intp), np.array([0, 1, 2], dtype=np.intp)
    assert least_moved(owner, weights, two, three) == pytest.approx(8.0)
    # A leave from three of 8 each moves exactly the leaver's 8.
    owner3: Owners = np.array([0, 0, 1, 1, 2, 2], dtype=np.intp)
    assert least_moved(owner3, weights, three, two) == pytest.approx(8.0)
    # An unbalanced start adds the excess of the others: 0 carries 16, 1 carries 8, fair is 12.
    skewed: Owners = np.array([0, 0, 0, 0, 1, 1], dtype=np.intp)
    assert least_moved(skewed, weights, two, two) == pytest.approx(4.0)


def test_least_moved_counts_the_shedding_a_leavers_hot_key_forces() -> None:
    # Consumer 2 holds one key of 30; 0 and 1 hold 15 each. When 2 leaves, the key must go to 0 or 1,
    # which then carries 45 against a fair level of 30: one of them must shed its other 15 as well.
    owner: Owners = np.array([0, 1, 2], dtype=np.intp)
    weights = np.array([15.0, 15.0, 30.0])
    three, two = np.array([0, 1, 2], dtype=np.intp), np.array([0, 1], dtype=np.intp)
    assert least_moved(owner, weights, three, two) == pytest.approx(30.0 + 15.0)
    # Planted: a plan that moves only the leaver's key would claim 30; the bound refuses that.
    assert least_moved(owner, weights, three, two) > 30.0


def test_measures_reject_arrays_of_different_shapes() -> None:
    with pytest.raises(ValueError, match="expected the same shape"):
        consumer_loads(OWNER, WEIGHTS[:7], THREE)
    with pytest.raises(ValueError, match="must have the same shape"):
        stickiness(OWNER, OWNER[:7], WEIGHTS)


# -- scenarios, runs, goals, drain times ------------------------------------------------


def test_scenarios_are_seeded_and_unknown_names_are_refused() -> None:
    first, again = build_scenario("zipf", quick=True), build_scenario("zipf", quick=True)
    assert first.events == again.events
    assert all(np.array_equal(a, b) for a, b in zip(first.windows, again.windows, strict=True))
    assert first.population.traffic.sum() == pytest.approx(first.population.messages)
    with pytest.raises(ValueError, match="scenario 'nope' is unknown; expected one of uniform"):
        build_scenario("nope")


def test_another_seed_draws_other_windows_and_other_random_changes() -> None:
    default, same = build_scenario("random", quick=True), build_scenario("random", quick=True, seed=SEED)
    assert default.events == same.events
    other = build_scenario("random", quick=True, seed=SEED + 1)
    assert other.events != default.events
    assert not np.array_equal(other.windows[0], default.windows[0])
    assert other.population.traffic.sum() == pytest.approx(default.population.traffic.sum())  # the same keys
    with pytest.raises(ValueError, match="seed must be an int >= 0, not -1"):
        build_scenario("random", seed=-1)


def test_rolling_restart_rejoins_each_consumer_after_it_left() -> None:
    built = build_scenario("rolling-restart", quick=True)
    starting = [event.consumer for event in built.setup]
    assert list(built.events) == [e for c in starting for e in (Leave(c), Join(c))]


def test_a_run_measures_every_event_within_bounds() -> None:
    result = run_strategy(PulsarAutoSplit(), build_scenario("uniform", quick=True))
    assert 0.0 <= result.stickiness_min <= result.stickiness_mean <= 1.0
    assert result.max_mean_traffic >= 1.0 and result.stddev_traffic >= 0.0
    assert result.shifts_per_event == 0.0  # blind to load: the settled state is the changed state
    assert result.max_mean_traffic == result.max_mean_at_change
    assert result.over_floor <= result.max_mean_traffic
    assert set(result.json_row()) == set(JSON_KEYS)


def test_no_strategy_moves_less_than_the_least_possible() -> None:
    # The bound holds for any policy that ends balanced; ours ends within its tolerance (a
    # newcomer at the low end of its band), so it moves at least that much less the tolerance.
    low = 1 - 2 * MultiRangePolicy().tolerance
    for name in ("uniform", "zipf", "hot-key"):
        result = run_strategy(KeyFailover(), build_scenario(name, quick=True))
        assert result.join_vs_least >= low and result.leave_vs_least >= low, name


def test_the_lower_bound_row_moves_the_fair_share_of_each_change() -> None:
    built = build_scenario("uniform", quick=True)  # 4 consumers, then 2 rounds of a leave and a join
    row = ideal(built)
    assert row.strategy == BOUND and row.scenario == "uniform"
    assert row.join_traffic_moved == pytest.approx(1 / 4)  # the newcomer makes 4 again
    assert row.leave_traffic_moved == pytest.approx(1 / 4)  # the leaver held a fourth
    assert row.join_keys_moved == pytest.approx(1 / 4)
    assert row.max_mean_traffic == pytest.approx(1.0)


def _result(strategy: str, scenario: str, **values: float) -> Result:
    base = dict.fromkeys((f.name for f in dataclasses.fields(Result) if f.name not in ("strategy", "scenario")), 1.0)
    return Result(strategy=strategy, scenario=scenario, **(base | values))


def test_goals_hold_exactly_at_their_bars() -> None:
    ours = _result("keyfailover", "zipf", max_mean_traffic=1.2, over_floor=1.1, join_vs_least=1.15, stickiness_mean=0.9)
    peer = _result("pulsar-consistent", "zipf", max_mean_traffic=1.2, stickiness_mean=0.9)
    verdicts = {goal.text.split(": ", 1)[1]: goal.holds for goal in goals([ours, peer], [])}
    assert verdicts == {
        "max/mean traffic no worse than pulsar-consistent": True,
        "max/mean traffic <= 1.10 x the floor (a key heavier than a fair share)": True,
        "traffic moved per join, shifts included, <= 1.15 x the least possible": True,
        "traffic moved per leave, shifts included, <= 1.15 x the least possible": True,
        "key stickiness no worse than pulsar-consistent": True,
    }
    worse = dataclasses.replace(ours, max_mean_traffic=1.21, over_floor=1.11, leave_vs_least=1.16, stickiness_mean=0.89)
    assert not any(goal.holds for goal in goals([worse, peer], []) if "join" not in goal.text)


@pytest.mark.parametrize("policy", ["multi", "contiguous"])
def test_drain_times_end_within_one_processing_time(policy: str) -> None:
    drains = {d.reason: d for d in drain_times(quick=True, policy=policy)}
    assert drains["join"].changes == 4 and drains["leave"].changes == 2
    for drain in drains.values():
        assert drain.undrained == 0
        assert 0.0 <= drain.mean_seconds <= drain.max_seconds <= PROCESSING + TICK
    assert drains["join"].max_seconds > 0.0  # moved keys had deliveries in flight on the old owner
    if policy == "contiguous":
        # Only the leaver's range moves, and the leaver is gone: its keys move at once. (The
        # multi-range policy may also move a live consumer's slots in the same change, which drain.)
        assert drains["leave"].max_seconds == 0.0


# -- the command line -------------------------------------------------------------------


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("evaluate", *args)


@pytest.mark.integration
def test_json_lists_every_strategy_and_scenario_with_exactly_the_documented_keys() -> None:
    done = _run("--quick", "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    expected = [(s, n) for n in SCENARIOS for s in (*STRATEGIES, BOUND)]
    assert [(row["strategy"], row["scenario"]) for row in rows] == expected
    rows = [row for row in rows if row["strategy"] != BOUND]
    for row in rows:
        assert list(row) == list(JSON_KEYS)
        assert row["max_mean_traffic"] >= 1.0 and row["stddev_traffic"] >= 0.0
        assert 0.0 <= row["stickiness_min"] <= row["stickiness_mean"] <= 1.0
        assert row["reassign_ms_mean"] > 0.0
    # The numbers are the run's own: the same seeded scenario gives the same balance in-process.
    again = run_strategy(PulsarConsistent(), build_scenario("hot-key", quick=True))
    row = next(r for r in rows if (r["strategy"], r["scenario"]) == ("pulsar-consistent", "hot-key"))
    assert row["max_mean_traffic"] == again.max_mean_traffic
    assert row["stickiness_mean"] == again.stickiness_mean


@pytest.mark.integration
@needs_matplotlib
def test_plot_writes_a_png_and_the_tables_name_each_strategy(tmp_path: Path) -> None:
    chart = tmp_path / "evaluation.png"
    done = _run("--quick", "--scenario", "hot-key", "--plot", str(chart))
    assert done.returncode == 0, done.stderr
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert done.stdout.lstrip().startswith("hot-key: one key at 20% of traffic")
    assert all(f"\n{name} " in done.stdout for name in STRATEGIES)
    assert "goals for keyfailover" in done.stdout
    assert "uniform:" not in done.stdout


@pytest.mark.integration
def test_seed_runs_the_scenarios_drawn_with_it_and_refuses_a_negative_one() -> None:
    done = _run("--quick", "--json", "--scenario", "random", "--seed", str(SEED + 1))
    assert done.returncode == 0, done.stderr
    row = next(r for r in json.loads(done.stdout) if r["strategy"] == "pulsar-consistent")
    drawn = run_strategy(PulsarConsistent(), build_scenario("random", quick=True, seed=SEED + 1))
    assert row["stickiness_mean"] == drawn.stickiness_mean
    default = run_strategy(PulsarConsistent(), build_scenario("random", quick=True))
    assert row["stickiness_mean"] != default.stickiness_mean
    refused = _run("--seed", "-1")
    assert refused.returncode == 2
    assert "expected an integer >= 0, got '-1'" in refused.stderr


def test_an_unknown_scenario_is_a_clear_error() -> None:
    done = run_main("evaluate", "--scenario", "nope")
    assert done.returncode == 2
    assert "unknown scenario 'nope'; expected one of uniform, zipf, hot-key" in done.stderr
    assert done.stdout == ""


@pytest.mark.integration
def test_check_exits_1_exactly_when_a_printed_goal_fails_and_progress_goes_to_stderr() -> None:
    done = run_cli("evaluate", "--quick", "--scenario", "uniform", "--check")
    verdicts = [line for line in done.stdout.splitlines() if line.startswith(("[holds]", "[FAILS]"))]
    assert verdicts, done.stdout
    failing = sum(line.startswith("[FAILS]") for line in verdicts)
    assert done.returncode == (1 if failing else 0), done.stderr
    assert f"keyfailover evaluate: scenario 1/1: uniform, {len(STRATEGIES)} strategies ..." in done.stderr
    assert "timing reassignments with 16 consumers" in done.stderr
    if failing:
        assert f"{failing} of {len(verdicts)} goals fail (--check)" in done.stderr
