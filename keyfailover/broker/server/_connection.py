"""What the server's reaper and shutdown need of a client connection, whichever protocol it speaks."""

from __future__ import annotations

import asyncio
from typing import Protocol

from keyfailover.core.errors import ErrorCode

__all__ = ["ClientConnection", "ReadPausing", "TailWatcher", "partial_since"]


def partial_since(since: float | None, buffered: int, decoded: bool, now: float) -> float | None:
    """When the frame still incomplete after bytes arrived at ``now`` began to arrive: None when nothing is
    buffered (``buffered`` bytes are), ``now`` when the bytes completed frames (``decoded``) or began one,
    else ``since``, when it had begun before. The server closes a connection whose frame takes too long."""
    if not buffered:
        return None
    return now if since is None or decoded else since


class ClientConnection(Protocol):
    """A native or Pulsar protocol connection, as the server's liveness checks see it."""

    authenticated: bool
    """Whether it has logged in (``connect``, or Pulsar's CONNECT)."""
    opened: float
    """``time.monotonic()`` when it was accepted."""
    last_seen: float
    """``time.monotonic()`` when bytes last arrived."""
    partial_since: float | None
    """When the frame still incomplete began to arrive (None: no partial frame)."""
    peer: str

    @property
    def closed(self) -> bool:
        """Closed by this side."""
        ...

    def refuse(self, code: ErrorCode, message: str) -> None:
        """Close the connection because it broke a limit (``message`` says which)."""

    def sessions_open(self) -> int:
        """How many consumer sessions it has."""
        ...

    def expire_sessions(self, reason: str, notify: bool = True) -> None:
        """End every consumer session it has (their unacked messages go to the keys' new owners)."""

    def close(self) -> None:
        """Close it, ending its sessions."""


class TailWatcher(Protocol):
    """What follows a topic's log outside its subscriptions (a Pulsar reader), as the server tells it."""

    def committed(self) -> None:
        """Messages were committed to the topic."""

    def topic_closed(self) -> None:
        """This server stopped serving the topic (a partition moved to another broker)."""


class ReadPausing(asyncio.Protocol):
    """A client connection that stops reading the client's requests while it does not read the replies
    (past the transport's high-water mark), so unread replies cannot pile up without bound."""

    _transport: asyncio.Transport | None
    _closed: bool

    def pause_writing(self) -> None:
        if self._transport is not None and not self._closed:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None and not self._closed:
            self._transport.resume_reading()
