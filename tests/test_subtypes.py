"""Subscription types: the Failover active consumer as Pulsar picks it, and a subscription's type in this process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyfailover.broker.server import Server
from keyfailover.broker.server._subscription import Session, Subscription
from keyfailover.core.clock import ManualClock
from keyfailover.core.dispatcher import Dispatcher
from keyfailover.core.errors import ConfigError, ErrorCode, ProtocolError
from keyfailover.core.subtypes import SUBSCRIPTION_TYPES, SubscriptionType, active_consumer, check_subscription_type
from keyfailover.wire.properties import DELIVER_AT_PROPERTY, encode_properties
from tests.test_server_seek import Inbox, run

consumers = st.dictionaries(st.text(min_size=1, max_size=6), st.integers(-3, 3), max_size=8).map(
    lambda by_name: [(level, name) for name, level in by_name.items()]
)


@settings(max_examples=50)
@given(consumers, st.integers(-1, 50), st.randoms())
def test_the_active_consumer_is_pulsars_pick_whatever_the_order_they_came_in(
    present: list[tuple[int, str]], partition: int, shuffle: object
) -> None:
    """Sorted by priority level then name; a partition takes the one at its index modulo the count of the
    highest priority level, any other topic the first; the order they joined in changes nothing."""
    chosen = active_consumer(present, partition)
    if not present:
        assert chosen is None
        return
    ranked = sorted(present)
    top = [name for level, name in ranked if level == ranked[0][0]]
    assert chosen == (top[partition % len(top)] if partition >= 0 else top[0])
    shuffled = list(present)
    shuffle.shuffle(shuffled)  # type: ignore[attr-defined]
    assert active_consumer(shuffled, partition) == chosen


@given(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=8, unique=True))
def test_the_partitions_of_a_topic_spread_over_consumers_of_one_priority(names: list[str]) -> None:
    """As many partitions as consumers: each consumer is active for exactly one."""
    picks = [active_consumer([(0, name) for name in names], partition) for partition in range(len(names))]
    assert sorted(pick for pick in picks if pick is not None) == sorted(names)


def test_a_lower_priority_level_wins_over_names() -> None:
    assert active_consumer([(1, "a"), (0, "z")]) == "z"
    assert [active_consumer([(1, "a"), (0, "y"), (0, "z")], p) for p in range(3)] == ["y", "z", "y"]


def test_subscription_types_are_checked() -> None:
    assert [check_subscription_type(name) for name in SUBSCRIPTION_TYPES] == list(SUBSCRIPTION_TYPES)
    with pytest.raises(ConfigError, match="subscription type must be one of exclusive, failover, shared, key_shared"):
        check_subscription_type("Exclusive")


def test_release_delayed_lets_delayed_messages_go_in_order_and_permits_counts_what_is_left() -> None:
    clock = ManualClock()
    dispatcher = Dispatcher(clock=clock)
    dispatcher.add_consumer("c")
    dispatcher.flow("c", 5)
    dispatcher.publish(1, "k", deliver_at=clock() + 3600)
    dispatcher.publish(2, "k")
    assert [d.position for d in dispatcher.poll()] == [2]
    dispatcher.publish(3, "j", deliver_at=clock() + 3600)  # not routed yet
    dispatcher.release_delayed()
    assert sorted(d.position for d in dispatcher.poll()) == [1, 3]
    assert dispatcher.permits("c") == 2


class Joined:
    """A session of a subscription, its frames and what it was told of being active."""

    def __init__(
        self, server: Server, subscription: Subscription, name: str, kind: SubscriptionType | None, permits: int
    ) -> None:
        self.inbox = Inbox()
        self.told: list[bool] = []
        self.session = Session(
            server.next_session_id(), name, subscription, self.inbox.send, sub_type=kind, on_active=self.told.append
        )
        subscription.attach(self.session, permits)

    async def until(self, count: int) -> list[int]:
        return await asyncio.wait_for(self.inbox.until(count), 10)


def test_failover_delivers_to_the_active_consumer_and_hands_over_its_unacked_messages(tmp_path: Path) -> None:
    async def body(server: Server) -> None:
        await server.storage.append("orders", None, [(None, f"k{i % 3}", b"x") for i in range(6)])
        subscription = await server.subscription("orders", "billing")
        bravo = Joined(server, subscription, "bravo", "failover", 10)
        alpha = Joined(server, subscription, "alpha", "failover", 4)
        assert (bravo.told, alpha.told) == ([True, False], [True])
        assert await alpha.until(4) == [1, 2, 3, 4]
        assert bravo.inbox.positions() == []
        subscription.flow(bravo.session, 5)  # kept for when it is active: 15 in all
        assert subscription.ack(bravo.session, [1]) == [1]  # a standby holds nothing
        assert subscription.ack(alpha.session, [1, 2]) == []
        subscription.detach(alpha.session, "closed")
        assert bravo.told == [True, False, True]
        assert await bravo.until(4) == [3, 4, 5, 6]
        assert subscription.describe()["active_consumer"] == "bravo"
        assert subscription.dispatcher.permits("bravo") == 11

    run(tmp_path, body)


def test_a_joiner_of_another_type_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    async def body(server: Server) -> None:
        subscription = await server.subscription("orders", "billing")
        Joined(server, subscription, "one", "exclusive", 1)
        refusals: list[tuple[str, SubscriptionType | None, str]] = [
            ("two", "exclusive", "Exclusive consumer is already connected"),
            ("three", "shared", "Subscription is of different type"),
            ("native", None, "Subscription is of different type"),
        ]
        for name, kind, why in refusals:
            with pytest.raises(ProtocolError, match=why) as refused:
                Joined(server, subscription, name, kind, 1)
            assert refused.value.code == ErrorCode.CONSUMER_BUSY
        assert list(subscription.sessions) == ["one"] and subscription.dispatcher.consumers() == ["one"]

    run(tmp_path, body)


def test_a_typed_subscriber_sets_the_live_mode_and_the_saved_one_comes_back_when_all_have_left(tmp_path: Path) -> None:
    async def body(server: Server) -> None:
        subscription = await server.subscription("orders", "billing")
        shared = Joined(server, subscription, "s", "shared", 1)
        assert subscription.dispatcher.consume_mode == "unordered"
        await subscription.set_consume_mode("ordered")  # saved; the Shared consumer's type holds meanwhile
        native = Joined(server, subscription, "native", None, 1)  # joins as the subscription is
        assert subscription.dispatcher.consume_mode == "unordered"
        subscription.detach(shared.session, "closed")
        assert subscription.dispatcher.consume_mode == "unordered"  # the subscription still has a consumer
        subscription.detach(native.session, "closed")
        assert (subscription.dispatcher.consume_mode, subscription.sub_type) == ("ordered", None)
        await subscription.set_consume_mode("unordered")
        Joined(server, subscription, "keyed", "key_shared", 1)
        assert (subscription.dispatcher.consume_mode, subscription.saved_mode) == ("ordered", "unordered")

    run(tmp_path, body)


def test_a_typed_joiner_of_untyped_consumers_keeps_its_type_after_they_leave(tmp_path: Path) -> None:
    """A Shared consumer joins native consumers of an unordered subscription; once they have left, a switch of the
    saved mode waits for it to leave too."""

    async def body(server: Server) -> None:
        subscription = await server.subscription("orders", "billing")
        await subscription.set_consume_mode("unordered")
        native = Joined(server, subscription, "native", None, 1)
        Joined(server, subscription, "shared", "shared", 1)
        subscription.detach(native.session, "closed")
        await subscription.set_consume_mode("ordered")
        assert (subscription.effective_type(), subscription.dispatcher.consume_mode) == ("shared", "unordered")

    run(tmp_path, body)


@pytest.mark.parametrize(("kind", "delivered"), [("failover", [1, 2]), ("key_shared", [2])])
def test_failover_delivers_a_message_at_once_whatever_its_delivery_time(
    tmp_path: Path, kind: SubscriptionType, delivered: list[int]
) -> None:
    """Pulsar honours delivery times on Shared and Key_Shared subscriptions only."""

    async def body(server: Server) -> None:
        later = encode_properties({DELIVER_AT_PROPERTY: str(int(time.time() * 1000) + 3_600_000)})
        await server.storage.append("orders", None, [(None, "k", b"later"), (None, "k", b"now")], [later, None])
        subscription = await server.subscription("orders", "billing")
        joined = Joined(server, subscription, "c", kind, 10)
        assert await joined.until(len(delivered)) == delivered

    run(tmp_path, body)
