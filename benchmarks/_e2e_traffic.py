"""The traffic of the end-to-end benchmarks: servers, producers, consumers, and the check of what arrived.

``bench_e2e`` runs it against one server per row and ``bench_cluster`` against the brokers of a cluster;
``bench_stuck_server`` takes its server and producer, beside consumers of its own. A server is a
``keyfailover serve`` or a ``redis-server`` on loopback. :func:`run_processes` starts the consumer and producer
processes, spawned: each imports this module and runs :func:`consumer_main` or :func:`producer_main`.
Every payload carries its message index and its send time, so :func:`delivery` checks that each message
arrived once, in per-key order, and measures throughput and latency.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import shutil
import struct
import subprocess
import sys
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
from _common import SEED

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

Results: TypeAlias = "Queue[tuple[Any, ...]]"


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
        """The median, the 99th percentile and the largest of the latencies ``ms``."""
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
        """Per-key order violations, inside each consumer and across consumers together."""
        return self.in_consumer_violations + self.across_violations


def key_ids(count: int) -> npt.NDArray[np.int64]:
    """The key (0 .. KEYS - 1) of each message index, the same in every process."""
    return np.random.default_rng(SEED).integers(0, KEYS, count, dtype=np.int64)


def key_names(count: int) -> list[str]:
    """The key of each message index as the producers send it: ``key-`` and its key id."""
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
    command = [sys.executable, "-P", *runner, "-m", "keyfailover", "serve", *where]  # -P: the installed build
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


def system_server(
    system: System, folder: Path, args: Sequence[str], profile: Path | None
) -> contextlib.AbstractContextManager[Server]:
    """The server of ``system`` in ``folder`` with ``args``: :func:`keyfailover_server`, under cProfile writing
    ``profile`` if one is given, or :func:`redis_server`, which ignores ``profile``."""
    if system == "keyfailover":
        return keyfailover_server(folder, args, profile)
    return redis_server(folder, args)


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
        """Block until ``confirmed`` messages are confirmed; RuntimeError after STALL_TIMEOUT seconds."""
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
        """Nothing arrived within a poll: publish the count taken so far to the progress array."""
        self.progress[self.slot] = len(self.indices)

    def report(self) -> ConsumerReport:
        """What this consumer took, with the CPU seconds it used since it started."""
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


# -- processes -------------------------------------------------------------------------


@dataclass(frozen=True)
class ProducerReport:
    """One producer's first and last send times, monotonic ns, and the CPU seconds it used."""

    first_send: int
    last_send: int
    cpu_seconds: float


def producer_main(
    system: System, address: str, count: int, window: int, *, share: tuple[int, int], results: Results
) -> None:
    """A producer process: send its ``share`` of ``count`` messages to ``address``, put its report on ``results``.

    A failure goes on ``results`` as an ``error`` with its traceback before it is raised.
    """
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
    """A consumer process: consume from ``address`` until ``stop`` and idle, put its report on ``results``.

    It says ``ready`` on ``results`` as :func:`consume_keyfailover` and :func:`consume_redis` describe; a
    failure goes on ``results`` as an ``error`` with its traceback before it is raised.
    """
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
        """The earliest first send of the producers, monotonic ns."""
        return min(p.first_send for p in self.producers)

    @property
    def started(self) -> int:
        """When the measured flow began: the first send, or the gate's opening in a backlog run."""
        return self.first_send if self.opened is None else self.opened

    @property
    def producer_cpu_seconds(self) -> float:
        """CPU seconds of every producer together."""
        return sum(p.cpu_seconds for p in self.producers)

    @property
    def consumer_cpu_seconds(self) -> float:
        """CPU seconds of every consumer together."""
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
