"""The native protocol's server side: one client connection, its frames served by the server's subscriptions."""

from __future__ import annotations

import asyncio
import hmac
import logging

from keyfailover.broker.server._connection import ConnectionHost, FrameReader
from keyfailover.broker.server._native_read import read_entries
from keyfailover.broker.server._subscription import Session
from keyfailover.broker.storage._store import NotServedError, Result, StoreUnavailableError
from keyfailover.core.errors import KeyFailoverError
from keyfailover.wire.protocol import (
    OLDEST_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Ack,
    Close,
    CloseConsumer,
    Connect,
    Connected,
    ConsumerClosed,
    Decoder,
    Error,
    ErrorCode,
    Extend,
    Flow,
    Frame,
    Lookup,
    Messages,
    Nack,
    Ping,
    Pong,
    Produce,
    ProtocolError,
    Read,
    Receipt,
    Route,
    Settled,
    Subscribe,
    Subscribed,
    encode,
    stream_transport,
)

__all__ = ["NativeConnection"]

_log = logging.getLogger("keyfailover.server")


def _refusal(exc: KeyFailoverError) -> ErrorCode:
    """The code refusing a request ``exc`` failed: ``store_unavailable``, retriable, when the store is out of
    reach; else ``invalid_message``."""
    return ErrorCode.STORE_UNAVAILABLE if isinstance(exc, StoreUnavailableError) else ErrorCode.INVALID_MESSAGE


class NativeConnection(FrameReader[Frame]):
    """One client connection: decodes frames, calls the subscriptions, writes replies."""

    _answered = (KeyFailoverError,)
    _internal_error = "internal server error; the connection is closed"

    def __init__(self, server: ConnectionHost) -> None:
        super().__init__()
        self._server = server
        config = server.config
        self._decoder = Decoder(min(config.login_frame, config.max_frame), accept="server")
        self.version = PROTOCOL_VERSION
        """The protocol version the client connected with (frames before ``connect`` are errors, the same in all)."""
        self._sessions: dict[int, Session] = {}
        self._refused: dict[tuple[str, str], int] = {}  # (topic, producer) -> first seq refused with not_owner

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Take the connection in, or refuse it with ``too_many_connections`` when the server has its maximum."""
        self._transport = stream = stream_transport(transport)
        self.peer = str(transport.get_extra_info("peername"))
        # Replies past the high-water mark pause reading from this client (pause_writing).
        stream.set_write_buffer_limits(high=1024 * 1024)
        if not self._server.connected(self):
            self._close_for(
                ErrorCode.TOO_MANY_CONNECTIONS,
                f"the server has its maximum of {self._server.config.max_connections} connections; try later",
            )

    def connection_lost(self, exc: Exception | None) -> None:
        """End the connection's consumer sessions: their unacked messages go to the keys' new owners."""
        self._closed = True
        self.expire_sessions("closed", notify=False)
        self._server.disconnected(self)

    # -- sending ---------------------------------------------------------------------

    def send(self, frame: Frame) -> None:
        """Write ``frame`` to the client. A connection whose unread replies pass ``max_output`` is dropped;
        deliveries do not count, as the consumer's permits bound them."""
        if type(frame) is Error:
            self._server.protocol_errors[frame.code] += 1
        elif type(frame) is ConsumerClosed:
            # The server ended the session (seek, partition moved, superseded, shutdown): forget it,
            # so it no longer holds its subscription (a seek replaces the subscription) in memory.
            self._sessions.pop(frame.session, None)
        transport = self._transport
        if not self._closed and transport is not None:
            transport.write(encode(frame, self.version))
            # Deliveries are bounded by the consumer's permits and the subscription's max_replay;
            # everything else is an answer the client asked for, and those may not pile up.
            if type(frame) is not Messages and transport.get_write_buffer_size() > self._server.config.max_output:
                _log.warning("closing %s: over %d bytes of replies unread", self.peer, self._server.config.max_output)
                self._server.protocol_errors[ErrorCode.SLOW_CONNECTION] += 1
                # Nothing more is written, and the buffer goes; the sessions end in
                # connection_lost, on the next turn of the loop, not inside a caller that may be
                # walking the subscription's sessions right now.
                self._closed = True
                transport.abort()

    def close(self) -> None:
        """Close the connection, ending its consumer sessions without telling them."""
        if self._transport is not None and not self._closed:
            self._closed = True
            self.expire_sessions("closed", notify=False)
            self._transport.close()

    def _close_for(self, code: ErrorCode, message: str) -> None:
        """Send a fatal ``error`` frame saying why, then close the connection."""
        self.send(Error(code=code, message=message, req=None))
        self.close()

    def refuse(self, code: ErrorCode, message: str) -> None:
        """Close the connection with a fatal ``error`` saying why (a limit it broke)."""
        _log.info("closing %s: %s", self.peer, message)
        self._close_for(code, message + "; the connection is closed")

    @property
    def closed(self) -> bool:
        """Closed by this side (its transport may still be sending what it had)."""
        return self._closed

    def sessions_open(self) -> int:
        """How many consumer sessions this connection has."""
        return len(self._sessions)

    def expire_sessions(self, reason: str, notify: bool = True) -> None:
        """End every consumer session of this connection for ``reason``, telling each with ``notify``."""
        for session in list(self._sessions.values()):
            session.subscription.detach(session, reason, notify=notify)
        self._sessions.clear()

    # -- frames ----------------------------------------------------------------------

    def _decode(self, data: bytes) -> tuple[list[Frame], int, tuple[ErrorCode, str] | None]:
        """The frames ``data`` completes, the bytes held of the next one, and the first bad frame's error."""
        frames, error = self._decoder.feed_partial(data)
        return frames, self._decoder.buffered, None if error is None else (error.code, error.message)

    def _answer(self, frame: Frame, exc: Exception) -> bool:
        """Answer ``frame`` with an ``error`` frame saying why it was refused; a fatal one closes the connection."""
        req = getattr(frame, "req", None)
        if not isinstance(exc, ProtocolError):
            self.send(Error(code=ErrorCode.INVALID_MESSAGE, message=str(exc), req=req))
            return True
        if exc.fatal:
            self._close_for(exc.code, exc.message)
            return False
        self.send(Error(code=exc.code, message=exc.message, req=req))
        return True

    def _frame_name(self, frame: Frame) -> str:
        """The frame's class name, for the log."""
        return type(frame).__name__

    def _handle(self, frame: Frame) -> None:
        """Serve one frame: produce, subscribe, lookup, read, ping, a consumer's ack, nack, extend or flow, close."""
        if isinstance(frame, Connect):
            self._connect(frame)
            return
        if not self.authenticated:
            raise ProtocolError(ErrorCode.NOT_CONNECTED, f"expected a connect frame first, got {frame.type!r}")
        if isinstance(frame, Ack | Nack | Extend | Flow):
            self._consumer_frame(frame)
        elif isinstance(frame, Produce):
            self._produce(frame)
        elif isinstance(frame, Subscribe):
            asyncio.get_running_loop().create_task(self._subscribe(frame))
        elif isinstance(frame, Lookup):
            asyncio.get_running_loop().create_task(self._lookup(frame))
        elif isinstance(frame, Read):
            asyncio.get_running_loop().create_task(self._read(frame))
        elif isinstance(frame, Ping):
            self.send(Pong(nonce=frame.nonce))
        elif isinstance(frame, CloseConsumer):
            session = self._session_for(frame.topic, frame.subscription, frame.session)
            self._sessions.pop(session.id, None)
            session.subscription.detach(session, "closed", req=frame.req)
        elif isinstance(frame, Close):
            self.close()
        else:
            raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"frame type {frame.type!r} is not accepted by the server")

    def _connect(self, frame: Connect) -> None:
        """Log the client in: check its protocol version and token, then raise the frame limit to ``max_frame``."""
        if self.authenticated:
            raise ProtocolError(ErrorCode.BAD_FIELD, "this connection already sent connect")
        if not OLDEST_PROTOCOL_VERSION <= frame.version <= PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.VERSION_MISMATCH,
                f"protocol version {frame.version} is not supported; expected {OLDEST_PROTOCOL_VERSION} to "
                f"{PROTOCOL_VERSION}",
            )
        token = self._server.config.token
        if token is not None and not hmac.compare_digest((frame.token or "").encode(), token.encode()):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "wrong or missing token")
        self.authenticated = True
        self.version = self._decoder.version = frame.version  # an older client's frames lack what its version does
        self._decoder.max_frame = self._server.config.max_frame
        self.send(
            Connected(
                version=frame.version,
                server="keyfailover",
                max_frame=self._server.config.max_frame,
                session_timeout=self._server.config.session_timeout,
            )
        )

    def _produce(self, frame: Produce) -> None:
        """Store a produce's messages and answer with a ``receipt`` of their positions once they are
        committed, or an ``error``: a topic not served here, a key of another partition, a failed append."""
        if self._server.closing:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the server is shutting down; nothing was stored")
        self._check_resend(frame)
        try:
            self._server.check_produce(frame.topic, frame.messages)
        except ProtocolError as exc:
            if exc.code == ErrorCode.NOT_OWNER:
                self._refuse_after(frame)
            raise
        future = self._server.storage.append(frame.topic, frame.producer, frame.messages, frame.properties)
        req = frame.req

        def answer(done: asyncio.Future[Result]) -> None:
            """Answer the produce once the append is done: its receipt, or why nothing was stored."""
            exc = done.exception()
            if exc is not None:
                if isinstance(exc, NotServedError | StoreUnavailableError):
                    self._refuse_after(frame)
                if isinstance(exc, NotServedError):
                    code = ErrorCode.NOT_OWNER
                else:
                    code = _refusal(exc) if isinstance(exc, KeyFailoverError) else ErrorCode.INTERNAL
                self.send(Error(code=code, message=str(exc), req=req))
                return
            result = done.result()
            self.send(Receipt(req=req, positions=[p for p, _ in result], duplicates=[dup for _, dup in result]))

        future.add_done_callback(answer)

    def _refuse_after(self, frame: Produce) -> None:
        """A named producer's produce was refused with ``not_owner`` or ``store_unavailable``: refuse its later
        ones on this connection too, until it resends from the refused one. A later batch stored while an earlier
        one waits for its resend would take its sequence ids out of order (and the resend would then
        be dropped as a duplicate of ids never stored)."""
        if frame.producer is not None and frame.messages and frame.messages[0][0] is not None:
            self._refused.setdefault((frame.topic, frame.producer), frame.messages[0][0])

    def _check_resend(self, frame: Produce) -> None:
        """Refuse a produce that skips over a refused one of its producer (see :meth:`_refuse_after`)."""
        if frame.producer is None or not self._refused:
            return
        key = (frame.topic, frame.producer)
        refused = self._refused.get(key)
        if refused is None:
            return
        first = frame.messages[0][0] if frame.messages else None
        if first is not None and first <= refused:
            del self._refused[key]  # the resend: from here on in order again
            return
        raise ProtocolError(
            ErrorCode.NOT_OWNER,
            f"an earlier produce of {frame.producer!r} to {frame.topic!r} (sequence id {refused}) was refused; "
            "nothing was stored: resend from that one, in order, to the partition's broker",
        )

    async def _subscribe(self, frame: Subscribe) -> None:
        """Attach a new consumer session to the subscription and answer ``subscribed`` with its ranges."""
        try:
            subscription = await self._server.open_subscription(frame.topic, frame.subscription)
            if self._closed:
                return
            session = Session(
                self._server.next_session_id(),
                frame.consumer,
                subscription,
                self.send,
                sub_type=frame.subscription_type,
                priority=frame.priority_level,
            )
            # Deliveries happen only in the subscription's pump task, so Subscribed, sent
            # right after the attach, reaches the client before any message of the session.
            subscription.attach(session, frame.receiver_queue, frame.secret)
            self._sessions[session.id] = session
            self.send(
                Subscribed(
                    req=frame.req,
                    session=session.id,
                    consumer=frame.consumer,
                    ranges=session.ranges,
                    secret=session.secret,
                )
            )
        except ProtocolError as exc:
            self.send(Error(code=exc.code, message=exc.message, req=frame.req))
        except KeyFailoverError as exc:
            self.send(Error(code=_refusal(exc), message=str(exc), req=frame.req))

    async def _lookup(self, frame: Lookup) -> None:
        """Answer ``route``: the broker serving each partition of the topic."""
        try:
            brokers = await self._server.route(frame.topic)
            self.send(Route(req=frame.req, topic=frame.topic, brokers=brokers))
        except ProtocolError as exc:
            self.send(Error(code=exc.code, message=exc.message, req=frame.req))
        except KeyFailoverError as exc:
            self.send(Error(code=_refusal(exc), message=str(exc), req=frame.req))

    async def _read(self, frame: Read) -> None:
        """Answer ``entries``: the stored messages of the topic after the read's position, and where the log ends."""
        try:
            entries = await read_entries(self._server, frame, self._server.config.max_frame)
        except ProtocolError as exc:
            self.send(Error(code=exc.code, message=exc.message, req=frame.req))
            return
        except KeyFailoverError as exc:
            self.send(Error(code=_refusal(exc), message=str(exc), req=frame.req))
            return
        except Exception:  # a fault of the log: the reader is told, the connection goes on
            _log.exception("read of %r after position %d failed", frame.topic, frame.after)
            self.send(Error(code=ErrorCode.INTERNAL, message="the log failed to read; nothing was read", req=frame.req))
            return
        self.send(entries)

    def _session_for(self, topic: str, name: str, session_id: int) -> Session:
        """This connection's live session ``session_id`` of subscription ``name`` of ``topic``, or the
        :class:`ProtocolError` saying why there is none: unknown topic, subscription or session, not served here."""
        subscription = self._server.subscriptions().get((topic, name))
        if subscription is None:
            if self._server.opening(topic, name):
                raise ProtocolError(
                    ErrorCode.UNKNOWN_SESSION,
                    f"session {session_id} of {topic!r}/{name!r} has ended: the subscription is being opened "
                    "again (a seek); nothing was changed, its messages come again to the consumer's next session",
                )
            if not self._server.storage.serves(topic):
                raise ProtocolError(
                    ErrorCode.NOT_OWNER, f"this broker does not serve {topic!r} now; look the topic up again"
                )
            known = self._server.storage.last_position(topic) or any(
                t == topic for t, _ in self._server.subscriptions()
            )
            if not known:
                raise ProtocolError(ErrorCode.UNKNOWN_TOPIC, f"topic {topic!r} does not exist")
            raise ProtocolError(ErrorCode.UNKNOWN_SUBSCRIPTION, f"subscription {name!r} of {topic!r} does not exist")
        session = self._sessions.get(session_id)
        if (
            session is None
            or session.subscription is not subscription
            or subscription.current(session.consumer, session_id) is None
        ):
            raise ProtocolError(
                ErrorCode.UNKNOWN_SESSION,
                f"session {session_id} is not a live session of {topic!r}/{name!r} on this connection "
                "(closed, timed out or superseded); nothing was changed",
            )
        return session

    def _consumer_frame(self, frame: Ack | Nack | Extend | Flow) -> None:
        """Apply a consumer's ack, nack, extend or flow to its session; positions not in flight are
        refused with ``not_in_flight``, or ``lease_expired`` when their lease ran out, and the rest taken."""
        session = self._session_for(frame.topic, frame.subscription, frame.session)
        subscription = session.subscription
        if isinstance(frame, Flow):
            subscription.flow(session, frame.permits)
            return
        if subscription.paused():
            raise ProtocolError(
                ErrorCode.NOT_IN_FLIGHT,
                f"{frame.type} of {len(frame.positions)} position(s) rejected: this broker paused "
                f"{subscription.topic!r} (its lease lapsed: no answer from ZooKeeper); nothing was taken, "
                "the messages come again",
            )
        if isinstance(frame, Ack):
            rejected = subscription.ack(session, frame.positions)
        elif isinstance(frame, Nack):
            rejected = subscription.nack(session, frame.positions)
        else:
            rejected = subscription.extend(session, frame.positions)
        if rejected:
            late = [p for p in rejected if subscription.lease_expired(session, p)]
            shown = ", ".join(str(p) for p in rejected[:10]) + (" ..." if len(rejected) > 10 else "")
            if late:
                raise ProtocolError(
                    ErrorCode.LEASE_EXPIRED,
                    f"{frame.type} of position(s) {shown} rejected on session {session.id}: "
                    f"{len(late)} of them were taken back when their lease expired (ack_timeout "
                    f"{subscription.dispatcher.ack_timeout:g} s) and are delivered again; "
                    "the others were accepted",
                )
            raise ProtocolError(
                ErrorCode.NOT_IN_FLIGHT,
                f"{frame.type} of position(s) {shown} rejected: not in flight on session {session.id}",
            )
        if frame.req is not None:
            self.send(Settled(req=frame.req))
