"""A partition whose serving ends takes nothing new: no subscription opens on it until it is served again.

A consumer told ``moved`` looks the partition up again and may ask the same broker before the
cluster has moved it; had the broker opened a new subscription for it while letting it go, the
consumer would stay on a subscription no new message reaches (found by ``keyfailover chaos``:
messages stored by the new owner reached nobody until the old one died).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from keyfailover.broker.server import Server, ServerConfig
from keyfailover.wire.protocol import ErrorCode, ProtocolError
from tests.aio import run_async


def test_a_closing_topic_refuses_subscriptions_produces_and_openings_until_served_again(tmp_path: Path) -> None:
    async def scenario() -> None:
        server = Server(ServerConfig(data_dir=tmp_path))
        await server.start()
        try:
            live = await server.subscription("orders", "billing")
            opening = asyncio.create_task(server.subscription("orders", "audit"))  # loading when serving ends
            await server.close_served("orders", "moved")
            with pytest.raises(ProtocolError) as refused:
                await opening
            assert refused.value.code == ErrorCode.NOT_OWNER
            for action in ("subscribe to", "produce to"):
                with pytest.raises(ProtocolError) as refused:
                    server.check_served("orders", action)
                assert refused.value.code == ErrorCode.NOT_OWNER
            with pytest.raises(ProtocolError):
                await server.subscription("orders", "billing")
            await server.open_served("orders")
            assert server.check_served("orders", "subscribe to") is None
            again = await server.subscription("orders", "billing")
            assert again is not live
        finally:
            await server.close()

    run_async(scenario())
