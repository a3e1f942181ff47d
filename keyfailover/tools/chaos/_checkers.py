"""The checkers of a chaos run: pure functions from its records to a verdict.

Each takes the run's records (any order; see :mod:`._records`) and returns a :class:`Verdict`:
whether the invariant held, how many violations, a few examples as sentences, and measures.
Nothing here reads a clock or a file, so each checker is tested on hand-made histories that
pass and that fail (tests/test_chaos_checkers.py).

- :func:`lost`: a send the broker confirmed that no consumer was ever handed and no
  dead-letter topic holds.
- :func:`duplicated`: deliveries beyond the first of a message, and messages stored twice
  (counted, never failed: keyfailover delivers at least once).
- :func:`order`: OpenMessaging-Chaos's OrderChecker: per key, the confirmed sends, in send
  order, are a subsequence of what consumers were handed, in the order they were handed it
  (redeliveries may repeat a message; none may come before an earlier one of its key was
  handed first).
- :func:`two_owners`: two brokers serving one partition at once.
- :func:`held_twice`: a consumer handed a key's message while another still held one of
  that key unacknowledged. A holding runs from the delivery to the ack that the broker
  confirmed; one it refused (the lease expired) or never answered is not counted (the broker
  had taken the message back, or nobody can tell when the holding ended).
- :func:`unowned_partitions`, :func:`unowned_ranges`: the longest time a partition had no
  broker, or a slot of a served partition no consumer, once it first had one; failed over ``limit``.
- :func:`unanswered`: a send its producer never got an answer for (no receipt, no error) by
  the end of the run: a producer stalled on a partition. The producer is never a fault target,
  so every send is answered, stored or refused, once the brokers have settled.
- :func:`dead_letter_accounting`: every confirmed send was acknowledged or dead-lettered by
  the end of the run. An ack that got no answer counts as acknowledged once its consumer was
  killed after sending it, or a lease's time had passed since (:func:`settled_unanswered`): had
  the broker not settled it, the message would have come again by then.
- :func:`writes_resumed`: after each fault on the replicated store, every partition stored a send
  made after the fault began within a bound: Patroni's ``ttl`` plus :data:`RESUME_MARGIN`, plus
  the fault's own length for a suspension or a loss (the primary is back, or its links healed, only
  then). :func:`store_failovers` measures each fault for the report.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from keyfailover.core.partitions import partition_slots
from keyfailover.tools.chaos._records import (
    STORE,
    UNANSWERED,
    Acked,
    DeadLettered,
    Delivered,
    Fault,
    Produced,
    RangeMap,
    Record,
    Served,
    on_store,
)

__all__ = [
    "RESUME_MARGIN",
    "StoreFailover",
    "Verdict",
    "acknowledgements",
    "check_all",
    "dead_letter_accounting",
    "duplicated",
    "gaps",
    "held_twice",
    "lost",
    "order",
    "settled_unanswered",
    "store_failovers",
    "two_owners",
    "unanswered",
    "unowned_partitions",
    "unowned_ranges",
    "writes_resumed",
    "zookeeper_outages",
]

EXAMPLES = 5
"""Violations named in a verdict; the count has them all."""


@dataclass(frozen=True)
class Verdict:
    """One checker's result: ``passed`` is False exactly when it found a violation."""

    checker: str
    passed: bool
    violations: int
    examples: tuple[str, ...] = ()
    measures: Mapping[str, float] = field(default_factory=dict)

    def line(self) -> str:
        """One line for a terminal or report: verdict, checker, violations, measures."""
        state = "PASS" if self.passed else "FAIL"
        measured = ", ".join(f"{name} {_number(value)}" for name, value in self.measures.items())
        return f"[{state}] {self.checker}: {self.violations} violation(s)" + (f"; {measured}" if measured else "")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3f}"


def _verdict(checker: str, problems: Sequence[str], measures: Mapping[str, float], fails: bool = True) -> Verdict:
    """A checker that ``fails`` counts its problems as violations; one that only counts shows them as notes."""
    violations = len(problems) if fails else 0
    return Verdict(checker, not violations, violations, tuple(problems[:EXAMPLES]), dict(measures))


R = TypeVar("R", bound=Record)


def _of(records: Iterable[Record], kind: type[R]) -> list[R]:
    return [record for record in records if isinstance(record, kind)]


def _confirmed_sends(records: Sequence[Record]) -> set[tuple[str, int]]:
    return {(p.key, p.value) for p in _of(records, Produced) if p.ok}


def lost(records: Sequence[Record]) -> Verdict:
    """Confirmed sends that were never delivered and are in no dead-letter topic."""
    sent = _confirmed_sends(records)
    reached = {(d.key, d.value) for d in _of(records, Delivered)}
    reached |= {(d.key, d.value) for d in _of(records, DeadLettered)}
    missing = sorted(sent - reached)
    problems = [f"key {key}: value {value} was confirmed to its producer and never delivered" for key, value in missing]
    return _verdict("lost", problems, {"confirmed sends": len(sent), "lost": len(missing)})


def unanswered(records: Sequence[Record]) -> Verdict:
    """Sends their producer got neither a receipt nor an error for by the end of the run."""
    sends = _of(records, Produced)
    waiting = sorted((p.key, p.value) for p in sends if p.error == UNANSWERED)
    problems = [f"key {key}: value {value} was sent and never answered" for key, value in waiting]
    return _verdict("unanswered", problems, {"sends": len(sends), "unanswered": len(waiting)})


def duplicated(records: Sequence[Record]) -> Verdict:
    """Deliveries of a message after its first (redelivered or not), and messages stored at two positions."""
    deliveries: dict[tuple[str, int], list[Delivered]] = defaultdict(list)
    for delivered in _of(records, Delivered):
        deliveries[(delivered.key, delivered.value)].append(delivered)
    again = counted = 0
    problems = []
    stored_twice = 0
    for (key, value), each in sorted(deliveries.items()):
        later = sorted(each, key=lambda d: d.t)[1:]
        again += len(later)
        counted += sum(1 for d in later if d.redelivery > 0)
        positions = {(d.partition, d.position) for d in each}
        if len(positions) > 1:
            stored_twice += 1
            problems.append(f"key {key}: value {value} stored at {len(positions)} positions {sorted(positions)}")
    problems += [f"{again - counted} deliveries after the first carried redelivery count 0"] if again > counted else []
    measures = {"delivered again": again, "with a redelivery count": counted, "stored twice": stored_twice}
    return _verdict("duplicated", problems, measures, fails=False)


def order(records: Sequence[Record]) -> Verdict:
    """Per key, the confirmed sends in send order must be a subsequence of the delivery order, and no
    message may be handed out for the first time before an earlier one of its key was (G2: a key's
    messages are stored in send order and dispatched in that order; only redeliveries repeat)."""
    sent: dict[str, list[int]] = defaultdict(list)
    for produced in _of(records, Produced):
        if produced.ok:
            sent[produced.key].append(produced.value)
    handed: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for delivered in _of(records, Delivered):
        handed[delivered.key].append((delivered.t, delivered.value))
    problems = []
    for key in sorted(sent):
        seen = [value for _, value in sorted(handed.get(key, []))]
        present = set(seen)
        expected = [value for value in sorted(sent[key]) if value in present]  # the lost are lost's to report
        at = 0
        for value in seen:
            if at < len(expected) and value == expected[at]:
                at += 1
        firsts = list(dict.fromkeys(seen))  # each value at its first delivery
        ahead = next(((a, b) for a, b in itertools.pairwise(firsts) if b < a), None)
        if at < len(expected):
            before = expected[at - 1] if at else None
            problems.append(
                f"key {key}: value {expected[at]} was not delivered after "
                + (f"value {before}" if before is not None else "the key's first delivery")
                + f" (deliveries in order: {_short(seen)})"
            )
        elif ahead is not None:
            problems.append(
                f"key {key}: value {ahead[0]} was handed out before value {ahead[1]} ever was"
                f" (deliveries in order: {_short(seen)})"
            )
    return _verdict("order", problems, {"keys": len(sent), "keys out of order": len(problems)})


def _short(values: Sequence[int], most: int = 12) -> str:
    shown = ", ".join(map(str, values[:most]))
    return shown + (f", ... ({len(values)} in all)" if len(values) > most else "")


def _end_of(records: Sequence[Record], end: float | None) -> float:
    return end if end is not None else max((record.t for record in records), default=0.0)


def two_owners(records: Sequence[Record], end: float | None = None) -> Verdict:
    """Intervals in which two brokers served one partition; ``end`` closes open intervals (default: the last record)."""
    stop = _end_of(records, end)
    by_partition: dict[int, list[tuple[float, float, str, int]]] = defaultdict(list)
    for served in _of(records, Served):
        until = stop if served.until is None else served.until
        if until > served.t:
            by_partition[served.partition].append((served.t, until, served.broker, served.epoch))
    problems = []
    longest = 0.0
    for partition, intervals in sorted(by_partition.items()):
        intervals.sort()
        for i, (_, until, broker, epoch) in enumerate(intervals):
            for other_start, other_until, other, other_epoch in intervals[i + 1 :]:
                if other_start >= until:
                    break
                if other != broker:
                    overlap = min(until, other_until) - other_start
                    longest = max(longest, overlap)
                    problems.append(
                        f"partition {partition}: {broker} (epoch {epoch}) and {other} (epoch {other_epoch}) "
                        f"both served it for {overlap:.3f} s from t={other_start:.3f}"
                    )
    return _verdict("two owners", problems, {"partitions": len(by_partition), "longest overlap s": longest})


def held_twice(records: Sequence[Record]) -> Verdict:
    """A consumer handed a key's message while another held one of that key, by confirmed acks."""
    delivered_at: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for delivered in _of(records, Delivered):
        delivered_at[(delivered.consumer, delivered.key, delivered.value)].append(delivered.t)
    holdings: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for acked in _of(records, Acked):
        times = sorted(delivered_at.get((acked.consumer, acked.key, acked.value), []))
        at = bisect.bisect_right(times, acked.t)
        if acked.confirmed is True and at:
            holdings[acked.key].append((times[at - 1], acked.t, acked.consumer))
    problems = []
    for key, held in sorted(holdings.items()):
        until: dict[str, float] = {}  # each consumer's latest confirmed ack of the key so far
        for start, stop, consumer in sorted(held):
            for other, other_until in sorted(until.items()):
                if other != consumer and other_until > start:
                    problems.append(
                        f"key {key}: {consumer} was handed it at t={start:.3f}"
                        f" while {other} held it until t={other_until:.3f}"
                    )
            until[consumer] = max(until.get(consumer, -math.inf), stop)
    measures = {"holdings": sum(map(len, holdings.values())), "keys": len(holdings)}
    return _verdict("held twice", problems, measures)


def zookeeper_outages(records: Sequence[Record]) -> list[tuple[float, float]]:
    """The windows in which a fault was on ZooKeeper (from each fault's start to its end)."""
    faults = sorted((f for f in _of(records, Fault) if f.target == "zookeeper"), key=lambda f: f.t)
    windows, began = [], None
    for fault in faults:
        if fault.action == "start":
            began = fault.t
        elif began is not None:
            windows.append((began, fault.t))
            began = None
    if began is not None:
        windows.append((began, math.inf))
    return windows


def _outside(start: float, stop: float, outages: Sequence[tuple[float, float]]) -> float:
    """The length of ``[start, stop]`` outside every outage window."""
    inside = sum(max(0.0, min(stop, high) - max(start, low)) for low, high in outages)
    return max(stop - start - inside, 0.0)


def gaps(intervals: Sequence[tuple[float, float]], stop: float) -> list[tuple[float, float]]:
    """The stretches after the first interval's start, up to ``stop``, that no interval covers."""
    if not intervals:
        return []
    ordered = sorted(intervals)
    covered = ordered[0][1]
    found = []
    for start, until in ordered[1:]:
        if start > covered:
            found.append((covered, start))
        covered = max(covered, until)
    if stop > covered:
        found.append((covered, stop))
    return found


def unowned_partitions(records: Sequence[Record], limit: float, end: float | None = None) -> Verdict:
    """The longest time each partition had no broker after it first had one, not counting the time a fault
    was on ZooKeeper (no broker can take a partition over then); failed over ``limit`` seconds."""
    stop = _end_of(records, end)
    outages = zookeeper_outages(records)
    by_partition: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for served in _of(records, Served):
        by_partition[served.partition].append((served.t, stop if served.until is None else served.until))
    problems = []
    longest = raw = 0.0
    for partition, intervals in sorted(by_partition.items()):
        for start, until in gaps(intervals, stop):
            counted = _outside(start, until, outages)
            longest, raw = max(longest, counted), max(raw, until - start)
            if counted > limit:
                problems.append(
                    f"partition {partition} had no broker for {counted:.3f} s from t={start:.3f} (limit {limit} s)"
                )
    measures = {"longest s": longest, "limit s": limit}
    if outages:
        measures["longest with ZooKeeper faulted s"] = raw
    return _verdict("unowned partitions", problems, measures)


def unowned_ranges(records: Sequence[Record], partitions: int, limit: float, end: float | None = None) -> Verdict:
    """The longest time a slot had no consumer after it first had one, not counting the time a fault was on
    ZooKeeper; failed over ``limit`` seconds.

    A slot is owned while a broker serves its partition and that broker's latest range map of it
    gives the slot to a consumer (a map with no broker named counts for whichever broker serves):
    the map of a broker that no longer serves the partition, a paused zombie's, say, owns nothing.
    Only the slots of a partition's block count (partition p of ``partitions`` holds the slots
    :func:`~keyfailover.core.partitions.partition_slots` says).
    """
    stop = _end_of(records, end)
    served: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    for record in _of(records, Served):
        served[record.partition].append((record.t, stop if record.until is None else record.until, record.broker))
    maps: dict[int, list[RangeMap]] = defaultdict(list)
    for snapshot in _of(records, RangeMap):
        maps[snapshot.partition].append(snapshot)
    outages = zookeeper_outages(records)
    problems = []
    longest = 0.0
    for partition in range(partitions):
        first, last = partition_slots(partition, partitions)
        found = _longest_unowned(first, last, served.get(partition, []), maps.get(partition, []), stop, outages=outages)
        gap, slot, at = found
        longest = max(longest, gap)
        if gap > limit:
            problems.append(
                f"partition {partition}: slot {slot} had no consumer for {gap:.3f} s from t={at:.3f} (limit {limit} s)"
            )
    return _verdict("unowned ranges", problems, {"longest s": longest, "limit s": limit})


def _longest_unowned(
    first: int,
    last: int,
    served: list[tuple[float, float, str]],
    maps: list[RangeMap],
    stop: float,
    *,
    outages: Sequence[tuple[float, float]] = (),
) -> tuple[float, int, float]:
    """Over the block ``[first, last]``: the longest unowned stretch of any slot (not counting ``outages``),
    the slot, and its start. ``served``: ``(start, until, broker)`` intervals."""
    width = last - first + 1
    changes: list[tuple[float, int, RangeMap | tuple[str, int]]] = []
    for start, until, broker in served:
        changes += [(start, 1, (broker, 1)), (until, 0, (broker, -1))]  # at one instant, an end before a start
    changes += [(snapshot.t, 2, snapshot) for snapshot in maps]
    changes.sort(key=lambda change: (change[0], change[1]))
    serving: dict[str, int] = defaultdict(int)
    coverage: dict[str, np.ndarray] = {}  # each broker's latest map ("": whichever serves)
    nothing = np.zeros(width, dtype=bool)
    since = np.full(width, np.nan)  # when each slot last lost its owner; NaN while owned or never owned
    ever = np.zeros(width, dtype=bool)
    best = (0.0, first, 0.0)

    def settle(now: float, owned: np.ndarray) -> None:
        nonlocal best
        ending = owned & ~np.isnan(since)
        if ending.any():
            began = since[ending]
            spans = now - began
            for low, high in outages:
                spans -= np.clip(np.minimum(now, high) - np.maximum(began, low), 0.0, None)
            top = int(np.argmax(spans))
            if spans[top] > best[0]:
                index = int(np.flatnonzero(ending)[top])
                best = (float(spans[top]), first + index, float(since[index]))
            since[ending] = np.nan
        starting = ~owned & ever & np.isnan(since)
        since[starting] = now
        ever[owned] = True

    def owned() -> np.ndarray:
        brokers = [broker for broker, count in serving.items() if count > 0]
        result = coverage.get("", nothing) if brokers else nothing
        for broker in brokers:
            result = result | coverage.get(broker, nothing)
        return result

    for now, _, change in changes:
        if isinstance(change, RangeMap):
            covered = np.zeros(width, dtype=bool)
            for start, stop_slot, _consumer in change.ranges:
                low, high = max(start, first), min(stop_slot, last)
                if low <= high:
                    covered[low - first : high - first + 1] = True
            coverage[change.broker] = covered
        else:
            broker, step = change
            serving[broker] += step
        settle(now, owned())
    settle(stop, np.ones(width, dtype=bool))
    return best


SETTLE_MARGIN = 1.0
"""Seconds past an ack timeout after which an unanswered ack counts as settled (the broker's poll may lag)."""


def settled_unanswered(records: Sequence[Record], now: float, ack_timeout: float) -> set[tuple[str, int]]:
    """The messages an ack of which went out and was never answered, that count as settled by ``now``:
    its consumer was killed after sending it, or ``ack_timeout`` (plus :data:`SETTLE_MARGIN`) had passed
    since it was sent. The chaos harness's drain and :func:`dead_letter_accounting` both use it."""
    kills: dict[str, list[float]] = defaultdict(list)
    for fault in _of(records, Fault):
        if fault.kind == "kill" and fault.action == "start":
            kills[fault.target].append(fault.t)
    settled_by = now - ack_timeout - SETTLE_MARGIN
    return {
        (ack.key, ack.value)
        for ack in _of(records, Acked)
        if ack.confirmed is None and (ack.t < settled_by or any(killed > ack.t for killed in kills[ack.consumer]))
    }


def acknowledgements(records: Sequence[Record]) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
    """``(acked, unknown)``: the messages an ack of which the broker confirmed, and those not acked so whose
    last ack went out and was never answered (its consumer was killed waiting, or it is still on its way).

    Each ack attempt is recorded as sent (``confirmed`` None) and then with its answer, both at the
    time it was sent: the answer wins.
    """
    outcomes: dict[tuple[str, str, int, float], bool | None] = {}
    for ack in _of(records, Acked):
        attempt = (ack.consumer, ack.key, ack.value, ack.t)
        if ack.confirmed is not None or attempt not in outcomes:
            outcomes[attempt] = ack.confirmed
    acked = {(key, value) for (_, key, value, _), outcome in outcomes.items() if outcome is True}
    unknown = {(key, value) for (_, key, value, _), outcome in outcomes.items() if outcome is None} - acked
    return acked, unknown


def dead_letter_accounting(records: Sequence[Record], ack_timeout: float, end: float | None = None) -> Verdict:
    """Every confirmed send ends acknowledged (an ack the broker confirmed, or one never answered that
    :func:`settled_unanswered` counts by ``end``) or in a dead-letter topic."""
    sent = _confirmed_sends(records)
    acked, unknown = acknowledgements(records)
    unknown &= settled_unanswered(records, _end_of(records, end), ack_timeout)
    buried = {(d.key, d.value) for d in _of(records, DeadLettered)}
    open_ = sorted(sent - acked - unknown - buried)
    problems = [f"key {key}: value {value} was neither acknowledged nor dead-lettered" for key, value in open_]
    measures = {
        "acknowledged": len(sent & acked),
        "ack outcome unknown": len(sent & unknown),
        "dead-lettered": len(sent & buried),
        "both": len(acked & buried),
    }
    return _verdict("dead-letter accounting", problems, measures)


RESUME_MARGIN = 5.0
"""Seconds past Patroni's ``ttl`` within which writes must resume after a fault on the store: the time
for the brokers to notice the new primary and reconnect to it, and for the producer to resend."""


@dataclass(frozen=True)
class StoreFailover:
    """A fault on the replicated store and how long every partition took to store a send made after it began."""

    t: float
    kind: str
    member: str
    length: float
    """From the fault's start to its end (the restart of a killed member, SIGCONT, the links healed)."""
    bound: float
    first: float | None
    """From the fault's start to the first receipt of a send made after it, on any partition."""
    resumed: float | None
    """From the fault's start to the moment every partition had one: the slowest partition's first."""
    waiting: tuple[int, ...]
    """Partitions that stored no send made after the fault's start by the end of the run."""

    def describe(self) -> str:
        """One line naming the fault, the member it hit and when."""
        return f"{self.kind} {STORE}:{self.member} at t={self.t:.3f} for {self.length:.1f} s"


def store_failovers(records: Sequence[Record], ttl: float, end: float | None = None) -> list[StoreFailover]:
    """Each fault on the store with the time writes took to resume on each partition after it began.

    A partition's writes resumed at the first receipt of a send made at or after the fault's start (a
    receipt right after it could be of a write committed before). The partitions are those the run
    stored anything on. The bound is ``ttl`` + :data:`RESUME_MARGIN`, plus the fault's length for a
    ``suspend`` or a ``loss``; a fault with no end on record lasts until ``end``.
    """
    stop = _end_of(records, end)
    by_partition: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for produced in _of(records, Produced):
        if produced.ok and produced.partition is not None and produced.sent is not None:
            by_partition[produced.partition].append((produced.sent, produced.t))
    sends: dict[int, tuple[list[float], list[float]]] = {}
    for partition, pairs in by_partition.items():
        pairs.sort()
        earliest = list(itertools.accumulate((t for _, t in reversed(pairs)), min))[::-1]  # receipt, from here on
        sends[partition] = ([sent for sent, _ in pairs], earliest)
    faults = sorted((fault for fault in _of(records, Fault) if on_store(fault)), key=lambda fault: fault.t)
    found = []
    for start in (fault for fault in faults if fault.action == "start"):
        healed = next((f.t for f in faults if f.target == start.target and f.action == "end" and f.t >= start.t), stop)
        length = healed - start.t
        bound = ttl + RESUME_MARGIN + (length if start.kind in ("suspend", "loss") else 0.0)
        firsts: dict[int, float] = {}
        for partition, (sent, earliest) in sends.items():
            at = bisect.bisect_left(sent, start.t)
            if at < len(sent):
                firsts[partition] = earliest[at] - start.t
        waiting = tuple(sorted(set(sends) - set(firsts)))
        found.append(
            StoreFailover(
                t=start.t,
                kind=start.kind,
                member=start.target.split(":", 1)[1],
                length=length,
                bound=bound,
                first=min(firsts.values(), default=None),
                resumed=None if waiting or not firsts else max(firsts.values()),
                waiting=waiting,
            )
        )
    return found


def writes_resumed(records: Sequence[Record], ttl: float, end: float | None = None) -> Verdict:
    """After each fault on the store, every partition stored a send made after it began within the bound
    :func:`store_failovers` gives; failed when one took longer or never did."""
    failovers = store_failovers(records, ttl, end)
    problems = []
    for failover in failovers:
        if failover.waiting:
            problems.append(
                f"{failover.describe()}: partitions {', '.join(map(str, failover.waiting))} stored no send made "
                "after it by the end of the run"
            )
        elif failover.resumed is not None and failover.resumed > failover.bound:
            problems.append(
                f"{failover.describe()}: writes resumed on every partition only after {failover.resumed:.3f} s "
                f"(bound {failover.bound:.1f} s)"
            )
    measures = {
        "store faults": len(failovers),
        "longest s": max((f.resumed for f in failovers if f.resumed is not None), default=0.0),
        "bound s (+ the fault's length for suspend, loss)": ttl + RESUME_MARGIN,
    }
    return _verdict("writes resumed", problems, measures)


def check_all(
    records: Sequence[Record],
    partitions: int,
    unowned_limit: float,
    ack_timeout: float,
    end: float | None = None,
    *,
    store_ttl: float | None = None,
) -> list[Verdict]:
    """Every checker over one run's records, in report order; ``end``: the run's end (default: the last record).

    With ``store_ttl``, Patroni's ``ttl`` of a run with a replicated store, :func:`writes_resumed` too.
    """
    end = _end_of(records, end)
    return [
        lost(records),
        unanswered(records),
        duplicated(records),
        order(records),
        two_owners(records, end),
        held_twice(records),
        unowned_partitions(records, unowned_limit, end),
        unowned_ranges(records, partitions, unowned_limit, end),
        dead_letter_accounting(records, ack_timeout, end),
        *([writes_resumed(records, store_ttl, end)] if store_ttl is not None else []),
    ]
