"""``keyfailover demo --cluster``: a broker, then the store's primary, killed under traffic.

It starts Debian's ZooKeeper, a Patroni group of two PostgreSQL servers (a primary and a
synchronous standby, Patroni's state in ZooKeeper under the cluster's root) and three brokers
(``keyfailover serve --cluster``, ``--store`` naming both members) on loopback, all their data
in one temporary folder, creates the topic ``accounts`` with six partitions and runs the demo's
account events through it: a producer at a steady rate and three consumers. Once a third of the
events are stored it kills the coordinator broker with SIGKILL and shows its partitions move:
the assignment before and after (the cluster's status in ZooKeeper), when each moved partition
was served again (the brokers' own lines) and when events were stored in and consumed from it
again. Then it kills the store's primary, Patroni and PostgreSQL together as a machine that dies,
and shows Patroni promote the standby and when events were stored again. It ends with the
server demo's checks: every event the cluster confirmed was consumed, none was stored twice, each
account's events were first delivered in the order produced, and no two brokers served a
partition at once. Without Patroni it says what is missing and runs one PostgreSQL server
instead, with no primary to kill (so does ``single_store``). Everything it started is stopped
and the folder removed, after an error, Ctrl-C or SIGTERM too.
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
from collections import defaultdict
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
from keyfailover.tools.demo._traffic import TOPIC, Observed, Produced, Worker, conclude, wait_for
from keyfailover.tools.services import (
    PatroniGroup,
    PostgreSQL,
    ServiceError,
    ZooKeeper,
    free_port,
    stop_process,
)

__all__ = ["run_cluster_demo"]

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
_STORE = f"{_ROOT}/store"
"""Where Patroni keeps the store's state in ZooKeeper: under the cluster's root."""
STORE_MEMBERS = 2
TTL = 10
"""Patroni's leader key lifetime, seconds: a dead primary's standby is promoted about this long after."""


@dataclass
class _Broker:
    """One ``keyfailover serve --cluster`` process; its stderr (the partitions it serves) goes to ``log``."""

    name: str
    address: str
    process: subprocess.Popen[str]
    log: Path
    killed: float | None = None
    """When the demo killed it (wall-clock seconds)."""

    def tail(self, lines: int = 5) -> str:
        return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])


def run_cluster_demo(
    events: int = 30_000,
    accounts: int = 2_000,
    seed: int = 7,
    out: TextIO = sys.stdout,
    *,
    single_store: bool = False,
) -> DemoReport:
    """Run the scenario on a cluster started for it; returns what was observed.

    :class:`ServiceError` before anything starts when ZooKeeper, PostgreSQL or the ``cluster``
    extra (kazoo, asyncpg) is not installed. Without Patroni, or with ``single_store``, the store
    is one PostgreSQL server and only a broker is killed; the first line of ``out`` says why.
    """
    if events < 1000 or accounts < 1:
        raise KeyFailoverError(f"demo needs events >= 1000 and accounts >= 1, got {events} and {accounts}")
    _check_installed()
    missing = None if single_store else PatroniGroup.missing()
    account_ids = zipf_ids(events, accounts, seed)
    report = DemoReport()
    observed, produced = Observed(), Produced(PARTITIONS)
    with sigterm_interrupts(), contextlib.ExitStack() as stack:
        if missing is not None:
            out.write(f"{missing}; without it the store is one PostgreSQL server, with no primary to kill\n")
        folder = Path(tempfile.mkdtemp(prefix="keyfailover-demo-cluster-"))
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        folder.chmod(0o711)  # the postgres user must get through to its own folder inside
        ha = not single_store and missing is None
        what = f"a Patroni group of {STORE_MEMBERS} PostgreSQL servers" if ha else "PostgreSQL"
        out.write(f"keyfailover demo --cluster: starting ZooKeeper, {what} and {BROKERS} brokers, data in {folder}\n")
        out.flush()
        zookeeper = stack.enter_context(ZooKeeper(folder / "zookeeper"))
        group: PatroniGroup | None = None
        if ha:
            group = stack.enter_context(
                PatroniGroup(folder / "store", zookeeper.hosts, members=STORE_MEMBERS, namespace=_STORE, ttl=TTL)
            )
            dsn = group.dsn
            out.write(
                f"ZooKeeper at {zookeeper.hosts}, Patroni group {group.scope!r} at {dsn} "
                f"(its state in ZooKeeper under {_STORE}, ttl {TTL} s, synchronous mode)\n"
            )
        else:
            dsn = stack.enter_context(PostgreSQL(folder / "postgresql")).dsn
            out.write(f"ZooKeeper at {zookeeper.hosts}, PostgreSQL at {dsn}\n")
        out.flush()
        cluster = f"zk://{zookeeper.hosts}{_ROOT}"
        brokers = _start_brokers(stack, folder, cluster, dsn)
        zk = stack.enter_context(_kazoo(zookeeper.hosts))
        out.write(f"{BROKERS} brokers in cluster {cluster}, ZooKeeper session timeout {SESSION_TIMEOUT:g} s\n")
        out.write(
            f"topic {TOPIC!r} with {PARTITIONS} partitions: {events} events over {accounts} Zipf(1.1) accounts "
            f"at {RATE}/s, {CONSUMERS} consumers\n"
        )
        victim = _scenario(
            zk, brokers, account_ids, group=group, observed=observed, produced=produced, report=report, out=out
        )
        stopping = time.time()
        for broker in brokers:
            stop_process(broker.process)
            if broker.process.returncode != (-signal.SIGKILL if broker is victim else 0):
                report.problems.append(f"broker {broker.name} exited with {broker.process.returncode}: {broker.tail()}")
        two_owners = _two_owners(
            [event for event in _served(brokers) if event.at < stopping], victim.name, victim.killed
        )
    report.problems += two_owners
    if not two_owners:
        out.write(
            "\none owner: no two brokers served a partition at once, by their own lines, until they were stopped\n"
        )
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


class _Gate:
    """How far the producer may go: it sends events below ``limit`` and waits there until released further."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._closed = False
        self._changed = threading.Condition()

    def release(self, limit: int) -> None:
        """Let the producer send the events below ``limit``."""
        with self._changed:
            self._limit = limit
            self._changed.notify_all()

    def close(self) -> None:
        """Stop the producer at its next event."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait(self, seconds: float, number: int) -> bool | None:
        """Wait ``seconds``, then until event ``number`` may be sent; None when closed, else whether it was held."""
        with self._changed:
            if self._changed.wait_for(lambda: self._closed, seconds):
                return None
            held = number >= self._limit
            self._changed.wait_for(lambda: self._closed or number < self._limit)
            return None if self._closed else held


def _produce(producer: Producer, produced: Produced, account_ids: list[int], gate: _Gate) -> None:
    """Send every event at :data:`RATE` per second as far as ``gate`` lets it, until done or the gate closes.

    Held at the gate, the producer starts its pace again when released.
    """
    start, first = time.monotonic(), 0
    try:
        for number, account in enumerate(account_ids):
            if number % 100 == 0:
                held = gate.wait(max(0.0, start + (number - first) / RATE - time.monotonic()), number)
                if held is None:
                    return
                if held:
                    start, first = time.monotonic(), number
            produced.send(producer, f"account-{account}", number)
    except ClientClosed:
        return


def _scenario(
    zk: Any,
    brokers: list[_Broker],
    account_ids: list[int],
    *,
    group: PatroniGroup | None,
    observed: Observed,
    produced: Produced,
    report: DemoReport,
    out: TextIO,
) -> _Broker:
    """Produce and consume, kill the coordinator and watch its partitions move, then kill the store's primary
    when there is a Patroni ``group`` and watch it fail over; returns the killed broker."""
    if not wait_for(lambda: len(_status(zk)["brokers"]) == BROKERS, WAIT):
        raise ServiceError(f"the {BROKERS} brokers did not all join the cluster within {WAIT:g} s")
    create_topic(zk, _ROOT, TOPIC, PARTITIONS)

    def balanced() -> bool:
        assigned = _assigned(_status(zk))
        return len(assigned) == PARTITIONS and len(set(assigned.values())) == BROKERS and _serving(brokers) == assigned

    if not wait_for(balanced, WAIT):
        raise ServiceError(f"the {PARTITIONS} partitions of {TOPIC!r} were not all served within {WAIT:g} s")
    events = len(account_ids)
    # With a primary to kill too, the producer stops at two thirds until that kill: events are sent around it.
    held_back = events * 2 // 3 // 100 * 100 if group is not None else events
    before = _status(zk)
    _print_assignment(out, "partitions before the kill", before, brokers)
    out.flush()
    gate = _Gate(held_back)
    with Client("kf://" + ",".join(broker.address for broker in brokers)) as client:
        workers = [Worker(client, f"c{number}", observed, 200) for number in range(1, CONSUMERS + 1)]
        producer = client.create_producer(TOPIC, "demo-producer")
        sender = threading.Thread(
            target=_produce, args=(producer, produced, account_ids, gate), name="demo-producer", daemon=True
        )
        sender.start()
        try:
            if not wait_for(lambda: len(produced.stored) >= held_back // 2, WAIT):
                raise KeyFailoverError(f"only {len(produced.stored)} of {events} events were stored in {WAIT:g} s")
            victim = next(broker for broker in brokers if broker.name == before["coordinator"])
            moved = sorted(p for p, broker in _assigned(before).items() if broker == victim.name)
            victim.process.kill()
            killed = victim.killed = time.time()
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
            if group is not None:
                _store_failover(group, brokers, gate, held_back, events, produced=produced, report=report, out=out)
            sender.join(timeout=WAIT + events / RATE)
            producer.flush(timeout=WAIT)
            wait_for(lambda: len(observed.first) >= len(produced.stored), WAIT)
        except KeyboardInterrupt:
            store = "PostgreSQL" if group is None else "the Patroni group"
            out.write(f"\ninterrupted: stopping the consumers, the producer, the brokers, {store} and ZooKeeper\n")
            out.flush()
            raise
        finally:
            gate.close()
            sender.join(timeout=WAIT)
            for worker in workers:
                worker.leave()
    return victim


def _roles(group: PatroniGroup) -> str:
    """The members Patroni lists and their roles: ``member0 primary, member1 synchronous standby``."""
    names = {"leader": "primary", "sync_standby": "synchronous standby", "replica": "standby"}
    return ", ".join(f"{m['name']} {names.get(m.get('role', ''), m.get('role', '?'))}" for m in group.members())


def _new_primary(group: PatroniGroup, old: str) -> str | None:
    """The member other than ``old`` that Patroni runs as the primary now; None while there is none."""
    for member in group.members():
        if member.get("name") != old and member.get("role") == "leader" and member.get("state") == "running":
            return str(member["name"])
    return None


def _store_failover(
    group: PatroniGroup,
    brokers: list[_Broker],
    gate: _Gate,
    held_back: int,
    events: int,
    *,
    produced: Produced,
    report: DemoReport,
    out: TextIO,
) -> None:
    """Kill the store's primary under traffic: print Patroni's promotion and when events were stored again.

    The producer, held at ``held_back``, is released to halfway through the rest; once half of
    those are stored, with the others in flight, the primary dies: Patroni and PostgreSQL together.
    Only then is the producer released to the end, so the events from halfway on are sent with the
    old primary dead: the first of them acknowledged marks writes resumed.
    """
    if not wait_for(lambda: len(produced.stored) >= held_back, WAIT):
        report.problems.append(f"only {len(produced.stored)} of the first {held_back} events were stored in {WAIT:g} s")
        return
    primary = group.primary()
    out.write(f"\nthe store before the kill: {_roles(group)}; a commit returns once the synchronous standby has it\n")
    halfway = (held_back + events) // 2 // 100 * 100
    gate.release(halfway)
    if not wait_for(lambda: len(produced.stored) >= (held_back + halfway) // 2, WAIT):
        report.problems.append(f"only {len(produced.stored)} of {events} events were stored in {WAIT:g} s")
        return
    stored, killed = len(produced.stored), time.time()
    group.kill(primary)
    gate.release(events)
    out.write(
        f"killed {primary} (the store's primary: Patroni and PostgreSQL) with SIGKILL "
        f"after {stored} of {events} events were stored\n"
    )
    lines: list[tuple[float, str]] = [(killed, f"{primary} killed")]
    promoted: tuple[float, str] | None = None
    resumed: float | None = None
    deadline = time.monotonic() + WAIT
    while promoted is None or resumed is None:
        if time.monotonic() > deadline:
            report.problems.append(
                f"{WAIT:g} s after the store's primary was killed, "
                + ("no member was promoted" if promoted is None else "no event sent since was stored")
            )
            break
        time.sleep(0.05)
        if promoted is None and (name := _new_primary(group, primary)) is not None:
            promoted = (time.time(), name)
            lines.append((promoted[0], f"{name} is the primary: Patroni promoted it"))
        if resumed is None:
            resumed = produced.first_stored_from(halfway, killed)
    if resumed is not None:
        lines.append((resumed, "events stored again: the first sent after the kill acknowledged"))
    lines += [
        (event.at, f"{event.broker} {'serves' if event.serves else 'stops serving'} partition {event.partition}")
        for event in _served(brokers)
        if event.at > killed
    ]
    for at, what in sorted(lines):
        out.write(f"  {at - killed:6.2f} s  {what}\n")
    if promoted is not None and resumed is not None:
        out.write(
            f"store failover: {promoted[1]} the primary {promoted[0] - killed:.2f} s after the kill "
            f"(Patroni's ttl {group.ttl} s); events stored again {resumed - killed:.2f} s after it\n"
        )
        roles = _roles(group)
        if "synchronous standby" not in roles:
            roles += ": no synchronous standby left, so it commits alone (synchronous mode, not strict) until one joins"
        out.write(f"the store after the kill: {roles}\n")


def _two_owners(served: list[Ownership], victim: str, killed: float | None) -> list[str]:
    """A problem for each time two brokers served one partition at once, by the brokers' lines (``served``,
    by time); the broker ``victim``, killed at ``killed``, served nothing after that."""
    serving: dict[int, dict[str, int]] = defaultdict(dict)  # partition -> broker serving it -> its owner epoch
    problems = []
    for event in served:
        now = serving[event.partition]
        if killed is not None and event.at > killed:
            now.pop(victim, None)
        if not event.serves:
            now.pop(event.broker, None)
            continue
        problems += [
            f"partition {event.partition}: {event.broker} (owner epoch {event.epoch}) served it while {other} "
            f"(owner epoch {epoch}) did too"
            for other, epoch in now.items()
            if other != event.broker
        ]
        now[event.broker] = event.epoch
    return problems


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
