"""Cluster mode end to end: keyfailover brokers on PostgreSQL (and ZooKeeper) beside the single-node
SQLite server and Redis Streams, then how long a killed broker's partitions stay unserved, and how long
a killed PostgreSQL primary of a replicated store stops writes.

Run: ``python benchmarks/bench_cluster.py [--quick] [--messages N] [--runs N] [--kills N] [--store-kills N]
[--ha-only | --no-ha]``. ``--ha-only`` runs the 3 brokers on one PostgreSQL, the 3 brokers on the
replicated store and part 3; ``--no-ha`` leaves the replicated store out (no Patroni needed).

Part 1, throughput. Each setup runs ``--runs`` times in interleaved rounds (so a burst of load
elsewhere on the machine hits every setup alike) and the run with the median throughput is shown
(the lower middle one for an even number of runs), with the range over all runs:

- keyfailover single node: ``keyfailover serve --data-dir`` (SQLite);
- keyfailover 1 broker and 3 brokers: ``keyfailover serve --cluster zk://... --store postgresql://...``,
  on one ZooKeeper and one PostgreSQL started for the whole benchmark (each run gets a cluster root
  of its own and a fresh database);
- keyfailover 3 brokers on the replicated store: the same, ``--store`` naming both members of a
  Patroni group started for the whole benchmark (2 members, synchronous mode, ttl ``HA_TTL`` s, its
  state in the same ZooKeeper), so a commit returns once the standby has it too;
- Redis Streams: ``redis-server`` with ``appendonly yes``, ``appendfsync always``.

The processes and messages are bench_e2e's (its producers, consumers and checks): the keyfailover
topic has ``PARTITIONS`` partitions (created before the consumers subscribe), the messages are 100
bytes over 10,000 keys, sent by ``PRODUCERS`` producer processes (each sends the messages of its
own keys, batches of 1000, one batch unconfirmed at a time) and taken by 4 consumer processes that
acknowledge each. The p50 and p99 columns are each message's latency from its send to its delivery.
Every message must arrive, and per-key order is checked on every run: a
keyfailover run that breaks it makes the script exit 1 (after the tables). The CPU table says
where the time goes: CPU seconds of the brokers (the server), PostgreSQL (every process of it),
ZooKeeper, the producers and the consumers while messages flowed, on a machine whose cores they
all share.

Part 2, failover. Three brokers with a session timeout of ``SESSION_TIMEOUT`` s serve a topic under
light traffic (a producer sending one message to each partition every 20 ms). ``--kills`` times, a
broker is killed with SIGKILL, the coordinator and the oldest follower in turn; the time from the
kill until every partition is served again is measured: ZooKeeper's assignment (polled every 20 ms)
has every partition on a live broker, and then a probe produce to each partition (a new client,
which looks the partitions up) is stored. The broker is then restarted on the same address, and the
next kill waits until the three share the partitions again. The light traffic's producer should
never see a message refused (its client resends until stored): how many were is reported beside the
goal.

Part 3, store failover. Three brokers on the replicated store serve a topic under steady traffic (a
producer sending one message to each partition every 20 ms through the client's normal path) and a
probe (a producer of its own sending one message at a time, resent by the probe on errors).
``--store-kills`` times, the group's primary is SIGKILLed (Patroni and its PostgreSQL, as a machine
that dies); the time from the kill to the first receipt of a probe message sent after it is the
failover time. The killed member is then restarted, and the next kill waits until it streams as the
synchronous standby again. At the end every message of the steady traffic is read back from the
store: an acknowledged message missing is lost, and a (partition, producer, sequence id) or a payload
stored more than once is stored twice; the goals are the issue's: median failover within ttl + 5 s,
none lost, none stored twice.

ZooKeeper (Debian's ``zookeeper``), PostgreSQL 15, Patroni and ``redis-server`` come from
``scripts/setup-system``; without Redis or Patroni their rows say they were skipped. Timing is printed, never
asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import asyncpg
from _common import format_count, print_goals, print_table, run_setting
from _e2e_traffic import (
    CONSUMERS,
    KEYS,
    PAYLOAD_BYTES,
    TOPIC,
    WINDOW,
    Delivery,
    ServiceCpu,
    System,
    cpu_seconds,
    delivery,
    keyfailover_server,
    redis_missing,
    redis_server,
    run_processes,
)
from _ha import (
    HA_MARGIN,
    HA_TTL,
    INDEX,
    STEADY_PERIOD,
    FailoverProbe,
    HAStore,
    Losses,
    SteadyTraffic,
    lost_and_duplicated,
    summarise_failovers,
)
from bench_e2e import REDIS_ALWAYS

from keyfailover.broker.cluster import cluster_status, connect
from keyfailover.client import Client
from keyfailover.core.partitions import partition_of_key
from keyfailover.tools.services import PatroniGroup, PostgreSQL, ServiceError, ZooKeeper, free_port

PARTITIONS = 6
PRODUCERS = 2
SESSION_TIMEOUT = 2.0
FAILOVER_MARGIN = 2.0  # the bar: every partition served again within the session timeout plus this
FAILOVER_BROKERS = 3
FAILOVER_TOPIC = "bench-failover"
LIGHT_PERIOD = 0.02
POLL = 0.02
WAIT = 60.0


@dataclass(frozen=True)
class Setup:
    """One row: what serves the messages, with how many brokers, and what a stored message survives."""

    label: str
    system: System
    brokers: int  # brokers of a cluster; 0: one server with its own storage
    durability: str
    replicated: bool = False  # the cluster's store is the Patroni group, not the one PostgreSQL


SINGLE = Setup("keyfailover single node (SQLite)", "keyfailover", 0, "fsync per group commit")
ONE_STORE = Setup("keyfailover 3 brokers (PostgreSQL + ZooKeeper)", "keyfailover", 3, "fsync per commit")
REPLICATED = Setup(
    "keyfailover 3 brokers (Patroni: primary + sync standby)",
    "keyfailover",
    3,
    "fsync per commit on 2 servers",
    replicated=True,
)
SETUPS = [
    SINGLE,
    Setup("keyfailover 1 broker (PostgreSQL + ZooKeeper)", "keyfailover", 1, "fsync per commit"),
    ONE_STORE,
    REPLICATED,
    Setup("Redis Streams (appendfsync always)", "redis", 0, "fsync per event-loop iteration"),
]
KINDS = ("brokers", "PostgreSQL", "ZooKeeper")


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """Return once ``condition()`` holds, polling every POLL seconds; SystemExit naming ``what`` past ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not within {timeout:g} s")
        time.sleep(POLL)


def tree_cpu_seconds(root: int) -> float:
    """User plus system CPU seconds of process ``root`` and its live descendants, with those of the
    children they reaped (PostgreSQL's exited backends are in the postmaster's); Linux /proc."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process exited meanwhile: its time is in its parent's reaped-children time
        pid = int(stat.parent.name)
        parents[pid] = int(fields[1])
        ticks[pid] = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    tree = {root}
    grown = True
    while grown:
        below = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= below
        grown = bool(below)
    return sum(ticks.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


# -- the services every cluster shares ------------------------------------------------------


class Services:
    """One ZooKeeper and one PostgreSQL on loopback, for every cluster of the benchmark, and a kazoo
    client to read the clusters' state; each cluster has a root path and a database of its own."""

    def __init__(self) -> None:
        self._folders = [Path(tempfile.mkdtemp(prefix=f"bench_cluster-{name}-")) for name in ("zk", "pg")]
        self.zookeeper = ZooKeeper(self._folders[0])
        self.postgres = PostgreSQL(self._folders[1])  # under /tmp: open to the postgres user
        self.zk: Any = None
        self.postmaster = 0

    def __enter__(self) -> Services:
        try:
            self.zookeeper.start()
            self.postgres.start()
            self.postmaster = int((self.postgres.folder / "data" / "postmaster.pid").read_text().split()[0])
            self.zk = connect(self.zookeeper.hosts)
        except ServiceError as error:
            self.__exit__(None, None, None)
            raise SystemExit(f"cannot start the cluster's services: {error}") from None
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self.zk is not None:
            self.zk.stop()
            self.zk.close()
        self.postgres.stop()
        self.zookeeper.stop()
        for folder in self._folders:
            shutil.rmtree(folder, ignore_errors=True)  # PostgreSQL's is owned by the postgres user when run as root

    def sql(self, statement: str) -> list[Any]:
        """The rows ``statement`` returns."""

        async def run() -> list[Any]:
            connection = await asyncpg.connect(self.postgres.dsn)
            try:
                return list(await connection.fetch(statement))
            finally:
                await connection.close()

        return asyncio.run(run())

    def create_database(self, name: str) -> str:
        """A new, empty database ``name``: its URL."""
        self.sql(f'CREATE DATABASE "{name}"')
        return f"{self.postgres.dsn.rsplit('/', 1)[0]}/{name}"

    def durability(self) -> str:
        """PostgreSQL's settings that decide what a commit survives, as it runs them."""
        names = ("fsync", "synchronous_commit", "wal_sync_method", "full_page_writes")
        return ", ".join(f"{name}={self.sql(f'SHOW {name}')[0][0]}" for name in names)

    def cpu(self) -> dict[str, float]:
        assert self.zookeeper.pid is not None
        return {"PostgreSQL": tree_cpu_seconds(self.postmaster), "ZooKeeper": cpu_seconds(self.zookeeper.pid)}

    def owners(self, root: str, topic: str) -> dict[int, str]:
        """Partition -> the broker ZooKeeper's assignment gives it, for ``topic`` of the cluster at ``root``."""
        partitions = cluster_status(self.zk, root)["assignment"]["partitions"]
        return {p["partition"]: p["broker"] for p in partitions if p["topic"] == topic}

    def live(self, root: str) -> set[str]:
        """The ids of the brokers registered in the cluster at ``root``."""
        return {broker["id"] for broker in cluster_status(self.zk, root)["brokers"]}


class Cluster:
    """Brokers of one cluster (a root path in the ZooKeeper, a database in the PostgreSQL or, given ``ha``,
    in its Patroni group), each started, killed and restarted on its own port; every broker still running
    is stopped at exit."""

    def __init__(self, services: Services, folder: Path, name: str, brokers: int, ha: HAStore | None = None) -> None:
        self.services = services
        self.ha = ha
        self.folder = folder
        self.root = f"/{name}"
        self.zk_url = f"zk://{services.zookeeper.hosts}{self.root}"
        self.store = services.create_database(name) if ha is None else ha.create_database(name)
        self.ports = [free_port() for _ in range(brokers)]
        self._running: dict[int, tuple[contextlib.ExitStack, int]] = {}

    @property
    def address(self) -> str:
        """The client URL naming every broker."""
        return "kf://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def start(self, port: int) -> None:
        folder = self.folder / f"broker-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        args = ("--advertise", f"127.0.0.1:{port}", "--cluster-session-timeout", f"{SESSION_TIMEOUT:g}")
        stack = contextlib.ExitStack()
        server = stack.enter_context(
            keyfailover_server(folder, args, None, port=port, storage=("--cluster", self.zk_url, "--store", self.store))
        )
        self._running[port] = (stack, server.pid)

    def kill(self, port: int) -> None:
        """SIGKILL the broker on ``port``: no shutdown code runs, its ZooKeeper session expires on its own."""
        stack, pid = self._running.pop(port)
        os.kill(pid, signal.SIGKILL)
        stack.close()

    def create_topic(self, topic: str, partitions: int) -> None:
        """``keyfailover topics create`` once every broker registered; returns when the partitions are spread."""
        ids = {f"127.0.0.1:{port}" for port in self.ports}
        wait_until(lambda: self.services.live(self.root) == ids, f"{len(ids)} brokers registered in {self.zk_url}")
        keyfailover_cli("topics", "create", topic, "--partitions", str(partitions), "--cluster", self.zk_url)
        self.wait_spread(topic, partitions, ids)

    def wait_spread(self, topic: str, partitions: int, ids: set[str]) -> None:
        """Until the assignment gives every partition of ``topic`` to one of ``ids``, each a share (±1)."""

        def spread() -> bool:
            counts = Counter(self.services.owners(self.root, topic).values())
            return (
                sum(counts.values()) == partitions
                and set(counts) == ids
                and max(counts.values()) - min(counts.values()) <= 1
            )

        wait_until(spread, f"the partitions of {topic} spread over {sorted(ids)}")

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of its brokers, its ZooKeeper and its store: every member's PostgreSQL when replicated."""
        used = {"brokers": sum(cpu_seconds(pid) for _, pid in self._running.values()), **self.services.cpu()}
        if self.ha is not None:
            used["PostgreSQL"] = sum(tree_cpu_seconds(pid) for pid in self.ha.postmasters())
        return used

    def __enter__(self) -> Cluster:
        try:
            for port in self.ports:
                self.start(port)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        while self._running:
            self._running.popitem()[1][0].close()


def keyfailover_cli(*args: str) -> None:
    """``python -m keyfailover ARGS``; SystemExit with its output when it fails."""
    done = subprocess.run(
        [sys.executable, "-P", "-m", "keyfailover", *args], capture_output=True, text=True, timeout=WAIT, check=False
    )
    if done.returncode:
        raise SystemExit(f"keyfailover {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")


# -- part 1: throughput ---------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """One run of one setup: what its consumers got and the CPU seconds of each kind of process."""

    setup: Setup
    delivery: Delivery
    seconds: float
    cpu: dict[str, float]  # brokers (or the server), PostgreSQL, ZooKeeper, producers, consumers
    other_cores: float


def server_cpu(pid: int) -> ServiceCpu:
    """The CPU seconds of the one server process ``pid``, as the brokers of its row."""
    return lambda: {"brokers": cpu_seconds(pid)}


def run_setup(setup: Setup, services: Services, ha: HAStore | None, count: int, name: str) -> Measured:
    """One run of ``setup`` in fresh storage, ``name`` naming its cluster root and database (in ``ha`` when the
    setup is replicated)."""
    with tempfile.TemporaryDirectory(prefix="bench_cluster-") as temporary, contextlib.ExitStack() as stack:
        folder = Path(temporary)
        if setup.brokers:
            store = ha if setup.replicated else None
            cluster = stack.enter_context(Cluster(services, folder, name, setup.brokers, store))
            cluster.create_topic(TOPIC, PARTITIONS)
            address, service_cpu = cluster.address, cluster.cpu
        else:
            if setup.system == "redis":
                server = stack.enter_context(redis_server(folder, REDIS_ALWAYS.args))
            else:
                server = stack.enter_context(keyfailover_server(folder, ("--metrics-port", "0"), None))
                assert server.admin is not None
                keyfailover_cli("topics", "create", TOPIC, "--partitions", str(PARTITIONS), "--admin-url", server.admin)
            address, service_cpu = server.address, server_cpu(server.pid)
        run = run_processes(setup.system, address, count, WINDOW, service_cpu=service_cpu, producers=PRODUCERS)
    cpu = {**run.service_cpu_seconds, "producers": run.producer_cpu_seconds, "consumers": run.consumer_cpu_seconds}
    return Measured(setup, delivery(run, count, setup.label), run.seconds, cpu, run.other_cores())


def median_runs(
    setups: Sequence[Setup], services: Services, ha: HAStore | None, count: int, runs: int
) -> list[list[Measured]]:
    """Every run of each setup, sorted by throughput; the setups run in interleaved rounds."""
    measured: dict[Setup, list[Measured]] = {setup: [] for setup in setups}
    for round_ in range(runs):
        for index, setup in enumerate(setups):
            measured[setup].append(run_setup(setup, services, ha, count, f"bench_{round_}_{index}"))
    return [sorted(measured[setup], key=lambda m: m.delivery.rate) for setup in setups]


def ratio(measured: Measured, of: Setup, medians: Sequence[Measured]) -> str:
    """The throughput of ``measured`` over that of the median run of ``of``; "-" when ``of`` did not run."""
    base = next((m for m in medians if m.setup == of), None)
    return "-" if base is None else f"{measured.delivery.rate / base.delivery.rate:.2f}x"


def print_throughput(
    count: int,
    runs: int,
    results: Sequence[list[Measured]],
    *,
    skipped: Sequence[tuple[str, str]],
    postgres: str,
    replicated: str | None,
) -> None:
    """The throughput and CPU tables of the median runs, ``skipped`` rows (label, why) last; ``postgres`` and
    ``replicated`` are the durability settings of the one PostgreSQL and of the Patroni group's primary."""
    medians = [every[(len(every) - 1) // 2] for every in results]
    rows = [
        [
            m.setup.label,
            m.setup.durability,
            format_count(m.delivery.rate),
            f"{format_count(every[0].delivery.rate)}-{format_count(every[-1].delivery.rate)}",
            ratio(m, SINGLE, medians),
            ratio(m, ONE_STORE, medians) if m.setup == REPLICATED else "-",
            f"{m.delivery.p50_ms:.0f}",
            f"{m.delivery.p99_ms:.0f}",
            format_count(sum(r.delivery.violations for r in every)),
        ]
        for m, every in zip(medians, results, strict=True)
    ]
    rows += [[label, f"skipped: {why}", *["-"] * 7] for label, why in skipped]
    print_table(
        f"End to end over loopback: {format_count(count)} messages of {PAYLOAD_BYTES} bytes, {KEYS:,} keys, "
        f"keyfailover topic of {PARTITIONS} partitions, {PRODUCERS} producer and {CONSUMERS} consumer processes "
        f"(each message acknowledged) on {os.cpu_count()} cores; median of {runs} run(s); p50/p99: produce to "
        "deliver latency",
        [
            "setup",
            "durability",
            "msgs/s produce+consume",
            "range",
            "vs single-node SQLite",
            "vs 1 PostgreSQL",
            "p50 ms",
            "p99 ms",
            "order violations",
        ],
        rows,
    )
    print(
        "Durability (what a message survives once its producer was told it is stored: power loss, for all):\n"
        "  single node: SQLite WAL, PRAGMA synchronous=FULL; each group commit (the produce batches queued while\n"
        "    the previous commit ran) is fsynced before the receipts go out.\n"
        "  brokers: a broker's group commit per partition is one PostgreSQL transaction (one COPY), answered once\n"
        f"    its commit record is flushed; PostgreSQL 15 ran with {postgres}.\n"
        + (
            "  Patroni: the same transactions on the group's primary, answered once the synchronous standby has\n"
            f"    flushed the commit record too; the primary ran with {replicated}.\n"
            if replicated is not None
            else ""
        )
        + "  Redis: appendonly yes, appendfsync always: the AOF is fsynced in each event-loop iteration before the\n"
        "    replies of that iteration go out.\n"
        "Order violations, over every run: first deliveries of a key taken (by receive time, across consumers)\n"
        "after a later message of that key. keyfailover must have none; Redis Streams hands a key's messages to\n"
        "whichever consumer reads next.\n"
    )
    print_table(
        "Where the time goes: CPU seconds (user + system) of each kind of process in the median run, from the "
        "producers' start to the last message received (wall s); brokers = the server for the single node and "
        "Redis; PostgreSQL = both members' for the Patroni row, without Patroni's own daemons; cores busy = their "
        "total over wall s; other load = cores kept busy meanwhile by processes outside the benchmark",
        ["setup", "wall s", *KINDS, "producers", "consumers", "total", "µs/msg", "cores busy", "other load"],
        [
            [
                m.setup.label,
                f"{m.seconds:.1f}",
                *(f"{m.cpu[kind]:.1f}" if kind in m.cpu else "-" for kind in (*KINDS, "producers", "consumers")),
                f"{sum(m.cpu.values()):.1f}",
                f"{sum(m.cpu.values()) * 1e6 / count:.0f}",
                f"{sum(m.cpu.values()) / m.seconds:.2f}",
                f"{m.other_cores:.2f}",
            ]
            for m in medians
        ],
    )


# -- part 2: failover -----------------------------------------------------------------------


class LightTraffic:
    """A thread sending one message to each of ``keys`` every LIGHT_PERIOD seconds, counting what was
    stored and what was refused."""

    def __init__(self, client: Client, topic: str, keys: Sequence[str]) -> None:
        self._producer = client.create_producer(topic, "light-traffic")
        self._keys = keys
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.stored = 0
        self.failed: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="light-traffic", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(LIGHT_PERIOD):
            for key in self._keys:
                self._producer.send_async(b"light", key, self._done)

    def _done(self, _position: int | None, error: BaseException | None) -> None:
        with self._lock:
            if error is None:
                self.stored += 1
            else:
                self.failed.append(error)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=WAIT)
        self._producer.flush(timeout=WAIT)


@dataclass(frozen=True)
class Kill:
    """One SIGKILLed broker: who, whether it coordinated, what it served, and the seconds from the kill
    until the assignment had every partition on a live broker and until every partition stored a probe."""

    victim: str
    coordinator: bool
    partitions: int
    reassigned: float
    served: float


def partition_keys(partitions: int) -> list[str]:
    """A key of each partition, in partition order."""
    keys: dict[int, str] = {}
    tried = 0
    while len(keys) < partitions:
        keys.setdefault(partition_of_key(f"key-{tried}", partitions), f"key-{tried}")
        tried += 1
    return [keys[p] for p in range(partitions)]


def probe(address: str, topic: str, keys: Sequence[str]) -> None:
    """A produce to each of ``keys`` (one per partition) through a new client, confirmed."""
    with Client(address) as client:
        producer = client.create_producer(topic, "probe")
        for key in keys:
            producer.send_async(b"probe", key)
        producer.flush(timeout=WAIT)


def failovers(services: Services, kills: int) -> tuple[list[Kill], LightTraffic]:
    """``kills`` brokers of three killed in turn under light traffic, each restarted once measured."""
    keys = partition_keys(PARTITIONS)
    with (
        tempfile.TemporaryDirectory(prefix="bench_cluster-") as folder,
        Cluster(services, Path(folder), "bench_failover", FAILOVER_BROKERS) as cluster,
    ):
        cluster.create_topic(FAILOVER_TOPIC, PARTITIONS)
        probe(cluster.address, FAILOVER_TOPIC, keys)
        with Client(cluster.address) as client:
            traffic = LightTraffic(client, FAILOVER_TOPIC, keys)
            measured = [failover(cluster, kill % 2 == 0, keys) for kill in range(kills)]
            traffic.stop()
    return measured, traffic


def failover(cluster: Cluster, coordinator: bool, keys: Sequence[str]) -> Kill:
    """Kill the coordinator (or the oldest follower, next in line), measure until every partition is served
    again, restart it on its address, and return once the brokers share the partitions again."""
    services = cluster.services
    status = cluster_status(services.zk, cluster.root)
    victim = status["brokers"][0 if coordinator else 1]["id"]
    port = int(victim.rsplit(":", 1)[1])
    ids = {f"127.0.0.1:{p}" for p in cluster.ports}
    survivors = ids - {victim}
    owned = sum(p["broker"] == victim for p in status["assignment"]["partitions"])

    def reassigned() -> bool:
        owners = services.owners(cluster.root, FAILOVER_TOPIC)
        return len(owners) == PARTITIONS and set(owners.values()) <= survivors & services.live(cluster.root)

    killed = time.monotonic()
    cluster.kill(port)
    wait_until(reassigned, f"the partitions of {victim} reassigned")
    reassigned_after = time.monotonic() - killed
    probe("kf://" + ",".join(sorted(survivors)), FAILOVER_TOPIC, keys)
    served_after = time.monotonic() - killed
    cluster.start(port)
    cluster.wait_spread(FAILOVER_TOPIC, PARTITIONS, ids)
    probe(cluster.address, FAILOVER_TOPIC, keys)
    return Kill(victim, coordinator, owned, reassigned_after, served_after)


def print_failovers(kills: Sequence[Kill], traffic: LightTraffic) -> list[tuple[str, str, bool]]:
    print_table(
        f"Failover: {FAILOVER_BROKERS} brokers, topic of {PARTITIONS} partitions, --cluster-session-timeout "
        f"{SESSION_TIMEOUT:g} s, light traffic (a message to each partition every {LIGHT_PERIOD * 1000:.0f} ms); "
        "seconds from the SIGKILL",
        ["kill", "victim", "coordinator", "its partitions", "reassigned in ZooKeeper s", "every partition served s"],
        [
            [
                str(i + 1),
                k.victim,
                "yes" if k.coordinator else "no",
                str(k.partitions),
                f"{k.reassigned:.2f}",
                f"{k.served:.2f}",
            ]
            for i, k in enumerate(kills)
        ],
    )
    served = [k.served for k in kills]
    bar = SESSION_TIMEOUT + FAILOVER_MARGIN
    print(
        f"Every partition served again after a kill: median {statistics.median(served):.2f} s, max {max(served):.2f} s "
        f"(session timeout {SESSION_TIMEOUT:g} s).\nLight traffic meanwhile: {format_count(traffic.stored)} "
        f"messages stored, {len(traffic.failed)} refused"
        + (f" ({Counter(str(error) for error in traffic.failed).most_common(1)[0][0]})" if traffic.failed else "")
        + ".\n"
    )
    return [
        (
            f"failover <= session timeout + {FAILOVER_MARGIN:g} s = {bar:g} s (max of {len(kills)} kills)",
            f"{max(served):.2f} s",
            max(served) <= bar,
        ),
        (
            "no light-traffic produce refused (its client resends until stored)",
            str(len(traffic.failed)),
            not traffic.failed,
        ),
    ]


# -- part 3: store failover ---------------------------------------------------------------


@dataclass(frozen=True)
class StoreKill:
    """One SIGKILLed primary of the Patroni group: which member, which one Patroni promoted, the seconds from the
    kill to the first write acknowledged on the new primary, and from the killed member's restart until it
    streamed as the synchronous standby again."""

    victim: str
    promoted: str
    seconds: float
    back: float


@dataclass(frozen=True)
class StoreFailovers:
    """The kills of part 3, what the steady traffic's client was told and what the store holds of it."""

    kills: list[StoreKill]
    losses: Losses
    sent: int
    refused: int
    first_refusal: str | None
    probe_refused: int


def store_failovers(services: Services, ha: HAStore, kills: int) -> StoreFailovers:
    """``kills`` primaries of the Patroni group killed in turn under steady traffic through three brokers, each
    restarted once measured; then every message of the steady traffic read back from the store."""
    keys = partition_keys(PARTITIONS)
    name = "bench_store_failover"
    with (
        tempfile.TemporaryDirectory(prefix="bench_cluster-") as folder,
        Cluster(services, Path(folder), name, FAILOVER_BROKERS, ha) as cluster,
    ):
        cluster.create_topic(FAILOVER_TOPIC, PARTITIONS)
        probe(cluster.address, FAILOVER_TOPIC, keys)
        with Client(cluster.address) as client:
            traffic = SteadyTraffic(client, FAILOVER_TOPIC, keys, "steady-traffic")
            watcher = FailoverProbe(cluster.address, FAILOVER_TOPIC, keys, POLL)
            try:
                measured = [store_failover(ha.group, watcher) for _ in range(kills)]
            except ServiceError as error:
                raise SystemExit(f"the Patroni group did not fail over and come back as expected: {error}") from None
            finally:
                watcher.stop()
                traffic.stop(WAIT)
        rows = ha.fetch(
            name,
            "SELECT partition, producer, seq, payload FROM kf_messages WHERE topic = $1 AND producer = $2",
            FAILOVER_TOPIC,
            traffic.name,
        )
    stored = [(row[0], row[1], row[2], INDEX.unpack(row[3])[0]) for row in rows]
    losses = lost_and_duplicated(traffic.acknowledged, stored)
    return StoreFailovers(measured, losses, traffic.sent, traffic.refused, traffic.first_refusal, watcher.refused)


def store_failover(group: PatroniGroup, watcher: FailoverProbe) -> StoreKill:
    """Kill the primary, measure until a write begun after the kill is acknowledged, restart the killed member and
    return once it streams as the synchronous standby again."""
    victim = group.wait_until_ready()
    killed = group.kill(victim)  # the instant it was frozen, then killed: a write begun after it meets no old primary
    wait_until(lambda: watcher.first_ack_after(killed) is not None, "a write acknowledged after the primary's kill")
    acked = watcher.first_ack_after(killed)
    assert acked is not None
    promoted = group.primary()
    restarted = time.monotonic()
    group.restart(victim)
    group.wait_until_ready()
    return StoreKill(victim, promoted, acked - killed, time.monotonic() - restarted)


def print_store_failovers(done: StoreFailovers) -> list[tuple[str, str, bool]]:
    """The table of the store failovers and their summary; the goals they are held to."""
    print_table(
        f"Store failover: a Patroni group of 2 members (synchronous mode, ttl {HA_TTL} s, loop_wait 1 s), "
        f"{FAILOVER_BROKERS} brokers, topic of {PARTITIONS} partitions, steady traffic (a message to each "
        f"partition every {STEADY_PERIOD * 1000:.0f} ms) and a probe (one message at a time, resent on errors); "
        "seconds from the primary's SIGKILL to the first probe message sent after it and acknowledged",
        ["kill", "killed primary", "promoted", "first write acknowledged s", "standby streaming again s"],
        [[str(i + 1), k.victim, k.promoted, f"{k.seconds:.2f}", f"{k.back:.1f}"] for i, k in enumerate(done.kills)],
    )
    summary = summarise_failovers([k.seconds for k in done.kills])
    losses = done.losses
    refused = f"{format_count(done.refused)} refused" + (f" (the first: {done.first_refusal})" if done.refused else "")
    twice = max(losses.twice_by_sequence, losses.twice_by_payload)
    print(
        f"Store failover, kill to first write acknowledged: min {summary.least:.2f} s, median {summary.median:.2f} s, "
        f"max {summary.largest:.2f} s (ttl {HA_TTL} s).\n"
        f"Steady traffic meanwhile (the client's normal path): {format_count(done.sent)} sent, "
        f"{format_count(losses.acknowledged)} acknowledged, {refused}; the probe's sends refused: "
        f"{format_count(done.probe_refused)}.\n"
        f"Read back from the store: {format_count(losses.stored)} stored; acknowledged but lost: {losses.lost}; "
        f"stored twice: {losses.twice_by_sequence} by (partition, producer, sequence id), "
        f"{losses.twice_by_payload} by payload.\n"
    )
    bar = HA_TTL + HA_MARGIN
    return [
        (
            f"store failover <= ttl + {HA_MARGIN:g} s = {bar:g} s (median of {len(done.kills)} kills)",
            f"{summary.median:.2f} s",
            summary.meets(HA_TTL),
        ),
        ("no acknowledged message lost across the primary kills", str(losses.lost), losses.lost == 0),
        ("no message stored twice across the primary kills", str(twice), twice == 0),
    ]


def main() -> None:
    """Parse the options, run the parts they ask for and print their tables and goals."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small run that finishes in one to two minutes")
    parser.add_argument("--messages", type=int, default=None, help="messages per run (default 100,000; 2,000 quick)")
    parser.add_argument("--runs", type=int, default=None, help="runs per setup, the median shown (default 3; 1 quick)")
    parser.add_argument("--kills", type=int, default=None, help="brokers killed in part 2 (default 5; 1 quick)")
    parser.add_argument(
        "--store-kills", type=int, default=None, help="store primaries killed in part 3 (default 5; 1 quick)"
    )
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--ha-only",
        action="store_true",
        help="only the replicated store: its row beside the 3 brokers on one PostgreSQL, and part 3",
    )
    only.add_argument("--no-ha", action="store_true", help="without the replicated store: no Patroni row, no part 3")
    options = parser.parse_args()
    count = options.messages or (2_000 if options.quick else 100_000)
    runs = options.runs or (1 if options.quick else 3)
    kills = options.kills or (1 if options.quick else 5)
    store_kills = options.store_kills or (1 if options.quick else 5)
    if count < 1 or runs < 1 or kills < 1 or store_kills < 1:
        parser.error("--messages, --runs, --kills and --store-kills must be positive")

    print(f"keyfailover: {run_setting()}\n")
    missing = {"redis": redis_missing(), "patroni": None if options.no_ha else PatroniGroup.missing()}
    if options.ha_only and missing["patroni"] is not None:
        raise SystemExit(f"--ha-only needs the replicated store: {missing['patroni']}")
    wanted = [ONE_STORE, REPLICATED] if options.ha_only else [s for s in SETUPS if not (options.no_ha and s.replicated)]
    skipped = [
        (s.label, why)
        for s in wanted
        if (why := missing["patroni"] if s.replicated else missing["redis"] if s.system == "redis" else None)
    ]
    setups = [s for s in wanted if s.label not in dict(skipped)]
    goals: list[tuple[str, str, bool]] = []
    with Services() as services, contextlib.ExitStack() as stack:
        ha = stack.enter_context(HAStore(services.zookeeper.hosts)) if REPLICATED in setups else None
        results = median_runs(setups, services, ha, count, runs)
        settings = ha.settings() if ha is not None else None
        print_throughput(count, runs, results, skipped=skipped, postgres=services.durability(), replicated=settings)
        if not options.ha_only:
            measured, traffic = failovers(services, kills)
            goals += print_failovers(measured, traffic)
        if ha is not None:
            goals += print_store_failovers(store_failovers(services, ha, store_kills))
    print_goals(goals)
    broken = sum(m.delivery.violations for every in results for m in every if m.setup.system == "keyfailover")
    if broken:
        raise SystemExit(f"keyfailover broke per-key order {broken} times")
    print("per-key order held in every keyfailover run")


if __name__ == "__main__":
    main()
