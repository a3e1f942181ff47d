"""A subscription's own bounds, run in this process (sessions are the server's own, frames collected)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

import pytest

from keyfailover.broker.server import Server, ServerConfig
from keyfailover.broker.server import _subscription as subscription_module
from keyfailover.broker.server._subscription import Session, Subscription, SubscriptionConfig
from keyfailover.broker.storage import DEFAULT_ENTRY_CACHE_BYTES
from keyfailover.broker.storage._cache import ENTRY_OVERHEAD
from keyfailover.broker.storage._store import StoreUnavailableError
from keyfailover.broker.storage.records import StoredMessage
from keyfailover.core.dispatcher import DeliverySettings
from keyfailover.wire.protocol import Messages
from tests.aio import run_async
from tests.test_server_seek import Inbox, run


def test_the_range_maps_kept_for_plots_are_bounded_by_their_ranges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sticky consumers declaring many ranges make large maps: the history keeps as many as fit the
    bound on ranges (the newest always), not a fixed number of maps."""
    monkeypatch.setattr(subscription_module, "_HISTORY_RANGES", 5_000)

    async def body(server: Server) -> None:
        subscription = await server.subscription("orders", "billing")
        many = [(2 * i, 2 * i) for i in range(1000)]  # 1000 one-slot ranges: about 2000 in the map
        for _ in range(10):
            inbox = Inbox()
            session = Session(server.next_session_id(), "wide", subscription, inbox.send)
            subscription.attach(session, 10, sticky=many)
            subscription.detach(session, "closed")
        kept = subscription.history()
        assert sum(len(ranges) for _, _, ranges in kept) <= 5_000
        assert kept[-1][1] == subscription.dispatcher.epoch and len(kept) >= 2

    run(tmp_path, body)


async def delivered_whole_and_in_key_order(
    server: Server, sent: list[tuple[None, str, bytes]], positions: list[int]
) -> Subscription:
    """Subscribe one consumer with permits for all of ``sent`` (stored at ``positions``), and check that each
    message arrives with its own key and payload, each key's in order; the subscription."""
    subscription = await server.subscription("orders", "billing")
    inbox = Inbox()
    subscription.attach(Session(server.next_session_id(), "c1", subscription, inbox.send), len(sent))
    await inbox.until(len(sent))
    delivered = [item for frame in inbox.frames if isinstance(frame, Messages) for item in frame.messages]
    assert {position: (key, payload) for position, key, payload, *_ in delivered} == {
        position: (key, payload) for position, (_, key, payload) in zip(positions, sent, strict=True)
    }
    for key in {key for _, key, _ in sent}:
        of_key = [position for position, k, *_ in delivered if k == key]
        assert of_key == sorted(of_key)
    return subscription


def test_payloads_dropped_from_a_full_cache_are_read_again_and_the_cache_stays_bounded(tmp_path: Path) -> None:
    """A read batch larger than ``payload_cache`` leaves only the newest payloads cached: the deliveries of
    the others read theirs from the log again, each message with its own payload, in key order."""

    async def main() -> None:
        config = ServerConfig(data_dir=tmp_path, subscription=SubscriptionConfig(payload_cache=7))
        server = Server(config)
        await server.start()
        try:
            sent = [(None, f"k{i % 3}", b"payload %d" % i) for i in range(50)]
            positions = [p for p, _ in await server.storage.append("orders", None, sent)]
            subscription = await delivered_whole_and_in_key_order(server, sent, positions)
            assert len(subscription._cache) <= 7
        finally:
            await server.close()

    run_async(main())


@pytest.mark.parametrize("cached", [0, 40, None])
def test_a_backlog_is_delivered_whole_and_in_key_order_however_much_of_it_the_entry_cache_holds(
    tmp_path: Path, cached: int | None
) -> None:
    """The store answers a read from its entry cache when it holds where the read starts (None: the default
    bound, room for all of it; 40: the last 40 messages only; 0: the cache is off), else from the log: the same
    messages either way."""

    async def main() -> None:
        size = ENTRY_OVERHEAD + 2 + 12  # what the entry cache counts one message below as
        bound = DEFAULT_ENTRY_CACHE_BYTES if cached is None else cached * size
        server = Server(ServerConfig(data_dir=tmp_path, entry_cache_bytes=bound))
        await server.start()
        try:
            sent = [(None, f"k{i % 7}", b"payload %04d" % i) for i in range(300)]
            positions = [
                p
                for batch in range(0, 300, 50)
                for p, _ in await server.storage.append("orders", None, sent[batch : batch + 50])
            ]
            cache = server.storage.entry_cache
            assert len(cache) == (300 if cached is None else cached)
            await delivered_whole_and_in_key_order(server, sent, positions)
            if cached is None:
                assert cache.hits == 300 and cache.misses == 0
            else:  # every read (of one consumer's share) starts before what the cache holds: the log gives all
                assert cache.hits == 0 and cache.misses == -(-300 // subscription_module._READ_PER_CONSUMER)
        finally:
            await server.close()

    run_async(main())


@pytest.mark.parametrize("fault", ["read fails", "lease lapses"])
def test_deliveries_that_could_not_be_sent_go_out_later_whole_in_order_and_with_their_permits(
    tmp_path: Path, fault: str
) -> None:
    """A read of payloads for deliveries fails (the store fails over), or the broker's lease lapses while it reads:
    those deliveries were not sent. They go back with their permits and out again once the store answers or the
    lease is renewed: every message once, in key order, and the consumer holds no permit the server spent on
    nothing. Without leases (ack_timeout 0), a delivery kept in flight unsent would hold its key for good."""

    async def main() -> None:
        subscription_config = SubscriptionConfig(payload_cache=7, delivery=DeliverySettings(ack_timeout=0))
        server = Server(ServerConfig(data_dir=tmp_path, subscription=subscription_config))
        await server.start()
        try:
            sent = [(None, f"k{i % 3}", b"payload %d" % i) for i in range(50)]
            positions = [p for p, _ in await server.storage.append("orders", None, sent)]
            faults = FaultyReads(server, fault)
            subscription = await server.subscription("orders", "billing")
            subscription._may_act = faults.may_act
            inbox = Inbox()
            session = Session(server.next_session_id(), "c1", subscription, inbox.send)
            subscription.attach(session, len(sent) + 5)
            await asyncio.wait_for(faults.over.wait(), 30)
            faults.lapsed = False
            subscription.wake()  # as the server does when the lease is renewed
            delivered = await asyncio.wait_for(inbox.until(len(sent)), 30)
            assert sorted(delivered) == positions  # each once
            for key in {key for _, key, _ in sent}:
                of_key = [item for frame in inbox.frames if isinstance(frame, Messages) for item in frame.messages]
                assert [p for p, k, *_ in of_key if k == key] == sorted(p for p, k, *_ in of_key if k == key)
            assert all(item[3] == 0 for frame in inbox.frames if isinstance(frame, Messages) for item in frame.messages)
            entry = subscription.dispatcher.stats()["consumers"]["c1"]
            assert (entry["permits"], entry["unacked"]) == (5, len(sent))
        finally:
            await server.close()

    run_async(main())


class FaultyReads:
    """The server's store, whose reads of payloads by position fail twice (``read fails``), or during whose first
    read the broker's lease lapses (``lease lapses``: ``may_act`` says no until ``lapsed`` is cleared); ``over``
    is set once the fault happened."""

    def __init__(self, server: Server, fault: str) -> None:
        self.over = asyncio.Event()
        self.lapsed = False
        read = server.storage.read_positions
        failures = 2 if fault == "read fails" else 0

        async def faulty(topic: str, positions: Iterable[int]) -> dict[int, StoredMessage]:
            nonlocal failures
            if failures:
                failures -= 1
                if not failures:
                    self.over.set()
                raise StoreUnavailableError("no member of the store accepts reads")
            if fault == "lease lapses" and not self.over.is_set():
                self.lapsed = True
                self.over.set()
            return await read(topic, positions)

        server.storage.read_positions = faulty  # type: ignore[method-assign]

    def may_act(self) -> bool:
        return not self.lapsed
