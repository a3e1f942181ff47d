"""keyfailover chaos end to end: a seeded run on a real cluster passes every checker, a broken consumer
is caught, and nothing the run started outlives it.

The runs use the test session's ZooKeeper and PostgreSQL (each run under a root and topic of its
own), so they do not target ZooKeeper; ``keyfailover chaos`` on the command line starts its own.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from keyfailover.tools.chaos import ChaosError, ChaosSettings, Fault, Served, chaos, plan_faults
from keyfailover.tools.services import PostgreSQL, ZooKeeper
from tests.server_process import run_main, wait_until


def running_commands() -> list[str]:
    """The command lines of every process of this machine (from /proc)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue  # it ended meanwhile
    return found


def test_a_seeded_chaos_run_passes_every_checker_and_leaves_nothing_behind(
    tmp_path: Path, zookeeper: ZooKeeper, postgres: PostgreSQL
) -> None:
    # seed 6 in 45 s: a consumer killed, the coordinator suspended, a broker suspended past its
    # session (fenced, its lease lapsed), a broker killed and restarted
    settings = ChaosSettings(duration=45.0, seed=6, faults=("kill", "suspend"), rate=150.0)
    kinds = {(fault.kind, fault.target) for fault in plan_faults(6, 45.0, settings.faults, settings.targets)}
    assert {("kill", "consumers"), ("suspend", "coordinator"), ("suspend", "brokers"), ("kill", "brokers")} <= kinds
    before = set(os.listdir("/tmp"))
    report = tmp_path / "report"
    out = io.StringIO()
    outcome = chaos(settings, report=report, out=out, zookeeper=zookeeper, postgres=postgres)
    failed = [verdict.line() + " " + "; ".join(verdict.examples) for verdict in outcome.verdicts if not verdict.passed]
    assert failed == [], out.getvalue()
    assert outcome.passed
    records = outcome.run.records
    assert len([r for r in records if isinstance(r, Fault) and r.action == "start"]) == 4
    assert {r.broker for r in records if isinstance(r, Served)} == {"b1", "b2", "b3"}
    assert outcome.measures.confirmed > 1000 and outcome.measures.delivered == outcome.measures.confirmed
    text = (report / "report.md").read_text()
    assert "Every checker passed." in text and "| held twice | pass | 0 |" in text
    assert (report / "records.jsonl").stat().st_size > 0
    assert {s.strategy for s in outcome.strategies} >= {"keyfailover sticky", "rocketmq-averagely"}
    # nothing it started is left: no process with its folder in its command line, no folder
    assert not outcome.run.folder.exists()
    assert not [command for command in running_commands() if str(outcome.run.folder) in command]
    assert {name for name in set(os.listdir("/tmp")) - before if name.startswith("keyfailover-chaos-")} == set()


@pytest.mark.parametrize(
    ("mutation", "caught"),
    [("drop", {"lost"}), ("reorder", {"order"})],
)
def test_a_consumer_that_breaks_a_guarantee_on_purpose_is_caught(
    mutation: str, caught: set[str], zookeeper: ZooKeeper, postgres: PostgreSQL
) -> None:
    settings = ChaosSettings(
        duration=12.0, seed=2, faults=("suspend",), targets=("consumers",), brokers=1, partitions=2,
        consumers=2, rate=100.0, mutate=mutation,
    )  # fmt: skip
    outcome = chaos(settings, out=io.StringIO(), zookeeper=zookeeper, postgres=postgres)
    assert {verdict.checker for verdict in outcome.verdicts if not verdict.passed} == caught


def test_brokers_without_their_lease_are_caught_serving_beside_the_new_owner(
    zookeeper: ZooKeeper, postgres: PostgreSQL
) -> None:
    """The same fault with the lease off (a test-only switch): a broker suspended past its session
    serves, once woken, beside the broker that took its partitions, and the two-owner checker says so.

    With the lease, the woken broker gets its partition back once the other has taken it: the
    producer, refused by it on the connection it kept, must go on there (the unanswered checker:
    the broker kept refusing it, waiting for a resend of what the other broker had stored)."""
    settings = ChaosSettings(
        duration=20.0, seed=55, faults=("suspend",), targets=("brokers",), brokers=2, partitions=2, consumers=1,
        rate=100.0, session_timeout=1.5, rebalance_interval=0.0,
    )  # fmt: skip
    (suspension,) = plan_faults(55, 20.0, ("suspend",), ("brokers",), session_timeout=1.5)
    # Past the session by as long again: time for the other broker to take over on a loaded machine.
    assert suspension.length > 2.9
    broken = chaos(replace(settings, mutate="no-lease"), out=io.StringIO(), zookeeper=zookeeper, postgres=postgres)
    assert {verdict.checker for verdict in broken.verdicts if not verdict.passed} == {"two owners"}
    kept = chaos(settings, out=io.StringIO(), zookeeper=zookeeper, postgres=postgres)
    assert kept.passed, [verdict.line() for verdict in kept.verdicts if not verdict.passed]  # the failed ones, whole
    assert {served.broker for served in kept.run.records if isinstance(served, Served) and served.epoch == 3} == {"b2"}


def test_bad_settings_say_what_was_expected(zookeeper: ZooKeeper, postgres: PostgreSQL) -> None:
    for settings, says in (
        (ChaosSettings(duration=0.0), "duration must be a positive number"),
        (ChaosSettings(brokers=0), "brokers must be an int >= 1"),
        (ChaosSettings(distribution="pareto"), "distribution must be zipf or uniform"),
        (ChaosSettings(mutate="burn"), "mutate must be one of drop, reorder, no-lease"),
        (ChaosSettings(faults=("flood",)), "unknown faults flood"),
    ):
        with pytest.raises((ChaosError, ValueError), match=says):
            chaos(settings, out=io.StringIO(), zookeeper=zookeeper, postgres=postgres)
    with pytest.raises(ChaosError, match="a shared ZooKeeper cannot be a fault target"):
        chaos(ChaosSettings(targets=("zookeeper",)), out=io.StringIO(), zookeeper=zookeeper, postgres=postgres)


def test_the_command_line_refuses_bad_flags_with_one_line_each() -> None:
    for arguments, says in (
        (["--faults", "kill,flood"], "expected a comma-separated list of kill, suspend, loss (flood unknown)"),
        (["--targets", ""], "expected a comma-separated list of brokers, consumers, coordinator, zookeeper"),
        (["--duration", "0"], "expected a finite number > 0"),
        (["--rebalance-interval", "-1"], "expected a finite number >= 0"),
    ):
        done = run_main("chaos", *arguments)
        assert done.returncode == 2, done.stderr
        assert says in done.stderr and "Traceback" not in done.stderr


def test_chaos_help_names_every_flag() -> None:
    done = run_main("chaos", "--help")
    assert done.returncode == 0, done.stderr
    for flag in ("--duration", "--seed", "--faults", "--targets", "--report", "--keep", "--session-timeout"):
        assert flag in done.stdout


@pytest.mark.integration
def test_sigterm_stops_a_run_and_everything_it_started() -> None:
    """The command line run starts its own ZooKeeper and PostgreSQL; SIGTERM halfway through stops
    every process it started and removes its folder (exit 130, as after Ctrl-C)."""
    command = [sys.executable, "-m", "keyfailover", "chaos", "--duration", "120", "--brokers", "1"]
    command += ["--consumers", "1", "--partitions", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        folder = Path(first.rsplit("data in ", 1)[1].strip())
        wait_until(lambda: "listening on" in _text(folder / "b1.log"), "the broker serving")
        wait_until((folder / "c1.jsonl").exists, "the consumer recording")
        process.terminate()
        assert process.wait(timeout=120) == 130
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not folder.exists()
    assert not [line for line in running_commands() if str(folder) in line]


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
