"""Helpers shared by the benchmark scripts: arguments, seeded key draws, timing, tables.

Each script runs as ``python benchmarks/NAME.py [--quick]``, so this module is imported
as ``_common`` from the script's own folder. Timing is printed, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from keyfailover.core.dispatcher import COMPILED
from keyfailover.core.loops import LOOP_ENV, LoopName, chosen_loop
from keyfailover.core.ranges import RangeMap
from keyfailover.core.rebalance import Load, MultiRangePolicy, Policy

__all__ = [
    "DISTINCT_KEYS",
    "SEED",
    "ZIPF_EXPONENT",
    "best_of",
    "build_name",
    "consumer_ids",
    "format_count",
    "joined_range_map",
    "loop_names",
    "on_loop",
    "parse_quick",
    "print_goals",
    "print_table",
    "run_setting",
    "timed",
    "zipf_keys",
    "zipf_ranks",
]

T = TypeVar("T")

SEED = 20240601
"""Seed of every random draw, so two runs measure the same work."""

DISTINCT_KEYS = 100_000
"""How many distinct keys the Zipf-drawn keys come from."""

ZIPF_EXPONENT = 1.1
"""Skew of the drawn keys: over 100,000 keys the hottest is about 13% of all draws."""


def build_name() -> str:
    """Which build of keyfailover runs here and in the processes started from here (the same environment):
    ``compiled`` with the dispatcher core mypyc compiled (``scripts/setup``), ``plain`` with its source."""
    return "compiled" if COMPILED else "plain"


def run_setting() -> str:
    """The build and the event loop the keyfailover processes of a run use, for a table's title."""
    return f"{build_name()} build, {chosen_loop()} event loop"


def loop_names(text: str) -> list[LoopName]:
    """A ``--loops`` argument: comma-separated names of asyncio and uvloop, each checked to be usable here."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or any(name not in ("asyncio", "uvloop") for name in names):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of asyncio and uvloop")
    try:
        return [chosen_loop(name) for name in dict.fromkeys(names)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@contextlib.contextmanager
def on_loop(loop: LoopName | None) -> Iterator[None]:
    """Every keyfailover process started in the block (servers, spawned clients) runs on ``loop``
    (``$KEYFAILOVER_LOOP`` set for the block); None leaves the choice as it is."""
    if loop is None:
        yield
        return
    before = os.environ.get(LOOP_ENV)
    os.environ[LOOP_ENV] = loop
    try:
        yield
    finally:
        if before is None:
            del os.environ[LOOP_ENV]
        else:
            os.environ[LOOP_ENV] = before


def parse_quick(description: str) -> bool:
    """Parse the command line every script shares; True when ``--quick`` was given."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a small run that finishes in a few seconds")
    return bool(parser.parse_args().quick)


def zipf_ranks(rng: np.random.Generator, count: int, distinct: int, exponent: float) -> npt.NDArray[np.int64]:
    """``count`` draws from a Zipf law over ranks ``0 .. distinct - 1`` (rank 0 the most frequent).

    P(rank r) is proportional to ``(r + 1) ** -exponent``; unlike ``Generator.zipf`` the
    ranks are bounded, so exactly ``distinct`` keys can occur.
    """
    weights = np.arange(1, distinct + 1, dtype=np.float64) ** -exponent
    cumulative = np.cumsum(weights)
    cumulative /= cumulative[-1]
    ranks = np.searchsorted(cumulative, rng.random(count), side="right")
    return np.minimum(ranks, distinct - 1).astype(np.int64)


def zipf_keys(rng: np.random.Generator, count: int, prefix: str = "key-") -> list[str]:
    """``count`` keys ``<prefix><rank>`` drawn Zipf(``ZIPF_EXPONENT``) from ``DISTINCT_KEYS`` ranks.

    Every draw is a string of its own, made in draw order, as a reader decoding messages makes them.
    """
    return [f"{prefix}{rank}" for rank in zipf_ranks(rng, count, DISTINCT_KEYS, ZIPF_EXPONENT).tolist()]


def consumer_ids(count: int, prefix: str = "c", first: int = 0) -> list[str]:
    """``[prefix + str(first), ..., prefix + str(first + count - 1)]``."""
    return [f"{prefix}{i}" for i in range(first, first + count)]


def joined_range_map(consumers: Sequence[str], load: Load | None = None, policy: Policy | None = None) -> RangeMap:
    """The map the first consumer starts with whole, then each next one joins by ``policy`` (the default one)."""
    chosen = MultiRangePolicy() if policy is None else policy
    ranges = RangeMap()
    ranges.assign_all(consumers[0])
    for consumer in consumers[1:]:
        ranges = chosen.join(ranges, consumer, load if load is not None else Load())
    return ranges


def timed(action: Callable[[], T]) -> tuple[float, T]:
    """Seconds one call of ``action`` takes, and what it returned."""
    start = time.perf_counter()
    result = action()
    return time.perf_counter() - start, result


def best_of(action: Callable[[], T], repeats: int) -> tuple[float, T]:
    """The fastest of ``repeats`` calls of ``action`` (the least disturbed run): seconds and result."""
    return min((timed(action) for _ in range(repeats)), key=lambda outcome: outcome[0])


def format_count(value: float) -> str:
    """A large count or rate with thousands separators and no decimals."""
    return f"{value:,.0f}"


def print_table(
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    skipped: tuple[str, str | None] = ("", None),
) -> None:
    """Print a plain-text table: the first column left-aligned, the others right-aligned.

    ``skipped`` is a peer's name and why it was not run: when the reason is not None, a last row
    says so, its other cells "-".
    """
    peer, why = skipped
    if why is not None:
        rows = [*rows, [peer, f"skipped: {why}", *["-"] * (len(headers) - 2)]]
    widths = [max(len(headers[i]), *(len(row[i]) for row in rows)) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        return "  ".join([first.ljust(widths[0]), *(cell.rjust(w) for cell, w in zip(rest, widths[1:], strict=True))])

    print(title)
    print()
    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))
    print()


def print_goals(goals: Sequence[tuple[str, str, bool]]) -> None:
    """Print each ``(goal, measured, met)`` under a table; goals are reported, never asserted."""
    print("Goals (reported, not asserted):")
    for goal, measured, met in goals:
        print(f"  {goal}: measured {measured} -> {'met' if met else 'NOT met'}")
    print()
