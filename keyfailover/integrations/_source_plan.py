"""The Spark source's planning, with no Spark in it: its options, its offsets, admission control, and the cut
of a micro-batch into read tasks.

An offset is a dict from a topic partition's index, as a str, to its next position: the first position
not yet read. Positions start at 1, so ``{"0": 1}`` is the start of an empty partition 0, and a partition
whose log ends at ``last`` has been read through once its next position is ``last + 1``.

:class:`SourceOptions` checks the options a user gives ``spark.read.format("keyfailover")``; every
refusal is a :class:`SourceOptionError` that names the option and says what was expected.
:func:`admit` is admission control: how far each partition reads in one micro-batch under a
``maxMessagesPerTrigger``. :func:`plan_by_partition` and :func:`plan_by_ranges` cut a batch into
:class:`ReadTask` lists, one list per Spark partition; :func:`cut_by_traffic` cuts the slot space
into contiguous ranges that carry equal shares of a sample's traffic, which :func:`sample_traffic`
reads from the batch. :func:`connect` gives the :class:`LogReader` every read goes through: a client
of the server at ``url``, or a :class:`~keyfailover.integrations._source_store.StoreLog` of ``store``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from keyfailover.client import Client, LogEntries, NoBrokerError, ServerError
from keyfailover.core.errors import ConfigError, ErrorCode, KeyFailoverError, LogError
from keyfailover.core.hashing import HASH_RANGE_SIZE
from keyfailover.core.partitions import partition_slots
from keyfailover.integrations._source_store import StoreLog
from keyfailover.integrations._store import StoreURL
from keyfailover.wire.protocol import MAX_READ, check_name

__all__ = [
    "CONNECT_TIMEOUT",
    "OPTIONS",
    "READ_TIMEOUT",
    "SAMPLE_SIZE",
    "LogReader",
    "Offsets",
    "ReadTask",
    "SourceOptionError",
    "SourceOptions",
    "admit",
    "check_starting",
    "connect",
    "cut_by_traffic",
    "plan_by_partition",
    "plan_by_ranges",
    "sample_traffic",
    "starting_offsets",
]

Offsets = dict[str, int]
"""A topic partition's index, as a str, to its next position: the first position not yet read."""

OPTIONS = (
    "url",
    "store",
    "topic",
    "startingPositions",
    "maxMessagesPerTrigger",
    "ranges",
    "token",
    "tlsCa",
    "binaryKeys",
)
"""The options the source takes, as the documentation spells them; Spark hands them over in lower case."""

CONNECT_TIMEOUT = 10.0
"""Seconds the source waits for a broker of ``url`` to answer."""

READ_TIMEOUT = 60.0
"""Seconds a read may wait for its partition's broker, which it follows through a failover, before it fails."""

SAMPLE_SIZE = 4096
"""At most this many messages of a micro-batch are read on the driver to cut the slot space by traffic."""

_SAMPLE_PROBES = 4
"""The sample of a partition is read in this many pages, spread evenly over its part of the batch."""


class SourceOptionError(ConfigError):
    """An option of the keyfailover Spark source is missing, unknown or wrong; the message names it."""


class LogReader(Protocol):
    """What the source reads a log through: a :class:`~keyfailover.client.Client` of a server, or a
    :class:`~keyfailover.integrations._source_store.StoreLog` of a cluster's PostgreSQL log."""

    def log_ends(self, topic: str, timeout: float | None = None) -> list[int]:
        """The last position of every partition of ``topic``, in partition order."""

    def read(
        self,
        topic: str,
        partition: int = 0,
        after: int = 0,
        limit: int = 1000,
        *,
        slots: tuple[int, int] | None = None,
        timeout: float | None = None,
    ) -> LogEntries:
        """The messages of ``partition`` above ``after``, at most ``limit``, in position order."""

    def close(self) -> None:
        """Let go of the connection."""

    def __enter__(self) -> LogReader: ...

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None: ...


@dataclass(frozen=True)
class SourceOptions:
    """The source's options, checked: what :meth:`parse` makes of the strings a user gave.

    One of ``url``, a server's, and ``store``, a cluster's PostgreSQL log, is given. ``starting`` is
    ``"earliest"``, ``"latest"`` or a dict from partition index to the first position to read; ``ranges``
    None cuts a batch by topic partition, an int N into N slot ranges.
    """

    url: str | None
    store: str | None
    topic: str
    starting: str | dict[int, int]
    max_per_trigger: int | None
    ranges: int | None
    token: str | None
    tls_ca: str | None
    binary_keys: bool

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        """The options given, checked each on its own; a :class:`SourceOptionError` for the first one wrong."""
        known = {name.lower(): name for name in OPTIONS}
        unknown = sorted(name for name in options if name.lower() not in known)
        if unknown:
            raise SourceOptionError(
                f"unknown option {unknown[0]!r} of the keyfailover source; expected one of {', '.join(OPTIONS)}"
            )
        given = {known[name.lower()]: value for name, value in options.items()}
        url, store = given.get("url"), given.get("store")
        if not url and not store:
            raise SourceOptionError(
                "option url is required: the server to read from, e.g. kf://127.0.0.1:6650, or a cluster's "
                "brokers, kf://HOST:PORT,HOST:PORT (or option store: a cluster's PostgreSQL log)"
            )
        if url and store:
            raise SourceOptionError("options url and store are both given; expected one: a server, or a store")
        for option in ("token", "tlsCa"):
            if store and option in given:
                raise SourceOptionError(
                    f"option {option} is for a server's url, not a store; expected the store's user and password "
                    "in its URL"
                )
        topic = given.get("topic")
        if topic is None:
            raise SourceOptionError("option topic is required: the topic to read")
        try:
            check_name("topic", topic)
        except KeyFailoverError as exc:
            raise SourceOptionError(f"option {exc}") from None
        return cls(
            url=url or None,
            store=store or None,
            topic=topic,
            starting=_parse_starting(given.get("startingPositions", "earliest")),
            max_per_trigger=_parse_count("maxMessagesPerTrigger", given.get("maxMessagesPerTrigger"), 2**31 - 1),
            ranges=_parse_ranges(given.get("ranges", "partitions")),
            token=given.get("token"),
            tls_ca=given.get("tlsCa"),
            binary_keys=_parse_bool("binaryKeys", given.get("binaryKeys", "false")),
        )


def _parse_starting(value: str) -> str | dict[int, int]:
    """``earliest``, ``latest`` or a JSON object from partition index to a first position, checked."""
    expected = 'expected earliest, latest or a JSON object of partition to position, such as {"0": 17, "1": 1}'
    if value.strip().lower() in ("earliest", "latest"):
        return value.strip().lower()
    try:
        parsed = json.loads(value)
    except ValueError:
        raise SourceOptionError(f"option startingPositions is {value!r}: not JSON; {expected}") from None
    if not isinstance(parsed, dict):
        raise SourceOptionError(f"option startingPositions is {value!r}; {expected}")
    positions: dict[int, int] = {}
    for name, position in parsed.items():
        if not name.isdigit() or name != str(int(name)):
            raise SourceOptionError(
                f"option startingPositions names the partition {name!r}; expected a partition index, such as "
                '"0", for each entry'
            )
        if type(position) is not int or position < 1:
            raise SourceOptionError(
                f"option startingPositions gives partition {name} the position {position!r}; expected a position, "
                "an int of at least 1 (positions start at 1)"
            )
        positions[int(name)] = position
    return positions


def _parse_count(option: str, value: str | None, most: int) -> int | None:
    """An int from 1 to ``most`` written in ``value``, None when it is not given."""
    if value is None:
        return None
    text = value.strip()
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise SourceOptionError(f"option {option} is {value!r}; expected a whole number from 1 to {most}")
    return int(text)


def _parse_ranges(value: str) -> int | None:
    """None for ``partitions``, else the number of slot ranges, from 1 to the number of slots."""
    if value.strip().lower() == "partitions":
        return None
    if not value.strip().isdigit() or not 1 <= int(value) <= HASH_RANGE_SIZE:
        raise SourceOptionError(
            f"option ranges is {value!r}; expected partitions (one Spark partition per topic partition) or a "
            f"number of slot ranges from 1 to {HASH_RANGE_SIZE}"
        )
    return int(value)


def _parse_bool(option: str, value: str) -> bool:
    """``true`` or ``false``, in any case."""
    text = value.strip().lower()
    if text not in ("true", "false"):
        raise SourceOptionError(f"option {option} is {value!r}; expected true or false")
    return text == "true"


def connect(options: SourceOptions) -> LogReader:
    """A reader of the log ``options`` name, connected; a failure to connect is a :class:`SourceOptionError`
    naming the option at fault: ``url`` for a malformed URL or no broker answering, ``tlsCa`` for its CA file,
    ``token`` for a token the server refuses, ``store`` for a store that cannot be read."""
    if options.store is not None:
        try:
            return StoreLog(StoreURL.parse(options.store))
        except LogError as exc:
            raise SourceOptionError(f"option store: {exc}") from None
    assert options.url is not None
    tls_ca = options.tls_ca
    if tls_ca is not None and not options.url.startswith("kf+ssl://"):
        raise SourceOptionError(f"option tlsCa is given but url {options.url!r} is plain TCP; expected a kf+ssl:// url")
    if tls_ca is not None and not os.path.isfile(tls_ca):
        raise SourceOptionError(f"option tlsCa is {tls_ca!r}, which is not a file; expected a PEM file of CAs")
    try:
        return Client(options.url, options.token, connect_timeout=CONNECT_TIMEOUT, tls_ca=tls_ca)
    except NoBrokerError as exc:
        raise SourceOptionError(f"option url: {exc}; expected a running keyfailover server there") from None
    except ServerError as exc:
        option = "token" if exc.code == ErrorCode.UNAUTHORIZED else "url"
        raise SourceOptionError(f"option {option}: the server at {options.url} refused the connection: {exc}") from None
    except OSError as exc:
        if tls_ca is not None:
            raise SourceOptionError(f"option tlsCa: cannot connect to {options.url} over TLS: {exc}") from None
        raise SourceOptionError(
            f"option url: cannot connect to {options.url}: {exc}; expected a running keyfailover server there"
        ) from None
    except KeyFailoverError as exc:
        option = "tlsCa" if tls_ca is not None and "CA" in str(exc) else "url"
        raise SourceOptionError(f"option {option}: {exc}") from None


def check_starting(starting: str | dict[int, int], ends: Sequence[int]) -> None:
    """Refuse a ``startingPositions`` map that names a partition the topic lacks, or a position past the end of
    its log; ``ends`` holds the last position of each partition."""
    if isinstance(starting, str):
        return
    for partition, position in sorted(starting.items()):
        if partition >= len(ends):
            raise SourceOptionError(
                f"option startingPositions names partition {partition}, but the topic has {len(ends)} "
                f"partition{'s' if len(ends) != 1 else ''}: expected partitions 0 to {len(ends) - 1}"
            )
        if position > ends[partition] + 1:
            raise SourceOptionError(
                f"option startingPositions starts partition {partition} at position {position}, beyond the end of "
                f"its log: expected at most {ends[partition] + 1}, the position after its last message "
                f"{ends[partition]}"
            )


def starting_offsets(starting: str | dict[int, int], ends: Sequence[int]) -> Offsets:
    """The offset a query starts from: every partition at its first position (``earliest``), after its last one
    (``latest``), or where the map says, partitions it does not name at their first. Checked against ``ends``."""
    check_starting(starting, ends)
    if starting == "latest":
        return {str(partition): last + 1 for partition, last in enumerate(ends)}
    given = starting if isinstance(starting, dict) else {}
    return {str(partition): given.get(partition, 1) for partition in range(len(ends))}


def admit(start: Offsets, ends: Sequence[int], most: int | None) -> Offsets:
    """The end offset of a micro-batch from ``start``: every partition to the end of its log when ``most`` is
    None, else at most ``most`` positions in all, split across partitions in proportion to their backlogs as
    Kafka's ``maxOffsetsPerTrigger`` does.

    The split gives each partition the whole part of its share, then one more to those with the largest
    remainders, ties to the lower partition, so the batch takes exactly ``most`` positions when the backlog
    is larger. A partition missing from ``start`` (one that appeared since) starts at position 1. A start
    beyond the end of a log, which a checkpoint of another log would hold, is a :class:`KeyFailoverError`.
    """
    begin = [start.get(str(partition), 1) for partition in range(len(ends))]
    for partition, (first, last) in enumerate(zip(begin, ends, strict=True)):
        if first > last + 1:
            raise KeyFailoverError(
                f"the query's offset starts partition {partition} at position {first}, but its log ends at {last}: "
                "expected the log the checkpoint was made with; start a new checkpoint to read this one"
            )
    backlogs = [max(0, last + 1 - first) for first, last in zip(begin, ends, strict=True)]
    total = sum(backlogs)
    if most is None or total <= most:
        taken = backlogs
    else:
        shares = [most * backlog / total for backlog in backlogs]
        taken = [int(share) for share in shares]
        by_remainder = sorted(range(len(ends)), key=lambda p: (-(shares[p] - taken[p]), p))
        for partition in by_remainder[: most - sum(taken)]:
            taken[partition] += 1
    end = dict(start)
    for partition, (first, count) in enumerate(zip(begin, taken, strict=True)):
        end[str(partition)] = first + count
    return end


class ReadTask(NamedTuple):
    """One read of a Spark task: partition ``partition`` from position ``after + 1`` through ``last``.

    ``slots`` None keeps every message; an inclusive pair keeps those whose key's slot lies in it, and
    with ``keyless`` the keyless ones too. ``filtered`` says whether the server applies the slot filter
    (false when keyless messages are kept: the server's filter drops them, so the task filters itself).
    """

    partition: int
    after: int
    last: int
    slots: tuple[int, int] | None
    keyless: bool

    @property
    def filtered(self) -> bool:
        """Whether the read sends its slot filter to the server."""
        return self.slots is not None and not self.keyless


def _bounds(start: Offsets, end: Offsets) -> list[tuple[int, int, int]]:
    """``(partition, after, last)`` of every partition of a batch: it reads positions after ``after`` through
    ``last``; nothing when they are equal."""
    return [(int(name), start.get(name, 1) - 1, next_position - 1) for name, next_position in sorted_offsets(end)]


def sorted_offsets(offsets: Offsets) -> list[tuple[str, int]]:
    """The items of ``offsets`` in partition order."""
    return sorted(offsets.items(), key=lambda item: int(item[0]))


def plan_by_partition(start: Offsets, end: Offsets) -> list[list[ReadTask]]:
    """One Spark partition per topic partition, in partition order: Spark partition i reads topic partition i."""
    return [[ReadTask(partition, after, last, None, True)] for partition, after, last in _bounds(start, end)]


def plan_by_ranges(start: Offsets, end: Offsets, ranges: Sequence[tuple[int, int]]) -> list[list[ReadTask]]:
    """One Spark partition per slot range: each reads, from every topic partition whose slots its range touches,
    the messages whose key's slot lies in the range.

    A key has one slot, so its messages are all in one Spark partition, read from its one topic partition
    in position order. The keyless messages of a topic partition go to the Spark partition whose range
    holds the partition's first slot.
    """
    bounds = _bounds(start, end)
    count = len(bounds)
    plan: list[list[ReadTask]] = []
    for first, last in ranges:
        tasks = []
        for partition, after, through in bounds:
            low, high = partition_slots(partition, count)
            if after >= through or high < first or last < low:
                continue
            lo, hi = max(low, first), min(high, last)
            whole = lo == low and hi == high
            tasks.append(ReadTask(partition, after, through, None if whole else (lo, hi), first <= low <= last))
        plan.append(tasks)
    return plan


def cut_by_traffic(traffic: npt.NDArray[np.float64], count: int) -> list[tuple[int, int]]:
    """``count`` contiguous inclusive slot ranges tiling the slot space, each carrying about an equal share of
    ``traffic`` (a weight per slot); equal widths when there is no traffic.

    Range i ends at the first slot where the running total reaches ``(i + 1) / count`` of the whole, moved
    on where needed so that every range holds at least one slot. A slot is never cut, so neither is a key.
    """
    total = float(traffic.sum())
    if total <= 0.0:
        ends = [(i + 1) * HASH_RANGE_SIZE // count - 1 for i in range(count)]
    else:
        cumulative = np.cumsum(traffic)
        ends = [int(np.searchsorted(cumulative, total * (i + 1) / count, side="left")) for i in range(count)]
    ranges = []
    first = 0
    for i in range(count):
        end = HASH_RANGE_SIZE - 1 if i == count - 1 else min(max(ends[i], first), HASH_RANGE_SIZE - count + i)
        ranges.append((first, end))
        first = end + 1
    return ranges


def sample_traffic(client: LogReader, topic: str, start: Offsets, end: Offsets) -> npt.NDArray[np.float64]:
    """The traffic of each slot in a micro-batch, estimated from a sample of at most :data:`SAMPLE_SIZE` of its
    messages read on the driver.

    Each partition's share of the sample is in proportion to its backlog in the batch, read in
    :data:`_SAMPLE_PROBES` pages spread evenly over its positions; each sampled message then stands for
    ``backlog / sampled`` messages of its partition, so partitions weigh by their backlogs.
    """
    traffic = np.zeros(HASH_RANGE_SIZE, dtype=np.float64)
    bounds = [(partition, after, last) for partition, after, last in _bounds(start, end) if last > after]
    total = sum(last - after for _, after, last in bounds)
    for partition, after, last in bounds:
        backlog = last - after
        share = min(backlog, MAX_READ, max(_SAMPLE_PROBES, SAMPLE_SIZE * backlog // total))
        page = max(1, share // _SAMPLE_PROBES)
        slots: list[int] = []
        for probe in range(_SAMPLE_PROBES):
            begin = after + probe * backlog // _SAMPLE_PROBES
            count = min(page, last - begin)
            if count <= 0:
                continue
            entries = client.read(topic, partition, begin, count, timeout=READ_TIMEOUT)
            slots.extend(entry.slot for entry in entries.messages if entry.slot is not None and entry.position <= last)
        if slots:
            np.add.at(traffic, np.asarray(slots, dtype=np.int64), backlog / len(slots))
    return traffic
