"""A consumer that takes messages and never acks, beside healthy ones: spilling to the log against holding everything.

Run: ``python benchmarks/bench_stuck.py [--quick]``. 1,000,000 messages over 10,000 keys
(uniform, seeded) go through one ``Dispatcher`` with 4 consumers, ``max_replay`` 100,000 and
Pulsar's default unacked limit of 50,000 per consumer (``--quick``: a tenth of each). One
consumer takes every message it is given and never acks (its application is blocked; its
lease, 30 s, never expires in this run, which moves no clock); the other three ack
everything. The loop plays the IO layer of a server: it publishes while ``wants()``
allows, polls, acks, and, with spilling, re-reads the parked slots from its log (a list)
within the bound. A row ends when every message of the healthy consumers' keys was
delivered, or when nothing moved for a round (reading stopped).

Rows, each in its own process: the dispatcher
with ``spill=True`` (what ``keyfailover serve`` runs) and the peer, the same dispatcher
without it (what keyfailover did before issue 13, and what Pulsar does: at the bound,
reading stops for every key). "dispatcher MiB" is the growth of the row process's peak
resident memory over what it had once its log was built: what the dispatcher held.
"""

from __future__ import annotations

import multiprocessing
import resource
import time
from multiprocessing.queues import Queue
from typing import Any

import numpy as np
from _common import SEED, format_count, parse_quick, print_goals, print_table

from keyfailover import Dispatcher, key_hash
from keyfailover.core.clock import ManualClock

KEYS = 10_000
CONSUMERS = ("stuck", "c1", "c2", "c3")


def run(spill: bool, total: int, results: Queue[tuple[Any, ...]]) -> None:
    """One row until done or stopped: (healthy delivered, healthy expected, unread, seconds, peak KiB, parked)."""
    rng = np.random.default_rng(SEED)
    keys = [f"key-{k}" for k in rng.integers(0, KEYS, total).tolist()]
    d = Dispatcher(
        clock=ManualClock(), max_replay=total // 10, max_unacked_per_consumer=total // 20, ack_timeout=30.0,
        spill=spill,
    )  # fmt: skip
    for name in CONSUMERS:
        d.add_consumer(name)
        d.flow(name, total)
    slots = np.fromiter((key_hash(k) for k in keys), np.int64, total)
    log_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the process with its log, before any message
    healthy_expected = sum(1 for k in keys if d.owner_of(k) != "stuck")
    delivered = 0
    published = 0
    started = time.perf_counter()
    while delivered < healthy_expected:
        before = (published, delivered)
        while published < total and d.wants():
            d.publish(published + 1, keys[published])
            published += 1
        for delivery in d.poll():
            if delivery.consumer != "stuck":
                d.ack(delivery.consumer, delivery.position)
                delivered += 1
        parked = d.rereads()
        if parked:
            wanted = np.fromiter(parked.keys(), np.int64, len(parked))
            start = min(parked.values())
            candidates = np.flatnonzero(np.isin(slots[start - 1 : published], wanted)) + start
            through = published
            for position in candidates.tolist():
                if position < parked[int(slots[position - 1])]:
                    continue
                if not d.wants():
                    through = position - 1
                    break
                d.restore(position, keys[position - 1])
            d.restored(parked, through)
        if (published, delivered) == before and not parked:
            break  # nothing moved: reading stopped
    seconds = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - log_kib
    results.put((delivered, healthy_expected, total - published, seconds, peak_kib, d.stats()["parked_slots"]))


def main() -> None:
    quick = parse_quick(__doc__ or "")
    total = 100_000 if quick else 1_000_000
    context = multiprocessing.get_context("spawn")
    rows = []
    measured: dict[bool, tuple[Any, ...]] = {}
    for spill in (True, False):
        results: Queue[tuple[Any, ...]] = context.Queue()
        process = context.Process(target=run, args=(spill, total, results))
        process.start()
        measured[spill] = results.get()
        process.join()
        delivered, expected, unread, seconds, peak_kib, parked = measured[spill]
        rows.append(
            [
                "spill=True (keyfailover serve)" if spill else "spill=False (peer: reading stops)",
                format_count(total),
                f"{format_count(delivered)} / {format_count(expected)}",
                format_count(unread),
                format_count(parked),
                f"{seconds:.1f}",
                f"{peak_kib / 1024:.0f}",
            ]
        )
    print_table(
        f"A consumer that never acks beside 3 healthy ones: {format_count(total)} messages over {KEYS:,} keys, "
        f"max_replay {total // 10:,}, unacked limit {total // 20:,}",
        ["Dispatcher", "messages", "healthy got", "never read", "parked slots", "seconds", "dispatcher MiB"],
        rows,
    )
    delivered, expected = measured[True][:2]
    goal = "healthy consumers receive all their keys' messages"
    print_goals([(goal, f"{delivered:,} of {expected:,}", delivered == expected)])


if __name__ == "__main__":
    main()
