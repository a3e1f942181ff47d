"""How an evaluation is shown: a table per scenario, the timing and drain tables, the goals, a chart."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from keyfailover.tools.evaluate._drain import PROCESSING, DrainTimes
from keyfailover.tools.evaluate._run import Result, Timing

__all__ = ["Goal", "drain_table", "goals", "plot", "scenario_table", "timing_table"]

OURS = "keyfailover"
PEER = "pulsar-consistent"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table, the first column left-aligned and the rest right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        return "  ".join(
            [first.ljust(widths[0]), *(cell.rjust(width) for cell, width in zip(rest, widths[1:], strict=True))]
        )

    return "\n".join([line(headers), line(["-" * width for width in widths]), *(line(row) for row in rows)])


def scenario_table(results: Sequence[Result]) -> str:
    """One row per strategy: balance (settled, before shifts, final), stickiness and reassignment time."""
    headers = [
        "strategy",
        "max/mean",
        "before shifts",
        "final",
        "sd traffic",
        "sd space",
        "sticky keys",
        "worst",
        "change only",
        "sticky traffic",
        "joins",
        "joins+shifts",
        "ms",
    ]
    rows = [
        [
            r.strategy,
            f"{r.max_mean_traffic:.3f}",
            f"{r.max_mean_at_change:.3f}",
            f"{r.max_mean_final:.3f}",
            f"{r.stddev_traffic:.3f}",
            f"{r.stddev_space:.3f}",
            f"{r.stickiness_mean:.3f}",
            f"{r.stickiness_min:.3f}",
            f"{r.change_stickiness_mean:.3f}",
            f"{r.traffic_stickiness_mean:.3f}",
            f"{r.join_stickiness:.3f}",
            f"{r.join_stickiness_settled:.3f}",
            f"{r.reassign_ms_mean:.3f}",
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
    """Check our policy's goals on whatever scenarios and timings were run."""
    by = {(r.strategy, r.scenario): r for r in results}
    scenarios = list(dict.fromkeys(r.scenario for r in results))
    found: list[Goal] = []
    restart = by.get((OURS, "rolling-restart"))
    if restart is not None:
        split = by.get(("pulsar-autosplit", "rolling-restart"))
        peer = "" if split is None else f" (pulsar-autosplit {split.max_mean_final:.3f})"
        found.append(
            Goal(
                "rolling restart, Zipf keys: max/mean traffic <= 1.15 after the restart",
                f"{restart.max_mean_final:.3f}{peer}",
                restart.max_mean_final <= 1.15,
            )
        )
    for scenario in scenarios:
        ours, peer_result = by.get((OURS, scenario)), by.get((PEER, scenario))
        if ours is None or peer_result is None:
            continue
        found.append(
            Goal(
                f"{scenario}: max/mean traffic within 5% of {PEER}",
                f"{ours.max_mean_traffic:.3f} vs {peer_result.max_mean_traffic:.3f}",
                ours.max_mean_traffic <= 1.05 * peer_result.max_mean_traffic,
            )
        )
        # The peer never shifts, so its join is all it moves; ours is judged on the join alone
        # and on the join with the shifts that follow it (the state whose balance is judged above).
        found.append(
            Goal(
                f"{scenario}: key stickiness of the join itself no worse than {PEER}",
                f"{ours.join_stickiness:.3f} vs {peer_result.join_stickiness:.3f}",
                ours.join_stickiness >= peer_result.join_stickiness,
            )
        )
        found.append(
            Goal(
                f"{scenario}: key stickiness of the join and the shifts that follow it no worse than {PEER}",
                f"{ours.join_stickiness_settled:.3f} vs {peer_result.join_stickiness:.3f}",
                ours.join_stickiness_settled >= peer_result.join_stickiness,
            )
        )
    hot = by.get((OURS, "hot-key"))
    if hot is not None:
        isolated = hot.hot_floor <= 1.0 or hot.hot_others <= 0.1
        found.append(
            Goal(
                "hot key: max/mean at the granularity floor (or under the shift threshold), "
                "its owner carrying no other heavy slots when the key alone exceeds the mean",
                f"max/mean {hot.max_mean_traffic:.3f}, floor {hot.hot_floor:.3f}; "
                f"its owner carries {hot.hot_others:.3f} mean loads besides the key",
                hot.max_mean_traffic <= max(1.02 * hot.hot_floor, 1.1) and isolated,
            )
        )
    for timing in timings:
        if timing.strategy == OURS:
            slowest = max(timing.join_ms, timing.leave_ms, timing.shift_ms or 0.0)
            found.append(
                Goal(
                    f"reassignment under 1 ms with {timing.consumers} consumers (median)",
                    f"join {timing.join_ms:.3f} ms, leave {timing.leave_ms:.3f} ms, "
                    f"shift {timing.shift_ms or 0.0:.3f} ms",
                    slowest < 1.0,
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
    strategies = list(dict.fromkeys(r.strategy for r in results))
    by = {(r.strategy, r.scenario): r for r in results}
    figure, (balance_axes, sticky_axes) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    width = 0.8 / len(strategies)
    for index, strategy in enumerate(strategies):
        offsets = [position + (index - (len(strategies) - 1) / 2) * width for position in range(len(scenarios))]
        balance_axes.bar(offsets, [by[strategy, s].max_mean_traffic for s in scenarios], width, label=strategy)
        sticky_axes.bar(offsets, [by[strategy, s].stickiness_mean for s in scenarios], width, label=strategy)
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
