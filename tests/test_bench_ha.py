"""bench_cluster's replicated-store helpers that compute without a process: the failover summary, the count
of what a store's failovers lost or stored twice, and the URL of a database of the Patroni group."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _ha import HA_TTL, database_url, lost_and_duplicated, summarise_failovers


def test_the_summary_keeps_each_failover_in_kill_order_with_least_median_and_largest() -> None:
    summary = summarise_failovers([10.4, 9.8, 14.9, 10.1, 30.0])
    assert summary.seconds == (10.4, 9.8, 14.9, 10.1, 30.0)
    assert (summary.least, summary.median, summary.largest) == (9.8, 10.4, 30.0)
    assert summary.meets(HA_TTL)  # one slow kill does not move the median past ttl + 5 s


def test_the_bar_is_the_median_within_ttl_plus_the_margin() -> None:
    assert summarise_failovers([14.0, 15.0]).meets(10)
    assert not summarise_failovers([15.0, 15.2]).meets(10)
    assert summarise_failovers([15.0, 15.2]).meets(10, margin=6.0)


def test_no_failover_measured_is_an_error_that_says_so() -> None:
    with pytest.raises(ValueError, match="no store failover was measured; expected at least one kill"):
        summarise_failovers([])


def test_an_acknowledged_message_missing_from_the_store_is_lost_and_an_unacknowledged_one_is_not() -> None:
    stored = [(0, "steady", 100, 0), (1, "steady", 100, 1), (0, "steady", 101, 3)]
    losses = lost_and_duplicated([0, 1, 2], stored)  # 3 stored without its receipt; 2 acknowledged, not stored
    assert (losses.acknowledged, losses.stored, losses.lost) == (3, 3, 1)
    assert (losses.twice_by_sequence, losses.twice_by_payload) == (0, 0)  # seq 100 of two partitions: two messages


def test_a_sequence_id_stored_twice_in_a_partition_counts_and_so_does_a_payload_stored_twice() -> None:
    stored = [(0, "steady", 7, 0), (0, "steady", 7, 0), (0, "steady", 7, 0), (2, "steady", 9, 1), (3, "steady", 4, 1)]
    losses = lost_and_duplicated([0, 1], stored)
    assert losses.lost == 0
    assert losses.twice_by_sequence == 2  # the third row of (0, steady, 7) is a second extra copy
    assert losses.twice_by_payload == 3  # index 0 twice more, index 1 once more under another sequence id


def test_a_database_of_the_group_keeps_every_member_and_the_read_write_attribute() -> None:
    dsn = "postgresql://kf@127.0.0.1:5001,127.0.0.1:5002/keyfailover?target_session_attrs=read-write"
    assert database_url(dsn, "bench_0_3") == (
        "postgresql://kf@127.0.0.1:5001,127.0.0.1:5002/bench_0_3?target_session_attrs=read-write"
    )


def test_a_url_without_a_database_is_refused_with_what_was_expected() -> None:
    with pytest.raises(ValueError, match=r"names no database; expected postgresql://user@hosts/database"):
        database_url("postgresql://kf@127.0.0.1:5001", "bench")
