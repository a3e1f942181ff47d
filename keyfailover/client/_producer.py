"""Producers: messages batched per partition, sent in order, resent after a failover until stored.

:class:`AsyncProducer` picks each message's partition by its key's slot; a :class:`PartProducer`
batches the messages of one partition, sends them on its broker's link and keeps every batch
until its receipt comes, so a reconnect or a moved partition resends it with the same sequence
ids, which the broker stores once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Mapping

from keyfailover.client._errors import LOOK_AGAIN, ClientClosed, ServerError
from keyfailover.client._link import MAX_BATCH, Link, LostCallback, Part, call_soon
from keyfailover.core.errors import KeyFailoverError
from keyfailover.core.partitions import partition_of_key
from keyfailover.wire.properties import encode_properties
from keyfailover.wire.protocol import Error, Frame, Key, Produce, Receipt

SendCallback = Callable[["int | None", "BaseException | None"], None]

MAX_SEQUENCE_ID = 2**63 - 1
"""The highest sequence id a message may have (the broker stores them as signed 64-bit ints)."""


def _message_size(key: Key, payload: bytes, properties: bytes | None = None) -> int:
    """An upper bound on the encoded size of one message in a ``produce`` frame, with its encoded properties."""
    if key is None:
        key_size = 0
    elif isinstance(key, str):
        try:
            key_size = len(key.encode())
        except UnicodeEncodeError as exc:
            raise KeyFailoverError(
                f"key {key!r} is not valid Unicode ({exc.reason} at index {exc.start}); expected a str that encodes "
                "to UTF-8"
            ) from None
    else:
        key_size = len(key)
    return len(payload) + key_size + 32 + (0 if properties is None else len(properties) + 8)


def _check_sequence_id(sequence_id: object) -> None:
    """Raise :class:`KeyFailoverError` unless ``sequence_id`` is None or an int in ``[0, MAX_SEQUENCE_ID]``."""
    if sequence_id is None:
        return
    if type(sequence_id) is not int or not 0 <= sequence_id <= MAX_SEQUENCE_ID:
        raise KeyFailoverError(f"sequence_id must be an int in [0, 2**63 - 1] or None, got {sequence_id!r}")


def _check_key(key: object) -> None:
    """Raise :class:`KeyFailoverError` unless ``key`` is None, bytes, or a str that encodes to UTF-8."""
    if key is not None and not isinstance(key, str | bytes):
        raise KeyFailoverError(f"key must be str, bytes or None, not {type(key).__name__}")
    _message_size(key, b"")  # raises for a str that does not encode


class _PendingBatch:
    """Messages queued for one produce frame, with their callbacks and encoded properties."""

    __slots__ = ("callbacks", "messages", "properties", "size")

    def __init__(self) -> None:
        self.messages: list[tuple[int | None, Key, bytes]] = []
        self.callbacks: list[SendCallback | None] = []
        self.properties: list[bytes | None] | None = None
        """Each message's encoded properties, once one of them has some (None until then)."""
        self.size = 0

    def add(
        self, message: tuple[int | None, Key, bytes], callback: SendCallback | None, properties: bytes | None, size: int
    ) -> None:
        """Append one message of ``size`` bytes (:func:`_message_size`) with its encoded ``properties``."""
        self.messages.append(message)
        self.callbacks.append(callback)
        self.size += size
        if properties is not None or self.properties is not None:
            self.last_properties(properties)

    def last_properties(self, properties: bytes | None) -> None:
        """Record the encoded properties of the message appended last; called when it or an earlier one has some."""
        if self.properties is None:
            self.properties = [None] * (len(self.messages) - 1)
        self.properties.append(properties)

    def split(self, limit: int) -> list[_PendingBatch]:
        """This batch as consecutive batches of at most ``limit`` bytes each (itself when it fits)."""
        if self.size <= limit:
            return [self]
        parts = [_PendingBatch()]
        properties = self.properties or [None] * len(self.messages)
        for message, callback, encoded in zip(self.messages, self.callbacks, properties, strict=True):
            size = _message_size(message[1], message[2], encoded)
            part = parts[-1]
            if part.messages and part.size + size > limit:
                part = _PendingBatch()
                parts.append(part)
            part.add(message, callback, encoded, size)
        return parts


class _Refusal:
    """The first message of a produce a broker refused with ``not_owner`` on one link.

    The broker refuses the producer's later produces on that connection until one starts at
    or before this message (so a resend cannot be overtaken by newer batches). When the
    message is stored through another broker meanwhile (``settled``) and the partition comes
    back, the resend starts after it: the message goes first, as a batch of its own that is
    stored as a duplicate (nothing new), and lifts the broker's refusal.
    """

    __slots__ = ("message", "properties", "settled")

    def __init__(self, message: tuple[int | None, Key, bytes], properties: bytes | None) -> None:
        self.message = message
        self.properties = properties
        self.settled = False

    @property
    def seq(self) -> int:
        """The refused message's sequence id."""
        seq = self.message[0]
        assert seq is not None  # a named producer's messages all have one
        return seq


class PartProducer(Part):
    """Sends keyed messages to one partition, in order, batched; retries are deduplicated."""

    def __init__(
        self, link: Link, base_topic: str, partition: int, partitions: int, *, name: str, on_lost: LostCallback
    ) -> None:
        super().__init__(link, base_topic, partition, partitions, on_lost)
        self.producer_name = name
        # Sequence ids start from the wall clock in microseconds, so a restarted producer of
        # the same name continues above what it stored before (unless it sent over a million
        # messages a second for the whole downtime).
        self._seq = itertools.count(time.time_ns() // 1000)
        self._last_seq = -1  # the highest sequence id queued, given or counted
        self._batch = _PendingBatch()
        self._full: list[_PendingBatch] = []  # batches at their limit, not yet sent
        self._flush_scheduled = False
        self._held = False  # a batch was refused (not_owner): newer ones wait to be resent after it
        self._unconfirmed: dict[int, _PendingBatch] = {}  # req -> batch, in send order
        self._refusals: dict[Link, _Refusal] = {}  # link -> the first produce it refused (not_owner)
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self._failure: ServerError | None = None
        self._lock = threading.Lock()  # send_async may be called from another thread (sync client)
        self._loop = asyncio.get_running_loop()

    def send_async(
        self,
        payload: bytes,
        key: Key,
        callback: SendCallback | None,
        properties: Mapping[str, str] | None,
        sequence_id: int | None = None,
    ) -> None:
        """Queue a message; ``callback(position, None)`` or ``callback(None, error)`` follows.

        ``sequence_id``: the message's own, above every one queued here before (a checked int, or None
        for the next of the counter, which then goes on above the given ones)."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise ClientClosed(f"producer {self.producer_name!r} is closed")
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise KeyFailoverError(f"payload must be bytes, not {type(payload).__name__}")
        if key is not None and not isinstance(key, str | bytes):
            raise KeyFailoverError(f"key must be str, bytes or None, not {type(key).__name__}")
        encoded = None if properties is None else encode_properties(properties)
        data = bytes(payload)
        size = _message_size(key, data, encoded)
        limit = self.link.max_batch_bytes - 1024
        if size > limit:
            raise KeyFailoverError(
                f"a message of {size} bytes (payload, key, properties and framing) is over the {limit} bytes a "
                "message may have on this connection (half the server's frame limit, less 1 KiB)"
            )
        with self._lock:
            seq = next(self._seq) if sequence_id is None else sequence_id
            if seq <= self._last_seq:
                if sequence_id is not None:
                    raise KeyFailoverError(
                        f"sequence id {sequence_id} of producer {self.producer_name!r} is not above {self._last_seq}, "
                        f"the last it sent to partition {self.partition} of {self.base_topic!r}; expected increasing "
                        "sequence ids"
                    )
                seq = self._last_seq + 1  # the counter is behind the ids given: it goes on above them
                self._seq = itertools.count(seq + 1)
            self._last_seq = seq
            batch = self._batch
            if batch.messages and (len(batch.messages) >= MAX_BATCH or batch.size + size > self.link.max_batch_bytes):
                # Full: it goes out with the next flush as it is; a new batch starts.
                self._full.append(batch)
                batch = self._batch = _PendingBatch()
            # batch.add, inline: this is every message's path
            batch.messages.append((seq, key, data))
            batch.callbacks.append(callback)
            batch.size += size
            if encoded is not None or batch.properties is not None:
                batch.last_properties(encoded)
            schedule = not self._flush_scheduled
            self._flush_scheduled = True
        if schedule:  # one flush per burst: it sends every full batch and the current one
            call_soon(self._loop, self._flush_now)

    async def flush(self) -> None:
        """Wait until every message sent so far is stored."""
        self._flush_now()
        while self._unconfirmed:
            self._idle.clear()
            await self._idle.wait()

    def _flush_now(self) -> None:
        """Send every full batch and the one being filled, in order; held back while a refused batch awaits a resend."""
        with self._lock:
            batches, self._full = self._full, []
            if self._batch.messages:
                batches.append(self._batch)
                self._batch = _PendingBatch()
            self._flush_scheduled = False
        for batch in batches:
            req = self.link.next_req()
            self._unconfirmed[req] = batch
            if not self._held:  # held: sent, in order, with the refused ones
                self._transmit(req, batch)

    def _transmit(self, req: int, batch: _PendingBatch) -> None:
        """Send ``batch`` as the produce ``req``; not connected, it stays unconfirmed for reconnected() to resend."""
        frame = Produce(
            req=req, topic=self.topic, producer=self.producer_name, messages=batch.messages, properties=batch.properties
        )
        link = self.link
        link.pending[req] = lambda reply: self._answered(req, reply, link)
        if not link.send(frame):
            link.pending.pop(req, None)  # resent by reconnected()

    def _answered(self, req: int, reply: Frame | None, link: Link) -> None:
        """A produce's answer on ``link``: a receipt calls back each position; not_owner or store_unavailable keeps
        this batch and the later ones for a resend where the partition is now; another error fails its messages.
        None: the connection dropped, the batch is resent after a reconnect."""
        if reply is None:
            return  # connection lost: kept in _unconfirmed and resent after reconnecting
        if isinstance(reply, Error) and reply.code in LOOK_AGAIN:
            # Kept in _unconfirmed, with everything after it (the broker refuses those too), and resent
            # in order to the partition's broker once found; newer batches wait for that.
            refused = self._unconfirmed.get(req)
            if refused is not None and refused.messages and link not in self._refusals:
                self._refusals[link] = _Refusal(refused.messages[0], (refused.properties or [None])[0])
            self._held = True
            self._on_lost(self)
            return
        batch = self._unconfirmed.pop(req, None)
        if batch is None:
            return
        if isinstance(reply, Receipt):
            if self._refusals:
                self._settle(batch, reply)
            for callback, position in zip(batch.callbacks, reply.positions, strict=True):
                if callback is None:
                    continue
                if position:
                    callback(position, None)
                else:  # a receipt without a position: the server did not store it
                    callback(None, ServerError("not_stored", "the server's receipt gave this message no position"))
        else:
            error = (
                ServerError(reply.code, reply.message)
                if isinstance(reply, Error)
                else ServerError("internal", "unexpected reply")
            )
            for callback in batch.callbacks:
                if callback is not None:
                    callback(None, error)
        if not self._unconfirmed:
            self._idle.set()

    @property
    def closed(self) -> bool:
        """Closed, or failed for good."""
        return self._closed or self._failure is not None

    def disconnected(self) -> None:
        """Unconfirmed batches stay queued for resending; the partition may have moved: look."""
        self._on_lost(self)

    def move(self, link: Link) -> None:
        """The partition is served by the broker of ``link`` now: resend there what is unconfirmed."""
        self._relink(link)
        if link.ready.is_set():
            self.reconnected()

    def resume(self) -> None:
        """Resend everything unconfirmed, in order: what was refused, and what was sent after it."""
        self.reconnected()

    def failed(self, error: ServerError) -> None:
        """The link failed for good: every message not yet confirmed fails with ``error``."""
        self._failure = error
        with self._lock:
            batches = [*self._unconfirmed.values(), *self._full, self._batch]
            self._unconfirmed, self._full, self._batch = {}, [], _PendingBatch()
        for batch in batches:
            for callback in batch.callbacks:
                if callback is not None:
                    callback(None, error)
        self._idle.set()

    def _settle(self, batch: _PendingBatch, receipt: Receipt) -> None:
        """Mark the refusals whose message ``batch`` holds and ``receipt`` stored as settled."""
        if not batch.messages:
            return
        first, last = batch.messages[0][0], batch.messages[-1][0]
        if first is None or last is None:
            return
        for refusal in self._refusals.values():
            if refusal.settled or not first <= refusal.seq <= last:
                continue
            for message, position in zip(batch.messages, receipt.positions, strict=True):
                if message[0] == refusal.seq:
                    refusal.settled = bool(position)
                    break

    def _lifting(self, first: int | None) -> _PendingBatch | None:
        """What to send ahead of a resend on this part's link (``first``: the resend's first sequence id) to
        lift the link's refusal of this producer, which the resend would not lift: the refused message
        again, when another broker stored it meanwhile and the resend starts after it. None otherwise."""
        for gone in [link for link in self._refusals if link.closed]:
            del self._refusals[gone]  # its connection and the broker's refusal with it
        refusal = self._refusals.pop(self.link, None)
        if refusal is None or (first is not None and first <= refusal.seq):
            return None  # no refusal here, or the resend starts at the refused message: it lifts the refusal
        if not refusal.settled:
            return None  # never stored (it failed): sending it now would store what was reported lost
        batch = _PendingBatch()  # no callback: its sender was answered when it was stored
        message = refusal.message
        batch.add(message, None, refusal.properties, _message_size(message[1], message[2], refusal.properties))
        return batch

    def reconnected(self) -> None:
        """Resend every unconfirmed batch, in order; split where the new server takes smaller frames."""
        self._held = False
        old, self._unconfirmed = self._unconfirmed, {}
        batches = list(old.values())
        if self._refusals:
            lifting = self._lifting(next((batch.messages[0][0] for batch in batches if batch.messages), None))
            if lifting is not None:
                batches.insert(0, lifting)  # a duplicate: stored as nothing new, and unconfirmed until answered
        for batch in batches:
            for part in batch.split(self.link.max_batch_bytes):
                req = self.link.next_req()
                self._unconfirmed[req] = part
                self._transmit(req, part)

    async def close(self) -> None:
        """Flush, then refuse further sends."""
        if self._closed:
            return
        await self.flush()
        self._closed = True
        with contextlib.suppress(ValueError):
            self.link.parties.remove(self)


class AsyncProducer:
    """Sends keyed messages to one topic, in order per key, batched; retries are deduplicated.

    Each key goes to the partition holding its slot (keyless messages round robin over the
    partitions); positions count within a partition.
    """

    def __init__(self, topic: str, name: str, parts: list[PartProducer]) -> None:
        self.topic = topic
        self.producer_name = name
        self._parts = parts
        self._next = itertools.count()

    @property
    def partitions(self) -> int:
        """How many partitions the topic has (positions count within each)."""
        return len(self._parts)

    def send_async(
        self,
        payload: bytes,
        key: Key = None,
        callback: SendCallback | None = None,
        *,
        properties: Mapping[str, str] | None = None,
        sequence_id: int | None = None,
    ) -> None:
        """Queue a message; ``callback(position, None)`` or ``callback(None, error)`` follows.

        ``properties``: str keys and values sent with it (at most 128, keys of at most 256 characters,
        64 KiB encoded: :mod:`keyfailover.wire.properties`); :class:`PropertiesError` refuses others
        and queues nothing.

        ``sequence_id``: the message's sequence id, for a producer that numbers its messages itself (as
        Pulsar's ``sequence_id``): the broker stores a message of this producer's name and sequence id
        once per partition, so a restarted producer that sends a message again with the same id stores
        nothing new. An int in ``[0, 2**63 - 1]``, above every id this producer sent to the message's
        partition before; ids may skip. :class:`KeyFailoverError` refuses others and queues nothing.
        None: the producer's counter numbers it (the wall clock in microseconds when the producer was
        created, then +1 a message, and above the ids given).
        """
        _check_sequence_id(sequence_id)
        parts = self._parts
        if len(parts) == 1:
            part = parts[0]
        elif key is None:
            part = parts[next(self._next) % len(parts)]
        else:
            _check_key(key)  # before it is hashed
            part = parts[partition_of_key(key, len(parts))]
        part.send_async(payload, key, callback, properties, sequence_id)

    async def send(
        self,
        payload: bytes,
        key: Key = None,
        *,
        properties: Mapping[str, str] | None = None,
        sequence_id: int | None = None,
    ) -> int:
        """Send and wait until the message is stored; returns its position (within its partition), for a
        message of a sequence id stored before the position it was stored at. Arguments as :meth:`send_async`."""
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def done(position: int | None, error: BaseException | None) -> None:
            """Settle the future with the position or the error."""
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(position or 0)

        self.send_async(payload, key, done, properties=properties, sequence_id=sequence_id)
        return await future

    async def flush(self) -> None:
        """Wait until every message sent so far is stored."""
        for part in self._parts:
            await part.flush()

    async def close(self) -> None:
        """Flush, then refuse further sends."""
        for part in self._parts:
            await part.close()
