"""What a chaos run records, one JSON object per line, and how it is read back.

Every record has a ``type`` and ``t``, seconds on the machine's monotonic clock,
``time.monotonic()``: CLOCK_MONOTONIC is one clock for every process on Linux, so the
records of a run's processes interleave truly. A message is named by its ``key`` and its
``value``: the producer numbers each key's sends 0, 1, 2, ... in send order, so a value
names one send and the produced order of a key is the order of its values.

- :class:`Produced`: a send and its receipt (``ok`` with the stored ``partition`` and
  ``position``, or the error the producer got; an unconfirmed send may still be stored); ``t`` is
  the receipt's time, ``sent`` the send's.
- :class:`Delivered`: a message handed to a consumer's application, with its redelivery count.
- :class:`Acked`: a consumer's ack of a delivery, sent at ``t``; ``confirmed`` True when the
  broker said it settled the message, False when it refused it (the lease had ended), None while
  the outcome is not known (written as the ack goes out; the answer, if one comes, follows in a
  second record, so an ack that got none, a timeout or its consumer killed, stays unknown).
- :class:`DeadLettered`: a message found in a dead-letter topic after the run.
- :class:`Served`: a broker serving a partition under an owner epoch from ``t`` until
  ``until`` (None: to the end of the run); the harness ends an interval at the broker's
  release, its kill, or the moment it was fenced.
- :class:`RangeMap`: the consumers' ranges of one partition's slots from ``t`` on (a whole
  map; an empty one while nobody consumes it).
- :class:`Fault`: a fault injected (``start``) or healed (``end``) on a target; a fault on the
  replicated store names the member it hit: ``store:member0``.
- :class:`StoreRoles`: the replicated store's members as Patroni lists them from ``t`` on: each
  member's role and state (a whole list; an empty one while no member answers).

Everything is a frozen dataclass; :func:`to_json` and :func:`from_json` round-trip them, and
:class:`RecordWriter` appends them to a file from many threads.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Literal, TextIO

__all__ = [
    "UNANSWERED",
    "Acked",
    "DeadLettered",
    "Delivered",
    "Fault",
    "Produced",
    "RangeMap",
    "Record",
    "RecordError",
    "RecordWriter",
    "Served",
    "StoreRoles",
    "from_json",
    "read_records",
    "to_json",
]


class RecordError(ValueError):
    """A line of a record file is not a record this module writes."""


UNANSWERED = "no receipt and no error by the end of the run"
"""A :class:`Produced` record's ``error`` for a send its producer never got an answer for."""


@dataclass(frozen=True)
class Produced:
    """A send and its receipt, or the error its producer got."""

    type: ClassVar[str] = "produced"
    t: float
    producer: str
    key: str
    value: int
    ok: bool
    partition: int | None = None
    position: int | None = None
    error: str | None = None
    sent: float | None = None
    """When the send was made; None in the records of a producer that did not say."""


@dataclass(frozen=True)
class _AtConsumer:
    """The fields of the records of a message at a consumer: :class:`Delivered` and :class:`Acked`."""

    t: float
    consumer: str
    key: str
    value: int
    partition: int
    position: int


@dataclass(frozen=True)
class Delivered(_AtConsumer):
    """A message handed to a consumer's application, with its redelivery count."""

    type: ClassVar[str] = "delivered"
    redelivery: int = 0


@dataclass(frozen=True)
class Acked(_AtConsumer):
    """A consumer's ack of a delivery and, once known, whether the broker settled it."""

    type: ClassVar[str] = "acked"
    confirmed: bool | None


@dataclass(frozen=True)
class DeadLettered:
    """A message found in a dead-letter topic after the run."""

    type: ClassVar[str] = "dead_lettered"
    t: float
    key: str
    value: int
    partition: int
    position: int


@dataclass(frozen=True)
class Served:
    """A broker serving a partition under an owner epoch from ``t`` until ``until``."""

    type: ClassVar[str] = "served"
    t: float
    broker: str
    partition: int
    epoch: int
    until: float | None = None


@dataclass(frozen=True)
class RangeMap:
    """The consumers' ranges of one partition's slots from ``t`` on."""

    type: ClassVar[str] = "ranges"
    t: float
    partition: int
    ranges: tuple[tuple[int, int, str], ...]
    """``(first slot, last slot, consumer)``, slots of the whole 0..65535 space."""
    broker: str = ""
    """The broker whose map it is; empty: whichever broker serves the partition."""


@dataclass(frozen=True)
class Fault:
    """A fault injected or healed on a target."""

    type: ClassVar[str] = "fault"
    t: float
    kind: str
    target: str
    action: Literal["start", "end"]
    detail: str = ""


STORE = "store"
"""The role name of the replicated store: the schedule's target, and the prefix of its faults' targets."""


def store_target(member: str) -> str:
    """The :class:`Fault` target of a fault on the store's member ``member``: ``store:member0``."""
    return f"{STORE}:{member}"


def on_store(fault: Fault) -> bool:
    """Whether ``fault`` hit a member of the replicated store."""
    return fault.target.startswith(STORE + ":")


@dataclass(frozen=True)
class StoreRoles:
    """The replicated store's members from ``t`` on, as Patroni lists them."""

    type: ClassVar[str] = "store_roles"
    t: float
    members: tuple[tuple[str, str, str], ...]
    """``(member, role, state)`` sorted by member: role ``leader``, ``sync_standby`` or ``replica``, state
    ``running``, ``streaming``, ``stopped``...; a member Patroni does not list is missing."""


Record = Produced | Delivered | Acked | DeadLettered | Served | RangeMap | Fault | StoreRoles

_TYPES: dict[str, type[Record]] = {
    kind.type: kind for kind in (Produced, Delivered, Acked, DeadLettered, Served, RangeMap, Fault, StoreRoles)
}


def to_json(record: Record) -> str:
    """One line of JSON (no newline): the record's fields and its ``type``."""
    return json.dumps({"type": record.type, **asdict(record)}, separators=(",", ":"))


def from_json(line: str) -> Record:
    """The record a line of :func:`to_json` holds, or RecordError saying what is wrong with it."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as error:
        raise RecordError(f"not JSON ({error.msg}): {line[:80]!r}") from None
    if not isinstance(data, dict):
        raise RecordError(f"expected a JSON object, not {type(data).__name__}: {line[:80]!r}")
    kind = _TYPES.get(data.pop("type", None))
    if kind is None:
        raise RecordError(f"unknown record type in {line[:80]!r}; expected one of {', '.join(_TYPES)}")
    names = {field.name for field in fields(kind)}
    if unknown := set(data) - names:
        raise RecordError(f"{kind.type} record has unknown fields {sorted(unknown)}: {line[:80]!r}")
    if kind is RangeMap and isinstance(data.get("ranges"), list):
        data["ranges"] = tuple(_range(item, line) for item in data["ranges"])
    if kind is StoreRoles and isinstance(data.get("members"), list):
        data["members"] = tuple(_role(item, line) for item in data["members"])
    try:
        return kind(**data)
    except TypeError as error:
        raise RecordError(f"{kind.type} record: {error}: {line[:80]!r}") from None


def _range(item: Any, line: str) -> tuple[int, int, str]:
    if not (isinstance(item, list) and len(item) == 3):
        raise RecordError(f"a range must be [first, last, consumer], not {item!r}: {line[:80]!r}")
    return int(item[0]), int(item[1]), str(item[2])


def _role(item: Any, line: str) -> tuple[str, str, str]:
    """One ``(member, role, state)`` of a :class:`StoreRoles` line, or RecordError."""
    if not (isinstance(item, list) and len(item) == 3):
        raise RecordError(f"a store member must be [member, role, state], not {item!r}: {line[:80]!r}")
    return str(item[0]), str(item[1]), str(item[2])


def read_records(path: Path) -> Iterator[Record]:
    """The records of a JSON-lines file, in file order (blank lines skipped)."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    yield from_json(line)
                except RecordError as error:
                    raise RecordError(f"{path}:{number}: {error}") from None


class RecordWriter:
    """Appends records to a JSON-lines file; safe to call from several threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO = path.open("a", encoding="utf-8", buffering=1)  # each line through to the kernel
        self._lock = threading.Lock()

    def write(self, record: Record) -> None:
        """Append one record."""
        self.write_all((record,))

    def write_all(self, records: Iterable[Record]) -> None:
        """Append ``records`` in one write, so no other thread's record falls between them."""
        text = "".join(to_json(record) + "\n" for record in records)
        with self._lock:
            self._file.write(text)

    def close(self) -> None:
        """Close the file; a second call does nothing."""
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
