"""The chaos checkers on hand-made histories: each passes a good one and catches a planted violation."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from keyfailover.core.partitions import partition_slots
from keyfailover.tools.chaos import (
    UNANSWERED,
    Acked,
    DeadLettered,
    Delivered,
    Fault,
    Produced,
    RangeMap,
    Record,
    RecordError,
    RecordWriter,
    ScheduleError,
    Served,
    check_all,
    dead_letter_accounting,
    duplicated,
    from_json,
    held_twice,
    lost,
    order,
    plan_faults,
    read_records,
    settled_unanswered,
    to_json,
    two_owners,
    unanswered,
    unowned_partitions,
    unowned_ranges,
)


def sent(key: str, *values: int, ok: bool = True, t: float = 0.0) -> list[Record]:
    return [Produced(t + v / 100, "p", key, v, ok, 0, v) for v in values]


def handed(consumer: str, key: str, *values_at: tuple[int, float], redelivery: int = 0) -> list[Record]:
    return [Delivered(t, consumer, key, v, 0, v, redelivery) for v, t in values_at]


def acked(consumer: str, key: str, *values_at: tuple[int, float], confirmed: bool = True) -> list[Record]:
    return [Acked(t, consumer, key, v, 0, v, confirmed) for v, t in values_at]


# -- records ------------------------------------------------------------------------------


def test_every_record_round_trips_through_a_json_line(tmp_path: Path) -> None:
    records: list[Record] = [
        Produced(1.0, "p1", "k", 3, True, 2, 17),
        Produced(1.5, "p1", "k", 4, False, error="timed out"),
        Delivered(2.0, "c1", "k", 3, 2, 17, 1),
        Acked(2.1, "c1", "k", 3, 2, 17, True),
        DeadLettered(9.0, "k", 4, 2, 18),
        Served(0.5, "b1", 2, 7, until=4.0),
        RangeMap(0.7, 2, ((21845, 30000, "c1"), (30001, 43689, "c2"))),
        Fault(3.0, "kill", "b1", "start", "SIGKILL"),
    ]
    assert [from_json(to_json(record)) for record in records] == records
    path = tmp_path / "run.jsonl"
    with RecordWriter(path) as writer:
        writer.write_all(records[:4])
        writer.write(records[4])
    with RecordWriter(path) as writer:  # appends
        writer.write_all(records[5:])
    assert list(read_records(path)) == records


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"type": "nope", "t": 1}', "unknown record type"),
        ('{"type": "fault", "t": 1, "kind": "kill", "target": "b", "action": "start", "color": 1}', "unknown fields"),
        ('{"type": "acked", "t": 1}', "acked record"),
        ('{"type": "ranges", "t": 1, "partition": 0, "ranges": [[1, 2]]}', "[first, last, consumer]"),
    ],
)
def test_a_bad_line_says_what_is_wrong(line: str, says: str) -> None:
    with pytest.raises(RecordError, match=says.replace("[", r"\[").replace("]", r"\]")):
        from_json(line)


def test_a_bad_line_in_a_file_is_named_by_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text(to_json(Fault(1.0, "kill", "b1", "start")) + "\n\n{oops\n")
    with pytest.raises(RecordError, match=r"run.jsonl:3: not JSON"):
        list(read_records(path))


# -- lost, duplicated, order -----------------------------------------------------------------


def test_lost_passes_when_every_confirmed_send_was_delivered_or_dead_lettered() -> None:
    history = [*sent("k", 0, 1, 2), *sent("k", 3, ok=False), *handed("c", "k", (0, 1.0), (1, 1.1))]
    history.append(DeadLettered(5.0, "k", 2, 0, 2))
    verdict = lost(history)
    assert verdict.passed and verdict.violations == 0
    assert verdict.measures["confirmed sends"] == 3


def test_lost_catches_a_confirmed_send_never_delivered() -> None:
    history = [*sent("k", 0, 1, 2), *handed("c", "k", (0, 1.0), (2, 1.1))]
    verdict = lost(history)
    assert not verdict.passed
    assert verdict.examples == ("key k: value 1 was confirmed to its producer and never delivered",)


def test_unanswered_passes_sends_that_were_stored_or_refused() -> None:
    history = [*sent("k", 0, 1), *sent("k", 2, ok=False), *handed("c", "k", (0, 1.0), (1, 1.1))]
    verdict = unanswered(history)
    assert verdict.passed and verdict.measures == {"sends": 3, "unanswered": 0}


def test_unanswered_catches_a_send_its_producer_never_got_an_answer_for() -> None:
    history = [*sent("k", 0), Produced(1.0, "p", "k", 1, False, error=UNANSWERED), *handed("c", "k", (0, 1.0))]
    verdict = unanswered(history)
    assert not verdict.passed and verdict.violations == 1
    assert verdict.examples == ("key k: value 1 was sent and never answered",)
    assert lost(history).passed  # never confirmed, so never lost: only this checker sees the stall


def test_duplicates_are_counted_and_never_fail() -> None:
    history = [
        *sent("k", 0, 1),
        *handed("a", "k", (0, 1.0), (1, 1.1)),
        *handed("b", "k", (0, 2.0), (1, 2.1), redelivery=1),
    ]
    verdict = duplicated(history)
    assert verdict.passed and verdict.violations == 0
    assert verdict.measures == {"delivered again": 2, "with a redelivery count": 2, "stored twice": 0}


def test_duplicates_name_a_message_stored_twice_and_uncounted_redeliveries() -> None:
    history = [*sent("k", 0), Delivered(1.0, "a", "k", 0, 0, 5), Delivered(2.0, "b", "k", 0, 0, 9)]
    verdict = duplicated(history)
    assert verdict.passed  # counted, not failed
    assert verdict.measures["stored twice"] == 1
    assert verdict.examples == (
        "key k: value 0 stored at 2 positions [(0, 5), (0, 9)]",
        "1 deliveries after the first carried redelivery count 0",
    )


def test_order_accepts_redeliveries_that_repeat_a_key_in_order() -> None:
    # a held 1 and 2 when it died; b was handed them again, then 3
    history = [
        *sent("k", 0, 1, 2, 3),
        *handed("a", "k", (0, 1.0), (1, 1.1), (2, 1.2)),
        *handed("b", "k", (1, 3.0), (2, 3.1), (3, 3.2), redelivery=1),
        *sent("j", 0),
    ]
    assert order(history).passed


def test_order_catches_a_message_handed_before_an_earlier_one_of_its_key() -> None:
    history = [*sent("k", 0, 1, 2), *handed("a", "k", (0, 1.0), (2, 1.1), (1, 1.2))]
    verdict = order(history)
    assert not verdict.passed and verdict.violations == 1
    assert verdict.examples == ("key k: value 2 was not delivered after value 1 (deliveries in order: 0, 2, 1)",)


def test_order_catches_a_later_message_handed_out_before_an_earlier_one_even_if_repeated_after() -> None:
    history = [*sent("k", 1, 2), *handed("a", "k", (2, 1.0), (1, 1.1), (2, 1.2))]  # 2, 1, 2: a subsequence
    verdict = order(history)
    assert not verdict.passed
    assert verdict.examples == ("key k: value 2 was handed out before value 1 ever was (deliveries in order: 2, 1, 2)",)


def test_order_leaves_lost_messages_to_lost() -> None:
    history = [*sent("k", 0, 1, 2), *handed("a", "k", (0, 1.0), (2, 1.1))]
    assert order(history).passed
    assert not lost(history).passed


# -- brokers ------------------------------------------------------------------------------


def test_two_owners_passes_handovers_and_catches_an_overlap() -> None:
    handover = [Served(0.0, "b1", 0, 1, until=5.0), Served(5.0, "b2", 0, 2), Served(0.0, "b2", 1, 1)]
    assert two_owners(handover, end=10.0).passed
    planted = [*handover, Served(8.0, "b3", 0, 3, until=9.5)]
    verdict = two_owners(planted, end=10.0)
    assert not verdict.passed
    assert verdict.examples == ("partition 0: b2 (epoch 2) and b3 (epoch 3) both served it for 1.500 s from t=8.000",)
    assert verdict.measures["longest overlap s"] == pytest.approx(1.5)


def test_unowned_partitions_measures_the_longest_gap_after_a_partition_was_first_served() -> None:
    history = [Served(1.0, "b1", 0, 1, until=4.0), Served(6.5, "b2", 0, 2), Served(0.0, "b2", 1, 1, until=9.0)]
    verdict = unowned_partitions(history, limit=3.0, end=10.0)
    assert verdict.passed
    assert verdict.measures["longest s"] == pytest.approx(2.5)
    failing = unowned_partitions(history, limit=2.0, end=10.0)
    assert not failing.passed
    assert failing.examples == ("partition 0 had no broker for 2.500 s from t=4.000 (limit 2.0 s)",)
    # a partition left without a broker at the end counts up to the end
    assert unowned_partitions(history, limit=10.0, end=13.0).measures["longest s"] == pytest.approx(4.0)


def test_time_zookeeper_was_faulted_does_not_count_as_unowned() -> None:
    low, high = block(0, 1)
    history: list[Record] = [
        Served(0.0, "b1", 0, 1, until=2.0),
        Served(10.0, "b2", 0, 2),  # 8 s without a broker, 6.5 of them with ZooKeeper killed
        RangeMap(0.5, 0, ((low, high, "a"),)),
        Fault(2.5, "kill", "zookeeper", "start"),
        Fault(9.0, "kill", "zookeeper", "end"),
    ]
    partitions = unowned_partitions(history, limit=2.0, end=12.0)
    assert partitions.passed
    assert partitions.measures["longest s"] == pytest.approx(1.5)
    assert partitions.measures["longest with ZooKeeper faulted s"] == pytest.approx(8.0)
    ranges = unowned_ranges(history, partitions=1, limit=2.0, end=12.0)
    assert ranges.passed and ranges.measures["longest s"] == pytest.approx(1.5)
    without_the_fault = [record for record in history if not isinstance(record, Fault)]
    assert not unowned_partitions(without_the_fault, limit=2.0, end=12.0).passed
    assert not unowned_ranges(without_the_fault, partitions=1, limit=2.0, end=12.0).passed


# -- consumers ----------------------------------------------------------------------------


def test_held_twice_passes_a_key_handed_over_after_the_ack() -> None:
    history = [
        *handed("a", "k", (0, 1.0)),
        *acked("a", "k", (0, 2.0)),
        *handed("b", "k", (1, 2.5)),
        *acked("b", "k", (1, 3.0)),
        *handed("b", "j", (0, 2.1)),
        *acked("b", "j", (0, 2.2)),
    ]
    assert held_twice(history).passed


def test_held_twice_catches_two_consumers_holding_one_key() -> None:
    history = [*handed("a", "k", (0, 1.0)), *acked("a", "k", (0, 2.0)), *handed("b", "k", (1, 1.5))]
    history += acked("b", "k", (1, 1.6))
    verdict = held_twice(history)
    assert not verdict.passed
    assert verdict.examples == ("key k: b was handed it at t=1.500 while a held it until t=2.000",)


def test_held_twice_does_not_count_a_holding_whose_ack_was_refused() -> None:
    # a's lease expired: the broker gave the message to b and refused a's late ack
    history = [
        *handed("a", "k", (0, 1.0)),
        *handed("b", "k", (0, 3.0), redelivery=1),
        *acked("b", "k", (0, 3.5)),
        *acked("a", "k", (0, 4.0), confirmed=False),
    ]
    assert held_twice(history).passed


def block(partition: int, partitions: int = 2) -> tuple[int, int]:
    return partition_slots(partition, partitions)


def test_unowned_ranges_passes_maps_that_always_cover_a_served_partition() -> None:
    low, high = block(0)
    middle = (low + high) // 2
    history: list[Record] = [
        Served(0.0, "b1", 0, 1),
        RangeMap(1.0, 0, ((low, high, "a"),)),
        RangeMap(2.0, 0, ((low, middle, "a"), (middle + 1, high, "b"))),
    ]
    verdict = unowned_ranges(history, partitions=2, limit=0.5, end=5.0)
    assert verdict.passed and verdict.measures["longest s"] == 0.0


def test_unowned_ranges_catches_slots_no_consumer_owned() -> None:
    low, high = block(0)
    middle = (low + high) // 2
    history: list[Record] = [
        Served(0.0, "b1", 0, 1),
        RangeMap(1.0, 0, ((low, high, "a"),)),
        RangeMap(2.0, 0, ((low, middle, "a"),)),  # b's half not given to anyone until 3.5
        RangeMap(3.5, 0, ((low, middle, "a"), (middle + 1, high, "b"))),
    ]
    verdict = unowned_ranges(history, partitions=2, limit=1.0, end=5.0)
    assert not verdict.passed
    assert verdict.measures["longest s"] == pytest.approx(1.5)
    assert verdict.examples == (
        f"partition 0: slot {middle + 1} had no consumer for 1.500 s from t=2.000 (limit 1.0 s)",
    )


def test_unowned_ranges_counts_a_partition_without_a_broker() -> None:
    low, high = block(1)
    history: list[Record] = [
        Served(0.0, "b1", 1, 1, until=2.0),
        Served(4.0, "b2", 1, 2),
        RangeMap(1.0, 1, ((low, high, "a"),)),
    ]
    verdict = unowned_ranges(history, partitions=2, limit=1.0, end=5.0)
    assert not verdict.passed and verdict.measures["longest s"] == pytest.approx(2.0)


def test_unowned_ranges_counts_only_the_map_of_a_broker_serving_the_partition() -> None:
    """b1 stops serving partition 0 at 2.0 (its map still lists consumers, as a paused zombie's would);
    b2 serves it from 2.0 with no consumer until 3.5: unowned 1.5 s, whatever b1's map says."""
    low, high = block(0)
    history: list[Record] = [
        Served(0.0, "b1", 0, 1, until=2.0),
        Served(2.0, "b2", 0, 2),
        RangeMap(0.5, 0, ((low, high, "a"),), "b1"),
        RangeMap(2.1, 0, (), "b2"),
        RangeMap(3.5, 0, ((low, high, "a"),), "b2"),
    ]
    verdict = unowned_ranges(history, partitions=2, limit=1.0, end=5.0)
    assert not verdict.passed and verdict.measures["longest s"] == pytest.approx(1.5)
    one_map = [record for record in history if not isinstance(record, RangeMap) or record.broker == "b1"]
    # b1's map alone, credited to whichever broker serves (the old per-partition rule), would hide it.
    anonymous = [*history[:2], RangeMap(0.5, 0, ((low, high, "a"),))]
    assert unowned_ranges(anonymous, partitions=2, limit=1.0, end=5.0).passed
    assert not unowned_ranges(one_map, partitions=2, limit=1.0, end=5.0).passed


def test_dead_letter_accounting_wants_every_confirmed_send_acked_or_dead_lettered() -> None:
    good = [*sent("k", 0, 1), *handed("a", "k", (0, 1.0)), *acked("a", "k", (0, 1.5)), DeadLettered(3.0, "k", 1, 0, 1)]
    verdict = dead_letter_accounting(good, ack_timeout=5.0)
    assert verdict.passed
    assert verdict.measures == {"acknowledged": 1, "ack outcome unknown": 0, "dead-lettered": 1, "both": 0}
    refused = [*good[:-1], *handed("a", "k", (1, 2.0)), *acked("a", "k", (1, 2.5), confirmed=False)]
    verdict = dead_letter_accounting(refused, ack_timeout=5.0)
    assert not verdict.passed
    assert verdict.examples == ("key k: value 1 was neither acknowledged nor dead-lettered",)


def test_an_ack_whose_consumer_died_waiting_for_the_answer_counts_as_acknowledged() -> None:
    history = [*sent("k", 0, 1), *handed("a", "k", (0, 1.0), (1, 1.1))]
    history += acked("a", "k", (0, 1.2))
    history.append(Acked(1.3, "a", "k", 1, 0, 1, None))  # sent; a was killed before the answer
    history.append(Fault(1.4, "kill", "a", "start", "SIGKILL"))
    verdict = dead_letter_accounting(history, ack_timeout=5.0, end=2.0)
    assert verdict.passed and verdict.measures["ack outcome unknown"] == 1
    answered = [*history, Acked(1.3, "a", "k", 1, 0, 1, False)]  # the answer came: refused
    assert not dead_letter_accounting(answered, ack_timeout=5.0, end=2.0).passed
    # an unknown outcome is no holding: b may take the key
    assert held_twice([*answered, *handed("b", "k", (1, 1.4)), *acked("b", "k", (1, 1.5))]).passed


def test_an_unanswered_ack_counts_only_once_a_lease_s_time_passed_or_its_consumer_was_killed() -> None:
    """Still on its way at the end (less than the ack timeout and margin ago, its consumer alive): had the
    broker not settled it, the message would come again, so it does not count yet; as the drain says."""
    history = [*sent("k", 0), *handed("a", "k", (0, 1.0)), Acked(1.2, "a", "k", 0, 0, 0, None)]
    early = dead_letter_accounting(history, ack_timeout=5.0, end=3.0)
    assert not early.passed
    assert early.examples == ("key k: value 0 was neither acknowledged nor dead-lettered",)
    assert dead_letter_accounting(history, ack_timeout=5.0, end=7.3).passed  # 6.1 s on: past 5 + 1
    killed_before = [*history, Fault(1.1, "kill", "a", "start", "SIGKILL")]  # a kill before it was sent
    assert not dead_letter_accounting(killed_before, ack_timeout=5.0, end=3.0).passed
    assert settled_unanswered(history, now=3.0, ack_timeout=5.0) == set()
    assert settled_unanswered([*history, Fault(2.0, "kill", "a", "start")], now=3.0, ack_timeout=5.0) == {("k", 0)}


def test_check_all_runs_every_checker_and_fails_only_where_a_violation_is() -> None:
    low, high = block(0, 1)
    history: list[Record] = [
        Served(0.0, "b1", 0, 1),
        RangeMap(0.5, 0, ((low, high, "a"),)),
        *sent("k", 0, 1, t=1.0),
        *handed("a", "k", (0, 2.0), (1, 2.1)),
        *acked("a", "k", (0, 2.2), (1, 2.3)),
    ]
    verdicts = check_all(history, partitions=1, unowned_limit=1.0, ack_timeout=5.0)
    assert [v.checker for v in verdicts] == [
        "lost",
        "unanswered",
        "duplicated",
        "order",
        "two owners",
        "held twice",
        "unowned partitions",
        "unowned ranges",
        "dead-letter accounting",
    ]
    assert all(v.passed for v in verdicts)
    assert verdicts[0].line() == "[PASS] lost: 0 violation(s); confirmed sends 2, lost 0"
    broken = [*history, *sent("k", 2, t=1.0)]
    failed = [v.checker for v in check_all(broken, partitions=1, unowned_limit=1.0, ack_timeout=5.0) if not v.passed]
    assert failed == ["lost", "dead-letter accounting"]


# -- schedule -----------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    first = plan_faults(1, 300.0, ("kill", "suspend", "loss"), ("brokers", "consumers", "coordinator"))
    assert first == plan_faults(1, 300.0, ("kill", "suspend", "loss"), ("brokers", "consumers", "coordinator"))
    assert first != plan_faults(2, 300.0, ("kill", "suspend", "loss"), ("brokers", "consumers", "coordinator"))
    assert {f.kind for f in first} == {"kill", "suspend", "loss"}
    assert {f.target for f in first} == {"brokers", "consumers", "coordinator"}


def test_faults_come_one_at_a_time_inside_the_run_and_suspensions_straddle_the_session() -> None:
    faults = plan_faults(7, 120.0, ("kill", "suspend"), ("brokers",), session_timeout=2.0, warmup=5.0, quiet=3.0)
    assert faults and faults[0].at >= 5.0
    for before, after in itertools.pairwise(faults):
        assert after.at >= before.at + before.length + 3.0
    assert faults[-1].at + faults[-1].length + 3.0 <= 120.0
    assert all(1.0 <= f.length <= 4.0 for f in faults if f.kind == "suspend")
    assert faults[0].describe().startswith(f"t+{faults[0].at:.1f}s {faults[0].kind} brokers[")


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"faults": ()}, "no faults given"),
        ({"faults": ("kill", "flood")}, "unknown faults flood"),
        ({"targets": ("printer",)}, "unknown targets printer"),
        ({"duration": 0.0}, "duration must be a positive"),
        ({"quiet": -1.0}, "quiet must be a number of seconds >= 0"),
        ({"longest": 0.5}, "longest must be at least 1 s"),
    ],
)
def test_bad_schedule_settings_say_what_was_expected(arguments: dict[str, object], says: str) -> None:
    settings: dict[str, object] = {"seed": 1, "duration": 60.0, **arguments}
    with pytest.raises(ScheduleError, match=says):
        plan_faults(**settings)  # type: ignore[arg-type]
