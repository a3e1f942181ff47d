"""End to end over loopback: keyfailover's server and client against Redis Streams consumer groups.

Run: ``python benchmarks/bench_e2e.py [--quick] [--messages N] [--repeats N] [--window N] [--loops LOOPS]
[--profile-server FILE]``.

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
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from _common import build_name, format_count, loop_names, on_loop, print_goals, print_table, run_setting
from _e2e_traffic import (
    BATCH,
    CONSUMERS,
    KEYS,
    PAYLOAD_BYTES,
    WINDOW,
    Delivery,
    System,
    cpu_seconds,
    delivery,
    redis_missing,
    run_processes,
    system_server,
)

from keyfailover.core.loops import LoopName

GOAL_RATE = 100_000.0
GOAL_RATIO = 0.5


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
    loop: LoopName | None = None
    """The event loop of the keyfailover processes (``--loops``); None: the one ``auto`` picks."""

    @property
    def label(self) -> str:
        """The mode as the tables show it: with its event loop when ``--loops`` named one."""
        return self.mode if self.loop is None else f"{self.mode}, {self.loop}"

    @property
    def on(self) -> str:
        """Its event loop as a goal names it, `` (uvloop)``; empty when ``--loops`` named none."""
        return "" if self.loop is None else f" ({self.loop})"

    @property
    def row(self) -> Trial:
        """This trial on no particular loop: what the goals and the peers compare."""
        return replace(self, loop=None)


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
DURABLE, NO_LEASES, UNORDERED, REDIS_ALWAYS, REDIS_EVERYSEC, REDIS_NONE = (TRIALS[i] for i in (0, 1, 2, 4, 5, 6))
COLD = Trial("keyfailover", "synchronous=full, cache off", ("--sync", "full", "--entry-cache-mb", "0"), POWER_LOSS)
"""The durable row with every message read from the log: a backlog older than the server's entry cache holds."""
BACKLOG_TRIALS = (DURABLE, COLD, UNORDERED, REDIS_ALWAYS, REDIS_NONE)
"""The rows of a ``--backlog`` run: what is stored does not change how it is read, so one durability (with its
messages read from the entry cache, as a backlog stored a moment ago is, and from the log) and Redis with and
without persistence."""
CONSUME_GOAL_RATIO = 1.2
SERVER_CPU_GOAL_US = 5.0
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
class Measured:
    """What one trial measured."""

    trial: Trial
    delivery: Delivery
    cpu_us: tuple[float, float, float]  # CPU µs per message of the server, the producer, the consumers
    others_cores: float  # cores that processes outside this benchmark kept busy while messages flowed


# -- one trial -------------------------------------------------------------------------


def run_trial(
    trial: Trial, count: int, window: int, profile: Path | None, *, consumers: int, backlog: bool = False
) -> Measured:
    """One run of ``trial``: a fresh server in a temporary folder, its traffic, what was delivered and the CPU.

    With ``profile``, a keyfailover server runs under cProfile writing that file; with ``backlog``, the consume
    path alone is measured.
    """
    with (
        tempfile.TemporaryDirectory(prefix="bench_e2e-") as folder,
        on_loop(trial.loop),
        system_server(trial.system, Path(folder), trial.args, profile) as server,
    ):
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
        delivery=delivery(run, count, f"{trial.system} {trial.label}"),
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
    """The throughput of ``m`` over that of ``peer``, or n/a without a peer."""
    return f"{m.delivery.rate / peer.delivery.rate:.2f}x" if peer is not None else "n/a"


def consumer_processes(count: int) -> str:
    """``count`` consumer processes, in words."""
    return f"{count} consumer process" if count == 1 else f"{count} consumer processes"


def print_results(
    count: int, repeats: int, consumers: int, measured: Sequence[Measured], skipped: str | None, *, setting: str
) -> None:
    """The table with its durability notes, where the CPU went, and the goals."""
    rows = [
        [
            m.trial.system,
            m.trial.label,
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
        f"best of {repeats}; {setting}",
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
                m.trial.label,
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
        f"{m.trial.system} {m.trial.label}": m.delivery.redelivered for m in measured if m.delivery.redelivered
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
                m.trial.label,
                *(f"{us:.1f}" for us in m.cpu_us),
                f"{sum(m.cpu_us):.1f}",
                format_count(2e6 / sum(m.cpu_us)),
                f"{m.others_cores:.2f}",
            ]
            for m in measured
        ],
    )
    goals: list[tuple[str, str, bool]] = []
    for durable in (m for m in measured if m.trial.row == DURABLE):
        on = durable.trial.on
        goals.append(
            (
                f"keyfailover durable{on} >= {format_count(GOAL_RATE)} msgs/s",
                format_count(durable.delivery.rate),
                durable.delivery.rate >= GOAL_RATE,
            )
        )
        goals.append(
            (
                f"keyfailover durable{on} server CPU <= {SERVER_CPU_GOAL_US} µs a message",
                f"{durable.cpu_us[0]:.1f}",
                durable.cpu_us[0] <= SERVER_CPU_GOAL_US,
            )
        )
        no_leases = _beside(measured, NO_LEASES, durable)
        if no_leases is not None:
            cost = 1.0 - durable.delivery.rate / no_leases.delivery.rate
            goals.append(
                (
                    f"lease bookkeeping{on} costs <= {LEASE_COST_GOAL:.0%} of throughput",
                    f"{cost:.1%}",
                    cost <= LEASE_COST_GOAL,
                )
            )
        unordered = _beside(measured, UNORDERED, durable)
        if unordered is not None:
            beside = unordered.delivery.rate / durable.delivery.rate
            print(f"Unordered mode beside ordered{on} (both durable, leases on): {beside:.2f}x\n")
        for peer_trial in (REDIS_ALWAYS, REDIS_EVERYSEC):
            goal = f"keyfailover durable{on} >= {GOAL_RATIO}x Redis Streams {peer_trial.mode}"
            peer = next((m for m in measured if m.trial == peer_trial), None)
            if peer is None:
                goals.append((goal, "n/a (Redis skipped)", False))
            else:
                goals.append((goal, ratio(durable, peer), durable.delivery.rate >= GOAL_RATIO * peer.delivery.rate))
    if goals:
        print_goals(goals)


def _beside(measured: Sequence[Measured], row: Trial, durable: Measured) -> Measured | None:
    """The measurement of ``row`` on the durable row's loop, if it ran."""
    return next((m for m in measured if m.trial.row == row and m.trial.loop == durable.trial.loop), None)


def print_backlog(
    count: int, repeats: int, consumers: int, measured: Sequence[Measured], skipped: str | None, *, setting: str
) -> None:
    """The consume path's table: drain rate, order, CPU per message of the server and the consumers."""
    redis = next((m for m in measured if m.trial == REDIS_NONE), None)
    rows = [
        [
            m.trial.system,
            m.trial.label,
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
        f"XACK of the batch) on {os.cpu_count()} cores, best of {repeats}; {setting}",
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
            "vs redis no persistence",
        ],
        rows,
        skipped=("redis", skipped),
    )
    goals = []
    for durable in (m for m in measured if m.trial.row == DURABLE):
        on = durable.trial.on
        goals.append(
            (
                f"keyfailover ordered consume path{on} >= {CONSUME_GOAL_RATIO}x Redis without persistence",
                ratio(durable, redis) if redis is not None else "n/a (Redis skipped)",
                redis is not None and durable.delivery.rate >= CONSUME_GOAL_RATIO * redis.delivery.rate,
            )
        )
    if goals:
        print_goals(goals)


def main() -> None:
    """Parse the options, run the rows, print their tables; exit non-zero if keyfailover broke per-key order."""
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
        "--loops",
        type=loop_names,
        default=None,
        metavar="LOOP[,LOOP]",
        help="run every keyfailover row on each of these event loops, asyncio and uvloop (default: one row each, "
        "on the loop $KEYFAILOVER_LOOP or auto picks)",
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
    if options.loops is not None:
        trials = [
            replace(t, loop=loop) if t.system == "keyfailover" else t
            for t in trials
            for loop in (options.loops if t.system == "keyfailover" else [None])
        ]
    measured = best_runs(
        trials,
        count,
        options.window,
        repeats,
        options.profile_server,
        consumers=options.consumers,
        backlog=options.backlog,
    )
    setting = f"{build_name()} build" if options.loops is not None else run_setting()
    if options.backlog:
        print_backlog(count, repeats, options.consumers, measured, skipped, setting=setting)
    else:
        print_results(count, repeats, options.consumers, measured, skipped, setting=setting)
    violations = sum(
        m.delivery.violations for m in measured if m.trial.system == "keyfailover" and m.trial.row != UNORDERED
    )
    if violations:
        raise SystemExit(f"keyfailover broke per-key order {violations} times")


if __name__ == "__main__":
    main()
