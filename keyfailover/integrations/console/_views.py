"""The console's JSON views: what each page of ``/ui`` polls, read from a live :class:`Server` at request time.

Nothing here runs per message: a view reads the dispatchers' stats, maps and meters when a page asks,
on the server's loop, and changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keyfailover.broker.server import Server, union_snapshot
from keyfailover.core.hashing import HASH_RANGE_SIZE

__all__ = ["RECENT_CHANGES", "dead_letter_view", "overview", "subscription_view"]

RECENT_CHANGES = 50
"""How many of the latest range changes the subscription view lists."""


def _traffic(live: list[Any]) -> np.ndarray[Any, np.dtype[np.float64]]:
    """Recent per-slot traffic of the whole slot space: each partition's meter in its block."""
    whole = np.zeros(HASH_RANGE_SIZE, dtype=np.float64)
    for subscription in live:
        first, _ = subscription.dispatcher.slots
        meter = np.asarray(subscription.dispatcher.traffic(), dtype=np.float64)
        whole[first : first + len(meter)] += meter
    return whole


def _shares(ranges: list[tuple[int, int]], sums: np.ndarray[Any, np.dtype[np.float64]]) -> tuple[float, float]:
    """``(share of the slot space, share of recent traffic)`` of inclusive ``ranges``; ``sums`` is the
    running sum of per-slot traffic with a leading zero."""
    slots = sum(end - start + 1 for start, end in ranges)
    total = float(sums[-1])
    traffic = sum(float(sums[end + 1] - sums[start]) for start, end in ranges)
    return slots / HASH_RANGE_SIZE, traffic / total if total > 0.0 else 0.0


def subscription_view(
    server: Server, topic: str, name: str, series: Sequence[Mapping[str, Any]]
) -> dict[str, Any] | None:
    """The subscription page's JSON for the live subscription ``name`` of ``topic`` (over all its partitions
    served here), with the sampler's ``series``; None when it is not live here."""
    topic = server.partition_of(topic)[0]
    live = server.live(topic, name)
    if not live:
        return None
    snapshot = union_snapshot(live)
    sums = np.concatenate(([0.0], np.cumsum(_traffic(live))))
    ranges = []
    for entry in snapshot["ranges"]:
        slot_share, traffic_share = _shares([(entry["start"], entry["end"])], sums)
        ranges.append({**entry, "slot_share": slot_share, "traffic_share": traffic_share})
    consumers: dict[str, dict[str, Any]] = {}
    changes = []
    draining: list[list[int]] = []
    wall = time.time() - time.monotonic()  # the dispatchers' clock is time.monotonic
    partitions = len(server.partition_names(topic))
    for subscription in live:
        dispatcher = subscription.dispatcher
        index = server.partition_of(subscription.topic)[1] if partitions > 1 else None
        for cid, stats in dispatcher.stats()["consumers"].items():
            row = consumers.setdefault(cid, _consumer_row(cid))
            row["ranges"] += [list(r) for r in stats["ranges"]]
            row["standby"] = row["standby"] and stats["standby"]
            row["stuck"] = row["stuck"] or stats["stuck"]
            row["stalled"] = row["stalled"] or stats["stalled"]
            for field, source in _SUMMED.items():
                row[field] += stats[source]
            ends = [e for e in (row["lease_ends_in"], stats["lease_ends_in"]) if e is not None]
            row["lease_ends_in"] = min(ends, default=None)
        draining += [list(r) for r in dispatcher.draining_slots()]
        changes += [
            {
                "time": event.time + wall,
                "epoch": event.epoch,
                "reason": event.reason,
                "consumer": event.consumer,
                "moved_slots": event.moved_slots,
                "stickiness": event.stickiness,
                "draining_keys": event.draining_keys,
                "drain_seconds": event.drain_seconds,
                "partition": index,
            }
            for event in dispatcher.rebalances()[-RECENT_CHANGES:]
        ]
    for row in consumers.values():
        row["ranges"].sort()
        row["slot_share"], row["traffic_share"] = _shares([(a, b) for a, b in row["ranges"]], sums)
    changes.sort(key=lambda change: (change["time"], change["epoch"]))
    return {
        "topic": topic,
        "subscription": name,
        "time": time.time(),
        "partitions": partitions,
        "consume_mode": live[0].dispatcher.consume_mode,
        "policy": live[0].dispatcher.policy.name,
        "epoch": snapshot["epoch"],
        "range_size": HASH_RANGE_SIZE,
        "ranges": ranges,
        "draining": sorted(draining),
        "consumers": [consumers[cid] for cid in sorted(consumers)],
        "changes": changes[-RECENT_CHANGES:],
        "backlog": sum(s.backlog() for s in live),
        "dead_lettered": sum(s.dead_lettered for s in live),
        "series": list(series),
    }


_SUMMED = {
    "rate": "rate",
    "permits": "permits",
    "unacked": "unacked",
    "draining_keys": "draining_hashes",
    "expired_leases": "expired",
    "redeliveries": "redelivered",
    "delivered": "delivered",
    "acked": "acked",
}
"""Consumer fields summed over a subscription's partitions, and the dispatcher stat each comes from."""


def _consumer_row(cid: str) -> dict[str, Any]:
    """A consumer's row before its partitions' stats are added in."""
    return {
        "consumer": cid,
        "ranges": [],
        "standby": True,
        "stuck": False,
        "stalled": False,
        "lease_ends_in": None,
        **dict.fromkeys(_SUMMED, 0),
    }


def overview(server: Server) -> dict[str, Any]:
    """The overview page's JSON: every live subscription served here, in a line each."""
    named = sorted({(s.settings_topic, s.name) for s in server.subscriptions().values()})
    broker = server.broker
    rows = []
    for topic, name in named:
        live = server.live(topic, name)
        if not live:
            continue
        stats = [s.dispatcher.stats() for s in live]
        consumers = {cid for one in stats for cid in one["consumers"]}
        rows.append(
            {
                "topic": topic,
                "subscription": name,
                "partitions": len(server.partition_names(topic)),
                "served_partitions": len(live),
                "consume_mode": live[0].dispatcher.consume_mode,
                "consumers": len(consumers),
                "stuck": len({cid for one in stats for cid, c in one["consumers"].items() if c["stuck"]}),
                "rate": sum(c["rate"] for one in stats for c in one["consumers"].values()),
                "epoch": union_snapshot(live)["epoch"],
                "backlog": sum(s.backlog() for s in live),
                "dead_lettered": sum(s.dead_lettered for s in live),
            }
        )
    return {
        "time": time.time(),
        "cluster": broker is not None,
        "broker": None if broker is None or not broker.joined else broker.member.broker_id,
        "connections": server.connection_count,
        "subscriptions": rows,
    }


async def dead_letter_view(server: Server) -> dict[str, Any]:
    """The dead-letter page's JSON: per subscription with dead letters, how many, how many not replayed yet,
    the oldest's time and the count of each reason (from the store: a cluster broker sees every partition's)."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for group in await server.storage.dead_letter_groups():
        topic = server.partition_of(group.topic)[0]
        row = found.setdefault(
            (topic, group.subscription),
            {"topic": topic, "subscription": group.subscription, "count": 0, "waiting": 0, "oldest": group.oldest,
             "reasons": {}, "partitions": set()},
        )  # fmt: skip
        row["count"] += group.letters
        row["waiting"] += group.waiting
        row["oldest"] = min(row["oldest"], group.oldest)
        row["reasons"][group.reason] = row["reasons"].get(group.reason, 0) + group.letters
        row["partitions"].add(group.partition)
    rows = []
    for (topic, _), row in sorted(found.items()):
        served = server.partition_names(topic)
        row["partitions"] = sorted(row["partitions"])
        row["served_here"] = sum(server.storage.serves(partition) for partition in served) == len(served)
        rows.append(row)
    return {"time": time.time(), "subscriptions": rows}
