"""``keyfailover serve``: a server with its embedded log, or a broker of a cluster."""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from pathlib import Path

from keyfailover.core.dispatcher import DeliverySettings
from keyfailover.core.errors import ConfigError
from keyfailover.core.loops import LOOP_CHOICES, LOOP_ENV
from keyfailover.core.rebalance import DEFAULT_MAX_RANGES
from keyfailover.tools.cli._common import (
    SubParsers,
    _ack_seconds,
    _cluster_url,
    _delivery_setting,
    _frame_size,
    _int_at_least,
    _int_between,
    _max_ranges,
    _port,
    _positive_int,
    _session_seconds,
    _token,
    _UsageError,
    token_args,
)


def _serve(args: argparse.Namespace) -> int:
    from keyfailover.broker.server import ServerConfig, SubscriptionConfig
    from keyfailover.broker.storage import DEFAULT_ENTRY_CACHE_BYTES
    from keyfailover.core.loops import chosen_loop, new_loop
    from keyfailover.core.signals import whole_loop
    from keyfailover.tools.serve import configure_logging, run_server
    from keyfailover.wire.protocol import DEFAULT_MAX_FRAME

    if (args.tls_cert is None) != (args.tls_key is None):
        raise _UsageError("--tls-cert and --tls-key go together")
    if args.max_ranges is not None and args.policy != "multi":
        raise _UsageError(
            f"--max-ranges goes with --policy multi; --policy {args.policy} gives each consumer one range"
        )
    try:
        delivery = DeliverySettings(
            **{declared.name: getattr(args, declared.name) for declared in DeliverySettings.declared()}
        )
    except ConfigError as exc:
        raise _UsageError(str(exc)) from None
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
        _check_advertised(args.advertise)
    try:
        loop = chosen_loop(args.loop)
    except ConfigError as exc:
        raise _UsageError(str(exc)) from None
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
            consume_mode=args.consume_mode,
            delivery=delivery,
        ),
    )
    configure_logging(args.log_level, config.cluster is not None)
    made = functools.partial(whole_loop, functools.partial(new_loop, loop))  # Ctrl-C as it starts: no half-made loop
    with asyncio.Runner(loop_factory=made) as runner:
        return runner.run(run_server(config))


def _check_advertised(text: str) -> None:
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


def add_serve(commands: SubParsers) -> None:
    """The ``serve`` command."""
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
    seconds = functools.partial(serve.add_argument, type=_session_seconds)  # 0.1 s to a day
    seconds(
        "--cluster-session-timeout",
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
    token_args(serve, "the token clients, and admin requests other than /healthz, must present")
    serve.add_argument("--tls-cert", default=None, help="PEM certificate: serve the broker and admin ports over TLS")
    serve.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    seconds(
        "--session-timeout", default=10.0, help="seconds a silent client keeps its sessions, 0.1 to 86400 (default 10)"
    )
    serve.add_argument(
        "--max-frame", type=_frame_size, default=None, help="largest frame in bytes, >= 1024 (default 5 MiB)"
    )
    serve.add_argument("--sync", choices=("full", "normal"), default="full", help="SQLite synchronous mode")
    serve.add_argument(
        "--loop",
        choices=LOOP_CHOICES,
        default=None,
        help="the event loop: uvloop, asyncio's own, or auto, uvloop when it is installed "
        f"(default: ${LOOP_ENV}, else auto)",
    )
    serve.add_argument(
        "--login-frame",
        type=_frame_size,
        default=64 * 1024,
        help="largest frame in bytes before a client has sent connect (default 64 KiB)",
    )
    seconds("--login-timeout", default=10.0, help="seconds a new connection has to send connect (default 10)")
    seconds(
        "--frame-timeout",
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
        "--consume-mode",
        choices=("ordered", "unordered"),
        default="ordered",
        help="the consume mode of subscriptions without one of their own (`keyfailover admin set-consume-mode` "
        "sets one): ordered (per-key order, the default) or unordered (any consumer takes any message)",
    )
    for declared in DeliverySettings.declared():  # each delivery setting's option, as its field declares it
        serve.add_argument(
            "--" + declared.name.replace("_", "-"),
            type=_delivery_setting(declared.name),
            default=declared.default,
            help=declared.metadata["help"],
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
