"""The report of a chaos run: ``report.md`` and PNG charts in a folder, and the lines a terminal shows.

``report.md`` has the command's settings, how faults were injected, the schedule as applied,
the checkers' verdicts, the run's measures (counts, latency percentiles, the longest a
partition went unserved after each fault) and the strategies' measures under the run's
faults (:mod:`._measures`); ``logs/`` beside it has every process's log and each broker's last
``/stats``. The charts (``timeline.png``: throughput with the faults shaded,
partitions per broker and ranges per consumer over time, and with a replicated store its members'
roles; ``latency.png``) need matplotlib
(``keyfailover[plot]``); without it the report says so and has everything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from keyfailover.tools.chaos._checkers import RESUME_MARGIN, StoreFailover, Verdict, store_failovers
from keyfailover.tools.chaos._measures import RunMeasures, StrategyMeasures
from keyfailover.tools.chaos._records import Fault, Record, StoreRoles

__all__ = ["FAULT_METHODS", "STORE_METHODS", "settings_table", "summary_lines", "write_report"]

FAULT_METHODS = {
    "kill": "SIGKILL to the process, restarted with the same command after the fault's length",
    "suspend": "SIGSTOP to the process, SIGCONT after the fault's length",
    "loss": "a fault-injecting TCP proxy on each link of the target (a broker: its clients', ZooKeeper and "
    "PostgreSQL links; ZooKeeper: every broker's link to it; a consumer: its links to every broker, through "
    "proxies of its own, switched by SIGUSR1/SIGUSR2) loses 30% of segments, which TCP resends after 200 ms "
    "doubling (everything behind waits), and delays each by 50 ms plus up to 50 ms",
}


STORE_METHODS = {
    "kill": "SIGKILL to the primary's Patroni and PostgreSQL together, as a machine that dies; the member is "
    "restarted after the fault's length and rejoins as a standby",
    "suspend": "SIGSTOP to the primary's Patroni and every PostgreSQL process of it, as a machine that freezes; "
    "SIGCONT after the fault's length",
    "loss": "every link of the primary loses and delays as above: each broker's to it, its Patroni's to "
    "ZooKeeper, and the standby's replication from it (a proxy per link)",
}


def summary_lines(
    verdicts: Sequence[Verdict], measures: RunMeasures, failovers: Sequence[StoreFailover] = ()
) -> list[str]:
    """What the terminal shows at the end: counts, latency, each fault on the store, one line per checker."""
    latency = ", ".join(f"{name} {value:.1f} ms" for name, value in measures.latency_ms.items()) or "none delivered"
    lines = [
        f"sent {measures.sent}, confirmed {measures.confirmed}, delivered {measures.delivered} "
        f"(again: {measures.redelivered})",
        f"receipt -> first delivery: {latency}",
    ]
    lines += [f"store: {_resumed(failover)}" for failover in failovers]
    return lines + [verdict.line() for verdict in verdicts]


def _resumed(failover: StoreFailover) -> str:
    """How long writes took to resume after a fault on the store, against its bound."""
    said = f"{failover.kind} {failover.member}: "
    if failover.resumed is None:
        return said + f"partitions {', '.join(map(str, failover.waiting)) or 'all'} never stored a later send"
    return (
        said + f"writes resumed on every partition after {failover.resumed:.3f} s "
        f"(the first after {failover.first:.3f} s; bound {failover.bound:.1f} s)"
    )


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
    store_ttl: float | None = None,
    ended: float | None = None,
) -> Path:
    """Write ``report.md`` (and the charts, when matplotlib is there) into ``folder``; returns the report's path.

    With ``store_ttl``, Patroni's ``ttl`` of a run with a replicated store, a section on the store: how
    its faults were injected, its members' role changes and how long writes took to resume after each.
    """
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
        *(_store_section(records, store_ttl, started, ended) if store_ttl is not None else []),
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


def _store_section(records: Sequence[Record], ttl: float, started: float, ended: float | None) -> list[str]:
    """The report's section on the replicated store: faults, role changes, writes resumed against the bound."""
    failovers = store_failovers(records, ttl, ended)
    changes = [record for record in records if isinstance(record, StoreRoles)]
    return [
        "## The replicated store",
        "",
        f"Two PostgreSQL servers under Patroni (ttl {ttl:g} s, synchronous mode, its state in the run's ZooKeeper); "
        "a fault on the store hits the member that is its primary when the fault starts:",
        "",
        *(f"- `{kind}`: {how}" for kind, how in STORE_METHODS.items()),
        "",
        f"Writes resumed: the time from a fault's start until every partition stored a send made after it. "
        f"Bound: ttl {ttl:g} s + {RESUME_MARGIN:g} s = {ttl + RESUME_MARGIN:g} s after a kill; plus the fault's "
        "own length after a suspend or a loss.",
        "",
        "| fault | first partition s | every partition s | bound s | within |",
        "|---|---|---|---|---|",
        *(
            f"| t+{f.t - started:.1f}s {f.kind} {f.member} for {f.length:.1f}s | {_seconds(f.first)} | "
            f"{_seconds(f.resumed)} | {f.bound:.1f} | "
            + ("yes" if f.resumed is not None and f.resumed <= f.bound else "**NO**")
            + " |"
            for f in failovers
        ),
        *(["| (no fault on the store was applied) | | | | |"] if not failovers else []),
        "",
        "Its members as Patroni listed them, at each change (polled every 0.5 s):",
        "",
        *(
            f"- t+{change.t - started:.1f}s: "
            + (", ".join(f"{member} {role} {state}" for member, role, state in change.members) or "no member answered")
            for change in changes
        ),
        "",
    ]


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.3f}"


def settings_table(settings: object) -> dict[str, object]:
    """A dataclass of settings as the report's table rows."""
    return {
        name: ",".join(map(str, value)) if isinstance(value, tuple) else value
        for name, value in asdict(settings).items()  # type: ignore[call-overload]
    }


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3f}"


ROLE_COLOURS = {"leader": "tab:green", "sync_standby": "tab:blue", "replica": "tab:olive"}
"""The colour of each Patroni role on the timeline; any other is grey."""


def _draw_roles(ax: Any, roles: Sequence[StoreRoles], started: float, end: float) -> None:
    """Each store member's role over time on ``ax``: a row per member, coloured by role, hatched unless
    its state is running or streaming; nothing where Patroni did not list it."""
    from matplotlib.patches import Patch

    members = sorted({member for change in roles for member, _, _ in change.members})
    rows = {member: row for row, member in enumerate(members)}
    shown: dict[str, None] = {}
    for change, after in zip(roles, [*roles[1:], None], strict=True):
        low, high = change.t - started, (end if after is None else after.t) - started
        for member, role, state in change.members:
            shown[role] = None
            ax.broken_barh(
                [(low, max(high - low, 0.01))],
                (rows[member] - 0.4, 0.8),
                facecolors=ROLE_COLOURS.get(role, "tab:gray"),
                hatch=None if state in ("running", "streaming") else "//",
            )
    handles = [Patch(facecolor=ROLE_COLOURS.get(role, "tab:gray"), label=role) for role in shown]
    handles.append(Patch(facecolor="white", hatch="//", label="not running"))
    ax.set_yticks(range(len(members)), members)
    ax.set_ylabel("store roles")
    ax.legend(handles=handles, fontsize="small", ncol=4, loc="upper right")


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
    roles = [r for r in records if isinstance(r, StoreRoles)]
    figure, axes = plt.subplots(4 if roles else 3, 1, figsize=(11, 11 if roles else 9), sharex=True)
    throughput, brokers, consumers = axes[:3]
    for name, counts in measures.throughput.items():
        throughput.plot(range(len(counts)), counts, label=f"{name}/s")
    throughput.set_ylabel("messages per second")
    for name, series in measures.partitions_per_broker.items():
        brokers.step([t for t, _ in series], [n for _, n in series], where="post", label=name)
    brokers.set_ylabel("partitions served")
    for name, series in measures.ranges_per_consumer.items():
        consumers.step([t for t, _ in series], [n for _, n in series], where="post", label=name)
    consumers.set_ylabel("ranges owned")
    if roles:
        _draw_roles(axes[3], roles, started, max(r.t for r in records))
    axes[-1].set_xlabel("seconds from the start of the schedule")
    for ax in axes:
        for low, high, _ in spans:
            ax.axvspan(low, max(high, low + 0.2), color="tab:red", alpha=0.15)
    for ax in axes[:3]:
        if ax.get_legend_handles_labels()[0]:  # a run whose records have none of a row's series draws no legend
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
