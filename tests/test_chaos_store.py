"""Chaos on the replicated store: its faults in the schedule, its role changes in the records and the
report, and the checker "writes resumed after the store failover", trusted because it catches a
planted gap that is too long.

The last test is a short seeded run on a real Patroni group: the primary SIGKILLed under traffic,
every checker passing, the promotion on the report's timeline.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest

from keyfailover.tools.chaos import (
    RESUME_MARGIN,
    ChaosSettings,
    Fault,
    PlannedFault,
    Produced,
    Record,
    StoreRoles,
    chaos,
    check_all,
    from_json,
    plan_faults,
    store_failovers,
    to_json,
    writes_resumed,
)
from keyfailover.tools.chaos._measures import run_measures
from keyfailover.tools.chaos._report import write_report
from keyfailover.tools.services import ZooKeeper
from tests.server_process import run_main, skip_without_patroni
from tests.test_chaos import running_commands

TTL = 10.0


def stored(partition: int, sent: float, receipt: float, value: int = 0) -> Produced:
    """A send made at ``sent`` and stored on ``partition``, its receipt at ``receipt``."""
    return Produced(receipt, "p1", f"key-{partition}", value, True, partition, value, sent=sent)


def fault(kind: str, start: float, end: float, member: str = "member0") -> list[Record]:
    """A fault on the store's member ``member`` from ``start`` to ``end``."""
    return [
        Fault(start, kind, f"store:{member}", "start", "SIGKILL"),
        Fault(end, kind, f"store:{member}", "end", "restarted"),
    ]


def steady(partitions: int, until: float, every: float = 0.5) -> list[Record]:
    """Sends to every partition, stored 10 ms after they were made, every ``every`` seconds up to ``until``."""
    found: list[Record] = []
    value = 0
    at = 0.0
    while at < until:
        for partition in range(partitions):
            found.append(stored(partition, at, at + 0.01, value))
            value += 1
        at += every
    return found


def with_outage(records: Sequence[Record], low: float, high: float) -> list[Record]:
    """``records`` with no receipt from ``low`` to ``high``: what was sent then is stored at ``high``."""
    return [
        Produced(high, r.producer, r.key, r.value, True, r.partition, r.position, sent=r.sent)
        if isinstance(r, Produced) and low <= r.t < high
        else r
        for r in records
    ]


def test_writes_resumed_passes_a_kill_after_which_every_partition_writes_within_ttl_plus_the_margin() -> None:
    # the primary killed at t=10, writes stored again at t=22 (12 s, bound 15 s); restarted at t=14
    records = with_outage(steady(3, 40.0), 10.0, 22.0) + fault("kill", 10.0, 14.0)
    verdict = writes_resumed(records, TTL)
    assert verdict.passed, verdict.examples
    (failover,) = store_failovers(records, TTL)
    assert (failover.kind, failover.member, failover.bound, failover.waiting) == ("kill", "member0", 15.0, ())
    assert failover.resumed == pytest.approx(12.0)
    assert verdict.measures["store faults"] == 1


def test_writes_resumed_catches_a_gap_longer_than_the_bound() -> None:
    records = with_outage(steady(3, 40.0), 10.0, 26.5) + fault("kill", 10.0, 14.0)
    verdict = writes_resumed(records, TTL)
    assert not verdict.passed and verdict.violations == 1
    assert "writes resumed on every partition only after 16.500 s (bound 15.0 s)" in verdict.examples[0]


def test_one_slow_partition_is_enough_to_fail() -> None:
    # partition 2 alone waits 20 s; the others resumed at once
    records = steady(3, 40.0)
    late = [r for r in records if isinstance(r, Produced) and r.partition == 2]
    records = [r for r in records if r not in late] + with_outage(late, 10.0, 30.0) + fault("kill", 10.0, 12.0)
    (failover,) = store_failovers(records, TTL)
    assert failover.first == pytest.approx(0.01) and failover.resumed == pytest.approx(20.0)
    assert not writes_resumed(records, TTL).passed


def test_a_receipt_after_the_fault_of_a_send_made_before_it_is_not_a_resumed_write() -> None:
    # a commit acknowledged just after the kill was made before it: writes had not resumed
    records = with_outage(steady(1, 40.0), 10.0, 30.0) + fault("kill", 10.0, 12.0)
    records.append(stored(0, sent=9.99, receipt=10.02, value=10_000))
    (failover,) = store_failovers(records, TTL)
    assert failover.first == pytest.approx(20.0)
    assert not writes_resumed(records, TTL).passed


def test_the_bound_of_a_suspension_or_a_loss_includes_the_fault_s_length() -> None:
    for kind in ("suspend", "loss"):
        records = with_outage(steady(2, 60.0), 10.0, 32.0) + fault(kind, 10.0, 18.0)  # 22 s: bound 10 + 5 + 8
        (failover,) = store_failovers(records, TTL)
        assert failover.bound == pytest.approx(TTL + RESUME_MARGIN + 8.0)
        assert writes_resumed(records, TTL).passed
        too_long = with_outage(steady(2, 60.0), 10.0, 33.5) + fault(kind, 10.0, 18.0)
        assert not writes_resumed(too_long, TTL).passed


def test_a_partition_that_never_writes_again_fails() -> None:
    records = steady(2, 40.0)
    records = [r for r in records if not (isinstance(r, Produced) and r.partition == 1 and (r.sent or 0.0) >= 10.0)]
    records += fault("kill", 10.0, 12.0)
    verdict = writes_resumed(records, TTL)
    assert not verdict.passed
    assert "partitions 1 stored no send made after it by the end of the run" in verdict.examples[0]


def test_faults_on_other_targets_are_not_store_failovers() -> None:
    records = with_outage(steady(2, 40.0), 10.0, 30.0)
    records += [Fault(10.0, "kill", "b1", "start"), Fault(12.0, "kill", "b1", "end")]
    assert store_failovers(records, TTL) == []
    assert writes_resumed(records, TTL).passed


def test_check_all_runs_writes_resumed_only_for_a_run_with_a_replicated_store() -> None:
    records = with_outage(steady(1, 40.0), 10.0, 30.0) + fault("kill", 10.0, 12.0)
    without = check_all(records, partitions=1, unowned_limit=5.0, ack_timeout=5.0)
    assert "writes resumed" not in {v.checker for v in without}
    failed = [v.checker for v in check_all(records, 1, 5.0, 5.0, store_ttl=TTL) if not v.passed]
    assert "writes resumed" in failed


def test_store_roles_and_a_send_s_time_round_trip_through_json_lines() -> None:
    roles = StoreRoles(3.5, (("member0", "leader", "running"), ("member1", "sync_standby", "streaming")))
    assert from_json(to_json(roles)) == roles
    assert from_json(to_json(StoreRoles(4.0, ()))) == StoreRoles(4.0, ())
    send = stored(1, 2.0, 2.5)
    assert from_json(to_json(send)) == send


def test_a_store_kill_or_suspension_lasts_half_to_twice_the_ttl_and_a_store_fault_is_followed_by_a_longer_spell() -> (
    None
):
    for seed in range(20):
        planned = plan_faults(seed, 300.0, ("kill", "suspend", "loss"), ("brokers", "store"), store_ttl=8.0)
        for one, after in itertools.pairwise(planned):
            if one.target == "store":
                assert after.at - (one.at + one.length) >= 5.0 + 8.0 - 0.01  # quiet + ttl
            else:
                assert after.at - (one.at + one.length) >= 5.0 - 0.01
        for one in planned:
            if one.target == "store" and one.kind != "loss":
                assert 4.0 <= one.length <= 16.0
            elif one.kind == "suspend":
                assert 1.0 <= one.length <= 4.0
            else:
                assert 1.0 <= one.length <= 10.0
    assert {f.target for f in plan_faults(1, 300.0, targets=("brokers", "store"))} == {"brokers", "store"}
    assert PlannedFault(5.0, 3.0, "kill", "store", 7).describe() == "t+5.0s kill store for 3.0s"


def test_the_report_lists_role_changes_and_resumption_against_the_bound(tmp_path: Path) -> None:
    records = with_outage(steady(2, 40.0), 10.0, 22.0) + fault("kill", 10.0, 14.0)
    records += [
        StoreRoles(1.0, (("member0", "leader", "running"), ("member1", "sync_standby", "streaming"))),
        StoreRoles(19.5, (("member1", "leader", "running"),)),
        StoreRoles(25.0, (("member0", "sync_standby", "streaming"), ("member1", "leader", "running"))),
    ]
    records.sort(key=lambda record: record.t)
    path = write_report(
        tmp_path,
        command="keyfailover chaos --targets store",
        settings={},
        applied=["t+10.0s kill store for 4.0s: store:member0"],
        verdicts=[writes_resumed(records, TTL)],
        measures=run_measures(records, 0.0, 2),
        strategies=[],
        records=records,
        started=0.0,
        netem="none",
        store_ttl=TTL,
    )
    text = path.read_text()
    assert "## The replicated store" in text
    assert "Bound: ttl 10 s + 5 s = 15 s after a kill" in text
    assert "| t+10.0s kill member0 for 4.0s | 12.000 | 12.000 | 15.0 | yes |" in text
    assert "- t+19.5s: member1 leader running" in text
    assert "| writes resumed | pass | 0 |" in text
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_the_command_line_takes_the_store_target_and_refuses_a_short_ttl() -> None:
    done = run_main("chaos", "--targets", "brokers,store", "--store-ttl", "3")
    assert done.returncode == 2 and "expected an integer >= 4, got '3'" in done.stderr
    done = run_main("chaos", "--targets", "store,disk")
    assert done.returncode == 2 and "zookeeper, store (disk unknown)" in done.stderr


@pytest.mark.slow
def test_a_run_that_kills_the_store_s_primary_passes_every_checker_and_shows_the_promotion(
    tmp_path: Path, zookeeper: ZooKeeper
) -> None:
    skip_without_patroni()
    # seed 7 in 40 s: one kill of the primary, at t+5 s for 14.8 s (ttl 10 s: Patroni promotes the standby)
    settings = ChaosSettings(
        duration=40.0, seed=7, faults=("kill",), targets=("store",), brokers=2, partitions=3, consumers=2,
        rate=50.0, keys=100, drain_timeout=30.0,
    )  # fmt: skip
    (planned,) = settings.schedule()
    assert (planned.kind, planned.target) == ("kill", "store")
    report = tmp_path / "report"
    out = io.StringIO()
    outcome = chaos(settings, report=report, out=out, zookeeper=zookeeper)
    failed = [verdict.line() + " " + "; ".join(verdict.examples) for verdict in outcome.verdicts if not verdict.passed]
    assert failed == [], out.getvalue()
    assert "writes resumed" in {verdict.checker for verdict in outcome.verdicts}
    killed = [r for r in outcome.run.records if isinstance(r, Fault) and r.action == "start"]
    assert [(f.kind, f.target.split(":")[0]) for f in killed] == [("kill", "store")]
    leaders = [
        {member for member, role, _ in r.members if role == "leader"}
        for r in outcome.run.records
        if isinstance(r, StoreRoles)
    ]
    first = next(iter(leaders[0]))
    assert first == killed[0].target.split(":")[1]  # the fault hit the primary of the time
    assert any(found and first not in found for found in leaders)  # then the standby was promoted
    text = (report / "report.md").read_text()
    assert "## The replicated store" in text and "leader running" in text
    assert (report / "timeline.png").exists()
    # nothing it started is left: no Patroni, no PostgreSQL of its store, no folder
    assert not outcome.run.folder.exists()
    assert not [command for command in running_commands() if str(outcome.run.folder) in command]
