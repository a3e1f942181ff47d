"""End to end over loopback: keyfailover's server and client against Redis Streams consumer groups.

Run: ``python benchmarks/bench_e2e.py [--quick] [--messages N] [--repeats N] [--window N] [--profile-server FILE]``.

Each row is a fresh server on a free loopback port with a fresh data folder, one producer
process and four consumer processes (the machine has two cores, so the server, the
producer and the consumers share them, as they would on one small host). The producer
sends 100-byte payloads over 10,000 keys (drawn uniformly, seeded) in batches of 1000,
keeping at most ``--window`` batches unconfirmed (1 by default: a batch is stored before
the next one goes): keyfailover's ``Producer.send_async`` per message, Redis's ``XADD``
per message in a redis-py pipeline sent per batch. Each consumer takes
messages one at a time and acknowledges each (keyfailover: ``receive`` + ``acknowledge``,
receiver queue of 1000; Redis: ``XREADGROUP COUNT 1000 BLOCK``, then ``XACK`` of the
whole batch pipelined with the next read).

Every payload carries its message index and its send time from ``time.monotonic_ns()``
(CLOCK_MONOTONIC, one clock for every process on Linux), so each consumer measures send →
receive latency per message. A second table shows publish → receive latency from the time the
broker stamped on each message as it stored it: keyfailover's ``Message.publish_time`` (the
server's wall clock at the group commit, in µs), and Redis's entry id (its server's wall clock
at ``XADD``, in ms, so its figures are up to 1 ms high), each against the consumer's
``time.time_ns()`` at receive (one machine, one clock). Throughput is messages over the time from the first send to
the last receive. Every message must arrive (the script fails otherwise). Per-key order is
checked on first deliveries twice: inside each consumer (the indices it sees of a key
increase) and across consumers (ordered by the time each consumer took the message, the
indices of a key increase). Redis hands a key's messages to whichever consumer reads
next, so a key is processed by several consumers at once: its order across consumers is
what the last two columns show it does not keep. keyfailover must have no violation.

Durability: keyfailover's default ``synchronous=full`` fsyncs the write-ahead log at every
(group) commit before the producer is answered; the Redis with the same guarantee is
``appendonly yes`` + ``appendfsync always``. Rows of weaker durability, labelled, pair up
the same way: keyfailover ``synchronous=normal`` (synced at checkpoints) with Redis
``appendfsync everysec``; Redis without persistence runs too. The ratio column divides by
the Redis row of the same durability. Each row runs ``--repeats`` times (rows interleaved)
and the fastest run is shown. The CPU table says how many cores other processes of the
machine kept busy meanwhile: on a shared machine that is what makes rows vary.

Redis comes from Debian's ``redis-server`` package (``scripts/setup-system`` installs it);
without it, or without the ``redis`` Python package, the Redis row says it was skipped
and why, and the script still exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import queue
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt
from _common import SEED, format_count, print_goals, print_table

from keyfailover.tools.services import free_port, stop_process

System = Literal["keyfailover", "redis"]

CONSUMERS = 4
KEYS = 10_000
PAYLOAD_BYTES = 100
BATCH = 1000
RECEIVER_QUEUE = 1000
WINDOW = 1
TOPIC = "bench-e2e"
SUBSCRIPTION = "bench"
STREAM = "bench-e2e"
GROUP = "bench"
HEADER = struct.Struct("<qq")  # message index, send time (monotonic ns)
PADDING = b"." * (PAYLOAD_BYTES - HEADER.size)
POLL_SECONDS = 0.05
START_TIMEOUT = 60.0
STALL_TIMEOUT = 60.0  # no message received for this long after the last send: stop and report what is missing
GOAL_RATE = 100_000.0
GOAL_RATIO = 0.5

Results: TypeAlias = "Queue[tuple[Any, ...]]"


@dataclass(frozen=True)
class Trial:
    """One row: a system, the label of its durability mode, the server's extra arguments, its durability.

    ``durability`` names what a confirmed message survives; rows with the same durability
    are the fair comparison (the ratio column divides by the Redis row that matches).
    """

    system: System
    mode: str
    args: tuple[str, ...]
    durability: str


POWER_LOSS = "power loss"
PROCESS_CRASH = "process crash"
NOTHING = "nothing"

TRIALS = [
    Trial("keyfailover", "synchronous=full (durable)", ("--sync", "full"), POWER_LOSS),
    Trial("keyfailover", "synchronous=full, no leases", ("--sync", "full", "--ack-timeout", "0"), POWER_LOSS),
    Trial("keyfailover", "synchronous=full, unordered", ("--sync", "full", "--consume-mode", "unordered"), POWER_LOSS),
    Trial("keyfailover", "synchronous=normal", ("--sync", "normal"), PROCESS_CRASH),
    Trial("redis", "appendfsync always (durable)", ("--appendonly", "yes", "--appendfsync", "always"), POWER_LOSS),
    Trial("redis", "appendfsync everysec", ("--appendonly", "yes", "--appendfsync", "everysec"), PROCESS_CRASH),
    Trial("redis", "no persistence", ("--appendonly", "no"), NOTHING),
]
DURABLE, NO_LEASES, UNORDERED, REDIS_ALWAYS, REDIS_EVERYSEC = TRIALS[0], TRIALS[1], TRIALS[2], TRIALS[4], TRIALS[5]
COLD = Trial("keyfailover", "synchronous=full, cache off", ("--sync", "full", "--entry-cache-mb", "0"), POWER_LOSS)
"""The durable row with every message read from the log: a backlog older than the server's entry cache holds."""
BACKLOG_TRIALS = (DURABLE, COLD, UNORDERED, REDIS_ALWAYS, TRIALS[6])
"""The rows of a ``--backlog`` run: what is stored does not change how it is read, so one durability (with its
messages read from the entry cache, as a backlog stored a moment ago is, and from the log) and Redis with and
without persistence."""
CONSUME_GOAL_RATIO = 1.0
LEASE_COST_GOAL = 0.10
PUBLISH_TIMES: dict[System, str] = {
    "keyfailover": "Message.publish_time (µs, group commit)",
    "redis": "entry id (ms at XADD: up to 1 ms high)",
}

DURABILITY_NOTES = """\
Durability of each row (what a message survives once its producer was told it is stored):
  keyfailover synchronous=full: SQLite WAL, PRAGMA synchronous=FULL; each group commit (every produce
    batch queued while the previous commit ran) is fsynced before the receipts go out -> power loss.
  redis appendfsync always: appendonly yes, the AOF written and fsynced in each event-loop iteration
    before the replies of that iteration go out (Redis' own group commit) -> power loss.
  keyfailover synchronous=normal: WAL written at each commit, fsynced at checkpoints -> process crash
    (a power loss can take the last commits).
  redis appendfsync everysec: AOF written at each iteration, fsynced once a second -> process crash
    (a power loss can take the last second).
  redis no persistence: appendonly no -> nothing. Every Redis runs with save "" (no RDB snapshots).
Every keyfailover row but "no leases" runs with the server's default ack timeout (30 s, never reached
here): "no leases" (--ack-timeout 0) shows what the lease bookkeeping costs. "unordered" is the
subscription in unordered (pop) mode: any consumer takes any message, so its order columns are expected
to be far from 0 (like Redis).
"vs redis same durability" divides by the Redis row with the same durability."""


@dataclass(frozen=True)
class Server:
    """A started server: the address its clients take, its process id, and its admin URL if it serves one."""

    address: str
    pid: int
    admin: str | None = None


@dataclass(frozen=True)
class Latency:
    """Percentiles of one latency, in milliseconds."""

    p50_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, ms: npt.NDArray[np.float64]) -> Latency:
        return cls(float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), float(ms.max()))


@dataclass(frozen=True)
class Delivery:
    """What the consumers of one run got, checked: every message arrived once, per-key order, latency."""

    messages: int
    rate: float  # messages over the time from the first send to the last receive
    p50_ms: float
    p99_ms: float
    published: Latency  # from the broker's publish time to the consumer's receive (wall clock)
    in_consumer_violations: int
    across_violations: int
    split_keys: int
    redelivered: int

    @property
    def violations(self) -> int:
        return self.in_consumer_violations + self.across_violations


@dataclass(frozen=True)
class Measured:
    """What one trial measured."""

    trial: Trial
    delivery: Delivery
    cpu_us: tuple[float, float, float]  # CPU µs per message of the server, the producer, the consumers
    others_cores: float  # cores that processes outside this benchmark kept busy while messages flowed


def key_ids(count: int) -> npt.NDArray[np.int64]:
    """The key (0 .. KEYS - 1) of each message index, the same in every process."""
    return np.random.default_rng(SEED).integers(0, KEYS, count, dtype=np.int64)


def key_names(count: int) -> list[str]:
    return [f"key-{k}" for k in key_ids(count).tolist()]


def producer_indices(count: int, share: tuple[int, int]) -> list[int]:
    """The message indices producer ``share[0]`` of ``share[1]`` sends, in order: those of its keys (key id
    modulo the number of producers), so that each key has one producer and its produced order is its index order."""
    producer, producers = share
    indices: list[int] = np.flatnonzero(key_ids(count) % producers == producer).tolist()
    return indices


# -- servers ---------------------------------------------------------------------------


@contextlib.contextmanager
def keyfailover_server(
    folder: Path, args: Sequence[str], profile: Path | None, *, port: int = 0, storage: Sequence[str] | None = None
) -> Iterator[Server]:
    """``keyfailover serve`` on loopback ``port`` (0: a free one), and its admin endpoint with ``--metrics-port``
    in ``args``; its log in ``folder``, in ``folder/data`` too unless ``storage`` gives other arguments
    (``--cluster`` and ``--store`` for a broker of a cluster)."""
    runner = ["-m", "cProfile", "-o", str(profile)] if profile is not None else []
    where = ["--data-dir", str(folder / "data")] if storage is None else list(storage)
    command = [sys.executable, *runner, "-m", "keyfailover", "serve", *where]
    command += ["--host", "127.0.0.1", "--port", str(port), *args]
    stderr = (folder / "server.log").open("wb")
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=stderr, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode()
        if not line.startswith("listening on "):
            process.wait(timeout=10)
            raise SystemExit(f"keyfailover serve did not start: {line!r}\n{(folder / 'server.log').read_text()}")
        admin = None
        if "--metrics-port" in args:
            metrics = process.stdout.readline().decode()
            if not metrics.startswith("metrics on "):
                raise SystemExit(f"keyfailover serve printed no metrics address: {metrics!r}")
            admin = metrics.split("metrics on ", 1)[1].strip()
        yield Server(f"kf://127.0.0.1:{line.rsplit(':', 1)[1].strip()}", process.pid, admin)
    finally:
        stop_process(process, timeout=30)
        if process.stdout is not None:
            process.stdout.close()
        stderr.close()


def redis_missing() -> str | None:
    """Why the Redis peer cannot run here, or None when it can."""
    if shutil.which("redis-server") is None:
        return "redis-server not installed (scripts/setup-system installs it)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis Python package is not installed (pip install -e '.[bench]')"
    return None


@contextlib.contextmanager
def redis_server(folder: Path, args: Sequence[str]) -> Iterator[Server]:
    """``redis-server`` on a free loopback port, with the stream and its consumer group."""
    import redis

    port = free_port()
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", ""]
    command += ["--logfile", str(folder / "redis.log"), *args]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log = folder / "redis.log"
                    raise SystemExit(f"redis-server did not start: {log.read_text() if log.exists() else ''}") from None
                time.sleep(0.02)
        client.xgroup_create(STREAM, GROUP, id="$", mkstream=True)
        client.close()
        yield Server(f"127.0.0.1:{port}", process.pid)
    finally:
        stop_process(process, timeout=30)


# -- producer --------------------------------------------------------------------------


class Confirmations:
    """Counts the producer's confirmed messages, so that it keeps at most a window of them unconfirmed."""

    def __init__(self) -> None:
        self.confirmed = 0
        self.errors: list[BaseException] = []
        self._wanted = 0
        self._changed = threading.Condition()

    def done(self, _position: int | None, error: BaseException | None) -> None:
        """The send callback, on the client's thread."""
        if error is not None:
            self.errors.append(error)
        self.confirmed += 1
        if self.confirmed >= self._wanted:
            with self._changed:
                self._changed.notify()

    def wait_for(self, confirmed: int) -> None:
        with self._changed:
            self._wanted = confirmed
            if not self._changed.wait_for(lambda: self.confirmed >= confirmed, timeout=STALL_TIMEOUT):
                raise RuntimeError(f"only {self.confirmed} of {confirmed} messages confirmed in {STALL_TIMEOUT} s")


def produce_keyfailover(address: str, count: int, window: int, share: tuple[int, int] = (0, 1)) -> tuple[int, int]:
    """``send_async`` of this producer's ``share`` of ``count`` messages (see :func:`producer_indices`) in
    batches of BATCH, at most ``window`` batches unconfirmed; first and last send times."""
    from keyfailover.client import Client

    keys = key_names(count)
    mine = producer_indices(count, share)
    confirmations = Confirmations()
    done = confirmations.done
    now = time.monotonic_ns
    pack = HEADER.pack
    with Client(address) as client:
        producer = client.create_producer(TOPIC, f"bench-producer-{share[0]}")
        send = producer.send_async
        first = now()
        for start in range(0, len(mine), BATCH):
            for index in mine[start : start + BATCH]:
                send(pack(index, now()) + PADDING, keys[index], done)
            confirmations.wait_for(min(start + BATCH, len(mine)) - (window - 1) * BATCH)
        producer.flush()
        last = now()
    if confirmations.errors:
        errors = confirmations.errors
        raise RuntimeError(f"{len(errors)} messages were not stored; first error: {errors[0]}")
    return first, last


def produce_redis(address: str, count: int, window: int, share: tuple[int, int] = (0, 1)) -> tuple[int, int]:
    """XADD of this producer's ``share`` of ``count`` messages in pipelines of BATCH on one connection, at most
    ``window`` unanswered; first and last send times.

    ``Pipeline.execute`` sends a batch and reads its replies; the same two halves
    (``pack_commands`` + ``send_packed_command``, then ``read_response`` per command)
    keep up to ``window`` batches in flight, in order, as the keyfailover producer does.
    """
    import redis

    host, port = address.rsplit(":", 1)
    keys = [key.encode() for key in key_names(count)]
    mine = producer_indices(count, share)
    now = time.monotonic_ns
    pack = HEADER.pack
    client = redis.Redis(host=host, port=int(port))
    connection = client.connection_pool.get_connection()
    unanswered: deque[int] = deque()
    try:
        first = now()
        for start in range(0, len(mine), BATCH):
            commands = [
                (b"XADD", STREAM, b"*", b"k", keys[index], b"p", pack(index, now()) + PADDING)
                for index in mine[start : start + BATCH]
            ]
            packed = connection.pack_commands(commands)  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
            connection.send_packed_command(packed)  # type: ignore[no-untyped-call]
            unanswered.append(len(commands))
            while len(unanswered) >= window or (unanswered and start + BATCH >= len(mine)):
                for _ in range(unanswered.popleft()):
                    connection.read_response()
        last = now()
    finally:
        client.connection_pool.release(connection)
        client.close()
    return first, last


# -- consumers -------------------------------------------------------------------------


@dataclass(frozen=True)
class ConsumerReport:
    """What one consumer saw of first deliveries, as int64 arrays in bytes, and the CPU it used."""

    slot: int
    indices: bytes
    sent: bytes
    received: bytes
    published: bytes  # the broker's publish time, µs since the epoch
    received_wall: bytes  # the wall clock at receive, µs since the epoch
    violations: int
    redelivered: int
    cpu_seconds: float


class Tally:
    """One consumer's record of first deliveries: index, send and receive times, publish time and the wall clock
    at receive, in-consumer order."""

    def __init__(self, slot: int, progress: Any) -> None:
        self.slot = slot
        self.progress = progress
        self.indices = array("q")
        self.sent = array("q")
        self.received = array("q")
        self.published = array("q")
        self.received_wall = array("q")
        self.last_of_key: dict[bytes | str | None, int] = {}
        self.violations = 0
        self.redelivered = 0
        self.cpu_start = time.process_time()

    def take(self, key: bytes | str | None, payload: bytes, now: int, published: int, wall: int) -> None:
        """A first delivery: ``now`` monotonic ns, ``published`` and ``wall`` (the clock now) µs since the epoch."""
        index, sent = HEADER.unpack_from(payload)
        if self.last_of_key.get(key, -1) > index:
            self.violations += 1
        else:
            self.last_of_key[key] = index
        self.indices.append(index)
        self.sent.append(sent)
        self.received.append(now)
        self.published.append(published)
        self.received_wall.append(wall)
        if not len(self.indices) & 255:
            self.progress[self.slot] = len(self.indices)

    def idle(self) -> None:
        self.progress[self.slot] = len(self.indices)

    def report(self) -> ConsumerReport:
        return ConsumerReport(
            self.slot,
            self.indices.tobytes(),
            self.sent.tobytes(),
            self.received.tobytes(),
            self.published.tobytes(),
            self.received_wall.tobytes(),
            self.violations,
            self.redelivered,
            time.process_time() - self.cpu_start,
        )


def consume_keyfailover(
    address: str, tally: Tally, stop: Event, ready: Callable[[], None], gate: Event | None = None
) -> None:
    """``receive`` and ``acknowledge`` one message at a time until ``stop`` and idle. With a ``gate`` (a
    backlog run): say ready once connected and subscribe when the gate opens; else once subscribed."""
    from keyfailover.client import Client, Timeout

    now, wall = time.monotonic_ns, time.time_ns
    with Client(address) as client:
        if gate is not None:
            ready()
            gate.wait()
        consumer = client.subscribe(
            TOPIC, SUBSCRIPTION, consumer_name=f"c{tally.slot}", receiver_queue_size=RECEIVER_QUEUE
        )
        if gate is None:
            ready()
        receive, acknowledge, take = consumer.receive, consumer.acknowledge, tally.take
        while True:
            try:
                message = receive(POLL_SECONDS)
            except Timeout:
                tally.idle()
                if stop.is_set():
                    break
                continue
            if message.redelivery_count:
                tally.redelivered += 1
            elif message.publish_time is None:
                raise RuntimeError(f"message {message.position} came without a publish time")
            else:
                take(message.key, message.payload, now(), message.publish_time, wall() // 1000)
            acknowledge(message)
        consumer.close()


def consume_redis(
    address: str, tally: Tally, stop: Event, ready: Callable[[], None], gate: Event | None = None
) -> None:
    """XREADGROUP a batch, take its messages one at a time, XACK the batch pipelined with the next read
    (from when the ``gate`` opens, in a backlog run)."""
    import redis

    host, port = address.rsplit(":", 1)
    now, wall = time.monotonic_ns, time.time_ns
    name = f"c{tally.slot}"
    client = redis.Redis(host=host, port=int(port))
    try:
        client.ping()
        pipe = client.pipeline(transaction=False)
        ready()
        if gate is not None:
            gate.wait()
        take = tally.take
        unacked: list[bytes] = []
        while True:
            if unacked:
                pipe.xack(STREAM, GROUP, *unacked)
            pipe.xreadgroup(GROUP, name, {STREAM: ">"}, count=BATCH, block=int(POLL_SECONDS * 1000))
            reply = pipe.execute()[-1]
            unacked = []
            if not reply:
                tally.idle()
                if stop.is_set():
                    break
                continue
            for entry_id, fields in reply[0][1]:
                # An entry id is "<ms of the Redis server's clock at XADD>-<sequence>".
                take(fields[b"k"], fields[b"p"], now(), int(entry_id.split(b"-", 1)[0]) * 1000, wall() // 1000)
                unacked.append(entry_id)
    finally:
        client.close()


# -- one trial -------------------------------------------------------------------------


@dataclass(frozen=True)
class ProducerReport:
    first_send: int
    last_send: int
    cpu_seconds: float


def producer_main(
    system: System, address: str, count: int, window: int, *, share: tuple[int, int], results: Results
) -> None:
    try:
        produce = produce_keyfailover if system == "keyfailover" else produce_redis
        cpu = time.process_time()
        first, last = produce(address, count, window, share)
        results.put(("producer", ProducerReport(first, last, time.process_time() - cpu)))
    except BaseException:
        results.put(("error", "producer", traceback.format_exc()))
        raise


def consumer_main(
    system: System, address: str, slot: int, *, stop: Event, progress: Any, results: Results, gate: Event | None
) -> None:
    try:
        consume = consume_keyfailover if system == "keyfailover" else consume_redis
        tally = Tally(slot, progress)
        consume(address, tally, stop, lambda: results.put(("ready", slot)), gate)
        results.put(("consumer", tally.report()))
    except BaseException:
        results.put(("error", f"consumer {slot}", traceback.format_exc()))
        raise


def end_processes(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    """Terminate each benchmark process still alive (SIGKILL if it does not exit within 5 s)."""
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> tuple[float, float]:
    """(CPU seconds every process of the machine used so far, monotonic now); (0, now) without /proc/stat."""
    now = time.monotonic()
    try:
        fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, now
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), now


ServiceCpu: TypeAlias = Callable[[], dict[str, float]]
"""The CPU seconds that each kind of service process (the server; brokers, PostgreSQL...) used so far."""


@dataclass(frozen=True)
class Run:
    """The reports of one trial's processes, the CPU seconds of its services by kind, and the machine's,
    while messages flowed."""

    producers: list[ProducerReport]
    consumers: list[ConsumerReport]
    service_cpu_seconds: dict[str, float]
    machine_cpu_seconds: float
    seconds: float
    opened: int | None = None
    """A backlog run: when the consumers' gate opened (monotonic ns); else None."""

    @property
    def first_send(self) -> int:
        return min(p.first_send for p in self.producers)

    @property
    def started(self) -> int:
        """When the measured flow began: the first send, or the gate's opening in a backlog run."""
        return self.first_send if self.opened is None else self.opened

    @property
    def producer_cpu_seconds(self) -> float:
        return sum(p.cpu_seconds for p in self.producers)

    @property
    def consumer_cpu_seconds(self) -> float:
        return sum(r.cpu_seconds for r in self.consumers)

    def other_cores(self) -> float:
        """Cores that processes outside this benchmark kept busy while messages flowed."""
        ours = sum(self.service_cpu_seconds.values()) + self.producer_cpu_seconds + self.consumer_cpu_seconds
        return max(self.machine_cpu_seconds - ours, 0.0) / self.seconds


def run_processes(
    system: System,
    address: str,
    count: int,
    window: int,
    *,
    service_cpu: ServiceCpu,
    producers: int = 1,
    consumers: int = CONSUMERS,
    backlog: bool = False,
) -> Run:
    """Start ``consumers`` consumers, then ``producers`` producers once all subscribed (each sends the messages of its
    keys, see :func:`producer_indices`); wait until every message arrived. ``service_cpu`` is read as the
    producers start and once every message arrived. With ``backlog``: the producers first, until all
    their sends are confirmed, then the consumers, connected and held at a gate that opens at once for
    all; ``service_cpu`` is read as it opens (the consume path alone is measured)."""
    context = multiprocessing.get_context("spawn")
    results: Results = context.Queue()
    stop = context.Event()
    gate = context.Event() if backlog else None
    progress = context.Array("q", consumers, lock=False)
    consuming = [
        context.Process(
            target=consumer_main,
            args=(system, address, slot),
            kwargs={"stop": stop, "progress": progress, "results": results, "gate": gate},
            daemon=True,
        )
        for slot in range(consumers)
    ]
    producing = [
        context.Process(
            target=producer_main,
            args=(system, address, count, window),
            kwargs={"share": (share, producers), "results": results},
            daemon=True,
        )
        for share in range(producers)
    ]
    processes = [*consuming, *producing]
    ready = 0
    cpu_before: dict[str, float] = {}
    machine_cpu, started = 0.0, 0.0
    produced: list[ProducerReport] = []
    reports: list[ConsumerReport] = []
    opened: int | None = None
    try:
        for process in producing if backlog else consuming:
            process.start()
        deadline = time.monotonic() + START_TIMEOUT
        seen, seen_at = -1, time.monotonic()
        while len(reports) < consumers:
            try:
                kind, *message = results.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if ready < consumers and time.monotonic() > deadline:
                    raise SystemExit(f"{system}: only {ready} of {consumers} consumers subscribed") from None
                for process in processes:
                    if process.exitcode not in (None, 0):
                        raise SystemExit(f"{system}: a benchmark process exited with {process.exitcode}") from None
                if len(produced) == producers and not stop.is_set():
                    total = sum(progress)
                    if total != seen:
                        seen, seen_at = total, time.monotonic()
                    if total >= count or time.monotonic() - seen_at > STALL_TIMEOUT:
                        stop.set()
                continue
            if kind == "error":
                raise SystemExit(f"{system}: the {message[0]} failed:\n{message[1]}")
            if kind == "ready":
                ready += 1
                if ready == consumers:
                    cpu_before = service_cpu()
                    machine_cpu, started = machine_busy_seconds()
                    if gate is not None:
                        opened = time.monotonic_ns()
                        gate.set()
                    else:
                        for process in producing:
                            process.start()
            elif kind == "producer":
                produced.append(message[0])
                seen_at = time.monotonic()
                if backlog and len(produced) == producers:
                    deadline = time.monotonic() + START_TIMEOUT
                    for process in consuming:
                        process.start()
            else:
                reports.append(message[0])
        cpu_after = service_cpu()
        machine_end, ended = machine_busy_seconds()
        for process in processes:
            process.join(timeout=30)
    finally:
        stop.set()
        end_processes(processes)
    assert len(produced) == producers
    used = {kind: cpu_after[kind] - cpu_before[kind] for kind in cpu_after}
    return Run(produced, reports, used, machine_end - machine_cpu, ended - started, opened)


def order_violations(
    keys: npt.NDArray[np.int64], indices: npt.NDArray[np.int64], received: npt.NDArray[np.int64]
) -> int:
    """Deliveries of a key taken (by receive time, over all consumers) after a later message of the key."""
    by_time = np.lexsort((indices, received))
    by_key = np.argsort(keys[by_time], kind="stable")
    k, i = keys[by_time][by_key], indices[by_time][by_key]
    # A violation is an index below the largest index of the same key taken before it.
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    ends = np.r_[starts[1:], len(k)]
    violations = 0
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        running_max = np.maximum.accumulate(i[start:end])
        violations += int(np.count_nonzero(i[start + 1 : end] < running_max[:-1]))
    return violations


def delivery(run: Run, count: int, what: str) -> Delivery:
    """Check that each of the ``count`` messages arrived once (SystemExit naming ``what`` otherwise); measure
    throughput, latency and per-key order."""
    reports = run.consumers
    indices = np.concatenate([np.frombuffer(r.indices, dtype=np.int64) for r in reports])
    sent = np.concatenate([np.frombuffer(r.sent, dtype=np.int64) for r in reports])
    received = np.concatenate([np.frombuffer(r.received, dtype=np.int64) for r in reports])
    owner = np.concatenate([np.full(len(r.indices) // 8, r.slot, dtype=np.int64) for r in reports])
    distinct = np.unique(indices)
    if len(distinct) != count or len(indices) != count:
        raise SystemExit(
            f"{what}: {count - len(distinct)} of {count} messages never arrived "
            f"and {len(indices) - len(distinct)} arrived twice as first deliveries"
        )
    keys = key_ids(count)[indices]
    keys_with_owner = np.unique(keys * len(reports) + owner) // len(reports)
    latency_ms = (received - sent) / 1e6
    published = np.concatenate([np.frombuffer(r.published, dtype=np.int64) for r in reports])
    received_wall = np.concatenate([np.frombuffer(r.received_wall, dtype=np.int64) for r in reports])
    return Delivery(
        messages=count,
        rate=count / ((int(received.max()) - run.started) / 1e9),
        p50_ms=float(np.percentile(latency_ms, 50)),
        p99_ms=float(np.percentile(latency_ms, 99)),
        published=Latency.of((received_wall - published) / 1e3),
        in_consumer_violations=sum(r.violations for r in reports),
        across_violations=order_violations(keys, indices, received),
        split_keys=int(np.count_nonzero(np.bincount(keys_with_owner) > 1)),
        redelivered=sum(r.redelivered for r in reports),
    )


def run_trial(
    trial: Trial, count: int, window: int, profile: Path | None, *, consumers: int, backlog: bool = False
) -> Measured:
    with tempfile.TemporaryDirectory(prefix="bench_e2e-") as folder:
        if trial.system == "keyfailover":
            started = keyfailover_server(Path(folder), trial.args, profile)
        else:
            started = redis_server(Path(folder), trial.args)
        with started as server:
            pid = server.pid
            run = run_processes(
                trial.system,
                server.address,
                count,
                window,
                service_cpu=lambda: {"server": cpu_seconds(pid)},
                consumers=consumers,
                backlog=backlog,
            )
    return Measured(
        trial=trial,
        delivery=delivery(run, count, f"{trial.system} {trial.mode}"),
        cpu_us=(
            sum(run.service_cpu_seconds.values()) * 1e6 / count,
            0.0 if backlog else run.producer_cpu_seconds * 1e6 / count,  # done before the flow measured
            run.consumer_cpu_seconds * 1e6 / count,
        ),
        others_cores=run.other_cores(),
    )


# -- report ----------------------------------------------------------------------------


def best_runs(
    trials: Sequence[Trial],
    count: int,
    window: int,
    repeats: int,
    profile: Path | None,
    *,
    consumers: int,
    backlog: bool = False,
) -> list[Measured]:
    """Each trial ``repeats`` times, in interleaved rounds (so a burst of load elsewhere hits every row alike).

    The run with the highest throughput of each trial is kept, as the least disturbed one.
    """
    best: dict[Trial, Measured] = {}
    for _ in range(repeats):
        for trial in trials:
            measured = run_trial(trial, count, window, profile, consumers=consumers, backlog=backlog)
            if trial not in best or measured.delivery.rate > best[trial].delivery.rate:
                best[trial] = measured
    return [best[trial] for trial in trials]


def redis_peer(measured: Sequence[Measured], durability: str) -> Measured | None:
    """The Redis row with ``durability``, if it ran."""
    return next((m for m in measured if m.trial.system == "redis" and m.trial.durability == durability), None)


def ratio(m: Measured, peer: Measured | None) -> str:
    return f"{m.delivery.rate / peer.delivery.rate:.2f}x" if peer is not None else "n/a"


def consumer_processes(count: int) -> str:
    return f"{count} consumer process" if count == 1 else f"{count} consumer processes"


def print_results(count: int, repeats: int, consumers: int, measured: Sequence[Measured], skipped: str | None) -> None:
    """The table with its durability notes, where the CPU went, and the goals."""
    rows = [
        [
            m.trial.system,
            m.trial.mode,
            format_count(m.delivery.messages),
            format_count(m.delivery.rate),
            f"{m.delivery.p50_ms:.2f}",
            f"{m.delivery.p99_ms:.2f}",
            format_count(m.delivery.in_consumer_violations),
            format_count(m.delivery.across_violations),
            format_count(m.delivery.split_keys),
            ratio(m, redis_peer(measured, m.trial.durability)),
        ]
        for m in measured
    ]
    print_table(
        f"End to end over loopback: {format_count(count)} messages of {PAYLOAD_BYTES} bytes, {KEYS:,} keys, "
        f"batches of {BATCH}, 1 producer and {consumer_processes(consumers)} on {os.cpu_count()} cores, "
        f"best of {repeats}",
        [
            "system",
            "mode",
            "messages",
            "msgs/s",
            "p50 ms",
            "p99 ms",
            "in-consumer order violations",
            "order violations",
            "keys on >1 consumer",
            "vs redis same durability",
        ],
        rows,
        skipped=("redis", skipped),
    )
    print(DURABILITY_NOTES)
    print_table(
        "Publish → receive latency from the broker's publish time: the server's wall clock as it stored the message, "
        "against the consumer's at receive (first deliveries, same machine)",
        ["system", "mode", "publish time", "p50 ms", "p99 ms", "max ms"],
        [
            [
                m.trial.system,
                m.trial.mode,
                PUBLISH_TIMES[m.trial.system],
                f"{m.delivery.published.p50_ms:.2f}",
                f"{m.delivery.published.p99_ms:.2f}",
                f"{m.delivery.published.max_ms:.2f}",
            ]
            for m in measured
        ],
    )
    print(
        "Order violations: first deliveries of a key taken (by receive time, across consumers) after a later\n"
        "message of that key. keys on >1 consumer: keys whose messages were processed by more than one consumer.\n"
    )
    redelivered = {
        f"{m.trial.system} {m.trial.mode}": m.delivery.redelivered for m in measured if m.delivery.redelivered
    }
    if redelivered:
        print(f"Redeliveries (not counted above): {redelivered}\n")
    print_table(
        "Where the CPU went: CPU µs per message (user + system) while messages flowed; "
        "other load = cores kept busy by processes outside the benchmark",
        ["system", "mode", "server", "producer", "consumers", "total", "2 cores / total", "other load"],
        [
            [
                m.trial.system,
                m.trial.mode,
                *(f"{us:.1f}" for us in m.cpu_us),
                f"{sum(m.cpu_us):.1f}",
                format_count(2e6 / sum(m.cpu_us)),
                f"{m.others_cores:.2f}",
            ]
            for m in measured
        ],
    )
    durable = next((m for m in measured if m.trial == DURABLE), None)
    if durable is None:
        return
    goals = [
        (
            f"keyfailover durable >= {format_count(GOAL_RATE)} msgs/s",
            format_count(durable.delivery.rate),
            durable.delivery.rate >= GOAL_RATE,
        )
    ]
    no_leases = next((m for m in measured if m.trial == NO_LEASES), None)
    if no_leases is not None:
        cost = 1.0 - durable.delivery.rate / no_leases.delivery.rate
        goals.append(
            (f"lease bookkeeping costs <= {LEASE_COST_GOAL:.0%} of throughput", f"{cost:.1%}", cost <= LEASE_COST_GOAL)
        )
    unordered = next((m for m in measured if m.trial == UNORDERED), None)
    if unordered is not None:
        beside = unordered.delivery.rate / durable.delivery.rate
        print(f"Unordered mode beside ordered (both durable, leases on): {beside:.2f}x\n")
    for peer_trial in (REDIS_ALWAYS, REDIS_EVERYSEC):
        goal = f"keyfailover durable >= {GOAL_RATIO}x Redis Streams {peer_trial.mode}"
        peer = next((m for m in measured if m.trial == peer_trial), None)
        if peer is None:
            goals.append((goal, "n/a (Redis skipped)", False))
        else:
            goals.append((goal, ratio(durable, peer), durable.delivery.rate >= GOAL_RATIO * peer.delivery.rate))
    print_goals(goals)


def print_backlog(count: int, repeats: int, consumers: int, measured: Sequence[Measured], skipped: str | None) -> None:
    """The consume path's table: drain rate, order, CPU per message of the server and the consumers."""
    redis = max((m for m in measured if m.trial.system == "redis"), key=lambda m: m.delivery.rate, default=None)
    rows = [
        [
            m.trial.system,
            m.trial.mode,
            format_count(m.delivery.rate),
            format_count(m.delivery.in_consumer_violations),
            format_count(m.delivery.across_violations),
            format_count(m.delivery.split_keys),
            f"{m.cpu_us[0]:.1f}",
            f"{m.cpu_us[2]:.1f}",
            f"{m.others_cores:.2f}",
            ratio(m, redis),
        ]
        for m in measured
    ]
    print_table(
        f"Consume path: a stored backlog of {format_count(count)} messages of {PAYLOAD_BYTES} bytes over {KEYS:,} keys "
        f"drained by {consumer_processes(consumers)} (receive and ack each; Redis: XREADGROUP COUNT {BATCH} and "
        f"XACK of the batch) on {os.cpu_count()} cores, best of {repeats}",
        [
            "system",
            "mode",
            "msgs/s",
            "in-consumer order violations",
            "order violations",
            "keys on >1 consumer",
            "server CPU µs/msg",
            "consumers CPU µs/msg",
            "other load",
            "vs fastest redis",
        ],
        rows,
        skipped=("redis", skipped),
    )
    durable = next((m for m in measured if m.trial == DURABLE), None)
    if durable is not None:
        goal = f"keyfailover ordered consume path >= {CONSUME_GOAL_RATIO}x the fastest Redis row"
        print_goals(
            [
                (
                    goal,
                    ratio(durable, redis) if redis is not None else "n/a (Redis skipped)",
                    redis is not None and durable.delivery.rate >= CONSUME_GOAL_RATIO * redis.delivery.rate,
                )
            ]
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small run that finishes in a few seconds")
    parser.add_argument("--messages", type=int, default=None, help="messages per row (default 200,000; 10,000 quick)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per row, the best kept (default 3; 1 quick)")
    parser.add_argument(
        "--window", type=int, default=WINDOW, help=f"batches a producer keeps unanswered (default {WINDOW})"
    )
    parser.add_argument("--consumers", type=int, default=CONSUMERS, help=f"consumer processes (default {CONSUMERS})")
    parser.add_argument(
        "--backlog",
        action="store_true",
        help="the consume path alone: each row's messages are stored first, then the consumers drain them "
        "(receive and ack each), from a gate that opens for all at once; rows: durable (read from the server's "
        "entry cache, and with it off from the log), unordered, and Redis",
    )
    parser.add_argument(
        "--profile-server",
        type=Path,
        default=None,
        metavar="FILE",
        help="run only the durable keyfailover row, once, its server under cProfile writing FILE",
    )
    options = parser.parse_args()
    count = options.messages or (10_000 if options.quick else 200_000)
    repeats = options.repeats or (1 if options.quick else 3)
    if count < 1 or repeats < 1 or options.window < 1 or options.consumers < 1:
        parser.error("--messages, --repeats, --window and --consumers must be positive")

    skipped = redis_missing()
    trials = [t for t in TRIALS if t.system == "keyfailover" or skipped is None]
    if options.backlog:
        trials = [t for t in BACKLOG_TRIALS if t in trials or t == COLD]
    if options.profile_server is not None:
        trials, skipped, repeats = [DURABLE], "only the profiled keyfailover row runs", 1
    measured = best_runs(
        trials,
        count,
        options.window,
        repeats,
        options.profile_server,
        consumers=options.consumers,
        backlog=options.backlog,
    )
    if options.backlog:
        print_backlog(count, repeats, options.consumers, measured, skipped)
    else:
        print_results(count, repeats, options.consumers, measured, skipped)
    violations = sum(
        m.delivery.violations for m in measured if m.trial.system == "keyfailover" and m.trial != UNORDERED
    )
    if violations:
        raise SystemExit(f"keyfailover broke per-key order {violations} times")


if __name__ == "__main__":
    main()
