"""``keyfailover chaos``: run the harness, check every invariant, measure, report."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from keyfailover.tools.chaos._checkers import Verdict, check_all, store_failovers
from keyfailover.tools.chaos._harness import ChaosRun, ChaosSettings, run_chaos
from keyfailover.tools.chaos._measures import (
    RunMeasures,
    StrategyMeasures,
    level_1,
    level_2,
    memberships,
    run_measures,
)
from keyfailover.tools.chaos._netns import support as netns_support
from keyfailover.tools.chaos._records import Produced, RecordWriter
from keyfailover.tools.chaos._report import settings_table, summary_lines, write_report
from keyfailover.tools.services import PostgreSQL, ZooKeeper

__all__ = ["ChaosOutcome", "chaos"]


@dataclass
class ChaosOutcome:
    """A checked run: its records, the verdicts, the measures, and the report's path if one was written."""

    run: ChaosRun
    verdicts: list[Verdict]
    measures: RunMeasures
    strategies: list[StrategyMeasures]
    report: Path | None

    @property
    def passed(self) -> bool:
        """Whether every checker passed."""
        return all(verdict.passed for verdict in self.verdicts)


def _netem() -> str:
    """Whether this kernel has netem, for the report (the proxy is what the run used either way)."""
    found = netns_support()
    if found.netem:
        return "this kernel has it; the run used the proxy all the same, so runs compare across machines"
    return "this kernel has none" + (f" ({found.reason})" if found.reason else "") + ": the proxy was used"


def chaos(
    settings: ChaosSettings,
    *,
    report: Path | None = None,
    keep: Path | None = None,
    command: str = "keyfailover chaos",
    out: TextIO = sys.stdout,
    zookeeper: ZooKeeper | None = None,
    postgres: PostgreSQL | None = None,
) -> ChaosOutcome:
    """Run :func:`run_chaos`, then every checker, the measures and (with ``report``) the report.

    ``postgres`` is not used by a run with the ``store`` target: it starts a replicated store of its own.
    """
    logs = None if report is None else report / "logs"
    run = run_chaos(settings, out, zookeeper=zookeeper, postgres=postgres, keep=keep, logs=logs)
    records = run.records
    store_ttl = settings.store_ttl if "store" in settings.targets else None
    verdicts = check_all(
        records, settings.partitions, settings.unowned_limit, settings.ack_timeout, end=run.ended, store_ttl=store_ttl
    )
    measures = run_measures(records, run.started, settings.partitions)
    brokers = [f"b{n}" for n in range(1, settings.brokers + 1)]
    consumers = [f"c{n}" for n in range(1, settings.consumers + 1)]
    sent = Counter(record.key for record in records if isinstance(record, Produced) and record.ok)
    strategies = level_1(brokers, settings.partitions, memberships(records, "b", settings.session_timeout))
    strategies += level_2(consumers, dict(sent), memberships(records, "c", settings.ack_timeout))
    path = None
    if report is not None:
        path = write_report(
            report,
            command=command,
            settings=settings_table(settings),
            applied=run.applied,
            verdicts=verdicts,
            measures=measures,
            strategies=strategies,
            records=records,
            started=run.started,
            netem=_netem(),
            store_ttl=store_ttl,
            ended=run.ended,
        )
        if keep is None or keep.resolve() != report.resolve():
            (report / "records.jsonl").unlink(missing_ok=True)
            with RecordWriter(report / "records.jsonl") as writer:
                writer.write_all(records)
    for line in summary_lines(verdicts, measures, store_failovers(records, store_ttl, run.ended) if store_ttl else []):
        out.write(line + "\n")
    if path is not None:
        out.write(f"report: {path}\n")
    out.flush()
    return ChaosOutcome(run, verdicts, measures, strategies, path)
