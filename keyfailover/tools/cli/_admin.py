"""``keyfailover ranges``, ``admin``, ``dlq`` and ``stats``: a running server's admin endpoint."""

from __future__ import annotations

import argparse
import json
from typing import Any

from keyfailover.core.dispatcher import DeliverySettings
from keyfailover.tools.cli._common import (
    SubParsers,
    _admin_call,
    _admin_url,
    _delivery_setting,
    _name,
    _or_default,
    _positive_int,
    _UsageError,
    add_actions,
    tls_ca_arg,
    token_args,
)


def _admin_args(sub: argparse.ArgumentParser) -> None:
    """The options of a command that asks a server's admin endpoint: its URL, --json, token and CA."""
    sub.add_argument(
        "--admin-url",
        type=_admin_url,
        default="http://127.0.0.1:9650",
        help="the server's --metrics-port endpoint (default http://127.0.0.1:9650)",
    )
    sub.add_argument("--json", action="store_true", help="print the raw JSON")
    token_args(sub, "the server's token, if it requires one")
    tls_ca_arg(sub, "https://")


def _subscription_args(
    sub: argparse.ArgumentParser, topic: str = "the subscription's topic", subscription: str = "the subscription"
) -> None:
    """The options of an action on one subscription: :func:`_admin_args`, then ``--topic`` and ``--subscription``
    with these helps."""
    _admin_args(sub)
    sub.add_argument("--topic", type=_name, required=True, help=topic)
    sub.add_argument("--subscription", type=_name, required=True, help=subscription)


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


def add_ranges(commands: SubParsers) -> None:
    """The ``ranges`` command."""
    ranges = commands.add_parser(
        "ranges",
        help="show each subscription's range map (from a running server)",
        description="Show each subscription's range map: one line per range, so a consumer that owns several "
        "ranges appears on several lines. With --pulsar-sticky, print one subscription's ranges per consumer as "
        "Apache Pulsar Key_Shared STICKY hash ranges. They mean the same in Pulsar 3.x; in Pulsar 4.x, which "
        "maps slot 0 to 1, a range that is exactly [0, 0] receives no keys.",
    )
    _admin_args(ranges)
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


_CONFIGURE_HELP = {
    "ack_timeout": "seconds, 0 for no leases, or default",
    "max_redeliveries": "redeliveries before the dead-letter topic, none (for ever), or default",
    "max_replay": "messages the subscription holds unacked in memory (as serve --max-replay), or default",
    "nack_backoff": "seconds, 0 for none, or default",
    "nack_backoff_max": "seconds, or default",
}
"""The help of each ``admin configure`` option: one for each of :meth:`DeliverySettings.own_names`."""


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
        setting: value for setting in DeliverySettings.own_names() if (value := getattr(args, setting)) is not None
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


def add_admin(commands: SubParsers) -> None:
    """The ``admin`` command and its actions, ``set-consume-mode`` and ``configure``."""
    admin_commands = add_actions(
        commands,
        "admin",
        "change a running server's subscriptions",
        "set-consume-mode: ordered or unordered; configure: a subscription's own delivery settings",
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
    _subscription_args(mode)
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
    _subscription_args(configure)
    for setting in DeliverySettings.own_names():
        configure.add_argument(
            "--" + setting.replace("_", "-"),
            type=_or_default(_delivery_setting(setting, none=True)),
            default=None,
            help=_CONFIGURE_HELP[setting],
        )
    configure.add_argument("--reset", action="store_true", help="drop every own setting first (then apply those given)")
    configure.set_defaults(run=_configure)


_DLQ_CHANGES = {
    "replay": ("/dlq/replay", "replayed {replayed} dead letter(s) to {topic}"),
    "purge": ("/dlq/purge", "purged {purged} dead letter(s) of {topic}/{subscription}"),
}
"""The dead-letter actions that change something: their POST route, and what is printed of its answer."""


def _dlq(args: argparse.Namespace) -> int:
    query = {"topic": args.topic, "subscription": args.subscription}
    if args.action in _DLQ_CHANGES:
        path, done = _DLQ_CHANGES[args.action]
        found = _admin_call(args, path, query, method="POST")
        print(json.dumps(found, indent=2, sort_keys=True) if args.json else done.format_map(found))
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


def add_dlq(commands: SubParsers) -> None:
    """The ``dlq`` command."""
    dlq = commands.add_parser(
        "dlq",
        help="list, replay or purge a subscription's dead letters (from a running server)",
        description="A message delivered max_redeliveries + 1 times without an ack (`keyfailover serve "
        "--max-redeliveries`) is stored in the topic <topic>-<subscription>-DLQ, which can be consumed like any "
        "topic. `list` shows where each came from and why; `replay` re-publishes those not replayed yet to the "
        "topic (every subscription of the topic receives them again); `purge` deletes the subscription's dead-letter "
        "records, replayed or not (the messages stay in the dead-letter topic for its readers).",
    )
    dlq.add_argument(
        "action", choices=("list", "replay", "purge"), help="list the dead letters, replay them, or purge them"
    )
    _subscription_args(dlq, "the topic the messages came from", "the subscription that gave up on them")
    dlq.add_argument("--limit", type=_positive_int, default=1000, help="with list: show at most this many (1000)")
    dlq.set_defaults(run=_dlq)


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


def add_stats(commands: SubParsers) -> None:
    """The ``stats`` command."""
    stats = commands.add_parser("stats", help="show per-consumer stats (from a running server)")
    _admin_args(stats)
    stats.set_defaults(run=_stats)
