"""What the demos report and the tables they print: shared by every demo."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TextIO

import numpy as np

from keyfailover.core.hashing import HASH_RANGE_SIZE

__all__ = [
    "RANGES_HEADER",
    "TAIL_HEADER",
    "DemoReport",
    "describe_ranges",
    "final_table",
    "in_hash_order",
    "verdict",
    "zipf_ids",
]


@dataclass
class DemoReport:
    """What the demo observed; ``problems`` is empty when every guarantee held."""

    published: int = 0
    acked: int = 0
    deliveries: dict[str, int] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)
    """Each consumer's state at the end: active, left, or stalled then removed."""
    redeliveries: int = 0
    problems: list[str] = field(default_factory=list)
    steps: list[tuple[str, dict[str, list[tuple[int, int]]]]] = field(default_factory=list)
    """Each table printed, in order: its title and the ranges each live consumer owned."""


def zipf_ids(count: int, distinct: int, seed: int) -> list[int]:
    """``count`` Zipf(1.1) draws in ``[1, distinct]``."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while len(ids) < count:
        drawn = rng.zipf(1.1, count * 4)
        ids.extend(drawn[drawn <= distinct][: count - len(ids)].tolist())
    return ids


def final_table(out: TextIO, report: DemoReport) -> None:
    """Write each consumer's delivery count and status."""
    out.write(f"\n  {'consumer':<10}{'deliveries':>12}  {'status'}\n")
    for consumer in sorted(report.deliveries.keys() | report.status.keys()):
        count = report.deliveries.get(consumer, 0)
        out.write(f"  {consumer:<10}{count:>12}  {report.status.get(consumer, 'active')}\n")


def verdict(out: TextIO, report: DemoReport, held: str) -> None:
    """Write the guarantees' violations found, the first 20, or ``held`` when there are none."""
    if report.problems:
        out.write("GUARANTEE VIOLATED:\n" + "".join(f"  {p}\n" for p in report.problems[:20]))
    else:
        out.write(held + "\n")


_SHOWN_RANGES = 3
"""Ranges listed per consumer in the tables; the rest are counted."""


def describe_ranges(ranges: list[tuple[int, int]]) -> tuple[str, str]:
    """A consumer's ranges for the tables: ``("3 ranges, 12.5% of slots", "[0, 99] [500, 899] ...")``."""
    if not ranges:
        return "no range (standby)", ""
    share = sum(end - start + 1 for start, end in ranges) / HASH_RANGE_SIZE
    summary = f"{len(ranges)} range{'' if len(ranges) == 1 else 's'}, {share:.1%} of slots"
    listed = " ".join(f"[{start}, {end}]" for start, end in ranges[:_SHOWN_RANGES])
    more = len(ranges) - _SHOWN_RANGES
    return summary, listed + (f" and {more} more" if more > 0 else "")


RANGES_HEADER = f"{'hash ranges':<28}"
TAIL_HEADER = f"  {'status':<9}first ranges"


def in_hash_order(owned: dict[str, list[tuple[int, int]]]) -> list[tuple[str, list[tuple[int, int]]]]:
    """``(consumer, ranges)`` by each consumer's first range; standbys, owning none, last."""
    return sorted(owned.items(), key=lambda item: (not item[1], item[1][:1]))
