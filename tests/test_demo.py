"""The main job: the scripted demo runs clean and reports what it saw."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from keyfailover.client import Message
from keyfailover.tools import services
from keyfailover.tools._ownership import Ownership
from keyfailover.tools.cli import main
from keyfailover.tools.demo import DemoReport, run_core_demo, run_server_demo
from keyfailover.tools.demo._cluster import _two_owners
from keyfailover.tools.demo._server import console_url
from keyfailover.tools.demo._traffic import Observed, Produced, check_events
from tests.server_process import run_cli, run_main, skip_without_patroni, wait_until


def test_demo_keeps_every_guarantee() -> None:
    out = io.StringIO()
    report = run_core_demo(messages=12_000, keys=800, seed=3, out=out)
    assert report.problems == []
    assert report.published == 12_000
    assert report.acked == report.published
    assert set(report.deliveries) == {"c1", "c2", "c3", "c4"}
    # The stalled consumer's unacked deliveries were redelivered elsewhere after its removal.
    assert report.deliveries["c4"] == 200
    assert report.redeliveries >= 200
    text = out.getvalue()
    assert "final range map" in text
    assert report.status == {"c1": "left", "c4": "stalled, then removed"}
    assert "consumer  hash ranges                    rate/s  unacked  draining  status   first ranges" in text
    assert "nothing lost" in text
    # Each consumer is one line saying how many ranges it owns and its share: the shares of a map add up.
    final = text[text.index("final range map") : text.index("deliveries  status")]
    shares = re.findall(r"^  (c\d) +(\d+) ranges?, +([\d.]+)% of slots", final, re.MULTILINE)
    assert sorted(name for name, _, _ in shares) == ["c2", "c3"]
    assert abs(sum(float(share) for _, _, share in shares) - 100.0) < 0.2


@pytest.mark.integration
def test_core_demo_command_line_exits_zero() -> None:
    done = run_cli("demo", "--core", "--messages", "5000", "--keys", "300")
    assert done.returncode == 0, done.stderr
    assert "c1 starts alone" in done.stdout
    assert "per-key order held" in done.stdout


@pytest.mark.integration
def test_server_demo_consumes_everything_in_key_order_then_lingers_until_stopped() -> None:
    """The scripted run, then a linger of a minute: the server and the last consumers stay up, the console URL
    printed at the start answers, and setting the stop event ends the demo well before the minute."""
    out, stop = io.StringIO(), threading.Event()
    reports: list[DemoReport] = []
    demo = threading.Thread(
        target=lambda: reports.append(
            run_server_demo(events=6_000, accounts=400, seed=5, out=out, linger=60.0, stop=stop)
        )
    )
    demo.start()
    try:
        wait_until(lambda: "keeping the server up for 60 s" in out.getvalue(), "the demo lingers", timeout=180)
        found = re.search(
            r"^console: (http://127\.0\.0\.1:\d+)/ui#/subscription/accounts/ledger$", out.getvalue(), re.M
        )
        assert found is not None, out.getvalue()
        with urllib.request.urlopen(
            found.group(1) + "/ranges?topic=accounts&subscription=ledger", timeout=10
        ) as answer:
            assert {r["consumer"] for r in json.load(answer)["ranges"]} == {"c2", "c3"}
    finally:
        stop.set()
        demo.join(timeout=60)
    assert not demo.is_alive(), "the demo went on lingering after the stop event was set"
    (report,) = reports
    assert report.problems == []
    assert report.published == report.acked == 6_000
    assert set(report.deliveries) <= {"c1", "c2", "c3", "c4"}
    assert {"c1", "c2", "c3"} <= set(report.deliveries)
    # c1 left and the stalled c4 was removed with deliveries unacked: those were redelivered.
    assert report.redeliveries > 0
    text = out.getvalue()
    assert "every event outside its ranges was consumed: True" in text
    assert text.count("console: ") == 2  # at the start, and again as it lingers
    # Five tables, one line per live consumer (it may own several ranges): the shares of each add up.
    tables = re.findall(r"^  consumer  hash ranges +received  status   first ranges\n((?:  c\d .*\n)+)", text, re.M)
    assert [len(table.splitlines()) for table in tables] == [2, 3, 4, 3, 2]
    for table in tables:
        shares = re.findall(r"^  c\d +\d+ ranges?, +([\d.]+)% of slots +\d+  (?:active|stalled) +\[", table, re.M)
        assert len(shares) == len(table.splitlines()) and abs(sum(map(float, shares)) - 100.0) < 0.3, table
    assert report.status == {"c1": "left", "c4": "stalled, then removed"}
    final = text[text.rindex("deliveries  status") :]
    assert "c4" in final and "stalled, then removed" in final
    # The server counts c4 stalled before c1 leaves, and c1's leave gives it no slot (a leave gave the
    # stalled consumer the ranges of the least busy, as its dispatch rate is ~0, until it was removed).
    counted = r"^the server counts c4 stalled after [\d.]+ s \(\d+ unacked, \d+ permits left, no ack\)"
    assert re.search(counted, text, re.M), text
    titles = [title for title, _ in report.steps]
    joined, left = (
        next(i for i, title in enumerate(titles) if title.startswith(who)) for who in ("c4 joins", "c1 leaves")
    )
    assert left == joined + 1
    before, after = report.steps[joined][1]["c4"], report.steps[left][1]["c4"]
    slots = {slot for start, end in before for slot in range(start, end + 1)}
    assert all(slot in slots for start, end in after for slot in range(start, end + 1)), (before, after)
    assert "the stalled c4 gets none" in titles[left]


@pytest.mark.integration
def test_server_demo_command_line_exits_zero() -> None:
    done = run_cli("demo", "--messages", "3000", "--keys", "200", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every event stored was consumed, none twice" in done.stdout
    assert "keeping the server up" not in done.stdout  # no linger by default


def test_the_event_checks_name_each_broken_guarantee() -> None:
    """An event confirmed but never consumed, one stored twice, and an account out of produced order."""
    produced, observed = Produced(partitions=2), Observed()
    received = [  # (account, event number, partition, position)
        ("account-1", 0, 0, 0),
        ("account-1", 1, 0, 1),
        ("account-2", 2, 1, 0),
        ("account-2", 2, 1, 1),  # the same event again at the next position: stored twice
        ("account-3", 5, 0, 2),
        ("account-3", 4, 0, 3),  # event 4 was produced before event 5
    ]
    with produced.lock:
        produced.stored = {(partition, position): (key, n) for key, n, partition, position in received}
        produced.stored[(1, 2)] = ("account-4", 6)  # confirmed, never received
    for key, number, partition, position in received:
        observed.record("c1", Message(key, f"{key}:{number}:0".encode(), position, 0, 1, partition))
    observed.record("c2", Message("account-1", b"account-1:1:0", 1, 1, 2, 0))  # a redelivery is no problem
    report = DemoReport()
    check_events(report, produced, observed)
    assert report.problems == [
        "1 stored events were never consumed, the first: event 6 of account-4 (partition 1, position 2)",
        "event 2 of account-2 was stored twice (at two positions)",
        "account-3: event 4 was first delivered after event 5, which was produced after it",
    ]
    assert (report.published, report.acked, report.redeliveries) == (7, 6, 1)
    assert report.deliveries == {"c1": 6, "c2": 1}


def processes_mentioning(*needles: str) -> list[str]:
    """The command lines of live processes that contain any of ``needles``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # not a process, or one that just ended
            continue
        if any(needle in command for needle in needles):
            found.append(f"{entry.name}: {command}")
    return found


def started(output: str) -> tuple[Path, str]:
    """The demo's temporary folder and its ZooKeeper address, from what it printed."""
    folder = re.search(r"data in (/\S+)", output)
    zookeeper = re.search(r"ZooKeeper at (127\.0\.0\.1:\d+)", output)
    assert folder is not None and zookeeper is not None, output
    return Path(folder.group(1)), zookeeper.group(1)


def assert_nothing_left(folder: Path, *others: str) -> None:
    """No folder, and no process of the demo's: ZooKeeper, the store, the brokers, which name the folder or ``others``
    such as ZooKeeper's address."""
    assert not folder.exists()
    try:
        wait_until(lambda: not processes_mentioning(str(folder), *others), "every process of the demo gone", timeout=10)
    except TimeoutError:
        pytest.fail(f"processes of the demo left 10 s after it ended: {processes_mentioning(str(folder), *others)}")


def assert_broker_failover(text: str) -> None:
    """The cluster demo's broker kill as it printed it: the coordinator's partitions moved to the others."""
    killed = re.search(r"^killed (b\d) \(the coordinator; it served partitions (\d), (\d)\) with SIGKILL", text, re.M)
    assert killed is not None, text
    victim, moved = killed.group(1), {int(killed.group(2)), int(killed.group(3))}
    # The timeline: the new coordinator reassigns the victim's partitions, the survivors serve them.
    assert re.search(r"^ +\d+\.\d\d s  b\d is the coordinator \(epoch 2\)$", text, re.M), text
    assert re.search(r"^ +\d+\.\d\d s  assignment generation \d+: partition \d to b\d, \d to b\d$", text, re.M), text
    served = re.findall(r"^ +\d+\.\d\d s  (b\d) serves partition (\d) \(owner epoch 2\)$", text, re.M)
    assert {int(p) for _, p in served} == moved and victim not in {b for b, _ in served}, text
    again = re.search(
        r"^every partition served again ([\d.]+) s after the kill; .* again ([\d.]+) s after it$", text, re.M
    )
    assert again is not None and 0 < float(again.group(1)) <= float(again.group(2)) < 60, text
    # The assignment before and after, from the cluster's status: the victim's partitions moved to the others.
    after = text[text.index("partitions after the kill") : text.index("* moved from the killed broker")]
    assert re.search(rf"^  {victim} +127\.0\.0\.1:\d+ +none +killed$", after, re.M), after
    assert sorted(int(p) for p in re.findall(r"(\d)\*", after)) == sorted(moved)


def assert_every_check_held(text: str, events: int) -> None:
    """The cluster demo's end: every event stored was consumed once, in order per account, one owner at a time."""
    assert f"stored {events}, consumed {events}" in text
    assert "one owner: no two brokers served a partition at once, by their own lines, until they were stopped" in text
    assert "every event stored was consumed, none twice; each account's events first delivered in produced" in text


@pytest.mark.integration
@pytest.mark.cluster
def test_cluster_demo_without_patroni_says_so_and_kills_a_broker_of_a_single_store_cluster(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(services, "PATRONI", Path("/nonexistent/patroni"))
    assert main(["demo", "--cluster", "--messages", "2000", "--keys", "200"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    text = captured.out
    assert text.splitlines()[0] == (
        "Patroni is not installed (no /nonexistent/patroni): run scripts/setup-system; "
        "without it the store is one PostgreSQL server, with no primary to kill"
    )
    assert re.search(r"^ZooKeeper at 127\.0\.0\.1:\d+, PostgreSQL at postgresql://\S+$", text, re.M), text
    assert_broker_failover(text)
    assert "the store's primary" not in text
    assert_every_check_held(text, 2000)
    assert_nothing_left(*started(text))


@pytest.mark.integration
@pytest.mark.cluster
@pytest.mark.slow
def test_cluster_demo_kills_a_broker_then_the_store_s_primary_and_patroni_promotes_the_standby() -> None:
    skip_without_patroni()
    done = run_cli("demo", "--cluster", "--messages", "3000", "--keys", "200", timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""
    text = done.stdout
    group = r"Patroni group 'kf' at postgresql://kf@127\.0\.0\.1:\d+,127\.0\.0\.1:\d+/keyfailover\?target_session_attrs=read-write"
    assert re.search(
        rf"^ZooKeeper at 127\.0\.0\.1:\d+, {group} \(its state in ZooKeeper under /keyfailover-demo/store", text, re.M
    )
    assert_broker_failover(text)
    # The store's failover: Patroni promotes the synchronous standby, then events are stored on it.
    before = re.search(r"^the store before the kill: (member\d) (\w[\w ]*), (member\d) (\w[\w ]*); ", text, re.M)
    assert before is not None, text
    roles = {before.group(1): before.group(2), before.group(3): before.group(4)}
    assert sorted(roles.values()) == ["primary", "synchronous standby"], roles
    primary = next(name for name, role in roles.items() if role == "primary")
    standby = next(name for name, role in roles.items() if role != "primary")
    killed = re.search(
        rf"^killed {primary} \(the store's primary: Patroni and PostgreSQL\) with SIGKILL after (\d+)", text, re.M
    )
    assert killed is not None and 2000 <= int(killed.group(1)) < 3000, text
    assert re.search(rf"^ +\d+\.\d\d s  {standby} is the primary: Patroni promoted it$", text, re.M), text
    assert re.search(r"^ +\d+\.\d\d s  events stored again: the first sent after the kill acknowledged$", text, re.M)
    failover = re.search(
        rf"^store failover: {standby} the primary ([\d.]+) s after the kill \(Patroni's ttl 10 s\); "
        r"events stored again ([\d.]+) s after it$",
        text,
        re.M,
    )
    assert failover is not None and 0 < float(failover.group(1)) <= float(failover.group(2)) < 60, text
    assert re.search(
        rf"^the store after the kill: {standby} primary: no synchronous standby left, so it commits alone", text, re.M
    )
    assert_every_check_held(text, 3000)
    assert_nothing_left(*started(text))


@pytest.mark.integration
def test_cluster_demo_interrupted_stops_everything_it_started() -> None:
    """Ctrl-C in a terminal: SIGINT to the demo and every process it started (one process group)."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "keyfailover", "demo", "--cluster", "--single-store", "--messages", "2000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert demo.stdout is not None and demo.stderr is not None
    output = ""
    try:
        while "partitions before the kill" not in output:  # the brokers serve, traffic is about to start
            line = demo.stdout.readline()
            assert line, output + demo.stderr.read()
            output += line
        os.killpg(demo.pid, signal.SIGINT)
        rest, errors = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    assert demo.returncode == 130, output + rest + errors
    assert errors == "keyfailover demo: interrupted\n"
    assert_nothing_left(*started(output))


@pytest.mark.integration
def test_cluster_demo_stopped_by_sigterm_while_starting_stops_what_it_started() -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "keyfailover", "demo", "--cluster", "--single-store"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert demo.stdout is not None
    output = demo.stdout.readline() + demo.stdout.readline()  # ZooKeeper and PostgreSQL run; the brokers start
    assert "PostgreSQL at" in output, output
    demo.terminate()
    rest, errors = demo.communicate(timeout=60)
    assert demo.returncode == 130, output + rest + errors
    assert errors == "keyfailover demo: interrupted\n"
    assert_nothing_left(*started(output))


@pytest.mark.integration
@pytest.mark.cluster
@pytest.mark.slow
def test_cluster_demo_stopped_by_sigterm_while_patroni_starts_stops_the_group_too() -> None:
    skip_without_patroni()
    demo = subprocess.Popen(
        [sys.executable, "-m", "keyfailover", "demo", "--cluster"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert demo.stdout is not None
    output = demo.stdout.readline()
    assert "starting ZooKeeper, a Patroni group of 2 PostgreSQL servers and 3 brokers" in output, output
    folder = Path(output.split("data in ")[1].strip())
    store = folder / "store"

    def bootstrapping() -> bool:
        """Both members' Patroni run and one of them has begun its PostgreSQL: the group is half made."""
        running = [store / name / "patroni.json" for name in ("member0", "member1")]
        made = any((store / name / "data").exists() for name in ("member0", "member1"))
        return made and all(processes_mentioning(str(config)) for config in running)

    try:
        wait_until(bootstrapping, "the Patroni group bootstrapping", timeout=60)
    finally:
        demo.terminate()
        rest, errors = demo.communicate(timeout=60)
    assert demo.returncode == 130, output + rest + errors
    assert errors == "keyfailover demo: interrupted\n"
    assert_nothing_left(folder)


@pytest.mark.parametrize(
    ("missing", "said"),
    [
        ("ZOOKEEPER_JAR", r"ZooKeeper is not installed \(no /nonexistent\S*\): run scripts/setup-system"),
        ("POSTGRESQL_BIN", r"PostgreSQL is not installed \(no /nonexistent\S*\): run scripts/setup-system"),
        ("asyncpg", r"asyncpg is not installed in \S+: run scripts/setup dev,cluster"),
    ],
)
def test_cluster_demo_says_what_is_not_installed_and_starts_nothing(
    missing: str, said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if missing == "asyncpg":
        monkeypatch.setitem(sys.modules, "asyncpg", None)  # its import fails
    else:
        monkeypatch.setattr(services, missing, Path("/nonexistent") / missing.lower())
    before = set(Path("/tmp").glob("keyfailover-demo-cluster-*"))
    assert main(["demo", "--cluster"]) == 1
    captured = capsys.readouterr()
    assert re.fullmatch(rf"keyfailover demo: {said}\n", captured.err), captured.err
    assert captured.out == ""
    assert set(Path("/tmp").glob("keyfailover-demo-cluster-*")) == before


@pytest.mark.parametrize(
    ("missing", "said"),
    [
        ("PATRONI", "Patroni is not installed (no /nonexistent/patroni): run scripts/setup-system"),
        (
            "PATRONI_KAZOO",
            "Patroni cannot reach ZooKeeper without Debian's python3-kazoo (no /nonexistent/patroni_kazoo): "
            "run scripts/setup-system",
        ),
    ],
)
def test_the_cluster_demo_names_what_patroni_lacks(missing: str, said: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The line the demo prints before it runs one PostgreSQL server instead of a Patroni group."""
    monkeypatch.setattr(services.PostgreSQL, "check_installed", staticmethod(lambda: None))
    for present in ("PATRONI", "PATRONI_KAZOO"):
        monkeypatch.setattr(services, present, Path(sys.executable))
    monkeypatch.setattr(services, missing, Path("/nonexistent") / missing.lower())
    assert services.PatroniGroup.missing() == said


def test_the_demo_is_of_one_kind(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--core", "--cluster"])
    assert exited.value.code == 2
    assert "argument --cluster: not allowed with argument --core" in capsys.readouterr().err


@pytest.mark.parametrize("kind", [[], ["--core"]])
def test_a_single_store_is_for_the_cluster_demo_only(kind: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *kind, "--single-store"]) == 2
    assert capsys.readouterr().err == (
        "keyfailover demo: --single-store goes with --cluster: only the cluster demo has a store to choose\n"
    )


@pytest.mark.parametrize("kind", [["--core"], ["--cluster"]])
def test_linger_is_for_the_server_demo_only(kind: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *kind, "--linger", "5"]) == 2
    assert capsys.readouterr().err == (
        "keyfailover demo: --linger goes with the server demo (no --core, no --cluster): only it serves the console\n"
    )


@pytest.mark.parametrize("seconds", ["-1", "inf", "soon"])
def test_linger_takes_seconds_from_0(seconds: str) -> None:
    done = run_main("demo", "--linger", seconds)
    assert done.returncode == 2
    assert "argument --linger: expected a" in done.stderr and f"number >= 0, got {seconds!r}" in done.stderr


def test_the_console_url_names_the_subscription_page_with_each_name_encoded() -> None:
    assert console_url("http://127.0.0.1:9650") == "http://127.0.0.1:9650/ui#/subscription/accounts/ledger"
    assert console_url("http://127.0.0.1:9650/", "a b/c", "s#1") == (
        "http://127.0.0.1:9650/ui#/subscription/a%20b%2Fc/s%231"
    )


def test_the_owner_check_finds_two_brokers_serving_a_partition_and_lets_a_killed_one_go() -> None:
    """A killed broker serves nothing after its kill; a live one serves until it says it stops."""
    served = [
        Ownership(1.0, "b1", 0, 1, serves=True),
        Ownership(1.0, "b2", 1, 1, serves=True),
        Ownership(2.0, "b2", 1, 1, serves=False),
        Ownership(2.5, "b3", 1, 2, serves=True),  # after b2 stopped: fine
        Ownership(5.0, "b3", 1, 3, serves=True),  # b3 again: one owner still
        Ownership(6.0, "b2", 1, 4, serves=True),  # b3 never stopped
        Ownership(11.0, "b2", 0, 2, serves=True),  # after b1 was killed: fine
    ]
    assert _two_owners(served, "b1", 10.0) == [
        "partition 1: b2 (owner epoch 4) served it while b3 (owner epoch 3) did too"
    ]
