"""The chaos harness: a real cluster on loopback, traffic through it, a seeded fault schedule, every record kept.

:func:`run_chaos` starts ZooKeeper and PostgreSQL (or uses the ones given; with ``store`` among the
targets, a :class:`~keyfailover.tools.services.PatroniGroup` instead of PostgreSQL), ``brokers``
``keyfailover serve --cluster`` processes, a topic of ``partitions``, one producer process and
``consumers`` consumer processes (:mod:`._worker`); applies the faults of
:func:`~._schedule.plan_faults` one at a time; then heals everything, stops the producer, waits
until the consumers acknowledged every confirmed send (or ``drain_timeout`` passed), stops them
and the brokers, and writes every record of the run, sorted by time, to ``records.jsonl`` in its
folder:

- the workers' own records (sends and receipts, deliveries, acks);
- :class:`~._records.Fault` records for every fault, as it starts and ends;
- :class:`~._records.Served` intervals from the brokers' own log lines (``serves`` / ``stops
  serving``); an interval ends at its broker's kill, and a suspension cuts it in two (a
  stopped process does nothing; after SIGCONT it may, until it says it stopped serving);
- :class:`~._records.RangeMap` snapshots of each partition's consumer ranges, polled from each
  broker's admin ``/stats`` every ``POLL`` seconds (each broker on its own thread);
- :class:`~._records.StoreRoles`, with a replicated store: its members' roles as Patroni lists them,
  polled every ``STORE_POLL`` seconds on a thread of its own, written as they change.

A fault on the store hits the member that is its primary when the fault starts (once the group has a
primary and a synchronous standby, waited for up to Patroni's ``ttl``; else the fault is skipped):
``kill`` SIGKILLs its Patroni and PostgreSQL and restarts the member at the fault's end, to rejoin
as a standby; ``suspend`` stops both and continues them; ``loss`` makes every broker's link to it lose
and delay traffic (each broker reaches each member through a proxy of its own).

Every process it started is stopped and (unless ``keep``) its folder removed, after an error,
Ctrl-C or SIGTERM too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.client import HTTPException
from pathlib import Path
from typing import Any, TextIO

from keyfailover.broker.cluster import UNSAFE_NO_LEASE, cluster_status, connect, create_topic
from keyfailover.core.errors import KeyFailoverError
from keyfailover.core.partitions import split_partition_topic
from keyfailover.tools._brokers import read_each
from keyfailover.tools._ownership import lease_events, ownership_events
from keyfailover.tools._signals import sigterm_interrupts
from keyfailover.tools.chaos._checkers import acknowledgements, settled_unanswered
from keyfailover.tools.chaos._proxy import FaultProxy
from keyfailover.tools.chaos._records import (
    Fault,
    Produced,
    RangeMap,
    Record,
    RecordWriter,
    Served,
    StoreRoles,
    from_json,
    read_records,
    store_target,
)
from keyfailover.tools.chaos._schedule import DELAY, FAULTS, LOSS, PlannedFault, heal, lose, plan_faults
from keyfailover.tools.chaos._worker import MUTATIONS
from keyfailover.tools.services import PatroniGroup, PostgreSQL, ZooKeeper, free_port, stop_process

__all__ = ["ChaosError", "ChaosRun", "ChaosSettings", "run_chaos"]

NO_LEASE = "no-lease"
POLL = 0.25
"""Seconds between polls of the brokers' consumer ranges."""
STORE_POLL = 0.5
"""Seconds between polls of the replicated store's members."""
UP = ("running", "streaming")
"""The states Patroni gives a member whose PostgreSQL runs (a standby streaming, in later versions)."""
TOPIC = "chaos"
SUBSCRIPTION = "checked"
START_TIMEOUT = 60.0


class ChaosError(KeyFailoverError, RuntimeError):
    """The chaos run could not be set up or carried out; the message says what and why."""


@dataclass(frozen=True)
class ChaosSettings:
    """What to run and which faults to apply; :meth:`check` says what is wrong with bad values."""

    duration: float = 60.0
    seed: int = 1
    faults: tuple[str, ...] = FAULTS
    targets: tuple[str, ...] = ("brokers", "consumers", "coordinator")
    brokers: int = 3
    partitions: int = 6
    consumers: int = 3
    rate: float = 200.0
    keys: int = 1000
    distribution: str = "zipf"
    session_timeout: float = 2.0
    rebalance_interval: float = 1.0
    ack_timeout: float = 5.0
    drain_timeout: float = 60.0
    store_ttl: int = 10
    """Patroni's ``ttl`` for the replicated store a run with the ``store`` target starts."""
    mutate: str | None = None
    """For the harness's own tests, a guarantee broken on purpose: the first consumer's (``_worker.MUTATIONS``),
    or ``no-lease``: brokers without their lease (a woken broker serves beside its partitions' new owners)."""

    @property
    def unowned_limit(self) -> float:
        """The longest a partition or key range may go without an owner: session + rebalance interval + 2 s."""
        return self.session_timeout + self.rebalance_interval + 2.0

    def check(self) -> None:
        """A ChaosError naming the first setting out of its bounds, before anything starts."""
        positive = {
            "duration": self.duration,
            "rate": self.rate,
            "session_timeout": self.session_timeout,
            "ack_timeout": self.ack_timeout,
            "drain_timeout": self.drain_timeout,
        }
        for name, value in positive.items():
            if not (isinstance(value, int | float) and 0 < value < float("inf")):
                raise ChaosError(f"{name} must be a positive number, not {value!r}")
        if not (isinstance(self.rebalance_interval, int | float) and self.rebalance_interval >= 0):
            raise ChaosError(f"rebalance_interval must be a number >= 0, not {self.rebalance_interval!r}")
        for name, value, least in (
            ("brokers", self.brokers, 1),
            ("partitions", self.partitions, 1),
            ("consumers", self.consumers, 1),
            ("keys", self.keys, 1),
            ("store_ttl", self.store_ttl, 4),
        ):
            if type(value) is not int or value < least:
                raise ChaosError(f"{name} must be an int >= {least}, not {value!r}")
        if self.distribution not in ("zipf", "uniform"):
            raise ChaosError(f"distribution must be zipf or uniform, not {self.distribution!r}")
        if self.mutate is not None and self.mutate not in (*MUTATIONS, NO_LEASE):
            raise ChaosError(f"mutate must be one of {', '.join((*MUTATIONS, NO_LEASE))}, not {self.mutate!r}")
        self.schedule()

    def schedule(self) -> list[PlannedFault]:
        """The run's faults, as :func:`~._schedule.plan_faults` plans them from these settings."""
        return plan_faults(
            self.seed,
            self.duration,
            self.faults,
            self.targets,
            session_timeout=self.session_timeout,
            store_ttl=self.store_ttl,
        )


@dataclass
class ChaosRun:
    """What a run left: its folder, the records (sorted by time) and the schedule it applied."""

    folder: Path
    records: list[Record]
    schedule: list[PlannedFault]
    applied: list[str] = field(default_factory=list)
    """One line per fault as applied (the target resolved), or why it was skipped."""
    started: float = 0.0
    """The monotonic time the schedule's clock started (t+0 of :meth:`PlannedFault.describe`)."""
    ended: float = 0.0
    """The monotonic time the run ended: every consumer stopped, the brokers not yet."""


@dataclass
class _Process:
    """A process of the run that faults may kill, suspend and restart; output appended to ``log``."""

    name: str
    command: list[str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    suspended: bool = False
    env: dict[str, str] = field(default_factory=dict)
    """Set in its environment, beside the harness's own."""

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                start_new_session=True,  # Ctrl-C interrupts the harness, which stops it
            )
        self.suspended = False

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive:
            assert self.process is not None
            self.process.send_signal(signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait()
        self.suspended = False

    def suspend(self) -> None:
        self.signal(signal.SIGSTOP)
        self.suspended = True

    def resume(self) -> None:
        self.signal(signal.SIGCONT)
        self.suspended = False

    def stop(self, timeout: float = 20.0) -> None:
        if self.process is not None:
            self.resume()
            stop_process(self.process, timeout)

    def tail(self, lines: int = 5) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:])


@dataclass
class _Broker(_Process):
    port: int = 0
    """The port clients reach it at: its own, or its client proxy's when links may lose packets."""
    admin: int = 0
    links: list[FaultProxy] = field(default_factory=list)
    """Its client, ZooKeeper and PostgreSQL proxies (none unless the run has loss faults)."""
    zookeeper_link: FaultProxy | None = None
    store_links: dict[str, FaultProxy] = field(default_factory=dict)
    """Its link to each member of the store, by member name (none unless the run has loss faults)."""

    @property
    def stats_url(self) -> str:
        return f"http://127.0.0.1:{self.admin}/stats"

    def stats(self, timeout: float) -> bytes:
        """Its admin endpoint's ``/stats`` (JSON); OSError when it does not answer within ``timeout``."""
        with urllib.request.urlopen(self.stats_url, timeout=timeout) as response:
            body: bytes = response.read()
        return body


class _ZooKeeperProcess:
    """The run's own ZooKeeper as a fault target: killed and restarted on its port and data."""

    def __init__(self, zookeeper: ZooKeeper) -> None:
        self.name = "zookeeper"
        self.zookeeper = zookeeper

    def kill(self) -> None:
        if self.zookeeper.pid is not None:
            os.kill(self.zookeeper.pid, signal.SIGKILL)
        self.zookeeper.stop()

    def start(self) -> None:
        self.zookeeper.start()

    def suspend(self) -> None:
        if self.zookeeper.pid is not None:
            os.kill(self.zookeeper.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.zookeeper.pid is not None:
            os.kill(self.zookeeper.pid, signal.SIGCONT)


class _StoreMember:
    """A member of the replicated store as a fault target: Patroni and its PostgreSQL together, as a machine."""

    def __init__(self, group: PatroniGroup, member: str) -> None:
        self.group = group
        self.member = member
        self.name = store_target(member)
        self.suspended = False

    def kill(self) -> None:
        self.group.kill(self.member)

    def start(self) -> None:
        self.group.restart(self.member)

    def suspend(self) -> None:
        self.group.suspend(self.member)
        self.suspended = True

    def resume(self) -> None:
        if self.suspended:
            self.group.resume(self.member)
        self.suspended = False


Target = _Process | _ZooKeeperProcess | _StoreMember


def run_chaos(
    settings: ChaosSettings,
    out: TextIO = sys.stdout,
    *,
    zookeeper: ZooKeeper | None = None,
    postgres: PostgreSQL | None = None,
    keep: Path | None = None,
    logs: Path | None = None,
) -> ChaosRun:
    """Run the cluster through ``settings``' fault schedule; returns the run's records.

    ``logs``: a folder to copy every process's log and each broker's last ``/stats`` to before the
    run's folder is removed (the report keeps them for diagnosis).

    With ``zookeeper`` and ``postgres`` given (a test session's), the run uses them under a
    root and topic of its own and may not target ZooKeeper; otherwise it starts its own. With
    ``store`` among the targets it starts a Patroni group of two members under the run's root in
    ZooKeeper, and the brokers store in it instead of ``postgres``.
    ``keep``: the folder for the run's data and records, kept; by default a temporary one,
    removed at the end (the records are returned).
    """
    settings.check()
    if zookeeper is not None and "zookeeper" in settings.targets:
        raise ChaosError("a shared ZooKeeper cannot be a fault target; let the run start its own")
    schedule = settings.schedule()
    root = f"/keyfailover-chaos-{uuid.uuid4().hex[:8]}"
    with sigterm_interrupts(), contextlib.ExitStack() as stack:
        if keep is None:
            folder = Path(tempfile.mkdtemp(prefix="keyfailover-chaos-"))
            stack.callback(shutil.rmtree, folder, ignore_errors=True)
        else:
            folder = keep
            folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o711)  # the postgres user must get through to its own folder inside
        if zookeeper is None:
            zookeeper = stack.enter_context(ZooKeeper(folder / "zookeeper"))
        store: PostgreSQL | PatroniGroup
        member_links: dict[str, list[FaultProxy]] = {}
        if "store" in settings.targets:
            out.write(f"starting the replicated store: 2 PostgreSQL under Patroni, ttl {settings.store_ttl} s\n")
            group = PatroniGroup(folder / "store", zookeeper.hosts, namespace=f"{root}/store", ttl=settings.store_ttl)
            if "loss" in settings.faults:
                member_links = _member_links(group, zookeeper, settings.seed, stack)
            store = stack.enter_context(group)
        elif postgres is None:
            store = stack.enter_context(PostgreSQL(folder / "postgresql"))
        else:
            store = postgres
        run = _Run(
            settings,
            folder=folder,
            zookeeper=zookeeper,
            store=store,
            member_links=member_links,
            root=root,
            schedule=schedule,
            out=out,
        )
        try:
            return run.carry_out(stack)
        finally:
            if logs is not None:
                logs.mkdir(parents=True, exist_ok=True)
                for path in [*folder.glob("*.log"), *folder.glob("*.stats.json")]:
                    shutil.copy(path, logs / path.name)
                for path in folder.glob("store/*/patroni.*"):  # each member's Patroni log, and PostgreSQL's
                    shutil.copy(path, logs / f"store-{path.parent.name}-{path.name}")
    raise AssertionError("unreachable")  # pragma: no cover  (mypy: the with block returns)


def _member_links(
    group: PatroniGroup, zookeeper: ZooKeeper, seed: int, stack: contextlib.ExitStack
) -> dict[str, list[FaultProxy]]:
    """A fault proxy on each store member's own links, started and routed before the group starts (closed after
    it stops): its Patroni's link to ZooKeeper, and the others' link to its PostgreSQL (streaming replication
    from it, pg_rewind against it). By member name, ZooKeeper's first."""
    links: dict[str, list[FaultProxy]] = {}
    for number, name in enumerate(group.names):
        proxies: list[FaultProxy] = []
        for upstream in (zookeeper.port, group.ports[name]):
            proxy = FaultProxy(("127.0.0.1", upstream), seed=seed * 1000 + 900 + number * 10 + len(proxies))
            proxies.append(proxy.start())
            stack.callback(proxy.close)
        to_zookeeper, to_postgresql = proxies
        group.reach_through(name, zookeeper=f"127.0.0.1:{to_zookeeper.port}", postgresql=to_postgresql.port)
        links[name] = proxies
    return links


class _Run:
    def __init__(
        self,
        settings: ChaosSettings,
        *,
        folder: Path,
        zookeeper: ZooKeeper,
        store: PostgreSQL | PatroniGroup,
        member_links: dict[str, list[FaultProxy]],
        root: str,
        schedule: list[PlannedFault],
        out: TextIO,
    ) -> None:
        self.settings = settings
        self.folder = folder
        self.zookeeper = zookeeper
        self.store = store
        self.group = store if isinstance(store, PatroniGroup) else None
        self.member_links = member_links
        """Each store member's own links (its Patroni's to ZooKeeper, the others' to its PostgreSQL), by name."""
        self.schedule = schedule
        self.out = out
        self.root = root
        self.topic = f"{TOPIC}-{uuid.uuid4().hex[:8]}"
        self.cluster = f"zk://{zookeeper.hosts}{self.root}"
        self.faults = RecordWriter(folder / "faults.jsonl")
        self.maps = RecordWriter(folder / "ranges.jsonl")
        self.roles = RecordWriter(folder / "store.jsonl")
        self.brokers: list[_Broker] = []
        self.consumers: list[_Process] = []
        self.applied: list[str] = []
        self.clock_offset = time.time() - time.monotonic()
        self._polling = threading.Event()
        self.store_target: _StoreMember | None = None
        """The store member of the last fault on the store: continued if the run ends while it is stopped
        (the group stops a stopped Patroni, but a stopped PostgreSQL's backends would outlive it)."""

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def carry_out(self, stack: contextlib.ExitStack) -> ChaosRun:
        stack.callback(self.faults.close)
        stack.callback(self.maps.close)
        stack.callback(self.roles.close)
        stack.callback(self._continue_store)
        settings = self.settings
        self.say(
            f"keyfailover chaos: {settings.brokers} brokers, {settings.partitions} partitions, "
            f"{settings.consumers} consumers, {settings.rate:g} msgs/s over {settings.keys} {settings.distribution} "
            f"keys, {settings.duration:g} s, seed {settings.seed}, data in {self.folder}"
        )
        for fault in self.schedule:
            self.say(f"  planned: {fault.describe()}")
        self._start_brokers(stack)
        zk = connect(self.zookeeper.hosts)
        try:
            create_topic(zk, self.root, self.topic, settings.partitions)
        finally:
            zk.stop()
            zk.close()
        url = "kf://" + ",".join(f"127.0.0.1:{broker.port}" for broker in self.brokers)  # as advertised
        for number in range(1, settings.consumers + 1):
            name = f"c{number}"
            consumer = self._worker(
                name,
                [
                    *("consume", "--url", url, "--topic", self.topic, "--name", name),
                    *("--subscription", SUBSCRIPTION, "--ack-timeout", f"{settings.ack_timeout:g}"),
                    *(("--mutate", settings.mutate) if settings.mutate in MUTATIONS and number == 1 else ()),
                    *(("--lossy", str(settings.seed * 1000 + 500 + number)) if "loss" in settings.faults else ()),
                ],
            )
            stack.callback(consumer.stop)
            self.consumers.append(consumer)
        producer = self._worker(
            "p1",
            [
                *("produce", "--url", url, "--topic", self.topic, "--name", "p1", "--rate", f"{settings.rate:g}"),
                *("--keys", str(settings.keys), "--distribution", settings.distribution, "--seed", str(settings.seed)),
            ],
        )
        stack.callback(producer.stop)
        pollers = [
            threading.Thread(target=self._poll, args=(broker,), name=f"chaos-ranges-{broker.name}", daemon=True)
            for broker in self.brokers
        ]
        if self.group is not None:
            pollers.append(
                threading.Thread(target=self._watch_store, args=(self.group,), name="chaos-store", daemon=True)
            )
        for poller in pollers:
            poller.start()
            stack.callback(poller.join, 5.0)
        stack.callback(self._polling.set)
        started = time.monotonic()
        self._apply_schedule(started)
        self.say("faults over: stopping the producer, then draining")
        self._check_alive([producer, *self.consumers])
        producer.stop(timeout=90.0)
        self._drain(producer)
        for consumer in self.consumers:
            consumer.stop()
        self._polling.set()
        for poller in pollers:
            poller.join(5.0)
        ended = time.monotonic()
        self._save_stats()
        for broker in self.brokers:
            broker.stop()
        records = self._collect(ended)
        return ChaosRun(self.folder, records, self.schedule, self.applied, started, ended)

    # -- processes ----------------------------------------------------------------------

    def _worker(self, name: str, arguments: list[str]) -> _Process:
        records = self.folder / f"{name}.jsonl"
        command = [sys.executable, "-m", "keyfailover.tools.chaos", *arguments, "--records", str(records)]
        worker = _Process(name, command, self.folder / f"{name}.log")
        worker.start()
        return worker

    def _start_brokers(self, stack: contextlib.ExitStack) -> None:
        settings = self.settings
        for number in range(1, settings.brokers + 1):
            name, port, admin = f"b{number}", free_port(), free_port()
            cluster, dsn, advertised = self.cluster, self.store.dsn, port
            links: list[FaultProxy] = []
            store_links: dict[str, FaultProxy] = {}
            if "loss" in settings.faults:  # every link of the broker through a proxy that can lose packets
                store = self.store
                members = store.ports if isinstance(store, PatroniGroup) else {"postgresql": store.port}
                for upstream in (port, self.zookeeper.port, *members.values()):
                    proxy = FaultProxy(
                        ("127.0.0.1", upstream), seed=settings.seed * 1000 + len(self.brokers) * 10 + len(links)
                    )
                    links.append(proxy.start())
                    stack.callback(proxy.close)
                advertised = links[0].port
                cluster = f"zk://127.0.0.1:{links[1].port}{self.root}"
                store_links = dict(zip(members, links[2:], strict=True))
                hosts = ",".join(f"127.0.0.1:{link.port}" for link in store_links.values())  # in the URL's order
                dsn = urllib.parse.urlsplit(dsn)._replace(netloc=f"kf@{hosts}").geturl()
            command = [
                sys.executable, "-m", "keyfailover", "serve", "--cluster", cluster, "--store", dsn,
                "--port", str(port), "--advertise", f"127.0.0.1:{advertised}", "--broker-id", name,
                "--metrics-port", str(admin), "--cluster-session-timeout", f"{settings.session_timeout:g}",
                "--min-rebalance-interval", f"{settings.rebalance_interval:g}",
                "--ack-timeout", f"{settings.ack_timeout:g}", "--log-level", "info",
            ]  # fmt: skip
            broker = _Broker(
                name,
                command,
                self.folder / f"{name}.log",
                port=advertised,
                admin=admin,
                links=links,
                zookeeper_link=links[1] if links else None,
                store_links=store_links,
                env={UNSAFE_NO_LEASE: "1"} if settings.mutate == NO_LEASE else {},
            )
            broker.start()
            stack.callback(broker.stop)
            self.brokers.append(broker)
        deadline = time.monotonic() + START_TIMEOUT
        for broker in self.brokers:
            while "listening on" not in (broker.log.read_text(errors="replace") if broker.log.exists() else ""):
                if not broker.alive or time.monotonic() > deadline:
                    raise ChaosError(f"broker {broker.name} did not start: {broker.tail()}")
                time.sleep(0.05)

    def _coordinator(self) -> _Broker | str:
        """The coordinating broker, or why none could be told."""
        unknown = "no coordinator could be read from ZooKeeper"
        try:
            zk = connect(self.zookeeper.hosts, timeout=2.0)
        except KeyFailoverError:
            return unknown
        try:
            name = cluster_status(zk, self.root)["coordinator"]
        finally:
            zk.stop()
            zk.close()
        return next((broker for broker in self.brokers if broker.name == name), unknown)

    def _target(self, fault: PlannedFault) -> Target | str:
        """What ``fault`` hits now, or why nothing: the fault is skipped."""
        if fault.target == "brokers":
            return self.brokers[fault.index % len(self.brokers)]
        if fault.target == "consumers":
            return self.consumers[fault.index % len(self.consumers)]
        if fault.target == "coordinator":
            return self._coordinator()
        if fault.target == "store":
            return self._store_primary()
        return _ZooKeeperProcess(self.zookeeper)

    def _store_primary(self) -> _StoreMember | str:
        """The store's primary, once it has a synchronous standby too (waited for up to Patroni's ``ttl``:
        the group is still taking its last fault's member back); when it has none by then, what it has."""
        assert self.group is not None  # a run targeting the store starts a group
        deadline = time.monotonic() + self.settings.store_ttl
        wake = threading.Event()
        while True:
            roles = _roles(self.group.members())
            leaders = [member for member, role, state in roles if role == "leader" and state == "running"]
            if leaders and any(role == "sync_standby" and state in UP for _, role, state in roles):
                self.store_target = _StoreMember(self.group, leaders[0])
                return self.store_target
            if time.monotonic() > deadline:
                return "the store had no primary with a synchronous standby: " + (
                    ", ".join(f"{member} {role} {state}" for member, role, state in roles) or "no member answered"
                )
            wake.wait(STORE_POLL)  # polling Patroni's REST API

    # -- faults -------------------------------------------------------------------------

    def _apply_schedule(self, started: float) -> None:
        wake = threading.Event()  # never set: waits below are the schedule's clock, not synchronisation
        for fault in self.schedule:
            wake.wait(max(started + fault.at - time.monotonic(), 0.0))
            target = self._target(fault)
            if isinstance(target, str):
                self.applied.append(f"{fault.describe()}: skipped ({target})")
                self.say(self.applied[-1])
                continue
            self._fault(fault, target, "start")
            wake.wait(fault.length)
            self._fault(fault, target, "end")
        wake.wait(max(started + self.settings.duration - time.monotonic(), 0.0))

    def _links(self, target: Target) -> list[FaultProxy]:
        """The proxies a loss fault on ``target`` acts on: a broker's own links, every link to ZooKeeper, or a store
        member's links (the brokers' to it, its Patroni's to ZooKeeper, the others' replication from it)."""
        if isinstance(target, _Broker):
            return target.links
        if isinstance(target, _ZooKeeperProcess):
            return [broker.zookeeper_link for broker in self.brokers if broker.zookeeper_link is not None]
        if isinstance(target, _StoreMember):
            member = target.member
            brokers = [broker.store_links[member] for broker in self.brokers if member in broker.store_links]
            return brokers + self.member_links.get(member, [])
        return []

    def _fault(self, fault: PlannedFault, target: Target, action: str) -> None:
        links = self._links(target)
        lossy = f"{len(links)} links" if links else "its links (its own proxies)"
        actions: dict[tuple[str, str], tuple[Callable[[], None], str]] = {
            ("kill", "start"): (target.kill, "SIGKILL"),
            ("kill", "end"): (target.start, "restarted"),
            ("suspend", "start"): (target.suspend, "SIGSTOP"),
            ("suspend", "end"): (target.resume, "SIGCONT"),
            ("loss", "start"): (
                (lambda: lose(links)) if links else (lambda: _signal(target, signal.SIGUSR1)),
                f"{lossy} lose {LOSS:.0%} of segments (TCP resends after 200 ms, doubling) "
                f"and delay {DELAY * 1000:.0f}+-{DELAY * 1000:.0f} ms",
            ),
            ("loss", "end"): ((lambda: heal(links)) if links else (lambda: _signal(target, signal.SIGUSR2)), "healed"),
        }
        act, detail = actions[(fault.kind, action)]
        began = time.monotonic()
        act()
        # a fault starts as it is injected and ends once healed: killing a store member (waiting for its
        # postmaster to go) takes a second or two, in which no write commits
        now = began if action == "start" else time.monotonic()
        self.faults.write(Fault(now, fault.kind, target.name, "start" if action == "start" else "end", detail))
        if action == "start":
            self.applied.append(f"{fault.describe()}: {target.name}")
            self.say(f"  fault: {fault.kind} {target.name} ({detail})")
        else:
            self.say(f"  healed: {target.name} ({detail})")

    # -- recording ----------------------------------------------------------------------

    def _poll(self, broker: _Broker) -> None:
        """Write ``broker``'s range maps as they change, read from its ``/stats`` every ``POLL`` seconds.

        Each broker has a thread of its own, so one that does not answer (stopped, behind a lossy
        link) delays no other broker's records; a record carries the time its answer arrived.
        """
        last: dict[int, tuple[tuple[int, int, str], ...]] = {}
        while not self._polling.wait(POLL):
            if not broker.alive:  # killed: what it serves after its restart is written afresh
                last.clear()
                continue
            if broker.suspended:
                continue
            try:
                stats = json.loads(broker.stats(timeout=0.5))
            except (OSError, ValueError, HTTPException):  # an answer cut short by a kill is an HTTPException
                continue  # starting, dying or stopped: the next poll or another broker tells
            now = time.monotonic()
            maps = _partition_maps(stats, self.topic)
            for partition in [partition for partition in last if partition not in maps]:
                del last[partition]  # it stopped serving the partition: its map owns nothing now
                self.maps.write(RangeMap(now, partition, (), broker.name))
            for partition, ranges in maps.items():
                if last.get(partition) != ranges:
                    last[partition] = ranges
                    self.maps.write(RangeMap(now, partition, ranges, broker.name))

    def _continue_store(self) -> None:
        """SIGCONT the store member of the last fault on the store, if the run ends while it is stopped."""
        if self.store_target is not None:
            self.store_target.resume()

    def _watch_store(self, group: PatroniGroup) -> None:
        """Write the store's members' roles as they change, read from Patroni every ``STORE_POLL`` seconds
        (with the time the answer arrived; a poll no member answers is an empty list)."""
        last: tuple[tuple[str, str, str], ...] | None = None
        while True:
            roles = _roles(group.members())
            if roles != last:
                last = roles
                self.roles.write(StoreRoles(time.monotonic(), roles))
            if self._polling.wait(STORE_POLL):
                return

    @staticmethod
    def _check_alive(workers: list[_Process]) -> None:
        """A worker that exited by itself (not killed by a fault) makes the run meaningless: say which and why."""
        for worker in workers:
            if worker.process is not None and worker.process.poll() is not None:
                raise ChaosError(
                    f"{worker.name} exited by itself with code {worker.process.returncode}: {worker.tail()}"
                )

    def _save_stats(self) -> None:
        """Keep each broker's last ``/stats`` in the run's folder (``b1.stats.json``), for diagnosing a failed
        run; all read at once, so one that does not answer costs the time limit once."""
        answers = read_each({broker.name: broker.stats_url for broker in self.brokers}, timeout=2.0)
        for name, answer in answers.items():
            path = self.folder / f"{name}.stats.json"
            if answer.body is None:
                path.write_text(json.dumps({"error": answer.failure}))
            else:
                path.write_bytes(answer.body)

    def _drain(self, producer: _Process) -> None:
        """Wait until every send the producer had confirmed was acknowledged, or the drain timeout passed.

        An ack the broker confirmed counts; so does one never answered that :func:`settled_unanswered`
        counts (as the dead-letter checker does): had the broker not settled it, the message would have
        come again by then, and its next ack would be waited for.
        """
        receipts = _read(self.folder / f"{producer.name}.jsonl")
        sent = {(p.key, p.value) for p in receipts if isinstance(p, Produced) and p.ok}
        deadline = time.monotonic() + self.settings.drain_timeout
        wake = threading.Event()
        faults: list[Record] = [f for f in _read(self.folder / "faults.jsonl") if isinstance(f, Fault)]  # over
        tails = [_Tail(self.folder / f"{consumer.name}.jsonl") for consumer in self.consumers]
        acks: list[Record] = []
        while True:
            for tail in tails:
                acks += tail.read()
            acked, unknown = acknowledgements(acks)
            unknown &= settled_unanswered([*faults, *acks], time.monotonic(), self.settings.ack_timeout)
            waiting = len(sent - acked - unknown)
            if not waiting:
                self.say(f"drained: all {len(sent)} confirmed sends acknowledged")
                return
            if time.monotonic() > deadline:
                self.say(f"drain timed out: {waiting} of {len(sent)} confirmed sends not acknowledged")
                return
            wake.wait(0.5)  # polling files other processes write

    def _collect(self, ended: float) -> list[Record]:
        """Every record of the run, sorted by time; serving intervals end where the run did (``ended``,
        before the brokers were stopped: their handovers as they shut down are not part of the run)."""
        records: list[Record] = []
        for path in sorted(self.folder.glob("*.jsonl")):
            if path.name != "records.jsonl":
                records += _read(path)
        faults = [record for record in records if isinstance(record, Fault)]
        for broker in self.brokers:
            for served in _served(broker, self.topic, self.clock_offset, faults):
                if served.t < ended:
                    until = ended if served.until is None else min(served.until, ended)
                    records.append(Served(served.t, served.broker, served.partition, served.epoch, until))
        records.sort(key=lambda record: record.t)
        with RecordWriter(self.folder / "records.jsonl") as writer:
            writer.write_all(records)
        return records


def _roles(members: list[dict[str, Any]]) -> tuple[tuple[str, str, str], ...]:
    """``(member, role, state)`` of each member Patroni lists, sorted by member."""
    return tuple(sorted((str(m.get("name")), str(m.get("role", "")), str(m.get("state", ""))) for m in members))


def _signal(target: Target, signum: int) -> None:
    """Signal a worker: a consumer started with ``--lossy`` switches loss on its own links (USR1 on, USR2 off)."""
    if isinstance(target, _Process):
        target.signal(signum)


class _Tail:
    """The records a file another process appends to has gained since the last read (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def read(self) -> list[Record]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as lines:
            lines.seek(self._offset)
            data = lines.read()
        whole = data.rfind(b"\n") + 1  # a line still being written is read next time
        self._offset += whole
        return [from_json(line) for line in data[:whole].decode().splitlines() if line.strip()]


def _read(path: Path) -> list[Record]:
    return list(read_records(path)) if path.exists() else []


def _partition_maps(stats: dict[str, Any], topic: str) -> dict[int, tuple[tuple[int, int, str], ...]]:
    """Each partition's consumer ranges from one broker's ``/stats``."""
    found = {}
    for subscription in stats.get("subscriptions", []):
        parts = split_partition_topic(subscription.get("topic", ""))
        if parts is None or parts[0] != topic or subscription.get("subscription") != SUBSCRIPTION:
            continue
        consumers = subscription.get("dispatcher", {}).get("consumers", {})
        found[parts[1]] = tuple(
            sorted((int(start), int(end), name) for name, state in consumers.items() for start, end in state["ranges"])
        )
    return found


def _served(broker: _Process, topic: str, offset: float, faults: list[Fault]) -> list[Served]:
    """The broker's serving intervals by its own lines, ended at its kills and cut by its suspensions and
    by the times its lease was lapsed (from the lapse it names until it said it resumed)."""
    text = broker.log.read_text(errors="replace") if broker.log.exists() else ""
    mine = [fault for fault in faults if fault.target == broker.name]
    kills = sorted(f.t for f in mine if f.kind == "kill" and f.action == "start")
    stops = sorted(f.t for f in mine if f.kind == "suspend" and f.action == "start")
    conts = sorted(f.t for f in mine if f.kind == "suspend" and f.action == "end")
    suspended = list(zip(stops, conts + [float("inf")] * (len(stops) - len(conts)), strict=True))
    lapsed_at: float | None = None
    for change in lease_events(text):
        if change.lapsed and lapsed_at is None:
            lapsed_at = change.at - offset
        elif not change.lapsed and lapsed_at is not None:
            suspended.append((lapsed_at, change.at - offset))
            lapsed_at = None
    if lapsed_at is not None:
        suspended.append((lapsed_at, float("inf")))
    opened: dict[tuple[int, int], float] = {}
    intervals: list[tuple[int, int, float, float | None]] = []
    for event in ownership_events(text, topic):
        at = event.at - offset
        if event.serves:
            opened[(event.partition, event.epoch)] = at
        elif (event.partition, event.epoch) in opened:
            intervals.append((event.partition, event.epoch, opened.pop((event.partition, event.epoch)), at))
    intervals += [(partition, epoch, start, None) for (partition, epoch), start in opened.items()]
    served = []
    for partition, epoch, start, until in intervals:
        killed = next((kill for kill in kills if kill >= start), None)
        end = until if killed is None or (until is not None and until < killed) else killed
        pieces: list[tuple[float, float | None]] = [(start, end)]
        for stop, cont in suspended:
            pieces = [piece for low, high in pieces for piece in _cut(low, high, stop, cont)]
        served += [Served(low, broker.name, partition, epoch, high) for low, high in pieces]
    return served


def _cut(low: float, high: float | None, stop: float, cont: float) -> Iterator[tuple[float, float | None]]:
    """``[low, high)`` without ``[stop, cont)`` (``high`` None: open-ended)."""
    top = float("inf") if high is None else high
    if cont <= low or stop >= top:
        yield low, high
        return
    if stop > low:
        yield low, stop
    if cont < top:
        yield cont, high
