"""Subscription types: the Failover active consumer as Pulsar picks it, and a subscription's type in this process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyfailover.broker.pulsar.PulsarApi_pb2 import BaseCommand, CommandAck, CommandSubscribe
from keyfailover.broker.server import Server, ServerConfig, SubscriptionConfig
from keyfailover.broker.server._subscription import Session, Subscription
from keyfailover.core.clock import ManualClock
from keyfailover.core.dispatcher import DeliverySettings, Dispatcher
from keyfailover.core.errors import ConfigError, ErrorCode, KeyFailoverError, ProtocolError
from keyfailover.core.rebalance import UNASSIGNED
from keyfailover.core.subtypes import SUBSCRIPTION_TYPES, SubscriptionType, active_consumer, check_subscription_type
from keyfailover.wire.properties import DELIVER_AT_PROPERTY, encode_properties
from keyfailover.wire.protocol import Messages
from tests.aio import run_async
from tests.pulsar_wire import RawPulsar, command, connect_command, subscribe_command
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
        assert subscription.describe()["consume_mode"] == "ordered"  # no consumer left names a type: the saved mode
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


def test_exclusive_delivers_keyed_and_keyless_messages_in_log_order(tmp_path: Path) -> None:
    """Keyless messages wait in one queue with the keyed ones, by position: a consumer granted permits twice gets
    the log in order, so its cumulative ack of a message never covers one it has not received."""

    async def body(server: Server) -> None:
        keys = ["x", "y", "x", None, "y", "x"]
        await server.storage.append("orders", None, [(None, key, b"m") for key in keys])
        subscription = await server.subscription("orders", "billing")
        joined = Joined(server, subscription, "c", "exclusive", 2)
        assert await joined.until(2) == [1, 2]
        subscription.flow(joined.session, 4)
        assert await joined.until(6) == [1, 2, 3, 4, 5, 6]
        keyless = [item for frame in joined.inbox.frames if isinstance(frame, Messages) for item in frame.messages]
        assert [item[1] for item in keyless] == keys  # each goes out with its own key, none for the keyless one

    run(tmp_path, body)


def test_a_failover_switch_waits_for_the_old_active_consumers_acks(tmp_path: Path) -> None:
    """G1 across a switch: the consumer that stood down keeps its unacked messages, and their keys, until it
    acks them; its acks are taken; then it leaves the dispatcher, and the new active consumer gets the rest."""

    async def body(server: Server) -> None:
        await server.storage.append("orders", None, [(None, f"k{i % 3}", b"x") for i in range(6)])
        subscription = await server.subscription("orders", "billing")
        bravo = Joined(server, subscription, "bravo", "failover", 4)
        assert await bravo.until(4) == [1, 2, 3, 4]
        alpha = Joined(server, subscription, "alpha", "failover", 10)
        assert (bravo.told, alpha.told) == ([True, False], [True])
        dispatcher = subscription.dispatcher
        assert sorted(dispatcher.consumers()) == ["alpha", "bravo"]
        assert (dispatcher.inflight_count("bravo"), dispatcher.permits("bravo")) == (4, 0)
        subscription.flow(bravo.session, 3)  # kept for when it is active again
        assert subscription.ack(bravo.session, [1, 2, 3]) == []
        assert sorted(dispatcher.consumers()) == ["alpha", "bravo"]  # 4 still in flight on it
        assert subscription.ack(bravo.session, [4]) == []
        assert dispatcher.consumers() == ["alpha"]
        assert await alpha.until(2) == [5, 6]
        assert (bravo.session.held, subscription.describe()["active_consumer"]) == (3, "alpha")

    run(tmp_path, body)


def test_a_draining_consumer_chosen_again_gets_its_permits_back(tmp_path: Path) -> None:
    async def body(server: Server) -> None:
        await server.storage.append("orders", None, [(None, f"k{i}", b"x") for i in range(4)])
        subscription = await server.subscription("orders", "billing")
        bravo = Joined(server, subscription, "bravo", "failover", 2)
        assert await bravo.until(2) == [1, 2]
        subscription.flow(bravo.session, 0)
        alpha = Joined(server, subscription, "alpha", "failover", 0)
        subscription.flow(bravo.session, 5)  # held while it drains
        subscription.detach(alpha.session, "closed")
        assert bravo.told == [True, False, True]
        assert subscription.dispatcher.consumers() == ["bravo"]
        assert subscription.dispatcher.permits("bravo") + subscription.dispatcher.inflight_count("bravo") >= 5
        assert await bravo.until(4) == [1, 2, 3, 4]

    run(tmp_path, body)


def state_of(subscription: Subscription) -> dict[str, object]:
    """What a refused subscribe must leave as it was: members, type, active consumer, modes, permits, messages."""
    view = subscription.describe()
    stats = view["dispatcher"]
    return {
        "sessions": list(subscription.sessions),
        "sub_type": subscription.sub_type,
        "type": view["subscription_type"],
        "active": view["active_consumer"],
        "modes": (view["consume_mode"], view["saved_consume_mode"]),
        "consumers": {
            name: (entry["ranges"], entry["permits"], entry["unacked"]) for name, entry in stats["consumers"].items()
        },
        "messages": (stats["held"], stats["replay"], stats["delayed_messages"]),
    }


@pytest.mark.parametrize(
    ("present", "kind"),
    [("failover", "failover"), (None, "shared"), (None, "exclusive"), ("key_shared", "key_shared")],
)
def test_a_refused_subscribe_changes_nothing(
    tmp_path: Path, present: SubscriptionType | None, kind: SubscriptionType
) -> None:
    """The name the range map keeps for unassigned slots is refused as a consumer name before anything changes:
    no ghost session, no type left set, no delayed message released."""

    async def body(server: Server) -> None:
        later = encode_properties({DELIVER_AT_PROPERTY: str(int(time.time() * 1000) + 3_600_000)})
        await server.storage.append("orders", None, [(None, "k", b"later"), (None, "j", b"now")], [later, None])
        subscription = await server.subscription("orders", "billing")
        if kind == "exclusive":  # a delayed message read by a consumer that left: the subscription has none
            reader = Joined(server, subscription, "reader", "key_shared", 5)
            assert await reader.until(1) == [2]
            subscription.detach(reader.session, "closed")
        else:
            if present is None:
                await subscription.set_consume_mode("unordered" if kind == "shared" else "ordered")
            first = Joined(server, subscription, "first", present, 5)
            await first.until(1)
        before = state_of(subscription)
        with pytest.raises(KeyFailoverError, match="reserved"):
            Joined(server, subscription, UNASSIGNED, kind, 3)
        assert state_of(subscription) == before

    run(tmp_path, body)


def test_the_saved_mode_comes_back_when_the_last_typed_consumer_leaves_untyped_ones(tmp_path: Path) -> None:
    """A Shared consumer joins native ones and leaves: the subscription has no type any more, the mode saved
    meanwhile is applied, and a Key_Shared subscriber is taken."""

    async def body(server: Server) -> None:
        subscription = await server.subscription("orders", "billing")
        await subscription.set_consume_mode("unordered")
        Joined(server, subscription, "native", None, 1)
        shared = Joined(server, subscription, "shared", "shared", 1)
        await subscription.set_consume_mode("ordered")  # saved; the Shared consumer holds the mode meanwhile
        assert subscription.dispatcher.consume_mode == "unordered"
        subscription.detach(shared.session, "closed")
        assert (subscription.sub_type, subscription.effective_type()) == (None, "key_shared")
        assert subscription.describe()["consume_mode"] == "ordered"
        Joined(server, subscription, "keyed", "key_shared", 1)
        assert subscription.describe()["subscription_type"] == "key_shared"

    run(tmp_path, body)


def test_an_ack_a_paused_subscription_refused_is_taken_by_a_later_cumulative_ack(tmp_path: Path) -> None:
    """Over the Pulsar protocol: while the broker may not act (a cluster lease lapsed) an ack is refused and its
    position stays out with the consumer, so a cumulative ack after the lease is back acks it too."""

    async def main() -> None:
        server = Server(ServerConfig(data_dir=tmp_path, pulsar_port=0))
        await server.start()
        try:
            await body(server)
        finally:
            await server.close()

    def ack(raw: RawPulsar, entry: int, request_id: int, kind: int = CommandAck.Individual) -> BaseCommand:
        command_ = command(BaseCommand.ACK, consumer_id=1, ack_type=kind, request_id=request_id)
        command_.ack.message_id.add(ledgerId=0, entryId=entry)
        raw.send(command_)
        return raw.receive_type(BaseCommand.ACK_RESPONSE)

    async def body(server: Server) -> None:
        await server.storage.append("paused", None, [(None, "a", b"1"), (None, "b", b"2")])
        assert server.pulsar_address is not None
        with RawPulsar("pulsar://{}:{}".format(*server.pulsar_address)) as raw:
            sub = subscribe_command("persistent://public/default/paused", CommandSubscribe.Exclusive)
            sub.subscribe.subscription = "s"
            sub.subscribe.initialPosition = CommandSubscribe.Earliest
            raw.send(connect_command(), sub)
            await asyncio.to_thread(raw.receive_type, BaseCommand.SUCCESS)
            raw.send(command(BaseCommand.FLOW, consumer_id=1, messagePermits=2))
            for _ in range(2):
                await asyncio.to_thread(raw.receive_type, BaseCommand.MESSAGE)
            subscription = await server.subscription("paused", "s")
            subscription._may_act = lambda: False
            refused = await asyncio.to_thread(ack, raw, 1, 7)
            assert refused.ackResponse.HasField("error")
            subscription._may_act = None
            taken = await asyncio.to_thread(ack, raw, 2, 8, CommandAck.Cumulative)
            assert not taken.ackResponse.HasField("error"), taken
            assert subscription.backlog() == 0

    run_async(main())


def test_a_message_read_while_exclusive_waits_for_its_time_once_the_type_honours_it(tmp_path: Path) -> None:
    """Read and left waiting by an Exclusive consumer, a delayed message keeps its delivery time: a Key_Shared
    consumer joining after it left does not get it early."""

    async def body(server: Server) -> None:
        later = encode_properties({DELIVER_AT_PROPERTY: str(int(time.time() * 1000) + 3_600_000)})
        stored = [(None, "k", b"now"), (None, "k", b"later"), (None, "j", b"now")]
        await server.storage.append("orders", None, stored, [None, later, None])
        subscription = await server.subscription("orders", "billing")
        exclusive = Joined(server, subscription, "exclusive", "exclusive", 1)
        assert await exclusive.until(1) == [1]
        subscription.detach(exclusive.session, "closed")
        keyed = Joined(server, subscription, "keyed", "key_shared", 5)
        assert sorted(await keyed.until(2)) == [1, 3]
        assert subscription.describe()["dispatcher"]["delayed_messages"] == 1

    run(tmp_path, body)


@pytest.mark.parametrize("then", ["flows", "leaves"])
def test_keyless_messages_parked_by_an_exclusive_subscription_come_back_once(tmp_path: Path, then: str) -> None:
    """A small buffer parks what the Exclusive consumer cannot take, keyless messages under the subscription's
    keyless key: re-read, they come back in log order to it, or once to a Key_Shared consumer after it left."""

    async def main() -> None:
        options = SubscriptionConfig(delivery=DeliverySettings(max_replay=4))
        server = Server(ServerConfig(data_dir=tmp_path, subscription=options))
        await server.start()
        try:
            await body(server)
        finally:
            await server.close()

    async def acking(joined: Joined, count: int) -> list[int]:
        """The first ``count`` positions ``joined`` gets, each acked as it comes (the buffer holds 4)."""
        acked = 0
        while acked < count:
            got = await joined.until(acked + 1)
            assert joined.session.subscription.ack(joined.session, got[acked:]) == []
            acked = len(got)
        return joined.inbox.positions()

    async def body(server: Server) -> None:
        keys = [None, None, "a", None, None, "a", None, None]
        await server.storage.append("orders", None, [(None, key, b"m") for key in keys])
        subscription = await server.subscription("orders", "billing")
        exclusive = Joined(server, subscription, "exclusive", "exclusive", 1)
        assert await exclusive.until(1) == [1]
        assert subscription.describe()["dispatcher"]["parked_slots"] == 2  # the keyless key's and "a"'s
        if then == "flows":
            subscription.flow(exclusive.session, 20)
            assert await acking(exclusive, 8) == list(range(1, 9))
            return
        subscription.detach(exclusive.session, "closed")
        keyed = Joined(server, subscription, "keyed", "key_shared", 20)
        assert sorted((await acking(keyed, 8))[:8]) == list(range(1, 9))

    run_async(main())


def test_a_draining_consumer_that_leaves_hands_its_unacked_messages_to_the_active_one(tmp_path: Path) -> None:
    async def body(server: Server) -> None:
        await server.storage.append("orders", None, [(None, f"k{i % 2}", b"x") for i in range(4)])
        subscription = await server.subscription("orders", "billing")
        bravo = Joined(server, subscription, "bravo", "failover", 3)
        assert await bravo.until(3) == [1, 2, 3]
        alpha = Joined(server, subscription, "alpha", "failover", 10)
        subscription.detach(bravo.session, "closed")
        assert subscription.dispatcher.consumers() == ["alpha"]
        assert await alpha.until(4) == [1, 2, 3, 4]

    run(tmp_path, body)
