"""How an evaluation is shown: a table per scenario with the lower bound, timing and drain tables, goals, a chart."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from keyfailover.tools.evaluate._drain import PROCESSING, DrainTimes
from keyfailover.tools.evaluate._run import BOUND, Result, Timing

__all__ = ["Goal", "drain_table", "goals", "plot", "scenario_table", "timing_table"]

OURS = "keyfailover"
PEER = "pulsar-consistent"
BALANCE_BAR = 1.10
"""Settled max/mean over the floor, wherever no key is heavier than a fair share."""
MOVED_BAR = 1.15
"""Traffic moved per join and per leave, shifts included, over the lower bound."""
BALANCED_SCENARIOS = ("uniform", "zipf", "rolling-restart", "scale", "random")
"""The scenarios whose keys are light enough to balance (the hot-key one has a key at 20%)."""
JOIN_MS_BARS = {64: 1.0, 1000: 5.0}
"""Median milliseconds of a join, a leave and a shift chance, by consumers."""


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table, the first column left-aligned and the rest right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        return "  ".join(
            [first.ljust(widths[0]), *(cell.rjust(width) for cell, width in zip(rest, widths[1:], strict=True))]
        )

    return "\n".join([line(headers), line(["-" * width for width in widths]), *(line(row) for row in rows)])


_SCENARIO_COLUMNS: tuple[tuple[str, str, str, bool], ...] = (
    ("max/mean", "max_mean_traffic", ".3f", True),
    ("at change", "max_mean_at_change", ".3f", True),
    ("final", "max_mean_final", ".3f", True),
    ("/floor", "over_floor", ".3f", False),
    ("sd", "stddev_traffic", ".3f", False),
    ("join traffic", "join_traffic_moved", ".3f", True),
    ("leave traffic", "leave_traffic_moved", ".3f", True),
    ("join keys", "join_keys_moved", ".3f", True),
    ("leave keys", "leave_keys_moved", ".3f", True),
    ("join/least", "join_vs_least", ".2f", False),
    ("leave/least", "leave_vs_least", ".2f", False),
    ("sticky keys", "stickiness_mean", ".3f", True),
    ("worst", "stickiness_min", ".3f", True),
    ("sticky traffic", "traffic_stickiness_mean", ".3f", True),
    ("ranges/consumer", "ranges_per_consumer", ".1f", False),
    ("ms", "reassign_ms_mean", ".3f", False),
)
"""The columns of :func:`scenario_table` after the strategy: header, :class:`Result` field, format, and whether
the lower bound has a value there; where it has none the cell is "-"."""


def scenario_table(results: Sequence[Result]) -> str:
    """One row per strategy (and the lower bound): balance, what each change moved, stickiness, ranges, time."""
    headers = ["strategy", *(header for header, _, _, _ in _SCENARIO_COLUMNS)]
    rows = [
        [
            r.strategy,
            *(
                format(getattr(r, name), spec) if r.strategy != BOUND or bounded else "-"
                for _, name, spec, bounded in _SCENARIO_COLUMNS
            ),
        ]
        for r in results
    ]
    return _table(headers, rows)


def timing_table(timings: Sequence[Timing]) -> str:
    """Milliseconds per join, leave and shift chance among many consumers."""
    headers = ["strategy", "consumers", "join ms", "leave ms", "p95 ms", "shift ms", "shift p95 ms"]
    rows = [
        [
            t.strategy,
            str(t.consumers),
            f"{t.join_ms:.3f}",
            f"{t.leave_ms:.3f}",
            f"{t.p95_ms:.3f}",
            "-" if t.shift_ms is None else f"{t.shift_ms:.3f}",
            "-" if t.shift_p95_ms is None else f"{t.shift_p95_ms:.3f}",
        ]
        for t in timings
    ]
    return _table(headers, rows)


def drain_table(drains: Sequence[DrainTimes]) -> str:
    """Seconds from each kind of range change until its last draining key was released."""
    headers = ["change", "count", "mean s", "max s", "still draining"]
    rows = [
        [d.reason, str(d.changes), f"{d.mean_seconds:.2f}", f"{d.max_seconds:.2f}", str(d.undrained)] for d in drains
    ]
    return _table(headers, rows) + f"\n(consumers ack each delivery {PROCESSING:g} s after receiving it)"


@dataclass(frozen=True)
class Goal:
    """One goal of the issue for our policy: what it asks, what was measured, whether it holds."""

    text: str
    measured: str
    holds: bool

    def __str__(self) -> str:
        return f"[{'holds' if self.holds else 'FAILS'}] {self.text}: {self.measured}"


def goals(results: Sequence[Result], timings: Sequence[Timing]) -> list[Goal]:
    """Check our policy's goals (issue 12's bars) on whatever scenarios and timings were run."""
    by = {(r.strategy, r.scenario): r for r in results}
    scenarios = list(dict.fromkeys(r.scenario for r in results))
    found: list[Goal] = []
    for scenario in scenarios:
        ours, peer, bound = by.get((OURS, scenario)), by.get((PEER, scenario)), by.get((BOUND, scenario))
        if ours is None:
            continue
        if peer is not None:
            found.append(
                Goal(
                    f"{scenario}: max/mean traffic no worse than {PEER}",
                    f"{ours.max_mean_traffic:.3f} vs {peer.max_mean_traffic:.3f}",
                    ours.max_mean_traffic <= peer.max_mean_traffic,
                )
            )
        if scenario in BALANCED_SCENARIOS:
            found.append(
                Goal(
                    f"{scenario}: max/mean traffic <= {BALANCE_BAR:.2f} x the floor (a key heavier than a fair share)",
                    f"{ours.over_floor:.3f} (max/mean {ours.max_mean_traffic:.3f}, floor {ours.hot_floor:.3f})",
                    ours.over_floor <= BALANCE_BAR,
                )
            )
        for kind, versus, moved, ideal in (
            ("join", ours.join_vs_least, ours.join_traffic_moved, bound.join_traffic_moved if bound else None),
            ("leave", ours.leave_vs_least, ours.leave_traffic_moved, bound.leave_traffic_moved if bound else None),
        ):
            reference = "" if ideal is None else f"; from a perfectly balanced state {ideal:.3f}"
            found.append(
                Goal(
                    f"{scenario}: traffic moved per {kind}, shifts included, <= {MOVED_BAR:.2f} x the least possible",
                    f"{versus:.2f}x (moved {moved:.3f} per {kind}{reference})",
                    versus <= MOVED_BAR,
                )
            )
        if peer is not None:
            found.append(
                Goal(
                    f"{scenario}: key stickiness no worse than {PEER}",
                    f"{ours.stickiness_mean:.3f} vs {peer.stickiness_mean:.3f}",
                    ours.stickiness_mean >= peer.stickiness_mean,
                )
            )
    hot = by.get((OURS, "hot-key"))
    if hot is not None:
        found.append(
            Goal(
                "hot key: its owner carries no other heavy load (at most 0.1 mean loads besides the key)",
                f"{hot.hot_others:.3f} mean loads besides the key; max/mean {hot.max_mean_traffic:.3f}, "
                f"floor {hot.hot_floor:.3f}",
                hot.hot_others <= 0.1,
            )
        )
    for timing in timings:
        if timing.strategy == OURS and timing.consumers in JOIN_MS_BARS:
            bar = JOIN_MS_BARS[timing.consumers]
            slowest = max(timing.join_ms, timing.leave_ms, timing.shift_ms or 0.0)
            found.append(
                Goal(
                    f"reassignment <= {bar:g} ms with {timing.consumers} consumers (median)",
                    f"join {timing.join_ms:.3f} ms, leave {timing.leave_ms:.3f} ms, "
                    f"shift {timing.shift_ms or 0.0:.3f} ms",
                    slowest <= bar,
                )
            )
    return found


def plot(results: Sequence[Result], path: Path) -> None:
    """Draw max/mean traffic and key stickiness per scenario and strategy to ``path`` (PNG).

    Needs matplotlib (``pip install keyfailover[plot]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r.scenario for r in results))
    strategies = [s for s in dict.fromkeys(r.strategy for r in results) if s != BOUND]
    by = {(r.strategy, r.scenario): r for r in results}
    figure, (balance_axes, sticky_axes) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    width = 0.8 / len(strategies)
    for index, strategy in enumerate(strategies):
        offsets = [position + (index - (len(strategies) - 1) / 2) * width for position in range(len(scenarios))]
        balance_axes.bar(offsets, [by[strategy, s].max_mean_traffic for s in scenarios], width, label=strategy)
        sticky_axes.bar(offsets, [by[strategy, s].stickiness_mean for s in scenarios], width, label=strategy)
    bounds = [by[BOUND, s] for s in scenarios if (BOUND, s) in by]
    if len(bounds) == len(scenarios):
        span = [position + offset for position in range(len(scenarios)) for offset in (-0.45, 0.45)]
        balance_axes.plot(span, [b.max_mean_traffic for b in bounds for _ in (0, 1)], "k_", label="floor")
        sticky_axes.plot(span, [b.stickiness_mean for b in bounds for _ in (0, 1)], "k_", label=BOUND)
    balance_axes.set_ylabel("max/mean traffic (lower is better)")
    balance_axes.axhline(1.0, color="grey", linewidth=0.8)
    balance_axes.legend(ncol=3, fontsize="small")
    sticky_axes.set_ylabel("keys keeping their consumer\nper change, with shifts (higher is better)")
    sticky_axes.set_ylim(0.0, 1.0)
    sticky_axes.set_xticks(range(len(scenarios)), scenarios)
    figure.suptitle("Rebalancing strategies: balance and stickiness (keyfailover evaluate)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
