"""``keyfailover topics create`` and ``cluster status``: a cluster's topics, brokers and assignment."""

from __future__ import annotations

import argparse
import json
from typing import Any
from urllib.request import Request

from keyfailover.tools.cli._common import (
    SubParsers,
    _admin_call,
    _admin_url,
    _ca_context,
    _cluster_url,
    _int_between,
    _name,
    _reply_seconds,
    _token,
    add_actions,
    tls_ca_arg,
    token_args,
)


def _cluster_arg(sub: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup, required: bool = True) -> None:
    """The ``--cluster zk://...`` option."""
    sub.add_argument(
        "--cluster",
        type=_cluster_url,
        required=required,
        help="the cluster's ZooKeeper ensemble and root path: zk://HOST:PORT[,HOST:PORT...]/PATH",
    )


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


def add_topics(commands: SubParsers) -> None:
    """The ``topics`` command and its action, ``create``."""
    topics_commands = add_actions(commands, "topics", "create topics with their partition counts", "create")
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
    _cluster_arg(where, required=False)
    where.add_argument(
        "--admin-url",
        type=_admin_url,
        default="http://127.0.0.1:9650",
        help="without --cluster: a single server's --metrics-port endpoint (default http://127.0.0.1:9650)",
    )
    token_args(create, "the server's token, if it requires one (with --admin-url)")
    tls_ca_arg(create, "https://")
    create.set_defaults(run=_create_topic)


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


def add_cluster(commands: SubParsers) -> None:
    """The ``cluster`` command and its action, ``status``."""
    cluster_commands = add_actions(
        commands, "cluster", "show a cluster's brokers, coordinator and partition assignment", "status"
    )
    status = cluster_commands.add_parser(
        "status",
        help="brokers, coordinator, epoch, generation, topics and partition -> broker, from ZooKeeper",
        description="Reads the cluster from ZooKeeper, then every broker's admin endpoint (--metrics-port) at "
        "once for its consumers' ranges: a broker that does not answer within --timeout is shown as not "
        'answering (in --json: "reachable": false, and why under "unreachable"), however many there are.',
    )
    _cluster_arg(status)
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
