"""Pulsar's producer access modes on one topic or partition, as a state machine without I/O.

A Pulsar producer asks for one of four access modes (PIP-68, enforced by the broker):

- ``Shared`` (the default): any number of producers; refused with ``ProducerBusy`` while an exclusive
  producer holds the topic or one waits for it.
- ``Exclusive``: the only producer; refused with ``ProducerFenced`` while any other producer is open or
  waiting.
- ``WaitForExclusive``: queued behind the producers open now (the client is answered "not ready yet"),
  and granted, in arrival order, once the topic has no producer left.
- ``ExclusiveWithFencing``: granted at once; every producer open or waiting is fenced out: the open ones
  are closed (their later sends fail), the waiting ones refused with ``ProducerFenced``.

Each exclusive grant raises the topic epoch by one. A client keeps the epoch it was granted and sends it
again when it reconnects: an epoch below the topic's means another exclusive producer took over in
between, and the reconnection is refused with ``ProducerFenced``, which the client treats as final. That
is how a fenced producer stays fenced. A reconnecting producer's own epoch is kept, as Pulsar keeps it.

The one difference from Apache Pulsar's broker: a waiting producer is granted when the last producer of
any mode leaves, where Pulsar promotes one only when an exclusive producer leaves (there, one waiting
behind shared producers waits until an exclusive producer came and went).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Generic, Protocol, TypeVar

from keyfailover.broker.pulsar.PulsarApi_pb2 import (
    Exclusive,
    ExclusiveWithFencing,
    ProducerBusy,
    ProducerFenced,
    Shared,
    UnknownError,
    WaitForExclusive,
)

__all__ = ["ACCESS_MODES", "Admission", "ProducerHandle", "Promotion", "TopicProducers"]


class _Named(Protocol):
    """A producer as this module sees it: hashable, with a name that refusals cite."""

    @property
    def name(self) -> str: ...

    def __hash__(self) -> int: ...


class ProducerHandle(_Named, Protocol):
    """A producer as a server's connections keep it in its topic's access modes: told what befalls it."""

    def fenced(self) -> None:
        """It was open and an ExclusiveWithFencing producer fenced it out: close it."""

    def refused(self, why: str) -> None:
        """It waited for exclusive access and can have it no more: refuse its request with ``ProducerFenced``."""

    def granted(self, epoch: int) -> None:
        """It waited for exclusive access and has it now, with the topic ``epoch``: answer its request."""


_H = TypeVar("_H", bound=_Named)

ACCESS_MODES: Final = {
    Shared: "Shared",
    Exclusive: "Exclusive",
    WaitForExclusive: "WaitForExclusive",
    ExclusiveWithFencing: "ExclusiveWithFencing",
}
"""The access modes served, by their number in ``CommandProducer.producer_access_mode``."""


@dataclass
class Admission(Generic[_H]):
    """What a producer's request for access gives: granted (with the topic epoch for an exclusive one),
    queued, or refused with a ServerError and why; and the producers it fenced out."""

    granted: bool
    queued: bool = False
    epoch: int | None = None
    """The topic epoch an exclusive producer was granted; None for a shared one."""
    error: int = UnknownError
    message: str = ""
    closed: list[_H] = field(default_factory=list)
    """Producers that were open and are fenced out: their client is told the producer closed."""
    refused: list[_H] = field(default_factory=list)
    """Producers that were waiting and are fenced out: their request is refused with ``ProducerFenced``."""


@dataclass
class Promotion(Generic[_H]):
    """What a producer leaving gives: the waiting producer granted exclusive access and its epoch (None: none
    is), and the waiting ones refused on the way, each with why (their epoch is stale)."""

    granted: _H | None = None
    epoch: int = 0
    refused: list[tuple[_H, str]] = field(default_factory=list)


@dataclass
class TopicProducers(Generic[_H]):
    """The producers of one topic or partition and its epoch. A refused request changes nothing."""

    epoch: int = 0
    """The topic epoch: raised by each exclusive grant of a new producer."""
    exclusive: _H | None = None
    """The producer holding exclusive access, if one does."""
    shared: dict[_H, None] = field(default_factory=dict)
    """The shared producers open, in arrival order."""
    waiting: dict[_H, int | None] = field(default_factory=dict)
    """The WaitForExclusive producers queued, in arrival order, with the epoch each had (None: new)."""

    def __len__(self) -> int:
        """How many producers are open or waiting."""
        return len(self.shared) + len(self.waiting) + (self.exclusive is not None)

    def add(self, producer: _H, mode: int, epoch: int | None = None) -> Admission[_H]:
        """Admit ``producer`` in access ``mode``; ``epoch`` is the topic epoch its client was granted before, None
        for a new producer. A producer admitted or queued already is answered as it was."""
        if producer in self.shared:
            return Admission(True)
        if producer == self.exclusive:
            return Admission(True, epoch=self.epoch)
        if producer in self.waiting:
            return Admission(False, queued=True)
        if mode not in ACCESS_MODES:
            modes = ", ".join(f"{name} ({number})" for number, name in ACCESS_MODES.items())
            return Admission(False, error=UnknownError, message=f"producer access mode {mode} is not one of {modes}")
        holder = "" if self.exclusive is None else f"producer {self.exclusive.name!r:.80} holds exclusive access"
        if mode == Shared:
            if holder or self.waiting:
                reason = holder or f"{len(self.waiting)} producer(s) wait for exclusive access"
                return Admission(False, error=ProducerBusy, message=f"{reason}; expected none for a Shared producer")
            self.shared[producer] = None
            return Admission(True)
        stale = self._stale(epoch)
        if stale:  # whatever else holds the topic: the producer can never be granted again
            return Admission(False, error=ProducerFenced, message=stale)
        if mode == Exclusive and (holder or self.shared or self.waiting):
            reason = holder or f"{len(self.shared) + len(self.waiting)} other producer(s) are open or waiting"
            return Admission(False, error=ProducerFenced, message=f"{reason}; expected none for an Exclusive producer")
        if mode == WaitForExclusive and (holder or self.shared):
            self.waiting[producer] = epoch
            return Admission(False, queued=True)
        closed: list[_H] = []
        refused: list[_H] = []
        if mode == ExclusiveWithFencing:
            closed = [*self.shared, *([] if self.exclusive is None else [self.exclusive])]
            refused = list(self.waiting)
            self.shared.clear()
            self.waiting.clear()
        self._grant(producer, epoch)
        return Admission(True, epoch=self.epoch, closed=closed, refused=refused)

    def remove(self, producer: _H) -> Promotion[_H]:
        """Forget ``producer`` (closed, or its connection gone); once the topic has no producer open, the first
        waiting one whose epoch is not stale is granted exclusive access (the stale ones before it refused)."""
        if producer in self.waiting:
            del self.waiting[producer]
            return Promotion()
        if producer == self.exclusive:
            self.exclusive = None
        else:
            self.shared.pop(producer, None)
        promotion: Promotion[_H] = Promotion()
        if self.exclusive is not None or self.shared:
            return promotion
        while self.waiting:
            waiting = next(iter(self.waiting))
            epoch = self.waiting.pop(waiting)
            stale = self._stale(epoch)
            if stale:
                promotion.refused.append((waiting, stale))
                continue
            self._grant(waiting, epoch)
            promotion.granted, promotion.epoch = waiting, self.epoch
            break
        return promotion

    def _grant(self, producer: _H, epoch: int | None) -> None:
        """Make ``producer`` the exclusive one: a reconnecting one keeps its epoch, a new one raises the topic's."""
        self.exclusive = producer
        self.epoch = self.epoch + 1 if epoch is None else epoch

    def _stale(self, epoch: int | None) -> str:
        """Why a producer that had ``epoch`` is fenced out (another exclusive producer came in between), or ''."""
        if epoch is None or epoch >= self.epoch:
            return ""
        return (
            f"the topic epoch is {self.epoch}, past this producer's {epoch}: another exclusive producer took over; "
            "expected a new producer"
        )
