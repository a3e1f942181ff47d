"""A subscription's own bounds, run in this process (sessions are the server's own, frames collected)."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyfailover.broker.server import Server
from keyfailover.broker.server import _subscription as subscription_module
from keyfailover.broker.server._subscription import Session
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
