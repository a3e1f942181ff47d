"""A seeded fault schedule: which fault, on which target, when and for how long.

The nemesis of OpenMessaging-Chaos and Jepsen, planned ahead so the same seed gives the
same schedule (and the report can print it before the run): faults come one at a time,
each followed by a quiet spell, so every fault's effect and recovery can be told apart.

- ``kill``: SIGKILL, then a restart after the fault's length (on the store, half to twice Patroni's
  ``ttl``: longer than it two times in three, so Patroni must elect a new primary).
- ``suspend``: SIGSTOP, then SIGCONT after the fault's length (half to twice a session timeout:
  longer than it two times in three, so the cluster must fence the suspended broker and take over;
  on the store, half to twice Patroni's ``ttl``, for the same reason).
- ``loss``: the target's links lose and delay traffic for the fault's length.

Targets name roles, not processes: ``brokers`` and ``consumers`` pick one by index (the
harness takes it modulo how many run), ``coordinator`` is whichever broker coordinates when
the fault starts, ``zookeeper`` is the ZooKeeper server, ``store`` is whichever member of the
replicated store is its primary when the fault starts. After a fault on the store the quiet spell
is longer by ``store_ttl``: the group elects a new primary and takes its old one back as a standby
before the next fault.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from keyfailover.tools.chaos._proxy import FaultProxy

__all__ = ["DELAY", "FAULTS", "LOSS", "TARGETS", "PlannedFault", "ScheduleError", "heal", "lose", "plan_faults"]

FAULTS = ("kill", "suspend", "loss")
TARGETS = ("brokers", "consumers", "coordinator", "zookeeper", "store")

LOSS = 0.3
"""Share of TCP segments (proxy chunks) a loss fault loses on each of its links."""
DELAY = 0.05
"""Seconds a loss fault delays each chunk on its links, plus up to as much again of jitter."""


def lose(links: Iterable[FaultProxy]) -> None:
    """Start a loss fault on ``links``: :data:`LOSS` of the segments lost (resent after 200 ms, doubling),
    each delayed by :data:`DELAY` plus up to as much again."""
    for link in links:
        link.drop(LOSS, rto=0.2)
        link.delay(DELAY, jitter=DELAY)


def heal(links: Iterable[FaultProxy]) -> None:
    """End every fault on ``links``."""
    for link in links:
        link.clear()


class ScheduleError(ValueError):
    """The schedule's settings are not usable; the message says what was expected."""


@dataclass(frozen=True)
class PlannedFault:
    """One fault: ``kind`` on ``target`` (instance ``index`` of it) from ``at`` for ``length`` seconds."""

    at: float
    length: float
    kind: str
    target: str
    index: int

    def describe(self) -> str:
        """One line for the run's output: when, what, on which target, for how long."""
        who = f"{self.target}[{self.index}]" if self.target in ("brokers", "consumers") else self.target
        return f"t+{self.at:.1f}s {self.kind} {who} for {self.length:.1f}s"


def _choices(given: Sequence[str], known: tuple[str, ...], what: str) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(given))
    if not chosen:
        raise ScheduleError(f"no {what} given; expected some of {', '.join(known)}")
    if unknown := [name for name in chosen if name not in known]:
        raise ScheduleError(f"unknown {what} {', '.join(unknown)}; expected some of {', '.join(known)}")
    return chosen


def plan_faults(
    seed: int,
    duration: float,
    faults: Sequence[str] = FAULTS,
    targets: Sequence[str] = ("brokers", "consumers"),
    *,
    session_timeout: float = 2.0,
    warmup: float = 5.0,
    quiet: float = 5.0,
    longest: float = 10.0,
    store_ttl: float = 10.0,
) -> list[PlannedFault]:
    """The faults of a run of ``duration`` seconds, the same for the same arguments.

    Nothing happens in the first ``warmup`` seconds (traffic starts) nor the last ``quiet``
    (the cluster recovers before the run ends); after each fault heals, a quiet spell of
    ``quiet`` to twice that, and ``store_ttl`` more after a fault on the store. A fault lasts from
    1 s to ``longest``; a suspension from half to twice ``session_timeout``; a kill or a suspension of the
    store from half to twice ``store_ttl``.
    """
    kinds = _choices(faults, FAULTS, "faults")
    whom = _choices(targets, TARGETS, "targets")
    for name, value in (
        ("duration", duration),
        ("session_timeout", session_timeout),
        ("longest", longest),
        ("store_ttl", store_ttl),
    ):
        if not value > 0:
            raise ScheduleError(f"{name} must be a positive number of seconds, not {value!r}")
    for name, value in (("warmup", warmup), ("quiet", quiet)):
        if not value >= 0:
            raise ScheduleError(f"{name} must be a number of seconds >= 0, not {value!r}")
    if longest < 1.0:
        raise ScheduleError(f"longest must be at least 1 s, not {longest!r}")
    rng = random.Random(seed)
    planned: list[PlannedFault] = []
    at = warmup
    while True:
        kind = rng.choice(kinds)
        target = rng.choice(whom)
        index = rng.randrange(1 << 16)
        if target == "store" and kind in ("kill", "suspend"):
            length = rng.uniform(store_ttl / 2.0, store_ttl * 2.0)
        elif kind == "suspend":
            length = rng.uniform(session_timeout / 2.0, session_timeout * 2.0)
        else:
            length = rng.uniform(1.0, longest)
        if at + length + quiet > duration:
            return planned
        planned.append(PlannedFault(round(at, 3), round(length, 3), kind, target, index))
        at += length + (rng.uniform(quiet, 2.0 * quiet) if quiet else 0.0) + (store_ttl if target == "store" else 0.0)
