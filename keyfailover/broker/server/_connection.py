"""A client connection, whichever protocol it speaks: what the server's reaper and shutdown need of it,
what it needs of the server, and the frame-reading loop the native and Pulsar connections share."""

from __future__ import annotations

import asyncio
import logging
import time
from abc import abstractmethod
from collections import Counter
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from keyfailover.core.errors import ErrorCode

if TYPE_CHECKING:
    from keyfailover.broker.server._pulsar_access import ProducerHandle, TopicProducers
    from keyfailover.broker.server._subscription import Subscription
    from keyfailover.broker.storage._store import Store
    from keyfailover.wire.protocol import Key

__all__ = [
    "ClientConnection",
    "ConnectionHost",
    "FrameReader",
    "ReadPausing",
    "ServerView",
    "TailWatcher",
    "partial_since",
]

_log = logging.getLogger("keyfailover.server")
_F = TypeVar("_F")


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


class FrameReader(ReadPausing, Generic[_F]):
    """A client connection that reads frames of type ``_F``: it feeds its decoder what arrives, tracks a
    partial frame, and handles each whole frame in order. Each protocol supplies how it decodes, handles
    a frame, answers a refused request and closes the connection; the loop is the same for all."""

    _answered: tuple[type[Exception], ...] = ()
    """The errors of handling a frame that refuse its request alone: :meth:`_answer` replies with them."""
    _internal_error: str = "internal server error"
    """What closing the connection for an unexpected error in handling a frame says."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._closed = False
        self.authenticated = False
        self.opened = self.last_seen = time.monotonic()
        self.partial_since: float | None = None  # when the frame still incomplete began to arrive
        self.peer = "?"

    def data_received(self, data: bytes) -> None:
        """Handle each frame ``data`` completes, in order. An error of :attr:`_answered` refuses that request,
        any other closes the connection as an internal error, logged; after the frames, a malformed or too
        large frame closes it."""
        self.last_seen = now = time.monotonic()
        frames, buffered, refusal = self._decode(data)
        self.partial_since = partial_since(self.partial_since, buffered, bool(frames), now)
        for frame in frames:
            if self._closed:
                return
            try:
                self._handle(frame)
            except self._answered as exc:
                if not self._answer(frame, exc):
                    return
            except Exception:
                _log.exception("internal error handling %s from %s", self._frame_name(frame), self.peer)
                self._close_for(ErrorCode.INTERNAL, self._internal_error)
                return
        self._frames_handled()
        if refusal is not None and not self._closed:
            self._close_for(*refusal)

    @abstractmethod
    def _decode(self, data: bytes) -> tuple[list[_F], int, tuple[ErrorCode, str] | None]:
        """Feed ``data`` to the decoder: the frames it completes, the bytes it holds of the next one, and
        the code and message to close the connection with for a bad frame after them (None: none)."""

    @abstractmethod
    def _handle(self, frame: _F) -> None:
        """Serve one frame; an error of :attr:`_answered` refuses its request."""

    @abstractmethod
    def _answer(self, frame: _F, exc: Exception) -> bool:
        """Answer ``frame``'s request refused with ``exc``; False when that closed the connection."""

    @abstractmethod
    def _frame_name(self, frame: _F) -> str:
        """What the log calls ``frame``."""

    @abstractmethod
    def _close_for(self, code: ErrorCode, message: str) -> None:
        """Close the connection because of ``code``, telling the client ``message`` where its protocol can."""

    def _frames_handled(self) -> None:
        """Called once the frames of one read are handled, before a bad frame after them closes the
        connection; a protocol that gathers work across a read's frames does it here."""


class _Limits(Protocol):
    """The server settings a client connection reads."""

    @property
    def token(self) -> str | None: ...

    @property
    def max_frame(self) -> int: ...

    @property
    def login_frame(self) -> int: ...

    @property
    def session_timeout(self) -> float: ...

    @property
    def max_output(self) -> int: ...

    @property
    def max_connections(self) -> int: ...


class ServerView(Protocol):
    """What the server's client connections and its admin API both read of it."""

    @property
    def closing(self) -> bool: ...

    @property
    def storage(self) -> Store: ...

    def subscriptions(self) -> dict[tuple[str, str], Subscription]: ...

    def partition_of(self, served: str) -> tuple[str, int, int]: ...


class ConnectionHost(ServerView, Protocol):
    """What a client connection needs of its server, whichever protocol it speaks."""

    @property
    def config(self) -> _Limits: ...

    @property
    def protocol_errors(self) -> Counter[str]: ...

    def connected(self, connection: ClientConnection) -> bool: ...

    def disconnected(self, connection: ClientConnection) -> None: ...

    def opening(self, topic: str, name: str) -> bool: ...

    def check_served(self, served: str, action: str) -> tuple[int, int] | None: ...

    def check_produce(self, topic: str, messages: list[tuple[int | None, Key, bytes]]) -> None: ...

    async def open_subscription(self, topic: str, name: str, at_end: bool = False) -> Subscription: ...

    async def unsubscribe(self, subscription: Subscription) -> None: ...

    async def seek(self, topic: str, name: str, position: int) -> int: ...

    async def route(self, topic: str, pulsar: bool = False) -> list[str | None]: ...

    async def partition_count(self, topic: str) -> int | None: ...

    async def topic_names(self) -> list[str]: ...

    @property
    def pulsar_advertised(self) -> str | None: ...

    @property
    def pulsar_tls(self) -> bool: ...

    @property
    def pulsar_producers(self) -> dict[str, TopicProducers[ProducerHandle]]: ...

    def watch(self, served: str, watcher: TailWatcher) -> None: ...

    def unwatch(self, served: str, watcher: TailWatcher) -> None: ...

    def next_session_id(self) -> int: ...
