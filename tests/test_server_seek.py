"""``Server.seek``: a subscription's cursor reset to a position, for every consumer, under concurrency.

The server is run in this process (its embedded log in a temporary folder) so that a seek can be
interleaved with a subscribe exactly; sessions are the server's own, their frames collected in lists.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import cast

import pytest

from keyfailover.broker.cursor import Cursor
from keyfailover.broker.server import Server, ServerConfig
from keyfailover.broker.server._subscription import Session, Subscription
from keyfailover.client.aio import AsyncClient
from keyfailover.core.errors import ErrorCode, ProtocolError
from keyfailover.wire.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Connect,
    ConsumerClosed,
    Decoder,
    Error,
    Frame,
    Messages,
    Subscribe,
    Subscribed,
    encode,
)
from tests.aio import run_async


def run(tmp_path: Path, body: Callable[[Server], Awaitable[None]]) -> None:
    async def main() -> None:
        server = Server(ServerConfig(data_dir=tmp_path))
        await server.start()
        try:
            await body(server)
        finally:
            await server.close()

    run_async(main())


class Inbox:
    """A session's frames, and a way to wait for the deliveries of some positions."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self._arrived = asyncio.Event()

    def send(self, frame: Frame) -> None:
        self.frames.append(frame)
        self._arrived.set()

    def positions(self) -> list[int]:
        return [item[0] for frame in self.frames if isinstance(frame, Messages) for item in frame.messages]

    async def until(self, count: int) -> list[int]:
        while len(self.positions()) < count:
            self._arrived.clear()
            await self._arrived.wait()
        return self.positions()


class HeldSave:
    """The server's store with its cursor saves held: ``saving`` is set when one starts, and it goes on
    once ``release`` is set (so a seek can be caught between closing the old subscription and opening
    the new one)."""

    def __init__(self, server: Server) -> None:
        self.saving, self.release = asyncio.Event(), asyncio.Event()
        save = server.storage.save_cursors

        async def held(cursors: Sequence[tuple[str, str, Cursor]]) -> None:
            self.saving.set()
            await self.release.wait()
            await save(cursors)

        server.storage.save_cursors = held  # type: ignore[method-assign]


def attach(server: Server, subscription: Subscription, consumer: str) -> Inbox:
    inbox = Inbox()
    session = Session(server.next_session_id(), consumer, subscription, inbox.send)
    subscription.attach(session, 100)
    return inbox


async def produce(server: Server, topic: str, count: int) -> None:
    await server.storage.append(topic, None, [(None, f"k{i % 3}", b"%d" % i) for i in range(count)])


def test_a_seek_ends_every_session_and_the_subscription_starts_again_at_the_position(tmp_path: Path) -> None:
    async def body(server: Server) -> None:
        await produce(server, "orders", 10)
        old = await server.subscription("orders", "billing")
        first = attach(server, old, "a")
        assert sorted(await first.until(10)) == list(range(1, 11))  # all in flight on the old dispatcher
        second = attach(server, old, "b")
        assert await server.seek("orders", "billing", 4) == 4
        for inbox in (first, second):
            assert [f.reason for f in inbox.frames if isinstance(f, ConsumerClosed)] == ["seek"]
        new = server.subscriptions()[("orders", "billing")]
        assert new is not old and not new.sessions
        assert new.cursor == Cursor(3) and await server.storage.load_cursor("orders", "billing") == Cursor(3)
        again = attach(server, new, "a")
        assert sorted(await again.until(7)) == [4, 5, 6, 7, 8, 9, 10]  # nothing in flight before leaks

    run(tmp_path, body)


def test_a_position_before_the_start_is_the_start_and_one_past_the_end_is_the_end(tmp_path: Path) -> None:
    async def body(server: Server) -> None:
        await produce(server, "orders", 5)
        subscription = await server.subscription("orders", "billing")
        inbox = attach(server, subscription, "a")
        await inbox.until(5)
        subscription.ack(subscription.sessions["a"], [1, 2, 3, 4, 5])
        assert await server.seek("orders", "billing", 0) == 1
        assert server.subscriptions()[("orders", "billing")].cursor == Cursor(0)
        assert await server.seek("orders", "billing", 1000) == 6
        assert server.subscriptions()[("orders", "billing")].cursor == Cursor(5)
        await produce(server, "orders", 1)
        late = attach(server, server.subscriptions()[("orders", "billing")], "a")
        assert await late.until(1) == [6]  # what came after the seek to the end

    run(tmp_path, body)


def test_a_seek_of_an_unknown_subscription_or_topic_not_served_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    async def body(server: Server) -> None:
        await produce(server, "orders", 3)
        with pytest.raises(ProtocolError) as refused:
            await server.seek("orders", "nobody", 2)
        assert refused.value.code == ErrorCode.UNKNOWN_SUBSCRIPTION
        assert "'nobody'" in refused.value.message
        assert ("orders", "nobody") not in server.subscriptions()
        assert not await server.storage.has_cursor("orders", "nobody")
        await server.subscription("orders", "billing")
        await server.close_served("orders", "moved")
        with pytest.raises(ProtocolError) as refused:
            await server.seek("orders", "billing", 2)
        assert refused.value.code == ErrorCode.NOT_OWNER

    run(tmp_path, body)


def test_a_subscribe_during_a_seek_gets_the_subscription_after_it(tmp_path: Path) -> None:
    async def body(server: Server) -> None:
        await produce(server, "orders", 6)
        old = await server.subscription("orders", "billing")
        seek = asyncio.create_task(server.seek("orders", "billing", 3))
        subscribe = asyncio.create_task(server.subscription("orders", "billing"))
        second_seek = asyncio.create_task(server.seek("orders", "billing", 5))
        assert await seek == 3
        after_first = await subscribe
        assert after_first is not old and after_first.cursor.mark_delete in (2, 4)
        assert await second_seek == 5  # waited for the first one, then came after it
        assert server.subscriptions()[("orders", "billing")].cursor == Cursor(4)

    run(tmp_path, body)


def test_a_seek_of_a_stored_subscription_not_live_reloads_it(tmp_path: Path) -> None:
    async def body(server: Server) -> None:
        await produce(server, "orders", 4)
        await server.storage.save_cursors([("orders", "billing", Cursor(4))])
        assert ("orders", "billing") not in server.subscriptions()
        assert await server.seek("orders", "billing", 2) == 2
        assert server.subscriptions()[("orders", "billing")].cursor == Cursor(1)

    run(tmp_path, body)


def test_a_native_connection_forgets_the_sessions_a_seek_ended(tmp_path: Path) -> None:
    """A seek ends every session and replaces the subscription: the consumer's connection must let go of
    the ended session, or each seek would keep a whole old subscription (its dispatcher, its payloads)."""

    async def body(server: Server) -> None:
        host, port = server.address
        async with AsyncClient(f"kf://{host}:{port}") as client:
            producer = await client.create_producer("orders", "p")
            for index in range(3):
                await producer.send(b"x", f"k{index}")
            consumer = await client.subscribe("orders", "billing", "c")
            for _ in range(3):
                await consumer.receive(timeout=10)
            for _ in range(5):
                await server.seek("orders", "billing", 1)
                assert [(await consumer.receive(timeout=10)).position for _ in range(3)] == [1, 2, 3]
            gc.collect()
            alive = [o for o in gc.get_objects() if isinstance(o, Subscription) and o.topic == "orders"]
            assert alive == [server.subscriptions()[("orders", "billing")]]

    run(tmp_path, body)


def test_an_ack_that_arrives_during_a_seek_is_told_its_session_ended(tmp_path: Path) -> None:
    """While a seek replaces the subscription it is in nobody's hands; an ack sent before the consumer
    learned of the seek is refused as an ended session's (not as an unknown subscription's)."""

    async def body(server: Server) -> None:
        await produce(server, "orders", 2)
        host, port = server.address
        reader, writer = await asyncio.open_connection(host, port)
        decoder = Decoder(1 << 20, accept="client")
        frames: list[Frame] = []

        async def next_frame(kind: type[Frame]) -> Frame:
            while not any(isinstance(f, kind) for f in frames):
                frames.extend(decoder.feed(await reader.read(65536)))
            found = next(f for f in frames if isinstance(f, kind))
            frames.remove(found)
            return found

        writer.write(encode(Connect(version=PROTOCOL_VERSION, token=None, client="raw")))
        writer.write(encode(Subscribe(req=1, topic="orders", subscription="billing", consumer="c", receiver_queue=10)))
        subscribed = cast(Subscribed, await next_frame(Subscribed))
        await next_frame(Messages)
        held = HeldSave(server)
        seek = asyncio.create_task(server.seek("orders", "billing", 1))
        await held.saving.wait()  # the old subscription is closed, the new one not open yet
        writer.write(
            encode(Ack(topic="orders", subscription="billing", session=subscribed.session, positions=[1], req=2))
        )
        error = cast(Error, await next_frame(Error))
        assert (error.code, error.req) == (ErrorCode.UNKNOWN_SESSION, 2)
        assert "being opened again (a seek)" in error.message
        held.release.set()
        assert await seek == 1
        writer.close()

    run(tmp_path, body)


def test_a_server_closing_during_a_seek_lets_the_seek_save_its_cursor_first(tmp_path: Path) -> None:
    async def body(server: Server) -> None:
        await produce(server, "orders", 3)
        await server.subscription("orders", "billing")
        held = HeldSave(server)
        seek = asyncio.create_task(server.seek("orders", "billing", 3))
        await held.saving.wait()
        closing = asyncio.create_task(server.close())
        held.release.set()
        assert await seek == 3
        await closing

    run(tmp_path, body)
    reopened = Server(ServerConfig(data_dir=tmp_path))

    async def saved() -> Cursor | None:
        await reopened.start()
        try:
            return (await reopened.subscription("orders", "billing")).cursor
        finally:
            await reopened.close()

    assert run_async(saved()) == Cursor(2)
