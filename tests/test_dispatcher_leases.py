"""Leases (ack deadlines), stuck consumers and dead letters in the dispatcher core (G7).

The property machine in test_dispatcher_properties.py runs these in a random event mix;
here each rule is pinned down on a small example with a manual clock.
"""

from __future__ import annotations

import pytest

from keyfailover import DeadLetter, Delivery, Dispatcher, LeaseExpiredError, NotInFlightError, key_hash
from keyfailover.core.clock import ManualClock
from keyfailover.core.errors import ConfigError, PositionError

TIMEOUT = 10.0


def two_consumers(**options: object) -> tuple[Dispatcher, ManualClock]:
    clock = ManualClock(100.0)
    d = Dispatcher(clock=clock, ack_timeout=TIMEOUT, **options)  # type: ignore[arg-type]
    for name in ("a", "b"):
        d.add_consumer(name)
        d.flow(name, 1000)
    return d, clock


def keys_of(d: Dispatcher, consumer: str, count: int = 3) -> list[str]:
    """``count`` keys that ``consumer`` owns now."""
    found = [f"key-{i}" for i in range(1000) if d.owner_of(f"key-{i}") == consumer]
    return found[:count]


def by_consumer(out: list[Delivery], consumer: str) -> list[tuple[int, str | bytes | None]]:
    return [(x.position, x.key) for x in out if x.consumer == consumer]


def test_an_expired_lease_takes_the_stuck_consumers_keys_to_the_others_in_order() -> None:
    d, clock = two_consumers()
    stuck_keys = keys_of(d, "a")
    for position, key in enumerate(stuck_keys * 2):  # two messages per key
        d.publish(position, key)
    first = d.poll()
    assert {x.consumer for x in first} == {"a"}
    assert d.next_deadline() == 100.0 + TIMEOUT
    assert d.stats()["consumers"]["a"]["lease_ends_in"] == pytest.approx(TIMEOUT)
    assert d.stats()["consumers"]["b"]["lease_ends_in"] is None  # nothing in flight
    clock.advance(TIMEOUT - 0.001)
    assert d.poll() == []  # not due yet
    assert not d.stats()["consumers"]["a"]["stuck"]
    assert d.stats()["consumers"]["a"]["lease_ends_in"] == pytest.approx(0.001)
    clock.advance(0.001)
    again = d.poll()
    # Every delivery came back (each key's later ones with it) and went to b, in position order.
    assert [(x.consumer, x.position, x.redelivery_count) for x in again] == [("b", p, 1) for p in range(6)]
    stats = d.stats()
    assert stats["consumers"]["a"]["stuck"] is True
    assert stats["consumers"]["a"]["ranges"] == [] and d.ranges() == [(0, 65535, "b")]
    assert stats["consumers"]["a"]["expired"] == 6 and stats["expired_leases"] == 6
    assert stats["rebalances"] == {"join": 2, "stuck": 1}
    d._audit()


def test_a_late_ack_is_refused_as_late_and_changes_nothing() -> None:
    d, clock = two_consumers()
    (key,) = keys_of(d, "a", 1)
    d.publish(1, key)
    d.poll()
    clock.advance(TIMEOUT)
    d.poll()
    assert d.lease_expired("a", 1)
    before = (d.ranges(), d.stats())
    with pytest.raises(LeaseExpiredError, match=r"lease expired .*\(ack_timeout 10 s\)"):
        d.ack("a", 1)
    with pytest.raises(NotInFlightError):  # a LeaseExpiredError is a NotInFlightError
        d.nack("a", 1)
    assert (d.ranges(), d.stats()) == before
    assert d.ack_many("a", [1]) == ([], [1])
    assert d.extend("a", [1]) == ([], [1])
    assert (d.ranges(), d.stats()) == before
    d.ack("b", 1)  # the new holder's ack counts


def test_an_expired_lease_releases_a_draining_key_without_waiting_for_the_old_owner() -> None:
    """G1 with leases: a key left in flight on its former owner drains at the lease's deadline."""
    clock = ManualClock(0.0)
    d = Dispatcher(clock=clock, ack_timeout=TIMEOUT)
    d.add_consumer("a")
    d.flow("a", 100)
    for position in range(1, 41):
        d.publish(position, f"key-{position}")
    d.poll()  # all 40 in flight on a
    clock.advance(1.0)
    d.add_consumer("b")  # b takes a share: its keys are draining on a
    d.flow("b", 100)
    d.ack_many("a", [p for p in range(1, 41) if d.owner_of(f"key-{p}") == "a"])
    drained = [p for p in range(1, 41) if d.owner_of(f"key-{p}") == "b"]
    assert drained and d.stats()["consumers"]["a"]["draining_hashes"] == len(drained)
    d.publish(41, f"key-{drained[0]}")
    assert d.poll() == []  # blocked: its key is in flight on a
    clock.advance(TIMEOUT - 1.0)
    out = d.poll()
    assert [(x.consumer, x.position) for x in out] == [("b", p) for p in [*drained, 41]]
    assert d.stats()["consumers"]["a"]["draining_hashes"] == 0
    d._audit()


def test_extend_keeps_a_lease_and_a_stuck_consumer_rejoins_on_progress() -> None:
    d, clock = two_consumers()
    keys = keys_of(d, "a", 2)
    d.publish(1, keys[0])
    d.publish(2, keys[1])
    d.poll()
    clock.advance(TIMEOUT - 1.0)
    assert d.extend("a", [1, 99]) == ([1], [99])
    clock.advance(1.0)
    d.poll()  # 2 expired, 1 was extended
    assert d.lease_expired("a", 2) and not d.lease_expired("a", 1)
    assert d.stats()["consumers"]["a"]["stuck"] and d.ranges_of("a") == []
    d.ack("a", 1)  # progress: a rejoins as a joiner
    assert not d.stats()["consumers"]["a"]["stuck"]
    assert d.ranges_of("a") != []
    assert d.stats()["rebalances"]["recovered"] == 1
    d._audit()


@pytest.mark.parametrize("progress", ["flow", "nack", "extend"])
def test_each_kind_of_progress_ends_stuck(progress: str) -> None:
    d, clock = two_consumers()
    keys = keys_of(d, "a", 2)
    d.publish(1, keys[0])
    d.poll()
    clock.advance(TIMEOUT / 2)
    d.publish(2, keys[1])
    d.poll()
    clock.advance(TIMEOUT / 2)
    d.poll()  # 1 expired; 2 (delivered later) is still leased to a
    assert d.stats()["consumers"]["a"]["stuck"]
    if progress == "flow":
        d.flow("a", 0)
    elif progress == "nack":
        d.nack("a", 2)
    else:
        d.extend("a", [2])
    assert not d.stats()["consumers"]["a"]["stuck"]
    d._audit()


def test_a_stuck_consumer_gets_no_keyless_messages_and_a_stuck_standby_stays_out() -> None:
    d, clock = two_consumers()
    d.publish(1, None)
    d.publish(2, None)
    out = d.poll()
    assert sorted(x.consumer for x in out) == ["a", "b"]
    d.ack("b", next(x.position for x in out if x.consumer == "b"))
    clock.advance(TIMEOUT)
    again = d.poll()
    assert [(x.consumer, x.redelivery_count) for x in again] == [("b", 1)]
    for position in range(3, 7):
        d.publish(position, None)
    assert {x.consumer for x in d.poll()} == {"b"}, "keyless messages skip a stuck consumer"


def test_redelivery_counts_survive_moves_and_a_poison_message_is_dead_lettered_then_the_key_goes_on() -> None:
    clock = ManualClock(0.0)
    d = Dispatcher(clock=clock, max_redeliveries=2, max_replay=10)
    for name in ("a", "b"):
        d.add_consumer(name)
        d.flow(name, 100)
    key = keys_of(d, "a", 1)[0]
    d.publish(1, key, "poison")
    deliveries = 0
    for round_ in range(3):
        out = d.poll()
        (first,) = [x for x in out if x.position == 1]
        assert first.redelivery_count == round_
        deliveries += 1
        if round_ == 1:
            d.remove_consumer(first.consumer)  # the count goes with the message to the new owner
            d.add_consumer(first.consumer)
            d.flow(first.consumer, 100)
        else:
            d.nack(first.consumer, 1)
    d.publish(2, key, "next")
    out = d.poll()
    assert deliveries == 3  # max_redeliveries + 1
    assert [x.position for x in out] == [2], "the key goes on with its next message"
    (letter,) = d.dead_letters()
    assert letter == DeadLetter(1, key, "poison", 2, "nack")
    assert d.dead_letters() == []
    stats = d.stats()
    assert stats["dead_lettered"] == 1 and stats["dead_letters_unconfirmed"] == 1
    assert stats["held"] == 2  # the dead letter counts until it is confirmed stored (and 2 is in flight)
    assert d.dead_lettered([1, 1, 7]) == ([1], [1, 7])
    assert d.stats()["held"] == 1 and d.stats()["dead_letters_unconfirmed"] == 0
    d._audit()


def test_a_dead_letter_names_why_its_last_delivery_came_back() -> None:
    d, clock = two_consumers(max_redeliveries=0)
    (key,) = keys_of(d, "a", 1)
    d.publish(1, key)
    d.publish(2, None)
    d.poll()
    clock.advance(TIMEOUT)
    assert d.poll() == []
    letters = d.dead_letters()
    assert sorted((x.position, x.redelivery_count, x.reason) for x in letters) == [
        (1, 0, "ack timeout"),
        (2, 0, "ack timeout"),
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ack_timeout": -1.0}, "ack_timeout must be a finite number >= 0.0"),
        ({"ack_timeout": float("inf")}, "ack_timeout"),
        ({"ack_timeout": "30"}, "ack_timeout"),
        ({"max_redeliveries": -1}, "max_redeliveries must be an int >= 0"),
        ({"max_redeliveries": True}, "max_redeliveries"),
        ({"max_redeliveries": 2.0}, "max_redeliveries"),
        ({"nack_backoff": -0.5}, "nack_backoff must be a finite number >= 0.0"),
        ({"nack_backoff": float("nan")}, "nack_backoff"),
        ({"nack_backoff": 2.0, "nack_backoff_max": 1.0}, r"nack_backoff_max must be a finite number >= 2.0 \(at least"),
        ({"nack_backoff_max": float("inf")}, "nack_backoff_max"),
    ],
)
def test_bad_lease_settings_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Dispatcher(**options)  # type: ignore[arg-type]


def test_without_leases_nothing_expires_and_extend_changes_nothing() -> None:
    clock = ManualClock(0.0)
    d = Dispatcher(clock=clock)
    d.add_consumer("a")
    d.flow("a", 10)
    d.publish(1, "k")
    d.poll()
    assert d.next_deadline() is None
    clock.advance(1e9)
    assert d.poll() == []
    assert d.extend("a", [1, 2]) == ([1], [2])
    d.ack("a", 1)
    assert d.stats()["expired_leases"] == 0


def test_when_every_consumer_is_stuck_nothing_is_lost() -> None:
    d, clock = two_consumers()
    for position in range(20):
        d.publish(position, f"key-{position}")
    d.poll()
    clock.advance(TIMEOUT)
    assert d.poll() == []
    assert d.ranges() == [] and d.stats()["replay"] == 20
    d.flow("b", 0)  # b shows progress: it rejoins and takes everything
    out = d.poll()
    assert sorted(x.position for x in out) == list(range(20)) and {x.consumer for x in out} == {"b"}
    d._audit()


def test_messages_taken_back_only_to_keep_their_keys_order_do_not_count_as_failures() -> None:
    """A nack returns the key's later deliveries too; only the nacked one failed, so only it is dead-lettered."""
    d = Dispatcher(clock=ManualClock(0.0), max_redeliveries=1)
    d.add_consumer("a")
    d.flow("a", 100)
    d.publish(1, "k", "poison")
    d.publish(2, "k", "innocent")
    for _ in range(2):
        assert [x.position for x in d.poll()] == [1, 2]
        d.nack("a", 1)
    assert [(x.position, x.redelivery_count) for x in d.poll()] == [(2, 2)]
    assert [letter.position for letter in d.dead_letters()] == [1]


def test_leases_extended_out_of_position_order_expire_together_oldest_first() -> None:
    """Found by the property machine: an extension puts a key's deadlines out of position order;
    when both expire at one poll, the oldest is the one that failed and the key restarts from it."""
    d, clock = two_consumers(max_redeliveries=0)
    (key,) = keys_of(d, "a", 1)
    d.publish(1, key, "first")
    d.publish(2, key, "second")
    assert [x.position for x in d.poll()] == [1, 2]
    clock.advance(TIMEOUT / 2)
    d.extend("a", [1])  # 1's deadline is now after 2's
    clock.advance(TIMEOUT)  # both are due
    out = d.poll()
    assert [(x.consumer, x.position, x.redelivery_count) for x in out] == [("b", 2, 1)]
    assert [(letter.position, letter.reason) for letter in d.dead_letters()] == [(1, "ack timeout")]
    d._audit()


def test_a_consumer_at_its_unacked_limit_gets_nothing_until_it_acks_half() -> None:
    """Pulsar's maxUnackedMessagesPerConsumer: permits are withheld, not lost, at the limit."""
    d = Dispatcher(clock=ManualClock(0.0), max_unacked_per_consumer=4)
    d.add_consumer("a")
    d.flow("a", 10)
    for position in range(1, 13):
        d.publish(position, f"key-{position}")
    first = d.poll()
    assert [x.position for x in first] == [1, 2, 3, 4]
    stats = d.stats()["consumers"]["a"]
    assert (stats["unacked_limit_reached"], stats["permits"], stats["unacked"]) == (True, 6, 4)
    d.flow("a", 5)  # counted, still withheld
    d.ack("a", 1)
    assert d.poll() == [], "3 unacked is above half the limit"
    d.ack("a", 2)
    assert [x.position for x in d.poll()] == [5, 6]  # down to 2: two more reach the limit again
    assert d.stats()["consumers"]["a"]["permits"] == 9
    d._audit()


def test_an_unacked_limit_must_be_a_non_negative_int() -> None:
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ConfigError, match="max_unacked_per_consumer must be an int >= 0"):
            Dispatcher(max_unacked_per_consumer=bad)  # type: ignore[arg-type]


def _stalled_run(
    spill: bool, *, unacked: int = 20, window: int | None = None
) -> tuple[Dispatcher, dict[str, list[int]], int]:
    """A never-acking consumer beside a healthy one: 3,000 messages over 100 keys through a buffer of 100.

    The test plays the IO layer: it publishes while wants() allows, polls, acks what the
    healthy consumer got, and re-reads parked slots from its own log. ``unacked``: the unacked
    limit per consumer; ``window``: the healthy consumer's permits, each ack giving one back (a
    receiver queue), None for more than it ever needs. Returns the dispatcher, the positions each
    consumer received, and how many messages were published.
    """
    d = Dispatcher(clock=ManualClock(0.0), max_replay=100, max_unacked_per_consumer=unacked, spill=spill)
    for name in ("stuck", "healthy"):
        d.add_consumer(name)
        d.flow(name, 10_000 if window is None or name == "stuck" else window)
    log = [(position, f"key-{position % 100}") for position in range(1, 3001)]
    got: dict[str, list[int]] = {"stuck": [], "healthy": []}
    published = 0
    for _ in range(1000):
        while published < len(log) and d.wants():
            d.publish(*log[published])
            published += 1
        for delivery in d.poll():
            got[delivery.consumer].append(delivery.position)
            if delivery.consumer == "healthy":
                d.ack("healthy", delivery.position)
                if window is not None:
                    d.flow("healthy", 1)
        slots = d.rereads()
        if slots:
            through = published
            for position, key in log[:published]:
                if key_hash(key) in slots and position >= slots[key_hash(key)]:
                    if not d.wants():
                        through = position - 1
                        break
                    d.restore(position, key)
            d.restored(slots, through)
        d._audit()
    return d, got, published


def test_with_spill_a_never_acking_consumer_does_not_stop_the_others() -> None:
    """Issue 13: the healthy consumer gets every message of its keys although the other one never acks."""
    d, got, published = _stalled_run(spill=True)
    assert published == 3000
    healthy_keys = {f"key-{i}" for i in range(100) if d.owner_of(f"key-{i}") == "healthy"}
    expected = [p for p in range(1, 3001) if f"key-{p % 100}" in healthy_keys]
    assert got["healthy"] == sorted(got["healthy"]) and set(got["healthy"]) == set(expected)
    assert len(got["stuck"]) == 20, "the stuck consumer holds its unacked limit"
    stats = d.stats()
    assert stats["held"] <= 100 and stats["parked_slots"] > 0 and stats["parked_messages"] > 0
    # The peer, without spilling: the stuck consumer's keys fill the buffer and reading stops for everyone.
    d, got, published = _stalled_run(spill=False)
    assert published < 300 and d.wants() == 0
    assert len(got["healthy"]) < len(expected) // 5


def test_a_consumer_holding_half_the_buffer_leaves_the_others_slots_re_read() -> None:
    """G5 with the server's default bounds' ratio (unacked limit = max_replay / 2, where parking starts): the
    never-acking consumer's unacked limit alone keeps half the buffer held, and the healthy consumer's slots,
    parked while it had no permits, are still re-read once it has them again."""
    d, got, published = _stalled_run(spill=True, unacked=50, window=5)
    assert published == 3000
    assert len(got["stuck"]) == 50, "the stuck consumer holds its unacked limit"
    healthy_keys = {f"key-{i}" for i in range(100) if d.owner_of(f"key-{i}") == "healthy"}
    expected = [p for p in range(1, 3001) if f"key-{p % 100}" in healthy_keys]
    assert d.stats()["parked_messages"] > 0, "the healthy consumer's slots were parked on the way"
    assert got["healthy"] == sorted(got["healthy"]) and set(got["healthy"]) == set(expected)


def test_restore_refuses_what_was_not_parked() -> None:
    d = Dispatcher(clock=ManualClock(0.0), max_replay=4, spill=True)
    d.add_consumer("a")
    d.publish(1, "k")
    with pytest.raises(PositionError, match="restore only right after poll"):
        d.restore(1, "k")
    d.poll()
    with pytest.raises(PositionError, match="is not parked"):
        d.restore(1, "k")
    with pytest.raises(PositionError, match="keyed message"):
        d.restore(2, None)
    with pytest.raises(PositionError, match="through must be an int position up to the last published 1"):
        d.restored([key_hash("k")], 5)
    with pytest.raises(ConfigError, match="spill must be a bool"):
        Dispatcher(spill=1)  # type: ignore[arg-type]


def test_no_backlog_range_goes_to_a_consumer_that_takes_messages_and_acks_none() -> None:
    """A consumer with permits and nothing waiting that never acks (its application is blocked, its
    lease not yet expired) is not idle: a slow consumer's growing backlog is not shed to it."""
    clock = ManualClock(0.0)
    d = Dispatcher(clock=clock, backlog_interval=1.0, shift_interval=3600.0)
    d.add_consumer("slow")
    d.add_consumer("taker")
    d.flow("slow", 10)
    d.flow("taker", 1_000_000)
    keys = [f"key-{i}" for i in range(4000)]
    position = 0
    for _ in range(6):
        for key in keys:
            position += 1
            d.publish(position, key)
        for delivery in d.poll():
            if delivery.consumer == "slow":
                d.ack(delivery.consumer, delivery.position)
        clock.advance(1.0)
        d.poll()
    assert d.stats()["consumers"]["taker"]["unacked"] > 0 and d.stats()["replay"] > 100
    assert "backlog" not in d.stats()["rebalances"]
    d._audit()


def test_a_consumer_whose_backlog_keeps_growing_sheds_range_to_an_idle_one() -> None:
    """Issue 13 part 2: a slow consumer (no permits left) beside an idle one loses range to it,
    so its waiting keys move; the change is a "backlog" rebalance."""
    clock = ManualClock(0.0)
    d = Dispatcher(clock=clock, backlog_interval=1.0, shift_interval=3600.0)
    d.add_consumer("slow")
    d.add_consumer("idle")
    d.flow("slow", 10)
    d.flow("idle", 10_000)
    slow_keys = [f"key-{i}" for i in range(2000) if d.owner_of(f"key-{i}") == "slow"][:200]
    position = 0
    before = d.ranges_of("slow")
    for _ in range(4):
        for key in slow_keys:
            position += 1
            d.publish(position, key)
        for delivery in d.poll():
            d.ack(delivery.consumer, delivery.position)
        clock.advance(1.0)
        d.poll()
    assert d.stats()["rebalances"].get("backlog") == 1
    after = d.ranges_of("slow")
    assert sum(e - s + 1 for s, e in after) < sum(e - s + 1 for s, e in before)
    moved = [key for key in slow_keys if d.owner_of(key) == "idle"]
    assert moved, "some of the slow consumer's waiting keys went to the idle one"
    assert d.stats()["consumers"]["idle"]["unacked"] > 0, "and it took their messages at once"
    d._audit()


def test_a_backlog_interval_must_be_positive_or_none() -> None:
    for bad in (0, -1.0, float("nan"), "5"):
        with pytest.raises(ConfigError, match="backlog_interval"):
            Dispatcher(backlog_interval=bad)  # type: ignore[arg-type]


# -- nack backoff ----------------------------------------------------------------------


def test_a_nacked_key_backs_off_doubling_up_to_the_max_while_other_keys_go_on() -> None:
    d, clock = two_consumers(nack_backoff=1.0, nack_backoff_max=3.0)
    poison, other = keys_of(d, "a", 2)
    d.publish(1, poison)
    d.publish(2, poison)
    d.publish(3, other)
    assert [x.position for x in d.poll()] == [1, 2, 3]
    waits = []
    for round_ in range(4):
        start = clock()
        d.nack("a", 1)  # 2, later of the key on a, comes back with it (G2)
        assert d.next_deadline() == start + waits_expected(round_)
        d.publish(10 + round_, other)  # another key of the same consumer is not held up (G5)
        assert [x.position for x in d.poll()] == [10 + round_]
        stats = d.stats()
        assert (stats["backoff_keys"], stats["backoff_messages"]) == (1, 2)
        clock.advance(waits_expected(round_) - 0.001)
        assert d.poll() == []
        clock.advance(0.001)
        again = d.poll()
        assert [(x.position, x.redelivery_count) for x in again] == [(1, round_ + 1), (2, round_ + 1)]
        waits.append(clock() - start)
        assert d.stats()["backoff_messages"] == 0
    assert waits == pytest.approx([1.0, 2.0, 3.0, 3.0])
    d._audit()


def waits_expected(round_: int) -> float:
    """The backoff of the (round_ + 1)-th nack of one message: 1 s doubling, at most 3 s."""
    return min(2.0**round_, 3.0)


def test_a_backed_off_key_holds_its_later_messages_and_dead_letters_after_max_redeliveries() -> None:
    d, clock = two_consumers(nack_backoff=0.5, max_redeliveries=1)
    (key,) = keys_of(d, "a", 1)
    d.publish(1, key)
    d.poll()
    d.nack("a", 1)
    d.publish(2, key)  # published during the backoff: it waits behind position 1
    assert d.poll() == []
    clock.advance(0.5)
    assert [x.position for x in d.poll()] == [1, 2]
    d.nack("a", 1)  # its second failure: past max_redeliveries, dead-lettered when its backoff ends
    clock.advance(0.999)
    assert d.poll() == [] and d.dead_letters() == []
    clock.advance(0.001)
    assert [x.position for x in d.poll()] == [2]
    assert [(x.position, x.reason) for x in d.dead_letters()] == [(1, "nack")]
    d._audit()


def test_a_keyless_message_and_an_unordered_one_back_off_alone() -> None:
    d, clock = two_consumers(nack_backoff=2.0)
    (key,) = keys_of(d, "a", 1)
    d.publish(1, None)
    d.publish(2, None)
    first = {x.position: x.consumer for x in d.poll()}
    d.nack(first[1], 1)
    d.publish(3, None)
    assert [x.position for x in d.poll()] == [3]
    clock.advance(2.0)
    assert [x.position for x in d.poll()] == [1]
    d.set_consume_mode("unordered")
    d.publish(4, key)
    d.publish(5, key)
    out = {x.position: x.consumer for x in d.poll()}
    d.nack(out[4], 4)  # in unordered mode the key's later message does not wait for it
    if out[5] == out[4]:
        assert [x.position for x in d.poll()] == [5]  # 5 came back with 4 (the client drops it) and goes at once
    assert d.stats()["backoff_messages"] == 1
    clock.advance(2.0)
    assert [x.position for x in d.poll()] == [4]
    d._audit()


def test_a_mode_switch_ends_every_backoff() -> None:
    d, _ = two_consumers(nack_backoff=60.0)
    (key,) = keys_of(d, "a", 1)
    d.publish(1, key)
    d.poll()
    d.nack("a", 1)
    assert d.poll() == []
    d.set_consume_mode("unordered")
    assert [x.position for x in d.poll()] == [1]
    d._audit()


def test_without_a_backoff_a_nack_redelivers_at_once_and_a_late_backoff_still_holds_the_key() -> None:
    d, clock = two_consumers(nack_backoff=5.0)
    (key,) = keys_of(d, "a", 1)
    d.publish(1, key)
    d.publish(2, key)
    d.poll()
    d.nack("a", 2)
    d.set_delivery_settings(ack_timeout=TIMEOUT, max_redeliveries=None, nack_backoff=0.0)
    d.nack("a", 1)  # no backoff of its own, but the key still waits for the running one (G2)
    assert d.poll() == []
    clock.advance(5.0)
    assert [x.position for x in d.poll()] == [1, 2]
    d.nack("a", 1)
    assert [x.position for x in d.poll()] == [1, 2]
    d._audit()


# -- delivery settings changed live ----------------------------------------------------


def test_a_shorter_ack_timeout_applies_to_leases_out_and_a_longer_one_to_new_deliveries() -> None:
    d, clock = two_consumers()
    key, other = keys_of(d, "a", 2)
    d.publish(1, key)
    d.poll()  # leased until 110
    clock.advance(2.0)
    d.set_delivery_settings(ack_timeout=20.0, max_redeliveries=None)
    assert d.next_deadline() == 110.0  # a longer timeout does not lengthen a lease already out
    d.publish(2, other)
    d.poll()
    d.set_delivery_settings(ack_timeout=1.0, max_redeliveries=3)
    assert d.next_deadline() == 103.0  # the leases out end at most 1 s from now
    assert (d.ack_timeout, d.max_redeliveries) == (1.0, 3)
    clock.advance(1.0)
    assert {x.redelivery_count for x in d.poll()} == {1}
    d.set_delivery_settings(ack_timeout=0.0, max_redeliveries=None)
    assert d.next_deadline() is None
    clock.advance(1e6)
    assert d.poll() == []
    d.set_delivery_settings(ack_timeout=4.0, max_redeliveries=None)  # leases again: what is out is leased from now
    assert d.next_deadline() == clock() + 4.0
    d._audit()


def test_a_bad_live_setting_is_refused_and_changes_nothing() -> None:
    d, _ = two_consumers(nack_backoff=1.0)
    before = d.stats()
    with pytest.raises(ConfigError, match=r"nack_backoff_max must be a finite number >= 5\.0"):
        d.set_delivery_settings(ack_timeout=1.0, max_redeliveries=2, nack_backoff=5.0, nack_backoff_max=1.0)
    with pytest.raises(ConfigError, match="max_redeliveries must be an int >= 0"):
        d.set_delivery_settings(ack_timeout=1.0, max_redeliveries=-1)
    assert d.stats() == before
    assert (d.ack_timeout, d.max_redeliveries, d.nack_backoff) == (TIMEOUT, None, (1.0, 60.0))


def test_a_reader_is_asked_for_more_only_while_a_consumer_that_may_take_it_has_permits() -> None:
    """``hungry()``: a consumer with permits left after a poll could use more messages; a stuck one's
    permits do not count, as it takes nothing until it shows progress."""
    clock = ManualClock(100.0)
    d = Dispatcher(clock=clock, ack_timeout=TIMEOUT)
    assert not d.hungry()  # no consumer
    d.add_consumer("a")
    assert not d.hungry()  # no permits
    d.flow("a", 2)
    assert d.hungry()
    d.publish(0, "k")
    d.publish(1, "k")
    assert [x.position for x in d.poll()] == [0, 1]
    assert not d.hungry()  # it has all it asked for
    d.flow("a", 1)
    assert d.hungry()
    clock.advance(TIMEOUT)
    d.poll()  # both leases expire: a is stuck, with one permit left
    assert d.stats()["consumers"]["a"]["stuck"]
    assert not d.hungry()
    d.add_consumer("b")
    d.flow("b", 1)
    assert d.hungry()


# -- delayed delivery (Pulsar's deliver_at_time) -----------------------------------------


def test_a_delayed_message_waits_for_its_time_and_does_not_block_its_key() -> None:
    """Its key's later messages go out meanwhile; at its time it goes to the consumer holding the key
    (G1), though a later message of its key is in flight there (G2 does not hold for it)."""
    d, clock = two_consumers()
    (key,) = keys_of(d, "a", 1)
    d.publish(1, key, "later", deliver_at=105.0)
    d.publish(2, key, "now")
    d.publish(3, None, "keyless later", deliver_at=103.0)
    assert [(x.consumer, x.position) for x in d.poll()] == [("a", 2)]
    assert d.next_deadline() == 103.0
    assert d.stats()["delayed_messages"] == 2 and d.stats()["replay"] == 2
    clock.advance(2.5)
    assert d.poll() == []
    clock.advance(0.5)
    assert [x.position for x in d.poll()] == [3]
    clock.advance(2.0)
    assert [(x.consumer, x.position, x.payload, x.redelivery_count) for x in d.poll()] == [("a", 1, "later", 0)]
    d._audit()
    d.nack("a", 1)  # delivered, it is an ordinary message: a nack returns the key's later deliveries with it
    assert [x.position for x in d.poll()] == [1, 2]
    assert d.stats()["delayed_messages"] == 0
    d._audit()


def test_a_delayed_message_of_a_draining_key_waits_for_the_drain() -> None:
    """G1 holds for a delayed message: due while its key is in flight on a former owner, it waits for
    that owner's acks, then goes to the new one."""
    clock = ManualClock(0.0)
    d = Dispatcher(clock=clock)
    d.add_consumer("a")
    d.flow("a", 100)
    keys = [f"key-{i}" for i in range(40)]
    for position, key in enumerate(keys, start=1):
        d.publish(position, key)
    for position, key in enumerate(keys, start=101):
        d.publish(position, key, deliver_at=5.0)
    assert len(d.poll()) == 40  # the delayed ones wait
    d.add_consumer("b")  # b takes a share: its keys are draining on a
    d.flow("b", 100)
    moved = [position for position, key in enumerate(keys, start=1) if d.owner_of(key) == "b"]
    assert moved
    clock.advance(5.0)
    out = d.poll()
    assert {(x.consumer, x.position) for x in out} == {
        ("a", 100 + p) for p in range(1, 41) if p not in moved
    }  # each to its key's holder, a, which still owns the key
    assert d.ack_many("a", moved) == (moved, [])
    assert sorted((x.consumer, x.position) for x in d.poll()) == [("b", 100 + p) for p in moved]
    d._audit()


def test_a_delivery_time_already_past_delivers_in_order_and_a_bad_one_is_refused() -> None:
    d, _ = two_consumers()
    (key,) = keys_of(d, "a", 1)
    d.publish(1, key, deliver_at=99.0)
    d.publish(2, key, deliver_at=100.0)  # the poll's own reading: not after it
    d.publish(3, key)
    assert [x.position for x in d.poll()] == [1, 2, 3]
    for bad in (float("nan"), float("inf"), "105", True, None):
        with pytest.raises(PositionError, match="deliver_at must be a finite"):
            d.publish(4, key, deliver_at=bad)  # type: ignore[arg-type]
    assert d.last_position == 3 and d.stats()["held"] == 3
    d._audit()


def test_a_delayed_message_in_unordered_mode_waits_alone() -> None:
    d, clock = two_consumers(consume_mode="unordered")
    (key,) = keys_of(d, "a", 1)
    d.publish(1, key, deliver_at=105.0)
    d.publish(2, key)
    assert [x.position for x in d.poll()] == [2]
    clock.advance(5.0)
    assert [x.position for x in d.poll()] == [1]
    d._audit()
