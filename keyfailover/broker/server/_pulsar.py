"""The Pulsar protocol endpoint: an unmodified Pulsar client's connection, served by keyfailover's subscriptions.

Each connection adapts Pulsar commands to the paths the native protocol takes: a SEND is a
produce of a named producer with its sequence ids (dedup on reconnect), a SUBSCRIBE attaches a
:class:`Session` to the same :class:`Subscription`, FLOW grants its permits, ACK and
REDELIVER_UNACKNOWLEDGED_MESSAGES ack and nack its positions. A message's id is ledger 0,
entry = its log position. Producer dedup runs per producer name and sequence id, as for native producers;
producer access modes run per topic (partition) on the server that serves it (``_pulsar_access``).
docs/pulsar.md says what is served, what is refused and why.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final

from keyfailover.broker.pulsar import (
    MAX_FRAME_PADDING,
    PROTOCOL_VERSION,
    SERVER_NAME,
    PulsarDecoder,
    PulsarFrame,
    SendFrame,
    encode_command,
    encode_delivery,
    encode_receipt,
    keyfailover_topic,
)
from keyfailover.broker.pulsar.PulsarApi_pb2 import (
    AuthenticationError,
    BaseCommand,
    ChecksumError,
    CommandAck,
    CommandGetOrCreateSchema,
    CommandGetSchema,
    CommandGetTopicsOfNamespace,
    CommandLookupTopic,
    CommandPartitionedTopicMetadata,
    CommandSubscribe,
    ConsumerBusy,
    ConsumerNotFound,
    KeySharedMode,
    MetadataError,
    NotAllowedError,
    PersistenceError,
    ProducerFenced,
    ServiceNotReady,
    UnknownError,
)
from keyfailover.broker.server._connection import ConnectionHost, FrameReader
from keyfailover.broker.server._pulsar_access import TopicProducers
from keyfailover.broker.server._pulsar_errors import RefusedError, server_error
from keyfailover.broker.server._pulsar_lookup import lookup, partitioned_metadata, topics_of_namespace
from keyfailover.broker.server._pulsar_reader import PulsarReader
from keyfailover.broker.server._pulsar_schema import consumer_schema, get_or_create_schema, get_schema, producer_schema
from keyfailover.broker.server._pulsar_send import Producer, Send, joined, sent_messages
from keyfailover.broker.server._subscription import Session, Subscription
from keyfailover.broker.storage._store import NotServedError, Result, StoreUnavailableError
from keyfailover.core.errors import ErrorCode, KeyFailoverError
from keyfailover.core.subtypes import SINGLE_ACTIVE, SubscriptionType
from keyfailover.wire.protocol import ConsumerClosed, Frame, Messages, is_valid_name, stream_transport

__all__ = ["OpenProducer", "PulsarConnection"]

_log = logging.getLogger("keyfailover.server")

_MAX_OPEN: Final = 1000
"""Producers, consumers, and requests being answered, one connection may have at once (each costs memory)."""
_MINUS_ONE: Final = 2**64 - 1
"""-1 in an unsigned 64-bit field, as Apache Pulsar's Java broker writes a long -1 there (read back as -1):
the request id of a command the broker sends unasked, and the ledger and entry of ``MessageId.earliest``."""
_LATEST: Final = 2**63 - 1
"""The ledger of ``MessageId.latest`` (Long.MAX_VALUE)."""
_ACTIVE_CONSUMER_CHANGE_VERSION: Final = 12
"""The protocol version that brought ACTIVE_CONSUMER_CHANGE."""
_SUB_TYPES: Final[dict[int, SubscriptionType]] = {
    CommandSubscribe.Exclusive: "exclusive",
    CommandSubscribe.Failover: "failover",
    CommandSubscribe.Shared: "shared",
    CommandSubscribe.Key_Shared: "key_shared",
}
"""keyfailover's name of each Pulsar subscription type."""


@dataclass
class _Consumer:
    session: Session
    partition: int
    unacked: dict[int, int] = field(default_factory=dict)
    """Positions delivered and not acked or nacked through this consumer (what a bare redeliver gives back), each
    with when it was last sent, counted in ``sent``: what a cumulative ack covers."""
    sent: int = 0
    """Messages sent to this consumer so far."""

    def settled(self, positions: list[int]) -> None:
        """``positions`` were acked or nacked through this consumer: out with it no more, unless its subscription
        is paused (a cluster broker without its lease), which took none of them."""
        if not self.session.subscription.paused():
            for position in positions:
                self.unacked.pop(position, None)


@dataclass(eq=False)
class OpenProducer:
    """A producer open, or waiting for exclusive access, on a Pulsar connection: what its topic's access modes
    (:class:`TopicProducers`) hold, one object per producer, compared by identity."""

    connection: PulsarConnection
    producer_id: int
    request_id: int
    """The PRODUCER request a waiting producer is answered on once granted."""
    producer: Producer
    last_sequence: int
    """The last sequence id the log held for its name when it asked."""
    schema_version: bytes | None = None
    """The version of its topic's schema it produces with (``_pulsar_schema``); None: it has no schema."""

    @property
    def name(self) -> str:
        """The producer's name."""
        return self.producer.name

    def fenced(self) -> None:
        """Fenced out by an ExclusiveWithFencing producer: see :meth:`PulsarConnection._fence`."""
        self.connection._fence(self)

    def refused(self, why: str) -> None:
        """Can wait for exclusive access no more: see :meth:`PulsarConnection._refuse_waiting`."""
        self.connection._refuse_waiting(self, why)

    def granted(self, epoch: int) -> None:
        """Granted exclusive access after waiting: see :meth:`PulsarConnection._grant`."""
        self.connection._grant(self, epoch)


def _command(kind: int) -> BaseCommand:
    """A new command of type ``kind``."""
    return BaseCommand(type=kind)  # type: ignore[arg-type]


def _request_id(command: BaseCommand) -> int | None:
    """The request id of a command's body, when it has one."""
    for descriptor, body in command.ListFields():
        body_type = descriptor.message_type
        if body_type is not None and "request_id" in body_type.fields_by_name and body.HasField("request_id"):
            return int(body.request_id)
    return None


class PulsarConnection(FrameReader[PulsarFrame | SendFrame]):
    """One Pulsar client connection: decodes commands, calls the server's subscriptions, writes replies."""

    _answered = (RefusedError,)

    def __init__(self, server: ConnectionHost) -> None:
        super().__init__()
        self._server = server
        config = server.config
        self._decoder = PulsarDecoder(min(config.login_frame, config.max_frame))
        self.version = 0
        """The protocol version agreed at CONNECT: the lower of the client's and :data:`PROTOCOL_VERSION`."""
        self._producers: dict[int, Producer] = {}  # the producers that may send, by producer id
        self._handles: dict[int, OpenProducer] = {}  # those and the ones waiting for exclusive access
        # Producers fenced out by an exclusive one, by id: their SENDs still on the way are dropped unanswered,
        # as Apache Pulsar drops those of a producer it closed (the client fails them itself).
        self._fenced: dict[int, None] = {}
        self._consumers: dict[int, _Consumer] = {}
        # Whether a consumer being opened is active, told while it joined: sent after its SUBSCRIBE's SUCCESS.
        self._early_active: dict[int, bool] = {}
        self._readers: dict[int, PulsarReader] = {}  # non-durable Exclusive subscriptions, by consumer id
        # Readers that seeked, by consumer id: their topic and the position their next SUBSCRIBE starts after.
        self._reader_seeks: dict[int, tuple[str, int]] = {}
        self._keepalive: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._output: list[bytes] = []
        self._sends: list[Send] = []  # checked SENDs of the read being handled
        self._last_store: asyncio.Future[Result] | None = None  # the latest store request of SENDs
        self._replied = False  # whether what is queued holds a reply, not only deliveries

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Take the connection in and start its keepalive, or close it when the server has its maximum."""
        self._transport = stream = stream_transport(transport)
        self.peer = str(transport.get_extra_info("peername"))
        stream.set_write_buffer_limits(high=1024 * 1024)
        if not self._server.connected(self):
            _log.info("closing Pulsar connection %s: the server has its maximum of connections", self.peer)
            self._closed = True
            stream.close()
            return
        self._schedule_keepalive()

    def _decode(self, data: bytes) -> tuple[list[PulsarFrame | SendFrame], int, tuple[ErrorCode, str] | None]:
        """The frames ``data`` completes, the bytes held of the next one, and the first bad frame's error."""
        frames, error = self._decoder.feed(data)
        if error is None:
            return frames, self._decoder.buffered, None
        code = ErrorCode.FRAME_TOO_LARGE if error.too_large else ErrorCode.MALFORMED_FRAME
        return frames, self._decoder.buffered, (code, str(error))

    def _answer(self, frame: PulsarFrame | SendFrame, exc: Exception) -> bool:
        """Answer a refused command with ERROR when it has a request id; a SEND was answered as it was read."""
        request_id = None if isinstance(frame, SendFrame) else _request_id(frame.command)
        if request_id is not None:
            self._error(request_id, *server_error(exc))
        return True

    def _frame_name(self, frame: PulsarFrame | SendFrame) -> str:
        """The command's type, for the log."""
        return "Pulsar " + ("SEND" if isinstance(frame, SendFrame) else _type_name(frame.command))

    def _frames_handled(self) -> None:
        """Store the SENDs of the read, in runs: see :meth:`_store_sends`."""
        if self._sends:
            self._store_sends()

    def _close_for(self, code: ErrorCode, message: str) -> None:
        """Close the connection: see :meth:`refuse`."""
        self.refuse(code, message)

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the keepalive and end the connection's consumer sessions and readers."""
        self._closed = True
        if self._keepalive is not None:
            self._keepalive.cancel()
        self.expire_sessions("closed", notify=False)
        for handle in list(self._handles.values()):
            self._release(handle)
        self._server.disconnected(self)

    # -- ClientConnection --------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Closed by this side."""
        return self._closed

    def close(self) -> None:
        """Write what is queued, then close the connection, ending its sessions without telling them."""
        if self._transport is not None and not self._closed:
            self._flush()  # an ERROR just queued goes out before the connection closes
            self._closed = True
            self.expire_sessions("closed", notify=False)
            self._transport.close()

    def refuse(self, code: ErrorCode, message: str) -> None:
        """Close the connection because it broke the protocol or a limit (Pulsar has no error frame for that)."""
        _log.info("closing Pulsar connection %s: %s", self.peer, message)
        self._server.protocol_errors[code] += 1
        self.close()

    def sessions_open(self) -> int:
        """How many consumers and readers this connection has."""
        return len(self._consumers) + len(self._readers)

    def expire_sessions(self, reason: str, notify: bool = True) -> None:
        """End every consumer session and reader; with ``notify`` each client consumer is sent CLOSE_CONSUMER
        (it subscribes again), by :meth:`_deliver` as the subscription tells the session."""
        for consumer_id, consumer in list(self._consumers.items()):
            consumer.session.subscription.detach(consumer.session, reason, notify=notify)
            self._consumers.pop(consumer_id, None)
        for reader in list(self._readers.values()):
            self._drop_reader(reader)
            if notify:
                self._tell_closed(reader.consumer_id)

    # -- sending ---------------------------------------------------------------------

    def _write(self, data: bytes, reply: bool = True) -> None:
        """Queue ``data``; what one turn of the event loop queues goes out in one write (a receipt per
        message would otherwise cost a system call each)."""
        if self._closed or self._transport is None:
            return
        if not self._output:
            asyncio.get_running_loop().call_soon(self._flush)
        self._output.append(data)
        self._replied = self._replied or reply

    def _flush(self) -> None:
        """Write what is queued; a connection whose unread replies (not deliveries, which its permits bound)
        pass ``max_output`` is dropped."""
        transport = self._transport
        if self._closed or transport is None or not self._output:
            return
        transport.write(b"".join(self._output))
        self._output.clear()
        replied, self._replied = self._replied, False
        if replied and transport.get_write_buffer_size() > self._server.config.max_output:
            _log.warning(
                "closing Pulsar connection %s: over %d bytes of replies unread",
                self.peer,
                self._server.config.max_output,
            )
            self._server.protocol_errors[ErrorCode.SLOW_CONNECTION] += 1
            self._closed = True
            transport.abort()

    def _send(self, command: BaseCommand) -> None:
        """Queue ``command``, a reply, for the next write."""
        self._write(encode_command(command))

    def _error(self, request_id: int, error: int, message: str) -> None:
        """Answer request ``request_id`` with ERROR: the ServerError ``error`` and ``message``."""
        command = _command(BaseCommand.ERROR)
        command.error.request_id = request_id
        command.error.error = error  # type: ignore[assignment]
        command.error.message = message
        self._send(command)

    def _success(self, request_id: int) -> None:
        """Answer request ``request_id`` with SUCCESS."""
        command = _command(BaseCommand.SUCCESS)
        command.success.request_id = request_id
        self._send(command)

    def _schedule_keepalive(self) -> None:
        """Check again for a quiet client in a third of the session timeout."""
        interval = self._server.config.session_timeout / 3
        self._keepalive = asyncio.get_running_loop().call_later(interval, self._ping, interval)

    def _ping(self, interval: float) -> None:
        """PING a logged-in client quiet for ``interval``: its PONG keeps its sessions alive (Pulsar clients
        ping only every 30 s by default, longer than a session timeout may be)."""
        if self._closed:
            return
        if self.authenticated and time.monotonic() - self.last_seen >= interval:
            ping = _command(BaseCommand.PING)
            ping.ping.SetInParent()
            self._send(ping)
        self._schedule_keepalive()

    def _deliver(self, consumer_id: int, frame: Frame) -> None:
        """What a subscription sends its session, as the Pulsar client expects it."""
        consumer = self._consumers.get(consumer_id)
        if consumer is None:
            return
        if isinstance(frame, Messages):
            chunks = []
            partition = consumer.partition
            unacked, sent = consumer.unacked, consumer.sent
            for position, key, payload, redeliveries, published, properties, producer in frame.messages:
                chunks.append(
                    encode_delivery(
                        consumer_id,
                        partition,
                        position,
                        key,
                        payload,
                        redeliveries=redeliveries,
                        published=published,
                        properties=properties,
                        producer=producer,
                    )
                )
                sent += 1
                unacked[position] = sent
            consumer.sent = sent
            # Deliveries are bounded by the consumer's permits, not by max_output.
            self._write(b"".join(chunks), reply=False)
        elif isinstance(frame, ConsumerClosed):
            # The server ended the session (timeout, shutdown, partition moved): the client resubscribes.
            del self._consumers[consumer_id]
            self._tell_closed(consumer_id)
        # RangesChanged: Pulsar clients are not told their hash ranges under AUTO_SPLIT.

    def _tell_active(self, consumer_id: int, active: bool) -> None:
        """ACTIVE_CONSUMER_CHANGE: whether the consumer is its Exclusive or Failover subscription's active one (a
        consumer still being opened is told after its SUCCESS). One that stands down keeps what was delivered to
        it until it acks it (:meth:`_drained`)."""
        consumer = self._consumers.get(consumer_id)
        if consumer is None:
            self._early_active[consumer_id] = active
            return
        if self.version < _ACTIVE_CONSUMER_CHANGE_VERSION:
            return
        command = _command(BaseCommand.ACTIVE_CONSUMER_CHANGE)
        command.active_consumer_change.consumer_id = consumer_id
        command.active_consumer_change.is_active = active
        self._send(command)

    def _drained(self, consumer_id: int) -> None:
        """A Failover consumer that stood down has nothing in flight any more and left the dispatcher: what it
        was sent is not out with it any more (acked, or taken back)."""
        consumer = self._consumers.get(consumer_id)
        if consumer is not None:
            consumer.unacked.clear()

    def _tell_closed(self, consumer_id: int) -> None:
        """CLOSE_CONSUMER from the server: the client's consumer subscribes again (after a lookup)."""
        command = _command(BaseCommand.CLOSE_CONSUMER)
        command.close_consumer.consumer_id = consumer_id
        command.close_consumer.request_id = _MINUS_ONE
        self._send(command)

    def _drop_reader(self, reader: PulsarReader) -> None:
        """Stop ``reader`` and forget it: it reads and watches its topic no more."""
        reader.close()
        self._readers.pop(reader.consumer_id, None)
        self._server.unwatch(reader.topic, reader)

    def _reader_ended(self, reader: PulsarReader) -> None:
        """``reader`` can go on no more here (its topic moved, the log failed): the client subscribes again."""
        if self._readers.get(reader.consumer_id) is reader:
            self._drop_reader(reader)
            self._tell_closed(reader.consumer_id)

    # -- commands --------------------------------------------------------------------

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Answer a request in a task of its own; refused with ServiceNotReady while :data:`_MAX_OPEN`
        requests of this connection are being answered."""
        if len(self._tasks) >= _MAX_OPEN:
            work.close()
            raise RefusedError(
                ServiceNotReady, f"{_MAX_OPEN} requests of this connection are being answered; expected fewer at once"
            )
        task = asyncio.get_running_loop().create_task(self._guarded(work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guarded(self, work: Coroutine[Any, Any, None]) -> None:
        """Run a request's task; a bug in it closes this connection (logged), not the server."""
        try:
            await work
        except Exception:
            _log.exception("internal error serving a Pulsar request from %s", self.peer)
            self.refuse(ErrorCode.INTERNAL, "internal server error")

    def _handle(self, frame: PulsarFrame | SendFrame) -> None:
        """Serve one command: a SEND or CONNECT here, any other by its handler in :attr:`_handlers`;
        before CONNECT, anything else closes the connection."""
        if isinstance(frame, SendFrame):
            if self.authenticated:
                self._send_command(frame)
            else:
                self.refuse(ErrorCode.NOT_CONNECTED, "expected CONNECT first, got SEND")
            return
        command = frame.command
        kind = command.type
        if kind == BaseCommand.CONNECT:
            self._connect(command)
            return
        if not self.authenticated:
            self.refuse(ErrorCode.NOT_CONNECTED, f"expected CONNECT first, got {_type_name(command)}")
            return
        handler = self._handlers.get(kind)
        if handler is None:
            raise RefusedError(
                NotAllowedError,
                f"{_type_name(command)} is not supported by keyfailover's Pulsar endpoint; docs/pulsar.md lists "
                "the commands it serves",
            )
        handler(self, frame)

    def _connect(self, command: BaseCommand) -> None:
        """Log the client in: check its token, agree on the protocol version and raise the frame limit to
        ``max_frame``; a wrong token is answered with ERROR and closes the connection."""
        if self.authenticated:
            self.refuse(ErrorCode.BAD_FIELD, "a second CONNECT on one connection")
            return
        connect = command.connect
        token = self._server.config.token
        if token is not None:
            given = connect.auth_data if connect.auth_method_name == "token" else b""
            if not hmac.compare_digest(given, token.encode()):
                method = connect.auth_method_name or "none"
                self._error(
                    _MINUS_ONE,
                    AuthenticationError,
                    f"wrong or missing token (authentication method {method!r}); expected the server's token with "
                    "AuthenticationToken",
                )
                self.refuse(ErrorCode.UNAUTHORIZED, "wrong or missing token")
                return
        self.authenticated = True
        self.version = min(connect.protocol_version, PROTOCOL_VERSION)
        max_frame = self._server.config.max_frame
        self._decoder.max_frame = max_frame
        reply = _command(BaseCommand.CONNECTED)
        reply.connected.server_version = SERVER_NAME
        reply.connected.protocol_version = self.version
        reply.connected.max_message_size = max(max_frame - MAX_FRAME_PADDING, 1)
        self._send(reply)

    def _ping_command(self, frame: PulsarFrame) -> None:
        """Answer the client's PING with PONG."""
        pong = _command(BaseCommand.PONG)
        pong.pong.SetInParent()
        self._send(pong)

    def _pong(self, frame: PulsarFrame) -> None:
        """The answer to our keepalive PING: its arrival already counted as a sign of life."""

    def _partitioned_metadata(self, frame: PulsarFrame) -> None:
        """PARTITIONED_METADATA: how many partitions a topic has, answered in a task."""
        self._spawn(self._answer_partitioned_metadata(frame.command.partitionMetadata))

    async def _answer_partitioned_metadata(self, request: CommandPartitionedTopicMetadata) -> None:
        """Send the PARTITIONED_METADATA_RESPONSE: see :func:`partitioned_metadata`."""
        self._send(await partitioned_metadata(self._server, request))

    def _lookup(self, frame: PulsarFrame) -> None:
        """LOOKUP: which broker serves a topic, answered in a task."""
        self._spawn(self._answer_lookup(frame.command.lookupTopic))

    async def _answer_lookup(self, request: CommandLookupTopic) -> None:
        """Send the LOOKUP_RESPONSE: see :func:`lookup`. Connect answers the address the client reached."""
        assert self._transport is not None
        here = self._transport.get_extra_info("sockname")[:2]
        self._send(await lookup(self._server, request, (str(here[0]), int(here[1]))))

    def _topics_of_namespace(self, frame: PulsarFrame) -> None:
        """GET_TOPICS_OF_NAMESPACE: the topics a pattern consumer may match, answered in a task."""
        self._spawn(self._answer_topics_of_namespace(frame.command.getTopicsOfNamespace))

    async def _answer_topics_of_namespace(self, request: CommandGetTopicsOfNamespace) -> None:
        """Send the GET_TOPICS_OF_NAMESPACE_RESPONSE: see :func:`topics_of_namespace`."""
        self._send(await topics_of_namespace(self._server, request))

    def _producer(self, frame: PulsarFrame) -> None:
        """PRODUCER: open a producer, answered in a task once its last stored sequence id is read."""
        _check_room("producers", self._handles, frame.command.producer.producer_id)
        self._spawn(self._open_producer(frame.command))

    async def _open_producer(self, command: BaseCommand) -> None:
        """Open the producer a PRODUCER asks for on a topic served here, in the access mode it asks for, and
        answer PRODUCER_SUCCESS with the last sequence id stored for its name and the version of its schema
        (:func:`producer_schema`; not ready yet for one that waits for exclusive access), or ERROR."""
        request = command.producer
        try:
            topic = keyfailover_topic(request.topic)
            name = request.producer_name if request.HasField("producer_name") else f"pulsar-{secrets.token_hex(8)}"
            if not is_valid_name(name):
                raise RefusedError(UnknownError, f"producer name {name!r:.80} must be 1 to 256 characters without NUL")
            if self._server.closing:
                raise RefusedError(ServiceNotReady, "the server is shutting down")
            self._server.check_served(topic, "produce to")
            last = await self._server.storage.last_sequence(topic, name)
            schema_version = await producer_schema(self._server, topic, request)
            if self._closed:
                return
            handle = self._handles.get(request.producer_id)
            if handle is not None and (handle.producer.topic, handle.name) != (topic, name):
                raise RefusedError(
                    UnknownError,
                    f"producer id {request.producer_id} is open already on this connection for another topic or name",
                )
        except (RefusedError, KeyFailoverError) as exc:
            self._error(request.request_id, *server_error(exc))
            return
        # A PRODUCER repeated for an open producer (a client's retry) is answered as the first one.
        if handle is None:
            handle = OpenProducer(
                self, request.producer_id, request.request_id, Producer(topic, name, self._partition(topic)), last
            )
        handle.schema_version = schema_version
        producers = self._server.pulsar_producers.setdefault(topic, TopicProducers())
        epoch = request.topic_epoch if request.HasField("topic_epoch") else None
        admission = producers.add(handle, request.producer_access_mode, epoch)
        if not (admission.granted or admission.queued):
            if not len(producers) and not producers.epoch:
                del self._server.pulsar_producers[topic]
            self._error(request.request_id, admission.error, admission.message)
            return
        self._handles[request.producer_id] = handle
        self._fenced.pop(request.producer_id, None)
        for fenced in admission.closed:
            fenced.fenced()
        for waiting in admission.refused:
            waiting.refused(f"fenced out by the ExclusiveWithFencing producer {name!r:.80}")
        handle.request_id = request.request_id
        if admission.queued:
            self._producer_success(handle, None, ready=False)
        else:
            self._producers[request.producer_id] = handle.producer
            self._producer_success(handle, admission.epoch)

    def _producer_success(self, handle: OpenProducer, epoch: int | None, ready: bool = True) -> None:
        """Answer ``handle``'s PRODUCER with PRODUCER_SUCCESS: the topic ``epoch`` for an exclusive producer, and
        ``ready`` False for one queued for exclusive access (the client then waits for the second answer)."""
        reply = _command(BaseCommand.PRODUCER_SUCCESS)
        success = reply.producer_success
        success.request_id = handle.request_id
        success.producer_name = handle.name
        success.last_sequence_id = handle.last_sequence
        success.producer_ready = ready
        if epoch is not None:
            success.topic_epoch = epoch
        if handle.schema_version is not None:
            success.schema_version = handle.schema_version
        self._send(reply)

    def _release(self, handle: OpenProducer) -> None:
        """Forget ``handle`` here and in its topic's access modes; a producer waiting for exclusive access that
        gets it now is answered on its own connection."""
        if self._handles.get(handle.producer_id) is handle:
            del self._handles[handle.producer_id]
            if self._producers.get(handle.producer_id) is handle.producer:
                del self._producers[handle.producer_id]
        topic = handle.producer.topic
        producers = self._server.pulsar_producers.get(topic)
        if producers is None:
            return
        promotion = producers.remove(handle)
        for waiting, why in promotion.refused:
            waiting.refused(why)
        if promotion.granted is not None:
            promotion.granted.granted(promotion.epoch)
        if not len(producers) and not producers.epoch:
            del self._server.pulsar_producers[topic]

    def _fence(self, handle: OpenProducer) -> None:
        """``handle`` was fenced out by an ExclusiveWithFencing producer: it is closed (CLOSE_PRODUCER tells the
        client, whose reconnection with its old topic epoch is then refused), and its SENDs still on the way
        are dropped."""
        if self._handles.get(handle.producer_id) is not handle:
            return
        del self._handles[handle.producer_id]
        self._producers.pop(handle.producer_id, None)
        self._fenced[handle.producer_id] = None
        if len(self._fenced) > _MAX_OPEN:
            del self._fenced[next(iter(self._fenced))]
        command = _command(BaseCommand.CLOSE_PRODUCER)
        command.close_producer.producer_id = handle.producer_id
        command.close_producer.request_id = _MINUS_ONE
        self._send(command)

    def _grant(self, handle: OpenProducer, epoch: int) -> None:
        """``handle``, which waited for exclusive access, has it now: it may send, and its PRODUCER is answered."""
        if self._handles.get(handle.producer_id) is handle:
            self._producers[handle.producer_id] = handle.producer
            self._producer_success(handle, epoch)

    def _refuse_waiting(self, handle: OpenProducer, why: str) -> None:
        """Refuse the PRODUCER of ``handle``, which waited for exclusive access, with ``ProducerFenced``."""
        if self._handles.get(handle.producer_id) is handle:
            del self._handles[handle.producer_id]
            self._error(handle.request_id, ProducerFenced, why)

    def _partition(self, topic: str) -> int:
        """The partition index message ids carry for ``topic``: -1 unless it is a partition."""
        _, index, count = self._server.partition_of(topic)
        return index if count > 1 else -1

    def _send_command(self, frame: SendFrame) -> None:
        """Read a SEND into keyfailover messages and queue it for the read's store request; a SEND that
        cannot be stored is answered with SEND_ERROR at once."""
        producer = self._producers.get(frame.producer_id)
        if producer is None and frame.producer_id in self._fenced:
            return  # the client fails it itself once it learns the producer was fenced out
        try:
            if producer is None:
                raise RefusedError(UnknownError, f"producer id {frame.producer_id} is not open on this connection")
            messages, properties = sent_messages(frame, self._server.config.max_frame - MAX_FRAME_PADDING)
            if self._server.closing:
                raise RefusedError(ServiceNotReady, "the server is shutting down; nothing was stored")
        except (RefusedError, KeyFailoverError) as exc:
            # ChecksumError fails this message at the client; any other error makes it reconnect and resend.
            self._refuse_send(frame.producer_id, frame.sequence_id, *server_error(exc))
            return
        first, last = messages[0][0], messages[-1][0]
        self._sends.append(
            (frame, producer, messages, -1 if first is None else first, -1 if last is None else last, properties)
        )

    def _store_sends(self) -> None:
        """Store the SENDs of one read: a producer's SENDs in a row go in one store request while their
        sequence ids rise (a key-based batcher's may not), answered together when it is stored. A SEND without
        sequence ids (a chunk but the last) is stored alone, without the producer's name: no dedup."""
        sends, self._sends = self._sends, []
        runs: list[list[Send]] = []
        last: dict[int, list[Send]] = {}  # the run each producer id is filling
        for send in sends:
            frame, producer, _, first_seq, _, _ = send
            run = last.get(frame.producer_id)
            if run is None or run[-1][1] is not producer or run[-1][4] >= first_seq or run[-1][4] < 0:
                run = last[frame.producer_id] = []
                runs.append(run)
            run.append(send)
        for run in runs:
            try:
                self._server.check_produce(run[0][1].topic, joined(run)[0])
            except KeyFailoverError:
                self._store_checked(run)
            else:
                self._store(run)

    def _store(self, run: list[Send]) -> None:
        """Store the SENDs of ``run`` in one request, each answered when it is stored."""
        producer = run[0][1]
        messages, properties = joined(run)
        name = producer.name if run[0][3] >= 0 else None
        stored = self._server.storage.append(producer.topic, name, messages, properties)
        stored.add_done_callback(functools.partial(self._receipts, run))
        self._last_store = stored

    def _refuse_send(self, producer_id: int, sequence_id: int, error: int, message: str) -> None:
        """Answer a SEND with SEND_ERROR after the receipts of the SENDs read before it: a Pulsar producer matches
        each answer to the oldest message it waits for, and a ChecksumError for a later one makes it reconnect
        and resend everything pending instead of failing that one message."""
        if self._sends:
            self._store_sends()
        if self._last_store is None:
            self._send_error(producer_id, sequence_id, error, message)
        else:  # its callbacks run in the order they were added: the receipts first
            self._last_store.add_done_callback(lambda _: self._send_error(producer_id, sequence_id, error, message))

    def _store_checked(self, run: list[Send]) -> None:
        """Store the SENDs of ``run`` the server takes, each checked alone (as a whole the run was refused): a
        refused one is answered with why, after the receipts of those before it. A key of another partition is
        refused for good (``ChecksumError``: resent, it would be refused again); a partition this broker does
        not serve now, with ``ServiceNotReady``, which the client retries after a lookup."""
        kept: list[Send] = []
        for send in run:
            frame, producer, messages, _, _, _ = send
            try:
                self._server.check_produce(producer.topic, messages)
            except KeyFailoverError as exc:
                if kept:
                    self._store(kept)
                    kept = []
                error, message = server_error(exc)
                final = ServiceNotReady if error == ServiceNotReady else ChecksumError
                self._refuse_send(frame.producer_id, frame.sequence_id, final, message)
            else:
                kept.append(send)
        if kept:
            self._store(kept)

    def _receipts(self, run: list[Send], done: asyncio.Future[Result]) -> None:
        """Answer each SEND of ``run``, stored together in ``done``, in one write."""
        exc = done.exception()
        if exc is not None:
            if isinstance(exc, NotServedError | StoreUnavailableError):
                error = ServiceNotReady
            else:
                error = UnknownError if isinstance(exc, KeyFailoverError) else PersistenceError
            for frame, _, _, _, _, _ in run:
                self._send_error(frame.producer_id, frame.sequence_id, error, f"not stored: {exc}")
            if isinstance(exc, StoreUnavailableError):
                # SENDs after these on the connection would be stored ahead of their resends once the store is
                # back: closed, the client reconnects and resends what is pending, in order (the dedup drops
                # what was stored after all).
                _log.info("closing Pulsar connection %s: a SEND found the store out of reach", self.peer)
                self.close()
            return
        results = done.result()
        receipts = []
        first = 0
        for frame, producer, messages, _, _, _ in run:
            receipts.append(
                encode_receipt(
                    frame.producer_id,
                    frame.sequence_id,
                    frame.highest_sequence_id,
                    results[first][0],
                    producer.partition,
                )
            )
            first += len(messages)
        self._write(b"".join(receipts))

    def _send_error(self, producer_id: int, sequence_id: int, error: int, message: str) -> None:
        """Answer a producer's SEND with SEND_ERROR: the ServerError ``error`` and ``message``."""
        command = _command(BaseCommand.SEND_ERROR)
        command.send_error.producer_id = producer_id
        command.send_error.sequence_id = sequence_id
        command.send_error.error = error  # type: ignore[assignment]
        command.send_error.message = message
        self._send(command)

    def _subscribe(self, frame: PulsarFrame) -> None:
        """SUBSCRIBE: open a consumer or a reader, answered in a task."""
        open_ids = self._consumers.keys() | self._readers.keys() | self._reader_seeks.keys()
        _check_room("consumers", open_ids, frame.command.subscribe.consumer_id)
        self._spawn(self._open_consumer(frame.command))

    async def _open_consumer(self, command: BaseCommand) -> None:
        """Attach a consumer session to the durable subscription a SUBSCRIBE names, of the type it asks for, and
        answer SUCCESS, or ERROR; a non-durable one is a reader. Its deliveries wait for the client's FLOW. A
        schema it brings is checked first (:func:`consumer_schema`)."""
        request = command.subscribe
        try:
            await consumer_schema(self._server, keyfailover_topic(request.topic), request)
        except (RefusedError, KeyFailoverError) as exc:
            self._error(request.request_id, *server_error(exc))
            return
        if self._closed:
            return
        if not request.durable:
            self._open_reader(request)
            return
        consumer_id = request.consumer_id
        try:
            topic = keyfailover_topic(request.topic)
            sub_type, sticky = _check_subscribe(request)
            consumer = request.consumer_name or f"pulsar-{secrets.token_hex(8)}"
            if not is_valid_name(consumer) or not is_valid_name(request.subscription):
                raise RefusedError(
                    UnknownError, "subscription and consumer names must be 1 to 256 characters without NUL"
                )
            if request.consumer_id in self._readers:
                raise RefusedError(
                    ConsumerBusy, f"consumer id {request.consumer_id} is open already on this connection as a reader"
                )
            at_end = request.initialPosition == CommandSubscribe.Latest  # a new subscription's start
            subscription = await self._server.open_subscription(topic, request.subscription, at_end)
            if self._closed:
                return
            known = self._consumers.get(request.consumer_id)
            if known is not None:
                # A SUBSCRIBE repeated for an open consumer (a client's retry) is answered as the first one.
                if known.session.subscription is not subscription:
                    raise RefusedError(
                        ConsumerBusy,
                        f"consumer id {request.consumer_id} is open already on this connection for another "
                        "subscription",
                    )
                self._success(request.request_id)
                return
            session = Session(
                self._server.next_session_id(),
                consumer,
                subscription,
                lambda frame: self._deliver(consumer_id, frame),
                counts_failures=True,  # the client's dead-letter policy counts redeliveries
                sub_type=sub_type,
                priority=request.priority_level,
                on_active=lambda active: self._tell_active(consumer_id, active),
                on_drained=lambda: self._drained(consumer_id),
            )
            # Permits come with the client's FLOW, right after SUCCESS.
            subscription.attach(session, 0, sticky=sticky)
        except (RefusedError, KeyFailoverError) as exc:
            self._early_active.pop(consumer_id, None)
            self._error(request.request_id, *server_error(exc))
            return
        self._consumers[consumer_id] = _Consumer(session, self._partition(topic))
        self._success(request.request_id)
        active = self._early_active.pop(consumer_id, None)
        if active is not None:
            self._tell_active(consumer_id, active)

    def _open_reader(self, request: CommandSubscribe) -> None:
        """A non-durable subscription: a Pulsar Reader (Exclusive), served from the log by a :class:`PulsarReader`."""
        consumer_id = request.consumer_id
        try:
            topic = keyfailover_topic(request.topic)
            _check_type(
                request,
                CommandSubscribe.Exclusive,
                "a non-durable {kind} subscription is not served: keyfailover serves non-durable subscriptions as "
                "Readers (Exclusive, one consumer)",
            )
            if self._server.closing:
                raise RefusedError(ServiceNotReady, "the server is shutting down")
            self._server.check_served(topic, "read")
            known = self._readers.get(consumer_id)
            if known is not None and known.topic == topic:
                self._success(request.request_id)  # a SUBSCRIBE repeated (a client's retry)
                return
            if known is not None or consumer_id in self._consumers:
                raise RefusedError(ConsumerBusy, f"consumer id {consumer_id} is open already on this connection")
            seeked = self._reader_seeks.pop(consumer_id, None)
            after = seeked[1] if seeked is not None and seeked[0] == topic else self._start_after(request, topic)
        except (RefusedError, KeyFailoverError) as exc:
            self._error(request.request_id, *server_error(exc))
            return
        reader = PulsarReader(
            self._server.storage,
            topic,
            after,
            consumer_id,
            partition=self._partition(topic),
            write=lambda data: self._write(data, reply=False),
            ended=self._reader_ended,
        )
        self._readers[consumer_id] = reader
        self._server.watch(topic, reader)
        reader.start()
        self._success(request.request_id)

    def _start_after(self, request: CommandSubscribe, topic: str) -> int:
        """The position a reader starts after: the start message id's entry less one (the client drops that
        message itself unless it asked for it), or per Pulsar's earliest and latest ids and initial position."""
        last = self._server.storage.last_position(topic)
        if not request.HasField("start_message_id"):
            return 0 if request.initialPosition == CommandSubscribe.Earliest else last
        start = request.start_message_id
        if start.ledgerId == _MINUS_ONE:
            return 0
        if start.ledgerId == _LATEST:
            return last
        if start.ledgerId != 0:
            raise RefusedError(
                UnknownError,
                f"start message id ({start.ledgerId}, {start.entryId}) is not one of this topic's: keyfailover's "
                "message ids are ledger 0 and the message's log position",
            )
        return min(max(start.entryId - 1, 0), last)

    def _flow(self, frame: PulsarFrame) -> None:
        """FLOW: grant the consumer or reader more deliveries."""
        request = frame.command.flow
        reader = self._readers.get(request.consumer_id)
        if reader is not None:
            reader.flow(request.messagePermits)
            return
        consumer = self._consumers.get(request.consumer_id)
        if consumer is not None:
            consumer.session.subscription.flow(consumer.session, request.messagePermits)

    def _ack(self, frame: PulsarFrame) -> None:
        """ACK: ack the consumer's positions; a cumulative ack, on an Exclusive or Failover subscription only,
        acks every position up to its message id that was delivered to the consumer, is not acked yet and was
        sent no later than that message (one sent after it may wait in the client's queue, unprocessed): none
        when that message is not out with the consumer. With a request id, ACK_RESPONSE says whether some were
        not in flight. Positions leave ``unacked`` once the subscription took the ack (a paused one takes none)."""
        request = frame.command.ack
        consumer = self._consumers.get(request.consumer_id)
        reader = self._readers.get(request.consumer_id)
        cumulative = request.ack_type == CommandAck.Cumulative
        if reader is not None:
            rejected = ""  # a reader keeps no cursor: its acks only say what the application took
            if cumulative and request.message_id:
                reader.acked(request.message_id[0].entryId)
        elif consumer is None:
            rejected = f"consumer id {request.consumer_id} is not open on this connection"
        elif cumulative and consumer.session.sub_type not in SINGLE_ACTIVE:
            rejected = (
                "cumulative acks are not allowed on Shared and Key_Shared subscriptions; expected individual acks "
                "(or an Exclusive or Failover subscription)"
            )
        elif cumulative and not request.message_id:
            rejected = "a cumulative ack without a message id; expected the id of the last message to ack"
        else:
            unacked = consumer.unacked
            upto = request.message_id[0].entryId if cumulative else 0
            sent = unacked.get(upto) if cumulative else None
            if not cumulative:
                positions = [message_id.entryId for message_id in request.message_id]
            elif sent is None:
                positions = []
            else:
                positions = sorted(q for q, order in unacked.items() if q <= upto and order <= sent)
            late = consumer.session.subscription.ack(consumer.session, positions)
            consumer.settled(positions)  # taken, or not in flight (taken back)
            # Acks of messages taken back (lease expired, session replaced) change nothing: they come again.
            rejected = f"{len(late)} of the acked messages were not in flight on this consumer" if late else ""
            if cumulative and sent is None:
                rejected = (
                    f"message {upto} is not out with this consumer (acked already, or taken back): nothing acked; "
                    "expected the id of a message received and not acked"
                )
        if request.HasField("request_id"):
            reply = _command(BaseCommand.ACK_RESPONSE)
            reply.ackResponse.consumer_id = request.consumer_id
            reply.ackResponse.request_id = request.request_id
            if rejected:
                reply.ackResponse.error = NotAllowedError
                reply.ackResponse.message = rejected
            self._send(reply)

    def _redeliver(self, frame: PulsarFrame) -> None:
        """REDELIVER_UNACKNOWLEDGED_MESSAGES: nack the positions named, or every one delivered to the
        consumer and not acked."""
        request = frame.command.redeliverUnacknowledgedMessages
        consumer = self._consumers.get(request.consumer_id)
        if consumer is None:
            return
        if request.message_ids:
            positions = sorted({message_id.entryId for message_id in request.message_ids})
        else:  # every message delivered to it and not acked
            positions = sorted(consumer.unacked)
        consumer.session.subscription.nack(consumer.session, positions)
        consumer.settled(positions)

    def _close_producer(self, frame: PulsarFrame) -> None:
        """CLOSE_PRODUCER: forget the producer, answered with SUCCESS."""
        request = frame.command.close_producer
        handle = self._handles.get(request.producer_id)
        if handle is not None:
            self._release(handle)
        self._success(request.request_id)

    def _close_consumer(self, frame: PulsarFrame) -> None:
        """CLOSE_CONSUMER: end the consumer's session or the reader, answered with SUCCESS."""
        request = frame.command.close_consumer
        self._reader_seeks.pop(request.consumer_id, None)
        reader = self._readers.get(request.consumer_id)
        if reader is not None:
            self._drop_reader(reader)
        consumer = self._consumers.pop(request.consumer_id, None)
        if consumer is not None:
            consumer.session.subscription.detach(consumer.session, "closed", notify=False)
        self._success(request.request_id)

    def _unsubscribe(self, frame: PulsarFrame) -> None:
        """UNSUBSCRIBE: a reader just ends; a durable subscription whose only consumer this is ends for good
        (its cursor forgotten), one with other consumers is refused (``ConsumerBusy``) and goes on."""
        request = frame.command.unsubscribe
        reader = self._readers.get(request.consumer_id)
        if reader is not None:
            self._drop_reader(reader)
            self._success(request.request_id)
            return
        consumer = self._consumers.get(request.consumer_id)
        if consumer is None:
            raise RefusedError(ConsumerNotFound, f"consumer id {request.consumer_id} is not open on this connection")
        session = consumer.session
        subscription = session.subscription
        others = [name for name, other in subscription.sessions.items() if other is not session]
        if others:
            raise RefusedError(
                ConsumerBusy,
                f"subscription {subscription.name!r} has {len(others)} other consumer(s); expected none to unsubscribe",
            )
        self._spawn(self._end_subscription(request.request_id, subscription))  # runs after this returns
        subscription.detach(session, "unsubscribed", notify=False)
        del self._consumers[request.consumer_id]

    async def _end_subscription(self, request_id: int, subscription: Subscription) -> None:
        """End ``subscription`` for good, answering the UNSUBSCRIBE with SUCCESS or ERROR."""
        try:
            await self._server.unsubscribe(subscription)
        except KeyFailoverError as exc:
            self._error(request_id, *server_error(exc))
            return
        self._success(request_id)

    def _seek(self, frame: PulsarFrame) -> None:
        """SEEK: reset the consumer's subscription so that its next deliveries start at a message id (that message
        comes again) or at the first message published at or after a time (ms); every consumer of it is sent
        CLOSE_CONSUMER and subscribes again (:meth:`Server.seek`). A reader starts again from there."""
        request = frame.command.seek
        reader = self._readers.get(request.consumer_id)
        consumer = self._consumers.get(request.consumer_id)
        if reader is not None:
            topic = reader.topic
        elif consumer is not None:
            topic = consumer.session.subscription.topic
        else:
            raise RefusedError(ConsumerNotFound, f"consumer id {request.consumer_id} is not open on this connection")
        if request.HasField("message_id"):
            position: int | None = self._seek_position(request.message_id, topic)
            publish_time = 0
        elif request.HasField("message_publish_time"):
            position, publish_time = None, min(request.message_publish_time * 1000, _LATEST)  # ms to µs
        else:
            raise RefusedError(MetadataError, "SEEK has neither a message id nor a publish time; expected one of them")
        if reader is not None:
            self._spawn(self._seek_reader(request.request_id, reader, position, publish_time))
        elif consumer is not None:
            subscription = consumer.session.subscription
            self._spawn(self._seek_subscription(request.request_id, subscription, position, publish_time))

    def _seek_position(self, message_id: Any, topic: str) -> int:
        """The position a SEEK to ``message_id`` starts at: its entry, Pulsar's earliest id the first position,
        its latest id the end (what comes after the last message)."""
        if message_id.ledgerId == _MINUS_ONE:
            return 1
        if message_id.ledgerId == _LATEST:
            return self._server.storage.last_position(topic) + 1
        if message_id.ledgerId != 0:
            raise RefusedError(
                UnknownError,
                f"message id ({message_id.ledgerId}, {message_id.entryId}) is not one of this topic's: keyfailover's "
                "message ids are ledger 0 and the message's log position",
            )
        return min(int(message_id.entryId), _LATEST)

    async def _seek_start(self, topic: str, position: int | None, publish_time: int) -> int:
        """``position``, or without one the position of the first message published at or after ``publish_time``
        (µs), the end of the topic when there is none."""
        if position is not None:
            return position
        found = await self._server.storage.position_at_time(topic, publish_time)
        return self._server.storage.last_position(topic) + 1 if found is None else found

    async def _seek_subscription(
        self, request_id: int, subscription: Subscription, position: int | None, publish_time: int
    ) -> None:
        """Reset ``subscription`` to the seek's position, answering the SEEK with SUCCESS or ERROR."""
        try:
            start = await self._seek_start(subscription.topic, position, publish_time)
            await self._server.seek(subscription.topic, subscription.name, start)
        except KeyFailoverError as exc:
            self._error(request_id, *server_error(exc))
            return
        self._success(request_id)

    async def _seek_reader(
        self, request_id: int, reader: PulsarReader, position: int | None, publish_time: int
    ) -> None:
        """Restart ``reader`` from the seek's position: it ends (CLOSE_CONSUMER) and its next SUBSCRIBE on this
        connection starts there, whatever start message id it asks for (a seek by time has none)."""
        try:
            start = await self._seek_start(reader.topic, position, publish_time)
        except KeyFailoverError as exc:
            self._error(request_id, *server_error(exc))
            return
        if self._readers.get(reader.consumer_id) is not reader:  # closed or ended meanwhile
            self._error(request_id, ConsumerNotFound, f"consumer id {reader.consumer_id} was closed during the seek")
            return
        last = self._server.storage.last_position(reader.topic)
        self._drop_reader(reader)
        self._reader_seeks[reader.consumer_id] = (reader.topic, min(max(start - 1, 0), last))
        self._tell_closed(reader.consumer_id)
        self._success(request_id)

    def _get_last_message_id(self, frame: PulsarFrame) -> None:
        """The id of the topic's last stored message, and the consumer's mark-delete position (everything up to
        it acked; a reader's is the last message its application took, not the last one sent): ledger 0 and the
        log positions, or Pulsar's earliest id (-1, -1) for none."""
        request = frame.command.getLastMessageId
        reader = self._readers.get(request.consumer_id)
        consumer = self._consumers.get(request.consumer_id)
        if reader is not None:
            topic, acked = reader.topic, reader.consumed
        elif consumer is not None:
            topic, acked = consumer.session.subscription.topic, consumer.session.subscription.cursor.mark_delete
        else:
            raise RefusedError(UnknownError, f"consumer id {request.consumer_id} is not open on this connection")
        partition = self._partition(topic)
        reply = _command(BaseCommand.GET_LAST_MESSAGE_ID_RESPONSE)
        answer = reply.getLastMessageIdResponse
        answer.request_id = request.request_id
        for field_name, position in (
            ("last_message_id", self._server.storage.last_position(topic)),
            ("consumer_mark_delete_position", acked),
        ):
            message_id = getattr(answer, field_name)
            message_id.ledgerId, message_id.entryId = (0, position) if position > 0 else (_MINUS_ONE, _MINUS_ONE)
            if partition >= 0:
                message_id.partition = partition
        self._send(reply)

    def _get_schema(self, frame: PulsarFrame) -> None:
        """GET_SCHEMA: a version of a topic's schema, answered in a task (``_pulsar_schema``)."""
        self._spawn(self._answer_get_schema(frame.command.getSchema))

    async def _answer_get_schema(self, request: CommandGetSchema) -> None:
        """Send the GET_SCHEMA_RESPONSE: see :func:`get_schema`."""
        self._send(await get_schema(self._server, request))

    def _get_or_create_schema(self, frame: PulsarFrame) -> None:
        """GET_OR_CREATE_SCHEMA: a schema's version, added if new, answered in a task (``_pulsar_schema``)."""
        self._spawn(self._answer_get_or_create_schema(frame.command.getOrCreateSchema))

    async def _answer_get_or_create_schema(self, request: CommandGetOrCreateSchema) -> None:
        """Send the GET_OR_CREATE_SCHEMA_RESPONSE: see :func:`get_or_create_schema`."""
        self._send(await get_or_create_schema(self._server, request))

    _handlers: Final[dict[int, Callable[[PulsarConnection, PulsarFrame], None]]] = {
        BaseCommand.PING: _ping_command,
        BaseCommand.PONG: _pong,
        BaseCommand.PARTITIONED_METADATA: _partitioned_metadata,
        BaseCommand.LOOKUP: _lookup,
        BaseCommand.GET_TOPICS_OF_NAMESPACE: _topics_of_namespace,
        BaseCommand.PRODUCER: _producer,
        BaseCommand.SUBSCRIBE: _subscribe,
        BaseCommand.FLOW: _flow,
        BaseCommand.ACK: _ack,
        BaseCommand.REDELIVER_UNACKNOWLEDGED_MESSAGES: _redeliver,
        BaseCommand.CLOSE_PRODUCER: _close_producer,
        BaseCommand.CLOSE_CONSUMER: _close_consumer,
        BaseCommand.GET_LAST_MESSAGE_ID: _get_last_message_id,
        BaseCommand.UNSUBSCRIBE: _unsubscribe,
        BaseCommand.SEEK: _seek,
        BaseCommand.GET_SCHEMA: _get_schema,
        BaseCommand.GET_OR_CREATE_SCHEMA: _get_or_create_schema,
    }


def _check_room(what: str, open_ids: Collection[int], new_id: int) -> None:
    """Refuse opening ``new_id`` when the connection has :data:`_MAX_OPEN` ``what`` open already."""
    if new_id not in open_ids and len(open_ids) >= _MAX_OPEN:
        raise RefusedError(
            NotAllowedError, f"a connection may have {_MAX_OPEN} {what} open; close one, or use another connection"
        )


def _check_type(request: CommandSubscribe, served: int, refusal: str) -> None:
    """Refuse a SUBSCRIBE of another subscription type than ``served``: ``refusal`` says why, its ``{kind}``
    the type asked for."""
    if request.subType != served:
        raise RefusedError(NotAllowedError, refusal.format(kind=CommandSubscribe.SubType.Name(request.subType)))


def _check_subscribe(request: CommandSubscribe) -> tuple[SubscriptionType, list[tuple[int, int]] | None]:
    """The subscription type a durable SUBSCRIBE asks for, and the hash ranges a Key_Shared STICKY consumer
    declares (None for AUTO_SPLIT and the other types)."""
    sub_type = _SUB_TYPES[request.subType]  # the decoder reads a type it does not know as the default, Exclusive
    if (
        sub_type != "key_shared"
        or not request.HasField("keySharedMeta")
        or request.keySharedMeta.keySharedMode != KeySharedMode.STICKY
    ):
        return sub_type, None
    return sub_type, [(hash_range.start, hash_range.end) for hash_range in request.keySharedMeta.hashRanges]


def _type_name(command: BaseCommand) -> str:
    """The name of ``command``'s type, as the log and refusals say it."""
    return BaseCommand.Type.Name(command.type)
