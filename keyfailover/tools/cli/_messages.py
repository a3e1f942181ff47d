"""``keyfailover produce``, ``consume`` and ``export``: messages in, out, and out of the log to files."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, BinaryIO

from keyfailover.core.errors import KeyFailoverError
from keyfailover.tools.cli._common import (
    SubParsers,
    _connected,
    _name,
    _positive_float,
    _positive_int,
    _server_url,
    _UsageError,
    tls_ca_arg,
    token_args,
)


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


def _client_args(sub: argparse.ArgumentParser) -> None:
    """The options of a command that connects to a server: its URL, token, CA and the topic."""
    sub.add_argument(
        "--url", type=_server_url, default="kf://127.0.0.1:6650", help="server URL (default kf://127.0.0.1:6650)"
    )
    token_args(sub, "the server's token, if it requires one")
    tls_ca_arg(sub, "kf+ssl://")
    sub.add_argument("--topic", type=_name, required=True, help="the topic to use")


def add_produce(commands: SubParsers) -> None:
    """The ``produce`` command."""
    produce = commands.add_parser("produce", help="send lines or JSON lines from a file or stdin")
    _client_args(produce)
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


def add_consume(commands: SubParsers) -> None:
    """The ``consume`` command."""
    consume = commands.add_parser("consume", help="print messages (acking as it goes)")
    _client_args(consume)
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


def add_export(commands: SubParsers) -> None:
    """The ``export`` command."""
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
