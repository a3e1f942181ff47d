"""The report of a chaos run: ``report.md`` and PNG charts in a folder, and the lines a terminal shows.

``report.md`` has the command's settings, how faults were injected, the schedule as applied,
the checkers' verdicts, the run's measures (counts, latency percentiles, the longest a
partition went unserved after each fault) and the strategies' measures under the run's
faults (:mod:`._measures`); ``logs/`` beside it has every process's log and each broker's last
``/stats``. The charts (``timeline.png``: throughput with the faults shaded,
partitions per broker and ranges per consumer over time; ``latency.png``) need matplotlib
(``keyfailover[plot]``); without it the report says so and has everything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from keyfailover.tools.chaos._checkers import Verdict
from keyfailover.tools.chaos._measures import RunMeasures, StrategyMeasures
from keyfailover.tools.chaos._records import Fault, Record

__all__ = ["FAULT_METHODS", "settings_table", "summary_lines", "write_report"]

FAULT_METHODS = {
    "kill": "SIGKILL to the process, restarted with the same command after the fault's length",
    "suspend": "SIGSTOP to the process, SIGCONT after the fault's length",
    "loss": "a fault-injecting TCP proxy on each link of the target (a broker: its clients', ZooKeeper and "
    "PostgreSQL links; ZooKeeper: every broker's link to it; a consumer: its links to every broker, through "
    "proxies of its own, switched by SIGUSR1/SIGUSR2) loses 30% of segments, which TCP resends after 200 ms "
    "doubling (everything behind waits), and delays each by 50 ms plus up to 50 ms",
}


def summary_lines(verdicts: Sequence[Verdict], measures: RunMeasures) -> list[str]:
    """What the terminal shows at the end: counts, latency, one line per checker."""
    latency = ", ".join(f"{name} {value:.1f} ms" for name, value in measures.latency_ms.items()) or "none delivered"
    lines = [
        f"sent {measures.sent}, confirmed {measures.confirmed}, delivered {measures.delivered} "
        f"(again: {measures.redelivered})",
        f"receipt -> first delivery: {latency}",
    ]
    return lines + [verdict.line() for verdict in verdicts]


def write_report(
    folder: Path,
    *,
    command: str,
    settings: dict[str, object],
    applied: Sequence[str],
    verdicts: Sequence[Verdict],
    measures: RunMeasures,
    strategies: Sequence[StrategyMeasures],
    records: Sequence[Record],
    started: float,
    netem: str,
) -> Path:
    """Write ``report.md`` (and the charts, when matplotlib is there) into ``folder``; returns the report's path."""
    folder.mkdir(parents=True, exist_ok=True)
    charts = _charts(folder, measures, records, started)
    passed = all(v.passed for v in verdicts)
    lines = [
        "# keyfailover chaos report",
        "",
        f"`{command}`",
        "",
        f"**{'Every checker passed.' if passed else 'A checker FAILED.'}**",
        "",
        "## Settings",
        "",
        "| setting | value |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in settings.items()),
        "",
        "## Faults",
        "",
        "How each fault was injected:",
        "",
        *(f"- `{kind}`: {how}" for kind, how in FAULT_METHODS.items()),
        f"- netem: {netem}",
        "",
        "As applied (times from the start of the schedule):",
        "",
        *(f"- {line}" for line in applied),
        *(["- (none: the run was shorter than the first fault)"] if not applied else []),
        "",
        "## Checkers",
        "",
        "| checker | verdict | violations | measures |",
        "|---|---|---|---|",
        *(
            f"| {v.checker} | {'pass' if v.passed else '**FAIL**'} | {v.violations} | "
            + ", ".join(f"{name} {_number(value)}" for name, value in v.measures.items())
            + " |"
            for v in verdicts
        ),
        "",
        *(f"- {v.checker}: {example}" for v in verdicts for example in v.examples),
        "",
        "## Measures",
        "",
        f"- sends {measures.sent}, confirmed {measures.confirmed}; delivered {measures.delivered}, "
        f"delivered again {measures.redelivered}",
        "- receipt of a send to its first delivery: "
        + (", ".join(f"{name} {value:.1f} ms" for name, value in measures.latency_ms.items()) or "nothing delivered"),
        "",
        "The longest a partition went without a broker, starting during each fault:",
        "",
        "| fault | longest unserved s |",
        "|---|---|",
        *(f"| {line} | {seconds:.3f} |" for line, seconds in measures.unserved_after_fault),
        "",
        "## Strategies under this run's faults",
        "",
        "The membership changes the faults caused, replayed through each strategy with the run's own key "
        "traffic: balance degree (std-dev of load per member in mean units, lower is better), stickiness "
        "(share of partitions or keys keeping their member per change, higher is better), reassignment time.",
        "",
        "| level | strategy | changes | balance sd | stickiness | reassign ms |",
        "|---|---|---|---|---|---|",
        *(
            f"| {s.level} | {s.strategy} | {s.changes} | {s.balance_sd:.3f} | {s.stickiness:.3f} | "
            f"{s.reassign_ms:.3f} |"
            for s in strategies
        ),
        *(
            ["", "(no membership change of consumers: level 2 has nothing to compare)"]
            if not any(s.level == 2 for s in strategies)
            else []
        ),
        "",
        "## Charts",
        "",
        *(f"![{name}]({name})" for name in charts),
        *(["(matplotlib is not installed: pip install keyfailover[plot] for the charts)"] if not charts else []),
        "",
    ]
    path = folder / "report.md"
    path.write_text("\n".join(lines))
    return path


def settings_table(settings: object) -> dict[str, object]:
    """A dataclass of settings as the report's table rows."""
    return {
        name: ",".join(map(str, value)) if isinstance(value, tuple) else value
        for name, value in asdict(settings).items()  # type: ignore[call-overload]
    }


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3f}"


def _charts(folder: Path, measures: RunMeasures, records: Sequence[Record], started: float) -> list[str]:
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = [r for r in records if isinstance(r, Fault)]
    spans = []
    for fault in (f for f in faults if f.action == "start"):
        end = next((f.t for f in faults if f.target == fault.target and f.action == "end" and f.t >= fault.t), None)
        spans.append(
            (fault.t - started, (end if end is not None else fault.t) - started, f"{fault.kind} {fault.target}")
        )
    figure, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    throughput, brokers, consumers = axes
    for name, counts in measures.throughput.items():
        throughput.plot(range(len(counts)), counts, label=f"{name}/s")
    throughput.set_ylabel("messages per second")
    for name, series in measures.partitions_per_broker.items():
        brokers.step([t for t, _ in series], [n for _, n in series], where="post", label=name)
    brokers.set_ylabel("partitions served")
    for name, series in measures.ranges_per_consumer.items():
        consumers.step([t for t, _ in series], [n for _, n in series], where="post", label=name)
    consumers.set_ylabel("ranges owned")
    consumers.set_xlabel("seconds from the start of the schedule")
    for ax in axes:
        for low, high, _ in spans:
            ax.axvspan(low, max(high, low + 0.2), color="tab:red", alpha=0.15)
        ax.legend(fontsize="small", ncol=4, loc="upper right")
    for low, _, label in spans:
        throughput.annotate(label, (low, 0), xytext=(2, 2), textcoords="offset points", fontsize="x-small", rotation=90)
    figure.suptitle("keyfailover chaos: throughput and ownership (faults shaded)")
    figure.tight_layout()
    figure.savefig(folder / "timeline.png", dpi=100)
    plt.close(figure)
    charts = ["timeline.png"]
    if measures.latency_ms:
        figure, ax = plt.subplots(figsize=(6, 3.5))
        names = list(measures.latency_ms)
        ax.bar(names, [measures.latency_ms[n] for n in names])
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title("receipt of a send to its first delivery")
        figure.tight_layout()
        figure.savefig(folder / "latency.png", dpi=100)
        plt.close(figure)
        charts.append("latency.png")
    return charts
