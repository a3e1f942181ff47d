"""Rebalancing strategies compared on balance, what they move, and time (``keyfailover evaluate``).

Our two policies and what Pulsar (3.x and 4.x, computed as Pulsar computes them), Flink
and RocketMQ ship or proposed, behind one interface, run through seeded scenarios beside
a lower bound; the measures are those of the RocketMQ sticky rebalancing proposal,
applied to keys and traffic. docs/evaluation.md has the results.
"""

from collections.abc import Callable

from keyfailover.tools.evaluate._drain import DrainTimes, drain_times
from keyfailover.tools.evaluate._measures import (
    Balance,
    HotKey,
    balance,
    consumer_loads,
    fair_level,
    hot_key,
    least_moved,
    stickiness,
)
from keyfailover.tools.evaluate._report import Goal, drain_table, goals, plot, scenario_table, timing_table
from keyfailover.tools.evaluate._run import (
    BOUND,
    JSON_KEYS,
    SHIFTS_PER_EVENT,
    Result,
    Timing,
    ideal,
    run_strategy,
    time_reassignments,
)
from keyfailover.tools.evaluate._scenarios import SCENARIOS, SEED, Population, Scenario, build_scenario
from keyfailover.tools.evaluate._strategies import (
    STRATEGIES,
    Event,
    FlinkKeyGroups,
    Join,
    KeyFailover,
    KeyFailoverContiguous,
    Leave,
    Measured,
    Ownership,
    PulsarAutoSplit,
    PulsarConsistent,
    PulsarConsistent3,
    RocketMQAveragely,
    RocketMQSticky,
    Strategy,
)

__all__ = [
    "BOUND",
    "JSON_KEYS",
    "SCENARIOS",
    "SEED",
    "SHIFTS_PER_EVENT",
    "STRATEGIES",
    "Balance",
    "DrainTimes",
    "Event",
    "FlinkKeyGroups",
    "Goal",
    "HotKey",
    "Join",
    "KeyFailover",
    "KeyFailoverContiguous",
    "Leave",
    "Measured",
    "Ownership",
    "Population",
    "PulsarAutoSplit",
    "PulsarConsistent",
    "PulsarConsistent3",
    "Result",
    "RocketMQAveragely",
    "RocketMQSticky",
    "Scenario",
    "Strategy",
    "Timing",
    "balance",
    "build_scenario",
    "consumer_loads",
    "drain_table",
    "drain_times",
    "evaluate",
    "fair_level",
    "goals",
    "hot_key",
    "ideal",
    "least_moved",
    "plot",
    "run_strategy",
    "scenario_table",
    "stickiness",
    "time_reassignments",
    "timing_table",
]


def evaluate(
    scenarios: tuple[str, ...] = SCENARIOS,
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
    seed: int = SEED,
) -> list[Result]:
    """Every strategy through each of ``scenarios`` (drawn with ``seed``) and the lower bound, in table order.

    ``progress`` hears of each scenario.
    """
    results: list[Result] = []
    for number, name in enumerate(scenarios, 1):
        if progress is not None:
            progress(f"scenario {number}/{len(scenarios)}: {name}, {len(STRATEGIES)} strategies")
        scenario = build_scenario(name, quick, seed)
        results.extend(run_strategy(strategy(), scenario) for strategy in STRATEGIES.values())
        results.append(ideal(scenario))
    return results
