"""What a held message costs the dispatcher core: a join or a leave beside what is held, and memory.

Run: ``python benchmarks/bench_held.py [--quick]``.

Rebalance table: a ``Dispatcher`` (the default policy) holds 10,000, 50,000, 100,000 and
1,000,000 messages (``--quick``: 10,000 and 50,000) with keys drawn Zipf(1.1) over 100,000
keys, published with 64 or 1000 consumers each given 50 permits, so most messages wait and
a few thousand are in flight unacked. Then rounds of one newcomer joining (given its
permits, then a poll) and one original consumer leaving (then a poll); every
``add_consumer`` and ``remove_consumer`` is timed on its own and the table shows the
medians, and the median share of the keys a join and a leave gave another owner (a
change costs about what it moves: the joiner takes a fair share of the traffic, in Zipf
traffic a few hot keys, while a leaver's keys all go). The peer is uhashring's
``HashRing.add_node`` / ``remove_node`` (160 vnodes per node) with the same consumers,
timed the same way in the same run.

Memory table: tracemalloc's growth while 1,000,000 messages (``--quick``: 100,000) are
handed over and held, with a fresh key string per message as a reader decoding them
makes, and payloads left in the log (None, as ``keyfailover serve`` publishes them):
the core with every message in flight (64 consumers with permits for all), the core
with every message waiting (no permits), and the baseline, a plain dict of position ->
(key, payload) plus a dict of key -> list of positions.
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable
from functools import partial

import numpy as np
import numpy.typing as npt
import uhashring
from _common import (
    DISTINCT_KEYS,
    SEED,
    ZIPF_EXPONENT,
    consumer_ids,
    format_count,
    parse_quick,
    print_goals,
    print_table,
    zipf_ranks,
)

from keyfailover import Dispatcher
from keyfailover.core.clock import ManualClock
from keyfailover.core.hashing import key_hashes

PERMITS = 50
TICK = 0.01
BAR_HELD = 50_000
BAR_CONSUMERS = 64


def churn_dispatcher(consumers: list[str], messages: int, rounds: int) -> tuple[float, float, int, float, float]:
    """Median seconds of a join and of a leave beside ``messages`` held, how many distinct keys they have,
    and the median share of those keys that a join and a leave gave another owner."""
    clock = ManualClock()
    dispatcher = Dispatcher(clock=clock, max_replay=messages)
    for cid in consumers:
        dispatcher.add_consumer(cid)
        dispatcher.flow(cid, PERMITS)
    ranks = zipf_ranks(np.random.default_rng(SEED), messages, DISTINCT_KEYS, ZIPF_EXPONENT).tolist()
    for position, rank in enumerate(ranks):
        dispatcher.publish(position, f"key-{rank}")
    dispatcher.poll()
    slots = key_hashes([f"key-{rank}" for rank in set(ranks)])
    joins: list[float] = []
    leaves: list[float] = []
    moved: tuple[list[float], list[float]] = ([], [])

    def change(call: Callable[[], None], times: list[float], shares: list[float]) -> None:
        before = owners(dispatcher, slots)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        shares.append(float(np.mean(before != owners(dispatcher, slots))))
        dispatcher.poll()
        clock.advance(TICK)

    for i in range(rounds):
        newcomer = f"n{i}"
        change(partial(dispatcher.add_consumer, newcomer), joins, moved[0])
        dispatcher.flow(newcomer, PERMITS)
        change(partial(dispatcher.remove_consumer, consumers[i]), leaves, moved[1])
    assert dispatcher.stats()["held"] == messages, "a join or a leave lost or added a message"
    joined, left = (statistics.median(shares) for shares in moved)
    return statistics.median(joins), statistics.median(leaves), len(slots), joined, left


def owners(dispatcher: Dispatcher, slots: npt.NDArray[np.int32]) -> npt.NDArray[np.object_]:
    """The consumer owning each of ``slots`` now."""
    ends, names = dispatcher.range_map().lookup_table()
    return np.asarray(names, dtype=object)[np.searchsorted(np.asarray(ends), slots)]


def churn_ring(consumers: list[str], rounds: int) -> tuple[float, float]:
    """Median seconds of uhashring's add_node and remove_node, the same rounds."""
    ring = uhashring.HashRing(nodes=list(consumers))
    joins: list[float] = []
    leaves: list[float] = []
    for i in range(rounds):
        start = time.perf_counter()
        ring.add_node(f"n{i}")
        joins.append(time.perf_counter() - start)
        start = time.perf_counter()
        ring.remove_node(consumers[i])
        leaves.append(time.perf_counter() - start)
    return statistics.median(joins), statistics.median(leaves)


def traced_bytes(hold: Callable[[], object]) -> int:
    """Bytes still allocated after ``hold()`` returns, while what it returned is kept."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = hold()
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del kept
    return grown


def hold_in_core(ranks: list[int], in_flight: bool) -> Callable[[], object]:
    """Publish a message per rank into a dispatcher with 64 consumers, with permits for all of them or none."""

    def hold() -> object:
        dispatcher = Dispatcher(clock=ManualClock(), max_replay=len(ranks))
        for cid in consumer_ids(64):
            dispatcher.add_consumer(cid)
            if in_flight:
                dispatcher.flow(cid, len(ranks))
        for position, rank in enumerate(ranks):
            dispatcher.publish(position, f"key-{rank}", None)
        deliveries = dispatcher.poll()
        assert len(deliveries) == (len(ranks) if in_flight else 0)
        return dispatcher

    return hold


def hold_in_dicts(ranks: list[int]) -> Callable[[], object]:
    """The baseline: a dict of position -> (key, payload) and a dict of key -> list of its positions."""

    def hold() -> object:
        messages: dict[int, tuple[str, None]] = {}
        by_key: dict[str, list[int]] = {}
        for position, rank in enumerate(ranks):
            key = f"key-{rank}"
            messages[position] = (key, None)
            positions = by_key.get(key)
            if positions is None:
                by_key[key] = [position]
            else:
                positions.append(position)
        return messages, by_key

    return hold


def main() -> None:
    quick = parse_quick(__doc__ or "")
    sizes = (10_000, 50_000) if quick else (10_000, 50_000, 100_000, 1_000_000)
    groups = (64, 200) if quick else (64, 1000)
    rounds = 10 if quick else 30
    rows = []
    medians: dict[tuple[int, int], tuple[float, float, float, float]] = {}
    for consumers in groups:
        members = consumer_ids(consumers)
        for messages in sizes:
            join, leave, keys, joined, left = churn_dispatcher(members, messages, rounds)
            ring_join, ring_leave = churn_ring(members, rounds)
            medians[consumers, messages] = (join, leave, ring_join, ring_leave)
            rows.append(
                [
                    f"Dispatcher, {consumers} consumers",
                    format_count(messages),
                    format_count(keys),
                    f"{joined:.1%} / {left:.1%}",
                    f"{join * 1e3:.3f}",
                    f"{leave * 1e3:.3f}",
                    f"{ring_join * 1e3:.3f}",
                    f"{ring_leave * 1e3:.3f}",
                    f"{ring_join / join:.2f}x / {ring_leave / leave:.2f}x",
                ]
            )
    print_table(
        f"A join and a leave beside what is held: median of {rounds} each; uhashring (peer) in the same run",
        ["Dispatcher", "held", "keys", "keys moved", "join ms", "leave ms", "uhashring add ms", "remove ms", "vs ring"],
        rows,
    )

    total = 100_000 if quick else 1_000_000
    ranks = zipf_ranks(np.random.default_rng(SEED), total, DISTINCT_KEYS, ZIPF_EXPONENT).tolist()
    measured = [
        ("dict + list (baseline)", traced_bytes(hold_in_dicts(ranks))),
        ("Dispatcher, every message in flight", traced_bytes(hold_in_core(ranks, in_flight=True))),
        ("Dispatcher, every message waiting", traced_bytes(hold_in_core(ranks, in_flight=False))),
    ]
    baseline = measured[0][1]
    print_table(
        f"Memory per held message: {format_count(total)} messages over {len(set(ranks)):,} keys (tracemalloc)",
        ["holder", "messages", "MiB", "bytes/message", "vs baseline"],
        [
            [name, format_count(total), f"{grown / 2**20:.1f}", f"{grown / total:.0f}", f"{grown / baseline:.2f}x"]
            for name, grown in measured
        ],
    )

    bar = medians[BAR_CONSUMERS, BAR_HELD]
    goals = [
        (
            f"join/leave with {BAR_CONSUMERS} consumers and {BAR_HELD:,} held <= uhashring add/remove",
            f"{bar[0] * 1e3:.2f}/{bar[1] * 1e3:.2f} ms vs {bar[2] * 1e3:.2f}/{bar[3] * 1e3:.2f} ms",
            bar[0] <= bar[2] and bar[1] <= bar[3],
        ),
        (
            "bytes per held message <= 200",
            " / ".join(f"{grown / total:.0f}" for _, grown in measured[1:]),
            all(grown / total <= 200 for _, grown in measured[1:]),
        ),
    ]
    if (BAR_CONSUMERS, 1_000_000) in medians:
        big = medians[BAR_CONSUMERS, 1_000_000]
        goals.insert(
            1,
            (
                f"join/leave at 1,000,000 held <= 2x the {BAR_HELD:,} figure",
                f"{big[0] / bar[0]:.2f}x / {big[1] / bar[1]:.2f}x",
                big[0] <= 2 * bar[0] and big[1] <= 2 * bar[1],
            ),
        )
    print_goals(goals)


if __name__ == "__main__":
    main()
