"""``keyfailover demo``, ``evaluate``, ``chaos`` and ``plot``: runs that show, measure or break the system."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from keyfailover.tools.cli._common import (
    SubParsers,
    _admin_call,
    _admin_url,
    _int_at_least,
    _non_negative_float,
    _positive_float,
    _positive_int,
    _UsageError,
    tls_ca_arg,
    token_args,
)


def _demo(args: argparse.Namespace) -> int:
    if args.single_store and not args.cluster:
        raise _UsageError("--single-store goes with --cluster: only the cluster demo has a store to choose")
    if args.linger > 0 and (args.core or args.cluster):
        raise _UsageError("--linger goes with the server demo (no --core, no --cluster): only it serves the console")
    if args.core:
        from keyfailover.tools.demo import run_core_demo

        report = run_core_demo(messages=args.messages, keys=args.keys, seed=args.seed)
    elif args.cluster:
        from keyfailover.tools.demo import run_cluster_demo

        report = run_cluster_demo(
            events=args.messages, accounts=args.keys, seed=args.seed, out=sys.stdout, single_store=args.single_store
        )
    else:
        from keyfailover.tools.demo import run_server_demo

        report = run_server_demo(events=args.messages, accounts=args.keys, seed=args.seed, linger=args.linger)
    return 1 if report.problems else 0


def add_demo(commands: SubParsers) -> None:
    """The ``demo`` command."""
    demo = commands.add_parser("demo", help="a server with consumers that join, leave and stall; per-key order checked")
    kind = demo.add_mutually_exclusive_group()
    kind.add_argument("--core", action="store_true", help="run the in-process dispatcher alone, on a simulated clock")
    kind.add_argument(
        "--cluster",
        action="store_true",
        help="start ZooKeeper, a Patroni group of two PostgreSQL servers and three brokers on loopback; kill a "
        "broker, then the store's primary, under traffic (scripts/setup-system installs ZooKeeper, PostgreSQL and "
        "Patroni; without Patroni the store is one PostgreSQL server)",
    )
    demo.add_argument(
        "--single-store",
        action="store_true",
        help="with --cluster: one PostgreSQL server as the store instead of a Patroni group; only a broker is killed",
    )
    demo.add_argument(
        "--messages", type=_int_at_least(1000), default=30_000, help="events to produce, >= 1000 (default 30000)"
    )
    demo.add_argument("--keys", type=_positive_int, default=2_000, help="distinct Zipf(1.1) keys (default 2000)")
    demo.add_argument("--seed", type=int, default=7, help="random seed (default 7)")
    demo.add_argument(
        "--linger",
        type=_non_negative_float,
        default=0.0,
        metavar="S",
        help="keep the server and the last consumers up S seconds after the run, to watch the console whose URL "
        "the demo prints (default 0; Ctrl-C ends it sooner)",
    )
    demo.set_defaults(run=_demo)


def _scenario(text: str) -> str:
    from keyfailover.tools.evaluate import SCENARIOS

    if text != "all" and text not in SCENARIOS:
        raise argparse.ArgumentTypeError(f"unknown scenario {text!r}; expected one of {', '.join(SCENARIOS)} or all")
    return text


def _evaluate(args: argparse.Namespace) -> int:
    from keyfailover.tools import evaluate as ev

    def progress(step: str) -> None:
        print(f"keyfailover evaluate: {step} ...", file=sys.stderr, flush=True)

    names = ev.SCENARIOS if args.scenario == "all" else (args.scenario,)
    seed = ev.SEED if args.seed is None else args.seed
    results = ev.evaluate(names, quick=args.quick, progress=progress, seed=seed)
    if args.plot is not None:
        progress(f"drawing {args.plot}")
        try:
            ev.plot(results, Path(args.plot))
        except ImportError:
            raise SystemExit("keyfailover evaluate: --plot needs matplotlib (pip install keyfailover[plot])") from None
        except OSError as exc:
            raise SystemExit(f"keyfailover evaluate: cannot write {args.plot}: {exc.strerror}") from None
    if args.json:
        print(json.dumps([result.json_row() for result in results], indent=2))
        if not args.check:
            return 0
    consumers = 16 if args.quick else 64
    progress(f"timing reassignments with {consumers} consumers")
    timing_scenario = ev.build_scenario("random", args.quick, seed)
    timings = [ev.time_reassignments(strategy(), timing_scenario, consumers) for strategy in ev.STRATEGIES.values()]
    found = ev.goals(results, timings)
    if not args.json:
        progress("measuring drain times in the dispatcher")
        drains = ev.drain_table(ev.drain_times(args.quick))
        for name in names:
            scenario = ev.build_scenario(name, args.quick, seed)
            print(f"\n{name}: {scenario.summary}\n")
            print(ev.scenario_table([result for result in results if result.scenario == name]))
        print(f"\nreassignment time with {consumers} consumers (Zipf traffic; medians, p95)\n")
        print(ev.timing_table(timings))
        print("\ndispatcher: seconds from a range change until its last draining key was released\n")
        print(drains)
        print("\ngoals for keyfailover\n")
        print("\n".join(str(goal) for goal in found))
    failing = [goal for goal in found if not goal.holds]
    if args.check and failing:
        print(f"keyfailover evaluate: {len(failing)} of {len(found)} goals fail (--check)", file=sys.stderr)
        return 1
    return 0


def add_evaluate(commands: SubParsers) -> None:
    """The ``evaluate`` command."""
    evaluate = commands.add_parser("evaluate", help="compare rebalancing strategies on balance, stickiness and time")
    evaluate.add_argument(
        "--scenario", type=_scenario, default="all", help="one scenario, or all (default); see docs/evaluation.md"
    )
    evaluate.add_argument("--json", action="store_true", help="print the results as a JSON list instead of tables")
    evaluate.add_argument("--plot", metavar="FILE.png", default=None, help="draw a comparison chart (needs matplotlib)")
    evaluate.add_argument("--quick", action="store_true", help="small scenarios that finish in seconds")
    evaluate.add_argument(
        "--seed",
        type=_int_at_least(0),
        default=None,
        help="the scenarios' seed: traffic windows and random joins and leaves (default 6, docs/evaluation.md's)",
    )
    evaluate.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when any goal fails (the goals are printed, or checked with --json)",
    )
    evaluate.set_defaults(run=_evaluate)


def _chaos_names(what: str) -> Callable[[str], tuple[str, ...]]:
    """A parser of a comma-separated list of some of the chaos ``faults`` or ``targets`` (imported when used)."""

    def parse(text: str) -> tuple[str, ...]:
        from keyfailover.tools.chaos import FAULTS, TARGETS

        known = FAULTS if what == "faults" else TARGETS
        names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
        unknown = [name for name in names if name not in known]
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"{what} {text!r}: expected a comma-separated list of {', '.join(known)}"
                + (f" ({', '.join(unknown)} unknown)" if unknown else "")
            )
        return names

    parse.__name__ = what
    return parse


def _chaos(args: argparse.Namespace) -> int:
    from keyfailover.tools.chaos import ChaosSettings, chaos

    settings = ChaosSettings(
        duration=args.duration,
        seed=args.seed,
        faults=args.faults,
        targets=args.targets,
        brokers=args.brokers,
        partitions=args.partitions,
        consumers=args.consumers,
        rate=args.rate,
        keys=args.keys,
        distribution=args.distribution,
        session_timeout=args.session_timeout,
        rebalance_interval=args.rebalance_interval,
        ack_timeout=args.ack_timeout,
        drain_timeout=args.drain_timeout,
        store_ttl=args.store_ttl,
    )
    command = "keyfailover chaos " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["chaos"] else "keyfailover chaos"
    outcome = chaos(settings, report=args.report, keep=args.keep, command=command.strip())
    return 0 if outcome.passed else 1


def add_chaos(commands: SubParsers) -> None:
    """The ``chaos`` command."""
    chaos = commands.add_parser(
        "chaos",
        help="kill, suspend and cut off processes of a real cluster on loopback; check every invariant",
        description="Start ZooKeeper, PostgreSQL (with --targets store, two under Patroni), brokers, a producer and "
        "consumers on 127.0.0.1, apply a seeded schedule of faults under traffic, record every send, delivery, "
        "ack, fault and ownership change, and check: nothing lost, per-key order, never two brokers on a "
        "partition, never two consumers holding a key, unowned time bounded, writes resumed after each fault on "
        "the store. Exit 1 when a checker fails. See docs/chaos.md.",
    )
    chaos.add_argument("--duration", type=_positive_float, default=60.0, help="seconds of faults and traffic (60)")
    chaos.add_argument("--seed", type=int, default=1, help="the schedule's seed: the same seed, the same faults (1)")
    chaos.add_argument(
        "--faults",
        type=_chaos_names("faults"),
        default=("kill", "suspend"),
        help="comma-separated, of kill, suspend, loss (default kill,suspend)",
    )
    chaos.add_argument(
        "--targets",
        type=_chaos_names("targets"),
        default=("brokers", "consumers", "coordinator"),
        help="comma-separated, of brokers, consumers, coordinator, zookeeper, store (default "
        "brokers,consumers,coordinator); store: the run stores in PostgreSQL under Patroni, a primary and a "
        "synchronous standby, and faults hit its primary",
    )
    chaos.add_argument("--brokers", type=_positive_int, default=3, help="brokers in the cluster (3)")
    chaos.add_argument("--partitions", type=_positive_int, default=6, help="partitions of the topic (6)")
    chaos.add_argument("--consumers", type=_positive_int, default=3, help="consumer processes (3)")
    chaos.add_argument("--rate", type=_positive_float, default=200.0, help="messages produced per second (200)")
    chaos.add_argument("--keys", type=_positive_int, default=1000, help="distinct keys (1000)")
    chaos.add_argument("--distribution", choices=("zipf", "uniform"), default="zipf", help="key traffic (zipf)")
    chaos.add_argument(
        "--session-timeout", type=_positive_float, default=2.0, help="brokers' ZooKeeper session, seconds (2)"
    )
    chaos.add_argument(
        "--rebalance-interval",
        type=_non_negative_float,
        default=1.0,
        help="brokers' least seconds between rebalances (1)",
    )
    chaos.add_argument("--ack-timeout", type=_positive_float, default=5.0, help="consumers' lease, seconds (5)")
    chaos.add_argument(
        "--store-ttl",
        type=_int_at_least(4),
        default=10,
        help="with --targets store: Patroni's ttl, seconds; writes must resume within it + 5 s of a kill (10)",
    )
    chaos.add_argument(
        "--drain-timeout", type=_positive_float, default=60.0, help="seconds to wait for the last acks (60)"
    )
    chaos.add_argument(
        "--report", type=Path, default=None, metavar="DIR", help="write report.md, charts and records here"
    )
    chaos.add_argument(
        "--keep", type=Path, default=None, metavar="DIR", help="keep the run's data and logs here (default: removed)"
    )
    chaos.set_defaults(run=_chaos)


def _plot(args: argparse.Namespace) -> int:
    from keyfailover.integrations.plot import history_from_records, load_history, render_ownership

    if args.admin_url is None:
        if args.topic is not None or args.subscription is not None:
            raise _UsageError("--topic and --subscription go with --admin-url, not --history-file")
        try:
            history = load_history(args.history_file)
        except OSError as exc:
            raise SystemExit(f"keyfailover plot: cannot read {args.history_file}: {exc.strerror}") from None
        name = Path(args.history_file).name
    else:
        if args.topic is None or args.subscription is None:
            raise _UsageError("--admin-url needs --topic and --subscription")
        found = _admin_call(args, "/history", {"topic": args.topic, "subscription": args.subscription})
        records = found.get("history") if isinstance(found, dict) else found
        history = history_from_records(records, f"{args.admin_url.rstrip('/')}/history")
        name = f"{args.topic}/{args.subscription}"
    try:
        render_ownership(history, args.out, args.title if args.title is not None else f"Range ownership: {name}")
    except OSError as exc:
        raise SystemExit(f"keyfailover plot: cannot write {args.out}: {exc.strerror}") from None
    print(f"wrote {args.out}: {len(history)} range maps")
    return 0


def add_plot(commands: SubParsers) -> None:
    """The ``plot`` command."""
    plot = commands.add_parser("plot", help="draw range ownership over time as a PNG (needs keyfailover[plot])")
    plot.add_argument("--out", required=True, help="the PNG file to write")
    history = plot.add_mutually_exclusive_group(required=True)
    history.add_argument("--history-file", default=None, help='JSON lines of {"time": unix seconds, "snapshot": ...}')
    history.add_argument(
        "--admin-url", type=_admin_url, default=None, help="a running server's --metrics-port endpoint"
    )
    plot.add_argument("--topic", default=None, help="with --admin-url: the subscription's topic")
    plot.add_argument("--subscription", default=None, help="with --admin-url: the subscription")
    plot.add_argument("--title", default=None, help="the picture's title (default: the subscription or file name)")
    token_args(plot, "with --admin-url: the server's token, if it requires one")
    tls_ca_arg(plot, "https://")
    plot.set_defaults(run=_plot)
