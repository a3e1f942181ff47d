"""The ``keyfailover`` command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import ssl
import sys
from collections.abc import Callable, Iterator, Sequence
from http.client import HTTPException
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.error import HTTPError, URLError
from urllib.parse import urlencode, urlsplit
from urllib.request import Request, urlopen

from keyfailover.core.dispatcher import DEFAULT_ACK_TIMEOUT, DEFAULT_NACK_BACKOFF_MAX
from keyfailover.core.errors import KeyFailoverError
from keyfailover.core.rebalance import DEFAULT_MAX_RANGES

if TYPE_CHECKING:
    from keyfailover.client import Client

__all__ = ["main"]

Command = Callable[[argparse.Namespace], int]


def _os_reason(exc: OSError) -> str:
    """Why a connection failed, in words: the resolver's, TLS's or the system's reason."""
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}" if not isinstance(exc, ssl.SSLCertVerificationError) else str(exc)
    if isinstance(exc, socket.gaierror):
        return str(exc.strerror)
    return os.strerror(exc.errno) if exc.errno else str(exc)


TOKEN_VARIABLE = "KEYFAILOVER_TOKEN"


def _ca_context(args: argparse.Namespace) -> ssl.SSLContext:
    from keyfailover.client.aio import client_tls

    try:
        return client_tls(args.tls_ca)
    except KeyFailoverError as exc:
        raise SystemExit(f"keyfailover {args.command}: {exc}") from None


def _token(args: argparse.Namespace) -> str | None:
    """The token from --token, --token-file or $KEYFAILOVER_TOKEN, in that order; None without one."""
    if args.token is not None and args.token_file is not None:
        raise _UsageError("give --token or --token-file, not both")
    if args.token is not None:
        found, where = args.token, "--token"
    elif args.token_file is not None:
        try:
            found = Path(args.token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
            raise SystemExit(
                f"keyfailover {args.command}: cannot read the token file {args.token_file}: {reason}"
            ) from None
        where = f"the token file {args.token_file}"
    elif TOKEN_VARIABLE in os.environ:
        found, where = os.environ[TOKEN_VARIABLE].strip(), f"${TOKEN_VARIABLE}"
    else:
        return None
    if not found:
        raise _UsageError(f"{where} is empty; expected a token")
    return str(found)


class _UsageError(Exception):
    """Options that do not go together, found after parsing: exit 2 like argparse's own errors."""


@contextlib.contextmanager
def _connected(args: argparse.Namespace) -> Iterator[Client]:
    """A client of ``args.url``; a server that is not there or refuses us is one clear line (exit 1)."""
    from keyfailover.client import Client, ServerError

    try:
        client = Client(args.url, _token(args), tls_ca=args.tls_ca)
    except ServerError as exc:
        raise SystemExit(
            f"keyfailover {args.command}: the server at {args.url} refused the connection: {exc}"
        ) from None
    except OSError as exc:
        reason = _os_reason(exc)
        raise SystemExit(
            f"keyfailover {args.command}: cannot connect to {args.url} ({reason}); is keyfailover serve running there?"
        ) from None
    with client:
        yield client


def _finite_float(text: str, zero: bool) -> float:
    """A finite number > 0, or >= 0 with ``zero`` (``inf`` and ``nan`` are refused)."""
    bound = ">= 0" if zero else "> 0"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text!r}") from None
    if not (value >= 0 if zero else value > 0) or not value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    """A finite number > 0."""
    return _finite_float(text, zero=False)


def _non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    return _finite_float(text, zero=True)


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


_positive_int = _int_at_least(1)


def _int_between(low: int, high: int, what: str) -> Callable[[str], int]:
    """A parser of ints from ``low`` to ``high``, whose error says ``what`` was expected."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} from {low} to {high}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {what} from {low} to {high}, got {text!r}")
        return value

    parse.__name__ = what
    return parse


_port = _int_between(0, 65535, "a port number")  # 0: the system picks a free one


def _frame_size(text: str) -> int:
    """A frame limit the protocol can state: 1 KiB to 4 GiB - 1."""
    value = _positive_int(text)
    if not 1024 <= value <= 2**32 - 1:
        raise argparse.ArgumentTypeError(f"expected a frame size from 1024 to {2**32 - 1} bytes, got {text!r}")
    return value


def _session_seconds(text: str) -> float:
    """A session timeout: finite, from 0.1 s to a day."""
    value = _positive_float(text)
    if not 0.1 <= value <= 86_400:
        raise argparse.ArgumentTypeError(f"expected seconds from 0.1 to 86400, got {text!r}")
    return value


def _reply_seconds(text: str) -> float:
    """How long to wait for an answer: finite, from 0.01 s to an hour."""
    value = _positive_float(text)
    if not 0.01 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds from 0.01 to 3600, got {text!r}")
    return value


_max_ranges = _int_between(1, 65536, "a number of ranges")


def _ack_seconds(text: str) -> float:
    """An ack timeout: 0 (no leases) or finite seconds up to a day."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (0 disables), got {text!r}") from None
    if not 0.0 <= value <= 86_400:
        raise argparse.ArgumentTypeError(f"expected seconds from 0 (disabled) to 86400, got {text!r}")
    return value


def _or_default(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An admin setting: what ``parse`` accepts, or ``default`` (the server's); kept as the text sent."""

    def check(text: str) -> str:
        if text != "default":
            parse(text)
        return text

    check.__name__ = getattr(parse, "__name__", "setting")
    return check


def _redeliveries_or_none(text: str) -> int | None:
    """A redelivery limit: an int from 0, or ``none`` (redeliver for ever)."""
    return None if text == "none" else _int_between(0, 1_000_000, "a number of redeliveries or none")(text)


def _server_url(text: str) -> str:
    """A broker URL the client accepts (checked before anything connects)."""
    from keyfailover.client.aio import parse_url

    try:
        parse_url(text)
    except KeyFailoverError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _name(text: str) -> str:
    """A topic, subscription, consumer or producer name the protocol accepts."""
    from keyfailover.wire.protocol import check_name

    try:
        return check_name("a name", text)
    except KeyFailoverError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cluster_url(text: str) -> tuple[str, str]:
    """``zk://HOST:PORT[,HOST:PORT...]/PATH``: the ZooKeeper ensemble and the cluster's root path."""
    from keyfailover.broker.cluster import parse_cluster_url

    try:
        return parse_cluster_url(text)
    except KeyFailoverError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _admin_url(text: str) -> str:
    """``http://HOST:PORT`` (or https) of a server's admin endpoint."""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"admin URL {text!r} is malformed ({exc}); expected http://HOST:PORT"
        ) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise argparse.ArgumentTypeError(f"admin URL {text!r} is not of the form http://HOST:PORT")
    return text


def _demo(args: argparse.Namespace) -> int:
    if args.core:
        from keyfailover.tools.demo import run_core_demo

        report = run_core_demo(messages=args.messages, keys=args.keys, seed=args.seed)
    elif args.cluster:
        from keyfailover.tools.demo import run_cluster_demo

        report = run_cluster_demo(events=args.messages, accounts=args.keys, seed=args.seed)
    else:
        from keyfailover.tools.demo import run_server_demo

        report = run_server_demo(events=args.messages, accounts=args.keys, seed=args.seed)
    return 1 if report.problems else 0


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
    )
    command = "keyfailover chaos " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["chaos"] else "keyfailover chaos"
    outcome = chaos(settings, report=args.report, keep=args.keep, command=command.strip())
    return 0 if outcome.passed else 1


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


def _serve(args: argparse.Namespace) -> int:
    from keyfailover.broker.server import ServerConfig, SubscriptionConfig
    from keyfailover.broker.storage import DEFAULT_ENTRY_CACHE_BYTES
    from keyfailover.core.signals import whole_loop
    from keyfailover.tools.serve import configure_logging, run_server
    from keyfailover.wire.protocol import DEFAULT_MAX_FRAME

    if (args.tls_cert is None) != (args.tls_key is None):
        raise _UsageError("--tls-cert and --tls-key go together")
    if args.max_ranges is not None and args.policy != "multi":
        raise _UsageError(
            f"--max-ranges goes with --policy multi; --policy {args.policy} gives each consumer one range"
        )
    if args.nack_backoff > args.nack_backoff_max:
        raise _UsageError(
            f"--nack-backoff {args.nack_backoff:g} is longer than --nack-backoff-max {args.nack_backoff_max:g}; "
            "expected a first backoff no longer than the longest"
        )
    clustered = args.cluster is not None or args.store is not None
    if clustered and (args.cluster is None or args.store is None):
        raise _UsageError("a broker of a cluster needs both --cluster zk://... and --store postgresql://...")
    if clustered and args.data_dir is not None:
        raise _UsageError("give --data-dir for a single server, or --cluster and --store for a broker, not both")
    if not clustered and args.data_dir is None:
        raise _UsageError("give --data-dir DIR (a single server) or --cluster and --store (a broker of a cluster)")
    if not clustered and (args.advertise or args.broker_id):
        raise _UsageError("--advertise and --broker-id are for a broker of a cluster (with --cluster and --store)")
    if args.store is not None and not args.store.startswith(("postgresql://", "postgres://")):
        raise _UsageError(f"--store {args.store!r} is not of the form postgresql://USER[:PASSWORD]@HOST:PORT/DATABASE")
    if args.advertise is not None:
        _advertised(args.advertise)
    token = _token(args)
    if token is None and not _loopback(args.host):
        print(
            f"keyfailover serve: warning: listening on {args.host} without a token: anyone who reaches it may "
            "produce and consume (use --token-file or $KEYFAILOVER_TOKEN, and --tls-cert across machines)",
            file=sys.stderr,
        )
    config = ServerConfig(
        data_dir=None if args.data_dir is None else Path(args.data_dir),
        cluster=None if args.cluster is None else "zk://{}{}".format(*args.cluster),
        store=args.store,
        advertise=args.advertise,
        broker_id=args.broker_id,
        cluster_session_timeout=args.cluster_session_timeout,
        min_rebalance_interval=args.min_rebalance_interval,
        host=args.host,
        port=args.port,
        token=token,
        tls_cert=None if args.tls_cert is None else Path(args.tls_cert),
        tls_key=None if args.tls_key is None else Path(args.tls_key),
        session_timeout=args.session_timeout,
        max_frame=args.max_frame or DEFAULT_MAX_FRAME,
        synchronous=args.sync,
        metrics_port=args.metrics_port,
        pulsar_port=args.pulsar_port,
        login_frame=args.login_frame,
        login_timeout=args.login_timeout,
        frame_timeout=args.frame_timeout,
        max_output=args.max_output,
        max_connections=args.max_connections,
        entry_cache_bytes=DEFAULT_ENTRY_CACHE_BYTES if args.entry_cache_mb is None else args.entry_cache_mb * 2**20,
        subscription=SubscriptionConfig(
            policy=args.policy,
            max_ranges=DEFAULT_MAX_RANGES if args.max_ranges is None else args.max_ranges,
            ack_timeout=args.ack_timeout,
            max_redeliveries=args.max_redeliveries,
            max_unacked_per_consumer=args.max_unacked_per_consumer,
            consume_mode=args.consume_mode,
            max_replay=args.max_replay,
            nack_backoff=args.nack_backoff,
            nack_backoff_max=args.nack_backoff_max,
        ),
    )
    configure_logging(args.log_level, config.cluster is not None)
    with asyncio.Runner(loop_factory=whole_loop) as runner:  # Ctrl-C as it starts: no half-made loop
        return runner.run(run_server(config))


def _advertised(text: str) -> None:
    """Refuse an --advertise that is not HOST:PORT."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _UsageError(f"--advertise {text!r} is not of the form HOST:PORT")


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def _admin_call(args: argparse.Namespace, path: str, query: dict[str, str], method: str = "GET") -> Any:
    """GET (or POST) ``path`` on the admin endpoint, as JSON; any failure is one clear line (exit 1)."""
    target = args.admin_url.rstrip("/") + path + ("?" + urlencode(query) if query else "")
    name = f"keyfailover {args.command}"
    hint = "the admin endpoint is the port given to `keyfailover serve --metrics-port`, not the broker port"
    token = _token(args)
    request = Request(target, headers={} if token is None else {"Authorization": f"Bearer {token}"}, method=method)
    tls = None if args.tls_ca is None else _ca_context(args)
    try:
        with urlopen(request, timeout=10, context=tls) as response:
            return json.load(response)
    except HTTPError as exc:
        raise SystemExit(f"{name}: {target}: {exc.code} {exc.read().decode(errors='replace').strip()}") from None
    except URLError as exc:
        reason = f"cannot reach {target} ({exc.reason})"
        raise SystemExit(f"{name}: {reason}; is the server running with --metrics-port?") from None
    except ValueError as exc:  # a malformed URL, or a body that is not JSON
        raise SystemExit(f"{name}: {target} did not answer with JSON ({exc}); {hint}") from None
    except (HTTPException, OSError) as exc:  # not HTTP at all: e.g. the broker's binary protocol
        raise SystemExit(f"{name}: {target} did not answer as an HTTP admin endpoint ({exc!r}); {hint}") from None


def _ranges(args: argparse.Namespace) -> int:
    if (args.topic is None) != (args.subscription is None):
        raise _UsageError("--topic and --subscription go together: give both, or neither for every subscription")
    if args.pulsar_sticky and args.topic is None:
        raise _UsageError("--pulsar-sticky shows one subscription: give --topic and --subscription")
    if args.pulsar_sticky and args.json:
        raise _UsageError("give --json or --pulsar-sticky, not both")
    query = {"topic": args.topic, "subscription": args.subscription} if args.topic else {}
    found = _admin_call(args, "/ranges", query)
    if args.json:
        print(json.dumps(found, indent=2, sort_keys=True))
        return 0
    if args.pulsar_sticky:
        print(_pulsar_sticky(found))
        return 0
    listing = (
        [{"topic": args.topic, "subscription": args.subscription, "ranges": found}] if query else found["subscriptions"]
    )
    for item in listing:
        snapshot = item["ranges"]
        mode = f", {item['consume_mode']}" if "consume_mode" in item else ""
        print(f"{item['topic']}/{item['subscription']} (epoch {snapshot['epoch']}{mode})")
        for entry in snapshot["ranges"]:
            share = (entry["end"] - entry["start"] + 1) / snapshot["range_size"]
            print(f"  {entry['consumer']:<24}[{entry['start']:>5}, {entry['end']:>5}]  {share:6.1%}")
    return 0


def _set_consume_mode(args: argparse.Namespace) -> int:
    query = {"topic": args.topic, "subscription": args.subscription, "mode": args.mode}
    found = _admin_call(args, "/consume-mode", query, method="POST")
    if args.json:
        print(json.dumps(found, indent=2, sort_keys=True))
    elif found["was"] is None:
        print(f"{args.topic}/{args.subscription}: consume mode {args.mode} saved (applies when it is next opened)")
    else:
        print(f"{args.topic}/{args.subscription}: consume mode {found['was']} -> {args.mode}")
    return 0


def _configure(args: argparse.Namespace) -> int:
    query = {"topic": args.topic, "subscription": args.subscription}
    changes = {
        setting: value
        for setting in ("ack_timeout", "max_redeliveries", "nack_backoff", "nack_backoff_max", "max_replay")
        if (value := getattr(args, setting)) is not None
    }
    if args.reset or changes:
        found = _admin_call(
            args,
            "/subscription-settings",
            {**query, **changes, **({"reset": "1"} if args.reset else {})},
            method="POST",
        )
    else:
        found = _admin_call(args, "/subscription-settings", query)
    if args.json:
        print(json.dumps(found, indent=2, sort_keys=True))
        return 0
    settings, own = found["settings"], set(found["own"])
    timeout, limit = settings["ack_timeout"], settings["max_redeliveries"]
    backoff, backoff_max = settings["nack_backoff"], settings["nack_backoff_max"]
    lines = {
        "ack_timeout": f"{timeout:g} s" if timeout else "off",
        "max_redeliveries": "none (for ever)" if limit is None else str(limit),
        "nack_backoff": f"{backoff:g} s" if backoff else "off",
        "nack_backoff_max": f"{backoff_max:g} s",
        "max_replay": f"{settings['max_replay']} messages",
    }
    print(f"{args.topic}/{args.subscription}:")
    for setting, text in lines.items():
        print(f"  {setting.replace('_', ' '):<18}{text} ({'own' if setting in own else 'server'})")
    if found.get("live") is False:
        print("  (saved; the subscription is not open: they apply when it is next opened)")
    return 0


def _create_topic(args: argparse.Namespace) -> int:
    from keyfailover.broker.cluster import connect, create_topic

    if args.cluster is None:
        answer = _admin_call(args, "/topics", {"topic": args.topic, "partitions": str(args.partitions)}, "POST")
        state = "created" if answer["created"] else "exists already"
        print(f"topic {args.topic!r} {state} with {args.partitions} partition(s) on {args.admin_url}")
        return 0
    hosts, root = args.cluster
    zk = connect(hosts)
    try:
        created = create_topic(zk, root, args.topic, args.partitions)
    finally:
        zk.stop()
        zk.close()
    state = "created" if created else "exists already"
    print(f"topic {args.topic!r} {state} with {args.partitions} partition(s) in zk://{hosts}{root}")
    return 0


_ZOOKEEPER_WAIT = 2.0
"""Seconds ``cluster status`` waits at least for ZooKeeper to take its connection (``--timeout`` if longer)."""


def _cluster_status(args: argparse.Namespace) -> int:
    from keyfailover.broker.cluster import cluster_status, connect

    hosts, root = args.cluster
    zk = connect(hosts, max(args.timeout, _ZOOKEEPER_WAIT))  # a frozen ZooKeeper is named at once, not in 10 s
    try:
        status = cluster_status(zk, root)
    finally:
        zk.stop()
        zk.close()
    status["subscriptions"], status["unreachable"], shown = _partition_consumers(args, status)
    for broker in status["brokers"]:
        # None: it has no admin endpoint to ask, so whether it would answer is not known
        broker["reachable"] = None if shown[broker["id"]] == "unknown" else shown[broker["id"]] == _REACHABLE
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    assignment = status["assignment"]
    print(
        f"cluster zk://{hosts}{root}: coordinator {status['coordinator'] or 'none'}, epoch {status['epoch']}, "
        f"assignment generation {assignment['generation']} (written at epoch {assignment['epoch']})"
    )
    print(f"brokers ({len(status['brokers'])}):")
    for broker in status["brokers"]:
        role = "  coordinator" if broker["id"] == status["coordinator"] else ""
        print(f"  {broker['id']:<20}{broker['address']:<24}{shown[broker['id']]:<15}{broker['node']}{role}")
    print(f"topics ({len(status['topics'])}):")
    for topic, count in status["topics"].items():
        print(f"  {topic:<28}{count} partition(s)")
    print("partitions:")
    live = {broker["id"] for broker in status["brokers"]}
    consumers: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for entry in status["subscriptions"]:
        consumers.setdefault((entry["topic"], entry["partition"]), []).append(entry)
    for entry in assignment["partitions"]:
        gone = "" if entry["broker"] in live else "  (broker gone: unserved until the coordinator reassigns it)"
        print(f"  {entry['topic']}-{entry['partition']:<8}{entry['broker']}{gone}")
        for found in consumers.get((entry["topic"], entry["partition"]), []):
            held = "; ".join(
                f"{name} " + ", ".join(f"[{start}, {end}]" for start, end in ranges) if ranges else f"{name} (standby)"
                for name, ranges in sorted(found["consumers"].items())
            )
            print(f"      {found['subscription']}: {held or 'no consumers'}")
    for broker_id, reason in sorted(status["unreachable"].items()):
        print(f"  (no consumer ranges from {broker_id}: {reason})")
    return 0


_REACHABLE = "reachable"


def _partition_consumers(
    args: argparse.Namespace, status: dict[str, Any]
) -> tuple[list[Any], dict[str, str], dict[str, str]]:
    """Each served partition's subscriptions and their consumers' ranges, from every broker's admin
    endpoint (brokers started with --metrics-port), all read at once within ``--timeout``; why a
    broker could not be read; and each broker's endpoint in a word (reachable, not answering, bad
    answer, unknown: it has none)."""
    from keyfailover.tools._brokers import read_each

    token = _token(args)
    tls = None if args.tls_ca is None else _ca_context(args)
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    unreachable: dict[str, str] = {}
    shown: dict[str, str] = {}
    requests: dict[str, Request] = {}
    for broker in status["brokers"]:
        if broker.get("admin") is None:
            unreachable[broker["id"]] = "it has no admin endpoint (--metrics-port)"
            shown[broker["id"]] = "unknown"
        else:
            requests[broker["id"]] = Request(broker["admin"] + "/stats", headers=headers)
    found: list[Any] = []
    for broker_id, answer in read_each(requests, args.timeout, tls).items():
        served = None if answer.body is None else _served_consumers(answer.body, broker_id, status)
        if served is None:
            unreachable[broker_id] = answer.failure or (
                f"{requests[broker_id].full_url} did not answer with a keyfailover server's stats (JSON)"
            )
            shown[broker_id] = "bad answer" if answer.answered else "not answering"
        else:
            found += served
            shown[broker_id] = _REACHABLE
    return found, unreachable, shown


def _served_consumers(body: bytes, broker_id: str, status: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Each subscription of each partition a broker's ``/stats`` shows, with its consumers' ranges;
    None when the body is not a keyfailover server's stats."""
    from keyfailover.core.partitions import split_partition_topic

    found = []
    try:
        for subscription in json.loads(body)["subscriptions"]:
            served = subscription["topic"]
            split = split_partition_topic(served)
            topic, partition = split if split is not None and split[0] in status["topics"] else (served, 0)
            consumers = subscription["dispatcher"]["consumers"]
            found.append(
                {
                    "topic": topic,
                    "partition": partition,
                    "subscription": subscription["subscription"],
                    "broker": broker_id,
                    "consumers": {name: state["ranges"] for name, state in consumers.items()},
                }
            )
    except (ValueError, LookupError, TypeError, AttributeError):
        return None
    return found


def _dlq(args: argparse.Namespace) -> int:
    query = {"topic": args.topic, "subscription": args.subscription}
    if args.action == "replay":
        found = _admin_call(args, "/dlq/replay", query, method="POST")
        if args.json:
            print(json.dumps(found, indent=2, sort_keys=True))
        else:
            print(f"replayed {found['replayed']} dead letter(s) to {args.topic}")
        return 0
    found = _admin_call(args, "/dlq", {**query, "limit": str(args.limit)})
    if args.json:
        print(json.dumps(found, indent=2, sort_keys=True))
        return 0
    letters = found["dead_letters"]
    print(f"{found['dlq_topic']}: {len(letters)} dead letter(s)")
    for entry in letters:
        key = entry["key"]
        shown = f"bytes {key['bytes']}" if isinstance(key, dict) else repr(key)
        replayed = "" if entry["replayed_at"] is None else f", replayed at {entry['replayed_at']}"
        print(
            f"  {entry['dlq_position']:>6}  from {entry['position']:>8}  key {shown}  "
            f"{entry['redelivery_count'] + 1} deliveries, {entry['reason']}{replayed}"
        )
    return 0


def _pulsar_sticky(snapshot: dict[str, Any]) -> str:
    """Each consumer's ranges of a range map snapshot as Pulsar Key_Shared STICKY hash ranges: JSON, a consumer a line.

    Pulsar's ``Range.of(start, end)`` is inclusive like ours, and a snapshot lists ranges in
    hash order, so each consumer's list comes out sorted. A sticky subscription's unassigned
    slots belong to no consumer and are left out.
    """
    from keyfailover.core.rebalance import UNASSIGNED

    sticky: dict[str, list[list[int]]] = {}
    for entry in snapshot["ranges"]:
        if entry["consumer"] != UNASSIGNED:
            sticky.setdefault(entry["consumer"], []).append([entry["start"], entry["end"]])
    lines = [f"  {json.dumps(consumer)}: {json.dumps(pairs)}" for consumer, pairs in sorted(sticky.items())]
    return "{\n" + ",\n".join(lines) + "\n}" if lines else "{}"


def _owned(ranges: list[list[int]], range_size: int) -> str:
    """A consumer's ranges in a few words: ``3 ranges, 12.5%`` of the slots, or ``standby``."""
    if not ranges:
        return "standby"
    share = sum(end - start + 1 for start, end in ranges) / range_size
    return f"{len(ranges)} range{'' if len(ranges) == 1 else 's'}, {share:.1%}"


def _stats(args: argparse.Namespace) -> int:
    from keyfailover.core.hashing import HASH_RANGE_SIZE

    found = _admin_call(args, "/stats", {})
    if args.json:
        print(json.dumps(found, indent=2, sort_keys=True))
        return 0
    print(f"connections {found['connections']}")
    for item in found["subscriptions"]:
        stats = item["dispatcher"]
        print(
            f"{item['topic']}/{item['subscription']}: backlog {item['backlog']}, replay {stats['replay']}, "
            f"mark-delete {item['mark_delete']}, epoch {stats['epoch']}, "
            f"{item['consume_mode']}, policy {item['policy']} (max {item['max_ranges']} ranges per consumer), "
            f"ack timeout {item['ack_timeout']:g} s, dead-lettered {item['dead_lettered']}"
        )
        print(f"  {'consumer':<24}{'ranges':>18}{'rate/s':>9}{'permits':>9}{'unacked':>9}{'draining':>9}")
        for consumer, info in sorted(stats["consumers"].items()):
            shown = "stuck (lease expired)" if info["stuck"] else _owned(info["ranges"], HASH_RANGE_SIZE)
            print(
                f"  {consumer:<24}{shown:>18}{info['rate']:>9.0f}{info['permits']:>9}"
                f"{info['unacked']:>9}{info['draining_hashes']:>9}"
            )
    return 0


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


class _Stored:
    """What the server confirmed of a produce run: count, first and last position, first error."""

    def __init__(self) -> None:
        self.count = 0
        self.partitions = 1
        self.first: int | None = None
        self.last: int | None = None
        self.errors: list[BaseException] = []

    def confirmed(self, position: int | None, error: BaseException | None) -> None:
        if error is not None or position is None:
            self.errors.append(error if error is not None else RuntimeError("no position"))
            return
        self.count += 1
        self.first = position if self.first is None else min(self.first, position)
        self.last = position if self.last is None else max(self.last, position)

    def summary(self, topic: str) -> str:
        span = "" if self.first is None else f", positions {self.first}..{self.last}"
        if self.partitions > 1:
            span = f" over {self.partitions} partitions (positions count within each)"
        return f"stored {self.count:,} message{'' if self.count == 1 else 's'} in {topic!r}{span}"


class _BadLineError(Exception):
    """A line that must not be stored: produce stops there and says what it stored before it."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")


def _property(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` of ``--property`` (the first ``=`` ends the key; the value may hold more)."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} has no '='; expected KEY=VALUE")
    return key, value


def _produce_properties(args: argparse.Namespace) -> dict[str, str]:
    """The ``--property`` options as one mapping, checked before anything is sent (a later KEY wins)."""
    from keyfailover.core.errors import PropertiesError
    from keyfailover.wire.properties import encode_properties

    properties = dict(args.property or [])
    try:
        encode_properties(properties)
    except PropertiesError as exc:
        raise _UsageError(f"--property: {exc}") from None
    return properties


def _produce(args: argparse.Namespace) -> int:
    import stat

    from keyfailover.tools._progress import Progress

    if args.allow_keyless and not args.json:
        raise _UsageError("--allow-keyless goes with --json (a JSON line without its key field)")
    properties = _produce_properties(args)
    try:
        source: BinaryIO = sys.stdin.buffer if args.file == "-" else open(args.file, "rb")  # noqa: SIM115
    except OSError as exc:
        raise SystemExit(f"keyfailover produce: cannot read {args.file}: {exc.strerror}") from None
    progress = None
    if args.progress:
        info = os.fstat(source.fileno())
        progress = Progress(sys.stderr, info.st_size if stat.S_ISREG(info.st_mode) else None)
    stored = _Stored()
    sent = done = through = 0
    stop: BaseException | None = None
    with _connected(args) as client, source:
        producer = client.create_producer(args.topic, args.producer_name)
        stored.partitions = producer.partitions
        try:
            for line_number, raw in enumerate(source, 1):
                done += len(raw)
                key, payload = _parse_line(raw, line_number, args)
                if payload is None:
                    continue
                try:
                    producer.send_async(payload, key, stored.confirmed, properties=properties)
                except KeyFailoverError as exc:  # e.g. larger than the server takes
                    raise _BadLineError(line_number, str(exc)) from None
                sent += 1
                through = line_number
                if progress is not None:
                    progress.update(sent, stored.count, done)
        except (_BadLineError, KeyboardInterrupt) as exc:
            stop = exc
        finally:
            try:  # what was sent is confirmed (or not) before anything is reported
                producer.flush()
            finally:  # the bar's last line ends before any message
                if progress is not None:
                    progress.finish(sent, stored.count, done)
    where = f" from lines 1..{through}" if through else ""
    if stored.errors:
        print(
            f"keyfailover produce: {len(stored.errors):,} of {sent:,} messages were not stored "
            f"(first error: {stored.errors[0]}); {stored.summary(args.topic)}",
            file=sys.stderr,
        )
        return 1
    if isinstance(stop, KeyboardInterrupt):
        print(f"keyfailover produce: interrupted; {stored.summary(args.topic)}{where}", file=sys.stderr)
        return 130
    if stop is not None:
        print(
            f"keyfailover produce: {stop}; {stored.summary(args.topic)}{where}; nothing after line {through} was sent",
            file=sys.stderr,
        )
        return 1
    print(f"{stored.summary(args.topic)}{where}")
    return 0


def _parse_line(raw: bytes, number: int, args: argparse.Namespace) -> tuple[str | None, bytes | None]:
    """``(key, payload)`` of one input line; payload None for a blank line. Raises :class:`_BadLineError`."""
    try:
        line = raw.decode().removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError as exc:
        raise _BadLineError(number, f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not line:
        return None, None
    if not args.json:
        if args.key_field is None:
            return None, line.encode()
        key, sep, payload = line.partition(args.key_field)
        if not sep:
            raise _BadLineError(number, f"no {args.key_field!r} separator between key and payload")
        return key, payload.encode()
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _BadLineError(number, f"not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise _BadLineError(number, f"expected a JSON object, got {type(record).__name__}")
    if args.key_field is None:
        return None, line.encode()
    return _json_key(record.get(args.key_field), number, args), line.encode()


def _json_key(value: object, number: int, args: argparse.Namespace) -> str | None:
    """The documented rule: a string is the key, an integer its decimal text; null or missing needs --allow-keyless."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if value is None:
        if args.allow_keyless:
            return None
        raise _BadLineError(
            number,
            f"no {args.key_field!r} field (or it is null); pass --allow-keyless to send such lines without a key",
        )
    shown = json.dumps(value)
    raise _BadLineError(
        number,
        f"the {args.key_field!r} field is {type(value).__name__} {shown[:40]}; expected a string or an integer",
    )


def _consume(args: argparse.Namespace) -> int:
    from keyfailover.client import Message, Timeout

    received = 0
    printed: list[Message] = []  # written to stdout, acknowledged once stdout is flushed

    def flush_and_ack() -> None:
        sys.stdout.flush()  # a reader that went away raises here: these are not acked
        for message in printed:
            consumer.acknowledge(message)
        printed.clear()

    with _connected(args) as client:
        consumer = client.subscribe(args.topic, args.subscription, args.consumer_name, args.receiver_queue)
        try:
            while args.count is None or received < args.count:
                try:
                    message = consumer.receive(timeout=0 if printed else args.idle_timeout)
                except Timeout:
                    if not printed:
                        break
                    flush_and_ack()
                    continue
                received += 1
                sys.stdout.write(_shown(message, args.json, consumer.partitions > 1))
                printed.append(message)
                if len(printed) >= 1000:
                    flush_and_ack()
            flush_and_ack()
        finally:  # interrupted or the reader is gone: what was not flushed is not acked, so it is redelivered
            printed.clear()
            consumer.close()
    return 0


def _shown(message: Any, as_json: bool, partitioned: bool) -> str:
    """A consumed message as a line: ``position<TAB>key<TAB>payload`` (``partition:position`` on a
    partitioned topic), or a JSON object (with ``partition`` on a partitioned topic, the publish time
    in µs since the epoch, null when unknown, and the properties, an object)."""
    payload = message.payload.decode("utf-8", "backslashreplace")
    if not as_json:
        where = f"{message.partition}:{message.position}" if partitioned else str(message.position)
        return f"{where}\t{message.key!s}\t{payload}\n"
    key = message.key.decode("utf-8", "backslashreplace") if isinstance(message.key, bytes) else message.key
    record = {
        **({"partition": message.partition} if partitioned else {}),
        "position": message.position,
        "key": key,
        "payload": payload,
        "redelivery_count": message.redelivery_count,
        "publish_time": message.publish_time,
        "properties": dict(message.properties),
    }
    return json.dumps(record, ensure_ascii=False) + "\n"


def _export(args: argparse.Namespace) -> int:
    from keyfailover.integrations.export import export_store_topic, export_topic

    if args.store is not None:
        stored = export_store_topic(args.store, args.topic, args.out, args.format, binary_keys=args.binary_keys)
        span = f" ({stored.partitions} partition{'s' * (stored.partitions != 1)})"
        messages, files = stored.messages, stored.files
    else:
        result = export_topic(args.data_dir, args.topic, args.out, args.format, binary_keys=args.binary_keys)
        span = "" if result.first_position is None else f" (positions {result.first_position}..{result.last_position})"
        messages, files = result.messages, result.files
    print(f"exported {messages} messages of {args.topic!r}{span}: {len(files)} file(s) in {args.out}")
    return 0


def token_args(sub: argparse.ArgumentParser, what: str) -> None:
    sub.add_argument(
        "--token", default=None, help=f"{what} (visible in `ps`: prefer --token-file or ${TOKEN_VARIABLE})"
    )
    sub.add_argument("--token-file", default=None, help=f"a file holding {what}")


def tls_ca_arg(sub: argparse.ArgumentParser, scheme: str) -> None:
    sub.add_argument(
        "--tls-ca", default=None, help=f"with {scheme} URLs: the CA certificates (PEM) to trust (default: the system's)"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keyfailover", description="Key-hash-range dispatcher (PIP-34 Key_Failover)")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="a server with consumers that join, leave and stall; per-key order checked")
    kind = demo.add_mutually_exclusive_group()
    kind.add_argument("--core", action="store_true", help="run the in-process dispatcher alone, on a simulated clock")
    kind.add_argument(
        "--cluster",
        action="store_true",
        help="start ZooKeeper, PostgreSQL and three brokers on loopback and kill one under traffic "
        "(scripts/setup-system installs ZooKeeper and PostgreSQL)",
    )
    demo.add_argument(
        "--messages", type=_int_at_least(1000), default=30_000, help="events to produce, >= 1000 (default 30000)"
    )
    demo.add_argument("--keys", type=_positive_int, default=2_000, help="distinct Zipf(1.1) keys (default 2000)")
    demo.add_argument("--seed", type=int, default=7, help="random seed (default 7)")
    demo.set_defaults(run=_demo)

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

    chaos = commands.add_parser(
        "chaos",
        help="kill, suspend and cut off processes of a real cluster on loopback; check every invariant",
        description="Start ZooKeeper, PostgreSQL, brokers, a producer and consumers on 127.0.0.1, apply a seeded "
        "schedule of faults under traffic, record every send, delivery, ack, fault and ownership change, and "
        "check: nothing lost, per-key order, never two brokers on a partition, never two consumers holding a "
        "key, unowned time bounded. Exit 1 when a checker fails. See docs/chaos.md.",
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
        help="comma-separated, of brokers, consumers, coordinator, zookeeper (default brokers,consumers,coordinator)",
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
        "--drain-timeout", type=_positive_float, default=60.0, help="seconds to wait for the last acks (60)"
    )
    chaos.add_argument(
        "--report", type=Path, default=None, metavar="DIR", help="write report.md, charts and records here"
    )
    chaos.add_argument(
        "--keep", type=Path, default=None, metavar="DIR", help="keep the run's data and logs here (default: removed)"
    )
    chaos.set_defaults(run=_chaos)

    serve = commands.add_parser(
        "serve",
        help="run a server with an embedded durable log, or a broker of a cluster",
        description="With --data-dir: one server and its embedded SQLite log. With --cluster and --store: a "
        "broker of a cluster, serving the partitions ZooKeeper assigns it from the shared PostgreSQL log.",
    )
    serve.add_argument("--data-dir", default=None, help="directory of the SQLite log (created if missing)")
    serve.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="warning",
        help="what the server logs on stderr: info adds each consumer session's start and end (default: warning)",
    )
    serve.add_argument(
        "--cluster",
        type=_cluster_url,
        default=None,
        help="join the cluster of this ZooKeeper ensemble and root path: zk://HOST:PORT[,HOST:PORT...]/PATH",
    )
    serve.add_argument(
        "--store", default=None, help="the cluster's shared log: postgresql://USER[:PASSWORD]@HOST:PORT/DATABASE"
    )
    serve.add_argument(
        "--advertise",
        default=None,
        help="HOST:PORT clients reach this broker at (default: the address it listens on)",
    )
    serve.add_argument("--broker-id", default=None, help="this broker's id in the cluster (default: --advertise)")
    serve.add_argument(
        "--cluster-session-timeout",
        type=_session_seconds,
        default=10.0,
        help="seconds of silence after which ZooKeeper gives this broker's partitions to others (default 10)",
    )
    serve.add_argument(
        "--min-rebalance-interval",
        type=_ack_seconds,
        default=0.0,
        help="seconds a coordinator waits between two partition assignments (default 0)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=6650, help="TCP port (default 6650; 0 picks a free one)")
    token_args(serve, "require clients (and admin requests other than /healthz) to present a token")
    serve.add_argument("--tls-cert", default=None, help="PEM certificate: serve the broker and admin ports over TLS")
    serve.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    serve.add_argument(
        "--session-timeout",
        type=_session_seconds,
        default=10.0,
        help="seconds a silent client keeps its sessions, 0.1 to 86400 (default 10)",
    )
    serve.add_argument(
        "--max-frame", type=_frame_size, default=None, help="largest frame in bytes, >= 1024 (default 5 MiB)"
    )
    serve.add_argument("--sync", choices=("full", "normal"), default="full", help="SQLite synchronous mode")
    serve.add_argument(
        "--login-frame",
        type=_frame_size,
        default=64 * 1024,
        help="largest frame in bytes before a client has sent connect (default 64 KiB)",
    )
    serve.add_argument(
        "--login-timeout",
        type=_session_seconds,
        default=10.0,
        help="seconds a new connection has to send connect (default 10)",
    )
    serve.add_argument(
        "--frame-timeout",
        type=_session_seconds,
        default=30.0,
        help="seconds one frame may take to arrive whole; slower senders are closed (default 30)",
    )
    serve.add_argument(
        "--max-output",
        type=_int_at_least(1024 * 1024),
        default=64 * 1024 * 1024,
        help="bytes of unread replies a connection may have before it is closed, >= 1 MiB (default 64 MiB)",
    )
    serve.add_argument(
        "--entry-cache-mb",
        type=_int_between(0, 1024 * 1024, "a number of MiB"),
        default=None,
        help="MiB of the messages stored last kept in memory, so that subscriptions reading them (keeping up, or "
        "draining a fresh backlog) spare the log a read; 0 keeps none (default 128)",
    )
    serve.add_argument(
        "--max-connections",
        type=_positive_int,
        default=1024,
        help="open connections; one more is refused with too_many_connections (default 1024)",
    )
    serve.add_argument(
        "--policy",
        choices=("multi", "contiguous"),
        default="multi",
        help="how consumers share the hash space: multi (default; a consumer may own several ranges, so a join or "
        "leave moves only about its share of the traffic) or contiguous (one range each, PIP-34 literally)",
    )
    serve.add_argument(
        "--max-ranges",
        type=_max_ranges,
        default=None,
        help=f"with --policy multi: the most ranges one consumer may own, 1 to 65536 (default {DEFAULT_MAX_RANGES})",
    )
    serve.add_argument(
        "--ack-timeout",
        type=_ack_seconds,
        default=DEFAULT_ACK_TIMEOUT,
        help="seconds a consumer has to ack a delivery before it is taken back and the consumer loses its ranges "
        f"until it acks or asks for more again; 0 disables (default {DEFAULT_ACK_TIMEOUT:g})",
    )
    serve.add_argument(
        "--max-redeliveries",
        type=_int_between(0, 1_000_000, "a number of redeliveries"),
        default=None,
        help="after this many redeliveries a message goes to the dead-letter topic <topic>-<subscription>-DLQ "
        "and its key goes on (default: redeliver for ever)",
    )
    serve.add_argument(
        "--max-replay",
        type=_int_between(100, 100_000_000, "a number of messages"),
        default=100_000,
        help="messages a subscription holds unacked in memory, waiting and in flight (default 100000); past half "
        "of it, the messages of consumers that cannot take them stay in the log and are re-read later",
    )
    serve.add_argument(
        "--consume-mode",
        choices=("ordered", "unordered"),
        default="ordered",
        help="the consume mode of subscriptions without one of their own (`keyfailover admin set-consume-mode` "
        "sets one): ordered (per-key order, the default) or unordered (any consumer takes any message)",
    )
    serve.add_argument(
        "--max-unacked-per-consumer",
        type=_int_between(0, 10_000_000, "a number of messages"),
        default=50_000,
        help="a consumer holding this many unacked messages gets no more until it acks half of them "
        "(Pulsar's maxUnackedMessagesPerConsumer); 0 is no limit (default 50000)",
    )
    serve.add_argument(
        "--nack-backoff",
        type=_ack_seconds,
        default=0.0,
        help="seconds a nacked message waits before it is delivered again, doubling with each failure of it up to "
        "--nack-backoff-max; in ordered mode its key waits with it, no other key does (default 0: at once)",
    )
    serve.add_argument(
        "--nack-backoff-max",
        type=_ack_seconds,
        default=DEFAULT_NACK_BACKOFF_MAX,
        help=f"the longest nack backoff in seconds (default {DEFAULT_NACK_BACKOFF_MAX:g})",
    )
    serve.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="serve /metrics, /ranges, /stats, /history, /healthz on this port",
    )
    serve.add_argument(
        "--pulsar-port",
        type=_port,
        default=None,
        help="also serve Apache Pulsar's binary protocol on this port, for unmodified Pulsar clients "
        "(docs/pulsar.md; 0 picks a free one; default: off)",
    )
    serve.set_defaults(run=_serve)

    def client_args(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--url", type=_server_url, default="kf://127.0.0.1:6650", help="server URL (default kf://127.0.0.1:6650)"
        )
        token_args(sub, "the server's token, if it requires one")
        tls_ca_arg(sub, "kf+ssl://")
        sub.add_argument("--topic", type=_name, required=True, help="the topic to use")

    produce = commands.add_parser("produce", help="send lines or JSON lines from a file or stdin")
    client_args(produce)
    produce.add_argument("--file", default="-", help="input file (default: stdin)")
    produce.add_argument("--json", action="store_true", help="lines are JSON objects; the payload is the line")
    produce.add_argument(
        "--key-field",
        default=None,
        help="with --json: the field holding the key (a string, or an integer sent as its decimal text); "
        "without --json: the separator between key and payload",
    )
    produce.add_argument(
        "--allow-keyless",
        action="store_true",
        help="with --json: send a line whose key field is missing or null without a key (no per-key order); "
        "without it such a line stops the run",
    )
    produce.add_argument("--producer-name", type=_name, default=None, help="stable name for deduplicated retries")
    produce.add_argument(
        "--property",
        type=_property,
        action="append",
        metavar="KEY=VALUE",
        help="a property every message carries (repeat for more; at most 128, keys of at most 256 characters, "
        "64 KiB in all)",
    )
    produce.add_argument(
        "--progress",
        action="store_true",
        help="draw a progress bar on stderr: sent, stored, rate, share of input read",
    )
    produce.set_defaults(run=_produce)

    consume = commands.add_parser("consume", help="print messages (acking as it goes)")
    client_args(consume)
    consume.add_argument("--subscription", type=_name, required=True, help="the subscription to join (created if new)")
    consume.add_argument(
        "--consumer-name",
        type=_name,
        default=None,
        help="this consumer's name in the subscription (default: a random one)",
    )
    consume.add_argument(
        "--receiver-queue", type=_positive_int, default=1000, help="messages prefetched ahead (default 1000)"
    )
    consume.add_argument("--json", action="store_true", help="print JSON lines")
    consume.add_argument("--count", type=_positive_int, default=None, help="stop after this many messages")
    consume.add_argument(
        "--idle-timeout", type=_positive_float, default=None, help="stop after this many seconds without a message"
    )
    consume.set_defaults(run=_consume)

    export = commands.add_parser(
        "export", help="write a topic from a data dir's or a cluster's log to Parquet or JSON lines"
    )
    source = export.add_mutually_exclusive_group(required=True)
    source.add_argument("--data-dir", help="the server's data directory (the server may be running)")
    source.add_argument(
        "--store",
        help="a cluster's log: postgresql://user[:password]@host[:port]/database (a password here shows in `ps`; "
        "without one, PGPASSWORD or ~/.pgpass is read); rows gain a partition column, in (partition, position) order",
    )
    export.add_argument("--topic", required=True, help="the topic to export")
    export.add_argument("--format", choices=("parquet", "jsonl"), default="parquet", help="default parquet")
    export.add_argument("--binary-keys", action="store_true", help="keys as binary (default: UTF-8 text)")
    export.add_argument("out", help="output folder, created; must be new or empty")
    export.set_defaults(run=_export)

    def admin_args(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--admin-url",
            type=_admin_url,
            default="http://127.0.0.1:9650",
            help="the server's --metrics-port endpoint (default http://127.0.0.1:9650)",
        )
        sub.add_argument("--json", action="store_true", help="print the raw JSON")
        token_args(sub, "the server's token, if it requires one")
        tls_ca_arg(sub, "https://")

    ranges = commands.add_parser(
        "ranges",
        help="show each subscription's range map (from a running server)",
        description="Show each subscription's range map: one line per range, so a consumer that owns several "
        "ranges appears on several lines. With --pulsar-sticky, print one subscription's ranges per consumer as "
        "Apache Pulsar Key_Shared STICKY hash ranges. They mean the same in Pulsar 3.x; in Pulsar 4.x, which "
        "maps slot 0 to 1, a range that is exactly [0, 0] receives no keys.",
    )
    admin_args(ranges)
    ranges.add_argument("--topic", default=None, help="one subscription's topic (with --subscription)")
    ranges.add_argument("--subscription", default=None, help="one subscription (with --topic; default: all)")
    ranges.add_argument(
        "--pulsar-sticky",
        action="store_true",
        help='print each consumer\'s ranges as Apache Pulsar Key_Shared STICKY hash ranges, JSON {"consumer": '
        "[[start, end], ...]} (inclusive, sorted): pass them to KeySharedPolicy.stickyHashRange().ranges("
        "Range.of(start, end), ...) for that consumer; needs --topic and --subscription. Slots are Pulsar 3.x's "
        "(murmur3_32(key) & 0x7FFFFFFF) %% 65536; Pulsar 4.x maps slot 0 to 1, so there a range that is exactly "
        "[0, 0] receives no keys (they go to the owner of slot 1) and every other range means the same",
    )
    ranges.set_defaults(run=_ranges)

    admin = commands.add_parser("admin", help="change a running server's subscriptions")
    admin_commands = admin.add_subparsers(
        dest="admin_command",
        required=True,
        metavar="ACTION",
        help="set-consume-mode: ordered or unordered; configure: a subscription's own delivery settings",
    )
    mode = admin_commands.add_parser(
        "set-consume-mode",
        help="switch a subscription between ordered and unordered consumption (live, saved)",
        description="ordered: each key's messages go, in order, to the one consumer owning its hash range. "
        "unordered: any consumer with permits takes any message under a lease (pop), without key ranges or "
        "per-key order, for subscriptions that need throughput more than order. The switch applies at once and "
        "is saved with the subscription; nothing waiting or in flight is lost. Back to ordered, a key waits until "
        "its messages delivered in unordered mode are acked or their leases expire.",
    )
    mode.add_argument("mode", choices=("ordered", "unordered"), help="the consume mode")
    admin_args(mode)
    mode.add_argument("--topic", type=_name, required=True, help="the subscription's topic")
    mode.add_argument("--subscription", type=_name, required=True, help="the subscription")
    mode.set_defaults(run=_set_consume_mode)

    configure = admin_commands.add_parser(
        "configure",
        help="show or set a subscription's own ack timeout, redelivery limit, nack backoff and buffer bound "
        "(live, saved)",
        description="Without settings, show the subscription's delivery settings and whether each is its own or the "
        "server's (`keyfailover serve` options). Each setting given becomes the subscription's own, at once and "
        "saved with it; 'default' gives it the server's again. A shorter ack timeout also shortens the leases "
        "already out (to the new timeout from now); a longer one applies to new deliveries. A lower max replay "
        "drops nothing held: the subscription reads no more until acks bring it under the bound.",
    )
    admin_args(configure)
    configure.add_argument("--topic", type=_name, required=True, help="the subscription's topic")
    configure.add_argument("--subscription", type=_name, required=True, help="the subscription")
    configure.add_argument(
        "--ack-timeout", type=_or_default(_ack_seconds), default=None, help="seconds, 0 for no leases, or default"
    )
    configure.add_argument(
        "--max-redeliveries",
        type=_or_default(_redeliveries_or_none),
        default=None,
        help="redeliveries before the dead-letter topic, none (for ever), or default",
    )
    configure.add_argument(
        "--nack-backoff", type=_or_default(_ack_seconds), default=None, help="seconds, 0 for none, or default"
    )
    configure.add_argument(
        "--nack-backoff-max", type=_or_default(_ack_seconds), default=None, help="seconds, or default"
    )
    configure.add_argument(
        "--max-replay",
        type=_or_default(_int_between(100, 100_000_000, "a number of messages")),
        default=None,
        help="messages the subscription holds unacked in memory (as serve --max-replay), or default",
    )
    configure.add_argument("--reset", action="store_true", help="drop every own setting first (then apply those given)")
    configure.set_defaults(run=_configure)

    dlq = commands.add_parser(
        "dlq",
        help="list or replay a subscription's dead letters (from a running server)",
        description="A message delivered max_redeliveries + 1 times without an ack (`keyfailover serve "
        "--max-redeliveries`) is stored in the topic <topic>-<subscription>-DLQ, which can be consumed like any "
        "topic. `list` shows where each came from and why; `replay` re-publishes those not replayed yet to the "
        "topic (every subscription of the topic receives them again).",
    )
    dlq.add_argument("action", choices=("list", "replay"), help="list the dead letters, or replay them")
    admin_args(dlq)
    dlq.add_argument("--topic", type=_name, required=True, help="the topic the messages came from")
    dlq.add_argument("--subscription", type=_name, required=True, help="the subscription that gave up on them")
    dlq.add_argument("--limit", type=_positive_int, default=1000, help="with list: show at most this many (1000)")
    dlq.set_defaults(run=_dlq)

    def cluster_arg(sub: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup, required: bool = True) -> None:
        sub.add_argument(
            "--cluster",
            type=_cluster_url,
            required=required,
            help="the cluster's ZooKeeper ensemble and root path: zk://HOST:PORT[,HOST:PORT...]/PATH",
        )

    topics = commands.add_parser("topics", help="create topics with their partition counts")
    topics_commands = topics.add_subparsers(dest="topics_command", required=True, metavar="ACTION", help="create")
    create = topics_commands.add_parser(
        "create",
        help="create a topic with P partitions (fixed at creation; again with the same count is a no-op)",
        description="Partition p of P holds the keys whose hash slot lies in [p*65536//P, (p+1)*65536//P). "
        "Creating a topic that exists with another partition count is refused. Give --cluster for a cluster "
        "(the topic is recorded in ZooKeeper) or --admin-url for a single server.",
    )
    create.add_argument("topic", type=_name, help="the topic")
    create.add_argument(
        "--partitions", type=_int_between(1, 65536, "a number of partitions"), default=1, help="P (default 1)"
    )
    where = create.add_mutually_exclusive_group()
    cluster_arg(where, required=False)
    where.add_argument(
        "--admin-url",
        type=_admin_url,
        default="http://127.0.0.1:9650",
        help="without --cluster: a single server's --metrics-port endpoint (default http://127.0.0.1:9650)",
    )
    token_args(create, "the server's token, if it requires one (with --admin-url)")
    tls_ca_arg(create, "https://")
    create.set_defaults(run=_create_topic)

    cluster = commands.add_parser("cluster", help="show a cluster's brokers, coordinator and partition assignment")
    cluster_commands = cluster.add_subparsers(dest="cluster_command", required=True, metavar="ACTION", help="status")
    status = cluster_commands.add_parser(
        "status",
        help="brokers, coordinator, epoch, generation, topics and partition -> broker, from ZooKeeper",
        description="Reads the cluster from ZooKeeper, then every broker's admin endpoint (--metrics-port) at "
        "once for its consumers' ranges: a broker that does not answer within --timeout is shown as not "
        'answering (in --json: "reachable": false, and why under "unreachable"), however many there are.',
    )
    cluster_arg(status)
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    status.add_argument(
        "--timeout",
        type=_reply_seconds,
        default=0.5,
        metavar="SECONDS",
        help="how long to wait for the brokers' admin endpoints, all read at once (default 0.5), and for "
        "ZooKeeper (at least 2 s)",
    )
    token_args(status, "the brokers' token, to read their consumers' ranges, if they require one")
    tls_ca_arg(status, "https://")
    status.set_defaults(run=_cluster_status)

    stats = commands.add_parser("stats", help="show per-consumer stats (from a running server)")
    admin_args(stats)
    stats.set_defaults(run=_stats)

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code (2 usage, 1 failure, 130 interrupted)."""
    parser = _parser()
    args = parser.parse_args(argv)
    name = f"keyfailover {args.command}"
    run: Command = args.run
    try:
        return run(args)
    except _UsageError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (`keyfailover consume | head -1`)
        _discard_stdout()
        return 0
    except KeyFailoverError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush does not fail on the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
