"""Key → consumer lookup: per-key ``owner_of``, the numpy batch path, and uhashring as the peer.

Run: ``python benchmarks/bench_lookup.py [--quick]``. The keys are ``key-<i>`` ids plus a
quarter of ``user-<id>`` ids drawn Zipf(1.1), so hot keys repeat as in real streams. The
range map for N consumers is built as the dispatcher builds it: ``c0`` owns everything,
then ``c1 .. c{N-1}`` join by the default (multi-range) policy with no measured load, so
the hash space is shared by width. uhashring's ``HashRing`` (consistent hashing, 160 vnodes per node, md5)
holds the same consumers and maps the same keys in the same run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import uhashring
from _common import (
    DISTINCT_KEYS,
    SEED,
    ZIPF_EXPONENT,
    best_of,
    consumer_ids,
    format_count,
    joined_range_map,
    parse_quick,
    print_goals,
    print_table,
    zipf_ranks,
)

from keyfailover import Dispatcher, key_hash, key_hashes

CONSUMER_COUNTS = (8, 64)
ZIPF_SHARE = 0.25

BATCH_GOAL = 5_000_000.0
SINGLE_GOAL_US = 1.5
PEER_GOAL = 10.0

PEER = "uhashring HashRing.get_node(k), per key (peer)"
SINGLE = "RangeMap.owner_of(key_hash(k)), per key"
BATCH = "RangeMap.owners_of(key_hashes(keys)), batch"


def make_keys(count: int) -> list[str]:
    """``count`` keys: ``key-<i>`` ids and Zipf-drawn ``user-<id>`` ids, in a seeded shuffle."""
    rng = np.random.default_rng(SEED)
    plain = count - int(count * ZIPF_SHARE)
    users = zipf_ranks(rng, count - plain, DISTINCT_KEYS, ZIPF_EXPONENT).tolist()
    # Each string is made in stream order, as a reader decoding messages makes them; shuffling
    # strings made in id order would scatter them in memory and time cache misses instead.
    return [f"key-{i}" if i < plain else f"user-{users[i - plain]}" for i in rng.permutation(count).tolist()]


def measure(consumers: int, keys: list[str], repeats: int) -> dict[str, float]:
    """Keys per second of every lookup path for ``consumers`` consumers, after checking they agree."""
    ids = consumer_ids(consumers)
    ranges = joined_range_map(ids)
    dispatcher = Dispatcher()
    for cid in ids:
        dispatcher.add_consumer(cid)
    ring = uhashring.HashRing(nodes=ids)
    hashes = key_hashes(keys)
    owner_of = ranges.owner_of
    dispatcher_owner_of = dispatcher.owner_of
    get_node = ring.get_node

    paths: dict[str, Callable[[], Iterable[object]]] = {
        SINGLE: lambda: [owner_of(key_hash(k)) for k in keys],
        BATCH: lambda: ranges.owners_of(key_hashes(keys)),
        "RangeMap.owners_of(hashes), precomputed": lambda: ranges.owners_of(hashes),
        "Dispatcher.owner_of(k), per key": lambda: [dispatcher_owner_of(k) for k in keys],
        PEER: lambda: [get_node(k) for k in keys],
    }
    expected = ranges.owners_of(hashes).tolist()
    for name, path in paths.items():
        if name != PEER and list(path()) != expected:
            raise SystemExit(f"{name} disagrees with the batch lookup for {consumers} consumers")
    return {name: len(keys) / best_of(path, repeats)[0] for name, path in paths.items()}


def main() -> None:
    quick = parse_quick(__doc__ or "")
    count = 50_000 if quick else 1_000_000
    repeats = 2 if quick else 3
    keys = make_keys(count)

    rows: list[list[str]] = []
    single_us: list[float] = []
    batch_rates: list[float] = []
    batch_speedups: list[float] = []
    for consumers in CONSUMER_COUNTS:
        rates = measure(consumers, keys, repeats)
        peer_rate = rates[PEER]
        for name, rate in rates.items():
            rows.append([name, str(consumers), format_count(rate), f"{1e6 / rate:.3f}", f"{rate / peer_rate:.1f}x"])
        single_us.append(1e6 / rates[SINGLE])
        batch_rates.append(rates[BATCH])
        batch_speedups.append(rates[BATCH] / peer_rate)

    print_table(
        f"Key lookup: {count:,} keys ({ZIPF_SHARE:.0%} Zipf({ZIPF_EXPONENT}) over {DISTINCT_KEYS:,} ids), "
        f"best of {repeats}",
        ["path", "consumers", "keys/s", "µs/key", "vs uhashring"],
        rows,
    )
    print_goals(
        [
            (
                f"batch (key_hashes + owners_of) >= {format_count(BATCH_GOAL)} keys/s",
                f"{format_count(min(batch_rates))} (worst of the consumer counts)",
                min(batch_rates) >= BATCH_GOAL,
            ),
            (
                f"single owner_of(key_hash(k)) <= {SINGLE_GOAL_US} µs",
                f"{max(single_us):.3f} µs (worst of the consumer counts)",
                max(single_us) <= SINGLE_GOAL_US,
            ),
            (
                f"batch >= {PEER_GOAL:.0f}x uhashring get_node",
                f"{min(batch_speedups):.1f}x (worst of the consumer counts)",
                min(batch_speedups) >= PEER_GOAL,
            ),
        ]
    )


if __name__ == "__main__":
    main()
