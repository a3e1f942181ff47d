"""``keyfailover demo --cluster``: a broker of a real cluster is killed under traffic.

It starts Debian's ZooKeeper and PostgreSQL and three brokers (``keyfailover serve --cluster``)
on loopback, all their data in one temporary folder, creates the topic ``accounts`` with six
partitions and runs the demo's account events through it: a producer at a steady rate and
three consumers. Once half of the events are stored it kills the coordinator broker with
SIGKILL and shows its partitions move: the assignment before and after (the cluster's status
in ZooKeeper), when each moved partition was served again (the brokers' own lines) and when
events were stored in and consumed from it again. It ends with the server demo's checks:
every event the cluster confirmed was consumed, none was stored twice, and each account's
events were first delivered in the order produced. Everything it started is stopped and the
folder removed, after an error, Ctrl-C or SIGTERM too.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from keyfailover.broker.cluster import cluster_status, connect, create_topic
from keyfailover.client import Client, ClientClosed, Producer
from keyfailover.core.errors import KeyFailoverError
from keyfailover.tools._ownership import Ownership, ownership_events
from keyfailover.tools._signals import sigterm_interrupts
from keyfailover.tools.demo._report import DemoReport, zipf_ids
from keyfailover.tools.demo._traffic import Observed, Produced, Worker, conclude, wait_for
from keyfailover.tools.services import PostgreSQL, ServiceError, ZooKeeper, free_port, stop_process

__all__ = ["run_cluster_demo"]

TOPIC = "accounts"
PARTITIONS = 6
BROKERS = 3
SESSION_TIMEOUT = 2.0
"""Each broker's ZooKeeper session timeout, seconds: a killed broker's partitions wait about this long."""
RATE = 2_500
"""Events produced per second."""
CONSUMERS = 3
WAIT = 60.0
"""Seconds the demo waits for any one step before it gives up and says which."""
_ROOT = "/keyfailover-demo"


@dataclass
class _Broker:
    """One ``keyfailover serve --cluster`` process; its stderr (the partitions it serves) goes to ``log``."""

    name: str
    address: str
    process: subprocess.Popen[str]
    log: Path

    def tail(self, lines: int = 5) -> str:
        return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])


def run_cluster_demo(
    events: int = 30_000, accounts: int = 2_000, seed: int = 7, out: TextIO = sys.stdout
) -> DemoReport:
    """Run the scenario on a cluster started for it; returns what was observed.

    :class:`ServiceError` before anything starts when ZooKeeper, PostgreSQL or the ``cluster``
    extra (kazoo, asyncpg) is not installed.
    """
    if events < 1000 or accounts < 1:
        raise KeyFailoverError(f"demo needs events >= 1000 and accounts >= 1, got {events} and {accounts}")
    _check_installed()
    account_ids = zipf_ids(events, accounts, seed)
    report = DemoReport()
    observed, produced = Observed(), Produced(PARTITIONS)
    with sigterm_interrupts(), contextlib.ExitStack() as stack:
        folder = Path(tempfile.mkdtemp(prefix="keyfailover-demo-cluster-"))
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        folder.chmod(0o711)  # the postgres user must get through to its own folder inside
        out.write(
            f"keyfailover demo --cluster: starting ZooKeeper, PostgreSQL and {BROKERS} brokers, data in {folder}\n"
        )
        out.flush()
        zookeeper = stack.enter_context(ZooKeeper(folder / "zookeeper"))
        postgresql = stack.enter_context(PostgreSQL(folder / "postgresql"))
        cluster = f"zk://{zookeeper.hosts}{_ROOT}"
        out.write(f"ZooKeeper at {zookeeper.hosts}, PostgreSQL at {postgresql.dsn}\n")
        out.flush()
        brokers = _start_brokers(stack, folder, cluster, postgresql.dsn)
        zk = stack.enter_context(_kazoo(zookeeper.hosts))
        out.write(f"{BROKERS} brokers in cluster {cluster}, ZooKeeper session timeout {SESSION_TIMEOUT:g} s\n")
        out.write(
            f"topic {TOPIC!r} with {PARTITIONS} partitions: {events} events over {accounts} Zipf(1.1) accounts "
            f"at {RATE}/s, {CONSUMERS} consumers\n"
        )
        victim = _scenario(zk, brokers, account_ids, observed=observed, produced=produced, report=report, out=out)
        for broker in brokers:
            stop_process(broker.process)
            if broker.process.returncode != (-signal.SIGKILL if broker is victim else 0):
                report.problems.append(f"broker {broker.name} exited with {broker.process.returncode}: {broker.tail()}")
    conclude(out, report, produced, observed)
    return report


def _check_installed() -> None:
    ZooKeeper.check_installed()
    PostgreSQL.check_installed()
    for module in ("kazoo", "asyncpg"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise ServiceError(
                f"{module} is not installed in {sys.executable}: run scripts/setup dev,cluster"
            ) from None


@contextlib.contextmanager
def _kazoo(hosts: str) -> Iterator[Any]:
    zk = connect(hosts)
    try:
        yield zk
    finally:
        zk.stop()
        zk.close()


def _start_brokers(stack: contextlib.ExitStack, folder: Path, cluster: str, store: str) -> list[_Broker]:
    """Start the brokers together; each is stopped when ``stack`` closes."""
    brokers = []
    for number in range(1, BROKERS + 1):
        name, port = f"b{number}", free_port()
        log = folder / f"{name}.log"
        command = [
            sys.executable, "-m", "keyfailover", "serve", "--cluster", cluster, "--store", store,
            "--port", str(port), "--advertise", f"127.0.0.1:{port}", "--broker-id", name,
            "--cluster-session-timeout", f"{SESSION_TIMEOUT:g}",
        ]  # fmt: skip
        with log.open("w") as errors:
            process = subprocess.Popen(  # its own session: Ctrl-C interrupts the demo, which stops it in turn
                command,
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                start_new_session=True,
            )
        stack.callback(_stop, process)
        brokers.append(_Broker(name, f"127.0.0.1:{port}", process, log))
    for broker in brokers:
        assert broker.process.stdout is not None
        if not broker.process.stdout.readline().startswith("listening on "):
            with contextlib.suppress(subprocess.TimeoutExpired):
                broker.process.wait(timeout=10)  # it exited (its stdout ended): let its last words reach the log
            raise ServiceError(f"broker {broker.name} did not start: {broker.tail()}")
    return brokers


def _stop(process: subprocess.Popen[str]) -> None:
    stop_process(process)
    if process.stdout is not None:
        process.stdout.close()


def _served(brokers: list[_Broker]) -> list[Ownership]:
    """Every partition of the topic the brokers started or stopped serving so far, by time."""
    found = [event for broker in brokers for event in ownership_events(broker.log.read_text(errors="replace"), TOPIC)]
    return sorted(found, key=lambda event: event.at)


def _serving(brokers: list[_Broker]) -> dict[int, str]:
    """Partition -> the live broker serving it now, by the brokers' own lines."""
    live = {broker.name for broker in brokers if broker.process.poll() is None}
    now: dict[int, str] = {}
    for event in _served(brokers):
        if event.serves:
            now[event.partition] = event.broker
        elif now.get(event.partition) == event.broker:
            del now[event.partition]
    return {partition: broker for partition, broker in now.items() if broker in live}


def _status(zk: Any) -> dict[str, Any]:
    return cluster_status(zk, _ROOT)


def _assigned(status: dict[str, Any]) -> dict[int, str]:
    """Partition of the topic -> broker, from a cluster status."""
    return {p["partition"]: p["broker"] for p in status["assignment"]["partitions"] if p["topic"] == TOPIC}


def _print_assignment(
    out: TextIO, title: str, status: dict[str, Any], brokers: list[_Broker], moved: Sequence[int] = ()
) -> None:
    """One line per broker: the partitions it is assigned, those in ``moved`` marked as moved from the killed one."""
    assigned = _assigned(status)
    out.write(
        f"\n{title} (assignment generation {status['assignment']['generation']}, coordinator {status['coordinator']})\n"
    )
    out.write(f"  {'broker':<8}{'address':<18}partitions\n")
    for broker in brokers:
        mine = [f"{p}*" if p in moved else str(p) for p in sorted(assigned) if assigned[p] == broker.name]
        role = "killed" if broker.process.poll() is not None else ""
        role = "coordinator" if broker.name == status["coordinator"] else role
        line = f"  {broker.name:<8}{broker.address:<18}{', '.join(mine) or 'none':<16}{role}"
        out.write(line.rstrip() + "\n")
    if moved:
        out.write("  * moved from the killed broker\n")


def _produce(producer: Producer, produced: Produced, account_ids: list[int], stop: threading.Event) -> None:
    """Send every event at :data:`RATE` per second, until done or ``stop`` is set."""
    start = time.monotonic()
    try:
        for number, account in enumerate(account_ids):
            if number % 100 == 0 and stop.wait(max(0.0, start + number / RATE - time.monotonic())):
                return
            produced.send(producer, f"account-{account}", number)
    except ClientClosed:
        return


def _scenario(
    zk: Any,
    brokers: list[_Broker],
    account_ids: list[int],
    *,
    observed: Observed,
    produced: Produced,
    report: DemoReport,
    out: TextIO,
) -> _Broker:
    """Produce and consume, kill the coordinator halfway and watch its partitions move; returns it."""
    if not wait_for(lambda: len(_status(zk)["brokers"]) == BROKERS, WAIT):
        raise ServiceError(f"the {BROKERS} brokers did not all join the cluster within {WAIT:g} s")
    create_topic(zk, _ROOT, TOPIC, PARTITIONS)

    def balanced() -> bool:
        assigned = _assigned(_status(zk))
        return len(assigned) == PARTITIONS and len(set(assigned.values())) == BROKERS and _serving(brokers) == assigned

    if not wait_for(balanced, WAIT):
        raise ServiceError(f"the {PARTITIONS} partitions of {TOPIC!r} were not all served within {WAIT:g} s")
    events = len(account_ids)
    before = _status(zk)
    _print_assignment(out, "partitions before the kill", before, brokers)
    out.flush()
    stop = threading.Event()
    with Client("kf://" + ",".join(broker.address for broker in brokers)) as client:
        workers = [Worker(client, f"c{number}", observed, 200) for number in range(1, CONSUMERS + 1)]
        producer = client.create_producer(TOPIC, "demo-producer")
        sender = threading.Thread(
            target=_produce, args=(producer, produced, account_ids, stop), name="demo-producer", daemon=True
        )
        sender.start()
        try:
            if not wait_for(lambda: len(produced.stored) >= events // 2, WAIT):
                raise KeyFailoverError(f"only {len(produced.stored)} of {events} events were stored in {WAIT:g} s")
            victim = next(broker for broker in brokers if broker.name == before["coordinator"])
            moved = sorted(p for p, broker in _assigned(before).items() if broker == victim.name)
            victim.process.kill()
            killed = time.time()
            victim.process.wait()
            out.write(
                f"\nkilled {victim.name} (the coordinator; it served partitions {_listed(moved)}) with SIGKILL "
                f"after {len(produced.stored)} of {events} events were stored\n"
            )
            after = _watch_failover(
                zk,
                brokers,
                victim,
                moved=moved,
                killed=killed,
                produced=produced,
                observed=observed,
                report=report,
                out=out,
            )
            _print_assignment(out, "partitions after the kill", after, brokers, moved)
            sender.join(timeout=WAIT + events / RATE)
            producer.flush(timeout=WAIT)
            wait_for(lambda: len(observed.first) >= len(produced.stored), WAIT)
        except KeyboardInterrupt:
            out.write("\ninterrupted: stopping the consumers, the producer, the brokers, PostgreSQL and ZooKeeper\n")
            out.flush()
            raise
        finally:
            stop.set()
            sender.join(timeout=WAIT)
            for worker in workers:
                worker.leave()
    return victim


def _listed(partitions: list[int]) -> str:
    return ", ".join(str(p) for p in sorted(partitions))


def _watch_failover(
    zk: Any,
    brokers: list[_Broker],
    victim: _Broker,
    *,
    moved: list[int],
    killed: float,
    produced: Produced,
    observed: Observed,
    report: DemoReport,
    out: TextIO,
) -> dict[str, Any]:
    """Print what happened after the kill, with the time since, until every moved partition is served
    again and has events stored in it and consumed from it since; returns the cluster status then."""
    lines: list[tuple[float, str]] = [(killed, f"{victim.name} killed")]
    epoch, reassigned = _status(zk)["epoch"], False
    back: dict[int, Ownership] = {}  # the first time each moved partition was served again
    stored: dict[int, float] = {}
    consumed: dict[int, float] = {}
    deadline = time.monotonic() + WAIT
    while not (reassigned and len(back) == len(stored) == len(consumed) == len(moved)):
        if time.monotonic() > deadline:
            report.problems.append(
                f"{WAIT:g} s after the kill, partitions {_listed(moved)} were not all served again with events "
                f"stored and consumed (served: {_listed(list(back))}, stored: {_listed(list(stored))}, "
                f"consumed: {_listed(list(consumed))})"
            )
            break
        time.sleep(0.01)
        now, status = time.time(), _status(zk)
        if status["epoch"] > epoch and status["coordinator"] is not None:  # a coordinator was elected
            epoch = status["epoch"]
            lines.append((now, f"{status['coordinator']} is the coordinator (epoch {epoch})"))
        assigned = _assigned(status)
        if not reassigned and victim.name not in assigned.values():
            reassigned = True
            gone_to = ", ".join(f"{p} to {assigned[p]}" for p in moved)
            lines.append((now, f"assignment generation {status['assignment']['generation']}: partition {gone_to}"))
        for event in _served(brokers):
            if event.serves and event.partition in moved and event.at > killed:
                back.setdefault(event.partition, event)
        with produced.lock, observed.lock:
            for partition, event in back.items():
                if (at := produced.stored_at.first_after(partition, event.at)) is not None:
                    stored[partition] = at
                if (at := observed.received_at.first_after(partition, event.at)) is not None:
                    consumed[partition] = at
    lines += [(e.at, f"{e.broker} serves partition {e.partition} (owner epoch {e.epoch})") for e in back.values()]
    if len(stored) == len(moved):
        lines.append((max(stored.values()), f"events stored in partitions {_listed(moved)} again"))
    if len(consumed) == len(moved):
        lines.append((max(consumed.values()), f"events consumed from partitions {_listed(moved)} again"))
    for at, what in sorted(lines):
        out.write(f"  {at - killed:6.2f} s  {what}\n")
    if len(back) == len(stored) == len(consumed) == len(moved):
        served = max(e.at for e in back.values()) - killed
        flowing = max(*stored.values(), *consumed.values()) - killed
        out.write(
            f"every partition served again {served:.2f} s after the kill; "
            f"events stored in and consumed from each again {flowing:.2f} s after it\n"
        )
    return _status(zk)
