"""Pulsar's producer access modes on one topic (``TopicProducers``), without I/O: each rule, and random runs."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from keyfailover.broker.pulsar.PulsarApi_pb2 import (
    Exclusive,
    ExclusiveWithFencing,
    ProducerBusy,
    ProducerFenced,
    Shared,
    UnknownError,
    WaitForExclusive,
)
from keyfailover.broker.server._pulsar_access import TopicProducers


@dataclass(eq=False)
class P:
    """A producer: compared by identity, as the server's are."""

    name: str


def state(topic: TopicProducers[P]) -> tuple[int, P | None, dict[P, None], dict[P, int | None]]:
    """What ``topic`` holds, copied."""
    return topic.epoch, topic.exclusive, dict(topic.shared), dict(topic.waiting)


def test_shared_producers_share_until_an_exclusive_one_holds_the_topic() -> None:
    topic: TopicProducers[P] = TopicProducers()
    a, b, c = P("a"), P("b"), P("c")
    assert topic.add(a, Shared).granted and topic.add(b, Shared).granted
    refused = topic.add(c, Exclusive)
    assert (refused.granted, refused.error) == (False, ProducerFenced)
    assert "2 other producer(s) are open" in refused.message
    topic.remove(a)
    topic.remove(b)
    granted = topic.add(c, Exclusive)
    assert (granted.granted, granted.epoch) == (True, 1)
    busy = topic.add(a, Shared)
    assert (busy.granted, busy.error) == (False, ProducerBusy)
    assert "producer 'c' holds exclusive access" in busy.message
    assert topic.add(c, Exclusive).granted  # a repeated request is answered as the first
    assert topic.add(P("d"), 7).error == UnknownError


def test_a_waiting_producer_is_granted_when_the_last_producer_leaves() -> None:
    topic: TopicProducers[P] = TopicProducers()
    holder, first, second, shared = P("holder"), P("first"), P("second"), P("shared")
    assert topic.add(holder, Exclusive).epoch == 1
    assert topic.add(first, WaitForExclusive).queued and topic.add(second, WaitForExclusive).queued
    assert topic.add(shared, Shared).error == ProducerBusy  # producers wait for the topic
    promotion = topic.remove(holder)
    assert (promotion.granted, promotion.epoch) == (first, 2)
    topic.remove(second)  # a waiting producer that leaves is just forgotten
    assert topic.remove(first).granted is None
    assert (topic.exclusive, topic.shared, topic.waiting, topic.epoch) == (None, {}, {}, 2)


def test_fencing_closes_the_open_producers_and_refuses_the_waiting_ones() -> None:
    topic: TopicProducers[P] = TopicProducers()
    holder, waiting, fencer = P("holder"), P("waiting"), P("fencer")
    topic.add(holder, Exclusive)
    topic.add(waiting, WaitForExclusive)
    fenced = topic.add(fencer, ExclusiveWithFencing)
    assert (fenced.granted, fenced.epoch, fenced.closed, fenced.refused) == (True, 2, [holder], [waiting])
    assert topic.exclusive is fencer and not topic.waiting
    # The fenced producer's client reconnects with the epoch it had: refused, and nothing changes.
    before = state(topic)
    again = topic.add(holder, Exclusive, epoch=1)
    assert (again.granted, again.error) == (False, ProducerFenced)
    assert "the topic epoch is 2, past this producer's 1" in again.message
    assert state(topic) == before
    # The fencing producer's own reconnection keeps its epoch.
    topic.remove(fencer)
    assert topic.add(fencer, ExclusiveWithFencing, epoch=2).epoch == 2


def test_a_producer_with_a_stale_epoch_is_refused_at_once_or_when_its_turn_comes() -> None:
    topic: TopicProducers[P] = TopicProducers()
    holder, first, second, late = P("holder"), P("first"), P("second"), P("late")
    assert topic.add(holder, Exclusive).epoch == 1
    assert topic.add(late, WaitForExclusive, epoch=0).error == ProducerFenced  # it can never be granted
    assert topic.add(first, WaitForExclusive).queued
    assert topic.add(second, WaitForExclusive, epoch=1).queued  # the holder's epoch: not stale yet
    promotion = topic.remove(holder)
    assert (promotion.granted, promotion.epoch, promotion.refused) == (first, 2, [])
    promotion = topic.remove(first)  # the epoch moved past the second one's while it waited
    assert (promotion.granted, [producer for producer, _ in promotion.refused]) == (None, [second])
    assert not len(topic) and topic.epoch == 2


MODES = st.sampled_from([Shared, Exclusive, WaitForExclusive, ExclusiveWithFencing])


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), MODES, st.none() | st.integers(0, 4)), max_size=60))
def test_random_runs_keep_one_writer_and_a_rising_epoch(
    steps: list[tuple[bool, int, int, int | None]],
) -> None:
    """Whatever producers ask and leave: an exclusive holder is the only open producer, producers wait only
    while the topic is held, the epoch never falls, and a refused request changes nothing."""
    producers = [P(f"p{i}") for i in range(6)]
    topic: TopicProducers[P] = TopicProducers()
    for adding, index, mode, epoch in steps:
        producer = producers[index]
        before = state(topic)
        if adding:
            admission = topic.add(producer, mode, epoch)
            if not (admission.granted or admission.queued):
                assert state(topic) == before
            for gone in admission.closed + admission.refused:
                assert gone not in topic.shared and gone not in topic.waiting and gone is not topic.exclusive
        else:
            promotion = topic.remove(producer)
            assert promotion.granted is None or promotion.granted is topic.exclusive
        assert topic.exclusive is None or not topic.shared
        assert not topic.waiting or topic.exclusive is not None or topic.shared
        assert topic.epoch >= before[0]
